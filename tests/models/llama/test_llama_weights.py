"""Llama config validation, strict checkpoint loading, dtype loading, seeded random init and KV cache rules."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.llama.config import LLAMA_PRESETS, LlamaConfig
from tilevox.models.llama.weights import load_llama, random_llama

TINY = LlamaConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_type="llama3",
    rope_factor=4.0,
    rope_original_max_position_embeddings=16,
)


def _hf_dict(config: LlamaConfig) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": config.rope_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_max_position_embeddings,
        },
    }


def _state(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    model = random_llama(config, seed=seed, device="cpu", dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def _write(tmp_path, config: LlamaConfig, state: dict[str, torch.Tensor]):
    (tmp_path / "config.json").write_text(json.dumps(_hf_dict(config)))
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_round_trip_and_config_from_dict(tmp_path):
    state = _state(TINY)
    model = load_llama(_write(tmp_path, TINY, state), device="cpu", dtype=torch.float32)
    assert model.config == TINY
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def test_missing_tensor_is_named(tmp_path):
    state = _state(TINY)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_llama(_write(tmp_path, TINY, state), device="cpu", dtype=torch.float32)


def test_unexpected_tensor_is_named(tmp_path):
    state = _state(TINY)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.0\.self_attn\.rotary_emb"):
        load_llama(_write(tmp_path, TINY, state), device="cpu", dtype=torch.float32)


def test_misshaped_tensor_is_named(tmp_path):
    state = _state(TINY)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(24, 32)  # 3 kv heads instead of 2
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(24, 32\), "
        r"expected \(16, 32\)",
    ):
        load_llama(_write(tmp_path, TINY, state), device="cpu", dtype=torch.float32)


def test_sharded_index_problems_are_named(tmp_path):
    state = _state(TINY)
    names = sorted(state)
    half = len(names) // 2
    save_file({n: state[n] for n in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({n: state[n] for n in names[half:]}, str(tmp_path / "b.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_hf_dict(TINY)))
    weight_map = {n: ("a.safetensors" if i < half else "b.safetensors") for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_llama(tmp_path, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(model.lm_head.weight, state["lm_head.weight"], rtol=0, atol=0)

    weight_map[names[0]] = "b.safetensors"  # the index points at the wrong shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"tensor '{names[0]}' is listed"):
        load_llama(tmp_path, device="cpu", dtype=torch.float32)
    weight_map[names[0]] = "c.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="c.safetensors: listed in model.safetensors.index.json but missing"):
        load_llama(tmp_path, device="cpu", dtype=torch.float32)


def test_tied_checkpoint_with_conflicting_lm_head_is_rejected(tmp_path):
    config = LlamaConfig(**{**asdict(TINY), "tie_word_embeddings": True})
    state = _state(config)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1.0
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from model.embed_tokens.weight"):
        load_llama(_write(tmp_path, config, state), device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_loads_in_requested_dtype(tmp_path, dtype):
    state = _state(TINY)
    model = load_llama(_write(tmp_path, TINY, state), device="cpu", dtype=dtype)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == dtype, name
        torch.testing.assert_close(tensor, state[name].to(dtype), rtol=0, atol=0)
    cache = model.new_cache(max_streams=2, max_seq_len=16)
    slot = cache.allocate()
    logits = model.prefill(cache, slot, torch.tensor([1, 5, 9]))
    assert logits.dtype == dtype and torch.isfinite(logits.float()).all()
    reference = load_llama(tmp_path, device="cpu", dtype=torch.float32)
    ref_cache = reference.new_cache(max_streams=1, max_seq_len=16)
    ref_logits = reference.prefill(ref_cache, ref_cache.allocate(), torch.tensor([1, 5, 9]))
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 5e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(logits.float(), ref_logits, rtol=0, atol=tolerance)


def test_random_init_is_seeded_and_tied_when_asked():
    a = random_llama(TINY, seed=5, device="cpu", dtype=torch.float32)
    b = random_llama(TINY, seed=5, device="cpu", dtype=torch.float32)
    c = random_llama(TINY, seed=6, device="cpu", dtype=torch.float32)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    tied = random_llama(
        LlamaConfig(**{**asdict(TINY), "tie_word_embeddings": True}), seed=5, device="cpu", dtype=torch.float32
    )
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_1b_preset_shapes_on_meta():
    config = LLAMA_PRESETS["1b"]
    model = random_llama(config, seed=0, device="meta", dtype=torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert num_params == 2 * 193800 * 2048 + 16 * per_layer + 2048
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (512, 2048)
    assert config.resolved_head_dim == 64 and config.num_key_value_groups == 4


def test_3_2_1b_preset_is_tied_on_meta():
    """Llama-3.2-1B: one tensor is both the embedding table and the head, so its 1,235,814,400 parameters
    (the published count) hold the 128,256 x 2,048 table once."""
    model = random_llama(LLAMA_PRESETS["3.2-1b"], seed=0, device="meta", dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.shape == (128256, 2048)
    assert len(dict(model.named_parameters(remove_duplicate=False))) == len(dict(model.named_parameters())) + 1
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert sum(p.numel() for p in model.parameters()) == 128256 * 2048 + 16 * per_layer + 2048 == 1_235_814_400


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": 30}, "multiple of num_attention_heads"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"rope_type": "yarn"}, "rope_type must be one of"),
        ({"rope_low_freq_factor": 4.0}, "low_freq_factor < high_freq_factor"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be > 0"),
    ],
)
def test_config_validation(override, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**asdict(TINY), **override})


def test_from_hf_config_rejects_unsupported():
    base = _hf_dict(TINY)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        LlamaConfig.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        LlamaConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="lacks: high_freq_factor"):
        LlamaConfig.from_hf_config(
            {
                **base,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 2.0,
                    "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 16,
                },
            }
        )
    with pytest.raises(ValueError, match="lacks required key"):
        LlamaConfig.from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})
    legacy = {**base, "rope_scaling": {**base["rope_scaling"], "type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]
    assert LlamaConfig.from_hf_config(legacy).rope_type == "llama3"


def test_kv_cache_rules():
    model = random_llama(TINY, seed=0, device="cpu", dtype=torch.float32)
    cache = model.new_cache(max_streams=2, max_seq_len=8)
    a, b = cache.allocate(), cache.allocate()
    with pytest.raises(RuntimeError, match="all 2 KV cache slots are in use"):
        cache.allocate()
    model.prefill(cache, a, torch.arange(6))
    with pytest.raises(ValueError, match="exceeds the cache length 8"):
        model.prefill(cache, a, torch.arange(3))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        model.prefill(cache, b, torch.tensor([3, 97]))
    with pytest.raises(ValueError, match="slots must be distinct"):
        model.decode(cache, [a, a], torch.tensor([1, 2]))
    model.decode(cache, [a], torch.tensor([1]))
    model.decode(cache, [a], torch.tensor([1]))
    with pytest.raises(ValueError, match="slot 0 is full"):
        model.decode(cache, [a], torch.tensor([1]))
    cache.free(b)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        model.decode(cache, [b], torch.tensor([1]))
    assert cache.allocate() == b and cache.lengths[b] == 0
