"""ONNX export of tilevox ops as TensorRT plugin nodes (runs in CI on CPU; needs onnx and onnxscript).

Checks node type/domain/attributes, that weights are initializer inputs and not attributes, onnx.checker's full
check, the parser-style field mapping, and that onnx's ReferenceEvaluator with the registered numpy ops
reproduces the torch reference on a token count other than the traced one.
"""

from __future__ import annotations

import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the ONNX export tests need `onnx` (pip install onnx onnxscript)")
pytest.importorskip("onnxscript", reason="the ONNX export tests need `onnxscript`")
ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 numpy inputs need ml_dtypes (an onnx dependency)")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from tilevox.trt_plugins.onnx import REFERENCE_OPS, PluginExportError, check_plugin_nodes, export_onnx, parser_fields  # noqa: E402
from tilevox.trt_plugins.ops import (  # noqa: E402
    GateUpLayout,
    SwigluKernel,
    SwigluMLP,
    pack_gate_up,
    swiglu_gateup,
    swiglu_gateup_ref,  # noqa: E402
    swiglu_mlp_ref,
)
from tilevox.trt_plugins.registry import PLUGINS  # noqa: E402


class _Block(torch.nn.Module):
    """A decoder-block-shaped toy: residual + fused MLP, so the plugin node sits between ordinary ops."""

    def __init__(self, w_gate, w_up, w_down, layout):
        super().__init__()
        self.mlp = SwigluMLP(w_gate, w_up, w_down, layout=layout)

    def forward(self, x):
        return x + self.mlp(x * 0.5)


class _GateUpOnly(torch.nn.Module):
    def __init__(self, w_gate, w_up, layout):
        super().__init__()
        self.layout = layout
        self.w_packed = torch.nn.Parameter(
            pack_gate_up(w_gate, w_up, kernel=layout.kernel, block=layout.block), requires_grad=False
        )

    def forward(self, x):
        return swiglu_gateup(x, self.w_packed, layout=self.layout)


def _weights(n, k, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) / s[1] ** 0.5).to(dtype) for s in ((n, k), (n, k), (h, n))]


def _to_numpy(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.fixture(scope="module")
def exported_mlp():
    w_gate, w_up, w_down = _weights(48, 40, 40, torch.bfloat16, seed=1)
    layout = GateUpLayout(kernel=SwigluKernel.PACKED_EVT, block=8)
    model = _Block(w_gate, w_up, w_down, layout)
    x = torch.randn(2, 7, 40).to(torch.bfloat16)
    proto = export_onnx(model, (x,), dynamic_shapes=({1: torch.export.Dim("T", min=1, max=8192)},))
    return proto, model, (w_gate, w_up, w_down), layout


def test_export_emits_plugin_node_with_attributes_and_weight_inputs(exported_mlp):
    proto, _, _, layout = exported_mlp
    spec = PLUGINS["tilevox::swiglu_mlp"]
    nodes = [n for n in proto.graph.node if n.domain == "tilevox"]
    assert [n.op_type for n in nodes] == ["swiglu_mlp"]
    node = nodes[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {
        "kernel": int(layout.kernel),
        "block": layout.block,
        "tile_config": -1,
        "down_tile_config": -1,
        "plugin_version": spec.version.encode(),
        "plugin_namespace": spec.namespace.encode(),
    }
    assert all(a.type != onnx.AttributeProto.TENSOR for a in node.attribute)
    initializers = {i.name: i for i in proto.graph.initializer}
    w_packed, w_down = initializers[node.input[1]], initializers[node.input[2]]
    assert tuple(w_packed.dims) == (96, 40) and tuple(w_down.dims) == (40, 48)
    assert w_packed.data_type == onnx.TensorProto.BFLOAT16
    assert ("tilevox", 1) in {(o.domain, o.version) for o in proto.opset_import}
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[1].dim_param and not dims[1].dim_value  # the token axis stayed dynamic
    onnx.checker.check_model(proto, full_check=True)


def test_parser_fields_match_creator_fields(exported_mlp):
    proto, _, _, layout = exported_mlp
    spec = PLUGINS["tilevox::swiglu_mlp"]
    node = next(n for n in proto.graph.node if n.domain == "tilevox")
    fields = parser_fields(node, spec)
    assert fields == {
        "kernel": ("kINT32", int(layout.kernel)),
        "block": ("kINT32", layout.block),
        "tile_config": ("kINT32", -1),
        "down_tile_config": ("kINT32", -1),
    }


@pytest.mark.parametrize("tokens", [1, 13])
def test_reference_evaluator_matches_torch_reference(exported_mlp, tokens):
    proto, model, (w_gate, w_up, w_down), _ = exported_mlp
    x = torch.randn(2, tokens, 40).to(torch.bfloat16)
    (out,) = ReferenceEvaluator(proto, new_ops=REFERENCE_OPS).run(None, {proto.graph.input[0].name: _to_numpy(x)})
    expected = x + swiglu_mlp_ref(x * 0.5, w_gate, w_up, w_down)
    got = torch.from_numpy(out.view("int16")).view(torch.bfloat16)
    assert got.shape == expected.shape
    # numpy and torch sum the fp32 products in different orders: allow one bf16 ulp at each rounding
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2e-3)


@pytest.mark.parametrize("kernel,block", [(1, 0), (2, 1), (2, 16)])
def test_gateup_export_fp32_evaluates_like_reference(kernel, block):
    w_gate, w_up, _ = _weights(32, 24, 24, torch.float32, seed=2)
    layout = GateUpLayout(kernel=SwigluKernel(kernel), block=block)
    model = _GateUpOnly(w_gate, w_up, layout)
    proto = export_onnx(model, (torch.randn(5, 24),), dynamic_shapes=({0: torch.export.Dim("M", min=1)},))
    node = next(n for n in proto.graph.node if n.domain == "tilevox")
    assert node.op_type == "swiglu_gateup" and len(node.input) == 2
    assert proto.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    x = torch.randn(11, 24)
    (out,) = ReferenceEvaluator(proto, new_ops=REFERENCE_OPS).run(None, {proto.graph.input[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), swiglu_gateup_ref(x, w_gate, w_up), rtol=1e-5, atol=1e-6)


def test_check_plugin_nodes_rejects_a_node_without_plugin_version(exported_mlp):
    proto = onnx.ModelProto()
    proto.CopyFrom(exported_mlp[0])
    node = next(n for n in proto.graph.node if n.domain == "tilevox")
    kept = [a for a in node.attribute if a.name != "plugin_version"]
    del node.attribute[:]
    node.attribute.extend(kept)
    with pytest.raises(PluginExportError, match="plugin_version"):
        check_plugin_nodes(proto)
