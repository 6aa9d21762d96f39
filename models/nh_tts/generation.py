"""The rules of NH-TTS (Dia) generation, as transformers' DiaForConditionalGeneration.generate applies them
to one frame of logits per stream, in its order:

1. classifier-free guidance (scale s != 1): guided = cond + (cond - uncond) * s; with a guidance top-k k,
   the conditional logits are kept at the k best guided ids and the rest set to -inf, otherwise guided;
2. repetition penalty (per channel, over the stream's sequence so far, its BOS/prompt included);
3. min_new_tokens: EOS is -inf on every channel until that many positions were generated;
4. temperature (any value but 1, sampled streams only: greedy picks the argmax anyway);
5. the EOS channel filter: only channel 0 may end; it ends if and only if EOS is its best id (then it is
   its only candidate); channels 1.. never see EOS or the other special ids;
6. top-k then top-p (sampled streams);
7. the EOS delay rule: once channel 0 picks EOS at position e (or e reaches the length limit), channel c
   is forced to EOS at e + delay[c];
then argmax (greedy) or one multinomial draw of all channels from the stream's generator; a channel that
has ended gets PAD; positions still inside the delayed prompt keep the prompt's token. `pick_codes` applies
them to a batch of streams (the plain path of the model's `nh_sampling` region; the executor's backend does
the same pick batched on the device with a counter-based draw).

The delay pattern: codebook c of audio frame f sits at sequence position f + delay[c]; `delay_prompt`
applies it to a prompt, `undelay` takes it back. Imports: torch, models.{region_backends,nh_tts.config}.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tilevox.models.nh_tts.config import NhTtsConfig
from tilevox.models.region_backends import NhPickRows

__all__ = [
    "apply_guidance",
    "delay_prompt",
    "eos_channel_filter",
    "eos_started",
    "pick_codes",
    "pick_scores",
    "top_k_top_p",
    "undelay",
]


def apply_guidance(cond: torch.Tensor, uncond: torch.Tensor, scale: float, top_k: Sequence[int]) -> torch.Tensor:
    """cond, uncond (B, C, V) fp32 -> (B, C, V): DiaClassifierFreeGuidanceLogitsProcessor per stream, its
    guidance top-k `top_k[b]` (0: none, the guided logits themselves)."""
    guided = cond + (cond - uncond) * scale
    out = guided
    for k in sorted(set(top_k)):
        if k <= 0:
            continue
        rows = torch.tensor([b for b, kb in enumerate(top_k) if kb == k], device=cond.device)
        part = guided[rows]
        keep = torch.zeros_like(part, dtype=torch.bool).scatter(-1, torch.topk(part, k=k, dim=-1).indices, True)
        if out is guided:
            out = guided.clone()
        out[rows] = cond[rows].masked_fill(~keep, float("-inf"))
    return out


def eos_channel_filter(scores: torch.Tensor, eos_id: int) -> torch.Tensor:
    """DiaEOSChannelFilterLogitsProcessor on (B, C, V)."""
    scores = scores.clone()
    scores[:, 1:, eos_id:] = float("-inf")
    scores[:, 0, eos_id + 1 :] = float("-inf")
    top = scores.argmax(dim=-1)  # (B, C)
    eos_best = top == eos_id
    below = torch.zeros_like(scores, dtype=torch.bool)
    below[..., :eos_id] = True
    scores = scores.masked_fill(eos_best[..., None] & below, float("-inf"))
    not_best = ~eos_best
    scores[..., eos_id] = scores[..., eos_id].masked_fill(not_best, float("-inf"))
    return scores


def top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' TopKLogitsWarper then TopPLogitsWarper (min_tokens_to_keep 1) on rows (N, V)."""
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def delay_prompt(config: NhTtsConfig, codes: torch.Tensor | None, *, device) -> torch.Tensor:
    """The delayed prompt as DiaProcessor builds it: audio-prompt codes (T, C) (or None) -> (1 + T + max_delay,
    C): BOS at position 0 and wherever position - delay[c] < 0, code t of channel c at t + 1 + delay[c], PAD
    past the prompt. Its first 1 + T positions are the decoder's prefill; later non-PAD entries are forced."""
    c = config.num_channels
    frames = 0 if codes is None else codes.shape[0]
    length = 1 + frames + config.max_delay
    undelayed = torch.full((length, c), config.pad_token_id, dtype=torch.long, device=device)
    undelayed[0] = config.bos_token_id
    if codes is not None:
        undelayed[1 : 1 + frames] = codes.to(device)
    out = torch.empty_like(undelayed)
    for channel, delay in enumerate(config.delay_pattern):
        out[:delay, channel] = config.bos_token_id
        out[delay:, channel] = undelayed[: length - delay, channel]
    return out


