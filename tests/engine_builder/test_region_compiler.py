"""Region compiler + megakernel VM against models.llama: a compiled full decode step (embedding,
layers, final norm, LM head, greedy sampling) equals LlamaForCausalLM.decode for batches of streams
at different positions; split regions equal one region; every legal interleaving gives bit-identical
results; broken dependencies are caught; the tile-graph JSON round-trips and its totals match an
independent count from the parameter shapes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tilevox.engine_builder.regions import (
    H200,
    RegionSpec,
    SchedulingPolicy,
    TilingConfig,
    compile_region,
    dump_tile_graph,
    load_tile_graph,
    simulate,
    tile_graph_dict,
)
from tilevox.engine_builder.regions.cost import instruction_time_s
from tilevox.engine_builder.regions.schedule import schedule_program
from tilevox.executor.megakernel_inputs import llama_decode_inputs, sampling_inputs
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama
from tilevox.models.sampling import SamplingParams
from tilevox.trt_plugins.megakernel import DeadlockError, Opcode, SchedulePolicy, run_program

MAX_STREAMS = 9
CACHE_LEN = 72
# Awkward tiles: 24-row matvec tiles leave a 16-row remainder at hidden 64 and 160; 7-token KV
# partitions put a partition boundary inside most rows' context; 3-row attention tiles split batches > 3.
TILING = TilingConfig(matvec_rows=24, lm_head_rows=100, heads_per_qkv_tile=2, partition_tokens=7, attn_rows=3)
ATOL = 2e-5


def _greedy(batch: int) -> dict[str, torch.Tensor]:
    return sampling_inputs([SamplingParams.greedy()] * batch, seeds=list(range(batch)))


def _prefilled_cache(model, slots: list[int], prompt_lengths: list[int], seed: int):
    cache = model.new_cache(max_streams=MAX_STREAMS, max_seq_len=CACHE_LEN)
    for _ in range(MAX_STREAMS):
        cache.allocate()
    gen = torch.Generator().manual_seed(seed)
    for slot, length in zip(slots, prompt_lengths):
        model.prefill(
            cache,
            slot,
            torch.randint(0, model.config.vocab_size, (length,), generator=gen),
        )
    return cache


def _clone_cache(model, cache):
    twin = model.new_cache(max_streams=MAX_STREAMS, max_seq_len=CACHE_LEN)
    twin.k.copy_(cache.k)
    twin.v.copy_(cache.v)
    twin.lengths = list(cache.lengths)
    twin._in_use = list(cache._in_use)
    return twin


def _compile(model, spec: RegionSpec, batch: int, **kw):
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


CASES = [  # (slots, prompt lengths): streams at different positions, slots out of order
    ([5], [1]),
    ([3, 0], [40, 6]),
    ([8, 1, 4, 0, 6, 2, 7], [1, 2, 7, 8, 15, 29, 50]),
]


@pytest.mark.parametrize("slots, lengths", CASES, ids=[f"batch{len(c[0])}" for c in CASES])
def test_full_step_region_matches_decode_for_16_greedy_steps(tiny_llama, slots, lengths):
    batch = len(slots)
    ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=batch)
    vm_cache = _clone_cache(tiny_llama, ref_cache)
    region = _compile(tiny_llama, RegionSpec.full_step(1), batch)
    tokens = torch.randint(
        0,
        tiny_llama.config.vocab_size,
        (batch,),
        generator=torch.Generator().manual_seed(7),
    )
    vm_tokens = tokens.clone()
    for _ in range(16):
        ref_logits = tiny_llama.decode(ref_cache, slots, tokens)
        out = run_program(
            region.program,
            {
                **llama_decode_inputs(region, vm_cache, slots, vm_tokens),
                **_greedy(batch),
            },
        )
        for slot in slots:
            vm_cache.lengths[slot] += 1
        torch.testing.assert_close(out["s0.logits"], ref_logits, atol=ATOL, rtol=1e-5)
        tokens = ref_logits.argmax(-1)
        vm_tokens = out["s0.tokens"]
        assert torch.equal(vm_tokens, tokens)
    torch.testing.assert_close(vm_cache.k, ref_cache.k, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(vm_cache.v, ref_cache.v, atol=ATOL, rtol=1e-5)


def test_sixteen_step_loop_region_equals_sixteen_decodes(tiny_llama):
    """One launch running 16 steps (each sampled token embedded for the next step) == 16 decode calls."""
    slots, lengths, steps = [2, 6, 0], [3, 30, 11], 16
    ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=11)
    vm_cache = _clone_cache(tiny_llama, ref_cache)
    tokens = torch.tensor([5, 900, 77])
    region = _compile(tiny_llama, RegionSpec.full_step(steps), len(slots))
    out = run_program(
        region.program,
        {**llama_decode_inputs(region, vm_cache, slots, tokens), **_greedy(3)},
    )
    for step in range(steps):
        ref_logits = tiny_llama.decode(ref_cache, slots, tokens)
        torch.testing.assert_close(out[f"s{step}.logits"], ref_logits, atol=ATOL, rtol=1e-5)
        tokens = ref_logits.argmax(-1)
        assert torch.equal(out[f"s{step}.tokens"], tokens)
    torch.testing.assert_close(vm_cache.k, ref_cache.k, atol=ATOL, rtol=1e-5)


def test_regions_in_sequence_equal_one_region(tiny_llama):
    slots, lengths = [1, 4], [9, 20]
    tokens = torch.tensor([17, 401])
    whole_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=3)
    split_cache = _clone_cache(tiny_llama, whole_cache)
    whole = _compile(tiny_llama, RegionSpec.full_step(1), 2)
    first = _compile(tiny_llama, RegionSpec.layers(0, 1, embed_input=True), 2)
    second = _compile(tiny_llama, RegionSpec.layers(1, 2, lm_head=True), 2)
    ref = run_program(
        whole.program,
        {**llama_decode_inputs(whole, whole_cache, slots, tokens), **_greedy(2)},
    )
    mid = run_program(first.program, llama_decode_inputs(first, split_cache, slots, tokens))
    end = run_program(
        second.program,
        {
            **llama_decode_inputs(second, split_cache, slots),
            "x_in": mid["x_out"],
            **_greedy(2),
        },
    )
    # Same math in the same order: bit-identical, not merely close.
    assert torch.equal(end["s0.logits"], ref["s0.logits"])
    assert torch.equal(end["s0.tokens"], ref["s0.tokens"])
    assert torch.equal(split_cache.k, whole_cache.k) and torch.equal(split_cache.v, whole_cache.v)


def _run_fresh(model, region, slots, lengths, tokens, **kw):
    cache = _prefilled_cache(model, slots, lengths, seed=5)
    out = run_program(
        region.program,
        {**llama_decode_inputs(region, cache, slots, tokens), **_greedy(len(slots))},
        **kw,
    )
    return out, cache


def test_legal_interleavings_give_identical_results(tiny_llama):
    slots, lengths, tokens = [0, 3, 5], [4, 13, 33], torch.tensor([1, 2, 3])
    fixed = dataclasses.replace(TILING, sm_balanced=False)  # the same tiles for every SM count: only the order varies
    base = _compile(tiny_llama, RegionSpec.full_step(2), 3, tiling=fixed)
    ref, ref_cache = _run_fresh(tiny_llama, base, slots, lengths, tokens)
    variants = [(base, SchedulePolicy.RANDOM, seed) for seed in range(4)]
    variants += [
        (
            _compile(tiny_llama, RegionSpec.full_step(2), 3, num_sms=n, policy=p, tiling=fixed),
            SchedulePolicy.RANDOM,
            9,
        )
        for n, p in (
            (1, SchedulingPolicy.CRITICAL_PATH),
            (17, SchedulingPolicy.ROUND_ROBIN),
        )
    ]
    orders = set()
    for region, policy, seed in variants:
        order: list[int] = []
        out, cache = _run_fresh(
            tiny_llama,
            region,
            slots,
            lengths,
            tokens,
            policy=policy,
            seed=seed,
            trace=lambda sm, idx, order=order: order.append(idx),
        )
        orders.add(tuple(order))
        for name in ("s0.logits", "s1.logits", "s0.tokens", "s1.tokens"):
            assert torch.equal(out[name], ref[name]), name
        assert torch.equal(cache.k, ref_cache.k)
    assert len(orders) == len(variants)  # the interleavings really differ


def test_missing_wait_is_caught_by_a_result_mismatch(tiny_llama):
    """Drop the waits of every attention partial: some legal-looking interleaving then reads q and the
    KV cache before they are written (NaN-poisoned scratch or stale cache), and the result differs."""
    slots, lengths, tokens = [0, 2], [5, 12], torch.tensor([10, 20])
    region = _compile(tiny_llama, RegionSpec.full_step(1), 2, num_sms=8)
    ref, _ = _run_fresh(tiny_llama, region, slots, lengths, tokens)
    broken = [
        dataclasses.replace(i, waits=()) if i.opcode is Opcode.ATTN_PARTIAL else i for i in region.program.instructions
    ]
    broken_region = dataclasses.replace(region, program=region.program.with_instructions(tuple(broken)))
    # In program order on one SM the broken program is still right: the mismatch below comes from ordering.
    in_order = dataclasses.replace(
        broken_region,
        program=broken_region.program.with_queues((tuple(range(len(broken))),)),
    )
    assert torch.equal(
        _run_fresh(tiny_llama, in_order, slots, lengths, tokens)[0]["s0.logits"],
        ref["s0.logits"],
    )
    mismatches = 0
    for seed in range(6):
        out, _ = _run_fresh(
            tiny_llama,
            broken_region,
            slots,
            lengths,
            tokens,
            policy=SchedulePolicy.RANDOM,
            seed=seed,
        )
        mismatches += not torch.equal(out["s0.logits"], ref["s0.logits"])
    assert mismatches > 0


def test_cyclic_wait_raises_deadlock_not_hang(tiny_llama):
    region = _compile(tiny_llama, RegionSpec.full_step(1), 1)
    program = region.program
    insts = list(program.instructions)
    first_qkv = next(i for i, inst in enumerate(insts) if inst.opcode is Opcode.RMSNORM_QKV_ROPE_APPEND)
    lm_head_wait = next(inst for inst in insts if inst.opcode is Opcode.SAMPLE_EMBED).waits[0]
    insts[first_qkv] = dataclasses.replace(insts[first_qkv], waits=(*insts[first_qkv].waits, lm_head_wait))
    cyclic = program.with_instructions(tuple(insts))
    cache = _prefilled_cache(tiny_llama, [0], [3], seed=0)
    bound = {**llama_decode_inputs(region, cache, [0], torch.tensor([4])), **_greedy(1)}
    with pytest.raises(DeadlockError, match="RMSNORM_QKV_ROPE_APPEND"):
        run_program(cyclic, bound)
    # A consumer queued ahead of its producer on the same SM is a deadlock too.
    reversed_queue = program.with_queues((tuple(reversed(range(len(insts)))),))
    with pytest.raises(DeadlockError):
        run_program(reversed_queue, bound)
    with pytest.raises(ValueError, match="deadlock"):
        simulate(reversed_queue, H200)


def test_tile_graph_json_round_trip(tiny_llama, tmp_path):
    region = _compile(tiny_llama, RegionSpec.full_step(2), 3)
    path = tmp_path / "graph.json"
    dump_tile_graph(region.program, H200, path)
    loaded = load_tile_graph(path)
    assert loaded == region.program
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(tile_graph_dict(loaded, H200)))
    assert len(data["instructions"]) == len(region.program.instructions)
    assert {i["sm"] for i in data["instructions"]} <= set(range(6))
    # Every edge points forward in a queue-consistent schedule: producers finish before consumers start.
    for src, dst in data["edges"]:
        assert data["instructions"][src]["finish_s"] <= data["instructions"][dst]["start_s"]
    with pytest.raises(ValueError, match="format"):
        load_tile_graph({**data, "format": "other"})


@pytest.mark.parametrize("batch, context, steps", [(1, 4096, 1), (32, 1000, 2)])
def test_tile_graph_totals_match_parameter_count(batch, context, steps):
    """Llama-1B shapes on the meta device (no weights needed to compile): bytes and FLOPs of the
    tile graph equal an independent count from the model's parameter shapes."""
    model = random_llama(LlamaConfig.preset("1b"), seed=0, device="meta", dtype=torch.bfloat16)
    c = model.config
    region = compile_region(model, RegionSpec.full_step(steps), batch_size=batch, max_context=context)
    totals = tile_graph_dict(region.program, H200, include_edges=False)["totals"]
    elt = 2
    matrices = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    matrices += model.lm_head.weight.numel()
    embed_rows = steps * batch * c.hidden_size  # one gathered row per stream and step
    assert totals["weight_bytes"] == elt * (steps * matrices + embed_rows)
    d, hkv, layers = c.resolved_head_dim, c.num_key_value_heads, c.num_hidden_layers
    keys = sum(context - steps + 1 + s for s in range(steps))  # keys per row summed over steps (cost context)
    attention_flops = layers * batch * c.num_attention_heads * d * 4 * keys
    assert totals["flops"] == 2 * batch * steps * matrices + attention_flops
    kv_written = steps * layers * batch * hkv * 2 * d * elt
    assert totals["kv_bytes"] == layers * batch * hkv * 2 * d * elt * keys + kv_written
    # The predicted time respects the two lower bounds: total work spread on every SM, and the longest chain.
    program = region.program
    spread = sum(instruction_time_s(i, H200) for i in program.instructions) / H200.num_sms
    assert region.predicted_time_s >= spread
    assert region.predicted_time_s >= totals["weight_bytes"] / H200.hbm_bytes_per_s


