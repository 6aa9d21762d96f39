"""NH-TTS configuration: the shapes of the text encoder and the parallel-codebook decoder, the audio
token ids and the delay pattern, read from a Hugging Face Dia `config.json` (model_type "dia") with the
same field names as transformers' DiaConfig / DiaEncoderConfig / DiaDecoderConfig; and the generation
defaults of its `generation_config.json`.

Only the default RoPE and the SiLU-gated MLP exist in Dia; any other `rope_scaling` or `hidden_act` is
refused rather than run wrongly. Imports: stdlib and models.{config_fields,errors}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tilevox.models.config_fields import config_bool, config_float, config_int, config_int_list, log_unknown_fields
from tilevox.models.errors import CheckpointError

__all__ = [
    "NhDecoderConfig",
    "NhEncoderConfig",
    "NhGenerationDefaults",
    "NhTtsConfig",
    "load_generation_defaults",
    "load_nh_config",
]

_ENCODER_FIELDS = (
    "max_position_embeddings",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "norm_eps",
    "vocab_size",
    "hidden_act",
    "rope_theta",
    "rope_scaling",
)
_DECODER_FIELDS = (
    *_ENCODER_FIELDS,
    "cross_num_attention_heads",
    "cross_head_dim",
    "cross_num_key_value_heads",
    "cross_hidden_size",
    "num_channels",
)
_TOP_FIELDS = ("encoder_config", "decoder_config", "norm_eps", "delay_pattern")
# DiaEncoderConfig / DiaDecoderConfig are PretrainedConfigs: their nested dicts repeat the generic keys.
_NESTED_GENERIC = ("model_type", "is_encoder_decoder", "use_cache")


@dataclass(frozen=True, slots=True, kw_only=True)
class NhEncoderConfig:
    """The byte-level text encoder (DiaEncoderConfig)."""

    vocab_size: int = 256
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    max_position_embeddings: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NhDecoderConfig:
    """The decoder over parallel codebooks (DiaDecoderConfig): vocab_size codes per channel (1024 DAC codes
    + EOS, PAD, BOS), num_channels summed embeddings in, num_channels heads out."""

    vocab_size: int = 1028
    num_channels: int = 9
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 18
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 128
    cross_num_attention_heads: int = 16
    cross_num_key_value_heads: int = 16
    cross_head_dim: int = 128
    cross_hidden_size: int = 1024
    max_position_embeddings: int = 3072
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NhTtsConfig:
    encoder: NhEncoderConfig = NhEncoderConfig()
    decoder: NhDecoderConfig = NhDecoderConfig()
    eos_token_id: int = 1024
    pad_token_id: int = 1025
    bos_token_id: int = 1026
    delay_pattern: tuple[int, ...] = (0, 8, 9, 10, 11, 12, 13, 14, 15)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError for an inconsistent configuration (each loader turns it into a CheckpointError)."""
        enc, dec = self.encoder, self.decoder
        if len(self.delay_pattern) != dec.num_channels:
            raise ValueError(
                f"delay_pattern has {len(self.delay_pattern)} entries but decoder_config.num_channels is {dec.num_channels}"
            )
        if min(self.delay_pattern) < 0 or self.delay_pattern[0] != 0:
            raise ValueError(f"delay_pattern must be non-negative with channel 0 undelayed, got {self.delay_pattern}")
        if enc.hidden_size != dec.cross_hidden_size:
            raise ValueError(
                f"decoder_config.cross_hidden_size ({dec.cross_hidden_size}) must equal the encoder's hidden_size "
                f"({enc.hidden_size})"
            )
        for name, heads, kv in (
            ("encoder_config", enc.num_attention_heads, enc.num_key_value_heads),
            ("decoder_config", dec.num_attention_heads, dec.num_key_value_heads),
            ("decoder_config.cross", dec.cross_num_attention_heads, dec.cross_num_key_value_heads),
        ):
            if heads <= 0 or kv <= 0 or heads % kv:
                raise ValueError(
                    f"{name}: attention heads ({heads}) must be a positive multiple of key/value heads ({kv})"
                )
        special = (self.eos_token_id, self.pad_token_id, self.bos_token_id)
        if len(set(special)) != 3 or not all(0 <= t < dec.vocab_size for t in special):
            raise ValueError(
                f"eos/pad/bos token ids {special} must be distinct ids below decoder vocab_size {dec.vocab_size}"
            )
        if self.eos_token_id != min(special):
            # The EOS filter (as transformers') masks channel 0 above EOS and channels 1.. from EOS on: the
            # codes must be the ids below EOS, the special tokens above.
            raise ValueError(f"eos_token_id ({self.eos_token_id}) must be the lowest special token id")
        if enc.head_dim % 2 or dec.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings)")

    @property
    def num_channels(self) -> int:
        return self.decoder.num_channels

    @property
    def num_codes(self) -> int:
        """Audio codes per channel (ids 0 .. eos_token_id - 1)."""
        return self.eos_token_id

    @property
    def max_delay(self) -> int:
        return max(self.delay_pattern)

    def with_decoder(self, **changes) -> NhTtsConfig:
        return replace(self, decoder=replace(self.decoder, **changes))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a transformers DiaConfig with these shapes writes (the fields tilevox reads)."""
        enc, dec = self.encoder, self.decoder

        def common(c) -> dict[str, Any]:
            return {
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_hidden_layers,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim,
                "max_position_embeddings": c.max_position_embeddings,
                "norm_eps": c.norm_eps,
                "rope_theta": c.rope_theta,
                "rope_scaling": None,
                "hidden_act": "silu",
            }

        decoder = common(dec) | {
            "num_channels": dec.num_channels,
            "cross_num_attention_heads": dec.cross_num_attention_heads,
            "cross_num_key_value_heads": dec.cross_num_key_value_heads,
            "cross_head_dim": dec.cross_head_dim,
            "cross_hidden_size": dec.cross_hidden_size,
            "model_type": "dia_decoder",
        }
        return {
            "model_type": "dia",
            "architectures": ["DiaForConditionalGeneration"],
            "encoder_config": common(enc) | {"model_type": "dia_encoder"},
            "decoder_config": decoder,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "delay_pattern": list(self.delay_pattern),
            "is_encoder_decoder": True,
        }


def _check_act_and_rope(data: Mapping[str, Any], section: str) -> None:
    act = data.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{section}.hidden_act {act!r} is not supported (Dia uses silu)")
    rope = data.get("rope_scaling")
    if rope is not None:
        if not isinstance(rope, Mapping):
            raise ValueError(f"{section}.rope_scaling must be an object or null, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type"))
        if kind != "default":
            raise ValueError(f"{section}.rope_scaling type {kind!r} is not supported (Dia uses the default RoPE)")


def _common(data: Mapping[str, Any], section: str, defaults) -> dict[str, Any]:
    _check_act_and_rope(data, section)
    return {
        "vocab_size": config_int(data, "vocab_size", defaults.vocab_size, section=section),
        "hidden_size": config_int(data, "hidden_size", defaults.hidden_size, section=section),
        "intermediate_size": config_int(data, "intermediate_size", defaults.intermediate_size, section=section),
        "num_hidden_layers": config_int(data, "num_hidden_layers", defaults.num_hidden_layers, section=section),
        "num_attention_heads": config_int(data, "num_attention_heads", defaults.num_attention_heads, section=section),
        "num_key_value_heads": config_int(data, "num_key_value_heads", defaults.num_key_value_heads, section=section),
        "head_dim": config_int(data, "head_dim", defaults.head_dim, section=section),
        "max_position_embeddings": config_int(
            data, "max_position_embeddings", defaults.max_position_embeddings, section=section
        ),
        "norm_eps": config_float(data, "norm_eps", defaults.norm_eps, section=section),
        "rope_theta": config_float(data, "rope_theta", defaults.rope_theta, section=section),
    }


def parse_nh_config(data: Mapping[str, Any], *, source: str) -> NhTtsConfig:
    """A Dia config.json's dict -> NhTtsConfig (defaults as transformers' for absent keys); ValueError
    naming the key for a wrongly typed or inconsistent value."""
    log_unknown_fields(data, _TOP_FIELDS, source=source)
    enc_data = data.get("encoder_config") or {}
    dec_data = data.get("decoder_config") or {}
    if not isinstance(enc_data, Mapping) or not isinstance(dec_data, Mapping):
        raise ValueError("encoder_config and decoder_config must be objects")
    log_unknown_fields(enc_data, (*_ENCODER_FIELDS, *_NESTED_GENERIC), source=source, section="encoder_config")
    log_unknown_fields(dec_data, (*_DECODER_FIELDS, *_NESTED_GENERIC), source=source, section="decoder_config")
    enc = NhEncoderConfig(**_common(enc_data, "encoder_config", NhEncoderConfig()))
    d = NhDecoderConfig()
    s = "decoder_config"
    dec = NhDecoderConfig(
        **_common(dec_data, s, d),
        num_channels=config_int(dec_data, "num_channels", d.num_channels, section=s),
        cross_num_attention_heads=config_int(
            dec_data, "cross_num_attention_heads", d.cross_num_attention_heads, section=s
        ),
        cross_num_key_value_heads=config_int(
            dec_data, "cross_num_key_value_heads", d.cross_num_key_value_heads, section=s
        ),
        cross_head_dim=config_int(dec_data, "cross_head_dim", d.cross_head_dim, section=s),
        cross_hidden_size=config_int(dec_data, "cross_hidden_size", d.cross_hidden_size, section=s),
    )
    top = NhTtsConfig.__dataclass_fields__
    return NhTtsConfig(
        encoder=enc,
        decoder=dec,
        eos_token_id=config_int(data, "eos_token_id", top["eos_token_id"].default),
        pad_token_id=config_int(data, "pad_token_id", top["pad_token_id"].default),
        bos_token_id=config_int(data, "bos_token_id", top["bos_token_id"].default),
        delay_pattern=config_int_list(data, "delay_pattern", top["delay_pattern"].default),
    )


def load_nh_config(root: Path) -> NhTtsConfig:
    """<root>/config.json as NhTtsConfig; every problem is a CheckpointError naming the file."""
    path = Path(root) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    if data.get("model_type") != "dia":
        raise CheckpointError(f"{path}: model_type {data.get('model_type')!r}, expected 'dia'")
    try:
        return parse_nh_config(data, source=str(path))
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class NhGenerationDefaults:
    """What generate() does when the caller chooses nothing: the values transformers' Dia conversion writes
    into generation_config.json (convert_dia_to_hf.get_generation_config)."""

    do_sample: bool = True
    temperature: float = 1.2
    top_k: int = 45
    top_p: float = 0.95
    guidance_scale: float = 3.0
    max_length: int = 3072


# transformers' GenerationConfig defaults: what generate() does for a key that generation_config.json lacks.
_HF_GENERATION_DEFAULTS = NhGenerationDefaults(
    do_sample=False, temperature=1.0, top_k=50, top_p=1.0, guidance_scale=1.0, max_length=20
)


def load_generation_defaults(root: Path) -> NhGenerationDefaults:
    """<root>/generation_config.json's sampling fields; a key it lacks (or a missing file) takes transformers'
    GenerationConfig default, as generate() would (no guidance, greedy)."""
    path = Path(root) / "generation_config.json"
    base = _HF_GENERATION_DEFAULTS
    if not path.exists():
        return base
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    try:
        out = NhGenerationDefaults(
            do_sample=config_bool(data, "do_sample", base.do_sample),
            temperature=config_float(data, "temperature", base.temperature),
            top_k=config_int(data, "top_k", base.top_k),
            top_p=config_float(data, "top_p", base.top_p),
            guidance_scale=config_float(data, "guidance_scale", base.guidance_scale),
            max_length=config_int(data, "max_length", base.max_length),
        )
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if out.guidance_scale < 1.0:
        raise CheckpointError(f"{path}: guidance_scale must be >= 1 (1: no guidance), got {out.guidance_scale}")
    if out.top_k < 0 or not (0.0 < out.top_p <= 1.0) or out.temperature <= 0.0:
        raise CheckpointError(
            f"{path}: top_k {out.top_k}, top_p {out.top_p} or temperature {out.temperature} out of range"
        )
    return out
