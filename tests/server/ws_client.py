"""A WebSocket streaming client for the server tests: one synthesis over /v1/audio/speech/stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection, Mapping, Sequence

from websockets.asyncio.client import connect


async def ws_synthesize(
    port: int,
    pieces: Sequence[str],
    config: Mapping[str, object],
    *,
    recv_timeout: float = 30,
    open_timeout: float = 10,  # websockets' default
    end_types: Collection[str] = ("done",),
    fail_types: Collection[str] = (),
    on_audio: Callable[[bytes], None] | None = None,
) -> tuple[bytes, list[dict]]:
    """Connect to ws://127.0.0.1:`port`/v1/audio/speech/stream, send {"type": "config", **config}, each of `pieces`
    as a text message and a flush, then receive until a JSON event whose type is in `end_types`.

    Binary frames are the audio (each passed to `on_audio` as it arrives); JSON events of other types are kept;
    one whose type is in `fail_types` raises AssertionError with the raw message. Every receive waits at most
    `recv_timeout` seconds. Returns (audio, events): the concatenated audio and every JSON event in order, the
    end event last."""
    async with connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", open_timeout=open_timeout) as ws:
        await ws.send(json.dumps({"type": "config", **config}))
        for piece in pieces:
            await ws.send(json.dumps({"type": "text", "text": piece}))
        await ws.send(json.dumps({"type": "flush"}))
        audio = bytearray()
        events: list[dict] = []
        while True:
            message = await asyncio.wait_for(ws.recv(), timeout=recv_timeout)
            if isinstance(message, bytes):
                audio += message
                if on_audio is not None:
                    on_audio(message)
                continue
            event = json.loads(message)
            events.append(event)
            if event["type"] in end_types:
                return bytes(audio), events
            if event["type"] in fail_types:
                raise AssertionError(message)
