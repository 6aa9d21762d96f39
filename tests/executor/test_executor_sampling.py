"""executor.sampling.sample_rows: the batched, capturable draw equals the float64 row-by-row reference
for every parameter mix, never depends on the other rows of the batch, and honours each filter; the
batched penalties in front of it (sample_next_tokens) equal models.sampling's per-row code."""

from __future__ import annotations

import torch

from tilevox.executor.sampling import (
    MIN_CANDIDATES,
    filter_plan,
    penalize_rows,
    sample_next_tokens,
    sample_rows,
    sample_rows_reference,
)
from tilevox.models.sampling import apply_repetition_penalty


def _params(rows: int, vocab: int, gen: torch.Generator):
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 0.5, 1.0] * rows, dtype=torch.float32)[:rows]
    top_k = torch.tensor([0, 0, 5, vocab + 3, 1, 40, 0] * rows, dtype=torch.int64)[:rows]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 0.3, 0.95] * rows, dtype=torch.float32)[:rows]
    seed = torch.randint(0, 2**62, (rows,), generator=gen, dtype=torch.int64)
    counter = torch.randint(0, 2**31, (rows,), generator=gen, dtype=torch.int64)
    return temperature, top_k, top_p, seed, counter


def test_batched_draw_equals_the_float64_reference():
    gen = torch.Generator().manual_seed(11)
    mismatches = 0
    for trial in range(6):
        rows, vocab = 7 + trial * 5, 333 + 97 * trial
        logits = 3.0 * torch.randn(rows, vocab, generator=gen)
        params = _params(rows, vocab, gen)
        got = sample_rows(logits, *params)
        want = sample_rows_reference(logits.double(), *params)
        mismatches += int((got != want).sum())
    # float32 vs float64 CDFs could split at a bin edge; with these inputs no draw lands on one.
    assert mismatches == 0


def test_a_row_draws_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 500, generator=gen)
    params = _params(9, 500, gen)
    together = sample_rows(logits, *params)
    for row in range(9):
        alone = sample_rows(logits[row : row + 1], *(p[row : row + 1] for p in params))
        assert int(alone[0]) == int(together[row])
    order = torch.randperm(9, generator=gen)
    assert torch.equal(sample_rows(logits[order], *(p[order] for p in params)), together[order])


def test_filter_plan_shortcuts_draw_exactly_the_full_filters():
    """A top-k of filter_plan's width and no nucleus sort when no row needs it give the very draw of the
    whole-vocabulary sorts, also with many exact ties at the k-th value (bf16-rounded logits)."""
    gen = torch.Generator().manual_seed(19)
    vocab = 5000
    assert filter_plan([0, 0], [1.0, 1.0], vocab) == (0, False)
    assert filter_plan([50, 0, 3], [1.0, 0.9, 1.0], vocab) == (MIN_CANDIDATES, True)
    assert filter_plan([65, 50], [1.0, 1.0], vocab) == (128, False)
    assert filter_plan([4999], [1.0], vocab) == (None, False)  # a width reaching the vocabulary: sort it all
    assert filter_plan([vocab + 3, 7], [1.0], vocab) == (MIN_CANDIDATES, False)  # top_k >= vocab is off
    drawn = 0
    for top_ks, top_ps in (
        ([50, 40, 1, 64], [1.0] * 4),
        ([50, 0, 120, 3], [1.0, 0.9, 0.5, 1.0]),
        ([0, 0, 0, 0], [1.0] * 4),
        ([0, 0, 0, 0], [0.7, 1.0, 0.2, 0.99]),
        ([2500, 10, 0, 4999], [1.0, 1.0, 0.8, 1.0]),
    ):
        rows = len(top_ks) * 50
        logits = (2.0 * torch.randn(rows, vocab, generator=gen)).bfloat16().float()  # ties are common
        temperature = torch.full((rows,), 0.9)
        top_k = torch.tensor(top_ks * 50)
        top_p = torch.tensor(top_ps * 50)
        seed = torch.randint(0, 2**62, (rows,), generator=gen)
        counter = torch.arange(rows)
        candidates, nucleus = filter_plan(top_k.tolist(), top_p.tolist(), vocab)
        full = sample_rows(logits, temperature, top_k, top_p, seed, counter)
        planned = sample_rows(logits, temperature, top_k, top_p, seed, counter, candidates=candidates, nucleus=nucleus)
        assert torch.equal(planned, full), (top_ks, top_ps, candidates, nucleus)
        drawn += len(set(full.tolist()))
    assert drawn > 100  # the draws are spread, not one token


