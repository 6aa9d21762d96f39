"""Llasa text-to-speech (Llama decoder + XCodec2 speech tokens) behind the SpeechModel streaming interface."""

from models.llasa.loader import LLASA_PRESETS, load_checkpoint, load_preset
from models.llasa.model import LlasaModel, StreamCapacityError
from models.llasa.tokenizer import LlasaTokenizer, build_random_tokenizer

__all__ = [
    "LLASA_PRESETS",
    "LlasaModel",
    "LlasaTokenizer",
    "StreamCapacityError",
    "build_random_tokenizer",
    "load_checkpoint",
    "load_preset",
]
