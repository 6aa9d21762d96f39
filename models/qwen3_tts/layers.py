"""Qwen3 decoder building blocks shared by the talker and the code predictor, with a slot KV cache.

Pure PyTorch reference math matching the official eager path: RMSNorm in fp32 then cast,
per-head q/k RMSNorm before RoPE, rotate-half RoPE with cos/sin computed in fp32 (rope_scaling
applied as transformers' rope init functions: rope_inv_freq), GQA attention
(softmax in fp32), SwiGLU. `KVCache` holds (layers, slots, kv_heads, max_len, head_dim) keys and
values; a `CacheView` tells one forward which slots it touches and where each row writes, so
streams at different positions step together in one batched forward.
Imports: torch, models.{layers,decoder_view,kv_cache_write} and models.qwen3_tts.config only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tilevox.models.decoder_view import LayerWeights, layer_weights_of
from tilevox.models.kv_cache_write import write_kv_cache
from tilevox.models.layers import GatedMLP, RMSNorm, gather_keys, slot_attention, slot_attention_supported
from tilevox.models.qwen3_tts.config import TransformerConfig

__all__ = ["CacheView", "DecoderLayer", "DecoderStack", "KVCache", "RMSNorm", "rope_cos_sin", "rope_inv_freq"]


def rope_inv_freq(config: TransformerConfig, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) fp32, attention_scaling) of a stack's RoPE, as transformers' rope init
    functions (4.57) compute them for the official code: default, linear, llama3 and yarn scaling
    (config.rope_scaling). cos and sin are multiplied by attention_scaling (1 except for yarn)."""
    dim, base, rs = config.head_dim, config.rope_theta, config.rope_scaling
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (base**exponent)
    if rs.rope_type == "default":
        return inv_freq, 1.0
    if rs.rope_type == "linear":
        return inv_freq / rs.factor, 1.0
    original_max = rs.original_max_position_embeddings or config.max_position_embeddings
    if rs.rope_type == "llama3":
        low_freq_wavelen = original_max / rs.low_freq_factor
        high_freq_wavelen = original_max / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (original_max / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rs.rope_type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = rs.attention_factor
        if attention_factor is None:
            if rs.mscale and rs.mscale_all_dim:
                attention_factor = float(mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim))
            else:
                attention_factor = mscale(rs.factor)

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: avoid a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
        pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float) / dim)
        inv_freq = (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, attention_factor
    raise ValueError(f"rope_scaling type {rs.rope_type!r} is not implemented")


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    *,
    inv_freq: torch.Tensor | None = None,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) long -> cos, sin (B, T, head_dim) in `dtype` (computed in fp32). `inv_freq`
    (from rope_inv_freq) replaces the default frequencies of `theta`; cos and sin are scaled by
    `attention_scaling` before the cast, as in transformers."""
    if inv_freq is None:
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
        inv_freq = 1.0 / (theta**exponent)  # (head_dim/2,)
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Keys/values for `num_slots` sequences of up to `max_len` tokens each."""

    def __init__(self, config: TransformerConfig, *, num_slots: int, max_len: int, device, dtype):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots}, {max_len}")
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.layer_ids = torch.arange(config.num_layers, device=device)  # see CacheView.write
        self.num_slots = num_slots
        self.max_len = max_len


