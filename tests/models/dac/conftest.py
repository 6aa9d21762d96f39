"""Fixtures for the DAC tests: transformers' DacModel as the reference (oracle tests only), and a way to
write a tilevox codec in the `DacModel.save_pretrained` layout without transformers."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tilevox.models.dac import DAC_PRESETS, DacCodec, random_dac

TINY = DAC_PRESETS["dac-tiny"]


@pytest.fixture(scope="session")
def hf_dac():
    """The module `transformers.models.dac.modeling_dac` (DacModel) with its DacConfig."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the DAC reference; see scripts/setup_cpu.sh)")
    return importlib.import_module("transformers.models.dac")


@pytest.fixture(scope="session")
def tiny_codec() -> DacCodec:
    return random_dac(TINY, seed=3)


def write_checkpoint(folder: Path, config_dict: dict, state: dict[str, torch.Tensor]) -> Path:
    """A save_pretrained-style folder: config.json and model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def weight_normed(state: dict[str, torch.Tensor], *, old_names: bool = False) -> dict[str, torch.Tensor]:
    """Every conv weight of `state` split into weight norm's magnitude g and direction v (norm over all
    but dim 0), named as torch's parametrization writes them, or as the old hook (`old_names`)."""
    g_suffix, v_suffix = (
        (".weight_g", ".weight_v")
        if old_names
        else (".parametrizations.weight.original0", ".parametrizations.weight.original1")
    )
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight") and ".codebook." not in name:
            module = name.removesuffix(".weight")
            norm = tensor.flatten(1).norm(dim=1).reshape((-1,) + (1,) * (tensor.dim() - 1))
            out[module + g_suffix] = norm
            out[module + v_suffix] = tensor * 2.0  # any positive scale of v folds to the same weight
        else:
            out[name] = tensor
    return out
