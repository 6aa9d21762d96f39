"""What the calibrated region simulator predicts for tilings no GPU has run yet (CPU only).

Calibrates the per-instruction cost model (engine_builder.regions.cost.calibrated) on one profiled launch per
batch size of a `benchmarks.megakernel_variants` JSON (--fit VARIANT: the factors hold across tilings at one
batch size, not across batch sizes; see benchmarks.cost_calibration), then compiles each model's region on the
meta device with each tiling of --tilings (benchmarks.megakernel_variants.TILINGS names, applied in order on top
of the fitted launch's tiling; `+` joins several, e.g. `onepart+split`) and simulates it. Every number it writes is
a prediction, to be replaced by a measurement when a GPU runs the tiling.

    python -m benchmarks.tiling_prediction --profile benchmarks/results/megakernel_variants_h100_e666ade.json \\
        --fit default@balanced --tilings balanced,split,onepart,onepart+split \\
        --out benchmarks/results/tiling_prediction_h100_e666ade.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
from pathlib import Path

import torch

from benchmarks.common import add_tiling_args, apply_tiling_args
from benchmarks.cost_calibration import BASES, _compile, _profiles, _tiling
from benchmarks.megakernel_variants import TILINGS
from tilevox.engine_builder.regions.compiler import compile_region
from tilevox.engine_builder.regions.cost import calibrated
from tilevox.engine_builder.regions.schedule import simulate
from tilevox.engine_builder.regions.spec import RegionSpec, region_spec
from tilevox.models.qwen3_tts.speech_tokenizer import PRESETS as SPEECH_PRESETS
from tilevox.models.qwen3_tts.speech_tokenizer.decoder import Transformer
from tilevox.models.region_backends import TALKER_STEP
from tilevox.models.registry import meta_regions

MODELS = ("llama-1b", "qwen3-tts-0.6b-talker", "qwen3-tts-0.6b-predictor", "qwen3-tts-codec-transformer")


def tiling_of(base, names: str):
    """`base` with the flags of TILINGS[name] for each `+`-joined name applied in order."""
    parser = argparse.ArgumentParser()
    add_tiling_args(parser)
    tiling = base
    for name in names.split("+"):
        if name not in TILINGS:
            raise ValueError(f"unknown tiling {name!r}; known: {', '.join(TILINGS)}")
        tiling = apply_tiling_args(tiling, parser.parse_args(TILINGS[name]))
    return tiling


@functools.cache
def _region(model: str) -> tuple[torch.nn.Module, RegionSpec, bool]:
    """(meta-device region, its spec, whether it attends the profile's context) of one of MODELS."""
    if model == "llama-1b":
        return meta_regions("llama-1b", dtype=torch.bfloat16)["decoder_step"], RegionSpec.full_step(1), True
    if model == "qwen3-tts-codec-transformer":  # the 12 Hz codec decoder's transformer, a full 72-frame window
        with torch.device("meta"):
            transformer = Transformer(SPEECH_PRESETS["12hz"].decoder).to(torch.bfloat16)
        return transformer, RegionSpec(lm_head=True), False
    regions = meta_regions("qwen3-tts-0.6b", dtype=torch.bfloat16)
    if model == "qwen3-tts-0.6b-talker":  # one talker step at the profile's context, its codec head included
        return regions["talker_step"], region_spec(TALKER_STEP), True
    # one Qwen3-TTS-0.6B frame's code-predictor loop (its own 17-position context)
    return regions["code_predictor_loop"], RegionSpec.code_predictor_loop(), False


def _predict(model: str, tiling, batch: int, context: int, max_context: int, device) -> float:
    region, spec, at_context = _region(model)
    extra = {"max_context": max_context, "cost_context": context + 1} if at_context else {}
    compiled = compile_region(
        region, spec, batch_size=batch, tiling=tiling, num_sms=device.num_sms, device=device, **extra
    )
    return simulate(compiled.program, device).makespan_s * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--fit", default="default@balanced", help="the profiled variant whose launches calibrate")
    parser.add_argument("--tilings", required=True, help="comma-separated TILINGS names (`a+b`: both)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if set(models) - set(MODELS):
        parser.error(f"unknown models {sorted(set(models) - set(MODELS))}; known: {', '.join(MODELS)}")
    data = json.loads(args.profile.read_text())
    profiles = _profiles(data)
    if args.fit not in profiles:
        parser.error(f"--fit {args.fit!r} not in the profile; it holds {sorted(profiles)}")
    fit = profiles[args.fit]
    base = next((d for key, d in BASES.items() if key in fit["device"]), None)
    if base is None:
        parser.error(f"no datasheet constants for {fit['device']!r}; known: {sorted(BASES)}")
    base = dataclasses.replace(base, num_sms=fit["num_sms"])
    llama = _region("llama-1b")[0]
    fitted_tiling = _tiling(fit["tiling"])
    try:
        tilings = {name: tiling_of(fitted_tiling, name) for name in args.tilings.split(",")}
    except ValueError as err:
        parser.error(str(err))
    rows = []
    for row in fit["rows"]:
        batch = row["batch"]
        device = calibrated(base, row, _compile(llama, fit, batch, base).program.instructions)
        for model in models:
            for name, tiling in tilings.items():
                ms = _predict(model, tiling, batch, fit["context"], fit["max_context"], device)
                rows.append({"model": model, "batch": batch, "tiling": name, "predicted_ms": ms})
                print(f"{model:26s} batch {batch:3d} {name:24s} predicted {ms:7.3f} ms")
    first = args.tilings.split(",")[0]
    reference = {(r["model"], r["batch"]): r["predicted_ms"] for r in rows if r["tiling"] == first}
    table = [f"| model | batch | tiling | predicted ms | vs {first} |", "|---|---|---|---|---|"]
    table += [
        f"| {r['model']} | {r['batch']} | {r['tiling']} | {r['predicted_ms']:.3f} | "
        f"{100 * (r['predicted_ms'] / reference[(r['model'], r['batch'])] - 1):+.1f} % |"
        for r in rows
    ]
    print("\n".join(table))
    if args.out is not None:
        report = {
            "benchmark": "calibrated region simulator: predicted launch times of tilings (no GPU run)",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "profile": str(args.profile),
            "profile_commit": data.get("commit"),
            "gpu": fit["device"],
            "fit": args.fit,
            "context": fit["context"],
            "tilings": {name: t.to_dict() for name, t in tilings.items()},
            "rows": rows,
            "table": "\n".join(table),
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
