"""The DAC codec as plain modules: conv encoder, residual vector quantizer of factorized codebooks,
conv decoder with snake activations.

Module and parameter names follow the checkpoint that transformers' `DacModel.save_pretrained`
writes (encoder.block.0.res_unit1.conv1.weight, quantizer.quantizers.3.codebook.weight, ...), with
weight norm folded into plain `weight`s (models.dac.weights does that at load time).

Every conv is "same"-padded with zeros and there is no normalization or attention, so a frame's
codes only reach the samples within the decoder's receptive field (`decoder_reach_frames`), which
is what makes windowed streaming exact (models.dac.streaming). Imports: torch, models.dac.config.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tilevox.models.dac.config import DacConfig
from tilevox.models.derived import derived

__all__ = ["DacCodec", "decoder_reach_frames"]

_DILATIONS = (1, 3, 9)  # of the three residual units in every encoder and decoder block
_RESIDUAL_KERNEL = 7
_EDGE_KERNEL = 7  # the decoder's first and last conv, the encoder's first


def _snake(x: torch.Tensor, alpha: torch.Tensor, inv_alpha: torch.Tensor) -> torch.Tensor:
    """x + sin^2(alpha x) / alpha, per channel; inv_alpha = 1 / (alpha + 1e-9) (the 1e-9 keeps a zero alpha
    finite). snake(0) = 0."""
    return torch.addcmul(x, inv_alpha, torch.sin(alpha * x).square())


def _inverse_alpha(alpha: torch.Tensor) -> tuple[torch.Tensor]:
    return ((alpha + 1e-9).reciprocal(),)


def _zero_beyond(x: torch.Tensor, beyond: torch.Tensor | None) -> torch.Tensor:
    """Zero the positions past each row's length (beyond (B, 1, T) bool, True there), as a shorter input's zero
    padding would see them."""
    return x if beyond is None else x.masked_fill(beyond, 0.0)


def _beyond_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """(B, 1, size) bool: True at positions past each row's length (made once per resolution, so that no layer
    inverts a validity mask again: 32 kernels of a DAC window's decode)."""
    return (torch.arange(size, device=lengths.device) >= lengths[:, None])[:, None, :]


