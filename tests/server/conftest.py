"""Fixtures: real servers on 127.0.0.1 free ports, over the FakeSpeechModel or the tiny model."""

from __future__ import annotations

import socket

import pytest

from tests.server.fake_model import FakeSpeechModel
from tilevox.server.app import ServerHandle
from tilevox.server.config import ServerConfig

API_KEY = "test-key-123"


def free_port() -> int:
    """A loopback port that was free a moment ago (for servers started as subprocesses)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_server(model, **overrides) -> ServerHandle:
    kw = {
        "host": "127.0.0.1",
        "http_port": 0,
        "grpc_port": 0,
        "max_streams": 4,
        "max_queued": 4,
        "idle_timeout_s": 5.0,
        "drain_timeout_s": 5.0,
    }
    kw.update(overrides)
    return ServerHandle(ServerConfig(**kw), model).start()


@pytest.fixture(scope="module")
def fake_model():
    return FakeSpeechModel()


@pytest.fixture(scope="module")
def fake_server(fake_model):
    """Open server (no API key) over the fake model; module-scoped to keep tests fast."""
    server = make_server(fake_model, max_text_chars=500)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server():
    server = make_server(FakeSpeechModel(), api_key=API_KEY)
    yield server
    server.stop()


@pytest.fixture
def server_factory():
    made = []

    def factory(model=None, **overrides):
        server = make_server(model or FakeSpeechModel(), **overrides)
        made.append(server)
        return server

    yield factory
    for server in made:
        server.stop()
