"""Qwen3-TTS 12 Hz speech tokenizer: exact streaming codec decoder and Mimi-based encoder.

Public API consumed by the rest of models.qwen3_tts: config, decoder (full, incremental and
official-chunked decode), encoder (audio -> codes for ICL prompts), loader and random init.
"""

from tilevox.models.qwen3_tts.speech_tokenizer.config import PRESETS, SpeechDecoderConfig, SpeechTokenizerConfig
from tilevox.models.qwen3_tts.speech_tokenizer.decoder import ChunkedDecoderState, DecoderState, SpeechTokenizerDecoder
from tilevox.models.qwen3_tts.speech_tokenizer.encoder import SpeechTokenizerEncoder
from tilevox.models.qwen3_tts.speech_tokenizer.weights import (
    load_speech_tokenizer,
    load_state_dict_strict,
    random_speech_tokenizer,
    randomize_,
    save_speech_tokenizer,
)

__all__ = [
    "PRESETS",
    "ChunkedDecoderState",
    "DecoderState",
    "SpeechDecoderConfig",
    "SpeechTokenizerConfig",
    "SpeechTokenizerDecoder",
    "SpeechTokenizerEncoder",
    "load_speech_tokenizer",
    "load_state_dict_strict",
    "random_speech_tokenizer",
    "randomize_",
    "save_speech_tokenizer",
]
