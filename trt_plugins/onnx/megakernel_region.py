"""`tilevox::MegakernelRegion`: a compiled megakernel Program as one ONNX plugin node, and its reference op.

The node carries the packed program (`packing.pack_program`: the words the CUDA interpreter reads) as
attributes, which the TensorRT ONNX parser turns into the creator's PluginFields of the IPluginV3
`MegakernelRegion` (trt_plugins/tensorrt/megakernel_region_plugin.cpp):

- INTS (parser: kINT32 arrays): `instructions` (num_queues x max_queue_len x INSTRUCTION_WORDS, flattened),
  `queue_lengths` (num_queues), `buffer_table` (num_buffers x (3 + MAX_DIMS), flattened, int64 narrowed to
  int32), `input_buffers` / `output_buffers` (the buffer ids bound to the node's inputs / outputs, in order);
- INT (kINT32) / FLOAT (kFLOAT32): the non-pointer fields of the kernel's launch parameters, named and typed by
  `instructions.LAUNCH_PARAMS` (num_queues, max_queue_len, num_buffers, num_counters and the RegionConstants),
  except `watchdog_ns` and `flags`; plus `watchdog_ms` (INT);
- STRINGS `buffer_names` (not a creator field; the parser ignores it): the names the reference op binds by.

Inputs: the WEIGHT, INPUT and STATE buffers in buffer-id order. Outputs: the STATE buffers (updated; ONNX is
functional, the plugin copies each state input to its output and runs in place there), then the OUTPUT buffers,
in buffer-id order, then `error` (int32, ERROR_WORDS: the kernel's error words, all zero after a clean run).
SCRATCH buffers and counters live in the plugin's workspace. The reference op runs the program through
`trt_plugins.megakernel.vm.run_program` (the oracle the CUDA kernel equals). Imports: numpy, onnx, torch,
trt_plugins.megakernel, trt_plugins.registry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx.defs import OpSchema
from onnx.reference.op_run import OpRun

from tilevox.trt_plugins.megakernel.instructions import (
    ERROR_WORDS,
    INSTRUCTION_WORDS,
    LAUNCH_PARAMS,
    BufferKind,
    BufferSpec,
    DType,
    Instruction,
    Program,
    RegionConstants,
)
from tilevox.trt_plugins.megakernel.packing import MAX_DIMS, pack_program
from tilevox.trt_plugins.megakernel.vm import TORCH_DTYPES, run_program
from tilevox.trt_plugins.registry import PLUGIN_NAMESPACE

__all__ = [
    "ARRAY_FIELDS",
    "ERROR_OUTPUT",
    "MEGAKERNEL_REGION",
    "MEGAKERNEL_REGION_VERSION",
    "SCALAR_FIELDS",
    "MegakernelRegion",
    "MegakernelRegionError",
    "megakernel_region_node",
    "node_io_buffers",
    "program_attributes",
    "program_from_attributes",
    "register_megakernel_region_schema",
]

MEGAKERNEL_REGION = "MegakernelRegion"  # creator name and ONNX op_type (domain: the plugin namespace)
MEGAKERNEL_REGION_VERSION = "1"
ERROR_OUTPUT = "error"
ARRAY_FIELDS = ("instructions", "queue_lengths", "buffer_table", "input_buffers", "output_buffers")
_NOT_FIELDS = ("watchdog_ns", "flags")  # per launch, not per program: the plugin sets them
# (name, "int" | "float") of every by-value launch parameter the node carries, in LAUNCH_PARAMS order.
SCALAR_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (name, "float" if c_type == "float" else "int")
    for name, c_type, _ in LAUNCH_PARAMS
    if not c_type.endswith("*") and name not in _NOT_FIELDS
) + (("watchdog_ms", "int"),)
_CONSTANT_NAMES = tuple(RegionConstants.__dataclass_fields__)
_TABLE_WIDTH = 3 + MAX_DIMS
_INPUT_KINDS = (BufferKind.WEIGHT, BufferKind.INPUT, BufferKind.STATE)
_OUTPUT_KINDS = (BufferKind.STATE, BufferKind.OUTPUT)
_ONNX_DTYPES = {
    DType.FLOAT32: onnx.TensorProto.FLOAT,
    DType.BFLOAT16: onnx.TensorProto.BFLOAT16,
    DType.FLOAT16: onnx.TensorProto.FLOAT16,
    DType.INT64: onnx.TensorProto.INT64,
    DType.INT32: onnx.TensorProto.INT32,
}


class MegakernelRegionError(ValueError):
    """A MegakernelRegion node whose attributes do not describe a valid program, or inputs that do not fit it."""


def onnx_dtype(dtype: DType) -> int:
    return _ONNX_DTYPES[dtype]


def node_io_buffers(program: Program) -> tuple[list[BufferSpec], list[BufferSpec]]:
    """(buffers bound to the node's inputs, buffers its outputs return before `error`), in buffer-id order."""
    inputs = [b for b in program.buffers if b.kind in _INPUT_KINDS]
    outputs = [b for b in program.buffers if b.kind is BufferKind.STATE] + [
        b for b in program.buffers if b.kind is BufferKind.OUTPUT
    ]
    return inputs, outputs


def _int32_list(name: str, values: torch.Tensor) -> list[int]:
    flat = values.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < -(2**31) or int(flat.max()) >= 2**31):
        raise MegakernelRegionError(f"{name} holds values outside int32 (the parser narrows INTS to kINT32)")
    return flat.tolist()


