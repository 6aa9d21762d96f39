"""Megakernel region backends on CPU through the VM executor: the Llasa decoder step and the Qwen3-TTS
talker step and code-predictor loop give the conventional path's tokens, codes and audio (fp32, greedy)
and logits within VM tolerance; construction refuses what can never run, a call it cannot take runs
conventionally with its reason logged once; region names parse or fail with the valid names."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from tests.conftest import sampled_frames
from tilevox.engine_builder.regions import BackendOptions, Executor, MegakernelUnavailable, install_megakernel_regions
from tilevox.engine_builder.regions.backends import (
    LOGGER_NAME,
    MegakernelCodePredictorLoop,
    MegakernelDecoderStep,
    MegakernelTalkerStep,
    parse_regions,
)
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import (
    CODE_PREDICTOR_LOOP,
    DECODER_STEP,
    TALKER_STEP,
    PredictorRows,
    set_region_backend,
)
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize

VM = BackendOptions(executor=Executor.VM)
ATOL = 2e-5


def _llasa(**kw):
    return load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=4, max_seq_len=256, **kw)


def _qwen3():
    return load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=3, max_seq_len=64))


def _greedy_request(text: str, seconds: float) -> SynthesisRequest:
    return SynthesisRequest(text=text, sampling=SamplingParams.greedy(), max_duration_s=seconds, seed=3)


def _megakernel_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME and r.levelno >= logging.WARNING]


def test_llasa_decoder_step_vm_equals_conventional():
    """Whole utterance: same tokens, bit-identical audio; every decode went through the region."""
    request = _greedy_request("Hello there, how are you", 0.4)
    tokens: dict[str, list[int]] = {"ref": [], "vm": []}
    model = _llasa()
    model.token_observer = lambda _sid, tok: tokens["ref"].append(tok)
    ref = synthesize(model, request)
    assert install_megakernel_regions(model, [DECODER_STEP], VM) == {DECODER_STEP: None}
    model.token_observer = lambda _sid, tok: tokens["vm"].append(tok)
    got = synthesize(model, request)
    assert len(tokens["ref"]) >= 10 and tokens["vm"] == tokens["ref"]
    np.testing.assert_array_equal(got.samples, ref.samples)
    backend = model.decoder_step_backend
    assert backend.num_megakernel_calls == ref.num_frames - 1 and backend.num_conventional_calls == 0


def test_decoder_step_logits_for_streams_at_different_positions():
    model = _llasa()
    llama = model.llama
    ref_cache = llama.new_cache(max_streams=4, max_seq_len=256)
    vm_cache = llama.new_cache(max_streams=4, max_seq_len=256)
    gen = torch.Generator().manual_seed(4)
    slots = [3, 0, 2]
    for cache in (ref_cache, vm_cache):
        for _ in range(4):
            cache.allocate()
    for slot, length in zip(slots, [2, 23, 9]):
        prompt = torch.randint(0, llama.config.vocab_size, (length,), generator=gen)
        llama.prefill(ref_cache, slot, prompt)
        llama.prefill(vm_cache, slot, prompt)
    backend = MegakernelDecoderStep(llama, VM)
    tokens = torch.randint(0, llama.config.vocab_size, (3,), generator=gen)
    for _ in range(3):
        ref = llama.decode(ref_cache, slots, tokens)
        got = backend(vm_cache, slots, tokens)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-5)
        assert vm_cache.lengths == ref_cache.lengths
        tokens = ref.argmax(-1)
    torch.testing.assert_close(vm_cache.k, ref_cache.k, atol=ATOL, rtol=1e-5)
    # Calls decode itself would refuse are not fallbacks: they raise decode's own error.
    with pytest.raises(ValueError, match="distinct"):
        backend(vm_cache, [0, 0], tokens[:2])


def test_qwen3_regions_vm_equal_conventional():
    """Talker step + code-predictor loop through the VM: same frames, bit-identical audio."""
    request = _greedy_request("Good morning", 0.5)
    frames: dict[str, list[torch.Tensor]] = {"ref": [], "vm": []}
    model = _qwen3()
    model.frame_observer = lambda _sid, codes: frames["ref"].append(codes)
    ref = synthesize(model, request)
    assert install_megakernel_regions(model, [TALKER_STEP, CODE_PREDICTOR_LOOP], VM) == {
        TALKER_STEP: None,
        CODE_PREDICTOR_LOOP: None,
    }
    model.frame_observer = lambda _sid, codes: frames["vm"].append(codes)
    got = synthesize(model, request)
    assert len(frames["ref"]) >= 5
    assert torch.equal(torch.stack(frames["vm"]), torch.stack(frames["ref"]))
    np.testing.assert_array_equal(got.samples, ref.samples)
    assert model.talker_step_backend.num_megakernel_calls == ref.num_frames
    assert model.code_predictor_loop_backend.num_megakernel_calls == ref.num_frames


def test_talker_step_outputs_match_forward_tokens():
    model = _qwen3()
    talker = model.talker
    hidden_size = talker.config.transformer.hidden_size
    ref_cache = talker.new_cache(num_slots=3, max_len=64)
    vm_cache = talker.new_cache(num_slots=3, max_len=64)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        ref_cache.keys.copy_(torch.randn(ref_cache.keys.shape, generator=gen))
        ref_cache.values.copy_(torch.randn(ref_cache.values.shape, generator=gen))
    vm_cache.keys.copy_(ref_cache.keys)
    vm_cache.values.copy_(ref_cache.values)
    inputs = torch.randn(2, 1, hidden_size, generator=gen)
    backend = MegakernelTalkerStep(talker, VM)

    def view(cache):
        return CacheView(cache=cache, slots=torch.tensor([2, 0]), start=torch.tensor([17, 5]), kv_len=18)

    with torch.no_grad():
        ref_hidden, ref_logits = talker.forward_tokens(inputs, view(ref_cache))
        got_hidden, got_logits = backend(inputs, view(vm_cache))
    torch.testing.assert_close(got_hidden, ref_hidden, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got_logits, ref_logits, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(vm_cache.keys, ref_cache.keys, atol=ATOL, rtol=1e-5)


def test_sampled_predictor_codes_do_not_depend_on_the_batch():
    """With on-device sampling, a stream's frames are the same stepped alone or with another stream
    (its draws use only its seed and frame index), and a different seed gives other codes."""
    params = SamplingParams(temperature=0.9, top_k=30)

    def frames_of(seeds: list[int]) -> dict[int, list[torch.Tensor]]:
        model = _qwen3()
        install_megakernel_regions(model, [CODE_PREDICTOR_LOOP], VM)
        return sampled_frames(model, seeds, params, steps=4)

    together = frames_of([5, 6])
    alone = frames_of([5])
    n = min(len(alone[5]), len(together[5]))
    assert n >= 2
    assert torch.equal(torch.stack(alone[5][:n]), torch.stack(together[5][:n]))
    assert not torch.equal(torch.stack(together[5][:n]), torch.stack(together[6][:n]))


def test_cuda_executor_on_cpu_falls_back_with_a_logged_reason(caplog):
    request = _greedy_request("Fallback please", 0.3)
    model = _qwen3()
    ref = synthesize(model, request)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        result = install_megakernel_regions(model, [TALKER_STEP, CODE_PREDICTOR_LOOP], BackendOptions())
    assert result == {TALKER_STEP: "no CUDA device is visible", CODE_PREDICTOR_LOOP: "no CUDA device is visible"}
    assert _megakernel_records(caplog) == [
        "megakernel region talker_step: conventional path: no CUDA device is visible",
        "megakernel region code_predictor_loop: conventional path: no CUDA device is visible",
    ]
    assert model.talker_step_backend is None and model.code_predictor_loop_backend is None
    got = synthesize(model, request)
    np.testing.assert_array_equal(got.samples, ref.samples)


def test_batch_above_the_limit_runs_conventionally_and_logs_once(caplog):
    """max_batch 1: two streams stepped together decode conventionally (one warning for all steps),
    a stream stepped alone goes through the region; the tokens equal an all-conventional run."""
    requests = [_greedy_request("First stream", 0.3), _greedy_request("Second one here", 0.3)]

    def run(model) -> list[list[int]]:
        tokens: dict[int, list[int]] = {}
        model.token_observer = lambda sid, tok: tokens.setdefault(sid, []).append(tok)
        ids = [model.open_stream(r) for r in requests]
        for _ in range(4):
            model.step(ids)
        for _ in range(3):
            model.step(ids[:1])
        return [tokens[i] for i in ids]

    ref = run(_llasa())
    model = _llasa()
    install_megakernel_regions(model, [DECODER_STEP], BackendOptions(executor=Executor.VM, max_batch=1))
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        got = run(model)
    assert got == ref
    assert _megakernel_records(caplog) == [
        "megakernel region decoder_step: conventional path: batch 2 exceeds max_batch 1"
    ]
    backend = model.decoder_step_backend
    assert backend.num_conventional_calls == 4 and backend.num_megakernel_calls == 3


def test_predictor_sampling_it_cannot_do_runs_conventionally(caplog):
    model = _qwen3()
    predictor = model.talker.code_predictor
    backend = MegakernelCodePredictorLoop(predictor, VM)
    hidden_size = model.talker.config.transformer.hidden_size
    gen = torch.Generator().manual_seed(2)
    hidden, code0 = torch.randn(2, hidden_size, generator=gen), torch.randn(2, hidden_size, generator=gen)
    rows = PredictorRows(
        params=(SamplingParams.greedy(repetition_penalty=1.3), SamplingParams.greedy()),
        seeds=(0, 1),
        rng_offsets=(0, 0),
    )
    calls = []

    def choose(head, logits):
        calls.append(head)
        return logits.argmax(-1)

    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME), torch.no_grad():
        got = backend(hidden, code0, choose, rows)
        backend(hidden, code0, choose, rows)
        ref = predictor.predict(hidden, code0, lambda head, logits: logits.argmax(-1))
    assert torch.equal(got, ref) and calls == list(range(predictor.num_steps)) * 2
    (message,) = _megakernel_records(caplog)
    assert message.startswith("megakernel region code_predictor_loop: conventional path: stream 0:")
    assert "repetition penalty" in message


def test_construction_refuses_what_the_kernel_cannot_run():
    config = dataclasses.replace(
        LlamaConfig.preset("tiny"), hidden_size=528, num_attention_heads=2, num_key_value_heads=1
    )
    wide_heads = random_llama(config, seed=0, device="cpu", dtype=torch.float32)
    with pytest.raises(MegakernelUnavailable, match="head_dim 264 is odd or above the kernel's 256"):
        MegakernelDecoderStep(wide_heads, VM)
    float64 = random_llama(LlamaConfig.preset("tiny"), seed=0, device="cpu", dtype=torch.float32).double()
    with pytest.raises(MegakernelUnavailable, match="dtype torch.float64"):
        MegakernelDecoderStep(float64, VM)
    with pytest.raises(MegakernelUnavailable, match="no CUDA device"):
        MegakernelDecoderStep(float64, BackendOptions())
    # What the fused SwiGLU swap leaves: an MLP module without the gate/up/down projections.
    swapped = random_llama(LlamaConfig.preset("tiny"), seed=0, device="cpu", dtype=torch.float32)
    swapped.model.layers[1].mlp = torch.nn.Identity()
    with pytest.raises(MegakernelUnavailable, match="fused SwiGLU swap removes them"):
        MegakernelDecoderStep(swapped, VM)


def test_region_names_parse_and_bad_names_fail():
    llasa, qwen3 = _llasa(), _qwen3()
    assert parse_regions(llasa, "all") == (DECODER_STEP,)
    assert parse_regions(qwen3, "all") == (TALKER_STEP, CODE_PREDICTOR_LOOP)
    assert parse_regions(qwen3, " none ") == () and parse_regions(qwen3, "") == ()
    assert parse_regions(qwen3, "code_predictor_loop, talker_step,code_predictor_loop") == (
        CODE_PREDICTOR_LOOP,
        TALKER_STEP,
    )
    with pytest.raises(
        ValueError, match=r"unknown megakernel region\(s\) 'talker_step'; valid: decoder_step, all, none"
    ):
        parse_regions(llasa, "talker_step")
    with pytest.raises(ValueError, match="LlasaModel has no region 'talker_step'"):
        set_region_backend(llasa, TALKER_STEP, None)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        BackendOptions(max_batch=0)
