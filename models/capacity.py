"""How many streams fit: KV-cache slots sized from the GPU's free memory.

A model's loader calls `streams_that_fit` after its weights are on the device, with the bytes one stream
holds for its whole context (its KV-cache slot at the context length; codec and sampling state are small
and sit in the reserve). The reserve keeps room for activations, batched prefills, captured CUDA graphs
and the allocator's slack: the larger of RESERVE_BYTES and RESERVE_FRACTION of the device; it is sized for a
batched prefill of at most MAX_PREFILL_BATCH admissions (the scheduler's default, and the engine builder's
profile opens its streams in parts of that size), not for a prefill of every stream at once. The result is
capped at MAX_STREAMS (the executor's largest batch bucket). On a CPU there is nothing to size: the
loaders keep their fixed defaults. Imports: torch.
"""

from __future__ import annotations

import torch

__all__ = [
    "MAX_PREFILL_BATCH",
    "MAX_STREAMS",
    "RESERVE_BYTES",
    "RESERVE_FRACTION",
    "kv_bytes_per_stream",
    "streams_that_fit",
]

MAX_STREAMS = 256
MAX_PREFILL_BATCH = 16  # admissions prefilled in one batched launch
RESERVE_BYTES = 8 << 30
RESERVE_FRACTION = 0.10


def kv_bytes_per_stream(*, num_layers: int, num_kv_heads: int, head_dim: int, context: int, dtype: torch.dtype) -> int:
    """Keys and values of one stream's slot: layers x 2 x kv heads x head_dim x context positions."""
    return num_layers * 2 * num_kv_heads * head_dim * context * torch.empty((), dtype=dtype).element_size()


def streams_that_fit(device: torch.device, bytes_per_stream: int, *, free_bytes: int | None = None) -> int:
    """Streams whose slots fit in the free memory of `device` beside the reserve, in [1, MAX_STREAMS].
    Raises RuntimeError when not even one fits (say so rather than run out of memory mid-stream)."""
    if bytes_per_stream <= 0:
        raise ValueError(f"bytes_per_stream must be positive, got {bytes_per_stream}")
    if free_bytes is None:
        free_bytes, total = torch.cuda.mem_get_info(device)
    else:
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else free_bytes
    reserve = max(RESERVE_BYTES, int(RESERVE_FRACTION * total))
    fit = (free_bytes - reserve) // bytes_per_stream
    if fit < 1:
        raise RuntimeError(
            f"no stream fits: {free_bytes / 2**30:.1f} GiB free on {device}, {reserve / 2**30:.1f} GiB kept in "
            f"reserve, {bytes_per_stream / 2**20:.0f} MiB per stream; lower the context or free the GPU"
        )
    return int(min(fit, MAX_STREAMS))
