"""Region compiler + megakernel VM against models.nh_tts (random:nh-tts-tiny, fp32 on CPU): the decoder step
region `nh_decoder_step` (self-attention, CROSS_ATTN over each row's encoder keys/values read in place from
NhDecoderCache, MLP, the all-channel head) gives NhTtsNetwork.step's logits and cache for rows at different
positions and text lengths under any legal interleaving; through install_megakernel_regions whole greedy
streams give the conventional path's codes; a prompt prefill runs conventionally and says why; networks
without cross-attention refuse a cross cache."""

from __future__ import annotations

import logging

import pytest
import torch

from tilevox.engine_builder.regions import TilingConfig, compile_region, region_compiler
from tilevox.engine_builder.regions.spec import region_spec
from tilevox.executor.megakernel import (
    LOGGER_NAME,
    BackendOptions,
    Executor,
    MegakernelNhDecoderStep,
    install_megakernel_regions,
)
from tilevox.executor.megakernel_inputs import nh_decoder_inputs
from tilevox.models.decoder_view import ModelFamily
from tilevox.models.nh_tts.loader import load_preset
from tilevox.models.region_backends import NH_DECODER_STEP
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest
from tilevox.trt_plugins.megakernel import BufferKind, Opcode, SchedulePolicy, run_program
from tilevox.trt_plugins.megakernel.validate import check_program

ATOL = 2e-5
MAX_ROWS, MAX_SEQ, MAX_TEXT = 8, 40, 24
TILING = TilingConfig(
    matvec_rows=20, lm_head_rows=100, heads_per_qkv_tile=3, partition_tokens=7, cross_attn_rows=2, attn_rows=2
)
COMPILER = region_compiler()
VM = BackendOptions(compiler=COMPILER, executor=Executor.VM)
# (cache rows, positions already decoded, text lengths): scattered rows, a row at position 0, text lengths
# from 1 to the whole cross cache, a batch that the cross-attention row tiles do not divide.
CASES = [
    ([3], [0], [7]),
    ([4, 1, 2], [3, 9, 1], [5, 24, 11]),
    ([7, 0, 5, 2, 6], [12, 0, 30, 5, 1], [1, 24, 9, 17, 2]),
]


@pytest.fixture(scope="module")
def tiny():
    return load_preset("nh-tts-tiny", device="cpu", dtype=torch.float32, max_streams=3)


def _caches(network, rows, positions, texts, seed):
    """Two identical caches (reference, region) with each row's encoder keys/values and its first
    positions decoded conventionally."""
    config = network.config
    gen = torch.Generator().manual_seed(seed)
    caches = [network.new_cache(max_rows=MAX_ROWS, max_seq_len=MAX_SEQ, max_text_len=MAX_TEXT) for _ in range(2)]
    encoded = torch.randn(len(rows), MAX_TEXT, config.encoder.hidden_size, generator=gen)
    valid = torch.arange(MAX_TEXT)[None, :] < torch.tensor(texts)[:, None]
    prefixes = [
        torch.randint(0, config.decoder.vocab_size, (1, n, config.decoder.num_channels), generator=gen)
        for n in positions
    ]
    for cache in caches:
        cache.claim(rows)
        network.decoder.write_cross(cache, rows, encoded, valid)
        for row, prefix in zip(rows, prefixes):
            if prefix.shape[1]:
                network.step(cache, [row], prefix)
    return caches, gen


def test_the_view_and_the_compiled_step(tiny):
    network = tiny.network
    view = network.decoder_view()
    dec = network.config.decoder
    assert view.family is ModelFamily.NH_TTS and view.attn_scale == 1.0
    assert view.cross.num_heads == dec.cross_num_attention_heads and view.cross.head_dim == dec.cross_head_dim
    assert all(layer.cross is not None for layer in view.layers)
    assert view.heads[0].shape == (dec.num_channels * dec.vocab_size, dec.hidden_size)
    region = compile_region(network, region_spec(NH_DECODER_STEP), batch_size=2, max_context=MAX_SEQ, num_sms=6)
    program = region.program
    check_program(program)
    ops = {inst.opcode for inst in program.instructions}
    assert Opcode.CROSS_ATTN in ops and Opcode.SAMPLE_EMBED not in ops and Opcode.EMBED not in ops
    assert sum(inst.opcode is Opcode.CROSS_ATTN for inst in program.instructions) == (
        dec.num_hidden_layers * dec.cross_num_key_value_heads  # one row tile of 2 rows per kv group
    )
    inputs = {spec.name for spec in program.buffers if spec.kind is BufferKind.INPUT}
    assert inputs == {"x_in", "positions", "slots", "text_lengths"}
    cross = program.buffer("cross_k_cache")
    assert cross.kind is BufferKind.STATE
    assert cross.shape == (dec.num_hidden_layers, 2, dec.cross_num_key_value_heads, 1024, dec.cross_head_dim)
    assert program.buffer("s0.logits").shape == (2, dec.num_channels * dec.vocab_size)


