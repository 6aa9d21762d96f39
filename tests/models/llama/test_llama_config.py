"""LlamaConfig <-> transformers' config.json."""

from __future__ import annotations

import dataclasses

import pytest

from tilevox.models.llama.config import LlamaConfig


@pytest.mark.parametrize("name", ["tiny", "1b", "3.2-1b"])
def test_hf_config_round_trip(name):
    """to_hf_config writes the config.json that from_hf_config reads back to the same config."""
    config = LlamaConfig.preset(name)
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config


# meta-llama/Llama-3.2-1B's config.json as published (the keys that shape the network; bos/eos ids, dtype and
# transformers' bookkeeping left out).
LLAMA_3_2_1B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}


def test_3_2_1b_is_llama_3_2_1b():
    """The "3.2-1b" preset is exactly the published Llama-3.2-1B config, and differs from "1b" (Llasa-1B's
    network) only in the vocabulary and the tied head."""
    preset = LlamaConfig.preset("3.2-1b")
    assert LlamaConfig.from_hf_config(LLAMA_3_2_1B_CONFIG_JSON) == preset
    assert dataclasses.replace(LlamaConfig.preset("1b"), vocab_size=128256, tie_word_embeddings=True) == preset
