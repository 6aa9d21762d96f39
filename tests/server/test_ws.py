"""WebSocket surface with an unmodified `websockets` client: text streamed in pieces, flush,
cancel mid-stream, idle timeout, auth, and error events that leave the session usable."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import websockets
from websockets.asyncio.client import connect

from tests.server.conftest import API_KEY
from tests.server.fake_model import FakeSpeechModel
from tilevox.models.streaming import SynthesisRequest
from tilevox.server.audio import float_to_pcm16


def _url(server) -> str:
    return f"ws://127.0.0.1:{server.http_port}/v1/audio/speech/stream"


async def _until(ws, kind: str):
    """Receive until an event of `kind`; returns (audio bytes before it, the event, other events)."""
    audio, events = bytearray(), []
    while True:
        msg = await asyncio.wait_for(ws.recv(), timeout=10)
        if isinstance(msg, bytes):
            audio += msg
            continue
        event = json.loads(msg)
        if event["type"] == kind:
            return bytes(audio), event, events
        events.append(event)


def test_streamed_text_in_pieces_gives_phrases_in_order(fake_server, fake_model):
    pieces = ["Hel", "lo there, wor", "ld. Pi is 3.", "14 to", "day! B", "ye"]

    async def main():
        async with connect(_url(fake_server)) as ws:
            await ws.send(json.dumps({"type": "config", "voice": "alloy", "response_format": "pcm", "seed": 11}))
            started = json.loads(await ws.recv())
            assert started["type"] == "started" and started["sample_rate"] == 16000
            for p in pieces:
                await ws.send(json.dumps({"type": "text", "text": p}))
            await ws.send(json.dumps({"type": "flush"}))
            audio, done, events = await _until(ws, "done")
            await ws.send(json.dumps({"type": "close"}))
            return audio, done, events

    audio, done, events = asyncio.run(main())
    assert [e["type"] for e in events] == ["first_audio"]
    assert done["stats"]["phrases"] == 3
    phrases = ["Hello there, world.", "Pi is 3.14 today!", "Bye"]
    expected = np.concatenate(
        [
            float_to_pcm16(fake_model.expected(SynthesisRequest(text=p, seed=11 + i, voice="anna")))
            for i, p in enumerate(phrases)
        ]
    )
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), expected)


def test_cancel_mid_stream_stops_audio_and_session_continues(server_factory):
    model = FakeSpeechModel(step_delay_s=0.005)
    server = server_factory(model, max_streams=2, max_queued=0)

    async def main():
        async with connect(_url(server)) as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm", "max_duration_s": 100}))
            await _until(ws, "started")
            await ws.send(json.dumps({"type": "text", "text": "long " * 400}))
            await ws.send(json.dumps({"type": "flush"}))
            first = await asyncio.wait_for(ws.recv(), timeout=10)
            while not isinstance(first, bytes):
                first = await asyncio.wait_for(ws.recv(), timeout=10)
            await ws.send(json.dumps({"type": "cancel"}))
            await _until(ws, "cancelled")
            for _ in range(200):  # the slot is freed within a step or two
                if server.state.scheduler.num_active == 0:
                    break
                await asyncio.sleep(0.01)
            assert server.state.scheduler.num_active == 0 and model.open_stream_ids == ()
            # the same socket keeps working
            await ws.send(json.dumps({"type": "text", "text": "again"}))
            await ws.send(json.dumps({"type": "flush"}))
            audio, done, _ = await _until(ws, "done")
            return audio, done

    audio, done = asyncio.run(main())
    assert done["stats"]["phrases"] == 1 and len(audio) == 2 * 5 * 320
    assert len(model.step_log) < 2000


def test_error_events_keep_the_session_open(fake_server):
    async def main():
        async with connect(_url(fake_server)) as ws:
            await ws.send(json.dumps({"type": "text", "text": "too early"}))
            errors = [json.loads(await ws.recv())]
            await ws.send("{broken json")
            errors.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "config", "voice": "nobody"}))
            errors.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "config", "response_format": "aiff"}))
            errors.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "dance"}))
            errors.append(json.loads(await ws.recv()))
            await ws.send(b"\x00binary")
            errors.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "config", "response_format": "pcm"}))
            await _until(ws, "started")
            await ws.send(json.dumps({"type": "text", "text": "x" * 600}))
            errors.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "text", "text": "fine"}))
            await ws.send(json.dumps({"type": "flush"}))
            audio, _, _ = await _until(ws, "done")
            return errors, audio

    errors, audio = asyncio.run(main())
    assert all(e["type"] == "error" and e["status"] == 400 for e in errors), errors
    assert "voice" in errors[2]["message"] and "response_format" in errors[3]["message"]
    assert len(audio) > 0


def test_idle_timeout_closes(server_factory):
    server = server_factory(idle_timeout_s=0.3)

    async def main():
        async with connect(_url(server)) as ws:
            event = json.loads(await asyncio.wait_for(ws.recv(), timeout=5))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), timeout=5)
            return event

    assert asyncio.run(main())["code"] == "idle_timeout"


def test_api_key_header(keyed_server):
    async def main():
        with pytest.raises(websockets.InvalidStatus) as info:
            async with connect(_url(keyed_server)):
                pass
        assert info.value.response.status_code == 403
        async with connect(_url(keyed_server), additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
            await ws.send(json.dumps({"type": "config"}))
            return json.loads(await ws.recv())

    assert asyncio.run(main())["type"] == "started"


def test_oversized_message_is_an_error_event_and_the_session_goes_on(server_factory):
    server = server_factory(max_message_bytes=4096)

    async def main():
        async with connect(_url(server), max_size=None) as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm", "sample_rate": 16000}))
            await _until(ws, "started")
            await ws.send(json.dumps({"type": "text", "text": "x" * 10000}))
            too_large = json.loads(await asyncio.wait_for(ws.recv(), timeout=5))
            await ws.send(json.dumps({"type": "text", "text": "small"}))
            await ws.send(json.dumps({"type": "flush"}))
            audio, _, _ = await _until(ws, "done")
            # beyond 4x the limit uvicorn's frame limit closes the socket (documented): 1009
            await ws.send(json.dumps({"type": "text", "text": "y" * 20000}))
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), timeout=5)
        return too_large, audio, info.value.rcvd.code if info.value.rcvd else None

    too_large, audio, code = asyncio.run(main())
    assert too_large["type"] == "error" and too_large["code"] == "message_too_large" and too_large["status"] == 413
    assert len(audio) == 2 * 5 * 320 and code == 1009


def test_a_long_utterance_outlives_the_idle_timeout(server_factory):
    """Idle means no client message and no audio: a stream that plays longer than the timeout is not cut."""
    server = server_factory(FakeSpeechModel(step_delay_s=0.01), idle_timeout_s=0.5)

    async def main():
        async with connect(_url(server)) as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm", "sample_rate": 16000}))
            await _until(ws, "started")
            await ws.send(json.dumps({"type": "text", "text": "L" * 150}))  # 150 frames at 10 ms each: 1.5 s
            await ws.send(json.dumps({"type": "flush"}))
            audio, done, events = await _until(ws, "done")
            return audio, events

    audio, events = asyncio.run(main())
    assert len(audio) == 2 * 150 * 320 and all(e["type"] != "error" for e in events), events


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "text", "text": "a\ud800b"},  # a lone surrogate (JSON escape) never reaches the tokenizer
        {"type": "config", "response_format": "mp3", "sample_rate": 96000},  # an encoder that cannot open
    ],
)
def test_failures_are_error_events_and_the_session_stays_usable(fake_server, bad):
    async def main():
        async with connect(_url(fake_server)) as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm"}))
            await _until(ws, "started")
            await ws.send(json.dumps(bad))
            error = json.loads(await asyncio.wait_for(ws.recv(), timeout=5))
            await ws.send(json.dumps({"type": "text", "text": "after"}))
            await ws.send(json.dumps({"type": "flush"}))
            audio, _, _ = await _until(ws, "done")
            return error, audio

    error, audio = asyncio.run(main())
    assert error["type"] == "error" and error["status"] == 400 and len(audio) > 0


def test_a_stream_cut_at_shutdown_ends_with_truncated_not_done():
    from tests.server.conftest import make_server

    server = make_server(FakeSpeechModel(step_delay_s=0.02), drain_timeout_s=0.3, warmup=False)

    async def main():
        async with connect(_url(server)) as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm"}))
            await _until(ws, "started")
            await ws.send(json.dumps({"type": "text", "text": "t" * 400}))
            await ws.send(json.dumps({"type": "flush"}))
            await asyncio.sleep(0.3)
            await asyncio.to_thread(server.stop)
            events = []
            try:
                while True:
                    msg = await asyncio.wait_for(ws.recv(), timeout=10)
                    if isinstance(msg, str):
                        events.append(json.loads(msg))
            except websockets.ConnectionClosed:
                return events

    events = asyncio.run(main())
    assert [e["code"] for e in events if e["type"] == "error"] == ["truncated"], events
    assert all(e["type"] != "done" for e in events)


def test_first_audio_latency_counts_from_the_first_text(fake_server):
    """An utterance whose first phrase completes late still measures from its first text message."""

    async def main():
        async with connect(_url(fake_server)) as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm"}))
            await _until(ws, "started")
            await ws.send(json.dumps({"type": "text", "text": "No phrase end yet"}))
            await asyncio.sleep(0.4)
            await ws.send(json.dumps({"type": "text", "text": ". Then more "}))
            _, first, _ = await _until(ws, "first_audio")
            await ws.send(json.dumps({"type": "flush"}))
            await _until(ws, "done")
            return first

    assert asyncio.run(main())["latency_ms"] >= 400


def test_accepted_connections_have_tcp_nodelay(fake_server):
    """asyncio sets TCP_NODELAY only when the listening socket's proto is TCP: the server's is."""
    import socket

    from tilevox.server.app import _bind_port

    listener = _bind_port("127.0.0.1", 0)
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        assert accepted.proto == socket.IPPROTO_TCP
        loop = asyncio.new_event_loop()
        try:

            async def wrap():
                transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, accepted)
                value = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                transport.close()
                return value

            assert loop.run_until_complete(wrap()) != 0
        finally:
            loop.close()
    finally:
        client.close()
        listener.close()


def test_websocket_first_audio_is_no_later_than_http(fake_server):
    """Issue 19 item 6: with TCP_NODELAY the WebSocket's first audio frame is not held back behind the small
    `first_audio` event until the client's delayed ACK: median of 10, within 10 ms of HTTP's."""
    import statistics
    import time

    import httpx

    body = {"input": "Nagle. After.", "response_format": "pcm", "sample_rate": 16000}

    def http_once() -> float:
        started = time.perf_counter()
        with httpx.stream("POST", fake_server.http_url + "/v1/audio/speech", json=body) as r:
            next(r.iter_raw())
            return time.perf_counter() - started

    async def ws_times() -> list[float]:
        out = []
        async with connect(_url(fake_server)) as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm", "sample_rate": 16000}))
            await _until(ws, "started")
            for _ in range(10):
                started = time.perf_counter()
                await ws.send(json.dumps({"type": "text", "text": body["input"]}))
                await ws.send(json.dumps({"type": "flush"}))
                while not isinstance(await ws.recv(), bytes):
                    pass
                out.append(time.perf_counter() - started)
                await _until(ws, "done")
        return out

    http = statistics.median(http_once() for _ in range(10))
    ws = statistics.median(asyncio.run(ws_times()))
    assert ws <= http + 0.010, (round(ws * 1e3, 1), round(http * 1e3, 1))


def test_a_refused_phrase_says_when_to_retry_and_keeps_its_place_on_its_connection(server_factory):
    """Under load a phrase gets an error event with status 429 and retry_after_ms; sent again on the same
    connection it keeps the place of its refused attempt (queued beyond max_queued), while a phrase from
    another connection is still refused."""
    server = server_factory(FakeSpeechModel(step_delay_s=0.02), max_streams=1, max_queued=0, max_text_chars=500)

    async def utterance(ws, text: str) -> None:
        await ws.send(json.dumps({"type": "text", "text": text}))
        await ws.send(json.dumps({"type": "flush"}))

    async def main():
        async with connect(_url(server)) as a, connect(_url(server)) as b, connect(_url(server)) as c:
            for ws in (a, b, c):
                await ws.send(json.dumps({"type": "config", "response_format": "pcm"}))
                await _until(ws, "started")
            await utterance(a, "a" * 120)  # 120 frames at 20 ms: runs for seconds
            await _until(a, "first_audio")
            await utterance(b, "b" * 20)
            _, refused, _ = await _until(b, "error")
            await utterance(b, "b" * 20)  # again on the same connection: queued behind a
            await utterance(c, "c" * 20)  # a new connection: the place is b's, c is refused
            _, other, _ = await _until(c, "error")
            b_audio, _, b_events = await _until(b, "done")
            await _until(a, "done")  # read to the end: an unread session would hold its close handshake
            return refused, other, b_audio, b_events

    refused, other, b_audio, b_events = asyncio.run(main())
    assert refused["status"] == 429 and refused["retry_after_ms"] >= 1, refused
    assert other["status"] == 429, other
    assert len(b_audio) > 0 and not [e for e in b_events if e["type"] == "error"], b_events
