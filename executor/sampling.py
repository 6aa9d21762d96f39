"""Batched on-device sampling with per-row parameters and a counter-based RNG (CUDA-graph capturable).

`sample_rows` draws one token per row of logits (B, V) from per-row tensors: temperature (0 = greedy),
top-k (0 = off), top-p (1 = off), seed and counter. It makes exactly the draw of the megakernel's
SAMPLE_EMBED (trt_plugins.megakernel.vm): keep the top-k (ties at the k-th value kept), then the smallest
nucleus reaching top-p (at least one token), then invert the CDF in vocabulary order at
u = uniform_from_seed(seed, counter) x total. No host synchronisation, no data-dependent shapes.
`sample_rows_reference` is the per-row float64 reference. `sample_next_tokens` puts the penalties of
models.sampling.sample_tokens in front of it (repetition penalty over each row's history, stop tokens held
back until min_new_tokens), batched and capturable. Imports: torch, trt_plugins.megakernel.vm.

Two static shortcuts, chosen on the host from the rows' parameters (`filter_plan`), leave the draw exactly as
it is and drop work no row needs: the k-th largest score comes from a top-k of `candidates` >= every row's
top_k instead of a sort of the whole vocabulary (a top-k's k-th value is the sorted one, ties included,
and the keep-mask still compares the whole row against it), and the nucleus sort is left out when no row
has top_p < 1. On a 193k-token vocabulary (Llasa) the two sorts were most of the sampling time.

`nh_pick_codes` is NH-TTS's whole pick (models.nh_tts.generation's rules 1-7, then the draw) for every
stream at once: per-row parameters as tensors, the draw of channel c at (seed, counter + c).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tilevox.models.nh_tts.generation import eos_channel_filter
from tilevox.trt_plugins.megakernel.vm import uniform_from_seed

__all__ = [
    "MIN_CANDIDATES",
    "NH_FLOATS",
    "NH_INTS",
    "filter_plan",
    "nh_pick_codes",
    "nh_pick_scores",
    "penalize_rows",
    "sample_next_tokens",
    "sample_rows",
    "sample_rows_reference",
]


MIN_CANDIDATES = 64  # the smallest top-k width filter_plan picks (then powers of two)


def filter_plan(top_ks: Sequence[int], top_ps: Sequence[float], vocab: int) -> tuple[int | None, bool]:
    """(candidates, nucleus) for sample_rows from the rows' top_k and top_p on the host: candidates is 0
    when no row filters by top-k, else the power of two from MIN_CANDIDATES >= the largest top_k (None,
    a whole-vocabulary sort, when that reaches the vocabulary); nucleus says whether any row has top_p < 1."""
    active = [k for k in top_ks if 0 < k < vocab]
    candidates: int | None = 0
    if active:
        candidates = MIN_CANDIDATES
        while candidates < max(active):
            candidates *= 2
        if candidates >= vocab:
            candidates = None
    return candidates, any(p < 1.0 for p in top_ps)


def _filter(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int | None, nucleus: bool
) -> torch.Tensor:
    """-inf outside each row's top-k and then outside its top-p nucleus; scores (B, V) float. candidates:
    0 = no row uses top-k, k = every active top_k is <= k, None = any (see filter_plan)."""
    vocab = scores.shape[-1]
    if candidates != 0:
        width = vocab if candidates is None else min(candidates, vocab)
        descending = (
            torch.topk(scores, width, dim=-1).values
            if width < vocab
            else torch.sort(scores, dim=-1, descending=True).values
        )
        kth = descending.gather(1, (top_k.clamp(min=1, max=width) - 1)[:, None])  # (B, 1)
        use_k = ((top_k > 0) & (top_k < vocab))[:, None]
        scores = scores.masked_fill(use_k & (scores < kth), float("-inf"))
    if not nucleus:
        return scores
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1.0 - top_p)[:, None]
    drop_sorted[:, -1] = False
    drop_sorted &= (top_p < 1.0)[:, None]
    return scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    *,
    candidates: int | None = None,
    nucleus: bool = True,
) -> torch.Tensor:
    """(B,) int64 tokens: argmax where temperature is 0, else the counter-based draw described above.
    temperature, top_p float32 (B,); top_k, seed, counter int64 (B,); all on logits' device. candidates,
    nucleus: filter_plan's shortcuts (the defaults take none); a plan that does not cover the rows'
    top_k/top_p draws from the wrong set, so take it from filter_plan of the same rows."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got {tuple(logits.shape)}")
    scores = logits.float()
    greedy = torch.argmax(scores, dim=-1)
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    filtered = _filter(scores / safe_temperature[:, None], top_k, top_p, candidates, nucleus)
    cdf = filtered.softmax(dim=-1).cumsum(dim=-1)
    u = uniform_from_seed(seed, counter)[:, None] * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
    return torch.where(temperature > 0, drawn, greedy)


