"""Qwen3-TTS speaker encoder (Base models): ECAPA-TDNN x-vector from 24 kHz audio.

`SpeakerEncoder.embed` runs the official front end exactly (reflect-padded magnitude STFT, n_fft
1024, hop 256, Hann 1024, 128 Slaney mel bands 0-12 kHz built here as librosa builds them, log
with clamp 1e-5), always in fp32, then the ECAPA-TDNN in the module's dtype. The embedding goes
straight into the talker's codec track. Parameter names match `speaker_encoder.*` in the
checkpoint. Imports: numpy, torch, models.errors, models.config_fields, models.qwen3_tts.speech_tokenizer.weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tilevox.models.config_fields import log_unknown_fields
from tilevox.models.errors import CheckpointError
from tilevox.models.qwen3_tts.speech_tokenizer.weights import load_state_dict_strict, randomize_

__all__ = [
    "SpeakerEncoder",
    "SpeakerEncoderConfig",
    "load_speaker_encoder",
    "mel_spectrogram",
    "random_speaker_encoder",
    "slaney_mel_filterbank",
]

# The official extraction hard-codes these (independent of the config).
SAMPLE_RATE_HZ = 24000
N_FFT = 1024
HOP = 256
WIN = 1024
NUM_MELS = 128
FMIN_HZ = 0.0
FMAX_HZ = 12000.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of config.json: the official files hold only enc_dim and sample_rate;
    the other keys are the official class's constructor defaults."""

    enc_dim: int = 1024
    sample_rate: int = 24000
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128

    def __post_init__(self) -> None:
        for name in ("enc_dim", "enc_attention_channels", "enc_res2net_scale", "enc_se_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speaker encoder {name} must be a positive int, got {value!r}")
        if self.sample_rate != SAMPLE_RATE_HZ:
            raise ValueError(f"speaker encoder sample_rate must be {SAMPLE_RATE_HZ}, got {self.sample_rate}")
        if self.mel_dim != NUM_MELS:
            raise ValueError(f"speaker encoder mel_dim must be {NUM_MELS} (the front end is fixed), got {self.mel_dim}")
        n = len(self.enc_channels)
        if n < 3 or len(self.enc_kernel_sizes) != n or len(self.enc_dilations) != n:
            raise ValueError(
                "enc_channels, enc_kernel_sizes and enc_dilations must have the same length >= 3, got "
                f"{len(self.enc_channels)}, {len(self.enc_kernel_sizes)}, {len(self.enc_dilations)}"
            )
        for i in range(1, n - 1):
            if self.enc_channels[i] != self.enc_channels[i - 1]:
                raise ValueError(f"SE-Res2Net blocks are residual: enc_channels[{i}] must equal enc_channels[{i - 1}]")
            if self.enc_channels[i] % self.enc_res2net_scale:
                raise ValueError(
                    f"enc_channels[{i}] ({self.enc_channels[i]}) must be divisible by enc_res2net_scale "
                    f"({self.enc_res2net_scale})"
                )
        if sum(self.enc_channels[1:-1]) != self.enc_channels[-1]:
            raise ValueError(
                f"enc_channels[-1] ({self.enc_channels[-1]}) must equal the sum of the SE-Res2Net outputs "
                f"({sum(self.enc_channels[1:-1])}): they are concatenated into it"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config.json") -> SpeakerEncoderConfig:
        """Parse `speaker_encoder_config`; unknown keys are accepted and logged once, as in every
        config (models.config_fields)."""
        known = set(cls.__dataclass_fields__)
        log_unknown_fields(data, known, source=source, section="speaker_encoder_config")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        return cls(**kwargs)


def slaney_mel_filterbank(*, sample_rate: int, n_fft: int, num_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """(num_mels, n_fft//2 + 1) float32 triangular filters on the Slaney mel scale with Slaney area
    normalisation, computed with librosa's float64 steps and float32 rounding points."""
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0

    def hz_to_mel(hz: float) -> float:
        return min_log_mel + math.log(hz / min_log_hz) / logstep if hz >= min_log_hz else hz / f_sp

    mels = np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), num_mels + 2)
    mel_f = f_sp * mels
    log_region = mels >= min_log_mel
    mel_f[log_region] = min_log_hz * np.exp(logstep * (mels[log_region] - min_log_mel))
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_freqs)
    weights = np.zeros((num_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(num_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))  # rounded to float32 here
    weights *= (2.0 / (mel_f[2 : num_mels + 2] - mel_f[:num_mels]))[:, None]  # float64 product, float32 store
    return weights


_MEL_BASIS = torch.from_numpy(
    slaney_mel_filterbank(sample_rate=SAMPLE_RATE_HZ, n_fft=N_FFT, num_mels=NUM_MELS, fmin=FMIN_HZ, fmax=FMAX_HZ)
)


def mel_spectrogram(wav: torch.Tensor) -> torch.Tensor:
    """(B, S) float32 audio at 24 kHz -> (B, 128, frames) log-mel, frames = (S + 768 - 1024) // 256 + 1."""
    if wav.dim() != 2:
        raise ValueError(f"wav must be (B, S), got shape {tuple(wav.shape)}")
    pad = (N_FFT - HOP) // 2
    if wav.shape[-1] <= pad:
        raise ValueError(f"speaker audio needs more than {pad} samples (reflect padding), got {wav.shape[-1]}")
    wav = wav.float()
    padded = F.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]  # (B, S + 768)
    window = torch.hann_window(WIN, device=wav.device)
    spec = torch.stft(
        padded,
        N_FFT,
        hop_length=HOP,
        win_length=WIN,
        window=window,
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # (B, 513, frames)
    mel = torch.matmul(_MEL_BASIS.to(wav.device), magnitude)
    return torch.log(torch.clamp(mel, min=1e-5))


def _same_conv(in_ch: int, out_ch: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TdnnBlock(nn.Module):
    """Conv1d ('same', reflect) + ReLU."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _same_conv(in_ch, out_ch, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Split channels into `scale` groups; group i>0 is convolved after adding group i-1's output."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TdnnBlock(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        for i in range(1, self.scale):
            inp = parts[i] if i == 1 else parts[i] + outs[-1]
            outs.append(self.blocks[i - 1](inp))
        return torch.cat(outs, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _same_conv(channels, se_channels, 1)
        self.conv2 = _same_conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SeRes2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, se_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TdnnBlock(channels, channels, 1, 1)
        self.res2net_block = Res2NetBlock(channels, scale, kernel, dilation)
        self.tdnn2 = TdnnBlock(channels, channels, 1, 1)
        self.se_block = SqueezeExcitation(channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


class AttentiveStatsPooling(nn.Module):
    """Attention over time conditioned on global mean/std; returns weighted mean and std (B, 2C, 1)."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TdnnBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _same_conv(attention_channels, channels, 1)

    @staticmethod
    def _stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(dim=2)
        std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(dim=2).clamp(1e-12))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, L)
        length = x.shape[-1]
        uniform = torch.ones_like(x[:, :1]) / length  # (B, 1, L); every frame is valid (no padding)
        mean, std = self._stats(x, uniform)
        context = torch.cat([x, mean[..., None].expand_as(x), std[..., None].expand_as(x)], dim=1)  # (B, 3C, L)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = self._stats(x, attention)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: (B, frames, 128) log-mel -> (B, enc_dim)."""

    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        self.config = config
        ch, ks, dil = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        blocks: list[nn.Module] = [TdnnBlock(config.mel_dim, ch[0], ks[0], dil[0])]
        blocks += [
            SeRes2NetBlock(ch[i], config.enc_res2net_scale, config.enc_se_channels, ks[i], dil[i])
            for i in range(1, len(ch) - 1)
        ]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TdnnBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPooling(ch[-1], config.enc_attention_channels)
        self.fc = _same_conv(ch[-1] * 2, config.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = mels.transpose(1, 2)  # (B, 128, frames)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))  # multi-layer feature aggregation
        return self.fc(self.asp(x))[..., 0]

    @property
    def min_samples(self) -> int:
        """Shortest audio `embed` accepts: every 'same' reflect-padded conv needs more mel frames
        than its one-sided padding (the official code fails below this too)."""
        cfg = self.config
        widest = max(math.ceil((k - 1) * d / 2) for k, d in zip(cfg.enc_kernel_sizes, cfg.enc_dilations))
        return max((N_FFT - HOP) // 2 + 1, (widest + 1) * HOP)

    @torch.inference_mode()
    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """(S,) float audio at 24 kHz (resample first) -> (enc_dim,) x-vector in the module's dtype."""
        if wav.dim() != 1:
            raise ValueError(f"wav must be 1-D (S,), got shape {tuple(wav.shape)}")
        if wav.shape[0] < self.min_samples:
            raise ValueError(
                f"speaker audio must have at least {self.min_samples} samples at 24 kHz, got {wav.shape[0]}"
            )
        param = self.fc.weight
        mels = mel_spectrogram(wav[None].to(device=param.device, dtype=torch.float32)).transpose(1, 2)
        return self.forward(mels.to(param.dtype))[0]


def load_speaker_encoder(
    state_dict: Mapping[str, torch.Tensor],
    config: SpeakerEncoderConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str = "model.safetensors",
) -> SpeakerEncoder:
    """Build from the `speaker_encoder.*` tensors of `state_dict` (other keys are ignored, so the
    whole model.safetensors dict can be passed). Strict within `speaker_encoder.*`."""
    prefix = "speaker_encoder."
    tensors = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not tensors:
        raise CheckpointError(f"{source}: no {prefix}* tensors (only Base checkpoints have a speaker encoder)")
    encoder = SpeakerEncoder(config)
    load_state_dict_strict(encoder, tensors, where=f"{source}: {prefix}")
    return encoder.to(device=device, dtype=dtype).eval()


def random_speaker_encoder(
    config: SpeakerEncoderConfig,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> SpeakerEncoder:
    """Seeded random weights (fan-in scaled, see `randomize_`), for `random:` presets and tests."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    encoder = SpeakerEncoder(config)
    randomize_(encoder, generator)
    return encoder.to(device=device, dtype=dtype).eval()
