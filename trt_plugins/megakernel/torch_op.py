"""`tilevox::megakernel_launch`: a megakernel launch as a torch custom op (torch.library.custom_op).

The op takes a handle to a live `runtime.BoundLaunch` plus the tensors the launch reads and writes,
so torch (autograd checks, functionalization, torch.compile, CUDA-graph trees) sees every write:
`counters`, `error` and the bound STATE / OUTPUT / SCRATCH buffers are declared mutated. The launch
itself is BoundLaunch.launch (the C ABI `tilevox_megakernel_launch`): no host-to-device copy at launch
time (the pointer table was uploaded by `bind`), so `launch_op(bound, check=False)` is capturable in
a CUDA graph. Imports: torch, trt_plugins.megakernel.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from tilevox.trt_plugins.megakernel.instructions import BufferKind

if TYPE_CHECKING:
    from tilevox.trt_plugins.megakernel.runtime import BoundLaunch

__all__ = ["OP_NAME", "launch_op", "megakernel_launch"]

OP_NAME = "tilevox::megakernel_launch"
_WRITTEN = (BufferKind.STATE, BufferKind.OUTPUT, BufferKind.SCRATCH)

# Handles of live BoundLaunch objects: an op argument must be a torch type, so the launch is passed
# by an integer key. Weak values: registering a launch never keeps its buffers alive.
_LAUNCHES: weakref.WeakValueDictionary[int, BoundLaunch] = weakref.WeakValueDictionary()
_HANDLES: weakref.WeakKeyDictionary[BoundLaunch, int] = weakref.WeakKeyDictionary()
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


def _handle(bound: BoundLaunch) -> int:
    with _LOCK:
        handle = _HANDLES.get(bound)
        if handle is None:
            handle = next(_NEXT_HANDLE)
            _HANDLES[bound] = handle
            _LAUNCHES[handle] = bound
        return handle


def _split_buffers(bound: BoundLaunch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(written, read-only) device tensors of the launch: the bound buffers in program order, then the
    launch's own optional tables (profile timestamps: written; L2 prefetch table: read)."""
    written, read = [], []
    for spec in bound.program.program.buffers:
        (written if spec.kind in _WRITTEN else read).append(bound.tensors[spec.name])
    written += _optional(bound, "timestamps")
    read += _optional(bound, "prefetch_table")
    return written, read


def _optional(bound: BoundLaunch, name: str) -> list[torch.Tensor]:
    tensor = getattr(bound, name, None)
    return [] if tensor is None else [tensor]


@torch.library.custom_op(OP_NAME, mutates_args=("counters", "error", "outputs"))
def megakernel_launch(
    handle: int,
    counters: torch.Tensor,
    error: torch.Tensor,
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    check: bool,
) -> None:
    """Run the BoundLaunch registered under `handle` once on the current stream.

    counters, error: the launch's own; outputs: its STATE/OUTPUT/SCRATCH buffers (+ profile timestamps),
    written; inputs: its WEIGHT/INPUT buffers (+ prefetch table), read. check=True synchronizes and
    raises on a watchdog or fault."""
    for name, tensor in (("counters", counters), ("error", error), *(("a buffer", t) for t in (*outputs, *inputs))):
        if tensor.device.type != "cuda":
            raise ValueError(f"{OP_NAME} runs on CUDA tensors only; {name} is on {tensor.device}")
    bound = _LAUNCHES.get(handle)
    if bound is None:
        raise ValueError(f"{OP_NAME}: no live BoundLaunch has handle {handle} (use launch_op(bound))")
    if counters.data_ptr() != bound.counters.data_ptr() or error.data_ptr() != bound.error.data_ptr():
        raise ValueError(f"{OP_NAME}: counters / error are not the ones of BoundLaunch {handle}")
    # The kernel reads the pointer table uploaded at bind time: the tensors handed to torch must be
    # exactly those, or torch's view of what is written would be wrong.
    given = sorted(t.data_ptr() for t in (*outputs, *inputs))
    written, read = _split_buffers(bound)
    expected = sorted(t.data_ptr() for t in (*written, *read))
    if given != expected:
        raise ValueError(f"{OP_NAME}: the buffers passed are not those bound in BoundLaunch {handle}")
    bound.launch(check=check)


@megakernel_launch.register_fake
def _megakernel_launch_fake(handle, counters, error, outputs, inputs, check) -> None:
    return None


def launch_op(bound: BoundLaunch, *, check: bool = True) -> dict[str, torch.Tensor]:
    """`bound.launch(check=check)` through the torch op; returns the bound tensors by name, as launch does.
    Use check=False under CUDA-graph capture and `bound.check_error()` after the replay completes."""
    written, read = _split_buffers(bound)
    torch.ops.tilevox.megakernel_launch(_handle(bound), bound.counters, bound.error, written, read, check)
    return bound.tensors
