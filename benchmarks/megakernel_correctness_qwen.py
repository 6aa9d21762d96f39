"""Megakernel correctness matrix for Qwen3-TTS: the frame's two regions and the codec's transformer region, each
against an fp32 PyTorch reference, by benchmarks/megakernel_correctness.py's rule.

Random bf16 weights (models.qwen3_tts.loader.randomize_network_; the codec's layer scales drawn N(0, 1) instead of
their 0.01 init, so that an error inside a layer is not scaled away). Each region is compiled per cell and run by
the CUDA megakernel, or by its PyTorch interpreter (the VM) on CPU. The reference is the same network in fp32
(TF32 off) on an fp32 copy of the bf16 weights' values, with its own fp32 caches holding the same initial values;
the conventional bf16 network, forced alike, gives the bf16 baseline.

- talker: the talker step (layers, final norm, codec head, greedy sampling of codebook 0) per batch x context, as
  the Llama matrix runs its step: keys and values N(0, 1) fill the cache to context - row % 3 positions in
  permuted slots, then --steps steps teacher-forced with the reference's codebook-0 argmax (the step's input is
  its talker embedding plus a fixed random text-track row).
- predictor: the whole code-predictor loop (15 heads) per batch over --frames frames of random talker hidden
  states and codebook-0 codes. Its context is always the frame's own positions, so it has no context axis. The
  loop feeds its own tokens forward, so the reference and the bf16 baseline are forced along the megakernel's
  tokens: every head's logits are compared at the same inputs, and a token that is not the reference's argmax
  must be a near-tie.
- codec: the codec's sliding-window transformer (input projection, layers, norm, output projection) per batch x
  context, where context is the frames a stream has decoded (rows at context - row % 3; past the window the
  ring wraps): random ring contents, then --steps frames of random inputs; its output against the reference's
  by the same bound (no tokens).

CPU smoke: --preset qwen3-tts-tiny --codec-preset tiny --device cpu --executor vm --batches 1,3 --contexts 2,9.
Writes JSON to --out (after every cell) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.common import add_executor_args, add_tiling_args, apply_executor_args, apply_tiling_args
from benchmarks.megakernel_conventional import random_talker
from benchmarks.megakernel_correctness import (
    DEFAULT_ATOL,
    DEFAULT_BF16_FACTOR,
    DEFAULT_RTOL,
    FULL_BATCHES,
    FULL_CONTEXTS,
    Launcher,
    Tolerance,
    error_entry,
    ints,
    run_and_report,
    step_stats,
    summarize_steps,
    sync,
)
from benchmarks.megakernel_correctness import row_text as token_row_text
from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region
from tilevox.engine_builder.regions.spec import region_spec
from tilevox.executor.megakernel_inputs import code_predictor_inputs, sampling_inputs
from tilevox.models.qwen3_tts.layers import CacheView
from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS, random_speech_tokenizer
from tilevox.models.region_backends import TALKER_STEP
from tilevox.models.sampling import SamplingParams

PARTS = ("talker", "predictor", "codec")


def _greedy(batch: int) -> dict[str, torch.Tensor]:
    return sampling_inputs([SamplingParams.greedy()] * batch, seeds=list(range(batch)))


def _launcher(program, bound: dict[str, torch.Tensor], device: torch.device, executor: str) -> Launcher:
    """The region's declared buffers from `bound`, on `device` (caches are bound as they are: in place)."""
    names = {spec.name for spec in program.buffers}
    return Launcher(program, {n: t.to(device) for n, t in bound.items() if n in names}, executor)


def _permuted_slots(batch: int, gen: torch.Generator, device: torch.device) -> tuple[int, torch.Tensor]:
    """A pool of batch + 1 slots (one stays unused) and the rows' slots, permuted."""
    num_slots = batch + 1
    return num_slots, torch.randperm(num_slots, generator=gen, device=device)[:batch]


# ---- talker step ---------------------------------------------------------------------------------------------


