"""Per-instruction time estimates for megakernel scheduling: a roofline on one SM's share of the GPU.

time = max(bytes / per-SM bandwidth, flops / per-SM throughput) + a fixed instruction overhead, plus
a synchronisation latency per counter wait. Every constant is named, sourced and dated; the
overhead and streaming rate are H200 measurements, the hand-off latency an assumption.
Imports: stdlib and trt_plugins.megakernel.instructions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tilevox.trt_plugins.megakernel.instructions import Instruction

__all__ = ["H100", "H200", "DeviceCosts", "calibrated", "instruction_time_s"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceCosts:
    name: str
    num_sms: int
    hbm_bytes_per_s: float
    dense_flops_per_s: float  # bf16 tensor-core, dense
    activation_bytes_per_s: float  # activations and replicated norm gains: mostly L2 hits on the GPU
    instruction_overhead_s: float  # decode a record, stage inputs, reduce, signal
    wait_latency_s: float  # one cross-SM counter hand-off through global memory (assumed)
    # Streaming rate one SM achieves inside the megakernel (measured); None: an equal share of HBM.
    sm_stream_bytes_per_s: float | None = None
    # (opcode name, factor) pairs: measured over modelled time of that opcode (calibrated(); empty: none)
    opcode_time_scale: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {self.num_sms}")
        for name in ("hbm_bytes_per_s", "dense_flops_per_s", "activation_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.instruction_overhead_s < 0 or self.wait_latency_s < 0:
            raise ValueError("latencies must be >= 0")
        if self.sm_stream_bytes_per_s is not None and not self.sm_stream_bytes_per_s > 0:
            raise ValueError(f"sm_stream_bytes_per_s must be > 0, got {self.sm_stream_bytes_per_s}")

    @property
    def sm_bytes_per_s(self) -> float:
        # With every SM streaming, each gets at most an equal share of HBM bandwidth.
        share = self.hbm_bytes_per_s / self.num_sms
        return share if self.sm_stream_bytes_per_s is None else min(share, self.sm_stream_bytes_per_s)

    @property
    def sm_activation_bytes_per_s(self) -> float:
        return self.activation_bytes_per_s / self.num_sms

    @property
    def sm_flops_per_s(self) -> float:
        return self.dense_flops_per_s / self.num_sms


# NVIDIA H200 SXM datasheet (retrieved 2026-12-02): 4.8 TB/s HBM3e, 989 TFLOPS dense BF16 (1,979 with
# sparsity), 132 SMs. Measured on an H200 (2026-12-02, benchmarks/results/megakernel_profile_h200_bab722a.json,
# Llama-1B step at batch 1, fit over the matrix-vector opcodes): 1.2 us per instruction plus its bytes at
# 22 GB/s per SM. Assumed: 0.7 us per counter hand-off, of the order of one HBM round trip (~0.5 us
# measured on MI300X, megakernels.md 4.1); activation traffic at the HBM rate (no L2 figure measured).
H200 = DeviceCosts(
    name="H200-SXM",
    num_sms=132,
    hbm_bytes_per_s=4.8e12,
    dense_flops_per_s=989e12,
    activation_bytes_per_s=4.8e12,
    instruction_overhead_s=1.2e-6,
    wait_latency_s=0.7e-6,
    sm_stream_bytes_per_s=22.2e9,
)


def instruction_time_s(inst: Instruction, device: DeviceCosts) -> float:
    """Estimated run time of `inst` on one SM, excluding waits (the scheduler adds wait latency on edges)."""
    memory_s = (inst.weight_bytes + inst.kv_bytes) / device.sm_bytes_per_s
    memory_s += inst.activation_bytes / device.sm_activation_bytes_per_s
    compute_s = inst.flops / device.sm_flops_per_s
    time_s = max(memory_s, compute_s) + device.instruction_overhead_s
    for name, factor in device.opcode_time_scale:
        if name == inst.opcode.name:
            return time_s * factor
    return time_s


# NVIDIA H100 SXM5 80GB datasheet (retrieved 2026-12-06): 3.35 TB/s HBM3, 989 TFLOPS dense BF16, 132 SMs.
# The latencies are the H200's assumptions until calibrated() replaces them from a profile of this GPU.
H100 = dataclasses.replace(
    H200, name="H100-SXM", hbm_bytes_per_s=3.35e12, activation_bytes_per_s=3.35e12, sm_stream_bytes_per_s=None
)


def calibrated(
    device: DeviceCosts, profile_row: Mapping[str, Any], instructions: Sequence[Instruction] = ()
) -> DeviceCosts:
    """`device` with the latencies and streaming rate one profiled launch measured (a row of
    benchmarks.megakernel_profile's JSON: its `streaming_fit`, `critical_path` and per-opcode `profile`).

    instruction_overhead_s and sm_stream_bytes_per_s: the fit of exec time = overhead + bytes / rate over the
    matrix-vector opcodes. wait_latency_s: what the critical path spent outside execution (hand-offs, waits
    that found their counters met, gaps between two instructions of one queue) per instruction on it: the
    simulator charges that latency once per waiting instruction. With the profiled launch's `instructions`,
    also opcode_time_scale: each opcode's measured mean execution time over its modelled mean (attention,
    its reduction and sampling are latency-bound, which the roofline does not see)."""
    fit, path = profile_row["streaming_fit"], profile_row["critical_path"]["path"]
    if not path["instructions"]:
        raise ValueError("the profiled critical path holds no instructions")
    latency_us = path["handoff_us"] + path["idle_wait_us"] + path["queue_gap_us"]
    device = dataclasses.replace(
        device,
        name=f"{device.name} (calibrated)",
        instruction_overhead_s=max(0.0, fit["overhead_us"]) * 1e-6,
        sm_stream_bytes_per_s=fit["sm_gb_per_s"] * 1e9,
        wait_latency_s=latency_us / path["instructions"] * 1e-6,
        opcode_time_scale=(),
    )
    modelled: dict[str, list[float]] = {}
    for inst in instructions:
        modelled.setdefault(inst.opcode.name, []).append(instruction_time_s(inst, device))
    measured = profile_row["profile"]["opcodes"]
    scale = tuple(
        (name, measured[name]["exec_us_mean"] * 1e-6 / (sum(times) / len(times)))
        for name, times in sorted(modelled.items())
        if name in measured and sum(times) > 0
    )
    return dataclasses.replace(device, opcode_time_scale=scale)
