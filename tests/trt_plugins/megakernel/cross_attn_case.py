"""A hand-built CROSS_ATTN program and its float64 reference, shared by the VM test (CPU) and the kernel
test (GPU): queries of several rows, per-row encoder keys/values in a cache laid out as NhDecoderCache's
cross_k / cross_v (layers, slots, kv heads, text, D) with rows at scattered slots and different text
lengths (1, partial, the full cache), GQA (two query heads per kv group), tiles of rows that do not divide
the batch, and a query width that differs from the region constants' head_dim."""

from __future__ import annotations

import torch

from tilevox.trt_plugins.megakernel import BufferKind, BufferSpec, DType, Instruction, Opcode, Program, RegionConstants

LAYERS, SLOTS, KV_HEADS, TEXT, HEAD_DIM, GROUP = 2, 7, 3, 37, 16, 2
SLOT_OF_ROW = (5, 0, 3, 6, 1)
TEXT_OF_ROW = (1, 37, 12, 30, 5)
LAYER = 1
SCALE = 0.3
_DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16}


def cross_attn_program(dtype: torch.dtype, *, rows_per_tile: int = 2, num_queues: int = 3) -> Program:
    batch, width = len(SLOT_OF_ROW), KV_HEADS * GROUP * HEAD_DIM
    act = _DTYPES[dtype]
    specs = [
        ("q", BufferKind.INPUT, act, (batch, width)),
        ("cross_k", BufferKind.STATE, act, (LAYERS, SLOTS, KV_HEADS, TEXT, HEAD_DIM)),
        ("cross_v", BufferKind.STATE, act, (LAYERS, SLOTS, KV_HEADS, TEXT, HEAD_DIM)),
        ("text_lengths", BufferKind.INPUT, DType.INT64, (batch,)),
        ("slots", BufferKind.INPUT, DType.INT64, (batch,)),
        ("attn_out", BufferKind.OUTPUT, act, (batch, width)),
    ]
    buffers = tuple(BufferSpec(buffer_id=i, name=n, kind=k, dtype=d, shape=s) for i, (n, k, d, s) in enumerate(specs))
    instructions = tuple(
        Instruction(
            opcode=Opcode.CROSS_ATTN,
            layer=LAYER,
            tile_start=start,
            tile_stop=min(start + rows_per_tile, batch),
            args=(group,),
            inputs=(0, 1, 2, 3, 4),
            outputs=(5,),
            signal=0,
        )
        for group in range(KV_HEADS)
        for start in range(0, batch, rows_per_tile)
    )
    constants = RegionConstants(  # the self-attention's shapes: CROSS_ATTN takes its own from the buffers
        batch_size=batch,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        attn_scale=SCALE,
        partition_tokens=4,
        num_partitions=1,
    )
    queues = tuple(tuple(range(q, len(instructions), num_queues)) for q in range(num_queues))
    return Program(constants=constants, buffers=buffers, instructions=instructions, queues=queues, num_counters=1)


def cross_attn_inputs(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(SLOT_OF_ROW), KV_HEADS * GROUP * HEAD_DIM
    shape = (LAYERS, SLOTS, KV_HEADS, TEXT, HEAD_DIM)
    return {
        "q": torch.randn(batch, width, generator=gen).to(dtype),
        "cross_k": torch.randn(shape, generator=gen).to(dtype),
        "cross_v": torch.randn(shape, generator=gen).to(dtype),
        "text_lengths": torch.tensor(TEXT_OF_ROW, dtype=torch.int64),
        "slots": torch.tensor(SLOT_OF_ROW, dtype=torch.int64),
    }


def cross_attn_reference(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """float64 attention of each row's query heads over its own slot's first text_lengths keys, (B, width)."""
    q = inputs["q"].double()
    out = torch.empty_like(q)
    for row, (slot, length) in enumerate(zip(SLOT_OF_ROW, TEXT_OF_ROW)):
        for head in range(KV_HEADS * GROUP):
            group = head // GROUP
            keys = inputs["cross_k"][LAYER, slot, group, :length].double()
            values = inputs["cross_v"][LAYER, slot, group, :length].double()
            query = q[row, head * HEAD_DIM : (head + 1) * HEAD_DIM]
            weights = torch.softmax((keys @ query) * SCALE, dim=0)
            out[row, head * HEAD_DIM : (head + 1) * HEAD_DIM] = weights @ values
    return out