def undelay(config: NhTtsConfig, sequence: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Audio frames [start, end) of a delayed sequence (positions, C): (C, end - start), frame f's channel
    c being sequence[f + delay[c], c] (DiaProcessor.batch_decode's revert)."""
    delays = torch.tensor(config.delay_pattern, dtype=torch.long, device=sequence.device)
    frames = torch.arange(start, end, device=sequence.device)
    positions = frames[None, :] + delays[:, None]  # (C, F)
    channels = torch.arange(config.num_channels, device=sequence.device)[:, None].expand_as(positions)
    return sequence[positions, channels]


def eos_started(rows: NhPickRows, b: int, top0: int, eos_id: int) -> bool:
    """Rule 7's start: stream b's channel 0 ends at this position (its best id is EOS, or the length limit)."""
    return rows.eos_positions[b] < 0 and (top0 == eos_id or rows.positions[b] == rows.eos_limits[b])


def pick_scores(
    config: NhTtsConfig, pending: torch.Tensor, sequences: torch.Tensor, rows: NhPickRows
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Rules 1-7 for a batch of streams: pending logits (B, R, C, V) float32 (edited in place), the delayed
    sequences (S, L, C) -> (the scores each stream's channels are picked from (B, C, V), channel 0's best id
    after the filters per stream, the ended channels (B, C) bool on the CPU)."""
    eos = config.eos_token_id
    cond = pending[:, 0]
    if pending.shape[1] == 2:
        scores = apply_guidance(cond, pending[:, 1], rows.guidance_scale, [p.top_k for p in rows.params])
    else:
        scores = cond
    for b, p in enumerate(rows.params):
        if p.repetition_penalty != 1.0:
            history = sequences[rows.slots[b], : rows.positions[b]].T  # (C, positions)
            row = scores[b]
            picked = row.gather(1, history)
            picked = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
            scores[b] = row.scatter(1, history, picked)
        if rows.positions[b] - rows.prompt_lens[b] < p.min_new_tokens:
            scores[b, :, eos] = float("-inf")
        if not p.is_greedy and p.temperature != 1.0:
            scores[b] = scores[b] / p.temperature
    scores = eos_channel_filter(scores, eos)
    for b, p in enumerate(rows.params):
        if not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0):
            scores[b] = top_k_top_p(scores[b], p.top_k, p.top_p)
    # The EOS delay rule (one host sync per step: whether channel 0 ends).
    top0 = scores[:, 0].argmax(dim=-1).tolist()
    batch = len(rows.params)
    forced = torch.zeros(batch, config.num_channels, dtype=torch.bool)
    ended = torch.zeros(batch, config.num_channels, dtype=torch.bool)
    delays = torch.tensor(config.delay_pattern, dtype=torch.long)
    for b in range(batch):
        eos_position = rows.positions[b] if eos_started(rows, b, top0[b], eos) else rows.eos_positions[b]
        if eos_position >= 0:
            since = rows.positions[b] - eos_position
            forced[b] = delays == since
            ended[b] = delays < since
    if bool(forced.any()):
        forced_d = forced.to(scores.device)
        scores = scores.masked_fill(forced_d[..., None], float("-inf"))
        scores[..., eos] = scores[..., eos].masked_fill(forced_d, 0.0)
    return scores, top0, ended


def pick_codes(
    config: NhTtsConfig, pending: torch.Tensor, sequences: torch.Tensor, rows: NhPickRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed position of every channel per stream: (codes (B, C) int64 on the pending logits' device,
    channel 0's best id after the filters (B,) int64 on the CPU). Greedy streams take the argmax, sampled
    streams one multinomial draw of all channels from their generator; ended channels get PAD and forced
    prompt entries (sequences[slot, position], non-PAD) replace the pick."""
    scores, top0, ended = pick_scores(config, pending, sequences, rows)
    tokens = scores.argmax(dim=-1)  # (B, C): the greedy picks
    for b, p in enumerate(rows.params):
        if not p.is_greedy:
            probs = scores[b].softmax(dim=-1)
            tokens[b] = torch.multinomial(probs, 1, generator=rows.generators[b])[:, 0]
    if bool(ended.any()):
        tokens = tokens.masked_fill(ended.to(tokens.device), config.pad_token_id)
    for b in range(len(rows.params)):
        if rows.positions[b] < rows.forced_lens[b]:
            row = sequences[rows.slots[b], rows.positions[b]]
            tokens[b] = torch.where(row != config.pad_token_id, row, tokens[b])
    return tokens, torch.tensor(top0, dtype=torch.long)
