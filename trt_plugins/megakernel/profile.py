"""Summarise a profiled megakernel launch: where the time of each instruction kind went.

`BoundLaunch(profile=True)` records, per queue position, the %globaltimer ns when the record was read,
when its counter waits were satisfied and when it finished. `summarize_profile` turns that into per-
opcode counts, mean/median execution and wait times (us) and the launch's span, so benchmarks can say
whether a region is bound by streaming, by dependencies or by instruction overhead.
Imports: torch and trt_plugins.megakernel.instructions.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from trt_plugins.megakernel.instructions import Program

__all__ = ["summarize_profile"]


def summarize_profile(program: Program, timestamps: torch.Tensor) -> dict[str, Any]:
    """timestamps: (queues, positions, 3) int64 from one launch. Times in microseconds."""
    stamps = timestamps.cpu().tolist()
    t0 = min(stamps[q][0][0] for q, queue in enumerate(program.queues) if queue)
    per_op: dict[str, dict[str, list[float]]] = {}
    end = t0
    busy = []
    for q, queue in enumerate(program.queues):
        queue_busy = 0.0
        for pos, index in enumerate(queue):
            start, waited, done = stamps[q][pos]
            name = program.instructions[index].opcode.name
            entry = per_op.setdefault(name, {"exec": [], "wait": [], "finish": []})
            entry["exec"].append((done - waited) / 1e3)
            entry["wait"].append((waited - start) / 1e3)
            entry["finish"].append((done - t0) / 1e3)
            queue_busy += (done - waited) / 1e3
            end = max(end, done)
        busy.append(queue_busy)
    span_us = (end - t0) / 1e3
    return {
        "span_us": span_us,
        "mean_queue_busy_pct": 100.0 * statistics.fmean(busy) / span_us if span_us > 0 else 0.0,
        "opcodes": {
            name: {
                "count": len(v["exec"]),
                "exec_us_mean": statistics.fmean(v["exec"]),
                "exec_us_median": statistics.median(v["exec"]),
                "wait_us_mean": statistics.fmean(v["wait"]),
                "total_exec_us": sum(v["exec"]),
                "last_finish_us": max(v["finish"]),
            }
            for name, v in sorted(per_op.items())
        },
    }
