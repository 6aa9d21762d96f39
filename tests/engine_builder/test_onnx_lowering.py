"""TensorRT lowering of a plan (engine_builder.onnx_lowering) on CPU: the exported Llama decoder step passes the
ONNX checker, and onnx's reference evaluator (the plugin ops' reference implementations: swiglu_mlp in numpy,
MegakernelRegion on the PyTorch VM) reproduces the conventional PyTorch step, logits and KV cache, in fp32; the
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

from tilevox.engine_builder.composition import Backend, Piece  # noqa: E402
from tilevox.engine_builder.onnx_lowering import (  # noqa: E402
    CacheLayout,
    OnnxLoweringError,
    export_decoder_step,
    export_plan,
)
from tilevox.engine_builder.regions import compile_region  # noqa: E402
from tilevox.engine_builder.regions.spec import region_spec  # noqa: E402
from tilevox.server.cli import main  # noqa: E402
from tilevox.trt_plugins.megakernel.packing import pack_program  # noqa: E402
from tilevox.trt_plugins.onnx import MEGAKERNEL_REGION, REFERENCE_OPS, program_from_attributes  # noqa: E402

CACHE = CacheLayout(num_slots=4, cache_len=16)


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.fixture()
def primed(tiny_llama):
    """A cache whose slots 3 and 1 hold 5 and 2 prompt tokens (rows at different positions)."""
    cache = tiny_llama.new_cache(max_streams=CACHE.num_slots, max_seq_len=CACHE.cache_len)
    for _ in range(CACHE.num_slots):
        cache.allocate()
    for slot, n in ((3, 5), (1, 2)):
        tiny_llama.prefill(cache, slot, torch.arange(1, n + 1))
    return cache


@pytest.mark.parametrize("megakernel", [False, True], ids=["conventional", "megakernel"])
def test_exported_step_reproduces_the_pytorch_step(tiny_llama, primed, megakernel):
    slots, tokens = [3, 1], torch.tensor([7, 11])
    feeds = {
        "tokens": tokens.numpy(),
        "positions": np.array([primed.lengths[s] for s in slots]),
        "slots": np.array(slots),
        "k_cache": primed.k.numpy().copy(),
        "v_cache": primed.v.numpy().copy(),
    }
    model = export_decoder_step(tiny_llama, batch=2, cache=CACHE, megakernel=megakernel)
    onnx.checker.check_model(model, full_check=True)
    kinds = [(n.domain, n.op_type) for n in model.graph.node]
    if megakernel:
        assert kinds == [("tilevox", MEGAKERNEL_REGION)]
    else:
        assert kinds.count(("tilevox", "swiglu_mlp")) == tiny_llama.config.num_hidden_layers
        assert ("tilevox", MEGAKERNEL_REGION) not in kinds
    out = dict(
        zip([o.name for o in model.graph.output], ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None, feeds))
    )
    expected = tiny_llama.decode(primed, slots, tokens)  # writes this step's keys into primed
    torch.testing.assert_close(torch.from_numpy(out["logits"]), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(out["k_cache_out"]), primed.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(out["v_cache_out"]), primed.v, rtol=1e-5, atol=1e-5)
    if megakernel:
        assert not out["decoder_step.error"].any()


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
    def plan(piece):
        return SimpleNamespace(buckets=[SimpleNamespace(batch=1, composition=SimpleNamespace(pieces=[piece]))])

    model = SimpleNamespace(max_streams=2, max_seq_len=8)
    talker = Piece(region="talker_step", first_layer=0, stop_layer=2, head=True, backend=Backend.GRAPH)
    with pytest.raises(OnnxLoweringError, match="talker_step has no ONNX lowering yet"):
        export_plan(model, plan(talker), "unused")
    cut = Piece(region="decoder_step", first_layer=0, stop_layer=1, head=False, backend=Backend.MEGAKERNEL)
    with pytest.raises(OnnxLoweringError, match="cuts region decoder_step"):
        export_plan(model, plan(cut), "unused")
    with pytest.raises(OnnxLoweringError, match="batch 5"):
        export_decoder_step(tiny_llama, batch=5, cache=CACHE, megakernel=False)


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
