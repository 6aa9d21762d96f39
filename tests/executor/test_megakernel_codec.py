"""The Qwen3-TTS codec decode (executor region CODEC_DECODE) with its sliding-window transformer as a megakernel
region, on CPU through the VM executor (fp32, tiny codec with a 5-frame window so every ring wraps): streams kept
as rows of one codec-state pool, stepped in varying groups, orders and frame counts, each decode to their full
decode; rows no call names stay exactly as they were; calls alternating between the region and the
conventional decode_slots on the same pool continue the same streams (the pool's rings are the region's
caches); padding to a batch bucket changes nothing; a call the backend cannot take runs conventionally with its
reason logged once. The served model with the region installed gives the conventional audio."""

from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import pytest
import torch

from tests.models.qwen3_tts.speech_tokenizer.codec_case import short_window_codec
from tilevox.engine_builder.regions import region_compiler
from tilevox.executor.megakernel import (
    LOGGER_NAME,
    BackendOptions,
    Executor,
    MegakernelCodecDecode,
    install_megakernel_regions,
    megakernel_region_names,
    parse_regions,
)
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import CODE_PREDICTOR_LOOP, CODEC_DECODE, TALKER_STEP
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize

VM = BackendOptions(compiler=region_compiler(), executor=Executor.VM, num_sms=4)
TOL = 1e-5
WINDOW = 5
FRAMES = 3 * WINDOW + 1


@pytest.fixture(scope="module")
def codec():
    return short_window_codec(WINDOW, seed=11, scale_seed=2)


