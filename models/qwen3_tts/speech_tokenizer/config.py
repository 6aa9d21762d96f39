"""Configuration of the Qwen3-TTS 12 Hz speech tokenizer (codec decoder + Mimi encoder).

Mirrors `speech_tokenizer/config.json` of the official checkpoints (model_type
`qwen3_tts_tokenizer_12hz`). Missing decoder keys take the official class defaults, as the
official loader does. The encoder is a `transformers` Mimi model, so its config stays a dict of
`MimiConfig` keyword arguments. Unknown keys are logged, wrongly typed ones refused naming the key
(models.config_fields). Imports: stdlib, models.config_fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tilevox.models.config_fields import config_bool, config_float, config_int, config_int_list, log_unknown_fields

__all__ = ["PRESETS", "SpeechDecoderConfig", "SpeechTokenizerConfig"]

MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
# Keys read by from_dict, or known not to change decoding (max_position_embeddings only sizes the
# official RoPE cache; attention_dropout is off at inference).
_TOP_FIELDS = frozenset(
    {
        "model_type",
        "decoder_config",
        "encoder_config",
        "encoder_valid_num_quantizers",
        "input_sample_rate",
        "output_sample_rate",
        "encode_downsample_rate",
        "decode_upsample_rate",
    }
)
_DECODER_FIELDS = frozenset(
    {
        "codebook_size",
        "codebook_dim",
        "latent_dim",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "num_hidden_layers",
        "sliding_window",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "layer_scale_initial_scale",
        "num_quantizers",
        "upsample_rates",
        "upsampling_ratios",
        "decoder_dim",
        "attention_bias",
        "hidden_act",
        "max_position_embeddings",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechDecoderConfig:
    """The codec decoder (`decoder_config`): RVQ -> causal conv -> sliding-window transformer ->
    ConvNeXt upsamplers -> SnakeBeta conv decoder."""

    codebook_size: int = 2048
    codebook_dim: int = 512  # width of the RVQ output; each codebook vector has codebook_dim // 2 entries
    latent_dim: int = 1024
    hidden_size: int = 512
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    sliding_window: int = 72  # keys q-71..q are visible to query q (the window includes the query)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    layer_scale_initial_scale: float = 0.01
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in (
            "codebook_size",
            "codebook_dim",
            "latent_dim",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_hidden_layers",
            "sliding_window",
            "num_quantizers",
            "decoder_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"decoder {name} must be a positive int, got {value!r}")
        if self.codebook_dim % 2:
            raise ValueError(
                f"decoder codebook_dim must be even (vectors are codebook_dim // 2 wide), got {self.codebook_dim}"
            )
        if self.num_quantizers < 2:
            raise ValueError(
                f"decoder num_quantizers must be >= 2 (1 semantic + acoustic books), got {self.num_quantizers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"decoder num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"decoder head_dim must be even for RoPE, got {self.head_dim}")
        if not self.upsample_rates or not self.upsampling_ratios:
            raise ValueError("decoder upsample_rates and upsampling_ratios must be non-empty")
        for rate in (*self.upsample_rates, *self.upsampling_ratios):
            if not isinstance(rate, int) or rate < 1:
                raise ValueError(f"decoder upsampling factors must be positive ints, got {rate!r}")
        if self.decoder_dim % (2 ** len(self.upsample_rates)):
            raise ValueError(
                f"decoder_dim ({self.decoder_dim}) must be divisible by 2**{len(self.upsample_rates)} "
                "(each decoder block halves the channels)"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError("decoder rms_norm_eps and rope_theta must be > 0")

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def output_dim(self) -> int:
        """Channels entering the last SnakeBeta + conv (96 at the official size)."""
        return self.decoder_dim // 2 ** len(self.upsample_rates)


# MimiConfig keys that define the official encoder (§2.5); keys not listed take transformers' defaults.
_OFFICIAL_ENCODER: dict[str, Any] = {
    "sampling_rate": 24000,
    "frame_rate": 12.5,
    "audio_channels": 1,
    "hidden_size": 512,
    "num_filters": 64,
    "num_residual_layers": 1,
    "upsampling_ratios": [8, 6, 5, 4],
    "kernel_size": 7,
    "last_kernel_size": 3,
    "residual_kernel_size": 3,
    "dilation_growth_rate": 2,
    "use_causal_conv": True,
    "pad_mode": "constant",
    "compress": 2,
    "trim_right_ratio": 1.0,
    "codebook_size": 2048,
    "codebook_dim": 256,
    "num_quantizers": 32,
    "num_semantic_quantizers": 1,
    "upsample_groups": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "gelu",
    "intermediate_size": 2048,
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": 250,
    "layer_scale_initial_scale": 0.01,
    "use_conv_shortcut": False,
    "vector_quantization_hidden_dimension": 256,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechTokenizerConfig:
    """Top level of `speech_tokenizer/config.json`."""

    decoder: SpeechDecoderConfig = field(default_factory=SpeechDecoderConfig)
    # MimiConfig keyword arguments (a private copy; a plain dict so `asdict` -> JSON works).
    encoder_config: dict[str, Any] = field(default_factory=lambda: dict(_OFFICIAL_ENCODER))
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    encode_downsample_rate: int = 1920
    decode_upsample_rate: int = 1920

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder_config", json.loads(json.dumps(dict(self.encoder_config))))
        for name in (
            "encoder_valid_num_quantizers",
            "input_sample_rate",
            "output_sample_rate",
            "encode_downsample_rate",
            "decode_upsample_rate",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.decode_upsample_rate != self.decoder.samples_per_frame:
            raise ValueError(
                f"decode_upsample_rate ({self.decode_upsample_rate}) must equal the product of the decoder's "
                f"upsampling factors ({self.decoder.samples_per_frame})"
            )
        if self.encoder_valid_num_quantizers != self.decoder.num_quantizers:
            raise ValueError(
                f"encoder_valid_num_quantizers ({self.encoder_valid_num_quantizers}) must equal the decoder's "
                f"num_quantizers ({self.decoder.num_quantizers}): encoded codes feed the decoder"
            )
        encoder_books = self.encoder_config.get("num_quantizers", 32)
        if self.encoder_valid_num_quantizers > encoder_books:
            raise ValueError(
                f"encoder_valid_num_quantizers ({self.encoder_valid_num_quantizers}) exceeds the encoder's "
                f"num_quantizers ({encoder_books})"
            )

    @property
    def frame_rate_hz(self) -> float:
        return self.output_sample_rate / self.decode_upsample_rate

    @property
    def num_quantizers(self) -> int:
        return self.decoder.num_quantizers

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config.json") -> SpeechTokenizerConfig:
        """Parse `speech_tokenizer/config.json`. Raises ValueError naming a bad, wrongly typed or missing
        key; unknown keys are accepted and logged once per `source` (models.config_fields). The
        `encoder_config` goes to transformers' MimiConfig, which applies its own rules."""
        model_type = data.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"speech tokenizer model_type must be {MODEL_TYPE!r}, got {model_type!r}")
        log_unknown_fields(data, _TOP_FIELDS, source=source)
        dec = data.get("decoder_config") or {}
        if not isinstance(dec, Mapping):
            raise ValueError(f"decoder_config must be an object, got {type(dec).__name__}")
        log_unknown_fields(dec, _DECODER_FIELDS, source=source, section="decoder_config")
        if "codebook_dim" not in dec:
            raise ValueError("decoder_config.codebook_dim is missing (the official decoder requires it)")
        rope_scaling = dec.get("rope_scaling")
        if rope_scaling is not None and (
            not isinstance(rope_scaling, Mapping)
            or rope_scaling.get("rope_type", rope_scaling.get("type")) != "default"
        ):
            raise ValueError(f"decoder_config.rope_scaling {rope_scaling!r} is not supported (only default RoPE)")
        if dec.get("hidden_act", "silu") != "silu":
            raise ValueError(f"decoder_config.hidden_act must be 'silu', got {dec['hidden_act']!r}")
        sec = "decoder_config"

        def dint(key: str, default: Any) -> Any:
            return config_int(dec, key, default, section=sec)

        def dfloat(key: str, default: float) -> float:
            return config_float(dec, key, default, section=sec)

        # The official class defaults (not this dataclass's official-size defaults) apply to missing keys.
        hidden = dint("hidden_size", 1024)
        heads = dint("num_attention_heads", 16)
        head_dim = dint("head_dim", None)
        if head_dim is None:
            if heads < 1 or hidden % heads:
                raise ValueError(
                    f"decoder_config: head_dim is absent and hidden_size {hidden} is not a multiple "
                    f"of num_attention_heads {heads}"
                )
            head_dim = hidden // heads
        decoder = SpeechDecoderConfig(
            codebook_size=dint("codebook_size", 2048),
            codebook_dim=config_int(dec, "codebook_dim", section=sec),
            latent_dim=dint("latent_dim", 1024),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=dint("num_key_value_heads", 16),
            head_dim=head_dim,
            intermediate_size=dint("intermediate_size", 3072),
            num_hidden_layers=dint("num_hidden_layers", 8),
            sliding_window=dint("sliding_window", 72),
            rms_norm_eps=dfloat("rms_norm_eps", 1e-5),
            rope_theta=dfloat("rope_theta", 10000.0),
            layer_scale_initial_scale=dfloat("layer_scale_initial_scale", 0.01),
            num_quantizers=dint("num_quantizers", 16),
            upsample_rates=config_int_list(dec, "upsample_rates", (8, 5, 4, 3), section=sec),
            upsampling_ratios=config_int_list(dec, "upsampling_ratios", (2, 2), section=sec),
            decoder_dim=dint("decoder_dim", 1536),
            attention_bias=config_bool(dec, "attention_bias", False, section=sec),
        )
        encoder_config = data.get("encoder_config") or {}
        if not isinstance(encoder_config, Mapping):
            raise ValueError(f"encoder_config must be an object, got {type(encoder_config).__name__}")
        return cls(
            decoder=decoder,
            encoder_config=dict(encoder_config),
            encoder_valid_num_quantizers=config_int(data, "encoder_valid_num_quantizers", 16),
            input_sample_rate=config_int(data, "input_sample_rate", 24000),
            output_sample_rate=config_int(data, "output_sample_rate", 24000),
            encode_downsample_rate=config_int(data, "encode_downsample_rate", 1920),
            decode_upsample_rate=config_int(data, "decode_upsample_rate", 1920),
        )

    def to_dict(self) -> dict[str, Any]:
        """The official `config.json` form (round-trips through `from_dict`)."""
        dec = self.decoder
        return {
            "model_type": MODEL_TYPE,
            "architectures": ["Qwen3TTSTokenizerV2Model"],
            "encoder_valid_num_quantizers": self.encoder_valid_num_quantizers,
            "input_sample_rate": self.input_sample_rate,
            "output_sample_rate": self.output_sample_rate,
            "encode_downsample_rate": self.encode_downsample_rate,
            "decode_upsample_rate": self.decode_upsample_rate,
            "encoder_config": dict(self.encoder_config),
            "decoder_config": {
                "codebook_size": dec.codebook_size,
                "codebook_dim": dec.codebook_dim,
                "latent_dim": dec.latent_dim,
                "hidden_size": dec.hidden_size,
                "num_attention_heads": dec.num_attention_heads,
                "num_key_value_heads": dec.num_key_value_heads,
                "head_dim": dec.head_dim,
                "intermediate_size": dec.intermediate_size,
                "num_hidden_layers": dec.num_hidden_layers,
                "sliding_window": dec.sliding_window,
                "rms_norm_eps": dec.rms_norm_eps,
                "rope_theta": dec.rope_theta,
                "layer_scale_initial_scale": dec.layer_scale_initial_scale,
                "num_quantizers": dec.num_quantizers,
                "upsample_rates": list(dec.upsample_rates),
                "upsampling_ratios": list(dec.upsampling_ratios),
                "decoder_dim": dec.decoder_dim,
                "attention_bias": dec.attention_bias,
                "hidden_act": "silu",
            },
        }


