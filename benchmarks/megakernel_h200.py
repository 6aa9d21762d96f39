"""Llama-1B full decode step: the CUDA megakernel (v1, CUDA-core matrix-vector) vs LlamaForCausalLM.decode.

Random bf16 weights on the GPU (models.llama "1b" preset), streams at context `--context` in a cache of
`--max-context` positions, one region per batch size compiled for the device's SM count. Times with CUDA
events (median of `--iters`): the megakernel launched eagerly and replayed from a CUDA graph, and the
conventional eager decode. Also the device-to-device copy bandwidth of the same run, the achieved weight
bandwidth, and a one-step agreement check (max |logit diff|, greedy token agreement) against decode.
Usage: python benchmarks/megakernel_h200.py --out results.json [--commit SHA]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch

from engine_builder.regions import RegionSpec, TilingConfig, compile_region
from engine_builder.regions.bindings import llama_decode_inputs, sampling_inputs
from models.llama.config import LlamaConfig
from models.llama.weights import random_llama
from models.sampling import SamplingParams
from trt_plugins.megakernel import run_program
from trt_plugins.megakernel.runtime import CudaProgram

# 64-key attention partitions: 16 per kv group at max context 1024, so attention spreads over more SMs.
TILING = TilingConfig(min_partition_tokens=64)


def _median_ms(fn, iters: int, warmup: int = 3, before=None) -> float:
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(iters):
        if before:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_bandwidth_gbs(iters: int) -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # bytes read + written


def _bench_batch(model, batch: int, context: int, max_context: int, iters: int, num_sms: int, vm_check: bool) -> dict:
    slots = list(range(batch))
    cache = model.new_cache(max_streams=batch, max_seq_len=max_context)
    for _ in slots:
        cache.allocate()
    gen = torch.Generator(device="cuda").manual_seed(batch)
    cache.k.normal_(0.0, 1.0, generator=gen)
    cache.v.normal_(0.0, 1.0, generator=gen)

    def reset_lengths():
        cache.lengths = [context] * batch

    reset_lengths()
    region = compile_region(model, RegionSpec.full_step(1), batch_size=batch, max_context=max_context,
                            num_cache_slots=batch, cache_len=max_context, num_sms=num_sms,
                            tiling=TILING)  # fmt: skip
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device="cuda", generator=gen)
    bound = {
        **llama_decode_inputs(region, cache, slots, tokens),
        **sampling_inputs([SamplingParams.greedy()] * batch, seeds=slots),
    }
    bound = {name: t.to("cuda") for name, t in bound.items()}
    launch = CudaProgram(region.program).bind(bound)
    k_before, v_before = cache.k.clone(), cache.v.clone()
    out = launch.launch(check=True)
    mk_logits = out["s0.logits"].float().clone()
    mk_tokens = out["s0.tokens"].clone()
    vm_agreement = None
    if vm_check:  # the oracle on the same device, same program, same inputs
        vm = run_program(region.program, {**bound, "k_cache": k_before, "v_cache": v_before})
        vm_agreement = {
            "max_abs_logit_diff": float((mk_logits - vm["s0.logits"].float()).abs().max()),
            "greedy_token_agreement": float((mk_tokens == vm["s0.tokens"]).float().mean()),
            "max_abs_k_cache_diff_vs_vm": float((cache.k.float() - vm["k_cache"].float()).abs().max()),
            "max_abs_v_cache_diff_vs_vm": float((cache.v.float() - vm["v_cache"].float()).abs().max()),
        }
        del vm
    del k_before, v_before
    reset_lengths()
    with torch.no_grad():
        ref_logits = model.decode(cache, slots, tokens).float()
    agreement = {
        "max_abs_logit_diff": float((mk_logits - ref_logits).abs().max()),
        "logit_scale_max_abs": float(ref_logits.abs().max()),
        "greedy_token_agreement": float((mk_tokens == ref_logits.argmax(-1)).float().mean()),
    }
    mk_eager = _median_ms(lambda: launch.launch(check=False), iters)
    launch.check_error()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch.launch(check=False)
    torch.cuda.current_stream().wait_stream(stream)
    mk_graph = _median_ms(graph.replay, iters)
    launch.check_error()

    def conventional():
        with torch.no_grad():
            model.decode(cache, slots, tokens)

    conv_eager = _median_ms(conventional, iters, before=reset_lengths)
    seen = set()
    weight_bytes = 0
    for t in region.weights.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weight_bytes += t.numel() * t.element_size()
    return {
        "batch": batch,
        "context": context,
        "instructions": len(region.program.instructions),
        "queues": len(region.program.queues),
        "predicted_ms": region.predicted_time_s * 1e3,
        "megakernel_eager_ms": mk_eager,
        "megakernel_graph_ms": mk_graph,
        "conventional_eager_ms": conv_eager,
        "weight_bytes": weight_bytes,
        "megakernel_weight_gbs": weight_bytes / (mk_graph * 1e-3) / 1e9,
        "agreement_vs_decode": agreement,
        "agreement_vs_vm": vm_agreement,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--vm-check-batches", default="8", help="batches also run through the VM oracle")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    model = random_llama(LlamaConfig.preset("1b"), seed=0, device="cuda", dtype=torch.bfloat16)
    copy_gbs = _copy_bandwidth_gbs(args.iters)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        vm_check = str(batch) in args.vm_check_batches.split(",")
        row = _bench_batch(model, batch, args.context, args.max_context, args.iters, props.multi_processor_count, vm_check)
        row["megakernel_weight_bw_pct_of_copy"] = 100.0 * row["megakernel_weight_gbs"] / copy_gbs
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        "benchmark": "llama-1b full decode step: megakernel v1 vs conventional eager decode",
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": args.commit,
        "torch": torch.__version__,
        "timing": f"CUDA events, median of {args.iters} after 3 warm-ups",
        "copy_bandwidth_gbs": copy_gbs,
        "tiling": {"min_partition_tokens": TILING.min_partition_tokens, "matvec_rows": TILING.matvec_rows,
                   "lm_head_rows": TILING.lm_head_rows},
        "conventional_graph": "not measured: LlamaForCausalLM.decode builds masks from host-side lengths",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
