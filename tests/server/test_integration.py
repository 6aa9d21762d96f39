"""End to end over the real tiny model (random:llama-tiny, 16 kHz) on loopback sockets:
the same request and seed through every API decodes to the same samples as a solo run, and
32 concurrent streams each equal their solo output (to one int16 step: batched float rounding)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading

import av
import httpx
import numpy as np
import openai
import pytest
import riva.client
from websockets.asyncio.client import connect

from tests.server.conftest import make_server
from tests.server.ws_client import ws_synthesize
from tilevox.models.registry import load_model
from tilevox.models.streaming import SynthesisRequest, synthesize
from tilevox.server.audio import float_to_pcm16

MODEL = "random:llama-tiny"
MAX_DURATION_S = 0.4  # 20 frames at 50 Hz keeps every stream short on CPU


@pytest.fixture(scope="module")
def reference_model():
    """A second instance for solo reference runs (the served one belongs to its worker thread)."""
    return load_model(MODEL)


@pytest.fixture(scope="module")
def tiny_server():
    server = make_server(load_model(MODEL), max_streams=8, max_queued=32)
    yield server
    server.stop()


def _solo_pcm(model, text: str, seed: int) -> np.ndarray:
    result = synthesize(model, SynthesisRequest(text=text, seed=seed, max_duration_s=MAX_DURATION_S))
    return float_to_pcm16(result.samples)


def test_same_request_and_seed_gives_same_samples_through_every_api(tiny_server, reference_model):
    text, seed = "The same words, every way.", 1234
    expected = _solo_pcm(reference_model, text, seed)
    assert expected.size > 0
    body = {"model": "tts-1", "voice": "alloy", "input": text, "seed": seed, "max_duration_s": MAX_DURATION_S}
    got: dict[str, np.ndarray] = {}

    client = openai.OpenAI(base_url=tiny_server.http_url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=text,
        response_format="pcm",
        extra_body={"seed": seed, "max_duration_s": MAX_DURATION_S, "sample_rate": 16000},
    ) as response:
        got["openai-sdk pcm"] = np.frombuffer(b"".join(response.iter_bytes()), "<i2")
    wav = httpx.post(tiny_server.http_url + "/v1/audio/speech", json=body | {"response_format": "wav"}).content
    got["http wav"] = np.frombuffer(wav[44:], "<i2")
    flac = httpx.post(tiny_server.http_url + "/v1/audio/speech", json=body | {"response_format": "flac"}).content
    got["http flac"] = np.concatenate([f.to_ndarray().reshape(-1) for f in av.open(io.BytesIO(flac)).decode(audio=0)])
    sse = httpx.post(
        tiny_server.http_url + "/v1/audio/speech",
        json=body | {"response_format": "pcm", "stream_format": "sse", "sample_rate": 16000},
    ).text
    deltas = [json.loads(b.split("data: ", 1)[1]) for b in sse.strip().split("\n\n")]
    got["http sse"] = np.frombuffer(
        b"".join(base64.b64decode(d["audio"]) for d in deltas if d["type"] == "speech.audio.delta"), "<i2"
    )

    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=tiny_server.grpc_target))
    custom = {"seed": seed, "max_duration_s": MAX_DURATION_S}
    got["riva synthesize"] = np.frombuffer(
        tts.synthesize(text, sample_rate_hz=16000, custom_configuration=custom).audio, "<i2"
    )
    online = tts.synthesize_online(text, sample_rate_hz=16000, custom_configuration=custom)
    got["riva synthesize_online"] = np.frombuffer(b"".join(r.audio for r in online), "<i2")

    config = {"response_format": "pcm", "seed": seed, "max_duration_s": MAX_DURATION_S}
    ws_audio, _ = asyncio.run(ws_synthesize(tiny_server.http_port, (text[:7], text[7:15], text[15:]), config))
    got["websocket"] = np.frombuffer(ws_audio, "<i2")
    for api, samples in got.items():
        np.testing.assert_array_equal(samples, expected, err_msg=api)


def test_32_concurrent_streams_each_equal_their_solo_output(tiny_server, reference_model):
    rng = np.random.default_rng()
    jobs = [(f"Stream number {i} says {int(rng.integers(0, 10**6))}.", int(rng.integers(0, 2**31))) for i in range(32)]
    results: dict[int, tuple[int, bytes]] = {}
    barrier = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        text, seed = jobs[i]
        barrier.wait()
        r = httpx.post(
            tiny_server.http_url + "/v1/audio/speech",
            json={
                "input": text,
                "seed": seed,
                "response_format": "pcm",
                "sample_rate": 16000,
                "max_duration_s": MAX_DURATION_S,
            },
            timeout=120,
        )
        results[i] = (r.status_code, r.content)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert sorted(results) == list(range(32))
    assert max(tiny_server.state.scheduler.step_batch_sizes) > 1  # they really shared steps
    for i, (text, seed) in enumerate(jobs):
        status, content = results[i]
        assert status == 200, content[:200]
        # Same tokens, same samples up to the rounding of batched float math: the server decodes the
        # codec blocks of all its streams in one call (and batches the LM), a solo run one at a time.
        # One int16 step (1/32768) apart at most; another token anywhere would differ by far more.
        served, solo = np.frombuffer(content, "<i2").astype(np.int32), _solo_pcm(reference_model, text, seed)
        assert served.shape == solo.shape, f"stream {i}"
        assert np.abs(served - solo).max() <= 1, f"stream {i}"


def test_websocket_cancel_mid_stream_on_real_model(tiny_server):
    async def main():
        async with connect(f"ws://127.0.0.1:{tiny_server.http_port}/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "config", "response_format": "pcm", "max_duration_s": 30}))
            assert json.loads(await ws.recv())["type"] == "started"
            for piece in ["A long ", "sentence that ", "goes on and on"]:
                await ws.send(json.dumps({"type": "text", "text": piece}))
            await ws.send(json.dumps({"type": "flush"}))
            got = 0
            while got == 0:
                msg = await asyncio.wait_for(ws.recv(), timeout=30)
                got += len(msg) if isinstance(msg, bytes) else 0
            await ws.send(json.dumps({"type": "cancel"}))
            while True:
                msg = await asyncio.wait_for(ws.recv(), timeout=30)
                if isinstance(msg, str) and json.loads(msg)["type"] == "cancelled":
                    break
            for _ in range(300):
                if tiny_server.state.scheduler.num_active == 0:
                    return got
                await asyncio.sleep(0.01)
            raise AssertionError("the cancelled stream still holds its slot")

    assert 0 < asyncio.run(main()) < 30 * 16000 * 2


def test_riva_resampled_output_of_real_model(tiny_server, reference_model):
    import soxr

    text, seed = "Resample to 44.1 kHz.", 9
    tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=tiny_server.grpc_target))
    audio = tts.synthesize(
        text, sample_rate_hz=44100, custom_configuration={"seed": seed, "max_duration_s": MAX_DURATION_S}
    ).audio
    ref = synthesize(reference_model, SynthesisRequest(text=text, seed=seed, max_duration_s=MAX_DURATION_S)).samples
    expected = float_to_pcm16(soxr.resample(ref, 16000, 44100, quality="HQ")).astype(np.int32)
    got = np.frombuffer(audio, "<i2").astype(np.int32)
    assert abs(len(got) - len(expected)) <= 1
    n = min(len(got), len(expected))
    assert np.max(np.abs(got[:n] - expected[:n])) <= 2


def test_qwen3_tts_tiny_at_24k_with_named_voices():
    """The second model family: 24 kHz output, named speakers reached through OpenAI and Riva names."""
    served, reference = load_model("random:qwen3-tts-tiny"), load_model("random:qwen3-tts-tiny")
    voices = [v.name for v in served.voices()]
    server = make_server(served, max_streams=2, max_queued=2)
    try:
        text, seed = "Twenty four kilohertz.", 77
        expected = float_to_pcm16(
            synthesize(
                reference,
                SynthesisRequest(text=text, seed=seed, voice=voices[1 % len(voices)], max_duration_s=MAX_DURATION_S),
            ).samples
        )
        r = httpx.post(
            server.http_url + "/v1/audio/speech",
            json={
                "input": text,
                "voice": "ash",
                "seed": seed,
                "response_format": "pcm",
                "max_duration_s": MAX_DURATION_S,
            },
        )
        assert r.status_code == 200 and r.headers["x-sample-rate"] == "24000"
        np.testing.assert_array_equal(np.frombuffer(r.content, "<i2"), expected)
        tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=server.grpc_target))
        resp = tts.synthesize(
            text,
            voice_name=voices[1 % len(voices)],
            sample_rate_hz=24000,
            custom_configuration={"seed": seed, "max_duration_s": MAX_DURATION_S},
        )
        np.testing.assert_array_equal(np.frombuffer(resp.audio, "<i2"), expected)
    finally:
        server.stop()
