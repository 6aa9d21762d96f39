"""The Llama forward under torch.compile: nothing it reads is created by its own first call, so a second call with
the same inputs runs the same compiled code. The executor's second call of a region is its CUDA-graph capture,
where compiling again fails (H100, 2026-12-07: the compiled Llasa prefill recompiled on a guard of the lazily made
rope table, `self._inv_freq is None`, and Inductor's constant folding then read a tensor during the capture)."""

from __future__ import annotations

import torch
import torch._dynamo

from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama


def test_a_compiled_prefill_is_not_compiled_again_on_its_second_call():
    torch._dynamo.reset()
    model = random_llama(LlamaConfig.preset("tiny"), seed=3, device="cpu", dtype=torch.float32)
    cache = model.new_cache(max_streams=3, max_seq_len=32)
    tokens = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    slots, last = torch.tensor([2, 0]), torch.tensor([8, 5])
    prefill = torch.compile(model.prefill_tokens, backend="eager", fullgraph=True)
    first = prefill(tokens, cache, slots, last)
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = prefill(tokens, cache, slots, last)  # RecompileError before the rope table was made eagerly
    assert torch.equal(first, second)
    torch.testing.assert_close(first, model.prefill_tokens(tokens, cache, slots, last))


def test_the_rope_table_follows_the_module_and_stays_fp32():
    model = random_llama(LlamaConfig.preset("tiny"), seed=3, device="cpu", dtype=torch.float32)
    table = model._inv_freq
    assert table.dtype == torch.float32 and table.device.type == "cpu"
    model.to(torch.bfloat16)
    assert model._inv_freq.dtype == torch.float32
    torch.testing.assert_close(model._inv_freq, table, rtol=0, atol=0)
    model.to("meta")
    assert model._inv_freq.device.type == "meta" and model._inv_freq.dtype == torch.float32
