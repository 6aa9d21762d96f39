"""Soak test of a running `tilevox serve`: many concurrent clients on all three surfaces for minutes,
with random cancels and disconnects, then checks that nothing leaked.

    python -m benchmarks.soak --minutes 10 --clients 32            # starts a CPU server (random:llama-tiny)
    python -m benchmarks.soak --minutes 1 --clients 8 --out /tmp/soak.json

Each client loops until the deadline, picking per request one of: HTTP streaming pcm, HTTP SSE (mp3),
WebSocket (config, text pieces, flush), Riva SynthesizeOnline (gRPC), and one of three endings: read to
the end, cancel part-way (WebSocket `cancel` message, gRPC call cancel), or drop the connection
part-way (close the socket / stop reading). Expected outcomes are counted; anything else is an
unexpected error, listed with an example. At the end: the server's running streams and queue must be
empty within 5 s (no leaked slots), and its resident memory after the run must be within 5 % of the
resident memory after the first minute (warm-up allocations excluded). Writes JSON to --out.
All traffic goes to 127.0.0.1; every loop is bounded by the deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import time
from pathlib import Path

import grpc
import httpx
import websockets
from riva.client.proto import riva_audio_pb2, riva_tts_pb2, riva_tts_pb2_grpc

from benchmarks.common import RESULTS, ServerProcess, commit, utc_now

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Please hold while I connect you to the next available agent.",
    "Your order number is 4 5 7 1, and it ships tomorrow morning.",
    "Streaming speech should start playing within a fraction of a second.",
]
SURFACES = ("http_pcm", "http_sse", "ws", "grpc")
ENDINGS = ("complete", "cancel", "disconnect")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _gauge(metrics_text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", metrics_text, re.M)
    if match is None:
        raise RuntimeError(f"metric {name} missing from /metrics")
    return float(match.group(1))


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.unexpected: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.audio_bytes = 0

    def ok(self, key: str) -> None:
        self.outcomes[key] += 1

    def bad(self, key: str, detail: str) -> None:
        self.unexpected[key] += 1
        self.examples.setdefault(key, detail[:300])


async def _http(client: httpx.AsyncClient, base: str, body: dict, ending: str, tally: Tally, key: str) -> None:
    limit = random.randint(1, 4) if ending != "complete" else None
    async with client.stream("POST", base + "/v1/audio/speech", json=body) as r:
        if r.status_code == 429:
            tally.ok(f"{key}:429")
            await r.aread()
            return
        if r.status_code != 200:
            tally.bad(key, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return
        chunks = 0
        tail = b""
        async for piece in r.aiter_bytes():
            tally.audio_bytes += len(piece)
            tail = (tail + piece)[-4096:]
            chunks += 1
            if limit is not None and chunks >= limit:
                break  # leaving the block closes the connection mid-stream: a disconnect
    if limit is None and body.get("stream_format") == "sse" and b"event: speech.audio.done" not in tail:
        tally.bad(key, f"SSE stream did not end with speech.audio.done: ...{tail[-200:]!r}")
        return
    tally.ok(f"{key}:{ending}")


async def _ws(base: str, text: str, seed: int, ending: str, api_key: str | None, tally: Tally) -> None:
    url = base.replace("http://", "ws://") + "/v1/audio/speech/stream"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.send(json.dumps({"type": "config", "response_format": "pcm", "seed": seed, "max_duration_s": 2.0}))
        for word in text.split():
            await ws.send(json.dumps({"type": "text", "text": word + " "}))
        await ws.send(json.dumps({"type": "flush"}))
        binary = 0
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                tally.audio_bytes += len(msg)
                binary += 1
                if ending != "complete" and binary >= 2:
                    break
                continue
            event = json.loads(msg)
            if event["type"] in ("started", "first_audio"):
                continue
            if event["type"] == "done":
                tally.ok("ws:complete")
                await ws.send(json.dumps({"type": "close"}))
                return
            if event["type"] == "error" and event.get("code") == "overloaded":
                tally.ok("ws:429")
                return
            tally.bad("ws", f"event {event}")
            return
        if ending == "cancel":
            await ws.send(json.dumps({"type": "cancel"}))
            while True:  # audio already in flight may precede the acknowledgement
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    continue
                event = json.loads(msg)
                if event["type"] == "cancelled":
                    tally.ok("ws:cancel")
                    await ws.send(json.dumps({"type": "close"}))
                    return
                if event["type"] not in ("first_audio", "done"):
                    tally.bad("ws", f"after cancel: {event}")
                    return
        tally.ok("ws:disconnect")  # leaving the block closes the socket mid-stream


async def _grpc(target: str, text: str, seed: int, ending: str, api_key: str | None, tally: Tally) -> None:
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(channel)
        request = riva_tts_pb2.SynthesizeSpeechRequest(
            text=text,
            language_code="en-US",
            encoding=riva_audio_pb2.LINEAR_PCM,
            sample_rate_hz=0,
            voice_name="",
            custom_configuration={"seed": str(seed), "max_duration_s": "2.0"},
        )
        call = stub.SynthesizeOnline(iter([request]), metadata=metadata)  # bidirectional in Riva 2.x
        chunks = 0
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                tally.audio_bytes += len(response.audio)
                chunks += 1
                if ending != "complete" and chunks >= 2:
                    call.cancel()  # a client-side cancel; the channel closing is the same to the server
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                tally.ok("grpc:429")
                return
            tally.bad("grpc", f"{exc.code().name}: {exc.details()}")
            return
    tally.ok(f"grpc:{ending}")


async def _client(idx: int, base: str, grpc_target: str, deadline: float, api_key: str | None, tally: Tally) -> None:
    rng = random.Random(idx)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        k = 0
        while time.monotonic() < deadline:
            surface = rng.choice(SURFACES)
            ending = rng.choices(ENDINGS, weights=(6, 2, 2))[0]
            text = TEXTS[(idx + k) % len(TEXTS)]
            seed = idx * 100_000 + k
            k += 1
            try:
                if surface in ("http_pcm", "http_sse"):
                    body = {
                        "input": text,
                        "voice": "alloy",
                        "seed": seed,
                        "max_duration_s": 2.0,
                        "response_format": "pcm" if surface == "http_pcm" else "mp3",
                        "stream_format": "audio" if surface == "http_pcm" else "sse",
                    }
                    await _http(client, base, body, "complete" if ending == "cancel" else ending, tally, surface)
                elif surface == "ws":
                    await _ws(base, text, seed, ending, api_key, tally)
                else:
                    await _grpc(
                        grpc_target, text, seed, "complete" if ending == "disconnect" else ending, api_key, tally
                    )
            except (httpx.HTTPError, websockets.WebSocketException, OSError, grpc.RpcError) as exc:
                tally.bad(surface, f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(rng.uniform(0, 0.2))


async def _soak(args, pid: int, base: str, grpc_target: str) -> dict:
    tally = Tally()
    started = time.monotonic()
    deadline = started + args.minutes * 60
    rss: list[tuple[float, int]] = [(0.0, _rss_kib(pid))]

    async def sample_rss() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(10)
            rss.append((round(time.monotonic() - started, 1), _rss_kib(pid)))

    await asyncio.gather(
        sample_rss(), *(_client(i, base, grpc_target, deadline, args.api_key, tally) for i in range(args.clients))
    )
    # Leaked slots: nothing may stay running or queued once every client has gone.
    async with httpx.AsyncClient(timeout=10) as client:
        active = queued = float("nan")
        for _ in range(50):
            text = (await client.get(base + "/metrics")).text
            active, queued = _gauge(text, "tilevox_active_streams"), _gauge(text, "tilevox_queue_depth")
            if active == 0 and queued == 0:
                break
            await asyncio.sleep(0.1)
    rss_end = _rss_kib(pid)
    baseline = next((kib for t, kib in rss if t >= 60), rss[-1][1])  # after the first minute
    growth = (rss_end - baseline) / baseline
    return {
        "outcomes": dict(sorted(tally.outcomes.items())),
        "requests": sum(tally.outcomes.values()) + sum(tally.unexpected.values()),
        "unexpected_errors": sum(tally.unexpected.values()),
        "unexpected_by_surface": dict(tally.unexpected),
        "unexpected_examples": tally.examples,
        "audio_mib_received": round(tally.audio_bytes / 2**20, 1),
        "leaked_active_streams": active,
        "leaked_queued_streams": queued,
        "rss_kib_after_first_minute": baseline,
        "rss_kib_end": rss_end,
        "rss_growth": round(growth, 4),
        "rss_samples": rss,
        "passed": sum(tally.unexpected.values()) == 0 and active == 0 and queued == 0 and growth < 0.05,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--model", default="random:llama-tiny")
    parser.add_argument(
        "--max-streams", type=int, default=8, help="server --max-streams (the rest of the clients queue)"
    )
    parser.add_argument("--api-key", default=None, help="serve and call with this key")
    parser.add_argument("--server-log", type=Path, default=Path("/tmp/tilevox_soak_server.log"))
    parser.add_argument("--out", type=Path, default=RESULTS / "soak_cpu.json")
    args = parser.parse_args()
    serve_args = [
        "--model",
        args.model,
        "--device",
        "cpu",
        "--max-streams",
        str(args.max_streams),
        "--max-queued",
        str(args.clients),
    ]
    env = {"TILEVOX_API_KEY": args.api_key} if args.api_key else None
    with ServerProcess(serve_args, log_path=args.server_log, start_timeout_s=300, env=env) as server:
        result = asyncio.run(_soak(args, server.proc.pid, server.base_url, server.grpc_target))
    report = {
        "benchmark": "soak",
        "date": utc_now(),
        "commit": commit(),
        "device": "cpu",
        "model": args.model,
        "minutes": args.minutes,
        "clients": args.clients,
        "server_max_streams": args.max_streams,
        "server_exit_code": server.returncode,
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=2))
    print(f"wrote {args.out}")
    return 0 if report["passed"] and server.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
