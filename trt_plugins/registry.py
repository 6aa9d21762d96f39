"""One table mapping each `tilevox::` torch op to its TensorRT plugin (name, version, namespace, fields).

The ONNX export (`trt_plugins.onnx`) reads it to name plugin nodes and their attributes, and the tests read it
to check that the C++ creators advertise the same fields. Field types are those the TensorRT ONNX parser
produces from ONNX attributes (INT -> kINT32), so a field listed here is an ONNX INT attribute.
Imports: standard library only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["PLUGIN_NAMESPACE", "PLUGINS", "FieldType", "PluginField", "PluginSpec", "plugin_for_op"]

# One namespace for every tilevox plugin: the parser dispatches on (op_type, plugin_version, plugin_namespace).
PLUGIN_NAMESPACE = "tilevox"


class FieldType(enum.Enum):
    """PluginField types used by tilevox plugins (the subset of nvinfer1::PluginFieldType we need)."""

    INT32 = "int32"


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginField:
    """One creator field: also an ONNX INT attribute of the plugin node, with its default."""

    name: str
    type: FieldType
    default: int

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name.startswith("plugin_"):
            raise ValueError(f"field name {self.name!r} must be an identifier not starting with 'plugin_'")


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginSpec:
    """A TensorRT plugin: `name` is both the creator name and the ONNX node op_type (domain = namespace)."""

    op: str  # qualified torch op name, e.g. "tilevox::swiglu_gateup"
    name: str
    version: str
    namespace: str
    inputs: tuple[str, ...]
    fields: tuple[PluginField, ...]

    def __post_init__(self) -> None:
        if not self.op.startswith(f"{self.namespace}::"):
            raise ValueError(f"op {self.op!r} must live in the plugin namespace {self.namespace!r}")
        if self.op.split("::", 1)[1] != self.name:
            raise ValueError(f"plugin name {self.name!r} must equal the op name of {self.op!r} (house naming rule)")
        if not self.version.isdigit():
            raise ValueError(f"plugin version {self.version!r} must be a decimal string")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in {names}")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


_SWIGLU_FIELDS = (
    # kernel id (1 = Kernel-1 dual Pingpong, 2 = Kernel-2 packed EVT); fixes the packed weight layout.
    PluginField(name="kernel", type=FieldType.INT32, default=1),
    # packing block of Kernel-2's interleaved layout (0 for Kernel-1's plain [gate; up] concatenation).
    PluginField(name="block", type=FieldType.INT32, default=0),
    # -1 = the kernel library's per-shape heuristic; otherwise a forced tile configuration index.
    PluginField(name="tile_config", type=FieldType.INT32, default=-1),
)

PLUGINS: dict[str, PluginSpec] = {
    spec.op: spec
    for spec in (
        PluginSpec(
            op="tilevox::swiglu_gateup",
            name="swiglu_gateup",
            version="1",
            namespace=PLUGIN_NAMESPACE,
            inputs=("x", "w_packed"),
            fields=_SWIGLU_FIELDS,
        ),
        PluginSpec(
            op="tilevox::swiglu_mlp",
            name="swiglu_mlp",
            version="1",
            namespace=PLUGIN_NAMESPACE,
            inputs=("x", "w_packed", "w_down"),
            fields=(*_SWIGLU_FIELDS, PluginField(name="down_tile_config", type=FieldType.INT32, default=-1)),
        ),
    )
}


def plugin_for_op(op: str) -> PluginSpec:
    """The plugin spec of a qualified op name such as "tilevox::swiglu_mlp"."""
    if op not in PLUGINS:
        raise ValueError(f"no TensorRT plugin is registered for op {op!r}; known: {', '.join(PLUGINS)}")
    return PLUGINS[op]
