"""Run megakernel Programs on the GPU through libtilevox_kernels.so's `tilevox_megakernel_launch`.

`CudaProgram` uploads a packed Program once; `CudaProgram.bind` checks tensors by buffer name (the
VM's rules: WEIGHT/INPUT/STATE must be bound, unbound SCRATCH/OUTPUT are allocated and NaN-poisoned)
and returns a `BoundLaunch` whose `launch()` runs on the current stream (capturable in a CUDA graph:
the launcher resets the counters with memset nodes). `run_program_cuda` mirrors `vm.run_program`.
Imports: torch, trt_plugins.library, trt_plugins.megakernel.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tilevox.trt_plugins.library import KernelLibraryError, check_status, kernels_library
from tilevox.trt_plugins.megakernel.instructions import (
    ERROR_WORDS,
    FLAG_SYNC_CHECK,
    LAUNCH_PARAMS,
    PROFILE_WORDS,
    BufferKind,
    ErrorCode,
    LaunchStatus,
    Program,
    RegionConstants,
)
from tilevox.trt_plugins.megakernel.packing import pack_program
from tilevox.trt_plugins.megakernel.prefetch import prefetch_table
from tilevox.trt_plugins.megakernel.vm import TORCH_DTYPES

__all__ = [
    "ERROR_WORDS",
    "BoundLaunch",
    "CudaProgram",
    "MegakernelFaultError",
    "MegakernelParams",
    "MegakernelWatchdogError",
    "run_program_cuda",
]

_CTYPES = {
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}


class MegakernelWatchdogError(KernelLibraryError):
    """A counter wait never completed within the watchdog budget: the program deadlocks."""


class MegakernelFaultError(KernelLibraryError):
    """An instruction met an out-of-range index (token, slot, position) or an unknown opcode."""


class MegakernelParams(ctypes.Structure):
    """tilevox_megakernel_params (trt_plugins/csrc/megakernel/megakernel.h), field for field."""

    # from the registry (instructions.LAUNCH_PARAMS), as instructions.h is: pointers are c_void_p
    _fields_ = [
        (name, ctypes.c_void_p if c_type.endswith("*") else _CTYPES[c_type]) for name, c_type, _ in LAUNCH_PARAMS
    ]


def constant_params(constants: RegionConstants) -> dict[str, int | float]:
    """Every RegionConstants field by name, as the launch parameters take them: each is a launch parameter of
    the same name (the registry says so; a constant added there reaches the kernel without being retyped here)."""
    names = {name for name, _, _ in LAUNCH_PARAMS}
    out = {field.name: getattr(constants, field.name) for field in dataclasses.fields(constants)}
    missing = sorted(set(out) - names)
    if missing:
        raise AssertionError(f"RegionConstants fields without a launch parameter: {missing}")
    return out


def _library() -> ctypes.CDLL:
    lib = kernels_library()
    fn = lib.tilevox_megakernel_launch  # AttributeError: the library predates the megakernel
    fn.argtypes = [ctypes.POINTER(MegakernelParams), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    lib.tilevox_megakernel_max_queues.argtypes = []
    lib.tilevox_megakernel_max_queues.restype = ctypes.c_int
    return lib


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """None when the CUDA megakernel can run on `device` (default: the current CUDA device); otherwise
    why not, in words. The one availability check: region backends and tests both ask it."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return f"the model is on {device}; the megakernel runs on a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the GPU is sm_{major}{minor}; the megakernel is built for sm_90 (Hopper)"
    try:
        _library()
    except (OSError, KernelLibraryError) as exc:  # not built / unloadable / ABI mismatch
        return f"kernel library unavailable: {exc}"
    except AttributeError:
        return "the kernel library predates the megakernel (no tilevox_megakernel_launch)"
    return None


def _raise_for_words(words: list[int]) -> None:
    code = words[0]
    if code == ErrorCode.NONE:
        return
    try:
        name = ErrorCode(code).description
    except ValueError:  # a code this registry does not know: say the number
        name = code
    detail = (
        f"megakernel {name}: queue {words[1]} position {words[2]} opcode {words[3]} "
        f"counter {words[4]} value {words[5]} target {words[6]}"
    )
    raise (MegakernelWatchdogError if code == ErrorCode.WATCHDOG else MegakernelFaultError)(detail)


