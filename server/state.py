"""The runtime objects every front end shares: config, model facts, scheduler, metrics, auth.

Built once in server/app.py; front ends receive it explicitly (no module globals).
"""

from __future__ import annotations

import hmac
import itertools
import os
import re
from dataclasses import dataclass, field

from tilevox.models.streaming import SpeechModel
from tilevox.server.config import ServerConfig
from tilevox.server.metrics import ServerMetrics
from tilevox.server.scheduler import Scheduler
from tilevox.server.voices import VoiceCatalog

__all__ = ["ServerState", "bearer_token", "new_request_id", "request_id_of"]

_counter = itertools.count(1)
_PREFIX = os.urandom(3).hex()


def new_request_id() -> str:
    """Short, unique within the process, sortable by arrival."""
    return f"req-{_PREFIX}-{next(_counter):06d}"


_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(headers) -> str:
    """The client's x-request-id (HTTP header, WebSocket handshake header or gRPC metadata mapping) when
    it is 1-128 characters of [A-Za-z0-9._:-], else a fresh id: junk is never echoed or logged."""
    given = headers.get("x-request-id")
    return given if given is not None and _CLIENT_REQUEST_ID.fullmatch(given) else new_request_id()


@dataclass(slots=True, kw_only=True)
class ServerState:
    config: ServerConfig
    model: SpeechModel
    scheduler: Scheduler
    metrics: ServerMetrics
    catalog: VoiceCatalog
    is_ready: bool = False
    is_draining: bool = False
    extra: dict = field(default_factory=dict)

    def check_api_key(self, presented: str | None) -> bool:
        """True if no key is configured or `presented` equals it (constant-time compare)."""
        if self.config.api_key is None:
            return True
        return presented is not None and hmac.compare_digest(presented.encode(), self.config.api_key.encode())


def bearer_token(header_value: str | None) -> str | None:
    if not header_value:
        return None
    scheme, _, token = header_value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
