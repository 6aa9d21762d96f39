"""Megakernel vs the same model's conventional PyTorch path: Llama-1B decode steps and Qwen3-TTS frames.

Rows: a full Llama decode step (Llama-3.2-1B tied 128,256 vocabulary = the issue's target, and Llasa-1B's
untied 193,800) and one Qwen3-TTS-0.6B frame (15 predictor steps + talker step), per batch size. Each
row times (CUDA events, medians) the megakernel launched eagerly and replayed from a CUDA graph, and the
conventional path eagerly, from a CUDA graph, under torch.compile(mode="reduce-overhead") of the whole step,
and regionally compiled (each decoder layer compiled by Inductor, the step then captured in one CUDA graph: a
compile of a few layer bodies instead of the Qwen frame's unrolled 15-step loop, which took minutes); bytes
read per step, achieved bandwidth as % of a device-to-device copy measured in the same run, and the targets.
CPU smoke: --device cpu --executor vm --llama-variants llama-tiny --qwen-preset qwen3-tts-tiny --no-compile.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import add_executor_args, add_tiling_args, apply_executor_args, apply_tiling_args
from benchmarks.megakernel_conventional import (
    LLAMA_VARIANTS,
    ConventionalLlamaStep,
    ConventionalQwenFrame,
    llama_step_bytes,
    o1_random_llama,
    qwen_frame_bytes,
    random_talker,
)
from benchmarks.megakernel_correctness import Launcher
from benchmarks.timing import capture, copy_bandwidth_gbs, median_ms
from tilevox.engine_builder.regions import RegionSpec, TilingConfig, compile_region
from tilevox.executor.megakernel_inputs import code_predictor_inputs, llama_decode_inputs, sampling_inputs
from tilevox.models.qwen3_tts.talker import Talker
from tilevox.models.sampling import SamplingParams

TILING = TilingConfig()  # 64-key partitions, the default
FLOOR_BANDWIDTH_BYTES_S = 4.8e12  # H200 HBM3e peak: the issue's weight-read floor
# The issue's targets (batch 1 only): Llama-3.2-1B full step and one Qwen3-TTS-0.6B frame.
TARGET_MS = {("llama-3.2-1b", 1): 0.65, ("qwen3-tts-0.6b", 1): 1.0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


class Timer:
    """Measures one row's variants, recording an error message (not a number) for a variant that fails."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device

    def time(self, fn: Callable[[], object], before: Callable[[], object] | None = None) -> dict:
        try:
            return {
                "ms": median_ms(fn, iters=self.args.iters, warmup=self.args.warmup, device=self.device, before=before)
            }
        except Exception as exc:  # noqa: BLE001 - reported in the row and the table; the other variants still run
            _sync_quietly(self.device)
            return {"error": _error(exc)}

    def graph(self, fn: Callable[[], object], before: Callable[[], object] | None = None) -> dict:
        if self.device.type != "cuda":
            return {"skipped": "CUDA graphs need a CUDA device"}
        try:
            replay = capture(fn, self.device, before)
        except Exception as exc:  # noqa: BLE001 - a capture failure is a result of this benchmark: report it
            _sync_quietly(self.device)
            return {"error": f"capture failed: {_error(exc)}"}
        return self.time(replay, before)

    def compiled(
        self,
        fn: Callable[[], None],
        mark_static: Callable[[], None],
        batch: int,
        before: Callable[[], object] | None = None,
    ) -> dict:
        """torch.compile(fn, mode="reduce-overhead", fullgraph=True): wall-clock of the first call (the
        compile), then the timing; Dynamo/Inductor counters show whether CUDA graphs were skipped."""
        skipped = self._skipped("whole", batch)
        if skipped is not None:
            return skipped
        from torch._dynamo.utils import counters

        # Inductor logs why it skips CUDA graphs (e.g. a mutated non-static input) on the "cudagraphs"
        # artifact logger of torch._inductor.cudagraph_utils (on CPU it only counts the skip).
        torch._logging.set_logs(cudagraphs=True)
        cudagraphs_log = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
        skips = _Messages()
        cudagraphs_log.addHandler(skips)
        try:
            result = self._compiled(fn, mark_static, before)
        finally:
            cudagraphs_log.removeHandler(skips)
        if "ms" in result:
            result["cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
            result["cudagraph_skip_reasons"] = skips.messages[:5]
            result["graph_breaks"] = sum(counters["graph_break"].values())
        return result

    def _compiled(
        self, fn: Callable[[], None], mark_static: Callable[[], None], before: Callable[[], object] | None
    ) -> dict:
        args = self.args
        mark_static()
        mode = "reduce-overhead" if args.compile_backend == "inductor" else None
        compiled_fn = torch.compile(fn, backend=args.compile_backend, mode=mode, fullgraph=True)

        def call() -> None:
            torch.compiler.cudagraph_mark_step_begin()
            compiled_fn()

        compile_s = self._first_call(call, before)
        if isinstance(compile_s, dict):
            return compile_s
        print(f"    torch.compile ({args.compile_backend}, {mode}) first call: {compile_s:.1f} s", flush=True)
        result = self.time(call, before)
        result["compile_wall_s"] = compile_s
        return result

    def _skipped(self, scope: str, batch: int) -> dict | None:
        """Why a compiled column (`scope`: whole, regional) is not run for this batch, or None; when it is run,
        Dynamo starts from a fresh cache and counters (no recompile limit across rows)."""
        args = self.args
        if args.no_compile or scope not in args.compile_scope:
            return {"skipped": "--no-compile" if args.no_compile else f"--compile-scope {','.join(args.compile_scope)}"}
        if args.compile_batches is not None and batch not in args.compile_batches:
            return {"skipped": f"batch {batch} not in --compile-batches"}
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        return None

    def _first_call(self, call: Callable[[], None], before: Callable[[], object] | None) -> float | dict:
        """The wall-clock seconds of call()'s first run (its compiles), or the error entry when it fails (a graph
        break under fullgraph, a compile error)."""
        t0 = time.perf_counter()
        try:
            if before is not None:
                before()
            call()
            _sync(self.device)
        except Exception as exc:  # noqa: BLE001 - a graph break (fullgraph) or a compile error: report it
            _sync_quietly(self.device)
            return {"error": f"compile failed: {_error(exc)}", "compile_wall_s": time.perf_counter() - t0}
        return time.perf_counter() - t0

    def regional(
        self, fn: Callable[[], None], module: torch.nn.Module, batch: int, before: Callable[[], object] | None = None
    ) -> dict:
        """`fn` with `module`'s repeated blocks compiled in place (`regionally_compiled`; Inductor's default mode,
        fullgraph), captured in one CUDA graph (timed eagerly on CPU): wall-clock of the first call (the
        compiles), then the timing. The blocks are restored afterwards."""
        skipped = self._skipped("regional", batch)
        if skipped is not None:
            return skipped
        from torch._dynamo.utils import counters

        args = self.args
        with regionally_compiled(module, args.compile_backend) as blocks:
            compile_s = self._first_call(fn, before)  # every block's compile (a recompile later is counted below)
            if isinstance(compile_s, dict):
                return compile_s
            print(f"    regional compile ({args.compile_backend}) of {blocks} blocks: {compile_s:.1f} s", flush=True)
            result = self.graph(fn, before) if self.device.type == "cuda" else self.time(fn, before)
        if "ms" in result:
            result["compile_wall_s"] = compile_s
            result["blocks_compiled"] = blocks
            result["graphs_compiled"] = counters["stats"]["unique_graphs"]
            result["graph_breaks"] = sum(counters["graph_break"].values())
            result["captured"] = self.device.type == "cuda"
        return result


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The elements of every ModuleList of two or more non-leaf modules of one class (decoder layers): what
    regional compilation compiles. Dynamo compiles a block class once per distinct shapes and reuses the code
    for the other blocks (their parameters are its inputs)."""
    blocks = []
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) >= 2 and len({type(m) for m in child}) == 1:
            if next(child[0].children(), None) is not None:
                blocks.extend(child)
    return blocks


@contextlib.contextmanager
def regionally_compiled(module: torch.nn.Module, backend: str) -> Iterator[int]:
    """`module`'s repeated blocks compiled in place (nn.Module.compile, fullgraph) for the duration; yields
    how many. Restored on exit, so the other columns' paths stay uncompiled."""
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(f"{type(module).__name__} has no repeated blocks to compile")
    for block in blocks:
        block.compile(backend=backend, fullgraph=True)
    # A block class whose forward reads an int attribute (LlamaAttention's layer_idx) is compiled once per block:
    # Dynamo specialises the int. Past the recompile limit (8) fullgraph makes that a hard failure (H100,
    # 2026-12-07, b3d00b8: Llama-3.2-1B's 16 layers), so the limit covers every block, twice (two batch shapes).
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(blocks))
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            yield len(blocks)
    finally:
        for block in blocks:
            block._compiled_call_impl = None  # what nn.Module.compile set: calls go to forward again


