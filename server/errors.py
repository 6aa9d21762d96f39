"""One table from server-side exceptions to each surface's error: HTTP status + OpenAI error
type/code, gRPC status code, and the WebSocket error event code.

    ApiError (server.protocol)   client mistake, carries its own HTTP status
    RequestError (models.errors) request the model cannot serve     -> 400 / INVALID_ARGUMENT
    OverloadedError              no slot and no queue place         -> 429 / RESOURCE_EXHAUSTED
    ShuttingDownError            draining after SIGTERM             -> 503 / UNAVAILABLE
    SynthesisFailed              the model raised                   -> 500 / INTERNAL
    StreamTruncated              cut before its end (drain deadline) -> 503 / ABORTED, code "truncated"
    anything else                a bug                              -> 500 / INTERNAL, code "internal_error"

Only the exceptions listed are the client's business; anything else (a plain ValueError raised by a bug
in model code included) is reported as an internal error that names the request id, and the surface
logs it with its traceback (`MappedError.unexpected`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tilevox.models.errors import RequestError
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
    unexpected: bool = False  # a bug: log the traceback; the client sees only the request id

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_GRPC_FOR_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
}


def map_exception(exc: BaseException, request_id: str | None = None) -> MappedError:
    """The surface-neutral description of `exc`; exceptions not listed above are bugs (`unexpected`)."""
    if isinstance(exc, ApiError):
        return MappedError(
            exc.status,
            _GRPC_FOR_HTTP.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT),
            exc.code or "invalid_request",
            exc.type,
            exc.message,
            exc.param,
        )
    if isinstance(exc, OverloadedError):
        return MappedError(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded", "rate_limit_exceeded", str(exc))
    if isinstance(exc, ShuttingDownError):
        return MappedError(503, grpc.StatusCode.UNAVAILABLE, "shutting_down", "server_error", str(exc))
    if isinstance(exc, StreamTruncated):
        return MappedError(503, grpc.StatusCode.ABORTED, "truncated", "server_error", str(exc))
    if isinstance(exc, SynthesisFailed):
        return MappedError(500, grpc.StatusCode.INTERNAL, "synthesis_failed", "server_error", str(exc))
    if isinstance(exc, RequestError):
        return MappedError(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request", "invalid_request_error", str(exc))
    where = f" (request {request_id})" if request_id else ""
    return MappedError(
        500,
        grpc.StatusCode.INTERNAL,
        "internal_error",
        "server_error",
        f"internal server error{where}: {type(exc).__name__}",
        unexpected=True,
    )