def test_filters_and_counter():
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 400, 64
    logits = torch.randn(1, vocab, generator=gen).expand(rows, vocab).contiguous()
    ones = torch.ones(rows)
    seed = torch.full((rows,), 123, dtype=torch.int64)
    counter = torch.arange(rows, dtype=torch.int64)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    drawn = sample_rows(logits, ones, torch.full((rows,), 3), ones, seed, counter)
    assert set(drawn.tolist()) == top3  # only the top 3 ever, and all of them over 400 counters
    greedy = sample_rows(logits, torch.zeros(rows), torch.zeros(rows, dtype=torch.int64), ones, seed, counter)
    assert set(greedy.tolist()) == {int(torch.argmax(logits[0]))}
    tiny_p = sample_rows(logits, ones, torch.zeros(rows, dtype=torch.int64), torch.full((rows,), 1e-6), seed, counter)
    assert set(tiny_p.tolist()) == {int(torch.argmax(logits[0]))}  # the nucleus keeps at least the top token
    same_counter = sample_rows(
        logits, ones, torch.zeros(rows, dtype=torch.int64), ones, seed, torch.zeros_like(counter)
    )
    assert len(set(same_counter.tolist())) == 1  # the draw is a function of (seed, counter) only


def _penalty_batch(gen: torch.Generator, rows: int, vocab: int):
    lengths = torch.tensor([0, 1, 7, 30, 5, 12, 3, 19][:rows], dtype=torch.int64)
    history = torch.randint(0, vocab, (rows, 32), generator=gen)
    history[:, 1::3] = history[:, ::3][:, : history[:, 1::3].shape[1]]  # repeated tokens
    penalty = torch.tensor([1.3, 1.0, 0.7, 1.05, 2.0, 1.3, 1.0, 1.5][:rows], dtype=torch.float32)
    min_new = torch.tensor([2, 0, 9, 0, 5, 0, 4, 0][:rows], dtype=torch.int64)
    return lengths, history, penalty, min_new


def test_penalties_equal_models_sampling_row_by_row():
    """The batched repetition penalty and min_new_tokens hold-back give exactly the values of
    models.sampling's per-row code (same float32 operations), padding past each row's length ignored."""
    gen = torch.Generator().manual_seed(21)
    rows, vocab = 8, 777
    logits = 4.0 * torch.randn(rows, vocab, generator=gen)
    lengths, history, penalty, min_new = _penalty_batch(gen, rows, vocab)
    stop_ids = torch.tensor([5, 776], dtype=torch.int64)
    got = penalize_rows(logits, penalty, history, lengths, min_new, stop_ids)
    for b in range(rows):
        want = apply_repetition_penalty(logits[b], history[b, : lengths[b]], float(penalty[b]))
        if lengths[b] < min_new[b]:
            want = want.index_fill(0, stop_ids, float("-inf"))
        assert torch.equal(got[b], want), f"row {b}"
    assert torch.equal(penalize_rows(logits, penalty, history[:, :0], lengths, min_new, stop_ids[:0]), logits)


def test_next_tokens_equal_the_float64_reference_after_penalties():
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 8, 401
    logits = 3.0 * torch.randn(rows, vocab, generator=gen)
    lengths, history, penalty, min_new = _penalty_batch(gen, rows, vocab)
    temperature, top_k, top_p, seed, counter = _params(rows, vocab, gen)
    stop_ids = torch.tensor([int(torch.argmax(logits[2]))], dtype=torch.int64)  # row 2 must not draw its argmax
    floats = torch.stack([temperature, top_p, penalty], dim=1)
    ints = torch.stack([top_k, seed, counter, min_new, lengths], dim=1)
    got = sample_next_tokens(logits, floats, ints, history, stop_ids)
    penalised = penalize_rows(logits, penalty, history, lengths, min_new, stop_ids)
    want = sample_rows_reference(penalised.double(), temperature, top_k, top_p, seed, counter)
    assert torch.equal(got, want)
    assert int(got[2]) != int(stop_ids[0])