def talker_cell(talker, ref, batch: int, context: int, args, tol: Tolerance, gen: torch.Generator) -> dict:
    """`args.steps` teacher-forced talker steps of `batch` rows at context - row % 3 cached positions."""
    device = args.device
    cache_len = context + args.steps
    num_slots, slots = _permuted_slots(batch, gen, device)
    mk_cache = talker.new_cache(num_slots=num_slots, max_len=cache_len)
    mk_cache.keys.normal_(generator=gen)
    mk_cache.values.normal_(generator=gen)
    ref_cache = ref.new_cache(num_slots=num_slots, max_len=cache_len)
    ref_cache.keys.copy_(mk_cache.keys)
    ref_cache.values.copy_(mk_cache.values)
    base_cache = None
    if not args.no_bf16_baseline:
        base_cache = talker.new_cache(num_slots=num_slots, max_len=cache_len)
        base_cache.keys.copy_(mk_cache.keys)
        base_cache.values.copy_(mk_cache.values)
    region = compile_region(
        talker,
        region_spec(TALKER_STEP),
        batch_size=batch,
        max_context=cache_len,
        num_cache_slots=num_slots,
        cache_len=cache_len,
        tiling=args.tiling,
        num_sms=args.num_sms,
    )
    lengths = [max(1, context - row % 3) for row in range(batch)]
    positions = torch.tensor(lengths, dtype=torch.int64, device=device)
    hidden = talker.config.transformer.hidden_size
    text_row = torch.randn(batch, hidden, generator=gen, device=device).to(torch.bfloat16)
    codes = torch.randint(0, talker.config.num_audio_codes, (batch,), generator=gen, device=device)
    bound = {
        **region.weights,
        "x_in": torch.zeros(batch, hidden, dtype=torch.bfloat16),
        "positions": positions.clone(),  # the launch's own input, rewritten before every launch
        "slots": slots,
        "k_cache": mk_cache.keys,
        "v_cache": mk_cache.values,
        **_greedy(batch),
    }
    launcher = _launcher(region.program, bound, device, args.executor)
    rows, mk_s = [], 0.0
    for step in range(args.steps):
        x = talker.embed_codec(codes) + text_row  # bf16, the region's input; the reference gets its values in fp32
        sync(device)
        t0 = time.perf_counter()
        launcher.tensors["x_in"].copy_(x)
        launcher.tensors["positions"].copy_(positions)
        launcher.launch()
        mk_logits = launcher.tensors["s0.logits"].float()
        mk_tokens = launcher.tensors["s0.tokens"].clone()
        sync(device)
        mk_s += time.perf_counter() - t0
        kv_len = max(lengths) + step + 1
        _, ref_logits = ref.forward_tokens(x[:, None].float(), CacheView(ref_cache, slots, positions, kv_len))
        base = None
        if base_cache is not None:
            base = talker.forward_tokens(x[:, None], CacheView(base_cache, slots, positions, kv_len))[1].float()
        rows.append(step_stats(mk_logits, mk_tokens, ref_logits.float(), base, tol))
        codes = ref_logits.argmax(-1)  # teacher forcing: every path gets the reference's codebook 0 next
        positions = positions + 1
    launcher.check_error()
    return {
        "batch": batch,
        "context": context,
        "context_per_row": [min(lengths), max(lengths)],
        "steps": args.steps,
        "tokens_compared": args.steps * batch,
        **summarize_steps(rows, with_baseline=base_cache is not None),
        "megakernel_s_per_step": mk_s / args.steps,
    }


# ---- code-predictor loop -------------------------------------------------------------------------------------


def _forced(into: list[torch.Tensor], tokens: Sequence[torch.Tensor]) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """A CodePredictor.predict `choose` that records each head's logits (fp32) into `into` and returns the given
    token of that head (the megakernel's), so the loop follows the megakernel's path."""

    def choose(head: int, logits: torch.Tensor) -> torch.Tensor:
        into.append(logits.float())
        return tokens[head]

    return choose


