"""The calls that voice-agent frameworks' stock TTS services make, replayed against a keyed server with their
default settings (Pipecat and LiveKit Agents do not install on the CI machine within its budget, so their
requests are reproduced from their source: the same client library, metadata, voices and formats)."""

from __future__ import annotations

import logging

import httpx
import numpy as np
import openai
import pytest
import riva.client
from riva.client.proto import riva_tts_pb2

from tests.server.conftest import API_KEY

NVIDIA_FUNCTION_ID = "877104f7-e885-42b9-8de8-f6e4c6303969"  # the hosted catalog's routing header: ignored


def _riva(server, with_key: bool = True) -> riva.client.SpeechSynthesisService:
    metadata = [["function-id", NVIDIA_FUNCTION_ID]] + ([["authorization", f"Bearer {API_KEY}"]] if with_key else [])
    return riva.client.SpeechSynthesisService(riva.client.Auth(None, False, server.grpc_target, metadata))


@pytest.mark.parametrize(
    "voice",
    [
        "Magpie-Multilingual.EN-US.Aria",
        "Magpie-Multilingual.EN-US.Ray",
        "Magpie-Multilingual.EN-US.Sofia",
        "Magpie-Multilingual.EN-US.Leo",
    ],
)
def test_nvidia_services_with_their_default_voices(keyed_server, voice, caplog):
    """Pipecat's NvidiaTTSService / LiveKit's nvidia.TTS: a key-less GetRivaSynthesisConfig at start-up, then
    synthesize_online with the catalog's default voice, en-US, LINEAR_PCM."""
    service = _riva(keyed_server)
    config = service.stub.GetRivaSynthesisConfig(
        riva_tts_pb2.RivaSynthesisConfigRequest()
    )  # no metadata: as they call it
    assert config.model_config and config.model_config[0].parameters["voice_name"]
    with caplog.at_level(logging.WARNING, logger="tilevox"):
        for _ in range(2):
            chunks = list(
                service.synthesize_online(
                    "Hello from a voice agent.",
                    voice,
                    "en-US",
                    sample_rate_hz=16000,
                    zero_shot_quality=20,
                    custom_dictionary={},
                )
            )
            assert sum(len(c.audio) for c in chunks) > 0
    warnings = [r for r in caplog.records if voice in r.getMessage() or voice in str(getattr(r, "fields", {}))]
    assert len(warnings) == 1  # one warning per unknown name, not per request


def test_nvidia_synthesis_still_needs_the_key(keyed_server):
    import grpc

    with pytest.raises(grpc.RpcError) as info:
        list(_riva(keyed_server, with_key=False).synthesize_online("no key", "Magpie-Multilingual.EN-US.Aria", "en-US"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_openai_services_get_24_khz_pcm(keyed_server):
    """Pipecat's OpenAITTSService and LiveKit's openai.TTS: the openai SDK, `pcm`, played at 24 kHz."""
    client = openai.OpenAI(base_url=keyed_server.http_url + "/v1", api_key=API_KEY)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Twenty four kilohertz.", response_format="pcm"
    ) as response:
        assert response.headers["x-sample-rate"] == "24000"
        pcm = np.frombuffer(response.read(), "<i2")
    wav = httpx.post(
        keyed_server.http_url + "/v1/audio/speech",
        headers={"authorization": f"Bearer {API_KEY}"},
        json={"model": "tts-1", "voice": "alloy", "input": "Twenty four kilohertz.", "response_format": "wav"},
    )
    seconds = (len(wav.content) - 44) / 2 / int(wav.headers["x-sample-rate"])
    assert len(pcm) == pytest.approx(seconds * 24000, abs=2)
