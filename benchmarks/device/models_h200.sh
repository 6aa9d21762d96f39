#!/usr/bin/env bash
# The H200 run behind the model figures in benchmarks/results/ (run through the device tool from the
# repo root, with the soundfile/cffi/pycparser wheels for Python 3.12 in .whl/). Writes logs and JSON to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/llasa/test_llasa_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
TEXT="Streaming speech synthesis on a Hopper GPU, one frame at a time."
for model in random:llama-1b random:qwen3-tts-0.6b; do
  name=${model#random:}
  python3 -m tilevox.server.cli synth --model "$model" --device cuda --dtype bf16 --text "$TEXT" \
    --out "/tmp/$name.wav" --max-duration 10 --seed 0 2>&1 | tee "$OUT/synth_$name.log"
done
python3 -m benchmarks.qwen3_tts_frame_timing --out "$OUT/qwen3_tts_frame_timing_h200.json" 2>&1 | tee "$OUT/qwen3_tts_frame_timing.log"