def test_critical_path_beats_round_robin_on_uneven_work(tiny_llama):
    """Short contexts leave most attention partitions empty (cheap): dealing in program order then
    balances counts, not time; list scheduling is strictly better here. Costs where work dominates the
    per-instruction overhead (the tiny model's tiles are ~1000x smaller than the H200-measured 1.2 us
    overhead would make worth scheduling)."""
    kw = {
        "batch_size": 4,
        "max_context": 4000,
        "tiling": TilingConfig(partition_tokens=64),
        "num_sms": 5,
        "cost_context": 70,
        "device": dataclasses.replace(H200, instruction_overhead_s=0.2e-6, sm_stream_bytes_per_s=None),
    }
    spec = RegionSpec.full_step(1)
    cp = compile_region(tiny_llama, spec, policy=SchedulingPolicy.CRITICAL_PATH, **kw)
    rr = compile_region(tiny_llama, spec, policy=SchedulingPolicy.ROUND_ROBIN, **kw)
    assert cp.predicted_time_s < rr.predicted_time_s
    assert rr.program.metadata["policy"] == "round_robin"


def test_compile_rejects_bad_specs(tiny_llama):
    with pytest.raises(ValueError, match="multi-step"):
        RegionSpec(num_steps=2)
    with pytest.raises(ValueError, match="stop_layer"):
        compile_region(tiny_llama, RegionSpec.layers(0, 5), batch_size=1, max_context=8)
    with pytest.raises(ValueError, match="max_context"):
        compile_region(tiny_llama, RegionSpec.full_step(4), batch_size=1, max_context=3)
    with pytest.raises(ValueError, match="CodePredictor"):
        compile_region(tiny_llama, RegionSpec.code_predictor_loop(), batch_size=1)
    region = _compile(tiny_llama, RegionSpec.full_step(1), 1)
    cache = _prefilled_cache(tiny_llama, [0], [CACHE_LEN], seed=0)
    with pytest.raises(ValueError, match="max_context"):
        llama_decode_inputs(region, cache, [0], torch.tensor([1]))


