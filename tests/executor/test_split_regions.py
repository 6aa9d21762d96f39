"""Regions run in pieces cut at layer boundaries (executor.split) on CPU, the megakernel pieces through the VM:
every split of the Llama decoder step, the Qwen3-TTS talker step and the NH-TTS decoder step (conventional and
megakernel pieces in any order, two to four pieces) gives the conventional call's logits, hidden states and cache
writes (fp32)
for a padded batch of streams at different positions; a whole utterance through a split gives the same
tokens and audio; a call a split cannot take runs whole on the conventional path and says why; pieces that
do not cover the region are refused."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from tests.conftest import decoded_nh_caches, prefilled_llama_caches
from tilevox.engine_builder.regions import region_compiler
from tilevox.executor.megakernel import BackendOptions, Executor
from tilevox.executor.split import SplitDecoderStep, SplitPiece, SplitTalkerStep, make_split_backend
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import CODE_PREDICTOR_LOOP, DECODER_STEP, TALKER_STEP, set_region_backend
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize

VM = BackendOptions(compiler=region_compiler(), executor=Executor.VM)
ATOL = 2e-5


def _llasa():
    return load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=4, max_seq_len=256)


def _qwen3():
    return load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=3, max_seq_len=64))


def _pieces(edges: list[int], kinds: str) -> list[SplitPiece]:
    """Pieces between consecutive `edges`, kind per piece: m (megakernel) or g (graph)."""
    return [SplitPiece(a, b, megakernel=k == "m") for a, b, k in zip(edges[:-1], edges[1:], kinds, strict=True)]


def _llama_splits(n: int) -> list[list[SplitPiece]]:
    half, third = n // 2, max(1, n // 3)
    return [
        _pieces([0, half, n], "mg"),
        _pieces([0, half, n], "gm"),
        _pieces([0, 1, n], "mm"),
        _pieces([0, third, n - 1, n], "gmg"),
        _pieces([0, 1, half, n - 1, n], "mgmm"),
    ]


@pytest.mark.parametrize("split", range(5))
def test_llama_decoder_step_in_pieces_equals_decode(split):
    """Slots 3, 0, 2 at positions 2, 23, 9 (a bucket of 4, row 0 repeated), three steps: logits, keys and
    values of decode, lengths advanced once per real row, slot 1 untouched."""
    llama = random_llama(
        dataclasses.replace(LlamaConfig.preset("tiny"), num_hidden_layers=5),
        seed=split,
        device="cpu",
        dtype=torch.float32,
    )
    n = len(llama.model.layers)
    pieces = _llama_splits(n)[split]
    gen = torch.Generator().manual_seed(split)
    got_cache, ref_cache = prefilled_llama_caches(llama, 2, {3: 2, 0: 23, 2: 9, 1: 14}, gen)
    untouched = got_cache.k[:, 1].clone()
    backend = SplitDecoderStep(llama, pieces, megakernel=VM)
    slots = [3, 0, 2]
    tokens = torch.randint(0, llama.config.vocab_size, (3,), generator=gen)
    for _ in range(3):
        want = llama.decode(ref_cache, slots, tokens)
        got = backend(got_cache, slots, tokens)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
        assert got_cache.lengths == ref_cache.lengths
        tokens = want.argmax(-1)
    torch.testing.assert_close(got_cache.k, ref_cache.k, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got_cache.v, ref_cache.v, atol=ATOL, rtol=1e-5)
    assert torch.equal(got_cache.k[:, 1], untouched)
    assert backend.num_split_calls == 3 and backend.num_conventional_calls == 0
    # the megakernel pieces were compiled as pieces: each region program covers its layers only
    for piece, runner in zip(backend.pieces, backend._runners, strict=True):
        assert (runner is not None) == piece.megakernel
        if runner is not None:
            (compiled,) = runner._compiled.values()
            region = compiled.region.program.metadata["region"]
            assert (region["first_layer"], region["stop_layer"]) == (piece.first, piece.stop)


@pytest.mark.parametrize("kinds", ["mg", "gm", "mm", "gg"])
def test_talker_step_in_pieces_equals_forward_tokens(kinds):
    talker = _qwen3().talker
    n = talker.config.transformer.num_layers
    assert n >= 2
    hidden_size = talker.config.transformer.hidden_size
    gen = torch.Generator().manual_seed(8)
    caches = [talker.new_cache(num_slots=5, max_len=64) for _ in range(2)]
    keys, values = torch.randn(caches[0].keys.shape, generator=gen), torch.randn(caches[0].values.shape, generator=gen)
    for cache in caches:
        cache.keys.copy_(keys)
        cache.values.copy_(values)
    backend = SplitTalkerStep(talker, _pieces([0, n // 2, n], kinds), megakernel=VM)
    slots, starts = torch.tensor([2, 0, 4]), torch.tensor([17, 5, 9])
    inputs = torch.randn(3, 1, hidden_size, generator=gen)

    def view(cache):
        return CacheView(cache=cache, slots=slots, start=starts, kv_len=18)

    with torch.no_grad():
        got_hidden, got_logits = backend(inputs, view(caches[0]))
        want_hidden, want_logits = talker.forward_tokens(inputs, view(caches[1]))
    torch.testing.assert_close(got_hidden, want_hidden, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(caches[0].keys, caches[1].keys, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(caches[0].values, caches[1].values, atol=ATOL, rtol=1e-5)
    assert not torch.equal(caches[0].keys, keys)  # the step wrote its keys (through whichever piece)
    assert backend.num_split_calls == 1


def test_qwen3_utterance_with_a_split_talker_equals_the_conventional_one():
    """Greedy: same frames and audio with the talker cut in two (megakernel, then graph)."""
    request = SynthesisRequest(text="Good morning", sampling=SamplingParams.greedy(), max_duration_s=0.5, seed=3)
    frames: dict[str, list[torch.Tensor]] = {"ref": [], "split": []}
    model = _qwen3()
    model.frame_observer = lambda _sid, codes: frames["ref"].append(codes)
    ref = synthesize(model, request)
    n = model.talker.config.transformer.num_layers
    backend = make_split_backend(model, TALKER_STEP, _pieces([0, n // 2, n], "mg"), megakernel=VM)
    set_region_backend(model, TALKER_STEP, backend)
    model.frame_observer = lambda _sid, codes: frames["split"].append(codes)
    got = synthesize(model, request)
    assert len(frames["ref"]) >= 5
    assert torch.equal(torch.stack(frames["split"]), torch.stack(frames["ref"]))
    np.testing.assert_allclose(got.samples, ref.samples, atol=1e-5)
    assert backend.num_split_calls == ref.num_frames


def test_llasa_utterance_with_a_split_decoder_equals_the_conventional_one():
    request = SynthesisRequest(
        text="Hello there, how are you", sampling=SamplingParams.greedy(), max_duration_s=0.4, seed=3
    )
    tokens: dict[str, list[int]] = {"ref": [], "split": []}
    model = _llasa()
    model.token_observer = lambda _sid, tok: tokens["ref"].append(tok)
    ref = synthesize(model, request)
    n = len(model.llama.model.layers)
    backend = make_split_backend(model, DECODER_STEP, _pieces([0, 1, n], "gm"), megakernel=VM)
    set_region_backend(model, DECODER_STEP, backend)
    model.token_observer = lambda _sid, tok: tokens["split"].append(tok)
    got = synthesize(model, request)
    assert len(tokens["ref"]) >= 10 and tokens["split"] == tokens["ref"]
    np.testing.assert_allclose(got.samples, ref.samples, atol=1e-5)
    assert backend.num_split_calls == ref.num_frames - 1 and backend.num_conventional_calls == 0


@pytest.mark.parametrize("kinds", ["mg", "gm", "mm"])
def test_nh_tts_decoder_step_in_pieces_equals_step(kinds):
    """NH-TTS (cross-attention in every layer): rows 4, 1, 2 at positions 3, 9, 1 with text lengths 5, 24, 11 (a
    bucket of 4), three steps: NhTtsNetwork.step's logits and self-attention caches, lengths advanced per real
    row, row 6 untouched."""
    from tilevox.executor.split import SplitNhDecoderStep
    from tilevox.models.nh_tts.loader import load_preset as load_nh_tts

    network = load_nh_tts("nh-tts-tiny", device="cpu", dtype=torch.float32, max_streams=3).network
    config = network.config
    n = config.decoder.num_hidden_layers
    assert n >= 2
    channels, vocab = config.decoder.num_channels, config.decoder.vocab_size
    rows, positions, texts = [4, 1, 2, 6], [3, 9, 1, 7], [5, 24, 11, 8]
    gen = torch.Generator().manual_seed(3)
    caches = decoded_nh_caches(network, 2, rows, positions, texts, gen)
    untouched = caches[0].self_k[:, 6].clone()
    split = SplitNhDecoderStep(network, _pieces([0, n // 2, n], kinds), megakernel=VM)
    for _ in range(3):
        codes = torch.randint(0, vocab, (3, 1, channels), generator=gen)
        got = split(caches[0], rows[:3], codes)
        want = network.step(caches[1], rows[:3], codes)
        assert got.shape == want.shape == (3, channels, vocab)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
        assert caches[0].lengths == caches[1].lengths
    torch.testing.assert_close(caches[0].self_k, caches[1].self_k, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(caches[0].self_v, caches[1].self_v, atol=ATOL, rtol=1e-5)
    assert torch.equal(caches[0].self_k[:, 6], untouched)
    assert split.num_split_calls == 3 and split.num_conventional_calls == 0


def test_a_call_a_split_cannot_take_runs_whole_and_says_why(caplog):
    model = _llasa()
    llama = model.llama
    n = len(llama.model.layers)
    limited = BackendOptions(compiler=region_compiler(), executor=Executor.VM, max_batch=1)
    backend = SplitDecoderStep(llama, _pieces([0, 1, n], "mg"), megakernel=limited)
    caches = [llama.new_cache(max_streams=4, max_seq_len=256) for _ in range(2)]
    for cache in caches:
        for slot in range(2):
            cache.allocate()
            llama.prefill(cache, slot, torch.tensor([1, 2, 3]))
    tokens = torch.tensor([5, 6])
    with caplog.at_level(logging.WARNING, logger="tilevox.executor"):
        got = backend(caches[0], [0, 1], tokens)
        backend(caches[0], [0, 1], tokens)
    torch.testing.assert_close(got, llama.decode(caches[1], [0, 1], tokens), atol=ATOL, rtol=1e-5)
    assert backend.num_conventional_calls == 2 and backend.num_split_calls == 0
    messages = [r.getMessage() for r in caplog.records if "split region" in r.getMessage()]
    assert len(messages) == 1 and "max_batch 1" in messages[0]  # logged once per reason


def test_pieces_must_cover_the_region_in_order():
    llama = _llasa().llama
    n = len(llama.model.layers)
    for bad in (
        _pieces([0, 1], "g") if n > 1 else None,  # stops short of the last layer
        [SplitPiece(1, n, megakernel=False)],  # starts after layer 0
        [SplitPiece(0, 1, megakernel=False), SplitPiece(0, n, megakernel=True)],  # overlaps
    ):
        if bad is None:
            continue
        with pytest.raises(ValueError, match="cover|gap"):
            SplitDecoderStep(llama, bad, megakernel=VM)
    with pytest.raises(ValueError, match="first < stop"):
        SplitPiece(2, 2, megakernel=True)
    with pytest.raises(ValueError, match="does not run in pieces"):
        make_split_backend(_qwen3(), CODE_PREDICTOR_LOOP, [SplitPiece(0, 1, megakernel=True)], megakernel=VM)
