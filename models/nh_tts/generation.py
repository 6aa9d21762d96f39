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
has ended gets PAD; positions still inside the delayed prompt keep the prompt's token.

The delay pattern: codebook c of audio frame f sits at sequence position f + delay[c]; `delay_prompt`
applies it to a prompt, `undelay` takes it back. Imports: torch, models.nh_tts.config.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tilevox.models.nh_tts.config import NhTtsConfig

__all__ = [
    "apply_guidance",
    "delay_prompt",
    "eos_channel_filter",
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
