"""CPU checks of the CUDA megakernel: its translation unit compiles with nvcc (`python -m tilevox.trt_plugins.build
--only megakernel`, skipped with the reason where nvcc or CUTLASS is missing), the ctypes mirror in
runtime.py matches the C struct in megakernel.h field for field, and error words map to the right
exception types."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tilevox.trt_plugins import build as tb
from tilevox.trt_plugins.megakernel import runtime

HEADER = Path(tb.CSRC_DIR) / "megakernel" / "instructions.h"  # the generated header holds the launch struct


def _toolchain_reason() -> str | None:
    try:
        tb.find_nvcc()
        tb.find_cutlass_include_dirs()
    except tb.BuildError as exc:
        return f"no CUDA toolchain here: {exc}"
    return None


_SKIP_REASON = _toolchain_reason()


@pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")
def test_megakernel_translation_unit_compiles(tmp_path: Path) -> None:
    assert any(p.stem == "megakernel" for p in tb.list_sources("megakernel"))
    proc = subprocess.run(  # noqa: PLW1510 (the return code is asserted below)
        [
            sys.executable,
            "-m",
            "tilevox.trt_plugins.build",
            "--out",
            str(tmp_path),
            "--only",
            "megakernel",
            "--jobs",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    obj = tmp_path / "obj" / "megakernel__megakernel.o"
    assert obj.is_file() and obj.stat().st_size > 0


_C_TYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _header_fields() -> list[tuple[str, str]]:
    body = re.search(
        r"typedef struct tilevox_megakernel_params \{(.*?)\} tilevox_megakernel_params;", HEADER.read_text(), re.DOTALL
    )
    assert body is not None
    fields = []
    for line in body.group(1).splitlines():
        line = re.sub(r"/\*.*?\*/", "", line).strip()
        if not line:
            continue
        decl, names = re.match(r"(.*?)(\w+(?:\s*,\s*\w+)*)\s*;$", line).groups()
        kind = "ptr" if "*" in decl else decl.strip()
        fields += [(name.strip(), kind) for name in names.split(",")]
    return fields


def test_ctypes_params_mirror_the_header() -> None:
    header = _header_fields()
    mirror = runtime.MegakernelParams._fields_
    assert [name for name, _ in header] == [name for name, _ in mirror]
    for (name, kind), (_, ctype) in zip(header, mirror):
        want = ctypes.c_void_p if kind == "ptr" else _C_TYPES[kind]
        assert ctype is want, name


def test_error_words_raise_the_matching_exception() -> None:
    runtime._raise_for_words([0] * runtime.ERROR_WORDS)
    with pytest.raises(runtime.MegakernelWatchdogError, match="queue 3 position 5 opcode 4 counter 9 value 1 target 2"):
        runtime._raise_for_words([1, 3, 5, 4, 9, 1, 2, 0])
    with pytest.raises(runtime.MegakernelFaultError, match="index out of range"):
        runtime._raise_for_words([3, 0, 0, 1, -1, 10, 10, 0])
