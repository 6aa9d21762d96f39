"""`tilevox build` and `--plan` on CPU (the megakernel through its interpreter): a build profiles both
backends and writes a plan that loads; synth follows a plan; a plan dispatches each call by its batch
bucket; plans from another machine, or with --megakernel, are refused with a usage error."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import soundfile
import torch

from tilevox.engine_builder.build import apply_plan, provenance_here
from tilevox.engine_builder.composition import Backend, Composition, Piece, model_layout
from tilevox.engine_builder.plan import BucketPlan, Plan, load_plan, save_plan
from tilevox.executor.megakernel import BackendOptions, Executor
from tilevox.models.llasa.loader import load_preset as load_llasa
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest
from tilevox.server.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def settles(monkeypatch) -> list[tuple[int, float]]:
    """The untimed steps before a build's first measurement, recorded (batch, seconds) instead of run (two
    seconds of steps per build would only slow these tests)."""
    from tilevox.engine_builder import build

    calls: list[tuple[int, float]] = []
    monkeypatch.setattr(build, "settle", lambda model, batch, seconds: calls.append((batch, seconds)) or 0)
    return calls


def test_build_profiles_both_backends_and_writes_a_plan_synth_follows(tmp_path, capsys):
    out = tmp_path / "build"
    argv = ["build", "--model", "random:qwen3-tts-tiny", "--device", "cpu", "--batches", "1,2"]
    argv += ["--megakernel-executor", "vm", "--warmup", "1", "--steps", "1", "--measure", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "1 streams: " in printed and "2 streams: " in printed
    plan = load_plan(out / "plan.json", here=provenance_here(torch.device("cpu")))
    assert [b.batch for b in plan.buckets] == [1, 2] and plan.provenance.gpu == "cpu"
    report = json.loads((out / "build_report.json").read_text())
    measured = {(m["region"], m["backend"], m["batch"]) for m in report["measured_ms"]}
    regions = {"talker_step", "code_predictor_loop", "codec_decode"}
    assert measured == {(r, b, n) for r in regions for b in ("graph", "megakernel") for n in (1, 2)}
    assert len(report["candidates"]["1"]) == 8  # each of three regions (the codec decode too) on graph or megakernel
    all_graph = "talker_step[0-2+head]=graph code_predictor_loop[0-2+head]=graph codec_decode[0-1+head]=graph"
    all_mk = "talker_step[0-2+head]=mk code_predictor_loop[0-2+head]=mk codec_decode[0-1+head]=mk"
    for batch in ("1", "2"):  # the two best predicted and both fixed choices ran end to end; the plan took the fastest
        rows = report["candidates"][batch]
        timed = [row for row in rows if "measured_step_ms" in row]
        assert 2 <= len(timed) <= 4 and rows[: len(timed)] == timed and all(r["measured_step_ms"] > 0 for r in timed)
        assert rows[0]["measured_step_ms"] == min(r["measured_step_ms"] for r in timed)
        why = {row["label"]: row["measured_as"] for row in timed}
        assert "fixed: all conventional" in why[all_graph] and "fixed: all megakernel" in why[all_mk]
        assert sum("predicted top 2" in w for w in why.values()) == 2
        assert rows[0]["label"] == next(b for b in plan.buckets if b.batch == int(batch)).composition.label()
        assert rows[0]["prediction_error"] == rows[0]["predicted_step_ms"] / rows[0]["measured_step_ms"] - 1.0
    assert (out / "build_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wav = tmp_path / "x.wav"
    synth = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(wav), "--max-duration", "0.3"]
    assert main([*synth, "--plan", str(out / "plan.json"), "--megakernel-executor", "vm", "--quiet"]) == 0
    assert soundfile.read(wav)[0].size > 0
    assert main([*synth, "--plan", str(out / "plan.json"), "--megakernel", "all"]) == 2
    assert "leave --megakernel out" in capsys.readouterr().err
    data = json.loads((out / "plan.json").read_text())
    data["provenance"]["gpu"] = "NVIDIA H200"
    (out / "plan.json").write_text(json.dumps(data))
    assert main([*synth, "--plan", str(out / "plan.json")]) == 2
    assert "measured elsewhere" in capsys.readouterr().err


def test_a_plan_dispatches_each_call_by_its_batch_bucket(tmp_path):
    """Bucket 1 on the megakernel (interpreter), buckets up to 4 on the executor's graph: one stream's
    steps go to the megakernel, three streams' to the graph."""
    model = load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=4)
    (layout,) = model_layout(model)

    def bucket(batch: int, backend: Backend) -> BucketPlan:
        piece = Piece(region=layout.name, first_layer=0, stop_layer=layout.num_layers, head=True, backend=backend)
        return BucketPlan(
            batch=batch,
            composition=Composition((piece,)),
            predicted_step_s=1e-3,
            predicted_ttfa_s=2e-3,
            num_candidates=2,
        )

    plan = Plan(
        model="random:llama-tiny",
        provenance=provenance_here(torch.device("cpu")),
        layout=(layout,),
        buckets=(bucket(1, Backend.MEGAKERNEL), bucket(4, Backend.GRAPH)),
    )
    save_plan(plan, tmp_path / "plan.json")
    dispatch = apply_plan(model, load_plan(tmp_path / "plan.json"), megakernel=BackendOptions(executor=Executor.VM))
    greedy = SamplingParams.greedy()
    single = model.open_stream(SynthesisRequest(text="One", sampling=greedy, max_duration_s=0.1))
    for _ in range(3):
        model.step([single])
    ids = [
        model.open_stream(SynthesisRequest(text=f"Three {n}", sampling=greedy, max_duration_s=0.1)) for n in range(3)
    ]
    for _ in range(3):
        model.step(ids)
    calls = dispatch[layout.name].calls
    assert calls[(1, "megakernel")] == 3 and calls[(4, "graph")] == 3
    assert dispatch[layout.name].num_above_largest == 0


