"""The build searches the executor regions that have a megakernel backend (the Qwen3-TTS codec decode) per batch
bucket, as one uncuttable region on the executor's graph or the megakernel, on CPU (the megakernel through its
VM): the layout holds it for Qwen3-TTS and not for Llasa; profiling times its step phase through whichever backend
is installed; a build whose stand-in timings make the megakernel faster at one bucket and slower at another picks
each; apply_plan installs each bucket's choice and the served audio equals the conventional one; a format-1 plan
(decoder regions only) still applies, the codec decode staying on its graph."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tilevox.engine_builder.build as build
from tilevox.engine_builder.build import apply_plan, build_plan, provenance_here
from tilevox.engine_builder.composition import (
    Backend,
    Composition,
    ConventionalCosts,
    CutCosts,
    Piece,
    RegionLayout,
    enumerate_compositions,
    model_layout,
    predict_step_s,
)
from tilevox.engine_builder.plan import FORMAT, BucketPlan, Plan, PlanError, load_plan, save_plan
from tilevox.engine_builder.profile import region_times
from tilevox.engine_builder.profile_cache import ProfileCache
from tilevox.engine_builder.regions import TilingConfig, region_compiler
from tilevox.executor.dispatch import BucketDispatch
from tilevox.executor.graphs import GraphedCodecDecode
from tilevox.executor.megakernel import BackendOptions, Executor, MegakernelCodecDecode, MegakernelUnavailable
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3
from tilevox.models.qwen3_tts.model import ModelOptions
from tilevox.models.region_backends import CODEC_DECODE, set_region_backend
from tilevox.models.sampling import SamplingParams
from tilevox.models.streaming import SynthesisRequest, synthesize

G, C, M = Backend.GRAPH, Backend.COMPILED, Backend.MEGAKERNEL
VM = BackendOptions(executor=Executor.VM, num_sms=4)
TOL = 1e-5  # as tests/executor/test_megakernel_codec.py: fp32, the region through the VM
DECODERS = ("talker_step", "code_predictor_loop")


def _qwen():
    return load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=3, max_seq_len=64))


def _whole(region: RegionLayout, backend: Backend) -> Piece:
    return Piece(region=region.name, first_layer=0, stop_layer=region.num_layers, head=True, backend=backend)


def _bucket(batch: int, layout, backends: dict[str, Backend]) -> BucketPlan:
    pieces = tuple(_whole(r, backends.get(r.name, G)) for r in layout)
    return BucketPlan(
        batch=batch, composition=Composition(pieces), predicted_step_s=1e-3, predicted_ttfa_s=2e-3, num_candidates=8
    )


# --- the layout and the search -------------------------------------------------------------------------------------
def test_the_codec_decode_is_one_uncuttable_region_on_graph_or_megakernel():
    from tilevox.models.llasa.loader import load_preset as load_llasa

    layout = model_layout(_qwen())
    assert [r.name for r in layout] == [*DECODERS, CODEC_DECODE]
    codec = layout[-1]
    assert codec.executor and not codec.cuttable and codec.num_layers == 1
    llasa = load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=2)
    assert [r.name for r in model_layout(llasa)] == ["decoder_step"]  # its chunk decode has no megakernel backend
    # The codec decode is never Inductor-compiled: its forms are the executor's graph and the megakernel only.
    candidates = enumerate_compositions(layout, conventional=(G, C), grid=64)
    assert {c.pieces[-1].backend for c in candidates} == {G, M}
    assert len(candidates) == 3 * 3 * 2
    with pytest.raises(ValueError, match="runs on graph or megakernel, not compiled"):
        Composition((*candidates[0].pieces[:-1], _whole(codec, C))).validate(layout)
    with pytest.raises(ValueError, match="executor region cannot be cut"):
        RegionLayout(name=CODEC_DECODE, num_layers=1, executor=True)


def test_no_cut_is_priced_into_or_out_of_an_executor_region():
    talker = RegionLayout(name="talker_step", num_layers=2, boundary_bytes_per_row=1024)
    codec = RegionLayout(name=CODEC_DECODE, num_layers=1, cuttable=False, executor=True)
    conventional = ConventionalCosts(
        layer_s={("talker_step", G, 1): 1e-3, (CODEC_DECODE, G, 1): 2e-3},
        head_s={("talker_step", G, 1): 0.0, (CODEC_DECODE, G, 1): 0.0},
    )
    cuts = CutCosts(launch_gap_s=1e-3, prefetch_stall_s=1e-3)

    def predict(talker_backend: Backend, codec_backend: Backend) -> float:
        pieces = (_whole(talker, talker_backend), _whole(codec, codec_backend))
        return predict_step_s(
            Composition(pieces), [talker, codec], 1, conventional=conventional, megakernel=lambda p, b: 5e-3, cuts=cuts
        )

    assert predict(G, G) == pytest.approx(2 * 1e-3 + 2e-3)
    assert predict(G, M) == pytest.approx(2 * 1e-3 + 5e-3)  # no launch gap, no prefetch stall into the codec
    assert predict(M, G) == pytest.approx(5e-3 + 2e-3)
    # the same pair as two decoder regions pays the cut (a check that the cut costs above are not zero)
    other = RegionLayout(name="code_predictor_loop", num_layers=1, cuttable=False)
    costs = ConventionalCosts(
        layer_s={("talker_step", G, 1): 1e-3, ("code_predictor_loop", G, 1): 2e-3},
        head_s={("talker_step", G, 1): 0.0, ("code_predictor_loop", G, 1): 0.0},
    )
    pieces = (_whole(talker, G), _whole(other, M))
    got = predict_step_s(
        Composition(pieces), [talker, other], 1, conventional=costs, megakernel=lambda p, b: 5e-3, cuts=cuts
    )
    assert got > 2 * 1e-3 + 5e-3 + 1.9e-3


# --- profiling -----------------------------------------------------------------------------------------------------
def test_the_step_phase_times_the_codec_decode_through_its_installed_backend():
    """`region_times` reports a codec_decode phase; with the megakernel backend installed, every decode of the
    timed steps went through it (so the build's megakernel pass measures the region, not the graph)."""
    model = load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=2))  # a context the profile text fits
    backend = MegakernelCodecDecode(
        model.codec_decoder, BackendOptions(executor=Executor.VM, compiler=region_compiler())
    )
    set_region_backend(model, CODEC_DECODE, backend)
    times = region_times(model, 2, warmup=0, steps=2)
    assert {*DECODERS, CODEC_DECODE} <= set(times) and times[CODEC_DECODE] > 0
    assert backend.num_megakernel_calls >= 2 and backend.num_conventional_calls == 0


