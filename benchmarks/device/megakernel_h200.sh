#!/usr/bin/env bash
# H200 megakernel verification, as run through the device tool (one call, ~7 minutes): the GPU tests, (B) the
# megakernel vs conventional benchmarks, (A) the correctness matrix against the fp32 PyTorch reference, then
# the per-opcode profile. Run from the repo root, carrying the kernel
# library built here (`python -m tilevox.trt_plugins.build`) and the server wheels the CLI tests import:
#   run(command="COMMIT=<sha> bash benchmarks/device/megakernel_h200.sh",
#       carry=["trt_plugins/build/libtilevox_kernels.so", ".whl"])
# The device has torch 2.11+cu130 and no network. Results (JSON + logs) go to $OUT; the committed copies are
# benchmarks/results/megakernel_*_h200.*.
set -uo pipefail
if [ -d .whl ]; then pip install --no-index --no-deps --target /tmp/site .whl/*.whl -q; fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export TILEVOX_KERNELS_LIB=${TILEVOX_KERNELS_LIB:-$PWD/trt_plugins/build/libtilevox_kernels.so}
COMMIT=${COMMIT:-unknown}
if [ ! -f "$TILEVOX_KERNELS_LIB" ]; then
  echo "missing $TILEVOX_KERNELS_LIB: build it here and carry it" | tee "$OUT/error.txt"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
timeout 100 python3 -m pytest -q -m gpu tests/trt_plugins/megakernel tests/executor/test_megakernel_backends_cuda.py \
  tests/server/test_cli_megakernel.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"
# B: Llama-3.2-1B and Llasa-1B decode steps, Qwen3-TTS-0.6B frames, batches 1 8 32; torch.compile at batch 1
# only, last (on 2026-12-02 the Qwen frame's compile did not finish inside this timeout).
timeout 270 python3 -m benchmarks.megakernel_h200 --commit "$COMMIT" --llama-variants llama-3.2-1b,llama-1b \
  --compile-batches 1 --out "$OUT/megakernel_h200.json" > "$OUT/bench.log" 2>&1
grep -v "^ \|^V1\|^I1\|^W1" "$OUT/bench.log" | tail -14
# A: Llasa-1B shapes (193,800-token untied head), batches 1 2 7 32 64 x contexts 1 100 1000 4000, 64 greedy
# steps each, split-region and CUDA-graph checks.
timeout 85 python3 -m benchmarks.megakernel_correctness --commit "$COMMIT" \
  --out "$OUT/megakernel_correctness_h200.json" > "$OUT/correctness.log" 2>&1
tail -27 "$OUT/correctness.log"
# Per-opcode profile (run separately on 2026-12-02: benchmarks/results/megakernel_profile_h200_bab722a.json).
timeout 40 python3 -m benchmarks.megakernel_profile --out "$OUT/profile.json" --batches 1,32 --commit "$COMMIT" 2>&1 | tail -26
