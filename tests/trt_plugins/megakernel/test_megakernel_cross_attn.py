"""CROSS_ATTN in the megakernel VM: against a float64 reference (fp32 and bf16 activations, GQA, rows at
scattered cache slots with text lengths 1 to the full cache, row tiles that do not divide the batch, every
legal interleaving the same), a row without encoder keys is refused, and the static check sees its
footprint (a CROSS_ATTN that does not wait for its query producer is a race)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.trt_plugins.megakernel.cross_attn_case import (
    cross_attn_inputs,
    cross_attn_program,
    cross_attn_reference,
)
from tilevox.trt_plugins.megakernel import (
    BufferKind,
    BufferSpec,
    DType,
    Instruction,
    Opcode,
    Program,
    SchedulePolicy,
    run_program,
)
from tilevox.trt_plugins.megakernel.validate import ProgramError, check_program

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows_per_tile", [1, 2, 5])
def test_cross_attention_matches_the_float64_reference(dtype, rows_per_tile):
    program = cross_attn_program(dtype, rows_per_tile=rows_per_tile)
    check_program(program)
    inputs = cross_attn_inputs(dtype, seed=rows_per_tile)
    want = cross_attn_reference(inputs)
    for seed in range(3):  # any legal interleaving of the queues gives the same result
        out = run_program(program, inputs, policy=SchedulePolicy.RANDOM, seed=seed)
        assert out["attn_out"].dtype == dtype
        torch.testing.assert_close(out["attn_out"].double(), want, **TOL[dtype])


def test_a_row_without_encoder_keys_is_refused():
    inputs = cross_attn_inputs(torch.float32)
    inputs["text_lengths"] = torch.tensor([3, 0, 4, 5, 6])
    with pytest.raises(ValueError, match="row 1: text length 0 outside"):
        run_program(cross_attn_program(torch.float32), inputs)
    inputs["text_lengths"] = torch.tensor([3, 38, 4, 5, 6])  # past the cache's 37 positions
    with pytest.raises(ValueError, match="text length 38 outside"):
        run_program(cross_attn_program(torch.float32), inputs)


def test_the_static_check_sees_the_query_read():
    """A norm + projection writes q, CROSS_ATTN reads it: without a wait on the producer it is a race."""
    base = cross_attn_program(torch.float32, rows_per_tile=5, num_queues=1)
    width = base.buffer("q").shape[1]
    extra = (
        BufferSpec(buffer_id=6, name="x", kind=BufferKind.INPUT, dtype=DType.FLOAT32, shape=(5, 8)),
        BufferSpec(buffer_id=7, name="ln", kind=BufferKind.WEIGHT, dtype=DType.FLOAT32, shape=(8,)),
        BufferSpec(buffer_id=8, name="w_q", kind=BufferKind.WEIGHT, dtype=DType.FLOAT32, shape=(width, 8)),
    )
    buffers = tuple(dataclasses.replace(b, kind=BufferKind.SCRATCH) if b.name == "q" else b for b in base.buffers)
    producer = Instruction(
        opcode=Opcode.RMSNORM_LMHEAD, tile_start=0, tile_stop=width, inputs=(6, 7, 8), outputs=(0, -1), signal=1
    )
    racy = Program(
        constants=base.constants,
        buffers=buffers + extra,
        instructions=(*base.instructions, producer),
        queues=(tuple(range(len(base.instructions))), (len(base.instructions),)),
        num_counters=2,
    )
    with pytest.raises(ProgramError, match="race: #0 CROSS_ATTN reads q"):
        check_program(racy)