class _Messages(logging.Handler):
    """Collects the messages of one logger (Inductor's CUDA-graph skip reasons)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _sync_quietly(device: torch.device) -> None:
    """Synchronize after a failure; a sticky CUDA error then shows in the next variant's message."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as exc:
            print(f"    device error after a failure: {_error(exc)}", flush=True)


def _ms(entry: dict) -> float | None:
    return entry.get("ms")


def _finish_row(row: dict, copy_gbs: float) -> dict:
    """Ratios, bandwidth and target distance from the timings and byte counts."""
    total = row["bytes"]["total_bytes"]
    mk = _ms(row["megakernel_graph"]) or _ms(row["megakernel_eager"])
    row["floor_ms_at_4p8_tbs"] = total / FLOOR_BANDWIDTH_BYTES_S * 1e3
    for name in (
        "megakernel_eager",
        "megakernel_graph",
        "conventional_eager",
        "conventional_graph",
        "conventional_compiled",
        "conventional_regional",
    ):
        ms = _ms(row[name])
        if ms is not None:
            row[name]["gbs"] = total / (ms * 1e-3) / 1e9
            row[name]["pct_of_copy_bw"] = 100.0 * row[name]["gbs"] / copy_gbs
    for name in ("conventional_eager", "conventional_graph", "conventional_compiled", "conventional_regional"):
        ms = _ms(row[name])
        row[f"speedup_vs_{name}"] = ms / mk if (ms is not None and mk is not None) else None
    target = TARGET_MS.get((row["variant"], row["batch"]))
    row["target_ms"] = target
    row["x_of_target"] = mk / target if (target is not None and mk is not None) else None
    return row


