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

from tilevox.trt_plugins.megakernel.instructions import Program

__all__ = ["fit_streaming_cost", "summarize_profile"]


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
            inst = program.instructions[index]
            entry = per_op.setdefault(name, {"exec": [], "wait": [], "finish": [], "bytes": []})
            entry["bytes"].append(inst.weight_bytes + inst.kv_bytes + inst.activation_bytes)
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
                "bytes_mean": statistics.fmean(v["bytes"]),  # the cost model's bytes per instruction
                "last_finish_us": max(v["finish"]),
            }
            for name, v in sorted(per_op.items())
        },
    }


def fit_streaming_cost(
    summary: dict[str, Any],
    opcodes: tuple[str, ...] = (
        "OPROJ_RESIDUAL",
        "RMSNORM_GATEUP_SWIGLU",
        "DOWN_RESIDUAL",
        "RMSNORM_LMHEAD",
        "RMSNORM_QKV_ROPE_APPEND",
    ),
) -> dict[str, float]:
    """Least-squares fit of exec_us_mean = overhead_us + bytes_mean / per-SM bandwidth over the streaming
    (matrix-vector) opcodes of one summary: the two constants the region cost model assumes."""
    points = [(o["bytes_mean"], o["exec_us_mean"]) for name, o in summary["opcodes"].items() if name in opcodes]
    if len(points) < 2:
        raise ValueError(f"need at least two streaming opcodes in the profile, got {len(points)}")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("the streaming opcodes all move the same bytes: the fit is undetermined")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx  # us per byte
    return {
        "overhead_us": my - slope * mx,
        "sm_gb_per_s": (1e-3 / slope) if slope > 0 else float("inf"),  # bytes/us -> GB/s
        "points": len(points),
    }
