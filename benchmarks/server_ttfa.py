"""Time to first audio (TTFA) of a running tilevox server at 1, 8 and 32 concurrent streams.

Closed loop, as riva_tts_perf_client: N workers each send `--rounds` streaming
POST /v1/audio/speech requests (pcm) one after another. TTFA is measured at the client, from
sending the request to the first audio byte; RTF is per request (wall time / audio duration).
Starts `tilevox serve` as a subprocess (--model, --device, --dtype) unless --url is given.

    python -m benchmarks.server_ttfa --model random:llama-tiny --device cpu
    python -m benchmarks.server_ttfa --model random:qwen3-tts-0.6b --device cuda --max-streams 32
    python -m benchmarks.server_ttfa --url http://gpu-host:8000
Prints a table and writes JSON (device, date, commit, per-level p50/p95/p99) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import RESULTS, ServerProcess, commit, device_name, utc_now

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech should start playing within a fraction of a second.",
    "Please hold while I connect you to the next available agent.",
    "Your order number is 4 5 7 1, and it ships tomorrow morning.",
]


async def _one(client: httpx.AsyncClient, url: str, body: dict, sample_rate_hz: int) -> dict:
    start = time.perf_counter()
    first = None
    num_bytes = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"{r.status_code} {r.text[:120]}"}
        async for piece in r.aiter_bytes():
            if piece and first is None:
                first = time.perf_counter() - start
            num_bytes += len(piece)
    wall = time.perf_counter() - start
    audio_s = num_bytes / 2 / sample_rate_hz
    return {"ttfa_s": first, "wall_s": wall, "audio_s": audio_s, "rtf": wall / audio_s if audio_s else None}


async def _level(
    base: str, concurrency: int, rounds: int, max_duration_s: float, sample_rate_hz: int, api_key: str | None
) -> dict:
    url = base + "/v1/audio/speech"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:

        async def worker(idx: int) -> list[dict]:
            out = []
            for k in range(rounds):
                body = {
                    "model": "tts-1",
                    "voice": "alloy",
                    "input": TEXTS[(idx + k) % len(TEXTS)],
                    "response_format": "pcm",
                    "seed": idx * 1000 + k,
                    "max_duration_s": max_duration_s,
                }
                out.append(await _one(client, url, body, sample_rate_hz))
            return out

        started = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(i) for i in range(concurrency))) for r in rs]
        elapsed = time.perf_counter() - started
    ok = [r for r in results if "error" not in r and r["ttfa_s"] is not None]
    ttfa_ms = np.array([r["ttfa_s"] * 1e3 for r in ok])
    rtf = np.array([r["rtf"] for r in ok if r["rtf"] is not None])
    audio_total = sum(r["audio_s"] for r in ok)

    def pct(a, q):
        return round(float(np.percentile(a, q)), 1) if a.size else None

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_examples": sorted({r["error"] for r in results if "error" in r})[:3],
        "ttfa_ms_p50": pct(ttfa_ms, 50),
        "ttfa_ms_p95": pct(ttfa_ms, 95),
        "ttfa_ms_p99": pct(ttfa_ms, 99),
        "ttfa_ms_mean": round(float(ttfa_ms.mean()), 1) if ttfa_ms.size else None,
        "rtf_p50": round(float(np.percentile(rtf, 50)), 3) if rtf.size else None,
        "rtf_p95": round(float(np.percentile(rtf, 95)), 3) if rtf.size else None,
        "audio_s_per_s": round(audio_total / elapsed, 2),  # aggregate throughput, all streams together
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    parser.add_argument("--model", default="random:llama-tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"])
    parser.add_argument(
        "--max-streams", type=int, default=None, help="server --max-streams (default: the model's limit, at most 32)"
    )
    parser.add_argument("--levels", default="1,8,32", help="comma-separated concurrency levels")
    parser.add_argument("--rounds", type=int, default=4, help="requests per worker per level")
    parser.add_argument("--max-duration", type=float, default=2.0, help="seconds of audio per request")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra `tilevox serve` argument (repeat; e.g. --serve-arg=--cuda-graphs --serve-arg=off)",
    )
    parser.add_argument("--api-key", default=os.environ.get("TILEVOX_API_KEY"))
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument(
        "--server-log", type=Path, default=Path("/tmp/tilevox_server_ttfa.log"), help="the started server's log"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: benchmarks/results/server_ttfa-<device>-<time>.json)",
    )
    args = parser.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]

    server = None
    base = args.url
    if base is None:
        serve_args = ["--model", args.model, "--device", args.device]
        if args.dtype:
            serve_args += ["--dtype", args.dtype]
        if args.max_streams:
            serve_args += ["--max-streams", str(args.max_streams)]
        serve_args += ["--max-queued", str(max(args.levels) * 2)]  # the benchmark measures latency, not 429s
        serve_args += args.serve_arg
        server = ServerProcess(serve_args, log_path=args.server_log, start_timeout_s=args.start_timeout).__enter__()
        base = server.base_url
    try:
        auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(base + "/v1/models", headers=auth).json()
        model_id = models["data"][0]["id"]
        ready = httpx.get(base + "/ready").json()
        warm = httpx.post(
            base + "/v1/audio/speech",
            json={"input": "warm up", "response_format": "pcm", "max_duration_s": 0.5},
            headers=auth,
            timeout=300,
        )
        rate = int(warm.headers["x-sample-rate"])
        levels = [asyncio.run(_level(base, n, args.rounds, args.max_duration, rate, args.api_key)) for n in args.levels]
    finally:
        if server is not None:
            server.__exit__(None, None, None)

    report = {
        "benchmark": "server_ttfa",
        "date": utc_now(),
        "commit": commit(),
        "device": device_name(args.device) if args.url is None else f"remote server {base}",
        "model": model_id,
        "server_max_streams": ready["max_streams"],
        "server_max_queued": ready["max_queued"],
        "sample_rate_hz": rate,
        "max_duration_s": args.max_duration,
        "serve_args": args.serve_arg,
        "rounds_per_worker": args.rounds,
        "ttfa_definition": "client-side, request sent -> first audio byte of a streaming pcm response",
        "levels": levels,
    }
    print(
        f"model {model_id} on {report['device']}, commit {report['commit']}, {args.max_duration:g} s of audio per request, "
        f"server max_streams {ready['max_streams']} (more concurrent requests queue)"
    )
    print(
        f"{'streams':>8} {'requests':>8} {'errors':>6} {'TTFA p50 ms':>12} {'TTFA p95 ms':>12} {'TTFA p99 ms':>12} {'RTF p50':>8} {'audio s/s':>10}"
    )
    for lv in levels:
        print(
            f"{lv['concurrency']:>8} {lv['requests']:>8} {lv['errors']:>6} {lv['ttfa_ms_p50']!s:>12} {lv['ttfa_ms_p95']!s:>12} "
            f"{lv['ttfa_ms_p99']!s:>12} {lv['rtf_p50']!s:>8} {lv['audio_s_per_s']!s:>10}"
        )
    out = args.out or RESULTS / f"server_ttfa-{args.device}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