@dataclass(slots=True)
class CacheView:
    """Where one forward of B rows x T new tokens reads and writes the cache.

    slots: (B,) long tensor of slot ids, or a slice (a view, no gather copy).
    start: (B,) long, the position of each row's first new token (= its cached length).
    kv_len: keys [0, kv_len) are read; must cover max(start) + T (a static value under CUDA graphs).
    write_offset: for multi-token writes, the common start of every row as a Python int (known to
        the caller; reading it from `start` would sync the device and break graph capture).
    """

    cache: KVCache
    slots: torch.Tensor | slice
    start: torch.Tensor
    kv_len: int
    write_offset: int | None = None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (B, KV, T, D) at each row's positions; return (B, KV, kv_len, D) keys, values."""
        self.write(layer_idx, k, v)
        return gather_keys(self.cache.keys[layer_idx], self.cache.values[layer_idx], self.slots, self.kv_len)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v (B, KV, T, D) at each row's positions."""
        num_new = k.shape[2]
        if torch.compiler.is_compiling():
            # Through the op a compiled graph keeps in place (models.kv_cache_write); the indexed writes
            # below would be functionalized into a scatter that may copy the whole cache per call.
            write_kv_cache(
                self.cache.keys, self.cache.values, layer_idx, self._slot_ids(k.device), self._positions(num_new), k, v
            )
            return
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]  # (N, KV, S, D)
        if num_new == 1:
            slots = self._slot_ids(k.device)
            # Written through the whole cache, the layer as an index: one index_put of (B, KV, D) targets
            # (advanced indices first).
            layer = self.cache.layer_ids[layer_idx : layer_idx + 1]
            self.cache.keys[layer, slots, :, self.start] = k[:, :, 0]
            self.cache.values[layer, slots, :, self.start] = v[:, :, 0]
        else:
            # Multi-token writes (prefill, predictor's first step) share one start position.
            if self.write_offset is None:
                raise ValueError("multi-token cache writes need write_offset (the rows' common start)")
            first = self.write_offset
            keys[self.slots, :, first : first + num_new] = k
            values[self.slots, :, first : first + num_new] = v

    def _slot_ids(self, device: torch.device) -> torch.Tensor:
        """slots as a (B,) long tensor."""
        if isinstance(self.slots, torch.Tensor):
            return self.slots
        return torch.arange(self.slots.start, self.slots.stop, device=device)

    def _positions(self, num_new: int) -> torch.Tensor:
        """(B, T) long: where each row's T new keys go (start for one, write_offset + t for several)."""
        if num_new == 1:
            return self.start[:, None]
        if self.write_offset is None:
            raise ValueError("multi-token cache writes need write_offset (the rows' common start)")
        offsets = self.write_offset + torch.arange(num_new, device=self.start.device)
        return offsets[None].expand(self.start.shape[0], num_new)

    def hidden_keys(self, num_new: int) -> torch.Tensor:
        """(B, 1, T, kv_len) bool: key j is hidden from new token t of row b iff j > start[b] + t (the attention
        mask as masked_fill takes it, made once per forward rather than inverted in every layer)."""
        key_pos = torch.arange(self.kv_len, device=self.start.device)
        query_pos = self.start[:, None] + torch.arange(num_new, device=self.start.device)  # (B, T)
        return (key_pos[None, None, :] > query_pos[:, :, None])[:, None]


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, view: CacheView, layer_idx: int, hidden: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.config.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, d)).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, d)).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, KV, T, D)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cached_keys = view.cache.keys[layer_idx]
        if t == 1 and isinstance(view.slots, torch.Tensor) and slot_attention_supported(q, cached_keys):
            # One new position per row: attend to each row's slot in place (the prefix mask is start + 1 keys).
            view.write(layer_idx, k, v)
            out = slot_attention(
                q, cached_keys, view.cache.values[layer_idx], view.slots, view.start + 1, view.kv_len, d**-0.5
            )
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        keys, values = view.update(layer_idx, k, v)  # (B, KV, kv_len, D)
        # Grouped-query attention without copying keys per head: head h reads kv head h // rep, so the
        # rep heads of a group (consecutive) and their T queries form one (rep*T)-row matmul per kv head.
        num_kv = keys.shape[1]
        heads = q.shape[1]
        grouped = q.reshape(b, num_kv, (heads // num_kv) * t, d)
        scores = (torch.matmul(grouped, keys.transpose(2, 3)) * d**-0.5).view(b, heads, t, -1)  # (B, H, T, kv_len)
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.view(b, num_kv, -1, probs.shape[-1]), values)  # (B, KV, rep*T, D)
        out = out.view(b, heads, t, d).transpose(1, 2).reshape(b, t, -1)  # (B, T, H*D)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, view: CacheView, layer_idx: int, hidden) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, view, layer_idx, hidden)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`layers.{i}` and the final `norm`; forward returns the final-norm hidden states."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # RoPE frequencies with rope_scaling applied (fp32, CPU; a plain attribute, so .to(dtype) keeps it fp32).
        self._scaled_rope = None if config.rope_scaling.rope_type == "default" else rope_inv_freq(config, "cpu")
        # The scaled frequencies on the parameters' device (None without scaling), made here and on every move
        # (_apply), never inside forward: state a compiled forward creates on its first call makes Dynamo compile it
        # again on the second, which the executor runs during a CUDA-graph capture (models/llama/model.py's rope
        # table, 2026-12-07).
        self._inv_freq: torch.Tensor | None = None
        self._place_scaled_rope()

    def _place_scaled_rope(self) -> None:
        if self._scaled_rope is not None:
            self._inv_freq = self._scaled_rope[0].to(self.norm.weight.device)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._place_scaled_rope()
        return module

    def layer_weights(self) -> tuple[LayerWeights, ...]:
        """Each layer's weights by role (models.decoder_view), for a region compiler; no copies."""
        return tuple(
            layer_weights_of(
                layer, qk_norm=torch.stack((layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)).detach()
            )
            for layer in self.layers
        )

    def region_inv_freq(self) -> torch.Tensor:
        """The stack's RoPE frequencies as forward computes them (rope_scaling included). A region's RoPE
        applies no attention scaling to cos/sin, so a scaling that needs one (yarn) is refused."""
        inv_freq, attention_scaling = rope_inv_freq(self.config)
        if attention_scaling != 1.0:
            raise ValueError(
                f"rope_scaling {self.config.rope_scaling.rope_type!r} scales cos/sin by {attention_scaling:.4f}; "
                "the megakernel's RoPE has no such factor"
            )
        return inv_freq

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scaled_rope is None:
            return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        if self._inv_freq.device != positions.device:
            raise ValueError(f"positions on {positions.device}, the model on {self._inv_freq.device}")
        return rope_cos_sin(
            positions,
            self.config.head_dim,
            self.config.rope_theta,
            dtype,
            inv_freq=self._inv_freq,
            attention_scaling=self._scaled_rope[1],
        )

    def run_layers(
        self, x: torch.Tensor, view: CacheView, first: int = 0, stop: int | None = None, *, final_norm: bool = True
    ) -> torch.Tensor:
        """x (B, T, hidden) new tokens at positions start..start+T-1 through layers [first, stop) (None: the
        last) -> (B, T, hidden), after the final norm unless final_norm is False (the residual stream a piece
        of a step cut at a layer boundary hands on: executor.split)."""
        num_new = x.shape[1]
        positions = view.start[:, None] + torch.arange(num_new, device=x.device)  # (B, T)
        cos, sin = self._rope(positions, x.dtype)
        # Always masked: rows sit at different positions, and kv_len is static under CUDA graphs.
        hidden = view.hidden_keys(num_new)
        stop = len(self.layers) if stop is None else stop
        for layer_idx in range(first, stop):
            x = self.layers[layer_idx](x, cos, sin, view, layer_idx, hidden)
        return self.norm(x) if final_norm else x
