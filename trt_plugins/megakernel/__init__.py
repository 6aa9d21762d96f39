"""tilevox: trt_plugins.megakernel, the instruction set, C-header generator and reference interpreter
of the persistent decode megakernel. Imports: torch and this package only."""

from tilevox.trt_plugins.megakernel.instructions import (
    BufferKind,
    BufferSpec,
    DType,
    Instruction,
    Opcode,
    Program,
    RegionConstants,
    Wait,
)
from tilevox.trt_plugins.megakernel.torch_op import launch_op
from tilevox.trt_plugins.megakernel.vm import (
    DeadlockError,
    SchedulePolicy,
    run_program,
    uniform_from_seed,
)

__all__ = [
    "BufferKind",
    "BufferSpec",
    "DType",
    "DeadlockError",
    "Instruction",
    "Opcode",
    "Program",
    "RegionConstants",
    "SchedulePolicy",
    "Wait",
    "launch_op",
    "run_program",
    "uniform_from_seed",
]
