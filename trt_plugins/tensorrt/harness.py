"""Python side of libtilevox_lean_harness.so: drive a tilevox plugin through a TensorRT lean runtime's registry.

`run_plugin` hands torch tensors' device pointers to the C++ harness, which loads the plugin library through the
lean runtime's plugin registry, creates the plugin from kINT32 fields (as the ONNX parser does), round-trips its
serialized fields and calls enqueue; the caller compares the output with the torch op. Without CUDA, pass
`use_global_registry=True` and no output: everything but enqueue still runs. `describe_plugins` lists creators.
`run_plugin_fields` is the general form (the MegakernelRegion plugin needs it): fields of any type and length
(`HarnessField`; `parser_fields` builds them from an ONNX node as the TensorRT ONNX parser does), several inputs
and outputs of mixed dtypes, the workspace the plugin asks for, and several enqueues on one attached plugin.
Imports: standard library, torch, trt_plugins.registry, trt_plugins.tensorrt.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tilevox.trt_plugins.registry import plugin_for_op

if TYPE_CHECKING:
    import onnx

__all__ = [
    "LEAN_LIBRARY_ENV_VAR",
    "TRT_DATA_TYPES",
    "HarnessField",
    "HarnessResult",
    "describe_plugins",
    "lean_library_path",
    "parser_fields",
    "run_plugin",
    "run_plugin_fields",
]

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


class _Field(ctypes.Structure):
    """tilevox_harness_field in lean_harness.cpp."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("type", ctypes.c_char_p),
        ("data", ctypes.c_void_p),
        ("length", ctypes.c_int32),
    ]


class _Tensor(ctypes.Structure):
    """tilevox_harness_tensor in lean_harness.cpp."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("type", ctypes.c_char_p),
        ("nb_dims", ctypes.c_int32),
        ("dims", ctypes.c_int64 * _MAX_DIMS),
    ]


class _PluginCase(ctypes.Structure):
    """tilevox_harness_plugin_case in lean_harness.cpp."""

    _fields_ = [
        ("lean_lib", ctypes.c_char_p),
        ("plugin_lib", ctypes.c_char_p),
        ("plugin_name", ctypes.c_char_p),
        ("plugin_version", ctypes.c_char_p),
        ("plugin_namespace", ctypes.c_char_p),
        ("nb_fields", ctypes.c_int32),
        ("fields", ctypes.POINTER(_Field)),
        ("nb_inputs", ctypes.c_int32),
        ("inputs", ctypes.POINTER(_Tensor)),
        ("nb_outputs", ctypes.c_int32),
        ("outputs", ctypes.POINTER(_Tensor)),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("stream", ctypes.c_void_p),
        ("use_global_registry", ctypes.c_int32),
        ("enqueue_count", ctypes.c_int32),
        ("reject_position", ctypes.c_int32),
    ]


# TensorRT DataType enumerator names of the torch dtypes (the harness maps names to the header's values).
TRT_DATA_TYPES: dict[torch.dtype, str] = {
    torch.float32: "kFLOAT",
    torch.float16: "kHALF",
    torch.bfloat16: "kBF16",
    torch.int8: "kINT8",
    torch.uint8: "kUINT8",
    torch.bool: "kBOOL",
    torch.int32: "kINT32",
    torch.int64: "kINT64",
}
# PluginFieldType enumerator names the harness copies, with the element type of their host array.
_FIELD_CTYPES = {
    "kINT8": ctypes.c_int8,
    "kINT16": ctypes.c_int16,
    "kINT32": ctypes.c_int32,
    "kINT64": ctypes.c_int64,
    "kFLOAT32": ctypes.c_float,
    "kFLOAT64": ctypes.c_double,
}
_INT_RANGES = {"kINT8": 8, "kINT16": 16, "kINT32": 32, "kINT64": 64}


@dataclass(frozen=True, slots=True)
class HarnessField:
    """One plugin field as a PluginField: `type` names a PluginFieldType (kINT32, kINT64, kFLOAT32, ...)."""

    name: str
    type: str
    values: tuple[int | float, ...]

    def __post_init__(self) -> None:
        if self.type not in _FIELD_CTYPES:
            raise ValueError(f"field {self.name!r}: type {self.type!r} is not one of {sorted(_FIELD_CTYPES)}")
        bits = _INT_RANGES.get(self.type)
        if bits is not None:
            if any(not isinstance(v, int) or isinstance(v, bool) for v in self.values):
                raise ValueError(f"field {self.name!r} ({self.type}) holds non-integers")
            if any(not -(2 ** (bits - 1)) <= v < 2 ** (bits - 1) for v in self.values):
                raise ValueError(f"field {self.name!r} holds values outside {self.type}")

    def as_array(self) -> ctypes.Array:
        ctype = _FIELD_CTYPES[self.type]
        return (ctype * max(1, len(self.values)))(*self.values)


@dataclass(frozen=True, slots=True, kw_only=True)
class HarnessResult:
    """status 0 = every check passed; report = one PASS/FAIL/INFO/SKIP line per step plus TensorRT's log."""

    status: int
    report: str
    workspace_bytes: int = -1  # run_plugin_fields: the plugin's getWorkspaceSize (-1: not reached)

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
    lib.tilevox_harness_run_plugin.argtypes = [
        ctypes.POINTER(_PluginCase),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_char_p,
        ctypes.c_int32,
    ]
    lib.tilevox_harness_run_plugin.restype = ctypes.c_int32
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


