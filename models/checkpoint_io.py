"""Shared checkpoint tensor reading: guarded safetensors access and tensor dtype checks.

Every loader (Llama, Qwen3-TTS talker and speech tokenizer, XCodec2) reads through these, so a
broken checkpoint fails the same way everywhere:
- a truncated or corrupt `.safetensors` file raises CheckpointError naming the file (never a
  bare SafetensorError traceback);
- a non-float tensor where the model holds a float (or the reverse) raises CheckpointError
  naming the tensor and the file, instead of being cast.
Config-field rules live in models.config_fields. Imports: torch, safetensors, models.errors.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tilevox.models.errors import CheckpointError

__all__ = ["SafetensorsFile", "check_tensor_dtype", "read_safetensors", "resolve_codec_dir"]


class SafetensorsFile:
    """`safe_open` with every failure (truncated, corrupt, unreadable file) raised as CheckpointError
    naming the file. Use as a context manager; tensors are read one at a time (`tensor`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handle = None

    def __enter__(self) -> SafetensorsFile:
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: missing")
        try:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.path}: unreadable safetensors file, truncated or corrupt ({exc})") from exc
        return self

    def __exit__(self, *exc_info) -> None:
        self._handle = None  # safe_open's handle needs no explicit close (the mmap goes with it)

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(self._handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r} unreadable ({exc})") from exc

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r} unreadable ({exc})") from exc


def read_safetensors(path: str | Path, *, skip_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (except names starting with `skip_prefixes`), guarded as
    SafetensorsFile."""
    with SafetensorsFile(path) as handle:
        return {name: handle.tensor(name) for name in handle.keys() if not name.startswith(skip_prefixes)}


def check_tensor_dtype(name: str, tensor: torch.Tensor, target: torch.Tensor | torch.dtype, *, where: str) -> None:
    """Refuse a checkpoint tensor whose kind differs from the model's: a non-float tensor for a float
    parameter (e.g. int32 weights), or a float for an integer/bool buffer. Floats of any width are
    accepted (the loader casts between float dtypes, as transformers does with `dtype=`)."""
    want = target if isinstance(target, torch.dtype) else target.dtype
    if want.is_floating_point and not tensor.is_floating_point():
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point tensor")
    if not want.is_floating_point and tensor.dtype != want:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected {want}")


def resolve_codec_dir(
    checkpoint_dir: Path, explicit: str | Path | None, *, subdir: str, env_var: str, codec: str, missing: str
) -> Path:
    """A model's separately distributed codec checkpoint: `explicit` if given, else <checkpoint>/<subdir>/,
    else $<env_var>; CheckpointError naming the codec (`missing`: how to provide it) when none exists."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_dir():
            raise CheckpointError(f"{path}: {codec} checkpoint directory does not exist")
        return path
    inside = checkpoint_dir / subdir
    if inside.is_dir():
        return inside
    from_env = os.environ.get(env_var)
    if from_env:
        path = Path(from_env)
        if not path.is_dir():
            raise CheckpointError(f"{env_var}={from_env}: no such directory for the {codec} checkpoint")
        return path
    raise CheckpointError(
        f"{checkpoint_dir}: no {codec} checkpoint found. {missing}: put it in {inside}/ or set {env_var}"
    )
