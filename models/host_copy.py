"""Host <-> device copies that never drain the GPU's queue.

`torch.tensor(values, device="cuda")` and `tensor.cpu()` copy through pageable memory and synchronise the
current stream: the host waits for every kernel queued before the copy, and the GPU idles while the host
prepares what comes next. These go through pinned memory with asynchronous copies instead: `to_device`
is ordered after the work already queued without waiting for it (the caching host allocator keeps the
pinned buffer until the copy has run); `to_host` returns a pinned tensor that holds the values once the
stream reaches the copy (synchronise the stream or an event recorded after it). On a CPU device both are plain copies.
Imports: torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device", "to_host"]


def to_device(values: Sequence, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (numbers, or rows of numbers) as a tensor on `device`, with no host synchronisation."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`: on a GPU a pinned tensor filled asynchronously (valid once the current
    stream has reached this point: synchronise it, or an event recorded after this call, first)."""
    if tensor.device.type != "cuda":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
