"""Sizes of the DAC codec (Descript Audio Codec), read from `transformers`' DacConfig config.json.

`DAC_PRESETS["dac-44khz"]` is descript/dac_44khz (9 codebooks x 1024 at 44.1 kHz, hop 512, 86.13
frames/s); `"dac-tiny"` keeps its codes, rate and hop with a few channels, for CPU tests.
Imports: stdlib, models.config_fields, models.errors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tilevox.models.config_fields import HF_GENERIC_CONFIG_FIELDS, config_float, config_int, config_int_list
from tilevox.models.errors import CheckpointError

__all__ = ["DAC_PRESETS", "DacConfig"]

MODEL_TYPE = "dac"
# Fields transformers derives from the others and writes too: checked against ours when present.
_DERIVED_FIELDS = ("hidden_size", "hop_length", "upsampling_ratios")
# Training-only fields (loss weights, quantizer dropout): type-checked, never used at inference.
_TRAINING_FIELDS = ("quantizer_dropout", "commitment_loss_weight", "codebook_loss_weight")


@dataclass(frozen=True, slots=True, kw_only=True)
class DacConfig:
    """Hyper-parameters named as in transformers' DacConfig (so config.json maps one to one)."""

    encoder_hidden_size: int  # width of the encoder's first conv; doubles at each downsampling
    downsampling_ratios: tuple[int, ...]  # encoder strides; the decoder upsamples by them reversed
    decoder_hidden_size: int  # width of the decoder's first conv; halves at each upsampling
    n_codebooks: int
    codebook_size: int
    codebook_dim: int  # the factorized (low-dimensional) code vector size
    sampling_rate: int

    def __post_init__(self) -> None:
        for name in _SIZING_FIELDS:
            if name != "downsampling_ratios":
                _check_positive_int(name, getattr(self, name))
        ratios = self.downsampling_ratios
        if not isinstance(ratios, tuple) or not ratios:
            raise ValueError(f"downsampling_ratios must be a non-empty tuple, got {ratios!r}")
        for ratio in ratios:
            # Even strides make every (transposed) conv map T positions to exactly T * stride.
            if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 2 or ratio % 2:
                raise ValueError(f"every downsampling ratio must be an even int >= 2, got {ratios}")
        if self.decoder_hidden_size // 2 ** len(ratios) < 1:
            raise ValueError(
                f"decoder_hidden_size {self.decoder_hidden_size} is too small to halve {len(ratios)} times"
            )

    @property
    def hidden_size(self) -> int:
        """Latent width between encoder, quantizer and decoder."""
        return self.encoder_hidden_size * 2 ** len(self.downsampling_ratios)

    @property
    def upsampling_ratios(self) -> tuple[int, ...]:
        return self.downsampling_ratios[::-1]

    @property
    def hop_length(self) -> int:
        return math.prod(self.downsampling_ratios)

    @property
    def frame_rate_hz(self) -> float:
        return self.sampling_rate / self.hop_length

    def to_dict(self) -> dict[str, Any]:
        """transformers' config.json layout (model_type and derived fields included)."""
        return {
            "model_type": MODEL_TYPE,
            "encoder_hidden_size": self.encoder_hidden_size,
            "downsampling_ratios": list(self.downsampling_ratios),
            "decoder_hidden_size": self.decoder_hidden_size,
            "n_codebooks": self.n_codebooks,
            "codebook_size": self.codebook_size,
            "codebook_dim": self.codebook_dim,
            "sampling_rate": self.sampling_rate,
            "hidden_size": self.hidden_size,
            "hop_length": self.hop_length,
            "upsampling_ratios": list(self.upsampling_ratios),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config.json") -> DacConfig:
        """Parse transformers' DacConfig config.json strictly: every sizing field is required, a field
        neither DAC's nor one of transformers' generic ones is refused (it may change the network), and
        derived fields must agree. Every failure raises CheckpointError "<source>: ..."."""
        try:
            return cls._parse(data)
        except ValueError as exc:
            raise CheckpointError(f"{source}: {exc}") from exc

    @classmethod
    def _parse(cls, data: Mapping[str, Any]) -> DacConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type must be {MODEL_TYPE!r}, got {data.get('model_type')!r}")
        known = set(_SIZING_FIELDS) | set(_DERIVED_FIELDS) | set(_TRAINING_FIELDS) | HF_GENERIC_CONFIG_FIELDS
        unknown = sorted(key for key in data if key not in known)
        if unknown:
            raise ValueError(f"unknown DAC config field(s) {', '.join(unknown)}")
        for name in _TRAINING_FIELDS:
            config_float(data, name, None)
        kwargs = {name: config_int(data, name) for name in _SIZING_FIELDS if name != "downsampling_ratios"}
        config = cls(downsampling_ratios=config_int_list(data, "downsampling_ratios"), **kwargs)
        derived = {
            "hidden_size": config_int(data, "hidden_size", None),
            "hop_length": config_int(data, "hop_length", None),
            "upsampling_ratios": config_int_list(data, "upsampling_ratios", None),
        }
        for name, value in derived.items():
            if value is not None and value != getattr(config, name):
                raise ValueError(f"{name} is {value!r} but the other fields make it {getattr(config, name)!r}")
        return config


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


_SIZING_FIELDS = (
    "encoder_hidden_size",
    "downsampling_ratios",
    "decoder_hidden_size",
    "n_codebooks",
    "codebook_size",
    "codebook_dim",
    "sampling_rate",
)

DAC_PRESETS: dict[str, DacConfig] = {
    "dac-44khz": DacConfig(
        encoder_hidden_size=64,
        downsampling_ratios=(2, 4, 8, 8),
        decoder_hidden_size=1536,
        n_codebooks=9,
        codebook_size=1024,
        codebook_dim=8,
        sampling_rate=44100,
    ),
    # The 44 kHz codes, strides and rate (so NH-TTS tiny models produce valid codes for it) with
    # 2..32-wide convs: decoding 100 frames takes milliseconds on one CPU core.
    "dac-tiny": DacConfig(
        encoder_hidden_size=2,
        downsampling_ratios=(2, 4, 8, 8),
        decoder_hidden_size=32,
        n_codebooks=9,
        codebook_size=1024,
        codebook_dim=8,
        sampling_rate=44100,
    ),
}
