"""NH-TTS's random-weight presets: the one table of their names and shapes (no torch import, so that
models.registry can list every preset without loading a model family). `dia-1.6b` is another name of
`nh-tts-1.6b` (Dia-1.6B's shapes, the family's served model)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_STREAMS", "NH_TTS_PRESETS", "NhTtsPreset"]

DEFAULT_MAX_STREAMS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class NhTtsPreset:
    network: str  # models.nh_tts.loader NETWORK_SHAPES key
    codec: str  # models.dac DAC_PRESETS key
    max_streams: int  # on a CPU (a GPU sizes it from free memory)


_FULL = NhTtsPreset(network="1.6b", codec="dac-44khz", max_streams=DEFAULT_MAX_STREAMS)

NH_TTS_PRESETS: dict[str, NhTtsPreset] = {
    "nh-tts-tiny": NhTtsPreset(network="tiny", codec="dac-tiny", max_streams=8),
    "nh-tts-1.6b": _FULL,
    "dia-1.6b": _FULL,
}
