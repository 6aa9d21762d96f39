"""Configuration of the Qwen3-TTS talker, code predictor and prompt ids (from `config.json`).

Field names follow the official `config.json` (model_type `qwen3_tts`); `from_dict` reads the
keys the official code reads; other keys are accepted and logged once, and wrongly typed values
are refused naming the key (models.config_fields). The talker's "MRoPE" (sections, interleaved)
reduces to plain RoPE because the three position rows are always equal for text/codec prompts,
so only theta, head_dim and `rope_scaling` (RopeScaling: default, linear, llama3, yarn, as
transformers' rope init functions the official code calls) matter.
Imports: stdlib, models.config_fields.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tilevox.models.config_fields import config_bool, config_float, config_int, log_unknown_fields

__all__ = [
    "ROPE_TYPES",
    "CodePredictorConfig",
    "GenerationDefaults",
    "Qwen3TTSConfig",
    "RopeScaling",
    "TalkerConfig",
    "TransformerConfig",
    "TtsModelType",
]

# rope_scaling types implemented here (transformers' static rope init functions). "dynamic" and
# "longrope" recompute frequencies from each forward's longest position (dynamic_rope_update), so
# a key cached at one step used other frequencies than the same key recomputed later, and a
# batch's result depends on its other rows: refused rather than silently approximated.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_SEQUENCE_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "original_max_position_embeddings",
        "truncate",
    ),
}
# Keys of the decoder-stack part of a talker / code-predictor config that are read, or known not to
# change inference (sliding-window keys only matter with use_sliding_window, which is refused;
# tie_word_embeddings: the strict loader needs every head tensor in the file either way).
_TRANSFORMER_FIELDS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "partial_rotary_factor",
        "vocab_size",
        "num_code_groups",
        "tie_word_embeddings",
    }
)
_TALKER_FIELDS = _TRANSFORMER_FIELDS | {
    "text_vocab_size",
    "text_hidden_size",
    "codec_pad_id",
    "codec_bos_id",
    "codec_eos_token_id",
    "codec_think_id",
    "codec_nothink_id",
    "codec_think_bos_id",
    "codec_think_eos_id",
    "codec_language_id",
    "spk_id",
    "spk_is_dialect",
    "code_predictor_config",
    "position_id_per_seconds",
}
_TOP_FIELDS = frozenset(
    {
        "model_type",
        "talker_config",
        "speaker_encoder_config",
        "tokenizer_type",
        "tts_model_size",
        "tts_model_type",
        "im_start_token_id",
        "im_end_token_id",
        "tts_pad_token_id",
        "tts_bos_token_id",
        "tts_eos_token_id",
        "assistant_token_id",
    }
)


class TtsModelType(enum.Enum):
    BASE = "base"  # voice cloning from reference audio
    CUSTOM_VOICE = "custom_voice"  # named speakers
    VOICE_DESIGN = "voice_design"  # natural-language voice description


def _positive_ints(obj: Any, names: tuple[str, ...], where: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where} {name} must be a positive int, got {value!r}")


# The talker's control ids in the codec vocabulary (talker_config keys, TalkerConfig fields)
CODEC_ID_FIELDS = (
    "codec_pad_id",
    "codec_bos_id",
    "codec_eos_token_id",
    "codec_think_id",
    "codec_nothink_id",
    "codec_think_bos_id",
    "codec_think_eos_id",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """`rope_scaling` of a talker / code-predictor config (transformers' parameter names).

    linear: inverse frequencies / factor. llama3: per-band scaling (low/high_freq_factor around
    original_max_position_embeddings). yarn: NTK-by-parts ramp between beta_fast and beta_slow plus
    `attention_factor` on cos/sin (derived from factor, mscale, mscale_all_dim when absent).
    `original_max_position_embeddings` None means the stack's max_position_embeddings."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type != "default" and not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if self.rope_type == "llama3" and not 0.0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings is not None and self.original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings must be >= 1, got {self.original_max_position_embeddings}"
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope_scaling.attention_factor must be > 0, got {self.attention_factor}")

    @classmethod
    def from_dict(cls, scaling: Any, section: str, *, source: str = "config.json") -> RopeScaling:
        """Parse `<section>.rope_scaling` (None -> default RoPE). Types other than ROPE_TYPES raise
        ValueError naming the key; the talker's mrope_section / interleaved are accepted (see module doc)."""
        where = f"{section}.rope_scaling"
        if scaling is None:
            return cls()
        if not isinstance(scaling, Mapping):
            raise ValueError(f"{where} must be an object or null, got {scaling!r}")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))  # "type": transformers' old key
        if rope_type in _SEQUENCE_DEPENDENT_ROPE_TYPES:
            raise ValueError(
                f"{where}.rope_type {rope_type!r} is not supported: its frequencies change with each forward's "
                f"sequence length, which a batched KV-cache decode cannot reproduce; supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{where}.rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        keys = _ROPE_KEYS[rope_type]
        log_unknown_fields(
            scaling, {"rope_type", "type", "mrope_section", "interleaved", *keys}, source=source, section=where
        )
        if rope_type in ("linear", "llama3", "yarn") and "factor" not in scaling:
            raise ValueError(f"{where} of type {rope_type!r} lacks 'factor'")
        if rope_type == "llama3":
            absent = [
                k
                for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if k not in scaling
            ]
            if absent:
                raise ValueError(f"{where} of type 'llama3' lacks {', '.join(absent)}")
        kwargs: dict[str, Any] = {"rope_type": rope_type}
        for key in keys:
            if key == "original_max_position_embeddings":
                kwargs[key] = config_int(scaling, key, None, section=where)
            elif key == "truncate":
                kwargs[key] = config_bool(scaling, key, True, section=where)
            elif key in ("attention_factor", "mscale", "mscale_all_dim"):
                kwargs[key] = config_float(scaling, key, None, section=where)
            else:
                kwargs[key] = config_float(scaling, key, getattr(_DEFAULT_ROPE, key), section=where)
        if rope_type == "yarn":  # transformers: `beta_fast or 32`, `beta_slow or 1` (0 means the default)
            kwargs["beta_fast"] = kwargs["beta_fast"] or 32.0
            kwargs["beta_slow"] = kwargs["beta_slow"] or 1.0
        return cls(**kwargs)


_DEFAULT_ROPE = RopeScaling()


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerConfig:
    """A Qwen3 decoder stack: GQA with per-head q/k RMSNorm, RoPE, SwiGLU, pre-norm."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        _positive_ints(
            self,
            (
                "hidden_size",
                "intermediate_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "max_position_embeddings",
            ),
            "transformer",
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    @classmethod
    def from_dict(
        cls,
        d: Mapping[str, Any],
        where: str,
        *,
        source: str = "config.json",
        known: frozenset[str] = _TRANSFORMER_FIELDS,
    ) -> TransformerConfig:
        """Parse the decoder-stack keys of `where` (a config.json section); keys outside `known` are
        logged once (models.config_fields), wrongly typed values raise ValueError naming the key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be an object, got {type(d).__name__}")
        log_unknown_fields(d, known, source=source, section=where)
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{where}: hidden_act must be 'silu' (SwiGLU), got {hidden_act!r}")
        if config_bool(d, "attention_bias", False, section=where):
            raise ValueError(f"{where}: attention_bias=true is not supported (no checkpoint uses it)")
        if config_bool(d, "use_sliding_window", False, section=where):
            raise ValueError(f"{where}: use_sliding_window=true is not supported (no checkpoint uses it)")
        layer_types = d.get("layer_types") or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{where}: layer_types other than 'full_attention' are not supported, got {layer_types!r}")
        if config_float(d, "partial_rotary_factor", 1.0, section=where) != 1.0:
            raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
        hidden = config_int(d, "hidden_size", section=where)
        heads = config_int(d, "num_attention_heads", section=where)
        head_dim = config_int(d, "head_dim", None, section=where)
        if head_dim is None:
            if heads < 1 or hidden % heads:
                raise ValueError(
                    f"{where}: head_dim is absent and hidden_size {hidden} is not a multiple of "
                    f"num_attention_heads {heads}"
                )
            head_dim = hidden // heads
        return cls(
            hidden_size=hidden,
            intermediate_size=config_int(d, "intermediate_size", section=where),
            num_layers=config_int(d, "num_hidden_layers", section=where),
            num_heads=heads,
            num_kv_heads=config_int(d, "num_key_value_heads", section=where),
            head_dim=head_dim,
            rms_norm_eps=config_float(d, "rms_norm_eps", 1e-6, section=where),
            rope_theta=config_float(d, "rope_theta", 10000.0, section=where),
            max_position_embeddings=config_int(d, "max_position_embeddings", 32768, section=where),
            rope_scaling=RopeScaling.from_dict(d.get("rope_scaling"), where, source=source),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CodePredictorConfig:
    """The sub-talker that predicts codebooks 1..Q-1 of a frame (vocab = one codebook)."""

    transformer: TransformerConfig
    vocab_size: int
    num_code_groups: int

    def __post_init__(self) -> None:
        _positive_ints(self, ("vocab_size", "num_code_groups"), "code predictor")
        if self.num_code_groups < 2:
            raise ValueError(f"code predictor num_code_groups must be >= 2, got {self.num_code_groups}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TalkerConfig:
    transformer: TransformerConfig
    code_predictor: CodePredictorConfig
    vocab_size: int  # codec ids: audio codes [0, vocab-1024) plus control ids in the top 1024
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_token_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    languages: Mapping[str, int] = field(default_factory=dict)  # name -> codec id (dialects included)
    speakers: Mapping[str, int] = field(default_factory=dict)  # name -> codec id (CustomVoice)
    speaker_dialects: Mapping[str, str | None] = field(default_factory=dict)  # name -> dialect language or None

    def __post_init__(self) -> None:
        _positive_ints(self, ("vocab_size", "text_vocab_size", "text_hidden_size", "num_code_groups"), "talker")
        if self.vocab_size <= 1024:
            raise ValueError(f"talker vocab_size must exceed 1024 (the control-id block), got {self.vocab_size}")
        if self.num_code_groups != self.code_predictor.num_code_groups:
            raise ValueError(
                f"talker num_code_groups ({self.num_code_groups}) != code predictor's "
                f"({self.code_predictor.num_code_groups})"
            )
        for name in CODEC_ID_FIELDS:
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"talker {name} {value} is outside the codec vocab [0, {self.vocab_size})")
        for table in ("languages", "speakers"):
            for name, value in getattr(self, table).items():
                if not 0 <= value < self.vocab_size:
                    raise ValueError(f"talker {table}[{name!r}] = {value} is outside the codec vocab")
        for speaker, dialect in self.speaker_dialects.items():
            if dialect is not None and dialect not in self.languages:
                raise ValueError(f"speaker {speaker!r} has dialect {dialect!r}, which is not in codec_language_id")
        object.__setattr__(self, "languages", MappingProxyType(dict(self.languages)))
        object.__setattr__(self, "speakers", MappingProxyType(dict(self.speakers)))
        object.__setattr__(self, "speaker_dialects", MappingProxyType(dict(self.speaker_dialects)))

    @property
    def num_audio_codes(self) -> int:
        """Codebook-0 ids the talker may emit besides EOS (generate() suppresses the top 1024 ids)."""
        return self.vocab_size - 1024

    @property
    def has_projection(self) -> bool:
        """The 1.7B maps talker width to predictor width with `small_to_mtp_projection`."""
        return self.transformer.hidden_size != self.code_predictor.transformer.hidden_size


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationDefaults:
    """`generation_config.json` values (explicit request values win, as in the official wrapper)."""

    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    max_new_tokens: int = 2048  # the wrapper's hard default when generation_config.json lacks it
    min_new_tokens: int = 2  # hard-coded by the official generate()

    def __post_init__(self) -> None:
        if self.top_k < 0 or self.subtalker_top_k < 0:
            raise ValueError("top_k values must be >= 0")
        if not (0 < self.top_p <= 1 and 0 < self.subtalker_top_p <= 1):
            raise ValueError("top_p values must be in (0, 1]")
        if self.temperature <= 0 or self.subtalker_temperature <= 0:
            raise ValueError("temperatures must be > 0 (use do_sample=false for greedy)")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "generation_config.json") -> GenerationDefaults:
        """Read the known keys (wrongly typed values raise ValueError naming the key); others are logged once."""
        known = {f for f in cls.__dataclass_fields__ if f != "min_new_tokens"}
        log_unknown_fields(d, known, source=source)
        kwargs: dict[str, Any] = {}
        for key in known:
            default = getattr(_DEFAULT_GENERATION, key)
            if isinstance(default, bool):
                kwargs[key] = config_bool(d, key, default)
            elif isinstance(default, int):
                kwargs[key] = config_int(d, key, default)
            else:
                kwargs[key] = config_float(d, key, default)
        return cls(**kwargs)


_DEFAULT_GENERATION = GenerationDefaults()


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3TTSConfig:
    talker: TalkerConfig
    tts_model_type: TtsModelType
    tts_model_size: str | None  # "0b6" | "1b7"; the wrapper drops CustomVoice instructions on "0b6"
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    speaker_encoder: Mapping[str, Any] = field(default_factory=dict)  # raw `speaker_encoder_config`

    def __post_init__(self) -> None:
        for name in (
            "im_start_token_id",
            "im_end_token_id",
            "tts_pad_token_id",
            "tts_bos_token_id",
            "tts_eos_token_id",
        ):
            value = getattr(self, name)
            if not 0 <= value < self.talker.text_vocab_size:
                raise ValueError(f"{name} {value} is outside the text vocab [0, {self.talker.text_vocab_size})")
        object.__setattr__(self, "speaker_encoder", MappingProxyType(dict(self.speaker_encoder)))

    @property
    def supports_instructions(self) -> bool:
        if self.tts_model_type is TtsModelType.VOICE_DESIGN:
            return True
        return self.tts_model_type is TtsModelType.CUSTOM_VOICE and self.tts_model_size != "0b6"

    @property
    def languages(self) -> tuple[str, ...]:
        """User-selectable languages (dialects are reached through dialect speakers), as upstream."""
        return tuple(name for name in self.talker.languages if "dialect" not in name)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> Qwen3TTSConfig:
        """Parse config.json. Raises ValueError naming a missing, wrongly typed or unsupported key;
        unknown keys are accepted and logged once per `source` (the file)."""
        if d.get("model_type") not in (None, "qwen3_tts"):
            raise ValueError(f"model_type must be 'qwen3_tts', got {d.get('model_type')!r}")
        log_unknown_fields(d, _TOP_FIELDS, source=source)
        if "talker_config" not in d:
            raise ValueError("missing key 'talker_config'")
        tc = d["talker_config"]
        if not isinstance(tc, Mapping):
            raise ValueError(f"talker_config must be an object, got {type(tc).__name__}")
        if "code_predictor_config" not in tc:
            raise ValueError("missing key 'talker_config.code_predictor_config'")
        cp = tc["code_predictor_config"]
        if not isinstance(cp, Mapping):
            raise ValueError(f"talker_config.code_predictor_config must be an object, got {type(cp).__name__}")
        cp_where = "talker_config.code_predictor_config"
        predictor = CodePredictorConfig(
            transformer=TransformerConfig.from_dict(cp, cp_where, source=source),
            vocab_size=config_int(cp, "vocab_size", section=cp_where),
            num_code_groups=config_int(cp, "num_code_groups", section=cp_where),
        )

        def table(key: str) -> dict[str, int]:
            raw = tc.get(key) or {}
            if not isinstance(raw, Mapping):
                raise ValueError(f"talker_config.{key} must be an object, got {type(raw).__name__}")
            return {str(k).lower(): config_int(raw, k, section=f"talker_config.{key}") for k in raw}

        raw_dialects = tc.get("spk_is_dialect") or {}
        if not isinstance(raw_dialects, Mapping):
            raise ValueError(f"talker_config.spk_is_dialect must be an object, got {type(raw_dialects).__name__}")
        dialects = {k.lower(): (v if v not in (False, None) else None) for k, v in raw_dialects.items()}
        ids = {name: config_int(tc, name, section="talker_config") for name in CODEC_ID_FIELDS}
        talker = TalkerConfig(
            transformer=TransformerConfig.from_dict(tc, "talker_config", source=source, known=_TALKER_FIELDS),
            code_predictor=predictor,
            vocab_size=config_int(tc, "vocab_size", section="talker_config"),
            text_vocab_size=config_int(tc, "text_vocab_size", section="talker_config"),
            text_hidden_size=config_int(tc, "text_hidden_size", section="talker_config"),
            num_code_groups=config_int(tc, "num_code_groups", section="talker_config"),
            languages=table("codec_language_id"),
            speakers=table("spk_id"),
            speaker_dialects=dialects,
            **ids,
        )
        model_type = d.get("tts_model_type")
        try:
            tts_model_type = TtsModelType(model_type)
        except ValueError as exc:
            raise ValueError(
                f"tts_model_type must be one of {[t.value for t in TtsModelType]}, got {model_type!r}"
            ) from exc
        token_ids = {
            k: config_int(d, k)
            for k in (
                "im_start_token_id",
                "im_end_token_id",
                "tts_pad_token_id",
                "tts_bos_token_id",
                "tts_eos_token_id",
            )
            if k in d
        }
        speaker_encoder = d.get("speaker_encoder_config") or {}
        if not isinstance(speaker_encoder, Mapping):
            raise ValueError(f"speaker_encoder_config must be an object, got {type(speaker_encoder).__name__}")
        return cls(
            talker=talker,
            tts_model_type=tts_model_type,
            tts_model_size=d.get("tts_model_size"),
            speaker_encoder=speaker_encoder,
            **token_ids,
        )