class Snake(nn.Module):
    def __init__(self, channels: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (inv_alpha,) = derived(self, (self.alpha,), _inverse_alpha)  # computed once (models.derived)
        return _snake(x, self.alpha, inv_alpha)


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(conv7_dilated(snake(x))))."""

    def __init__(self, channels: int, dilation: int, **factory) -> None:
        super().__init__()
        pad = (_RESIDUAL_KERNEL - 1) * dilation // 2
        self.snake1 = Snake(channels, **factory)
        self.conv1 = nn.Conv1d(channels, channels, _RESIDUAL_KERNEL, dilation=dilation, padding=pad, **factory)
        self.snake2 = Snake(channels, **factory)
        self.conv2 = nn.Conv1d(channels, channels, 1, **factory)

    def forward(self, x: torch.Tensor, beyond: torch.Tensor | None = None) -> torch.Tensor:
        h = _zero_beyond(self.conv1(self.snake1(x)), beyond)
        return x + _zero_beyond(self.conv2(self.snake2(h)), beyond)


def _residual_units(channels: int, **factory) -> list[ResidualUnit]:
    return [ResidualUnit(channels, dilation, **factory) for dilation in _DILATIONS]


class EncoderBlock(nn.Module):
    """Three residual units at `channels // 2`, then a strided conv to `channels` (T -> T / stride)."""

    def __init__(self, channels: int, stride: int, **factory) -> None:
        super().__init__()
        self.res_unit1, self.res_unit2, self.res_unit3 = _residual_units(channels // 2, **factory)
        self.snake1 = Snake(channels // 2, **factory)
        self.conv1 = nn.Conv1d(
            channels // 2, channels, 2 * stride, stride=stride, padding=math.ceil(stride / 2), **factory
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_unit3(self.res_unit2(self.res_unit1(x)))
        return self.conv1(self.snake1(x))


class DecoderBlock(nn.Module):
    """A transposed conv from `in_channels` to `in_channels // 2` (T -> T * stride), then three
    residual units."""

    def __init__(self, in_channels: int, stride: int, **factory) -> None:
        super().__init__()
        out_channels = in_channels // 2
        self.stride = stride
        self.snake1 = Snake(in_channels, **factory)
        self.conv_t1 = nn.ConvTranspose1d(
            in_channels, out_channels, 2 * stride, stride=stride, padding=math.ceil(stride / 2), **factory
        )
        self.res_unit1, self.res_unit2, self.res_unit3 = _residual_units(out_channels, **factory)

    def forward(self, x: torch.Tensor, beyond: torch.Tensor | None = None) -> torch.Tensor:
        x = _zero_beyond(self.conv_t1(self.snake1(x)), beyond)
        for unit in (self.res_unit1, self.res_unit2, self.res_unit3):
            x = unit(x, beyond)
        return x


class Encoder(nn.Module):
    def __init__(self, config: DacConfig, **factory) -> None:
        super().__init__()
        width = config.encoder_hidden_size
        self.conv1 = nn.Conv1d(1, width, _EDGE_KERNEL, padding=_EDGE_KERNEL // 2, **factory)
        self.block = nn.ModuleList(
            EncoderBlock(width * 2 ** (i + 1), stride, **factory) for i, stride in enumerate(config.downsampling_ratios)
        )
        self.snake1 = Snake(config.hidden_size, **factory)
        self.conv2 = nn.Conv1d(config.hidden_size, config.hidden_size, 3, padding=1, **factory)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = self.conv1(wav)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class Decoder(nn.Module):
    def __init__(self, config: DacConfig, **factory) -> None:
        super().__init__()
        width = config.decoder_hidden_size
        self.conv1 = nn.Conv1d(config.hidden_size, width, _EDGE_KERNEL, padding=_EDGE_KERNEL // 2, **factory)
        self.block = nn.ModuleList(
            DecoderBlock(width // 2**i, stride, **factory) for i, stride in enumerate(config.upsampling_ratios)
        )
        out_channels = width // 2 ** len(config.upsampling_ratios)
        self.snake1 = Snake(out_channels, **factory)
        self.conv2 = nn.Conv1d(out_channels, 1, _EDGE_KERNEL, padding=_EDGE_KERNEL // 2, **factory)

    def forward(self, latent: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """(B, hidden, T) -> (B, T * hop); with `lengths` (B,) each row is decoded as if it ended there."""
        beyond = None if lengths is None else _beyond_mask(lengths, latent.shape[-1])
        x = _zero_beyond(self.conv1(_zero_beyond(latent, beyond)), beyond)
        scale = 1
        for block in self.block:
            scale *= block.stride
            beyond = None if lengths is None else _beyond_mask(lengths * scale, x.shape[-1] * block.stride)
            x = block(x, beyond)
        return _zero_beyond(torch.tanh(self.conv2(self.snake1(x))), beyond)[:, 0]


class FactorizedCodebook(nn.Module):
    """One residual stage: project to `codebook_dim`, pick the code of highest cosine similarity,
    project its (unnormalized) vector back."""

    def __init__(self, config: DacConfig, **factory) -> None:
        super().__init__()
        self.in_proj = nn.Conv1d(config.hidden_size, config.codebook_dim, 1, **factory)
        self.out_proj = nn.Conv1d(config.codebook_dim, config.hidden_size, 1, **factory)
        self.codebook = nn.Embedding(config.codebook_size, config.codebook_dim, **factory)

    def nearest(self, latent: torch.Tensor) -> torch.Tensor:
        """(B, codebook_dim, T) -> codes (B, T)."""
        batch, dim, frames = latent.shape
        queries = F.normalize(latent.transpose(1, 2).reshape(batch * frames, dim))
        codes = F.normalize(self.codebook.weight)
        # Negated squared distance of unit vectors, in the reference's float form so that
        # near-ties break the same way (a bare cosine ranks identically up to rounding).
        score = (2 * queries @ codes.t() - queries.square().sum(1, keepdim=True)) + codes.square().sum(1)[None]
        return score.argmax(dim=1).reshape(batch, frames)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, T) -> code vectors (B, codebook_dim, T)."""
        return F.embedding(codes, self.codebook.weight).transpose(1, 2)


