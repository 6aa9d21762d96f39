"""The build-prediction table: per model and batch bucket, which composition `tilevox build` predicts best, which
one measured best end to end, and how far every prediction was off.

    python -m benchmarks.build_table OUT_DIR_1 OUT_DIR_2 ... --out benchmarks/results/build_table_h200_COMMIT

Each argument is the --out directory of a `tilevox build --measure N` run (or its build_report.json); a run may
hold several batches, and several runs of one model are merged (a batch twice is an error). Writes PREFIX.json,
PREFIX.md and PREFIX.png (predicted against measured step time of every measured candidate, one marker per
model, one colour per batch, the y = x line; the predicted picks ringed).

Per (model, batch) row:
- `predicted_pick`: the candidate the search ranks first on predictions alone, i.e. what a build without
  --measure writes to plan.json. The report does not keep that order once --measure has moved the fastest
  measured candidate to the front, so it is recomputed with the search's own key (predicted step time, then
  fewer megakernels: engine_builder.composition.search; predicted TTFA = step here, as the build passes no
  prefill or codec time).
- `measured_best`: the fastest of the measured candidates (the N best predicted ones).
- `plan_choice`: what plan.json holds. With --measure the build keeps the fastest measured candidate, so this
  equals `measured_best` by construction; the question the table answers is whether the prediction alone
  would have done as well: `pick_within_tolerance` is true when the predicted pick measured within
  `--tolerance` (3 %) of the measured best (true when it is the measured best).
- `errors`: prediction_error = predicted / measured - 1 of EVERY measured candidate; `unmeasurable`: the
  candidates whose predicted time is null (a backend that could not run a region at that batch).

Per model: its category (engine_builder.composition.Category): the report's own `category` (current builds
classify their plan), or, for a report without one (older builds) or a model merged from several reports,
engine_builder.composition.classify of plan.json's per-bucket choices computed here (`category_source` says
which); and `category_predicted`, the same classify of the predicted picks (what the prediction alone would
have planned). The summary counts the cells whose predicted pick is the measured best or within the tolerance,
and gives the largest |prediction error| among the picks and among all measured candidates.

A build's predicted step is the decoder regions as the search priced them plus the rest of a whole conventional
step timed end to end (the anchor, `anchor_step_ms` in reports since 2026-12-06; before, the rest was the sum of
the other phases' synced times; `predicted_regions_ms` holds the first part alone). Reports of still older builds
predicted the regions only, so their errors lean negative by the other phases' time, the same for every
candidate of a cell (which does not change the pick). Imports: stdlib, engine_builder.composition,
matplotlib (for the PNG, lazily).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from tilevox.engine_builder.composition import Backend, Composition, classify

__all__ = ["ISSUE_MODELS", "build_table", "load_report", "main", "markdown", "plot"]

REPORT_NAME = "build_report.json"
TOLERANCE = 0.03
# The issue's names for the presets it asks about, in its order (other models keep their id and follow).
ISSUE_MODELS: dict[str, str] = {
    "random:llama-3.2-1b": "Llama-3.2-1B",
    "random:llama-1b": "Llasa-1B",
    "random:qwen3-tts-0.6b": "Qwen3-TTS-0.6B",
    "random:qwen3-tts-1.7b": "Qwen3-TTS-1.7B",
}
_SHORT = {Backend.GRAPH: "graph", Backend.COMPILED: "compiled", Backend.MEGAKERNEL: "mk"}


def load_report(path: str | Path) -> tuple[Path, dict]:
    """A build report: `path` is a `tilevox build --out` directory or its build_report.json."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_NAME
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ValueError(f"{path}: no build report there (run `tilevox build --measure N --out DIR`)") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    for key in ("plan", "candidates"):
        if key not in report:
            raise ValueError(f"{path}: not a build report (no {key!r})")
    return path, report


def short_label(composition: Sequence[Mapping], layers: Mapping[str, int]) -> str:
    """`talker_step=graph code_predictor_loop=mk` for whole regions; a cut piece keeps its layer range."""
    parts = []
    for piece in composition:
        backend = _SHORT[Backend(piece["backend"])]
        whole = piece["first_layer"] == 0 and piece["stop_layer"] == layers.get(piece["region"]) and piece["head"]
        span = "" if whole else f"[{piece['first_layer']}-{piece['stop_layer']}{'+head' if piece['head'] else ''}]"
        parts.append(f"{piece['region']}{span}={backend}")
    return " ".join(parts)


def _num_megakernels(row: Mapping) -> int:
    return sum(piece["backend"] == Backend.MEGAKERNEL.value for piece in row["composition"])


def _error(row: Mapping) -> float | None:
    """The row's prediction error (predicted / measured - 1), from the report or from its two times."""
    if row.get("prediction_error") is not None:
        return float(row["prediction_error"])
    predicted, measured = row.get("predicted_step_ms"), row.get("measured_step_ms")
    if predicted is None or measured is None:
        return None
    return predicted / measured - 1.0


