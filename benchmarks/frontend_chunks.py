"""How many audio chunks the server's front end moves per second when the model costs nothing.

A fake model (tests.server.fake_model: instant steps, 50 frames/s of 320 samples at 16 kHz) behind the
real server; N concurrent HTTP pcm streams of F frames each, from one asyncio client in the same process.
Two deliveries are compared side by side in one run:

- per_step (the server as it is): a worker step hands all its chunks to the event loop in one wake-up,
  and a stream's consumer takes every chunk already waiting as one array (one write);
- per_chunk (the delivery before 2026-12-03, re-created here by patching StreamHandle): one event-loop
  wake-up and one write per chunk.

Reports medians over --rounds of wall time and audio seconds per second (the front end's ceiling on this
machine: a model whose frames are free could not stream faster), writes JSON. Usage:
python -m benchmarks.frontend_chunks --out benchmarks/results/frontend_chunks_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.common import commit, device_name, utc_now
from tests.server.conftest import make_server
from tests.server.fake_model import FakeSpeechModel
from tilevox.server import scheduler


def _per_chunk_deliver(self, item) -> None:
    self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


async def _per_chunk_anext(self):
    item = await self._queue.get()
    if item is scheduler._END:
        self._queue.put_nowait(scheduler._END)
        raise StopAsyncIteration
    if isinstance(item, scheduler.StreamStats):
        self.stats = item
        self._queue.put_nowait(scheduler._END)
        raise StopAsyncIteration
    if isinstance(item, BaseException):
        self._queue.put_nowait(scheduler._END)
        raise item
    return item


async def _load(url: str, streams: int, frames: int) -> tuple[float, int]:
    async def one(client: httpx.AsyncClient, seed: int) -> int:
        body = {"input": "x" * frames, "seed": seed, "response_format": "pcm", "sample_rate": 16000}
        received = 0
        async with client.stream("POST", url + "/v1/audio/speech", json=body) as response:
            response.raise_for_status()
            async for piece in response.aiter_bytes():
                received += len(piece)
        return received

    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        sizes = await asyncio.gather(*(one(client, seed) for seed in range(streams)))
        return time.perf_counter() - start, sum(sizes)


def run(delivery: str, streams: int, frames: int, rounds: int) -> dict:
    saved = scheduler.StreamHandle._deliver, scheduler.StreamHandle.__anext__
    if delivery == "per_chunk":
        scheduler.StreamHandle._deliver = _per_chunk_deliver
        scheduler.StreamHandle.__anext__ = _per_chunk_anext
    server = make_server(FakeSpeechModel(max_streams=streams), max_streams=streams, max_queued=streams)
    try:
        walls, audio = [], 0.0
        for _ in range(rounds):
            wall, num_bytes = asyncio.run(_load(server.http_url, streams, frames))
            walls.append(wall)
            audio = num_bytes / 2 / 16000
            if audio != streams * frames / 50:
                raise RuntimeError(f"{delivery}: got {audio} s of audio, expected {streams * frames / 50}")
    finally:
        server.stop()
        scheduler.StreamHandle._deliver, scheduler.StreamHandle.__anext__ = saved
    wall = statistics.median(walls)
    return {"delivery": delivery, "wall_s_median": wall, "audio_s": audio, "audio_s_per_s": audio / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--frames", type=int, default=150, help="frames per stream (50 per second of audio)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for _ in range(2):  # alternate, so that neither delivery always runs on a warmer process
        for delivery in ("per_chunk", "per_step"):
            rows.append(run(delivery, args.streams, args.frames, args.rounds))
    summary = {
        delivery: statistics.median(r["audio_s_per_s"] for r in rows if r["delivery"] == delivery)
        for delivery in ("per_chunk", "per_step")
    }
    print("| delivery | audio s per s (median) |\n|---|---|")
    for delivery, value in summary.items():
        print(f"| {delivery} | {value:.1f} |")
    print(f"per_step / per_chunk: {summary['per_step'] / summary['per_chunk']:.2f}x")
    report = {
        "benchmark": "frontend_chunks",
        "device": device_name("cpu"),
        "date": utc_now(),
        "commit": commit(),
        "streams": args.streams,
        "frames_per_stream": args.frames,
        "rounds": args.rounds,
        "audio_s_per_s_median": summary,
        "ratio_per_step_over_per_chunk": summary["per_step"] / summary["per_chunk"],
        "runs": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
