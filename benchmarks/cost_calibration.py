"""How well the region simulator predicts the megakernel once its cost constants come from a GPU profile.

Reads a `benchmarks.megakernel_variants` (or `megakernel_profile`) JSON of the Llasa-1B step, calibrates
the per-instruction cost model (engine_builder.regions.cost.calibrated) on ONE profiled launch (--fit
VARIANT:BATCH), then compiles every other profiled (variant tiling, batch) on the meta device, simulates it
with the calibrated constants and compares the prediction with the measured CUDA-graph time of that launch.
CPU only (no GPU needed); variants that differ only in build switches share a prediction.

    python -m benchmarks.cost_calibration --profile benchmarks/results/megakernel_variants_h100_e666ade.json \\
        --fit default:1 --out benchmarks/results/cost_calibration_h100_e666ade.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import torch

from tilevox.engine_builder.regions.compiler import compile_region
from tilevox.engine_builder.regions.cost import H100, H200, calibrated
from tilevox.engine_builder.regions.schedule import simulate
from tilevox.engine_builder.regions.spec import RegionSpec, TilingConfig
from tilevox.models.registry import meta_regions

BASES = {"H100": H100, "H200": H200}


def _profiles(data: dict) -> dict[str, dict]:
    """variant name -> megakernel_profile result (a bare megakernel_profile JSON is one variant, 'profile')."""
    return data["results"] if "results" in data else {"profile": data}


def _tiling(recorded: dict) -> TilingConfig:
    known = {f.name for f in dataclasses.fields(TilingConfig)}
    # Fields a profile predates keep the value they had then: all rows per attention tile, the reduce kept.
    base = {"attn_rows": None, "reduce_single_partition": True, "sm_balanced": False}
    return TilingConfig(**{**base, **{k: v for k, v in recorded.items() if k in known}})


def _compile(region, result: dict, batch: int, device):
    """The profiled launch's program: its tiling, batch and context, scheduled under `device`'s costs."""
    return compile_region(
        region,
        RegionSpec.full_step(1),
        batch_size=batch,
        max_context=result["max_context"],
        cost_context=result["context"] + 1,
        tiling=_tiling(result["tiling"]),
        num_sms=device.num_sms,
        device=device,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--fit", default="default:1", help="VARIANT:BATCH whose profile sets the constants")
    parser.add_argument("--model", default="llama-1b", help="the preset the profile ran (Llasa-1B: llama-1b)")
    parser.add_argument(
        "--per-opcode", choices=["on", "off"], default="on", help="also scale each opcode by its measured mean"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    data = json.loads(args.profile.read_text())
    profiles = _profiles(data)
    fit_variant, fit_batch = args.fit.rsplit(":", 1)
    if fit_variant not in profiles:
        parser.error(f"--fit variant {fit_variant!r} not in the profile; it holds {sorted(profiles)}")
    fit_rows = [r for r in profiles[fit_variant]["rows"] if r["batch"] == int(fit_batch)]
    if not fit_rows:
        parser.error(f"--fit batch {fit_batch} not profiled for {fit_variant}")
    gpu = profiles[fit_variant]["device"]
    base = next((d for key, d in BASES.items() if key in gpu), None)
    if base is None:
        parser.error(f"no datasheet constants for {gpu!r}; known: {sorted(BASES)}")
    region = meta_regions(args.model, dtype=torch.bfloat16)["decoder_step"]
    base = dataclasses.replace(base, num_sms=profiles[fit_variant]["num_sms"])
    fitted = _compile(region, profiles[fit_variant], int(fit_batch), base)
    device = calibrated(base, fit_rows[0], fitted.program.instructions if args.per_opcode == "on" else ())
    predicted: dict[tuple, float] = {}
    rows = []
    for name, result in profiles.items():
        tiling = _tiling(result["tiling"])
        for row in result["rows"]:
            key = (json.dumps(dataclasses.asdict(tiling), sort_keys=True), row["batch"])  # build switches aside
            if key not in predicted:
                compiled = _compile(region, result, row["batch"], device)
                predicted[key] = simulate(compiled.program, device).makespan_s * 1e3
            measured = row["graph_ms_no_prefetch"]
            rows.append(
                {
                    "variant": name,
                    "batch": row["batch"],
                    "instructions": row["instructions"],
                    "measured_ms": measured,
                    "predicted_ms": predicted[key],
                    "error_pct": 100 * (predicted[key] - measured) / measured,
                    "fitted_on": name == fit_variant and row["batch"] == int(fit_batch),
                }
            )
            print(
                f"{name:24s} batch {row['batch']:3d}: measured {measured:7.3f} ms, predicted {predicted[key]:7.3f} ms "
                f"({rows[-1]['error_pct']:+.1f} %){'  <- fitted here' if rows[-1]['fitted_on'] else ''}"
            )
    table = ["| variant | batch | measured ms | predicted ms | error |", "|---|---|---|---|---|"]
    table += [
        f"| {r['variant']}{' (fit)' if r['fitted_on'] else ''} | {r['batch']} | {r['measured_ms']:.3f} | "
        f"{r['predicted_ms']:.3f} | {r['error_pct']:+.1f} % |"
        for r in rows
    ]
    print("\n".join(table))
    if args.out is not None:
        report = {
            "benchmark": "region simulator calibrated on one profiled megakernel launch, against measured launches",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "profile": str(args.profile),
            "profile_commit": data.get("commit"),
            "gpu": gpu,
            "fit": args.fit,
            "per_opcode": args.per_opcode,
            "device_costs": dataclasses.asdict(device),
            "rows": rows,
            "table": "\n".join(table),
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
