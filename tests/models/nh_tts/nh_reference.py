"""Tiny transformers Dia models (and a tiny DacModel) saved as Hugging Face checkpoints, and the reference
generate() inputs built as DiaProcessor builds them (its own delay helpers), for the NH-TTS oracle tests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DacConfig, DacModel, DiaConfig, DiaForConditionalGeneration, DiaProcessor, DiaTokenizer

# Two tiny shapes with different awkward sizes: GQA in self and cross attention, odd head counts, and a
# delay pattern other than Dia's in the second one.
SHAPES = {
    "a": {
        "encoder": dict(
            num_hidden_layers=2,
            hidden_size=40,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=10,
            intermediate_size=56,
            vocab_size=256,
            max_position_embeddings=128,
        ),
        "decoder": dict(
            num_hidden_layers=2,
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=72,
            cross_num_attention_heads=4,
            cross_num_key_value_heads=2,
            cross_head_dim=10,
            cross_hidden_size=40,
            vocab_size=1028,
            num_channels=9,
            max_position_embeddings=256,
        ),
        "delay_pattern": [0, 8, 9, 10, 11, 12, 13, 14, 15],
    },
    "b": {
        "encoder": dict(
            num_hidden_layers=2,
            hidden_size=36,
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=12,
            intermediate_size=44,
            vocab_size=256,
            max_position_embeddings=96,
            rope_theta=500.0,
        ),
        "decoder": dict(
            num_hidden_layers=3,
            hidden_size=42,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=50,
            cross_num_attention_heads=3,
            cross_num_key_value_heads=1,
            cross_head_dim=14,
            cross_hidden_size=36,
            vocab_size=1028,
            num_channels=9,
            max_position_embeddings=200,
            rope_theta=2000.0,
        ),
        "delay_pattern": [0, 2, 3, 3, 5, 6, 8, 9, 11],
    },
}

TINY_DAC = dict(
    encoder_hidden_size=2,
    downsampling_ratios=[2, 4, 8, 8],
    decoder_hidden_size=32,
    n_codebooks=9,
    codebook_size=1024,
    codebook_dim=8,
    sampling_rate=44100,
)


@dataclass
class Reference:
    root: Path
    model: DiaForConditionalGeneration
    dac: DacModel
    config: DiaConfig


@torch.no_grad()
def make_reference(root: Path, shape: str, *, seed: int, eos_like: int | None = None) -> Reference:
    """A seeded tiny DiaForConditionalGeneration with weights at a scale where attention and guidance visibly
    move the logits (transformers' own init, std 0.02, leaves them almost flat), saved with a tiny DacModel
    in <root>/dac. `eos_like`: channel 0's EOS row of the head becomes 1.2 x that code's row, so that a stream
    ends (by itself, after a data-dependent number of steps) where it would have picked that code."""
    spec = SHAPES[shape]
    config = DiaConfig(
        encoder_config=spec["encoder"],
        decoder_config=spec["decoder"],
        delay_pattern=spec["delay_pattern"],
        eos_token_id=1024,
        pad_token_id=1025,
        bos_token_id=1026,
    )
    torch.manual_seed(seed)
    model = DiaForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            continue
        std = 1.0 if "embed" in name else 1.0 / math.sqrt(param.shape[-1])
        if name.endswith("q_proj.weight"):
            std /= 3.0  # Dia's attention is unscaled
        param.copy_(torch.randn(param.shape, generator=generator) * std)
    if eos_like is not None:
        weight = model.logits_dense.weight  # rows: channel-major, channel 0 first
        weight[config.eos_token_id] = 1.2 * weight[eos_like]
    model.save_pretrained(root)
    torch.manual_seed(seed + 1)
    dac = DacModel(DacConfig(**TINY_DAC)).eval()
    dac.save_pretrained(root / "dac")
    return Reference(root=root, model=model, dac=dac, config=config)


def encoder_inputs(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask as DiaProcessor's tokenizer makes them (right padding, no special tokens)."""
    enc = DiaTokenizer()(texts, padding=True, padding_side="right", add_special_tokens=False, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def decoder_inputs(config: DiaConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """decoder_input_ids / decoder_attention_mask of DiaProcessor(text) for generation (no audio prompt)."""
    delay = config.delay_pattern
    channels, length = len(delay), 1 + max(delay)
    prefill = torch.full((batch, length, channels), config.pad_token_id, dtype=torch.int)
    prefill[:, :1] = config.bos_token_id
    idx = DiaProcessor.build_indices(
        bsz=batch, seq_len=length, num_channels=channels, delay_pattern=delay, revert=False
    )
    delayed = DiaProcessor.apply_audio_delay(prefill, config.pad_token_id, config.bos_token_id, idx)
    return delayed, torch.ones(batch, length, dtype=torch.long)


def prompt_decoder_inputs(config: DiaConfig, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same for one audio prompt's codes (T, C), as DiaProcessor(text, audio) builds them."""
    delay = config.delay_pattern
    channels, frames = len(delay), codes.shape[0]
    length = 1 + frames + max(delay)
    prefill = torch.full((1, length, channels), config.pad_token_id, dtype=torch.int)
    prefill[0, 0] = config.bos_token_id
    prefill[0, 1 : 1 + frames] = codes.int()
    idx = DiaProcessor.build_indices(bsz=1, seq_len=length, num_channels=channels, delay_pattern=delay, revert=False)
    delayed = DiaProcessor.apply_audio_delay(prefill, config.pad_token_id, config.bos_token_id, idx)
    return delayed, torch.ones(1, length, dtype=torch.long)


def revert_delay(config: DiaConfig, sequences: torch.Tensor) -> torch.Tensor:
    """DiaProcessor.batch_decode's revert of the delay: (B, L, C) -> (B, C, L) (out-of-range entries -1)."""
    batch, length, channels = sequences.shape
    idx = DiaProcessor.build_indices(
        bsz=batch, seq_len=length, num_channels=channels, delay_pattern=config.delay_pattern, revert=True
    )
    return DiaProcessor.apply_audio_delay(sequences, -1, -1, idx).transpose(1, 2)
