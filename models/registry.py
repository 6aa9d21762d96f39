"""One table of model names: resolve a model spec (`random:<preset>` or a checkpoint directory) to a SpeechModel.

A preset name means one thing everywhere (synth, serve, the region compiler, benchmarks): it is an entry
of its family's preset table (models.llasa.presets, models.qwen3_tts.presets), and the registry lists
the families. Adding a preset is one entry in its family's table; adding a family is one `Family` here.
Model packages are imported lazily so that loading one model never imports another (the preset
tables import no torch). Imports: models.* only.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tilevox.models.errors import CheckpointError
from tilevox.models.fused_swiglu import FusedSwiglu, apply_fused_swiglu
from tilevox.models.streaming import SpeechModel

__all__ = ["DTYPES", "FAMILIES", "Family", "load_model", "meta_regions", "parse_dtype", "preset_family", "presets"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """A model family. Its `loader` module provides
    load_preset(name, *, device, dtype, **options), load_checkpoint(path, *, device, dtype, **options) and
    meta_regions(name, *, dtype) (the region networks with shapes only); `presets` names its preset table
    ("module:ATTRIBUTE", a dict keyed by preset name); `options` lists the loader options it accepts."""

    name: str
    presets: str
    loader: str
    checkpoint_type: str  # config.json "model_type" of its checkpoints
    options: tuple[str, ...] = ()


FAMILIES: tuple[Family, ...] = (
    Family(
        name="llasa",
        presets="tilevox.models.llasa.presets:LLASA_PRESETS",
        loader="tilevox.models.llasa.loader",
        checkpoint_type="llama",
    ),
    Family(
        name="qwen3_tts",
        presets="tilevox.models.qwen3_tts.presets:QWEN3_TTS_PRESETS",
        loader="tilevox.models.qwen3_tts.loader",
        checkpoint_type="qwen3_tts",
        options=("decode_mode",),
    ),
    Family(
        name="nh_tts",
        presets="tilevox.models.nh_tts.presets:NH_TTS_PRESETS",
        loader="tilevox.models.nh_tts.loader",
        checkpoint_type="dia",
    ),
)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _attribute(target: str):
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def presets() -> dict[str, Family]:
    """Every preset name -> its family, in table order."""
    out: dict[str, Family] = {}
    for family in FAMILIES:
        for name in _attribute(family.presets):
            if name in out:
                raise RuntimeError(f"preset {name!r} is in both {out[name].name} and {family.name}")
            out[name] = family
    return out


def preset_family(preset: str) -> Family:
    """The family of `preset` (a name with or without `random:`); ValueError listing the known ones."""
    name = preset.removeprefix("random:")
    table = presets()
    if name not in table:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join('random:' + p for p in table)}")
    return table[name]


def _loader_options(family: Family, options: dict[str, object]) -> dict[str, object]:
    given = {k: v for k, v in options.items() if v is not None}
    refused = sorted(set(given) - set(family.options))
    if refused:
        raise ValueError(f"{family.name} models take no {', '.join(refused)} option")
    return given


def meta_regions(preset: str, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.nn.Module]:
    """The preset's regions (name -> network), shapes only on the meta device: for the region compiler."""
    name = preset.removeprefix("random:")
    family = preset_family(name)
    return importlib.import_module(family.loader).meta_regions(name, dtype=dtype)


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    fused_swiglu: FusedSwiglu = FusedSwiglu.AUTO,
    decode_mode: str | None = None,
) -> SpeechModel:
    """Load `spec`: `random:<preset>` (seeded random weights) or a checkpoint directory.

    With `fused_swiglu` AUTO each MLP call takes the path that the measured dispatch table
    (models/fused_swiglu_dispatch.json) names for its shape and token count on this GPU, PyTorch wherever
    the table has nothing faster; ON uses the fused op at every token count and raises where it cannot run.
    `decode_mode` (Qwen3-TTS only; None: the family's default "exact"): "official_chunked" reproduces the
    official package's chunked codec decode of audio longer than 300 frames."""
    model = _load_model(spec, device=device, dtype=dtype, options={"decode_mode": decode_mode})
    apply_fused_swiglu(model.torch_modules(), fused_swiglu)
    return model


def _load_model(
    spec: str, *, device: str | torch.device, dtype: torch.dtype, options: dict[str, object]
) -> SpeechModel:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is visible")
    if spec.startswith("random:"):
        family = preset_family(spec)
        loader = importlib.import_module(family.loader)
        return loader.load_preset(
            spec.removeprefix("random:"), device=device, dtype=dtype, **_loader_options(family, options)
        )
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
    by_type = {family.checkpoint_type: family for family in FAMILIES}
    if model_type not in by_type:
        raise CheckpointError(f"{config_path}: model_type {model_type!r} is not served; known: {', '.join(by_type)}")
    family = by_type[model_type]
    loader = importlib.import_module(family.loader)
    return loader.load_checkpoint(path, device=device, dtype=dtype, **_loader_options(family, options))
