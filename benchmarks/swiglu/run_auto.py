"""Measure the SwiGLU MLP paths per (shape, token count) on the GPU, derive `--fused-swiglu auto`'s dispatch table
from the timings, and check on the same GPU that `auto` is never slower than the plain PyTorch MLP.

Run on the GPU machine from the repository root, with `tilevox` importable and libtilevox_kernels.so built
(benchmarks/device/swiglu_auto_h200.sh does both):
  python3 benchmarks/swiglu/run_auto.py --out DIR [--git-commit SHA] [--margin 0.05]
Writes DIR/swiglu_auto_h200.json (every timing and error), DIR/swiglu_auto_h200.md (the table) and
DIR/fused_swiglu_dispatch.json (the table `tilevox.models.fused_swiglu` loads; commit it under models/).

Candidates per MLP (models.fused_swiglu.MlpPath): `torch` is the model's own GatedMLP (three cuBLAS GEMMs, silu,
mul), `fused` the fused gate/up kernel + CUTLASS down GEMM, `fused_torch_down` the fused gate/up kernel + cuBLAS
down GEMM (both run through DispatchedSwigluMLP pinned to one path, i.e. the code `auto` runs); `old_auto` is what
`auto` did before this table (SwigluMLP with the library's layout, CUTLASS down GEMM at every M), for reference.
Timing: each candidate runs a stack of R layers with distinct weights (R chosen so the weights are > 4x the 50 MB
L2, as in a real model), captured in one CUDA graph ("graph") and also called from Python ("eager", host cost
included, as tilevox's decode loop runs); CUDA events around each replay/loop, candidates alternating call by
call, median per layer. The table keeps a fused path only where it beat `torch` by `--margin` in both regimes. Then
`apply_fused_swiglu(AUTO)` with that table swaps a copy of the torch stack, and the auto stack is timed against
the torch stack again, side by side (a second, independent measurement). Numerics: every candidate's output
against a float64 reference of the MLP on fresh random inputs, outputs poisoned with NaN before the call.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from tilevox.models.fused_swiglu import (
    DispatchedSwigluMLP,
    DispatchTable,
    FusedSwiglu,
    MlpPath,
    ShapeDispatch,
    apply_fused_swiglu,
)
from tilevox.models.layers import GatedMLP
from tilevox.trt_plugins.library import kernels_library_path
from tilevox.trt_plugins.ops import SwigluMLP, layout_for_device

# name -> (hidden H, intermediate I). tilevox's own models first, then the Qwen2.5 family of run_swiglu.py.
SHAPES = {
    "qwen3-tts talker 0.6B + code predictor": (1024, 3072),
    "qwen3-tts talker 1.7B": (2048, 6144),
    "llama-1b (Llasa)": (2048, 8192),
    "qwen2.5 0.5B": (896, 4864),
    "qwen2.5 1.5B": (1536, 8960),
    "qwen2.5 3B": (2048, 11008),
    "qwen2.5 7B": (3584, 18944),
    "qwen2.5 14B": (5120, 13824),
    "qwen2.5 32B": (5120, 27648),
    "qwen2.5 72B": (8192, 29568),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192]
CANDIDATES = ("torch", "fused", "fused_torch_down", "old_auto")
REGIMES = ("graph", "eager")
WEIGHT_BYTES_TARGET = 256e6  # per stack: > 4x L2, so each layer streams its weights from HBM
REL_ERR_BOUND = 1e-2  # bf16 operands: rel. Frobenius error vs float64 lands between 1e-3 and 1e-2
DEV = "cuda"


def _pinned(mlp: GatedMLP, path: MlpPath, max_m: int) -> DispatchedSwigluMLP:
    h, i = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    entry = ShapeDispatch(hidden=h, intermediate=i, points=((1, path), (max(max_m, 2), path)))  # path at 1..max_m
    return DispatchedSwigluMLP.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, dispatch=entry)


def make_stacks(h: int, i: int, layers: int, max_m: int, gen: torch.Generator) -> dict[str, nn.ModuleList]:
    torch_stack = nn.ModuleList()
    for _ in range(layers):
        mlp = GatedMLP(h, i, device=DEV, dtype=torch.bfloat16)
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            with torch.no_grad():
                lin.weight.copy_(torch.randn(lin.weight.shape, device=DEV, generator=gen) / math.sqrt(lin.in_features))
        torch_stack.append(mlp)
    layout = layout_for_device(DEV, i, h)
    return {
        "torch": torch_stack,
        "fused": nn.ModuleList(_pinned(m, MlpPath.FUSED, max_m) for m in torch_stack),
        "fused_torch_down": nn.ModuleList(_pinned(m, MlpPath.FUSED_TORCH_DOWN, max_m) for m in torch_stack),
        "old_auto": nn.ModuleList(
            SwigluMLP.from_linears(m.gate_proj, m.up_proj, m.down_proj, layout=layout) for m in torch_stack
        ),
    }


def rel_error(stack: nn.ModuleList, m: int, gen: torch.Generator) -> float:
    layer = stack[0]
    ref_layer = stacks_ref_weights(layer)
    x = torch.randn(m, ref_layer[0].shape[1], device=DEV, generator=gen).to(torch.bfloat16)
    wg, wu, wd = ref_layer
    g = x.double() @ wg.double().T
    ref = (g * torch.sigmoid(g) * (x.double() @ wu.double().T)) @ wd.double().T
    poison = torch.full((m, wd.shape[0]), float("nan"), device=DEV, dtype=torch.bfloat16)
    del poison  # the caching allocator hands this NaN block to the next same-size output
    y = layer(x)
    torch.cuda.synchronize()
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    return float((y.double() - ref).norm() / ref.norm())


def stacks_ref_weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(layer, GatedMLP):
        return layer.gate_proj.weight, layer.up_proj.weight, layer.down_proj.weight
    if isinstance(layer, DispatchedSwigluMLP):
        n = layer.w_packed.shape[0] // 2
        return layer.w_packed[:n], layer.w_packed[n:], layer.w_down
    from tilevox.trt_plugins.ops import unpack_gate_up

    wg, wu = unpack_gate_up(layer.w_packed, kernel=layer.layout.kernel, block=layer.layout.block)
    return wg, wu, layer.w_down


class Runner:
    """One candidate stack at one token count: an eager callable and its CUDA graph."""

    def __init__(self, stack: nn.ModuleList, x: torch.Tensor) -> None:
        self.stack, self.x = stack, x

        def run():
            return [layer(x) for layer in stack]

        self.eager = run
        run()
        run()  # warm-up: library load, cuBLAS handles, CUTLASS init, allocator
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outs = run()
        self.graph.replay()
        torch.cuda.synchronize()

    def call(self, regime: str) -> None:
        if regime == "graph":
            self.graph.replay()
        else:
            self.eager()


def time_side_by_side(runners: dict[str, Runner], layers: int, *, budget_ms: float = 200.0) -> dict:
    """Median ms per layer for each runner and regime. Runners alternate call by call (one call of each, then
    again), so a slow spell of the host or the GPU lands on all of them alike instead of on one candidate."""
    out: dict[str, dict[str, float]] = {name: {} for name in runners}
    for regime in REGIMES:
        t0 = time.perf_counter()
        for r in runners.values():
            r.call(regime)
        torch.cuda.synchronize()
        cycle_ms = (time.perf_counter() - t0) * 1e3
        reps = int(min(200, max(9, budget_ms / max(cycle_ms, 1e-3))))
        events = {
            name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for name in runners
        }
        for rep in range(reps):
            for name, r in runners.items():
                start, end = events[name][rep]
                start.record()
                r.call(regime)
                end.record()
            if rep % 16 == 15:
                torch.cuda.synchronize()  # bound the queue of pending events
        torch.cuda.synchronize()
        for name in runners:
            out[name][regime] = statistics.median(s.elapsed_time(e) / layers for s, e in events[name])
    return out


def row_timings(row: dict, *, verified: bool) -> dict[str, dict[MlpPath, float]]:
    """`ShapeDispatch.from_timings`'s input for one token count: both regimes of the first measurement (candidates
    within REL_ERR_BOUND), and with `verified` also the re-measurement of the path `auto` ran (torch vs that path),
    so that a fused path survives only if it beat torch by the margin in both regimes of both measurements."""
    out = {
        regime: {
            MlpPath(c): row["ms"][c][regime]
            for c in ("torch", "fused", "fused_torch_down")
            if c in row["ms"] and row["rel_err"].get(c, math.inf) <= REL_ERR_BOUND
        }
        for regime in REGIMES
    }
    v = row.get("verify")
    if verified and v and v["auto_path"] != "torch" and v["rel_err_auto"] <= REL_ERR_BOUND:
        for regime in REGIMES:
            out[f"{regime}_verify"] = {
                MlpPath.TORCH: v["ms"]["torch"][regime],
                MlpPath(v["auto_path"]): v["ms"]["auto"][regime],
            }
    return out


def run_shape(
    name: str, h: int, i: int, tokens: list[int], margin: float, gen: torch.Generator, device_name: str
) -> dict:
    layers = int(min(16, max(2, math.ceil(WEIGHT_BYTES_TARGET / (3 * h * i * 2)))))
    stacks = make_stacks(h, i, layers, max(tokens), gen)
    rows = []
    timings: dict[int, dict[str, dict[MlpPath, float]]] = {}
    for m in tokens:
        x = torch.randn(m, h, device=DEV, generator=gen).to(torch.bfloat16)
        row = {"M": m, "ms": {}, "rel_err": {}, "errors": {}}
        runners = {}
        for cand, stack in stacks.items():
            try:
                row["rel_err"][cand] = rel_error(stack, m, gen)
                runners[cand] = Runner(stack, x)
            except Exception as exc:  # recorded in the JSON and disqualifying, never hidden
                row["errors"][cand] = f"{type(exc).__name__}: {exc}"
        row["ms"] = time_side_by_side(runners, layers)
        del runners
        timings[m] = row_timings(row, verified=False)
        rows.append(row)
        print(
            f"{name} M={m}: "
            + "  ".join(f"{c} {row['ms'][c]['graph'] * 1e3:.1f}/{row['ms'][c]['eager'] * 1e3:.1f}us" for c in row["ms"])
            + (f"  errors {row['errors']}" if row["errors"] else ""),
            flush=True,
        )
    entry = ShapeDispatch.from_timings(h, i, timings, margin=margin)
    # Verification: the production swap with this entry, timed against the torch stack again.
    auto_stack = copy.deepcopy(stacks["torch"])
    swapped = apply_fused_swiglu(
        (auto_stack,), FusedSwiglu.AUTO, table=DispatchTable(device=device_name, shapes=(entry,))
    )
    for row in rows:
        m = row["M"]
        x = torch.randn(m, h, device=DEV, generator=gen).to(torch.bfloat16)
        runners = {"torch": Runner(stacks["torch"], x), "auto": Runner(auto_stack, x)}
        ms = time_side_by_side(runners, layers)
        row["choice"] = entry.path_for(m).value
        row["verify"] = {
            "swapped_layers": swapped,
            "auto_path": (auto_stack[0].path_for(m).value if swapped else "torch"),
            "rel_err_auto": rel_error(auto_stack, m, gen),
            **{f"{regime}_auto_over_torch": ms["auto"][regime] / ms["torch"][regime] for regime in REGIMES},
            "ms": ms,
        }
        del runners
    del stacks, auto_stack
    torch.cuda.empty_cache()
    return {
        "name": name,
        "H": h,
        "I": i,
        "layers": layers,
        "rows": rows,
        "dispatch": [[m, p.value] for m, p in entry.points],
    }


def render_md(result: dict) -> str:
    us = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    out = [
        f"# SwiGLU MLP paths and `--fused-swiglu auto` on {result['device']}",
        "",
        f"Date {result['date_utc']}, git {result['git_commit']}, torch {result['torch']} (CUDA {result['cuda']}), "
        f"kernel library {result['kernels_library']}, seed {result['seed']}, margin {result['margin']}. "
        f"Script: benchmarks/swiglu/run_auto.py (benchmarks/device/swiglu_auto_h200.sh), wall {result['wall_s']:.0f} s.",
        "",
        "Times: microseconds per MLP layer, median over calls alternating between the candidates, a stack of distinct-weight layers "
        "(weights > 4x L2) per replay; `graph` = CUDA graph replay, `eager` = Python calls (host cost included). "
        "`old auto` = the fused op with CUTLASS down GEMM at every M (the previous `auto`). "
        "choice = the committed dispatch table's path (a fused path needs a `--margin` lead over torch in both regimes "
        "of the first measurement and of the re-measurement; `(was ...)` marks one the re-measurement demoted); "
        "`auto/torch` = that re-measurement of the stack swapped by the first measurement's choices against the "
        "PyTorch stack (< 1 is faster). err = max rel. Frobenius error vs float64 over the candidates.",
        "",
        "| shape (H x I) | M | torch graph | fused graph | fused+cuBLAS down graph | old auto graph | torch eager "
        "| fused eager | fused+cuBLAS down eager | old auto eager | choice | auto/torch graph | auto/torch eager | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["shapes"]:
        final = dict(s["dispatch_final"])
        for row in s["rows"]:
            ms = row["ms"]
            choice = final[row["M"]] if final[row["M"]] == row["choice"] else f"{final[row['M']]} (was {row['choice']})"
            cells = [us(ms[c][reg]) if c in ms else "err" for reg in REGIMES for c in CANDIDATES]
            v = row["verify"]
            err = max(list(row["rel_err"].values()) + [v["rel_err_auto"]])
            out.append(
                f"| {s['name']} ({s['H']}x{s['I']}) | {row['M']} | "
                + " | ".join(cells)
                + f" | {choice} | {v['graph_auto_over_torch']:.3f} | {v['eager_auto_over_torch']:.3f} | {err:.1e} |"
            )
    worst = result["summary"]
    spread = "; ".join(f"{reg} {lo:.3f}-{hi:.3f}" for reg, (lo, hi) in worst["same_path_spread"].items())
    out += [
        "",
        f"Points where auto runs a fused path ({len(worst['fused_points'])}): "
        f"{', '.join(worst['fused_points']) or 'none'}; of these not faster than torch in both regimes: "
        f"{worst['fused_points_not_faster'] or 'none'}. Where auto runs the PyTorch MLP the ratio only shows "
        f"the measurement's own spread: {spread or 'n/a'}.",
    ]
    out += ["", f"Demoted by the re-measurement: {worst['demoted_by_verification'] or 'none'}."]
    out += [
        "",
        f"Worst auto/torch over all {worst['points']} points: graph {worst['graph_max']:.3f} "
        f"({worst['graph_argmax']}), eager {worst['eager_max']:.3f} ({worst['eager_argmax']}); "
        f"points where auto was > {worst['slower_tolerance']:.2f}x torch: {worst['slower_points'] or 'none'}; "
        f"max rel. error {worst['max_rel_err']:.2e} (bound {REL_ERR_BOUND:g}).",
        "",
    ]
    return "\n".join(out)


def finish(result: dict, out_dir: Path) -> None:
    """Summary, dispatch table and markdown from a result (also `--render RESULT.json` on any machine)."""
    device_name = result["device"]
    tol = 1.02  # flagged in the summary; the same_path_spread says how far the measurement moves on its own
    points = [(s["name"], r["M"], r["verify"]) for s in result["shapes"] for r in s["rows"]]
    g = max(points, key=lambda p: p[2]["graph_auto_over_torch"])
    e = max(points, key=lambda p: p[2]["eager_auto_over_torch"])
    fused_points = [p for p in points if p[2]["auto_path"] != "torch"]
    same_path = [p for p in points if p[2]["auto_path"] == "torch"]  # auto runs the PyTorch MLP: ratio = noise
    result["summary"] = {
        "points": len(points),
        "slower_tolerance": tol,
        "fused_points": [
            f"{n} M={m} ({v['auto_path']}: graph {v['graph_auto_over_torch']:.3f}, eager "
            f"{v['eager_auto_over_torch']:.3f})"
            for n, m, v in fused_points
        ],
        "fused_points_not_faster": [
            f"{n} M={m}"
            for n, m, v in fused_points
            if max(v["graph_auto_over_torch"], v["eager_auto_over_torch"]) >= 1.0
        ],
        "same_path_spread": {
            regime: [
                min(v[f"{regime}_auto_over_torch"] for _, _, v in same_path),
                max(v[f"{regime}_auto_over_torch"] for _, _, v in same_path),
            ]
            for regime in REGIMES
        }
        if same_path
        else {},
        "graph_max": g[2]["graph_auto_over_torch"],
        "graph_argmax": f"{g[0]} M={g[1]}",
        "eager_max": e[2]["eager_auto_over_torch"],
        "eager_argmax": f"{e[0]} M={e[1]}",
        "slower_points": [
            f"{n} M={m} ({v['auto_path']}: graph {v['graph_auto_over_torch']:.3f}, eager "
            f"{v['eager_auto_over_torch']:.3f})"
            for n, m, v in points
            if max(v["graph_auto_over_torch"], v["eager_auto_over_torch"]) > tol
        ],
        "max_rel_err": max(
            max(list(r["rel_err"].values()) + [r["verify"]["rel_err_auto"]])
            for s in result["shapes"]
            for r in s["rows"]
        ),
        "errors": {f"{s['name']} M={r['M']}": r["errors"] for s in result["shapes"] for r in s["rows"] if r["errors"]},
    }
    # The committed table: the first measurement's choices, each fused one kept only if the re-measurement of the
    # swapped stack confirmed it by the margin in both regimes (demoting a point to torch only moves `auto` towards
    # the PyTorch MLP, which is what it is compared with, so the result needs no third measurement).
    shapes = tuple(
        ShapeDispatch.from_timings(
            s["H"], s["I"], {r["M"]: row_timings(r, verified=True) for r in s["rows"]}, margin=result["margin"]
        )
        for s in result["shapes"]
    )
    for s, entry in zip(result["shapes"], shapes):
        s["dispatch_final"] = [[m, p.value] for m, p in entry.points]
    result["summary"]["demoted_by_verification"] = [
        f"{s['name']} M={m} ({first})"
        for s in result["shapes"]
        for (m, first), (_, final) in zip(s["dispatch"], s["dispatch_final"])
        if first != final
    ]
    (out_dir / "swiglu_auto_h200.json").write_text(json.dumps(result, indent=1))
    table = DispatchTable(
        device=device_name,
        margin=result["margin"],
        shapes=shapes,
        source=f"benchmarks/results/swiglu_auto_h200.json ({result['date_utc']}, git {result['git_commit']})",
    )
    (out_dir / "fused_swiglu_dispatch.json").write_text(table.to_json())
    md = render_md(result)
    (out_dir / "swiglu_auto_h200.md").write_text(md)
    print(md)
    print(json.dumps(result["summary"], indent=1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--render", metavar="RESULT_JSON", help="only redo the summary, table and markdown of a result")
    ap.add_argument("--git-commit", default="unknown")
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of names in SHAPES")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args()
    if args.render:
        finish(json.loads(Path(args.render).read_text()), Path(args.out))
        return 0
    tokens = [int(v) for v in args.tokens.split(",")]
    gen = torch.Generator(device=DEV).manual_seed(args.seed)
    device_name = torch.cuda.get_device_name(0)
    t0 = time.time()
    result = {
        "device": device_name,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": args.git_commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seed": args.seed,
        "kernels_library": str(kernels_library_path()),
        "margin": args.margin,
        "tokens": tokens,
        "shapes": [],
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for name in args.shapes.split(","):
            h, i = SHAPES[name]
            result["shapes"].append(run_shape(name, h, i, tokens, args.margin, gen, device_name))
            (out_dir / "swiglu_auto_h200.json").write_text(json.dumps(result, indent=1))
    result["wall_s"] = time.time() - t0
    finish(result, out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
