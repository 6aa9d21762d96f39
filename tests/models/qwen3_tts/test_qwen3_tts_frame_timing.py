"""Smoke run of benchmarks/qwen3_tts_frame_timing.py on CPU with the tiny preset."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "qwen3_tts_frame_timing.py"


def test_frame_timing_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("qwen3_tts_frame_timing", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "timing.json"
    assert bench.main(["--device", "cpu", "--iters", "2", "--preset", "qwen3-tts-tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"device", "date_utc", "git_commit", "torch_version"} <= set(report)
    assert set(report["results"]) == set(bench.PARTS)
    for part in bench.PARTS:
        for batch in ("b1", "b32"):
            entry = report["results"][part][batch]
            assert entry["eager"]["iters"] == 2 and entry["eager"]["median_ms"] > 0
            assert "CUDA" in entry["cuda_graph"]["error"]  # no graphs on CPU, and the table says so
    assert "talker_step" in capsys.readouterr().out
