"""Where a served frame's time goes: `SpeechModel.step` of B open streams, whole and by phase.

For each model, batch size and executor setting (--graphs off: every op eager; on: the executor's
CUDA-graph regions; compiled: the same, Inductor-compiled before capture) this opens B streams with long
texts, runs warm-up steps (compilation and graph capture happen there: `warmup_s`), times a batched prefill
of B more admissions beside them (`prefill_ms_median`, open_streams of B requests, fewer where the model holds fewer), then times `step` twice:

- whole steps, as the server runs them (no extra syncs): wall clock per step with one sync after it;
- by phase: the models label their phases with `torch.profiler.record_function("tilevox.<phase>")`; here
  that name is replaced by a timer that synchronizes the device before and after each phase, so each
  phase's time includes its launches and its GPU work. What the phases leave out ("host, outside phases")
  is the step's Python bookkeeping. The synced run is slower than the whole one: it shows shares, the
  whole-step median shows the speed.

Streams that finish are replaced (outside the timed steps) so every step has B streams. Prints a table,
writes JSON (device, date, commit, torch). CPU smoke run: --device cpu --models llama-tiny --batches 1,2
--steps 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import commit, device_name, utc_now
from tilevox.engine_builder.profile import PhaseTimer, SteadyStreams, phases_timed
from tilevox.engine_builder.profile import synchronize as _sync
from tilevox.models.registry import load_model, parse_dtype


def profile_table(streams: SteadyStreams, steps: int, rows: int = 25) -> str:
    """torch.profiler over `steps` steps: the kernels (graph replays included) by total device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            streams.step()
            _sync(streams.model.device)
            streams.refill()
    return prof.key_averages().table(sort_by="device_time_total", row_limit=rows, max_name_column_width=70)


def prefill_profile(model, admissions: int, rows: int = 30) -> str:
    """cProfile of one batched prefill (open_streams of `admissions` requests, synchronized): the host's
    share of an admission, by function."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    extra = SteadyStreams(model, admissions, 60.0)
    _sync(model.device)
    profiler.disable()
    extra.close()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def measure(
    model, batch: int, *, warmup: int, steps: int, max_duration_s: float, profile_out: Path | None = None
) -> dict:
    device = model.device
    started = time.perf_counter()
    streams = SteadyStreams(model, batch, max_duration_s)
    try:
        for _ in range(warmup):
            streams.step()
            streams.refill()
        _sync(device)
        warmup_s = time.perf_counter() - started
        prefill = []
        admissions = min(batch, model.max_streams - batch)
        for _ in range(3 if admissions else 0):  # admissions in one batched prefill, beside the running streams
            start = time.perf_counter()
            extra = SteadyStreams(model, admissions, max_duration_s)
            _sync(device)
            prefill.append((time.perf_counter() - start) * 1e3)
            extra.close()
        whole = []
        for _ in range(steps):
            start = time.perf_counter()
            streams.step()
            _sync(device)
            whole.append((time.perf_counter() - start) * 1e3)
            streams.refill()
        per_step: list[dict[str, float]] = []
        synced = []
        for _ in range(steps):
            timer = PhaseTimer(device)
            with phases_timed(timer):
                start = time.perf_counter()
                streams.step()
                _sync(device)
                synced.append((time.perf_counter() - start) * 1e3)
            per_step.append(dict(timer.totals))
            streams.refill()
        if profile_out is not None:
            with profile_out.open("a") as f:
                f.write(f"== {batch} streams, {steps} steps\n{profile_table(streams, steps)}\n")
                if admissions:
                    f.write(
                        f"== one prefill of {admissions} admissions (cProfile)\n{prefill_profile(model, admissions)}\n"
                    )
    finally:
        streams.close()
    names = sorted({name for step in per_step for name in step})
    phases = {name: statistics.median(step.get(name, 0.0) for step in per_step) for name in names}
    phases["host, outside phases"] = statistics.median(
        total - sum(step.values()) for total, step in zip(synced, per_step)
    )
    step_ms = statistics.median(whole)
    frame_s = 1.0 / model.frame_rate_hz
    return {
        "batch": batch,
        "step_ms_median": step_ms,
        "step_ms_min": min(whole),
        "step_ms_synced_median": statistics.median(synced),
        "prefill_admissions": admissions,
        "prefill_ms_median": statistics.median(prefill) if prefill else None,
        "warmup_s": warmup_s,
        "phases_ms_median": phases,
        "audio_s_per_s": batch * frame_s / (step_ms * 1e-3),
        "real_time_per_stream": frame_s * 1e3 / step_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-tts-0.6b,llama-1b", help="random presets, comma separated")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument(
        "--graphs", default="off,on", help="executor settings to compare, comma separated: off, on, compiled"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-duration", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile-out", type=Path, default=None, help="append a torch.profiler kernel table per row")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    rows = []
    for preset in args.models.split(","):
        for graphs in args.graphs.split(","):
            model = load_model(f"random:{preset}", device=device, dtype=dtype)
            if graphs in ("on", "compiled"):
                from tilevox.executor import GraphOptions, install_graph_regions

                install_graph_regions(model, options=GraphOptions(compile=graphs == "compiled"))
            for batch in (int(b) for b in args.batches.split(",")):
                if args.profile_out is not None:
                    with args.profile_out.open("a") as f:
                        f.write(f"=== {preset}, cuda graphs {graphs}\n")
                row = {"model": preset, "graphs": graphs} | measure(
                    model,
                    batch,
                    warmup=args.warmup,
                    steps=args.steps,
                    max_duration_s=args.max_duration,
                    profile_out=args.profile_out,
                )
                rows.append(row)
                phases = ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms_median"].items())
                print(
                    f"{preset:16s} graphs={graphs:8s} B={batch:3d}  prefill {row['prefill_ms_median'] or 0:7.2f} ms  step {row['step_ms_median']:7.2f} ms  "
                    f"{row['audio_s_per_s']:7.1f} audio s/s  x{row['real_time_per_stream']:.2f} real time  "
                    f"| synced {row['step_ms_synced_median']:.2f} ms: {phases}",
                    flush=True,
                )
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report = {
        "benchmark": "frame_breakdown",
        "device": device_name(device.type),
        "date": utc_now(),
        "commit": commit(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "warmup": args.warmup,
        "steps": args.steps,
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
