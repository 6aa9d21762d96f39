"""The NH-TTS byte-level text encoder, and the blocks it shares with the decoder, as transformers'
DiaEncoder computes them: RMSNorm (fp32 statistics), unscaled dot-product attention (Dia folds the
1/sqrt(d) into its query weights, so `scaling` is 1), default RoPE on positions 0..T-1, a fused gate/up
SiLU MLP. Module and parameter names equal transformers' so checkpoints load by name.
Imports: torch, models.layers, models.nh_tts.config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tilevox.models.layers import RMSNorm
from tilevox.models.nh_tts.config import NhEncoderConfig

__all__ = ["FusedGateUpMLP", "NhAttentionProjections", "NhTextEncoder", "apply_rope", "attend", "rope_inv_freq"]


class _Linear(nn.Linear):
    """nn.Linear without the init pass (the loaders always set the weights)."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim / 2,) fp32 on CPU, as transformers' default RoPE init."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) int -> cos, sin (B, T, D) in `dtype` (angles in fp32, as transformers)."""
    freqs = positions[..., None].float() * inv_freq.float()[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos/sin (B, T, D)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Unscaled attention (Dia's scaling 1): q (B, H, Tq, D), k/v (B, KV, Tk, D), mask bool broadcastable
    to (B, H, Tq, Tk) (True = attend) -> (B, Tq, H * D). Key/value heads repeat as transformers' repeat_kv."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


class FusedGateUpMLP(nn.Module):
    """down(up * silu(gate)) with gate and up as the two halves of one gate_up_proj (DiaMLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.gate_up_proj = _Linear(hidden_size, 2 * intermediate_size, bias=False, device=device, dtype=dtype)
        self.down_proj = _Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class NhAttentionProjections(nn.Module):
    """q/k/v/o projections of one attention (self or cross); `kv_in` is the width keys and values read."""

    def __init__(
        self, hidden_size: int, kv_in: int, heads: int, kv_heads: int, head_dim: int, *, device=None, dtype=None
    ) -> None:
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = _Linear(hidden_size, heads * head_dim, **kw)
        self.k_proj = _Linear(kv_in, kv_heads * head_dim, **kw)
        self.v_proj = _Linear(kv_in, kv_heads * head_dim, **kw)
        self.o_proj = _Linear(heads * head_dim, hidden_size, **kw)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, H, T, D)."""
        return self.q_proj(x).view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, kv_in) -> k, v (B, KV, T, D)."""
        shape = (x.shape[0], x.shape[1], self.num_kv_heads, self.head_dim)
        return self.k_proj(x).view(shape).transpose(1, 2), self.v_proj(x).view(shape).transpose(1, 2)


class NhEncoderLayer(nn.Module):
    def __init__(self, config: NhEncoderConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        h = config.hidden_size
        self.pre_sa_norm = RMSNorm(h, config.norm_eps, **kw)
        self.self_attention = NhAttentionProjections(
            h, h, config.num_attention_heads, config.num_key_value_heads, config.head_dim, **kw
        )
        self.post_sa_norm = RMSNorm(h, config.norm_eps, **kw)
        self.mlp = FusedGateUpMLP(h, config.intermediate_size, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.pre_sa_norm(x)
        q = apply_rope(self.self_attention.queries(h), cos, sin)
        k, v = self.self_attention.keys_values(h)
        k = apply_rope(k, cos, sin)
        x = x + self.self_attention.o_proj(attend(q, k, v, mask))
        return x + self.mlp(self.post_sa_norm(x))


class NhTextEncoder(nn.Module):
    """Byte ids (B, T) and their validity mask (B, T) bool -> hidden states (B, T, hidden) after the final norm.
    Rows are right-padded: padded keys are masked (padded query rows come out but mean nothing)."""

    def __init__(self, config: NhEncoderConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.embedding = _Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(NhEncoderLayer(config, **kw) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, **kw)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta)
        self.register_buffer("inv_freq", inv_freq.to(device) if device is not None else inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :].expand(input_ids.shape[0], -1)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        mask = valid[:, None, None, :]  # (B, 1, 1, T): every query sees the row's valid keys
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)