def _stand_in_times(calls: list, codec_ms: dict[tuple[str, int], float]):
    """region_times stand-in: the decoder regions are faster on the graph (2 / 3 ms against 6 / 7); the codec
    decode takes codec_ms[(backend, batch)]. Records which backend each region ran on per call."""

    def fake(model, batch, **_):
        kinds = {}
        for name in (*DECODERS, CODEC_DECODE):
            kinds[name] = (
                "megakernel" if type(getattr(model, f"{name}_backend")).__name__.startswith("Mega") else "graph"
            )
        calls.append((batch, kinds))
        on_mk = kinds["talker_step"] == "megakernel"
        return {
            "talker_step": 6.0 if on_mk else 2.0,
            "code_predictor_loop": 7.0 if on_mk else 3.0,
            CODEC_DECODE: codec_ms[(kinds[CODEC_DECODE], batch)],
            "talker_sampling": 0.5,
        }

    return fake


CODEC_MS = {("graph", 1): 3.0, ("megakernel", 1): 2.0, ("graph", 2): 4.0, ("megakernel", 2): 5.0}


def _codec_choices(plan: Plan) -> dict[int, Backend]:
    return {b.batch: next(p.backend for p in b.composition.pieces if p.region == CODEC_DECODE) for b in plan.buckets}


