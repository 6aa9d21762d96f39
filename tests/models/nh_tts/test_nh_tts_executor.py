"""NH-TTS through the executor's regions on CPU (eager: the reference its CUDA graphs must equal), on tiny
seeded checkpoints in the Hugging Face layout whose streams end by themselves (EOS) and by length, with an
audio prompt: the batched on-device pick (nh_sampling) gives greedy streams exactly the plain path's codes;
its filtered probabilities are the plain rule's; sampled streams draw the same alone and in a batch; the
text encoder graph (nh_encoder) pads rows and positions without changing the real rows."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from tests.models.nh_tts.nh_reference import make_reference
from tilevox.executor import GraphOptions, install_graph_regions
from tilevox.executor.graphs import LOGGER_NAME, GraphedNhSampling
from tilevox.executor.sampling import nh_pick_codes, nh_pick_scores
from tilevox.models.nh_tts.generation import pick_codes, pick_scores
from tilevox.models.nh_tts.loader import load_checkpoint
from tilevox.models.region_backends import NH_SAMPLING, NhPickRows
from tilevox.models.sampling import SamplingParams, make_generator
from tilevox.models.streaming import FinishReason, SynthesisRequest, VoicePrompt

pytestmark = pytest.mark.oracle  # the checkpoints are written by transformers

EAGER = GraphOptions(capture=False)
TEXTS = ("[S1] Hello there, friend.", "[S1] A much longer line of text, [S2] with a second speaker in it.", "[S2] Hm.")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Shape "a" (Dia's delay pattern), guidance 3: channel 0's EOS row resembles code 22, so streams end."""
    root = tmp_path_factory.mktemp("nh_exec")
    make_reference(root, "a", seed=3, eos_like=22)
    (root / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "guidance_scale": 3.0, "top_k": 45, "temperature": 1.2, "top_p": 0.95})
    )
    return root


def _model(checkpoint, install: bool, max_streams: int = 4, options: GraphOptions = EAGER):
    model = load_checkpoint(checkpoint, device="cpu", dtype=torch.float32, max_streams=max_streams)
    if install:
        assert set(install_graph_regions(model, options=options).values()) == {None}
    return model


def _run(model, requests, join_at: int = 0):
    """Open requests[:-1] together (all of them when join_at is 0), the last one before step join_at, and
    step every open stream to its end: per request (codes (L, C), audio, finish reason)."""
    codes: dict[int, list[torch.Tensor]] = {}
    model.code_observer = lambda sid, pos, c: codes.setdefault(sid, []).append(c.clone())
    ids = list(model.open_streams(requests[:-1] if join_at else requests))
    assert all(isinstance(i, int) for i in ids), ids
    reasons: dict[int, FinishReason] = {}
    audio: dict[int, list[np.ndarray]] = {}
    steps = 0
    while len(reasons) < len(requests):
        steps += 1
        if steps == join_at:
            ids.append(model.open_stream(requests[-1]))
        for chunk in model.step([i for i in ids if i in model.open_stream_ids]):
            audio.setdefault(chunk.stream_id, []).append(chunk.samples)
            if chunk.is_finished:
                reasons[chunk.stream_id] = chunk.finish_reason
    return [(torch.stack(codes[i]), np.concatenate(audio[i]), reasons[i]) for i in ids]


def _prompted(text: str, sampling: SamplingParams, seed: int = 0) -> SynthesisRequest:
    rng = np.random.default_rng(seed)
    samples = (0.3 * rng.standard_normal(4 * 512 + 77)).astype(np.float32)  # 5 frames once padded
    prompt = VoicePrompt(samples=samples, sample_rate_hz=44100, transcript="[S1] The prompt's words.")
    return SynthesisRequest(text=text, voice_prompt=prompt, sampling=sampling, seed=seed, max_duration_s=1.0)


