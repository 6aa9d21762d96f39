"""WebSocket `/v1/audio/speech/stream`: text in as an LLM produces it, audio out as it is made.

Client messages (JSON text frames; vLLM-Omni names accepted as aliases):
  {"type": "config", ...speech fields but "input"}   first message (session.config)
  {"type": "text", "text": "..."}                     (input.text) buffered into phrases
  {"type": "flush"}                                   (input.done) speak what is buffered, then "done"
  {"type": "cancel"}                                  drop buffered text and stop the audio now
  {"type": "close"}                                   (session.close)
Server: {"type": "started"} once, binary audio frames, {"type": "first_audio"} per utterance,
{"type": "done", "stats"} per flush, {"type": "cancelled"}, {"type": "error", "code", "message"}.
Phrase i of a session uses seed + i, so a single-phrase utterance equals the HTTP output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from fastapi import WebSocket, WebSocketDisconnect

from tilevox.server.audio import AudioFormat, StreamEncoder
from tilevox.server.errors import map_exception
from tilevox.server.logs import log_event
from tilevox.server.protocol import ApiError, parse_speech_request
from tilevox.server.state import ServerState, bearer_token, new_request_id
from tilevox.server.text_buffer import PhraseBuffer

__all__ = ["serve_websocket"]

log = logging.getLogger("tilevox.ws")

_ALIASES = {"session.config": "config", "input.text": "text", "input.done": "flush", "input.cancel": "cancel", "session.close": "close"}
_FLUSH = object()


class _Session:
    def __init__(self, ws: WebSocket, state: ServerState, request_id: str):
        self.ws = ws
        self.state = state
        self.request_id = request_id
        self.params = None
        self.buffer = PhraseBuffer()
        self.phrases: asyncio.Queue = asyncio.Queue()
        self.phrase_idx = 0
        self.current = None  # the StreamHandle being played
        self.encoder: StreamEncoder | None = None
        self.utterance_started_at: float | None = None
        self.utt = {}
        self.generation = 0  # bumped by cancel: queued work of older generations is dropped

    async def send_event(self, kind: str, **fields) -> None:
        await self.ws.send_text(json.dumps({"type": kind, **fields}))

    async def send_error(self, exc: BaseException) -> None:
        mapped = map_exception(exc)
        if mapped is None:
            raise exc
        await self.send_event("error", code=mapped.code, message=mapped.message, status=mapped.http_status)

    def enqueue(self, phrase) -> None:
        if phrase is not _FLUSH and self.utterance_started_at is None:
            self.utterance_started_at = time.perf_counter()
        self.phrases.put_nowait((self.generation, phrase))

    async def player(self) -> None:
        """Synthesize queued phrases one after another, in order, into one encoder per utterance."""

        while True:
            generation, phrase = await self.phrases.get()
            if generation != self.generation:
                continue
            if phrase is _FLUSH:
                await self._end_utterance()
                continue
            if self.encoder is None:
                self.encoder = StreamEncoder(self.params.response_format, in_rate_hz=self.state.model.sample_rate_hz, out_rate_hz=self.params.sample_rate_hz)
                self.utt = {"phrases": 0, "num_frames": 0, "audio_s": 0.0, "first_audio_ms": None}
            base = self.params.request
            request = dataclasses.replace(base, text=phrase, seed=(base.seed + self.phrase_idx) % (2**63))
            self.phrase_idx += 1
            try:
                handle = self.state.scheduler.submit(request)
            except Exception as exc:  # noqa: BLE001 - reported as an error event; the session goes on
                await self.send_error(exc)
                continue
            self.current = handle
            encoder = self.encoder
            try:
                async for samples in handle:
                    if generation != self.generation:  # cancelled: send nothing more of this phrase
                        break
                    data = encoder.encode(samples)
                    if self.utt["first_audio_ms"] is None:
                        self.utt["first_audio_ms"] = round((time.perf_counter() - self.utterance_started_at) * 1e3, 2)
                        await self.send_event("first_audio", latency_ms=self.utt["first_audio_ms"])
                    if data:
                        await self.ws.send_bytes(data)
            except Exception as exc:  # noqa: BLE001 - a failed phrase is reported in-band
                await self.send_error(exc)
            finally:
                handle.cancel()
                self.current = None
            if handle.stats is not None and generation == self.generation:
                self.utt["phrases"] += 1
                self.utt["num_frames"] += handle.stats.num_frames
                self.utt["audio_s"] += handle.stats.audio_duration_s

    async def _end_utterance(self) -> None:
        if self.encoder is not None:
            tail = self.encoder.finish()
            if tail:
                await self.ws.send_bytes(tail)
        stats = dict(self.utt, audio_s=round(self.utt.get("audio_s", 0.0), 4))
        if self.utterance_started_at is not None:
            stats["wall_ms"] = round((time.perf_counter() - self.utterance_started_at) * 1e3, 2)
        await self.send_event("done", stats=stats)
        self.encoder = None
        self.utterance_started_at = None
        self.utt = {}

    async def cancel(self) -> None:
        self.generation += 1
        self.buffer.flush()
        if self.current is not None:
            self.current.cancel()
        self.encoder = None
        self.utterance_started_at = None


def _parse_config(msg: dict, state: ServerState):
    body = {k: v for k, v in msg.items() if k != "type"}
    if "input" in body:
        raise ApiError(400, "config must not carry input; send it in text messages", param="input")
    return parse_speech_request(
        body, catalog=state.catalog, native_rate_hz=state.model.sample_rate_hz,
        max_text_chars=state.config.max_text_chars, default_max_duration_s=state.config.default_max_duration_s,
        default_format=AudioFormat.PCM, require_input=False,
    )


async def serve_websocket(ws: WebSocket, state: ServerState) -> None:
    request_id = ws.headers.get("x-request-id") or new_request_id()
    if not state.check_api_key(bearer_token(ws.headers.get("authorization"))):
        await ws.close(code=1008, reason="missing or wrong API key")  # before accept: the client sees HTTP 403
        return
    await ws.accept()
    session = _Session(ws, state, request_id)
    player: asyncio.Task | None = None
    cfg = state.config
    try:
        while True:
            try:
                frame = await asyncio.wait_for(ws.receive(), timeout=cfg.idle_timeout_s)
            except TimeoutError:
                await session.send_event("error", code="idle_timeout", message=f"no message for {cfg.idle_timeout_s} s", status=408)
                break
            if frame["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(frame.get("code", 1000))
            raw = frame.get("text")
            if raw is None:
                await session.send_error(ApiError(400, "binary messages are not accepted; send JSON text messages"))
                continue
            if len(raw) > cfg.max_message_bytes:
                await session.send_event("error", code="message_too_large", message=f"message exceeds {cfg.max_message_bytes} bytes", status=413)
                continue
            try:
                msg = json.loads(raw)
                if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                    raise ApiError(400, "each message must be a JSON object with a string 'type'")
            except json.JSONDecodeError as exc:
                await session.send_error(ApiError(400, f"message is not valid JSON: {exc}"))
                continue
            except ApiError as exc:
                await session.send_error(exc)
                continue
            kind = _ALIASES.get(msg["type"], msg["type"])
            try:
                if kind == "config":
                    session.params = _parse_config(msg, state)
                    if player is None:
                        player = asyncio.create_task(session.player())
                    await session.send_event(
                        "started", request_id=request_id, model=state.model.model_id,
                        format=session.params.response_format.value, sample_rate=session.params.sample_rate_hz,
                    )
                elif session.params is None:
                    raise ApiError(400, "the first message must be {\"type\": \"config\", ...}")
                elif kind == "text":
                    text = msg.get("text")
                    if not isinstance(text, str):
                        raise ApiError(400, "text must be a string", param="text")
                    if len(session.buffer.pending) + len(text) > cfg.max_text_chars:
                        raise ApiError(400, f"buffered text exceeds {cfg.max_text_chars} characters; send flush", param="text")
                    for phrase in session.buffer.push(text):
                        session.enqueue(phrase)
                elif kind == "flush":
                    tail = session.buffer.flush()
                    if tail:
                        session.enqueue(tail)
                    session.enqueue(_FLUSH)
                elif kind == "cancel":
                    await session.cancel()
                    await session.send_event("cancelled")
                elif kind == "close":
                    break
                else:
                    raise ApiError(400, f"unknown message type {msg['type']!r}", param="type")
            except ApiError as exc:
                await session.send_error(exc)
        await ws.close(code=1000)
    except WebSocketDisconnect:
        log_event(log, "ws.disconnected", request_id=request_id)  # the client left; `finally` frees its stream at once
    finally:
        if player is not None:
            player.cancel()
        if session.current is not None:
            session.current.cancel()
        state.metrics.requests_total.labels(api="ws", outcome="closed").inc()
        log_event(log, "ws.closed", request_id=request_id, phrases=session.phrase_idx)
