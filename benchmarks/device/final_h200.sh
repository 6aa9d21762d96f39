#!/usr/bin/env bash
# H200 run: GPU tests (fused SwiGLU ops, TensorRT plugin through the lean runtime, models), synth with
# the fused SwiGLU MLPs off and on, and server TTFA with random:qwen3-tts-0.6b. Carried (gitignored):
# .whl (Python 3.12 wheels the image lacks), .device-carry/tv (libtilevox_kernels.so from
# `python -m tilevox.trt_plugins.build`, libtilevox_trt_plugins.so from `python -m tilevox.trt_plugins.tensorrt.build`),
# .device-carry/trt-lean (libnvinfer_lean.so.11 from tensorrt-lean-cu13-libs 11.4.0.106, xz-compressed).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
xz -dc .device-carry/trt-lean/libnvinfer_lean.so.11.xz > /tmp/libnvinfer_lean.so.11
export TILEVOX_TRT_LEAN_LIB=/tmp/libnvinfer_lean.so.11
export TILEVOX_KERNELS_LIB=$PWD/.device-carry/tv/libtilevox_kernels.so
export TILEVOX_TRT_PLUGINS_LIB=$PWD/.device-carry/tv/libtilevox_trt_plugins.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/trt_plugins/test_swiglu_ops.py \
  tests/trt_plugins/test_tensorrt_plugins.py tests/trt_plugins/test_onnx_export.py tests/trt_plugins/test_tuning_table.py \
  tests/models/test_fused_swiglu.py tests/models/llasa/test_llasa_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
TEXT="Streaming speech synthesis on a Hopper GPU, one frame at a time."
for model in random:llama-1b random:qwen3-tts-0.6b; do
  for fused in off on; do
    python3 -m tilevox.server.cli synth --model "$model" --device cuda --dtype bf16 --fused-swiglu $fused --text "$TEXT" \
      --out /tmp/x.wav --max-duration 5 --seed 0 2>&1 | tail -1 | sed "s|^|$model fused=$fused: |" | tee -a "$OUT/synth.log"
  done
done
# benchmarks/server_ttfa.py was replaced by `tilevox bench` (server/bench.py) after this run (2026-12-03).
timeout 300 python3 -m benchmarks.server_ttfa --model random:qwen3-tts-0.6b --device cuda --max-streams 32 \
  --rounds 2 --out "$OUT/server_ttfa_h200.json" 2>&1 | tail -20 | tee "$OUT/server_ttfa.log"