def test_seeded_sampling_loop_draws_with_per_step_counters(tiny_llama):
    """A 6-step region with sampling: step s of row b draws with counter rng_offset[b] + s; the tokens
    equal a decode loop that samples each step's logits through models.sampling's filter with the
    same uniform (so the VM's RNG plumbing, filter and inverse CDF are all checked)."""
    from tilevox.models.sampling import filter_top_k_top_p
    from tilevox.trt_plugins.megakernel import uniform_from_seed

    slots, lengths, steps = [7, 1, 3], [2, 19, 40], 6
    params = [
        SamplingParams(temperature=1.0, top_k=0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.5, top_k=3),
    ]
    inputs = sampling_inputs(params, seeds=[5, 2**35 + 1, 99], rng_offsets=[0, 40, 7])
    ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=8)
    vm_cache = _clone_cache(tiny_llama, ref_cache)
    tokens = torch.tensor([3, 4, 5])
    region = _compile(tiny_llama, RegionSpec.full_step(steps), 3)
    out = run_program(
        region.program,
        {**llama_decode_inputs(region, vm_cache, slots, tokens), **inputs},
    )
    drawn = set()
    for step in range(steps):
        logits = tiny_llama.decode(ref_cache, slots, tokens)
        expected = []
        for row, p in enumerate(params):
            probs = filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p).softmax(-1)
            cdf = probs.cumsum(-1)
            u = uniform_from_seed(
                inputs["seed"][row : row + 1],
                inputs["rng_offset"][row : row + 1] + step,
            )
            expected.append(int(torch.searchsorted(cdf, u * cdf[-1], right=True)))
        tokens = torch.tensor(expected)
        assert torch.equal(out[f"s{step}.tokens"], tokens), step
        drawn.update(expected)
    assert len(drawn) > steps  # real draws, not one repeated token


