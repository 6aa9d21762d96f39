"""Tensors derived from a module's parameters, computed once and reused until a parameter changes.

An activation such as Qwen3-TTS's SnakeBeta (x + sin(x e^alpha)^2 / (e^beta + 1e-9)) or DAC's Snake recomputed its
per-channel factors (exp, add, reciprocal: one small kernel each) on every call, and the codec's RVQ its whole
codebook tables. `derived(owner, params, compute)` returns compute(*params), cached on `owner` and recomputed when any of
`params` is written in place (its version counter), moved or re-created (its storage, dtype, device): a loader's
`copy_`, `.to()`, `load_state_dict` all invalidate it. Under torch.compile it simply computes (no Python-side
cache inside a traced graph). Under CUDA-graph capture a call that would compute is an error instead: the first
eager call (every backend's warm-up) fills the cache, and a capture must not allocate and own it.
Imports: torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["derived"]


def _key(params: Sequence[torch.Tensor]) -> tuple:
    # An inference tensor (a module built under torch.inference_mode) has no version counter: its storage, dtype,
    # device and shape still change with every move or reload; an in-place write to it goes unseen.
    return tuple(
        (-1 if p.is_inference() else p._version, p.data_ptr(), p.dtype, p.device, tuple(p.shape)) for p in params
    )


def derived(
    owner: torch.nn.Module, params: Sequence[torch.Tensor], compute: Callable[..., tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, ...]:
    """compute(*params) (no autograd), cached on `owner` until one of `params` changes (see the module docs)."""
    if torch.compiler.is_compiling():
        return compute(*params)
    key = _key(params)
    cached = owner.__dict__.get("_derived_cache")
    if cached is not None and cached[0] == key:
        return cached[1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{type(owner).__name__}: its parameter-derived constants would be computed inside a CUDA-graph capture; "
            "run the module once eagerly first (a warm-up) so that they exist"
        )
    with torch.no_grad():
        values = compute(*params)
    owner.__dict__["_derived_cache"] = (key, values)
    return values
