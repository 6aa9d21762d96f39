"""NH-TTS (random:nh-tts-tiny, 44.1 kHz DAC) behind every front end, with the same unmodified clients as the
other models: its voices listed by /v1/audio/voices and Riva's GetRivaSynthesisConfig, the same request and
seed giving the solo run's samples through the OpenAI SDK, plain HTTP, Riva and the WebSocket, at 44.1 kHz
native and resampled to what a client asks."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
import riva.client
import soxr
from riva.client.proto import riva_tts_pb2

from tests.server.conftest import make_server
from tests.server.ws_client import ws_synthesize
from tilevox.models.registry import load_model
from tilevox.models.streaming import SynthesisRequest, synthesize
from tilevox.server.audio import float_to_pcm16

MODEL = "random:nh-tts-tiny"
MAX_DURATION_S = 0.3  # 25 frames at 86 Hz (plus the 15-position delay tail) keeps every stream short on CPU


@pytest.fixture(scope="module")
def reference_model():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def nh_server():
    server = make_server(load_model(MODEL), max_streams=4, max_queued=8)
    yield server
    server.stop()


def _solo(model, text: str, seed: int, voice: str | None = None) -> np.ndarray:
    request = SynthesisRequest(text=text, seed=seed, voice=voice, max_duration_s=MAX_DURATION_S)
    return synthesize(model, request).samples


def test_voices_are_listed_by_http_and_riva(nh_server):
    voices = httpx.get(nh_server.http_url + "/v1/audio/voices").json()["voices"]
    assert {"S1", "S2", "alloy"} <= {v["id"] for v in voices}
    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=nh_server.grpc_target))
    (config,) = tts.stub.GetRivaSynthesisConfig(riva_tts_pb2.RivaSynthesisConfigRequest()).model_config
    params = dict(config.parameters)
    assert params["subvoices"] == "S1:0,S2:1" and params["sample_rate_hz"] == "44100"


def test_every_front_end_serves_the_solo_samples_at_44_1_khz(nh_server, reference_model):
    text, seed = "[S1] Forty four point one.", 4242
    expected = float_to_pcm16(_solo(reference_model, text, seed))
    assert expected.size > 0
    got: dict[str, np.ndarray] = {}
    client = openai.OpenAI(base_url=nh_server.http_url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=text,
        response_format="pcm",
        extra_body={"seed": seed, "max_duration_s": MAX_DURATION_S, "sample_rate": 44100},
    ) as response:
        assert response.headers["x-sample-rate"] == "44100"
        got["openai-sdk pcm"] = np.frombuffer(b"".join(response.iter_bytes()), "<i2")
    body = {"input": text, "seed": seed, "max_duration_s": MAX_DURATION_S, "response_format": "wav"}
    got["http wav"] = np.frombuffer(httpx.post(nh_server.http_url + "/v1/audio/speech", json=body).content[44:], "<i2")
    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=nh_server.grpc_target))
    custom = {"seed": seed, "max_duration_s": MAX_DURATION_S}
    got["riva synthesize"] = np.frombuffer(
        tts.synthesize(text, voice_name="S1", sample_rate_hz=44100, custom_configuration=custom).audio, "<i2"
    )
    online = tts.synthesize_online(text, sample_rate_hz=44100, custom_configuration=custom)
    got["riva synthesize_online"] = np.frombuffer(b"".join(r.audio for r in online), "<i2")

    config = {"response_format": "pcm", "seed": seed, "max_duration_s": MAX_DURATION_S}
    ws_audio, _ = asyncio.run(ws_synthesize(nh_server.http_port, (text,), config, recv_timeout=60))
    got["websocket"] = np.frombuffer(ws_audio, "<i2")
    # The same codes, so the same samples up to float rounding of the DAC (one int16 step; another code anywhere
    # would differ by far more). Every surface gets the same samples as every other.
    for api, samples in got.items():
        assert samples.shape == expected.shape, api
        assert np.abs(samples.astype(np.int32) - expected.astype(np.int32)).max() <= 1, api
        np.testing.assert_array_equal(samples, got["http wav"], err_msg=api)


def test_resampled_to_what_the_client_asks_and_second_voice(nh_server, reference_model):
    text, seed = "Sixteen kilohertz please.", 7
    reference = _solo(reference_model, text, seed, voice="S2")
    expected = float_to_pcm16(soxr.resample(reference, 44100, 16000, quality="HQ")).astype(np.int32)
    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=nh_server.grpc_target))
    audio = tts.synthesize(
        text,
        voice_name="S2",
        sample_rate_hz=16000,
        custom_configuration={"seed": seed, "max_duration_s": MAX_DURATION_S},
    ).audio
    got = np.frombuffer(audio, "<i2").astype(np.int32)
    assert abs(len(got) - len(expected)) <= 1
    n = min(len(got), len(expected))
    assert np.max(np.abs(got[:n] - expected[:n])) <= 2
    r = httpx.post(
        nh_server.http_url + "/v1/audio/speech",
        json={
            "input": text,
            "voice": "S2",
            "seed": seed,
            "response_format": "pcm",
            "sample_rate": 16000,
            "max_duration_s": MAX_DURATION_S,
        },
    )
    assert r.status_code == 200 and r.headers["x-sample-rate"] == "16000"
    np.testing.assert_array_equal(np.frombuffer(r.content, "<i2").astype(np.int32), got)
    # OpenAI's raw pcm is 24 kHz unless the client asks otherwise: the SDK's default request is resampled.
    client = openai.OpenAI(base_url=nh_server.http_url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="ash",  # OpenAI's second voice: S2
        input=text,
        response_format="pcm",
        extra_body={"seed": seed, "max_duration_s": MAX_DURATION_S},
    ) as response:
        assert response.headers["x-sample-rate"] == "24000"
        sdk = np.frombuffer(b"".join(response.iter_bytes()), "<i2").astype(np.int32)
    want = float_to_pcm16(soxr.resample(reference, 44100, 24000, quality="HQ")).astype(np.int32)
    assert abs(len(sdk) - len(want)) <= 1
    n = min(len(sdk), len(want))
    assert np.max(np.abs(sdk[:n] - want[:n])) <= 2
