"""onnxscript translations that turn `tilevox::` torch ops into TensorRT plugin nodes during ONNX export.

Each translation emits one node: op_type = plugin name, domain = plugin namespace, the op's integer arguments
as INT attributes (the creator fields), plus `plugin_version` / `plugin_namespace` STRING attributes. Weights
stay graph inputs/initializers. The tensor parameters and the return must be type-annotated: without the
annotation the dynamo exporter gets an empty tuple back (tensorrt-plugins.md §4.1).
Imports: onnxscript, torch, trt_plugins.ops, trt_plugins.registry.
"""

from __future__ import annotations

import onnxscript
import torch
from onnxscript import BFLOAT16

import tilevox.trt_plugins.ops  # noqa: F401  (registers torch.ops.tilevox.*)
from tilevox.trt_plugins.registry import PLUGIN_NAMESPACE, PLUGINS

__all__ = ["custom_translation_table"]

_op = onnxscript.values.Opset(PLUGIN_NAMESPACE, 1)
_GATEUP = PLUGINS["tilevox::swiglu_gateup"]
_MLP = PLUGINS["tilevox::swiglu_mlp"]

# The annotations name bf16 (what the plugins run); they only tell onnxscript the node has one tensor output,
# and the exporter takes the real element type from the traced graph (checked for fp32 in the tests).


@onnxscript.script(opset=_op)
def _swiglu_gateup(x: BFLOAT16, w_packed: BFLOAT16, kernel: int, block: int, tile_config: int) -> BFLOAT16:
    return _op.swiglu_gateup(
        x,
        w_packed,
        kernel=kernel,
        block=block,
        tile_config=tile_config,
        plugin_version=_GATEUP.version,
        plugin_namespace=_GATEUP.namespace,
    )


@onnxscript.script(opset=_op)
def _swiglu_mlp(
    x: BFLOAT16, w_packed: BFLOAT16, w_down: BFLOAT16, kernel: int, block: int, tile_config: int, down_tile_config: int
) -> BFLOAT16:
    return _op.swiglu_mlp(
        x,
        w_packed,
        w_down,
        kernel=kernel,
        block=block,
        tile_config=tile_config,
        down_tile_config=down_tile_config,
        plugin_version=_MLP.version,
        plugin_namespace=_MLP.namespace,
    )


def custom_translation_table() -> dict:
    """The `custom_translation_table` argument for torch.onnx.export(dynamo=True)."""
    return {
        torch.ops.tilevox.swiglu_gateup.default: _swiglu_gateup,
        torch.ops.tilevox.swiglu_mlp.default: _swiglu_mlp,
    }
