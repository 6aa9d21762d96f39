"""Load the official `speech_tokenizer/` folder, or make seeded random speech tokenizers.

Loading is strict: a missing, unexpected or mis-shaped tensor raises CheckpointError naming it.
Random weights are scaled by fan-in (so activations stay O(1) at any size and the clamped
output is not saturated) and give codebooks non-zero vectors (HF init leaves them at zero,
which decodes to silence). Imports: torch, safetensors, models.errors, models.checkpoint_io, this package.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tilevox.models.checkpoint_io import check_tensor_dtype, read_safetensors
from tilevox.models.errors import CheckpointError
from tilevox.models.qwen3_tts.speech_tokenizer.config import SpeechTokenizerConfig
from tilevox.models.qwen3_tts.speech_tokenizer.decoder import SpeechTokenizerDecoder
from tilevox.models.qwen3_tts.speech_tokenizer.encoder import SpeechTokenizerEncoder

__all__ = [
    "load_speech_tokenizer",
    "load_state_dict_strict",
    "random_speech_tokenizer",
    "randomize_",
    "save_speech_tokenizer",
]


def load_state_dict_strict(module: nn.Module, tensors: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Copy `tensors` into `module`, raising CheckpointError on any missing, unexpected, mis-shaped or
    wrongly typed (non-float for a float tensor, or the reverse) tensor. `where` prefixes messages (file and key prefix, e.g. ".../model.safetensors: decoder.")."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}{missing[0]}: missing tensor{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{where}{unexpected[0]}: unexpected tensor{more}")
    for name, target in expected.items():
        if tuple(tensors[name].shape) != tuple(target.shape):
            raise CheckpointError(
                f"{where}{name}: shape {tuple(tensors[name].shape)} does not match the config's {tuple(target.shape)}"
            )
        file, _, prefix = where.rpartition(": ")
        check_tensor_dtype(prefix + name, tensors[name], target, where=file or where)
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])


def _read_config(directory: Path) -> SpeechTokenizerConfig:
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing; the speech tokenizer folder needs a config.json") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    try:
        return SpeechTokenizerConfig.from_dict(data, source=str(path))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def load_speech_tokenizer(
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    with_encoder: bool = True,
    attn_implementation: str = "sdpa",
) -> tuple[SpeechTokenizerConfig, SpeechTokenizerDecoder, SpeechTokenizerEncoder | None]:
    """Load `speech_tokenizer/` (config.json + model.safetensors) -> (config, decoder, encoder).

    `with_encoder=False` skips the Mimi encoder (returns None; its tensors are then not checked)."""
    directory = Path(directory)
    config = _read_config(directory)
    weights_path = directory / "model.safetensors"
    tensors = read_safetensors(weights_path)
    groups: dict[str, dict[str, torch.Tensor]] = {"decoder.": {}, "encoder.": {}}
    for name, tensor in tensors.items():
        prefix = next((p for p in groups if name.startswith(p)), None)
        if prefix is None:
            raise CheckpointError(f"{weights_path}: {name}: unexpected tensor (neither encoder.* nor decoder.*)")
        groups[prefix][name[len(prefix) :]] = tensor

    decoder = SpeechTokenizerDecoder(config.decoder)
    load_state_dict_strict(decoder, groups["decoder."], where=f"{weights_path}: decoder.")
    decoder = decoder.to(device=device, dtype=dtype).eval()
    encoder = None
    if with_encoder:
        encoder = SpeechTokenizerEncoder(config, attn_implementation=attn_implementation)
        load_state_dict_strict(encoder.mimi, groups["encoder."], where=f"{weights_path}: encoder.")
        encoder = encoder.to(device=device, dtype=dtype).eval()
        encoder.reset_caches()
    return config, decoder, encoder


def randomize_(module: nn.Module, generator: torch.Generator) -> None:
    """Overwrite every parameter and float buffer of a speech-tokenizer or speaker-encoder module
    (ours or the official classes: the rules go by module type and tensor name) with seeded values.

    Raises ValueError for a tensor no rule covers, so new layers cannot silently keep HF init."""

    def normal(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=generator) * std + mean)

    with torch.no_grad():
        for mod_name, mod in module.named_modules():
            tensors = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
            for name, t in tensors:
                if not t.is_floating_point() or name in ("inv_freq", "original_inv_freq"):
                    continue
                full = f"{mod_name}.{name}" if mod_name else name
                if name == "initialized":  # Mimi's codebook flag must stay 1
                    continue
                if name == "cluster_usage":
                    t.copy_(torch.rand(t.shape, generator=generator) + 0.5)
                elif name in ("embedding_sum", "embed_sum"):
                    normal(t, 0.0, 1.0)
                elif name == "weight" and isinstance(mod, nn.ConvTranspose1d):
                    # each output sample sums in_channels * kernel / stride products
                    fan_in = t.shape[0] * t.shape[2] / mod.stride[0]
                    normal(t, 0.0, 1.0 / math.sqrt(fan_in))
                elif name == "weight" and isinstance(mod, (nn.Conv1d, nn.Linear)):
                    # Residual-branch outputs (`...conv2.conv`, SnakeBeta decoder units) get a small gain
                    # so the 12 stacked residual units do not grow the signal ~3x per block.
                    gain = 0.2 if mod_name.endswith("conv2.conv") else 1.0
                    if isinstance(mod, nn.Conv1d) and mod.out_channels == 1:
                        gain = 0.15  # the waveform conv: aim at speech-like levels, far from the +-1 clamp
                    normal(t, 0.0, gain / math.sqrt(t[0].numel()))
                elif name == "bias":
                    normal(t, 0.0, 0.05)
                elif name == "weight" and t.dim() == 1:  # LayerNorm / RMSNorm gains
                    normal(t, 1.0, 0.1)
                elif name in ("scale", "gamma"):  # LayerScale / ConvNeXt gamma
                    normal(t, 0.3, 0.05)
                elif name in ("alpha", "beta"):  # SnakeBeta, log space
                    normal(t, 0.0, 0.1)
                else:
                    raise ValueError(f"randomize_: no rule for tensor {full} {tuple(t.shape)}")


def random_speech_tokenizer(
    config: SpeechTokenizerConfig,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    with_encoder: bool = True,
    attn_implementation: str = "sdpa",
) -> tuple[SpeechTokenizerDecoder, SpeechTokenizerEncoder | None]:
    """Seeded random (decoder, encoder): same seed and config -> same tensors, on any device."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    decoder = SpeechTokenizerDecoder(config.decoder)
    randomize_(decoder, generator)
    decoder = decoder.to(device=device, dtype=dtype).eval()
    encoder = None
    if with_encoder:
        encoder = SpeechTokenizerEncoder(config, attn_implementation=attn_implementation)
        randomize_(encoder.mimi, generator)
        encoder = encoder.to(device=device, dtype=dtype).eval()
        encoder.reset_caches()
    return decoder, encoder


def save_speech_tokenizer(
    directory: str | Path,
    config: SpeechTokenizerConfig,
    decoder: SpeechTokenizerDecoder,
    encoder: SpeechTokenizerEncoder,
) -> None:
    """Write the official folder layout (config.json + model.safetensors, fp32) that
    `load_speech_tokenizer` and the official package read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"decoder.{k}": v.detach().float().cpu().contiguous() for k, v in decoder.state_dict().items()}
    tensors |= {f"encoder.{k}": v.detach().float().cpu().contiguous() for k, v in encoder.mimi.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
