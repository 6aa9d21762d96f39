"""Pack a Program into the flat int32 tensors the CUDA interpreter reads.

`instructions` (num_sms, max_queue_len, INSTRUCTION_WORDS) holds each SM's queue in order (rows past
a queue's length are NO_ID), `queue_lengths` (num_sms,), and `buffer_table` (num_buffers, 3 + MAX_DIMS)
rows [kind, dtype, ndim, dims...] so the launcher can check every bound tensor; counters are
num_counters int32 zeros at launch start. `unpack_queues` inverts the instruction packing.
Imports: torch and trt_plugins.megakernel.instructions.
"""

from __future__ import annotations

import torch

from tilevox.trt_plugins.megakernel.instructions import (
    INSTRUCTION_WORDS,
    NO_ID,
    Instruction,
    Program,
)

__all__ = ["MAX_DIMS", "pack_program", "unpack_queues"]

MAX_DIMS = 5  # the KV caches are (layers, slots, kv heads, length, head_dim)


def pack_program(program: Program) -> dict[str, torch.Tensor]:
    num_sms = len(program.queues)
    max_len = max((len(q) for q in program.queues), default=0)
    words = torch.full((num_sms, max_len, INSTRUCTION_WORDS), NO_ID, dtype=torch.int32)
    encoded = [inst.encode() for inst in program.instructions]
    for sm, queue in enumerate(program.queues):
        if queue:
            words[sm, : len(queue)] = torch.tensor([encoded[idx] for idx in queue], dtype=torch.int32)
    table = torch.full((len(program.buffers), 3 + MAX_DIMS), NO_ID, dtype=torch.int64)
    for spec in program.buffers:
        if len(spec.shape) > MAX_DIMS:
            raise ValueError(f"buffer {spec.name!r} has {len(spec.shape)} dims; at most {MAX_DIMS}")
        table[spec.buffer_id, :3] = torch.tensor([spec.kind.value, spec.dtype.value, len(spec.shape)])
        table[spec.buffer_id, 3 : 3 + len(spec.shape)] = torch.tensor(spec.shape, dtype=torch.int64)
    return {
        "instructions": words,
        "queue_lengths": torch.tensor([len(q) for q in program.queues], dtype=torch.int32),
        "buffer_table": table,
        "counters": torch.zeros(program.num_counters, dtype=torch.int32),
    }


def unpack_queues(packed: dict[str, torch.Tensor]) -> list[list[Instruction]]:
    """Decoded instructions per SM (cost annotations are not packed and come back as 0)."""
    return [
        [Instruction.decode(packed["instructions"][sm, pos].tolist()) for pos in range(int(length))]
        for sm, length in enumerate(packed["queue_lengths"].tolist())
    ]
