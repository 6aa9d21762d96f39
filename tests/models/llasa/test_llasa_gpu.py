"""CUDA runs of the Llama decoder and Llasa (skipped without a GPU): CPU parity and the full-size random preset."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama
from tilevox.models.llasa.loader import load_preset
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import FinishReason, SynthesisRequest

pytestmark = pytest.mark.gpu


def test_llama_cuda_matches_cpu():
    config = LlamaConfig(
        vocab_size=509,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_type="llama3",
        rope_factor=8.0,
        rope_original_max_position_embeddings=64,
    )
    cpu = random_llama(config, seed=0, device="cpu", dtype=torch.float32)
    gpu = random_llama(config, seed=0, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        for p_gpu, p_cpu in zip(gpu.parameters(), cpu.parameters()):
            p_gpu.copy_(p_cpu * 5.0)  # same weights on both (the generators differ); sharpened
            p_cpu.mul_(5.0)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 509, (n,), generator=generator) for n in (7, 31, 2)]
    steps = torch.randint(0, 509, (3, 9), generator=generator)
    outputs = []
    for model in (cpu, gpu):
        cache = model.new_cache(max_streams=3, max_seq_len=64)
        slots = [cache.allocate() for _ in prompts]
        logits = [model.prefill(cache, s, p).float().cpu() for s, p in zip(slots, prompts)]
        for i in range(steps.shape[1]):
            logits.append(model.decode(cache, slots, steps[:, i]).float().cpu())
        outputs.append(logits)
    for ours, ref in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-3)


def test_llama_1b_random_preset_on_cuda():
    start = time.perf_counter()
    model = load_preset("llama-1b", device="cuda", dtype=torch.bfloat16)
    load_s = time.perf_counter() - start
    assert load_s < 60.0, f"building the random 1B preset took {load_s:.1f} s"
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in model.llama.parameters())
    assert model.llama.config.vocab_size == 193800 and model.tokenizer.num_speech_tokens == 65536
    requests = [
        SynthesisRequest(text=f"Stream {i} on the GPU.", seed=i, sampling=SamplingParams(max_new_tokens=20 + i))
        for i in range(4)
    ]
    ids = [model.open_stream(r) for r in requests]
    samples = {i: [] for i in ids}
    while model.open_stream_ids:
        for chunk in model.step(list(model.open_stream_ids)):
            samples[chunk.stream_id].append(chunk.samples)
            if chunk.is_finished:
                assert chunk.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    for stream_id, pieces in samples.items():
        audio = np.concatenate(pieces)
        assert audio.size % 320 == 0 and 0 < audio.size <= (20 + ids.index(stream_id)) * 320
        assert np.isfinite(audio).all()