def test_a_plan_that_cuts_a_region_runs_it_in_pieces_with_the_same_tokens(tmp_path):
    """Bucket 1 cuts the Llasa decoder step after layer 1 (megakernel, interpreter; then the graph), bucket 4
    runs it whole on the graph: one stream's greedy tokens equal the plain model's, its steps went through the
    pieces, three streams' through the graph; NH-TTS's decoder step cut the same way applies too; a cut of a region
    the executor does not run in pieces (the code predictor's loop) is a PlanError."""
    from tilevox.engine_builder.build import _composition_backend
    from tilevox.engine_builder.plan import PlanError
    from tilevox.executor.graphs import GraphOptions
    from tilevox.executor.split import SplitDecoderStep, SplitNhDecoderStep
    from tilevox.models.registry import load_model

    def plan_for(layout, cut_bucket: int, whole_bucket: int | None) -> Plan:
        n = layout.num_layers
        cut = Composition(
            (
                Piece(region=layout.name, first_layer=0, stop_layer=1, head=False, backend=Backend.MEGAKERNEL),
                Piece(region=layout.name, first_layer=1, stop_layer=n, head=True, backend=Backend.GRAPH),
            )
        )
        whole = Composition((Piece(region=layout.name, first_layer=0, stop_layer=n, head=True, backend=Backend.GRAPH),))
        buckets = [(cut_bucket, cut)] + ([] if whole_bucket is None else [(whole_bucket, whole)])
        return Plan(
            model="random:tiny",
            provenance=provenance_here(torch.device("cpu")),
            layout=(layout,),
            buckets=tuple(
                BucketPlan(batch=b, composition=c, predicted_step_s=1e-3, predicted_ttfa_s=2e-3, num_candidates=2)
                for b, c in buckets
            ),
        )

    greedy = SamplingParams.greedy()
    tokens: dict[str, list[int]] = {"plain": [], "plan": []}
    for which in tokens:
        model = load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=4)
        (layout,) = model_layout(model)
        assert layout.num_layers >= 2
        if which == "plan":
            plan = plan_for(layout, 1, 4)
            save_plan(plan, tmp_path / "plan.json")
            vm = BackendOptions(executor=Executor.VM)
            dispatch = apply_plan(model, load_plan(tmp_path / "plan.json"), megakernel=vm)
        model.token_observer = lambda _sid, tok, _w=which: tokens[_w].append(tok)
        single = model.open_stream(SynthesisRequest(text="One", sampling=greedy, max_duration_s=0.1))
        for _ in range(4):
            model.step([single])
    assert len(tokens["plain"]) >= 4 and tokens["plan"] == tokens["plain"]
    ids = [
        model.open_stream(SynthesisRequest(text=f"Three {n}", sampling=greedy, max_duration_s=0.1)) for n in range(3)
    ]
    for _ in range(2):
        model.step(ids)
    calls = dispatch[layout.name].calls
    cut_label = f"{layout.name}[0-1]=mk {layout.name}[1-{layout.num_layers}+head]=graph"
    assert calls[(1, cut_label)] >= 3 and calls[(4, "graph")] == 2
    (split,) = [b for _, label, b in dispatch[layout.name].choices if label == cut_label]
    assert isinstance(split, SplitDecoderStep) and split.num_split_calls == calls[(1, cut_label)]
    nh = load_model("random:nh-tts-tiny")
    (nh_layout,) = model_layout(nh)
    nh_dispatch = apply_plan(nh, plan_for(nh_layout, 1, None), megakernel=BackendOptions(executor=Executor.VM))
    ((_, _, nh_split),) = nh_dispatch[nh_layout.name].choices
    assert isinstance(nh_split, SplitNhDecoderStep)  # NH-TTS's decoder step (cross-attention) runs in pieces too
    predictor_cut = [
        Piece(region="code_predictor_loop", first_layer=0, stop_layer=2, head=False, backend=Backend.MEGAKERNEL),
        Piece(region="code_predictor_loop", first_layer=2, stop_layer=5, head=True, backend=Backend.GRAPH),
    ]
    with pytest.raises(PlanError, match="runs for decoder_step, talker_step, nh_decoder_step only"):
        _composition_backend(nh, predictor_cut, {}, graphs=GraphOptions(), megakernel=BackendOptions())


