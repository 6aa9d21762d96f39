"""`tilevox bench`: what users feel, at several load levels, against a URL or a server it starts.

Each request is a streaming POST /v1/audio/speech (pcm). Per request: time to first audio (TTFA, request
sent -> first audio byte), real-time factor (wall time / audio seconds), the largest gap between two
audio chunks, and stalls: a chunk that arrives after a player that started at the first byte has played
everything received so far (its buffer ran dry: an audible stall). Per level: TTFA p50/p95/p99, RTF
p50/p95, stalls, aggregate audio seconds per second, and the GPU memory in use (nvidia-smi, when there is
one). Closed loop: N clients, each sending `rounds` requests back to back. Open loop: Poisson arrivals
at `rate` requests per second for `duration` seconds, N = the level's cap on requests in flight.
Writes JSON and a PNG (TTFA and throughput against streams). Imports: httpx, numpy, matplotlib (plot).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["LevelResult", "RequestResult", "ServerProcess", "plot", "request_result", "run_level", "serve_command"]

TEXTS = (
    "The quick brown fox jumps over the lazy dog, and then it runs back into the quiet forest.",
    "Streaming speech should start playing within a fraction of a second, and never stop halfway.",
    "Please hold while I connect you to the next available agent; your call is important to us.",
    "Your order number is 4 5 7 1, it ships tomorrow morning, and arrives by Friday afternoon.",
)


@dataclass(slots=True)
class RequestResult:
    ttfa_s: float | None = None
    wall_s: float = 0.0
    audio_s: float = 0.0
    max_gap_s: float = 0.0
    stalls: int = 0
    error: str | None = None

    @property
    def rtf(self) -> float | None:
        return self.wall_s / self.audio_s if self.audio_s else None


def request_result(arrivals: list[tuple[float, int]], sample_rate_hz: int, wall_s: float) -> RequestResult:
    """Gaps and stalls of one stream from its chunks' (arrival time since the request, bytes of s16 audio)."""
    result = RequestResult(wall_s=wall_s)
    audible = [(t, n) for t, n in arrivals if n > 0]
    if not audible:
        return result
    first = audible[0][0]
    result.ttfa_s = first
    received_s = 0.0
    previous = first
    for t, n in audible:
        result.max_gap_s = max(result.max_gap_s, t - previous)
        if t - first > received_s + 1e-3:  # the player (started at `first`) has run out of audio
            result.stalls += 1
        received_s += n / 2 / sample_rate_hz
        previous = t
    result.audio_s = received_s
    return result


@dataclass(slots=True)
class LevelResult:
    streams: int
    mode: str
    requests: list[RequestResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    gpu_memory_mib: float | None = None
    server: dict | None = None  # the server's own counters over the level (server_counters), when readable

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.error is None and r.ttfa_s is not None]
        ttfa = np.array([r.ttfa_s * 1e3 for r in ok])
        rtf = np.array([r.rtf for r in ok if r.rtf is not None])
        gaps = np.array([r.max_gap_s * 1e3 for r in ok])

        def pct(values, q):
            return round(float(np.percentile(values, q)), 1) if values.size else None

        return {
            "streams": self.streams,
            "mode": self.mode,
            "requests": len(self.requests),
            "errors": len(self.requests) - len(ok),
            "error_examples": sorted({r.error for r in self.requests if r.error})[:3],
            "ttfa_ms_p50": pct(ttfa, 50),
            "ttfa_ms_p95": pct(ttfa, 95),
            "ttfa_ms_p99": pct(ttfa, 99),
            "rtf_p50": round(float(np.percentile(rtf, 50)), 3) if rtf.size else None,
            "rtf_p95": round(float(np.percentile(rtf, 95)), 3) if rtf.size else None,
            "max_gap_ms_p50": pct(gaps, 50),
            "max_gap_ms_max": round(float(gaps.max()), 1) if gaps.size else None,
            "stalls": int(sum(r.stalls for r in ok)),
            "requests_with_stalls": int(sum(r.stalls > 0 for r in ok)),
            "audio_s_per_s": round(sum(r.audio_s for r in ok) / self.elapsed_s, 2) if self.elapsed_s else None,
            "gpu_memory_mib": self.gpu_memory_mib,
            "server": self.server,
        }


