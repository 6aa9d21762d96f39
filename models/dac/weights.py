"""Build a DacCodec with seeded random weights, or load the folder transformers' `DacModel.save_pretrained`
writes (config.json + model.safetensors).

A conv weight may be stored plain (`weight`), or weight-normed as the old hook writes it (`weight_g`,
`weight_v`) or as torch's parametrization does (`parametrizations.weight.original0` = g,
`.original1` = v): the loader folds g * v / |v| (norm over all but dim 0) into a plain weight.
Imports: torch, models.errors, models.checkpoint_io, models.dac.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tilevox.models.checkpoint_io import check_tensor_dtype, read_safetensors
from tilevox.models.dac.config import DacConfig
from tilevox.models.dac.model import DacCodec, ResidualUnit, Snake
from tilevox.models.errors import CheckpointError

__all__ = ["CHECKPOINT_FILE", "CONFIG_FILE", "fold_weight_norm", "load_dac", "random_dac"]

CHECKPOINT_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Weight-norm spellings: suffix of the magnitude g and of the direction v that replace ".weight".
_WEIGHT_NORM_SUFFIXES = (
    (".weight_g", ".weight_v"),
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
)

_RESIDUAL_BRANCH_SCALE = 0.3


def random_dac(
    config: DacConfig,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DacCodec:
    """A codec with seeded random weights: the same seed gives the same weights on every device (drawn
    on the CPU in fp32, then cast). Conv weights are fan-in scaled normals, the residual branches'
    output convs 0.3 times that, so activations keep their size through the 12 residual sums and the
    final tanh stays out of saturation (output std ~0.35); snake alphas scatter around 1 and stay positive."""
    model = DacCodec(config, device="cpu", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                fan_in = module.in_channels * module.kernel_size[0]
                module.weight.normal_(0.0, fan_in**-0.5, generator=generator)
                module.bias.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, Snake):
                module.alpha.uniform_(0.5, 1.5, generator=generator)
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, 1.0, generator=generator)
        for module in model.modules():
            if isinstance(module, ResidualUnit):
                module.conv2.weight.mul_(_RESIDUAL_BRANCH_SCALE)
    return model.to(device=device, dtype=dtype).eval()


def load_dac(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DacCodec:
    """Load a `DacModel.save_pretrained` folder. Strict: an unknown config field, a missing, unexpected or
    mis-shaped tensor, or half of a weight-norm pair raises CheckpointError naming it."""
    path = Path(path)
    config_path, weights_path = path / CONFIG_FILE, path / CHECKPOINT_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a DacModel.save_pretrained folder")
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing")
    if not weights_path.is_file():
        raise CheckpointError(f"{weights_path}: missing (sharded or .bin DAC checkpoints are not supported)")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: unreadable JSON ({exc})") from exc
    config = DacConfig.from_dict(data, source=str(config_path))

    state = fold_weight_norm(read_safetensors(weights_path), where=str(weights_path), dtype=dtype)
    expected = DacCodec(config, device="meta").state_dict()
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(f"{weights_path}: {len(unexpected)} unexpected tensor(s) for this config: {shown}")
    for name, param in expected.items():
        if name not in state:
            raise CheckpointError(f"{weights_path}: missing tensor {name!r}")
        if tuple(state[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"{weights_path}: tensor {name!r} has shape {tuple(state[name].shape)}, expected {tuple(param.shape)}"
            )
        check_tensor_dtype(name, state[name], dtype, where=str(weights_path))

    model = DacCodec(config, device=device, dtype=dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def fold_weight_norm(
    state: dict[str, torch.Tensor], *, where: str, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """`state` with every weight-norm pair (g, v) replaced by its plain `<module>.weight`; other tensors
    pass through. Folded in float64 and rounded once, to `dtype` (default: v's dtype)."""
    out: dict[str, torch.Tensor] = {}
    paired: set[str] = set()
    for name, tensor in state.items():
        for g_suffix, v_suffix in _WEIGHT_NORM_SUFFIXES:
            if name.endswith(g_suffix):
                module = name.removesuffix(g_suffix)
                v_name = module + v_suffix
                if v_name not in state:
                    raise CheckpointError(f"{where}: tensor {name!r} has no weight-norm partner {v_name!r}")
                out[_claim(out, module + ".weight", name, where)] = _fold(tensor, state[v_name], name, where, dtype)
                paired.update((name, v_name))
    for name, tensor in state.items():
        if name in paired:
            continue
        for g_suffix, v_suffix in _WEIGHT_NORM_SUFFIXES:
            if name.endswith(v_suffix):
                g_name = name.removesuffix(v_suffix) + g_suffix
                raise CheckpointError(f"{where}: tensor {name!r} has no weight-norm partner {g_name!r}")
        out[_claim(out, name, name, where)] = tensor
    return out


def _claim(out: dict[str, torch.Tensor], key: str, source: str, where: str) -> str:
    if key in out:
        raise CheckpointError(f"{where}: {key!r} is stored twice (plain and weight-normed; {source!r})")
    return key


def _fold(g: torch.Tensor, v: torch.Tensor, name: str, where: str, dtype: torch.dtype | None) -> torch.Tensor:
    if not (g.is_floating_point() and v.is_floating_point()):
        raise CheckpointError(f"{where}: weight-norm tensors of {name!r} must be floating point")
    if v.dim() < 2 or tuple(g.shape) != (v.shape[0],) + (1,) * (v.dim() - 1):
        raise CheckpointError(
            f"{where}: weight-norm magnitude {name!r} has shape {tuple(g.shape)}, "
            f"expected {(v.shape[0],) + (1,) * (v.dim() - 1)} for a direction of shape {tuple(v.shape)}"
        )
    v64 = v.double()
    norm = v64.flatten(1).norm(dim=1).reshape(g.shape)
    return (v64 * (g.double() / norm)).to(dtype or v.dtype)