def _codes(config, frames: int, seed: int) -> torch.Tensor:
    """One stream's codes (1, Q, frames) for a codec decoder config."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (1, config.num_quantizers, frames), generator=gen)


def _stream_pool(decoder, backend, use_region, seed: int, device: str = "cpu"):
    """Streams in slots 4, 1 and 2 of a 6-row pool (the other rows poisoned), stepped in random groups of 1 to 3
    frames until each has FRAMES; `use_region(step)` says whether a step goes through `backend` or decode_slots.
    Returns (pool, the untouched rows' state before, each stream's samples, its codes)."""
    config = decoder.config
    pool = decoder.new_state(6)
    for tensor in (pool.keys, pool.values, *pool.conv_tails):  # a row's state must come from its own decodes
        tensor.normal_()
    pool.put([4, 1, 2], decoder.new_state(3))
    others = pool.select([0, 3, 5])
    codes = {slot: _codes_for(config, slot).to(device) for slot in (4, 1, 2)}
    done = dict.fromkeys(codes, 0)
    pieces: dict[int, list[torch.Tensor]] = {slot: [] for slot in codes}
    gen = torch.Generator().manual_seed(seed)
    step = 0
    while any(n < FRAMES for n in done.values()):
        group = [slot for slot in codes if done[slot] < FRAMES and torch.rand((), generator=gen) < 0.7]
        group = [group[i] for i in torch.randperm(len(group), generator=gen).tolist()]
        if not group:
            continue
        n = min(int(torch.randint(1, 4, (), generator=gen)), *(FRAMES - done[slot] for slot in group))
        batch = torch.cat([codes[slot][..., done[slot] : done[slot] + n] for slot in group])
        decode = backend if use_region(step) else decoder.decode_slots
        out = decode(batch, pool, torch.tensor(group, device=device))
        assert out.shape == (len(group), n * config.samples_per_frame)
        for row, slot in enumerate(group):
            pieces[slot].append(out[row : row + 1])
            done[slot] += n
        step += 1
    return pool, others, {slot: torch.cat(p, dim=-1) for slot, p in pieces.items()}, codes


def _codes_for(config, slot: int) -> torch.Tensor:
    return _codes(config, FRAMES, seed=40 + slot)


def _check_streams(decoder, pool, others, samples, codes) -> None:
    for slot, got in samples.items():
        assert (got - decoder(codes[slot])).abs().max().item() <= TOL
    assert pool.positions.tolist() == [0, FRAMES, FRAMES, 0, FRAMES, 0]
    for (mine, _), (theirs, _) in zip(pool.select([0, 3, 5])._tensors(), others._tensors(), strict=True):
        assert torch.equal(mine, theirs)


@torch.no_grad()
@pytest.mark.parametrize("buckets", [True, False])
def test_codec_region_streams_equal_their_full_decode(codec, buckets):
    """Every step through the region (groups of 3 padded to bucket 4 with buckets on)."""
    decoder = codec
    backend = MegakernelCodecDecode(decoder, dataclasses.replace(VM, buckets=buckets))
    pool, others, samples, codes = _stream_pool(decoder, backend, lambda step: True, seed=5)
    _check_streams(decoder, pool, others, samples, codes)
    assert backend.num_megakernel_calls > 8 and backend.num_conventional_calls == 0
    compiled = set(backend._runner._compiled)
    assert compiled <= ({1, 2, 4} if buckets else {1, 2, 3}) and len(compiled) >= 2


@torch.no_grad()
def test_region_and_conventional_calls_continue_the_same_streams(codec):
    """Steps alternate between the region and decode_slots on one pool: the rings are one state, so each
    path continues what the other wrote."""
    decoder = codec
    backend = MegakernelCodecDecode(decoder, VM)
    pool, others, samples, codes = _stream_pool(decoder, backend, lambda step: step % 2 == 0, seed=6)
    _check_streams(decoder, pool, others, samples, codes)
    assert backend.num_megakernel_calls >= 4


@torch.no_grad()
def test_region_without_its_layer_scales_is_caught(codec):
    """Mutation check: the region compiled from a copy of the transformer whose attention layer scales are ones
    (the codec's convolutions unchanged) no longer gives the full decode, so the comparisons see the region."""
    decoder = codec
    mutated = copy.deepcopy(decoder.pre_transformer)
    for layer in mutated.layers:
        layer.self_attn_layer_scale.scale.fill_(1.0)
    backend = MegakernelCodecDecode(decoder, VM)
    pool = decoder.new_state(1)
    codes = _codes(decoder.config, 3, seed=1)
    backend._bound_runner(pool, mutated, torch.device("cpu"), {"num_cache_slots": 1})  # bound before any call
    got = backend(codes, pool, torch.tensor([0]))
    assert (got - decoder(codes)).abs().max().item() > 100 * TOL


@torch.no_grad()
def test_calls_it_cannot_take_run_conventionally_and_log_once(codec, caplog):
    decoder = codec
    backend = MegakernelCodecDecode(decoder, dataclasses.replace(VM, max_batch=1))
    pool = decoder.new_state(2)
    codes = torch.cat([_codes(decoder.config, 2, seed=s) for s in (1, 2)])
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for start in (0, 1):
            backend(codes[..., start : start + 1], pool, torch.tensor([0, 1]))
    assert backend.num_conventional_calls == 2 and backend.num_megakernel_calls == 0
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert messages == ["megakernel region codec_decode: conventional path: batch 2 exceeds max_batch 1"]
    other = decoder.new_state(1)  # another pool than the bound one: conventional, its own reason
    backend(codes[:1, :, :1], pool, torch.tensor([0]))
    backend(codes[:1, :, :1], other, torch.tensor([0]))
    assert backend.num_megakernel_calls == 1 and backend.num_conventional_calls == 3
    with pytest.raises(ValueError, match="codes must be"):
        backend(codes[:, :1], pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slots must be"):
        backend(codes[..., :1], pool, torch.tensor([0]))


def test_codec_decode_is_a_megakernel_region():
    model = load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=3, max_seq_len=64))
    assert megakernel_region_names(model) == (TALKER_STEP, CODE_PREDICTOR_LOOP, CODEC_DECODE)
    assert parse_regions(model, "all") == (TALKER_STEP, CODE_PREDICTOR_LOOP, CODEC_DECODE)
    assert parse_regions(model, "codec_decode,talker_step") == (CODEC_DECODE, TALKER_STEP)


def test_served_model_with_the_codec_region_gives_the_conventional_audio():
    """A whole greedy utterance: the codec decode through the region (VM) equals the conventional audio
    within fp32 rounding; every decode call went through the region."""
    request = SynthesisRequest(text="Good morning", sampling=SamplingParams.greedy(), max_duration_s=0.5, seed=3)
    model = load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=3, max_seq_len=64))
    ref = synthesize(model, request)
    assert install_megakernel_regions(model, [CODEC_DECODE], VM) == {CODEC_DECODE: None}
    got = synthesize(model, request)
    assert got.num_frames == ref.num_frames >= 5
    np.testing.assert_allclose(got.samples, ref.samples, atol=TOL, rtol=0)
    backend = model.codec_decode_backend
    assert backend.num_megakernel_calls >= 1 and backend.num_conventional_calls == 0