def test_build_with_splits_prices_cuts_and_measures_the_best_one(tmp_path, capsys):
    """`--splits`: the candidates also cut the talker at layer boundaries; each bucket measures its best cut
    candidate end to end besides the top one, and the plan it writes loads and runs whatever it picked."""
    out = tmp_path / "build"
    argv = ["build", "--model", "random:qwen3-tts-tiny", "--device", "cpu", "--batches", "1,2", "--splits"]
    argv += ["--megakernel-executor", "vm", "--warmup", "1", "--steps", "1", "--measure", "1", "--context", "64"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "build_report.json").read_text())
    assert "cut candidates (--splits)" in report["note"]
    for batch in ("1", "2"):
        rows = report["candidates"][batch]
        assert len(rows) > 8  # the 8 whole-region compositions and cuts of the talker
        cut = [r for r in rows if any(p["region"] == "talker_step" and not p["head"] for p in r["composition"])]
        assert cut and all(r["predicted_step_ms"] > 0 for r in cut)
        measured = [r for r in rows if "measured_step_ms" in r]  # the top one, the best cut, both fixed choices
        assert 2 <= len(measured) <= 4 and rows[: len(measured)] == measured
        assert [r for r in measured if r in cut and "best cut" in r["measured_as"]]
        assert measured[0]["measured_step_ms"] == min(r["measured_step_ms"] for r in measured)
    costs = report["cut_costs"]  # the measured cut and whole candidates fitted the price of a cut
    assert costs["source"] == "default" and costs["fitted_cut_s"] >= 0 and len(costs["samples_s"]) >= 2
    assert "fitted from this build's measured cuts" in capsys.readouterr().out
    plan = load_plan(out / "plan.json", here=provenance_here(torch.device("cpu")))
    wav = tmp_path / "x.wav"
    synth = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(wav), "--max-duration", "0.3"]
    assert main([*synth, "--plan", str(out / "plan.json"), "--megakernel-executor", "vm", "--quiet"]) == 0
    assert soundfile.read(wav)[0].size > 0 and len(plan.buckets) == 2
    # a rebuild into the same folder searches with the fitted price, from the profile cache
    assert main([*argv, "--out", str(out)]) == 0
    again = json.loads((out / "build_report.json").read_text())["cut_costs"]
    assert again["source"].startswith("profile cache") and again["used_cut_s"] == costs["fitted_cut_s"]


