"""The WebSocket session's protocol as an I/O-free state machine: client messages in, actions out.

`WsSession.receive(raw)` parses one client text message and returns what the I/O shell (server/ws.py)
must do, in order: `SendEvent` (a JSON event to the client), `Heard` (text arrived: an utterance's
first-audio latency counts from its first one), `Speak` (queue a phrase for synthesis),
`EndUtterance` (the flush marker: finish the utterance's audio, then `done`), `Cancel` (drop queued
work and stop the audio now) and `Close`. No sockets, no model, no clock: tests feed strings and read
actions (tests/server/test_ws_protocol.py).

Client messages (JSON text frames; vLLM-Omni names accepted as aliases):
  {"type": "config", ...speech fields but "input"}   first message (session.config)
  {"type": "text", "text": "..."}                     (input.text) buffered into phrases
  {"type": "flush"}                                   (input.done) speak what is buffered, then "done"
  {"type": "cancel"}                                  (input.cancel) drop buffered text and stop the audio now
  {"type": "close"}                                   (session.close)
Every mistake becomes an `error` event and the session stays usable.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilevox.server.audio import AudioFormat
from tilevox.server.protocol import ApiError, SpeechParams, check_text, loads_json, parse_speech_request
from tilevox.server.text_buffer import PhraseBuffer
from tilevox.server.voices import VoiceCatalog

__all__ = ["Cancel", "Close", "EndUtterance", "Heard", "SendEvent", "Speak", "WsLimits", "WsSession"]

ALIASES = {
    "session.config": "config",
    "input.text": "text",
    "input.done": "flush",
    "input.cancel": "cancel",
    "session.close": "close",
}


@dataclass(frozen=True, slots=True)
class SendEvent:
    event: dict


@dataclass(frozen=True, slots=True)
class Heard:
    pass


@dataclass(frozen=True, slots=True)
class Speak:
    text: str
    generation: int  # a later cancel bumps the session's generation: older work is dropped


@dataclass(frozen=True, slots=True)
class EndUtterance:
    generation: int


@dataclass(frozen=True, slots=True)
class Cancel:
    pass


@dataclass(frozen=True, slots=True)
class Close:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class WsLimits:
    catalog: VoiceCatalog
    native_rate_hz: int
    max_text_chars: int
    max_message_bytes: int
    default_max_duration_s: float


def error_event(code: str, message: str, status: int, **fields) -> SendEvent:
    return SendEvent({"type": "error", "code": code, "message": message, "status": status, **fields})


class WsSession:
    """One WebSocket session's protocol state. `params` is set by the first valid config."""

    def __init__(self, limits: WsLimits, *, request_id: str, model_id: str) -> None:
        self.limits = limits
        self.request_id = request_id
        self.model_id = model_id
        self.params: SpeechParams | None = None
        self.buffer = PhraseBuffer()
        self.generation = 0

    def receive(self, raw: str | bytes | None) -> list:
        """Actions for one client message (`raw` None: a binary frame)."""
        if raw is None:
            return [self._error(ApiError(400, "binary messages are not accepted; send JSON text messages"))]
        size = len(raw.encode("utf-8", errors="surrogatepass")) if isinstance(raw, str) else len(raw)
        if size > self.limits.max_message_bytes:
            return [error_event("message_too_large", f"message exceeds {self.limits.max_message_bytes} bytes", 413)]
        try:
            msg = loads_json(raw, what="message")
            if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                raise ApiError(400, "each message must be a JSON object with a string 'type'")
            return self._dispatch(ALIASES.get(msg["type"], msg["type"]), msg)
        except ApiError as exc:
            return [self._error(exc)]

    def _dispatch(self, kind: str, msg: dict) -> list:
        if kind == "config":
            body = {k: v for k, v in msg.items() if k != "type"}
            if "input" in body:
                raise ApiError(400, "config must not carry input; send it in text messages", param="input")
            self.params = parse_speech_request(
                body,
                catalog=self.limits.catalog,
                native_rate_hz=self.limits.native_rate_hz,
                max_text_chars=self.limits.max_text_chars,
                default_max_duration_s=self.limits.default_max_duration_s,
                default_format=AudioFormat.PCM,
                require_input=False,
            )
            return [
                SendEvent(
                    {
                        "type": "started",
                        "request_id": self.request_id,
                        "model": self.model_id,
                        "format": self.params.response_format.value,
                        "sample_rate": self.params.sample_rate_hz,
                    }
                )
            ]
        if self.params is None:
            raise ApiError(400, 'the first message must be {"type": "config", ...}')
        if kind == "text":
            text = msg.get("text")
            if not isinstance(text, str):
                raise ApiError(400, "text must be a string", param="text")
            check_text(text, param="text")
            if len(self.buffer.pending) + len(text) > self.limits.max_text_chars:
                raise ApiError(
                    400, f"buffered text exceeds {self.limits.max_text_chars} characters; send flush", param="text"
                )
            return [Heard(), *(Speak(phrase, self.generation) for phrase in self.buffer.push(text))]
        if kind == "flush":
            tail = self.buffer.flush()
            return [*([Speak(tail, self.generation)] if tail else []), EndUtterance(self.generation)]
        if kind == "cancel":
            self.generation += 1
            self.buffer.flush()
            return [Cancel(), SendEvent({"type": "cancelled"})]
        if kind == "close":
            return [Close()]
        raise ApiError(400, f"unknown message type {msg['type']!r}", param="type")

    def _error(self, exc: ApiError) -> SendEvent:
        return error_event(
            exc.code or "invalid_request", exc.message, exc.status, **({"param": exc.param} if exc.param else {})
        )
