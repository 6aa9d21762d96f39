#!/usr/bin/env bash
# H200 run of the executor's CUDA graphs (issue 12, first part): the GPU tests (graph replay equals the
# eager executor bit for bit; slot reuse), `tilevox synth` with --cuda-graphs off vs auto, and the server's
# TTFA/throughput with the graphs off vs on, side by side in one run. Carried (gitignored): .whl (Python
# 3.12 wheels the image lacks, from `pip download --python-version 3.12 ...`; no kernel library needed).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
shim=/tmp/tilevox-src/tilevox  # tilevox importable without installing it (setup.py's package_dir, as symlinks)
mkdir -p "$shim"
ln -sf "$PWD/tilevox/__init__.py" "$shim/__init__.py"
for folder in trt_plugins models executor engine_builder server; do ln -sfn "$PWD/$folder" "$shim/$folder"; done
repo=$PWD
export PYTHONPATH=/tmp/tilevox-src:/tmp/site:$repo PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
date -u +%FT%TZ >> "$OUT/gpu.txt"
(cd /tmp/tilevox-src && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs -c "$repo/pyproject.toml" \
  --rootdir "$repo" "$repo/tests/executor" "$repo/tests/models/test_capacity.py") 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
TEXT="Streaming speech synthesis on a Hopper GPU, one frame at a time."
for model in random:qwen3-tts-0.6b random:llama-1b; do
  for graphs in off auto; do
    timeout 60 python3 -m tilevox.server.cli synth --model "$model" --device cuda --cuda-graphs $graphs --quiet \
      --text "$TEXT" --out /tmp/x.wav --max-duration 4 --seed 0 2>&1 | tail -2 | tr '\n' ' ' \
      | sed "s|^|$model cuda-graphs=$graphs: |" | tee -a "$OUT/synth.log"; echo | tee -a "$OUT/synth.log"
  done
done
timeout 150 python3 -m benchmarks.server_ttfa --model random:qwen3-tts-0.6b --device cuda --max-streams 64 \
  --levels 1,8,32,64 --rounds 2 --max-duration 2 --serve-arg=--cuda-graphs --serve-arg=auto \
  --server-log /tmp/server_qwen_auto.log --out "$OUT/ttfa_qwen_auto.json" 2>&1 | tail -7 | tee -a "$OUT/ttfa.log"
timeout 150 python3 -m benchmarks.server_ttfa --model random:qwen3-tts-0.6b --device cuda --max-streams 32 \
  --levels 1,8,32 --rounds 2 --max-duration 2 --serve-arg=--cuda-graphs --serve-arg=off \
  --server-log /tmp/server_qwen_off.log --out "$OUT/ttfa_qwen_off.json" 2>&1 | tail -6 | tee -a "$OUT/ttfa.log"
timeout 100 python3 -m benchmarks.server_ttfa --model random:llama-1b --device cuda --max-streams 32 \
  --levels 1,8,32 --rounds 2 --max-duration 2 --serve-arg=--cuda-graphs --serve-arg=auto \
  --server-log /tmp/server_llama_auto.log --out "$OUT/ttfa_llama_auto.json" 2>&1 | tail -6 | tee -a "$OUT/ttfa.log"
for log in /tmp/server_*.log; do echo "== $log (last lines)"; tail -8 "$log"; done >> "$OUT/ttfa.log"
