"""Parity of models.llama with transformers' LlamaForCausalLM (llama3 rope scaling, GQA, fp32).

A tiny random transformers model is saved with save_pretrained (single file and sharded), loaded by
tilevox, and three prompts of different lengths are prefilled and then decoded together for 16
steps in the batched KV cache; every logit must match a full-sequence transformers forward.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="oracle tests need transformers (pip install -e .[test])")

from tilevox.models.llama.config import LlamaConfig  # noqa: E402
from tilevox.models.llama.model import rope_inv_freq  # noqa: E402
from tilevox.models.llama.weights import load_llama  # noqa: E402

pytestmark = pytest.mark.oracle

NUM_DECODE_STEPS = 16
ATOL = 1e-4


def _hf_config(*, tie: bool, rope_type: str = "llama3") -> transformers.LlamaConfig:
    rope_scaling = None
    if rope_type == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    return transformers.LlamaConfig(
        vocab_size=301,
        hidden_size=48,
        intermediate_size=88,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )


def _random_hf_model(config, seed: int):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))  # non-unit norms so loading them matters
            else:
                param.normal_(0.0, 0.15)
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single", "sharded"])
def test_prefill_and_batched_decode_match_transformers(tmp_path, tie, max_shard_size):
    hf_config = _hf_config(tie=tie)
    hf_model = _random_hf_model(hf_config, seed=1234 + tie)
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    hf_model.save_pretrained(tmp_path, **save_kwargs)
    if max_shard_size is not None:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1

    model = load_llama(tmp_path, device="cpu", dtype=torch.float32)
    assert model.config.tie_word_embeddings is tie
    generator = torch.Generator().manual_seed(7)
    prompt_lengths = [5, 13, 8]
    prompts = [torch.randint(0, hf_config.vocab_size, (n,), generator=generator) for n in prompt_lengths]
    continuations = torch.randint(0, hf_config.vocab_size, (3, NUM_DECODE_STEPS), generator=generator)

    with torch.no_grad():
        reference = [
            hf_model(torch.cat([p, c])[None], use_cache=False).logits[0] for p, c in zip(prompts, continuations)
        ]

    cache = model.new_cache(max_streams=4, max_seq_len=64)
    slot_a = cache.allocate()
    junk_slot = cache.allocate()
    model.prefill(cache, junk_slot, torch.randint(0, hf_config.vocab_size, (40,), generator=generator))
    slot_b = cache.allocate()
    cache.free(junk_slot)  # its stale keys stay in the cache and must stay masked
    slot_c = cache.allocate()
    assert slot_c == junk_slot
    slots = [slot_a, slot_b, slot_c]
    for slot, prompt, ref in zip(slots, prompts, reference):
        logits = model.prefill(cache, slot, prompt, all_logits=True)
        torch.testing.assert_close(logits, ref[: prompt.numel()], rtol=0, atol=ATOL)
    for step in range(NUM_DECODE_STEPS):
        logits = model.decode(cache, slots, continuations[:, step])
        assert logits.shape == (3, hf_config.vocab_size)
        for row, (prompt, ref) in enumerate(zip(prompts, reference)):
            torch.testing.assert_close(logits[row], ref[prompt.numel() + step], rtol=0, atol=ATOL)
    assert [cache.lengths[s] for s in slots] == [n + NUM_DECODE_STEPS for n in prompt_lengths]


def test_decode_subsets_and_order_match_transformers(tmp_path):
    """Streams stepped in changing subsets and orders still see only their own history."""
    hf_config = _hf_config(tie=False, rope_type="default")
    hf_model = _random_hf_model(hf_config, seed=99)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model = load_llama(tmp_path, device="cpu", dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf_config.vocab_size, (n,), generator=generator) for n in (3, 9)]
    tokens = torch.randint(0, hf_config.vocab_size, (2, 7), generator=generator)
    with torch.no_grad():
        reference = [hf_model(torch.cat([p, t])[None], use_cache=False).logits[0] for p, t in zip(prompts, tokens)]
    cache = model.new_cache(max_streams=2, max_seq_len=32)
    slots = [cache.allocate(), cache.allocate()]
    for slot, prompt in zip(slots, prompts):
        model.prefill(cache, slot, prompt)
    done = [0, 0]
    schedule = [[0], [1, 0], [1], [0, 1], [1, 0], [0], [1], [0, 1], [1], [0]]
    for streams in schedule:
        batch_tokens = torch.stack([tokens[i, done[i]] for i in streams])
        logits = model.decode(cache, [slots[i] for i in streams], batch_tokens)
        for row, i in enumerate(streams):
            torch.testing.assert_close(logits[row], reference[i][prompts[i].numel() + done[i]], rtol=0, atol=ATOL)
            done[i] += 1
    assert done == [7, 7]


def test_rope_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope_type in ("default", "llama3"):
        hf_config = _hf_config(tie=False, rope_type=rope_type)
        expected, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        assert scaling == 1.0
        ours = rope_inv_freq(LlamaConfig.from_hf_config(hf_config.to_dict()))
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_from_hf_config_reads_transformers_dict():
    hf_config = _hf_config(tie=True)
    config = LlamaConfig.from_hf_config(hf_config.to_dict())
    assert config.vocab_size == 301 and config.num_key_value_heads == 2 and config.resolved_head_dim == 8
    assert config.rope_type == "llama3" and config.rope_factor == 8.0
    assert config.rope_original_max_position_embeddings == 32
    assert config.tie_word_embeddings is True