def test_bf16_full_step_within_bf16_tolerance(tiny_llama):
    """bf16 weights and cache (the GPU's dtype): logits within bf16 tolerance of decode, and greedy
    tokens equal wherever the reference's top-2 margin exceeds that tolerance."""
    model = random_llama(tiny_llama.config, seed=0, device="cpu", dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in tiny_llama.state_dict().items()})
    slots, lengths = [0, 6, 2, 8], [1, 12, 33, 64]
    ref_cache = _prefilled_cache(model, slots, lengths, seed=12)
    vm_cache = _clone_cache(model, ref_cache)
    region = _compile(model, RegionSpec.full_step(1), 4)
    tokens = torch.tensor([9, 8, 7, 6])
    decided = 0
    for _ in range(4):
        ref = model.decode(ref_cache, slots, tokens).float()
        out = run_program(
            region.program,
            {**llama_decode_inputs(region, vm_cache, slots, tokens), **_greedy(4)},
        )
        for slot in slots:
            vm_cache.lengths[slot] += 1
        torch.testing.assert_close(out["s0.logits"].float(), ref, atol=0.1, rtol=0.05)
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.2
        assert torch.equal(out["s0.tokens"][clear], ref.argmax(-1)[clear])
        decided += int(clear.sum())
        tokens = ref.argmax(-1)
    assert decided >= 8