# ONNX AttributeProto.AttributeType values (onnx.proto; fixed by the format, so no onnx import is needed)
_ONNX_FLOAT, _ONNX_INT, _ONNX_FLOATS, _ONNX_INTS = 1, 2, 6, 7


def parser_fields(
    node: onnx.NodeProto, declared: Mapping[str, str], *, int_type: str | None = None
) -> list[HarnessField]:
    """The PluginFields the TensorRT ONNX parser hands the creator for `node`: one per attribute the creator
    declares (`declared`: name -> PluginFieldType name, as `describe_plugins` reports getFieldNames), in the
    node's attribute order; INT / INTS become integer fields and FLOAT / FLOATS kFLOAT32 fields of the declared
    type. Attributes the creator does not declare (plugin_version, plugin_namespace, ...) are not passed.
    int_type: pass integer fields as this type instead (e.g. "kINT64", as an API caller may)."""
    fields = []
    for attr in node.attribute:
        if attr.name not in declared:
            continue
        kind = declared[attr.name]
        if attr.type in (_ONNX_INT, _ONNX_INTS):
            values = (attr.i,) if attr.type == _ONNX_INT else tuple(attr.ints)
            if kind not in _INT_RANGES:
                raise ValueError(f"{node.name}: attribute {attr.name!r} is an integer, the creator declares {kind}")
            fields.append(HarnessField(attr.name, int_type or kind, values))
        elif attr.type in (_ONNX_FLOAT, _ONNX_FLOATS):
            values = (attr.f,) if attr.type == _ONNX_FLOAT else tuple(attr.floats)
            if kind not in ("kFLOAT32", "kFLOAT64"):
                raise ValueError(f"{node.name}: attribute {attr.name!r} is a float, the creator declares {kind}")
            fields.append(HarnessField(attr.name, kind, values))
        else:
            raise ValueError(
                f"{node.name}: attribute {attr.name!r} (ONNX type {attr.type}) has no field conversion here"
            )
    return fields


def _tensor(t: torch.Tensor, *, bind: bool) -> _Tensor:
    if t.dtype not in TRT_DATA_TYPES:
        raise ValueError(f"dtype {t.dtype} has no TensorRT DataType here ({sorted(map(str, TRT_DATA_TYPES))})")
    if bind and (t.device.type != "cuda" or not t.is_contiguous()):
        raise ValueError(
            f"an enqueued tensor must be contiguous on CUDA, got {t.device} contiguous={t.is_contiguous()}"
        )
    return _Tensor(
        data=t.data_ptr() if bind else None,
        type=TRT_DATA_TYPES[t.dtype].encode(),
        nb_dims=t.dim(),
        dims=(ctypes.c_int64 * _MAX_DIMS)(*_dims(tuple(t.shape))),
    )


