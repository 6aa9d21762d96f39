#!/usr/bin/env bash
# The H200 run behind benchmarks/results/swiglu_auto_h200.{json,md} and models/fused_swiglu_dispatch.json
# (`--fused-swiglu auto`'s per-shape, per-token-count choice). Run through the device tool from the repo root,
# carrying trt_plugins/build/libtilevox_kernels.so (gitignored; built here with
# `.venv/bin/python -m tilevox.trt_plugins.build --jobs 2`). Writes logs and JSON to $OUT.
# Arguments go to benchmarks/swiglu/run_auto.py (e.g. --shapes / --tokens for a partial run); GIT_COMMIT names the
# checkout (the device's copy of the tree has no .git).
set -uo pipefail
source benchmarks/device/shim.sh  # tilevox importable without installing it; sets repo and PYTHONPATH
export TILEVOX_KERNELS_LIB=$PWD/trt_plugins/build/libtilevox_kernels.so
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt"
# From the shim's folder: `python -m` puts the working directory first on sys.path, and the repo root's own
# tilevox/ (only __init__.py) would hide the mapping.
(cd /tmp/tilevox-src && python3 -m pytest -q -m gpu -p no:cacheprovider -rs -c "$repo/pyproject.toml" --rootdir "$repo" \
  "$repo/tests/models/test_fused_swiglu.py" "$repo/tests/trt_plugins/test_swiglu_ops.py") > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
python3 benchmarks/swiglu/run_auto.py --out "$OUT" --git-commit "${GIT_COMMIT:-unknown}" "$@" > "$OUT/run_auto.log" 2>&1
rc=$?
grep -v "^|" "$OUT/run_auto.log" | tail -40
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/gpu.txt"
exit $rc
