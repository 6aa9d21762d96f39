"""Check a running `tilevox serve` from the outside: /ready, then one request on each front end.

    python scripts/smoke_serve.py --http-port 8000 --grpc-port 50051 [--host 127.0.0.1] [--wait 120]

Waits up to --wait seconds for GET /ready to answer 200, then sends one OpenAI HTTP request
(POST /v1/audio/speech, wav), one WebSocket utterance (/v1/audio/speech/stream: config, text, flush
until `done`) and one Riva `Synthesize` call (grpc with the stubs that ship in tilevox,
tilevox.server.riva_proto). Needs only tilevox's own dependencies. Prints one JSON line with what each
returned; exits 1 naming the first front end that failed. Used by tests/test_packaging.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.error
import urllib.request

import grpc
import websockets

from tilevox.server.riva_proto import riva_audio_pb2, riva_tts_pb2, riva_tts_pb2_grpc

TEXT = "Hello from tilevox."
MAX_DURATION_S = 0.5  # random weights speak noise until the limit: keep each request short


def wait_ready(base: str, wait_s: float) -> None:
    deadline, last = time.monotonic() + wait_s, None
    while True:
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise RuntimeError(f"/ready did not answer 200 within {wait_s} s (last: {last})")
        time.sleep(0.25)


def http_speech(base: str) -> dict:
    body = {
        "model": "tts-1",
        "input": TEXT,
        "voice": "alloy",
        "response_format": "wav",
        "max_duration_s": MAX_DURATION_S,
    }
    req = urllib.request.Request(
        f"{base}/v1/audio/speech", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        audio = resp.read()
        ctype = resp.headers.get("content-type", "")
    if not audio.startswith(b"RIFF") or len(audio) <= 44:
        raise RuntimeError(f"not a WAV with audio: {len(audio)} bytes, content-type {ctype!r}")
    return {"bytes": len(audio), "content_type": ctype}


async def ws_speech(url: str) -> dict:
    audio_bytes, events = 0, []
    async with websockets.connect(url, open_timeout=10) as ws:
        config = {"type": "config", "voice": "alloy", "response_format": "pcm", "max_duration_s": MAX_DURATION_S}
        await ws.send(json.dumps(config))
        await ws.send(json.dumps({"type": "text", "text": TEXT}))
        await ws.send(json.dumps({"type": "flush"}))
        while True:
            msg = await asyncio.wait_for(ws.recv(), timeout=60)
            if isinstance(msg, bytes):
                audio_bytes += len(msg)
                continue
            event = json.loads(msg)
            events.append(event["type"])
            if event["type"] == "error":
                raise RuntimeError(f"error event: {event}")
            if event["type"] == "done":
                break
        await ws.send(json.dumps({"type": "close"}))
    if audio_bytes == 0:
        raise RuntimeError(f"no audio before done; events {events}")
    return {"audio_bytes": audio_bytes, "events": events}


def riva_synthesize(target: str) -> dict:
    with grpc.insecure_channel(target) as channel:
        stub = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(channel)
        request = riva_tts_pb2.SynthesizeSpeechRequest(
            text=TEXT,
            language_code="en-US",
            encoding=riva_audio_pb2.LINEAR_PCM,
            sample_rate_hz=16000,
            custom_configuration={"max_duration_s": str(MAX_DURATION_S)},
        )
        response = stub.Synthesize(request, timeout=60)
    if not response.audio:
        raise RuntimeError("empty audio")
    return {"audio_bytes": len(response.audio)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=50051)
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for /ready (default: %(default)s)")
    args = parser.parse_args(argv)
    base = f"http://{args.host}:{args.http_port}"
    checks = (
        ("ready", lambda: wait_ready(base, args.wait)),
        ("http", lambda: http_speech(base)),
        ("websocket", lambda: asyncio.run(ws_speech(f"ws://{args.host}:{args.http_port}/v1/audio/speech/stream"))),
        ("grpc", lambda: riva_synthesize(f"{args.host}:{args.grpc_port}")),
    )
    results: dict[str, object] = {}
    for name, check in checks:
        try:
            results[name] = check() or "ok"
        except Exception as exc:  # noqa: BLE001  (any failure is this script's result, reported with the front end's name)
            print(f"smoke_serve: {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            print(json.dumps(results))
            return 1
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
