"""The tiny Qwen3-TTS codec decoder the megakernel codec tests share: a short sliding window, so the ring caches
wrap within a few frames, and layer scales drawn N(0, 1), far from their 0.01 init, so a missing or misplaced
scale shows in the outputs."""

from __future__ import annotations

import dataclasses

import torch

from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, SpeechTokenizerDecoder, random_speech_tokenizer


def short_window_codec(
    window: int, *, seed: int, scale_seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> SpeechTokenizerDecoder:
    """The `tiny` preset's decoder with a `window`-frame sliding window and random layer scales (seeded)."""
    config = PRESETS["tiny"]
    config = dataclasses.replace(config, decoder=dataclasses.replace(config.decoder, sliding_window=window))
    decoder, _ = random_speech_tokenizer(config, seed=seed, dtype=dtype, device=device, with_encoder=False)
    gen = torch.Generator().manual_seed(scale_seed)
    with torch.no_grad():
        for layer in decoder.pre_transformer.layers:
            for scale in (layer.self_attn_layer_scale.scale, layer.mlp_layer_scale.scale):
                scale.copy_(torch.randn(scale.shape, generator=gen).to(scale))
    return decoder
