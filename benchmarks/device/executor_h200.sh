#!/usr/bin/env bash
# H200 run of the executor (issue 12); `executor_h200.sh final`: tests, synth, breakdown and both load curves at once.
# `executor_h200.sh tests`: the GPU tests (graph replay equals the eager executor bit for bit; slot reuse;
# capacity), `tilevox synth` with --cuda-graphs auto, and the frame
# breakdown (benchmarks/frame_breakdown.py: step time by phase, graphs off vs on). `executor_h200.sh bench`:
# a torch.profiler kernel table of the graphed steps at 1 and 32 streams (profile.txt), then `tilevox bench` (TTFA,
# RTF, stalls, throughput) with the graphs on vs off, side by side in one run.
# Carried (gitignored): .whl (Python 3.12 wheels the image lacks, from `pip download --python-version 3.12 ...`:
# fastapi starlette uvicorn websockets grpcio-health-checking==1.84.0 (the image's grpcio is 1.84) protobuf soundfile cffi pycparser soxr pydantic
# pydantic_core annotated-types typing-inspection anyio typing_extensions opentelemetry-api); no kernel library needed.
set -uo pipefail
part=${1:-tests}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
source benchmarks/device/shim.sh  # tilevox importable without installing it; sets repo and PYTHONPATH
cd /tmp/tilevox-src  # not the repo root: its tilevox/ (the namespace's __init__ alone) would shadow the shim
gpu_tests() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
  date -u +%FT%TZ >> "$OUT/gpu.txt"
  echo "commit ${TILEVOX_COMMIT:-unknown}" >> "$OUT/gpu.txt"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs -c "$repo/pyproject.toml" --rootdir "$repo" \
    "$repo/tests/executor" "$repo/tests/models/test_capacity.py" > "$OUT/gpu_tests.log" 2>&1; tail -4 "$OUT/gpu_tests.log"
}
synths() {
  local text="Streaming speech synthesis on a Hopper GPU, one frame at a time."
  for model in random:qwen3-tts-0.6b random:llama-1b; do
    timeout 50 python3 -m tilevox.server.cli synth --model "$model" --device cuda --cuda-graphs auto --quiet \
      --text "$text" --out /tmp/x.wav --max-duration 4 --seed 0 2>&1 | tail -2 | tr '\n' ' ' \
      | sed "s|^|$model cuda-graphs=auto: |" | tee -a "$OUT/synth.log"; echo | tee -a "$OUT/synth.log"
  done
}
breakdown() {  # graph settings, batches
  timeout 200 python3 -m benchmarks.frame_breakdown --models qwen3-tts-0.6b,llama-1b --batches "$2" --graphs "$1" \
    --out "$OUT/frame_breakdown_h200.json" 2>&1 | tee "$OUT/frame_breakdown.log"
}
bench() {  # name, then tilevox bench arguments (4 s requests, closed loop; PNGs are drawn from the JSON later)
  local name=$1; shift
  timeout 170 python3 -m tilevox.server.cli bench --device cuda --max-duration 4 --rounds 2 --no-plot \
    --out "/tmp/bench/$name.json" "$@" 2>&1 | tail -6 | sed "s|^|$name: |" | tee -a "$OUT/bench.log"
  python3 -c "import json,os,sys; p=sys.argv[1]; r=json.load(open(p)); r['commit']=os.environ.get('TILEVOX_COMMIT','unknown'); json.dump(r,open(p,'w'),indent=1)" "/tmp/bench/$name.json" && cp "/tmp/bench/$name.json" "$OUT/"
}
mkdir -p /tmp/bench
case $part in
  tests) gpu_tests; synths; breakdown off,on 1,8,32 ;;
  bench)
    timeout 150 python3 -m benchmarks.frame_breakdown --models qwen3-tts-0.6b,llama-1b --batches 1,32 --graphs on \
      --warmup 8 --steps 4 --out /tmp/profiled.json --profile-out "$OUT/profile.txt" 2>&1 | tail -4
    bench qwen_graphs --model random:qwen3-tts-0.6b --levels 1,8,32,64 --serve-arg=--cuda-graphs --serve-arg=auto
    bench qwen_eager --model random:qwen3-tts-0.6b --levels 1,8,32 --serve-arg=--cuda-graphs --serve-arg=off
    bench llama_graphs --model random:llama-1b --levels 1,8,32 --serve-arg=--cuda-graphs --serve-arg=auto ;;
  final)  # the landed state in one call: GPU tests, synth, breakdown with the graphs on, both models' load curves
    gpu_tests; synths; breakdown on 1,8,32,64
    bench qwen_graphs --model random:qwen3-tts-0.6b --levels 1,8,32,64 --serve-arg=--cuda-graphs --serve-arg=auto
    bench llama_graphs --model random:llama-1b --levels 1,8,32,64 --serve-arg=--cuda-graphs --serve-arg=auto ;;
  *) echo "usage: executor_h200.sh tests|bench|final" >&2; exit 2 ;;
esac
for log in /tmp/bench/*.server.log; do echo "== $log (last lines)"; tail -8 "$log"; done >> "$OUT/bench.log"