def test_greedy_streams_through_the_executor_equal_the_plain_path(checkpoint):
    """Four streams of different texts and rules (guidance top-k 5 and none, repetition penalties above and
    below 1, min_new_tokens, an audio prompt whose delayed entries are forced): the executor's regions (all
    four, eagerly) give exactly the plain path's codes at every position, its finish reasons (EOS and length,
    the streams ending at different steps) and its audio."""
    requests = [
        SynthesisRequest(text=TEXTS[0], sampling=SamplingParams(temperature=0.0, top_k=5), max_duration_s=1.0),
        SynthesisRequest(
            text=TEXTS[1],
            sampling=SamplingParams(temperature=0.0, top_k=0, repetition_penalty=1.3, min_new_tokens=12),
            max_duration_s=1.0,
        ),
        SynthesisRequest(text=TEXTS[2], sampling=SamplingParams(temperature=0.0, top_k=5), max_duration_s=0.1),
        _prompted("[S1] And what comes next.", SamplingParams(temperature=0.0, top_k=7, repetition_penalty=0.8)),
    ]
    plain = _run(_model(checkpoint, False), requests)
    model = _model(checkpoint, True)
    got = _run(model, requests)
    reasons = [r for _, _, r in plain]
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons, reasons
    assert len({c.shape[0] for c, _, _ in plain}) >= 3  # they end at different steps
    for (codes, audio, reason), (want_codes, want_audio, want_reason) in zip(got, plain, strict=True):
        assert reason is want_reason and torch.equal(codes, want_codes)
        np.testing.assert_allclose(audio, want_audio, atol=1e-5, rtol=0)
    sampling = model.nh_sampling_backend
    assert sampling.num_conventional_calls == 0 and sampling.num_graph_calls == max(c.shape[0] for c, _, _ in got)
    assert {bucket for bucket, _ in sampling.keys_used} >= {4, 2, 1}  # 4 streams, then fewer
    assert any(width > 0 for _, width in sampling.keys_used)  # the penalised rows read their history
    assert model.nh_encoder_backend.num_graph_calls == 1  # all four streams' texts in one call
    (encoder_key,) = model.nh_encoder_backend.keys_used
    assert encoder_key == (8, 64)  # 4 streams x 2 guidance rows, texts of 10 to 61 bytes


def test_sampled_streams_draw_the_same_alone_and_in_a_batch(checkpoint):
    """The device draw (stream seed, position x channels + channel): a sampled stream's codes, EOS included,
    are bitwise the same alone and beside a greedy and another sampled stream, joining mid-way."""
    sampled = SamplingParams(temperature=1.2, top_k=45, top_p=0.95, repetition_penalty=1.1)
    mine = SynthesisRequest(text=TEXTS[0], sampling=sampled, seed=7, max_duration_s=1.0)
    others = [
        SynthesisRequest(text=TEXTS[1], sampling=SamplingParams(temperature=0.9, top_p=0.8), seed=8),
        SynthesisRequest(text=TEXTS[2], sampling=SamplingParams.greedy(), seed=9, max_duration_s=0.5),
    ]
    ((alone, _, alone_reason),) = _run(_model(checkpoint, True), [mine])
    together = _run(_model(checkpoint, True), [*others, mine], join_at=4)
    codes, _, reason = together[-1]
    assert alone.shape[0] > 10 and reason is alone_reason and torch.equal(codes, alone)
    assert not torch.equal(together[0][0][: alone.shape[0]], alone)


def _rows(
    config, batch_params, positions, *, slots, eos_positions, eos_limits, prompt_lens, forced_lens, scale, seeds=None
):
    seeds = range(100, 100 + len(batch_params)) if seeds is None else seeds
    return NhPickRows(
        params=tuple(batch_params),
        generators=tuple(make_generator(seed, "cpu") for seed in seeds),
        seeds=tuple(seeds),
        slots=tuple(slots),
        positions=tuple(positions),
        prompt_lens=tuple(prompt_lens),
        forced_lens=tuple(forced_lens),
        eos_limits=tuple(eos_limits),
        eos_positions=tuple(eos_positions),
        guidance_scale=scale,
    )


