"""Qwen3-TTS codec decode of one new frame: its sliding-window transformer as a megakernel region against the
same transformer's conventional step, and the whole frame decode for scale, per batch size.

Rows (batch 1 / 8 / 32 / 64 by default, random bf16 weights of the 12 Hz decoder, every stream 100 frames in,
past the 72-frame window): the transformer step (input projection, 8 sliding-window layers, final norm and
output projection) eagerly, replayed from a CUDA graph, under torch.compile(mode="reduce-overhead"), and as a
megakernel region launched eagerly and from a CUDA graph; the whole incremental decode of one frame
(`decode_incremental`, RVQ to waveform) from a CUDA graph, and the same frame with the region in place of the
transformer (decode_front and decode_back from CUDA graphs of their own, the region's launch between them, with
the largest sample difference to decode_incremental over 4 frames); the weight-read floor of the transformer at
4.8 TB/s. As served: the executor's graphed codec decode (decode_slots of a pool's rows) against the megakernel
backend (executor.megakernel.MegakernelCodecDecode: the whole call one CUDA graph with the region in it).
CUDA events, medians. Each row also reports the largest difference between the region's output and the
conventional step's, and both against an fp32 twin of the transformer, over --accuracy-frames frames (the
stated bf16 bound: the region no further from fp32 than 1.25 x the conventional bf16 step, + 1e-3 of the scale).
CPU smoke: --device cpu --executor vm --preset tiny --batches 1,2 --no-compile --iters 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.common import add_tiling_args, apply_tiling_args, device_name, utc_now
from benchmarks.megakernel_correctness import Launcher
from benchmarks.timing import capture, median_ms
from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region, region_compiler
from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, random_speech_tokenizer

FLOOR_BANDWIDTH_BYTES_S = 4.8e12  # H200 HBM3e peak, as benchmarks/megakernel_h200.py
TARGET_MS = {1: 0.5, 32: 2.0}  # issue 13: codec decode of one new frame (the whole decode, not only this part)
START_FRAME = 100


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _timed(fn: Callable[[], object], args, device, before=None) -> dict:
    """{"ms": median} or {"error": message}: a variant that fails is reported, never dropped."""
    try:
        return {"ms": median_ms(fn, iters=args.iters, warmup=args.warmup, device=device, before=before)}
    except Exception as exc:  # noqa: BLE001 - one variant's failure is part of the report
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return {"error": _error(exc)}


def bench_batch(decoder, batch: int, args, device: torch.device, tiling: TilingConfig) -> dict:
    transformer = decoder.pre_transformer
    cfg = decoder.config
    gen = torch.Generator().manual_seed(batch)
    dtype = transformer.norm.weight.dtype
    state = decoder.new_state(batch)
    window = cfg.sliding_window
    for ring in (state.keys, state.values):  # earlier frames, any values: one copy, then its twin
        ring[..., :window, :].copy_(torch.randn(ring[..., :window, :].shape, generator=gen).to(dtype))
        ring[..., window:, :].copy_(ring[..., :window, :])
    state.positions.fill_(START_FRAME)
    x = torch.randn(batch, 1, cfg.latent_dim, generator=gen).to(device=device, dtype=dtype)
    codes = torch.randint(0, cfg.codebook_size, (batch, cfg.num_quantizers, 1), generator=gen).to(device)
    row: dict = {"batch": batch}
    weight_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
    row["transformer_weight_bytes"] = weight_bytes
    row["floor_ms"] = weight_bytes / FLOOR_BANDWIDTH_BYTES_S * 1e3

    # The region, bound to the rings of a copy of the state (DecoderState.keys / values are its k_cache /
    # v_cache layout), which decode_front / decode_back of the frames through the region also advance.
    region = compile_region(
        transformer, RegionSpec(lm_head=True), batch_size=batch, tiling=tiling, num_sms=args.num_sms
    )
    mk_state = copy.deepcopy(state)
    bound = {
        **{name: t.to(device) for name, t in region.weights.items()},
        "x_in": x[:, 0].contiguous(),
        "positions": torch.full((batch,), START_FRAME, dtype=torch.int64, device=device),
        "slots": torch.arange(batch, device=device),
        "k_cache": mk_state.keys,
        "v_cache": mk_state.values,
    }
    launcher = Launcher(region.program, bound, args.executor)

    x_in, x_out, pos_in = (launcher.tensors[name] for name in ("x_in", "x_out", "positions"))

    def front() -> None:  # RVQ and pre-conv, their output into the region's input
        x_in.copy_(decoder.decode_front(codes, mk_state)[:, 0])
        pos_in.copy_(mk_state.positions)

    def back() -> torch.Tensor:  # the region's output through the upsamplers and the decoder
        return decoder.decode_back(x_out[:, None], mk_state)

    with torch.no_grad():
        row.update(_accuracy(transformer, state, launcher, args.accuracy_frames, gen))
        mk_state.positions.copy_(launcher.tensors["positions"])
        row.update(_frame_accuracy(decoder, mk_state, codes, front, launcher, back, gen))
        for held in (state, mk_state):
            held.positions.fill_(START_FRAME)
        pos_in.fill_(START_FRAME)
        row["transformer_eager"] = _timed(lambda: transformer(x, state), args, device)
        row["megakernel_eager"] = _timed(launcher.launch, args, device)
        if device.type == "cuda":
            row["transformer_graph"] = _timed(capture(lambda: transformer(x, state), device), args, device)
            row["megakernel_graph"] = _timed(capture(launcher.launch, device), args, device)
            reset = lambda: state.positions.fill_(START_FRAME)  # noqa: E731 - decode_incremental advances them
            row["frame_decode_graph"] = _timed(
                capture(lambda: decoder.decode_incremental(codes, state), device, before=reset), args, device, reset
            )
            # The same frame with the transformer as the region: front and back each from a CUDA graph of
            # their own, the region's launch between them from a third.
            mk_reset = lambda: mk_state.positions.fill_(START_FRAME)  # noqa: E731
            parts = [capture(front, device, before=mk_reset), capture(launcher.launch, device), capture(back, device)]
            row["frame_decode_with_region_graph"] = _timed(lambda: [part() for part in parts], args, device, mk_reset)
            if args.compile:
                compiled = torch.compile(lambda: transformer(x, state), mode="reduce-overhead")
                row["transformer_compiled"] = _timed(compiled, args, device)
        row.update(_served(decoder, state, codes, args, device, tiling))
        launcher.check_error()
    return row


def _served(decoder, state, codes, args, device: torch.device, tiling: TilingConfig) -> dict:
    """The codec decode as served (the CODEC_DECODE region of a pool of 2 x batch streams, every other row
    decoding): the executor's graphed decode_slots against the megakernel backend (the whole call one CUDA graph
    with the region's launch in it), each on a pool of its own filled from the same state."""
    from tilevox.executor.graphs import GraphedCodecDecode
    from tilevox.executor.megakernel import BackendOptions, Executor, MegakernelCodecDecode

    batch = state.batch_size
    slots = torch.arange(0, 2 * batch, 2, device=device)
    backends = {
        "served_decode_graph": GraphedCodecDecode(decoder),
        "served_decode_megakernel": MegakernelCodecDecode(
            decoder,
            BackendOptions(compiler=region_compiler(tiling), num_sms=args.num_sms, executor=Executor(args.executor)),
        ),
    }
    out, first = {}, {}
    for name, backend in backends.items():
        pool = decoder.new_state(2 * batch)
        pool.put(slots, state)
        first[name] = backend(codes, pool, slots).float()  # the same frame from the same state on both
        out[name] = _timed(lambda backend=backend, pool=pool: backend(codes, pool, slots), args, device)
        if isinstance(backend, MegakernelCodecDecode):
            backend.check()
    names = list(backends)
    out["served_max_abs_sample_diff"] = (first[names[0]] - first[names[1]]).abs().max().item()
    return out


