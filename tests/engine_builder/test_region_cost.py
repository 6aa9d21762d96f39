"""The region cost model calibrated from a profiled launch (engine_builder.regions.cost.calibrated)."""

from __future__ import annotations

import pytest

from tilevox.engine_builder.regions.cost import H100, calibrated, instruction_time_s
from tilevox.trt_plugins.megakernel import Opcode
from tilevox.trt_plugins.megakernel.instructions import Instruction


def _inst(opcode: Opcode, weight_bytes: int) -> Instruction:
    info = opcode.value
    return Instruction(
        opcode=opcode,
        args=(0,) * len(info.args),
        inputs=(0,) * len(info.inputs),
        outputs=(1,) * len(info.outputs),
        weight_bytes=weight_bytes,
    )


def _row(**path) -> dict:
    return {
        "streaming_fit": {"overhead_us": 0.9, "sm_gb_per_s": 20.0, "points": 5},
        "critical_path": {
            "path": {"instructions": 10, "handoff_us": 5.0, "idle_wait_us": 30.0, "queue_gap_us": 15.0, **path}
        },
        "profile": {
            "opcodes": {
                "DOWN_RESIDUAL": {"exec_us_mean": 2 * (0.9 + 200_000 / 20e3)},  # twice the fitted roofline
                "ATTN_PARTIAL": {"exec_us_mean": 7.0},
            }
        },
    }


def test_calibrated_takes_the_fit_and_the_critical_paths_latency_per_instruction():
    device = calibrated(H100, _row())
    assert device.instruction_overhead_s == pytest.approx(0.9e-6)
    assert device.sm_stream_bytes_per_s == pytest.approx(20e9)
    assert device.wait_latency_s == pytest.approx((5 + 30 + 15) / 10 * 1e-6)
    assert device.opcode_time_scale == ()  # without the launch's instructions, no per-opcode factors
    down = _inst(Opcode.DOWN_RESIDUAL, 200_000)
    assert instruction_time_s(down, device) == pytest.approx((0.9 + 200_000 / 20e3) * 1e-6)


def test_per_opcode_factors_make_each_opcodes_mean_the_measured_one():
    insts = [_inst(Opcode.DOWN_RESIDUAL, 200_000), _inst(Opcode.ATTN_PARTIAL, 0), _inst(Opcode.OPROJ_RESIDUAL, 1000)]
    device = calibrated(H100, _row(), insts)
    scale = dict(device.opcode_time_scale)
    assert scale["DOWN_RESIDUAL"] == pytest.approx(2.0)
    assert instruction_time_s(insts[0], device) == pytest.approx(2 * (0.9 + 200_000 / 20e3) * 1e-6)
    assert instruction_time_s(insts[1], device) == pytest.approx(7.0e-6)
    assert "OPROJ_RESIDUAL" not in scale  # not profiled: the roofline alone
    assert instruction_time_s(insts[2], device) == pytest.approx((0.9 + 1000 / 20e3) * 1e-6)


def test_an_empty_critical_path_is_refused():
    with pytest.raises(ValueError, match="no instructions"):
        calibrated(H100, _row(instructions=0))