@pytest.mark.parametrize("rows, positions, texts", CASES, ids=[f"batch{len(c[0])}" for c in CASES])
def test_region_logits_equal_the_step_teacher_forced(tiny, rows, positions, texts):
    network = tiny.network
    config = network.config.decoder
    (ref_cache, cache), gen = _caches(network, rows, positions, texts, seed=len(rows))
    region = compile_region(
        network,
        region_spec(NH_DECODER_STEP),
        batch_size=len(rows),
        max_context=MAX_SEQ,
        num_cache_slots=MAX_ROWS,
        cache_len=MAX_SEQ,
        cross_cache_len=MAX_TEXT,
        tiling=TILING,
        num_sms=5,
    )
    for step in range(4):
        codes = torch.randint(0, config.vocab_size, (len(rows), 1, config.num_channels), generator=gen)
        want = network.step(ref_cache, rows, codes)
        bound = nh_decoder_inputs(region, cache, rows, network.decoder.embeddings(codes)[:, 0])
        out = run_program(region.program, bound, policy=SchedulePolicy.RANDOM, seed=step)
        for row in rows:
            cache.lengths[row] += 1
        got = out["s0.logits"].view(len(rows), config.num_channels, config.vocab_size)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    for name in ("self_k", "self_v"):
        torch.testing.assert_close(getattr(cache, name), getattr(ref_cache, name), atol=ATOL, rtol=1e-5)
    assert cache.lengths == ref_cache.lengths


def _run_streams(model, requests):
    codes: dict[int, list[torch.Tensor]] = {}
    model.code_observer = lambda sid, pos, c: codes.setdefault(sid, []).append(c.clone())
    ids = list(model.open_streams(requests))
    assert all(isinstance(i, int) for i in ids), ids
    finished: set[int] = set()
    while len(finished) < len(ids):
        for chunk in model.step([i for i in ids if i in model.open_stream_ids]):
            if chunk.is_finished:
                finished.add(chunk.stream_id)
    return [torch.stack(codes[i]) for i in ids]


def test_whole_greedy_streams_through_the_vm_equal_the_conventional_path():
    """Two streams (guidance: two cache rows each) of different texts and lengths, ending at different steps:
    the decoder step through the region (prefill of the BOS frame included) gives exactly the same codes."""
    requests = [
        SynthesisRequest(
            text="[S1] Hello there.", sampling=SamplingParams(temperature=0.0, top_k=5), max_duration_s=0.5, seed=1
        ),
        SynthesisRequest(
            text="[S2] A longer line of text here, ok.",
            sampling=SamplingParams(temperature=0.0, top_k=0),
            max_duration_s=0.3,
            seed=2,
        ),
    ]
    want = _run_streams(load_preset("nh-tts-tiny", device="cpu", dtype=torch.float32, max_streams=3), requests)
    model = load_preset("nh-tts-tiny", device="cpu", dtype=torch.float32, max_streams=3)
    assert install_megakernel_regions(model, [NH_DECODER_STEP], VM) == {NH_DECODER_STEP: None}
    got = _run_streams(model, requests)
    assert len({c.shape[0] for c in want}) == 2  # the streams end at different steps
    for codes, want_codes in zip(got, want, strict=True):
        assert torch.equal(codes, want_codes)
    backend = model.nh_decoder_step_backend
    assert isinstance(backend, MegakernelNhDecoderStep)
    assert backend.num_conventional_calls == 0 and backend.num_megakernel_calls == max(c.shape[0] for c in want)


def test_a_prompt_prefill_runs_conventionally_and_says_why(tiny, caplog):
    network = tiny.network
    config = network.config.decoder
    rows, positions, texts = [2, 5], [0, 0], [6, 13]
    (ref_cache, cache), gen = _caches(network, rows, positions, texts, seed=9)
    backend = MegakernelNhDecoderStep(network, VM)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for _ in range(2):
            codes = torch.randint(0, config.vocab_size, (2, 3, config.num_channels), generator=gen)
            torch.testing.assert_close(backend(cache, rows, codes), network.step(ref_cache, rows, codes))
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert messages == [
        "megakernel region nh_decoder_step: conventional path: 3 new positions per row (a prompt prefill); "
        "the region decodes one"
    ]
    assert backend.num_conventional_calls == 2 and backend.num_megakernel_calls == 0
    codes = torch.randint(0, config.vocab_size, (2, 1, config.num_channels), generator=gen)
    torch.testing.assert_close(backend(cache, rows, codes), network.step(ref_cache, rows, codes), atol=ATOL, rtol=1e-5)
    assert backend.num_megakernel_calls == 1


def test_a_network_without_cross_attention_refuses_a_cross_cache(tiny_llama):
    with pytest.raises(ValueError, match="cross_cache_len given for a network without cross-attention"):
        compile_region(
            tiny_llama, region_spec("decoder_step"), batch_size=1, max_context=8, cross_cache_len=4, num_sms=2
        )
