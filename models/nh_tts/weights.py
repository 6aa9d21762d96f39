"""NH-TTS network weights: seeded random weights, and strict loading of a Hugging Face Dia checkpoint
(`model.safetensors`, or shards named by `model.safetensors.index.json`) whose tensor names are
DiaForConditionalGeneration's. Missing, unexpected and mis-shaped tensors are one CheckpointError that
names them; a non-float tensor is refused (models.checkpoint_io). Imports: torch, safetensors (through
models.checkpoint_io), models.{errors,checkpoint_io}, models.nh_tts.{config,decoder}.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tilevox.models.checkpoint_io import SafetensorsFile, check_tensor_dtype
from tilevox.models.errors import CheckpointError
from tilevox.models.nh_tts.config import NhTtsConfig
from tilevox.models.nh_tts.decoder import NhTtsNetwork

__all__ = ["checkpoint_files", "load_network", "random_network"]


@torch.no_grad()
def random_network(config: NhTtsConfig, *, seed: int, device, dtype: torch.dtype) -> NhTtsNetwork:
    """Seeded random weights (normal, std 0.02 for matrices and embeddings scaled so logits stay O(1);
    norms 1), drawn on the CPU in fp32 so every device gets the same numbers. On the meta device: shapes only."""
    device = torch.device(device)
    network = NhTtsNetwork(config, device=device, dtype=dtype)
    if device.type == "meta":
        return network
    generator = torch.Generator().manual_seed(seed)
    for name, param in network.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        fan_in = param.shape[-1]
        std = 1.0 if "embed" in name else 1.0 / math.sqrt(fan_in)
        if name.endswith("q_proj.weight"):  # Dia's attention is unscaled: keep q.k at O(1) as its weights do
            head_dim = config.encoder.head_dim if ".encoder." in name else config.decoder.head_dim
            if ".cross_attention." in name:
                head_dim = config.decoder.cross_head_dim
            std /= math.sqrt(head_dim)
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
        param.copy_(values.to(dtype))
    return network.eval()


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: model.safetensors, or the index's shards."""
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc})") from exc
        return [root / name for name in sorted(set(weight_map.values()))]
    raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json")


@torch.no_grad()
def load_network(root: str | Path, config: NhTtsConfig, *, device, dtype: torch.dtype) -> NhTtsNetwork:
    """The network of a Dia checkpoint directory, every tensor checked against the model's names and shapes."""
    root = Path(root)
    device = torch.device(device)
    network = NhTtsNetwork(config, device=device, dtype=dtype)
    params = dict(network.named_parameters())
    seen: set[str] = set()
    unexpected: list[str] = []
    misshaped: list[str] = []
    for path in checkpoint_files(root):
        with SafetensorsFile(path) as handle:
            for name in handle.keys():
                if name not in params:
                    unexpected.append(name)
                    continue
                if name in seen:
                    raise CheckpointError(f"{path}: tensor {name!r} appears in more than one shard")
                shape = handle.shape(name)
                if shape != tuple(params[name].shape):
                    misshaped.append(f"{name} {list(shape)} (expected {list(params[name].shape)})")
                    continue
                tensor = handle.tensor(name)
                check_tensor_dtype(name, tensor, params[name], where=str(path))
                params[name].copy_(tensor.to(device=device, dtype=dtype))
                seen.add(name)
    missing = sorted(set(params) - seen - {m.split(" ")[0] for m in misshaped})
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {', '.join(misshaped)}")
    if problems:
        raise CheckpointError(f"{root}: not an NH-TTS (Dia) checkpoint for its config.json; " + "; ".join(problems))
    return network.eval()
