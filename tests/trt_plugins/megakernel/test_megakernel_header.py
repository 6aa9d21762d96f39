"""The committed C header is exactly what the registry generates, and a C compiler reads the same
opcodes, record offsets and constants struct layout as Python."""

from __future__ import annotations

import itertools
import shutil
import subprocess
from dataclasses import fields

import pytest

from tilevox.trt_plugins.megakernel.header import HEADER_PATH, generate_header, main
from tilevox.trt_plugins.megakernel.instructions import (
    INSTRUCTION_WORDS,
    RECORD_FIELDS,
    BufferKind,
    DType,
    Opcode,
    RegionConstants,
)


def test_committed_header_is_current():
    assert HEADER_PATH.read_text() == generate_header(), (
        "trt_plugins/csrc/megakernel/instructions.h is stale: run python -m tilevox.trt_plugins.megakernel.header"
    )
    assert main(["--check"]) == 0


def test_registry_is_consistent():
    codes = [op.code for op in Opcode]
    assert len(set(codes)) == len(codes) and min(codes) >= 1
    words = sorted((start, start + width) for _, start, width in RECORD_FIELDS)
    for (_, end), (start, _) in itertools.pairwise(words):
        assert end <= start  # fields do not overlap
    assert words[-1][1] <= INSTRUCTION_WORDS


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on PATH to check the header")
def test_c_compiler_sees_the_registry(tmp_path):
    checks = [f"TILEVOX_MK_OP_{op.name}" for op in Opcode]
    checks += [f"TILEVOX_MK_FIELD_{name.upper()}" for name, _, _ in RECORD_FIELDS]
    checks += [f"TILEVOX_MK_BUFFER_{k.name}" for k in BufferKind] + [f"TILEVOX_MK_DTYPE_{d.name}" for d in DType]
    checks += ["TILEVOX_MK_INSTRUCTION_WORDS", "(int)sizeof(TilevoxMkRegionConstants)"]
    body = "\n".join(f'  printf("%d\\n", (int)({c}));' for c in checks)
    source = tmp_path / "check.c"
    source.write_text(f'#include <stdio.h>\n#include "{HEADER_PATH}"\nint main(void) {{\n{body}\n  return 0;\n}}\n')
    exe = tmp_path / "check"
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", str(source), "-o", str(exe)], check=True)
    printed = [
        int(line) for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    ]
    expected = [op.code for op in Opcode] + [start for _, start, _ in RECORD_FIELDS]
    expected += [k.value for k in BufferKind] + [d.value for d in DType]
    expected += [
        INSTRUCTION_WORDS,
        4 * len(fields(RegionConstants)),
    ]  # every field is 4 bytes
    assert printed == expected


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on PATH to check the header")
def test_c_compiler_sees_the_launch_interface(tmp_path):
    """Limits, statuses, error codes, flags and the launch struct come from the registry: a C compiler reads
    the same values, and the struct's size and field offsets equal the ctypes structure runtime.py passes."""
    import ctypes

    from tilevox.trt_plugins.megakernel.instructions import (
        ERROR_WORDS,
        FLAG_SYNC_CHECK,
        LAUNCH_PARAMS,
        MAX_HEAD_DIM,
        MAX_ROW_WIDTH,
        PREFETCH_RANGES,
        PROFILE_WORDS,
        ErrorCode,
        LaunchStatus,
    )
    from tilevox.trt_plugins.megakernel.runtime import MegakernelParams

    checks = [
        "TILEVOX_MK_MAX_HEAD_DIM",
        "TILEVOX_MK_MAX_ROW_WIDTH",
        "TILEVOX_MK_ERROR_WORDS",
        "TILEVOX_MK_FLAG_SYNC_CHECK",
        "TILEVOX_MK_PREFETCH_WORDS",
        "TILEVOX_MK_PROFILE_WORDS",
    ]
    checks += [f"TILEVOX_ERR_{s.name}" for s in LaunchStatus] + [f"TILEVOX_MK_ERROR_{c.name}" for c in ErrorCode]
    checks += ["sizeof(tilevox_megakernel_params)"]
    checks += [f"offsetof(tilevox_megakernel_params, {name})" for name, _, _ in LAUNCH_PARAMS]
    body = "\n".join(f'  printf("%d\\n", (int)({c}));' for c in checks)
    source = tmp_path / "check.c"
    source.write_text(
        f'#include <stddef.h>\n#include <stdio.h>\n#include "{HEADER_PATH}"\nint main(void) {{\n{body}\n  return 0;\n}}\n'
    )
    exe = tmp_path / "check"
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", str(source), "-o", str(exe)], check=True)
    printed = [
        int(line) for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    ]
    expected = [MAX_HEAD_DIM, MAX_ROW_WIDTH, ERROR_WORDS, FLAG_SYNC_CHECK, 2 * PREFETCH_RANGES, PROFILE_WORDS]
    expected += [int(s) for s in LaunchStatus] + [int(c) for c in ErrorCode]
    expected += [ctypes.sizeof(MegakernelParams)]
    expected += [getattr(MegakernelParams, name).offset for name, _, _ in LAUNCH_PARAMS]
    assert printed == expected


def test_every_region_constant_reaches_the_launch_parameters():
    """BoundLaunch fills the launch parameters from constant_params: every RegionConstants field, by name, with
    its value (a constant left out would reach the kernel as 0, as `window` once did)."""
    import dataclasses

    from tilevox.trt_plugins.megakernel.instructions import RegionConstants
    from tilevox.trt_plugins.megakernel.runtime import MegakernelParams, constant_params

    constants = RegionConstants(
        batch_size=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        attn_scale=0.125,
        partition_tokens=16,
        num_partitions=5,
        window=72,
    )
    values = constant_params(constants)
    assert set(values) == {f.name for f in dataclasses.fields(RegionConstants)}
    params = MegakernelParams(**values)
    for name, value in values.items():
        assert getattr(params, name) == pytest.approx(value)
