"""Python side of libtilevox_lean_harness.so: drive a tilevox plugin through a TensorRT lean runtime's registry.

`run_plugin` hands torch tensors' device pointers to the C++ harness, which loads the plugin library through the
lean runtime's plugin registry, creates the plugin from kINT32 fields (as the ONNX parser does), round-trips its
serialized fields and calls enqueue; the caller compares the output with the torch op. Without CUDA, pass
`use_global_registry=True` and no output: everything but enqueue still runs. `describe_plugins` lists creators.
Imports: standard library, torch, trt_plugins.registry, trt_plugins.tensorrt.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tilevox.trt_plugins.registry import plugin_for_op

__all__ = ["LEAN_LIBRARY_ENV_VAR", "HarnessResult", "describe_plugins", "lean_library_path", "run_plugin"]

LEAN_LIBRARY_ENV_VAR = "TILEVOX_TRT_LEAN_LIB"
_MAX_DIMS = 8
_REPORT_BYTES = 1 << 16


class _HarnessCase(ctypes.Structure):
    """tilevox_harness_case in lean_harness.cpp."""

    _fields_ = [
        ("lean_lib", ctypes.c_char_p),
        ("plugin_lib", ctypes.c_char_p),
        ("plugin_name", ctypes.c_char_p),
        ("plugin_version", ctypes.c_char_p),
        ("plugin_namespace", ctypes.c_char_p),
        ("nb_fields", ctypes.c_int32),
        ("field_names", ctypes.POINTER(ctypes.c_char_p)),
        ("field_values", ctypes.POINTER(ctypes.c_int32)),
        ("nb_inputs", ctypes.c_int32),
        ("inputs", ctypes.POINTER(ctypes.c_void_p)),
        ("input_dims", ctypes.POINTER(ctypes.c_int64)),
        ("input_nb_dims", ctypes.POINTER(ctypes.c_int32)),
        ("output", ctypes.c_void_p),
        ("output_dims", ctypes.POINTER(ctypes.c_int64)),
        ("output_nb_dims", ctypes.c_int32),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("stream", ctypes.c_void_p),
        ("use_global_registry", ctypes.c_int32),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class HarnessResult:
    """status 0 = every check passed; report = one PASS/FAIL/INFO/SKIP line per step plus TensorRT's log."""

    status: int
    report: str

    @property
    def ok(self) -> bool:
        return self.status == 0


def lean_library_path() -> Path | None:
    """libnvinfer_lean.so.11: $TILEVOX_TRT_LEAN_LIB, else the installed tensorrt-lean-cu13-libs wheel; None if absent."""
    env = os.environ.get(LEAN_LIBRARY_ENV_VAR)
    if env:
        return Path(env)
    spec = importlib.util.find_spec("tensorrt_lean_libs")  # locates the package without importing (loading) it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "libnvinfer_lean.so.11"
    return path if path.is_file() else None


def _load(harness_lib: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(harness_lib))
    lib.tilevox_harness_describe.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32]
    lib.tilevox_harness_describe.restype = ctypes.c_int32
    lib.tilevox_harness_run.argtypes = [ctypes.POINTER(_HarnessCase), ctypes.c_char_p, ctypes.c_int32]
    lib.tilevox_harness_run.restype = ctypes.c_int32
    return lib


def describe_plugins(plugin_lib: Path, harness_lib: Path) -> list[dict]:
    """The creators `getCreators()` of `plugin_lib` returns: kind, name, version, namespace, [field, type] pairs."""
    buf = ctypes.create_string_buffer(_REPORT_BYTES)
    status = _load(harness_lib).tilevox_harness_describe(str(plugin_lib).encode(), buf, _REPORT_BYTES)
    if status != 0:
        raise RuntimeError(f"cannot describe {plugin_lib}: {buf.value.decode()}")
    return json.loads(buf.value.decode())


def _dims(shape: tuple[int, ...]) -> list[int]:
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"TensorRT tensors have at most {_MAX_DIMS} dims, got {shape}")
    return [*shape, *([0] * (_MAX_DIMS - len(shape)))]


def run_plugin(
    op: str,
    inputs: list[torch.Tensor],
    fields: dict[str, int],
    *,
    output: torch.Tensor | None,
    output_shape: tuple[int, ...],
    lean_lib: Path,
    plugin_lib: Path,
    harness_lib: Path,
    workspace: torch.Tensor | None = None,
    use_global_registry: bool = False,
) -> HarnessResult:
    """Run the plugin of `op` once through the harness (enqueue on the current CUDA stream when `output` is given)."""
    spec = plugin_for_op(op)
    if len(inputs) != len(spec.inputs):
        raise ValueError(f"{op} takes inputs {spec.inputs}, got {len(inputs)} tensors")
    unknown = set(fields) - set(spec.field_names)
    if unknown:
        raise ValueError(f"{op} has no fields {sorted(unknown)}; fields: {spec.field_names}")
    names = list(fields)
    stream = torch.cuda.current_stream().cuda_stream if output is not None else None
    if output is not None and tuple(output.shape) != tuple(output_shape):
        raise ValueError(f"output shape {tuple(output.shape)} != output_shape {output_shape}")
    keep = {  # ctypes arrays must outlive the call
        "names": (ctypes.c_char_p * max(1, len(names)))(*(n.encode() for n in names)),
        "values": (ctypes.c_int32 * max(1, len(names)))(*(fields[n] for n in names)),
        "ptrs": (ctypes.c_void_p * len(inputs))(*(t.data_ptr() for t in inputs)),
        "dims": (ctypes.c_int64 * (_MAX_DIMS * len(inputs)))(*(d for t in inputs for d in _dims(tuple(t.shape)))),
        "nb_dims": (ctypes.c_int32 * len(inputs))(*(t.dim() for t in inputs)),
        "out_dims": (ctypes.c_int64 * _MAX_DIMS)(*_dims(tuple(output_shape))),
    }
    case = _HarnessCase(
        lean_lib=str(lean_lib).encode(),
        plugin_lib=str(plugin_lib).encode(),
        plugin_name=spec.name.encode(),
        plugin_version=spec.version.encode(),
        plugin_namespace=spec.namespace.encode(),
        nb_fields=len(names),
        field_names=keep["names"],
        field_values=keep["values"],
        nb_inputs=len(inputs),
        inputs=keep["ptrs"],
        input_dims=keep["dims"],
        input_nb_dims=keep["nb_dims"],
        output=output.data_ptr() if output is not None else None,
        output_dims=keep["out_dims"],
        output_nb_dims=len(output_shape),
        workspace=workspace.data_ptr() if workspace is not None else None,
        workspace_bytes=workspace.numel() * workspace.element_size() if workspace is not None else 0,
        stream=stream,
        use_global_registry=int(use_global_registry),
    )
    buf = ctypes.create_string_buffer(_REPORT_BYTES)
    status = _load(harness_lib).tilevox_harness_run(ctypes.byref(case), buf, _REPORT_BYTES)
    return HarnessResult(status=status, report=buf.value.decode(errors="replace"))
