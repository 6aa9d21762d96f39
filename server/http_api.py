"""OpenAI-compatible HTTP surface (FastAPI): POST /v1/audio/speech streams audio as frames are
produced (raw bytes of the response_format, or SSE `speech.audio.delta`/`speech.audio.done`),
plus GET /v1/models, /v1/audio/voices, /health, /ready and /metrics.

Synthesis routes need `Authorization: Bearer <key>` when a key is configured; probes and
/metrics never do. Client disconnect cancels the stream (Starlette cancels the body iterator).

A stream that ends early never looks finished: with `stream_format: "sse"` it ends with a
`speech.audio.error` event (code `truncated` when the server cut it at its drain deadline); a raw audio
body is aborted (the connection closes without the chunked terminator, so clients report an incomplete
body). `"stream": false` returns the whole file at once with a Content-Length and exact WAV/FLAC headers.
A client's `x-request-id` is used when it is 1-128 characters of [A-Za-z0-9._:-], else a fresh id.
A 429 carries `retry-after` (and `retry-after-ms`) and, usually, `x-tilevox-ticket`: sent back on the retry, it keeps the
client's place in line (server/scheduler.py, fair admission); a retry on the same kept-alive connection keeps it
without the header.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tilevox.server.audio import StreamEncoder, encode_all
from tilevox.server.errors import MappedError, map_exception
from tilevox.server.logs import log_event
from tilevox.server.protocol import OPENAI_PCM_RATE_HZ, ApiError, StreamFormat, loads_json, parse_speech_request
from tilevox.server.scheduler import OverloadedError, StreamHandle
from tilevox.server.state import ServerState, bearer_token, request_id_of

__all__ = ["build_http_app"]

log = logging.getLogger("tilevox.http")


def _log_mapped(mapped: MappedError, exc: BaseException, request_id: str, event: str) -> None:
    if mapped.unexpected:
        log_event(log, event, level=logging.ERROR, exc_info=exc, request_id=request_id, status=500)
    else:
        log_event(
            log, event, level=logging.WARNING, request_id=request_id, status=mapped.http_status, error=mapped.message
        )


def _connection(request: Request) -> str | None:
    """The connection a request came on (peer address and port): a retry on it keeps the place its last
    refusal was given, for clients that honour Retry-After but do not echo x-tilevox-ticket."""
    return f"http {request.client.host}:{request.client.port}" if request.client else None


def _error_response(exc: BaseException, request_id: str) -> JSONResponse:
    mapped = map_exception(exc, request_id)
    headers = {"x-request-id": request_id}
    if isinstance(exc, OverloadedError):
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s)))  # whole seconds, per RFC 9110
        headers["retry-after-ms"] = str(max(1, round(exc.retry_after_s * 1000)))  # what OpenAI's SDKs read first
        if exc.ticket:
            headers["x-tilevox-ticket"] = exc.ticket
    return JSONResponse(mapped.openai_body(), status_code=mapped.http_status, headers=headers)


def build_http_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tilevox", docs_url=None, redoc_url=None, openapi_url=None)
    cfg = state.config

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        is_ready = state.is_ready and not state.is_draining and state.scheduler.worker_error is None
        body = {
            "ready": is_ready,
            "model": state.model.model_id,
            "max_streams": cfg.max_streams,
            "max_queued": cfg.max_queued,
        }
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def _auth(request: Request) -> None:
        if not state.check_api_key(bearer_token(request.headers.get("authorization"))):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    def _rejected(exc: BaseException, request_id: str) -> JSONResponse:
        response = _error_response(exc, request_id)
        _log_mapped(map_exception(exc, request_id), exc, request_id, "speech.rejected")
        state.metrics.requests_total.labels(api="http", outcome=f"rejected_{response.status_code}").inc()
        return response

    async def _read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_message_bytes:
            raise ApiError(413, f"request body exceeds {cfg.max_message_bytes} bytes")
        parts, size = [], 0
        async for part in request.stream():  # bounded even without a content-length
            size += len(part)
            if size > cfg.max_message_bytes:
                raise ApiError(413, f"request body exceeds {cfg.max_message_bytes} bytes")
            parts.append(part)
        return b"".join(parts)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        request_id = request_id_of(request.headers)
        try:
            _auth(request)
        except ApiError as exc:
            return _error_response(exc, request_id)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": state.model.model_id, "object": "model", "owned_by": "tilevox", "created": 0}],
            }
        )

    @app.get("/v1/audio/voices")
    async def voices(request: Request) -> JSONResponse:
        request_id = request_id_of(request.headers)
        try:
            _auth(request)
        except ApiError as exc:
            return _error_response(exc, request_id)
        return JSONResponse({"voices": state.catalog.listed(), "languages": list(state.catalog.languages)})

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        request_id = request_id_of(request.headers)
        try:
            _auth(request)
            try:  # a body shorter than its Content-Length must not hold the connection for ever
                raw = await asyncio.wait_for(_read_body(request), timeout=cfg.idle_timeout_s)
            except TimeoutError:
                raise ApiError(
                    408, f"request body not received within {cfg.idle_timeout_s:g} s", code="request_timeout"
                ) from None
            params = parse_speech_request(
                loads_json(raw),
                catalog=state.catalog,
                native_rate_hz=state.model.sample_rate_hz,
                max_text_chars=cfg.max_text_chars,
                default_max_duration_s=cfg.default_max_duration_s,
                default_pcm_rate_hz=OPENAI_PCM_RATE_HZ,
            )
            encoder = StreamEncoder(
                params.response_format, in_rate_hz=state.model.sample_rate_hz, out_rate_hz=params.sample_rate_hz
            )
            handle = state.scheduler.submit(
                params.request, ticket=request.headers.get("x-tilevox-ticket"), client=_connection(request)
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes a 4xx/5xx JSON body naming the request id
            return _rejected(exc, request_id)
        log_event(
            log,
            "speech.accepted",
            request_id=request_id,
            chars=len(params.request.text),
            format=params.response_format.value,
            stream_format=params.stream_format,
        )
        headers = {"x-request-id": request_id, "x-sample-rate": str(params.sample_rate_hz), "cache-control": "no-store"}
        if not params.stream:
            return await _whole_file(handle, params, request_id, headers)
        is_sse = params.stream_format == StreamFormat.SSE
        body_iter = (
            _sse_body(handle, encoder, params.response_format.value, request_id)
            if is_sse
            else _audio_body(handle, encoder, request_id)
        )
        media_type = "text/event-stream" if is_sse else params.response_format.content_type
        return StreamingResponse(body_iter, media_type=media_type, headers=headers)

    async def _whole_file(handle: StreamHandle, params, request_id: str, headers: dict) -> Response:
        try:
            samples = await handle.collect()
            data = encode_all(
                params.response_format,
                samples,
                in_rate_hz=state.model.sample_rate_hz,
                out_rate_hz=params.sample_rate_hz,
            )
        except Exception as exc:  # noqa: BLE001 - nothing was sent yet: a plain error response
            _finished(handle, request_id)
            mapped = map_exception(exc, request_id)
            _log_mapped(mapped, exc, request_id, "speech.failed")
            return JSONResponse(
                mapped.openai_body(), status_code=mapped.http_status, headers={"x-request-id": request_id}
            )
        _finished(handle, request_id)
        return Response(data, media_type=params.response_format.content_type, headers=headers)

    async def _audio_body(handle: StreamHandle, encoder: StreamEncoder, request_id: str):
        try:
            async for samples in handle:
                data = encoder.encode(samples)
                if data:
                    yield data
            tail = encoder.finish()
            if tail:
                yield tail
        except Exception as exc:
            # Headers are sent: the only honest signal left is to abort the body (no chunked terminator).
            _log_mapped(map_exception(exc, request_id), exc, request_id, "speech.aborted")
            raise
        finally:
            _finished(handle, request_id)

    async def _sse_body(handle: StreamHandle, encoder: StreamEncoder, fmt: str, request_id: str):
        def event(name: str, payload: dict) -> bytes:
            return f"event: {name}\ndata: {json.dumps({'type': name, **payload})}\n\n".encode()

        try:
            try:
                async for samples in handle:
                    data = encoder.encode(samples)
                    if data:
                        yield event(
                            "speech.audio.delta", {"audio": base64.b64encode(data).decode(), "response_format": fmt}
                        )
                tail = encoder.finish()
                if tail:
                    yield event(
                        "speech.audio.delta", {"audio": base64.b64encode(tail).decode(), "response_format": fmt}
                    )
            except Exception as exc:  # noqa: BLE001 - reported in-band: the stream ends with an error event
                mapped = map_exception(exc, request_id)
                _log_mapped(mapped, exc, request_id, "speech.aborted")
                yield event("speech.audio.error", mapped.openai_body())
                return
            frames = handle.stats.num_frames if handle.stats else 0
            usage = {
                "input_tokens": len(handle.request.text),
                "output_tokens": frames,
                "total_tokens": len(handle.request.text) + frames,
            }
            yield event("speech.audio.done", {"usage": usage})
        finally:
            _finished(handle, request_id)

    def _finished(handle: StreamHandle, request_id: str) -> None:
        handle.cancel()  # no-op when it already finished; frees the slot on disconnect
        stats = handle.stats.as_dict() if handle.stats else None
        outcome = stats["finish_reason"] if stats else "aborted"
        state.metrics.requests_total.labels(api="http", outcome=outcome).inc()
        log_event(log, "speech.finished", request_id=request_id, stats=stats, at=time.time())

    return app