# Counters of /metrics (server.metrics) that the bench differences over a level.
SERVER_COUNTERS = (
    "tilevox_steps_total",
    "tilevox_step_seconds_total",
    "tilevox_frames_total",
    "tilevox_prefills_total",
    "tilevox_prefill_seconds_total",
    "tilevox_admissions_total",
)


def parse_counters(text: str) -> dict[str, float]:
    """The SERVER_COUNTERS in a Prometheus text exposition (missing ones are left out)."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SERVER_COUNTERS:
            values[name] = float(value)
    return values


def server_counters(before: dict[str, float], after: dict[str, float], elapsed_s: float) -> dict | None:
    """Where the server's model worker spent a level: mean step and prefill times, their shares of the
    level's wall time (the rest is the worker waiting, or its host work between them), streams per step."""
    if not all(name in before and name in after for name in SERVER_COUNTERS) or elapsed_s <= 0:
        return None
    d = {name.removeprefix("tilevox_"): after[name] - before[name] for name in SERVER_COUNTERS}
    steps, prefills = d["steps_total"], d["prefills_total"]
    return {
        "steps": int(steps),
        "step_ms_mean": round(d["step_seconds_total"] / steps * 1e3, 2) if steps else None,
        "streams_per_step_mean": round(d["frames_total"] / steps, 2) if steps else None,
        "prefills": int(prefills),
        "prefill_ms_mean": round(d["prefill_seconds_total"] / prefills * 1e3, 2) if prefills else None,
        "admissions_per_prefill_mean": round(d["admissions_total"] / prefills, 2) if prefills else None,
        "step_share": round(d["step_seconds_total"] / elapsed_s, 3),
        "prefill_share": round(d["prefill_seconds_total"] / elapsed_s, 3),
    }


