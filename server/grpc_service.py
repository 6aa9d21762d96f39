"""Riva-compatible gRPC surface: `nvidia.riva.tts.RivaSpeechSynthesis` on tilevox's own Riva
stubs (`tilevox.server.riva_proto`, generated from Riva's .proto files; no nvidia-riva-client needed):
Synthesize, bidirectional SynthesizeOnline, GetRivaSynthesisConfig, plus the standard grpc.health.v1 service.

LINEAR_PCM is raw s16le at the requested rate (0 = the model's), resampled with soxr; OGGOPUS,
FLAC, MULAW and ALAW are also served. Voices are listed as `Tilevox.<LANG>` with subvoices, and
accepted as full (`Tilevox.EN-US.anna`), bare (`anna`), OpenAI alias or NVIDIA catalog names
(`Magpie-Multilingual.EN-US.Aria`); a name that matches nothing is served by the default voice with one
warning per name, unless `strict_voices`. custom_configuration carries seed, max_duration_s, temperature,
top_k, top_p and instructions. With an API key, Synthesize and SynthesizeOnline need metadata
`authorization: Bearer <key>` (or `api-key: <key>`); GetRivaSynthesisConfig does not (it lists voices and
rates only, and Riva's own client sends no metadata on it). A stream the server cut at its drain
deadline ends with ABORTED, never OK. `x-request-id` metadata names the request in the logs; on
RESOURCE_EXHAUSTED the trailing metadata carries `retry-after-ms` and `x-tilevox-ticket`, which a retry
sends back as metadata to keep its place in line; a retry on the same channel keeps it without the ticket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from tilevox.models.errors import RequestError
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest
from tilevox.server.audio import MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ, AudioFormat, StreamEncoder
from tilevox.server.errors import map_exception
from tilevox.server.logs import log_event
from tilevox.server.protocol import ApiError, check_text
from tilevox.server.riva_proto import riva_audio_pb2, riva_tts_pb2, riva_tts_pb2_grpc
from tilevox.server.scheduler import OverloadedError
from tilevox.server.state import ServerState, bearer_token, request_id_of

__all__ = ["RivaSynthesisService", "add_to_server", "riva_language_code", "riva_voice_prefix"]

log = logging.getLogger("tilevox.grpc")

_ENCODINGS = {
    riva_audio_pb2.ENCODING_UNSPECIFIED: AudioFormat.PCM,
    riva_audio_pb2.LINEAR_PCM: AudioFormat.PCM,
    riva_audio_pb2.FLAC: AudioFormat.FLAC,
    riva_audio_pb2.MULAW: AudioFormat.MULAW,
    riva_audio_pb2.OGGOPUS: AudioFormat.OPUS,
    riva_audio_pb2.ALAW: AudioFormat.ALAW,
}
# BCP-47 primary subtag -> language names that some models list instead of codes
_LANGUAGE_NAMES = {
    "en": "english",
    "zh": "chinese",
    "ja": "japanese",
    "ko": "korean",
    "de": "german",
    "fr": "french",
    "es": "spanish",
    "it": "italian",
    "pt": "portuguese",
    "ru": "russian",
}
_CUSTOM_KEYS = {
    "seed": int,
    "max_duration_s": float,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "instructions": str,
}


def riva_language_code(state: ServerState) -> str:
    """The BCP-47 code listed in GetRivaSynthesisConfig: en-US when the model speaks English
    (Riva clients default to it), else the model's first language as a code where one is known."""
    langs = [lang.lower() for lang in state.catalog.languages]
    if not langs or any(lang in ("en", "en-us", "english") for lang in langs):
        return "en-US"
    codes = {name: code for code, name in _LANGUAGE_NAMES.items()}
    return codes.get(langs[0], langs[0])


def riva_voice_prefix(state: ServerState) -> str:
    return f"Tilevox.{riva_language_code(state).upper()}"


