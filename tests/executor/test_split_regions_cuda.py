"""Regions run in pieces (executor.split) on the GPU: conventional pieces as CUDA graphs, megakernel pieces as
captured launches of the CUDA megakernel. The Llama decoder step cut after layer 1 (megakernel, then graph;
and graph, then megakernel) gives the conventional decode's logits within fp32 tolerance for three streams at
different positions over several steps, its graph replays equal the same pieces run eagerly bit for bit, and the
Qwen3-TTS talker step cut in half gives forward_tokens' hidden states and logits within bf16 tolerance, and the
NH-TTS decoder step (cross-attention in every layer) cut in half gives NhTtsNetwork.step's logits and caches within
fp32 tolerance, its replays equal to the same pieces run eagerly bit for bit. Needs an sm_90 GPU and libtilevox_kernels.so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import decoded_nh_caches, prefilled_llama_caches
from tilevox.engine_builder.regions import region_compiler
from tilevox.executor.graphs import GraphOptions
from tilevox.executor.megakernel import BackendOptions
from tilevox.executor.split import SplitDecoderStep, SplitNhDecoderStep, SplitPiece, SplitTalkerStep
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.nh_tts.loader import network_config
from tilevox.models.nh_tts.weights import random_network
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions

pytestmark = [pytest.mark.gpu, pytest.mark.requires_megakernel]

MK = BackendOptions(compiler=region_compiler())
# the same pieces run eagerly: no graphs, megakernel launches not captured (what each test's replays must equal)
EAGER_GRAPHS, EAGER_MK = GraphOptions(capture=False), dataclasses.replace(MK, cuda_graphs=False)


def _llama():
    """The tiny Llasa preset's Llama (fp32) re-drawn to O(1) activations, as the megakernel GPU tests do."""
    model = load_llasa("llama-tiny", device="cuda", dtype=torch.float32, max_streams=4, max_seq_len=256)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.llama.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(
                1.0 + 0.1 * noise if param.dim() == 1 else noise if "embed" in name else noise / param.shape[1] ** 0.5
            )
    return model.llama


@pytest.mark.parametrize("kinds", ["mg", "gm"])
def test_llama_step_in_pieces_equals_decode_and_replays_equal_first_calls(kinds):
    llama = _llama()
    n = len(llama.model.layers)
    pieces = [SplitPiece(0, 1, megakernel=kinds[0] == "m"), SplitPiece(1, n, megakernel=kinds[1] == "m")]
    ref_cache, split_cache, again_cache = prefilled_llama_caches(
        llama, 3, {3: 2, 0: 23, 2: 9}, torch.Generator().manual_seed(2)
    )
    split = SplitDecoderStep(llama, pieces, megakernel=MK)
    slots = [3, 0, 2]
    tokens = torch.tensor([5, 7, 11], device="cuda")
    steps = []
    for _ in range(4):
        want = llama.decode(ref_cache, slots, tokens)
        got = split(split_cache, slots, tokens)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        steps.append((tokens, got))
        tokens = want.argmax(-1)
    split.check()
    assert split.num_split_calls == 4 and split.num_conventional_calls == 0
    # the same pieces run eagerly against this one's replays: bit for bit
    fresh = SplitDecoderStep(llama, pieces, graphs=EAGER_GRAPHS, megakernel=EAGER_MK)
    for step_tokens, got in steps:
        assert torch.equal(fresh(again_cache, slots, step_tokens), got)
    torch.cuda.synchronize()


def test_talker_step_in_pieces_equals_forward_tokens_bf16():
    talker = load_qwen3(
        "qwen3-tts-tiny", device="cuda", dtype=torch.bfloat16, options=ModelOptions(max_streams=3, max_seq_len=256)
    ).talker
    n = talker.config.transformer.num_layers
    hidden_size = talker.config.transformer.hidden_size
    gen = torch.Generator().manual_seed(8)
    caches = [talker.new_cache(num_slots=5, max_len=64) for _ in range(2)]
    keys = torch.randn(caches[0].keys.shape, generator=gen).to("cuda", torch.bfloat16)
    values = torch.randn(caches[0].values.shape, generator=gen).to("cuda", torch.bfloat16)
    for cache in caches:
        cache.keys.copy_(keys)
        cache.values.copy_(values)
    split = SplitTalkerStep(
        talker, [SplitPiece(0, n // 2, megakernel=True), SplitPiece(n // 2, n, megakernel=False)], megakernel=MK
    )
    slots, starts = torch.tensor([2, 0, 4], device="cuda"), torch.tensor([17, 5, 9], device="cuda")
    inputs = torch.randn(3, 1, hidden_size, generator=gen).to("cuda", torch.bfloat16)

    def view(cache):
        return CacheView(cache=cache, slots=slots, start=starts, kv_len=18)

    with torch.no_grad():
        for _ in range(2):  # the first call eager, the second a replay
            got_hidden, got_logits = split(inputs, view(caches[0]))
        want_hidden, want_logits = talker.forward_tokens(inputs, view(caches[1]))
    split.check()
    torch.testing.assert_close(got_hidden.float(), want_hidden.float(), atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(got_logits.float(), want_logits.float(), atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("kinds", ["mg", "gm"])
def test_nh_tts_decoder_step_in_pieces_equals_step_and_replays_equal_first_calls(kinds):
    """random:nh-tts-tiny (fp32) on the GPU: rows 5, 0, 2 at positions 6, 1, 17 with text lengths 9, 1, 30, four
    steps: logits and self-attention caches within fp32 tolerance of NhTtsNetwork.step, lengths advanced alike;
    the same pieces run eagerly (no graphs, launches not captured) equal the replays bit for bit."""
    network = random_network(network_config("nh-tts-tiny"), seed=1, device="cuda", dtype=torch.float32)
    config = network.config
    n = config.decoder.num_hidden_layers
    channels, vocab = config.decoder.num_channels, config.decoder.vocab_size
    rows, positions, texts = [5, 0, 2], [6, 1, 17], [9, 1, 30]
    gen = torch.Generator().manual_seed(5)
    ref_cache, split_cache, again_cache = decoded_nh_caches(
        network, 3, rows, positions, texts, gen, max_seq_len=64, max_text_len=32
    )
    pieces = [SplitPiece(0, n // 2, megakernel=kinds[0] == "m"), SplitPiece(n // 2, n, megakernel=kinds[1] == "m")]
    split = SplitNhDecoderStep(network, pieces, megakernel=MK)
    steps = []
    for _ in range(4):
        codes = torch.randint(0, vocab, (3, 1, channels), generator=gen).cuda()
        with torch.no_grad():
            want = network.step(ref_cache, rows, codes)
        got = split(split_cache, rows, codes)
        assert got.shape == want.shape == (3, channels, vocab)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        assert split_cache.lengths == ref_cache.lengths
        steps.append((codes, got))
    split.check()
    torch.testing.assert_close(split_cache.self_k, ref_cache.self_k, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(split_cache.self_v, ref_cache.self_v, atol=1e-3, rtol=1e-3)
    assert split.num_split_calls == 4 and split.num_conventional_calls == 0
    fresh = SplitNhDecoderStep(network, pieces, graphs=EAGER_GRAPHS, megakernel=EAGER_MK)
    for codes, got in steps:
        assert torch.equal(fresh(again_cache, rows, codes), got)
    torch.cuda.synchronize()
