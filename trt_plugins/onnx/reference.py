"""numpy implementations of the tilevox plugin nodes for onnx.reference.ReferenceEvaluator.

Written independently of the torch references (numpy fp32 GEMMs, fp32 activation, one rounding to the input
dtype per GEMM stage, as the kernels do), so that evaluating an exported graph checks the export end to end.
Pass `REFERENCE_OPS` as `new_ops=` to the evaluator (it also holds `MegakernelRegion`, which runs a compiled
megakernel program on the PyTorch VM). Imports: numpy, onnx, trt_plugins.registry, trt_plugins.onnx.megakernel_region.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from tilevox.trt_plugins.onnx.megakernel_region import MegakernelRegion
from tilevox.trt_plugins.registry import PLUGIN_NAMESPACE

__all__ = ["REFERENCE_OPS", "swiglu_gateup_np", "swiglu_mlp_np"]


def _split_packed(y: np.ndarray, kernel: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) from y = x @ w_packed^T with last dim 2N, for kernel 1 ([Wg; Wu]) or 2 (B-blocks)."""
    n = y.shape[-1] // 2
    if kernel == 1:
        return y[..., :n], y[..., n:]
    if kernel == 2:
        pairs = y.reshape(*y.shape[:-1], n // block, 2, block)  # (..., N/B, {gate, up}, B)
        return pairs[..., 0, :].reshape(*y.shape[:-1], n), pairs[..., 1, :].reshape(*y.shape[:-1], n)
    raise ValueError(f"unknown kernel id {kernel}")


def swiglu_gateup_np(x: np.ndarray, w_packed: np.ndarray, kernel: int, block: int) -> np.ndarray:
    y = x.astype(np.float32) @ w_packed.astype(np.float32).T  # (..., 2N)
    gate, up = _split_packed(y, kernel, block)
    # silu(g) = g * sigmoid(g); written with exp(-|g|) so that no intermediate overflows
    e = np.exp(-np.abs(gate))
    sigmoid = np.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32)
    return (gate * sigmoid * up).astype(x.dtype)


def swiglu_mlp_np(x: np.ndarray, w_packed: np.ndarray, w_down: np.ndarray, kernel: int, block: int) -> np.ndarray:
    h = swiglu_gateup_np(x, w_packed, kernel, block)
    return (h.astype(np.float32) @ w_down.astype(np.float32).T).astype(x.dtype)


class swiglu_gateup(OpRun):  # noqa: N801  (the class name is the ONNX op_type)
    op_domain = PLUGIN_NAMESPACE

    def _run(self, x, w_packed, kernel=1, block=0, tile_config=-1, plugin_version=None, plugin_namespace=None):
        return (swiglu_gateup_np(x, w_packed, kernel, block),)


class swiglu_mlp(OpRun):  # noqa: N801
    op_domain = PLUGIN_NAMESPACE

    def _run(
        self,
        x,
        w_packed,
        w_down,
        kernel=1,
        block=0,
        tile_config=-1,
        down_tile_config=-1,
        plugin_version=None,
        plugin_namespace=None,
    ):
        return (swiglu_mlp_np(x, w_packed, w_down, kernel, block),)


REFERENCE_OPS = [swiglu_gateup, swiglu_mlp, MegakernelRegion]