def test_long_context_with_default_tiling(tiny_llama):
    """Default tiling (16-row tiles, >= 64-key partitions): a 600-token and a 3-token stream in one
    batch, context 1000 -> 16 partitions of 64 keys, most of them empty for the short row."""
    slots, lengths = [1, 0], [600, 3]
    cache = tiny_llama.new_cache(max_streams=2, max_seq_len=1000)
    for _ in range(2):
        cache.allocate()
    gen = torch.Generator().manual_seed(2)
    for slot, length in zip(slots, lengths):
        tiny_llama.prefill(cache, slot, torch.randint(0, 1024, (length,), generator=gen))
    vm_k, vm_v = cache.k.clone(), cache.v.clone()
    region = compile_region(
        tiny_llama,
        RegionSpec.full_step(1),
        batch_size=2,
        max_context=1000,
        num_cache_slots=2,
    )
    assert region.program.constants.num_partitions == 16
    assert region.program.constants.partition_tokens == 64
    tokens = torch.tensor([1, 2])
    bound = {
        **llama_decode_inputs(region, cache, slots, tokens),
        **_greedy(2),
        "k_cache": vm_k,
        "v_cache": vm_v,
    }
    out = run_program(region.program, bound)
    ref = tiny_llama.decode(cache, slots, tokens)
    torch.testing.assert_close(out["s0.logits"], ref, atol=ATOL, rtol=1e-5)
    assert torch.equal(out["s0.tokens"], ref.argmax(-1))


def test_compiled_programs_pass_the_static_race_check(tiny_llama):
    from tilevox.trt_plugins.megakernel.validate import check_program

    for spec in (RegionSpec.full_step(3), RegionSpec.layers(0, 1, embed_input=True), RegionSpec.layers(1, 2)):
        for policy in SchedulingPolicy:
            check_program(_compile(tiny_llama, spec, 3, policy=policy).program)


def test_static_race_check_finds_missing_waits(tiny_llama):
    from tilevox.trt_plugins.megakernel.validate import ProgramError, check_program

    program = _compile(tiny_llama, RegionSpec.full_step(2), 2).program
    insts = program.instructions
    # 1. Attention without its QKV wait: reads q and the new K/V unordered.
    no_attn_wait = [dataclasses.replace(i, waits=()) if i.opcode is Opcode.ATTN_PARTIAL else i for i in insts]
    with pytest.raises(ProgramError, match=r"race: #\d+ ATTN_PARTIAL reads s0\.l0\.q"):
        check_program(program.with_instructions(tuple(no_attn_wait)))
    # 2. No KV chain: step 1's QKV no longer waits for step 0's QKV of the same layer and group. Still a
    # correct program here (step 1's input is step 0's sampled token), so no race may be reported.
    qkv_counters = {i.signal for i in insts if i.opcode is Opcode.RMSNORM_QKV_ROPE_APPEND}
    no_chain = [
        dataclasses.replace(i, waits=tuple(w for w in i.waits if w.counter_id not in qkv_counters))
        if i.opcode is Opcode.RMSNORM_QKV_ROPE_APPEND
        else i
        for i in insts
    ]
    check_program(program.with_instructions(tuple(no_chain)))
    # 3. A wait for more signals than a stage has.
    bad_target = list(insts)
    wait = bad_target[-1].waits[0]
    bad_target[-1] = dataclasses.replace(bad_target[-1], waits=(dataclasses.replace(wait, target=wait.target + 1),))
    with pytest.raises(ProgramError, match="only"):
        check_program(program.with_instructions(tuple(bad_target)))
    # 4. Queue order against the dependencies.
    with pytest.raises(ProgramError, match="deadlock"):
        check_program(program.with_queues((tuple(reversed(range(len(insts)))),)))