class RivaSynthesisService(riva_tts_pb2_grpc.RivaSpeechSynthesisServicer):
    def __init__(self, state: ServerState):
        self.state = state

    # ---- helpers ---------------------------------------------------------------------
    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException, request_id: str):
        mapped = map_exception(exc, request_id)
        log_event(
            log,
            "grpc.rejected",
            level=logging.ERROR if mapped.unexpected else logging.WARNING,
            request_id=request_id,
            code=mapped.grpc_code.name,
            error=mapped.message,
            exc_info=exc if mapped.unexpected else None,
        )
        if isinstance(exc, OverloadedError):
            context.set_trailing_metadata(
                (
                    ("retry-after-ms", str(max(1, round(exc.retry_after_s * 1000)))),
                    *((("x-tilevox-ticket", exc.ticket),) if exc.ticket else ()),
                )
            )
        self.state.metrics.requests_total.labels(api="grpc", outcome=f"rejected_{mapped.http_status}").inc()
        await context.abort(mapped.grpc_code, mapped.message)

    @staticmethod
    def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
        return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        md = self._metadata(context)
        presented = bearer_token(md.get("authorization")) or md.get("api-key")
        if not self.state.check_api_key(presented):
            raise ApiError(
                401, "missing or wrong API key (metadata authorization: Bearer <key>)", code="invalid_api_key"
            )

    def _voice(self, name: str) -> str | None:
        prefix = riva_voice_prefix(self.state)
        if name in ("", prefix):
            return None
        if name.startswith(prefix + "."):
            name = name[len(prefix) + 1 :]
        try:
            return self.state.catalog.resolve_voice(name, lenient=not self.state.config.strict_voices)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="voice_name") from exc

    def _language(self, code: str) -> str | None:
        """BCP-47 code -> one of the model's languages (exact or primary subtag), else automatic."""
        code = code.lower()
        primary = code.split("-")[0]
        for lang in self.state.catalog.languages:
            if lang.lower() in (code, primary, _LANGUAGE_NAMES.get(primary)):
                return lang
        return None

    def _parse(self, req: riva_tts_pb2.SynthesizeSpeechRequest) -> tuple[SynthesisRequest, StreamEncoder]:
        cfg = self.state.config
        if not req.text.strip():
            raise ApiError(400, "text must be non-empty", param="text")
        check_text(req.text, param="text")
        if len(req.text) > cfg.max_text_chars:
            raise ApiError(400, f"text is {len(req.text)} characters; the limit is {cfg.max_text_chars}", param="text")
        if req.encoding not in _ENCODINGS:
            raise ApiError(400, f"encoding {req.encoding} is not supported", param="encoding")
        if req.HasField("zero_shot_data") and req.zero_shot_data.audio_prompt:
            raise ApiError(400, "zero-shot voice prompts are not supported by this server yet", param="zero_shot_data")
        rate = req.sample_rate_hz or self.state.model.sample_rate_hz
        if not (MIN_SAMPLE_RATE_HZ <= rate <= MAX_SAMPLE_RATE_HZ):
            raise ApiError(
                400,
                f"sample_rate_hz must be 0 or in [{MIN_SAMPLE_RATE_HZ}, {MAX_SAMPLE_RATE_HZ}], got {rate}",
                param="sample_rate_hz",
            )
        custom = dict(req.custom_configuration)
        unknown = sorted(set(custom) - set(_CUSTOM_KEYS))
        if unknown:
            raise ApiError(
                400,
                f"unknown custom_configuration key(s) {unknown}; known: {sorted(_CUSTOM_KEYS)}",
                param="custom_configuration",
            )
        values = {}
        for key, raw in custom.items():
            try:
                values[key] = _CUSTOM_KEYS[key](raw)
            except ValueError:
                kind = {int: "an integer", float: "a number", str: "a string"}[_CUSTOM_KEYS[key]]
                raise ApiError(
                    400,
                    f"custom_configuration {key!r} must be {kind}, got {raw!r}",
                    param=f"custom_configuration.{key}",
                ) from None
        try:
            chosen = {k: values[k] for k in ("temperature", "top_k", "top_p") if k in values}
            sampling = SamplingParams(**chosen) if chosen else None  # None: the model's own defaults
            request = SynthesisRequest(
                text=req.text,
                voice=self._voice(req.voice_name),
                language=self._language(req.language_code) if req.language_code else None,
                instructions=values.get("instructions") or None,
                sampling=sampling,
                seed=values.get("seed", 0),
                max_duration_s=values.get("max_duration_s", cfg.default_max_duration_s),
            )
            if request.language is not None:
                # Riva clients always send a language_code (default en-US), so it is advisory: a
                # model that picks the language from the text itself (Llasa) gets none.
                try:
                    self.state.model.validate(request)
                except ValueError:
                    request = dataclasses.replace(request, language=None)
            encoder = StreamEncoder(
                _ENCODINGS[req.encoding], in_rate_hz=self.state.model.sample_rate_hz, out_rate_hz=rate
            )
        except ApiError:
            raise
        except RequestError as exc:  # anything else is a bug: INTERNAL, logged with its traceback
            raise ApiError(400, str(exc)) from exc
        return request, encoder

    # ---- RPCs --------------------------------------------------------------------------
    async def Synthesize(self, request, context):
        request_id = request_id_of(self._metadata(context))
        try:
            self._check_auth(context)
            synth_request, encoder = self._parse(request)
            handle = self.state.scheduler.submit(
                synth_request, ticket=self._metadata(context).get("x-tilevox-ticket"), client=context.peer()
            )
        except Exception as exc:  # noqa: BLE001 - mapped to a status; unmapped re-raise
            await self._abort(context, exc, request_id)
        try:
            parts = [encoder.encode(samples) async for samples in handle]
            parts.append(encoder.finish())
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc, request_id)
        finally:
            handle.cancel()  # client cancellation (CancelledError) lands here too
        self.state.metrics.requests_total.labels(api="grpc", outcome=handle.stats.finish_reason.value).inc()
        log_event(log, "grpc.synthesize.finished", request_id=request_id, stats=handle.stats.as_dict())
        return riva_tts_pb2.SynthesizeSpeechResponse(
            audio=b"".join(parts), meta=riva_tts_pb2.SynthesizeSpeechResponseMetadata(text=request.text), id=request.id
        )

    async def SynthesizeOnline(self, request_iterator, context):
        request_id = request_id_of(self._metadata(context))
        try:
            self._check_auth(context)
        except ApiError as exc:
            await self._abort(context, exc, request_id)
        iterator = request_iterator.__aiter__()
        while True:
            try:
                request = await asyncio.wait_for(iterator.__anext__(), timeout=self.state.config.idle_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no request for {self.state.config.idle_timeout_s} s"
                )
            try:
                synth_request, encoder = self._parse(request)
                handle = self.state.scheduler.submit(
                    synth_request, ticket=self._metadata(context).get("x-tilevox-ticket"), client=context.peer()
                )
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, exc, request_id)
            try:
                async for samples in handle:
                    data = encoder.encode(samples)
                    if data:
                        yield riva_tts_pb2.SynthesizeSpeechResponse(audio=data, id=request.id)
                tail = encoder.finish()
                if tail:
                    yield riva_tts_pb2.SynthesizeSpeechResponse(audio=tail, id=request.id)
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, exc, request_id)
            finally:
                handle.cancel()
            self.state.metrics.requests_total.labels(api="grpc", outcome=handle.stats.finish_reason.value).inc()
            log_event(log, "grpc.online.finished", request_id=request_id, stats=handle.stats.as_dict())

    async def GetRivaSynthesisConfig(self, request, context):
        # No key needed: it lists voices and rates only, like the health probes, and Riva's client (with
        # the frameworks built on it) calls it without metadata; synthesis calls still need the key.
        catalog = self.state.catalog
        voices = catalog.model_voices or ("default",)
        model_name = f"tilevox-{self.state.model.model_id}"
        if request.model_name and request.model_name != model_name:
            return riva_tts_pb2.RivaSynthesisConfigResponse()
        config = riva_tts_pb2.RivaSynthesisConfigResponse.Config(model_name=model_name)
        config.parameters["language_code"] = riva_language_code(self.state)
        config.parameters["voice_name"] = riva_voice_prefix(self.state)
        config.parameters["subvoices"] = ",".join(f"{v}:{i}" for i, v in enumerate(voices))
        config.parameters["sample_rate_hz"] = str(self.state.model.sample_rate_hz)
        return riva_tts_pb2.RivaSynthesisConfigResponse(model_config=[config])


def add_to_server(server: grpc.aio.Server, state: ServerState):
    """Register the Riva service and grpc.health.v1; returns the health servicer."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    riva_tts_pb2_grpc.add_RivaSpeechSynthesisServicer_to_server(RivaSynthesisService(state), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer, health_pb2