def sample_rows_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
) -> torch.Tensor:
    """The same draw row by row in float64 (for tests)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for row in range(logits.shape[0]):
        scores = logits[row].double().cpu()
        temp = float(temperature[row])
        if temp == 0.0:
            out[row] = int(torch.argmax(scores))
            continue
        scores = scores / temp
        k, p = int(top_k[row]), float(top_p[row])
        if 0 < k < scores.numel():
            scores = scores.masked_fill(scores < torch.topk(scores, k).values[-1], float("-inf"))
        if p < 1.0:
            ascending, order = torch.sort(scores)
            drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - p
            drop[-1] = False
            scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        cdf = scores.softmax(dim=-1).cumsum(dim=-1)
        u = float(uniform_from_seed(seed[row : row + 1].cpu(), counter[row : row + 1].cpu())[0]) * float(cdf[-1])
        out[row] = int(
            torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0].clamp(max=cdf.numel() - 1)
        )
    return out


def penalize_rows(
    logits: torch.Tensor,
    penalty: torch.Tensor,
    history: torch.Tensor,
    lengths: torch.Tensor,
    min_new_tokens: torch.Tensor,
    stop_ids: torch.Tensor,
) -> torch.Tensor:
    """models.sampling's penalties for a batch, in its order: the repetition penalty (float32 (B,); 1 = off)
    over history[b, :lengths[b]] (int64 (B, L), anything past a row's length is ignored; L may be 0), then
    stop_ids (int64 (S,)) set to -inf in rows with lengths < min_new_tokens. Same values as the per-row
    models.sampling.apply_repetition_penalty (x * p below zero, x / p otherwise, once per distinct token)."""
    vocab = logits.shape[-1]
    if history.shape[1]:
        valid = torch.arange(history.shape[1], device=history.device)[None, :] < lengths[:, None]
        index = torch.where(valid, history, torch.full_like(history, vocab))  # column `vocab`: a dropped pad
        padded = torch.nn.functional.pad(logits, (0, 1))
        scores = padded.gather(1, index)
        scores = torch.where(scores < 0, scores * penalty[:, None], scores / penalty[:, None])
        logits = padded.scatter(1, index, scores)[:, :vocab]
    if stop_ids.numel():
        hold = (lengths < min_new_tokens)[:, None]
        stops = logits.index_select(1, stop_ids)
        logits = logits.index_copy(1, stop_ids, torch.where(hold, torch.full_like(stops, float("-inf")), stops))
    return logits


def sample_next_tokens(
    logits: torch.Tensor,
    floats: torch.Tensor,
    ints: torch.Tensor,
    history: torch.Tensor,
    stop_ids: torch.Tensor,
    *,
    candidates: int | None = None,
    nucleus: bool = True,
) -> torch.Tensor:
    """(B,) int64: `penalize_rows`, then `sample_rows`. floats (B, 3) float32: temperature, top_p, repetition
    penalty; ints (B, 5) int64: top_k, seed, counter, min_new_tokens, history length."""
    scores = penalize_rows(logits.float(), floats[:, 2], history, ints[:, 4], ints[:, 3], stop_ids)
    return sample_rows(
        scores, floats[:, 0], ints[:, 0], floats[:, 1], ints[:, 1], ints[:, 2], candidates=candidates, nucleus=nucleus
    )


# Columns of nh_pick_scores' per-row tensors.
NH_FLOATS = ("temperature", "top_p", "repetition_penalty")  # float32; a greedy row: 0, 1, its penalty
NH_INTS = (
    "guidance_top_k",  # the stream's top_k (0: none), also for greedy streams, as generate() applies it
    "top_k",  # 0 for greedy rows
    "seed",
    "counter",  # the draw of channel c uses counter + c
    "hold_eos",  # 1 while fewer than min_new_tokens positions were generated
    "position",  # the position picked; also the history length
    "eos_limit",
    "eos_position",  # -1: channel 0 has not ended
    "slot",  # the stream's row of the sequences
    "forced_len",  # positions below this may hold forced prompt entries (non-PAD) in the sequences
)


def nh_pick_scores(
    pending: torch.Tensor,
    sequences: torch.Tensor,
    floats: torch.Tensor,
    ints: torch.Tensor,
    delays: torch.Tensor,
    *,
    history: int,
    eos: int,
    scale: float,
    guidance_candidates: int | None,
    candidates: int | None,
    nucleus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """models.nh_tts.generation.pick_scores batched on the device (no host synchronisation): pending (B, R, C,
    V) float32, sequences (S, L, C) int64, floats (B, 3) and ints (B, 10) by NH_FLOATS / NH_INTS, delays (C,)
    int64 -> (scores (B, C, V), channel 0's best id after the filters (B,)). `history`: positions of the
    repetition penalty's history read per row (>= every penalised row's position; 0 when no row penalises);
    guidance_candidates / candidates / nucleus: filter_plan's shortcuts for the guidance top-k and the
    sampling top-k / top-p."""
    scores, top0, _ = _nh_scores(
        pending,
        sequences,
        floats,
        ints,
        delays,
        history=history,
        eos=eos,
        scale=scale,
        guidance_candidates=guidance_candidates,
        candidates=candidates,
        nucleus=nucleus,
    )
    return scores, top0


def _nh_scores(
    pending, sequences, floats, ints, delays, *, history, eos, scale, guidance_candidates, candidates, nucleus
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nh_pick_scores, and each row's EOS position after this pick (-1: none) (B,)."""
    batch, _, channels, vocab = pending.shape
    guidance_k, top_k, position = ints[:, 0], ints[:, 1], ints[:, 5]
    is_eos = torch.arange(vocab, device=pending.device) == eos  # (V,)
    cond = pending[:, 0]
    if pending.shape[1] == 2:  # rule 1
        scores = cond + (cond - pending[:, 1]) * scale
        if guidance_candidates != 0:  # the conditional logits at each row's guidance_k best guided ids
            width = vocab if guidance_candidates is None else min(guidance_candidates, vocab)
            best = torch.topk(scores, width, dim=-1).indices  # (B, C, width), best first
            rank = torch.arange(width, device=scores.device)
            first_k = (rank[None, None, :] < guidance_k[:, None, None]).expand(batch, channels, width)
            keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, best, first_k)
            kept = cond.masked_fill(~keep, float("-inf"))
            scores = torch.where((guidance_k > 0)[:, None, None], kept, scores)
    else:
        scores = cond
    if history:  # rule 2, per channel over the row's positions [0, position)
        seen = sequences[:, :history].index_select(0, ints[:, 8]).transpose(1, 2)  # (B, C, history)
        valid = torch.arange(history, device=seen.device)[None, None, :] < position[:, None, None]
        index = torch.where(valid, seen, torch.full_like(seen, vocab))  # column `vocab`: a dropped pad
        padded = torch.nn.functional.pad(scores, (0, 1))
        picked = padded.gather(2, index)
        penalty = floats[:, 2][:, None, None]
        picked = torch.where(picked < 0, picked * penalty, picked / penalty)
        scores = padded.scatter(2, index, picked)[..., :vocab]
    hold = (ints[:, 4] > 0)[:, None, None]  # rule 3
    scores = scores.masked_fill(hold & is_eos, float("-inf"))
    temperature = floats[:, 0]  # rule 4 (greedy rows and temperature 1: divided by 1, unchanged)
    scores = scores / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None, None]
    scores = eos_channel_filter(scores, eos)  # rule 5
    scores = _filter(  # rule 6 (greedy rows: top_k 0, top_p 1, unchanged)
        scores.reshape(batch * channels, vocab),
        top_k[:, None].expand(batch, channels).reshape(-1),
        floats[:, 1][:, None].expand(batch, channels).reshape(-1),
        candidates,
        nucleus,
    ).view(batch, channels, vocab)
    # Rule 7: channel 0 ends here if its best id is EOS or at its length limit; channel c is then forced to
    # EOS at eos_position + delay[c].
    top0 = scores[:, 0].argmax(dim=-1)
    starts = (ints[:, 7] < 0) & ((top0 == eos) | (position == ints[:, 6]))
    eos_position = torch.where(starts, position, ints[:, 7])
    forced = ((eos_position >= 0)[:, None] & (delays[None, :] == (position - eos_position)[:, None]))[..., None]
    scores = scores.masked_fill(forced, float("-inf")).masked_fill(forced & is_eos, 0.0)
    return scores, top0, eos_position


