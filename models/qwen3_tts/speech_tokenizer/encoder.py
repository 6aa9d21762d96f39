"""Qwen3-TTS speech-tokenizer encoder: 24 kHz audio -> (B, Q, T) codes for ICL voice prompts.

The official encoder is `transformers`' MimiModel with its decoder parts removed, keeping the
first `encoder_valid_num_quantizers` of its RVQ codes; we reuse that class the same way (it is
the reference implementation of Mimi). transformers is imported lazily, only when an encoder
is built, so decode-only deployments do not need it. Imports: torch, transformers (lazy).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tilevox.models.qwen3_tts.speech_tokenizer.config import SpeechTokenizerConfig

__all__ = ["SpeechTokenizerEncoder"]


class SpeechTokenizerEncoder(nn.Module):
    """Mimi encoder + split RVQ. `self.mimi`'s state dict is the checkpoint's `encoder.*` tensors."""

    def __init__(self, config: SpeechTokenizerConfig, *, attn_implementation: str = "sdpa"):
        super().__init__()
        from transformers import MimiConfig, MimiModel  # lazy: heavy, and only ICL prompts need it

        self.config = config
        mimi_config = MimiConfig(**dict(config.encoder_config))
        mimi_config._attn_implementation = attn_implementation
        mimi = MimiModel(mimi_config)
        # Same pruning as the official encoder: these parts are not in the checkpoint.
        mimi.upsample = None
        mimi.decoder_transformer = None
        mimi.decoder = None
        self.mimi = mimi

    def reset_caches(self) -> None:
        """Mimi caches each codebook's table on first use; call after changing its tensors."""
        for module in self.mimi.modules():
            if hasattr(module, "_embed"):
                module._embed = None

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """wav (B, S) float at 24 kHz (rows of equal length, no padding mask, as the official
        encode of an unpadded batch) -> codes (B, Q, ceil(S / 1920)) int64."""
        if wav.dim() != 2 or wav.shape[-1] == 0:
            raise ValueError(f"wav must be a non-empty (B, S) tensor, got shape {tuple(wav.shape)}")
        num_books = self.config.encoder_valid_num_quantizers
        dtype = next(self.mimi.parameters()).dtype
        # RVQ codes are residual and sequential, so asking for the first Q books gives the same
        # codes as the official "all 32 books, then keep Q", at half the cost.
        out = self.mimi.encode(wav[:, None].to(dtype), num_quantizers=num_books, return_dict=True)
        num_frames = math.ceil(wav.shape[-1] / self.config.encode_downsample_rate)
        return out.audio_codes[:, :num_books, :num_frames].long()