def _run_fields_once(
    lib: ctypes.CDLL,
    plugin: tuple[str, str, str],
    fields: Sequence[HarnessField],
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    lean_lib: Path,
    plugin_lib: Path,
    workspace: torch.Tensor | None,
    enqueue_count: int,
    use_global_registry: bool,
    reject_position: int,
) -> HarnessResult:
    bind = enqueue_count > 0
    arrays = [f.as_array() for f in fields]  # ctypes arrays must outlive the call
    keep = {
        "fields": (_Field * max(1, len(fields)))(
            *(
                _Field(name=f.name.encode(), type=f.type.encode(), data=ctypes.addressof(a), length=len(f.values))
                for f, a in zip(fields, arrays)
            )
        ),
        "inputs": (_Tensor * max(1, len(inputs)))(*(_tensor(t, bind=bind) for t in inputs)),
        "outputs": (_Tensor * max(1, len(outputs)))(*(_tensor(t, bind=bind) for t in outputs)),
    }
    name, version, namespace = plugin
    case = _PluginCase(
        lean_lib=str(lean_lib).encode(),
        plugin_lib=str(plugin_lib).encode(),
        plugin_name=name.encode(),
        plugin_version=version.encode(),
        plugin_namespace=namespace.encode(),
        nb_fields=len(fields),
        fields=keep["fields"],
        nb_inputs=len(inputs),
        inputs=keep["inputs"],
        nb_outputs=len(outputs),
        outputs=keep["outputs"],
        workspace=workspace.data_ptr() if workspace is not None and bind else None,
        workspace_bytes=workspace.numel() * workspace.element_size() if workspace is not None else 0,
        stream=torch.cuda.current_stream().cuda_stream if bind else None,
        use_global_registry=int(use_global_registry),
        enqueue_count=enqueue_count,
        reject_position=reject_position,
    )
    needed = ctypes.c_int64(-1)
    buf = ctypes.create_string_buffer(_REPORT_BYTES)
    status = lib.tilevox_harness_run_plugin(ctypes.byref(case), ctypes.byref(needed), buf, _REPORT_BYTES)
    return HarnessResult(status=status, report=buf.value.decode(errors="replace"), workspace_bytes=needed.value)


def run_plugin_fields(
    plugin: tuple[str, str, str],
    fields: Sequence[HarnessField],
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    lean_lib: Path,
    plugin_lib: Path,
    harness_lib: Path,
    enqueue_count: int = 1,
    use_global_registry: bool = False,
    reject_position: int = -1,
) -> HarnessResult:
    """Create `plugin` (name, version, namespace) from `fields` through the lean runtime's registry and run it.

    inputs / outputs give the tensors' dtypes and shapes (the plugin's I/O in order); with enqueue_count > 0
    they are CUDA tensors the plugin reads and writes, `enqueue_count` enqueues on the current stream of one
    attached runtime plugin, synchronized before the harness returns. The workspace is what the plugin's
    getWorkspaceSize asks for: a first run without enqueue reads it, then a CUDA buffer of that size is
    passed. enqueue_count 0: every step but enqueue (no CUDA with use_global_registry=True).
    reject_position >= 0: supportsFormatCombination must refuse that position with its type changed."""
    if enqueue_count < 0:
        raise ValueError(f"enqueue_count must be >= 0, got {enqueue_count}")
    lib = _load(harness_lib)
    common = dict(
        lean_lib=lean_lib,
        plugin_lib=plugin_lib,
        use_global_registry=use_global_registry,
        reject_position=reject_position,
    )
    dry = _run_fields_once(lib, plugin, fields, inputs, outputs, workspace=None, enqueue_count=0, **common)
    if enqueue_count == 0 or not dry.ok:
        return dry
    if dry.workspace_bytes < 0:
        raise RuntimeError(f"the harness did not report the workspace size:\n{dry.report}")
    workspace = torch.empty(max(1, dry.workspace_bytes), dtype=torch.uint8, device="cuda")
    return _run_fields_once(
        lib, plugin, fields, inputs, outputs, workspace=workspace, enqueue_count=enqueue_count, **common
    )
