"""Sans-I/O parsing of speech requests shared by the HTTP and WebSocket surfaces.

`parse_speech_request(body, ...)` turns a decoded JSON object (the OpenAI /v1/audio/speech body
plus tilevox/vLLM-Omni extensions: seed, language, temperature, top_k, top_p, max_duration_s,
sample_rate) into a `SpeechParams`, raising `ApiError` with the HTTP status, OpenAI error type,
offending parameter and a message. No sockets, no model calls: tested with dicts in, errors out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest
from tilevox.server.audio import AudioFormat, check_rate, supported_rates
from tilevox.server.voices import VoiceCatalog

__all__ = [
    "MAX_JSON_DEPTH",
    "ApiError",
    "SpeechParams",
    "StreamFormat",
    "check_text",
    "loads_json",
    "parse_speech_request",
]

MULAW_RATE_HZ = 8000  # telephony
OPENAI_PCM_RATE_HZ = 24000  # OpenAI defines raw `pcm` as 24 kHz s16le mono; its clients play it at that rate
MAX_JSON_DEPTH = 32  # nesting of a request body or WebSocket message; deeper is refused before parsing


class ApiError(Exception):
    """A client error with everything an OpenAI-style error body needs."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _json_depth(raw: str | bytes) -> int:
    """Deepest bracket nesting of a JSON document, ignoring brackets inside strings (one linear scan)."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads_json(raw: str | bytes, *, what: str = "request body") -> object:
    """`json.loads` for client input: too deep nesting and malformed JSON/UTF-8 become ApiError 400
    (never a RecursionError or a 500)."""
    if _json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"{what} is not valid JSON: {exc}") from None


def check_text(text: str, *, param: str) -> str:
    """Text that will reach a tokenizer: refuse lone surrogates (not encodable as UTF-8) and NUL with a
    400 naming `param`, before any model code sees it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400, f"{param} contains an unpaired surrogate at position {exc.start}; send valid Unicode", param=param
        ) from None
    if "\x00" in text:
        raise ApiError(400, f"{param} contains a NUL character", param=param)
    return text


class StreamFormat:
    AUDIO = "audio"
    SSE = "sse"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechParams:
    request: SynthesisRequest
    response_format: AudioFormat
    sample_rate_hz: int  # output rate
    stream_format: str
    stream: bool = True  # False: the whole file at once, with exact length fields (WAV, FLAC)


_KNOWN_FIELDS = {
    "model",
    "input",
    "voice",
    "instructions",
    "response_format",
    "speed",
    "stream_format",
    "stream",
    "seed",
    "language",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "max_duration_s",
    "max_new_tokens",
    "sample_rate",
}


_SAMPLING_FIELDS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}


def _number(body: dict, name: str, kind: type, default):
    value = body.get(name, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name} must be finite", param=name)
    return kind(value)


def parse_speech_request(
    body: object,
    *,
    catalog: VoiceCatalog,
    native_rate_hz: int,
    max_text_chars: int,
    default_max_duration_s: float,
    default_format: AudioFormat = AudioFormat.MP3,
    default_pcm_rate_hz: int | None = None,
    require_input: bool = True,
) -> SpeechParams:
    """`default_pcm_rate_hz`: the rate of raw `pcm` when the request names none (the OpenAI surface
    passes OPENAI_PCM_RATE_HZ, since its clients assume it; None = the model's native rate)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if not catalog.is_served_model(model):
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {catalog.model_id!r}",
            param="model",
            code="model_not_found",
        )
    text = body.get("input", "placeholder" if not require_input else None)
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "input must be a non-empty string", param="input")
    check_text(text, param="input")
    if len(text) > max_text_chars:
        raise ApiError(
            400,
            f"input is {len(text)} characters; the limit is {max_text_chars}",
            param="input",
            code="string_above_max_length",
        )
    voice = body.get("voice")
    if isinstance(voice, dict):  # OpenAI's custom-voice object form {"id": ...}
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise ApiError(400, 'voice must be a string or {"id": string}', param="voice")
    try:
        model_voice = catalog.resolve_voice(voice)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="voice", code="voice_not_found") from exc
    fmt_name = body.get("response_format")  # only absent or null means the default: [] or "" are mistakes
    fmt_name = default_format.value if fmt_name is None else fmt_name
    try:
        if not isinstance(fmt_name, str):
            raise ValueError(fmt_name)
        fmt = AudioFormat(fmt_name)
    except ValueError:
        names = ", ".join(f.value for f in AudioFormat)
        raise ApiError(
            400, f"response_format {fmt_name!r} is not supported; choose one of {names}", param="response_format"
        ) from None
    stream_format = body.get("stream_format")
    stream_format = StreamFormat.AUDIO if stream_format is None else stream_format
    if stream_format not in (StreamFormat.AUDIO, StreamFormat.SSE):
        raise ApiError(400, f"stream_format must be 'audio' or 'sse', got {stream_format!r}", param="stream_format")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream")
    if not stream and stream_format == StreamFormat.SSE:
        raise ApiError(400, "stream_format 'sse' needs stream true", param="stream")
    speed = _number(body, "speed", float, 1.0)
    if not (0.25 <= speed <= 4.0):
        raise ApiError(400, f"speed must be in [0.25, 4.0], got {speed}", param="speed")
    if speed != 1.0:
        # SynthesisRequest has no speed field yet, so no model can honour it: refuse rather than ignore.
        raise ApiError(400, f"model {catalog.model_id!r} does not support speed other than 1.0", param="speed")
    sample_rate = _number(body, "sample_rate", int, None)
    if fmt in (AudioFormat.MULAW, AudioFormat.ALAW):
        if sample_rate not in (None, MULAW_RATE_HZ):
            raise ApiError(400, f"{fmt.value} is served at {MULAW_RATE_HZ} Hz only", param="sample_rate")
        sample_rate = MULAW_RATE_HZ
    elif sample_rate is None:  # a rate the client did not choose: the surface's default, else the model's,
        sample_rate = default_pcm_rate_hz if fmt is AudioFormat.PCM and default_pcm_rate_hz else native_rate_hz
        rates = supported_rates(fmt)  # moved up to the next rate the encoder takes
        if rates is not None and sample_rate not in rates:
            sample_rate = next((r for r in rates if r >= sample_rate), rates[-1])
    else:
        try:
            check_rate(fmt, sample_rate)
        except ValueError as exc:
            raise ApiError(400, f"sample_rate: {exc}", param="sample_rate") from None
    instructions = body.get("instructions")
    language = body.get("language")
    for name, value in (("instructions", instructions), ("language", language)):
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"{name} must be a string", param=name)
    try:
        # Sampling is "chosen" when the request names any of its fields (even with the default values);
        # otherwise None: the model's own defaults (Qwen3-TTS: its generation_config.json).
        chosen = {name: _number(body, name, kind, None) for name, kind in _SAMPLING_FIELDS.items()}
        chosen = {name: value for name, value in chosen.items() if value is not None}
        sampling = SamplingParams(**chosen) if chosen else None
        request = SynthesisRequest(
            text=text,
            voice=model_voice,
            language=language or None,
            instructions=instructions or None,
            sampling=sampling,
            seed=_number(body, "seed", int, 0),
            max_duration_s=_number(body, "max_duration_s", float, default_max_duration_s),
        )
    except ApiError:
        raise
    except ValueError as exc:  # SamplingParams / SynthesisRequest validation names its field first
        field = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), param=field if field in _KNOWN_FIELDS else None) from exc
    return SpeechParams(
        request=request, response_format=fmt, sample_rate_hz=sample_rate, stream_format=stream_format, stream=stream
    )
