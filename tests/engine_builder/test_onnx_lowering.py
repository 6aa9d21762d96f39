"""TensorRT lowering of a plan (engine_builder.onnx_lowering) on CPU: the exported Llama decoder step, Qwen3-TTS
talker step and code-predictor loop pass the ONNX checker, and onnx's reference evaluator (the plugin ops'
reference implementations: swiglu_mlp in numpy, MegakernelRegion on the PyTorch VM) reproduces the PyTorch
step in fp32 (logits, hidden, KV caches; the predictor's codes and per-head logits), in both forms, and so for
the NH-TTS decoder step (random:nh-tts-tiny, with cross-attention); the decoder steps also cut in halves (one
MegakernelRegion node per megakernel piece, each with a clean error output; a plan that cuts one lowers as one
file); the
MegakernelRegion node's attributes decode to the compiled program, packed words equal."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the ONNX lowering needs `onnx` (pip install onnx onnxscript)")
pytest.importorskip("onnxscript", reason="trt_plugins.onnx needs `onnxscript`")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from tilevox.engine_builder.composition import Backend, Piece, RegionLayout  # noqa: E402
from tilevox.engine_builder.onnx_lowering import (  # noqa: E402
    CacheLayout,
    OnnxLoweringError,
    export_code_predictor_loop,
    export_cut_step,
    export_decoder_step,
    export_nh_decoder_step,
    export_plan,
    export_talker_step,
)
from tilevox.engine_builder.regions import compile_region  # noqa: E402
from tilevox.engine_builder.regions.spec import region_spec  # noqa: E402
from tilevox.executor.megakernel_inputs import code_predictor_inputs, sampling_inputs  # noqa: E402
from tilevox.models.nh_tts.loader import load_preset as load_nh_tts  # noqa: E402
from tilevox.models.qwen3_tts.layers import CacheView  # noqa: E402
from tilevox.models.qwen3_tts.loader import load_preset as load_qwen3  # noqa: E402
from tilevox.models.qwen3_tts.model import ModelOptions  # noqa: E402
from tilevox.models.sampling import SamplingParams  # noqa: E402
from tilevox.server.cli import main  # noqa: E402
from tilevox.trt_plugins.megakernel import run_program  # noqa: E402
from tilevox.trt_plugins.megakernel.packing import pack_program  # noqa: E402
from tilevox.trt_plugins.onnx import MEGAKERNEL_REGION, REFERENCE_OPS, program_from_attributes  # noqa: E402

CACHE = CacheLayout(num_slots=4, cache_len=16)


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _evaluate(model, feeds) -> dict:
    onnx.checker.check_model(model, full_check=True)
    runs = ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None, feeds)
    return {o.name: torch.from_numpy(np.asarray(v)) for o, v in zip(model.graph.output, runs)}


def _node_kinds(model, megakernel: bool, num_layers: int) -> None:
    kinds = [(n.domain, n.op_type) for n in model.graph.node]
    if megakernel:
        assert [k for k in kinds if k[0] == "tilevox"] == [("tilevox", MEGAKERNEL_REGION)]
    else:
        assert kinds.count(("tilevox", "swiglu_mlp")) >= num_layers
        assert ("tilevox", MEGAKERNEL_REGION) not in kinds


# A step exported whole (conventional ops or one megakernel node) or cut in halves: `cut XY` runs the first half on
# the megakernel for X = m or as ops for X = c, the second half likewise by Y (export_cut_step).
FORMS = ["conventional", "megakernel", "cut mc", "cut cm"]
_WHOLE_EXPORTS = {
    "decoder_step": export_decoder_step,
    "talker_step": export_talker_step,
    "nh_decoder_step": export_nh_decoder_step,
}


def _export_form(network, region: str, form: str, num_layers: int, *, batch: int, cache: CacheLayout):
    if form in ("conventional", "megakernel"):
        return _WHOLE_EXPORTS[region](network, batch=batch, cache=cache, megakernel=form == "megakernel")
    half, kinds = max(1, num_layers // 2), form.split()[1]
    pieces = [(0, half, kinds[0] == "m"), (half, num_layers, kinds[1] == "m")]
    return export_cut_step(network, region, pieces, batch=batch, cache=cache)


def _check_form(model, out: dict, form: str, num_layers: int) -> None:
    """A MegakernelRegion node per megakernel piece, each with a clean error output, and a swiglu_mlp node per
    layer run as ops."""
    half = max(1, num_layers // 2)
    if form in ("conventional", "megakernel"):
        spans = [(num_layers, form == "megakernel")]
    else:
        spans = [(half, form.split()[1][0] == "m"), (num_layers - half, form.split()[1][1] == "m")]
    kinds = [(n.domain, n.op_type) for n in model.graph.node]
    assert kinds.count(("tilevox", MEGAKERNEL_REGION)) == sum(m for _, m in spans)
    assert kinds.count(("tilevox", "swiglu_mlp")) == sum(n for n, m in spans if not m)
    errors = [name for name in out if name.endswith(".error")]
    assert len(errors) == sum(m for _, m in spans) and not any(out[name].any() for name in errors)


@pytest.fixture()
def primed(tiny_llama):
    """A cache whose slots 3 and 1 hold 5 and 2 prompt tokens (rows at different positions)."""
    cache = tiny_llama.new_cache(max_streams=CACHE.num_slots, max_seq_len=CACHE.cache_len)
    for _ in range(CACHE.num_slots):
        cache.allocate()
    for slot, n in ((3, 5), (1, 2)):
        tiny_llama.prefill(cache, slot, torch.arange(1, n + 1))
    return cache


@pytest.mark.parametrize("form", [*FORMS, "cut mm"])
def test_exported_step_reproduces_the_pytorch_step(tiny_llama, primed, form):
    slots, tokens = [3, 1], torch.tensor([7, 11])
    feeds = {
        "tokens": tokens.numpy(),
        "positions": np.array([primed.lengths[s] for s in slots]),
        "slots": np.array(slots),
        "k_cache": primed.k.numpy().copy(),
        "v_cache": primed.v.numpy().copy(),
    }
    num_layers = tiny_llama.config.num_hidden_layers
    model = _export_form(tiny_llama, "decoder_step", form, num_layers, batch=2, cache=CACHE)
    if form == "megakernel":
        assert [(n.domain, n.op_type) for n in model.graph.node] == [("tilevox", MEGAKERNEL_REGION)]
    out = _evaluate(model, feeds)
    _check_form(model, out, form, num_layers)
    expected = tiny_llama.decode(primed, slots, tokens)  # writes this step's keys into primed
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["logits"], expected, **close)
    torch.testing.assert_close(out["k_cache_out"], primed.k, **close)
    torch.testing.assert_close(out["v_cache_out"], primed.v, **close)


def test_megakernel_node_attributes_round_trip_to_the_program(tiny_llama):
    model = export_decoder_step(tiny_llama, batch=3, cache=CACHE, megakernel=True)
    model = onnx.load_from_string(model.SerializeToString())  # through the serialized form
    (node,) = model.graph.node
    expected = compile_region(
        tiny_llama,
        region_spec("decoder_step"),
        batch_size=3,
        max_context=CACHE.cache_len,
        num_cache_slots=CACHE.num_slots,
        cache_len=CACHE.cache_len,
    ).program
    decoded = program_from_attributes(_attrs(node))
    # FLOAT attributes are float32, as the kernel's launch parameters are (ctypes c_float)
    as_f32 = {n: float(np.float32(getattr(expected.constants, n))) for n in ("rms_norm_eps", "attn_scale")}
    assert decoded.constants == dataclasses.replace(expected.constants, **as_f32)
    assert decoded.buffers == expected.buffers
    packed, want = pack_program(decoded), pack_program(expected)
    assert set(packed) == set(want)
    for name in want:
        assert packed[name].numpy().tobytes() == want[name].numpy().tobytes(), name


def test_unsupported_regions_and_cuts_are_refused(tiny_llama):
    def plan(piece, layout=()):
        return SimpleNamespace(
            buckets=[SimpleNamespace(batch=1, composition=SimpleNamespace(pieces=[piece]))], tiling=None, layout=layout
        )

    model = SimpleNamespace(max_streams=2, max_seq_len=8)
    codec = Piece(region="codec_decode", first_layer=0, stop_layer=1, head=True, backend=Backend.GRAPH)
    with pytest.raises(OnnxLoweringError, match="codec_decode has no ONNX lowering yet"):
        export_plan(model, plan(codec), "unused")
    # the same region declared an executor region of the plan is the executor's: skipped, nothing written
    executor = RegionLayout(name="codec_decode", num_layers=1, cuttable=False, executor=True)
    assert export_plan(model, plan(codec, (executor,)), "unused") == []
    cut = Piece(region="code_predictor_loop", first_layer=0, stop_layer=1, head=False, backend=Backend.MEGAKERNEL)
    with pytest.raises(OnnxLoweringError, match="cuts region code_predictor_loop"):
        export_plan(model, plan(cut), "unused")
    with pytest.raises(OnnxLoweringError, match="batch 5"):
        export_decoder_step(tiny_llama, batch=5, cache=CACHE, megakernel=False)
    with pytest.raises(OnnxLoweringError, match="qwen3_tts_talker networks; got a llama network"):
        export_talker_step(tiny_llama, batch=1, cache=CACHE, megakernel=False)


def test_megakernel_nodes_take_the_tiling_the_plan_was_measured_with(tmp_path):
    """A plan recording split_qkv lowers its megakernel region with it (KV_APPEND in the node's program, the
    same program as export_region with that tiling); another explicit tiling is refused."""
    from tilevox.engine_builder.build import provenance_here
    from tilevox.engine_builder.composition import Composition, model_layout
    from tilevox.engine_builder.onnx_lowering import export_region
    from tilevox.engine_builder.plan import BucketPlan, Plan
    from tilevox.engine_builder.regions import TilingConfig
    from tilevox.models.llasa.loader import load_preset as load_llasa
    from tilevox.trt_plugins.megakernel import Opcode

    model = load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=4)
    (layout,) = model_layout(model)
    tiling = TilingConfig(split_qkv=True, attn_rows=2)
    piece = Piece(
        region=layout.name, first_layer=0, stop_layer=layout.num_layers, head=True, backend=Backend.MEGAKERNEL
    )
    bucket = BucketPlan(
        batch=2, composition=Composition((piece,)), predicted_step_s=1e-3, predicted_ttfa_s=2e-3, num_candidates=2
    )
    provenance = provenance_here(torch.device("cpu"))
    plan = Plan(
        model="random:llama-tiny", provenance=provenance, layout=(layout,), buckets=(bucket,), tiling=tiling.to_dict()
    )
    (path,) = export_plan(model, plan, tmp_path)
    (node,) = onnx.load(str(path)).graph.node
    decoded = program_from_attributes(_attrs(node))
    assert Opcode.KV_APPEND in {inst.opcode for inst in decoded.instructions}
    (direct,) = export_region(model, layout.name, batch=2, megakernel=True, tiling=tiling).graph.node
    assert pack_program(decoded).keys() == pack_program(program_from_attributes(_attrs(direct))).keys()
    for name, words in pack_program(program_from_attributes(_attrs(direct))).items():
        assert pack_program(decoded)[name].numpy().tobytes() == words.numpy().tobytes(), name
    with pytest.raises(OnnxLoweringError, match="measured with tiling"):
        export_plan(model, plan, tmp_path, tiling=TilingConfig())


def test_build_onnx_writes_each_bucket(tmp_path, capsys):
    out = tmp_path / "build"
    argv = ["build", "--model", "random:llama-tiny", "--device", "cpu", "--batches", "1,2", "--onnx"]
    argv += ["--megakernel-executor", "vm", "--warmup", "1", "--steps", "1", "--out", str(out)]
    assert main(argv) == 0
    assert "onnx/decoder_step_b2.onnx" in capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    for bucket in plan["buckets"]:
        path = out / "onnx" / f"decoder_step_b{bucket['batch']}.onnx"
        onnx.checker.check_model(str(path), full_check=True)
        nodes = {n.op_type for n in onnx.load(str(path)).graph.node}
        backend = bucket["composition"][0]["backend"]
        assert (MEGAKERNEL_REGION in nodes) == (backend == "megakernel"), (backend, nodes)
        assert (backend == "megakernel") or "swiglu_mlp" in nodes


# --- Qwen3-TTS ---------------------------------------------------------------------------------------------------
TALKER_CACHE = CacheLayout(num_slots=3, cache_len=16)


@pytest.fixture(scope="module")
def qwen3():
    """random:qwen3-tts-tiny in fp32 (the predictor is narrower than the talker: an input projection)."""
    return load_qwen3("qwen3-tts-tiny", options=ModelOptions(max_streams=3, max_seq_len=16))


@pytest.fixture()
def talker_cache(qwen3):
    """A talker cache whose slots 2 and 0 hold 5 and 2 prompt positions (rows at different positions)."""
    talker = qwen3.talker
    cache = talker.new_cache(num_slots=TALKER_CACHE.num_slots, max_len=TALKER_CACHE.cache_len)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for slot, n in ((2, 5), (0, 2)):
            prompt = torch.randn(1, n, talker.config.transformer.hidden_size, generator=gen)
            view = CacheView(
                cache=cache, slots=torch.tensor([slot]), start=torch.tensor([0]), kv_len=16, write_offset=0
            )
            talker.forward_tokens(prompt, view)
    return cache


@pytest.mark.parametrize("form", FORMS)
def test_exported_talker_step_reproduces_forward_tokens(qwen3, talker_cache, form):
    talker, slots, positions = qwen3.talker, [2, 0], [5, 2]
    x = torch.randn(2, 1, talker.config.transformer.hidden_size, generator=torch.Generator().manual_seed(1))
    num_layers = talker.config.transformer.num_layers
    model = _export_form(talker, "talker_step", form, num_layers, batch=2, cache=TALKER_CACHE)
    feeds = {
        "x_in": x[:, 0].numpy(),
        "positions": np.array(positions),
        "slots": np.array(slots),
        "k_cache": talker_cache.keys.numpy().copy(),
        "v_cache": talker_cache.values.numpy().copy(),
    }
    out = _evaluate(model, feeds)
    _check_form(model, out, form, num_layers)
    view = CacheView(cache=talker_cache, slots=torch.tensor(slots), start=torch.tensor(positions), kv_len=16)
    with torch.no_grad():
        hidden, logits = talker.forward_tokens(x, view)  # writes this step's keys into talker_cache
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["hidden"], hidden, **close)
    torch.testing.assert_close(out["logits"], logits, **close)
    torch.testing.assert_close(out["k_cache_out"], talker_cache.keys, **close)
    torch.testing.assert_close(out["v_cache_out"], talker_cache.values, **close)


def _frame(qwen3, batch: int):
    talker = qwen3.talker
    gen = torch.Generator().manual_seed(batch)
    hidden = torch.randn(batch, talker.config.transformer.hidden_size, generator=gen)
    with torch.no_grad():
        return hidden, talker.embed_codec(torch.randint(0, talker.config.num_audio_codes, (batch,), generator=gen))


@pytest.mark.parametrize("megakernel", [False, True], ids=["conventional", "megakernel"])
def test_exported_code_predictor_loop_reproduces_predict(qwen3, megakernel):
    """Greedy rows' codes and per-head logits equal CodePredictor.predict with argmax, and the frame cache equals
    its cache; the megakernel form takes the on-device sampling inputs (row 1 samples: its codes equal the
    compiled region's own run on the VM with the same inputs)."""
    predictor, batch = qwen3.talker.code_predictor, 3
    hidden, code0 = _frame(qwen3, batch)
    ref_logits = []

    def argmax(head: int, logits: torch.Tensor) -> torch.Tensor:
        ref_logits.append(logits)
        return logits.argmax(-1)

    cache = predictor.new_cache(batch)
    with torch.no_grad():
        codes = predictor.predict(hidden, code0, argmax, cache=cache)
    model = export_code_predictor_loop(predictor, batch=batch, megakernel=megakernel)
    _node_kinds(model, megakernel, predictor.config.code_predictor.transformer.num_layers)
    stale = torch.randn(cache.keys.shape, generator=torch.Generator().manual_seed(9))  # every position is written
    feeds = {
        "hidden": hidden.numpy(),
        "code0_embedding": code0.numpy(),
        "k_cache": stale.numpy(),
        "v_cache": stale.numpy(),
    }
    greedy_rows = [0, 2]
    if megakernel:
        params = [
            SamplingParams.greedy(),
            SamplingParams(temperature=0.9, top_k=20, top_p=0.9),
            SamplingParams.greedy(),
        ]
        sampling = sampling_inputs(params, seeds=[5, 6, 7], rng_offsets=[0, 8, 16])
        feeds.update({n: t.numpy() for n, t in sampling.items()})
        assert [i.name for i in model.graph.input][2:7] == list(sampling)
    else:
        assert not {"temperature", "seed"} & {i.name for i in model.graph.input}
        assert {p.key: p.value for p in model.metadata_props} == {"tilevox.sampling": "greedy"}
    out = _evaluate(model, feeds)
    close = dict(rtol=1e-5, atol=1e-5)
    assert out["codes"].shape == codes.shape and out["codes"].dtype == torch.int64
    assert torch.equal(out["codes"][greedy_rows], codes[greedy_rows])
    torch.testing.assert_close(out["logits"][greedy_rows], torch.stack(ref_logits, 1)[greedy_rows], **close)
    if not megakernel:  # all rows greedy: the whole frame cache is predict's
        assert torch.equal(out["codes"], codes)
        torch.testing.assert_close(out["k_cache_out"], cache.keys, **close)
        torch.testing.assert_close(out["v_cache_out"], cache.values, **close)
        return
    torch.testing.assert_close(out["k_cache_out"][:, greedy_rows], cache.keys[:, greedy_rows], **close)
    assert not out["code_predictor_loop.error"].any()
    region = compile_region(predictor, region_spec("code_predictor_loop"), batch_size=batch)
    vm = run_program(
        region.program, {**code_predictor_inputs(region, predictor.new_cache(batch), hidden, code0), **sampling}
    )
    assert torch.equal(out["codes"], torch.stack([vm[f"s{h + 1}.tokens"] for h in range(predictor.num_steps)], 1))


@pytest.mark.parametrize("winner", ["graph", "megakernel"])
def test_build_onnx_writes_qwen3_tts_regions(tmp_path, capsys, monkeypatch, winner):
    """Stand-in region timings make `winner` the faster backend of every region, so the plan takes it."""
    import tilevox.engine_builder.build as build

    def fake_region_times(model, batch, **_):
        on_megakernel = type(model.talker_step_backend).__name__.startswith("Megakernel")
        fast = on_megakernel == (winner == "megakernel")
        return {region: 1.0 if fast else 10.0 for region in ("talker_step", "code_predictor_loop", "codec_decode")}

    monkeypatch.setattr(build, "region_times", fake_region_times)
    out = tmp_path / "build"
    argv = ["build", "--model", "random:qwen3-tts-tiny", "--device", "cpu", "--batches", "1,2", "--onnx"]
    argv += ["--megakernel-executor", "vm", "--warmup", "1", "--steps", "1", "--out", str(out)]
    argv += ["--context", "64"]
    assert main(argv) == 0
    assert "onnx/code_predictor_loop_b2.onnx" in capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    written, backends = set(), set()
    for bucket in plan["buckets"]:
        for piece in bucket["composition"]:
            backends.add(piece["backend"])
            if piece["region"] == "codec_decode":  # an executor region (on `winner` too): the executor's, not lowered
                continue
            path = out / "onnx" / f"{piece['region']}_b{bucket['batch']}.onnx"
            onnx.checker.check_model(str(path), full_check=True)
            nodes = {n.op_type for n in onnx.load(str(path)).graph.node}
            assert (MEGAKERNEL_REGION in nodes) == (piece["backend"] == "megakernel"), (piece, nodes)
            written.add(path.name)
    assert backends == {winner}
    assert {p.name for p in (out / "onnx").iterdir()} == written
    assert written == {f"{r}_b{b}.onnx" for r in ("talker_step", "code_predictor_loop") for b in (1, 2)}


# --- plans that cut a step -------------------------------------------------------------------------------------
def test_a_plan_that_cuts_a_step_lowers_it_as_one_file(tmp_path):
    """export_plan: a bucket cutting Llasa's decoder step writes decoder_step_b<B>.onnx of its pieces (one
    conventional layer, then a megakernel node); pieces that do not cover the layers, or a cut of a region
    that is not lowered in pieces, are refused."""
    from tilevox.engine_builder.build import provenance_here
    from tilevox.engine_builder.composition import Composition, model_layout
    from tilevox.engine_builder.plan import BucketPlan, Plan
    from tilevox.models.llasa.loader import load_preset as load_llasa

    speech = load_llasa("llama-tiny", device="cpu", dtype=torch.float32, max_streams=2, max_seq_len=32)
    (layout,) = model_layout(speech)
    n = layout.num_layers
    cut = Composition(
        (
            Piece(region="decoder_step", first_layer=0, stop_layer=1, head=False, backend=Backend.GRAPH),
            Piece(region="decoder_step", first_layer=1, stop_layer=n, head=True, backend=Backend.MEGAKERNEL),
        )
    )
    plan = Plan(
        model="random:llama-tiny",
        provenance=provenance_here(torch.device("cpu")),
        layout=(layout,),
        buckets=(BucketPlan(batch=2, composition=cut, predicted_step_s=1e-3, predicted_ttfa_s=1e-3, num_candidates=2),),
    )
    (path,) = export_plan(speech, plan, tmp_path)
    assert path.name == "decoder_step_b2.onnx"
    nodes = [node.op_type for node in onnx.load(str(path)).graph.node]
    assert nodes.count(MEGAKERNEL_REGION) == 1 and nodes.count("swiglu_mlp") == 1
    with pytest.raises(OnnxLoweringError, match="do not cover"):
        export_cut_step(speech.llama, "decoder_step", [(0, 1, True)], batch=1, cache=CACHE)
    with pytest.raises(OnnxLoweringError, match="not lowered in pieces"):
        export_cut_step(speech.llama, "code_predictor_loop", [(0, 1, True), (1, n, False)], batch=1, cache=CACHE)


# --- NH-TTS ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
def test_exported_nh_decoder_step_reproduces_the_step(form):
    """Rows 3 and 1 at positions 4 and 0 with texts of 6 and 2 encoder positions; the other rows' cross keys
    are large stale values (masked by slot and text length)."""
    network = load_nh_tts("nh-tts-tiny", device="cpu", dtype=torch.float32, max_streams=2).network
    config, layout = network.config, CacheLayout(num_slots=4, cache_len=12, text_len=10)
    rows, positions, texts = [3, 1], [4, 0], [6, 2]
    gen = torch.Generator().manual_seed(0)
    cache = network.new_cache(max_rows=4, max_seq_len=12, max_text_len=10)
    encoded = torch.randn(2, 10, config.encoder.hidden_size, generator=gen)
    cache.claim(rows)
    network.decoder.write_cross(cache, rows, encoded, torch.arange(10)[None] < torch.tensor(texts)[:, None])
    cache.cross_k[:, [0, 2]] = 1e3
    channels, vocab = config.decoder.num_channels, config.decoder.vocab_size
    for row, n in zip(rows, positions):
        if n:
            network.step(cache, [row], torch.randint(0, vocab, (1, n, channels), generator=gen))
    codes = torch.randint(0, vocab, (2, 1, channels), generator=gen)
    with torch.no_grad():
        x_in = network.decoder.embeddings(codes)[:, 0]
    num_layers = config.decoder.num_hidden_layers
    model = _export_form(network, "nh_decoder_step", form, num_layers, batch=2, cache=layout)
    feeds = {"x_in": x_in.numpy(), "positions": np.array(positions), "slots": np.array(rows)}
    feeds["text_lengths"] = np.array(texts)
    for name, t in (("k", cache.self_k), ("v", cache.self_v), ("cross_k", cache.cross_k), ("cross_v", cache.cross_v)):
        feeds[f"{name}_cache"] = t.numpy().copy()
    out = _evaluate(model, feeds)
    _check_form(model, out, form, num_layers)
    logits = network.step(cache, rows, codes)  # (B, C, V); appends this step's keys
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["logits"].view(2, channels, vocab), logits, **close)
    torch.testing.assert_close(out["k_cache_out"], cache.self_k, **close)
    torch.testing.assert_close(out["v_cache_out"], cache.self_v, **close)
    with pytest.raises(OnnxLoweringError, match="text_len"):
        export_nh_decoder_step(network, batch=2, cache=CacheLayout(num_slots=4, cache_len=12), megakernel=False)
