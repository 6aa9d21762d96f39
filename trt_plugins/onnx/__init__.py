"""ONNX export of tilevox ops as TensorRT plugin nodes: schemas, translations, reference-evaluator ops.

Importing this package needs `onnx` and `onnxscript` (optional dependencies: only the export path needs them).
"""

from tilevox.trt_plugins.onnx.export import (
    PluginExportError,
    check_plugin_nodes,
    export_onnx,
    parser_fields,
    plugin_nodes,
)
from tilevox.trt_plugins.onnx.megakernel_region import (
    MEGAKERNEL_REGION,
    MegakernelRegionError,
    megakernel_region_node,
    program_attributes,
    program_from_attributes,
)
from tilevox.trt_plugins.onnx.reference import REFERENCE_OPS
from tilevox.trt_plugins.onnx.schemas import register_schemas
from tilevox.trt_plugins.onnx.translations import custom_translation_table

__all__ = [
    "MEGAKERNEL_REGION",
    "REFERENCE_OPS",
    "MegakernelRegionError",
    "PluginExportError",
    "check_plugin_nodes",
    "custom_translation_table",
    "export_onnx",
    "megakernel_region_node",
    "parser_fields",
    "plugin_nodes",
    "program_attributes",
    "program_from_attributes",
    "register_schemas",
]
