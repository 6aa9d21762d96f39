"""Time to the first audio byte and to the first decodable audio at the client, per format and surface.

    python -m benchmarks.first_byte --model random:llama-tiny --repeats 10

For each format x surface (HTTP raw body, HTTP SSE, WebSocket, Riva gRPC where the format exists there)
one request at a time against a `tilevox serve` subprocess on loopback (CPU): the clock starts when the
request is sent; "first byte" is the first audio byte received, "first decodable" the moment the bytes
received so far first decode (PyAV for compressed formats; raw formats decode at their first byte).
Medians of --repeats, the cases measured round-robin. The interesting column is the gap to `pcm` on the same surface: what a codec's frame
size, encoder delay and muxer add. Writes JSON and a markdown table (benchmarks/results/first_byte_cpu.*).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

import av
import grpc
import httpx
import websockets
from riva.client.proto import riva_audio_pb2, riva_tts_pb2, riva_tts_pb2_grpc

from benchmarks.common import RESULTS, ServerProcess, commit, device_name, utc_now

HTTP_FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac", "mulaw")
GRPC_ENCODINGS = {
    "pcm": riva_audio_pb2.LINEAR_PCM,
    "opus": riva_audio_pb2.OGGOPUS,
    "flac": riva_audio_pb2.FLAC,
    "mulaw": riva_audio_pb2.MULAW,
}
TEXT = "The first words of a sentence should be heard at once."
RAW = ("pcm", "wav", "mulaw")


class Probe:
    """Accumulates received bytes; records when the first byte and the first decodable audio arrived."""

    def __init__(self, fmt: str, started: float) -> None:
        self.fmt, self.started = fmt, started
        self.buffer = bytearray()
        self.first_byte_ms: float | None = None
        self.first_decodable_ms: float | None = None

    def feed(self, data: bytes) -> None:
        if not data:
            return
        now_ms = (time.perf_counter() - self.started) * 1e3
        self.buffer += data
        if self.first_byte_ms is None:
            self.first_byte_ms = now_ms
        if self.first_decodable_ms is None and self._decodes():
            self.first_decodable_ms = now_ms

    def _decodes(self) -> bool:
        if self.fmt in RAW:
            return len(self.buffer) > (44 if self.fmt == "wav" else 0)
        try:
            with av.open(
                io.BytesIO(bytes(self.buffer)), format={"opus": "ogg", "aac": "aac"}.get(self.fmt, self.fmt)
            ) as c:
                return any(frame.samples for frame in c.decode(audio=0))
        except (av.error.FFmpegError, EOFError, ValueError):  # not enough bytes yet for the demuxer/decoder
            return False


async def _http(base: str, fmt: str, sse: bool) -> Probe:
    body = {"input": TEXT, "response_format": fmt, "seed": 1, "max_duration_s": 1.0}
    if sse:
        body["stream_format"] = "sse"
    async with httpx.AsyncClient(timeout=60) as client:
        probe = Probe(fmt, time.perf_counter())
        async with client.stream("POST", base + "/v1/audio/speech", json=body) as r:
            r.raise_for_status()
            if not sse:
                async for piece in r.aiter_raw():
                    probe.feed(piece)
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if event["type"] == "speech.audio.delta":
                            probe.feed(base64.b64decode(event["audio"]))
    return probe


async def _ws(base: str, fmt: str) -> Probe:
    async with websockets.connect(base.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:
        await ws.send(json.dumps({"type": "config", "response_format": fmt, "seed": 1, "max_duration_s": 1.0}))
        json.loads(await ws.recv())  # started
        probe = Probe(fmt, time.perf_counter())
        await ws.send(json.dumps({"type": "text", "text": TEXT}))
        await ws.send(json.dumps({"type": "flush"}))
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                probe.feed(msg)
            elif json.loads(msg)["type"] in ("done", "error"):
                return probe


async def _grpc(target: str, fmt: str) -> Probe:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(channel)
        request = riva_tts_pb2.SynthesizeSpeechRequest(
            text=TEXT,
            language_code="en-US",
            encoding=GRPC_ENCODINGS[fmt],
            sample_rate_hz=8000 if fmt == "mulaw" else 0,
            custom_configuration={"seed": "1", "max_duration_s": "1.0"},
        )
        probe = Probe(fmt, time.perf_counter())
        async for response in stub.SynthesizeOnline(iter([request])):
            probe.feed(response.audio)
    return probe


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 1) if got else None


async def _measure(server: ServerProcess, repeats: int) -> list[dict]:
    cases = [("http", fmt, False) for fmt in HTTP_FORMATS] + [("http-sse", fmt, True) for fmt in HTTP_FORMATS]
    cases += [("websocket", fmt, False) for fmt in HTTP_FORMATS] + [("grpc", fmt, False) for fmt in GRPC_ENCODINGS]
    probes: dict[tuple, list[Probe]] = {case: [] for case in cases}
    # Round-robin over the cases, so that load or warm-up drift on the machine spreads over all of them
    # alike; the first round warms every encoder and connection path and is dropped.
    for round_index in range(repeats + 1):
        for case in cases:
            surface, fmt, sse = case
            if surface.startswith("http"):
                probe = await _http(server.base_url, fmt, sse)
            elif surface == "websocket":
                probe = await _ws(server.base_url, fmt)
            else:
                probe = await _grpc(server.grpc_target, fmt)
            if round_index:
                probes[case].append(probe)
    rows = [
        {
            "surface": surface,
            "format": fmt,
            "first_byte_ms": _median([p.first_byte_ms for p in got]),
            "first_decodable_ms": _median([p.first_decodable_ms for p in got]),
        }
        for (surface, fmt, _), got in probes.items()
    ]
    for row in rows:  # the codec's cost: the gap to raw pcm on the same surface
        pcm = next(r for r in rows if r["surface"] == row["surface"] and r["format"] == "pcm")
        row["decodable_after_pcm_ms"] = (
            round(row["first_decodable_ms"] - pcm["first_decodable_ms"], 1)
            if row["first_decodable_ms"] is not None and pcm["first_decodable_ms"] is not None
            else None
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-tiny")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--server-log", type=Path, default=Path("/tmp/tilevox_first_byte_server.log"))
    parser.add_argument("--out", type=Path, default=RESULTS / "first_byte_cpu.json")
    args = parser.parse_args()
    with ServerProcess(
        ["--model", args.model, "--device", "cpu"], log_path=args.server_log, start_timeout_s=300
    ) as server:
        rows = asyncio.run(_measure(server, args.repeats))
    report = {
        "benchmark": "first_byte",
        "date": utc_now(),
        "commit": commit(),
        "device": device_name("cpu"),
        "model": args.model,
        "repeats": args.repeats,
        "text": TEXT,
        "rows": rows,
        "definition": "client clock from request sent; first_decodable = first time the received bytes decode to audio",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    table = [
        "| surface | format | first byte ms | first decodable ms | decodable after pcm ms |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {r['surface']} | {r['format']} | {r['first_byte_ms']} | {r['first_decodable_ms']} | {r['decodable_after_pcm_ms']} |"
        for r in rows
    ]
    md = (
        f"# Time to first audio byte and first decodable audio ({report['device']}, {report['date']}, commit {report['commit']})\n\n"
        f"Model {args.model}, medians of {args.repeats} sequential requests on loopback; see benchmarks/first_byte.py.\n\n"
        + "\n".join(table)
        + "\n"
    )
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
