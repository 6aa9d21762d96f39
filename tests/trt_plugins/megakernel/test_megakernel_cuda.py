"""The CUDA persistent megakernel against the megakernel VM (the oracle): same compiled program, same
buffer values (the VM on CPU, the kernel on the GPU). Tiny Llama full-step regions at batch 1, 2, 7 for
16 greedy steps (fp32 and bf16), a 16-step loop region with seeded top-k/top-p sampling, split regions
in sequence, the Qwen3-TTS code-predictor loop, CUDA-graph capture + replay, and the watchdog turning
an unsatisfiable wait into an error instead of a hang; CROSS_ATTN on random inputs (also against its
float64 reference) and the NH-TTS decoder step (self- and cross-attention, all-channel head) for rows at
different positions and text lengths; the Qwen3-TTS codec's sliding-window transformer (ring caches, layer
scales, biased projections) past several wraps of its window. Needs a GPU and libtilevox_kernels.so."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.models.qwen3_tts.speech_tokenizer.codec_case import short_window_codec
from tests.trt_plugins.megakernel.cross_attn_case import (
    cross_attn_inputs,
    cross_attn_program,
    cross_attn_reference,
)
from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region
from tilevox.engine_builder.regions.spec import region_spec
from tilevox.executor.megakernel_inputs import (
    code_predictor_inputs,
    llama_decode_inputs,
    nh_decoder_inputs,
    sampling_inputs,
)
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import o1_random_llama
from tilevox.models.nh_tts.loader import network_config
from tilevox.models.nh_tts.weights import random_network
from tilevox.models.region_backends import NH_DECODER_STEP
from tilevox.models.sampling import SamplingParams
from tilevox.trt_plugins.megakernel import BufferKind, Wait, run_program
from tilevox.trt_plugins.megakernel.instructions import (
    BufferSpec,
    DType,
    Instruction,
    Opcode,
    Program,
    RegionConstants,
)

pytestmark = [pytest.mark.gpu, pytest.mark.requires_megakernel]

MAX_STREAMS = 9
CACHE_LEN = 72
TILING = TilingConfig(matvec_rows=24, lm_head_rows=100, heads_per_qkv_tile=2, partition_tokens=7, attn_rows=3)
DEVICE = "cuda"
CASES = [([5], [1]), ([3, 0], [40, 6]), ([8, 1, 4, 0, 6, 2, 7], [1, 2, 7, 8, 15, 29, 50])]


@pytest.fixture(scope="module")
def rt():
    """tilevox.trt_plugins.megakernel.runtime (the module's marks skip it where the megakernel cannot run)."""
    from tilevox.trt_plugins.megakernel import runtime

    return runtime


def _tiny_llama(dtype: torch.dtype, **config_changes):
    """The region-compiler tests' tiny Llama (O(1) activations, so greedy tokens have clear margins), cast."""
    config = dataclasses.replace(LlamaConfig.preset("tiny"), **config_changes)
    return o1_random_llama(config, seed=1, device="cpu", dtype=torch.float32).to(dtype)


@pytest.fixture(scope="module")
def llama32():
    return _tiny_llama(torch.float32)


def _cache(model, slots, lengths, seed):
    cache = model.new_cache(max_streams=MAX_STREAMS, max_seq_len=CACHE_LEN)
    for _ in range(MAX_STREAMS):
        cache.allocate()
    gen = torch.Generator().manual_seed(seed)
    for slot, length in zip(slots, lengths):
        model.prefill(cache, slot, torch.randint(0, model.config.vocab_size, (length,), generator=gen))
    return cache


def _compile(model, spec, batch, **kw):
    return compile_region(
        model,
        spec,
        batch_size=batch,
        max_context=CACHE_LEN,
        num_cache_slots=MAX_STREAMS,
        cache_len=CACHE_LEN,
        tiling=kw.pop("tiling", TILING),
        num_sms=kw.pop("num_sms", 6),
        **kw,
    )


def _to_cuda(bound):
    return {name: t.to(DEVICE).contiguous() for name, t in bound.items()}


def _tol(dtype):
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def _greedy(batch):
    return sampling_inputs([SamplingParams.greedy()] * batch, seeds=list(range(batch)))


def _run_both(rt, program, bound_cpu):
    """VM on CPU (on clones of STATE buffers) and the kernel on the GPU; returns (vm_out, gpu_out)."""
    states = {s.name for s in program.buffers if s.kind is BufferKind.STATE}
    vm_bound = {n: (t.clone() if n in states else t) for n, t in bound_cpu.items()}
    gpu_out = rt.run_program_cuda(program, _to_cuda(bound_cpu))
    vm_out = run_program(program, vm_bound)
    return vm_out, gpu_out


def _assert_outputs_close(program, vm_out, gpu_out, dtype):
    for spec in program.buffers:
        if spec.kind not in (BufferKind.OUTPUT, BufferKind.STATE):
            continue
        got, want = gpu_out[spec.name].cpu(), vm_out[spec.name]
        if want.dtype.is_floating_point:
            torch.testing.assert_close(got, want, **_tol(dtype), msg=lambda m, n=spec.name: f"{n}: {m}")
        else:
            assert torch.equal(got, want), spec.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slots, lengths", CASES, ids=[f"batch{len(c[0])}" for c in CASES])
def test_full_step_matches_vm_for_16_greedy_steps(rt, llama32, slots, lengths, dtype):
    model = llama32 if dtype == torch.float32 else _tiny_llama(dtype)
    batch = len(slots)
    vm_cache = _cache(model, slots, lengths, seed=batch)
    gpu_k, gpu_v = vm_cache.k.to(DEVICE), vm_cache.v.to(DEVICE)
    region = _compile(model, RegionSpec.full_step(1), batch)
    launch = rt.CudaProgram(region.program)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(7))
    gpu_tokens = tokens.clone()
    for _ in range(16):
        vm_out = run_program(region.program, {**llama_decode_inputs(region, vm_cache, slots, tokens), **_greedy(batch)})
        bound = _to_cuda({**llama_decode_inputs(region, vm_cache, slots, gpu_tokens), **_greedy(batch)})
        bound["k_cache"], bound["v_cache"] = gpu_k, gpu_v
        gpu_out = launch.bind(bound).launch()
        for slot in slots:
            vm_cache.lengths[slot] += 1
        torch.testing.assert_close(gpu_out["s0.logits"].cpu(), vm_out["s0.logits"], **_tol(dtype))
        assert torch.equal(gpu_out["s0.tokens"].cpu(), vm_out["s0.tokens"])
        tokens, gpu_tokens = vm_out["s0.tokens"], gpu_out["s0.tokens"].cpu()
    torch.testing.assert_close(gpu_k.cpu(), vm_cache.k, **_tol(dtype))
    torch.testing.assert_close(gpu_v.cpu(), vm_cache.v, **_tol(dtype))


