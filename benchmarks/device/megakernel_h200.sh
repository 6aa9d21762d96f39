#!/usr/bin/env bash
# H200 megakernel verification: (A) the correctness matrix against the fp32 PyTorch reference, then (B) the
# megakernel vs conventional benchmarks, within ~8 minutes (each step under its own timeout; both scripts
# rewrite their JSON after every cell/row, so a step cut short keeps what it finished). Run through the
# device tool from the repo root, carrying the kernel library built here (`python -m trt_plugins.build`):
#   run(command="COMMIT=<sha> bash benchmarks/device/megakernel_h200.sh",
#       carry=["trt_plugins/build/libtilevox_kernels.so"])
# The device has torch 2.11+cu130 and no network. Writes to $OUT: gpu.txt, megakernel_correctness_h200.json
# (+ _tied), megakernel_h200.json and a .log per step; the last lines of each log hold the tables.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TILEVOX_KERNELS_LIB=$PWD/trt_plugins/build/libtilevox_kernels.so
COMMIT=${COMMIT:-unknown}
if [ ! -f "$TILEVOX_KERNELS_LIB" ]; then
  echo "missing $TILEVOX_KERNELS_LIB: build it here and carry it" | tee "$OUT/error.txt"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt"

# A: Llama-1B shapes (models.llama "1b" preset: Llasa-1B's untied 193,800 vocabulary), batches 1 2 7 32 64,
# contexts 1 100 1000 4000, 64 greedy steps each, split-region and CUDA-graph checks.
timeout 200 python3 benchmarks/megakernel_correctness.py --commit "$COMMIT" \
  --out "$OUT/megakernel_correctness_h200.json" 2>&1 | tee "$OUT/megakernel_correctness.log"
echo "exit ${PIPESTATUS[0]} (124: timeout)" | tee -a "$OUT/megakernel_correctness.log"
# A, quick, on the tied Llama-3.2-1B (128,256 vocabulary): batches 1 7 64, contexts 1 1000, 8 steps.
timeout 45 python3 benchmarks/megakernel_correctness.py --commit "$COMMIT" --variant llama-3.2-1b --quick \
  --steps 8 --out "$OUT/megakernel_correctness_h200_tied.json" 2>&1 | tee "$OUT/megakernel_correctness_tied.log"
echo "exit ${PIPESTATUS[0]} (124: timeout)" | tee -a "$OUT/megakernel_correctness_tied.log"

# B: Llama-3.2-1B and Llasa-1B decode steps, Qwen3-TTS-0.6B frames, batches 1 8 32; torch.compile
# (reduce-overhead) at batch 1 only, run after every other timing (the targets first).
timeout 240 python3 benchmarks/megakernel_h200.py --commit "$COMMIT" --compile-batches 1 \
  --out "$OUT/megakernel_h200.json" 2>&1 | tee "$OUT/megakernel_h200.log"
echo "exit ${PIPESTATUS[0]} (124: timeout)" | tee -a "$OUT/megakernel_h200.log"
