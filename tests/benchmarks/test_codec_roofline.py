"""benchmarks/codec_roofline.py: the counted parts compose each decode (checked inside for Qwen3-TTS), and the
figures the README quotes hold: Qwen3-TTS's codec frame is weight-bound at batch 1 except its last blocks;
XCodec2's streamed block crosses the ridge at about one window."""

from __future__ import annotations

import importlib
import json


def test_codec_roofline_counts(tmp_path):
    roofline = importlib.import_module("benchmarks.codec_roofline")
    out = tmp_path / "roofline.json"
    assert roofline.main(["--out", str(out)]) == 0
    qwen, xcodec2 = json.loads(out.read_text())["codecs"]
    parts = {r["part"]: r for r in qwen["parts"]}
    assert parts["transformer (8 layers)"]["ridge_batch"] > 100  # one row: pure weight streaming
    assert parts["decoder block x3 (96 channels)"]["ridge_batch"] < 1  # 1,920 rows: FLOPs-bound at batch 1
    assert [r["rows"] for r in qwen["parts"]][-1] == 1920  # 24 kHz / 12.5 Hz samples per frame
    assert 4e9 < sum(r["flops"] for r in qwen["parts"]) < 6e9
    assert all(r["rows"] == 163 for r in xcodec2["parts"])
    flops = sum(r["flops"] for r in xcodec2["parts"])
    weights = sum(r["weight_bytes"] for r in xcodec2["parts"])
    ridge = weights / roofline.PEAK_BYTES_S / (flops / roofline.PEAK_FLOPS)
    assert 1.0 < ridge < 1.5
    assert out.with_suffix(".md").read_text().count("| **total** |") == 2
