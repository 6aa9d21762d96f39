"""OpenAI HTTP surface over the fake model, driven by the unmodified openai SDK and by httpx:
streaming bodies, SSE, listing routes, probes, metrics, auth, limits and every error path."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile

from tests.server.conftest import API_KEY
from tests.server.fake_model import FakeSpeechModel
from tilevox.models.streaming import SynthesisRequest


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2")


def _expected_pcm(model: FakeSpeechModel, text: str, seed: int = 0, voice: str | None = None) -> np.ndarray:
    from tilevox.server.audio import float_to_pcm16

    return float_to_pcm16(model.expected(SynthesisRequest(text=text, seed=seed, voice=voice)))


def test_openai_sdk_streaming_pcm_equals_model_output(fake_server, fake_model):
    client = openai.OpenAI(base_url=fake_server.http_url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="ash",
        input="stream me please",
        response_format="pcm",
        extra_body={"seed": 5, "sample_rate": 16000},
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        pieces = list(response.iter_bytes(chunk_size=None))
    assert len(pieces) > 1  # it streamed
    np.testing.assert_array_equal(_pcm(b"".join(pieces)), _expected_pcm(fake_model, "stream me please", 5, "bert"))


def test_openai_sdk_sse(fake_server, fake_model):
    client = openai.OpenAI(base_url=fake_server.http_url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts",
        voice="alloy",
        input="sse please",
        response_format="pcm",
        stream_format="sse",
        extra_body={"sample_rate": 16000},  # the model's own rate: bit-exact (without it, pcm is 24 kHz)
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


@pytest.mark.parametrize(
    "fmt,ctype",
    [
        ("mp3", "audio/mpeg"),
        ("opus", "audio/ogg"),
        ("flac", "audio/flac"),
        ("aac", "audio/aac"),
        ("mulaw", "audio/basic"),
    ],
)
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
    for name in (
        "tilevox_time_to_first_audio_seconds_bucket",
        "tilevox_active_streams",
        "tilevox_queue_depth",
        "tilevox_frames_total",
        "tilevox_frames_per_second",
        "tilevox_request_real_time_factor_bucket",
    ):
        assert name in metrics


def _metric(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


def test_metrics_count_what_was_served(server_factory):
    server = server_factory()
    before = httpx.get(server.http_url + "/metrics").text
    assert (
        httpx.post(
            server.http_url + "/v1/audio/speech", json={"input": "count these frames", "response_format": "pcm"}
        ).status_code
        == 200
    )
    after = httpx.get(server.http_url + "/metrics").text
    assert _metric(after, "tilevox_frames_total") - _metric(before, "tilevox_frames_total") == len("count these frames")
    assert (
        _metric(after, "tilevox_time_to_first_audio_seconds_count")
        - _metric(before, "tilevox_time_to_first_audio_seconds_count")
        == 1
    )
    assert _metric(after, "tilevox_active_streams") == 0 and _metric(after, "tilevox_queue_depth") == 0
    assert _metric(after, "tilevox_audio_seconds_total") - _metric(
        before, "tilevox_audio_seconds_total"
    ) == pytest.approx(len("count these frames") / 50)


@pytest.mark.parametrize(
    "kwargs,status,code",
    [
        ({"content": b"{not json"}, 400, "invalid_request"),
        ({"json": {"input": ""}}, 400, "invalid_request"),
        ({"json": {"input": "x" * 501}}, 400, "string_above_max_length"),
        ({"json": {"input": "hi", "voice": "nobody"}}, 400, "voice_not_found"),
        ({"json": {"input": "hi", "model": "nope"}}, 404, "model_not_found"),
        ({"json": {"input": "hi", "response_format": "aiff"}}, 400, "invalid_request"),
        ({"json": {"input": "hi", "response_format": []}}, 400, "invalid_request"),  # falsy is not "default"
        ({"json": {"input": "hi", "response_format": ""}}, 400, "invalid_request"),
        ({"json": {"input": "hi", "sample_rate": 3}}, 400, "invalid_request"),
        ({"content": b'{"input": "a\\ud800b"}'}, 400, "invalid_request"),  # lone surrogate, before the tokenizer
        ({"content": b'{"input": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}, 400, "invalid_request"),
        ({"content": b"\xff\xfe"}, 400, "invalid_request"),
        ({"content": b"x" * (2 << 20)}, 413, "invalid_request"),
    ],
)
def test_errors_and_server_keeps_serving(fake_server, kwargs, status, code):
    r = httpx.post(fake_server.http_url + "/v1/audio/speech", headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    assert (
        httpx.post(
            fake_server.http_url + "/v1/audio/speech", json={"input": "still here", "response_format": "pcm"}
        ).status_code
        == 200
    )


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
    assert (
        len(client.audio.speech.create(model="tts-1", voice="alloy", input="secret", response_format="pcm").content) > 0
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.http_url + "/v1", api_key="bad", max_retries=0).audio.speech.create(
            model="tts-1", voice="alloy", input="x"
        )


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


def _decoded_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    return sum(f.samples for f in frames) / frames[0].sample_rate


def test_raw_pcm_without_sample_rate_is_24_khz_for_every_model(fake_server):
    """OpenAI's raw pcm is 24 kHz s16le mono and clients play it so: the 16 kHz model is resampled."""
    body = {"input": "twenty four k", "seed": 3}
    wav = httpx.post(fake_server.http_url + "/v1/audio/speech", json=body | {"response_format": "wav"})
    pcm = httpx.post(fake_server.http_url + "/v1/audio/speech", json=body | {"response_format": "pcm"})
    assert wav.headers["x-sample-rate"] == "16000" and pcm.headers["x-sample-rate"] == "24000"
    seconds = (len(wav.content) - 44) / 2 / 16000
    assert len(pcm.content) / 2 == pytest.approx(seconds * 24000, abs=2)
    explicit = httpx.post(
        fake_server.http_url + "/v1/audio/speech", json=body | {"response_format": "pcm", "sample_rate": 16000}
    )
    assert explicit.content == wav.content[44:]  # an explicit rate still wins


