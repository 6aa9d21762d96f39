"""Sizes of the XCodec2 decoder (the 16 kHz, 50 frames/s codec behind Llasa TTS).

`preset("full")` is the official HKUSTAudio/xcodec2 decoder; `preset("tiny")` keeps the same
code book and STFT geometry but a small backbone, for CPU tests. Imports: stdlib, models.config_fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from tilevox.models.config_fields import config_bool, config_int, config_int_list, log_unknown_fields

__all__ = ["XCodec2Config"]

# config.json "model_type" values of the official checkpoint (BigCodecConfig says "xcodec";
# the hub repository's config.json says "xcodec2").
_PACKAGE_MODEL_TYPES = ("xcodec", "xcodec2")


@dataclass(frozen=True, slots=True, kw_only=True)
class XCodec2Config:
    """Decoder hyper-parameters, named after what they size (package name in brackets)."""

    hidden_size: int = 1024  # backbone width [hidden_dim]
    num_layers: int = 12  # transformer blocks [depth]
    num_heads: int = 16  # attention heads [heads]
    rope_dim: int = 64  # rotary size [pos_meb_dim]; the package needs it == head dim
    fsq_levels: tuple[int, ...] = (4,) * 8  # one FSQ code book of prod(levels) = 65,536 codes
    vq_dim: int = 2048  # FSQ project_out width, the input of fc_post_a
    num_norm_groups: int = 32  # GroupNorm groups in the ResNet blocks
    num_prior_blocks: int = 2  # ResNet blocks before the transformer [prior_net]
    num_post_blocks: int = 2  # ResNet blocks after the transformer [post_net]
    hop_samples: int = 320  # samples per codec frame
    n_fft: int = 1280  # ISTFT size = window length (the package uses 4 * hop)
    sample_rate_hz: int = 16000

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "rope_dim",
            "vq_dim",
            "num_norm_groups",
            "hop_samples",
            "n_fft",
            "sample_rate_hz",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_prior_blocks", "num_post_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not isinstance(self.fsq_levels, tuple) or not self.fsq_levels:
            raise ValueError(f"fsq_levels must be a non-empty tuple, got {self.fsq_levels!r}")
        if any(not isinstance(lv, int) or lv < 2 for lv in self.fsq_levels):
            raise ValueError(f"every FSQ level must be an int >= 2, got {self.fsq_levels}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}")
        if self.rope_dim != self.head_dim:
            # torchtune's rotary module, as the package calls it, only runs when its size is the head size.
            raise ValueError(f"rope_dim {self.rope_dim} must equal the head dim {self.head_dim}")
        if self.hidden_size % self.num_norm_groups:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_norm_groups {self.num_norm_groups}"
            )
        if self.n_fft <= self.hop_samples or (self.n_fft - self.hop_samples) % 2:
            raise ValueError(
                f"n_fft {self.n_fft} must exceed hop_samples {self.hop_samples} by an even number "
                "(the 'same' ISTFT padding trims (n_fft - hop) / 2 samples on each side)"
            )
        if self.n_fft % 2:
            raise ValueError(f"n_fft must be even, got {self.n_fft}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def codebook_size(self) -> int:
        return math.prod(self.fsq_levels)

    @property
    def num_fsq_dims(self) -> int:
        return len(self.fsq_levels)

    @property
    def frame_rate_hz(self) -> float:
        return self.sample_rate_hz / self.hop_samples

    @property
    def istft_pad_samples(self) -> int:
        """Samples trimmed from each end of the overlap-added signal ("same" padding)."""
        return (self.n_fft - self.hop_samples) // 2

    @classmethod
    def preset(cls, name: str) -> XCodec2Config:
        if name not in _PRESETS:
            raise ValueError(f"unknown XCodec2 preset {name!r}; choose one of {', '.join(_PRESETS)}")
        return _PRESETS[name]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fsq_levels"] = list(self.fsq_levels)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config.json") -> XCodec2Config:
        """Build from `to_dict()` output, or from the official checkpoint's config.json.

        The package's config.json (model_type "xcodec"/"xcodec2") does not size the decoder:
        `CodecDecoderVocos()` is built with hard-coded defaults, so such a config maps to the
        full preset, and a `codec_decoder_hidden_size` other than 1024 is rejected. Unknown keys
        are accepted and logged once; a wrongly typed value raises ValueError naming the key
        (models.config_fields).
        """
        if data.get("model_type") in _PACKAGE_MODEL_TYPES:
            log_unknown_fields(data, _PACKAGE_FIELDS, source=source)
            hidden = config_int(data, "codec_decoder_hidden_size", 1024)
            if hidden != 1024:
                raise ValueError(
                    f"codec_decoder_hidden_size {hidden!r} is not served: the xcodec2 package always "
                    "builds a 1024-wide decoder"
                )
            if config_bool(data, "use_vocos", True) is not True:
                raise ValueError("use_vocos must be true: only the Vocos (ISTFT) decoder exists in the package")
            return _PRESETS["full"]
        known = {f.name for f in fields(cls)}
        log_unknown_fields(data, known, source=source)
        kwargs: dict[str, Any] = {}
        for name in known:
            if name == "fsq_levels":
                kwargs[name] = config_int_list(data, name, _DEFAULT.fsq_levels)
            else:
                kwargs[name] = config_int(data, name, getattr(_DEFAULT, name))
        return cls(**kwargs)


_DEFAULT = XCodec2Config()
# The xcodec2 package's BigCodecConfig fields (the encoder sizes do not concern the decoder).
_PACKAGE_FIELDS = frozenset(
    {"model_type", "semantic_hidden_size", "codec_encoder_hidden_size", "codec_decoder_hidden_size", "use_vocos"}
)

_PRESETS: dict[str, XCodec2Config] = {
    "full": XCodec2Config(),
    # Same code book, vq_dim and STFT as the full model (so tiny checkpoints use the official
    # layout), with a 64-wide, 2-layer backbone: decoding 200 frames takes ~10 ms on one CPU core.
    "tiny": XCodec2Config(hidden_size=64, num_layers=2, num_heads=4, rope_dim=16),
}
