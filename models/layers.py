"""Building blocks shared by the Llama/Qwen3 decoders and the Qwen3-TTS codec transformer.

RMSNorm here is the Llama/Qwen form: statistics in fp32, cast back to the input dtype, then scaled
by the weight (transformers' order; XCodec2 scales in fp32 and keeps its own). `GatedMLP` is the
bias-free-or-not SwiGLU MLP whose gate_proj/up_proj/down_proj names match Hugging Face checkpoints
and which models.fused_swiglu swaps for the fused kernel.
Imports: torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GatedMLP", "RMSNorm", "gather_keys"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool = False, device=None, dtype=None
    ) -> None:
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def gather_keys(
    keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor | slice, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [0, num_keys) of the given slots of one layer's cache (N, KV, S, D): (B, KV, num_keys, D)
    each. Eagerly a slice then a gather (only those keys are copied). Under torch.compile the positions are
    gathered by index instead, so that a symbolic num_keys stays symbolic even where it equals S (a slice
    view's contiguity would otherwise pin it to the cache length, one compile per length)."""
    if not torch.compiler.is_compiling():
        return keys[slots, :, :num_keys], values[slots, :, :num_keys]
    positions = torch.arange(num_keys, device=keys.device)
    if isinstance(slots, slice):
        keys, values = keys[slots], values[slots]
        return keys[:, :, positions], values[:, :, positions]
    rows = slots[:, None]  # advanced indices split by a slice: (B, num_keys, KV, D), then back
    return keys[rows, :, positions].transpose(1, 2), values[rows, :, positions].transpose(1, 2)