def _cell(model: str, batch: int, rows: Sequence[Mapping], plan_bucket: Mapping | None, layers, tolerance) -> dict:
    predictable = [r for r in rows if r.get("predicted_step_ms") is not None]
    # the search's order on predictions (sorted() is stable: an exact tie keeps the report's order)
    by_prediction = sorted(predictable, key=lambda r: (r["predicted_step_ms"], _num_megakernels(r)))
    pick = by_prediction[0] if by_prediction else None
    measured = [r for r in rows if r.get("measured_step_ms") is not None]
    best = min(measured, key=lambda r: r["measured_step_ms"]) if measured else None
    pick_measured = pick.get("measured_step_ms") if pick is not None else None
    within = None
    if best is not None and pick_measured is not None:
        within = pick_measured <= best["measured_step_ms"] * (1.0 + tolerance)
    errors = [
        {
            "candidate": short_label(r["composition"], layers),
            "predicted_step_ms": r["predicted_step_ms"],
            "measured_step_ms": r["measured_step_ms"],
            "prediction_error": _error(r),
            "round_ms": list(r.get("measured_round_ms") or []),
        }
        for r in sorted(measured, key=lambda r: r["measured_step_ms"])
    ]

    def label(row):
        return short_label(row["composition"], layers) if row is not None else None

    # the two fixed choices, where the build measured them (reports since 2026-12-08 say why a row was measured)
    fixed = {
        name: r["measured_step_ms"]
        for name in ("all conventional", "all megakernel")
        for r in measured
        if f"fixed: {name}" in r.get("measured_as", "")
    }
    best_fixed = min(fixed.values()) if fixed else None

    return {
        "model": model,
        "name": ISSUE_MODELS.get(model, model),
        "batch": batch,
        "num_candidates": len(rows),
        "num_measured": len(measured),
        "predicted_pick": label(pick),
        "measured_best": label(best),
        "plan_choice": label(plan_bucket),
        "pick_is_measured_best": None if best is None or pick is None else label(pick) == label(best),
        "pick_within_tolerance": within,
        "pick_predicted_step_ms": pick["predicted_step_ms"] if pick is not None else None,
        "pick_measured_step_ms": pick_measured,
        "pick_prediction_error": _error(pick) if pick is not None else None,
        "measured_best_step_ms": best["measured_step_ms"] if best is not None else None,
        "pick_slowdown": pick_measured / best["measured_step_ms"] - 1.0 if within is not None else None,
        "fixed_step_ms": fixed,
        # the measured best (what plan.json keeps with --measure) against the faster fixed choice
        "best_vs_best_fixed": best["measured_step_ms"] / best_fixed - 1.0 if best_fixed else None,
        "errors": errors,
        "unmeasurable": [label(r) for r in rows if r.get("predicted_step_ms") is None],
        "_pick_composition": pick["composition"] if pick is not None else None,
    }


def _fixed(row: Mapping) -> str:
    """The fixed choices' measured times, and how the measured best compares with the faster one."""
    fixed = row.get("fixed_step_ms") or {}
    if not fixed:
        return "not measured"
    times = " / ".join(_ms(fixed[k]) if k in fixed else "n/a" for k in ("all conventional", "all megakernel"))
    return f"{times} (best {_pct(row['best_vs_best_fixed'])})"


def _category(choices: Mapping[int, Sequence[Mapping]]) -> dict:
    if not choices:
        return {"category": None, "reason": "no bucket"}
    result = classify({batch: Composition.from_list(c) for batch, c in choices.items()})
    return {
        "category": result.category.value,
        "reason": result.reason,
        "megakernel_share": {str(b): s for b, s in result.shares.items()},
    }