def test_a_build_picks_the_codec_backend_per_bucket(monkeypatch):
    """Megakernel faster at batch 1 (2 against 3 ms), slower at batch 2 (5 against 4): the plan runs the codec
    decode on the megakernel in bucket 1 and on the graph in bucket 2, the decoder regions on the graph."""
    calls: list = []
    monkeypatch.setattr(build, "region_times", _stand_in_times(calls, CODEC_MS))
    monkeypatch.setattr(build, "step_time_ms", lambda model, batch, **_: 20.0 + batch)
    result = build_plan(_qwen(), "random:qwen3-tts-tiny", [1, 2], megakernel=VM, warmup=0, steps=1)
    # every region ran on the profiled backend in its pass, the codec decode included
    assert [kinds for _, kinds in calls] == [dict.fromkeys((*DECODERS, CODEC_DECODE), "graph")] * 2 + [
        dict.fromkeys((*DECODERS, CODEC_DECODE), "megakernel")
    ] * 2
    assert _codec_choices(result.plan) == {1: M, 2: G}
    assert all(p.backend is G for b in result.plan.buckets for p in b.composition.pieces if p.region in DECODERS)
    assert {k: v for k, v in result.measured_ms.items() if k[0] == CODEC_DECODE} == {
        (CODEC_DECODE, kind, batch): ms for (kind, batch), ms in CODEC_MS.items()
    }
    assert [r.name for r in result.plan.layout] == [*DECODERS, CODEC_DECODE]
    for batch, codec in ((1, "mk"), (2, "graph")):
        rows = result.ranked[batch]
        assert len(rows) == 8 and rows[0]["label"].endswith(f"codec_decode[0-1+head]={codec}")
        # predicted from the anchor (20 + batch ms) and the regions' differences against the all-graph step
        assert rows[0]["predicted_step_ms"] == pytest.approx(20.0 + batch + (-1.0 if batch == 1 else 0.0), abs=0.01)


def test_the_codec_choice_follows_the_timings_not_the_bucket(monkeypatch):
    """The same build with the codec timings swapped picks the opposite backend in each bucket."""
    swapped = {("graph", 1): 2.0, ("megakernel", 1): 3.0, ("graph", 2): 5.0, ("megakernel", 2): 4.0}
    monkeypatch.setattr(build, "region_times", _stand_in_times([], swapped))
    monkeypatch.setattr(build, "step_time_ms", lambda model, batch, **_: 20.0 + batch)
    result = build_plan(_qwen(), "random:qwen3-tts-tiny", [1, 2], megakernel=VM, warmup=0, steps=1)
    assert _codec_choices(result.plan) == {1: G, 2: M}


def test_with_only_the_compiled_form_profiled_the_codec_decode_is_on_its_graph(monkeypatch):
    """Profiling `compiled` and `megakernel`: the codec decode's conventional time (its graph, measured in the
    compiled pass) is recorded as graph, and the all-conventional anchor composition is compiled + graph."""
    monkeypatch.setattr(build, "region_times", _stand_in_times([], CODEC_MS))
    monkeypatch.setattr(build, "step_time_ms", lambda model, batch, **_: 20.0 + batch)
    result = build_plan(_qwen(), "random:qwen3-tts-tiny", [1, 2], backends=(C, M), megakernel=VM, warmup=0, steps=1)
    assert {(r, k) for (r, k, _) in result.measured_ms if r == CODEC_DECODE} == {
        (CODEC_DECODE, "graph"),
        (CODEC_DECODE, "megakernel"),
    }
    assert _codec_choices(result.plan) == {1: M, 2: G}
    assert {p.backend for b in result.plan.buckets for p in b.composition.pieces if p.region in DECODERS} == {C}


