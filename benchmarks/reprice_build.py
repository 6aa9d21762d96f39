"""Re-price the candidates of finished `tilevox build --splits` reports with today's search (no GPU): the
measurements in each build_report.json (per-region times, anchors, end-to-end steps) stay as measured; only
the predictions are recomputed (engine_builder.build's pricing of cut pieces, the model's simulated tile
graphs on this CPU), so that a change of the pricing is checked against steps that were really run.

    python -m benchmarks.reprice_build benchmarks/results/build_h100_b3d00b8/build_llama-1b ... --out PATH

Prints, per build and bucket, each measured candidate's predicted step under the report's pricing and under
today's, with both errors, and which candidate today's search ranks first; per build, the price of a cut that
engine_builder.build.fit_cut_costs fits from its measured cut and whole candidates; writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tilevox.engine_builder.build import _is_cut, fit_cut_costs, piece_prices
from tilevox.engine_builder.composition import (
    Backend,
    Composition,
    CutCosts,
    cuts_s,
    model_layout,
    predict_step_s,
)
from tilevox.engine_builder.regions import TilingConfig
from tilevox.engine_builder.simulated_costs import SimulatedMegakernelCost
from tilevox.models.registry import load_model


def reprice(build_dir: Path, context: int) -> list[dict]:
    report = json.loads((build_dir / "build_report.json").read_text())
    plan = report["plan"]
    model = load_model(plan["model"], device="cpu", dtype=torch.bfloat16)
    layout = model_layout(model)
    measured = {(m["region"], m["backend"], m["batch"]): m["ms_per_step"] for m in report["measured_ms"]}
    measured = {k: (float("inf") if v is None else v) for k, v in measured.items()}
    tiling = None if plan.get("tiling") is None else TilingConfig.from_dict(plan["tiling"])
    shares, megakernel_s = piece_prices(
        measured, layout, SimulatedMegakernelCost(model, context=context, tiling=tiling)
    )

    rows, fit_data = [], {}
    for batch_text, candidates in report["candidates"].items():
        batch = int(batch_text)
        step_s = {}
        for row in candidates:
            composition = Composition.from_list(row["composition"])
            step_s[row["label"]] = predict_step_s(
                composition, layout, batch, conventional=shares, megakernel=megakernel_s
            )
        anchor = next(
            r for r in candidates if all(Backend(p["backend"]).is_conventional for p in r["composition"])
        )  # every region conventional: its predicted step is the anchor (build.py)
        rest_ms = report["anchor_step_ms"][batch_text] - step_s[anchor["label"]] * 1e3
        best = min(step_s, key=step_s.get)
        for row in candidates:
            if "measured_step_ms" not in row:
                continue
            today = step_s[row["label"]] * 1e3 + rest_ms
            composition = Composition.from_list(row["composition"])
            uncut_ms = today - cuts_s(composition, layout, batch, CutCosts()) * 1e3
            fit_data.setdefault(batch, []).append((composition, row["measured_step_ms"] * 1e-3, uncut_ms * 1e-3))
            rows.append(
                {
                    "model": plan["model"],
                    "batch": batch,
                    "label": row["label"],
                    "cut": _is_cut(composition, layout),
                    "measured_ms": row["measured_step_ms"],
                    "predicted_ms_then": row["predicted_step_ms"],
                    "error_then": row["prediction_error"],
                    "predicted_ms_now": today,
                    "error_now": today / row["measured_step_ms"] - 1.0,
                    "first_now": row["label"] == best,
                }
            )
        rows.append({"model": plan["model"], "batch": batch, "ranked_first_now": best})
    fit = fit_cut_costs(fit_data, layout)
    rows.append(
        {
            "model": plan["model"],
            "fitted_cut_s": None if fit is None else fit[0],
            "cut_samples_s": [] if fit is None else fit[1],
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", type=Path, help="build output folders (with build_report.json)")
    parser.add_argument("--context", type=int, default=512, help="keys per stream of the simulated tile graphs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = [row for build in args.builds for row in reprice(build, args.context)]
    print("| model | batch | candidate | cut | measured ms | predicted then | error then | predicted now | error now |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "fitted_cut_s" in r:
            samples = ", ".join(f"{x * 1e6:+.0f}" for x in r["cut_samples_s"])
            fitted = "none" if r["fitted_cut_s"] is None else f"{r['fitted_cut_s'] * 1e6:.1f} us"
            print(
                f"| {r['model']} | | price of a cut fitted (build.fit_cut_costs): {fitted}; samples us: {samples} | | | | | | |"
            )
            continue
        if "ranked_first_now" in r:
            print(f"| {r['model']} | {r['batch']} | today's first: {r['ranked_first_now']} | | | | | | |")
            continue
        print(
            f"| {r['model']} | {r['batch']} | {r['label']} | {'yes' if r['cut'] else 'no'} | {r['measured_ms']:.3f} | "
            f"{r['predicted_ms_then']:.3f} | {r['error_then']:+.1%} | {r['predicted_ms_now']:.3f} | {r['error_now']:+.1%} |"
        )
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