def build_table(reports: Sequence[tuple[Path, Mapping]], *, tolerance: float = TOLERANCE) -> dict:
    """The table (a JSON-ready dict: `models`, `rows`, `summary`) of `reports` ((path, report) pairs)."""
    models: dict[str, dict] = {}
    for path, report in reports:
        plan = report["plan"]
        model = plan["model"]
        entry = models.setdefault(
            model,
            {
                "model": model,
                "name": ISSUE_MODELS.get(model, model),
                "reports": [],
                "rows": {},
                "plan": {},
                "reported": [],
            },
        )
        entry["reports"].append(str(path))
        layers = {r["name"]: r["num_layers"] for r in plan["layout"]}
        buckets = {int(b["batch"]): b for b in plan["buckets"]}
        for batch_key, rows in report["candidates"].items():
            batch = int(batch_key)
            if batch in entry["rows"]:
                raise ValueError(
                    f"{model} batch {batch} is in two reports: {entry['rows'][batch]['source']} and {path}"
                )
            cell = _cell(model, batch, rows, buckets.get(batch), layers, tolerance)
            cell["source"] = str(path)
            entry["rows"][batch] = cell
            if batch in buckets:
                entry["plan"][batch] = buckets[batch]["composition"]
        if "category" in report:  # `tilevox build` classifies its own plan (category, category_why)
            entry["reported"].append((report["category"], report.get("category_why")))
    order = [m for m in ISSUE_MODELS if m in models] + [m for m in models if m not in ISSUE_MODELS]
    rows, model_rows = [], []
    for model in order:
        entry = models[model]
        cells = [entry["rows"][b] for b in sorted(entry["rows"])]
        predicted = {c["batch"]: c["_pick_composition"] for c in cells if c["_pick_composition"] is not None}
        planned = _category(entry["plan"])
        # The build's own category holds when one report has all of the model's batches; a model merged from
        # several runs is classified here over all of its buckets (the same classify the build calls).
        if len(entry["reports"]) == 1 and len(entry["reported"]) == 1:
            category, reason = entry["reported"][0]
            source = "build report"
        else:
            category, reason = planned["category"], planned["reason"]
            source = "computed here: engine_builder.composition.classify of plan.json's per-bucket choices"
            if entry["reported"]:
                source += f" (merged from {len(entry['reports'])} reports)"
        model_rows.append(
            {
                "model": model,
                "name": entry["name"],
                "batches": [c["batch"] for c in cells],
                "category": category,
                "category_source": source,
                "category_reason": reason or planned["reason"],
                "megakernel_share": planned.get("megakernel_share", {}),
                "category_predicted": _category(predicted)["category"],
                "reports": entry["reports"],
            }
        )
        for cell in cells:
            rows.append({k: v for k, v in cell.items() if not k.startswith("_")})
    judged = [r for r in rows if r["pick_within_tolerance"] is not None]
    pick_errors = [abs(r["pick_prediction_error"]) for r in rows if r["pick_prediction_error"] is not None]
    all_errors = [abs(e["prediction_error"]) for r in rows for e in r["errors"] if e["prediction_error"] is not None]
    summary = {
        "cells": len(rows),
        "cells_measured": len(judged),
        "pick_is_measured_best": sum(bool(r["pick_is_measured_best"]) for r in judged),
        "pick_within_tolerance": sum(bool(r["pick_within_tolerance"]) for r in judged),
        "tolerance": tolerance,
        "max_abs_error_picks": max(pick_errors) if pick_errors else None,
        "max_abs_error_all": max(all_errors) if all_errors else None,
        "plan_choice_is_measured_best": sum(r["plan_choice"] == r["measured_best"] for r in judged),
        # builds since 8e3e2cd time each candidate in rounds: how far one composition's rounds spread (max / min - 1)
        "round_spreads": sorted(
            max(e["round_ms"]) / min(e["round_ms"]) - 1.0 for r in rows for e in r["errors"] if len(e["round_ms"]) > 1
        ),
    }
    summary["line"] = _summary_line(summary)
    return {"models": model_rows, "rows": rows, "summary": summary}


def _pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:+.1f} %" if signed else f"{value * 100:.1f} %"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _summary_line(s: Mapping) -> str:
    if not s["cells_measured"]:
        return f"{s['cells']} cells, none measured end to end (build with --measure N to judge the predictions)"
    return (
        f"{s['pick_within_tolerance']} of {s['cells_measured']} measured cells: the predicted pick is the measured "
        f"best or within {s['tolerance']:.0%} of it ({s['pick_is_measured_best']} exactly the measured best); max "
        f"|prediction error|: {_pct(s['max_abs_error_picks'], signed=False)} among the picks, "
        f"{_pct(s['max_abs_error_all'], signed=False)} among all measured candidates"
        + (
            f"; one candidate's measuring rounds spread by {_pct(statistics.median(spreads), signed=False)} "
            f"(median) and {_pct(spreads[-1], signed=False)} (most) over {len(spreads)} candidates"
            if (spreads := s.get("round_spreads"))
            else ""
        )
    )


