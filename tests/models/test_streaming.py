"""Request validation and the single-stream driver of the streaming interface."""

import numpy as np
import pytest

from tilevox.models.registry import load_model
from tilevox.models.streaming import FinishReason, SynthesisRequest, VoicePrompt, synthesize


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"text": ""}, "text"),
        ({"text": "   \n"}, "text"),
        ({"text": "hi", "max_duration_s": 0.0}, "max_duration_s"),
        ({"text": "hi", "seed": -1}, "seed"),
    ],
)
def test_request_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SynthesisRequest(**kwargs)


def test_voice_prompt_validation():
    with pytest.raises(ValueError, match="mono"):
        VoicePrompt(samples=np.zeros((2, 10), dtype=np.float32), sample_rate_hz=16000)
    with pytest.raises(ValueError, match="sample rate"):
        VoicePrompt(samples=np.zeros(10, dtype=np.float32), sample_rate_hz=0)


def test_unknown_model_and_preset_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        load_model("random:nope")
    with pytest.raises(ValueError, match="unknown model"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(RuntimeError, match="not served"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tts-tiny"])
def test_synthesize_tiny_preset(preset):
    model = load_model(f"random:{preset}")
    assert model.is_random
    request = SynthesisRequest(text="Hello there, 42 times.", seed=3, max_duration_s=1.0)
    result = synthesize(model, request)
    assert result.samples.dtype == np.float32
    assert result.samples.size > 0 and np.isfinite(result.samples).all()
    assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert result.duration_s <= 1.0 + 1.0 / model.frame_rate_hz
    assert result.time_to_first_audio_s <= result.wall_time_s
    assert model.open_stream_ids == ()
    again = synthesize(model, request)
    np.testing.assert_array_equal(again.samples, result.samples)  # same seed, same audio
