"""Find and load libtilevox_kernels.so (the CUTLASS kernel library with a plain C ABI) through ctypes.

The library is looked up in $TILEVOX_KERNELS_LIB, else in the default build directory. ctypes structs here
mirror trt_plugins/csrc/tilevox_kernels.h field for field; the ABI version is checked at load time.
Imports: standard library only (the kernel library must not depend on torch, and neither does its loader).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

__all__ = [
    "ABI_VERSION",
    "DEFAULT_LIBRARY_PATH",
    "LIBRARY_ENV_VAR",
    "KernelLibraryError",
    "KernelLibraryNotFoundError",
    "GemmBf16Params",
    "SwigluGateupParams",
    "check_status",
    "kernels_library",
    "kernels_library_path",
]

LIBRARY_ENV_VAR = "TILEVOX_KERNELS_LIB"
# Where `python -m tilevox.trt_plugins.build` writes the library (kept in sync with trt_plugins/build.py).
DEFAULT_LIBRARY_PATH = Path(__file__).resolve().parent / "build" / "libtilevox_kernels.so"
ABI_VERSION = 1  # TILEVOX_ABI_VERSION in tilevox_kernels.h

STATUS_NAMES = {
    0: "TILEVOX_OK",
    1: "TILEVOX_ERR_INVALID_ARGUMENT",
    2: "TILEVOX_ERR_UNSUPPORTED_SHAPE",
    3: "TILEVOX_ERR_CUDA",
    4: "TILEVOX_ERR_CUTLASS",
    5: "TILEVOX_ERR_NO_DEVICE_SUPPORT",
}


class KernelLibraryError(RuntimeError):
    """A launcher of libtilevox_kernels.so returned an error status; the message carries its text."""


class KernelLibraryNotFoundError(FileNotFoundError):
    """libtilevox_kernels.so is not where $TILEVOX_KERNELS_LIB or the default build directory says."""


class SwigluGateupParams(ctypes.Structure):
    """tilevox_swiglu_gateup_params."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("w_gate", ctypes.c_void_p),
        ("w_up", ctypes.c_void_p),
        ("w_packed", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("ldx", ctypes.c_int64),
        ("ldo", ctypes.c_int64),
        ("kernel", ctypes.c_int),
        ("tile_config", ctypes.c_int),
    ]


class GemmBf16Params(ctypes.Structure):
    """tilevox_gemm_bf16_params."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("lda", ctypes.c_int64),
        ("ldd", ctypes.c_int64),
        ("tile_config", ctypes.c_int),
    ]


def kernels_library_path() -> Path:
    """The path that `kernels_library()` loads: $TILEVOX_KERNELS_LIB if set, else the default build path."""
    env = os.environ.get(LIBRARY_ENV_VAR)
    return Path(env) if env else DEFAULT_LIBRARY_PATH


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_char_p, c_void_p, c_int64 = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64
    signatures = {
        "tilevox_abi_version": ([], c_int),
        "tilevox_last_error": ([], c_char_p),
        "tilevox_swiglu_packing_block": ([], c_int),
        "tilevox_swiglu_gateup_launch": ([ctypes.POINTER(SwigluGateupParams), c_void_p], c_int),
        "tilevox_swiglu_gateup_num_configs": ([c_int], c_int),
        "tilevox_swiglu_gateup_config_name": ([c_int, c_int], c_char_p),
        "tilevox_swiglu_gateup_select": (
            [c_int64, c_int64, c_int64, c_int, ctypes.POINTER(c_int), ctypes.POINTER(c_int)],
            c_int,
        ),
        "tilevox_gemm_bf16_launch": ([ctypes.POINTER(GemmBf16Params), c_void_p], c_int),
        "tilevox_gemm_bf16_num_configs": ([], c_int),
        "tilevox_gemm_bf16_config_name": ([c_int], c_char_p),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)  # AttributeError names the missing symbol: the library is too old
        fn.argtypes = argtypes
        fn.restype = restype


@functools.cache
def _load(path: Path) -> ctypes.CDLL:
    if not path.is_file():
        raise KernelLibraryNotFoundError(
            f"tilevox kernel library not found at {path}; build it with `python -m tilevox.trt_plugins.build` "
            f"(needs nvcc) or point ${LIBRARY_ENV_VAR} at an existing libtilevox_kernels.so"
        )
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    version = lib.tilevox_abi_version()
    if version != ABI_VERSION:
        raise KernelLibraryError(f"{path} has C ABI version {version}; this tilevox expects {ABI_VERSION}: rebuild it")
    return lib


def kernels_library() -> ctypes.CDLL:
    """Load (once per path) and return libtilevox_kernels.so with typed function signatures."""
    return _load(kernels_library_path().resolve())


def check_status(lib: ctypes.CDLL, status: int, what: str) -> None:
    """Raise KernelLibraryError with the library's message if `status` is not TILEVOX_OK."""
    if status != 0:
        message = lib.tilevox_last_error().decode(errors="replace")
        raise KernelLibraryError(f"{what} failed with {STATUS_NAMES.get(status, status)}: {message}")
