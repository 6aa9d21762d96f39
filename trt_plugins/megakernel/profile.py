"""Summarise a profiled megakernel launch: where the time of each instruction kind went.

`BoundLaunch(profile=True)` records, per queue position, the %globaltimer ns when the record was read,
when its counter waits were satisfied and when it finished. `summarize_profile` turns that into per-
opcode counts, mean/median execution and wait times (us) and the launch's span, so benchmarks can say
whether a region is bound by streaming, by dependencies or by instruction overhead. `critical_path` walks
back from the last instruction to finish and splits the launch's span into what held it: instruction
execution per opcode, the hand-off from a producer's end to its consumer seeing the counter, the wait
itself when nothing was pending, and the gap between two instructions of one queue.
Imports: torch and trt_plugins.megakernel.instructions.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from tilevox.trt_plugins.megakernel.instructions import NO_ID, Program

__all__ = ["critical_path", "fit_streaming_cost", "summarize_profile"]


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
        "RMSNORM_LINEAR",
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


def critical_path(program: Program, timestamps: torch.Tensor) -> dict[str, Any]:
    """Where the span of one profiled launch went, along its critical path (times in microseconds).

    Per instruction the stamps give start (record read), waited (counters satisfied) and done (after the
    block's barrier, before the release). Its producers are the instructions signalling the counters it
    waits on. Walking back from the last `done`: an instruction whose producers finished after it started
    was held by them (the step goes to the latest producer, and `handoff` = waited - that producer's done
    is the release, the counter's trip through L2 and the poll); otherwise it was held by its own queue
    (the step goes to the previous instruction there, with the gap between that one's done and this
    one's start: the release and the loop). Along the path: execution (done - waited) per opcode,
    hand-offs, waits that found their counters complete (waited - start, no producer pending) and queue
    gaps; they sum to the span. Also the hand-off distribution over every producer-held instruction."""
    stamps = timestamps.cpu().tolist()
    where: dict[int, tuple[int, int]] = {}
    for q, queue in enumerate(program.queues):
        for pos, index in enumerate(queue):
            where[index] = (q, pos)
    signalers: dict[int, list[int]] = {}
    for index, inst in enumerate(program.instructions):
        if inst.signal != NO_ID:
            signalers.setdefault(inst.signal, []).append(index)

    def stamp(index: int) -> tuple[int, int, int]:
        q, pos = where[index]
        start, waited, done = stamps[q][pos]
        return start, waited, done

    def latest_producer(index: int) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for wait in program.instructions[index].waits:
            for producer in signalers.get(wait.counter_id, []):
                done = stamp(producer)[2]
                if best is None or done > best[1]:
                    best = (producer, done)
        return best

    t0 = min(stamps[q][0][0] for q, queue in enumerate(program.queues) if queue)
    handoffs = []
    for index in where:
        producer = latest_producer(index)
        start, waited, _ = stamp(index)
        if producer is not None and producer[1] > start:
            handoffs.append((waited - producer[1]) / 1e3)
    last = max(where, key=lambda i: stamp(i)[2])
    span_us = (stamp(last)[2] - t0) / 1e3
    exec_us: dict[str, float] = {}
    totals = {"handoff_us": 0.0, "idle_wait_us": 0.0, "queue_gap_us": 0.0, "launch_us": 0.0}
    counts = {"instructions": 0, "handoffs": 0}
    index: int | None = last
    while index is not None:
        start, waited, done = stamp(index)
        name = program.instructions[index].opcode.name
        exec_us[name] = exec_us.get(name, 0.0) + (done - waited) / 1e3
        counts["instructions"] += 1
        producer = latest_producer(index)
        q, pos = where[index]
        if producer is not None and producer[1] > start:
            totals["handoff_us"] += (waited - producer[1]) / 1e3
            counts["handoffs"] += 1
            index = producer[0]
        else:
            totals["idle_wait_us"] += (waited - start) / 1e3
            if pos == 0:
                totals["launch_us"] += (start - t0) / 1e3
                index = None
            else:
                totals["queue_gap_us"] += (start - stamps[q][pos - 1][2]) / 1e3
                index = program.queues[q][pos - 1]
    handoffs.sort()

    def quantile(p: float) -> float:
        return handoffs[min(len(handoffs) - 1, int(p * len(handoffs)))] if handoffs else 0.0

    return {
        "span_us": span_us,
        "path": {**counts, **totals, "exec_us": dict(sorted(exec_us.items(), key=lambda kv: -kv[1]))},
        "handoff_us": {
            "count": len(handoffs),
            "median": quantile(0.5),
            "p90": quantile(0.9),
            "max": handoffs[-1] if handoffs else 0.0,
        },
    }
