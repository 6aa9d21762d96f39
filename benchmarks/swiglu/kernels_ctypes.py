"""ctypes binding of libtilevox_kernels.so for the SwiGLU benchmark scripts (no dependency on trt_plugins.ops).

The parameter structs come from trt_plugins.library; torch tensors are passed by data_ptr on the
current stream. Each call raises RuntimeError(code, tilevox_last_error()) on a non-zero status.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from tilevox.trt_plugins.library import GemmBf16Params, SwigluGateupParams

KERNEL_AUTO, KERNEL_DUAL_PINGPONG, KERNEL_PACKED_EVT = 0, 1, 2
ERR_UNSUPPORTED_SHAPE = 2


# The parameter structs are the ones trt_plugins.library keeps in step with tilevox_kernels.h.
SwigluParams = SwigluGateupParams
GemmParams = GemmBf16Params


class KernelError(RuntimeError):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"tilevox status {code}: {message}")
        self.code = code
        self.message = message


class TilevoxKernels:
    def __init__(self, path: str | os.PathLike | None = None) -> None:
        path = path or os.environ.get("TILEVOX_KERNELS_LIB") or Path("trt_plugins/build/libtilevox_kernels.so")
        self.lib = ctypes.CDLL(str(path))
        L = self.lib
        L.tilevox_swiglu_gateup_launch.argtypes = [ctypes.POINTER(SwigluParams), ctypes.c_void_p]
        L.tilevox_gemm_bf16_launch.argtypes = [ctypes.POINTER(GemmParams), ctypes.c_void_p]
        L.tilevox_last_error.restype = ctypes.c_char_p
        L.tilevox_swiglu_gateup_config_name.restype = ctypes.c_char_p
        L.tilevox_gemm_bf16_config_name.restype = ctypes.c_char_p
        L.tilevox_swiglu_gateup_select.argtypes = [
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int),
        ]
        self.packing_block = L.tilevox_swiglu_packing_block()

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise KernelError(rc, self.lib.tilevox_last_error().decode())

    def last_error(self) -> str:
        return self.lib.tilevox_last_error().decode()

    def select(self, m: int, n: int, k: int, kernel: int) -> tuple[int, int, str]:
        kid, cfg = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.tilevox_swiglu_gateup_select(m, n, k, kernel, ctypes.byref(kid), ctypes.byref(cfg)))
        return kid.value, cfg.value, self.lib.tilevox_swiglu_gateup_config_name(kid.value, cfg.value).decode()

    def swiglu_params(self, x, w_gate, w_up, w_packed, out, kernel=KERNEL_AUTO, tile_config=-1) -> SwigluParams:
        m, k = x.shape
        n = out.shape[1]
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return SwigluParams(
            ptr(x),
            ptr(w_gate),
            ptr(w_up),
            ptr(w_packed),
            ptr(out),
            m,
            n,
            k,
            x.stride(0),
            out.stride(0),
            kernel,
            tile_config,
        )

    def swiglu_launch(self, params: SwigluParams) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.tilevox_swiglu_gateup_launch(ctypes.byref(params), ctypes.c_void_p(stream)))

    def swiglu(self, x, w_gate, w_up, w_packed, out, kernel=KERNEL_AUTO, tile_config=-1) -> None:
        self.swiglu_launch(self.swiglu_params(x, w_gate, w_up, w_packed, out, kernel, tile_config))

    def gemm(self, a, b, d, tile_config=-1) -> None:
        m, k = a.shape
        n = b.shape[0]
        p = GemmParams(a.data_ptr(), b.data_ptr(), d.data_ptr(), m, n, k, a.stride(0), d.stride(0), tile_config)
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.tilevox_gemm_bf16_launch(ctypes.byref(p), ctypes.c_void_p(stream)))

    def pack(self, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
        """Kernel-2 weight layout (see tilevox_kernels.h): blocks of B gate rows then B up rows."""
        n, k = w_gate.shape
        b = self.packing_block
        return torch.stack([w_gate.view(n // b, b, k), w_up.view(n // b, b, k)], dim=1).reshape(2 * n, k).contiguous()
