"""SwiGLU gate/up kernels on an H200: correctness suite + benchmark, one JSON file and printed tables.

Run on the GPU machine from the repo root:
  python3 benchmarks/swiglu/run_swiglu.py --lib PATH/libtilevox_kernels.so --out DIR [--git-commit SHA]
Correctness: fresh random bf16 inputs, outputs poisoned with NaN before every run, float64 reference from
the same bf16 values, mismatch rate |out - ref| > rtol * |ref| at rtol 2^-8 and 5e-3 for Kernel-1 and
Kernel-2 (every tile config) and the torch bf16 (cuBLAS) paths; awkward shapes handled or rejected.
Benchmark: CUDA events around each call, medians, input sets rotated to defeat L2, peak from an 8192^3
cuBLAS GEMM measured in the same run; whole MLP (with down projection) under CUDA graphs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for trt_plugins.library
from kernels_ctypes import (  # noqa: E402
    ERR_UNSUPPORTED_SHAPE,
    KERNEL_AUTO,
    KERNEL_DUAL_PINGPONG,
    KERNEL_PACKED_EVT,
    KernelError,
    TilevoxKernels,
)

# Qwen2.5 dense MLPs: name -> (hidden H = K, intermediate I = N).
QWEN25_SHAPES = {
    "0.5B": (896, 4864),
    "1.5B": (1536, 8960),
    "3B": (2048, 11008),
    "7B": (3584, 18944),
    "14B": (5120, 13824),
    "32B": (5120, 27648),
    "72B": (8192, 29568),
}
TOKENS = [1, 7, 32, 128, 512, 2048, 8192]
RTOLS = {"2^-8": 2.0**-8, "5e-3": 5e-3}
DEV = "cuda"


def make_inputs(t: int, h: int, i: int, gen: torch.Generator, x_scale: float = 1.0):
    x = (torch.randn(t, h, device=DEV, generator=gen) * x_scale).to(torch.bfloat16)
    wg = (torch.randn(i, h, device=DEV, generator=gen) / math.sqrt(h)).to(torch.bfloat16)
    wu = (torch.randn(i, h, device=DEV, generator=gen) / math.sqrt(h)).to(torch.bfloat16)
    return x, wg, wu


def reference_f64(x, wg, wu) -> torch.Tensor:
    xd = x.double()
    g = xd @ wg.double().T
    u = xd @ wu.double().T
    return g * torch.sigmoid(g) * u


def mismatch_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o = out.double()
    finite = bool(torch.isfinite(o).all())
    err = (o - ref).abs()
    aref = ref.abs()
    stats = {"all_finite": finite, "numel": out.numel()}
    for name, rtol in RTOLS.items():
        stats[f"mismatch_rate_rtol_{name}"] = float((err > rtol * aref).double().mean()) if finite else 1.0
    stats["bitwise_ne_rn_bf16_ref"] = float((out != ref.to(torch.bfloat16)).double().mean())
    rms = float(aref.pow(2).mean().sqrt())
    bad = err > RTOLS["2^-8"] * aref
    # Where the 2^-8 mismatches sit: |ref| / rms(ref) of the largest mismatched element (cancellation
    # in the fp32 dot products shows up as mismatches confined to near-zero outputs).
    stats["mismatch_2^-8_max_abs_ref_over_rms"] = float(aref[bad].max() / rms) if finite and bool(bad.any()) else 0.0
    floor = 1e-3 * rms
    stats["max_rel_err_floored"] = float((err / aref.clamp_min(floor)).max()) if finite else float("inf")
    return stats


def torch_eager(x, wg, wu):
    return F.silu(x @ wg.T) * (x @ wu.T)


def torch_merged(x, wcat):
    g, u = (x @ wcat.T).chunk(2, dim=-1)
    return F.silu(g) * u


def run_correctness(kern: TilevoxKernels, shapes, tokens, gen) -> list[dict]:
    rows = []
    for name, (h, i) in shapes.items():
        for t in tokens:
            x, wg, wu = make_inputs(t, h, i, gen)
            wpk = kern.pack(wg, wu)
            ref = reference_f64(x, wg, wu)
            row = {"model": name, "T": t, "H": h, "I": i, "results": {}}
            for kid, kname in ((KERNEL_DUAL_PINGPONG, "k1"), (KERNEL_PACKED_EVT, "k2")):
                for cfg in range(kern.lib.tilevox_swiglu_gateup_num_configs(kid)):
                    out = torch.full((t, i), float("nan"), device=DEV, dtype=torch.bfloat16)
                    try:
                        kern.swiglu(x, wg, wu, wpk, out, kernel=kid, tile_config=cfg)
                        torch.cuda.synchronize()
                        row["results"][f"{kname}_cfg{cfg}"] = mismatch_stats(out, ref)
                    except KernelError as exc:
                        row["results"][f"{kname}_cfg{cfg}"] = {"error": str(exc)}
            row["results"]["torch_eager_bf16"] = mismatch_stats(torch_eager(x, wg, wu), ref)
            wcat = torch.cat([wg, wu], 0)
            g, u = (x @ wcat.T).chunk(2, dim=-1)
            row["results"]["torch_merged_fp32act"] = mismatch_stats((F.silu(g.float()) * u.float()).bfloat16(), ref)
            rows.append(row)
            del x, wg, wu, wpk, ref, wcat, g, u
        torch.cuda.empty_cache()
        print(f"correctness {name} done", flush=True)
    return rows


def run_awkward(kern: TilevoxKernels, gen) -> list[dict]:
    """Shapes off the tile grid (handled) and shapes the TMA cannot take (rejected with a message)."""
    rows = []
    handled = [(7, 136, 200), (1, 64, 8), (300, 1000, 1000), (129, 904, 4872), (65, 8, 16)]
    for t, h, i in handled:
        for strided in (False, True):
            x, wg, wu = make_inputs(t, h, i, gen)
            if strided:  # row strides larger than the row: x and out are column slices of wider tensors
                xw = torch.randn(t, h + 24, device=DEV, generator=gen).to(torch.bfloat16)
                xw[:, :h] = x
                x = xw[:, :h]
            ref = reference_f64(x, wg, wu)
            wpk = kern.pack(wg, wu)
            for kid, kname in ((KERNEL_DUAL_PINGPONG, "k1"), (KERNEL_PACKED_EVT, "k2")):
                for cfg in range(kern.lib.tilevox_swiglu_gateup_num_configs(kid)):
                    big = torch.full((t, i + 16 if strided else i), float("nan"), device=DEV, dtype=torch.bfloat16)
                    out = big[:, :i]
                    entry = {"case": f"T={t} H={h} I={i} strided={strided}", "kernel": f"{kname}_cfg{cfg}"}
                    try:
                        kern.swiglu(x, wg, wu, wpk, out, kernel=kid, tile_config=cfg)
                        torch.cuda.synchronize()
                        entry.update(mismatch_stats(out, ref))
                        if strided:  # the padding columns must stay untouched (still NaN)
                            entry["padding_untouched"] = bool(torch.isnan(big[:, i:].float()).all())
                    except KernelError as exc:
                        entry["error"] = str(exc)
                    rows.append(entry)
    # Large |g| (exp overflow region): silu must give 0, not NaN.
    x, wg, wu = make_inputs(64, 512, 256, gen, x_scale=300.0)
    ref = reference_f64(x, wg, wu)
    wpk = kern.pack(wg, wu)
    for kid, kname in ((KERNEL_DUAL_PINGPONG, "k1"), (KERNEL_PACKED_EVT, "k2")):
        out = torch.full((64, 256), float("nan"), device=DEV, dtype=torch.bfloat16)
        kern.swiglu(x, wg, wu, wpk, out, kernel=kid)
        torch.cuda.synchronize()
        rows.append({"case": "T=64 H=512 I=256 x*300 (|g| >> 88)", "kernel": kname, **mismatch_stats(out, ref)})
    # Rejections.
    rejected = [
        ("k % 8 != 0", 4, 100, 64, {}),
        ("n % 8 != 0", 4, 64, 1001, {}),
        ("x misaligned", 4, 64, 64, {"misalign_x": True}),
        ("ldx % 8 != 0", 4, 64, 64, {"ldx_pad": 4}),
    ]
    for what, t, h, i, opt in rejected:
        for kid, kname in ((KERNEL_DUAL_PINGPONG, "k1"), (KERNEL_PACKED_EVT, "k2")):
            x, wg, wu = make_inputs(t, h, i, gen)
            if opt.get("misalign_x"):
                x = torch.empty(t * h + 1, device=DEV, dtype=torch.bfloat16)[1:].view(t, h)
            if opt.get("ldx_pad"):
                x = torch.empty(t, h + opt["ldx_pad"], device=DEV, dtype=torch.bfloat16)[:, :h]
            wpk = torch.cat([wg, wu], 0)
            out = torch.empty(t, i, device=DEV, dtype=torch.bfloat16)
            entry = {"case": f"reject: {what} (T={t} H={h} I={i})", "kernel": kname}
            try:
                kern.swiglu(x, wg, wu, wpk, out, kernel=kid)
                torch.cuda.synchronize()
                entry["error"] = None
                entry["rejected_ok"] = False
            except KernelError as exc:
                entry["error"] = exc.message
                entry["rejected_ok"] = exc.code == ERR_UNSUPPORTED_SHAPE
            rows.append(entry)
    return rows


def run_gemm_correctness(kern: TilevoxKernels, gen) -> list[dict]:
    rows = []
    for t, n, k in [(1, 896, 4864), (7, 3584, 18944), (128, 8192, 29568), (2048, 5120, 13824), (100, 136, 1000)]:
        a = torch.randn(t, k, device=DEV, generator=gen).to(torch.bfloat16)
        b = (torch.randn(n, k, device=DEV, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
        ref = a.double() @ b.double().T
        for cfg in range(kern.lib.tilevox_gemm_bf16_num_configs()):
            d = torch.full((t, n), float("nan"), device=DEV, dtype=torch.bfloat16)
            kern.gemm(a, b, d, tile_config=cfg)
            torch.cuda.synchronize()
            rows.append({"case": f"M={t} N={n} K={k}", "cfg": cfg, **mismatch_stats(d, ref)})
        rows.append({"case": f"M={t} N={n} K={k}", "cfg": "torch_bf16", **mismatch_stats(a @ b.T, ref)})
    return rows


def time_fn(fn, sets, min_iters=10, max_iters=200, target_ms=150.0) -> float:
    """Median milliseconds of fn(set) over rotated input sets; one event pair around each call."""
    r = len(sets)
    for w in range(3):
        fn(sets[w % r])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for w in range(3):
        fn(sets[w % r])
    torch.cuda.synchronize()
    est_ms = (time.perf_counter() - t0) * 1e3 / 3
    iters = int(min(max_iters, max(min_iters, target_ms / max(est_ms, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for it in range(iters):
        starts[it].record()
        fn(sets[it % r])
        ends[it].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def measure_peak() -> float:
    n = 8192
    sets = [(torch.randn(n, n, device=DEV).bfloat16(), torch.randn(n, n, device=DEV).bfloat16()) for _ in range(2)]
    ms = time_fn(lambda s: s[0] @ s[1], sets, min_iters=20, max_iters=40)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def run_bench(kern: TilevoxKernels, shapes, tokens, gen, peak: float, use_compile: bool) -> list[dict]:
    rows = []
    compiled = torch.compile(torch_eager) if use_compile else None
    for name, (h, i) in shapes.items():
        for t in tokens:
            set_bytes = 2 * (t * h + 6 * i * h + 6 * t * i)
            nsets = int(max(2, min(8, math.ceil(256e6 / set_bytes))))
            sets = []
            for _ in range(nsets):
                x, wg, wu = make_inputs(t, h, i, gen)
                out = torch.empty(t, i, device=DEV, dtype=torch.bfloat16)
                wpk = kern.pack(wg, wu)
                wcat = torch.cat([wg, wu], 0)
                sets.append({"x": x, "wg": wg, "wu": wu, "wpk": wpk, "wcat": wcat, "out": out})
            flops = 4.0 * t * h * i
            res = {}
            variants = {}
            for kid, kname in ((KERNEL_DUAL_PINGPONG, "k1"), (KERNEL_PACKED_EVT, "k2")):
                for cfg in range(kern.lib.tilevox_swiglu_gateup_num_configs(kid)):
                    for s in sets:
                        s[f"p_{kname}{cfg}"] = kern.swiglu_params(
                            s["x"], s["wg"], s["wu"], s["wpk"], s["out"], kid, cfg
                        )
                    variants[f"{kname}_cfg{cfg}"] = (lambda key: lambda s: kern.swiglu_launch(s[key]))(
                        f"p_{kname}{cfg}"
                    )
            for s in sets:
                s["p_auto"] = kern.swiglu_params(s["x"], s["wg"], s["wu"], s["wpk"], s["out"], KERNEL_AUTO, -1)
            variants["tilevox_auto"] = lambda s: kern.swiglu_launch(s["p_auto"])
            variants["torch_eager"] = lambda s: torch_eager(s["x"], s["wg"], s["wu"])
            variants["torch_merged_act"] = lambda s: torch_merged(s["x"], s["wcat"])
            variants["cublas_gemm_2n_alone"] = lambda s: s["x"] @ s["wcat"].T
            if compiled is not None:
                variants["torch_compile_default"] = lambda s: compiled(s["x"], s["wg"], s["wu"])
            for vname, fn in variants.items():
                try:
                    ms = time_fn(fn, sets)
                    res[vname] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
                except Exception as exc:  # recorded in the JSON, never hidden
                    res[vname] = {"error": f"{type(exc).__name__}: {exc}"}
            for vname in res:
                if "ms" in res[vname]:
                    res[vname]["pct_peak"] = 100.0 * res[vname]["tflops"] / peak
                    if "ms" in res.get("torch_eager", {}):
                        res[vname]["speedup_vs_eager"] = res["torch_eager"]["ms"] / res[vname]["ms"]
            auto = {}
            for kid, kname in ((KERNEL_DUAL_PINGPONG, "k1"), (KERNEL_PACKED_EVT, "k2"), (KERNEL_AUTO, "auto")):
                sel_kid, sel_cfg, sel_name = kern.select(t, i, h, kid)
                auto[kname] = f"{'k1' if sel_kid == KERNEL_DUAL_PINGPONG else 'k2'}_cfg{sel_cfg}"
            rows.append(
                {
                    "model": name,
                    "T": t,
                    "H": h,
                    "I": i,
                    "flops": flops,
                    "num_sets": nsets,
                    "heuristic": auto,
                    "results": res,
                }
            )
            del sets
            print(f"bench {name} T={t} done", flush=True)
        torch.cuda.empty_cache()
    return rows


def run_gemm_bench(kern: TilevoxKernels, shapes, tokens, gen, peak: float) -> list[dict]:
    """Down projection y (T, H) = h (T, I) @ W_down^T: tilevox GEMM configs vs torch (cuBLAS)."""
    rows = []
    for name, (h, i) in shapes.items():
        for t in tokens:
            nsets = int(max(2, min(8, math.ceil(256e6 / (2 * (t * i + h * i + t * h))))))
            sets = [
                {
                    "a": torch.randn(t, i, device=DEV, generator=gen).bfloat16(),
                    "b": (torch.randn(h, i, device=DEV, generator=gen) / math.sqrt(i)).bfloat16(),
                    "d": torch.empty(t, h, device=DEV, dtype=torch.bfloat16),
                }
                for _ in range(nsets)
            ]
            res = {}
            for cfg in [-1, *range(kern.lib.tilevox_gemm_bf16_num_configs())]:
                ms = time_fn(lambda s, c=cfg: kern.gemm(s["a"], s["b"], s["d"], tile_config=c), sets)
                res["auto" if cfg < 0 else f"cfg{cfg}"] = {"ms": ms}
            res["torch"] = {"ms": time_fn(lambda s: s["a"] @ s["b"].T, sets)}
            for v in res.values():
                v["tflops"] = 2.0 * t * h * i / (v["ms"] * 1e-3) / 1e12
                v["pct_peak"] = 100 * v["tflops"] / peak
            rows.append({"model": name, "T": t, "M": t, "N": h, "K": i, "results": res})
            del sets
    return rows


def run_mlp_graphs(kern: TilevoxKernels, gen, peak: float) -> list[dict]:
    """Whole MLP y = down(swiglu(x)) under CUDA graphs: tilevox (fused gate/up + tilevox GEMM) vs eager."""
    rows = []
    for name in ("0.5B", "7B", "72B"):
        h, i = QWEN25_SHAPES[name]
        for t in (1, 32, 512, 2048):
            x, wg, wu = make_inputs(t, h, i, gen)
            wd = (torch.randn(h, i, device=DEV, generator=gen) / math.sqrt(i)).to(torch.bfloat16)
            wpk = kern.pack(wg, wu)
            hbuf = torch.empty(t, i, device=DEV, dtype=torch.bfloat16)
            y = torch.empty(t, h, device=DEV, dtype=torch.bfloat16)
            entry = {"model": name, "T": t}

            def fused():
                kern.swiglu(x, wg, wu, wpk, hbuf, kernel=KERNEL_AUTO)
                kern.gemm(hbuf, wd, y)

            def eager():
                return (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T

            wcat = torch.cat([wg, wu], 0)

            def gateup_only():
                kern.swiglu(x, wg, wu, wpk, hbuf, kernel=KERNEL_AUTO)

            def down_only():
                kern.gemm(hbuf, wd, y)

            variants = (
                ("tilevox_fused_mlp", fused),
                ("torch_eager_mlp", eager),
                ("tilevox_gateup", gateup_only),
                ("torch_eager_gateup", lambda: torch_eager(x, wg, wu)),
                ("torch_merged_gateup_act", lambda: torch_merged(x, wcat)),
                ("tilevox_down_gemm", down_only),
                ("torch_down_gemm", lambda: hbuf @ wd.T),
            )
            for vname, fn in variants:
                try:
                    fn()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        fn()
                    ms = time_fn(lambda _s: g.replay(), [None], min_iters=20)
                    entry[vname] = {"ms_graph": ms, "tflops": 6.0 * t * h * i / (ms * 1e-3) / 1e12}
                except Exception as exc:
                    entry[vname] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-800:]}
            ref = (
                F.silu(x.double() @ wg.double().T) * (x.double() @ wu.double().T)
            ).bfloat16().double() @ wd.double().T
            fused()
            torch.cuda.synchronize()
            entry["fused_mlp_rel_fro_err"] = float((y.double() - ref).norm() / ref.norm())
            rows.append(entry)
    return rows


def print_tables(result: dict) -> None:
    peak = result["peak_tflops"]
    print(f"\npeak bf16 (8192^3 cuBLAS, this run): {peak:.1f} TFLOP/s")
    cols = [
        "k1_cfg0",
        "k1_cfg1",
        "k2_cfg0",
        "k2_cfg1",
        "k2_cfg2",
        "k2_cfg3",
        "k2_cfg4",
        "tilevox_auto",
        "torch_eager",
        "torch_merged_act",
        "torch_compile_default",
        "cublas_gemm_2n_alone",
    ]
    print("\nmodel  T     " + " ".join(f"{c[:14]:>14}" for c in cols) + "  best_tv  %peak  x_eager  x_merged")
    for row in result.get("bench", []):
        r = row["results"]
        cells = []
        for c in cols:
            cells.append(f"{r[c]['ms'] * 1e3:12.1f}us" if "ms" in r.get(c, {}) else f"{'-':>14}")
        tv = {c: r[c]["ms"] for c in cols[:8] if "ms" in r.get(c, {})}
        if tv:
            best = min(tv, key=tv.get)
            pk = r[best]["pct_peak"]
            xe = r["torch_eager"]["ms"] / tv[best] if "ms" in r.get("torch_eager", {}) else float("nan")
            xm = r["torch_merged_act"]["ms"] / tv[best] if "ms" in r.get("torch_merged_act", {}) else float("nan")
            print(
                f"{row['model']:<6} {row['T']:<5} " + " ".join(cells) + f"  {best:>7} {pk:5.1f} {xe:7.2f}x {xm:7.2f}x"
            )
    print("\ndown-projection GEMM (us): model T auto cfg0 cfg1 cfg2 torch")
    for row in result.get("gemm_down_bench", []):
        r = row["results"]
        print(
            f"  {row['model']:<5} {row['T']:<5} "
            + " ".join(f"{r[c]['ms'] * 1e3:9.1f}" for c in ("auto", "cfg0", "cfg1", "cfg2", "torch"))
        )
    for m in result.get("mlp_cuda_graphs", []):
        cells = {k: v.get("ms_graph", v.get("error")) for k, v in m.items() if isinstance(v, dict)}
        print("  mlp graph", m["model"], m["T"], cells)
    print("\ncorrectness: max mismatch rate over all shapes")
    agg: dict[str, dict[str, float]] = {}
    for row in result.get("correctness", []):
        for cand, st in row["results"].items():
            a = agg.setdefault(cand, {"2^-8": 0.0, "5e-3": 0.0, "errors": 0, "nonfinite": 0, "refmag": 0.0})
            if "error" in st:
                a["errors"] += 1
                continue
            a["nonfinite"] += int(not st["all_finite"])
            for k in ("2^-8", "5e-3"):
                a[k] = max(a[k], st[f"mismatch_rate_rtol_{k}"])
            a["refmag"] = max(a["refmag"], st.get("mismatch_2^-8_max_abs_ref_over_rms", 0.0))
    for cand, a in agg.items():
        print(
            f"  {cand:<22} rtol 2^-8: {100 * a['2^-8']:.4f}%  rtol 5e-3: {100 * a['5e-3']:.4f}%  "
            f"errors {a['errors']}  nonfinite {a['nonfinite']}  mismatched |ref|/rms <= {a['refmag']:.3g}"
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-commit", default="unknown")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--models", default=",".join(QWEN25_SHAPES))
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args()
    tokens = [int(v) for v in args.tokens.split(",")]
    shapes = {m: QWEN25_SHAPES[m] for m in args.models.split(",")}
    gen = torch.Generator(device=DEV).manual_seed(args.seed)
    kern = TilevoxKernels(args.lib)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": args.git_commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seed": args.seed,
        "allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "packing_block": kern.packing_block,
        "tokens": tokens,
        "models": list(shapes),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "swiglu_h200.json"

    def dump():
        path.write_text(json.dumps(result, indent=1))

    t0 = time.time()
    result["peak_tflops"] = measure_peak()
    if not args.skip_correctness:
        result["awkward"] = run_awkward(kern, gen)
        result["gemm_correctness"] = run_gemm_correctness(kern, gen)
        dump()
        result["correctness"] = run_correctness(kern, shapes, tokens, gen)
        dump()
        print(f"correctness wall {time.time() - t0:.0f}s", flush=True)
    if not args.skip_bench:
        result["bench"] = run_bench(kern, shapes, tokens, gen, result["peak_tflops"], not args.no_compile)
        dump()
        result["gemm_down_bench"] = run_gemm_bench(kern, shapes, tokens, gen, result["peak_tflops"])
        dump()
        result["mlp_cuda_graphs"] = run_mlp_graphs(kern, gen, result["peak_tflops"])
    result["wall_s"] = time.time() - t0
    dump()
    for e in result.get("awkward", []):
        print("awkward", json.dumps({k: v for k, v in e.items() if k not in ("numel",)}))
    print_tables(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
