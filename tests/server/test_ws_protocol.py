"""The WebSocket protocol state machine without sockets: messages in, actions out."""

from __future__ import annotations

import json

from tilevox.server.voices import VoiceCatalog
from tilevox.server.ws_protocol import Cancel, Close, EndUtterance, Heard, SendEvent, Speak, WsLimits, WsSession

LIMITS = WsLimits(
    catalog=VoiceCatalog(model_id="m", model_voices=("anna",), languages=("en",)),
    native_rate_hz=16000,
    max_text_chars=50,
    max_message_bytes=200,
    default_max_duration_s=10.0,
)


def _session() -> WsSession:
    return WsSession(LIMITS, request_id="r1", model_id="m")


def _msg(**fields) -> str:
    return json.dumps(fields)


def _errors(actions) -> list[dict]:
    return [a.event for a in actions if isinstance(a, SendEvent) and a.event["type"] == "error"]


def test_config_text_flush_close():
    s = _session()
    (started,) = s.receive(_msg(type="session.config", voice="alloy"))
    assert started.event == {"type": "started", "request_id": "r1", "model": "m", "format": "pcm", "sample_rate": 16000}
    assert s.receive(_msg(type="text", text="Hello there. Bye")) == [Heard(), Speak("Hello there.", 0)]
    assert s.receive(_msg(type="input.done")) == [Speak("Bye", 0), EndUtterance(0)]
    assert s.receive(_msg(type="close")) == [Close()]


def test_cancel_moves_to_a_new_generation_and_drops_buffered_text():
    s = _session()
    s.receive(_msg(type="config"))
    s.receive(_msg(type="text", text="half a sen"))
    assert s.receive(_msg(type="cancel")) == [Cancel(), SendEvent({"type": "cancelled"})]
    assert s.receive(_msg(type="flush")) == [EndUtterance(1)]


def test_every_mistake_is_one_error_event_and_the_session_goes_on():
    s = _session()
    assert _errors(s.receive(_msg(type="text", text="early")))[0]["status"] == 400
    assert _errors(s.receive("{nope"))[0]["message"].startswith("message is not valid JSON")
    assert _errors(s.receive("[" * 40 + "]" * 40))[0]["message"] == "message nests deeper than 32 levels"
    assert _errors(s.receive(None))[0]["message"].startswith("binary messages")
    assert _errors(s.receive("x" * 201)) == [
        {"type": "error", "code": "message_too_large", "message": "message exceeds 200 bytes", "status": 413}
    ]
    assert _errors(s.receive(_msg(type="config", input="no")))[0]["param"] == "input"
    s.receive(_msg(type="config"))
    assert _errors(s.receive(json.dumps({"type": "text", "text": "a\ud800b"})))[0]["param"] == "text"
    assert _errors(s.receive(_msg(type="text", text="y" * 51)))[0]["param"] == "text"
    assert _errors(s.receive(_msg(type="dance")))[0]["param"] == "type"
    assert s.receive(_msg(type="text", text="still fine. ")) == [Heard(), Speak("still fine.", 0)]