# Tilings that are off by default until these tests have run on a GPU (TilingConfig's fields), over the awkward
# TILING: balanced matrix-vector tiles, one partition without ATTN_REDUCE (7 -> 72-key partitions), split QKV
# (RMSNORM_LINEAR, ATTN_PARTIAL with k_new, KV_APPEND), and all of them together.
TILINGS = {
    "balanced": {"sm_balanced": True},
    "onepart": {"partition_tokens": CACHE_LEN, "reduce_single_partition": False},
    "split": {"split_qkv": True},
    "all": {"sm_balanced": True, "partition_tokens": CACHE_LEN, "reduce_single_partition": False, "split_qkv": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tiling_name", list(TILINGS))
def test_tilings_match_vm_over_steps(rt, llama32, dtype, tiling_name):
    """Each tiling of TILINGS on the kernel: bf16 takes the grouped attention path, fp32 the general one; two
    micro-steps per launch (with split QKV the second reads the key the first one's KV_APPEND wrote), 7-key
    partitions put the newest key inside or at the start of one. Logits, tokens and both caches follow the VM
    for 6 launches."""
    model = llama32 if dtype == torch.float32 else _tiny_llama(dtype)
    slots, lengths = CASES[2]
    batch = len(slots)
    vm_cache = _cache(model, slots, lengths, seed=3)
    gpu_k, gpu_v = vm_cache.k.to(DEVICE), vm_cache.v.to(DEVICE)
    tiling = dataclasses.replace(TILING, **TILINGS[tiling_name])
    region = _compile(model, RegionSpec.full_step(2), batch, tiling=tiling)
    opcodes = {i.opcode for i in region.program.instructions}
    assert (Opcode.KV_APPEND in opcodes) == tiling.split_qkv
    one_partition = region.program.constants.num_partitions == 1
    assert (Opcode.ATTN_REDUCE in opcodes) == (tiling.reduce_single_partition or not one_partition)
    assert one_partition == (tiling.partition_tokens == CACHE_LEN)
    launch = rt.CudaProgram(region.program)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(5))
    gpu_tokens = tokens.clone()
    for _ in range(6):
        vm_out = run_program(region.program, {**llama_decode_inputs(region, vm_cache, slots, tokens), **_greedy(batch)})
        bound = _to_cuda({**llama_decode_inputs(region, vm_cache, slots, gpu_tokens), **_greedy(batch)})
        bound["k_cache"], bound["v_cache"] = gpu_k, gpu_v
        gpu_out = launch.bind(bound).launch()
        for slot in slots:
            vm_cache.lengths[slot] += 2
        for name in ("s0.logits", "s1.logits"):
            torch.testing.assert_close(gpu_out[name].cpu(), vm_out[name], **_tol(dtype))
        for name in ("s0.tokens", "s1.tokens"):
            assert torch.equal(gpu_out[name].cpu(), vm_out[name]), name
        tokens, gpu_tokens = vm_out["s1.tokens"], gpu_out["s1.tokens"].cpu()
    torch.testing.assert_close(gpu_k.cpu(), vm_cache.k, **_tol(dtype))
    torch.testing.assert_close(gpu_v.cpu(), vm_cache.v, **_tol(dtype))


def test_rows_longer_than_one_staging_chunk(rt):
    """intermediate 8196: the down projection stages at most 5 batch rows at a time (192 KiB of fp32), so
    batch 7 takes two passes over each weight row; the bf16 weights take the scalar (K % 8 != 0) path."""
    for dtype in (torch.float32, torch.bfloat16):
        model = _tiny_llama(dtype, intermediate_size=8196)
        slots, lengths = [8, 1, 4, 0, 6, 2, 7], [1, 2, 7, 8, 15, 29, 50]
        region = _compile(model, RegionSpec.full_step(3), len(slots))
        bound = {
            **llama_decode_inputs(region, _cache(model, slots, lengths, seed=4), slots, torch.arange(7) * 100),
            **_greedy(7),
        }
        vm_out, gpu_out = _run_both(rt, region.program, bound)
        _assert_outputs_close(region.program, vm_out, gpu_out, dtype)


def test_loop_region_with_seeded_sampling_matches_vm(rt, llama32):
    """16 steps in one launch, each step's token sampled (temperature, top-k, top-p, per-stream seeds)."""
    slots, lengths = [2, 6, 0], [3, 30, 11]
    cache = _cache(llama32, slots, lengths, seed=11)
    region = _compile(llama32, RegionSpec.full_step(16), 3)
    params = [
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=0, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=7, top_p=1.0),
    ]
    sampling = sampling_inputs(params, seeds=[123, 2**40 + 5, 9], rng_offsets=[0, 17, 4])
    bound = {**llama_decode_inputs(region, cache, slots, torch.tensor([5, 900, 77])), **sampling}
    vm_out, gpu_out = _run_both(rt, region.program, bound)
    _assert_outputs_close(region.program, vm_out, gpu_out, torch.float32)


