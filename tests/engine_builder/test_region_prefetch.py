"""The megakernel's L2 prefetch table on compiled regions: every instruction's prefetched weight bytes are
exactly the weight bytes the cost model says it streams (same rows, same matrices), ranges lie inside
the bound tensors, and the table's layout follows the queues."""

from __future__ import annotations

import pytest
import torch

from tilevox.engine_builder.regions import RegionSpec, compile_region
from tilevox.trt_plugins.megakernel.instructions import Opcode
from tilevox.trt_plugins.megakernel.prefetch import prefetch_table, weight_row_ranges


@pytest.mark.parametrize("spec", [RegionSpec.full_step(1), RegionSpec.layers(1, 2)], ids=["full", "layers"])
def test_prefetched_bytes_equal_the_streamed_weight_bytes(tiny_llama, spec):
    region = compile_region(tiny_llama, spec, batch_size=3, max_context=40, num_sms=7)
    program = region.program
    names = [b.name for b in program.buffers]
    for inst in program.instructions:
        ranges = weight_row_ranges(inst, program.constants)
        got = 0
        for buffer_id, first, stop in ranges:
            weight = region.weights[names[buffer_id]]
            assert 0 <= first < stop <= weight.shape[0]
            got += (stop - first) * weight.shape[1] * weight.element_size()
        if inst.opcode in (Opcode.EMBED, Opcode.SAMPLE_EMBED, Opcode.ATTN_PARTIAL, Opcode.ATTN_REDUCE):
            assert ranges == []
        else:
            assert got == inst.weight_bytes, inst.opcode


def test_table_rows_follow_the_queues(tiny_llama):
    region = compile_region(tiny_llama, RegionSpec.full_step(1), batch_size=2, max_context=24, num_sms=5)
    program = region.program
    tensors = {name: t.contiguous() for name, t in region.weights.items()}
    max_len = max(len(q) for q in program.queues)
    table = prefetch_table(program, tensors, max_len)
    assert table.shape == (5, max_len, 4)
    by_address = {t.data_ptr(): (t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()}
    names = [b.name for b in program.buffers]
    for q, queue in enumerate(program.queues):
        for pos, index in enumerate(queue):
            inst = program.instructions[index]
            ranges = weight_row_ranges(inst, program.constants)[:2]
            for slot, (buffer_id, first, stop) in enumerate(ranges):
                weight = tensors[names[buffer_id]]
                row_bytes = weight.shape[1] * weight.element_size()
                assert table[q, pos, 2 * slot].item() == weight.data_ptr() + first * row_bytes
                assert table[q, pos, 2 * slot + 1].item() == (stop - first) * row_bytes
            for slot in range(len(ranges), 2):
                assert table[q, pos, 2 * slot + 1].item() == 0
        assert torch.all(table[q, len(queue) :] == 0)
    # Every range lies inside one bound tensor.
    for address, size in table.view(-1, 2).tolist():
        if size:
            assert any(lo <= address and address + size <= lo + n for lo, n in by_address.values())


def test_profile_summary_and_cost_fit(tiny_llama):
    """Synthetic stamps where every instruction takes 2 us + 1 us per KB and waits 0.5 us: the summary
    recovers them per opcode and the fit recovers the two constants."""
    from tilevox.trt_plugins.megakernel.profile import fit_streaming_cost, summarize_profile

    region = compile_region(tiny_llama, RegionSpec.full_step(1), batch_size=2, max_context=24, num_sms=3)
    program = region.program
    max_len = max(len(q) for q in program.queues)
    stamps = torch.zeros((3, max_len, 3), dtype=torch.int64)
    for q, queue in enumerate(program.queues):
        t = 1_000
        for pos, index in enumerate(queue):
            inst = program.instructions[index]
            exec_ns = 2_000 + (inst.weight_bytes + inst.kv_bytes + inst.activation_bytes)  # 1 ns per byte
            stamps[q, pos] = torch.tensor([t, t + 500, t + 500 + exec_ns])
            t += 500 + exec_ns
    summary = summarize_profile(program, stamps)
    assert summary["opcodes"]["RMSNORM_LMHEAD"]["count"] == sum(
        1 for i in program.instructions if i.opcode is Opcode.RMSNORM_LMHEAD
    )
    for entry in summary["opcodes"].values():
        assert entry["wait_us_mean"] == pytest.approx(0.5)
    fit = fit_streaming_cost(summary)
    assert fit["overhead_us"] == pytest.approx(2.0, abs=1e-6)
    assert fit["sm_gb_per_s"] == pytest.approx(1.0, rel=1e-6)  # 1 byte per ns


def test_profile_critical_path(tiny_llama):
    """Synthetic stamps from a replay of the queues with a known hand-off (700 ns after the latest
    producer, where one is pending at the start), idle wait (300 ns, where none is) and queue gap (200 ns): the walk's parts sum to the span, every producer-held instruction shows the
    700 ns hand-off, and the path's gaps and idle waits are the known constants times its steps."""
    from tilevox.trt_plugins.megakernel.instructions import NO_ID
    from tilevox.trt_plugins.megakernel.profile import critical_path

    region = compile_region(tiny_llama, RegionSpec.full_step(1), batch_size=2, max_context=24, num_sms=3)
    program = region.program
    handoff, idle, gap = 700, 300, 200
    signalers: dict[int, list[int]] = {}
    for index, inst in enumerate(program.instructions):
        if inst.signal != NO_ID:
            signalers.setdefault(inst.signal, []).append(index)
    max_len = max(len(q) for q in program.queues)
    stamps = torch.zeros((len(program.queues), max_len, 3), dtype=torch.int64)
    done: dict[int, int] = {}
    heads = [0] * len(program.queues)
    free = [5_000] * len(program.queues)
    progress = True
    while progress:
        progress = False
        for q, queue in enumerate(program.queues):
            while heads[q] < len(queue):
                index = queue[heads[q]]
                producers = [p for w in program.instructions[index].waits for p in signalers[w.counter_id]]
                if any(p not in done for p in producers):
                    break
                start = free[q] + (gap if heads[q] else 0)
                latest = max((done[p] for p in producers), default=0)
                waited = latest + handoff if latest > start else start + idle
                finish = waited + 1_000 + 37 * index % 500
                stamps[q, heads[q]] = torch.tensor([start, waited, finish])
                done[index] = free[q] = finish
                heads[q] += 1
                progress = True
    assert len(done) == len(program.instructions)
    result = critical_path(program, stamps)
    path = result["path"]
    assert result["span_us"] == pytest.approx((max(done.values()) - 5_000) / 1e3)
    parts = path["handoff_us"] + path["idle_wait_us"] + path["queue_gap_us"] + path["launch_us"]
    assert parts + sum(path["exec_us"].values()) == pytest.approx(result["span_us"])
    assert path["handoffs"] >= 1
    assert path["handoff_us"] == pytest.approx(path["handoffs"] * handoff / 1e3)
    queue_steps = path["instructions"] - path["handoffs"] - 1  # the last queue step reaches position 0
    assert path["queue_gap_us"] == pytest.approx(queue_steps * gap / 1e3)
    assert path["idle_wait_us"] == pytest.approx((queue_steps + 1) * idle / 1e3)
    assert result["handoff_us"]["median"] == pytest.approx(handoff / 1e3)
    assert result["handoff_us"]["max"] == pytest.approx(handoff / 1e3)