def predictor_cell(talker, ref, batch: int, args, tol: Tolerance, gen: torch.Generator) -> dict:
    """`args.frames` frames of the loop for `batch` rows; every head compared (15 per frame)."""
    device = args.device
    predictor, ref_predictor = talker.code_predictor, ref.code_predictor
    region = compile_region(
        predictor, RegionSpec.code_predictor_loop(), batch_size=batch, tiling=args.tiling, num_sms=args.num_sms
    )
    hidden_size = talker.config.transformer.hidden_size
    hidden_in, code0_in = (torch.zeros(batch, hidden_size, dtype=torch.bfloat16) for _ in range(2))  # the launch's own
    bound = {**code_predictor_inputs(region, predictor.new_cache(batch), hidden_in, code0_in), **_greedy(batch)}
    launcher = _launcher(region.program, bound, device, args.executor)
    heads = predictor.num_steps
    rows, mk_s = [], 0.0
    for _ in range(args.frames):
        hidden = torch.randn(batch, hidden_size, generator=gen, device=device).to(torch.bfloat16)
        code0 = torch.randint(0, talker.config.num_audio_codes, (batch,), generator=gen, device=device)
        code0_embedding = talker.embed_codec(code0)
        sync(device)
        t0 = time.perf_counter()
        launcher.tensors["hidden"].copy_(hidden)
        launcher.tensors["code0_embedding"].copy_(code0_embedding)
        launcher.launch()
        mk_logits = [launcher.tensors[f"s{h + 1}.logits"].float() for h in range(heads)]
        mk_tokens = [launcher.tensors[f"s{h + 1}.tokens"].clone() for h in range(heads)]
        sync(device)
        mk_s += time.perf_counter() - t0

        ref_logits: list[torch.Tensor] = []
        ref_predictor.predict(hidden.float(), ref.embed_codec(code0), _forced(ref_logits, mk_tokens))
        base_logits: list[torch.Tensor] = []
        if not args.no_bf16_baseline:
            predictor.predict(hidden, code0_embedding, _forced(base_logits, mk_tokens))
        for h in range(heads):
            base = base_logits[h] if base_logits else None
            rows.append(step_stats(mk_logits[h], mk_tokens[h], ref_logits[h], base, tol))
    launcher.check_error()
    cell = {
        "batch": batch,
        "frames": args.frames,
        "heads": heads,
        "tokens_compared": args.frames * heads * batch,
        **summarize_steps(rows, with_baseline=not args.no_bf16_baseline),
        "megakernel_s_per_frame": mk_s / args.frames,
    }
    cell["per_head_max_abs_diff"] = cell.pop("per_step_max_abs_diff")  # frames x heads, frame-major
    return cell


# ---- codec transformer ---------------------------------------------------------------------------------------


