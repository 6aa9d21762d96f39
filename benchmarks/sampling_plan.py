"""GPU time of one batched draw (executor.sampling.sample_rows) with and without filter_plan's shortcuts,
side by side in one run: each variant captured in a CUDA graph and replayed, median of the replays.

    python -m benchmarks.sampling_plan --out sampling_plan.json

Vocabularies: Llasa's 193,800 tokens, the Qwen3-TTS talker's 3,072 and its code predictor's 2,048; rows
sample with top_k 50 and top_p 1 (both models' defaults), and with top_p 0.9 (the nucleus kept).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from tilevox.executor.sampling import filter_plan, sample_rows


def _graph_ms(fn, replays: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default="193800,3072,2048")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for top_p in (1.0, 0.9):
                logits = torch.randn(batch, vocab, device=device)
                temperature = torch.full((batch,), 0.8, device=device)
                top_k = torch.full((batch,), 50, dtype=torch.int64, device=device)
                top_ps = torch.full((batch,), top_p, device=device)
                seed = torch.arange(batch, dtype=torch.int64, device=device)
                counter = torch.zeros(batch, dtype=torch.int64, device=device)
                candidates, nucleus = filter_plan([50] * batch, [top_p] * batch, vocab)
                inputs = (logits, temperature, top_k, top_ps, seed, counter)
                plain = functools.partial(sample_rows, *inputs)
                shortcut = functools.partial(sample_rows, *inputs, candidates=candidates, nucleus=nucleus)
                full = _graph_ms(plain, args.replays)
                planned = _graph_ms(shortcut, args.replays)
                same = torch.equal(plain(), shortcut())
                row = {
                    "vocab": vocab,
                    "batch": batch,
                    "top_k": 50,
                    "top_p": top_p,
                    "plan": [candidates, nucleus],
                    "full_ms": round(full, 4),
                    "planned_ms": round(planned, 4),
                    "speedup": round(full / planned, 2),
                    "same_tokens": same,
                }
                rows.append(row)
                print(
                    f"vocab {vocab:>6} B={batch:>3} top_p {top_p}: full {full:.3f} ms, planned {planned:.3f} ms "
                    f"(x{full / planned:.2f}), same tokens {same}"
                )
    report = {
        "benchmark": "sampling_plan",
        "device": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
