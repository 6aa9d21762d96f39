"""Llasa's random-weight presets: the one table of their names and shapes (no torch import, so that
models.registry can list every preset without loading a model family)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_STREAMS", "LLASA_MAX_SEQ_LEN", "LLASA_PRESETS", "LlasaPreset"]

# Llasa was trained on sequences of at most 2048 tokens (prompt + speech), as its model card says.
LLASA_MAX_SEQ_LEN = 2048
DEFAULT_MAX_STREAMS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class LlasaPreset:
    llama: str  # models.llama LLAMA_PRESETS key (the network's shapes)
    codec: str  # XCodec2Config preset
    max_streams: int
    max_seq_len: int
    vocab_size: int | None  # None: exactly the random tokenizer's vocabulary
    num_speech_tokens: int | None  # None: the whole XCodec2 code book (65,536)


LLASA_PRESETS: dict[str, LlasaPreset] = {
    # 4,096 of the 65,536 codes keep the tiny vocabulary (and so sampling) small.
    "llama-tiny": LlasaPreset(
        llama="tiny",
        codec="tiny",
        max_streams=8,
        max_seq_len=LLASA_MAX_SEQ_LEN,
        vocab_size=None,
        num_speech_tokens=4096,
    ),
    # Real sizes: 128256 Llama + 8 markers + 65536 speech tokens. The random tokenizer uses only its
    # first 65,805 ids; the rest are masked out like any non-speech token.
    "llama-1b": LlasaPreset(
        llama="1b",
        codec="full",
        max_streams=DEFAULT_MAX_STREAMS,
        max_seq_len=LLASA_MAX_SEQ_LEN,
        vocab_size=193800,
        num_speech_tokens=None,
    ),
    # Llama-3.2-1B's own network (models.llama "3.2-1b": 128,256-token vocabulary, head tied to the embedding
    # table) with the full XCodec2 codec: the same decoder as llama-1b but for the vocabulary and the tie, so
    # the build can compare Llasa-1B with the plain Llama-3.2-1B step. The random tokenizer's 65,805 ids fit
    # inside the 128,256; the rest are masked out like any non-speech token.
    "llama-3.2-1b": LlasaPreset(
        llama="3.2-1b",
        codec="full",
        max_streams=DEFAULT_MAX_STREAMS,
        max_seq_len=LLASA_MAX_SEQ_LEN,
        vocab_size=128256,
        num_speech_tokens=None,
    ),
}
