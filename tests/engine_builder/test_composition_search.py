"""Where to cut (engine_builder.composition) and the plan file (engine_builder.plan) on toy cost tables
whose answers are known by hand: the legal compositions, the predicted step time with its cut costs, the
search's pick per batch, the model's category, and plans that round-trip and refuse other machines."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from tilevox.engine_builder.composition import (
    Backend,
    Category,
    Composition,
    ConventionalCosts,
    CutCosts,
    Piece,
    RegionLayout,
    classify,
    enumerate_compositions,
    iter_pieces,
    megakernel_layer_share,
    predict_step_s,
    search,
)
from tilevox.engine_builder.plan import BucketPlan, Plan, PlanError, Provenance, load_plan, save_plan

G, C, M = Backend.GRAPH, Backend.COMPILED, Backend.MEGAKERNEL
TALKER = RegionLayout(name="talker_step", num_layers=8, boundary_bytes_per_row=2048)
PREDICTOR = RegionLayout(name="code_predictor_loop", num_layers=5, cuttable=False, boundary_bytes_per_row=2048)


def _piece(first, stop, backend, region="talker_step", last=8):
    return Piece(region=region, first_layer=first, stop_layer=stop, head=stop == last, backend=backend)


def _expected_count(num_chunks: int, max_megakernels: int) -> int:
    """Label each grid chunk graph or megakernel; neighbouring graph chunks are one piece, neighbouring
    megakernel chunks may be one launch or two (a cut): count the distinct compositions."""
    total = 0
    for labels in itertools.product("GM", repeat=num_chunks):
        adjacent_m = sum(a == b == "M" for a, b in itertools.pairwise(labels))
        for cuts in itertools.product((False, True), repeat=adjacent_m):
            pieces_m = labels.count("M") - (adjacent_m - sum(cuts))
            total += pieces_m <= max_megakernels
    return total


@pytest.mark.parametrize("max_megakernels", [1, 2, 4])
def test_enumeration_is_every_legal_composition_once(max_megakernels):
    got = enumerate_compositions([TALKER], max_megakernels=max_megakernels, grid=2)
    for composition in got:
        composition.validate([TALKER])
        assert composition.num_megakernels <= max_megakernels
    keys = [tuple((p.first_layer, p.stop_layer, p.backend) for p in c.pieces) for c in got]
    assert len(keys) == len(set(keys)) == _expected_count(4, max_megakernels)
    assert ((0, 8, G),) in keys and ((0, 8, M),) in keys
    if max_megakernels >= 2:
        assert ((0, 4, M), (4, 8, M)) in keys and ((0, 2, M), (2, 6, G), (6, 8, M)) in keys


def test_an_uncuttable_region_is_whole_and_compiled_forms_are_candidates():
    got = enumerate_compositions([PREDICTOR, TALKER], conventional=(G, C), grid=4)
    predictor_options = {c.pieces[0] for c in got}
    assert {p.backend for p in predictor_options} == {G, C, M}
    assert all(p.first_layer == 0 and p.stop_layer == 5 and p.head for p in predictor_options)
    assert any(p.backend is C for c in got for p in c.pieces[1:])
    assert set(iter_pieces(got)) >= {_piece(0, 4, M), _piece(0, 8, M)}


def test_invalid_compositions_are_refused():
    with pytest.raises(ValueError, match="do not cover"):
        Composition((_piece(0, 3, G), _piece(4, 8, M))).validate([TALKER])
    with pytest.raises(ValueError, match="head belongs"):
        Composition((Piece(region="talker_step", first_layer=0, stop_layer=8, head=False, backend=G),)).validate(
            [TALKER]
        )
    with pytest.raises(ValueError, match="cannot be cut"):
        pieces = (_piece(0, 2, G, "code_predictor_loop", 5), _piece(2, 5, M, "code_predictor_loop", 5))
        Composition((*pieces, _piece(0, 8, G))).validate([PREDICTOR, TALKER])
    with pytest.raises(ValueError, match="do not match"):
        Composition((_piece(0, 8, G),)).validate([PREDICTOR, TALKER])


def _costs():
    """Per layer: graph 10 us at batch 1, 12 us at 32; head 20 / 30 us. A megakernel piece: 3 us + 4 us
    per layer (+ 5 us with the head) at batch 1; 20 us per layer (+ 40 us with the head) at batch 32 (its
    matvec path loses to GEMMs there)."""
    conventional = ConventionalCosts(
        layer_s={("talker_step", G, 1): 10e-6, ("talker_step", G, 32): 12e-6},
        head_s={("talker_step", G, 1): 20e-6, ("talker_step", G, 32): 30e-6},
    )

    def megakernel(piece: Piece, batch: int) -> float:
        per_layer, head = (4e-6, 5e-6) if batch == 1 else (20e-6, 40e-6)
        return 3e-6 + per_layer * piece.num_layers + (head if piece.head else 0.0)

    return conventional, megakernel


def test_predicted_step_adds_pieces_and_prices_each_cut():
    conventional, megakernel = _costs()
    cuts = CutCosts(launch_gap_s=1e-6, memory_bytes_per_s=1e9, prefetch_stall_s=2e-6)
    mixed = Composition((_piece(0, 4, M), _piece(4, 8, G)))
    # megakernel 3 + 16 us; graph 4 x 10 + 20 us; one cut into the graph: 1 us + 2 x 2048 B x 1 / 1e9
    want = 19e-6 + 60e-6 + 1e-6 + 2 * 2048 / 1e9
    got = predict_step_s(mixed, [TALKER], 1, conventional=conventional, megakernel=megakernel, cuts=cuts)
    assert got == pytest.approx(want, rel=1e-12)
    graph_then_mk = Composition((_piece(0, 4, G), _piece(4, 8, M)))
    got = predict_step_s(graph_then_mk, [TALKER], 1, conventional=conventional, megakernel=megakernel, cuts=cuts)
    assert got == pytest.approx(40e-6 + (3e-6 + 16e-6 + 5e-6) + 1e-6 + 2 * 2048 / 1e9 + 2e-6, rel=1e-12)
    # batch 16 interpolates the graph's layer and head times between the measured batches 1 and 32
    whole = Composition((_piece(0, 8, G),))
    got = predict_step_s(whole, [TALKER], 16, conventional=conventional, megakernel=megakernel, cuts=cuts)
    assert got == pytest.approx(8 * (10e-6 + 2e-6 * 15 / 31) + 20e-6 + 10e-6 * 15 / 31, rel=1e-12)
    with pytest.raises(KeyError, match="outside the measured batches"):
        predict_step_s(whole, [TALKER], 64, conventional=conventional, megakernel=megakernel, cuts=cuts)


def test_search_picks_the_known_best_per_batch_and_the_category_follows():
    conventional, megakernel = _costs()
    best = {}
    for batch in (1, 32):
        ranked = search([TALKER], batch, conventional=conventional, megakernel=megakernel, prefill_s=1e-3)
        assert len(ranked) == len(enumerate_compositions([TALKER]))
        assert [r.ttfa_s for r in ranked] == sorted(r.ttfa_s for r in ranked)
        assert ranked[0].ttfa_s == pytest.approx(1e-3 + ranked[0].step_s)
        best[batch] = ranked[0].composition
    # batch 1: one monolith (4 us/layer beats 10, and any cut only adds); batch 32: the plain graph
    assert best[1] == Composition((_piece(0, 8, M),))
    assert best[32] == Composition((_piece(0, 8, G),))
    got = classify(best)
    assert got.category is Category.RECEDING and got.shares == {1: 1.0, 32: 0.0}
    assert classify({1: best[32], 32: best[32]}).category is Category.AVERSE
    assert classify({1: best[32], 32: best[1]}).category is Category.ADVANCING
    assert classify({1: best[1], 8: best[1], 32: best[1]}).category is Category.STABLE


def test_a_split_wins_where_the_layers_differ():
    """The first half is cheap as a megakernel, the second half cheap conventionally: the best is one cut
    at the half, and a second megakernel or a cut elsewhere costs more."""
    conventional = ConventionalCosts(layer_s={("talker_step", G, 1): 10e-6}, head_s={("talker_step", G, 1): 20e-6})

    def megakernel(piece: Piece, batch: int) -> float:
        return 2e-6 + sum(2e-6 if layer < 4 else 30e-6 for layer in range(piece.first_layer, piece.stop_layer))

    ranked = search([TALKER], 1, conventional=conventional, megakernel=megakernel)
    assert ranked[0].composition == Composition((_piece(0, 4, M), _piece(4, 8, G)))
    assert megakernel_layer_share(ranked[0].composition) == 0.5


def _plan(tmp_path, *, gpu="NVIDIA H200"):
    provenance = Provenance(
        gpu=gpu, driver="580.159.04", library_hash="abc123", commit="d7604e2", profile_date="2026-12-03T19:00:00Z"
    )
    conventional, megakernel = _costs()
    buckets = []
    for batch in (1, 32):
        ranked = search([TALKER], batch, conventional=conventional, megakernel=megakernel, prefill_s=1e-3)
        buckets.append(BucketPlan.best_of(batch, ranked))
    plan = Plan(model="toy", provenance=provenance, layout=(TALKER,), buckets=tuple(buckets))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    return plan, path


def test_a_plan_round_trips_and_serves_each_batch_from_its_bucket(tmp_path):
    plan, path = _plan(tmp_path)
    loaded = load_plan(path, here=plan.provenance, model="toy")
    assert loaded == plan
    assert loaded.bucket_for(1).composition == Composition((_piece(0, 8, M),))
    assert loaded.bucket_for(2) is loaded.buckets[1] and loaded.bucket_for(32) is loaded.buckets[1]
    with pytest.raises(PlanError, match="above the plan's largest bucket"):
        loaded.bucket_for(33)
    assert json.loads(path.read_text())["buckets"][0]["label"] == "talker_step[0-8+head]=mk"


def test_a_plan_from_elsewhere_or_broken_is_refused(tmp_path):
    plan, path = _plan(tmp_path)
    here = Provenance(
        gpu="NVIDIA H100", driver="580.159.04", library_hash="abc123", commit="x", profile_date="2026-12-04"
    )
    with pytest.raises(PlanError, match="measured elsewhere .*gpu: plan 'NVIDIA H200', here 'NVIDIA H100'"):
        load_plan(path, here=here)
    with pytest.raises(PlanError, match="is for toy, not qwen"):
        load_plan(path, model="qwen")
    data = json.loads(path.read_text())
    data["buckets"][0]["composition"][0]["stop_layer"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="bucket 1: .*do not cover"):
        load_plan(path)
    data["format"] = "tilevox.plan/0"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="not a tilevox.plan/2 plan .*reads tilevox.plan/1, tilevox.plan/2"):
        load_plan(path)
    del data["provenance"]
    data["format"] = "tilevox.plan/2"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="malformed plan"):
        load_plan(path)


def test_a_plan_carries_its_tiling_and_refuses_one_this_version_cannot_compile(tmp_path):
    """A plan's megakernel tiling round-trips; one without (older plans) loads with none; an unknown field or
    a value of the wrong type is a malformed plan."""
    import dataclasses

    from tilevox.engine_builder.regions import TilingConfig

    plan, path = _plan(tmp_path)
    assert plan.tiling is None and "tiling" not in json.loads(path.read_text())
    tiled = dataclasses.replace(plan, tiling=TilingConfig(split_qkv=True, attn_rows=8).to_dict())
    save_plan(tiled, path)
    assert load_plan(path).tiling == tiled.tiling
    data = json.loads(path.read_text())
    for broken in ({"split_qkv": 1}, {"warp_specialised": True}, {"matvec_rows": None}):
        path.write_text(json.dumps({**data, "tiling": {**data["tiling"], **broken}}))
        with pytest.raises(PlanError, match="malformed plan: ValueError: .*tiling"):
            load_plan(path)


def test_the_layout_comes_from_what_the_models_declare():
    from tilevox.engine_builder.composition import model_layout
    from tilevox.models.llasa.loader import load_preset as load_llasa
    from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3

    qwen = load_qwen3("qwen3-tts-tiny")
    layout = model_layout(qwen)
    talker, predictor = qwen.talker.config.transformer, qwen.talker.config.code_predictor.transformer
    assert [(r.name, r.num_layers, r.cuttable, r.executor) for r in layout] == [
        ("talker_step", talker.num_layers, True, False),
        ("code_predictor_loop", predictor.num_layers, False, False),
        ("codec_decode", 1, False, True),  # the executor region with a megakernel backend: one unit
    ]
    assert all(r.boundary_bytes_per_row > 0 for r in layout if not r.executor)
    assert all(c.num_megakernels <= 4 for c in enumerate_compositions(layout))
    llasa = load_llasa("llama-tiny", device="cpu", dtype=torch.float32)
    (decoder,) = model_layout(llasa)  # its executor regions (chunk decode, sampling) have no megakernel backend
    assert decoder.name == "decoder_step" and decoder.num_layers == llasa.llama.config.num_hidden_layers


def test_simulated_megakernel_costs_compile_each_piece_once():
    """Pieces of a tiny Qwen3-TTS talker and Llasa decoder, compiled and simulated: positive times that
    grow with the layers a piece covers and with the batch, each (piece, batch) compiled once, and a search
    over them ranks every candidate."""
    from tilevox.engine_builder.composition import model_layout
    from tilevox.engine_builder.simulated_costs import SimulatedMegakernelCost
    from tilevox.models.llasa.loader import load_preset as load_llasa
    from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3

    qwen = load_qwen3("qwen3-tts-tiny")
    layers = qwen.talker.config.transformer.num_layers
    cost = SimulatedMegakernelCost(qwen, context=64)
    half = _piece(0, layers // 2, M, last=layers)
    whole = _piece(0, layers, M, last=layers)
    assert 0 < cost(half, 1) < cost(whole, 1) < cost(whole, 8)
    predictor = Piece(region="code_predictor_loop", first_layer=0, stop_layer=5, head=True, backend=M)
    assert cost(predictor, 1) > 0
    assert cost(half, 1) == cost(half, 1) and cost.num_compiled == 4
    llasa = load_llasa("llama-tiny", device="cpu", dtype=torch.float32)
    n = llasa.llama.config.num_hidden_layers
    llama_cost = SimulatedMegakernelCost(llasa, context=64)
    first = Piece(region="decoder_step", first_layer=0, stop_layer=1, head=False, backend=M)
    rest = Piece(region="decoder_step", first_layer=1, stop_layer=n, head=True, backend=M)
    assert llama_cost(first, 2) > 0 and llama_cost(rest, 2) > 0
    layout = model_layout(llasa)
    conventional = ConventionalCosts(
        layer_s={("decoder_step", G, 2): 1e-3}, head_s={("decoder_step", G, 2): 1e-3}
    )  # slow enough that megakernels win
    ranked = search(layout, 2, conventional=conventional, megakernel=llama_cost)
    assert ranked[0].composition.num_megakernels >= 1 and len(ranked) == len(enumerate_compositions(layout))


def test_a_cut_region_divides_its_measured_time_by_simulated_shares():
    """build._SimulatedShares: a whole region costs what was measured; a piece its simulated share of that,
    the same share whatever backend runs it; of the tiny Llasa's two layers, the piece with the last layer and the
    head takes more than the first (and more than an even share), and complementary pieces share about the whole."""
    from tilevox.engine_builder.build import _SimulatedShares
    from tilevox.engine_builder.composition import model_layout
    from tilevox.engine_builder.simulated_costs import SimulatedMegakernelCost
    from tilevox.models.llasa.loader import load_preset as load_llasa

    llasa = load_llasa("llama-tiny", device="cpu", dtype=torch.float32)
    layout = model_layout(llasa)
    (region,) = layout
    n = region.num_layers
    measured = ConventionalCosts(layer_s={("decoder_step", G, 1): 1e-3 / n}, head_s={("decoder_step", G, 1): 0.0})
    simulated = SimulatedMegakernelCost(llasa, context=64)
    shares = _SimulatedShares(measured, simulated, layout)
    whole = Piece(region="decoder_step", first_layer=0, stop_layer=n, head=True, backend=G)
    first = Piece(region="decoder_step", first_layer=0, stop_layer=n - 1, head=False, backend=G)
    last = Piece(region="decoder_step", first_layer=n - 1, stop_layer=n, head=True, backend=G)
    assert shares.piece_s(whole, 1) == pytest.approx(1e-3)
    assert shares.piece_s(last, 1) > 1e-3 / n  # more than an even share: it holds the head
    assert shares.piece_s(last, 1) > shares.piece_s(first, 1)
    assert 0.8e-3 < shares.piece_s(first, 1) + shares.piece_s(last, 1) < 1.5e-3
    assert simulated.share(last, 1, n) == simulated.share(dataclasses.replace(last, backend=M), 1, n)


def test_the_price_of_a_cut_is_fitted_from_measured_cut_and_whole_candidates():
    """build.fit_cut_costs: per bucket the whole candidates' mean residual is the bias; a cut candidate's
    residual beyond it, per cut inside a region, is one sample; the median sample, clamped at zero."""
    from tilevox.engine_builder.build import fit_cut_costs, fitted_cut_costs
    from tilevox.engine_builder.composition import num_cuts

    layout = [TALKER, PREDICTOR]
    whole_mk = Composition((_piece(0, 8, M), _piece(0, 5, M, region="code_predictor_loop", last=5)))
    whole_g = Composition((_piece(0, 8, G), _piece(0, 5, M, region="code_predictor_loop", last=5)))
    one_cut = Composition((_piece(0, 4, M), _piece(4, 8, M), _piece(0, 5, M, region="code_predictor_loop", last=5)))
    two_cuts = Composition(
        (_piece(0, 2, M), _piece(2, 4, G), _piece(4, 8, M), _piece(0, 5, M, region="code_predictor_loop", last=5))
    )
    assert (num_cuts(whole_mk), num_cuts(one_cut), num_cuts(two_cuts)) == (0, 1, 2)
    ms = 1e-3
    buckets = {
        # bias (0.1 + 0.3) / 2 = 0.2 ms; the cut's sample (0.7 - 0.2) / 1 = 0.5 ms
        1: [(whole_mk, 10.1 * ms, 10.0 * ms), (whole_g, 12.3 * ms, 12.0 * ms), (one_cut, 10.7 * ms, 10.0 * ms)],
        8: [(whole_mk, 20.0 * ms, 20.0 * ms), (two_cuts, 21.4 * ms, 20.0 * ms)],  # bias 0: (1.4 - 0) / 2 cuts
        32: [(one_cut, 30.0 * ms, 29.0 * ms)],  # no whole candidate measured: no sample
    }
    fitted, samples = fit_cut_costs(buckets, layout)
    assert samples == pytest.approx([0.5 * ms, 0.7 * ms]) and fitted == pytest.approx(0.6 * ms)
    faster = {1: [(whole_mk, 10.0 * ms, 10.0 * ms), (one_cut, 9.8 * ms, 10.0 * ms)]}  # a cut measured faster
    assert fit_cut_costs(faster, layout)[0] == 0.0
    assert fit_cut_costs({1: [(whole_mk, 10 * ms, 10 * ms)]}, layout) is None
    costs = fitted_cut_costs(0.6 * ms)
    assert costs.launch_gap_s == 0.6 * ms and costs.prefetch_stall_s == 0.0


def test_a_megakernel_piece_timeline_is_drawn(tmp_path):
    """The simulated SM queues of a piece as a PNG; its makespan is the piece's simulated time."""
    from tilevox.engine_builder.simulated_costs import SimulatedMegakernelCost
    from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3

    qwen = load_qwen3("qwen3-tts-tiny")
    layers = qwen.talker.config.transformer.num_layers
    cost = SimulatedMegakernelCost(qwen, context=64)
    piece = _piece(0, layers, M, last=layers)
    path = tmp_path / "timeline.png"
    assert cost.timeline(piece, 2, path) == pytest.approx(cost(piece, 2))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