def program_attributes(program: Program, *, watchdog_ms: int = 2000) -> dict:
    """The node's attributes for `program` (everything but plugin_version / plugin_namespace)."""
    if watchdog_ms < 1:
        raise MegakernelRegionError(f"watchdog_ms must be >= 1, got {watchdog_ms}")
    packed = pack_program(program)
    inputs, outputs = node_io_buffers(program)
    scalars = {
        "num_queues": len(program.queues),
        "max_queue_len": int(packed["instructions"].shape[1]),
        "num_buffers": len(program.buffers),
        "num_counters": program.num_counters,
        **{name: getattr(program.constants, name) for name in _CONSTANT_NAMES},
        "watchdog_ms": watchdog_ms,
    }
    missing = {name for name, _ in SCALAR_FIELDS} ^ set(scalars)
    if missing:  # LAUNCH_PARAMS gained or lost a field this module does not fill
        raise MegakernelRegionError(f"launch parameters and node attributes disagree on {sorted(missing)}")
    return {
        "instructions": _int32_list("instructions", packed["instructions"]),
        "queue_lengths": _int32_list("queue_lengths", packed["queue_lengths"]),
        "buffer_table": _int32_list("buffer_table", packed["buffer_table"]),
        "input_buffers": [b.buffer_id for b in inputs],
        "output_buffers": [b.buffer_id for b in outputs],
        **{name: (float(scalars[name]) if kind == "float" else int(scalars[name])) for name, kind in SCALAR_FIELDS},
        "buffer_names": [b.name for b in program.buffers],
    }


def _get(attrs: Mapping, name: str):
    if name not in attrs:
        raise MegakernelRegionError(f"MegakernelRegion node lacks attribute {name!r}")
    value = attrs[name]
    return value.tolist() if isinstance(value, np.ndarray) else value


def program_from_attributes(attrs: Mapping) -> Program:
    """The Program the attributes describe (queues are consecutive instruction indices in queue order; cost
    annotations and metadata are not carried). `pack_program` of it equals the packed words the node holds."""
    num_queues, max_len = int(_get(attrs, "num_queues")), int(_get(attrs, "max_queue_len"))
    num_buffers = int(_get(attrs, "num_buffers"))
    words = list(_get(attrs, "instructions"))
    lengths = [int(v) for v in _get(attrs, "queue_lengths")]
    table = [int(v) for v in _get(attrs, "buffer_table")]
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in _get(attrs, "buffer_names")]
    if len(words) != num_queues * max_len * INSTRUCTION_WORDS or len(lengths) != num_queues:
        raise MegakernelRegionError(
            f"instructions hold {len(words)} words and queue_lengths {len(lengths)} entries; expected "
            f"{num_queues} x {max_len} x {INSTRUCTION_WORDS} and {num_queues}"
        )
    if len(table) != num_buffers * _TABLE_WIDTH or len(names) != num_buffers:
        raise MegakernelRegionError(
            f"buffer_table has {len(table)} entries and buffer_names {len(names)}; expected {num_buffers} buffers "
            f"of {_TABLE_WIDTH} entries"
        )
    if any(not 0 <= n <= max_len for n in lengths):
        raise MegakernelRegionError(f"queue lengths {lengths} exceed max_queue_len {max_len}")
    instructions, queues = [], []
    for q, length in enumerate(lengths):
        start = len(instructions)
        for pos in range(length):
            offset = (q * max_len + pos) * INSTRUCTION_WORDS
            instructions.append(Instruction.decode(words[offset : offset + INSTRUCTION_WORDS]))
        queues.append(tuple(range(start, len(instructions))))
    buffers = []
    for i in range(num_buffers):
        row = table[i * _TABLE_WIDTH : (i + 1) * _TABLE_WIDTH]
        ndim = row[2]
        if not 0 <= ndim <= MAX_DIMS:
            raise MegakernelRegionError(f"buffer {i}: {ndim} dims; at most {MAX_DIMS}")
        buffers.append(
            BufferSpec(
                buffer_id=i, name=names[i], kind=BufferKind(row[0]), dtype=DType(row[1]), shape=tuple(row[3 : 3 + ndim])
            )
        )
    constants = RegionConstants(**{name: _get(attrs, name) for name in _CONSTANT_NAMES})
    program = Program(
        constants=constants,
        buffers=tuple(buffers),
        instructions=tuple(instructions),
        queues=tuple(queues),
        num_counters=int(_get(attrs, "num_counters")),
    )
    inputs, outputs = node_io_buffers(program)
    if [int(v) for v in _get(attrs, "input_buffers")] != [b.buffer_id for b in inputs] or [
        int(v) for v in _get(attrs, "output_buffers")
    ] != [b.buffer_id for b in outputs]:
        raise MegakernelRegionError("input_buffers / output_buffers do not list the program's node buffers in order")
    return program