def codec_decoder(preset: str, *, seed: int, device: torch.device):
    """The codec decoder of `preset` in bf16, its transformer's layer scales drawn N(0, 1) (seeded)."""
    decoder, _ = random_speech_tokenizer(
        PRESETS[preset], seed=seed, device=device, dtype=torch.bfloat16, with_encoder=False
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in decoder.pre_transformer.layers:
            for scale in (layer.self_attn_layer_scale.scale, layer.mlp_layer_scale.scale):
                scale.copy_(torch.randn(scale.shape, generator=gen).to(scale))
    return decoder


def codec_cell(decoder, ref, batch: int, context: int, args, tol: Tolerance, gen: torch.Generator) -> dict:
    """`args.steps` frames through the codec transformer for `batch` rows at context - row % 3 frames decoded."""
    device = args.device
    transformer = decoder.pre_transformer
    num_slots, slots = _permuted_slots(batch, gen, device)
    pool = decoder.new_state(num_slots)
    window = decoder.config.sliding_window
    for ring in (pool.keys, pool.values):  # earlier frames, any values: one copy of the window, then its twin
        ring[..., :window, :].normal_(generator=gen)
        ring[..., window:, :].copy_(ring[..., :window, :])
    lengths = [max(0, context - row % 3) for row in range(batch)]
    positions = torch.tensor(lengths, dtype=torch.int64, device=device)
    ref_state = pool.select(slots)  # the rows' rings, gathered (copies)
    ref_state.keys, ref_state.values = ref_state.keys.float(), ref_state.values.float()
    ref_state.positions = positions.clone()
    base_state = None
    if not args.no_bf16_baseline:
        base_state = pool.select(slots)
        base_state.positions = positions.clone()
    region = compile_region(
        transformer,
        RegionSpec(lm_head=True),
        batch_size=batch,
        num_cache_slots=num_slots,
        tiling=args.tiling,
        num_sms=args.num_sms,
    )
    latent = decoder.config.latent_dim
    bound = {
        **region.weights,
        "x_in": torch.zeros(batch, latent, dtype=torch.bfloat16),
        "positions": positions.clone(),  # the launch's own input, rewritten before every launch
        "slots": slots,
        "k_cache": pool.keys,
        "v_cache": pool.values,
    }
    launcher = _launcher(region.program, bound, device, args.executor)
    diffs, scales, bounds, base_diffs, mk_s = [], [], [], [], 0.0
    for step in range(args.steps):
        x = torch.randn(batch, latent, generator=gen, device=device).to(torch.bfloat16)
        sync(device)
        t0 = time.perf_counter()
        launcher.tensors["x_in"].copy_(x)
        launcher.tensors["positions"].copy_(positions + step)
        launcher.launch()
        out = launcher.tensors["x_out"].float()
        sync(device)
        mk_s += time.perf_counter() - t0
        expected = ref(x[:, None].float(), ref_state)[:, 0].float()
        ref_state.positions.add_(1)
        limit = tol.atol + tol.rtol * expected.abs().amax()
        if base_state is not None:
            base_diff = (transformer(x[:, None], base_state)[:, 0].float() - expected).abs().amax()
            base_state.positions.add_(1)
            limit = torch.maximum(limit, tol.bf16_factor * base_diff)
            base_diffs.append(base_diff)
        diffs.append((out - expected).abs().amax())
        scales.append(expected.abs().amax())
        bounds.append(limit)
    launcher.check_error()
    diff, scale, bound = (torch.stack(v).cpu() for v in (diffs, scales, bounds))
    cell = {
        "batch": batch,
        "context": context,
        "context_per_row": [min(lengths), max(lengths)],
        "steps": args.steps,
        "window": window,
        "max_abs_diff": float(diff.max()),
        "max_ref": float(scale.max()),
        "worst_diff_over_bound": float((diff / bound).max()),
        "per_step_max_abs_diff": [round(float(x), 5) for x in diff],
        "megakernel_s_per_step": mk_s / args.steps,
    }
    if base_diffs:
        cell["bf16_conventional_max_abs_diff"] = float(torch.stack(base_diffs).max())
    cell["passed"] = bool((diff <= bound).all())  # False on NaN
    return cell


# ---- the matrix ----------------------------------------------------------------------------------------------


def _fp32_twin(module: torch.nn.Module, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`make()` (the same architecture) in fp32 holding exactly `module`'s weight values."""
    twin = make().float()
    twin.load_state_dict(module.state_dict())
    return twin.eval().requires_grad_(False)


def run(args: argparse.Namespace, save: Callable[[dict], None] | None = None) -> dict:
    """Every part's cells; `save(report)` after every cell with the report so far."""
    device = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    tol = Tolerance(atol=args.atol, rtol=args.rtol, bf16_factor=args.bf16_factor)
    started = time.perf_counter()
    report = {
        "benchmark": "megakernel correctness matrix, Qwen3-TTS (talker step, code-predictor loop, codec transformer "
        "vs fp32 PyTorch references)",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": args.commit,
        "torch_version": torch.__version__,
        "executor": args.executor,
        "preset": args.preset,
        "codec_preset": args.codec_preset,
        "weights": f"randomize_network_ / random_speech_tokenizer, seed {args.seed}, stored in bf16; codec layer "
        "scales N(0, 1)",
        "reference": "the same networks in fp32 (TF32 off) on fp32 copies of the bf16 weights' values, with fp32 "
        "caches holding the same initial values",
        "tolerance": {
            **dataclasses.asdict(tol),
            "rule": "per step (talker, codec) or head (predictor): max|mk - ref| <= max(atol + rtol * max|ref|, "
            "bf16_factor * max|bf16 PyTorch - ref|) over the batch; a token != ref argmax is a near-tie if "
            "ref[argmax] - ref[token] <= that bound, else a failure",
        },
        "tiling": dataclasses.asdict(args.tiling),
        "num_sms": args.num_sms,
        "parts": list(args.parts),
        "talker": [],
        "predictor": [],
        "codec": [],
        "complete": False,
        "passed": None,
    }

    def record(part: str, make: Callable[[], dict], **where) -> None:
        try:
            cell = make()
        except Exception as exc:  # noqa: BLE001 - recorded as a failed cell (see error_entry)
            cell = error_entry(exc, **where)
        report[part].append(cell)
        print(f"{part:9s} {row_text(cell)}", flush=True)
        report["wall_s"] = time.perf_counter() - started
        if save is not None:
            save(report)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    with torch.inference_mode():
        if "talker" in args.parts or "predictor" in args.parts:
            talker = random_talker(args.preset, seed=args.seed, device=device, dtype=torch.bfloat16)
            ref = _fp32_twin(
                talker, lambda: random_talker(args.preset, seed=args.seed, device=device, dtype=torch.float32)
            )
            for batch in args.batches:
                if "talker" in args.parts:
                    for context in args.contexts:
                        record(
                            "talker",
                            lambda: talker_cell(talker, ref, batch, context, args, tol, gen),  # noqa: B023
                            batch=batch,
                            context=context,
                        )
                if "predictor" in args.parts:
                    record("predictor", lambda: predictor_cell(talker, ref, batch, args, tol, gen), batch=batch)  # noqa: B023
            del talker, ref
        if "codec" in args.parts:
            decoder = codec_decoder(args.codec_preset, seed=args.seed, device=device)
            ref = _fp32_twin(
                decoder.pre_transformer,
                lambda: codec_decoder(args.codec_preset, seed=args.seed, device=device).pre_transformer,
            )
            for batch in args.batches:
                for context in args.contexts:
                    record(
                        "codec",
                        lambda: codec_cell(decoder, ref, batch, context, args, tol, gen),  # noqa: B023
                        batch=batch,
                        context=context,
                    )
    cells = [c for part in PARTS for c in report[part]]
    report["passed"] = bool(cells) and all(c["passed"] for c in cells)
    report["complete"] = True
    report["wall_s"] = time.perf_counter() - started
    if save is not None:
        save(report)
    return report


def row_text(c: dict) -> str:
    """A cell as a table row: a talker or predictor cell (logits and tokens) as the Llama matrix gives it, a
    codec cell (hidden states, no tokens) in the same columns."""
    if "error" in c or "hard_mismatches" in c:
        return token_row_text(c)
    base = c.get("bf16_conventional_max_abs_diff")
    base_text = f"{base:9.4f}" if base is not None else f"{'-':>9}"
    return (
        f"{c['batch']:5d} {c['context']:7d} {c['max_abs_diff']:9.4f} {c['worst_diff_over_bound']:6.2f} {'':23} "
        f"{base_text} {'':5} {c['megakernel_s_per_step'] * 1e3:8.2f} {'PASS' if c['passed'] else 'FAIL'}"
    )


HEADER = (
    f"{'part':9s} {'batch':>5} {'ctx/frm':>7} {'max|d|':>9} {'d/tol':>6} {'mism':>5} {'ties':>5} {'hard':>5} "
    f"{'self':>5} {'bf16|d|':>9} {'bf16m':>5} {'mk ms':>8} result"
)


def format_table(report: dict) -> str:
    t = report["tolerance"]
    lines = [
        f"megakernel vs fp32 reference: {report['preset']} / codec {report['codec_preset']} on {report['device']} "
        f"({report['executor']}), atol {t['atol']} rtol {t['rtol']} bf16 factor {t['bf16_factor']}",
        "talker: batch x context, steps teacher-forced; predictor: batch x frames (15 heads each); codec: batch x "
        "frames decoded",
        HEADER,
    ]
    lines += [f"{part:9s} {row_text(c)}" for part in PARTS for c in report[part]]
    lines.append(f"overall: {'PASS' if report['passed'] else 'FAIL'} ({report['wall_s']:.1f} s)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON output path")
    parser.add_argument("--commit", default="unknown", help="git commit recorded in the JSON")
    parser.add_argument("--preset", default="qwen3-tts-0.6b", help="talker preset (models.qwen3_tts.presets)")
    parser.add_argument("--codec-preset", default="12hz", choices=sorted(PRESETS))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    add_executor_args(parser)
    parser.add_argument("--batches", type=ints, default=FULL_BATCHES, help=f"default {FULL_BATCHES}")
    parser.add_argument(
        "--contexts", type=ints, default=FULL_CONTEXTS, help=f"talker and codec contexts, default {FULL_CONTEXTS}"
    )
    parser.add_argument("--steps", type=int, default=32, help="talker steps and codec frames per cell")
    parser.add_argument("--frames", type=int, default=8, help="code-predictor frames per batch")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL)
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL)
    parser.add_argument("--bf16-factor", type=float, default=DEFAULT_BF16_FACTOR)
    parser.add_argument("--no-bf16-baseline", action="store_true", help="skip the conventional bf16 baseline")
    parser.add_argument("--seed", type=int, default=0)
    add_tiling_args(parser)
    args = parser.parse_args(argv)
    args.tiling = apply_tiling_args(TilingConfig(), args)
    args.parts = tuple(p for p in args.parts.split(",") if p)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--parts must name some of {', '.join(PARTS)}; got {unknown or 'none'}")
    if min(args.batches) < 1 or min(args.contexts) < 1 or args.steps < 1 or args.frames < 1:
        parser.error("--batches, --contexts, --steps and --frames must be >= 1")
    apply_executor_args(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run_and_report(parse_args(argv), HEADER, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
