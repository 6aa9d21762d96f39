"""Build LlasaModel from a random preset or a Llasa checkpoint directory.

Presets: "llama-tiny" (CPU-test sized Llama + tiny XCodec2) and "llama-1b" (Llama-3.2-1B shapes with
Llasa-1B's 193,800-token vocabulary + the full XCodec2 decoder), seeded, `is_random` True. Their
tokenizer is the in-memory byte-level stand-in of models.llasa.tokenizer.
A checkpoint directory holds Llasa's LlamaForCausalLM config.json, *.safetensors and tokenizer.json.
XCodec2 (HKUSTAudio/xcodec2) is a separate download: put it in an `xcodec2/` subfolder of the
checkpoint directory, or name its directory in the environment variable TILEVOX_XCODEC2_DIR (used
only when there is no subfolder); without either, loading raises CheckpointError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tilevox.models.errors import CheckpointError
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import load_llama, load_llama_config, random_llama
from tilevox.models.llasa.model import LlasaModel
from tilevox.models.llasa.tokenizer import LlasaTokenizer, build_random_tokenizer
from tilevox.models.xcodec2.config import XCodec2Config
from tilevox.models.xcodec2.weights import load_xcodec2_decoder, random_xcodec2_decoder

__all__ = ["LLASA_PRESETS", "XCODEC2_DIR_ENV", "load_checkpoint", "load_preset", "resolve_xcodec2_dir"]

XCODEC2_DIR_ENV = "TILEVOX_XCODEC2_DIR"
XCODEC2_SUBDIR = "xcodec2"
# Llasa was trained on sequences of at most 2048 tokens (prompt + speech), as its model card says.
LLASA_MAX_SEQ_LEN = 2048
DEFAULT_MAX_STREAMS = 16
_LLAMA_SEED = 0
_CODEC_SEED = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class LlasaPreset:
    llama: str  # LLAMA_PRESETS key
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
}


def load_preset(
    preset_name: str,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_streams: int | None = None,
    max_seq_len: int | None = None,
) -> LlasaModel:
    """A seeded random-weight Llasa (its audio is noise); weights are allocated on `device` directly."""
    if preset_name not in LLASA_PRESETS:
        raise ValueError(f"unknown Llasa preset {preset_name!r}; known: {', '.join(LLASA_PRESETS)}")
    preset = LLASA_PRESETS[preset_name]
    device = torch.device(device)
    codec = random_xcodec2_decoder(XCodec2Config.preset(preset.codec), seed=_CODEC_SEED, device=device, dtype=dtype)
    tokenizer = build_random_tokenizer(preset.num_speech_tokens or codec.config.codebook_size)
    vocab_size = preset.vocab_size if preset.vocab_size is not None else tokenizer.vocab_size
    assert vocab_size >= tokenizer.vocab_size, f"preset {preset_name}: vocabulary smaller than its tokenizer's"
    config = LlamaConfig.preset(preset.llama).with_vocab_size(vocab_size)
    llama = random_llama(config, seed=_LLAMA_SEED, device=device, dtype=dtype)
    return LlasaModel(
        llama=llama,
        tokenizer=tokenizer,
        codec=codec,
        model_id=f"random:{preset_name}",
        max_streams=max_streams or preset.max_streams,
        max_seq_len=max_seq_len or preset.max_seq_len,
        is_random=True,
    )


def resolve_xcodec2_dir(checkpoint_dir: Path, xcodec2_dir: str | Path | None = None) -> Path:
    """The XCodec2 checkpoint: `xcodec2_dir` if given, else <checkpoint>/xcodec2/, else $TILEVOX_XCODEC2_DIR."""
    if xcodec2_dir is not None:
        path = Path(xcodec2_dir)
        if not path.exists():
            raise CheckpointError(f"{path}: XCodec2 checkpoint directory does not exist")
        return path
    subdir = checkpoint_dir / XCODEC2_SUBDIR
    if subdir.is_dir():
        return subdir
    from_env = os.environ.get(XCODEC2_DIR_ENV)
    if from_env:
        path = Path(from_env)
        if not path.exists():
            raise CheckpointError(f"{XCODEC2_DIR_ENV}={from_env}: no such directory for the XCodec2 checkpoint")
        return path
    raise CheckpointError(
        f"{checkpoint_dir}: no XCodec2 checkpoint found. Llasa needs the separate HKUSTAudio/xcodec2 download: "
        f"put it in {subdir}/ or set {XCODEC2_DIR_ENV} to its directory"
    )


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_streams: int = DEFAULT_MAX_STREAMS,
    xcodec2_dir: str | Path | None = None,
) -> LlasaModel:
    """Load a Llasa checkpoint directory (config.json, *.safetensors, tokenizer.json) and its XCodec2."""
    root = Path(path)
    device = torch.device(device)
    config = load_llama_config(root)
    tokenizer = LlasaTokenizer.from_file(root / "tokenizer.json")
    codec_dir = resolve_xcodec2_dir(root, xcodec2_dir)
    last_id = max(tokenizer.speech_offset + tokenizer.num_speech_tokens - 1, tokenizer.speech_end_id)
    if last_id >= config.vocab_size:
        raise CheckpointError(
            f"{root}: tokenizer.json has ids up to {last_id} but config.json vocab_size is {config.vocab_size}"
        )
    llama = load_llama(root, device=device, dtype=dtype, config=config)
    codec = load_xcodec2_decoder(codec_dir, device=device, dtype=dtype)
    if tokenizer.num_speech_tokens > codec.config.codebook_size:
        raise CheckpointError(
            f"{root}: tokenizer.json has {tokenizer.num_speech_tokens} speech tokens but the XCodec2 code book in "
            f"{codec_dir} has {codec.config.codebook_size}"
        )
    return LlasaModel(
        llama=llama,
        tokenizer=tokenizer,
        codec=codec,
        model_id=str(root),
        max_streams=max_streams,
        max_seq_len=min(LLASA_MAX_SEQ_LEN, config.max_position_embeddings),
        is_random=False,
    )
