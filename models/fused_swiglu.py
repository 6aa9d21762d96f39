"""Swap a model's SwiGLU MLPs (bias-free gate_proj/up_proj/down_proj) for the fused CUTLASS op.

The fused op (trt_plugins.ops.SwigluMLP) runs only on SM 9.0 GPUs in bf16 with the kernel library
built; everywhere else the model keeps its plain PyTorch MLP, which is the reference. `AUTO`
applies the swap where it can and logs why it did not; `ON` raises instead; `OFF` never swaps.
Weights are repacked once here, at load time.
"""

from __future__ import annotations

import enum
import logging

import torch
from torch import nn

__all__ = ["FusedSwiglu", "apply_fused_swiglu", "fused_swiglu_unavailable_reason"]

log = logging.getLogger(__name__)


class FusedSwiglu(enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


def fused_swiglu_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the fused op can run for weights on `device` in `dtype`; otherwise why not."""
    if device.type != "cuda":
        return f"device is {device.type}, the fused SwiGLU kernels need a CUDA Hopper GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"GPU compute capability is {capability[0]}.{capability[1]}, the kernels are built for sm_90a"
    if dtype != torch.bfloat16:
        return f"dtype is {dtype}, the fused SwiGLU kernels take bf16"
    from tilevox.trt_plugins.library import KernelLibraryError, KernelLibraryNotFoundError, kernels_library

    try:
        kernels_library()
    except (KernelLibraryError, KernelLibraryNotFoundError) as exc:
        return str(exc)
    return None


def _swiglu_mlps(root: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for parent in root.modules():
        for name, child in parent.named_children():
            projections = [getattr(child, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
            if all(isinstance(p, nn.Linear) and p.bias is None for p in projections):
                found.append((parent, name, child))
    return found


def apply_fused_swiglu(roots: tuple[nn.Module, ...], mode: FusedSwiglu) -> int:
    """Replace every SwiGLU MLP under `roots`; returns how many were replaced."""
    if mode is FusedSwiglu.OFF:
        return 0
    from tilevox.trt_plugins.ops import SwigluMLP, layout_for_device

    count = 0
    for root in roots:
        for parent, name, mlp in _swiglu_mlps(root):
            weight = mlp.gate_proj.weight
            reason = fused_swiglu_unavailable_reason(weight.device, weight.dtype)
            n, k = weight.shape
            if reason is None and (n % 8 or k % 8):
                reason = f"MLP shape N={n}, K={k}: the kernels need multiples of 8"
            if reason is not None:
                if mode is FusedSwiglu.ON:
                    raise ValueError(f"fused SwiGLU was asked for but cannot run: {reason}")
                log.info("fused SwiGLU not used: %s", reason)
                return count
            layout = layout_for_device(weight.device, n, k)
            setattr(parent, name, SwigluMLP.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, layout=layout))
            count += 1
    if count:
        log.info("fused SwiGLU: %d MLPs use the CUTLASS kernels", count)
    return count
