"""Riva gRPC surface driven by nvidia-riva-client's unmodified SpeechSynthesisService:
synthesize, synthesize_online (several texts on one stream), voice listing, resampling,
encodings, health, auth and the status code of each mistake."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import riva.client
import soxr
from grpc_health.v1 import health_pb2, health_pb2_grpc
from riva.client.proto import riva_tts_pb2

from tests.server.conftest import API_KEY
from tests.server.fake_model import FakeSpeechModel
from tilevox.models.streaming import SynthesisRequest
from tilevox.server.audio import float_to_pcm16

PCM = riva.client.AudioEncoding.LINEAR_PCM


def _service(server, metadata=None):
    auth = riva.client.Auth(uri=server.grpc_target, use_ssl=False, metadata_args=metadata)
    return riva.client.SpeechSynthesisService(auth)


def _expected(model, text, seed=0, voice=None):
    return float_to_pcm16(model.expected(SynthesisRequest(text=text, seed=seed, voice=voice)))


def test_synthesize_at_native_rate_is_exact(fake_server, fake_model):
    tts = _service(fake_server)
    resp = tts.synthesize(
        "riva hello", voice_name="Tilevox.EN-US.bert", sample_rate_hz=16000, custom_configuration={"seed": 4}
    )
    np.testing.assert_array_equal(np.frombuffer(resp.audio, "<i2"), _expected(fake_model, "riva hello", 4, "bert"))
    bare = tts.synthesize("riva hello", voice_name="bert", sample_rate_hz=0, custom_configuration={"seed": 4})
    assert bare.audio == resp.audio


def test_synthesize_online_streams_each_text(fake_server, fake_model):
    tts = _service(fake_server)
    texts = ["first text", "second one"]
    responses = list(tts.synthesize_online(texts, sample_rate_hz=16000))
    assert len(responses) > 2
    audio = b"".join(r.audio for r in responses)
    expected = np.concatenate([_expected(fake_model, t) for t in texts])
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), expected)
    single = list(tts.synthesize_online("just one", sample_rate_hz=16000))
    np.testing.assert_array_equal(
        np.frombuffer(b"".join(r.audio for r in single), "<i2"), _expected(fake_model, "just one")
    )


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_linear_pcm_resampled_to_any_rate(fake_server, fake_model, rate):
    resp = _service(fake_server).synthesize("resample me", sample_rate_hz=rate)
    got = np.frombuffer(resp.audio, "<i2").astype(np.int32)
    ref = float_to_pcm16(
        soxr.resample(fake_model.expected(SynthesisRequest(text="resample me")), 16000, rate, quality="HQ")
    ).astype(np.int32)
    assert abs(len(got) - len(ref)) <= 1
    n = min(len(got), len(ref))
    assert np.max(np.abs(got[:n] - ref[:n])) <= 2


def test_oggopus(fake_server):
    import soundfile

    resp = _service(fake_server).synthesize(
        "opus please", encoding=riva.client.AudioEncoding.OGGOPUS, sample_rate_hz=48000
    )
    assert resp.audio[:4] == b"OggS"
    y, sr = soundfile.read(io.BytesIO(resp.audio))
    assert sr == 48000 and abs(len(y) - len("opus please") * 320 * 3) < 4000


def test_config_lists_voices_the_riva_way(fake_server):
    tts = _service(fake_server)
    resp = tts.stub.GetRivaSynthesisConfig(riva_tts_pb2.RivaSynthesisConfigRequest())
    (config,) = resp.model_config
    params = dict(config.parameters)
    assert (
        params["voice_name"] == "Tilevox.EN-US"
        and params["subvoices"] == "anna:0,bert:1"
        and params["language_code"] == "en-US"
    )
    # talk.py builds full names as voice_name + "." + subvoice name; they must be accepted
    full = params["voice_name"] + "." + params["subvoices"].split(",")[1].split(":")[0]
    assert len(tts.synthesize("full name", voice_name=full, sample_rate_hz=16000).audio) > 0


def test_health_service(fake_server):
    channel = grpc.insecure_channel(fake_server.grpc_target)
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "nvidia.riva.tts.RivaSpeechSynthesis"):
        assert (
            stub.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        )


@pytest.mark.parametrize(
    "kwargs,code",
    [
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "x" * 501}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "hi", "sample_rate_hz": 100}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"text": "hi", "encoding": riva.client.AudioEncoding.OGGOPUS, "sample_rate_hz": 44100},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"text": "hi", "custom_configuration": {"warp": "9"}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": "hi", "custom_configuration": {"seed": "abc"}}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_errors_and_server_keeps_serving(fake_server, kwargs, code):
    tts = _service(fake_server)
    with pytest.raises(grpc.RpcError) as info:
        tts.synthesize(**kwargs)
    assert info.value.code() == code and info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(tts.synthesize_online(**kwargs))
    assert info.value.code() == code
    assert len(tts.synthesize("still serving", sample_rate_hz=16000).audio) > 0


def test_api_key_metadata(keyed_server):
    with pytest.raises(grpc.RpcError) as info:
        _service(keyed_server).synthesize("no key")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        _service(keyed_server, [["authorization", "Bearer wrong"]]).synthesize("bad key")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(_service(keyed_server, [["authorization", f"Bearer {API_KEY}"]]).synthesize("good").audio) > 0
    assert len(_service(keyed_server, [["api-key", API_KEY]]).synthesize("good").audio) > 0
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(keyed_server.grpc_target))
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_overload_is_resource_exhausted_and_cancel_frees_slot(server_factory):
    model = FakeSpeechModel(step_delay_s=0.005)
    server = server_factory(model, max_streams=1, max_queued=0)
    tts = _service(server)
    stream = tts.synthesize_online("w" * 3000, custom_configuration={"max_duration_s": "120"}, sample_rate_hz=16000)
    next(stream)  # first audio: the only slot is taken
    with pytest.raises(grpc.RpcError) as info:
        tts.synthesize("second")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stream.cancel()  # what Pipecat does on barge-in
    import time

    deadline = time.monotonic() + 5
    while server.state.scheduler.num_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.state.scheduler.num_active == 0 and model.open_stream_ids == ()
    assert len(tts.synthesize("third", sample_rate_hz=16000).audio) > 0


def test_synthesize_online_idle_timeout(server_factory):
    import threading

    server = server_factory(idle_timeout_s=0.3)
    stub = _service(server).stub
    release = threading.Event()

    def requests():
        yield riva_tts_pb2.SynthesizeSpeechRequest(text="one", sample_rate_hz=16000)
        release.wait(10)  # then go silent without half-closing

    call = stub.SynthesizeOnline(requests())
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    release.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_custom_configuration_errors_name_the_key(fake_server):
    with pytest.raises(grpc.RpcError) as info:
        _service(fake_server).synthesize("hi", custom_configuration={"seed": "abc"})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'seed' must be an integer, got 'abc'" in info.value.details()


def test_voice_listing_needs_no_key_but_synthesis_does(keyed_server):
    """Riva's client calls GetRivaSynthesisConfig without metadata (talk.py --list-voices, the frameworks)."""
    config = _service(keyed_server).stub.GetRivaSynthesisConfig(riva_tts_pb2.RivaSynthesisConfigRequest())
    assert config.model_config[0].parameters["voice_name"].startswith("Tilevox.")
    with pytest.raises(grpc.RpcError) as info:
        list(_service(keyed_server).synthesize_online("no key"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_unknown_voices_are_served_by_default_or_refused_when_strict(server_factory, caplog):
    import logging

    lenient = server_factory()
    with caplog.at_level(logging.WARNING, logger="tilevox.voices"):
        for _ in range(2):
            assert (
                len(
                    _service(lenient)
                    .synthesize("who", voice_name="Other-Model.EN-US.Nobody", sample_rate_hz=16000)
                    .audio
                )
                > 0
            )
    assert [r.getMessage() for r in caplog.records] == ["voice.unknown_served_default"]  # once per name
    strict = server_factory(strict_voices=True)
    with pytest.raises(grpc.RpcError) as info:
        _service(strict).synthesize("who", voice_name="Other-Model.EN-US.Nobody")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown voice" in info.value.details()


def test_a_stream_cut_at_shutdown_ends_aborted_not_ok():
    import threading

    from tests.server.conftest import make_server

    server = make_server(FakeSpeechModel(step_delay_s=0.02), drain_timeout_s=0.3, warmup=False)
    outcome = {}

    def online():
        try:
            for _ in _service(server).synthesize_online("c" * 400, sample_rate_hz=16000):
                pass
            outcome["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()

    t = threading.Thread(target=online)
    t.start()
    import time

    time.sleep(0.4)
    server.stop()
    t.join(30)
    assert outcome["code"] == grpc.StatusCode.ABORTED


def test_overload_trailers_carry_retry_after_and_a_ticket(server_factory):
    server = server_factory(FakeSpeechModel(step_delay_s=0.005), max_streams=1, max_queued=0)
    tts = _service(server)
    stream = tts.synthesize_online("w" * 3000, custom_configuration={"max_duration_s": "120"}, sample_rate_hz=16000)
    next(stream)
    with pytest.raises(grpc.RpcError) as info:
        tts.synthesize("second")
    trailers = dict(info.value.trailing_metadata())
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(trailers["retry-after-ms"]) > 0 and trailers["x-tilevox-ticket"]
    stream.cancel()
