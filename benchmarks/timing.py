"""The one timer of the benchmarks: run times of a callable on a device (CUDA events on a GPU, wall clock
after a sync on CPU), their median, and CUDA-graph capture of a callable."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["capture", "copy_bandwidth_gbs", "median_ms", "times_ms"]


def times_ms(
    fn: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    device: torch.device,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """`iters` run times of `fn` in ms after `warmup` untimed runs: CUDA events on a GPU, wall clock on CPU.
    `before` runs ahead of each run, outside the timed span (e.g. resetting positions)."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(
    fn: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    device: torch.device,
    before: Callable[[], object] | None = None,
) -> float:
    """Median of `times_ms`."""
    return statistics.median(times_ms(fn, iters=iters, warmup=warmup, device=device, before=before))


def copy_bandwidth_gbs(device: torch.device, *, iters: int) -> float:
    """Device-to-device copy of 1 GiB (64 MiB on CPU): bytes read + written per second."""
    src = torch.empty((1 << 30) if device.type == "cuda" else (1 << 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=iters, warmup=3, device=device)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def capture(
    fn: Callable[[], object], device: torch.device, before: Callable[[], object] | None = None
) -> Callable[[], object]:
    """Capture `fn` in a CUDA graph after warm-up runs on a side stream; returns the replay. `before`
    runs ahead of each warm-up run and of the capture, outside the graph."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            if before is not None:
                before()
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    if before is not None:
        before()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
