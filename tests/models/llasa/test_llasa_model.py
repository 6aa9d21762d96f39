"""LlasaModel streaming: stream independence, greedy parity with a full recompute, limits, slots, validation."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from tilevox.models.errors import RequestError
from tilevox.models.llasa.loader import load_preset
from tilevox.models.llasa.model import LlasaModel, StreamCapacityError
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import FinishReason, SynthesisRequest, VoiceInfo, VoicePrompt, synthesize
from tilevox.models.xcodec2.streaming import XCodec2StreamDecoder

HOP = 320


def _tiny(*, max_streams: int = 4, end_scale: float | None = None, max_seq_len: int | None = None) -> LlasaModel:
    """The random tiny preset with its matrices scaled from std 0.02 to 0.2, so that attention (and a
    stream's whole history) visibly moves the logits; `end_scale` enlarges the end token's lm_head row
    so that streams stop by themselves after a data-dependent number of steps."""
    model = load_preset(
        "llama-tiny", device="cpu", dtype=torch.float32, max_streams=max_streams, max_seq_len=max_seq_len
    )
    with torch.no_grad():
        for name, param in model.llama.named_parameters():
            if param.dim() == 2 and name != "lm_head.weight":
                param.mul_(10.0)
        if end_scale is not None:
            model.llama.lm_head.weight[model.tokenizer.speech_end_id] *= end_scale
    return model


class _Recorder:
    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = defaultdict(list)

    def __call__(self, stream_id: int, token_id: int) -> None:
        self.tokens[stream_id].append(token_id)


def _run_alone(model: LlasaModel, request: SynthesisRequest):
    stream_id = model.open_stream(request)
    pieces, reasons = [], []
    while True:
        (chunk,) = model.step([stream_id])
        pieces.append(chunk.samples)
        if chunk.is_finished:
            reasons.append(chunk.finish_reason)
            break
    return stream_id, np.concatenate(pieces), reasons[0]


def _sampling(greedy: bool, **kw) -> SamplingParams:
    return SamplingParams.greedy(**kw) if greedy else SamplingParams(temperature=0.9, top_k=40, top_p=0.95, **kw)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_streams_are_independent(greedy):
    main = SynthesisRequest(
        text="The stream under test.", seed=1234, sampling=_sampling(greedy, min_new_tokens=45, max_new_tokens=45)
    )

    alone_model = _tiny(max_streams=4, end_scale=3.0)
    alone_rec = _Recorder()
    alone_model.token_observer = alone_rec
    alone_id, alone_audio, alone_reason = _run_alone(alone_model, main)
    alone_tokens = alone_rec.tokens[alone_id]
    assert alone_reason is FinishReason.LENGTH and len(alone_tokens) == 45
    assert alone_audio.size == 45 * HOP

    model = _tiny(max_streams=4, end_scale=3.0)
    rec = _Recorder()
    model.token_observer = rec

    def other(i: int, min_new_tokens: int = 0) -> SynthesisRequest:
        # Longer prompts than the main one: its batch-mates sit at later positions than it does.
        return SynthesisRequest(
            text=f"Another, rather longer stream, number {i}" + "!" * i,
            seed=100 + i,
            sampling=_sampling(greedy, min_new_tokens=min_new_tokens, max_new_tokens=30 + i),
        )

    # other(1) cannot stop before step 20, so it is still open when it is cancelled at step 6.
    others = [model.open_stream(other(0)), model.open_stream(other(1, min_new_tokens=20))]
    # The main stream inherits a slot whose cache still holds another stream's keys.
    junk = model.open_stream(SynthesisRequest(text="A long stream that is cancelled early, leaving stale keys " * 2))
    model.step([junk, others[0]])
    model.close(junk)
    main_id = model.open_stream(main)
    assert model._streams[main_id].slot == 2
    main_pieces, finished_others, cancelled = [], 0, 0
    step = 0
    while True:
        if step == 3:
            others.append(model.open_stream(other(2)))
        if step == 6:
            cancelled += model.close(others[1])
        if step in (9, 17) and len(model.open_stream_ids) < model.max_streams:
            others.append(model.open_stream(other(3 + step)))
        ids = list(model.open_stream_ids)
        if step % 2:
            ids.reverse()  # batch order changes from step to step
        chunks = model.step(ids)
        by_id = {c.stream_id: c for c in chunks}
        for c in chunks:
            if c.stream_id != main_id and c.is_finished:
                finished_others += 1
        main_chunk = by_id[main_id]
        main_pieces.append(main_chunk.samples)
        step += 1
        if main_chunk.is_finished:
            assert main_chunk.finish_reason is FinishReason.LENGTH
            break
    assert cancelled == 1
    assert finished_others >= 1, "some other stream should finish while the main one runs"
    assert rec.tokens[main_id] == alone_tokens
    np.testing.assert_allclose(np.concatenate(main_pieces), alone_audio, rtol=0, atol=1e-5)


def test_greedy_tokens_match_full_recompute_and_audio_is_the_codec_of_the_codes():
    model = _tiny(end_scale=3.0)
    rec = _Recorder()
    model.token_observer = rec
    request = SynthesisRequest(text="Greedy parity", sampling=SamplingParams.greedy(max_new_tokens=80))
    stream_id, audio, reason = _run_alone(model, request)
    tokens = rec.tokens[stream_id]
    assert reason is FinishReason.STOP and tokens[-1] == model.tokenizer.speech_end_id
    assert len(tokens) >= 3

    prompt = model.tokenizer.prompt_ids(request.text)
    cache = model.llama.new_cache(max_streams=1, max_seq_len=len(prompt) + len(tokens))
    slot = cache.allocate()
    logits = model.llama.prefill(cache, slot, torch.tensor(prompt + tokens[:-1]), all_logits=True)
    masked = logits[len(prompt) - 1 :].float() + model._logit_mask
    assert masked.argmax(dim=-1).tolist() == tokens

    codes = torch.tensor(tokens[:-1]) - model.tokenizer.speech_offset
    assert int(codes.min()) >= 0
    reference = XCodec2StreamDecoder(model.codec)
    expected = np.concatenate([reference.push(codes[i : i + 1]) for i in range(codes.numel())] + [reference.flush()])
    np.testing.assert_array_equal(audio, expected)
    assert audio.size == codes.numel() * HOP


def test_non_speech_tokens_are_never_sampled():
    model = _tiny()
    rec = _Recorder()
    model.token_observer = rec
    text_id = model.tokenizer.backend.token_to_id("A")
    with torch.no_grad():  # a text token that would win every argmax without the mask
        model.llama.lm_head.weight[text_id] = model.llama.model.norm.weight * 50.0
    for greedy in (True, False):
        request = SynthesisRequest(text="Mask", sampling=_sampling(greedy, max_new_tokens=12))
        stream_id, _, _ = _run_alone(model, request)
        assert len(rec.tokens[stream_id]) == 12
        assert all(model.tokenizer.speech_code(t) is not None for t in rec.tokens[stream_id])


def test_limits_finish_with_length():
    model = _tiny()
    _, audio, reason = _run_alone(
        model, SynthesisRequest(text="Short", max_duration_s=0.1, sampling=SamplingParams(max_new_tokens=50))
    )
    assert reason is FinishReason.LENGTH and audio.size == 5 * HOP  # 0.1 s at 50 frames/s
    _, audio, reason = _run_alone(model, SynthesisRequest(text="Short", sampling=SamplingParams(max_new_tokens=7)))
    assert reason is FinishReason.LENGTH and audio.size == 7 * HOP
    prompt_len = len(model.tokenizer.prompt_ids("Short"))
    small = _tiny(max_seq_len=prompt_len + 3)
    _, audio, reason = _run_alone(small, SynthesisRequest(text="Short"))
    assert reason is FinishReason.LENGTH and audio.size == 3 * HOP  # the context holds 3 more tokens
    with pytest.raises(RequestError, match="text is too long"):
        small.validate(SynthesisRequest(text="Short and then some"))


def test_min_new_tokens_holds_back_the_end_token():
    model = _tiny(end_scale=8.0)
    _, audio, reason = _run_alone(
        model, SynthesisRequest(text="Hold", sampling=SamplingParams.greedy(min_new_tokens=6, max_new_tokens=40))
    )
    assert audio.size >= 6 * HOP and reason is FinishReason.STOP


def test_slots_are_freed_on_close_and_finish():
    model = _tiny(max_streams=3)
    request = SynthesisRequest(text="Slots", sampling=SamplingParams(max_new_tokens=2))
    ids = [model.open_stream(request) for _ in range(3)]
    assert len(set(ids)) == 3 and model.open_stream_ids == tuple(ids)
    with pytest.raises(StreamCapacityError, match="all 3 streams are open"):
        model.open_stream(request)
    assert model.close(ids[1]) is True
    assert model.close(ids[1]) is False
    new_id = model.open_stream(request)
    assert new_id not in ids
    with pytest.raises(ValueError, match="not open"):
        model.step([ids[1]])
    with pytest.raises(ValueError, match="distinct"):
        model.step([ids[0], ids[0]])
    for _ in range(2):  # max_new_tokens=2: the second step finishes every stream and frees its slot
        chunks = model.step(list(model.open_stream_ids))
    assert all(c.finish_reason is FinishReason.LENGTH for c in chunks)
    assert model.open_stream_ids == () and model.step([]) == []
    assert len([model.open_stream(request) for _ in range(3)]) == 3


def test_voices_and_request_validation():
    model = _tiny()
    assert model.voices() == (
        VoiceInfo(name="default", languages=("zh", "en"), description=model.voices()[0].description),
    )
    model.validate(SynthesisRequest(text="ok", voice="default"))
    model.validate(SynthesisRequest(text="ok"))
    with pytest.raises(RequestError, match="voice 'alice' is unknown"):
        model.validate(SynthesisRequest(text="ok", voice="alice"))
    with pytest.raises(RequestError, match="language"):
        model.validate(SynthesisRequest(text="ok", language="en"))
    with pytest.raises(RequestError, match="instructions"):
        model.validate(SynthesisRequest(text="ok", instructions="whisper"))
    with pytest.raises(RequestError, match="voice_prompt"):
        model.validate(
            SynthesisRequest(text="ok", voice_prompt=VoicePrompt(samples=np.ones(10, np.float32), sample_rate_hz=16000))
        )
    with pytest.raises(RequestError, match="special token"):
        model.open_stream(SynthesisRequest(text="hi <|s_1|>"))
    assert model.open_stream_ids == ()


def test_synthesize_end_to_end():
    model = _tiny()
    assert model.is_random and model.sample_rate_hz == 16000 and model.frame_rate_hz == 50.0
    result = synthesize(model, SynthesisRequest(text="Hello there", max_duration_s=0.5, seed=3))
    assert result.finish_reason is FinishReason.LENGTH
    assert result.num_frames == 25 and result.samples.size == 25 * HOP
    assert result.samples.dtype == np.float32 and np.isfinite(result.samples).all()
    assert model.open_stream_ids == ()


def test_open_streams_prefills_a_batch_as_each_prompt_alone():
    """One batched prefill of prompts of different lengths: each stream's greedy tokens equal its tokens
    opened alone; a bad request and one beyond capacity fail alone, the others open."""
    texts = ["Batched prefill", "A much longer prompt that pads the others in the batch", "Mid length one"]
    requests = [SynthesisRequest(text=t, sampling=_sampling(True), max_duration_s=0.4, seed=1) for t in texts]
    alone = {}
    for n, request in enumerate(requests):
        model, recorder = _tiny(), _Recorder()
        model.token_observer = recorder
        stream_id, _, _ = _run_alone(model, request)
        alone[n] = recorder.tokens[stream_id]
    model, recorder = _tiny(max_streams=3), _Recorder()
    model.token_observer = recorder
    bad = SynthesisRequest(text="Bad", voice="nobody")
    opened = model.open_streams([requests[0], bad, requests[1], requests[2], requests[0]])
    assert isinstance(opened[1], RequestError) and isinstance(opened[4], StreamCapacityError)
    ids = [opened[0], opened[2], opened[3]]
    while live := [i for i in ids if i in model.open_stream_ids]:
        model.step(live)
    for n, stream_id in enumerate(ids):
        assert len(alone[n]) > 5 and recorder.tokens[stream_id] == alone[n]


def test_prefill_many_equals_one_prompt_at_a_time():
    model = _tiny(max_streams=3)
    cache, gen = model._cache, torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 2000, (n,), generator=gen) for n in (5, 17, 9)]
    slots = [cache.allocate() for _ in prompts]
    many = model.llama.prefill_many(cache, slots, prompts)
    assert [cache.lengths[s] for s in slots] == [5, 17, 9]
    for slot in slots:
        cache.free(slot)
    for row, prompt in enumerate(prompts):
        slot = cache.allocate()
        torch.testing.assert_close(many[row], model.llama.prefill(cache, slot, prompt), atol=1e-5, rtol=0)
        cache.free(slot)
    slot = cache.allocate()
    model.llama.prefill(cache, slot, prompts[0])
    with pytest.raises(ValueError, match="fills empty slots"):
        model.llama.prefill_many(cache, [slot], prompts[:1])
