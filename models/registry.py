"""Resolve a model spec (`random:<family>-<size>` or a checkpoint directory) to a SpeechModel.

Model packages are imported lazily so that loading one model never imports another.
Imports: models.* only.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from tilevox.models.errors import CheckpointError
from tilevox.models.fused_swiglu import FusedSwiglu, apply_fused_swiglu
from tilevox.models.streaming import SpeechModel

__all__ = ["DTYPES", "PRESETS", "load_model", "parse_dtype"]

# preset name -> "module:function" taking (preset_name, *, device, dtype) -> SpeechModel
PRESETS: dict[str, str] = {
    "llama-tiny": "tilevox.models.llasa.loader:load_preset",
    "llama-1b": "tilevox.models.llasa.loader:load_preset",
    "qwen3-tts-tiny": "tilevox.models.qwen3_tts.loader:load_preset",
    "qwen3-tts-0.6b": "tilevox.models.qwen3_tts.loader:load_preset",
    "qwen3-tts-1.7b": "tilevox.models.qwen3_tts.loader:load_preset",
}

# config.json "model_type" -> "module:function" taking (checkpoint_dir, *, device, dtype) -> SpeechModel
CHECKPOINT_TYPES: dict[str, str] = {
    "llama": "tilevox.models.llasa.loader:load_checkpoint",
    "qwen3_tts": "tilevox.models.qwen3_tts.loader:load_checkpoint",
}

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _resolve(target: str):
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    fused_swiglu: FusedSwiglu = FusedSwiglu.AUTO,
) -> SpeechModel:
    """Load `spec`: `random:<preset>` (seeded random weights) or a checkpoint directory.

    With `fused_swiglu` AUTO each MLP call takes the path that the measured dispatch table
    (models/fused_swiglu_dispatch.json) names for its shape and token count on this GPU, PyTorch wherever
    the table has nothing faster; ON uses the fused op at every token count and raises where it cannot run."""
    model = _load_model(spec, device=device, dtype=dtype)
    apply_fused_swiglu(model.torch_modules(), fused_swiglu)
    return model


def _load_model(spec: str, *, device: str | torch.device, dtype: torch.dtype) -> SpeechModel:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is visible")
    if spec.startswith("random:"):
        preset = spec.removeprefix("random:")
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {spec!r}; known presets: {', '.join('random:' + p for p in PRESETS)}")
        return _resolve(PRESETS[preset])(preset, device=device, dtype=dtype)
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"unknown model {spec!r}: not a random: preset and no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{spec}: a checkpoint must be a directory holding config.json")
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{config_path}: missing; a checkpoint directory needs a config.json") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: unreadable ({exc})") from exc
    model_type = config.get("model_type")
    if model_type not in CHECKPOINT_TYPES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not served; known: {', '.join(CHECKPOINT_TYPES)}"
        )
    return _resolve(CHECKPOINT_TYPES[model_type])(path, device=device, dtype=dtype)
