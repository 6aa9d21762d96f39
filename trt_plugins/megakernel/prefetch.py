"""Which weight bytes each instruction reads, as contiguous row ranges: the megakernel's L2 prefetch table.

A block asks L2 to prefetch the weight tile of an instruction a few positions ahead in its queue
while it waits on counters, so HBM keeps streaming through the dependency bubbles. The ranges follow
each opcode's tile semantics (instructions.py); they are only a hint to the hardware (results never
depend on them), so an instruction whose ranges do not fit the table's two slots keeps its first two.
Imports: torch and trt_plugins.megakernel.instructions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tilevox.trt_plugins.megakernel.instructions import NO_ID, PREFETCH_RANGES, Instruction, Opcode, Program

__all__ = ["RANGES_PER_INSTRUCTION", "prefetch_table", "weight_row_ranges"]

RANGES_PER_INSTRUCTION = PREFETCH_RANGES  # [address, bytes] pairs per instruction (TILEVOX_MK_PREFETCH_WORDS / 2)


def weight_row_ranges(inst: Instruction, constants) -> list[tuple[int, int, int]]:
    """(weight buffer id, first row, stop row) of the weight matrices `inst` streams, in read order."""
    op, start, stop = inst.opcode, inst.tile_start, inst.tile_stop
    if op in (Opcode.LINEAR_BIAS, Opcode.OPROJ_RESIDUAL, Opcode.DOWN_RESIDUAL):
        return [(inst.inputs[1], start, stop)]
    if op is Opcode.RMSNORM_GATEUP_SWIGLU:
        return [(inst.inputs[2], start, stop), (inst.inputs[3], start, stop)]
    if op in (Opcode.RMSNORM_LMHEAD, Opcode.RMSNORM_LINEAR):
        return [(inst.inputs[2], start, stop)]
    if op is Opcode.RMSNORM_QKV_ROPE_APPEND:
        group, d = inst.args[0], constants.head_dim
        g = constants.num_heads // constants.num_kv_heads
        ranges = []
        if start < g:  # query heads group*g + [start, min(stop, g))
            ranges.append((inst.inputs[2], (group * g + start) * d, (group * g + min(stop, g)) * d))
        if start <= g < stop:
            ranges.append((inst.inputs[3], group * d, (group + 1) * d))
        if start <= g + 1 < stop:
            ranges.append((inst.inputs[4], group * d, (group + 1) * d))
        return ranges
    return []  # embedding rows, attention, sampling: data-dependent or not weights


def prefetch_table(program: Program, tensors: Mapping[str, torch.Tensor], max_queue_len: int) -> torch.Tensor:
    """(num_queues, max_queue_len, 4) int64 [address, bytes, address, bytes] per queue position (bytes 0:
    nothing); addresses and sizes are multiples of 16 as cp.async.bulk.prefetch requires."""
    names = [spec.name for spec in program.buffers]
    table = torch.zeros((len(program.queues), max(1, max_queue_len), 2 * RANGES_PER_INSTRUCTION), dtype=torch.int64)
    rows = table.numpy()
    for queue_index, queue in enumerate(program.queues):
        for pos, inst_index in enumerate(queue):
            slot = 0
            for buffer_id, first, stop in weight_row_ranges(program.instructions[inst_index], program.constants):
                if buffer_id == NO_ID or stop <= first or slot == RANGES_PER_INSTRUCTION:
                    continue
                weight = tensors[names[buffer_id]]
                row_bytes = weight.stride(0) * weight.element_size()
                address = weight.data_ptr() + first * row_bytes
                size = (min(stop, weight.shape[0]) - first) * row_bytes
                if address % 16 or size % 16 or size <= 0:
                    continue
                rows[queue_index, pos, 2 * slot] = address
                rows[queue_index, pos, 2 * slot + 1] = size
                slot += 1
    return table