def _accuracy(transformer, state, launcher: Launcher, frames: int, gen: torch.Generator) -> dict:
    """`frames` consecutive frames through the region, the conventional step (same dtype) and an fp32 twin of the
    transformer, each from the same state: the largest differences per frame, max over frames. The region passes
    when it is no further from the fp32 step than the conventional step is, up to 1.25x (the correctness matrix's
    bf16 factor) plus 1e-3 of the output's scale."""
    twin = copy.deepcopy(transformer).float()
    twin_state = copy.deepcopy(state)
    twin_state.keys, twin_state.values = twin_state.keys.float(), twin_state.values.float()
    x_in, positions = launcher.tensors["x_in"], launcher.tensors["positions"]
    region_diff = conventional_diff = region_vs_conventional = scale = 0.0
    for _ in range(frames):
        x = torch.randn(x_in.shape, generator=gen).to(x_in)
        x_in.copy_(x)
        launcher.launch()
        out = transformer(x[:, None], state)[:, 0].float()
        ref = twin(x[:, None].float(), twin_state)[:, 0]
        mk = launcher.tensors["x_out"].float()
        region_diff = max(region_diff, (mk - ref).abs().max().item())
        conventional_diff = max(conventional_diff, (out - ref).abs().max().item())
        region_vs_conventional = max(region_vs_conventional, (mk - out).abs().max().item())
        scale = max(scale, ref.abs().max().item())
        for held in (state, twin_state):
            held.positions.add_(1)
        positions.add_(1)
    launcher.check_error()
    return {
        "accuracy_frames": frames,
        "region_max_abs_diff_vs_fp32": region_diff,
        "conventional_max_abs_diff_vs_fp32": conventional_diff,
        "region_max_abs_diff": region_vs_conventional,
        "fp32_output_scale": scale,
        "accuracy_passed": region_diff <= 1.25 * conventional_diff + 1e-3 * scale,
    }