def test_sm_balanced_tiling_gives_each_sm_one_tile_per_stage(tiny_llama):
    """TilingConfig.sm_balanced: every matrix-vector stage is cut into at most num_sms tiles of a multiple of
    matvec_rows rows that cover its outputs once, and the step still equals the model's decode."""
    slots, lengths, num_sms = [4, 0, 7], [9, 1, 30], 5
    tiling = TilingConfig(matvec_rows=16, sm_balanced=True, partition_tokens=7)
    region = _compile(tiny_llama, RegionSpec.full_step(1), len(slots), tiling=tiling, num_sms=num_sms)
    plain = _compile(
        tiny_llama, RegionSpec.full_step(1), len(slots), tiling=dataclasses.replace(tiling, sm_balanced=False)
    )
    matvec = {
        Opcode.OPROJ_RESIDUAL,
        Opcode.RMSNORM_GATEUP_SWIGLU,
        Opcode.DOWN_RESIDUAL,
        Opcode.RMSNORM_LMHEAD,
    }
    stages: dict[int, list] = {}
    for inst in region.program.instructions:
        if inst.opcode in matvec:
            stages.setdefault(inst.signal, []).append(inst)
    rows_of = {
        Opcode.OPROJ_RESIDUAL: tiny_llama.config.hidden_size,
        Opcode.DOWN_RESIDUAL: tiny_llama.config.hidden_size,
        Opcode.RMSNORM_GATEUP_SWIGLU: tiny_llama.config.intermediate_size,
        Opcode.RMSNORM_LMHEAD: tiny_llama.config.vocab_size,
    }
    assert len(stages) == 3 * tiny_llama.config.num_hidden_layers + 1
    for tiles in stages.values():
        rows = rows_of[tiles[0].opcode]
        size = -(-math.ceil(rows / num_sms) // 16) * 16  # ceil(rows / num_sms), rounded up to 16
        assert len(tiles) <= num_sms
        assert [(t.tile_start, t.tile_stop) for t in tiles] == [
            (start, min(start + size, rows)) for start in range(0, rows, size)
        ]
    assert len(region.program.instructions) < len(plain.program.instructions)
    ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=5)
    vm_cache = _clone_cache(tiny_llama, ref_cache)
    tokens = torch.tensor([3, 1000, 17])
    out = run_program(region.program, {**llama_decode_inputs(region, vm_cache, slots, tokens), **_greedy(3)})
    ref_logits = tiny_llama.decode(ref_cache, slots, tokens)
    torch.testing.assert_close(out["s0.logits"], ref_logits, atol=ATOL, rtol=1e-5)
    assert torch.equal(out["s0.tokens"], ref_logits.argmax(-1))


def test_one_partition_writes_attn_out_without_a_reduce_stage(tiny_llama):
    """When one partition covers the region's context, ATTN_PARTIAL writes attn_out itself (no ATTN_REDUCE
    stage: one dependent stage fewer per layer), and the step equals both the decode and, bit for bit, the
    program that keeps the reduce (TilingConfig.reduce_single_partition)."""
    slots, lengths = [4, 0, 7], [9, 1, 30]
    tiling = dataclasses.replace(TILING, partition_tokens=CACHE_LEN, reduce_single_partition=False)
    region = _compile(tiny_llama, RegionSpec.full_step(2), len(slots), tiling=tiling)
    kept = _compile(
        tiny_llama,
        RegionSpec.full_step(2),
        len(slots),
        tiling=dataclasses.replace(tiling, reduce_single_partition=True),
    )
    assert region.program.constants.num_partitions == 1
    ops = [inst.opcode for inst in region.program.instructions]
    assert Opcode.ATTN_REDUCE not in ops and Opcode.ATTN_REDUCE in [i.opcode for i in kept.program.instructions]
    steps, layers, kv_heads = 2, tiny_llama.config.num_hidden_layers, tiny_llama.config.num_key_value_heads
    # per layer and step: one stage of partials instead of one per kv group plus the reduce stage
    assert region.program.num_counters == kept.program.num_counters - steps * layers * kv_heads
    for inst in region.program.instructions:
        if inst.opcode is Opcode.ATTN_PARTIAL:
            assert region.program.buffers[inst.outputs[0]].name.endswith("attn_out")
    outs = []
    for program_region in (region, kept):
        ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=11)
        vm_cache = _clone_cache(tiny_llama, ref_cache)
        tokens = torch.tensor([3, 1000, 17])
        inputs = {**llama_decode_inputs(program_region, vm_cache, slots, tokens), **_greedy(3)}
        outs.append(run_program(program_region.program, inputs))
    ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=11)
    ref_logits = tiny_llama.decode(ref_cache, slots, torch.tensor([3, 1000, 17]))
    torch.testing.assert_close(outs[0]["s0.logits"], ref_logits, atol=ATOL, rtol=1e-5)
    for name in ("s0.logits", "s1.logits", "s0.tokens", "s1.tokens"):
        assert torch.equal(outs[0][name], outs[1][name]), name


