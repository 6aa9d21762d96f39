"""Qwen3-TTS open_streams: several prompts in one batched talker prefill give every stream what it gets
when opened alone (greedy frames identical, fp32 audio within 1e-5); a bad request fails alone; slots
run out per request, not for the whole batch."""

from __future__ import annotations

import numpy as np
import torch

from tilevox.models.errors import RequestError
from tilevox.models.qwen3_tts.loader import load_preset
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest

TEXTS = ["Hi.", "A somewhat longer prompt than the first one, to pad.", "Third, middling length."]


def _model(max_streams: int = 4):
    return load_preset("qwen3-tts-tiny", options=ModelOptions(max_streams=max_streams, max_seq_len=256))


def _request(text: str, seed: int) -> SynthesisRequest:
    return SynthesisRequest(text=text, sampling=SamplingParams.greedy(), seed=seed, max_duration_s=1.5)


def _drain(model, ids: list[int]) -> tuple[dict[int, list[torch.Tensor]], dict[int, np.ndarray]]:
    frames: dict[int, list[torch.Tensor]] = {}
    model.frame_observer = lambda sid, codes: frames.setdefault(sid, []).append(codes)
    audio: dict[int, list[np.ndarray]] = {i: [] for i in ids}
    while live := [i for i in ids if i in model.open_stream_ids]:
        for chunk in model.step(live):
            audio[chunk.stream_id].append(chunk.samples)
    return frames, {i: np.concatenate(a) for i, a in audio.items()}


def test_batched_prefill_equals_opening_alone():
    batched = _model()
    ids = batched.open_streams([_request(t, n) for n, t in enumerate(TEXTS)])
    assert all(isinstance(i, int) for i in ids)
    frames, audio = _drain(batched, ids)
    for n, text in enumerate(TEXTS):
        alone = _model()
        sid = alone.open_stream(_request(text, n))
        alone_frames, alone_audio = _drain(alone, [sid])
        assert len(frames[ids[n]]) > 3
        assert torch.equal(torch.stack(frames[ids[n]]), torch.stack(alone_frames[sid]))
        np.testing.assert_allclose(audio[ids[n]], alone_audio[sid], atol=1e-5, rtol=0)


def test_a_bad_request_or_a_full_model_fails_only_its_own_request():
    model = _model(max_streams=2)
    results = model.open_streams(
        [
            _request("Good", 1),
            SynthesisRequest(text="Bad voice", voice="nobody"),
            _request("Also good", 2),
            _request("x", 3),
        ]
    )
    assert isinstance(results[0], int) and isinstance(results[2], int)
    assert isinstance(results[1], RequestError) and "nobody" in str(results[1])
    assert isinstance(results[3], RuntimeError) and "slots are in use" in str(results[3])
    assert set(model.open_stream_ids) == {results[0], results[2]}
