"""Build a LlamaForCausalLM with seeded random weights, or load one from a Hugging Face checkpoint.

Both paths allocate the parameters once, directly on the target device in the target dtype (no
fp32 CPU copy of a 1B model, no init pass that is then overwritten). Loading is strict: a
missing, unexpected or mis-shaped tensor raises CheckpointError naming it.
A truncated or corrupt file raises CheckpointError naming it (models.checkpoint_io).
Imports: torch, models.errors, models.checkpoint_io, models.llama.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tilevox.models.checkpoint_io import SafetensorsFile, check_tensor_dtype
from tilevox.models.errors import CheckpointError
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.model import LlamaForCausalLM

__all__ = ["load_llama", "load_llama_config", "o1_random_llama", "random_llama", "read_safetensors_index"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INIT_STD = 0.02  # transformers' initializer_range default for Llama


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of float32, float16, bfloat16; got {dtype}")


def random_llama(config: LlamaConfig, *, seed: int, device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Seeded random weights: N(0, 0.02) matrices and embeddings, unit norms, zero biases. Values depend
    on the device's generator (CPU and CUDA draw different streams for the same seed). On the meta
    device only shapes are built."""
    _check_dtype(dtype)
    device = torch.device(device)
    model = LlamaForCausalLM(config, device=device, dtype=dtype)
    if device.type != "meta":
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():  # tied weights appear once
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, _INIT_STD, generator=generator)
    return model.eval().requires_grad_(False)


def o1_random_llama(config: LlamaConfig, *, seed: int, device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Seeded random Llama with O(1) activations, for numerical tests and benchmarks: matrices
    N(0, 1/fan_in), an untied embedding N(0, 1), norm gains 1 + N(0, 0.1). `random_llama`'s N(0, 0.02)
    init gives near-uniform logits, where greedy tokens would test rounding rather than the code. Drawn in
    fp32 on `device`, then stored in `dtype`. A tied table is also the head, so it is drawn as a matrix:
    N(0, 1) rows would dominate the final hidden state and every step would predict its own input token."""
    _check_dtype(dtype)
    device = torch.device(device)
    model = LlamaForCausalLM(config, device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head appears once (as the embedding)
            noise = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * noise)
            elif "embed" in name and not config.tie_word_embeddings:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))
    return model.eval().requires_grad_(False)


def load_llama_config(checkpoint_dir: str | Path) -> LlamaConfig:
    config_path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{config_path}: missing") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: unreadable ({exc})") from exc
    try:
        return LlamaConfig.from_hf_config(raw, source=str(config_path))
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc


def read_safetensors_index(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it.

    With model.safetensors.index.json the index's weight_map decides (and each named file must exist
    and hold its tensors); without it every *.safetensors file in the directory is read, and a name
    found in two files is an error."""
    root = Path(checkpoint_dir)
    index_path = root / "model.safetensors.index.json"
    locations: dict[str, Path] = {}
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: unreadable or lacks weight_map ({exc})") from exc
        by_file: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            by_file.setdefault(file_name, []).append(name)
        for file_name, names in sorted(by_file.items()):
            path = root / file_name
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {index_path.name} but missing")
            with SafetensorsFile(path) as handle:
                present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{path}: tensor {name!r} is listed in {index_path.name} but not in the file")
                locations[name] = path
        return locations
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files (and no model.safetensors.index.json)")
    for path in files:
        with SafetensorsFile(path) as handle:
            for name in handle.keys():
                if name in locations:
                    raise CheckpointError(f"tensor {name!r} appears in both {locations[name]} and {path}")
                locations[name] = path
    return locations


def _name_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_llama(
    checkpoint_dir: str | Path, *, device, dtype: torch.dtype, config: LlamaConfig | None = None
) -> LlamaForCausalLM:
    """Load config.json (unless `config` is given) and the safetensors weights, cast to `dtype`."""
    _check_dtype(dtype)
    root = Path(checkpoint_dir)
    if config is None:
        config = load_llama_config(root)
    device = torch.device(device)
    model = LlamaForCausalLM(config, device=device, dtype=dtype)  # uninitialised: every tensor is copied in
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {name: tuple(p.shape) for name, p in params.items()}
    tied_name = "lm_head.weight"
    if config.tie_word_embeddings:
        expected.pop(tied_name)
    locations = read_safetensors_index(root)
    missing = sorted(set(expected) - set(locations))
    # A tied checkpoint may still carry lm_head.weight; it is checked against the embedding below.
    unexpected = sorted(set(locations) - set(expected) - ({tied_name} if config.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"{root}: missing tensor(s) {_name_list(missing)}")
    if unexpected:
        raise CheckpointError(f"{root}: unexpected tensor(s) {_name_list(unexpected)}")

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(locations[name], []).append(name)
    if config.tie_word_embeddings and tied_name in locations:
        by_file.setdefault(locations[tied_name], []).append(tied_name)
    tied_pair: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for path, names in by_file.items():
            with SafetensorsFile(path) as handle:
                for name in names:
                    shape = handle.shape(name)
                    want = expected.get(name, expected.get("model.embed_tokens.weight"))
                    if shape != want:
                        raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, expected {want}")
                    tensor = handle.tensor(name)
                    check_tensor_dtype(name, tensor, dtype, where=str(path))
                    if config.tie_word_embeddings and name in (tied_name, "model.embed_tokens.weight"):
                        tied_pair[name] = tensor
                    if name in expected:
                        params[name].copy_(tensor)  # one tensor at a time: host memory stays small
    if tied_name in tied_pair and not torch.equal(tied_pair[tied_name], tied_pair["model.embed_tokens.weight"]):
        raise CheckpointError(
            f"{locations[tied_name]}: {tied_name!r} differs from model.embed_tokens.weight although "
            "tie_word_embeddings is true"
        )
    return model.eval().requires_grad_(False)
