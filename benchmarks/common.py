"""What every benchmark needs: where a result came from (commit, device, date) and a `tilevox serve`
started as a subprocess on free loopback ports."""

from __future__ import annotations

import datetime
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["REPO", "RESULTS", "ServerProcess", "commit", "device_name", "free_port", "utc_now"]

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commit() -> str:
    """The checkout's short commit, with `-dirty` when it has uncommitted changes."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu} ({os.cpu_count()} cores)"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class ServerProcess:
    """`tilevox serve` on free loopback ports, ready (GET /ready is 200) when the `with` block starts,
    drained with SIGTERM when it ends. Its log goes to a file (a pipe would fill and block it)."""

    def __init__(
        self, serve_args: list[str], *, log_path: Path, start_timeout_s: float = 600.0, env: dict | None = None
    ):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "tilevox.server.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            *serve_args,
        ]
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> ServerProcess:
        log_file = open(self.log_path, "w")  # noqa: SIM115 - owned by the process, closed in __exit__
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(self.env or {})},
        )
        self._log_file = log_file
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise SystemExit(f"server did not become ready in {self.start_timeout_s} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.returncode = self.proc.returncode
        self._log_file.close()
