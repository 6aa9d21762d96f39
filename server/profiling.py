"""A profile of the live model worker (`tilevox serve --profile-steps N`): where a served step's time goes.

A step measured alone (benchmarks/frame_breakdown.py) and the same step inside the server can differ by
the worker's own Python (admission, batch picking, chunk delivery, metrics) and by waits for the GIL
while the event loop sends audio. This profiles N worker iterations that step at least `min_batch`
streams, after `skip` such iterations: cProfile of the worker thread (the Python it runs) and, on a GPU,
torch.profiler's operator and kernel tables; the report also gives each iteration's wall time against the
device time of its kernels. Off unless asked for; it slows the profiled iterations (cProfile's hooks, which
on Python >= 3.12 see every thread, the event loop's included), and the worker pauses while the report is
written (seconds to a minute for a few hundred GPU steps): profile a server no client depends on.
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
import statistics
import time
from pathlib import Path

from tilevox.server.logs import log_event

__all__ = ["WorkerProfile"]

log = logging.getLogger("tilevox.profile")


class WorkerProfile:
    """Called by the worker thread around each iteration: `begin(batch_size)` then `end()`."""

    def __init__(self, steps: int, out: str | Path, *, skip: int = 50, min_batch: int = 1, cuda: bool = False):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        if min_batch < 1:
            raise ValueError(f"min_batch must be >= 1, got {min_batch}")
        self.steps, self.skip, self.min_batch, self.cuda = steps, skip, min_batch, cuda
        self.out = Path(out)
        self.done = False
        self._seen = 0  # iterations with a batch of at least min_batch
        self._wall: list[float] = []
        self._periods: list[float] = []
        self._batches: list[int] = []
        self._started_at = 0.0
        self._cprofile: cProfile.Profile | None = None
        self._torch = None
        self._active = False

    def begin(self, batch_size: int) -> None:
        if self.done or batch_size < self.min_batch:
            return
        self._seen += 1
        if self._seen <= self.skip:
            return
        if self._cprofile is None:
            self._start()
        now = time.perf_counter()
        if self._started_at:
            self._periods.append(now - self._started_at)  # begin to begin: the step plus what runs between
        self._active = True
        self._batches.append(batch_size)
        self._started_at = now

    def end(self) -> None:
        if not self._active:
            return
        self._active = False
        self._wall.append(time.perf_counter() - self._started_at)
        if len(self._wall) >= self.steps:
            self._finish()

    def _start(self) -> None:
        if self.cuda:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._torch = torch.profiler.profile(activities=activities)
            self._torch.start()
        self._cprofile = cProfile.Profile()
        self._cprofile.enable()  # this thread (the worker) only

    def _finish(self) -> None:
        assert self._cprofile is not None
        self._cprofile.disable()
        self.done = True
        report = io.StringIO()
        wall_ms = [w * 1e3 for w in self._wall]
        period_ms = [p * 1e3 for p in self._periods] or [float("nan")]
        report.write(
            f"tilevox worker profile: {len(wall_ms)} iterations with >= {self.min_batch} streams after {self.skip}; "
            f"batch mean {statistics.fmean(self._batches):.1f}; iteration wall ms median "
            f"{statistics.median(wall_ms):.2f}, mean {statistics.fmean(wall_ms):.2f}, max {max(wall_ms):.2f}; "
            f"step to step ms median {statistics.median(period_ms):.2f}, mean {statistics.fmean(period_ms):.2f} "
            "(admissions, prefills and waits between steps included; cProfile's hooks inflate the Python parts)\n"
        )
        if self._torch is not None:
            import torch

            torch.cuda.synchronize()
            self._torch.stop()
            averages = self._torch.key_averages()
            device_us = sum(  # kernels and copies: not the device-side mirrors of record_function ranges
                e.self_device_time_total
                for e in averages
                if e.device_type.name == "CUDA" and not e.key.startswith(("tilevox.", "aten::"))
            )
            report.write(
                f"device: kernels {device_us / 1e3 / len(wall_ms):.2f} ms per iteration of "
                f"{statistics.fmean(wall_ms):.2f} ms of step wall ({100 * device_us / 1e3 / sum(wall_ms):.0f}%)\n\n"
            )
            report.write("== torch.profiler, by self CPU time ==\n")
            report.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
            report.write("== torch.profiler, by device time ==\n")
            report.write(averages.table(sort_by="self_device_time_total", row_limit=30) + "\n")
        for key in ("tottime", "cumulative"):
            report.write(f"== cProfile of the worker thread, by {key} ==\n")
            stats = pstats.Stats(self._cprofile, stream=report)
            stats.sort_stats(key).print_stats(45)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(report.getvalue())
        log_event(log, "worker.profile_written", path=str(self.out), iterations=len(wall_ms))