def test_regions_in_sequence_equal_one_region(rt, llama32):
    slots, lengths = [1, 4], [9, 20]
    tokens = torch.tensor([17, 401], device=DEVICE)
    cache = _cache(llama32, slots, lengths, seed=3)
    whole = _compile(llama32, RegionSpec.full_step(1), 2)
    first = _compile(llama32, RegionSpec.layers(0, 1, embed_input=True), 2)
    second = _compile(llama32, RegionSpec.layers(1, 2, lm_head=True), 2)
    whole_bound = _to_cuda({**llama_decode_inputs(whole, cache, slots), **_greedy(2)})
    split_k, split_v = whole_bound["k_cache"].clone(), whole_bound["v_cache"].clone()
    ref = rt.run_program_cuda(whole.program, {**whole_bound, "tokens": tokens})
    first_bound = _to_cuda(llama_decode_inputs(first, cache, slots))
    mid = rt.run_program_cuda(first.program, {**first_bound, "tokens": tokens, "k_cache": split_k, "v_cache": split_v})
    second_bound = _to_cuda({**llama_decode_inputs(second, cache, slots), **_greedy(2)})
    end = rt.run_program_cuda(
        second.program, {**second_bound, "x_in": mid["x_out"], "k_cache": split_k, "v_cache": split_v}
    )
    # Each instruction's arithmetic does not depend on the schedule: bit-identical.
    assert torch.equal(end["s0.logits"], ref["s0.logits"])
    assert torch.equal(end["s0.tokens"], ref["s0.tokens"])
    assert torch.equal(split_k, ref["k_cache"]) and torch.equal(split_v, ref["v_cache"])


