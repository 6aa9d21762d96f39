"""Decoder building blocks: slot KV cache (batched rows at different positions == separate
prefills), and the official interleaved MRoPE with equal position rows == plain RoPE."""

from __future__ import annotations

import pytest
import torch
from oracle_checkpoints import _import_qwen_tts

from tilevox.models.qwen3_tts.config import TransformerConfig
from tilevox.models.qwen3_tts.layers import CacheView, DecoderStack, KVCache, _rotate_half, rope_cos_sin

CONFIG = TransformerConfig(
    hidden_size=40, intermediate_size=72, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=12, rope_theta=1e6
)


def _stack(seed: int) -> DecoderStack:
    torch.manual_seed(seed)
    stack = DecoderStack(CONFIG).eval()
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[1] ** 0.5)
    return stack


@torch.no_grad()
def test_batched_decode_at_different_positions_matches_full_prefill():
    """Rows with prompts of 1, 7 and 37 tokens sit in slots 4, 0, 2; they then decode 5 tokens
    together (each at its own position). Every decode output equals the last position of a
    one-shot causal prefill of that row's whole sequence."""
    stack = _stack(0)
    lengths, slots, num_steps = [1, 7, 37], [4, 0, 2], 5
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n + num_steps, CONFIG.hidden_size, generator=gen) for n in lengths]
    cache = KVCache(CONFIG, num_slots=5, max_len=64, device="cpu", dtype=torch.float32)
    for seq, n, slot in zip(seqs, lengths, slots):
        view = CacheView(
            cache=cache, slots=torch.tensor([slot]), start=torch.zeros(1, dtype=torch.long), kv_len=n, write_offset=0
        )
        stack.run_layers(seq[None, :n], view)
    for step in range(num_steps):
        start = torch.tensor([n + step for n in lengths])
        view = CacheView(cache=cache, slots=torch.tensor(slots), start=start, kv_len=int(start.max()) + 1)
        out = stack.run_layers(torch.stack([seq[n + step] for seq, n in zip(seqs, lengths)])[:, None], view)
        for row, (seq, n) in enumerate(zip(seqs, lengths)):
            fresh = KVCache(CONFIG, num_slots=1, max_len=64, device="cpu", dtype=torch.float32)
            full_view = CacheView(
                cache=fresh,
                slots=slice(0, 1),
                start=torch.zeros(1, dtype=torch.long),
                kv_len=n + step + 1,
                write_offset=0,
            )
            reference = stack.run_layers(seq[None, : n + step + 1], full_view)[0, -1]
            torch.testing.assert_close(out[row, 0], reference, atol=2e-5, rtol=0)


@pytest.mark.oracle
@pytest.mark.parametrize("sections,head_dim", [([24, 20, 20], 128), ([4, 2, 2], 16)])
def test_official_interleaved_mrope_with_equal_rows_is_plain_rope(sections, head_dim):
    _import_qwen_tts()
    from qwen_tts.core.models.modeling_qwen3_tts import apply_multimodal_rotary_pos_emb

    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([[0, 1, 5, 37, 1000, 4095, 20000]])  # (B=1, T)
    q = torch.randn(1, 3, positions.shape[1], head_dim, generator=gen)
    k = torch.randn(1, 2, positions.shape[1], head_dim, generator=gen)
    cos, sin = rope_cos_sin(positions, head_dim, 1e6, torch.float32)  # (1, T, D)
    rows3 = lambda t: t[None].expand(3, -1, -1, -1)  # noqa: E731  (3, B, T, D): equal t/h/w rows
    q_ref, k_ref = apply_multimodal_rotary_pos_emb(q, k, rows3(cos), rows3(sin), sections, mrope_interleaved=True)
    q_ours = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    k_ours = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    assert torch.equal(q_ours, q_ref) and torch.equal(k_ours, k_ref)