def test_build_draws_the_timelines_of_the_chosen_megakernel_pieces(tmp_path, monkeypatch):
    """With profiles where the megakernel wins every region (stand-in timings), the plan chooses it and the
    build writes each chosen piece's simulated SM-queue timeline."""
    import tilevox.engine_builder.build as build

    def fake_region_times(model, batch, **_):
        on_megakernel = type(model.talker_step_backend).__name__.startswith("Megakernel")
        return dict.fromkeys(("talker_step", "code_predictor_loop", "codec_decode"), 1.0 if on_megakernel else 10.0)

    monkeypatch.setattr(build, "region_times", fake_region_times)
    out = tmp_path / "build"
    argv = ["build", "--model", "random:qwen3-tts-tiny", "--device", "cpu", "--batches", "1,2"]
    assert main([*argv, "--megakernel-executor", "vm", "--context", "64", "--out", str(out)]) == 0
    plan = load_plan(out / "plan.json")
    assert all(p.backend is Backend.MEGAKERNEL for b in plan.buckets for p in b.composition.pieces)
    # the codec decode's megakernel (an executor region) has no simulated timeline: none drawn for it
    drawn = sorted(p.name for p in out.glob("timeline_*.png"))
    assert drawn == [f"timeline_{r}_b{b}.png" for r in ("code_predictor_loop", "talker_step") for b in (1, 2)]