def test_cuda_graph_replay_gives_the_same_result_twice(rt, llama32):
    slots, lengths = [0, 3, 5], [4, 13, 33]
    cache = _cache(llama32, slots, lengths, seed=5)
    region = _compile(llama32, RegionSpec.full_step(2), 3)
    bound = _to_cuda({**llama_decode_inputs(region, cache, slots, torch.tensor([1, 2, 3])), **_greedy(3)})
    launch = rt.CudaProgram(region.program).bind(bound)
    eager = {n: t.clone() for n, t in launch.launch().items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        launch.launch(check=False)  # warm-up on the side stream
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            launch.launch(check=False)
    torch.cuda.current_stream().wait_stream(stream)
    results = []
    for _ in range(2):
        for name in ("s0.logits", "s1.logits", "s0.tokens", "s1.tokens"):
            launch.tensors[name].fill_(-7)  # a replay must rewrite these
        graph.replay()
        launch.check_error()
        results.append({n: t.clone() for n, t in launch.tensors.items()})
    for name in ("s0.logits", "s1.logits", "s0.tokens", "s1.tokens", "k_cache", "v_cache"):
        assert torch.equal(results[0][name], eager[name]), name
        assert torch.equal(results[1][name], eager[name]), name
    vm_out = run_program(
        region.program, {**llama_decode_inputs(region, cache, slots, torch.tensor([1, 2, 3])), **_greedy(3)}
    )
    torch.testing.assert_close(results[1]["s1.logits"].cpu(), vm_out["s1.logits"], **_tol(torch.float32))


def test_broken_dependency_trips_the_watchdog_not_a_hang(rt, llama32):
    slots, lengths = [1, 4], [9, 20]
    cache = _cache(llama32, slots, lengths, seed=3)
    region = _compile(llama32, RegionSpec.full_step(1), 2)
    insts = list(region.program.instructions)
    victim = next(i for i, inst in enumerate(insts) if inst.opcode is Opcode.ATTN_REDUCE)
    wait = insts[victim].waits[0]
    insts[victim] = dataclasses.replace(
        insts[victim], waits=(Wait(counter_id=wait.counter_id, target=wait.target + 1), *insts[victim].waits[1:])
    )
    broken = region.program.with_instructions(tuple(insts))
    bound = _to_cuda({**llama_decode_inputs(region, cache, slots, torch.tensor([3, 4])), **_greedy(2)})
    start = time.perf_counter()
    # Blocks waiting downstream of the victim may time out first: any watchdog error is right.
    with pytest.raises(rt.MegakernelWatchdogError, match="watchdog"):
        rt.run_program_cuda(broken, bound, watchdog_s=0.05)
    assert time.perf_counter() - start < 10.0
    # The device is still usable and the intact program still runs.
    out = rt.run_program_cuda(region.program, bound)
    assert torch.isfinite(out["s0.logits"]).all()


def test_unsatisfiable_wait_and_bad_token_are_reported(rt):
    f32, i64 = DType.FLOAT32, DType.INT64
    names = [
        ("tokens", BufferKind.INPUT, i64, (3,)),
        ("table", BufferKind.WEIGHT, f32, (10, 4)),
        ("x1", BufferKind.OUTPUT, f32, (3, 4)),
        ("x2", BufferKind.OUTPUT, f32, (3, 4)),
    ]
    buffers = tuple(BufferSpec(buffer_id=i, name=n, kind=k, dtype=d, shape=s) for i, (n, k, d, s) in enumerate(names))
    insts = (
        Instruction(opcode=Opcode.EMBED, tile_start=0, tile_stop=3, inputs=(0, 1), outputs=(2,), signal=0),
        Instruction(
            opcode=Opcode.EMBED,
            tile_start=0,
            tile_stop=3,
            inputs=(0, 1),
            outputs=(3,),
            waits=(Wait(counter_id=0, target=1),),
            signal=1,
        ),
    )
    constants = RegionConstants(
        batch_size=3,
        num_heads=1,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        attn_scale=0.5,
        partition_tokens=1,
        num_partitions=1,
    )
    table = torch.randn(10, 4, device=DEVICE)
    good = Program(constants=constants, buffers=buffers, instructions=insts, queues=((1,), (0,)), num_counters=2)
    out = rt.run_program_cuda(good, {"tokens": torch.tensor([3, 0, 9], device=DEVICE), "table": table})
    assert torch.equal(out["x2"], table[torch.tensor([3, 0, 9], device=DEVICE)])
    deadlocked = Program(constants=constants, buffers=buffers, instructions=insts, queues=((1, 0),), num_counters=2)
    with pytest.raises(rt.MegakernelWatchdogError, match="queue 0 position 0 opcode 1 counter 0 value 0 target 1"):
        rt.run_program_cuda(
            deadlocked, {"tokens": torch.tensor([3, 0, 9], device=DEVICE), "table": table}, watchdog_s=0.02
        )
    with pytest.raises(rt.MegakernelFaultError, match="index out of range"):
        launch = rt.CudaProgram(good).bind({"tokens": torch.tensor([3, 10, 9], device=DEVICE), "table": table})
        launch.launch(check=False)
        launch.check_error()


# The predictor attends at most 17 positions: default partitions (64 keys) make it one partition.
PREDICTOR_TILINGS = {
    "plain": {},
    "split": {"split_qkv": True},
    "onepart": {"partition_tokens": None, "reduce_single_partition": False},
    "all": {
        "partition_tokens": None,
        "reduce_single_partition": False,
        "split_qkv": True,
        "sm_balanced": True,
        "attn_rows": 2,
    },
}


@pytest.mark.parametrize(
    "batch, same_width, tiling_name",
    [
        (1, False, "plain"),
        (2, True, "plain"),
        (7, False, "plain"),
        (7, False, "split"),
        (7, False, "onepart"),
        (7, False, "all"),
        (1, True, "all"),
    ],
)
def test_code_predictor_loop_matches_vm(rt, batch, same_width, tiling_name):
    from tilevox.models.qwen3_tts.config import Qwen3TTSConfig
    from tilevox.models.qwen3_tts.loader import preset_config_dict, randomize_network_
    from tilevox.models.qwen3_tts.talker import Talker

    config_dict = preset_config_dict("qwen3-tts-tiny")
    if same_width:
        talker_dict = config_dict["talker_config"]
        talker_dict["code_predictor_config"]["hidden_size"] = talker_dict["hidden_size"]
    talker = Talker(Qwen3TTSConfig.from_dict(config_dict).talker).eval().requires_grad_(False)
    randomize_network_(talker, seed=3)
    predictor = talker.code_predictor
    gen = torch.Generator().manual_seed(batch)
    hidden = torch.randn(batch, talker.config.transformer.hidden_size, generator=gen)
    code0 = talker.embed_codec(torch.randint(0, talker.config.num_audio_codes, (batch,), generator=gen))
    tiling = TilingConfig(matvec_rows=20, lm_head_rows=12, heads_per_qkv_tile=3, partition_tokens=3)
    tiling = dataclasses.replace(tiling, **PREDICTOR_TILINGS[tiling_name])
    region = compile_region(predictor, RegionSpec.code_predictor_loop(), batch_size=batch, tiling=tiling, num_sms=5)
    params = [
        SamplingParams.greedy() if b % 2 == 0 else SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
        for b in range(batch)
    ]
    bound = {
        **code_predictor_inputs(region, predictor.new_cache(batch), hidden, code0),
        **sampling_inputs(params, seeds=[40 + b for b in range(batch)]),
    }
    vm_out, gpu_out = _run_both(rt, region.program, bound)
    _assert_outputs_close(region.program, vm_out, gpu_out, torch.float32)


@pytest.mark.parametrize("rows_per_tile", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_attention_matches_vm(rt, dtype, rows_per_tile):
    """CROSS_ATTN alone on random inputs (tests/trt_plugins/megakernel/cross_attn_case.py: GQA, scattered
    slots, text lengths 1 to the full cache, a head_dim other than the region constants')."""
    program = cross_attn_program(dtype, rows_per_tile=rows_per_tile)
    bound = cross_attn_inputs(dtype, seed=rows_per_tile)
    vm_out, gpu_out = _run_both(rt, program, bound)
    _assert_outputs_close(program, vm_out, gpu_out, dtype)
    torch.testing.assert_close(gpu_out["attn_out"].cpu().double(), cross_attn_reference(bound), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nh_decoder_step_matches_vm(rt, dtype):
    """The compiled nh_decoder_step of random:nh-tts-tiny, three rows at positions 0 / 5 / 21 with text
    lengths 1 / 24 / 9, four teacher-forced steps: logits and the appended self keys/values equal the VM's."""
    network = random_network(network_config("nh-tts-tiny"), seed=2, device="cpu", dtype=dtype)
    config = network.config
    rows, positions, texts = [6, 1, 3], [0, 5, 21], [1, 24, 9]
    gen = torch.Generator().manual_seed(7)
    cache = network.new_cache(max_rows=8, max_seq_len=CACHE_LEN, max_text_len=24)
    cache.claim(rows)
    encoded = torch.randn(3, 24, config.encoder.hidden_size, generator=gen).to(dtype)
    network.decoder.write_cross(cache, rows, encoded, torch.arange(24)[None, :] < torch.tensor(texts)[:, None])
    for row, n in zip(rows, positions):
        if n:
            codes = torch.randint(0, config.decoder.vocab_size, (1, n, config.decoder.num_channels), generator=gen)
            network.step(cache, [row], codes)
    region = compile_region(
        network,
        region_spec(NH_DECODER_STEP),
        batch_size=3,
        max_context=CACHE_LEN,
        num_cache_slots=8,
        cache_len=CACHE_LEN,
        cross_cache_len=24,
        tiling=dataclasses.replace(TILING, cross_attn_rows=2),
        num_sms=6,
    )
    for _ in range(4):
        codes = torch.randint(0, config.decoder.vocab_size, (3, 1, config.decoder.num_channels), generator=gen)
        with torch.no_grad():
            x_in = network.decoder.embeddings(codes)[:, 0]
        bound = nh_decoder_inputs(region, cache, rows, x_in)
        vm_out, gpu_out = _run_both(rt, region.program, bound)
        _assert_outputs_close(region.program, vm_out, gpu_out, dtype)
        cache.self_k.copy_(vm_out["k_cache"])  # the VM ran on clones: advance the cache as it did
        cache.self_v.copy_(vm_out["v_cache"])
        for row in rows:
            cache.lengths[row] += 1


CODEC_WINDOW = 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split_qkv", [False, True], ids=["fused", "split"])
def test_codec_transformer_region_matches_vm(rt, dtype, split_qkv):
    """The codec transformer region (window 9: a twice-written ring of 18 cache positions; 4-key partitions, so a
    window spans three) for rows at positions 0, 4 and 23 over 14 frames: x_out and both ring caches follow the
    VM every frame. bf16 takes the grouped attention path, fp32 the general one."""
    decoder = short_window_codec(CODEC_WINDOW, seed=2, scale_seed=4, dtype=dtype)
    transformer = decoder.pre_transformer
    gen = torch.Generator().manual_seed(5)
    tiling = dataclasses.replace(TILING, partition_tokens=4, split_qkv=split_qkv)
    region = compile_region(transformer, RegionSpec(lm_head=True), batch_size=3, num_cache_slots=5, tiling=tiling)
    shape = region.program.buffer("k_cache").shape
    assert region.program.constants.window == CODEC_WINDOW and shape[3] == 2 * CODEC_WINDOW
    # Arbitrary earlier frames: random ring contents (both copies equal, as the appends write them).
    ring = torch.randn(2, *shape[:3], CODEC_WINDOW, shape[4], generator=gen).to(dtype)
    vm_k, vm_v = (torch.cat([half, half], dim=3) for half in ring)
    gpu_k, gpu_v = vm_k.to(DEVICE), vm_v.to(DEVICE)
    slots, positions = torch.tensor([3, 0, 4]), torch.tensor([0, 4, 23])
    launch = rt.CudaProgram(region.program)
    for frame in range(14):
        x = torch.randn(3, decoder.config.latent_dim, generator=gen).to(dtype)
        bound = {**region.weights, "x_in": x, "positions": positions + frame, "slots": slots}
        vm_out = run_program(region.program, {**bound, "k_cache": vm_k, "v_cache": vm_v})
        gpu_out = launch.bind({**_to_cuda(bound), "k_cache": gpu_k, "v_cache": gpu_v}).launch()
        torch.testing.assert_close(gpu_out["x_out"].cpu(), vm_out["x_out"], **_tol(dtype))
        torch.testing.assert_close(gpu_k.cpu(), vm_k, **_tol(dtype))
        torch.testing.assert_close(gpu_v.cpu(), vm_v, **_tol(dtype))
