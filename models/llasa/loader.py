"""Build LlasaModel from a random preset or a Llasa checkpoint directory.

Presets: "llama-tiny" (CPU-test sized Llama + tiny XCodec2), "llama-1b" (Llama-3.2-1B shapes with
Llasa-1B's 193,800-token vocabulary + the full XCodec2 decoder) and "llama-3.2-1b" (Llama-3.2-1B itself:
its 128,256-token vocabulary, head tied to the embedding table, + the full XCodec2 decoder), seeded,
`is_random` True. Their
tokenizer is the in-memory byte-level stand-in of models.llasa.tokenizer.
A checkpoint directory holds Llasa's LlamaForCausalLM config.json, *.safetensors and tokenizer.json.
XCodec2 (HKUSTAudio/xcodec2) is a separate download: put it in an `xcodec2/` subfolder of the
checkpoint directory, or name its directory in the environment variable TILEVOX_XCODEC2_DIR (used
only when there is no subfolder); without either, loading raises CheckpointError.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tilevox.models.capacity import kv_bytes_per_stream, streams_that_fit
from tilevox.models.checkpoint_io import resolve_codec_dir
from tilevox.models.errors import CheckpointError
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import load_llama, load_llama_config, random_llama
from tilevox.models.llasa.model import LlasaModel, llasa_region_modules
from tilevox.models.llasa.presets import DEFAULT_MAX_STREAMS, LLASA_MAX_SEQ_LEN, LLASA_PRESETS, LlasaPreset
from tilevox.models.llasa.tokenizer import LlasaTokenizer, build_random_tokenizer
from tilevox.models.xcodec2.config import XCodec2Config
from tilevox.models.xcodec2.weights import load_xcodec2_decoder, random_xcodec2_decoder

__all__ = [
    "LLASA_PRESETS",
    "XCODEC2_DIR_ENV",
    "llama_config",
    "load_checkpoint",
    "load_preset",
    "meta_regions",
    "resolve_xcodec2_dir",
]

XCODEC2_DIR_ENV = "TILEVOX_XCODEC2_DIR"
XCODEC2_SUBDIR = "xcodec2"
_LLAMA_SEED = 0
_CODEC_SEED = 1


def _preset(preset_name: str) -> LlasaPreset:
    if preset_name not in LLASA_PRESETS:
        raise ValueError(f"unknown Llasa preset {preset_name!r}; known: {', '.join(LLASA_PRESETS)}")
    return LLASA_PRESETS[preset_name]


def llama_config(preset_name: str) -> LlamaConfig:
    """The Llama network of a preset: its LLAMA_PRESETS shapes with the preset's vocabulary."""
    preset = _preset(preset_name)
    vocab_size = preset.vocab_size
    if vocab_size is None:
        vocab_size = build_random_tokenizer(
            preset.num_speech_tokens or XCodec2Config.preset(preset.codec).codebook_size
        ).vocab_size
    return LlamaConfig.preset(preset.llama).with_vocab_size(vocab_size)


def meta_regions(preset_name: str, *, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """A preset's region networks with shapes only (meta device, no weights, no codec): what a region
    compiler needs to plan a full-size model on a machine without its memory."""
    return llasa_region_modules(random_llama(llama_config(preset_name), seed=_LLAMA_SEED, device="meta", dtype=dtype))


def _default_streams(config: LlamaConfig, device: torch.device, dtype: torch.dtype, context: int, cpu: int) -> int:
    """On a GPU: as many streams as the free memory holds once the weights are loaded (models.capacity);
    on a CPU: `cpu`."""
    if device.type != "cuda":
        return cpu
    per_stream = kv_bytes_per_stream(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.resolved_head_dim,
        context=context,
        dtype=dtype,
    )
    return streams_that_fit(device, per_stream)


def load_preset(
    preset_name: str,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_streams: int | None = None,
    max_seq_len: int | None = None,
) -> LlasaModel:
    """A seeded random-weight Llasa (its audio is noise); weights are allocated on `device` directly."""
    preset = _preset(preset_name)
    device = torch.device(device)
    codec = random_xcodec2_decoder(XCodec2Config.preset(preset.codec), seed=_CODEC_SEED, device=device, dtype=dtype)
    tokenizer = build_random_tokenizer(preset.num_speech_tokens or codec.config.codebook_size)
    config = llama_config(preset_name)
    assert config.vocab_size >= tokenizer.vocab_size, f"preset {preset_name}: vocabulary smaller than its tokenizer's"
    llama = random_llama(config, seed=_LLAMA_SEED, device=device, dtype=dtype)
    return LlasaModel(
        llama=llama,
        tokenizer=tokenizer,
        codec=codec,
        model_id=f"random:{preset_name}",
        max_streams=max_streams
        or _default_streams(config, device, dtype, max_seq_len or preset.max_seq_len, preset.max_streams),
        max_seq_len=max_seq_len or preset.max_seq_len,
        is_random=True,
    )


def resolve_xcodec2_dir(checkpoint_dir: Path, xcodec2_dir: str | Path | None = None) -> Path:
    """The XCodec2 checkpoint: `xcodec2_dir` if given, else <checkpoint>/xcodec2/, else $TILEVOX_XCODEC2_DIR."""
    missing = "Llasa needs the separate HKUSTAudio/xcodec2 download"
    return resolve_codec_dir(
        checkpoint_dir, xcodec2_dir, subdir=XCODEC2_SUBDIR, env_var=XCODEC2_DIR_ENV, codec="XCodec2", missing=missing
    )


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_streams: int | None = None,
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
    context = min(LLASA_MAX_SEQ_LEN, config.max_position_embeddings)
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
        max_streams=max_streams or _default_streams(config, device, dtype, context, DEFAULT_MAX_STREAMS),
        max_seq_len=context,
        is_random=False,
    )