def gpu_memory_mib() -> float | None:
    """Memory in use on GPU 0 as nvidia-smi reports it (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return float(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


async def _request(client, url: str, body: dict, sample_rate_hz: int) -> RequestResult:
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult(error=f"{response.status_code} {response.text[:120]}")
            async for piece in response.aiter_bytes():
                arrivals.append((time.perf_counter() - start, len(piece)))
    except Exception as exc:  # noqa: BLE001 - a failed request is a result of the benchmark, counted as an error
        return RequestResult(error=f"{type(exc).__name__}: {exc}"[:160])
    return request_result(arrivals, sample_rate_hz, time.perf_counter() - start)


async def run_level(
    base_url: str,
    streams: int,
    *,
    sample_rate_hz: int,
    max_duration_s: float,
    mode: str = "closed",
    rounds: int = 2,
    rate_per_s: float | None = None,
    duration_s: float = 20.0,
    api_key: str | None = None,
    seed: int = 0,
) -> LevelResult:
    """One load level: `streams` closed-loop clients x `rounds`, or Poisson arrivals (open loop) at
    `rate_per_s` for `duration_s` with at most `streams` in flight (arrivals beyond it wait)."""
    import httpx

    if mode not in ("closed", "open"):
        raise ValueError(f"mode must be closed or open, got {mode!r}")
    if mode == "open" and not (rate_per_s and rate_per_s > 0):
        raise ValueError("open loop needs a positive rate_per_s")
    url = base_url + "/v1/audio/speech"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    level = LevelResult(streams=streams, mode=mode)

    def body(n: int) -> dict:
        return {
            "model": "tts-1",
            "voice": "alloy",
            "input": TEXTS[n % len(TEXTS)],
            "response_format": "pcm",
            "seed": seed * 100_000 + n,
            "max_duration_s": max_duration_s,
        }

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)

    async def counters(client) -> dict[str, float]:
        try:
            response = await client.get(base_url + "/metrics", timeout=10)
        except httpx.HTTPError:  # a URL without /metrics (another server): the level has no server figures
            return {}
        return parse_counters(response.text) if response.status_code == 200 else {}

    async with httpx.AsyncClient(timeout=900, limits=limits, headers=headers) as client:
        before = await counters(client)
        started = time.perf_counter()
        if mode == "closed":

            async def client_loop(index: int) -> list[RequestResult]:
                return [await _request(client, url, body(index * rounds + k), sample_rate_hz) for k in range(rounds)]

            results = await asyncio.gather(*(client_loop(i) for i in range(streams)))
            level.requests = [r for rs in results for r in rs]
        else:
            gate = asyncio.Semaphore(streams)
            rng = random.Random(seed)

            async def one(n: int) -> RequestResult:
                async with gate:
                    return await _request(client, url, body(n), sample_rate_hz)

            tasks, n, t = [], 0, 0.0
            while True:
                t += rng.expovariate(rate_per_s)
                if t > duration_s:
                    break
                await asyncio.sleep(max(0.0, started + t - time.perf_counter()))
                tasks.append(asyncio.create_task(one(n)))
                n += 1
            level.requests = list(await asyncio.gather(*tasks))
        level.elapsed_s = time.perf_counter() - started
        level.server = server_counters(before, await counters(client), level.elapsed_s)
    level.gpu_memory_mib = gpu_memory_mib()
    return level


def serve_command(http_port: int, grpc_port: int, *serve_args: str) -> list[str]:
    """The argv of `tilevox serve` on loopback at these ports, run by this Python."""
    return [
        sys.executable,
        "-m",
        "tilevox.server.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        *serve_args,
    ]


class ServerProcess:
    """`tilevox serve` on free loopback ports, ready (GET /ready is 200) inside the `with` block, drained
    with SIGTERM when it ends. Its log goes to a file (a pipe would fill and block it)."""

    def __init__(self, serve_args: list[str], *, log_path: Path, start_timeout_s: float = 600.0, env=None):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.cmd = serve_command(self.http_port, self.grpc_port, *serve_args)
        self.log_path = Path(log_path)
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
        import httpx

        self._log_file = open(self.log_path, "w")  # noqa: SIM115 - owned by the process, closed in __exit__
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(self.env or {})}
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log_file.close()
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server did not become ready in {self.start_timeout_s} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        self._log_file.close()


# Ports handed out below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by
# default) and above Ray's worker ports (10002-19999). A port the kernel gives to another process's bind(0)
# or outgoing connection can never be one of these, so one picked here stays free until the server started
# later binds it; a port from bind(0) can be taken in between (it once cost Ray Serve's proxy its port).
_PORT_RANGE = (20000, 32767)
_ports = random.Random()


def free_port() -> int:
    """A loopback port, free now and outside the range the kernel assigns (for a server started later)."""
    low, high = _PORT_RANGE
    for _ in range(200):
        port = _ports.randint(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {low}-{high} after 200 tries")


def plot(report: dict, path: Path) -> None:
    """TTFA p50/p95 and aggregate audio seconds per second against streams, one line per run label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = report["levels"]
    streams = [lv["streams"] for lv in levels]
    left.plot(streams, [lv["ttfa_ms_p50"] for lv in levels], "o-", label="TTFA p50")
    left.plot(streams, [lv["ttfa_ms_p95"] for lv in levels], "s--", label="TTFA p95")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("concurrent streams")
    left.set_ylabel("time to first audio (ms)")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    right.plot(streams, [lv["audio_s_per_s"] for lv in levels], "o-", color="tab:green")
    right.set_xscale("log", base=2)
    for ax in (left, right):
        ax.set_xticks(streams, [str(n) for n in streams])
    right.set_xlabel("concurrent streams")
    right.set_ylabel("audio seconds per second (all streams)")
    right.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{report['model']} on {report['device']} ({report['mode']} loop, {report['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out: Path, png: Path | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if png is not None:
        plot(report, png)
