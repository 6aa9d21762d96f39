#!/usr/bin/env bash
# The H200 run of the GPU tests that this stop's refactors touch: the megakernel runtime and its torch op
# (the shared `requires_megakernel` marker, `o1_random_llama`), the region backends (RoPE through the Qwen3
# adapter), Llasa on CUDA. Run through the device tool from the repo root, carrying
# trt_plugins/build/libtilevox_kernels.so (gitignored; built here with `python -m tilevox.trt_plugins.build`).
set -uo pipefail
source benchmarks/device/shim.sh  # tilevox importable without installing it; sets repo and PYTHONPATH
export TILEVOX_KERNELS_LIB=$repo/trt_plugins/build/libtilevox_kernels.so
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
(cd /tmp/tilevox-src && python3 -m pytest -q -m gpu -p no:cacheprovider -rs -c "$repo/pyproject.toml" --rootdir "$repo" \
  "$repo/tests/trt_plugins/megakernel" "$repo/tests/executor/test_megakernel_backends_cuda.py" \
  "$repo/tests/models/llasa" "$repo/tests/models/test_fused_swiglu.py") 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