class CudaProgram:
    """A Program's packed queues and buffer table on one CUDA device (uploaded once, reused per launch)."""

    def __init__(self, program: Program, *, device: torch.device | str | None = None, watchdog_s: float = 2.0) -> None:
        if not watchdog_s > 0:
            raise ValueError(f"watchdog_s must be > 0, got {watchdog_s}")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaProgram needs a CUDA device, got {device}")
        self.program = program
        self.device = device
        self.watchdog_ns = int(watchdog_s * 1e9)
        packed = pack_program(program)
        self.instructions = packed["instructions"].to(device).contiguous()
        self.queue_lengths = packed["queue_lengths"].to(device)
        self.buffer_table = packed["buffer_table"].to(device).contiguous()
        self.lib = _library()

    def bind(self, bound: Mapping[str, torch.Tensor], *, prefetch: bool = False, profile: bool = False) -> BoundLaunch:
        """Check `bound` against the buffer specs and allocate the rest; the tensors must stay alive and
        in place for as long as the BoundLaunch is launched (a CUDA graph replays their addresses).
        prefetch: pass the L2 weight-prefetch table (a hint; results are identical without it). Off by
            default: on the H200 (2026-12-02, same-run comparison, megakernel_profile_h200_bab722a.json) it
            made the Llama-1B step 4-8 % slower, since the weight loads already start before the waits.
        profile: record per-instruction timestamps of every launch (`BoundLaunch.profile`)."""
        specs = {spec.name: spec for spec in self.program.buffers}
        unknown = sorted(set(bound) - set(specs))
        if unknown:
            raise ValueError(f"unknown buffer name(s): {unknown}")
        tensors: dict[str, torch.Tensor] = {}
        for spec in self.program.buffers:
            dtype = TORCH_DTYPES[spec.dtype]
            if spec.name not in bound:
                if spec.kind not in (BufferKind.SCRATCH, BufferKind.OUTPUT):
                    raise ValueError(f"buffer {spec.name!r} ({spec.kind.name}) must be bound")
                fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
                tensors[spec.name] = torch.full(spec.shape, fill, dtype=dtype, device=self.device)
                continue
            tensor = bound[spec.name]
            if tuple(tensor.shape) != spec.shape or tensor.dtype != dtype:
                raise ValueError(
                    f"buffer {spec.name!r} expects {spec.shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
                )
            if tensor.device != self.device:
                raise ValueError(f"buffer {spec.name!r} is on {tensor.device}, the program on {self.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"buffer {spec.name!r} must be contiguous (the kernel computes dense strides)")
            if tensor.data_ptr() % 16:
                raise ValueError(f"buffer {spec.name!r} must be 16-byte aligned (vector loads)")
            tensors[spec.name] = tensor
        return BoundLaunch(self, tensors, prefetch=prefetch, profile=profile)


@dataclass(eq=False)
class BoundLaunch:
    """One binding of a CudaProgram's buffers: launch as often as needed (eagerly or under graph capture)."""

    program: CudaProgram
    tensors: dict[str, torch.Tensor]
    prefetch: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        p, dev = self.program, self.program.device
        ptrs = [self.tensors[spec.name].data_ptr() for spec in p.program.buffers]
        self.pointer_table = torch.tensor(ptrs or [0], dtype=torch.int64).to(dev)
        self.counters = torch.zeros(max(1, p.program.num_counters), dtype=torch.int32, device=dev)
        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev)
        max_len = int(p.instructions.shape[1])
        self.prefetch_table = prefetch_table(p.program, self.tensors, max_len).to(dev) if self.prefetch else None
        # (queues, positions, 3) globaltimer ns: record read, waits satisfied, finished.
        self.timestamps = (
            torch.zeros((len(p.program.queues), max(1, max_len), PROFILE_WORDS), dtype=torch.int64, device=dev)
            if self.profile
            else None
        )
        self.params = MegakernelParams(
            instructions=p.instructions.data_ptr(),
            queue_lengths=p.queue_lengths.data_ptr(),
            buffer_table=p.buffer_table.data_ptr(),
            buffer_ptrs=self.pointer_table.data_ptr(),
            counters=self.counters.data_ptr(),
            error=self.error.data_ptr(),
            profile=None if self.timestamps is None else self.timestamps.data_ptr(),
            prefetch=None if self.prefetch_table is None else self.prefetch_table.data_ptr(),
            num_queues=len(p.program.queues),
            max_queue_len=int(p.instructions.shape[1]),
            num_buffers=len(p.program.buffers),
            num_counters=p.program.num_counters,
            watchdog_ns=p.watchdog_ns,
            flags=0,
            **constant_params(p.program.constants),
        )

    def launch(self, *, check: bool = True) -> dict[str, torch.Tensor]:
        """Enqueue one run on the current stream. check=True synchronizes and raises
        MegakernelWatchdogError / MegakernelFaultError; use check=False under graph capture and call
        `check_error()` after the stream (or graph replay) completes."""
        if check and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("launch(check=True) synchronizes; pass check=False while capturing a CUDA graph")
        self.params.flags = FLAG_SYNC_CHECK if check else 0
        lib = self.program.lib
        stream = torch.cuda.current_stream(self.program.device).cuda_stream
        status = lib.tilevox_megakernel_launch(ctypes.byref(self.params), ctypes.c_void_p(stream))
        if status in (LaunchStatus.MK_WATCHDOG, LaunchStatus.MK_FAULT):
            message = lib.tilevox_last_error().decode(errors="replace")
            raise (MegakernelWatchdogError if status == LaunchStatus.MK_WATCHDOG else MegakernelFaultError)(message)
        check_status(lib, status, "tilevox_megakernel_launch")
        return self.tensors

    def check_error(self) -> None:
        """Synchronize the current stream and raise if the last completed launch recorded an error."""
        torch.cuda.current_stream(self.program.device).synchronize()
        _raise_for_words(self.error.tolist())


def run_program_cuda(
    program: Program, bound: Mapping[str, torch.Tensor], *, watchdog_s: float = 2.0
) -> dict[str, torch.Tensor]:
    """GPU counterpart of `vm.run_program`: one synchronous launch; every buffer by name (STATE in place)."""
    return CudaProgram(program, watchdog_s=watchdog_s).bind(bound).launch(check=True)
