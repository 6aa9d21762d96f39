"""The Qwen3-TTS SpeechModel on the tiny preset: stream independence under batching, chunking,
limits, request validation and stream bookkeeping (CPU, no reference package needed)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from tilevox.models.errors import RequestError
from tilevox.models.qwen3_tts.loader import load_preset
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import FinishReason, SynthesisRequest, VoicePrompt, synthesize

SAMPLES_PER_FRAME = 1920


@pytest.fixture(scope="module")
def model():
    return load_preset(
        "qwen3-tts-tiny", device="cpu", dtype=torch.float32, options=ModelOptions(max_streams=5, max_seq_len=256)
    )


def _request(text: str, seed: int, greedy: bool, **kw) -> SynthesisRequest:
    sampling = (
        SamplingParams.greedy(max_new_tokens=40)
        if greedy
        else SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1, max_new_tokens=40)
    )
    return SynthesisRequest(text=text, seed=seed, sampling=sampling, **kw)


def _record(model):
    frames: dict[int, list[torch.Tensor]] = defaultdict(list)
    model.frame_observer = lambda sid, codes: frames[sid].append(codes)
    return frames


def _run_alone(model, request):
    frames = _record(model)
    result = synthesize(model, request)
    (codes,) = frames.values()
    model.frame_observer = None
    return torch.stack(codes), result


@pytest.mark.parametrize("greedy", [True, False])
def test_streams_independent_of_batching(model, greedy):
    """A stream's codes are identical alone and batched with streams that are opened, cancelled
    and finish at other steps (different prompt lengths, so different cache positions)."""
    main = _request("Streams must not interact, whatever shares the batch.", seed=7, greedy=greedy)
    alone_codes, alone = _run_alone(model, main)
    assert alone_codes.shape[0] >= 5

    frames = _record(model)
    main_id = model.open_stream(main)
    others = [model.open_stream(_request("Short.", seed=1, greedy=not greedy))]
    audio = []
    step_idx = 0
    while True:
        if step_idx == 2:
            others.append(model.open_stream(_request("Joins the batch late, longer text here.", seed=3, greedy=greedy)))
        if step_idx == 4:
            assert model.close(others[0]) is True
        live = [main_id] + [o for o in others if o in model.open_stream_ids]
        chunks = {c.stream_id: c for c in model.step(live[::-1])}  # order must not matter either
        audio.append(chunks[main_id].samples)
        step_idx += 1
        if chunks[main_id].is_finished:
            finish = chunks[main_id].finish_reason
            break
    for o in others:
        model.close(o)
    model.frame_observer = None
    assert torch.equal(torch.stack(frames[main_id]), alone_codes)
    assert finish is alone.finish_reason
    # Audio may differ only by the rounding of batched matmuls.
    np.testing.assert_allclose(np.concatenate(audio), alone.samples, atol=1e-5, rtol=0)
    assert model.open_stream_ids == ()


def test_first_audio_after_first_frame_and_chunking(model):
    request = _request("Chunked audio equals per-frame audio.", seed=11, greedy=False)
    per_frame = synthesize(model, request)
    sid = model.open_stream(request)
    first = model.step([sid])[0]
    assert first.samples.shape == (SAMPLES_PER_FRAME,) and first.num_new_frames == 1
    model.close(sid)

    chunked = load_preset("qwen3-tts-tiny", options=ModelOptions(max_streams=2, max_seq_len=256, audio_every_frames=3))
    sid = chunked.open_stream(request)
    sizes, pieces = [], []
    while True:
        (chunk,) = chunked.step([sid])
        sizes.append(chunk.samples.size)
        pieces.append(chunk.samples)
        if chunk.is_finished:
            break
    assert len(sizes) == per_frame.num_frames
    expected = [3 * SAMPLES_PER_FRAME if (i + 1) % 3 == 0 else 0 for i in range(len(sizes) - 1)]
    assert sizes[:-1] == expected
    assert sum(sizes) == per_frame.num_frames * SAMPLES_PER_FRAME
    np.testing.assert_allclose(np.concatenate(pieces), per_frame.samples, atol=1e-5, rtol=0)


def test_limits(model):
    # max_duration_s: int(0.5 * 12.5) = 6 frames, finish LENGTH (greedy tiny model never stops early here)
    result = synthesize(model, _request("Limited by duration.", seed=0, greedy=True, max_duration_s=0.5))
    assert result.num_frames == 6 and result.finish_reason is FinishReason.LENGTH
    assert result.samples.size == 6 * SAMPLES_PER_FRAME
    # max_new_tokens N: N-1 frames (upstream discards the token that reaches the limit)
    request = SynthesisRequest(text="Token limit.", sampling=SamplingParams.greedy(max_new_tokens=4))
    result = synthesize(model, request)
    assert result.num_frames == 3 and result.finish_reason is FinishReason.LENGTH
    # max_new_tokens 1 (or under one frame of duration): no frame at all, in a batch with a live stream
    done = model.open_stream(SynthesisRequest(text="None.", sampling=SamplingParams.greedy(max_new_tokens=1)))
    live = model.open_stream(SynthesisRequest(text="Some.", sampling=SamplingParams.greedy(max_new_tokens=9)))
    first, second = model.step([done, live])
    assert (first.num_new_frames, first.samples.size, first.finish_reason) == (0, 0, FinishReason.LENGTH)
    assert second.num_new_frames == 1 and not second.is_finished
    assert model.open_stream_ids == (live,) and model.close(live)
    result = synthesize(model, SynthesisRequest(text="Short.", max_duration_s=0.05))
    assert result.num_frames == 0 and result.samples.size == 0 and result.finish_reason is FinishReason.LENGTH


def test_default_sampling_comes_from_generation_config(model):
    talker, predictor = model._sampling(SynthesisRequest(text="x"))
    g = model.generation
    assert (talker.temperature, talker.top_k, talker.top_p, talker.repetition_penalty) == (
        g.temperature,
        g.top_k,
        g.top_p,
        g.repetition_penalty,
    )
    assert talker.min_new_tokens == 2 and talker.max_new_tokens == g.max_new_tokens
    assert (predictor.temperature, predictor.top_k, predictor.repetition_penalty) == (
        g.subtalker_temperature,
        g.subtalker_top_k,
        1.0,
    )
    explicit, predictor = model._sampling(SynthesisRequest(text="x", sampling=SamplingParams.greedy()))
    assert explicit.is_greedy and predictor.is_greedy and explicit.min_new_tokens == 2


def test_voices_and_request_errors(model):
    voices = {v.name: v for v in model.voices()}
    assert set(voices) == {"aiden", "dylan"}
    assert voices["aiden"].languages == ("english", "chinese")
    assert "beijing_dialect" in voices["dylan"].description
    model.validate(SynthesisRequest(text="ok", voice="Dylan", language="Chinese"))
    bad = [
        (dict(voice="nobody"), "voice"),
        (dict(language="klingon"), "language"),
        (dict(language="beijing_dialect"), "language"),  # dialects come only through dialect speakers
        (dict(voice_prompt=VoicePrompt(samples=np.ones(4800, np.float32), sample_rate_hz=24000)), "voice_prompt"),
    ]
    for kwargs, word in bad:
        with pytest.raises(RequestError, match=word):
            model.open_stream(SynthesisRequest(text="hello", **kwargs))
    # a prompt past the context is refused by validate (the server's submit: HTTP 400), not by the prefill
    with pytest.raises(RequestError, match="text too long"):
        model.validate(SynthesisRequest(text="word " * model.options.max_seq_len))
    assert model.open_stream_ids == ()


def test_stream_bookkeeping(model):
    ids = [model.open_stream(_request("slot", seed=i, greedy=True)) for i in range(model.max_streams)]
    assert len(set(ids)) == len(ids)
    with pytest.raises(RuntimeError, match="slots"):
        model.open_stream(_request("one too many", seed=9, greedy=True))
    with pytest.raises(ValueError, match="unique"):
        model.step([ids[0], ids[0]])
    assert model.close(ids[0]) is True and model.close(ids[0]) is False
    with pytest.raises(ValueError, match="not open"):
        model.step([ids[0]])
    reopened = model.open_stream(_request("reuses the slot", seed=5, greedy=True))
    assert reopened not in ids
    for sid in ids[1:] + [reopened]:
        model.close(sid)
    assert model.open_stream_ids == () and model.step([]) == []


@pytest.mark.parametrize("greedy", [True, False])
def test_blocked_ids_and_minimum_frames(model, greedy):
    """With a codec head that scores every control id 200 and EOS 100 (audio codes 0), the talker
    still emits audio codes for its first 2 tokens (EOS blocked, control ids suppressed as
    upstream) and EOS as its third: 2 frames, then STOP."""
    talker = model.talker
    original = talker.codec_head
    vocab, hidden = original.weight.shape
    audio = talker.config.num_audio_codes
    fixed = torch.nn.Linear(hidden, vocab, bias=True)
    with torch.no_grad():
        fixed.weight.zero_()
        fixed.bias.zero_()
        fixed.bias[audio:] = 200.0
        fixed.bias[talker.config.codec_eos_token_id] = 100.0
    talker.codec_head = fixed
    try:
        frames = _record(model)
        result = synthesize(model, _request("Blocked ids.", seed=4, greedy=greedy))
    finally:
        talker.codec_head = original
        model.frame_observer = None
    (codes,) = frames.values()
    assert result.num_frames == 2 and result.finish_reason is FinishReason.STOP
    assert all(int(c[0]) < audio for c in codes)


def test_sampling_not_chosen_uses_generation_config_and_chosen_defaults_are_kept():
    from tilevox.models.registry import load_model
    from tilevox.models.sampling import SamplingParams
    from tilevox.models.streaming import SynthesisRequest

    model = load_model("random:qwen3-tts-tiny")
    g = model.generation
    talker, _ = model._sampling(SynthesisRequest(text="hi"))
    assert (talker.temperature, talker.repetition_penalty) == (g.temperature, g.repetition_penalty)
    chosen, _ = model._sampling(SynthesisRequest(text="hi", sampling=SamplingParams()))
    defaults = SamplingParams()
    assert (chosen.temperature, chosen.repetition_penalty) == (defaults.temperature, defaults.repetition_penalty)
    assert (defaults.temperature, defaults.repetition_penalty) != (
        g.temperature,
        g.repetition_penalty,
    )  # the test can tell