def test_plan_commit_names_the_source(monkeypatch):
    """A device copy's git metadata may be stale: $TILEVOX_COMMIT names the source; a checkout names its
    HEAD, marked -dirty when files differ from it."""
    from tilevox.server.cli import _commit

    monkeypatch.setenv("TILEVOX_COMMIT", "abc1234")
    assert _commit() == "abc1234"
    monkeypatch.delenv("TILEVOX_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, cwd=REPO)
    if head.returncode:
        pytest.skip("not a git checkout")
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=REPO
    )
    assert _commit() == head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def test_build_of_an_nh_tts_model_profiles_with_a_text_its_encoder_holds(tmp_path):
    """NH-TTS's encoder holds 1,024 bytes: the profile text is the longest repetition the model validates,
    and `tilevox build` plans its decoder step (graph vs megakernel through the VM)."""
    from tilevox.engine_builder.profile import PROFILE_TEXT, profile_text
    from tilevox.models.registry import load_model

    model = load_model("random:nh-tts-tiny")
    text = profile_text(model)
    assert text == PROFILE_TEXT * (len(text) // len(PROFILE_TEXT)) and 512 < len(text.encode()) <= 1024
    assert profile_text(load_model("random:llama-tiny")) == PROFILE_TEXT * 8
    out = tmp_path / "build"
    argv = ["build", "--model", "random:nh-tts-tiny", "--device", "cpu", "--batches", "1"]
    assert main([*argv, "--megakernel-executor", "vm", "--warmup", "1", "--steps", "1", "--out", str(out)]) == 0
    plan = load_plan(out / "plan.json", here=provenance_here(torch.device("cpu")))
    assert [b.batch for b in plan.buckets] == [1]


def test_a_rebuild_reuses_the_profile_cache_and_measures_only_what_changed(tmp_path, monkeypatch, capsys, settles):
    """The first build measures every (backend, batch) and every measured candidate and stores them; a rebuild
    of the same model into the same folder measures nothing and plans the same; other measurement settings
    (--steps) miss the cache; a broken cache file is a usage error naming it."""
    import tilevox.engine_builder.build as build

    calls = {"regions": 0, "step": 0}

    def fake_region_times(model, batch, **_):
        calls["regions"] += 1
        on_megakernel = type(model.talker_step_backend).__name__.startswith("Megakernel")
        times = {"talker_step": 2.0 if on_megakernel else 3.0, "code_predictor_loop": 5.0 if on_megakernel else 4.0}
        return {**times, "codec_decode": 1.5 if on_megakernel else 1.0}

    def fake_step_time_ms(model, batch, *, record=None, **_):
        calls["step"] += 1
        assert model.talker_step_backend is not None, "a whole step timed with no region backend installed"
        record.extend([6.5 + batch, 7.5 + batch])  # each timed step, kept in the report beside their mean
        return 7.0 + batch

    monkeypatch.setattr(build, "region_times", fake_region_times)
    monkeypatch.setattr(build, "step_time_ms", fake_step_time_ms)
    out = tmp_path / "build"
    argv = ["build", "--model", "random:qwen3-tts-tiny", "--device", "cpu", "--batches", "1,2", "--measure", "2"]
    argv += ["--megakernel-executor", "vm", "--warmup", "0", "--steps", "1", "--out", str(out)]
    assert main(argv) == 0
    # 2 backends x 2 batches; (1 anchor + 4 candidates: the 2 best predicted, all graph, all megakernel) x 2 batches
    # x 3 rounds (the default --measure-rounds)
    assert calls == {"regions": 4, "step": 30}
    assert settles == [(1, 2.0)]  # once, before the first measurement, at its batch
    first = json.loads((out / "build_report.json").read_text())
    # Predictions are anchored on the whole conventional step (7 + batch ms; its regions take 3 + 4 + 1 ms): the
    # all-graph composition is predicted as its anchor, the others as the anchor plus their regions' difference
    # (and the priced cost of a cut between a graph and a megakernel, microseconds; none around the codec decode).
    assert first["anchor_step_ms"] == {"1": 8.0, "2": 9.0}
    assert first["anchor_step_times_ms"] == {"1": [7.5, 8.5] * 3, "2": [8.5, 9.5] * 3}  # three timings each
    measured_rows = [row for rows in first["candidates"].values() for row in rows if "measured_step_ms" in row]
    assert len(measured_rows) == 8 and all(len(row["measured_step_times_ms"]) == 6 for row in measured_rows)
    decoders = {
        "talker_step[0-2+head]=graph code_predictor_loop[0-2+head]=graph": 0.0,
        "talker_step[0-2+head]=mk code_predictor_loop[0-2+head]=graph": -1.0,
        "talker_step[0-2+head]=graph code_predictor_loop[0-2+head]=mk": 1.0,
        "talker_step[0-2+head]=mk code_predictor_loop[0-2+head]=mk": 0.0,
    }
    codec = {"codec_decode[0-1+head]=graph": 0.0, "codec_decode[0-1+head]=mk": 0.5}
    for batch in (1, 2):
        predicted = {row["label"]: row["predicted_step_ms"] for row in first["candidates"][str(batch)]}
        all_graph = "talker_step[0-2+head]=graph code_predictor_loop[0-2+head]=graph codec_decode[0-1+head]=graph"
        assert predicted[all_graph] == 7.0 + batch
        assert predicted == pytest.approx(
            abs=0.01,
            expected={f"{d} {c}": 7.0 + batch + dd + dc for d, dd in decoders.items() for c, dc in codec.items()},
        )
    assert first["profile_cache"]["reused"] == 0 and (out / "profile_cache.json").is_file()
    assert first["category"] == "megakernel-stable"  # talker on the megakernel at both batches
    capsys.readouterr()

    def must_not_measure(*_, **__):
        raise AssertionError("a cached measurement was run again")

    monkeypatch.setattr(build, "region_times", must_not_measure)
    monkeypatch.setattr(build, "step_time_ms", must_not_measure)
    settles.clear()
    assert main(argv) == 0
    assert settles == []  # nothing measured, nothing to settle
    second = json.loads((out / "build_report.json").read_text())
    assert second["plan"]["buckets"] == first["plan"]["buckets"]
    # The cache keeps each measurement's mean, not its steps: a rebuild reports the same candidates without them.
    assert without_step_times(second["candidates"]) == without_step_times(first["candidates"])
    assert all(not row["measured_step_times_ms"] for rows in second["candidates"].values() for row in rows[:4])
    assert second["profile_cache"] == {"path": str(out / "profile_cache.json"), "reused": 14, "measured": 0}
    assert "14 measurements reused, 0 made" in capsys.readouterr().out

    # A cache written before anchors existed: the conventional backend is installed again for its anchors
    # alone, nothing else is measured, and the predictions come out as before.
    cache_file = out / "profile_cache.json"
    data = json.loads(cache_file.read_text())
    data["entries"] = {k: v for k, v in data["entries"].items() if json.loads(k)["kind"] != "anchor"}
    cache_file.write_text(json.dumps(data))
    monkeypatch.setattr(build, "step_time_ms", fake_step_time_ms)
    calls.update(regions=0, step=0)
    assert main(argv) == 0
    assert calls == {"regions": 0, "step": 6}  # 2 anchors, timed 3 times each
    assert settles == [(1, 2.0)]  # before the first anchor: whichever timing comes first
    third = json.loads((out / "build_report.json").read_text())
    assert without_step_times(third["candidates"]) == without_step_times(first["candidates"])
    assert third["anchor_step_ms"] == first["anchor_step_ms"]

    monkeypatch.setattr(build, "region_times", fake_region_times)
    calls.update(regions=0, step=0)
    assert main([*argv[:-4], "--steps", "2", "--out", str(out)]) == 0
    assert calls == {"regions": 4, "step": 30}

    (out / "profile_cache.json").write_text("{not json")
    assert main(argv) == 2
    assert "profile_cache.json: unreadable profile cache" in capsys.readouterr().err
    assert main([*argv, "--profile-cache", "none"]) == 0  # measures afresh, keeps nothing


def test_the_plan_records_its_megakernel_tiling_and_the_cache_keys_on_it(tmp_path, monkeypatch, capsys):
    """`--megakernel-tiling` compiles the megakernel regions with those overrides; the plan records the tiling
    and `--plan` compiles with it (not with today's defaults, and not with another --megakernel-tiling); a
    rebuild with another tiling measures the megakernel again and reuses the graph's measurements."""
    import tilevox.engine_builder.build as build
    from tilevox.engine_builder.regions import TilingConfig

    calls = {"regions": [], "step": 0}

    def fake_region_times(model, batch, **_):
        on_megakernel = type(model.talker_step_backend).__name__.startswith("Megakernel")
        calls["regions"].append("megakernel" if on_megakernel else "graph")
        times = {"talker_step": 2.0 if on_megakernel else 3.0, "code_predictor_loop": 5.0 if on_megakernel else 4.0}
        return {**times, "codec_decode": 1.0}

    def fake_step_time_ms(model, batch, **_):
        calls["step"] += 1
        return 7.0 + batch

    monkeypatch.setattr(build, "region_times", fake_region_times)
    monkeypatch.setattr(build, "step_time_ms", fake_step_time_ms)
    out = tmp_path / "build"
    argv = ["build", "--model", "random:qwen3-tts-tiny", "--device", "cpu", "--batches", "1"]
    argv += ["--megakernel-executor", "vm", "--warmup", "0", "--steps", "1", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads((out / "plan.json").read_text())["tiling"] == TilingConfig().to_dict()
    assert calls == {"regions": ["graph", "megakernel"], "step": 3}  # the anchor, timed 3 times
    calls.update(regions=[], step=0)
    assert main([*argv, "--megakernel-tiling", "split_qkv=on,attn_rows=2"]) == 0
    assert calls == {"regions": ["megakernel"], "step": 0}  # the graph's times and the anchor from the cache
    plan = load_plan(out / "plan.json")
    assert plan.tiling == TilingConfig(split_qkv=True, attn_rows=2).to_dict()

    compiled_with = []
    real_region_compiler = build.region_compiler

    def recording_region_compiler(tiling=None):
        compiled_with.append(tiling)
        return real_region_compiler(tiling)

    monkeypatch.setattr(build, "region_compiler", recording_region_compiler)
    apply_plan(_tiny_qwen(), plan, megakernel=BackendOptions(executor=Executor.VM))
    assert compiled_with == [TilingConfig(split_qkv=True, attn_rows=2)]
    wav = tmp_path / "x.wav"
    synth = ["synth", "--model", "random:qwen3-tts-tiny", "--text", "Hi", "--out", str(wav), "--max-duration", "0.2"]
    synth += ["--plan", str(out / "plan.json"), "--megakernel-executor", "vm", "--quiet"]
    assert main([*synth, "--megakernel-tiling", "split_qkv=off"]) == 2
    assert "leave --megakernel-tiling out" in capsys.readouterr().err
    assert main([*argv, "--megakernel-tiling", "split_qkv=maybe"]) == 2
    assert "--megakernel-tiling: tiling override 'split_qkv=maybe'" in capsys.readouterr().err


def _tiny_qwen():
    """A tiny Qwen3-TTS model on CPU (the layout the build above planned)."""
    from tilevox.models.registry import load_model

    return load_model("random:qwen3-tts-tiny", device="cpu", dtype=torch.float32)


def test_the_model_signature_tells_configs_apart():
    from tilevox.engine_builder.profile_cache import model_signature

    def signature(preset: str, dtype: torch.dtype) -> str:
        return model_signature(load_llasa(preset, device="cpu", dtype=dtype, max_streams=1).torch_modules())

    assert signature("llama-tiny", torch.float32) == signature("llama-tiny", torch.float32)
    assert signature("llama-tiny", torch.float32) != signature("llama-tiny", torch.bfloat16)


def without_step_times(candidates: dict) -> dict:
    """A report's candidates without the timed steps and rounds of their measurements (a rebuild from the cache
    has neither)."""
    timed = ("measured_step_times_ms", "measured_round_ms")
    return {
        batch: [{k: v for k, v in row.items() if k not in timed} for row in rows] for batch, rows in candidates.items()
    }


def test_measured_candidates_are_timed_in_interleaved_rounds(tmp_path, monkeypatch):
    """--measure-rounds 3: the candidates are timed round after round, the order rotated each round (A B C,
    B C A, C A B), and each one's time is the median of its rounds' means, which are kept in the report."""
    import tilevox.engine_builder.build as build

    installed: list[str] = []
    real_install = build.install_composition

    def recording_install(model, composition, *args, **kwargs):
        installed.append(composition.label())
        return real_install(model, composition, *args, **kwargs)

    def fake_region_times(model, batch, **_):  # the talker faster on the megakernel, the rest slower
        mk = type(model.talker_step_backend).__name__.startswith("Megakernel")
        return {"talker_step": 2.0 if mk else 3.0, "code_predictor_loop": 5.0 if mk else 4.0, "codec_decode": 1.0}

    drift = iter([5.0, 9.0, 6.0, 8.0, 4.0, 7.0, 30.0, 1.0, 2.0])  # the 9 timed candidate steps, in call order

    def fake_step_time_ms(model, batch, *, record=None, **_):
        if len(installed) == 0:  # the anchor, timed before any candidate is installed
            return 10.0
        value = next(drift)
        record.append(value)
        return value

    monkeypatch.setattr(build, "install_composition", recording_install)
    monkeypatch.setattr(build, "region_times", fake_region_times)
    monkeypatch.setattr(build, "step_time_ms", fake_step_time_ms)
    out = tmp_path / "build"
    argv = ["build", "--model", "random:qwen3-tts-tiny", "--device", "cpu", "--batches", "1", "--measure", "1"]
    argv += ["--measure-rounds", "3", "--megakernel-executor", "vm", "--warmup", "0", "--steps", "1"]
    assert main([*argv, "--profile-cache", "none", "--out", str(out)]) == 0
    assert len(installed) == 9
    a, b, c = installed[:3]
    assert len({a, b, c}) == 3 and installed[3:] == [b, c, a, c, a, b]
    rows = {r["label"]: r for r in json.loads((out / "build_report.json").read_text())["candidates"]["1"]}
    # calls: a 5, b 9, c 6 | b 8, c 4, a 7 | c 30, a 1, b 2 -> medians a 5, b 8, c 6
    assert [rows[x]["measured_round_ms"] for x in (a, b, c)] == [[5.0, 7.0, 1.0], [9.0, 8.0, 2.0], [6.0, 4.0, 30.0]]
    assert [rows[x]["measured_step_ms"] for x in (a, b, c)] == [5.0, 8.0, 6.0]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["buckets"][0]["label"] == a  # the fastest median, though b and c each had a faster round
    assert main([*argv[:-2], "--measure-rounds", "0", "--out", str(out)]) == 2
