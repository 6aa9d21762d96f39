"""XCodec2 decoder: FSQ codes -> 16 kHz waveform, in plain PyTorch.

Pipeline (as xcodec2 0.1.5's `XCodec2Model.decode_code`): FSQ index -> per-dim levels ->
`quantizer.project_out` -> `fc_post_a` -> Vocos-style backbone (conv embed, 2 ResNet blocks,
pre-norm transformer blocks, 2 ResNet blocks, LayerNorm) -> ISTFT head with "same" padding.
T frames give exactly T * hop samples. `decode_windows` decodes a batch of right-padded windows of
different lengths in one call, each row as if alone: a frame mask keeps the padding out of everything
that mixes frames (zeroed before each convolution, as its own zero padding; left out of GroupNorm's
statistics and attention's keys; no ISTFT frames and no window envelope there). Imports: torch and
models.xcodec2.config only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tilevox.models.xcodec2.config import XCodec2Config

__all__ = ["XCodec2Decoder", "fsq_indices_to_codes", "masked_group_norm"]


def fsq_indices_to_codes(indices: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """FSQ index (any shape, int64) -> code vector (..., len(levels)) in [-1, 1).

    The index is a mixed-radix number, first level least significant; digit d of level L maps
    to (d - L//2) / (L//2), as vector-quantize-pytorch's FSQ does.
    """
    basis = torch.cumprod(F.pad(levels[:-1], (1, 0), value=1), dim=0)  # (L,)
    digits = (indices.unsqueeze(-1) // basis) % levels  # (..., L)
    half_width = levels // 2
    return (digits - half_width).float() / half_width.float()


class RMSNorm(nn.Module):
    """RMSNorm with eps 1e-6, statistics in fp32."""

    def __init__(self, dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + 1e-6)
        return (xf * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    """Bidirectional multi-head self-attention without positional encoding.

    The package passes (B, heads, T, head_dim) tensors to torchtune's rotary module, which
    expects (B, T, heads, head_dim): it rotates every time step of head h by the angle of
    "position" h. Queries and keys of one head get the same rotation, so q.k is unchanged and
    the rotation is left out here (the oracle test checks the equivalence).
    """

    def __init__(self, dim: int, num_heads: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False, device=device, dtype=dtype)
        self.c_proj = nn.Linear(dim, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: (B, T) bool, True at real frames (keys outside it are not attended), or None."""
        batch, num_frames, dim = x.shape
        qkv = self.c_attn(x).view(batch, num_frames, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, T, head_dim)
        keys = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)  # (B, heads, T, head_dim)
        y = y.transpose(1, 2).reshape(batch, num_frames, dim)  # (B, T, D)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False, device=device, dtype=dtype)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.att_norm = RMSNorm(dim, device=device, dtype=dtype)
        self.ffn_norm = RMSNorm(dim, device=device, dtype=dtype)
        self.att = Attention(dim, num_heads, device=device, dtype=dtype)
        self.mlp = MLP(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.att(self.att_norm(x), mask)
        return x + self.mlp(self.ffn_norm(x))


class ResnetBlock(nn.Module):
    """(GroupNorm, SiLU, conv3) twice plus identity, on (B, C, T).

    GroupNorm pools each group over channels and *all* frames, so every output frame depends
    on the whole sequence: one reason a windowed (streaming) decode is only approximate.
    """

    def __init__(self, dim: int, num_groups: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = nn.GroupNorm(num_groups, dim, eps=1e-6, **kw)
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=3, padding=1, **kw)
        self.norm2 = nn.GroupNorm(num_groups, dim, eps=1e-6, **kw)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, padding=1, **kw)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: (B, 1, T) bool, True at real frames, or None. With a mask, GroupNorm's statistics
        pool real frames only and each convolution sees zeros past a row's end, as it would alone;
        the output past the end is not meaningful."""
        if mask is None:
            h = self.conv1(F.silu(self.norm1(x)))
            h = self.conv2(F.silu(self.norm2(h)))
            return x + h
        h = self.conv1(_masked(F.silu(masked_group_norm(self.norm1, x, mask)), mask))
        h = self.conv2(_masked(F.silu(masked_group_norm(self.norm2, h, mask)), mask))
        return x + h


def _masked_attention_backends():
    """SDPA backends for the masked window decode: not cuDNN's, which builds an execution plan for every new
    shape (about 10 ms a layer on the H200: 0.95 s of a served Llasa profile, 2026-12-04, each time a batch
    met a new window width), while the memory-efficient kernel takes the key mask with no plan. Under
    torch.compile the choice is Inductor's."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (B, C, T) with zeros where mask (B, 1, T) is False (a select, so padding never spreads a nan)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_group_norm(norm: nn.GroupNorm, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """nn.GroupNorm of each row's real frames: statistics (fp32, biased variance) over each group's
    channels and the frames where mask (B, 1, T) is True, then the affine map; x (B, C, T)."""
    batch, channels, frames = x.shape
    groups = norm.num_groups
    xf = x.float().view(batch, groups, channels // groups, frames)
    keep = mask.view(batch, 1, 1, frames)
    count = keep.sum(dim=(2, 3), keepdim=True).clamp_min(1) * (channels // groups)  # (B, 1, 1, 1)
    xf = torch.where(keep, xf, 0.0)
    mean = xf.sum(dim=(2, 3), keepdim=True) / count  # (B, G, 1, 1)
    centred = torch.where(keep, xf - mean, 0.0)
    var = centred.square().sum(dim=(2, 3), keepdim=True) / count
    y = (centred * torch.rsqrt(var + norm.eps)).view(batch, channels, frames)
    if norm.affine:
        y = y * norm.weight.float()[:, None] + norm.bias.float()[:, None]
    return y.to(x.dtype)


class Backbone(nn.Module):
    """(B, T, D) -> (B, T, D); submodule names follow the checkpoint's `generator.backbone.*`."""

    def __init__(self, config: XCodec2Config, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        dim = config.hidden_size
        self.embed = nn.Conv1d(dim, dim, kernel_size=7, padding=3, **kw)
        self.prior_net = nn.Sequential(
            *(ResnetBlock(dim, config.num_norm_groups, **kw) for _ in range(config.num_prior_blocks))
        )
        self.transformers = nn.Sequential(
            *(TransformerBlock(dim, config.num_heads, **kw) for _ in range(config.num_layers))
        )
        self.post_net = nn.Sequential(
            *(ResnetBlock(dim, config.num_norm_groups, **kw) for _ in range(config.num_post_blocks))
        )
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-6, **kw)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D); mask (B, T) bool, True at real frames (right padding), or None."""
        if mask is None:
            x = self.prior_net(self.embed(x.transpose(1, 2)))  # (B, D, T)
            x = self.transformers(x.transpose(1, 2))  # (B, T, D)
            x = self.post_net(x.transpose(1, 2)).transpose(1, 2)  # (B, T, D)
            return self.final_layer_norm(x)
        frames = mask[:, None, :]  # (B, 1, T)
        x = self.embed(_masked(x.transpose(1, 2), frames))  # (B, D, T)
        for block in self.prior_net:
            x = block(x, frames)
        x = x.transpose(1, 2)  # (B, T, D)
        for block in self.transformers:
            x = block(x, mask)
        x = x.transpose(1, 2)  # (B, D, T)
        for block in self.post_net:
            x = block(x, frames)
        return self.final_layer_norm(x.transpose(1, 2))


class XCodec2Decoder(nn.Module):
    """FSQ codes (B, T) int64 in [0, codebook_size) -> waveform (B, T * hop_samples) float32.

    The package's `decode_code` returns (B, 1, T * hop); this returns the same samples as
    (B, T * hop). Checkpoint names: `fsq_project_out` = `generator.quantizer.project_out`,
    `fc_post_a` = `fc_post_a`, `backbone` = `generator.backbone`, `head_out` = `generator.head.out`.
    """

    def __init__(self, config: XCodec2Config, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.config = config
        self.sample_rate_hz = config.sample_rate_hz
        self.hop_samples = config.hop_samples
        self.fsq_project_out = nn.Linear(config.num_fsq_dims, config.vq_dim, **kw)
        self.fc_post_a = nn.Linear(config.vq_dim, config.hidden_size, **kw)
        self.backbone = Backbone(config, **kw)
        # Predicts log-magnitude (n_fft/2 + 1 bins) then phase (n_fft/2 + 1 bins) per frame.
        self.head_out = nn.Linear(config.hidden_size, config.n_fft + 2, **kw)
        levels = torch.tensor(config.fsq_levels, dtype=torch.long, device=device)
        self.register_buffer("fsq_levels", levels, persistent=False)
        # Periodic Hann window, kept fp32 whatever the model dtype (the ISTFT runs in fp32).
        window = torch.hann_window(config.n_fft, dtype=torch.float32, device=device)
        self.register_buffer("window", window, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.head_out.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head_out.weight.dtype

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, T) codes -> (B, T, hidden) backbone input."""
        fsq = fsq_indices_to_codes(codes, self.fsq_levels).to(self.dtype)  # (B, T, num_fsq_dims)
        return self.fc_post_a(self.fsq_project_out(fsq))

    def istft(self, spec_real: torch.Tensor, spec_imag: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """ "Same"-padded ISTFT of (B, n_fft/2 + 1, T) fp32 parts -> (B, T * hop).

        Overlap-adds windowed frames, trims (n_fft - hop)/2 samples at each end and divides by
        the summed squared window; the ends see fewer frames, so the envelope is smaller there.
        mask (B, T) bool, True at real frames: padding frames add nothing (the parts must be zero
        there) and each row's envelope ends where its frames do; samples past a row's end are zero.
        """
        cfg = self.config
        num_frames = spec_real.shape[-1]
        frames = torch.fft.irfft(torch.complex(spec_real, spec_imag), cfg.n_fft, dim=1)  # (B, n_fft, T)
        frames = frames * self.window[:, None]
        full_len = (num_frames - 1) * cfg.hop_samples + cfg.n_fft
        fold = dict(output_size=(1, full_len), kernel_size=(1, cfg.n_fft), stride=(1, cfg.hop_samples))
        y = F.fold(frames, **fold)[:, 0, 0, :]  # (B, full_len)
        window_sq = self.window.square()[None, :, None].expand(1, cfg.n_fft, num_frames)  # (1, n_fft, T)
        pad = cfg.istft_pad_samples
        if mask is None:
            envelope = F.fold(window_sq, **fold)[0, 0, 0, :]  # (full_len,)
            return y[:, pad : full_len - pad] / envelope[pad : full_len - pad]
        envelope = F.fold(window_sq * mask[:, None, :].float(), **fold)[:, 0, 0, :]  # (B, full_len)
        y, envelope = y[:, pad : full_len - pad], envelope[:, pad : full_len - pad]
        samples = torch.arange(y.shape[1], device=y.device) // cfg.hop_samples  # each sample's frame
        real = mask.gather(1, samples.expand(y.shape[0], -1))  # (B, T * hop): inside the row's own frames
        return torch.where(real, y / envelope.clamp_min(torch.finfo(torch.float32).tiny), 0.0)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 2 or codes.dtype != torch.long:
            raise ValueError(f"codes must be a (B, T) int64 tensor, got {tuple(codes.shape)} {codes.dtype}")
        if codes.shape[1] < 1:
            raise ValueError("codes must hold at least one frame")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.config.codebook_size):
            raise ValueError(
                f"codes must lie in [0, {self.config.codebook_size}), got range "
                f"[{int(codes.min())}, {int(codes.max())}]"
            )
        x = self.backbone(self.embed_codes(codes.to(self.device)))  # (B, T, D)
        pred = self.head_out(x).float().transpose(1, 2)  # (B, n_fft + 2, T)
        log_mag, phase = pred.chunk(2, dim=1)  # each (B, n_fft/2 + 1, T)
        mag = torch.exp(log_mag).clamp(max=1e2)  # the package's cap on magnitudes
        return self.istft(mag * torch.cos(phase), mag * torch.sin(phase))

    def decode_windows(self, codes: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded code windows (G, T) int64 and their frame counts `lengths` (G,) int64 on this device
        -> (G, T * hop) float32: row g's first lengths[g] * hop samples are forward(codes[g, :lengths[g]])'s,
        up to float rounding; the rest are zeros. No range check and no host synchronisation (the codes
        must be valid: callers check them once on arrival), so a CUDA graph can capture it."""
        if codes.dim() != 2 or codes.dtype != torch.long or lengths.shape != codes.shape[:1]:
            raise ValueError(
                f"codes must be (G, T) int64 and lengths (G,), got {tuple(codes.shape)} {codes.dtype}, "
                f"{tuple(lengths.shape)}"
            )
        mask = torch.arange(codes.shape[1], device=codes.device) < lengths[:, None]  # (G, T)
        with _masked_attention_backends():
            x = self.backbone(self.embed_codes(codes), mask)  # (G, T, D)
        pred = self.head_out(x).float().transpose(1, 2)  # (G, n_fft + 2, T)
        log_mag, phase = pred.chunk(2, dim=1)
        mag = torch.where(mask[:, None, :], torch.exp(log_mag).clamp(max=1e2), 0.0)
        return self.istft(mag * torch.cos(phase), mag * torch.sin(phase), mask)