class ResidualQuantizer(nn.Module):
    def __init__(self, config: DacConfig, **factory) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(FactorizedCodebook(config, **factory) for _ in range(config.n_codebooks))

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        """(B, hidden, T) -> codes (B, n_q, T): each stage quantizes what the previous left."""
        residual, codes = latent, []
        for stage in self.quantizers:
            projected = stage.in_proj(residual)
            stage_codes = stage.nearest(projected)
            # projected + (vector - projected) is the reference's straight-through form; it rounds
            # differently from `vector`, and later stages see that residual.
            vector = projected + (stage.lookup(stage_codes) - projected)
            residual = residual - stage.out_proj(vector)
            codes.append(stage_codes)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, n_q, T) -> latent (B, hidden, T), the sum of every stage's projected vector."""
        latent = self.quantizers[0].out_proj(self.quantizers[0].lookup(codes[:, 0]))
        for index in range(1, codes.shape[1]):
            stage = self.quantizers[index]
            latent = latent + stage.out_proj(stage.lookup(codes[:, index]))
        return latent


class DacCodec(nn.Module):
    """DAC encoder, quantizer and decoder. `decode(codes (B, n_q, T))` -> (B, T * hop_length) samples
    in the model's dtype; `encode(wav (B, 1, S))` -> codes (B, n_q, T) with T = S // hop_length
    (pad S to a multiple of hop_length to keep its tail)."""

    def __init__(self, config: DacConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.config = config
        self.sample_rate_hz = config.sampling_rate
        self.hop_length = config.hop_length
        self.num_codebooks = config.n_codebooks
        self.codebook_size = config.codebook_size
        self.encoder = Encoder(config, **factory)
        self.quantizer = ResidualQuantizer(config, **factory)
        self.decoder = Decoder(config, **factory)

    @property
    def device(self) -> torch.device:
        return self.decoder.conv1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv1.weight.dtype

    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        if wav.dim() != 3 or wav.shape[1] != 1 or not wav.is_floating_point():
            raise ValueError(f"wav must be a float (batch, 1, samples) tensor, got {tuple(wav.shape)} {wav.dtype}")
        if wav.shape[-1] < self.hop_length:
            raise ValueError(f"wav has {wav.shape[-1]} samples, fewer than one frame ({self.hop_length})")
        return self.quantizer.encode(self.encoder(wav.to(self.dtype)))

    def codes_to_latent(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, n_q, T) -> the decoder's input (B, hidden_size, T)."""
        self._check_codes(codes)
        return self.quantizer.decode(codes)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.codes_to_latent(codes))

    forward = decode

    def decode_windows(self, codes: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded windows (B, n_q, T) of `lengths` (B,) frames -> (B, T * hop_length) samples, row b
        equal to decoding codes[b, :, :lengths[b]] alone (up to float rounding) and zero past its end.
        Padding codes may hold anything (they are masked before the codebook lookup)."""
        self._check_codes(codes)
        if lengths.shape != (codes.shape[0],):
            raise ValueError(f"lengths must have shape ({codes.shape[0]},), got {tuple(lengths.shape)}")
        latent = self.codes_to_latent(codes.masked_fill(_beyond_mask(lengths, codes.shape[-1]), 0))
        return self.decoder(latent, lengths)

    def _check_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks or codes.dtype != torch.long:
            raise ValueError(
                f"codes must be an int64 (batch, {self.num_codebooks}, frames) tensor, "
                f"got {tuple(codes.shape)} {codes.dtype}"
            )


def decoder_reach_frames(config: DacConfig) -> tuple[int, int]:
    """(left, right): how many frames before / after a frame can change that frame's samples.

    Walks the decoder's convs backwards from one frame's samples, widening the span of positions they
    read: a "same" conv of kernel k and dilation d by (k - 1) d / 2 each way, a transposed conv of
    stride s (kernel 2s, padding p) maps output o to inputs ceil((o + p - 2s + 1) / s) ..
    floor((o + p) / s). The decoder is shift-invariant in whole frames, so any frame away from the
    edges gives the answer."""
    edge = (_EDGE_KERNEL - 1) // 2
    residual = sum((_RESIDUAL_KERNEL - 1) * d // 2 for d in _DILATIONS)
    frame = 1_000_000
    low, high = frame * config.hop_length - edge, (frame + 1) * config.hop_length - 1 + edge
    for stride in reversed(config.upsampling_ratios):
        pad = math.ceil(stride / 2)
        low, high = low - residual, high + residual
        low, high = -((-(low + pad - 2 * stride + 1)) // stride), (high + pad) // stride
    return frame - (low - edge), (high + edge) - frame
