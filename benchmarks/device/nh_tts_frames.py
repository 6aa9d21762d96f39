"""NH-TTS (Dia-1.6B shapes) region timings: (a) the text encoder of a request (both guidance rows), (b) one
decoder step with classifier-free guidance (2 rows per stream), (c) one DAC chunk decode (the streaming
window: left context + chunk + lookahead frames), at each batch size, eager and captured in a CUDA graph
(torch.cuda.CUDAGraph over static buffers; CUDA only). Medians of --reps timings after --warmup runs.

    python -m benchmarks.device.nh_tts_frames --out results/nh_tts_frames_h200.json                # CUDA, bf16
    python -m benchmarks.device.nh_tts_frames --device cpu --model random:nh-tts-tiny --out /tmp/x.json

The JSON records the device name, torch version, UTC date, $TILEVOX_COMMIT and every median (ms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tilevox.models.dac.model import decoder_reach_frames
from tilevox.models.dac.streaming import DEFAULT_CHUNK_FRAMES
from tilevox.models.nh_tts.model import NhTtsModel
from tilevox.models.registry import load_model, parse_dtype


def _time(fn: Callable[[], object], *, device: torch.device, reps: int, warmup: int) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU, perf_counter on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
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
    return statistics.median(times)


def _graphed(fn: Callable[[], object], *, warmup: int) -> Callable[[], object]:
    """Capture `fn` (static inputs and outputs) in a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 2)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.inference_mode()
def measure(model: NhTtsModel, *, batch: int, text_len: int, context: int, reps: int, warmup: int, graphs: bool):
    network, codec, device = model.network, model.codec, model.device
    config = network.config
    rows = 2 * batch  # conditional + unconditional per stream
    out: dict[str, float] = {}
    generator = torch.Generator(device="cpu").manual_seed(0)

    # (a) encoder: `batch` requests of text_len bytes, both guidance rows.
    ids = torch.randint(3, 256, (rows, text_len), generator=generator).to(device)
    ids[batch:] = 0
    valid = torch.ones(rows, text_len, dtype=torch.bool, device=device)
    out["encoder_ms"] = _time(lambda: network.encode_text(ids, valid), device=device, reps=reps, warmup=warmup)

    # (b) one decoder step of every row at position `context`, cross-attending text_len positions.
    cache = network.new_cache(max_rows=rows, max_seq_len=context + 1, max_text_len=text_len)
    cache.claim(list(range(rows)))
    network.decoder.write_cross(cache, list(range(rows)), network.encode_text(ids, valid), valid)
    index = torch.arange(rows, device=device)
    positions = torch.full((rows, 1), context, dtype=torch.long, device=device)
    codes = torch.randint(0, config.num_codes, (rows, 1, config.num_channels), generator=generator).to(device)

    def step():
        hidden = network.decoder.forward_static(cache, index, positions, codes, num_keys=context + 1, num_text=text_len)
        return network.logits_dense(hidden)

    out["decoder_step_ms"] = _time(step, device=device, reps=reps, warmup=warmup)

    # (c) one DAC chunk decode per stream: windows of left context + chunk + lookahead frames.
    left, right = decoder_reach_frames(codec.config)
    frames = left + DEFAULT_CHUNK_FRAMES + right
    dac_codes = torch.randint(0, codec.codebook_size, (batch, codec.num_codebooks, frames), generator=generator)
    dac_codes = dac_codes.to(device)
    lengths = torch.full((batch,), frames, dtype=torch.long, device=device)
    chunk = lambda: codec.decode_windows(dac_codes, lengths)  # noqa: E731
    out["dac_chunk_ms"] = _time(chunk, device=device, reps=reps, warmup=warmup)
    out["dac_chunk_frames"] = frames

    if graphs and device.type == "cuda":
        for name, fn in (
            ("encoder", lambda: network.encode_text(ids, valid)),
            ("decoder_step", step),
            ("dac_chunk", chunk),
        ):
            try:
                replay = _graphed(fn, warmup=warmup)
            except RuntimeError as exc:  # recorded in the JSON: a region that cannot be captured as it is written
                out[f"{name}_graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
                torch.cuda.synchronize()
                continue
            out[f"{name}_graph_ms"] = _time(replay, device=device, reps=reps, warmup=warmup)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:nh-tts-1.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="bf16 on CUDA, fp32 on CPU unless given")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--text-len", type=int, default=256, help="text bytes per request")
    parser.add_argument("--context", type=int, default=512, help="decoder position of the timed step")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.reps < 20:
        parser.error("--reps must be at least 20")
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    model = load_model(args.model, device=device, dtype=dtype)
    if not isinstance(model, NhTtsModel):
        parser.error(f"{args.model} is not an NH-TTS model")
    text_len = min(args.text_len, model.max_text_len)
    context = min(args.context, model.max_seq_len - 1)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        results[str(batch)] = measure(
            model,
            batch=batch,
            text_len=text_len,
            context=context,
            reps=args.reps,
            warmup=args.warmup,
            graphs=not args.no_graphs,
        )
        print(f"batch {batch}: {results[str(batch)]}", flush=True)
    record = {
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("TILEVOX_COMMIT", "unknown"),
        "text_len": text_len,
        "context": context,
        "reps": args.reps,
        "warmup": args.warmup,
        "statistic": "median",
        "rows_per_stream": 2,
        "results_ms_by_batch": results,
    }
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=2)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
