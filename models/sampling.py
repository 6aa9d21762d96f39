"""Token sampling on logits, one generator per stream.

Each stream carries its own `SamplingParams` and `torch.Generator`, so a stream's draws
depend only on its own seed and logits, never on which other streams share the batch.
Order of operations follows `transformers`' generate(): repetition penalty, then
min-new-tokens suppression of stop tokens, then temperature, top-k, top-p, then a draw.

Imports: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tilevox.models.errors import RequestError
from tilevox.models.host_copy import to_device

__all__ = [
    "SamplingParams",
    "apply_repetition_penalty",
    "filter_top_k_top_p",
    "make_generator",
    "sample_tokens",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy (argmax)
    top_k: int = 50  # 0 disables
    top_p: float = 1.0  # 1 disables
    repetition_penalty: float = 1.0  # 1 disables; >1 discourages tokens already generated
    min_new_tokens: int = 0  # stop tokens are suppressed until this many tokens exist
    max_new_tokens: int = 4096

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.repetition_penalty > 0.0):
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_new_tokens < 0:
            raise RequestError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy(cls, **overrides) -> SamplingParams:
        return cls(temperature=0.0, top_k=0, top_p=1.0, **overrides)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def apply_repetition_penalty(logits: torch.Tensor, previous_tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as transformers' RepetitionPenaltyLogitsProcessor) on a (V,) row."""
    if penalty == 1.0 or previous_tokens.numel() == 0:
        return logits
    scores = logits.gather(0, previous_tokens)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(0, previous_tokens, scores)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf on a (V,) row (transformers' semantics:
    top-p keeps the smallest set whose probability reaches top_p, and at least one token)."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - top_p)
        remove_sorted[-1] = False
        remove = remove_sorted.scatter(0, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    previous_tokens: Sequence[torch.Tensor],
    stop_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Draw one token per row of `logits` (B, V); returns a (B,) int64 tensor on logits' device.

    `previous_tokens[i]` holds stream i's generated tokens so far (for repetition penalty
    and min_new_tokens)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got {tuple(logits.shape)}")
    if not (len(params) == len(generators) == len(previous_tokens) == logits.shape[0]):
        raise ValueError("params, generators and previous_tokens must each have one entry per logits row")
    stop_ids = to_device(list(stop_token_ids), dtype=torch.long, device=logits.device)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for row_idx, (p, gen, prev) in enumerate(zip(params, generators, previous_tokens)):
        row = logits[row_idx].float()
        row = apply_repetition_penalty(row, prev.to(logits.device), p.repetition_penalty)
        if stop_ids.numel() and prev.numel() < p.min_new_tokens:
            row = row.index_fill(0, stop_ids, float("-inf"))
        if p.is_greedy:
            out[row_idx] = torch.argmax(row)
            continue
        row = filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(dim=-1)
        out[row_idx] = torch.multinomial(probs, 1, generator=gen)[0]
    return out
