"""Qwen3-TTS 12 Hz codec decoder with exact incremental (streaming) decoding.

`forward` is the plain full decode (zero-padded causal convs, causal sliding-window attention
over the whole utterance), equal to the official `decoder(codes)`. `decode_incremental` keeps
per-layer state (causal-conv input tails, transposed-conv overlaps, a ring of the last window frames of
keys/values per attention layer, per-row positions), so decoding any split of an utterance into
pieces yields the same samples as one `forward` (up to float rounding). `chunked_decode` is the
official long-audio decode (`decode()`: 300-frame chunks, 25 frames of left context), and
`decode_incremental_chunked` streams it exactly (ChunkedDecoderState). Parameter names match the
official checkpoint (`decoder.*` in speech_tokenizer/model.safetensors). `Transformer.decoder_view` hands
the sliding-window transformer to the megakernel region compiler. Imports: torch, models.layers,
models.decoder_view.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tilevox.models.decoder_view import DecoderView, ModelFamily, layer_weights_of
from tilevox.models.derived import derived
from tilevox.models.layers import GatedMLP, RMSNorm
from tilevox.models.qwen3_tts.speech_tokenizer.config import SpeechDecoderConfig

__all__ = [
    "DEFAULT_CHUNK_FRAMES",
    "DEFAULT_CHUNK_LEFT_CONTEXT_FRAMES",
    "ChunkedDecoderState",
    "DecoderState",
    "SpeechTokenizerDecoder",
]

# The official decode(): chunked_decode(codes, chunk_size=300, left_context_size=25).
DEFAULT_CHUNK_FRAMES = 300
DEFAULT_CHUNK_LEFT_CONTEXT_FRAMES = 25


@dataclass(slots=True)
class DecoderState:
    """Streaming state of a batch of utterances. Every tensor has the batch on dim 0 except `keys` and
    `values` (batch on dim 1, see `_BATCH_DIMS`), so states of separate streams can be merged with `cat` and
    split with `select`. `decode_incremental` updates the tensors in place (fixed shapes, no host sync), so
    a step can be CUDA-graph captured.

    conv_tails[i]: the last (kernel-1)*dilation inputs of causal conv i (zeros = the causal padding).
    trans_overlaps[i]: transposed conv i's partial sums (without bias) that spill past the emitted samples.
    keys / values: (layers, B, H_kv, 2 * window, D) keys (after RoPE) and values of the previous frames, a
        ring written twice: frame p sits at p % window and p % window + window, so any `window` consecutive
        frames are contiguous. This is the megakernel region's `k_cache` / `v_cache` layout (RegionConstants
        .window), so a pool of states is bound by the region in place. Slots no frame has written yet are
        masked by position (zeros in a fresh state).
    positions: (B,) long, frames decoded so far (= RoPE position of the next frame).
    ring_rows: None, or (B,) long: the rows of `keys` / `values` this state's rows use, when they are a pool's,
        shared rather than copied (`select(rows, rings=False)`); the transformer then reads and writes those
        rows in place.
    flat: None, or (B, N): one buffer whose columns back every conv tail and transposed-conv overlap (each a view
        of it, `SpeechTokenizerDecoder.new_state` makes them so), so that gathering or scattering a batch's
        small state is one kernel instead of one per tensor (21 for the 12 Hz codec).
    """

    conv_tails: list[torch.Tensor]
    trans_overlaps: list[torch.Tensor]
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    ring_rows: torch.Tensor | None = None
    flat: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.positions.shape[0])

    def _fields(self) -> list[tuple[str, int, list[torch.Tensor] | torch.Tensor]]:
        """(field, its batch dim, its tensor or list of tensors)."""
        return [(name, _BATCH_DIMS.get(name, 0), getattr(self, name)) for name in _FIELDS]

    def _map(self, fn, rings: bool) -> DecoderState:
        """A new state of fn(tensor, batch_dim) of every tensor (rings=False: keys / values as they are); with a
        flat buffer, fn of the buffer once and the new tails and overlaps as views of its result."""
        out = {}
        for name, dim, value in self._fields():
            if not rings and name in _RINGS:
                out[name] = value
            elif self.flat is not None and name in _SMALL:
                continue
            else:
                out[name] = [fn(t, dim) for t in value] if isinstance(value, list) else fn(value, dim)
        if self.flat is not None:
            out["flat"] = fn(self.flat, 0)
            out["conv_tails"], out["trans_overlaps"] = _small_views(
                out["flat"], [t.shape[1:] for t in self.conv_tails], [t.shape[1:] for t in self.trans_overlaps]
            )
        return DecoderState(**out)

    def select(self, rows: Sequence[int] | torch.Tensor, *, rings: bool = True) -> DecoderState:
        """The state of a subset of rows (a copy). rings=False: the copy shares this state's keys / values (all
        its rows, uncopied; `ring_rows` names the selected ones), so a decode reads and writes them in place
        instead of copying every ring out and back (the pool's decode_slots, the megakernel region)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.positions.device)
        if self.ring_rows is not None:
            raise ValueError("select of a state that shares another's rings (ring_rows set): select from that one")
        state = self._map(lambda t, dim: t.index_select(dim, index), rings)
        if not rings:
            state.ring_rows = index
        return state

    def put(self, rows: Sequence[int] | torch.Tensor, other: DecoderState, *, rings: bool = True) -> None:
        """Write `other`'s rows into rows `rows` of this state, in place (the inverse of `select`; rings=False
        leaves keys / values alone)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.positions.device)
        if rings and other.ring_rows is not None:
            raise ValueError("put of a state that shares this one's rings: put(..., rings=False)")
        flat = self.flat is not None and other.flat is not None  # else view by view (index_copy_ writes through)
        for (mine, dim), (theirs, _) in zip(self._tensors(rings, flat), other._tensors(rings, flat), strict=True):
            mine.index_copy_(dim, index, theirs)

    def _tensors(self, rings: bool = True, flat: bool = False) -> list[tuple[torch.Tensor, int]]:
        """Every tensor with its batch dim (rings=False: without keys / values; flat: the flat buffer in place of
        the tails and overlaps it backs)."""
        out = [(self.flat, 0)] if flat else []
        for name, dim, value in self._fields():
            if (rings or name not in _RINGS) and not (flat and name in _SMALL):
                out += [(t, dim) for t in value] if isinstance(value, list) else [(value, dim)]
        return out

    @staticmethod
    def cat(states: Sequence[DecoderState]) -> DecoderState:
        """Stack states of separate batches (e.g. independent streams) along the batch."""
        if not states:
            raise ValueError("cat needs at least one DecoderState")
        if any(s.ring_rows is not None for s in states):
            raise ValueError("cat of states that share another's rings (ring_rows set)")
        flat = all(s.flat is not None for s in states)
        out = {}
        for name, dim, value in states[0]._fields():
            if flat and name in _SMALL:
                continue
            parts = [getattr(s, name) for s in states]
            if isinstance(value, list):
                out[name] = [torch.cat([p[i] for p in parts], dim=dim) for i in range(len(value))]
            else:
                out[name] = torch.cat(parts, dim=dim)
        if flat:
            first = states[0]
            out["flat"] = torch.cat([s.flat for s in states], dim=0)
            out["conv_tails"], out["trans_overlaps"] = _small_views(
                out["flat"], [t.shape[1:] for t in first.conv_tails], [t.shape[1:] for t in first.trans_overlaps]
            )
        return DecoderState(**out)


_FIELDS = ("conv_tails", "trans_overlaps", "keys", "values", "positions")
_RINGS = ("keys", "values")
_SMALL = ("conv_tails", "trans_overlaps")  # backed by DecoderState.flat where it is set
_BATCH_DIMS = dict.fromkeys(_RINGS, 1)  # (layers, B, ...): one tensor the region binds; the rest batch-first


def _small_views(
    flat: torch.Tensor, tail_shapes: Sequence[Sequence[int]], overlap_shapes: Sequence[Sequence[int]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The conv tails and transposed-conv overlaps (B, C, k) of these shapes as views of consecutive columns of
    `flat` (B, N)."""
    views, offset = [], 0
    for shape in (*tail_shapes, *overlap_shapes):
        size = math.prod(shape)
        views.append(flat[:, offset : offset + size].view(flat.shape[0], *shape))
        offset += size
    if offset != flat.shape[1]:
        raise ValueError(f"the flat state has {flat.shape[1]} columns; its tails and overlaps need {offset}")
    return views[: len(tail_shapes)], views[len(tail_shapes) :]


@dataclass(slots=True)
class ChunkedDecoderState:
    """Streaming state that reproduces the official chunked decode exactly.

    The official decode() cuts an utterance into chunks [k*C, (k+1)*C) (C = 300 frames) and decodes
    chunk k >= 1 from scratch over [k*C - L, (k+1)*C) (L = 25), dropping the audio of its L context
    frames. The decoder is causal, so a fresh DecoderState fed from frame k*C - L gives that chunk's
    samples incrementally: `emitter` produces the samples of the current chunk, and `warm` (a fresh
    state started L frames before the next chunk, its output dropped) takes over at the boundary.
    No added latency; the cost is L extra frames of decode per C frames. All rows of a batch share
    `frames` (one stream per state in practice)."""

    emitter: DecoderState
    warm: DecoderState | None
    frames: int  # frames decoded so far (all rows)
    chunk_frames: int
    left_context_frames: int

    @property
    def batch_size(self) -> int:
        return self.emitter.batch_size


# ----------------------------------------------------------------------------------------------
# Stateful building blocks. Each has `forward(x)` (whole sequence) and `step(x, state)`.


class CausalConv1d(nn.Module):
    """Conv1d (stride 1) with (kernel-1)*dilation zeros on the left, so output t sees inputs <= t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation  # inputs of the past each output needs
        self.slot = -1  # index into DecoderState.conv_tails, set by the decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T) -> (B, C', T)
        return self.conv(F.pad(x, (self.context, 0)))

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        if self.context == 0:
            return self.conv(x)
        full = torch.cat([state.conv_tails[self.slot], x], dim=-1)  # (B, C, context + n)
        state.conv_tails[self.slot].copy_(full[..., -self.context :])
        return self.conv(full)


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d(k, stride s) with the last k-s outputs dropped: n inputs -> n*s outputs."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.overlap = kernel_size - stride  # outputs of frame t that land in frame t+1's span
        self.slot = -1  # index into DecoderState.trans_overlaps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.overlap] if self.overlap > 0 else y

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        num_out = x.shape[-1] * self.stride
        if self.overlap == 0:
            return self.conv(x)
        # Without bias, so that carried partial sums get the bias exactly once when emitted.
        y = F.conv_transpose1d(x, self.conv.weight, None, stride=self.stride)  # (B, C', n*s + overlap)
        y[..., : self.overlap].add_(state.trans_overlaps[self.slot])  # in place: y is this call's own tensor
        state.trans_overlaps[self.slot].copy_(y[..., num_out:])
        out = y[..., :num_out]
        return out + self.conv.bias[:, None] if self.conv.bias is not None else out


def _snake_beta_factors(alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^alpha, 1 / (e^beta + 1e-9)) as (1, C, 1) columns, in the parameters' dtype."""
    return torch.exp(alpha)[None, :, None], (1.0 / (torch.exp(beta) + 1e-9))[None, :, None]


class SnakeBeta(nn.Module):
    """y = x + sin(x * e^alpha)^2 / (e^beta + 1e-9), alpha and beta stored in log space per channel.

    The per-channel factors are computed once (models.derived) and the sum is one addcmul: 4 kernels a call
    instead of 9, on the 29 activations of a codec frame."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T)
        alpha, inv_beta = derived(self, (self.alpha, self.beta), _snake_beta_factors)
        return torch.addcmul(x, inv_beta, torch.sin(x * alpha).square())

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        return self.forward(x)


# ----------------------------------------------------------------------------------------------
# Residual vector quantizer (decode side only).


def _codebook_table(cluster_usage: torch.Tensor, embedding_sum: torch.Tensor) -> tuple[torch.Tensor]:
    return (embedding_sum / cluster_usage.clamp(min=1e-5)[:, None],)


class Codebook(nn.Module):
    """EMA-style codebook storage: the table is embedding_sum / max(cluster_usage, 1e-5), computed once
    (models.derived; recomputed when a weight changes) rather than over the whole table at every decode: per
    frame that was 32 kernels and about 34 MB of reads and writes for the 16 codebooks of the 12 Hz codec."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))
        self.embedding_sum = nn.Parameter(torch.zeros(codebook_size, dim))

    def table(self) -> torch.Tensor:
        (table,) = derived(self, (self.cluster_usage, self.embedding_sum), _codebook_table)
        return table


class VectorQuantizer(nn.Module):
    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(codebook_size, dim)


class ResidualQuantizer(nn.Module):
    """A group of codebooks whose lookups are summed, then projected by a 1x1 conv."""

    def __init__(self, num_quantizers: int, codebook_size: int, dim: int, io_dim: int):
        super().__init__()
        # input_proj belongs to the encode side; the checkpoint ships it, decoding never uses it.
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(VectorQuantizer(codebook_size, dim) for _ in range(num_quantizers))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # (B, K, T) -> (B, io_dim, T)
        total = None
        for book_idx, layer in enumerate(self.vq.layers):
            looked_up = F.embedding(codes[:, book_idx], layer._codebook.table())  # (B, T, dim)
            total = looked_up if total is None else total + looked_up
        return self.output_proj(total.transpose(1, 2))


class SplitResidualQuantizer(nn.Module):
    """Book 0 ("semantic") and books 1.. ("acoustic") are projected separately and added."""

    def __init__(self, config: SpeechDecoderConfig):
        super().__init__()
        dim = config.codebook_dim // 2
        self.rvq_first = ResidualQuantizer(1, config.codebook_size, dim, config.codebook_dim)
        self.rvq_rest = ResidualQuantizer(config.num_quantizers - 1, config.codebook_size, dim, config.codebook_dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # (B, Q, T) -> (B, codebook_dim, T)
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# ----------------------------------------------------------------------------------------------
# Sliding-window transformer.


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: SpeechDecoderConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.window = config.sliding_window
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.attention_bias)
        self.slot = -1  # index into DecoderState.keys / values

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, n, D)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, n, D)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, n, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _attend(self, q, k, v, hidden: torch.Tensor) -> torch.Tensor:
        """q (B, H, n, D), k/v (B, Hkv, m, D), hidden (B, n, m) bool (True: key not attended) -> (B, n, H*D)."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim**-0.5  # (B, H, n, m)
        scores = scores.masked_fill(hidden[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # (B, H, n, D)
        b, _, n, _ = out.shape
        return out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        n = x.shape[1]
        idx = torch.arange(n, device=x.device)
        delta = idx[:, None] - idx[None, :]  # query pos - key pos
        hidden = ((delta < 0) | (delta >= self.window))[None].expand(x.shape[0], n, n)
        return self.o_proj(self._attend(q, k, v, hidden))

    def step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: DecoderState, ring: RingStep
    ) -> torch.Tensor:
        """n new frames per row against the ring of earlier frames (DecoderState.keys), then the ring
        takes the last min(n, window) of them."""
        q, k_new, v_new = self._qkv(x, cos, sin)
        ring_k, ring_v = state.keys[self.slot], state.values[self.slot]  # (rows, Hkv, 2W, D) views
        rows = state.ring_rows
        past_k = ring_k[:, :, : self.window] if rows is None else ring_k[rows, :, : self.window]
        past_v = ring_v[:, :, : self.window] if rows is None else ring_v[rows, :, : self.window]
        k = torch.cat([past_k, k_new], dim=2)  # (B, Hkv, W + n, D): keys in any order, masked by position
        v = torch.cat([past_v, v_new], dim=2)
        out = self.o_proj(self._attend(q, k, v, ring.hidden))
        m = ring.write_index.shape[1] // 2
        for held, new in ((ring_k, k_new), (ring_v, v_new)):
            new = new[:, :, -m:].repeat(1, 1, 2, 1)  # (B, Hkv, 2m, D): both copies
            if rows is None:
                index = ring.write_index[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
                held.scatter_(2, index, new)
            else:  # advanced indices around a slice: the indexed shape is (B, 2m, Hkv, D)
                held[rows[:, None], :, ring.write_index] = new.transpose(1, 2)
        return out


@dataclass(slots=True)
class RingStep:
    """What every layer's `Attention.step` of n new frames shares (computed once per step).

    hidden: (B, n, W + n) bool, True where query i (frame start + i) does not attend a key: the ring's first W
        slots (slot s holds the latest frame p < start with p % W == s; none yet where that p < 0), then the n
        new frames (made once per step, not inverted in every layer).
    write_index: (B, 2m) long, ring slots of the last m = min(n, W) new frames, both copies.
    """

    hidden: torch.Tensor
    write_index: torch.Tensor

    @staticmethod
    def of(positions: torch.Tensor, n: int, window: int) -> RingStep:
        start = positions[:, None]  # (B, 1)
        slot = torch.arange(window, device=positions.device)
        held = start - 1 - torch.remainder(start - 1 - slot, window)  # (B, W) frame in ring slot s
        new = start + torch.arange(n, device=positions.device)  # (B, n)
        k_pos = torch.cat([held, new], dim=1)[:, None, :]  # (B, 1, W + n)
        delta = new[:, :, None] - k_pos
        hidden = (delta < 0) | (delta >= window) | (k_pos < 0)
        written = torch.remainder(new[:, n - min(n, window) :], window)
        return RingStep(hidden=hidden, write_index=torch.cat([written, written + window], dim=1))


class TransformerLayer(nn.Module):
    def __init__(self, config: SpeechDecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(self, x, cos, sin, state: DecoderState | None = None, ring: RingStep | None = None):
        normed = self.input_layernorm(x)
        if state is None:
            attn = self.self_attn(normed, cos, sin)
        else:
            attn = self.self_attn.step(normed, cos, sin, state, ring)
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, config: SpeechDecoderConfig):
        super().__init__()
        self.config = config
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def decoder_view(self) -> DecoderView:
        """The weights a region compiler reads (models.decoder_view): input projection, layers with their
        sliding window and layer scales, final norm and output projection. A region runs one new frame per
        row and step, reading and writing DecoderState.keys / values in place (the region's ring caches)."""
        if self.config.attention_bias:
            raise ValueError("the codec transformer has attention biases, which no megakernel region runs")
        c = self.config
        layers = tuple(
            layer_weights_of(
                layer, attn_layer_scale=layer.self_attn_layer_scale.scale, mlp_layer_scale=layer.mlp_layer_scale.scale
            )
            for layer in self.layers
        )
        return DecoderView(
            family=ModelFamily.QWEN3_TTS_CODEC,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            inv_freq=self.inv_freq.float(),
            layers=layers,
            final_norm=self.norm.weight,
            embed_tables=(),
            heads=(),
            projection=(self.input_proj.weight, self.input_proj.bias),
            input_size=c.latent_dim,
            sliding_window=c.sliding_window,
            output_projection=(self.output_proj.weight, self.output_proj.bias),
        )

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions (B, n) long -> cos, sin (B, n, D), computed in fp32 then cast (as official)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()[None, None, :]  # (B, n, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, state: DecoderState | None = None) -> torch.Tensor:  # (B, n, latent)
        b, n, _ = x.shape
        offsets = torch.arange(n, device=x.device)[None, :]
        positions = offsets.expand(b, n) if state is None else state.positions[:, None] + offsets
        x = self.input_proj(x)
        cos, sin = self._rope(positions, x.dtype)
        ring = None if state is None else RingStep.of(state.positions, n, self.config.sliding_window)
        for layer in self.layers:
            x = layer(x, cos, sin, state, ring)
        return self.output_proj(self.norm(x))


# ----------------------------------------------------------------------------------------------
# Upsamplers and the SnakeBeta decoder.


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def _pointwise(self, residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h.transpose(1, 2)  # (B, T, C)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return residual + (self.gamma * h).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pointwise(x, self.dwconv(x))

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        return self._pointwise(x, self.dwconv.step(x, state))


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        h = self.conv1.step(self.act1(x), state)
        return x + self.conv2.step(self.act2(h), state)


class DecoderBlock(nn.Module):
    """SnakeBeta -> causal transposed conv (x rate, halves channels) -> residual units (dilations 1, 3, 9)."""

    def __init__(self, in_dim: int, rate: int):
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.block:
            x = module(x)
        return x

    def step(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        for module in self.block:
            x = module.step(x, state)
        return x


class SpeechTokenizerDecoder(nn.Module):
    """Codes (B, Q, T) -> waveform (B, T * samples_per_frame) in [-1, 1]."""

    def __init__(self, config: SpeechDecoderConfig):
        super().__init__()
        self.config = config
        self.samples_per_frame = config.samples_per_frame
        self.quantizer = SplitResidualQuantizer(config)
        self.pre_conv = CausalConv1d(config.codebook_dim, config.latent_dim, kernel_size=3)
        self.pre_transformer = Transformer(config)
        latent = config.latent_dim
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(latent, latent, r, r), ConvNeXtBlock(latent)])
            for r in config.upsampling_ratios
        )
        blocks: list[nn.Module] = [CausalConv1d(config.latent_dim, config.decoder_dim, kernel_size=7)]
        blocks += [DecoderBlock(config.decoder_dim // 2**i, rate) for i, rate in enumerate(config.upsample_rates)]
        blocks += [SnakeBeta(config.output_dim), CausalConv1d(config.output_dim, 1, kernel_size=7)]
        self.decoder = nn.ModuleList(blocks)
        # Number the stateful modules; module registration order is also execution order.
        self._convs = [m for m in self.modules() if isinstance(m, CausalConv1d) and m.context > 0]
        self._trans = [m for m in self.modules() if isinstance(m, CausalConvTranspose1d) and m.overlap > 0]
        self._attns = [m for m in self.modules() if isinstance(m, Attention)]
        for group in (self._convs, self._trans, self._attns):
            for slot, module in enumerate(group):
                module.slot = slot

    def check_codes(self, codes: torch.Tensor) -> None:
        """ValueError unless `codes` is an integer (B, Q, T) tensor of this codec's Q codebooks."""
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"codes must be (B, {self.config.num_quantizers}, T), got {tuple(codes.shape)}")
        if codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode of (B, Q, T) codes -> (B, T * samples_per_frame), no chunking."""
        self.check_codes(codes)
        h = self.pre_conv(self.quantizer.decode(codes))  # (B, latent, T)
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)  # (B, latent, T)
        for trans, convnext in self.upsample:
            h = convnext(trans(h))
        for module in self.decoder:
            h = module(h)
        return h.clamp(-1.0, 1.0)[:, 0]

    def new_state(self, batch_size: int) -> DecoderState:
        """Fresh state for `batch_size` utterances (on the decoder's device and dtype)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        param = self.pre_conv.conv.weight
        device, dtype = param.device, param.dtype
        cfg = self.config
        kv_shape = (len(self._attns), batch_size, cfg.num_key_value_heads, 2 * cfg.sliding_window, cfg.head_dim)
        tail_shapes = [(m.conv.in_channels, m.context) for m in self._convs]
        overlap_shapes = [(m.conv.out_channels, m.overlap) for m in self._trans]
        columns = sum(math.prod(shape) for shape in (*tail_shapes, *overlap_shapes))
        flat = torch.zeros(batch_size, columns, device=device, dtype=dtype)  # zeros: the causal padding
        conv_tails, trans_overlaps = _small_views(flat, tail_shapes, overlap_shapes)
        return DecoderState(
            conv_tails=conv_tails,
            trans_overlaps=trans_overlaps,
            keys=torch.zeros(kv_shape, device=device, dtype=dtype),
            values=torch.zeros(kv_shape, device=device, dtype=dtype),
            positions=torch.zeros(batch_size, dtype=torch.long, device=device),
            flat=flat,
        )

    def decode_incremental(self, codes: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Decode the next n >= 1 frames (B, Q, n) of each row, updating `state` in place;
        returns (B, n * samples_per_frame), the samples a full decode has at those frames."""
        self.check_codes(codes)
        if codes.shape[-1] < 1:
            raise ValueError("decode_incremental needs at least one frame")
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"codes batch {codes.shape[0]} != state batch {state.batch_size}")
        h = self.decode_front(codes, state)
        return self.decode_back(self.pre_transformer(h, state), state)

    def decode_front(self, codes: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """decode_incremental up to the transformer: RVQ lookup and the causal pre-conv of the next n frames
        (B, Q, n) -> the transformer's input (B, n, latent); advances the pre-conv's tail only."""
        return self.pre_conv.step(self.quantizer.decode(codes), state).transpose(1, 2)

    def decode_back(self, h: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """decode_incremental after the transformer: its output (B, n, latent) through the upsamplers and the
        SnakeBeta decoder -> samples (B, n * samples_per_frame); advances their state and the positions."""
        frames = h.shape[1]
        h = h.transpose(1, 2)
        for trans, convnext in self.upsample:
            h = convnext.step(trans.step(h, state), state)
        for module in self.decoder:
            h = module.step(h, state)
        state.positions.add_(frames)
        return h.clamp(-1.0, 1.0)[:, 0]

    def decode_slots(self, codes: torch.Tensor, pool: DecoderState, slots: torch.Tensor) -> torch.Tensor:
        """`decode_incremental` of the rows `slots` (B,) long of a state pool (one row per stream slot):
        gathers their states (all but the rings, which the transformer reads and writes in place), decodes the
        next n frames (B, Q, n) and writes the states back, with fixed shapes and no host sync (capturable).
        Returns (B, n * samples_per_frame)."""
        if slots.dim() != 1 or slots.shape[0] != codes.shape[0]:
            raise ValueError(f"slots must be ({codes.shape[0]},), got {tuple(slots.shape)}")
        state = pool.select(slots, rings=False)  # the transformer reads and writes the pool's rings in place
        wav = self.decode_incremental(codes, state)
        pool.put(slots, state, rings=False)
        return wav

    def new_chunked_state(
        self,
        batch_size: int,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
        left_context_frames: int = DEFAULT_CHUNK_LEFT_CONTEXT_FRAMES,
    ) -> ChunkedDecoderState:
        """Fresh state for `decode_incremental_chunked` (the official chunking by default)."""
        if left_context_frames < 0 or chunk_frames <= left_context_frames:
            # chunk <= context would make the official rule decode early chunks from frame 0 instead.
            raise ValueError(
                f"need chunk_frames > left_context_frames >= 0, got {chunk_frames} and {left_context_frames}"
            )
        return ChunkedDecoderState(
            emitter=self.new_state(batch_size),
            warm=None,
            frames=0,
            chunk_frames=chunk_frames,
            left_context_frames=left_context_frames,
        )

    def decode_incremental_chunked(self, codes: torch.Tensor, state: ChunkedDecoderState) -> torch.Tensor:
        """Decode the next n >= 1 frames (B, Q, n), updating `state`; returns (B, n * samples_per_frame),
        the samples `chunked_decode` (the official decode()) has at those frames, whatever the split."""
        self.check_codes(codes)
        total = codes.shape[-1]
        if total < 1:
            raise ValueError("decode_incremental_chunked needs at least one frame")
        pieces, pos = [], 0
        while pos < total:
            next_start = (state.frames // state.chunk_frames + 1) * state.chunk_frames
            warm_start = next_start - state.left_context_frames
            boundary = warm_start if state.frames < warm_start else next_start
            take = min(total - pos, boundary - state.frames)
            segment = codes[..., pos : pos + take]
            pieces.append(self.decode_incremental(segment, state.emitter))
            if state.warm is not None:
                self.decode_incremental(segment, state.warm)  # the next chunk's left context: audio dropped
            pos += take
            state.frames += take
            if state.frames == warm_start and state.warm is None:
                state.warm = self.new_state(state.batch_size)
            if state.frames == next_start:
                state.emitter, state.warm = state.warm, None
        return torch.cat(pieces, dim=-1)

    def chunked_decode(self, codes: torch.Tensor, chunk: int = 300, left_context: int = 25) -> torch.Tensor:
        """The official long-audio decode: `chunk`-frame pieces, each re-decoding up to
        `left_context` earlier frames whose audio is dropped."""
        self.check_codes(codes)
        if chunk < 1 or left_context < 0:
            raise ValueError(f"chunk must be >= 1 and left_context >= 0, got {chunk}, {left_context}")
        pieces = []
        start, total = 0, codes.shape[-1]
        while start < total:
            end = min(start + chunk, total)
            # Official rule: full context only when strictly more than left_context frames precede.
            context = left_context if start - left_context > 0 else start
            wav = self.forward(codes[..., start - context : end])
            pieces.append(wav[..., context * self.samples_per_frame :])
            start = end
        return torch.cat(pieces, dim=-1)

    def decode_padded(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """The official `decode()` of a batch right-padded with -1: each row's length is its count
        of codes >= 0 in book 0; pads become 0, the batch is `chunked_decode`d together and each
        row is cut to length * samples_per_frame. Returns one (S_i,) waveform per row."""
        self.check_codes(codes)
        lengths = (codes[:, 0] > -1).sum(dim=1) * self.samples_per_frame  # (B,)
        wav = self.chunked_decode(codes.clamp(min=0))
        return [row[:length] for row, length in zip(wav, lengths.tolist())]
