"""Fixtures: real servers on 127.0.0.1 free ports, over the FakeSpeechModel or the tiny model."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.server.fake_model import FakeSpeechModel
from tilevox.server.app import ServerHandle
from tilevox.server.bench import free_port, serve_command
from tilevox.server.config import ServerConfig

API_KEY = "test-key-123"


def make_server(model, **overrides) -> ServerHandle:
    kw = {
        "host": "127.0.0.1",
        "http_port": 0,
        "grpc_port": 0,
        "max_streams": 4,
        "max_queued": 4,
        "idle_timeout_s": 5.0,
        "drain_timeout_s": 5.0,
    }
    kw.update(overrides)
    return ServerHandle(ServerConfig(**kw), model).start()


REPO = Path(__file__).resolve().parents[2]


def serve_subprocess(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, int, int]:
    """`tilevox serve` as a user runs it, on free loopback ports: (process, HTTP port, gRPC port)."""
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        serve_command(http_port, grpc_port, *args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"} | (env or {}),
    )
    return proc, http_port, grpc_port


def wait_ready(proc: subprocess.Popen, http_port: int, timeout_s: float = 60) -> None:
    """Until GET /ready is 200; fails with the process's output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/ready").status_code == 200:
                return
        except httpx.HTTPError:  # not listening yet
            time.sleep(0.2)
    raise AssertionError(f"server not ready within {timeout_s} s")


@pytest.fixture(scope="module")
def fake_model():
    return FakeSpeechModel()


@pytest.fixture(scope="module")
def fake_server(fake_model):
    """Open server (no API key) over the fake model; module-scoped to keep tests fast."""
    server = make_server(fake_model, max_text_chars=500)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server():
    server = make_server(FakeSpeechModel(), api_key=API_KEY)
    yield server
    server.stop()


@pytest.fixture
def server_factory():
    made = []

    def factory(model=None, **overrides):
        server = make_server(model or FakeSpeechModel(), **overrides)
        made.append(server)
        return server

    yield factory
    for server in made:
        server.stop()
