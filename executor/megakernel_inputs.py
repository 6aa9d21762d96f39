"""Bind a compiled region's INPUT and STATE buffers from the reference models' own objects.

`CompiledProgram` is what the executor needs of a compiled region (engine_builder.regions.CompiledRegion
is one): its instruction program, the weight tensors to bind by buffer name, the decode steps it runs and
the context it was compiled for.
`sampling_inputs` turns per-stream `SamplingParams` + seeds into the SAMPLE_EMBED buffers (and
refuses what the on-device sampler does not implement); `llama_decode_inputs`, `code_predictor_inputs`
and `nh_decoder_inputs` bind the models' KV caches in place (their layout is the region's; NH-TTS's cross
keys/values too).
Imports: torch, models (sampling, llama, qwen3_tts, nh_tts), trt_plugins.megakernel (the program type).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tilevox.models.llama.model import LlamaKVCache
from tilevox.models.nh_tts.decoder import NhDecoderCache
from tilevox.models.qwen3_tts.layers import KVCache
from tilevox.models.sampling import SamplingParams
from tilevox.trt_plugins.megakernel.instructions import Program

__all__ = ["CompiledProgram", "code_predictor_inputs", "llama_decode_inputs", "nh_decoder_inputs", "sampling_inputs"]


class CompiledProgram(Protocol):
    program: Program
    weights: dict[str, torch.Tensor]  # by buffer name, on the model's device (views of its parameters)
    num_steps: int  # decode (micro-)steps the region runs
    max_context: int


def sampling_inputs(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    rng_offsets: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """SAMPLE_EMBED inputs for B streams. Raises ValueError for repetition_penalty != 1 or
    min_new_tokens > 0: SAMPLE_EMBED implements temperature, top-k and top-p only."""
    if len(params) != len(seeds) or (rng_offsets is not None and len(rng_offsets) != len(seeds)):
        raise ValueError(f"need one seed (and rng offset) per stream: {len(params)} params, {len(seeds)} seeds")
    for row, p in enumerate(params):
        if p.repetition_penalty != 1.0 or p.min_new_tokens:
            raise ValueError(
                f"stream {row}: the megakernel sampler has no repetition penalty or min_new_tokens "
                f"(got {p.repetition_penalty}, {p.min_new_tokens}); run this region conventionally"
            )
    offsets = [0] * len(seeds) if rng_offsets is None else list(rng_offsets)
    return {
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
        "seed": torch.tensor(list(seeds), dtype=torch.int64),
        "rng_offset": torch.tensor(offsets, dtype=torch.int64),
    }


def llama_decode_inputs(
    region: CompiledProgram,
    cache: LlamaKVCache,
    slots: Sequence[int],
    tokens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Weights + positions/slots (+ tokens) + the model's KV cache tensors (updated in place by a run).

    The caller advances cache.lengths by the region's num_steps after a run (as decode does per step)."""
    batch = region.program.constants.batch_size
    if len(slots) != batch:
        raise ValueError(f"region was compiled for batch {batch}, got {len(slots)} slots")
    positions = [cache.lengths[s] for s in slots]
    if max(positions) + region.num_steps > region.max_context:
        raise ValueError(
            f"positions up to {max(positions)} + {region.num_steps} steps exceed the region's "
            f"max_context {region.max_context}"
        )
    bound = dict(
        region.weights,
        positions=torch.tensor(positions, dtype=torch.int64),
        slots=torch.tensor(list(slots), dtype=torch.int64),
        k_cache=cache.k,
        v_cache=cache.v,
    )
    if tokens is not None:
        bound["tokens"] = tokens.to(torch.int64)
    return bound


def code_predictor_inputs(
    region: CompiledProgram,
    cache: KVCache,
    hidden: torch.Tensor,
    code0_embedding: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Weights + talker hidden and codebook-0 embedding (B, talker width) + the predictor's frame cache."""
    batch = region.program.constants.batch_size
    if hidden.shape[0] != batch or code0_embedding.shape != hidden.shape:
        raise ValueError(
            f"hidden and code0_embedding must be ({batch}, H), got {tuple(hidden.shape)}, "
            f"{tuple(code0_embedding.shape)}"
        )
    return dict(
        region.weights,
        hidden=hidden,
        code0_embedding=code0_embedding,
        positions=torch.zeros(batch, dtype=torch.int64),
        slots=torch.arange(batch, dtype=torch.int64),
        k_cache=cache.keys,
        v_cache=cache.values,
    )


def nh_decoder_inputs(
    region: CompiledProgram, cache: NhDecoderCache, rows: Sequence[int], x_in: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Weights + the summed codebook embeddings of one new position per row `x_in` (B, hidden) + each row's
    position, cache row and text length + NhDecoderCache's self and cross keys/values (read in place; the
    self keys/values of the new position are appended by the run). The caller advances cache.lengths by 1.
    ValueError for rows that are not allocated, have no encoder keys/values or no room left."""
    batch = region.program.constants.batch_size
    rows = [int(r) for r in rows]
    if len(rows) != batch or x_in.shape[0] != batch:
        raise ValueError(f"region was compiled for batch {batch}, got {len(rows)} rows and x_in {tuple(x_in.shape)}")
    bad = [
        r
        for r in rows
        if not cache.is_allocated(r) or cache.text_lengths[r] < 1 or cache.lengths[r] + 1 > region.max_context
    ]
    if bad:
        raise ValueError(
            f"cache rows {bad} are not allocated, have no encoder keys/values or are full (max_context "
            f"{region.max_context})"
        )
    index = torch.tensor(rows, dtype=torch.int64, device=cache.text_lengths_device.device)
    return dict(
        region.weights,
        x_in=x_in,
        positions=torch.tensor([cache.lengths[r] for r in rows], dtype=torch.int64),
        slots=torch.tensor(rows, dtype=torch.int64),
        text_lengths=cache.text_lengths_device[index],
        k_cache=cache.self_k,
        v_cache=cache.self_v,
        cross_k_cache=cache.cross_k,
        cross_v_cache=cache.cross_v,
    )
