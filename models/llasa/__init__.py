"""Llasa text-to-speech (Llama decoder + XCodec2 speech tokens) behind the SpeechModel streaming interface."""

from tilevox.models.llasa.loader import LLASA_PRESETS, load_checkpoint, load_preset
from tilevox.models.llasa.model import LlasaModel, StreamCapacityError
from tilevox.models.llasa.tokenizer import LlasaTokenizer, build_random_tokenizer

__all__ = [
    "LLASA_PRESETS",
    "LlasaModel",
    "LlasaTokenizer",
    "StreamCapacityError",
    "build_random_tokenizer",
    "load_checkpoint",
    "load_preset",
]