def _greedy(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    inputs = sampling_inputs([SamplingParams.greedy()] * batch, seeds=list(range(batch)))
    return {name: t.to(device) for name, t in inputs.items()}


def _kernel_error(run: Callable[[], object], device: torch.device) -> str | None:
    """None, or the message of a megakernel error (watchdog, fault, launch status) raised by `run`."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - a megakernel error is a result: recorded in the row
        _sync_quietly(device)
        return _error(exc)
    return None


def _time_megakernel(
    row: dict,
    launch: Callable[[], object],
    check_error: Callable[[], None],
    first_error: str | None,
    timer: Timer,
    args,
) -> None:
    """Eager and CUDA-graph timings of a megakernel launch; an error at the first launch or in any
    timed launch (checked once afterwards) replaces the timings with the error."""
    if first_error is not None:
        row["megakernel_eager"] = row["megakernel_graph"] = {"error": first_error}
        return
    row["megakernel_eager"] = timer.time(launch)
    row["megakernel_graph"] = timer.graph(launch) if args.executor == "cuda" else {"skipped": "VM executor"}
    later_error = _kernel_error(check_error, timer.device)
    if later_error is not None:
        row["megakernel_eager"] = row["megakernel_graph"] = {"error": f"in a timed launch: {later_error}"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Pending:
    """A row's conventional step, kept alive to be compiled after all rows' other timings: a slow
    torch.compile (minutes) under a timeout then costs only its own column."""

    row: dict
    fn: Callable[[], None]
    mark_static: Callable[[], None]
    before: Callable[[], object] | None
    module: torch.nn.Module  # whose repeated blocks the regional compile compiles


def bench_llama(variant: str, batch: int, args, timer: Timer, model, copy_gbs: float) -> tuple[dict, Pending]:
    device = model.device
    context, max_context = args.context, args.context + args.headroom
    slots = list(range(batch))
    cache = model.new_cache(max_streams=batch, max_seq_len=max_context)
    for _ in slots:
        cache.allocate()
    gen = torch.Generator(device=device).manual_seed(batch)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.lengths = [context] * batch
    region = compile_region(
        model,
        RegionSpec.full_step(1),
        batch_size=batch,
        max_context=max_context,
        num_cache_slots=batch,
        cache_len=max_context,
        tiling=TILING,
        num_sms=args.num_sms,
    )
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=gen, device=device)
    bound = {**llama_decode_inputs(region, cache, slots, tokens), **_greedy(batch, device)}
    mk = Launcher(region.program, {n: t.to(device) for n, t in bound.items()}, args.executor)
    conv = ConventionalLlamaStep(model, cache, slots, [context] * batch, num_keys=max_context)
    # Agreement at one step (both bf16, same cache contents, same position): a sanity check of what is timed.
    conv.tokens.copy_(tokens)
    conv_logits = conv.logits().float()
    first_error = _kernel_error(lambda: (mk.launch(), mk.check_error()), device)
    if first_error is None:
        mk_logits = mk.tensors["s0.logits"].float()
        agreement = {
            "max_abs_logit_diff": float((mk_logits - conv_logits).abs().max()),
            "max_abs_logit": float(conv_logits.abs().max()),
            "greedy_token_agreement": float((mk.tensors["s0.tokens"] == conv_logits.argmax(-1)).float().mean()),
        }
    else:
        agreement = {"error": first_error}
    row = {
        "model": "llama",
        "variant": variant,
        "batch": batch,
        "context": context,
        "max_context": max_context,
        "instructions": len(region.program.instructions),
        "predicted_ms": region.predicted_time_s * 1e3,
        "bytes": llama_step_bytes(model.config, [context + 1] * batch, model.dtype.itemsize),
        "agreement_one_step": agreement,
    }
    print(f"  {variant} batch {batch}: megakernel", flush=True)
    _time_megakernel(row, mk.launch, mk.check_error, first_error, timer, args)
    print(f"  {variant} batch {batch}: conventional", flush=True)
    row["conventional_eager"] = timer.time(conv, before=conv.reset)
    row["conventional_graph"] = timer.graph(conv, before=conv.reset)
    row["conventional_compiled"] = {"skipped": "pending (compiled after every row's other timings)"}
    row["conventional_regional"] = {"skipped": "pending (compiled after every row's other timings)"}
    pending = Pending(row=row, fn=conv.__call__, mark_static=conv.mark_static, before=conv.reset, module=model)
    return _finish_row(row, copy_gbs), pending


class MegakernelQwenFrame:
    """One frame through two megakernel regions plus conventional glue, on static buffers: the
    CODE_PREDICTOR_LOOP region (talker hidden + codebook-0 embedding -> codes 1..Q-1), the frame
    embedding sum (+ text row) into the talker region's `x_in`, the talker-step region (layers + codec
    head + greedy sampling; its `x_normed` output is the predictor's next `hidden`, its token the next
    codebook 0), and the codebook-0 embedding for the next frame. Capturable in one CUDA graph."""

    def __init__(
        self,
        talker: Talker,
        frame: ConventionalQwenFrame,
        *,
        batch: int,
        context: int,
        cache_len: int,
        args: argparse.Namespace,
    ) -> None:
        device = frame.hidden.device
        num_layers = talker.config.transformer.num_layers
        self.talker = talker
        self.num_codes = talker.config.num_code_groups
        self.talker_region = compile_region(
            talker,
            RegionSpec.layers(0, num_layers, lm_head=True),
            batch_size=batch,
            max_context=cache_len,
            num_cache_slots=batch,
            cache_len=cache_len,
            tiling=TILING,
            num_sms=args.num_sms,
        )
        self.predictor_region = compile_region(
            talker.code_predictor,
            RegionSpec.code_predictor_loop(),
            batch_size=batch,
            tiling=TILING,
            num_sms=args.num_sms,
        )
        self.hidden = frame.hidden.clone()
        self.code0 = frame.code0.clone()
        self.text_row = frame.text_row
        self.code0_embedding = talker.embed_codec(self.code0)
        self.x_in = torch.empty_like(self.hidden)
        self.frame_codes = torch.zeros(batch, self.num_codes, dtype=torch.int64, device=device)  # (B, Q)
        talker_bound = {
            **self.talker_region.weights,
            "x_in": self.x_in,
            "x_normed": self.hidden,
            "s0.tokens": self.code0,
            "positions": torch.full((batch,), context, dtype=torch.int64, device=device),
            "slots": torch.arange(batch, device=device),
            "k_cache": frame.cache.keys,
            "v_cache": frame.cache.values,
            **_greedy(batch, device),
        }
        predictor_bound = {
            **code_predictor_inputs(
                self.predictor_region, talker.code_predictor.new_cache(batch), self.hidden, self.code0_embedding
            ),
            **_greedy(batch, device),
        }
        # .to(device): inv_freq is computed on the CPU; device tensors pass through as themselves.
        self.talker_launch = Launcher(
            self.talker_region.program, {n: t.to(device) for n, t in talker_bound.items()}, args.executor
        )
        self.predictor_launch = Launcher(
            self.predictor_region.program, {n: t.to(device) for n, t in predictor_bound.items()}, args.executor
        )

    def __call__(self) -> None:
        self.predictor_launch.launch()
        rest = [self.predictor_launch.tensors[f"s{j}.tokens"] for j in range(1, self.num_codes)]
        self.frame_codes.copy_(torch.stack([self.code0, *rest], dim=1))  # the frame, as the conventional keeps it
        self.x_in.copy_(self.talker.embed_frame(self.frame_codes) + self.text_row)  # (B, H)
        self.talker_launch.launch()  # hidden <- final-norm hidden, code0 <- greedy codec token
        self.code0_embedding.copy_(self.talker.embed_codec(self.code0))

    def check_error(self) -> None:
        self.predictor_launch.check_error()
        self.talker_launch.check_error()


def bench_qwen(preset: str, batch: int, args, timer: Timer, talker: Talker, copy_gbs: float) -> tuple[dict, Pending]:
    context = args.qwen_context
    cache_len = context + args.headroom
    conv = ConventionalQwenFrame(talker, batch=batch, context=context, cache_len=cache_len, seed=batch)
    mk = MegakernelQwenFrame(talker, conv, batch=batch, context=context, cache_len=cache_len, args=args)
    # Agreement on one frame from the same state (bf16 both; greedy near-ties can differ).
    first_error = _kernel_error(lambda: (mk(), mk.check_error()), timer.device)
    mk_codes, mk_next = mk.frame_codes.clone(), mk.code0.clone()
    mk_hidden = mk.hidden.float()
    conv()
    agreement = (
        {"error": first_error}
        if first_error is not None
        else {
            "frame_code_agreement": float((mk_codes == conv.codes).float().mean()),
            "next_code0_agreement": float((mk_next == conv.code0).float().mean()),
            "max_abs_hidden_diff": float((mk_hidden - conv.hidden.float()).abs().max()),
        }
    )
    row = {
        "model": "qwen3-tts",
        "variant": preset,
        "batch": batch,
        "context": context,
        "max_context": cache_len,
        "instructions": len(mk.talker_region.program.instructions) + len(mk.predictor_region.program.instructions),
        "predicted_ms": (mk.talker_region.predicted_time_s + mk.predictor_region.predicted_time_s) * 1e3,
        "bytes": qwen_frame_bytes(talker, batch=batch, context=context, element_size=talker.codec_head.weight.itemsize),
        "agreement_one_frame": agreement,
    }
    print(f"  {preset} batch {batch}: megakernel", flush=True)
    _time_megakernel(row, mk, mk.check_error, first_error, timer, args)
    print(f"  {preset} batch {batch}: conventional", flush=True)
    row["conventional_eager"] = timer.time(conv)
    row["conventional_graph"] = timer.graph(conv)
    row["conventional_compiled"] = {"skipped": "pending (compiled after every row's other timings)"}
    row["conventional_regional"] = {"skipped": "pending (compiled after every row's other timings)"}
    pending = Pending(row=row, fn=conv.__call__, mark_static=conv.mark_static, before=None, module=talker)
    return _finish_row(row, copy_gbs), pending


def _cell(entry: dict) -> str:
    if "ms" in entry:
        return f"{entry['ms']:8.3f}"
    return f"{'err' if 'error' in entry else '-':>8}"


def _opt(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else f"{'-':>{len(format(1.0, fmt))}}"


HEADER = (
    f"{'model':<15} {'batch':>5} {'mk eager':>8} {'mk graph':>8} {'cv eager':>8} {'cv graph':>8} "
    f"{'compiled':>8} {'regional':>8} {'xgraph':>6} {'xcomp':>6} {'xreg':>6} {'GB':>6} {'%copy':>6} {'floor':>6} "
    f"{'target':>6} {'x tgt':>6}"
)


def format_row(r: dict) -> str:
    mk = r["megakernel_graph"] if "ms" in r["megakernel_graph"] else r["megakernel_eager"]
    return (
        f"{r['variant']:<15} {r['batch']:5d} {_cell(r['megakernel_eager'])} {_cell(r['megakernel_graph'])} "
        f"{_cell(r['conventional_eager'])} {_cell(r['conventional_graph'])} {_cell(r['conventional_compiled'])} "
        f"{_cell(r['conventional_regional'])} {_opt(r['speedup_vs_conventional_graph'], '6.2f')} "
        f"{_opt(r['speedup_vs_conventional_compiled'], '6.2f')} {_opt(r['speedup_vs_conventional_regional'], '6.2f')} "
        f"{r['bytes']['total_bytes'] / 1e9:6.3f} {_opt(mk.get('pct_of_copy_bw'), '6.1f')} "
        f"{r['floor_ms_at_4p8_tbs']:6.3f} {_opt(r['target_ms'], '6.2f')} {_opt(r['x_of_target'], '6.2f')}"
    )


def format_table(report: dict) -> str:
    title = (
        f"megakernel vs conventional on {report['device']}: ms are CUDA-event medians; xgraph / xcomp / xreg = "
        f"conventional graph / compiled / regionally compiled time over the megakernel's (graph, else eager); %copy of "
        f"{report['copy_bandwidth_gbs']:.0f} GB/s; floor = bytes at 4.8 TB/s"
    )
    lines = [title, HEADER]
    lines += [format_row(r) for r in report["rows"]]
    notes = [
        f"  {r['variant']} b{r['batch']} {name}: {r[name]['error']}"
        for r in report["rows"]
        for name in (
            "megakernel_eager",
            "megakernel_graph",
            "conventional_eager",
            "conventional_graph",
            "conventional_compiled",
            "conventional_regional",
        )
        if "error" in r[name]
    ]
    return "\n".join(lines + (["errors:"] + notes if notes else []))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON output path (rewritten after every row)")
    parser.add_argument("--commit", default="unknown", help="git commit recorded in the JSON")
    add_executor_args(parser)
    parser.add_argument("--batches", type=_ints, default=(1, 8, 32))
    parser.add_argument(
        "--llama-variants", default="llama-3.2-1b,llama-1b", help=f"comma list of {sorted(LLAMA_VARIANTS)}, or 'none'"
    )
    parser.add_argument("--qwen-preset", default="qwen3-tts-0.6b", help="Qwen3-TTS preset, or 'none'")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per Llama stream")
    parser.add_argument("--qwen-context", type=int, default=256, help="cached talker tokens per Qwen stream")
    parser.add_argument(
        "--headroom",
        type=int,
        default=16,
        help="max_context = context + headroom (attention "
        "keys of the conventional step under graphs, which reads a static key count)",
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help=">= 3: reduce-overhead records its graph on call 2-3")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (it takes minutes)")
    parser.add_argument("--compile-batches", type=_ints, default=None, help="compile only at these batches")
    parser.add_argument(
        "--compile-scope",
        default="whole,regional",
        help="whole (the step under reduce-overhead; the Qwen frame takes minutes), regional (decoder layers, "
        "then one CUDA graph), or both (default)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="inductor (with mode reduce-overhead); eager/aot_eager check tracing only",
    )
    add_tiling_args(parser)
    args = parser.parse_args(argv)
    global TILING
    TILING = apply_tiling_args(TILING, args)
    if min(args.batches) < 1 or args.iters < 1 or args.context < 1 or args.qwen_context < 1 or args.headroom < 1:
        parser.error("--batches, --iters, --context, --qwen-context and --headroom must be >= 1")
    if args.warmup < 3:
        parser.error("--warmup must be >= 3 (CUDA-graph trees warm up, then record, then replay)")
    args.compile_scope = tuple(x for x in args.compile_scope.split(",") if x)
    if not args.compile_scope or set(args.compile_scope) - {"whole", "regional"}:
        parser.error(f"--compile-scope must name whole and/or regional, got {','.join(args.compile_scope)!r}")
    args.llama_variants = [] if args.llama_variants == "none" else args.llama_variants.split(",")
    unknown = [v for v in args.llama_variants if v not in LLAMA_VARIANTS]
    if unknown:
        parser.error(f"unknown --llama-variants {unknown}; known: {sorted(LLAMA_VARIANTS)}")
    apply_executor_args(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    started = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs(device, iters=args.iters)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    report = {
        "benchmark": "megakernel vs conventional: Llama-1B decode step and Qwen3-TTS frame",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "num_sms": args.num_sms,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": args.commit,
        "torch_version": torch.__version__,
        "executor": args.executor,
        "timing": f"CUDA events (wall clock on CPU), median of {args.iters} after {args.warmup} warm-ups",
        "copy_bandwidth_gbs": copy_gbs,
        "tiling": asdict(TILING),
        "bytes_rule": "what one step / frame must read: every layer matrix and norm, final norm, head(s) once "
        "(a tied head once), predictor layers once per head (15 passes), one embedding row per stream and "
        "code, K/V over each row's context + 1 keys; the same count for every path",
        "conventional": "benchmarks/megakernel_conventional.py: static device tensors; the Llama step attends "
        "a static max_context keys (masked); the Qwen frame re-runs one talker position",
        "weights": "seeded random bf16 (Llama: o1_random_llama; Qwen: randomize_network_)",
        "args": {
            k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, torch.device) else v)
            for k, v in vars(args).items()
            if k != "out"
        },
        "rows": [],
    }
    timer = Timer(args, device)

    def save() -> None:
        report["wall_s"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # after every row: partial results survive a timeout

    pending: list[Pending] = []

    def add(result: tuple[dict, Pending]) -> None:
        row, compile_later = result
        report["rows"].append(row)
        pending.append(compile_later)
        print(format_row(row), flush=True)
        _sync(device)
        save()

    print(HEADER, flush=True)
    with torch.inference_mode():
        for variant in args.llama_variants:
            model = o1_random_llama(LLAMA_VARIANTS[variant], seed=0, device=device, dtype=torch.bfloat16)
            for batch in args.batches:
                add(bench_llama(variant, batch, args, timer, model, copy_gbs))
        if args.qwen_preset != "none":
            talker = random_talker(args.qwen_preset, seed=0, device=device, dtype=torch.bfloat16)
            for batch in args.batches:
                add(bench_qwen(args.qwen_preset, batch, args, timer, talker, copy_gbs))
        # torch.compile last, rows with a target first (the issue's comparisons), then by batch.
        pending.sort(key=lambda p: (p.row["target_ms"] is None, p.row["batch"]))
        for p in pending:
            print(f"  {p.row['variant']} batch {p.row['batch']}: torch.compile", flush=True)
            p.row["conventional_regional"] = timer.regional(p.fn, p.module, p.row["batch"], before=p.before)
            _finish_row(p.row, copy_gbs)
            save()
            p.row["conventional_compiled"] = timer.compiled(p.fn, p.mark_static, p.row["batch"], before=p.before)
            _finish_row(p.row, copy_gbs)
            print(format_row(p.row), flush=True)
            save()
    print(format_table(report))
    print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
