"""parse_speech_request: OpenAI body -> SpeechParams, and the exact error for each mistake."""

from __future__ import annotations

import pytest

from tilevox.server.audio import AudioFormat
from tilevox.server.protocol import ApiError, parse_speech_request
from tilevox.server.voices import OPENAI_VOICES, VoiceCatalog

CATALOG = VoiceCatalog(model_id="fake-tts", model_voices=("anna", "bert", "cleo"), languages=("en",))


def parse(body, **kw):
    kw = {"catalog": CATALOG, "native_rate_hz": 24000, "max_text_chars": 100, "default_max_duration_s": 30.0} | kw
    return parse_speech_request(body, **kw)


def test_defaults_and_aliases():
    p = parse({"model": "tts-1", "input": "hi", "voice": "alloy"})
    assert p.response_format is AudioFormat.MP3 and p.sample_rate_hz == 24000 and p.stream_format == "audio"
    assert p.request.voice == "anna" and p.request.seed == 0 and p.request.max_duration_s == 30.0
    assert parse({"input": "hi", "voice": {"id": "bert"}}).request.voice == "bert"
    assert parse({"input": "hi", "response_format": "mulaw"}).sample_rate_hz == 8000
    q = parse(
        {
            "input": "hi",
            "seed": 7,
            "temperature": 0,
            "sample_rate": 16000,
            "response_format": "pcm",
            "stream_format": "sse",
        }
    )
    assert (q.request.seed, q.request.sampling.temperature, q.sample_rate_hz, q.stream_format) == (7, 0.0, 16000, "sse")


def test_openai_voice_mapping_is_modular_and_documented():
    mapping = CATALOG.mapping()
    assert [mapping[v] for v in OPENAI_VOICES] == [CATALOG.model_voices[i % 3] for i in range(len(OPENAI_VOICES))]
    no_voices = VoiceCatalog(model_id="m", model_voices=(), languages=())
    assert no_voices.resolve_voice("nova") is None


@pytest.mark.parametrize(
    "body,status,param",
    [
        ([1, 2], 400, None),
        ({"input": ""}, 400, "input"),
        ({"input": "   "}, 400, "input"),
        ({"input": "x" * 101}, 400, "input"),
        ({"input": 5}, 400, "input"),
        ({"input": "hi", "voice": "nobody"}, 400, "voice"),
        ({"input": "hi", "model": "whisper-1"}, 404, "model"),
        ({"input": "hi", "response_format": "aiff"}, 400, "response_format"),
        ({"input": "hi", "response_format": []}, 400, "response_format"),
        ({"input": "hi", "response_format": 0}, 400, "response_format"),
        ({"input": "hi", "response_format": "mp3", "sample_rate": 96000}, 400, "sample_rate"),
        ({"input": "a\ud800b"}, 400, "input"),
        ({"input": "hi", "stream": "no"}, 400, "stream"),
        ({"input": "hi", "stream_format": "chunks"}, 400, "stream_format"),
        ({"input": "hi", "speed": 1.5}, 400, "speed"),
        ({"input": "hi", "speed": 9.0}, 400, "speed"),
        ({"input": "hi", "sample_rate": 1000}, 400, "sample_rate"),
        ({"input": "hi", "sample_rate": 16000.5}, 400, "sample_rate"),
        ({"input": "hi", "response_format": "mulaw", "sample_rate": 16000}, 400, "sample_rate"),
        ({"input": "hi", "response_format": "opus", "sample_rate": 44100}, 400, "sample_rate"),
        ({"input": "hi", "seed": "7"}, 400, "seed"),
        ({"input": "hi", "seed": True}, 400, "seed"),
        ({"input": "hi", "temperature": -1}, 400, "temperature"),
        ({"input": "hi", "max_duration_s": 0}, 400, "max_duration_s"),
        ({"input": "hi", "bogus": 1}, 400, "bogus"),
    ],
)
def test_errors(body, status, param):
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == status
    assert info.value.param == param
    assert info.value.body()["error"]["message"]


def test_speed_one_is_accepted():
    assert parse({"input": "hi", "speed": 1.0}).request.text == "hi"


def test_sampling_is_chosen_only_when_named():
    """No sampling field: None (the model's own defaults, e.g. Qwen3-TTS's generation_config.json); a client that
    sends the default values explicitly has chosen them and gets exactly them."""
    from tilevox.models.sampling import SamplingParams

    assert parse({"input": "hi"}).request.sampling is None
    explicit = parse({"input": "hi", "temperature": SamplingParams().temperature, "top_k": SamplingParams().top_k})
    assert explicit.request.sampling == SamplingParams()
