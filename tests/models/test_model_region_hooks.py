"""models.region_backends hooks: models list their regions, default to the conventional path, and route
each step's region through a set backend with the conventional call's arguments (spy backends that
delegate to the conventional call leave the audio unchanged); the predictor backend gets each stream's
sampling params, seed and frame x heads RNG offset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import (
    CODE_PREDICTOR_LOOP,
    DECODER_STEP,
    TALKER_STEP,
    PredictorRows,
    region_names,
    set_region_backend,
)
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize


def _request(seed: int = 4) -> SynthesisRequest:
    return SynthesisRequest(text="Spy on me", sampling=SamplingParams(temperature=0.8), seed=seed, max_duration_s=0.3)


def test_llasa_decoder_step_hook():
    model = load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=2, max_seq_len=256)
    assert region_names(model) == (DECODER_STEP,) and model.decoder_step_backend is None
    ref = synthesize(model, _request())
    calls = []

    def spy(cache, slots, token_ids):
        calls.append((list(slots), token_ids.clone()))
        return model.llama.decode(cache, slots, token_ids)

    set_region_backend(model, DECODER_STEP, spy)
    got = synthesize(model, _request())
    np.testing.assert_array_equal(got.samples, ref.samples)
    assert len(calls) == ref.num_frames - 1 and all(len(slots) == 1 for slots, _ in calls)
    set_region_backend(model, DECODER_STEP, None)
    assert model.decoder_step_backend is None


def test_qwen3_talker_and_predictor_hooks():
    model = load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=2, max_seq_len=64))
    assert region_names(model) == (TALKER_STEP, CODE_PREDICTOR_LOOP)
    ref = synthesize(model, _request(seed=9))
    talker_calls, predictor_rows = [], []

    def talker_spy(inputs, view):
        talker_calls.append(inputs.shape)
        return model.talker.forward_tokens(inputs, view)

    def predictor_spy(hidden, code0_embedding, choose, rows: PredictorRows):
        predictor_rows.append(rows)
        return model.talker.code_predictor.predict(hidden, code0_embedding, choose)

    set_region_backend(model, TALKER_STEP, talker_spy)
    set_region_backend(model, CODE_PREDICTOR_LOOP, predictor_spy)
    got = synthesize(model, _request(seed=9))
    np.testing.assert_array_equal(got.samples, ref.samples)  # the spies delegate: same draws, same audio
    frames = ref.num_frames
    assert talker_calls == [torch.Size([1, 1, model.config.talker.transformer.hidden_size])] * frames
    heads = model.talker.code_predictor.num_steps
    assert [r.rng_offsets for r in predictor_rows] == [(frame * heads,) for frame in range(frames)]
    assert all(r.seeds == (9,) and r.params == (model._sampling(_request())[1],) for r in predictor_rows)


def test_unknown_region_names_are_refused():
    model = load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=1, max_seq_len=64))
    with pytest.raises(ValueError, match="Qwen3TTSSpeechModel has no region 'decoder_step'; its regions: talker_step"):
        set_region_backend(model, DECODER_STEP, lambda *a: None)
    assert region_names(object()) == ()
    with pytest.raises(ValueError, match="one params, seed and rng offset per row"):
        PredictorRows(params=(SamplingParams(),), seeds=(), rng_offsets=(0,))