def _frame_accuracy(decoder, state, codes, front, launcher: Launcher, back, gen: torch.Generator, frames: int = 4):
    """`frames` whole frame decodes with the transformer as the region (front, region, back, all on `state`,
    whose rings the region binds) against decode_incremental from a copy of the same state: the largest sample
    difference, and the samples' scale."""
    reference = copy.deepcopy(state)
    diff = scale = 0.0
    for _ in range(frames):
        codes.copy_(torch.randint(0, decoder.config.codebook_size, codes.shape, generator=gen))
        ref = decoder.decode_incremental(codes, reference).float()
        front()
        launcher.launch()
        out = back().float()
        diff = max(diff, (out - ref).abs().max().item())
        scale = max(scale, ref.abs().max().item())
    launcher.check_error()
    return {"frame_max_abs_sample_diff": diff, "frame_sample_scale": scale}


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "-"
    return f"{entry['ms']:.3f}" if "ms" in entry else "error"


def format_table(report: dict) -> str:
    head = (
        "| batch | transformer eager | transformer graph | torch.compile | megakernel | megakernel graph | "
        "floor | whole frame decode (graph) | frame decode with the region (graphs) | vs fp32: megakernel / "
        "conventional | frame samples max abs diff | served decode: graph / megakernel |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in report["rows"]:
        lines.append(
            f"| {r['batch']} | {_cell(r.get('transformer_eager'))} | {_cell(r.get('transformer_graph'))} | "
            f"{_cell(r.get('transformer_compiled'))} | {_cell(r.get('megakernel_eager'))} | "
            f"{_cell(r.get('megakernel_graph'))} | {r['floor_ms']:.3f} | {_cell(r.get('frame_decode_graph'))} | "
            f"{_cell(r.get('frame_decode_with_region_graph'))} | "
            f"{r['region_max_abs_diff_vs_fp32']:.2e} / {r['conventional_max_abs_diff_vs_fp32']:.2e}"
            f"{'' if r['accuracy_passed'] else ' FAIL'} | {r['frame_max_abs_sample_diff']:.2e} | "
            f"{_cell(r.get('served_decode_graph'))} / {_cell(r.get('served_decode_megakernel'))} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--executor", choices=("cuda", "vm"), default="cuda")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="12hz")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-sms", type=int, default=132)
    parser.add_argument("--accuracy-frames", type=int, default=16, help="frames compared with the fp32 step")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", type=Path)
    add_tiling_args(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        args.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiling = apply_tiling_args(TilingConfig(), args)
    decoder, _ = random_speech_tokenizer(
        PRESETS[args.preset], seed=0, device=device, dtype=getattr(torch, args.dtype), with_encoder=False
    )
    rows = [bench_batch(decoder, int(b), args, device, tiling) for b in args.batches.split(",")]
    report = {
        "benchmark": "megakernel_codec",
        "device": device_name(device.type),
        "date": utc_now(),
        "commit": args.commit,
        "torch": torch.__version__,
        "preset": args.preset,
        "dtype": args.dtype,
        "executor": args.executor,
        "tiling": tiling.to_dict(),
        "start_frame": START_FRAME,
        "targets_ms_whole_frame_decode": {str(k): v for k, v in TARGET_MS.items()},
        "rows": rows,
    }
    table = format_table(report)
    print(table)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
