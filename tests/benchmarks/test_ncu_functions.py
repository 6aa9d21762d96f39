"""benchmarks/device/ncu_functions.py: Nsight Compute's per-instruction samples summed per megakernel function, on a
hand-made listing and source-page export with known answers."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "ncu_functions.py"
_spec = importlib.util.spec_from_file_location("ncu_functions", _PATH)
ncu_functions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_functions)

NS = "_ZN46_GLOBAL__N__05369c2b_13_megakernel_cu_4834aedf"
LISTING = f"""\t.section\t.text.{NS}10megakernelE25tilevox_megakernel_params,"ax",@progbits
.text.{NS}10megakernelE25tilevox_megakernel_params:
{NS}10megakernelE25tilevox_megakernel_params:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   BRA `(.L_x_1) ;
${NS}10megakernelE25tilevox_megakernel_params$_ZN44_INTERNAL_05369c2b_13_megakernel_cu_4834aedf{NS[4:]}15op_attn_partialENS0_3CtxEPKiPfS4_:
        /*0020*/                   LDG.E R2, [R4.64] ;
        /*0030*/                   RET.REL.NODEC R20 ;
${NS}10megakernelE25tilevox_megakernel_params$_ZN44_INTERNAL_05369c2b_13_megakernel_cu_4834aedf{NS[4:]}20attn_partial_groupedILi16ELi2EEEvNS0_3CtxEPKiPfS5_ii:
        /*0040*/                   FFMA R3, R2, R2, R3 ;
$__internal_4_$__cuda_sm3x_div_rn_noftz_f32_slowpath:
        /*0050*/                   MUFU.RCP R5, R4 ;
"""

# Addresses as Nsight Compute exports them: where the kernel was loaded, not the listing's section offsets.
CSV = """"Kernel Name","megakernel"
"Address","Source","Instructions Executed","Warp Stall Sampling (All Samples)","stall_long_sb","stall_no_instruction"
"0x7f67cb400000","      MOV R1, c[0x0][0x28]","10","5","0","5"
"0x7f67cb400010","      BRA `(.L_x_1)","100","50","0","10"
"0x7f67cb400020","      LDG.E R2, [R4.64]","8","30","28","2"
"0x7f67cb400030","      RET.REL.NODEC R20","8","5","0","5"
"0x7f67cb400040","      FFMA R3, R2, R2, R3","64","8","1","7"
"0x7f67cb400050","      MUFU.RCP R5, R4","2","2","0","2"
"""


def test_function_starts_names_every_function() -> None:
    starts = ncu_functions.function_starts(LISTING)
    assert starts == [
        (0x00, "megakernel"),
        (0x20, "op_attn_partial"),
        (0x40, "attn_partial_grouped<16,2>"),
        (0x50, "__cuda_sm3x_div_rn_noftz_f32_slowpath"),
    ]


def test_samples_sum_per_function(tmp_path: Path) -> None:
    path = tmp_path / "pred_sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(CSV)
    result = ncu_functions.summarize(
        ncu_functions.read_source_csv(path),
        ncu_functions.function_starts(LISTING),
        ncu_functions.listing_opcodes(LISTING),
    )
    by_name = {f["function"]: f for f in result["functions"]}
    assert by_name["megakernel"]["samples"] == 55 and by_name["megakernel"]["executed"] == 110
    assert by_name["op_attn_partial"]["samples"] == 35
    assert by_name["op_attn_partial"]["stalls"] == {"stall_long_sb": 28, "stall_no_instruction": 7}
    assert by_name["attn_partial_grouped<16,2>"]["samples"] == 8
    assert abs(sum(f["share_pct"] for f in result["functions"]) - 100) < 1e-9
    assert [f["function"] for f in result["functions"]][:2] == ["megakernel", "op_attn_partial"]


def test_an_export_without_samples_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "raw.csv"
    path.write_text('"Address","Source","Instructions Executed"\n"0x0","MOV R1, c[0x0][0x28]","10"\n')
    with pytest.raises(ValueError, match="Sampling"):
        ncu_functions.summarize(ncu_functions.read_source_csv(path), ncu_functions.function_starts(LISTING))


def test_a_listing_of_another_build_is_refused(tmp_path: Path) -> None:
    """Every function's first opcode is compared: one instruction more before op_attn_partial moves every row."""
    path = tmp_path / "pred_sass.csv"
    path.write_text(CSV)
    shifted = LISTING.replace(
        "/*0020*/                   LDG.E", "/*0020*/                   NOP ;\n        /*0030*/  LDG.E"
    )
    with pytest.raises(ValueError, match="op_attn_partial at \\+0x20: the listing has NOP, the export LDG.E"):
        ncu_functions.summarize(
            ncu_functions.read_source_csv(path),
            ncu_functions.function_starts(shifted),
            ncu_functions.listing_opcodes(shifted),
        )


def test_opcodes_without_predicates() -> None:
    ops = ncu_functions.listing_opcodes("        /*0010*/                   @!P0  BRA 0x7f67cb4fd4d0 ;\n")
    assert ops == {0x10: "BRA"}


def test_hot_spots_of_one_function(tmp_path: Path) -> None:
    path = tmp_path / "pred_sass.csv"
    path.write_text(CSV)
    rows, starts = ncu_functions.read_source_csv(path), ncu_functions.function_starts(LISTING)
    spans = ncu_functions.hot_spots(rows, starts, "op_attn_partial", span=16)
    assert [(e["offset"], e["samples"], e["executed"]) for e in spans] == [(0x0, 30, 8), (0x10, 5, 8)]
    assert spans[0]["code"] == ["LDG.E R2, [R4.64]"] and spans[0]["stalls"] == {
        "stall_long_sb": 28,
        "stall_no_instruction": 2,
    }
    whole = ncu_functions.hot_spots(rows, starts, "megakernel")
    assert [(e["offset"], e["samples"]) for e in whole] == [(0x0, 55)]
    with pytest.raises(ValueError, match="no function 'op_qkv'"):
        ncu_functions.hot_spots(rows, starts, "op_qkv")
