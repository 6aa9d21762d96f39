"""benchmarks.tiling_prediction: the calibrated simulator's predictions for tilings no GPU has run, from the
committed H100 profile (CPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tilevox.engine_builder.regions import TilingConfig

tiling_prediction = pytest.importorskip("benchmarks.tiling_prediction", reason="needs the repository's benchmarks/")
PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "megakernel_variants_h100_e666ade.json"


def test_tiling_names_apply_in_order():
    base = TilingConfig(sm_balanced=True, reduce_single_partition=True)
    tiling = tiling_prediction.tiling_of(base, "onepart+split+attn8")
    assert (tiling.reduce_single_partition, tiling.split_qkv, tiling.attn_rows, tiling.sm_balanced) == (
        False,
        True,
        8,
        True,
    )
    with pytest.raises(ValueError, match="unknown tiling"):
        tiling_prediction.tiling_of(base, "split+nonesuch")


def test_split_qkv_is_predicted_faster_for_the_qwen_predictor(tmp_path):
    """Calibrated per batch on the balanced Llasa launches, the predictor loop with balanced q/k/v tiles is
    predicted faster than with one whole head per tile, at batch 1 and 32."""
    out = tmp_path / "prediction.json"
    argv = ["--profile", str(PROFILE), "--fit", "default@balanced", "--tilings", "balanced,split"]
    assert tiling_prediction.main([*argv, "--models", "qwen3-tts-0.6b-predictor", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    ms = {(r["batch"], r["tiling"]): r["predicted_ms"] for r in report["rows"]}
    assert sorted(ms) == [(1, "balanced"), (1, "split"), (32, "balanced"), (32, "split")]
    for batch in (1, 32):
        assert 0 < ms[(batch, "split")] < ms[(batch, "balanced")]
    assert report["tilings"]["split"]["split_qkv"] is True and report["gpu"].startswith("NVIDIA H100")


def test_unknown_models_are_refused(capsys):
    argv = ["--profile", str(PROFILE), "--tilings", "split", "--models", "qwen3-tts-0.6b-talker,llama-70b"]
    with pytest.raises(SystemExit):
        tiling_prediction.main(argv)
    assert "unknown models ['llama-70b']" in capsys.readouterr().err


def test_the_codec_transformer_region_is_predicted(tmp_path):
    """The Qwen3-TTS codec's sliding-window transformer (12 Hz decoder shapes, meta device) compiles and
    simulates at both calibrated batch sizes; more rows take longer."""
    out = tmp_path / "codec.json"
    argv = ["--profile", str(PROFILE), "--tilings", "balanced", "--models", "qwen3-tts-codec-transformer"]
    assert tiling_prediction.main([*argv, "--out", str(out)]) == 0
    ms = {r["batch"]: r["predicted_ms"] for r in json.loads(out.read_text())["rows"]}
    assert sorted(ms) == [1, 32] and 0 < ms[1] < ms[32]
