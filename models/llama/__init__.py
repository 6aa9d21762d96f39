"""Llama 3.x decoder: config, model with a slot-based batched KV cache, and weight loading."""

from tilevox.models.llama.config import LLAMA_PRESETS, LlamaConfig
from tilevox.models.llama.model import LlamaForCausalLM, LlamaKVCache
from tilevox.models.llama.weights import load_llama, load_llama_config, random_llama

__all__ = [
    "LLAMA_PRESETS",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaKVCache",
    "load_llama",
    "load_llama_config",
    "random_llama",
]
