#!/usr/bin/env bash
# Issue 17: Ray Serve with one replica per GPU (server/ray_serve.py, `tilevox serve --ray`) against one replica on
# one GPU, `tilevox bench` (4 s streaming requests, closed loop) against each in the same run:
#   bash benchmarks/device/ray_gpus.sh REPLICAS LEVELS [MODEL]
# e.g. on nvidia-h200-x2: `ray_gpus.sh 1,2 1,32,64,128`; on one GPU the baseline alone: `ray_gpus.sh 1 1,32,64`.
# Per replica count N, in $OUT: ray_Ngpu.json (the bench report: TTFA p50/p95/p99, RTF, stalls, audio s per s,
# and the replicas' own /metrics view), ray_Ngpu.server.log.gz. The JSONs' ratio at each level is the scaling;
# equal load per GPU compares N replicas at 2L streams with one at L. NVLink multicast stays off as the machine
# sets it (NCCL_NVLS_ENABLE=0 and the others are inherited, never overridden; tilevox uses no NCCL).
# Carried: .whl, .device-carry/ray (benchmarks/device/ray_carry.sh: Ray Serve 2.60.0 for Python 3.12).
set -uo pipefail
replicas=${1:?replica counts, e.g. 1,2} levels=${2:?stream levels, e.g. 1,32,64,128} model=${3:-random:qwen3-tts-0.6b}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
tar -xJf .device-carry/ray/site.tar.xz -C /tmp/site || exit 1
source benchmarks/device/shim.sh  # tilevox importable without installing it; sets repo and PYTHONPATH
mkdir -p /tmp/bench
cd /tmp/tilevox-src
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; echo "commit ${TILEVOX_COMMIT:-unknown}"
  env | grep -E "NVLS|MULTICAST" || true; } > "$OUT/gpu.txt"
for n in ${replicas//,/ }; do
  start=$(date +%s)
  timeout "${RAY_BENCH_TIMEOUT:-280}" python3 -m tilevox.server.cli bench --device cuda --model "$model" --levels "$levels" \
    --max-duration 4 --no-plot --out "/tmp/bench/ray_${n}gpu.json" --serve-arg=--ray --serve-arg="--num-replicas=$n" \
    2>&1 | tail -10 | sed "s|^|$n replica(s): |"
  echo "$n replica(s): $(( $(date +%s) - start )) s with Ray's and the replicas' start-up"
  cp "/tmp/bench/ray_${n}gpu.json" "$OUT/" 2> /dev/null
  gzip -c "/tmp/bench/ray_${n}gpu.server.log" > "$OUT/ray_${n}gpu.server.log.gz" 2> /dev/null
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1  # `ray stop` (unpacked wheels have no console scripts)
done
