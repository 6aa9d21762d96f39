"""OpenAI HTTP surface over the fake model, driven by the unmodified openai SDK and by httpx:
streaming bodies, SSE, listing routes, probes, metrics, auth, limits and every error path."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from tilevox.models.streaming import SynthesisRequest
from tests.server.conftest import API_KEY
from tests.server.fake_model import FakeSpeechModel


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2")


def _expected_pcm(model: FakeSpeechModel, text: str, seed: int = 0, voice: str | None = None) -> np.ndarray:
    from tilevox.server.audio import float_to_pcm16

    return float_to_pcm16(model.expected(SynthesisRequest(text=text, seed=seed, voice=voice)))


def test_openai_sdk_streaming_pcm_equals_model_output(fake_server, fake_model):
    client = openai.OpenAI(base_url=fake_server.http_url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="ash", input="stream me please", response_format="pcm", extra_body={"seed": 5}
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        pieces = list(response.iter_bytes(chunk_size=None))
    assert len(pieces) > 1  # it streamed
    np.testing.assert_array_equal(_pcm(b"".join(pieces)), _expected_pcm(fake_model, "stream me please", 5, "bert"))


def test_openai_sdk_sse(fake_server, fake_model):
    client = openai.OpenAI(base_url=fake_server.http_url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input="sse please", response_format="pcm", stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = [json.loads(block.split("data: ", 1)[1]) for block in text.strip().split("\n\n")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == len("sse please")
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    np.testing.assert_array_equal(_pcm(audio), _expected_pcm(fake_model, "sse please", 0, "anna"))


def test_wav_has_one_streaming_header(fake_server, fake_model):
    r = httpx.post(fake_server.http_url + "/v1/audio/speech", json={"input": "wave", "response_format": "wav"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert r.content[:4] == b"RIFF" and r.content[4:8] == b"\xff\xff\xff\xff" and r.content.count(b"RIFF") == 1
    np.testing.assert_array_equal(_pcm(r.content[44:]), _expected_pcm(fake_model, "wave"))


@pytest.mark.parametrize("fmt,ctype", [("mp3", "audio/mpeg"), ("opus", "audio/ogg"), ("flac", "audio/flac"), ("mulaw", "audio/basic")])
def test_other_formats(fake_server, fmt, ctype):
    r = httpx.post(fake_server.http_url + "/v1/audio/speech", json={"input": "formats " * 3, "response_format": fmt})
    assert r.status_code == 200 and r.headers["content-type"] == ctype and len(r.content) > 0
    if fmt == "mulaw":
        assert r.headers["x-sample-rate"] == "8000"
        n_model = len("formats " * 3) * 320  # frames * samples per frame at 16 kHz
        assert abs(len(r.content) - n_model // 2) <= 2  # one byte per 8 kHz sample


def test_listing_routes_and_probes(fake_server):
    base = fake_server.http_url
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert httpx.get(base + "/ready").json()["ready"] is True
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "fake-tts"
    voices = httpx.get(base + "/v1/audio/voices").json()["voices"]
    ids = {v["id"] for v in voices}
    assert {"anna", "bert", "alloy", "cedar"} <= ids
    metrics = httpx.get(base + "/metrics").text
    for name in ("tilevox_time_to_first_audio_seconds_bucket", "tilevox_active_streams", "tilevox_queue_depth",
                 "tilevox_frames_total", "tilevox_frames_per_second", "tilevox_request_real_time_factor_bucket"):
        assert name in metrics


def _metric(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


def test_metrics_count_what_was_served(server_factory):
    server = server_factory()
    before = httpx.get(server.http_url + "/metrics").text
    assert httpx.post(server.http_url + "/v1/audio/speech", json={"input": "count these frames", "response_format": "pcm"}).status_code == 200
    after = httpx.get(server.http_url + "/metrics").text
    assert _metric(after, "tilevox_frames_total") - _metric(before, "tilevox_frames_total") == len("count these frames")
    assert _metric(after, "tilevox_time_to_first_audio_seconds_count") - _metric(before, "tilevox_time_to_first_audio_seconds_count") == 1
    assert _metric(after, "tilevox_active_streams") == 0 and _metric(after, "tilevox_queue_depth") == 0
    assert _metric(after, "tilevox_audio_seconds_total") - _metric(before, "tilevox_audio_seconds_total") == pytest.approx(len("count these frames") / 50)


@pytest.mark.parametrize(
    "kwargs,status,code",
    [
        ({"content": b"{not json"}, 400, "invalid_request"),
        ({"json": {"input": ""}}, 400, "invalid_request"),
        ({"json": {"input": "x" * 501}}, 400, "string_above_max_length"),
        ({"json": {"input": "hi", "voice": "nobody"}}, 400, "voice_not_found"),
        ({"json": {"input": "hi", "model": "nope"}}, 404, "model_not_found"),
        ({"json": {"input": "hi", "response_format": "aac"}}, 400, "invalid_request"),
        ({"json": {"input": "hi", "sample_rate": 3}}, 400, "invalid_request"),
        ({"content": b"x" * (2 << 20)}, 413, "invalid_request"),
    ],
)
def test_errors_and_server_keeps_serving(fake_server, kwargs, status, code):
    r = httpx.post(fake_server.http_url + "/v1/audio/speech", headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    assert httpx.post(fake_server.http_url + "/v1/audio/speech", json={"input": "still here", "response_format": "pcm"}).status_code == 200


def test_openai_sdk_sees_errors_as_exceptions(fake_server):
    client = openai.OpenAI(base_url=fake_server.http_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts-1", voice="nobody", input="hi")
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="nope", voice="alloy", input="hi")


def test_api_key(keyed_server):
    url = keyed_server.http_url + "/v1/audio/speech"
    body = {"input": "secret", "response_format": "pcm"}
    assert httpx.post(url, json=body).status_code == 401
    r = httpx.post(url, json=body, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed_server.http_url + "/v1/models").status_code == 401
    assert httpx.get(keyed_server.http_url + "/health").status_code == 200  # probes stay open
    assert httpx.get(keyed_server.http_url + "/metrics").status_code == 200
    client = openai.OpenAI(base_url=keyed_server.http_url + "/v1", api_key=API_KEY)
    assert len(client.audio.speech.create(model="tts-1", voice="alloy", input="secret", response_format="pcm").content) > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.http_url + "/v1", api_key="bad", max_retries=0).audio.speech.create(model="tts-1", voice="alloy", input="x")


def _wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_twice_max_streams_gives_clean_429s_then_recovers(server_factory):
    server = server_factory(FakeSpeechModel(step_delay_s=0.01), max_streams=3, max_queued=1)
    url = server.http_url + "/v1/audio/speech"
    results: list[int] = []
    barrier = threading.Barrier(6)

    def one():
        barrier.wait()
        with httpx.stream("POST", url, json={"input": "z" * 60, "response_format": "pcm"}, timeout=30) as r:
            body = r.read()
            results.append(r.status_code)
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and json.loads(body)["error"]["code"] == "overloaded"

    threads = [threading.Thread(target=one) for _ in range(6)]  # 2 x max_streams
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200] * 4 + [429] * 2  # 3 running + 1 queued accepted, the rest refused
    assert _wait_for(lambda: server.state.scheduler.num_active == 0)
    assert httpx.post(url, json={"input": "after", "response_format": "pcm"}).status_code == 200


def test_disconnect_mid_stream_frees_the_slot(server_factory):
    model = FakeSpeechModel(step_delay_s=0.005)
    server = server_factory(model, max_streams=1, max_queued=0)
    url = server.http_url + "/v1/audio/speech"
    with httpx.stream("POST", url, json={"input": "q" * 3000, "response_format": "pcm", "max_duration_s": 120}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
        assert server.state.scheduler.num_active == 1
    # the client hung up after the first bytes: the stream must be cancelled and its slot freed
    assert _wait_for(lambda: server.state.scheduler.num_active == 0 and model.open_stream_ids == ())
    assert len(model.step_log) < 3000  # it did not run to completion
    assert httpx.post(url, json={"input": "next one", "response_format": "pcm"}).status_code == 200
