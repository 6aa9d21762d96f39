"""The megakernel VM on hand-built programs: record encoding, packing, split-KV attention against plain
softmax attention, the counter-based RNG against an independent Python implementation, the
top-k/top-p filter against models.sampling, counter ordering across SMs, deadlock detection and
buffer binding checks."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tilevox.models.sampling import filter_top_k_top_p
from tilevox.trt_plugins.megakernel import (
    BufferKind,
    BufferSpec,
    DeadlockError,
    DType,
    Instruction,
    Opcode,
    Program,
    RegionConstants,
    SchedulePolicy,
    Wait,
    run_program,
    uniform_from_seed,
)
from tilevox.trt_plugins.megakernel.instructions import MAX_WAITS, NO_ID
from tilevox.trt_plugins.megakernel.packing import pack_program, unpack_queues
from tilevox.trt_plugins.megakernel.vm import _filter_top_k_top_p


def _random_instruction(op: Opcode, rng: random.Random) -> Instruction:
    info = op.value
    return Instruction(
        opcode=op,
        layer=rng.randrange(-1, 40),
        step=rng.randrange(0, 20),
        tile_start=(s := rng.randrange(0, 90)),
        tile_stop=s + rng.randrange(1, 30),
        args=tuple(rng.randrange(0, 10**6) for _ in info.args),
        inputs=tuple(rng.choice([NO_ID, rng.randrange(0, 500)]) for _ in info.inputs),
        outputs=tuple(rng.randrange(0, 500) for _ in info.outputs),
        waits=tuple(
            Wait(counter_id=rng.randrange(0, 999), target=rng.randrange(1, 600))
            for _ in range(rng.randrange(0, MAX_WAITS + 1))
        ),
        signal=rng.randrange(-1, 999),
        weight_bytes=rng.randrange(0, 10**9),
        flops=rng.randrange(0, 10**9),
    )


def test_encode_decode_round_trip_for_every_opcode():
    rng = random.Random(0)
    for op in Opcode:
        for _ in range(5):
            inst = _random_instruction(op, rng)
            words = inst.encode()
            assert all(-(2**31) <= w < 2**31 for w in words)
            assert Instruction.decode(words) == dataclasses.replace(inst, weight_bytes=0, flops=0)
            assert Instruction.from_dict(inst.to_dict()) == inst


def test_instruction_validation():
    with pytest.raises(ValueError, match="inputs"):
        Instruction(opcode=Opcode.EMBED, inputs=(0,), outputs=(1,))
    with pytest.raises(ValueError, match="waits"):
        Instruction(
            opcode=Opcode.EMBED,
            inputs=(0, 1),
            outputs=(2,),
            waits=tuple(Wait(counter_id=i, target=1) for i in range(MAX_WAITS + 1)),
        )
    with pytest.raises(ValueError, match="tile range"):
        Instruction(opcode=Opcode.EMBED, inputs=(0, 1), outputs=(2,), tile_start=3, tile_stop=3)
    with pytest.raises(ValueError, match="target"):
        Wait(counter_id=0, target=0)


def _buffers(
    *specs: tuple[str, BufferKind, DType, tuple[int, ...]],
) -> tuple[BufferSpec, ...]:
    return tuple(BufferSpec(buffer_id=i, name=n, kind=k, dtype=d, shape=s) for i, (n, k, d, s) in enumerate(specs))


def _embed_program(queues, waits_on_first: bool = True) -> Program:
    """x1 = table[tokens] (instruction 0, signals counter 0); x2 = table[tokens] too but waiting on
    counter 0 (instruction 1) -- a producer/consumer pair with a counter between them."""
    f32, i64 = DType.FLOAT32, DType.INT64
    buffers = _buffers(
        ("tokens", BufferKind.INPUT, i64, (3,)),
        ("table", BufferKind.WEIGHT, f32, (10, 4)),
        ("x1", BufferKind.OUTPUT, f32, (3, 4)),
        ("x2", BufferKind.OUTPUT, f32, (3, 4)),
    )
    insts = (
        Instruction(
            opcode=Opcode.EMBED,
            tile_start=0,
            tile_stop=3,
            inputs=(0, 1),
            outputs=(2,),
            signal=0,
        ),
        Instruction(
            opcode=Opcode.EMBED,
            tile_start=0,
            tile_stop=3,
            inputs=(0, 1),
            outputs=(3,),
            waits=(Wait(counter_id=0, target=1),) if waits_on_first else (),
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
    return Program(
        constants=constants,
        buffers=buffers,
        instructions=insts,
        queues=queues,
        num_counters=2,
    )


def test_counter_orders_instructions_across_sms():
    program = _embed_program(queues=((1,), (0,)))  # the consumer sits on SM 0, which round-robin tries first
    order: list[tuple[int, int]] = []
    bound = {"tokens": torch.tensor([3, 0, 9]), "table": torch.randn(10, 4)}
    out = run_program(program, bound, trace=lambda sm, idx: order.append((sm, idx)))
    assert order == [(1, 0), (0, 1)]
    assert torch.equal(out["x2"], bound["table"][bound["tokens"]])


def test_unsatisfiable_wait_raises_deadlock():
    program = _embed_program(queues=((1, 0),))  # consumer ahead of its producer on one SM
    bound = {"tokens": torch.tensor([3, 0, 9]), "table": torch.randn(10, 4)}
    with pytest.raises(DeadlockError, match=r"waits \(counter, value, target\) \[\(0, 0, 1\)\]"):
        run_program(program, bound)
    with pytest.raises(ValueError, match="exactly once"):
        dataclasses.replace(program, queues=((0,),))


def test_binding_is_checked():
    program = _embed_program(queues=((0, 1),))
    table = torch.randn(10, 4)
    with pytest.raises(ValueError, match="must be bound"):
        run_program(program, {"tokens": torch.tensor([1, 2, 3])})
    with pytest.raises(ValueError, match="expects"):
        run_program(program, {"tokens": torch.tensor([1, 2, 3]), "table": table.double()})
    with pytest.raises(ValueError, match="unknown"):
        run_program(program, {"tokens": torch.tensor([1, 2, 3]), "table": table, "tabel": table})


def test_pack_program_round_trip():
    program = _embed_program(queues=((1,), (), (0,)))
    packed = pack_program(program)
    assert packed["instructions"].shape == (3, 1, 48) and packed["queue_lengths"].tolist() == [1, 0, 1]
    assert unpack_queues(packed) == [
        [program.instructions[1]],
        [],
        [program.instructions[0]],
    ]
    assert packed["buffer_table"][1, :5].tolist() == [
        BufferKind.WEIGHT.value,
        DType.FLOAT32.value,
        2,
        10,
        4,
    ]
    assert packed["counters"].tolist() == [0, 0]


@pytest.mark.parametrize(
    "partition_tokens, tile, row_tiles",
    [
        (3, 2, [(NO_ID, NO_ID)]),
        (5, 1, [(0, 1), (1, 4)]),
        (64, 1, [(0, 3), (3, 4)]),
        (5, 2, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ],
)
def test_split_kv_attention_equals_softmax_attention(partition_tokens, tile, row_tiles):
    """ATTN_PARTIAL tiles (several partitions per tile, batch rows in ranges; NO_ID: all rows) + ATTN_REDUCE
    tiles (per row range) == softmax(q K^T * scale) V over each row's own keys [0, position + step], slots out
    of order, GQA groups of 3."""
    gen = torch.Generator().manual_seed(partition_tokens)
    batch, heads, kv_heads, d, cache_len, layers = 4, 6, 2, 8, 40, 2
    layer, step = 1, 2
    positions = torch.tensor([0, 9, 17, 37])  # lengths 3, 12, 20, 40
    slots = torch.tensor([3, 1, 0, 4])
    num_partitions = -(-cache_len // partition_tokens)
    constants = RegionConstants(
        batch_size=batch,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        rms_norm_eps=1e-6,
        attn_scale=d**-0.5,
        partition_tokens=partition_tokens,
        num_partitions=num_partitions,
    )
    f32, i64 = DType.FLOAT32, DType.INT64
    cache_shape = (layers, 5, kv_heads, cache_len, d)
    buffers = _buffers(
        ("q", BufferKind.INPUT, f32, (batch, heads, d)),
        ("k_cache", BufferKind.STATE, f32, cache_shape),
        ("v_cache", BufferKind.STATE, f32, cache_shape),
        ("positions", BufferKind.INPUT, i64, (batch,)),
        ("slots", BufferKind.INPUT, i64, (batch,)),
        (
            "part_out",
            BufferKind.SCRATCH,
            f32,
            (batch, kv_heads, num_partitions, heads // kv_heads, d),
        ),
        (
            "part_lse",
            BufferKind.SCRATCH,
            f32,
            (batch, kv_heads, num_partitions, heads // kv_heads),
        ),
        ("attn_out", BufferKind.OUTPUT, f32, (batch, heads * d)),
    )
    insts = [
        Instruction(
            opcode=Opcode.ATTN_PARTIAL,
            layer=layer,
            step=step,
            tile_start=p,
            tile_stop=min(p + tile, num_partitions),
            args=(g, r0, r1),
            inputs=(0, 1, 2, 3, 4, NO_ID, NO_ID, NO_ID, NO_ID),
            outputs=(5, 6),
            signal=0,
        )
        for g in range(kv_heads)
        for p in range(0, num_partitions, tile)
        for r0, r1 in row_tiles
    ]
    partials = len(insts)
    insts += [
        Instruction(
            opcode=Opcode.ATTN_REDUCE,
            layer=layer,
            step=step,
            tile_start=0,
            tile_stop=kv_heads,
            args=(r0, r1),
            inputs=(5, 6),
            outputs=(7,),
            waits=(Wait(counter_id=0, target=partials),),
        )
        for r0, r1 in row_tiles
    ]
    program = Program(
        constants=constants,
        buffers=buffers,
        instructions=tuple(insts),
        queues=(tuple(range(partials, len(insts))), tuple(range(partials))[::-1]),
        num_counters=1,
    )
    bound = {
        "q": torch.randn(batch, heads, d, generator=gen),
        "k_cache": torch.randn(cache_shape, generator=gen),
        "v_cache": torch.randn(cache_shape, generator=gen),
        "positions": positions,
        "slots": slots,
    }
    out = run_program(program, bound, policy=SchedulePolicy.RANDOM, seed=1)
    expected = torch.empty(batch, heads, d)
    for row in range(batch):
        length = int(positions[row]) + step + 1
        for head in range(heads):
            keys = bound["k_cache"][layer, slots[row], head // 3, :length]
            values = bound["v_cache"][layer, slots[row], head // 3, :length]
            probs = torch.softmax(keys @ bound["q"][row, head] * d**-0.5, dim=0)
            expected[row, head] = probs @ values
    torch.testing.assert_close(out["attn_out"], expected.reshape(batch, heads * d), atol=1e-5, rtol=1e-5)
    too_long = {**bound, "positions": torch.tensor([0, 0, 0, cache_len])}
    with pytest.raises(ValueError, match="partitions"):
        run_program(program, too_long)


def _hash32_python(x: int) -> int:
    # Independent plain-int implementation of lowbias32 (what a CUDA thread computes on uint32_t).
    m = 0xFFFFFFFF
    x &= m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_uniform_from_seed_matches_uint32_arithmetic_and_is_uniform():
    rng = random.Random(4)
    seeds = [rng.randrange(0, 2**63) for _ in range(64)] + [0, 1, 2**32, 2**63 - 1]
    counters = [rng.randrange(0, 2**32) for _ in range(len(seeds))]
    got = uniform_from_seed(torch.tensor(seeds), torch.tensor(counters)).tolist()
    for seed, counter, u in zip(seeds, counters, got):
        key = _hash32_python(_hash32_python(seed & 0xFFFFFFFF) ^ (seed >> 32))
        bits = _hash32_python(key ^ _hash32_python(counter))
        assert u == (2 * (bits >> 9) + 1) / 2**24  # exact: float32 holds the 24-bit odd numerator
    draws = uniform_from_seed(torch.full((40000,), 12345), torch.arange(40000))
    assert 0.0 < float(draws.min()) and float(draws.max()) < 1.0
    counts = torch.histc(draws, bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - 2000.0) ** 2 / 2000.0).sum())
    assert chi2 < 45.0  # 19 degrees of freedom: p < 1e-3 above ~43.8 for a fair generator


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (7, 1.0), (0, 0.6), (12, 0.9), (1, 0.5), (500, 0.999)])
def test_sampling_filter_matches_models_sampling(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k)
    for _ in range(5):
        scores = torch.randn(301, generator=gen) * 3
        assert torch.equal(
            _filter_top_k_top_p(scores, top_k, top_p),
            filter_top_k_top_p(scores, top_k, top_p),
        )


def _linear_chain(*, with_wait: bool, rows: tuple[int, int] = (0, 4)) -> Program:
    """y = x W^T over two column tiles, then z = y W^T (reads all of y): z needs both y tiles."""
    f32 = DType.FLOAT32
    buffers = _buffers(
        ("x", BufferKind.INPUT, f32, (2, 4)),
        ("w", BufferKind.WEIGHT, f32, (4, 4)),
        ("y", BufferKind.SCRATCH, f32, (2, 4)),
        ("z", BufferKind.OUTPUT, f32, (2, 4)),
    )
    insts = (
        Instruction(opcode=Opcode.LINEAR_BIAS, tile_start=0, tile_stop=2, inputs=(0, 1, NO_ID), outputs=(2,), signal=0),
        Instruction(opcode=Opcode.LINEAR_BIAS, tile_start=2, tile_stop=4, inputs=(0, 1, NO_ID), outputs=(2,), signal=0),
        Instruction(
            opcode=Opcode.LINEAR_BIAS,
            tile_start=rows[0],
            tile_stop=rows[1],
            inputs=(2, 1, NO_ID),
            outputs=(3,),
            waits=(Wait(counter_id=0, target=2),) if with_wait else (),
        ),
    )
    constants = RegionConstants(
        batch_size=2,
        num_heads=1,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        attn_scale=0.5,
        partition_tokens=1,
        num_partitions=1,
    )
    # Round-robin runs SM 0, then SM 1 (the consumer), then SM 2 (the second producer).
    return Program(constants=constants, buffers=buffers, instructions=insts, queues=((0,), (2,), (1,)), num_counters=1)


def test_static_check_on_hand_built_programs():
    from tilevox.trt_plugins.megakernel.validate import ProgramError, check_program

    check_program(_linear_chain(with_wait=True))
    with pytest.raises(ProgramError, match=r"race: #2 LINEAR_BIAS reads y"):
        check_program(_linear_chain(with_wait=False))
    program = _linear_chain(with_wait=True)
    overlapping = dataclasses.replace(program.instructions[1], tile_start=1)  # columns 1..3 overlap tile 0..2
    with pytest.raises(ProgramError, match="both write y"):
        check_program(program.with_instructions((program.instructions[0], overlapping, program.instructions[2])))
    # The VM agrees: without the wait, round-robin runs the consumer before the second producer.
    bound = {"x": torch.randn(2, 4), "w": torch.randn(4, 4)}
    good = run_program(_linear_chain(with_wait=True), bound)["z"]
    torch.testing.assert_close(good, bound["x"] @ bound["w"].T @ bound["w"].T)
    assert torch.isnan(run_program(_linear_chain(with_wait=False), bound)["z"]).any()
