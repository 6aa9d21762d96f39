"""Build NhTtsModel from a random preset or a Hugging Face Dia checkpoint directory.

Presets: "nh-tts-tiny" (CPU-test sized network + the tiny DAC) and "nh-tts-1.6b" / "dia-1.6b" (Dia-1.6B's
shapes + the full 44.1 kHz DAC), seeded, `is_random` True, with the generation defaults of transformers'
Dia conversion (guidance scale 3, temperature 1.2, top-k 45, top-p 0.95).

A checkpoint directory is what transformers' `convert_dia_to_hf.py` writes (nari-labs/Dia-1.6B-0626 on the
Hub): config.json (model_type "dia"), model.safetensors (or shards with model.safetensors.index.json),
generation_config.json (optional: sampling defaults and guidance scale), and the processor files, which name
the DAC (`descript/dac_44khz`) but do not contain it. The DAC is a separate `DacModel.save_pretrained`
folder: put it in a `dac/` subfolder of the checkpoint directory, or name it in $TILEVOX_DAC_DIR (used only
when there is no subfolder), or pass `dac_dir`; without any, loading raises CheckpointError.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tilevox.models.capacity import streams_that_fit
from tilevox.models.checkpoint_io import resolve_codec_dir
from tilevox.models.dac import DAC_PRESETS, load_dac, random_dac
from tilevox.models.errors import CheckpointError
from tilevox.models.nh_tts.config import (
    NhDecoderConfig,
    NhEncoderConfig,
    NhGenerationDefaults,
    NhTtsConfig,
    load_generation_defaults,
    load_nh_config,
)
from tilevox.models.nh_tts.decoder import NhDecoderCache
from tilevox.models.nh_tts.model import NhTtsModel, nh_region_modules
from tilevox.models.nh_tts.presets import DEFAULT_MAX_STREAMS, NH_TTS_PRESETS, NhTtsPreset
from tilevox.models.nh_tts.weights import load_network, random_network
from tilevox.models.sampling import SamplingParams

__all__ = [
    "DAC_DIR_ENV",
    "NETWORK_SHAPES",
    "default_sampling",
    "load_checkpoint",
    "load_preset",
    "meta_regions",
    "network_config",
    "resolve_dac_dir",
]

DAC_DIR_ENV = "TILEVOX_DAC_DIR"
DAC_SUBDIR = "dac"
_NETWORK_SEED = 0
_CODEC_SEED = 1

NETWORK_SHAPES: dict[str, NhTtsConfig] = {
    "tiny": NhTtsConfig(
        encoder=NhEncoderConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
        ),
        decoder=NhDecoderConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            cross_num_attention_heads=4,
            cross_num_key_value_heads=2,
            cross_head_dim=8,
            cross_hidden_size=32,
            max_position_embeddings=3072,
        ),
    ),
    "1.6b": NhTtsConfig(),  # transformers' DiaConfig defaults are Dia-1.6B's shapes
}


def _preset(name: str) -> NhTtsPreset:
    if name not in NH_TTS_PRESETS:
        raise ValueError(f"unknown NH-TTS preset {name!r}; known: {', '.join(NH_TTS_PRESETS)}")
    return NH_TTS_PRESETS[name]


def network_config(preset_name: str) -> NhTtsConfig:
    return NETWORK_SHAPES[_preset(preset_name).network]


def default_sampling(defaults: NhGenerationDefaults) -> SamplingParams:
    """The SamplingParams of a request that chooses none (greedy when the generation config does not sample;
    its top_k is then still the guidance top-k, as in transformers)."""
    if not defaults.do_sample:
        return SamplingParams(temperature=0.0, top_k=defaults.top_k, top_p=1.0)
    return SamplingParams(temperature=defaults.temperature, top_k=defaults.top_k, top_p=defaults.top_p)


def meta_regions(preset_name: str, *, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """A preset's region networks with shapes only (meta device, no weights, no codec)."""
    return nh_region_modules(
        random_network(network_config(preset_name), seed=_NETWORK_SEED, device="meta", dtype=dtype)
    )


def _max_streams(config: NhTtsConfig, device: torch.device, dtype: torch.dtype, rows: int, cpu: int) -> int:
    """On a GPU: as many streams as the free memory holds (both guidance rows, self and cross keys/values at
    full context); on a CPU: `cpu`."""
    if device.type != "cuda":
        return cpu
    per_row = NhDecoderCache.bytes_per_row(
        config.decoder,
        max_seq_len=config.decoder.max_position_embeddings,
        max_text_len=config.encoder.max_position_embeddings,
        dtype=dtype,
    )
    return streams_that_fit(device, per_row * rows)


def _build(network, codec, *, model_id, defaults: NhGenerationDefaults, max_streams, device, dtype, is_random, cpu):
    config = network.config
    rows = 2 if defaults.guidance_scale != 1.0 else 1
    return NhTtsModel(
        network=network,
        codec=codec,
        model_id=model_id,
        max_streams=max_streams or _max_streams(config, device, dtype, rows, cpu),
        max_seq_len=config.decoder.max_position_embeddings,
        max_text_len=config.encoder.max_position_embeddings,
        guidance_scale=defaults.guidance_scale,
        default_sampling=default_sampling(defaults),
        is_random=is_random,
    )


def load_preset(
    preset_name: str, *, device: str | torch.device, dtype: torch.dtype, max_streams: int | None = None
) -> NhTtsModel:
    """A seeded random-weight NH-TTS model (its audio is noise)."""
    preset = _preset(preset_name)
    device = torch.device(device)
    codec = random_dac(DAC_PRESETS[preset.codec], seed=_CODEC_SEED, device=device, dtype=dtype)
    network = random_network(network_config(preset_name), seed=_NETWORK_SEED, device=device, dtype=dtype)
    return _build(
        network,
        codec,
        model_id=f"random:{preset_name}",
        defaults=NhGenerationDefaults(),
        max_streams=max_streams,
        device=device,
        dtype=dtype,
        is_random=True,
        cpu=preset.max_streams,
    )


def resolve_dac_dir(checkpoint_dir: Path, dac_dir: str | Path | None = None) -> Path:
    """The DAC folder: `dac_dir` if given, else <checkpoint>/dac/, else $TILEVOX_DAC_DIR."""
    missing = "Dia's processor names descript/dac_44khz but the model repository does not contain it (its DacModel.save_pretrained folder)"
    return resolve_codec_dir(
        checkpoint_dir, dac_dir, subdir=DAC_SUBDIR, env_var=DAC_DIR_ENV, codec="DAC", missing=missing
    )


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_streams: int | None = None,
    dac_dir: str | Path | None = None,
) -> NhTtsModel:
    """Load a Hugging Face Dia checkpoint directory and its DAC (see the module docstring for the layout)."""
    root = Path(path)
    device = torch.device(device)
    config = load_nh_config(root)
    defaults = load_generation_defaults(root)
    codec_dir = resolve_dac_dir(root, dac_dir)
    network = load_network(root, config, device=device, dtype=dtype)
    codec = load_dac(codec_dir, device=device, dtype=dtype)
    if codec.num_codebooks != config.num_channels or codec.codebook_size < config.num_codes:
        raise CheckpointError(
            f"{codec_dir}: the DAC has {codec.num_codebooks} codebooks of {codec.codebook_size} codes; {root} "
            f"needs {config.num_channels} codebooks of at least {config.num_codes}"
        )
    return _build(
        network,
        codec,
        model_id=str(root),
        defaults=defaults,
        max_streams=max_streams,
        device=device,
        dtype=dtype,
        is_random=False,
        cpu=DEFAULT_MAX_STREAMS,
    )