def markdown(table: Mapping, *, title: str = "tilevox build: predicted vs measured compositions") -> str:
    s = table["summary"]
    lines = [f"# {title}", "", f"{s['line']}.", ""]
    lines += ["| model | category (plan) | category (predictions only) | batches |", "|---|---|---|---|"]
    for m in table["models"]:
        batches = ", ".join(str(b) for b in m["batches"])
        lines.append(f"| {m['name']} | {m['category']} | {m['category_predicted']} | {batches} |")
    lines += [
        "",
        "| model | batch | predicted pick | measured best | pick within "
        f"{s['tolerance']:.0%} | pick predicted ms | pick measured ms | best measured ms | fixed choices ms "
        "(all conventional / all megakernel) | prediction error of every measured candidate |",
        "|---|---:|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in table["rows"]:
        if r["pick_within_tolerance"] is None:
            within = "n/a"
        elif r["pick_is_measured_best"]:
            within = "yes (best)"
        else:  # how much slower the pick measured than the best
            within = f"{'yes' if r['pick_within_tolerance'] else '**no**'} ({_pct(r['pick_slowdown'])})"
        errors = "; ".join(f"{e['candidate']}: {_pct(e['prediction_error'])}" for e in r["errors"]) or "none measured"
        if r["unmeasurable"]:
            errors += "; not measurable: " + ", ".join(r["unmeasurable"])
        lines.append(
            f"| {r['name']} | {r['batch']} | {r['predicted_pick']} | {r['measured_best'] or 'n/a'} | {within} | "
            f"{_ms(r['pick_predicted_step_ms'])} | {_ms(r['pick_measured_step_ms'])} | "
            f"{_ms(r['measured_best_step_ms'])} | {_fixed(r)} | {errors} |"
        )
    lines += [
        "",
        "Predicted pick: the search's first candidate on predictions alone (what a build without --measure plans). "
        "Measured best: the fastest of the candidates run end to end (plan.json with --measure keeps it). "
        "Prediction error: predicted / measured step time - 1; the prediction is the decoder regions as the search "
        "priced them plus the rest of the step (sampling, codec, host): since 2026-12-06 what a whole conventional "
        "step timed end to end (the anchor) spent beyond its priced regions, before that the other phases' synced "
        "times. "
        "Category (plan), from: " + "; ".join(sorted({m["category_source"] for m in table["models"]})) + ". "
        "Category (predictions only): the same classify of the predicted picks.",
        "",
        "Reports: " + ", ".join(p for m in table["models"] for p in m["reports"]),
        "",
    ]
    return "\n".join(lines)


def plot(table: Mapping, path: Path) -> int:
    """Predicted against measured step time of every measured candidate: one marker per model, one colour per
    batch, predicted picks ringed, the y = x line. Returns the number of points (0: nothing measured, no file)."""
    points = [
        (r["name"], r["batch"], e["predicted_step_ms"], e["measured_step_ms"], e["candidate"] == r["predicted_pick"])
        for r in table["rows"]
        for e in r["errors"]
        if e["predicted_step_ms"] is not None
    ]
    if not points:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names = list(dict.fromkeys(p[0] for p in points))
    batches = sorted({p[1] for p in points})
    markers = dict(zip(names, "osD^vP*Xph"))
    colours = {b: plt.get_cmap("viridis")(i / max(1, len(batches) - 1)) for i, b in enumerate(batches)}
    fig, ax = plt.subplots(figsize=(6.5, 6))
    for name, batch, predicted, measured, picked in points:
        ax.scatter([predicted], [measured], marker=markers.get(name, "o"), color=colours[batch], s=36, zorder=3)
        if picked:
            ax.scatter([predicted], [measured], marker="o", s=170, facecolors="none", edgecolors="black", zorder=2)
    values = [v for p in points for v in p[2:4]]
    low, high = min(values), max(values)
    log = high / low > 20
    lo, hi = (low / 1.3, high * 1.3) if log else (0.0, high * 1.1)
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, linestyle="--", label="y = x")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted step (ms)")
    ax.set_ylabel("measured step (ms)")
    ax.set_title("tilevox build: every measured candidate (ringed: predicted pick)", fontsize=10)
    handles = [Line2D([], [], marker=markers[n], linestyle="", color="black", label=n) for n in names]
    handles += [Line2D([], [], marker="s", linestyle="", color=colours[b], label=f"batch {b}") for b in batches]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return len(points)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "reports", nargs="+", type=Path, help="`tilevox build --out` directories or their build_report.json"
    )
    parser.add_argument("--out", required=True, type=Path, help="PREFIX: writes PREFIX.json, PREFIX.md, PREFIX.png")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="pick within this of the best (0.03: 3 %%)")
    args = parser.parse_args(argv)
    if not (0.0 <= args.tolerance < 1.0) or math.isnan(args.tolerance):
        parser.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    loaded = [load_report(p) for p in args.reports]
    table = {
        "benchmark": "build_table",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "provenance": [{"model": r["plan"]["model"], **r["plan"].get("provenance", {})} for _, r in loaded],
        **build_table(loaded, tolerance=args.tolerance),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prefix = str(args.out)
    Path(prefix + ".json").write_text(json.dumps(table, indent=1) + "\n")
    Path(prefix + ".md").write_text(markdown(table))
    drawn = plot(table, Path(prefix + ".png"))
    print(markdown(table))
    print(
        f"wrote {prefix}.json, {prefix}.md"
        + (f" and {prefix}.png ({drawn} points)" if drawn else " (no PNG: nothing measured)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
