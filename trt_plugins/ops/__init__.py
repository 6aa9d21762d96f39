"""tilevox torch.library ops (`torch.ops.tilevox.*`) and their pure-PyTorch references.

Importing this package registers the ops. Imports: torch and trt_plugins.library only.
"""

from tilevox.trt_plugins.ops.swiglu import (
    GateUpLayout,
    SwigluKernel,
    SwigluMLP,
    TileRule,
    TileTable,
    gate_up_from_packed,
    gemm_ref,
    layout_for_device,
    pack_gate_up,
    swiglu_gateup,
    swiglu_gateup_ref,
    swiglu_mlp,
    swiglu_mlp_ref,
    unpack_gate_up,
)

__all__ = [
    "GateUpLayout",
    "SwigluKernel",
    "SwigluMLP",
    "TileRule",
    "TileTable",
    "gate_up_from_packed",
    "gemm_ref",
    "layout_for_device",
    "pack_gate_up",
    "swiglu_gateup",
    "swiglu_gateup_ref",
    "swiglu_mlp",
    "swiglu_mlp_ref",
    "unpack_gate_up",
]