# A tiny tokenizer for CPU tests and the `random:qwen3-tts-tiny` preset (§8.2 step 5): same
# 1920-sample frames, so the streaming/causality logic is exercised at full depth.
_TINY_ENCODER: dict[str, Any] = {
    **_OFFICIAL_ENCODER,
    "hidden_size": 32,
    "num_filters": 8,
    "codebook_size": 32,
    "codebook_dim": 16,
    "vector_quantization_hidden_dimension": 16,
    "num_quantizers": 8,
    "upsample_groups": 32,  # Mimi builds a grouped transposed conv even when unused: groups must divide hidden
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "intermediate_size": 64,
}

PRESETS: dict[str, SpeechTokenizerConfig] = {
    "12hz": SpeechTokenizerConfig(),
    "tiny": SpeechTokenizerConfig(
        decoder=SpeechDecoderConfig(
            codebook_size=32,
            codebook_dim=16,
            latent_dim=32,
            hidden_size=32,
            # q width 4*16 = 64 != hidden (as 16*64 != 512 at the official size) and 2 kv heads, so
            # the tiny parity tests exercise the non-square projections and the grouped-kv path.
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            num_hidden_layers=2,
            sliding_window=72,
            num_quantizers=4,
            decoder_dim=64,
        ),
        encoder_config=_TINY_ENCODER,
        encoder_valid_num_quantizers=4,
    ),
}
