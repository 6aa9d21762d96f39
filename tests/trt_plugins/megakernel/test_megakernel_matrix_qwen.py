"""benchmarks/megakernel_correctness_qwen.py: the Qwen3-TTS correctness matrix (talker step, code-predictor loop,
codec transformer against fp32 references).

On CPU it runs the tiny presets through the VM: every part passes at the bf16 tolerances, fails at zero tolerance,
and fails when a region is fed the wrong positions. On a GPU a reduced matrix runs the CUDA megakernel at
Qwen3-TTS-0.6B shapes.
"""

from __future__ import annotations

import importlib
import json

import pytest


@pytest.fixture(scope="module")
def matrix():
    """The benchmarks package sits at the repository root, where pytest runs (README: `python -m pytest`)."""
    return importlib.import_module("benchmarks.megakernel_correctness_qwen")


# The tiny codec's window is 72 frames: context 80 wraps its ring.
VM_ARGS = [
    "--preset",
    "qwen3-tts-tiny",
    "--codec-preset",
    "tiny",
    "--device",
    "cpu",
    "--executor",
    "vm",
    "--num-sms",
    "5",
    "--batches",
    "1,3",
    "--contexts",
    "2,80",
    "--steps",
    "3",
    "--frames",
    "2",
]


def test_qwen_matrix_on_the_vm_passes_with_bf16_tolerances(matrix, tmp_path, capsys):
    out = tmp_path / "matrix.json"
    assert matrix.main([*VM_ARGS, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["complete"] is True
    cells = [(1, 2), (1, 80), (3, 2), (3, 80)]
    assert [(c["batch"], c["context"]) for c in report["talker"]] == cells
    assert [(c["batch"], c["context"]) for c in report["codec"]] == cells
    assert [c["batch"] for c in report["predictor"]] == [1, 3]
    for cell in report["talker"] + report["predictor"]:
        assert cell["passed"] and cell["hard_mismatches"] == 0 and cell["self_argmax_violations"] == 0
        # bf16 activations against an fp32 reference: never exact, and well inside the bound.
        assert 0 < cell["max_abs_logit_diff"] and cell["worst_diff_over_bound"] < 0.7
        assert cell["near_ties"] == cell["mismatches"]
        assert cell["bf16_conventional"]["max_abs_logit_diff"] > 0
    for cell in report["talker"]:
        assert cell["tokens_compared"] == 3 * cell["batch"]
        assert cell["context_per_row"] == [max(1, cell["context"] - min(2, cell["batch"] - 1)), cell["context"]]
    for cell in report["predictor"]:
        assert cell["heads"] >= 2 and cell["tokens_compared"] == 2 * cell["heads"] * cell["batch"]
        assert len(cell["per_head_max_abs_diff"]) == 2 * cell["heads"]
    for cell in report["codec"]:
        assert cell["passed"] and 0 < cell["max_abs_diff"] and cell["worst_diff_over_bound"] < 0.7
        assert cell["window"] == 72 and cell["bf16_conventional_max_abs_diff"] > 0
        assert cell["context_per_row"] == [max(0, cell["context"] - min(2, cell["batch"] - 1)), cell["context"]]
    assert {"device", "date_utc", "commit", "torch_version", "reference", "tolerance", "tiling"} <= set(report)
    assert "overall: PASS" in capsys.readouterr().out


def test_qwen_matrix_fails_at_zero_tolerance(matrix, tmp_path):
    """The checker can fail: bf16 outputs are never within 0 of the fp32 reference, in any part."""
    out = tmp_path / "matrix.json"
    zero = ["--batches", "3", "--contexts", "9", "--atol", "0", "--rtol", "0", "--bf16-factor", "0"]
    assert matrix.main([*VM_ARGS, *zero, "--no-bf16-baseline", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["passed"] is False
    for part in ("talker", "predictor", "codec"):
        (cell,) = report[part]
        assert not cell["passed"], part
    for part in ("talker", "predictor"):
        (cell,) = report[part]
        assert not cell["logits_ok"] and "bf16_conventional" not in cell
        assert cell["near_ties"] == 0 and cell["hard_mismatches"] == cell["mismatches"]


def test_regions_fed_positions_one_behind_fail(matrix, tmp_path, monkeypatch):
    """An error of the kind the matrix is for: each launch of the talker step and the codec transformer sees its
    rows one position behind (rope and the cache write off by one). Both fail at the bf16 tolerances."""
    real = matrix.Launcher.launch

    def behind(self):
        positions = self.tensors["positions"]
        positions.sub_(1)
        real(self)
        positions.add_(1)

    monkeypatch.setattr(matrix.Launcher, "launch", behind)
    out = tmp_path / "matrix.json"
    args = [*VM_ARGS, "--parts", "talker,codec", "--batches", "3", "--contexts", "80", "--out", str(out)]
    assert matrix.main(args) == 1
    report = json.loads(out.read_text())
    (talker,) = report["talker"]
    (codec,) = report["codec"]
    assert not talker["logits_ok"] and talker["worst_diff_over_bound"] > 1
    assert not codec["passed"] and codec["worst_diff_over_bound"] > 1
    assert report["predictor"] == []


def test_parts_are_checked(matrix):
    with pytest.raises(SystemExit):
        matrix.parse_args(["--out", "x.json", "--device", "cpu", "--executor", "vm", "--parts", "talker,vocoder"])


@pytest.mark.gpu
@pytest.mark.requires_megakernel
def test_reduced_qwen_matrix_on_the_gpu(matrix, tmp_path):
    """Qwen3-TTS-0.6B shapes (talker, code predictor, the 12 Hz codec's transformer), batches 1 and 7, contexts 1
    and 100 (past the codec's 72-frame window), 8 steps, 2 predictor frames: the CUDA megakernel against fp32."""
    out = tmp_path / "matrix.json"
    rc = matrix.main(["--batches", "1,7", "--contexts", "1,100", "--steps", "8", "--frames", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    failed = [c for part in ("talker", "predictor", "codec") for c in report[part] if not c["passed"]]
    assert rc == 0 and report["passed"], json.dumps(failed)
    assert len(report["talker"]) == 4 and len(report["predictor"]) == 2 and len(report["codec"]) == 4
