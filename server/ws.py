"""WebSocket `/v1/audio/speech/stream`: text in as an LLM produces it, audio out as it is made.

The protocol (messages, events, validation) is the I/O-free state machine in server/ws_protocol.py;
this module is its I/O shell: it reads frames, runs the actions, and plays queued phrases through
the scheduler. Server events: {"type": "started"} per config, binary audio frames,
{"type": "first_audio", "latency_ms"} per utterance (from the utterance's first text message to its
first audio), {"type": "done", "stats"} per flush, {"type": "cancelled"}, {"type": "error", "code",
"message", "status"} (a refusal under load adds "retry_after_ms"; a phrase sent again on the same
connection keeps the place in line of its refused attempt). Phrase i of a session uses seed + i, so a single-phrase utterance equals the HTTP
output. Every failure is an `error` event and the session stays usable; a stream the server cut at
its drain deadline ends its utterance with `error` code `truncated`, never `done`.

Idle timeout: the session is closed after `idle_timeout_s` with no client message AND no audio being
made or sent; a long utterance keeps the session alive however long it plays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from fastapi import WebSocket, WebSocketDisconnect

from tilevox.server.audio import StreamEncoder
from tilevox.server.errors import map_exception
from tilevox.server.logs import log_event
from tilevox.server.scheduler import OverloadedError
from tilevox.server.state import ServerState, bearer_token, request_id_of
from tilevox.server.ws_protocol import Cancel, Close, EndUtterance, Heard, SendEvent, Speak, WsLimits, WsSession

__all__ = ["serve_websocket"]

log = logging.getLogger("tilevox.ws")


class _Player:
    """Plays queued phrases in order into one encoder per utterance; owns everything sent after `started`."""

    def __init__(self, ws: WebSocket, state: ServerState, session: WsSession) -> None:
        self.ws = ws
        self.state = state
        self.session = session
        # the connection, for the scheduler: a phrase retried on it after a refusal keeps its place in line
        self.client = f"ws {ws.client.host}:{ws.client.port}" if ws.client else None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.phrase_idx = 0
        self.current = None  # the StreamHandle being played
        self.encoder: StreamEncoder | None = None
        self.utterance_started_at: float | None = None  # first text message of the utterance
        self.utt: dict = {}
        self.failed_generation: int | None = None  # an utterance that already reported its error
        self.last_activity = time.monotonic()
        self.busy = False

    async def send_event(self, event: dict) -> None:
        self.last_activity = time.monotonic()
        await self.ws.send_text(json.dumps(event))

    async def send_error(self, exc: BaseException) -> None:
        mapped = map_exception(exc, self.session.request_id)
        if mapped.unexpected:
            log_event(log, "ws.failed", level=logging.ERROR, exc_info=exc, request_id=self.session.request_id)
        else:
            log_event(
                log,
                "ws.error",
                level=logging.WARNING,
                request_id=self.session.request_id,
                code=mapped.code,
                error=mapped.message,
            )
        event = {"type": "error", "code": mapped.code, "message": mapped.message, "status": mapped.http_status}
        if isinstance(exc, OverloadedError):
            event["retry_after_ms"] = max(1, round(exc.retry_after_s * 1000))
        await self.send_event(event)

    def note_text(self) -> None:
        if self.utterance_started_at is None:
            self.utterance_started_at = time.perf_counter()

    def cancel(self) -> None:
        if self.current is not None:
            self.current.cancel()
        self.encoder = None
        self.utterance_started_at = None
        self.utt = {}

    async def run(self) -> None:
        while True:
            item = await self.queue.get()
            self.busy = True
            try:
                await self._play(item)
            except (WebSocketDisconnect, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is reported in-band; the session goes on
                self.failed_generation = item.generation
                self.encoder = None
                await self.send_error(exc)
            finally:
                self.busy = not self.queue.empty()
                self.last_activity = time.monotonic()

    async def _play(self, item: Speak | EndUtterance) -> None:
        if item.generation != self.session.generation or item.generation == self.failed_generation:
            if isinstance(item, EndUtterance) and item.generation == self.failed_generation:
                self.failed_generation = None
                self._reset_utterance()
            return
        if isinstance(item, EndUtterance):
            await self._end_utterance()
            return
        params = self.session.params
        if self.encoder is None:
            self.encoder = StreamEncoder(
                params.response_format, in_rate_hz=self.state.model.sample_rate_hz, out_rate_hz=params.sample_rate_hz
            )
            self.utt = {"phrases": 0, "num_frames": 0, "audio_s": 0.0, "first_audio_ms": None}
            if self.utterance_started_at is None:
                self.utterance_started_at = time.perf_counter()
        request = dataclasses.replace(
            params.request, text=item.text, seed=(params.request.seed + self.phrase_idx) % (2**63)
        )
        self.phrase_idx += 1
        handle = self.state.scheduler.submit(request, client=self.client)
        self.current = handle
        encoder = self.encoder
        try:
            async for samples in handle:
                if item.generation != self.session.generation:  # cancelled: send nothing more of this phrase
                    break
                data = encoder.encode(samples)
                if self.utt["first_audio_ms"] is None:
                    self.utt["first_audio_ms"] = round((time.perf_counter() - self.utterance_started_at) * 1e3, 2)
                    await self.send_event({"type": "first_audio", "latency_ms": self.utt["first_audio_ms"]})
                if data:
                    self.last_activity = time.monotonic()
                    await self.ws.send_bytes(data)
        finally:
            handle.cancel()
            self.current = None
        if handle.stats is not None and item.generation == self.session.generation:
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
        await self.send_event({"type": "done", "stats": stats})
        self._reset_utterance()

    def _reset_utterance(self) -> None:
        self.encoder = None
        self.utterance_started_at = None
        self.utt = {}


async def serve_websocket(ws: WebSocket, state: ServerState) -> None:
    request_id = request_id_of(ws.headers)
    if not state.check_api_key(bearer_token(ws.headers.get("authorization"))):
        await ws.close(code=1008, reason="missing or wrong API key")  # before accept: the client sees HTTP 403
        return
    await ws.accept()
    cfg = state.config
    limits = WsLimits(
        catalog=state.catalog,
        native_rate_hz=state.model.sample_rate_hz,
        max_text_chars=cfg.max_text_chars,
        max_message_bytes=cfg.max_message_bytes,
        default_max_duration_s=cfg.default_max_duration_s,
    )
    session = WsSession(limits, request_id=request_id, model_id=state.model.model_id)
    player = _Player(ws, state, session)
    player_task = asyncio.create_task(player.run())
    receive: asyncio.Task | None = None
    try:
        while True:
            if player_task.done():  # only a disconnect ends the player; surface it here
                player_task.result()
            receive = receive or asyncio.create_task(ws.receive())
            idle_for = time.monotonic() - player.last_activity
            wait_s = 1.0 if player.busy else max(0.0, cfg.idle_timeout_s - idle_for)
            done, _ = await asyncio.wait(
                {receive, player_task}, timeout=min(wait_s, 1.0), return_when=asyncio.FIRST_COMPLETED
            )
            if receive not in done:
                if not player.busy and time.monotonic() - player.last_activity >= cfg.idle_timeout_s:
                    await player.send_event(
                        {
                            "type": "error",
                            "code": "idle_timeout",
                            "status": 408,
                            "message": f"no message and no audio for {cfg.idle_timeout_s:g} s",
                        }
                    )
                    break
                continue
            frame, receive = receive.result(), None
            if frame["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(frame.get("code", 1000))
            player.last_activity = time.monotonic()
            should_close = False
            for action in session.receive(frame.get("text")):
                if isinstance(action, SendEvent):
                    await player.send_event(action.event)
                elif isinstance(action, Heard):
                    player.note_text()
                elif isinstance(action, Speak):
                    player.busy = True
                    player.queue.put_nowait(action)
                elif isinstance(action, EndUtterance):
                    player.busy = True
                    player.queue.put_nowait(action)
                elif isinstance(action, Cancel):
                    player.cancel()
                elif isinstance(action, Close):
                    should_close = True
            if should_close:
                break
        await ws.close(code=1000)
    except WebSocketDisconnect:
        log_event(log, "ws.disconnected", request_id=request_id)  # the client left; `finally` frees its stream at once
    finally:
        for task in (receive, player_task):
            if task is not None:
                task.cancel()
        if player.current is not None:
            player.current.cancel()
        state.metrics.requests_total.labels(api="ws", outcome="closed").inc()
        log_event(log, "ws.closed", request_id=request_id, phrases=player.phrase_idx)