def test_the_profile_cache_keys_the_megakernel_pass_on_the_codec_region(monkeypatch):
    """A megakernel-pass entry from before the codec decode was searched (its codec time from the graph) is not
    reused; a rebuild with the new entries measures nothing and plans the same."""
    calls: list = []
    monkeypatch.setattr(build, "region_times", _stand_in_times(calls, CODEC_MS))
    monkeypatch.setattr(build, "step_time_ms", lambda model, batch, **_: 20.0 + batch)
    cache = ProfileCache(None, {"test": "codec"})
    old = {"talker_step": 6.0, "code_predictor_loop": 7.0, CODEC_DECODE: 0.1}
    for batch in (1, 2):
        cache.put("regions", old, backend="megakernel", batch=batch, warmup=0, steps=1, tiling=TilingConfig().to_dict())
    model = _qwen()
    first = build_plan(model, "random:qwen3-tts-tiny", [1, 2], megakernel=VM, warmup=0, steps=1, cache=cache)
    assert len(calls) == 4 and first.measured_ms[(CODEC_DECODE, "megakernel", 1)] == 2.0
    assert _codec_choices(first.plan) == {1: M, 2: G}
    calls.clear()
    again = build_plan(model, "random:qwen3-tts-tiny", [1, 2], megakernel=VM, warmup=0, steps=1, cache=cache)
    assert calls == [] and again.plan.buckets == first.plan.buckets


def test_a_codec_megakernel_that_cannot_be_made_leaves_the_decoders_profiled(monkeypatch):
    """The codec decode's megakernel unavailable (stand-in): the decoder regions are still profiled on the
    megakernel, the codec decode stays on its graph in every bucket, and the report says why."""
    monkeypatch.setattr(build, "region_times", _stand_in_times([], CODEC_MS))
    monkeypatch.setattr(build, "step_time_ms", lambda model, batch, **_: 20.0 + batch)
    real = build.make_backend

    def make_backend(model, name, options):
        if name == CODEC_DECODE:
            raise MegakernelUnavailable("stand-in: no codec region here")
        return real(model, name, options)

    monkeypatch.setattr(build, "make_backend", make_backend)
    result = build_plan(_qwen(), "random:qwen3-tts-tiny", [1, 2], megakernel=VM, warmup=0, steps=1)
    assert result.unavailable == {"megakernel codec_decode": "stand-in: no codec region here"}
    assert result.measured_ms[("talker_step", "megakernel", 1)] == 6.0
    assert result.measured_ms[(CODEC_DECODE, "megakernel", 1)] == float("inf")
    assert _codec_choices(result.plan) == {1: G, 2: G}


# --- apply_plan ----------------------------------------------------------------------------------------------------
def _serve(model, texts: list[str]) -> list[np.ndarray]:
    """Greedy streams of `texts` stepped together until each finishes; each stream's samples."""
    greedy = SamplingParams.greedy()
    ids = [
        model.open_stream(SynthesisRequest(text=t, sampling=greedy, max_duration_s=0.4, seed=n))
        for n, t in enumerate(texts)
    ]
    pieces: dict[int, list[np.ndarray]] = {i: [] for i in ids}
    live = list(ids)
    while live:
        for chunk in model.step(live):
            pieces[chunk.stream_id].append(chunk.samples)
            if chunk.finish_reason is not None:
                live.remove(chunk.stream_id)
    return [np.concatenate(pieces[i]) for i in ids]


def _old_plan(tmp_path, layout) -> Plan:
    """A format-1 plan (before executor regions were searched): the decoder regions on the graph in buckets 1, 2."""
    decoders = tuple(r for r in layout if not r.executor)
    plan = Plan(
        model="random:qwen3-tts-tiny",
        provenance=provenance_here(torch.device("cpu")),
        layout=decoders,
        buckets=(_bucket(1, decoders, {}), _bucket(2, decoders, {})),
    )
    path = tmp_path / "old_plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    data["format"] = "tilevox.plan/1"
    for region in data["layout"]:
        del region["executor"]  # the field format 1 did not have
    path.write_text(json.dumps(data))
    return load_plan(path, here=provenance_here(torch.device("cpu")), model="random:qwen3-tts-tiny")