def megakernel_region_node(
    program: Program,
    inputs: Sequence[str],
    outputs: Sequence[str],
    *,
    name: str,
    watchdog_ms: int = 2000,
) -> onnx.NodeProto:
    """One MegakernelRegion node: `inputs` name the node_io_buffers inputs, `outputs` the outputs then `error`."""
    in_specs, out_specs = node_io_buffers(program)
    if len(inputs) != len(in_specs) or len(outputs) != len(out_specs) + 1:
        raise MegakernelRegionError(
            f"{name}: the program takes {len(in_specs)} inputs and returns {len(out_specs)} outputs + error; got "
            f"{len(inputs)} input and {len(outputs)} output names"
        )
    return onnx.helper.make_node(
        MEGAKERNEL_REGION,
        list(inputs),
        list(outputs),
        name=name,
        domain=PLUGIN_NAMESPACE,
        plugin_version=MEGAKERNEL_REGION_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
        **program_attributes(program, watchdog_ms=watchdog_ms),
    )


def schema() -> OpSchema:
    types = ["tensor(float)", "tensor(bfloat16)", "tensor(float16)", "tensor(int64)", "tensor(int32)"]
    variadic = OpSchema.FormalParameterOption.Variadic
    attributes = [
        OpSchema.Attribute(
            name, OpSchema.AttrType.INTS, "packed program (trt_plugins.megakernel.packing)", required=True
        )
        for name in ARRAY_FIELDS
    ]
    attributes += [
        OpSchema.Attribute(
            name,
            OpSchema.AttrType.FLOAT if kind == "float" else OpSchema.AttrType.INT,
            "megakernel launch parameter (instructions.LAUNCH_PARAMS)",
            required=True,
        )
        for name, kind in SCALAR_FIELDS
    ]
    attributes += [
        OpSchema.Attribute("buffer_names", OpSchema.AttrType.STRINGS, "program buffer names", required=True),
        OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version", required=False),
        OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace", required=False),
    ]
    return OpSchema(
        MEGAKERNEL_REGION,
        PLUGIN_NAMESPACE,
        1,
        "A compiled megakernel region: weights, inputs and state in; updated state, outputs and error words out.",
        inputs=[OpSchema.FormalParameter("buffers", "T", "", param_option=variadic, is_homogeneous=False)],
        outputs=[OpSchema.FormalParameter("results", "T", "", param_option=variadic, is_homogeneous=False)],
        type_constraints=[("T", types, "buffer element types (instructions.DType)")],
        attributes=attributes,
    )


def register_megakernel_region_schema() -> None:
    """Register the node's schema with onnx once (idempotent)."""
    if not onnx.defs.has(MEGAKERNEL_REGION, 1, PLUGIN_NAMESPACE):
        onnx.defs.register_schema(schema())


def _to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype.name == "bfloat16":  # ml_dtypes
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16).clone()
    return torch.from_numpy(np.array(array, copy=True))


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class MegakernelRegion(OpRun):
    """onnx.reference implementation: decode the attributes into a Program and run it on the PyTorch VM."""

    op_domain = PLUGIN_NAMESPACE

    def _run(self, *arrays, **attrs):
        program = program_from_attributes(attrs)
        in_specs, out_specs = node_io_buffers(program)
        if len(arrays) != len(in_specs):
            raise MegakernelRegionError(f"MegakernelRegion takes {len(in_specs)} inputs, got {len(arrays)}")
        bound = {}
        for spec, array in zip(in_specs, arrays):
            tensor = _to_torch(array)  # a copy: STATE is updated in place by the VM, the input stays as it was
            if tensor.dtype != TORCH_DTYPES[spec.dtype] or tuple(tensor.shape) != spec.shape:
                raise MegakernelRegionError(
                    f"input {spec.name!r}: expected {spec.shape} {spec.dtype.name}, got {tuple(tensor.shape)} {tensor.dtype}"
                )
            bound[spec.name] = tensor
        result = run_program(program, bound)
        error = np.zeros(ERROR_WORDS, dtype=np.int32)  # the VM raises DeadlockError where the kernel records one
        return (*(_to_numpy(result[spec.name]) for spec in out_specs), error)
