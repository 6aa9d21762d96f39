"""benchmarks/build_table.py: the predicted-vs-measured table of `tilevox build --measure` reports, on synthetic
reports whose answers are known (a predicted pick within 3 % of the measured best, one outside, a candidate that
could not be measured), on the committed H200 report (no --measure data) and on a real CPU build."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tilevox.server.cli import main as tilevox_main

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "build_table.py"
H200_REPORT = REPO / "benchmarks" / "results" / "build_h200_d08788c_qwen3-tts-0.6b" / "build_report.json"


@pytest.fixture(scope="module")
def bt():
    """The script loaded from its file (the repository root need not be on sys.path)."""
    spec = importlib.util.spec_from_file_location("build_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(model: str, layout: dict[str, int], cells: dict[int, list[tuple]], measure: int) -> dict:
    """A build report as `tilevox build --measure` writes it. `cells`: batch -> (backend per region, predicted ms
    or None, measured ms or None) per candidate. Rows are ranked as the build ranks them (predicted time, then
    fewer megakernels, unmeasurable last), the `measure` best ran end to end and the fastest measured moved
    to the front; the plan takes it."""
    candidates, buckets = {}, []
    for batch, rows in cells.items():
        ranked = []
        for backends, predicted, measured in rows:
            composition = [
                {"region": region, "first_layer": 0, "stop_layer": n, "head": True, "backend": backend}
                for (region, n), backend in zip(layout.items(), backends)
            ]
            short = {"graph": "graph", "megakernel": "mk"}
            label = " ".join(f"{r}[0-{n}+head]={short[b]}" for (r, n), b in zip(layout.items(), backends))
            row = {"label": label, "predicted_step_ms": predicted, "composition": composition}
            ranked.append((row, measured, sum(b == "megakernel" for b in backends)))
        ranked.sort(key=lambda t: (t[0]["predicted_step_ms"] is None, t[0]["predicted_step_ms"] or 0.0, t[2]))
        for row, measured, _ in ranked[:measure]:
            if row["predicted_step_ms"] is not None:
                assert measured is not None, "the build measures each of the N best predicted candidates"
                row["measured_step_ms"] = measured
                row["prediction_error"] = row["predicted_step_ms"] / measured - 1.0
        rows = [row for row, _, _ in ranked]
        timed = [i for i, row in enumerate(rows) if "measured_step_ms" in row]
        fastest = min(timed, key=lambda i: rows[i]["measured_step_ms"])
        rows.insert(0, rows.pop(fastest))
        candidates[str(batch)] = rows
        buckets.append(
            {
                "batch": batch,
                "composition": rows[0]["composition"],
                "label": rows[0]["label"],
                "predicted_step_s": rows[0]["predicted_step_ms"] * 1e-3,
                "predicted_ttfa_s": rows[0]["predicted_step_ms"] * 1e-3,
                "num_candidates": len(rows),
            }
        )
    plan = {
        "format": "tilevox.plan/1",
        "model": model,
        "provenance": {
            "gpu": "NVIDIA H200",
            "driver": "x",
            "library_hash": "x",
            "commit": "abc1234",
            "profile_date": "d",
        },
        "layout": [
            {"name": name, "num_layers": n, "cuttable": True, "boundary_bytes_per_row": 4096}
            for name, n in layout.items()
        ],
        "buckets": buckets,
    }
    return {"plan": plan, "measured_ms": [], "not_profiled": {}, "candidates": candidates, "note": "synthetic"}


G, MK = "graph", "megakernel"
# Llasa-1B. Batch 1: the megakernel is predicted best (5.0 ms) but measures 5.1 ms against the graph's 5.0:
# 2 % slower, within 3 %. Batch 8: predicted 7.0, measured 9.0 against the graph's 8.0: 12.5 % slower, outside.
LLASA = _report(
    "random:llama-1b",
    {"decoder_step": 16},
    {1: [((MK,), 5.0, 5.1), ((G,), 6.5, 5.0)], 8: [((MK,), 7.0, 9.0), ((G,), 8.0, 8.0)]},
    measure=2,
)
# Qwen3-TTS-0.6B: the predicted pick is the measured best at both batches; talker and predictor both on the
# megakernel could not be measured (predicted null), and the fourth candidate is not among the 2 measured.
QWEN = _report(
    "random:qwen3-tts-0.6b",
    {"talker_step": 28, "code_predictor_loop": 5},
    {
        1: [((G, MK), 14.0, 15.0), ((G, G), 16.0, 17.0), ((MK, MK), None, None), ((MK, G), 20.0, None)],
        32: [((G, G), 24.0, 25.0), ((G, MK), 26.0, 30.0), ((MK, MK), None, None), ((MK, G), 40.0, None)],
    },
    measure=2,
)


def _write(tmp_path: Path, name: str, report: dict) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "build_report.json").write_text(json.dumps(report))
    return directory


def test_synthetic_reports_give_the_known_answers(bt, tmp_path):
    # given in the other order: rows follow the model order
    table = bt.build_table([bt.load_report(_write(tmp_path, n, r)) for n, r in (("q", QWEN), ("l", LLASA))])
    rows = {(r["name"], r["batch"]): r for r in table["rows"]}
    assert list(rows) == [("Llasa-1B", 1), ("Llasa-1B", 8), ("Qwen3-TTS-0.6B", 1), ("Qwen3-TTS-0.6B", 32)]

    llasa1, llasa8 = rows[("Llasa-1B", 1)], rows[("Llasa-1B", 8)]
    # the report lists the measured best first; the predicted pick is recovered from the predictions
    assert (llasa1["predicted_pick"], llasa1["measured_best"], llasa1["plan_choice"]) == (
        "decoder_step=mk",
        "decoder_step=graph",
        "decoder_step=graph",
    )
    assert llasa1["pick_within_tolerance"] and not llasa1["pick_is_measured_best"]
    assert llasa1["pick_slowdown"] == pytest.approx(0.02)
    assert (llasa1["pick_predicted_step_ms"], llasa1["pick_measured_step_ms"]) == (5.0, 5.1)
    errors = {e["candidate"]: e["prediction_error"] for e in llasa1["errors"]}
    assert errors == pytest.approx({"decoder_step=mk": 5.0 / 5.1 - 1, "decoder_step=graph": 0.3})
    assert llasa8["pick_within_tolerance"] is False and llasa8["pick_slowdown"] == pytest.approx(0.125)
    assert llasa8["pick_prediction_error"] == pytest.approx(7.0 / 9.0 - 1)

    qwen1, qwen32 = rows[("Qwen3-TTS-0.6B", 1)], rows[("Qwen3-TTS-0.6B", 32)]
    assert qwen1["predicted_pick"] == qwen1["measured_best"] == "talker_step=graph code_predictor_loop=mk"
    assert qwen1["pick_is_measured_best"] and qwen1["pick_within_tolerance"] and qwen1["pick_slowdown"] == 0.0
    assert qwen1["unmeasurable"] == ["talker_step=mk code_predictor_loop=mk"]
    assert (qwen1["num_candidates"], qwen1["num_measured"], len(qwen1["errors"])) == (4, 2, 2)
    assert qwen32["predicted_pick"] == qwen32["measured_best"] == "talker_step=graph code_predictor_loop=graph"

    models = {m["name"]: m for m in table["models"]}
    # the plan (measured fastest) keeps the graph at both batches; the predictions alone took the megakernel
    assert models["Llasa-1B"]["category"] == "megakernel-averse"
    assert models["Llasa-1B"]["category_predicted"] == "megakernel-stable"
    assert "classify" in models["Llasa-1B"]["category_source"]
    # the predictor (5 of 33 layers) on the megakernel at batch 1, nothing at batch 32
    assert models["Qwen3-TTS-0.6B"]["category"] == models["Qwen3-TTS-0.6B"]["category_predicted"]
    assert models["Qwen3-TTS-0.6B"]["category"] == "megakernel-receding"
    assert models["Qwen3-TTS-0.6B"]["megakernel_share"] == pytest.approx({"1": 5 / 33, "32": 0.0})

    s = table["summary"]
    assert (s["cells"], s["cells_measured"], s["pick_within_tolerance"], s["pick_is_measured_best"]) == (4, 4, 3, 2)
    assert s["plan_choice_is_measured_best"] == 4
    assert s["max_abs_error_picks"] == pytest.approx(2.0 / 9.0)  # Llasa-1B batch 8
    assert s["max_abs_error_all"] == pytest.approx(0.3)  # Llasa-1B batch 1, the graph
    assert s["line"].startswith("3 of 4 measured cells")

    text = bt.markdown(table)
    assert "| Llasa-1B | 8 | decoder_step=mk | decoder_step=graph | **no** (+12.5 %) |" in text
    assert "| Llasa-1B | 1 | decoder_step=mk | decoder_step=graph | yes (+2.0 %) |" in text
    assert "not measurable: talker_step=mk code_predictor_loop=mk" in text


def test_main_writes_json_markdown_and_png(bt, tmp_path, capsys):
    prefix = tmp_path / "out" / "table"
    assert bt.main([str(_write(tmp_path, "l", LLASA)), str(_write(tmp_path, "q", QWEN)), "--out", str(prefix)]) == 0
    written = json.loads(prefix.with_suffix(".json").read_text())
    assert written["summary"]["pick_within_tolerance"] == 3 and len(written["rows"]) == 4
    assert [p["commit"] for p in written["provenance"]] == ["abc1234", "abc1234"]
    assert prefix.with_suffix(".md").read_text().startswith("# tilevox build")
    assert prefix.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(8 points)" in capsys.readouterr().out  # every measured candidate: 2 + 2 + 2 + 2


def test_the_same_batch_twice_and_a_reported_category(bt, tmp_path):
    twice = [bt.load_report(_write(tmp_path, n, LLASA)) for n in ("a", "b")]
    with pytest.raises(ValueError, match="random:llama-1b batch 1 is in two reports"):
        bt.build_table(twice)
    with pytest.raises(ValueError, match="no build report there"):
        bt.load_report(tmp_path / "nowhere")
    # a build that classifies its plan is believed...
    classified = {**LLASA, "category": "megakernel-advancing", "category_why": "made up"}
    (model,) = bt.build_table([bt.load_report(_write(tmp_path, "c", classified))])["models"]
    assert (model["category"], model["category_source"], model["category_reason"]) == (
        "megakernel-advancing",
        "build report",
        "made up",
    )
    # ...but one run per batch classifies a single batch each: the merged model is classified here over both
    layout, cells = (
        {"decoder_step": 16},
        {1: [((MK,), 5.0, 4.0), ((G,), 6.0, 6.0)], 8: [((MK,), 9.0, 9.0), ((G,), 8.0, 8.0)]},
    )
    runs = [
        {**_report("random:llama-1b", layout, {batch: cells[batch]}, measure=2), "category": "megakernel-stable"}
        for batch in (1, 8)
    ]
    table = bt.build_table([bt.load_report(_write(tmp_path, f"b{i}", r)) for i, r in enumerate(runs)])
    (model,) = table["models"]
    assert model["category"] == "megakernel-receding" and "merged from 2 reports" in model["category_source"]
    assert [r["plan_choice"] for r in table["rows"]] == ["decoder_step=mk", "decoder_step=graph"]


def test_a_report_without_measurements(bt, tmp_path):
    """The committed H200 build of Qwen3-TTS-0.6B ran without --measure: predictions only, nothing judged, no PNG."""
    table = bt.build_table([bt.load_report(H200_REPORT)])
    assert [(r["batch"], r["measured_best"], r["pick_within_tolerance"]) for r in table["rows"]] == [
        (1, None, None),
        (32, None, None),
    ]
    assert table["rows"][0]["predicted_pick"] == table["rows"][0]["plan_choice"]
    assert table["models"][0]["category"] == "megakernel-receding"
    assert table["summary"]["cells_measured"] == 0 and "none measured" in table["summary"]["line"]
    assert bt.plot(table, tmp_path / "x.png") == 0 and not (tmp_path / "x.png").exists()


def test_a_real_cpu_build_report(bt, tmp_path, capsys):
    """The schema as `tilevox build --measure` writes it today (llama-tiny on CPU, the megakernel through its VM)."""
    out = tmp_path / "build"
    argv = ["build", "--model", "random:llama-tiny", "--device", "cpu", "--batches", "1,2", "--megakernel-executor"]
    argv += ["vm", "--warmup", "1", "--steps", "1", "--measure", "2", "--out", str(out)]
    assert tilevox_main(argv) == 0
    capsys.readouterr()
    table = bt.build_table([bt.load_report(out)])
    assert [r["batch"] for r in table["rows"]] == [1, 2]
    for row in table["rows"]:
        assert row["num_candidates"] == row["num_measured"] == 2  # graph and megakernel, both measured
        assert {e["candidate"] for e in row["errors"]} == {"decoder_step=graph", "decoder_step=mk"}
        assert row["plan_choice"] == row["measured_best"] and row["pick_within_tolerance"] is not None
    (model,) = table["models"]
    assert model["category_source"] == "build report"  # the build classifies its plan: the same as classify here
    planned = json.loads((out / "plan.json").read_text())["buckets"]
    assert model["category"] == bt._category({b["batch"]: b["composition"] for b in planned})["category"]


def test_the_fixed_choices_are_reported_where_the_build_measured_them(bt, tmp_path):
    """A report that says why each row was measured (builds since 2026-12-08): the fixed choices' times and the
    measured best against the faster of them; a report without it says they were not measured."""
    llasa = json.loads(json.dumps(LLASA))
    for rows in llasa["candidates"].values():
        for row in rows:
            fixed = "all megakernel" if row["label"].endswith("=mk") else "all conventional"
            row["measured_as"] = f"predicted top 2, fixed: {fixed}"
    llasa["candidates"]["8"][0]["measured_step_ms"] = 7.5  # the graph, now faster than predicted
    llasa["candidates"]["8"][0]["measured_round_ms"] = [7.5, 6.0, 9.0]  # rounds 50 % apart
    llasa["candidates"]["1"][0]["measured_round_ms"] = [5.0, 5.5]  # 10 % apart
    table = bt.build_table([bt.load_report(_write(tmp_path, n, r)) for n, r in (("l", llasa), ("q", QWEN))])
    rows = {(r["name"], r["batch"]): r for r in table["rows"]}
    assert rows[("Llasa-1B", 1)]["fixed_step_ms"] == {"all conventional": 5.0, "all megakernel": 5.1}
    assert rows[("Llasa-1B", 1)]["best_vs_best_fixed"] == 0.0
    assert rows[("Llasa-1B", 8)]["fixed_step_ms"] == {"all conventional": 7.5, "all megakernel": 9.0}
    assert (
        rows[("Qwen3-TTS-0.6B", 1)]["fixed_step_ms"] == {} and rows[("Qwen3-TTS-0.6B", 1)]["best_vs_best_fixed"] is None
    )
    markdown = bt.markdown(table)
    assert "| 5.000 / 5.100 (best +0.0 %) |" in markdown and "| not measured |" in markdown
    assert table["summary"]["round_spreads"] == pytest.approx([0.1, 0.5])
    assert "rounds spread by 30.0 % (median) and 50.0 % (most) over 2 candidates" in markdown
