"""Markdown summary of a run_swiglu.py JSON: python benchmarks/swiglu/summarize.py RESULT.json > RESULT.md.

Tables: fused gate/up (AUTO pick and best config) against eager, merged GEMM + activation, torch.compile
and the cuBLAS GEMM over 2N alone; numerics per candidate; the whole MLP and its parts under CUDA graphs.
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    r = json.loads(open(path).read())
    peak = r["peak_tflops"]
    print(f"# SwiGLU gate/up kernels on {r['device']}\n")
    print(
        f"Date {r['date_utc']}, git {r['git_commit']}, torch {r['torch']} (CUDA {r['cuda']}), "
        f"allow_bf16_reduced_precision_reduction={r['allow_bf16_reduced_precision_reduction']}, "
        f"seed {r['seed']}. Peak bf16 measured in the same run (8192^3 cuBLAS): **{peak:.1f} TFLOP/s**.\n"
    )
    print(
        "Times are medians of CUDA-event timings around each call (host launch cost included, so small "
        "shapes are launch-bound), input sets rotated past L2. torch.compile is mode=default (max-autotune "
        "not run). x = speedup of tilevox AUTO.\n"
    )
    print(
        "| model | T | tilevox AUTO (us) | AUTO pick | best config (us) | eager | merged+act | compile | "
        "cuBLAS 2N alone | AUTO % peak | x eager | x merged | x compile |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in r["bench"]:
        res = row["results"]
        a = res["tilevox_auto"]["ms"]
        best = min((c for c in res if c.startswith("k") and "ms" in res[c]), key=lambda c: res[c]["ms"])
        us = lambda c: res[c]["ms"] * 1e3  # noqa: E731
        print(
            f"| {row['model']} | {row['T']} | {a * 1e3:.1f} | {row['heuristic']['auto']} | {best} {us(best):.1f} | "
            f"{us('torch_eager'):.1f} | {us('torch_merged_act'):.1f} | {us('torch_compile_default'):.1f} | "
            f"{us('cublas_gemm_2n_alone'):.1f} | {res['tilevox_auto']['pct_peak']:.1f} | "
            f"{res['torch_eager']['ms'] / a:.2f} | {res['torch_merged_act']['ms'] / a:.2f} | "
            f"{res['torch_compile_default']['ms'] / a:.2f} |"
        )
    print("\n## Numerics (max over the 49 Qwen2.5 cases; fresh random inputs, NaN-poisoned outputs, fp64 reference)\n")
    print("| candidate | mismatch rtol 2^-8 | mismatch rtol 5e-3 | max bitwise != RN_bf16(ref) | non-finite |")
    print("|---|---|---|---|---|")
    agg: dict[str, list[float]] = {}
    for row in r["correctness"]:
        for cand, st in row["results"].items():
            a = agg.setdefault(cand, [0.0, 0.0, 0.0, 0.0])
            a[0] = max(a[0], st["mismatch_rate_rtol_2^-8"])
            a[1] = max(a[1], st["mismatch_rate_rtol_5e-3"])
            a[2] = max(a[2], st["bitwise_ne_rn_bf16_ref"])
            a[3] += 0 if st["all_finite"] else 1
    for cand, a in agg.items():
        print(f"| {cand} | {100 * a[0]:.3f} % | {100 * a[1]:.3f} % | {100 * a[2]:.2f} % | {int(a[3])} |")
    print("\n## Under CUDA graphs (us): whole MLP and its parts\n")
    keys = [
        "tilevox_fused_mlp",
        "torch_eager_mlp",
        "tilevox_gateup",
        "torch_eager_gateup",
        "torch_merged_gateup_act",
        "tilevox_down_gemm",
        "torch_down_gemm",
    ]
    print("| model | T | " + " | ".join(keys) + " | fused MLP rel. error |")
    print("|---|---|" + "---|" * (len(keys) + 1))
    for m in r["mlp_cuda_graphs"]:
        cells = [f"{m[k]['ms_graph'] * 1e3:.1f}" if "ms_graph" in m.get(k, {}) else "error" for k in keys]
        print(f"| {m['model']} | {m['T']} | " + " | ".join(cells) + f" | {m['fused_mlp_rel_fro_err']:.2e} |")


if __name__ == "__main__":
    main(sys.argv[1])