def test_apply_plan_runs_the_codec_decode_on_each_buckets_choice(tmp_path):
    """Bucket 1 decodes on the megakernel (VM), bucket 2 on the executor's graph; a format-1 plan leaves the codec
    decode on its graph in every bucket. One stream, then two together: the audio under the new plan equals the
    old plan's (the conventional codec decode) within fp32 rounding, and each decode went where its bucket says."""
    model = _qwen()
    layout = model_layout(model)
    old = _old_plan(tmp_path, layout)
    assert [r.name for r in old.layout] == list(DECODERS)
    dispatchers = apply_plan(model, old, megakernel=VM)
    assert set(dispatchers) == set(DECODERS)
    assert isinstance(model.codec_decode_backend, GraphedCodecDecode)  # not dispatched: as served
    request = SynthesisRequest(text="Good morning", sampling=SamplingParams.greedy(), max_duration_s=0.5, seed=3)
    ref_one = synthesize(model, request)
    ref_two = _serve(model, ["One two three", "Four"])
    assert model.codec_decode_backend.num_graph_calls > 0

    plan = Plan(
        model="random:qwen3-tts-tiny",
        provenance=provenance_here(torch.device("cpu")),
        layout=layout,
        buckets=(_bucket(1, layout, {CODEC_DECODE: M}), _bucket(2, layout, {CODEC_DECODE: G})),
    )
    save_plan(plan, tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == FORMAT == "tilevox.plan/2"
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded == plan
    dispatchers = apply_plan(model, loaded, megakernel=VM)
    codec = dispatchers[CODEC_DECODE]
    assert isinstance(codec, BucketDispatch) and model.codec_decode_backend is codec
    (_, _, on_mk), (_, _, on_graph) = codec.choices
    assert isinstance(on_mk, MegakernelCodecDecode) and isinstance(on_graph, GraphedCodecDecode)

    got_one = synthesize(model, request)
    assert got_one.num_frames == ref_one.num_frames >= 5
    np.testing.assert_allclose(got_one.samples, ref_one.samples, atol=TOL, rtol=0)
    assert on_mk.num_megakernel_calls == got_one.num_frames and on_mk.num_conventional_calls == 0
    assert on_graph.num_graph_calls == 0
    got_two = _serve(model, ["One two three", "Four"])
    for got, ref in zip(got_two, ref_two, strict=True):
        assert got.size == ref.size > 0
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert on_graph.num_graph_calls > 0 and codec.calls[(2, "graph")] == on_graph.num_graph_calls
    assert codec.calls[(1, "megakernel")] == on_mk.num_megakernel_calls
    assert codec.num_above_largest == 0


def test_plans_whose_regions_are_not_the_models_are_refused(tmp_path):
    model = _qwen()
    layout = model_layout(model)
    talker_only = tuple(r for r in layout if r.name == "talker_step")
    reordered = (layout[2], layout[0], layout[1])
    for wrong in (talker_only, reordered):
        plan = Plan(
            model="m",
            provenance=provenance_here(torch.device("cpu")),
            layout=wrong,
            buckets=(_bucket(1, wrong, {}),),
        )
        with pytest.raises(PlanError, match="do not match this model's"):
            apply_plan(model, plan, megakernel=VM)
    # a format-1 plan cannot declare an executor region
    save_plan(
        Plan(model="m", provenance=plan.provenance, layout=layout, buckets=(_bucket(1, layout, {}),)),
        tmp_path / "p.json",
    )
    data = json.loads((tmp_path / "p.json").read_text())
    data["format"] = "tilevox.plan/1"
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="malformed plan: .*tilevox.plan/1 plan has decoder regions only"):
        load_plan(tmp_path / "p.json")