def test_split_qkv_projects_in_balanced_tiles_and_equals_the_fused_qkv(tiny_llama):
    """TilingConfig.split_qkv: per layer and step one stage of RMSNORM_LINEAR tiles covering the q, k and v rows
    once (tiles of the balanced size, none crossing a matrix), attention that norms and ropes its queries and
    the newest key itself, and KV_APPEND beside it. Two steps equal the decode, the fused-QKV program (fp32,
    within the VM's matmul rounding) and the cache it leaves; the static race check passes."""
    from tilevox.trt_plugins.megakernel.validate import check_program

    slots, lengths, num_sms = [4, 0, 7], [9, 1, 30], 5
    tiling = dataclasses.replace(TILING, split_qkv=True, sm_balanced=True)
    region = _compile(tiny_llama, RegionSpec.full_step(2), len(slots), tiling=tiling, num_sms=num_sms)
    fused = _compile(
        tiny_llama, RegionSpec.full_step(2), len(slots), tiling=dataclasses.replace(tiling, split_qkv=False)
    )
    check_program(region.program)
    cfg = tiny_llama.config
    d = cfg.hidden_size // cfg.num_attention_heads
    widths = {"q_raw": cfg.num_attention_heads * d, "k_raw": cfg.num_key_value_heads * d}
    widths["v_raw"] = widths["k_raw"]
    ops = [inst.opcode for inst in region.program.instructions]
    assert Opcode.RMSNORM_QKV_ROPE_APPEND not in ops
    names = {spec.buffer_id: spec.name for spec in region.program.buffers}
    stages: dict[int, list] = {}
    for inst in region.program.instructions:
        if inst.opcode is Opcode.RMSNORM_LINEAR:
            stages.setdefault(inst.signal, []).append(inst)
    assert len(stages) == 2 * cfg.num_hidden_layers
    size = -(-math.ceil(sum(widths.values()) / num_sms) // TILING.matvec_rows) * TILING.matvec_rows
    for tiles in stages.values():
        covered: dict[str, list[tuple[int, int]]] = {}
        for t in tiles:
            covered.setdefault(names[t.outputs[0]].split(".")[-1], []).append((t.tile_start, t.tile_stop))
        for name, width in widths.items():
            assert covered[name] == [(s, min(s + size, width)) for s in range(0, width, size)], name
    # Same dependent chain per layer: linear -> partials -> reduce -> o-proj -> gate/up -> down.
    appends = [i for i in region.program.instructions if i.opcode is Opcode.KV_APPEND]
    assert len(appends) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 1  # 3 rows: one 3-row tile
    append_counters = {i.signal for i in appends}
    consumers = [i for i in region.program.instructions if any(w.counter_id in append_counters for w in i.waits)]
    assert {i.opcode for i in consumers} == {Opcode.ATTN_PARTIAL, Opcode.KV_APPEND}
    assert all(i.step == 1 for i in consumers)  # only the next step waits for this step's appends
    outs, caches = [], []
    for program_region in (region, fused):
        ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=11)
        vm_cache = _clone_cache(tiny_llama, ref_cache)
        inputs = {**llama_decode_inputs(program_region, vm_cache, slots, torch.tensor([3, 1000, 17])), **_greedy(3)}
        outs.append(run_program(program_region.program, inputs, policy=SchedulePolicy.RANDOM, seed=3))
        caches.append((vm_cache.k, vm_cache.v))
    ref_cache = _prefilled_cache(tiny_llama, slots, lengths, seed=11)
    ref_logits = tiny_llama.decode(ref_cache, slots, torch.tensor([3, 1000, 17]))
    torch.testing.assert_close(outs[0]["s0.logits"], ref_logits, atol=ATOL, rtol=1e-5)
    for name in ("s0.logits", "s1.logits"):
        torch.testing.assert_close(outs[0][name], outs[1][name], atol=1e-6, rtol=1e-6)
    for name in ("s0.tokens", "s1.tokens"):
        assert torch.equal(outs[0][name], outs[1][name]), name
    for split_cache, fused_cache in zip(*caches):
        torch.testing.assert_close(split_cache, fused_cache, atol=1e-6, rtol=1e-6)