@pytest.mark.parametrize("guidance_rows", [2, 1])
def test_the_device_pick_filters_as_the_plain_rule(checkpoint, guidance_rows):
    """Per row, before the draw: the device pick's probabilities equal the plain rule's (guidance and its
    top-k, repetition penalty over the history, min_new_tokens, temperature, the EOS channel filter, top-k /
    top-p, EOS forced by the delay rule), channel 0's best ids are the same, greedy rows get the plain codes,
    ended channels PAD and forced prompt entries their prompt's codes."""
    model = _model(checkpoint, False)
    config = model.config
    channels, vocab, eos, pad = config.num_channels, config.decoder.vocab_size, config.eos_token_id, config.pad_token_id
    generator = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(temperature=1.2, top_k=45, top_p=0.95, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=0, top_p=0.8, min_new_tokens=50),
        SamplingParams(temperature=1.0, top_k=3, repetition_penalty=0.7),
        SamplingParams(temperature=0.0, top_k=0, repetition_penalty=1.5),
    ]
    batch = len(params)
    pending = 4.0 * torch.randn(batch, guidance_rows, channels, vocab, generator=generator)
    pending[1, 0, 0, eos] = 40.0  # row 1's channel 0 prefers EOS: it ends here
    positions, slots = [30, 30, 30, 26, 29], [0, 5, 3, 2, 1]
    sequences = torch.full((6, 64, channels), pad, dtype=torch.long)  # as the model keeps them: the positions
    for slot, position in zip(slots, positions):  # picked so far, PAD (or a forced prompt entry) after them
        sequences[slot, :position] = torch.randint(0, 1024, (position, channels), generator=generator)
    sequences[3, 30, 4:] = torch.tensor([11, 12, 13, 14, 15])  # row 2 (slot 3): forced prompt entries here
    sequences[0, 31:40] = 17  # row 0: entries past its position that its pick never reads
    sequences[1, 29, 1] = 18  # row 4: an entry at its position, past its forced prompt (forced_lens 16)
    rows = _rows(
        config,
        params,
        positions=positions,
        slots=slots,
        eos_positions=[-1, -1, -1, 17, 20],  # rows 3, 4: channels with delay 9 and 8 forced / ended
        eos_limits=[99, 99, 99, 99, 29],
        prompt_lens=[1, 1, 1, 1, 1],
        forced_lens=[16, 16, 31, 16, 16],
        scale=3.0,
    )
    backend = GraphedNhSampling(model.network, EAGER)
    floats, ints = backend.row_values(rows)
    guidance, candidates, nucleus = backend.plan(rows)
    kwargs = dict(eos=eos, scale=3.0, guidance_candidates=guidance, candidates=candidates, nucleus=nucleus)
    delays = torch.tensor(config.delay_pattern)
    scores, top0 = nh_pick_scores(pending.clone(), sequences, floats, ints, delays, history=64, **kwargs)
    want, want_top0, ended = pick_scores(config, pending.clone(), sequences, rows)
    assert top0.tolist() == want_top0 and want_top0[1] == eos
    torch.testing.assert_close(scores.softmax(-1), want.softmax(-1), atol=1e-6, rtol=0)
    assert torch.equal(scores.isinf(), want.isinf())  # the same candidates
    assert ended[3].any() and ended[4].any() and not ended[:3].any()
    codes, _ = nh_pick_codes(pending.clone(), sequences, floats, ints, delays, history=64, pad=pad, **kwargs)
    plain, _ = pick_codes(config, pending.clone(), sequences, rows)
    for b in (0, 4):  # greedy
        assert torch.equal(codes[b], plain[b])
    assert torch.equal(codes[ended], plain[ended]) and (codes[ended] == pad).all()
    assert codes[2, 4:].tolist() == [11, 12, 13, 14, 15] == plain[2, 4:].tolist()
    assert codes[1, 0] == eos and plain[1, 0] == eos


def test_the_device_draw_follows_the_filtered_probabilities(checkpoint):
    """One stream's position drawn under 4,000 seeds (16 calls of 250 rows): each channel's code frequencies
    match its filtered probabilities, and no code outside them is drawn."""
    model = _model(checkpoint, False)
    config = model.config
    channels, vocab = config.num_channels, config.decoder.vocab_size
    pending = 2.0 * torch.randn(1, 2, channels, vocab, generator=torch.Generator().manual_seed(1))
    sequences = torch.full((1, 64, channels), config.pad_token_id, dtype=torch.long)
    params = SamplingParams(temperature=1.5, top_k=6, top_p=0.97)

    def rows_of(seeds: range) -> NhPickRows:
        n = len(seeds)
        return _rows(
            config,
            [params] * n,
            positions=[40] * n,
            slots=[0] * n,
            eos_positions=[-1] * n,
            eos_limits=[999] * n,
            prompt_lens=[1] * n,
            forced_lens=[16] * n,
            scale=3.0,
            seeds=seeds,
        )

    backend = GraphedNhSampling(model.network, EAGER)
    rows = 250
    codes = torch.cat(
        [backend(pending.expand(rows, -1, -1, -1), sequences, rows_of(range(first, first + rows)))[0]
         for first in range(0, 4000, rows)]
    )  # fmt: skip
    assert backend.num_graph_calls == 16 and backend.num_conventional_calls == 0
    probs = pick_scores(config, pending.clone(), sequences, rows_of(range(1)))[0][0].softmax(-1)
    for c in range(channels):
        freq = torch.bincount(codes[:, c], minlength=vocab).double() / codes.shape[0]
        assert (freq[probs[c] == 0] == 0).all()
        assert (freq - probs[c].double()).abs().max() < 0.035


def test_calls_the_pick_cannot_take_run_the_plain_path_and_say_why(checkpoint, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    requests = [
        SynthesisRequest(text=t, sampling=SamplingParams(temperature=0.0, top_k=5), max_duration_s=0.3) for t in TEXTS
    ]
    plain = _run(_model(checkpoint, False), requests)
    model = _model(checkpoint, True, options=GraphOptions(capture=False, max_batch=2))
    got = _run(model, requests)
    for (codes, _, _), (want, _, _) in zip(got, plain, strict=True):
        assert torch.equal(codes, want)
    messages = [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER_NAME and r.getMessage().startswith(f"{NH_SAMPLING}: conventional path")
    ]
    assert messages == ["nh_sampling: conventional path for this call: batch 3 above max_batch 2"]
    assert model.nh_sampling_backend.num_conventional_calls > 0 and model.nh_sampling_backend.num_graph_calls > 0
