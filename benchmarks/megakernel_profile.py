"""Where a megakernel launch spends its time: per-opcode execution and wait times from the kernel's own
%globaltimer stamps, and the launch time with and without the L2 weight prefetch, side by side.

Llama-1B full decode step (random bf16 weights on the GPU; `--vocab 128256 --tied` for Llama-3.2-1B,
default Llasa-1B's untied 193,800) at the given batches and context, or (`--model qwen3-tts-0.6b-predictor`) one
Qwen3-TTS-0.6B frame's code-predictor loop. Times: CUDA-graph replays, CUDA
events, median of `--iters`. Each row also gives the launch's critical path (`megakernel.profile.critical_path`:
execution per opcode, hand-offs, idle waits, queue gaps) and, with `--fingerprint`, a checksum of every non-scratch
buffer after the profiled launches (benchmarks.megakernel_variants compares builds with it).
Usage: python -m benchmarks.megakernel_profile --out profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import torch

from benchmarks.common import add_tiling_args, apply_tiling_args
from benchmarks.megakernel_conventional import random_talker
from benchmarks.timing import capture, median_ms
from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region
from tilevox.executor.megakernel_inputs import code_predictor_inputs, llama_decode_inputs, sampling_inputs
from tilevox.models.llama.config import LlamaConfig
from tilevox.models.llama.weights import random_llama
from tilevox.models.sampling import SamplingParams
from tilevox.trt_plugins.megakernel.instructions import BufferKind
from tilevox.trt_plugins.megakernel.profile import critical_path, fit_streaming_cost, summarize_profile
from tilevox.trt_plugins.megakernel.runtime import CudaProgram


def _graph_ms(launch, iters: int) -> float:
    """Median CUDA-graph replay time of one launch (the benchmark's own capture and timer)."""
    device = launch.program.device
    replay = capture(lambda: launch.launch(check=False), device)
    ms = median_ms(replay, iters=iters, warmup=3, device=device)
    launch.check_error()
    return ms


def _fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """A position-weighted sum of each tensor's 32-bit words (int64, exact): equal bytes, equal sums."""
    out = {}
    for name, t in sorted(tensors.items()):
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        raw = torch.nn.functional.pad(raw, (0, (-raw.numel()) % 4)).view(torch.int32)
        total = 0
        for start in range(0, raw.numel(), 1 << 24):
            part = raw[start : start + (1 << 24)].to(torch.int64)
            weights = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
            total += int((part * weights).sum().item())
        out[name] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument(
        "--model",
        choices=["llama", "qwen3-tts-0.6b-predictor"],
        default="llama",
        help="llama: the Llama-1B full step (--vocab, --tied); qwen3-tts-0.6b-predictor: one frame's code-predictor "
        "loop (15 heads, CODE_PREDICTOR_LOOP) with random weights",
    )
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--matvec-rows", type=int, default=16)
    parser.add_argument("--lm-head-rows", type=int, default=64)
    parser.add_argument("--min-partition-tokens", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    add_tiling_args(parser)
    parser.add_argument(
        "--fingerprint", action="store_true", help="checksum every non-scratch buffer after the launches"
    )
    args = parser.parse_args()
    torch.manual_seed(0)  # the cache contents and tokens: the same in every process (variants compare outputs)
    config = LlamaConfig.preset("1b")
    if args.vocab:
        config = config.with_vocab_size(args.vocab)
    if args.tied:
        config = dataclasses.replace(config, tie_word_embeddings=True)
    if args.model == "llama":
        model = random_llama(config, seed=0, device="cuda", dtype=torch.bfloat16)
    else:
        model = random_talker("qwen3-tts-0.6b", seed=0, device="cuda", dtype=torch.bfloat16)
    tiling = apply_tiling_args(
        TilingConfig(
            matvec_rows=args.matvec_rows,
            lm_head_rows=args.lm_head_rows,
            min_partition_tokens=args.min_partition_tokens,
        ),
        args,
    )
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        if args.model == "llama":
            cache = model.new_cache(max_streams=batch, max_seq_len=args.max_context)
            slots = [cache.allocate() for _ in range(batch)]
            cache.k.normal_()
            cache.v.normal_()
            cache.lengths = [args.context] * batch
            region = compile_region(
                model,
                RegionSpec.full_step(1),
                batch_size=batch,
                max_context=args.max_context,
                num_cache_slots=batch,
                cache_len=args.max_context,
                num_sms=num_sms,
                tiling=tiling,
            )
            tokens = torch.randint(0, config.vocab_size, (batch,), device="cuda")
            inputs = llama_decode_inputs(region, cache, slots, tokens)
        else:
            predictor = model.code_predictor
            region = compile_region(
                predictor, RegionSpec.code_predictor_loop(), batch_size=batch, num_sms=num_sms, tiling=tiling
            )
            width = model.config.transformer.hidden_size
            hidden = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
            cache = predictor.new_cache(batch)
            inputs = code_predictor_inputs(region, cache, hidden, torch.randn_like(hidden))
        bound = {**inputs, **sampling_inputs([SamplingParams.greedy()] * batch, seeds=list(range(batch)))}
        bound = {name: t.to("cuda") for name, t in bound.items()}
        program = CudaProgram(region.program)
        profiled = program.bind(bound, profile=True)
        profiled.launch(check=True)
        profiled.launch(check=True)  # second run: warm caches, as in the replays
        summary = summarize_profile(region.program, profiled.timestamps)
        path = critical_path(region.program, profiled.timestamps)
        fingerprint = None
        if args.fingerprint:  # every buffer but scratch: weights, inputs, outputs (logits, tokens) and caches
            kinds = {spec.name: spec.kind for spec in region.program.buffers}
            fingerprint = _fingerprint(
                {n: t for n, t in profiled.tensors.items() if kinds.get(n) is not BufferKind.SCRATCH}
            )
        row = {
            "batch": batch,
            "instructions": len(region.program.instructions),
            "predicted_ms": region.predicted_time_s * 1e3,
            "graph_ms_prefetch": _graph_ms(program.bind(bound, prefetch=True), args.iters),
            "graph_ms_no_prefetch": _graph_ms(program.bind(bound, prefetch=False), args.iters),
            "profile": summary,
            "streaming_fit": fit_streaming_cost(summary),
            "critical_path": path,
            "fingerprint": fingerprint,
        }
        print(
            f"batch {batch}: {len(region.program.instructions)} instructions, predicted {row['predicted_ms']:.3f} ms, "
            f"graph {row['graph_ms_prefetch']:.3f} ms (prefetch) / {row['graph_ms_no_prefetch']:.3f} ms (none), "
            f"profiled span {summary['span_us']:.0f} us, queues busy {summary['mean_queue_busy_pct']:.0f} %"
        )
        fit = row["streaming_fit"]
        print(
            f"  matrix-vector fit: {fit['overhead_us']:.2f} us per instruction + bytes at {fit['sm_gb_per_s']:.1f} GB/s per SM"
        )
        print(
            f"  {'opcode':<26}{'count':>7}{'exec us':>10}{'median':>9}{'wait us':>10}{'sum exec':>11}{'last end':>10}"
        )
        for name, o in summary["opcodes"].items():
            print(
                f"  {name:<26}{o['count']:>7}{o['exec_us_mean']:>10.2f}{o['exec_us_median']:>9.2f}"
                f"{o['wait_us_mean']:>10.2f}{o['total_exec_us']:>11.0f}{o['last_finish_us']:>10.0f}"
            )
        cp = path["path"]
        print(
            f"  critical path {path['span_us']:.0f} us over {cp['instructions']} instructions: "
            f"hand-offs {cp['handoff_us']:.0f} us ({cp['handoffs']}), idle waits {cp['idle_wait_us']:.0f}, "
            f"queue gaps {cp['queue_gap_us']:.0f}, launch {cp['launch_us']:.0f}; hand-off median "
            f"{path['handoff_us']['median']:.2f} us, p90 {path['handoff_us']['p90']:.2f}"
        )
        print("  path execution: " + ", ".join(f"{k} {v:.0f}" for k, v in cp["exec_us"].items()))
        rows.append(row)
        del cache, bound, program, profiled
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(
            {
                "benchmark": "megakernel per-opcode profile, "
                + ("Llama-1B full decode step" if args.model == "llama" else "Qwen3-TTS-0.6B code-predictor loop"),
                "model": args.model,
                "device": torch.cuda.get_device_name(0),
                "num_sms": num_sms,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": args.commit,
                "torch": torch.__version__,
                "vocab_size": config.vocab_size,
                "tied": config.tie_word_embeddings,
                "context": args.context,
                "max_context": args.max_context,
                "tiling": dataclasses.asdict(tiling),
                "rows": rows,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
