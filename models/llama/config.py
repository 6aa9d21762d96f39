"""Configuration of a Llama decoder (Llama 3.x layout, as transformers' LlamaConfig).

`LlamaConfig` is frozen and validated on construction; `from_hf_config` reads a checkpoint's
config.json with transformers' defaults for absent keys (unknown keys are logged, wrongly typed
ones refused naming the key: models.config_fields), and `PRESETS` holds exact-size shapes for
random-weight models. Imports: stdlib, models.config_fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tilevox.models.config_fields import config_bool, config_float, config_int, log_unknown_fields

__all__ = ["LLAMA_PRESETS", "LlamaConfig"]

_ROPE_TYPES = ("default", "llama3")
# transformers LlamaConfig fields: read above, or known not to change inference (pretraining_tp
# only splits the matmuls; mlp/attention dropout are off at inference). Others are logged.
_HF_KNOWN_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "partial_rotary_factor",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "model_type",
        "pretraining_tp",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads (transformers' rule)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    # llama3 rope scaling (ignored for rope_type "default")
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}) when head_dim is not given"
            )
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            raise ValueError(f"head_dim must be a positive integer or None, got {self.head_dim!r}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.resolved_head_dim}")
        if not (self.rms_norm_eps > 0.0):
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0.0) or not math.isfinite(self.rope_theta):
            raise ValueError(f"rope_theta must be a positive finite number, got {self.rope_theta}")
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "llama3":
            if not (self.rope_factor >= 1.0):
                raise ValueError(f"llama3 rope factor must be >= 1, got {self.rope_factor}")
            if not (0.0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
                raise ValueError(
                    "llama3 rope needs 0 < low_freq_factor < high_freq_factor, got "
                    f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
                )
            if self.rope_original_max_position_embeddings <= 0:
                raise ValueError(
                    "llama3 rope original_max_position_embeddings must be positive, got "
                    f"{self.rope_original_max_position_embeddings}"
                )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def with_vocab_size(self, vocab_size: int) -> LlamaConfig:
        return replace(self, vocab_size=vocab_size)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, source: str = "config.json") -> LlamaConfig:
        """Build from a transformers LlamaConfig dict (config.json); absent keys take transformers' defaults.

        Raises ValueError naming the key (and the expected type) for a wrongly typed value or anything
        this decoder does not implement; unknown keys are accepted and logged once (models.config_fields)."""
        if not isinstance(hf, dict):
            raise ValueError(f"config must be a dict, got {type(hf).__name__}")
        log_unknown_fields(hf, _HF_KNOWN_FIELDS, source=source)
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"config.json model_type must be 'llama', got {model_type!r}")
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json hidden_act {hidden_act!r} is not supported (only 'silu')")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [key for key in required if key not in hf]
        if missing:
            raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")
        rope_kwargs: dict[str, Any] = {}
        scaling = hf.get("rope_scaling")
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise ValueError(f"config.json rope_scaling must be an object or null, got {scaling!r}")
            # transformers accepts the older key "type" for "rope_type"
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type not in _ROPE_TYPES:
                raise ValueError(f"config.json rope_scaling type {rope_type!r} is not supported; known: {_ROPE_TYPES}")
            rope_kwargs["rope_type"] = rope_type
            if rope_type == "llama3":
                keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                absent = [key for key in keys if key not in scaling]
                if absent:
                    raise ValueError(f"config.json llama3 rope_scaling lacks: {', '.join(absent)}")
                rope_kwargs.update(
                    rope_factor=config_float(scaling, "factor", section="rope_scaling"),
                    rope_low_freq_factor=config_float(scaling, "low_freq_factor", section="rope_scaling"),
                    rope_high_freq_factor=config_float(scaling, "high_freq_factor", section="rope_scaling"),
                    rope_original_max_position_embeddings=config_int(
                        scaling, "original_max_position_embeddings", section="rope_scaling"
                    ),
                )
        if config_float(hf, "partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json partial_rotary_factor != 1 is not supported")
        num_heads = config_int(hf, "num_attention_heads")
        return cls(
            vocab_size=config_int(hf, "vocab_size"),
            hidden_size=config_int(hf, "hidden_size"),
            intermediate_size=config_int(hf, "intermediate_size"),
            num_hidden_layers=config_int(hf, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=config_int(hf, "num_key_value_heads", num_heads),
            head_dim=config_int(hf, "head_dim", None),
            max_position_embeddings=config_int(hf, "max_position_embeddings", 2048),
            rms_norm_eps=config_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=config_float(hf, "rope_theta", 10000.0),
            tie_word_embeddings=config_bool(hf, "tie_word_embeddings", False),
            attention_bias=config_bool(hf, "attention_bias", False),
            mlp_bias=config_bool(hf, "mlp_bias", False),
            **rope_kwargs,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers LlamaConfig dict (config.json) that `from_hf_config` reads back to this config."""
        hf: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
        }
        if self.head_dim is not None:
            hf["head_dim"] = self.head_dim
        if self.rope_type == "llama3":
            hf["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_factor,
                "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings,
            }
        return hf

    @classmethod
    def preset(cls, name: str) -> LlamaConfig:
        if name not in LLAMA_PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; known: {', '.join(LLAMA_PRESETS)}")
        return LLAMA_PRESETS[name]


# meta-llama/Llama-3.2-1B itself: its config.json (hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64,
# intermediate 8192, rms_norm_eps 1e-5, rope_theta 500000 with llama3 scaling factor 32 / low 1 / high 4 /
# original 8192, 131072 positions, no biases), 128,256 tokens, the head TIED to the embedding table:
# 1,235,814,400 parameters.
_LLAMA_3_2_1B = LlamaConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_type="llama3",
    rope_factor=32.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_position_embeddings=8192,
    tie_word_embeddings=True,
)

LLAMA_PRESETS: dict[str, LlamaConfig] = {
    # Llama-3.2-1B shapes with Llasa-1B's vocabulary: 128256 Llama tokens + 8 Llasa markers + 65536
    # speech tokens = 193800. Untied: Llasa's single 3.53 GB bf16 safetensors is 1.77 B parameters,
    # which only adds up with a separate lm_head (tied would be 1.37 B, 2.74 GB).
    "1b": replace(_LLAMA_3_2_1B, vocab_size=193800, tie_word_embeddings=False),
    "3.2-1b": _LLAMA_3_2_1B,
    # Small enough for CPU tests; llama3 scaling with a short original context so that all three
    # frequency bands (kept, smoothed, divided) occur at head_dim 16.
    "tiny": LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
}
