"""Sampling on logits: agreement with transformers' logits processors, and per-stream determinism."""

import pytest
import torch

from tilevox.models.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    filter_top_k_top_p,
    make_generator,
    sample_tokens,
)


@pytest.mark.oracle
@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 0.9, 0.7), (17, 1.0, 1.3), (5, 0.5, 1.0), (1, 0.3, 0.5)])
def test_filters_match_transformers(top_k, top_p, temperature):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(top_k)
    logits = torch.randn(3, 211) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    for row in range(3):
        got = filter_top_k_top_p(logits[row] / temperature, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(expected[row]))
        finite = ~torch.isinf(got)
        torch.testing.assert_close(got[finite], expected[row][finite])


@pytest.mark.oracle
def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 97)
    previous = torch.tensor([3, 3, 50, 96, 0])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(previous[None], logits.clone())[0]
    torch.testing.assert_close(apply_repetition_penalty(logits[0], previous, 1.3), expected)


def test_greedy_is_argmax_and_min_new_tokens_blocks_stop():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 1.0, 9.0]])
    params = [SamplingParams.greedy(), SamplingParams.greedy(min_new_tokens=2)]
    gens = [make_generator(0, "cpu"), make_generator(0, "cpu")]
    prev = [torch.zeros(0, dtype=torch.long), torch.tensor([1])]
    out = sample_tokens(logits, params, gens, prev, stop_token_ids=[2])
    assert out.tolist() == [1, 0]  # row 1 would pick the stop token 2 but has only 1 < 2 tokens


def test_sampling_depends_only_on_own_seed_and_logits():
    torch.manual_seed(1)
    logits = torch.randn(4, 500)
    params = [SamplingParams(temperature=1.0, top_k=0)] * 4
    prev = [torch.zeros(0, dtype=torch.long)] * 4

    def draw(rows, seeds, steps=20):
        gens = [make_generator(s, "cpu") for s in seeds]
        return torch.stack(
            [sample_tokens(logits[rows], [params[0]] * len(rows), gens, prev[: len(rows)]) for _ in range(steps)]
        )

    alone = draw([2], [7])
    batched = draw([0, 2, 3], [5, 7, 9])
    assert torch.equal(alone[:, 0], batched[:, 1])
    assert not torch.equal(batched[:, 0], batched[:, 2])  # different seeds and logits give different draws


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([10.0, 0.0, 0.0])
    out = filter_top_k_top_p(logits, 0, 0.01)
    assert torch.isfinite(out).sum() == 1 and torch.isfinite(out[0])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
