"""Time each part of one Qwen3-TTS frame: talker step, the code predictor's steps, codec decode.

Loads `random:<preset>` (default qwen3-tts-0.6b, bf16, cuda) with B streams at `--context` cached
tokens and times each part per batch size, eager and as a CUDA-graph replay (static buffers; CUDA
events; medians over --iters; a part that cannot be captured is reported with the error). The
predictor uses greedy argmax; replays only time (the same cache position/codec state is re-used).
Prints a table and writes JSON (device, date, git commit, torch version) to --out. CPU smoke run:
--device cpu --iters 2 --preset qwen3-tts-tiny (wall-clock timers, no graphs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import commit
from benchmarks.timing import capture, times_ms
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.loader import load_preset
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.registry import parse_dtype

PARTS = ("talker_step", "predictor_steps", "codec_decode_frame")


def _summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered),
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "iters": len(ordered),
    }


def _part_fns(model, batch: int, context: int) -> dict[str, Callable[[], object]]:
    """Closures over static buffers, one per frame part (each safe to capture in a CUDA graph)."""
    talker = model.talker
    device, dtype = model.device, model.dtype
    hidden_size = talker.config.transformer.hidden_size
    gen = torch.Generator(device=device).manual_seed(0)
    num_codes = talker.config.num_audio_codes
    inputs = torch.randn(batch, 1, hidden_size, generator=gen, device=device).to(dtype)
    start = torch.full((batch,), context, dtype=torch.long, device=device)
    # Every stream sits at `context` cached tokens; the step rewrites position `context` each time.
    view = CacheView(cache=model.cache, slots=slice(0, batch), start=start, kv_len=context + 1)

    def talker_step():
        return talker.forward_tokens(inputs, view)

    hidden = torch.randn(batch, hidden_size, generator=gen, device=device).to(dtype)
    code0 = torch.randint(0, num_codes, (batch,), generator=gen, device=device)
    predictor_cache = talker.code_predictor.new_cache(batch)

    def predictor_steps():
        return talker.code_predictor.predict(
            hidden, talker.embed_codec(code0), lambda head, logits: logits.argmax(-1), predictor_cache
        )

    decoder = model.codec_decoder
    num_books = talker.config.num_code_groups
    codebook = decoder.config.codebook_size
    frame = torch.randint(0, codebook, (batch, num_books, 1), generator=gen, device=device)
    state = decoder.new_state(batch)

    def codec_decode_frame():
        return decoder.decode_incremental(frame, state)

    return {"talker_step": talker_step, "predictor_steps": predictor_steps, "codec_decode_frame": codec_decode_frame}


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype)
    max_batch = max(args.batch_sizes)
    options = ModelOptions(max_streams=max_batch, max_seq_len=args.context + 16)
    model = load_preset(args.preset, device=device, dtype=dtype, options=options)
    results: dict[str, dict] = {}
    with torch.inference_mode():
        fns_by_batch = {batch: _part_fns(model, batch, args.context) for batch in args.batch_sizes}
        # Parts outer, codec decode last: a failed capture cannot disturb the parts timed before it.
        for part in PARTS:
            for batch in args.batch_sizes:
                fn = fns_by_batch[batch][part]
                entry = results.setdefault(part, {}).setdefault(f"b{batch}", {})
                entry["eager"] = _summary(times_ms(fn, iters=args.iters, warmup=args.warmup, device=device))
                if device.type != "cuda":
                    entry["cuda_graph"] = {"error": "CUDA graphs need a CUDA device"}
                    continue
                try:
                    replay = capture(fn, device)
                except Exception as exc:  # report any capture failure with its message, per part
                    entry["cuda_graph"] = {"error": f"capture failed: {type(exc).__name__}: {exc}".splitlines()[0]}
                    torch.cuda.synchronize(device)
                    continue
                entry["cuda_graph"] = _summary(times_ms(replay, iters=args.iters, warmup=args.warmup, device=device))
    return {
        "benchmark": "qwen3_tts_frame_timing",
        "preset": args.preset,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": commit(),
        "torch_version": torch.__version__,
        "context_tokens": args.context,
        "num_predictor_steps": model.talker.code_predictor.num_steps,
        "samples_per_frame": model.codec_decoder.config.samples_per_frame,
        "results": results,
    }


def _cell(entry: dict) -> str:
    return f"{entry['median_ms']:9.3f}" if "median_ms" in entry else "      n/a"


def format_table(report: dict) -> str:
    lines = [
        f"Qwen3-TTS frame parts: {report['preset']} {report['dtype']} on {report['device']}, "
        f"context {report['context_tokens']} tokens, median ms",
        f"{'part':<20} {'batch':>5} {'eager':>9} {'graph':>9}",
    ]
    notes = []
    for part, by_batch in report["results"].items():
        for key, entry in by_batch.items():
            lines.append(f"{part:<20} {key[1:]:>5} {_cell(entry['eager'])} {_cell(entry['cuda_graph'])}")
            if "error" in entry["cuda_graph"]:
                notes.append(f"  {part} {key}: graph {entry['cuda_graph']['error']}")
    return "\n".join(lines + (["notes:"] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-tts-0.6b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--dtype", default=None, choices=["fp32", "fp16", "bf16"], help="default: bf16 on cuda, fp32 on cpu"
    )
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per part (median reported)")
    parser.add_argument("--warmup", type=int, default=None, help="default: 5 on cuda, 1 on cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=256, help="cached tokens per stream during the talker step")
    parser.add_argument("--out", type=Path, required=True, help="JSON output path")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.context < 1 or min(args.batch_sizes) < 1:
        parser.error("--iters, --context and --batch-sizes must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA GPU is visible")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.warmup = args.warmup if args.warmup is not None else (5 if args.device == "cuda" else 1)
    report = run(args)
    print(format_table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
