"""ONNX OpSchemas for tilevox plugin nodes, so that onnx.checker (full check) and onnxscript accept them.

One schema per plugin in `trt_plugins.registry`: domain = plugin namespace, op_type = plugin name, inputs as
listed there (weights are inputs, never attributes), INT attributes for the creator fields, and the STRING
attributes `plugin_version` / `plugin_namespace` that the TensorRT ONNX parser dispatches on.
Imports: onnx, trt_plugins.registry.
"""

from __future__ import annotations

import onnx
from onnx.defs import OpSchema

from tilevox.trt_plugins.registry import PLUGINS, PluginSpec

__all__ = ["TENSOR_TYPES", "register_schemas", "schema_for"]

# The torch ops accept these on CPU; the TensorRT plugins and CUDA kernels take bf16 only.
TENSOR_TYPES = ("tensor(bfloat16)", "tensor(float16)", "tensor(float)")

_DOCS = {
    "swiglu_gateup": "h = silu(x @ Wg^T) * (x @ Wu^T); w_packed is (2N, K) in the layout named by kernel/block.",
    "swiglu_mlp": "y = (silu(x @ Wg^T) * (x @ Wu^T)) @ w_down^T; w_packed (2N, K), w_down (H, N).",
}


def schema_for(spec: PluginSpec) -> OpSchema:
    """The OpSchema of one plugin node (since_version 1 of the plugin's domain)."""
    inputs = [OpSchema.FormalParameter(name, "T") for name in spec.inputs]
    attributes = [
        OpSchema.Attribute(f.name, OpSchema.AttrType.INT, f"creator field {f.name}", required=False)
        for f in spec.fields
    ]
    attributes += [
        OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version", required=False),
        OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace", required=False),
    ]
    return OpSchema(
        spec.name,
        spec.namespace,
        1,
        _DOCS.get(spec.name, spec.op),
        inputs=inputs,
        outputs=[OpSchema.FormalParameter("y", "T")],
        type_constraints=[("T", list(TENSOR_TYPES), "floating-point activations and weights")],
        attributes=attributes,
    )


def register_schemas() -> None:
    """Register every plugin schema with onnx once (idempotent; onnx rejects a second registration), and the
    MegakernelRegion node's (trt_plugins.onnx.megakernel_region)."""
    from tilevox.trt_plugins.onnx.megakernel_region import register_megakernel_region_schema

    register_megakernel_region_schema()
    for spec in PLUGINS.values():
        if not onnx.defs.has(spec.name, 1, spec.namespace):
            onnx.defs.register_schema(schema_for(spec))