def test_split_qkv_attention_needs_the_append_chain(tiny_llama):
    """Split QKV: step 1's attention reads the cache below its own position, which step 0's KV_APPEND wrote;
    without that wait the static check reports the race, and without the projection wait the raw q."""
    from tilevox.trt_plugins.megakernel.validate import ProgramError, check_program

    tiling = dataclasses.replace(TILING, split_qkv=True)
    program = _compile(tiny_llama, RegionSpec.full_step(2), 2, tiling=tiling).program
    insts = program.instructions
    appends = {i.signal for i in insts if i.opcode is Opcode.KV_APPEND}
    linears = {i.signal for i in insts if i.opcode is Opcode.RMSNORM_LINEAR}

    def without(counters: set[int]) -> tuple:
        return tuple(
            dataclasses.replace(i, waits=tuple(w for w in i.waits if w.counter_id not in counters))
            if i.opcode is Opcode.ATTN_PARTIAL
            else i
            for i in insts
        )

    with pytest.raises(ProgramError, match=r"race: #\d+ ATTN_PARTIAL reads k_cache"):
        check_program(program.with_instructions(without(appends)))
    with pytest.raises(ProgramError, match=r"race: #\d+ ATTN_PARTIAL reads s0\.l0\.q_raw"):
        check_program(program.with_instructions(without(linears)))


def test_opcode_affinity_moves_no_start_and_keeps_outputs(tiny_llama):
    """TilingConfig.opcode_affinity: the same instructions on fewer SMs per opcode, every predicted start where it
    was (an instruction only moves to an SM free by its start), and the VM's outputs bit for bit the same."""
    slots, lengths, num_sms = [4, 0, 7], [9, 1, 30], 40
    spec = RegionSpec.full_step(3)
    plain = _compile(tiny_llama, spec, len(slots), num_sms=num_sms)
    region = _compile(
        tiny_llama, spec, len(slots), num_sms=num_sms, tiling=dataclasses.replace(TILING, opcode_affinity=True)
    )
    assert region.program.instructions == plain.program.instructions
    assert region.program.metadata["affinity"] is True and "affinity" not in plain.program.metadata

    def sms_of(program):
        out: dict[Opcode, set[int]] = {}
        for sm, queue in enumerate(program.queues):
            for idx in queue:
                out.setdefault(program.instructions[idx].opcode, set()).add(sm)
        return out

    before, after = sms_of(plain.program), sms_of(region.program)
    assert all(len(after[op]) <= len(before[op]) for op in before)
    assert sum(map(len, after.values())) < sum(map(len, before.values()))
    assert region.program.queues != plain.program.queues
    assert simulate(region.program, H200).start_s == simulate(plain.program, H200).start_s
    from tilevox.trt_plugins.megakernel.validate import check_program

    check_program(region.program)
    outs = []
    for program in (plain.program, region.program):
        cache = _prefilled_cache(tiny_llama, slots, lengths, seed=5)
        tokens = torch.tensor([3, 1000, 17])
        out = run_program(program, {**llama_decode_inputs(region, cache, slots, tokens), **_greedy(3)})
        outs.append((out["s2.logits"], cache.k.clone(), cache.v.clone()))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="CRITICAL_PATH option"):
        schedule_program(plain.program, num_sms=4, policy=SchedulingPolicy.ROUND_ROBIN, device=H200, affinity=True)


def test_a_region_piece_keeps_the_embedding_at_layer_0_and_the_head_at_the_last_layer():
    from tilevox.engine_builder.regions.spec import RegionSpec, region_spec
    from tilevox.models.region_backends import CODE_PREDICTOR_LOOP, DECODER_STEP, TALKER_STEP

    step = region_spec(DECODER_STEP)
    assert step.piece(0, 3, 16) == RegionSpec.layers(0, 3, embed_input=True)
    assert step.piece(3, 16, 16) == RegionSpec.layers(3, 16, lm_head=True)
    assert step.piece(3, 9, 16) == RegionSpec.layers(3, 9)
    assert step.piece(0, 16, 16) == RegionSpec.layers(0, 16, embed_input=True, lm_head=True)
    assert region_spec(TALKER_STEP).piece(0, 7, 28) == RegionSpec.layers(0, 7)  # takes embeddings: no embed_input
    with pytest.raises(ValueError, match="not within"):
        step.piece(3, 17, 16)
    with pytest.raises(ValueError, match="single-step decoder"):
        region_spec(CODE_PREDICTOR_LOOP).piece(0, 1, 5)
    with pytest.raises(ValueError, match="single-step decoder"):
        RegionSpec.full_step(2).piece(0, 1, 16)
