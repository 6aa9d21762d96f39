"""The recorded tile heuristic matches the committed H200 measurements it was generated from.

tuning_table.inc (compiled into libtilevox_kernels.so) must name, for every measured (T, I, H), the fastest
Kernel-1 config, the fastest Kernel-2 config and the fastest overall in benchmarks/results/swiglu_h200.json.
The ctypes check of tilevox_swiglu_gateup_select runs only where the library has been built (no GPU needed).
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "trt_plugins" / "csrc" / "common" / "tuning_table.inc"
RESULTS = ROOT / "benchmarks" / "results" / "swiglu_h200.json"
LIBRARY = ROOT / "trt_plugins" / "build" / "libtilevox_kernels.so"


def _measured_best() -> dict[tuple[int, int, int], dict[str, str]]:
    out = {}
    for row in json.loads(RESULTS.read_text())["bench"]:
        res = row["results"]
        best = {}
        for kname in ("k1", "k2"):
            cands = {c: v["ms"] for c, v in res.items() if c.startswith(kname + "_cfg") and "ms" in v}
            best[kname] = min(cands, key=cands.get)
        best["all"] = min(best.values(), key=lambda c: res[c]["ms"])
        out[(row["T"], row["I"], row["H"])] = best
    return out


def _table() -> dict[tuple[int, int, int], tuple[int, ...]]:
    rows = re.findall(r"^\{(\d+), (\d+), (\d+), (\d), (\d), (\d), (\d)\},", TABLE.read_text(), flags=re.M)
    return {(int(r[0]), int(r[1]), int(r[2])): tuple(int(v) for v in r[3:]) for r in rows}


def test_table_matches_committed_measurements() -> None:
    table, best = _table(), _measured_best()
    assert set(table) == set(best) and len(table) == 49  # 7 Qwen2.5 MLPs x 7 token counts
    for key, (kernel, cfg, k1_cfg, k2_cfg) in table.items():
        assert best[key]["k1"] == f"k1_cfg{k1_cfg}", key
        assert best[key]["k2"] == f"k2_cfg{k2_cfg}", key
        assert best[key]["all"] == f"k{kernel}_cfg{cfg}", key


@pytest.mark.skipif(not LIBRARY.is_file(), reason=f"{LIBRARY} not built (python -m tilevox.trt_plugins.build)")
def test_library_select_reproduces_table() -> None:
    lib = ctypes.CDLL(str(LIBRARY))
    lib.tilevox_swiglu_gateup_select.argtypes = (
        [ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 2
    )
    for (m, n, k), (kernel, cfg, k1_cfg, k2_cfg) in _table().items():
        for requested, want in ((0, (kernel, cfg)), (1, (1, k1_cfg)), (2, (2, k2_cfg))):
            kid, tc = ctypes.c_int(-9), ctypes.c_int(-9)
            assert lib.tilevox_swiglu_gateup_select(m, n, k, requested, ctypes.byref(kid), ctypes.byref(tc)) == 0
            assert (kid.value, tc.value) == want, (m, n, k, requested)
    kid, tc = ctypes.c_int(), ctypes.c_int()
    assert lib.tilevox_swiglu_gateup_select(1, 8, 8, 7, ctypes.byref(kid), ctypes.byref(tc)) == 1  # unknown kernel id