@pytest.mark.parametrize("stream", [True, False])
def test_aac_decodes_to_the_duration_of_wav(fake_server, stream):
    body = {"input": "advanced audio coding", "seed": 1, "stream": stream}
    wav = httpx.post(fake_server.http_url + "/v1/audio/speech", json=body | {"response_format": "wav"}).content
    aac = httpx.post(fake_server.http_url + "/v1/audio/speech", json=body | {"response_format": "aac"})
    assert aac.status_code == 200 and aac.content[:2] == b"\xff\xf1"  # an ADTS sync word
    # AAC adds the encoder's priming (1024 samples) and pads its last frame: within two 1024-sample frames
    assert _decoded_seconds(aac.content) == pytest.approx(_decoded_seconds(wav), abs=2 * 1024 / 16000)


@pytest.mark.parametrize(
    "fmt,rate",
    [("mp3", 17000), ("mp3", 64000), ("mp3", 88200), ("mp3", 96000), ("mp3", 192000), ("aac", 17000), ("opus", 44100)],
)
def test_encoder_rates_are_checked_before_any_audio(fake_server, fmt, rate):
    r = httpx.post(
        fake_server.http_url + "/v1/audio/speech", json={"input": "rates", "response_format": fmt, "sample_rate": rate}
    )
    assert r.status_code == 400, r.text[:200]
    assert r.json()["error"]["param"] == "sample_rate" and "encodes only at" in r.json()["error"]["message"]


def test_whole_flac_has_exact_headers_and_streamed_flac_decodes(fake_server):
    body = {"input": "free lossless", "seed": 2, "response_format": "flac"}
    whole = httpx.post(fake_server.http_url + "/v1/audio/speech", json=body | {"stream": False})
    assert whole.status_code == 200 and int(whole.headers["content-length"]) == len(whole.content)
    info = soundfile.info(io.BytesIO(whole.content))
    assert info.frames == len("free lossless") * 320 and info.samplerate == 16000
    streamed = httpx.post(fake_server.http_url + "/v1/audio/speech", json=body).content
    # streamed FLAC's STREAMINFO says total_samples = 0 ("unknown"): a streaming decoder reads it all
    assert _decoded_seconds(streamed) == pytest.approx(info.frames / 16000)


def test_request_ids_are_echoed_only_when_sane(fake_server):
    url = fake_server.http_url + "/v1/audio/speech"
    ok = httpx.post(url, json={"input": "id"}, headers={"x-request-id": "client-42.a:b"})
    assert ok.headers["x-request-id"] == "client-42.a:b"
    for junk in ("x" * 129, "has space", "semi;colon"):
        r = httpx.post(url, json={"input": "id"}, headers={"x-request-id": junk})
        assert r.headers["x-request-id"] != junk and r.headers["x-request-id"].startswith("req-")


def test_rejected_requests_are_counted(server_factory):
    server = server_factory(api_key=API_KEY)
    url = server.http_url + "/v1/audio/speech"
    assert httpx.post(url, json={"input": "no key"}).status_code == 401
    assert httpx.post(url, json={"input": ""}, headers={"authorization": f"Bearer {API_KEY}"}).status_code == 400
    text = httpx.get(server.http_url + "/metrics").text
    assert _metric(text, 'tilevox_requests_total{api="http",outcome="rejected_401"}') == 1
    assert _metric(text, 'tilevox_requests_total{api="http",outcome="rejected_400"}') == 1


def test_a_body_shorter_than_its_content_length_times_out(server_factory):
    server = server_factory(idle_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"input": '
        )
        started = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    assert time.monotonic() - started < 5


def test_a_bug_in_the_model_is_a_500_naming_the_request(server_factory):
    class Buggy(FakeSpeechModel):
        def validate(self, request):
            raise ValueError("an internal invariant broke")  # a bug, not a client mistake

    server = server_factory(Buggy())
    r = httpx.post(server.http_url + "/v1/audio/speech", json={"input": "x"}, headers={"x-request-id": "bug-1"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "bug-1" in r.json()["error"]["message"] and "invariant" not in r.text


def test_a_stream_cut_at_shutdown_is_an_error_not_an_end(fake_model):
    from tests.server.conftest import make_server

    server = make_server(FakeSpeechModel(step_delay_s=0.02), drain_timeout_s=0.3, warmup=False)
    url = server.http_url + "/v1/audio/speech"
    outcome = {}

    def raw():
        try:
            with httpx.stream("POST", url, json={"input": "r" * 400, "response_format": "pcm"}, timeout=30) as r:
                for _ in r.iter_bytes():
                    pass
            outcome["raw"] = "clean end"
        except httpx.RemoteProtocolError as exc:
            outcome["raw"] = f"aborted: {exc}"

    def sse():
        text = httpx.post(
            url, json={"input": "s" * 400, "response_format": "pcm", "stream_format": "sse"}, timeout=30
        ).text
        outcome["sse"] = json.loads(text.strip().split("\n\n")[-1].split("data: ", 1)[1])

    threads = [threading.Thread(target=raw), threading.Thread(target=sse)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    server.stop()
    for t in threads:
        t.join(30)
    assert outcome["raw"].startswith("aborted"), outcome
    assert outcome["sse"]["type"] == "speech.audio.error" and outcome["sse"]["error"]["code"] == "truncated"