def nh_pick_codes(
    pending: torch.Tensor,
    sequences: torch.Tensor,
    floats: torch.Tensor,
    ints: torch.Tensor,
    delays: torch.Tensor,
    *,
    history: int,
    eos: int,
    pad: int,
    scale: float,
    guidance_candidates: int | None,
    candidates: int | None,
    nucleus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """models.nh_tts.generation.pick_codes batched on the device: nh_pick_scores, then per row the argmax
    (temperature 0) or sample_rows' draw of channel c at (seed, counter + c); ended channels get `pad`, and
    non-PAD entries of sequences[slot, position] below forced_len (the forced prompt) replace the pick.
    Returns (codes (B, C) int64, channel 0's best id (B,))."""
    scores, top0, eos_position = _nh_scores(
        pending,
        sequences,
        floats,
        ints,
        delays,
        history=history,
        eos=eos,
        scale=scale,
        guidance_candidates=guidance_candidates,
        candidates=candidates,
        nucleus=nucleus,
    )
    batch, channels, vocab = scores.shape
    sampled = torch.where(floats[:, 0] > 0, 1.0, 0.0)[:, None].expand(batch, channels).reshape(-1)  # T applied
    counter = ints[:, 3][:, None] + torch.arange(channels, device=scores.device)[None, :]
    codes = sample_rows(
        scores.reshape(batch * channels, vocab),
        sampled,
        torch.zeros_like(counter).view(-1),
        torch.ones_like(sampled),
        ints[:, 2][:, None].expand(batch, channels).reshape(-1),
        counter.view(-1),
        candidates=0,
        nucleus=False,
    ).view(batch, channels)
    position = ints[:, 5]
    ended = (eos_position >= 0)[:, None] & (delays[None, :] < (position - eos_position)[:, None])
    codes = codes.masked_fill(ended, pad)
    prompt = sequences[ints[:, 8], position]  # (B, C): PAD where nothing is forced
    forced = (prompt != pad) & (position < ints[:, 9])[:, None]
    return torch.where(forced, prompt, codes), top0
