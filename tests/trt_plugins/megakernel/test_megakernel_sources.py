"""The megakernel's CUDA sources are split as the house style asks: the interpreter loop and launcher in
megakernel.cu, shared helpers beside it, and one file per instruction under ops/ (OPROJ_RESIDUAL and
DOWN_RESIDUAL share one body), each named in its file's first line, included by megakernel.cu and
dispatched by its opcode; the PyTorch VM has one method per instruction too."""

from __future__ import annotations

import re
from pathlib import Path

from tilevox.trt_plugins.megakernel import vm
from tilevox.trt_plugins.megakernel.instructions import Opcode

SOURCES = Path(vm.__file__).resolve().parents[1] / "csrc" / "megakernel"


def test_one_file_per_instruction_included_and_dispatched():
    kernel = (SOURCES / "megakernel.cu").read_text()
    files = sorted((SOURCES / "ops").glob("*.cuh"))
    named: dict[str, list[str]] = {}
    for path in files:
        first = path.read_text().splitlines()[0]
        assert first.startswith(f"// ops/{path.name}: "), first
        for name in re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", first.split(":", 2)[1]):
            named.setdefault(name, []).append(path.name)
        assert f'#include "ops/{path.name}"' in kernel
    for op in Opcode:
        assert named.get(op.name, []) and len(named[op.name]) == 1, f"{op.name}: files {named.get(op.name)}"
        assert f"case TILEVOX_MK_OP_{op.name}:" in kernel, f"{op.name} is not dispatched"
        assert hasattr(vm._Machine, f"_{op.name.lower()}"), f"the VM has no method for {op.name}"
    assert len(kernel.splitlines()) < 300  # the loop and the launcher only


def test_instruction_bodies_use_the_generated_slot_names():
    """Record slots are read through instructions.h's named indices (TILEVOX_MK_<OP>_IN_<NAME>, ...), never by
    a bare number, so a registry change cannot silently shift what an opcode reads."""
    numbered = re.compile(r"(ins_of\(inst\)|outs_of\(inst\)|args_of\(inst\)|\bin|\bout)\[\d+\]")
    for path in sorted((SOURCES / "ops").glob("*.cuh")):
        found = numbered.findall(path.read_text())
        assert not found, f"{path.name} indexes record slots by number: {found}"
