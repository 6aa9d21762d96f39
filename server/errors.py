"""One table from server-side exceptions to each surface's error: HTTP status + OpenAI error
type/code, gRPC status code, and the WebSocket error event code.

    ApiError (server.protocol)   client mistake, carries its own HTTP status
    ValueError                   request the model cannot serve     -> 400 / INVALID_ARGUMENT
    OverloadedError              no slot and no queue place         -> 429 / RESOURCE_EXHAUSTED
    ShuttingDownError            draining after SIGTERM             -> 503 / UNAVAILABLE
    SynthesisFailed              the model raised                   -> 500 / INTERNAL
    StreamTruncated              cut before its end (drain deadline) -> 503 / ABORTED, code "truncated"
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tilevox.server.protocol import ApiError
from tilevox.server.scheduler import OverloadedError, ShuttingDownError, StreamTruncated, SynthesisFailed

__all__ = ["MappedError", "map_exception"]


@dataclass(frozen=True, slots=True)
class MappedError:
    http_status: int
    grpc_code: grpc.StatusCode
    code: str  # OpenAI error code / WebSocket error event code
    type: str  # OpenAI error type
    message: str
    param: str | None = None

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_GRPC_FOR_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT}


def map_exception(exc: BaseException) -> MappedError | None:
    """The surface-neutral description of `exc`, or None for exceptions that are bugs."""
    if isinstance(exc, ApiError):
        return MappedError(exc.status, _GRPC_FOR_HTTP.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT), exc.code or "invalid_request", exc.type, exc.message, exc.param)
    if isinstance(exc, OverloadedError):
        return MappedError(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded", "rate_limit_exceeded", str(exc))
    if isinstance(exc, ShuttingDownError):
        return MappedError(503, grpc.StatusCode.UNAVAILABLE, "shutting_down", "server_error", str(exc))
    if isinstance(exc, StreamTruncated):
        return MappedError(503, grpc.StatusCode.ABORTED, "truncated", "server_error", str(exc))
    if isinstance(exc, SynthesisFailed):
        return MappedError(500, grpc.StatusCode.INTERNAL, "synthesis_failed", "server_error", str(exc))
    if isinstance(exc, ValueError):  # models.errors.RequestError and SynthesisRequest validation
        return MappedError(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request", "invalid_request_error", str(exc))
    return None
