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

__all__ = [
    "GatedMLP",
    "RMSNorm",
    "gather_keys",
    "slot_attention",
    "slot_attention_reference",
    "slot_attention_supported",
    "slot_key_offsets",
]


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


# One decode query per row against its own slot of a layer's cache, without gathering the slots' keys
# first: FlashAttention's variable-length kernel reads each row's keys in place. The layer's cache
# (N, KV, S, D) is seen as (rows, KV, D) with a row stride of D and a head stride of S*D (an overlapping
# strided view), so slot n's keys start at row n*KV*S; cu_seqlens_k gives each batch row that start and
# seqused_k its number of visible keys (start + 1), so neither has to be contiguous nor ordered. The gather
# this replaces copied every row's keys and values, layer by layer, through PyTorch's generic index kernel:
# 4.8 of 9.0 ms of a batch-32 Llama-1B step on the H200 (benchmarks/results/profile_llama-1b_h200_3668617.txt).
SLOT_ATTENTION_MAX_HEAD_DIM = 256  # FlashAttention 2's largest head size


def slot_attention_supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether slot_attention runs for this query (B, H, 1, D) and layer cache (N, KV, S, D): one new
    position per row, fp16/bf16 on an Ampere-or-later GPU, a head size FlashAttention takes, whole GQA
    groups, eager or under CUDA-graph capture (torch.compile keeps its own gathered form)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or keys.dtype != q.dtype:
        return False
    if q.dim() != 4 or q.shape[2] != 1 or keys.dim() != 4 or not keys.is_contiguous():
        return False
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > SLOT_ATTENTION_MAX_HEAD_DIM or q.shape[1] % keys.shape[1]:
        return False
    if torch.compiler.is_compiling():
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def slot_key_offsets(keys: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer cache keys (N, KV, S, D) as FlashAttention's packed (rows, KV, D) keys (a strided view,
    no copy) and cu_seqlens_k (B + 1,) int32: row b's keys start at slots[b] * KV * S; the last entry is
    the view's row count (unused: seqused_k gives every row's length)."""
    num_slots, num_kv, seq, head_dim = keys.shape
    rows = (num_slots - 1) * num_kv * seq + seq  # the last row any slot's last head reads, plus one
    packed = keys.as_strided((rows, num_kv, head_dim), (head_dim, seq * head_dim, 1))
    starts = (slots * (num_kv * seq)).to(torch.int32)
    end = torch.full((1,), rows, dtype=torch.int32, device=keys.device)
    return packed, torch.cat((starts, end))


def slot_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    max_keys: int,
    scale: float,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over keys [0, lengths[b]) of slot slots[b], read in place: q (B, H, 1, D);
    keys, values one layer's cache (N, KV, S, D); slots, lengths (B,) on q's device, lengths <= max_keys
    (a host bound: FlashAttention's max_seqlen_k). Returns (B, H, 1, D). Check slot_attention_supported."""
    batch, heads, _, head_dim = q.shape
    packed_k, cu_k = slot_key_offsets(keys, slots)
    packed_v, _ = slot_key_offsets(values, slots)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    out = torch.ops.aten._flash_attention_forward(
        q.reshape(batch, heads, head_dim).contiguous(),
        packed_k,
        packed_v,
        cu_q,
        cu_k,
        1,
        max_keys,
        0.0,
        False,
        False,
        scale=scale,
        seqused_k=lengths.to(torch.int32),
    )[0]
    return out.view(batch, heads, 1, head_dim)


def slot_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """slot_attention's semantics in float64, reading keys through slot_key_offsets' packed view and
    offsets exactly as the kernel does (so a CPU test checks the offsets, and a GPU test the kernel)."""
    batch, heads, _, head_dim = q.shape
    packed_k, cu_k = slot_key_offsets(keys, slots)
    packed_v, _ = slot_key_offsets(values, slots)
    groups = heads // keys.shape[1]
    out = torch.empty(batch, heads, 1, head_dim, dtype=torch.float64)
    for row in range(batch):
        start, count = int(cu_k[row]), int(lengths[row])
        k = packed_k[start : start + count].double().cpu()  # (count, KV, D)
        v = packed_v[start : start + count].double().cpu()
        for head in range(heads):
            scores = (k[:, head // groups] @ q[row, head, 0].double().cpu()) * scale
            out[row, head, 0] = scores.softmax(0) @ v[:, head // groups]
    return out
