"""Qwen3-TTS random-weight presets: the one table of their names (no torch import, so that
models.registry can list every preset without loading a model family). The config.json each one
stands for is built by models.qwen3_tts.loader.preset_config_dict."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["QWEN3_TTS_PRESETS", "Qwen3TTSPreset"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3TTSPreset:
    layout: str  # "official": the released models' layout at talker_hidden; "tiny": a CPU-test layout
    talker_hidden: int
    talker_intermediate: int
    size: str  # config.json tts_model_size
    codec: str  # speech tokenizer preset (models.qwen3_tts.speech_tokenizer.PRESETS)


QWEN3_TTS_PRESETS: dict[str, Qwen3TTSPreset] = {
    "qwen3-tts-tiny": Qwen3TTSPreset(layout="tiny", talker_hidden=32, talker_intermediate=64, size="1b7", codec="tiny"),
    "qwen3-tts-0.6b": Qwen3TTSPreset(
        layout="official", talker_hidden=1024, talker_intermediate=3072, size="0b6", codec="12hz"
    ),
    "qwen3-tts-1.7b": Qwen3TTSPreset(
        layout="official", talker_hidden=2048, talker_intermediate=6144, size="1b7", codec="12hz"
    ),
}
