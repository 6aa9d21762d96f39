"""Configuration of the Qwen3-TTS talker, code predictor and prompt ids (from `config.json`).

Field names follow the official `config.json` (model_type `qwen3_tts`); `from_dict` reads the
keys the official code reads and ignores the rest (e.g. `position_id_per_seconds`, unused
upstream). The talker's "MRoPE" (sections, interleaved) reduces to plain RoPE because the
three position rows are always equal for text/codec prompts, so only theta and head_dim matter.
Imports: stdlib only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "CodePredictorConfig",
    "GenerationDefaults",
    "Qwen3TTSConfig",
    "TalkerConfig",
    "TransformerConfig",
    "TtsModelType",
]


class TtsModelType(enum.Enum):
    BASE = "base"  # voice cloning from reference audio
    CUSTOM_VOICE = "custom_voice"  # named speakers
    VOICE_DESIGN = "voice_design"  # natural-language voice description


def _positive_ints(obj: Any, names: tuple[str, ...], where: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where} {name} must be a positive int, got {value!r}")


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
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "TransformerConfig":
        try:
            hidden_act = d.get("hidden_act", "silu")
            if hidden_act != "silu":
                raise ValueError(f"{where}: hidden_act must be 'silu' (SwiGLU), got {hidden_act!r}")
            if d.get("attention_bias", False):
                raise ValueError(f"{where}: attention_bias=true is not supported (no checkpoint uses it)")
            if d.get("use_sliding_window", False):
                raise ValueError(f"{where}: use_sliding_window=true is not supported (no checkpoint uses it)")
            return cls(
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=d["num_attention_heads"],
                num_kv_heads=d["num_key_value_heads"],
                head_dim=d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                max_position_embeddings=d.get("max_position_embeddings", 32768),
            )
        except KeyError as exc:
            raise ValueError(f"{where}: missing key {exc.args[0]!r}") from exc


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
        for name in (
            "codec_pad_id",
            "codec_bos_id",
            "codec_eos_token_id",
            "codec_think_id",
            "codec_nothink_id",
            "codec_think_bos_id",
            "codec_think_eos_id",
        ):
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
    def from_dict(cls, d: Mapping[str, Any]) -> "GenerationDefaults":
        known = {f for f in cls.__dataclass_fields__ if f != "min_new_tokens"}
        return cls(**{k: v for k, v in d.items() if k in known})


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
    def from_dict(cls, d: Mapping[str, Any]) -> "Qwen3TTSConfig":
        if d.get("model_type") not in (None, "qwen3_tts"):
            raise ValueError(f"model_type must be 'qwen3_tts', got {d.get('model_type')!r}")
        try:
            tc = d["talker_config"]
            cp = tc["code_predictor_config"]
            predictor = CodePredictorConfig(
                transformer=TransformerConfig.from_dict(cp, "code_predictor_config"),
                vocab_size=cp["vocab_size"],
                num_code_groups=cp["num_code_groups"],
            )
            dialects = {k: (v if v not in (False, None) else None) for k, v in (tc.get("spk_is_dialect") or {}).items()}
            talker = TalkerConfig(
                transformer=TransformerConfig.from_dict(tc, "talker_config"),
                code_predictor=predictor,
                vocab_size=tc["vocab_size"],
                text_vocab_size=tc["text_vocab_size"],
                text_hidden_size=tc["text_hidden_size"],
                num_code_groups=tc["num_code_groups"],
                codec_pad_id=tc["codec_pad_id"],
                codec_bos_id=tc["codec_bos_id"],
                codec_eos_token_id=tc["codec_eos_token_id"],
                codec_think_id=tc["codec_think_id"],
                codec_nothink_id=tc["codec_nothink_id"],
                codec_think_bos_id=tc["codec_think_bos_id"],
                codec_think_eos_id=tc["codec_think_eos_id"],
                languages={k.lower(): v for k, v in (tc.get("codec_language_id") or {}).items()},
                speakers={k.lower(): v for k, v in (tc.get("spk_id") or {}).items()},
                speaker_dialects={k.lower(): v for k, v in dialects.items()},
            )
            model_type = d.get("tts_model_type")
            try:
                tts_model_type = TtsModelType(model_type)
            except ValueError as exc:
                raise ValueError(
                    f"tts_model_type must be one of {[t.value for t in TtsModelType]}, got {model_type!r}"
                ) from exc
            ids = {
                k: d[k]
                for k in (
                    "im_start_token_id",
                    "im_end_token_id",
                    "tts_pad_token_id",
                    "tts_bos_token_id",
                    "tts_eos_token_id",
                )
                if k in d
            }
            return cls(
                talker=talker,
                tts_model_type=tts_model_type,
                tts_model_size=d.get("tts_model_size"),
                speaker_encoder=d.get("speaker_encoder_config") or {},
                **ids,
            )
        except KeyError as exc:
            raise ValueError(f"config.json: missing key {exc.args[0]!r}") from exc
