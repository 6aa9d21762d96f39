"""Export a torch module that calls `tilevox::` ops to ONNX with TensorRT plugin nodes, and check the result.

`export_onnx` runs torch.onnx.export(dynamo=True) with the plugin translations, strips onnxscript's private
`_`-prefixed attributes from plugin nodes, asserts that every plugin node carries the registry's version,
namespace and fields, and runs onnx.checker with full_check. `parser_fields` mirrors how the TensorRT ONNX parser
turns a node's attributes into PluginFields (INT -> kINT32, only the creator's listed fields).
Imports: onnx, torch, trt_plugins.onnx.*, trt_plugins.registry.
"""

from __future__ import annotations

import onnx
import torch

from tilevox.trt_plugins.onnx.megakernel_region import (
    MEGAKERNEL_REGION,
    MEGAKERNEL_REGION_VERSION,
    MegakernelRegionError,
    node_io_buffers,
    program_from_attributes,
)
from tilevox.trt_plugins.onnx.schemas import register_schemas
from tilevox.trt_plugins.onnx.translations import custom_translation_table
from tilevox.trt_plugins.registry import PLUGIN_NAMESPACE, PLUGINS, PluginSpec

__all__ = ["PluginExportError", "check_plugin_nodes", "export_onnx", "parser_fields", "plugin_nodes"]

_BY_NAME = {spec.name: spec for spec in PLUGINS.values()}


class PluginExportError(ValueError):
    """An exported plugin node does not match its registry entry (missing attribute, wrong version, ...)."""


def plugin_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The tilevox plugin nodes of the main graph, in graph order."""
    return [n for n in model.graph.node if n.domain == PLUGIN_NAMESPACE]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def check_plugin_nodes(model: onnx.ModelProto) -> None:
    """Raise PluginExportError unless every tilevox-domain node names a registered plugin with all its attributes
    (a MegakernelRegion node: its version, namespace, and attributes that decode to a program)."""
    for node in plugin_nodes(model):
        if node.op_type == MEGAKERNEL_REGION:
            _check_megakernel_region(node)
            continue
        spec = _BY_NAME.get(node.op_type)
        if spec is None:
            raise PluginExportError(f"node {node.name!r}: {node.domain}::{node.op_type} is not a registered plugin")
        attrs = _attrs(node)
        expected = {"plugin_version": spec.version.encode(), "plugin_namespace": spec.namespace.encode()}
        for name, value in expected.items():
            if attrs.get(name) != value:
                raise PluginExportError(f"node {node.name!r}: {name} is {attrs.get(name)!r}, expected {value!r}")
        for field in spec.fields:
            if not isinstance(attrs.get(field.name), int):
                raise PluginExportError(f"node {node.name!r}: missing INT attribute {field.name!r}")
        if len(node.input) != len(spec.inputs) or len(node.output) != 1:
            raise PluginExportError(
                f"node {node.name!r}: expected inputs {spec.inputs} and one output, got {list(node.input)} -> "
                f"{list(node.output)}"
            )


def _check_megakernel_region(node: onnx.NodeProto) -> None:
    attrs = _attrs(node)
    expected = {"plugin_version": MEGAKERNEL_REGION_VERSION.encode(), "plugin_namespace": PLUGIN_NAMESPACE.encode()}
    for name, value in expected.items():
        if attrs.get(name) != value:
            raise PluginExportError(f"node {node.name!r}: {name} is {attrs.get(name)!r}, expected {value!r}")
    try:
        program = program_from_attributes(attrs)
    except (MegakernelRegionError, ValueError, KeyError) as exc:
        raise PluginExportError(f"node {node.name!r}: attributes do not describe a program: {exc}") from exc
    inputs, outputs = node_io_buffers(program)
    if len(node.input) != len(inputs) or len(node.output) != len(outputs) + 1:
        raise PluginExportError(
            f"node {node.name!r}: the program takes {len(inputs)} inputs and returns {len(outputs)} outputs + error, "
            f"the node has {len(node.input)} and {len(node.output)}"
        )


def parser_fields(node: onnx.NodeProto, spec: PluginSpec) -> dict[str, tuple[str, int]]:
    """PluginFields the TensorRT ONNX parser would build: creator fields only, INT narrowed to kINT32."""
    attrs = _attrs(node)
    fields = {}
    for field in spec.fields:
        if field.name in attrs:  # the parser only warns on a missing field; the creator then uses its default
            value = attrs[field.name]
            if not -(2**31) <= value < 2**31:
                raise PluginExportError(f"node {node.name!r}: {field.name}={value} does not fit kINT32")
            fields[field.name] = ("kINT32", value)
    return fields


def export_onnx(model: torch.nn.Module, args: tuple, *, dynamic_shapes=None) -> onnx.ModelProto:
    """Export `model(*args)` to an ONNX ModelProto with tilevox plugin nodes, post-processed and fully checked."""
    register_schemas()
    program = torch.onnx.export(
        model.eval(),
        args,
        dynamo=True,
        custom_translation_table=custom_translation_table(),
        dynamic_shapes=dynamic_shapes,
        verbose=False,
    )
    proto = program.model_proto
    for node in plugin_nodes(proto):
        # onnxscript may add private attributes such as `_outputs`; TensorRT and the schema know none of them
        keep = [a for a in node.attribute if not a.name.startswith("_")]
        del node.attribute[:]
        node.attribute.extend(keep)
    check_plugin_nodes(proto)
    onnx.checker.check_model(proto, full_check=True)
    return proto
