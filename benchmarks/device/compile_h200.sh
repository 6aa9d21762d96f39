#!/usr/bin/env bash
# H200 run of the executor with Inductor-compiled regions (issue 12, `--compile on`). Parts run in the order
# given: `compile_h200.sh frames tests bench`.
#   frames MODELS BATCHES GRAPHS  frame breakdown (benchmarks/frame_breakdown.py) for the --graphs settings GRAPHS
#                          (e.g. on,compiled), with kernel tables of the steps and a cProfile of one batched prefill
#   synth MODEL ARGS... -- `tilevox synth --device cuda` (4 s, after warm-up) with the extra synth ARGS
#   tests EXPR             the GPU tests matching pytest -k EXPR ("": all)
#   pytest EXPR PATH... -- the GPU tests of these repository paths matching -k EXPR
#   bench NAME MODEL LEVELS MODE SECONDS SERVE_ARGS... --  `tilevox bench` (4 s requests) against a started
#                          server, cut after SECONDS; open loop at 8 requests/s for 20 s
#   build MODEL BATCHES ARGS... --  `tilevox build` (graph vs megakernel per region and bucket) with extra build ARGS
#                          (e.g. --measure 4), the kernel library carried in .kernels/ (built with
#                          `python -m tilevox.trt_plugins.build`; outside trt_plugins/build, so that the parts
#                          before it run without fused kernels); timed, BUILD_TIMEOUT seconds at most (300); CLI_FLAGS=-v for tracebacks
#   nhframes               NH-TTS region timings (benchmarks/device/nh_tts_frames.py), batch 1 and 32, eager and graphs
#   sampling               the sampling draw with and without executor.sampling.filter_plan's shortcuts
#   trt                    the TensorRT plugin tests (tests/trt_plugins/test_tensorrt_plugins.py) through the lean
#                          runtime: the SwiGLU plugins and the MegakernelRegion plugin (built here, --megakernel-region)
#                          enqueued and compared bit for bit with the torch ops. Carried: .device-carry/trt-lean
#                          (libnvinfer_lean.so.11 of tensorrt-lean-cu13-libs 11.4.0.106, xz), .device-carry/trt-include
#                          (the TensorRT OSS include/ headers), .kernels
#   mkvariants NAME BATCHES ARGS... --  megakernel build variants (benchmarks/megakernel_variants.py), one library
#                          each, carried in .mkvariants (built here with `python -m benchmarks.megakernel_variants build
#                          --out .mkvariants`): Llama-1B step timed and profiled per variant, outputs compared bit for bit
#                          with the default; ARGS go to the runner (--variants, and benchmarks.megakernel_profile's flags)
#   mkbench NAME ARGS... --  benchmarks/megakernel_h200.py (megakernel vs conventional CUDA graph vs torch.compile per
#                          model and batch) with ARGS, MKBENCH_TIMEOUT seconds at most (240)
#   mkprofile NAME ARGS... --  benchmarks/megakernel_profile.py (per-opcode profile and critical path) with ARGS
#   mkcodec NAME ARGS... --  benchmarks/megakernel_codec.py (the Qwen3-TTS codec transformer: megakernel region vs
#                          its conventional step eager / CUDA graph / torch.compile, and the whole frame decode) with ARGS
#   layoutab BATCHES       benchmarks/device/codec_layout_ab.py: the codec state's shifted window (3f0a486, from
#                          benchmarks/device/_decoder_3f0a486.py, written by `git show` before the call) against the ring
#   mkcorrect              the megakernel correctness matrix (benchmarks/megakernel_correctness.py, Llasa-1B shapes)
#   mkcorrectx NAME ARGS... --  the same with extra flags (e.g. benchmarks.common's tiling flags: --split-qkv on)
#   mkcorrectq NAME ARGS... --  the Qwen3-TTS correctness matrix (benchmarks/megakernel_correctness_qwen.py: talker
#                          step, code-predictor loop, codec transformer against fp32) with ARGS, MKCORRECTQ_TIMEOUT
#                          seconds at most (300); the full default matrix needs ~125 GB at batch 64 x context 4000 (an
#                          H200; on an H100 that cell is recorded as an out-of-memory error)
#   restore PATH... --     put these paths back to the landed commit first (a helper's unfinished edit in the copied
#                          working tree stays out of the run)
#   pack                   everything in $OUT into results.tgz (a call brings back 8 files at most)
# Serve flags go after the bench part's SECONDS, e.g. `--cuda-graphs on --graph-prefill on --`.
# Inductor's cache is not kept between calls (it comes to ~36 MB compressed for Qwen3-TTS-0.6B, above what a
# call may bring back), so each call compiles afresh.
# Carried (gitignored): .whl (Python 3.12 wheels the image lacks; list in executor_h200.sh).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
source benchmarks/device/shim.sh  # tilevox importable without installing it; sets repo and PYTHONPATH
mkdir -p /tmp/bench
# The carried kernel library, for every part (megakernel regions in synth/bench/pytest need it; without it they
# stay on the conventional path with a warning). `--fused-swiglu auto` picks PyTorch for every tilevox shape on
# the H200, so the library changes no conventional path.
if [ -z "${TILEVOX_KERNELS_LIB:-}" ] && [ -f "$repo/.kernels/libtilevox_kernels.so" ]; then
  export TILEVOX_KERNELS_LIB=$repo/.kernels/libtilevox_kernels.so
fi
cd /tmp/tilevox-src  # not the repo root: its tilevox/ (the namespace's __init__ alone) would shadow the shim
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; echo "commit ${TILEVOX_COMMIT:-unknown}"; } > "$OUT/gpu.txt"
while [ $# -gt 0 ]; do
  part=$1; shift
  case $part in
    frames)
      models=$1 batches=$2 graphs=$3; shift 3
      timeout 420 python3 -m benchmarks.frame_breakdown --models "$models" --batches "$batches" --graphs "$graphs" \
        --out "$OUT/frame_breakdown_${models//,/_}.json" --profile-out "$OUT/profile_${models//,/_}.txt" 2>&1 \
        | grep -v "^ " | tee -a "$OUT/frames.log" ;;
    synth)
      model=$1; shift; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      timeout "${SYNTH_TIMEOUT:-200}" python3 -m tilevox.server.cli synth --model "$model" --device cuda --quiet --seed 0 --max-duration 4 \
        --text "Streaming speech synthesis on a Hopper GPU, one frame at a time." --out /tmp/synth.wav "${extra[@]}" 2>&1 \
        | tail -2 | sed "s|^|synth $model ${extra[*]}: |" | tee -a "$OUT/synth.log" ;;
    tests)
      expr=$1; shift  # pytest -k expression ("" = all)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs -c "$repo/pyproject.toml" --rootdir "$repo" \
        -k "$expr" "$repo/tests/executor" "$repo/tests/models/test_capacity.py" "$repo/tests/models/test_slot_attention.py" \
        > "$OUT/gpu_tests.log" 2>&1
      tail -4 "$OUT/gpu_tests.log" ;;
    pytest)  # pytest EXPR PATH... -- : the GPU tests of these paths matching -k EXPR (megakernel ones need
      # TILEVOX_KERNELS_LIB, e.g. the carried .kernels/libtilevox_kernels.so)
      expr=$1; shift; paths=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do paths+=("$repo/$1"); shift; done; shift || true
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs -c "$repo/pyproject.toml" --rootdir "$repo" \
        -k "$expr" "${paths[@]}" > "$OUT/gpu_pytest.log" 2>&1
      tail -15 "$OUT/gpu_pytest.log" ;;
    bench)
      name=$1 model=$2 levels=$3 mode=$4 seconds=$5; shift 5
      serve=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do serve+=("--serve-arg=$1"); shift; done; shift || true
      start=$(date +%s)
      timeout "$seconds" python3 -m tilevox.server.cli bench --device cuda --model "$model" --levels "$levels" --mode "$mode" \
        --rate 8 --duration 20 --max-duration 4 --no-plot --out "/tmp/bench/$name.json" "${serve[@]}" 2>&1 | tail -8 | sed "s|^|$name: |" \
        | tee -a "$OUT/bench.log"
      echo "$name: $(( $(date +%s) - start )) s with server start-up" | tee -a "$OUT/bench.log"
      python3 -c "import json,os,sys; p=sys.argv[1]; r=json.load(open(p)); r['commit']=os.environ.get('TILEVOX_COMMIT','unknown'); json.dump(r,open(p,'w'),indent=1)" "/tmp/bench/$name.json" \
        && cp "/tmp/bench/$name.json" "$OUT/"
      gzip -c "/tmp/bench/$name.server.log" > "$OUT/$name.server.log.gz" ;;
    build)
      model=$1 batches=$2; shift 2; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      export TILEVOX_KERNELS_LIB=${TILEVOX_KERNELS_LIB:-$repo/.kernels/libtilevox_kernels.so}
      start=$(date +%s)
      timeout "${BUILD_TIMEOUT:-300}" python3 -m tilevox.server.cli ${CLI_FLAGS:-} build --model "$model" --batches "$batches" \
        --out "$OUT/build_${model#random:}" "${extra[@]}" 2>&1 | grep -v '^\s*$' | tail -14 | sed "s|^|build $model: |" \
        | tee -a "$OUT/build.log"
      echo "build $model: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log" ;;
    nhframes)  # benchmarks/device/nh_tts_frames.py: NH-TTS (Dia-1.6B shapes) encoder, decoder step, DAC chunk
      timeout 300 python3 -m benchmarks.device.nh_tts_frames --out "$OUT/nh_tts_frames.json" 2>&1 | tail -20 \
        | tee "$OUT/nhframes.log" ;;
    sampling)  # benchmarks/sampling_plan.py: the draw with and without filter_plan's shortcuts, CUDA graphs
      timeout 120 python3 -m benchmarks.sampling_plan --out "$OUT/sampling_plan.json" 2>&1 | tee "$OUT/sampling.log" ;;
    trt)
      xz -dc "$repo/.device-carry/trt-lean/libnvinfer_lean.so.11.xz" > /tmp/libnvinfer_lean.so.11
      TILEVOX_TRT_LEAN_LIB=/tmp/libnvinfer_lean.so.11 TENSORRT_INCLUDE_DIR="$repo/.device-carry/trt-include" \
        CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TILEVOX_KERNELS_LIB=${TILEVOX_KERNELS_LIB:-$repo/.kernels/libtilevox_kernels.so} \
        timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -c "$repo/pyproject.toml" --rootdir "$repo" \
        "$repo/tests/trt_plugins/test_tensorrt_plugins.py" > "$OUT/trt_tests.log" 2>&1
      tail -15 "$OUT/trt_tests.log" ;;
    mkvariants)
      name=$1 batches=$2; shift 2; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      timeout "${MKVARIANTS_TIMEOUT:-420}" python3 -m benchmarks.megakernel_variants run --libs "$repo/.mkvariants" --out "$OUT/$name.json" \
        --batches "$batches" --commit "${TILEVOX_COMMIT:-unknown}" "${extra[@]}" > "$OUT/$name.log" 2>&1
      echo "mkvariants $name rc $?"; grep "^|\|critical path\|^batch" "$OUT/$name.log" | tail -70 ;;
    mkbench)
      name=$1; shift; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      timeout "${MKBENCH_TIMEOUT:-240}" python3 -m benchmarks.megakernel_h200 --commit "${TILEVOX_COMMIT:-unknown}" \
        --out "$OUT/$name.json" "${extra[@]}" > "$OUT/$name.log" 2>&1
      echo "mkbench $name rc $?"; grep -v "^ \|^V1\|^I1\|^W1" "$OUT/$name.log" | tail -24 ;;
    mkprofile)  # mkprofile NAME ARGS... -- : benchmarks.megakernel_profile with ARGS (e.g. --model qwen3-tts-0.6b-predictor)
      name=$1; shift; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      timeout 240 python3 -m benchmarks.megakernel_profile --commit "${TILEVOX_COMMIT:-unknown}" --out "$OUT/$name.json" \
        "${extra[@]}" > "$OUT/$name.log" 2>&1
      echo "mkprofile $name rc $?"; grep -v "^ \{4\}" "$OUT/$name.log" | tail -30 ;;
    mkcodec)  # mkcodec NAME ARGS... -- : benchmarks.megakernel_codec with ARGS (e.g. --batches 1,32 --split-qkv on)
      name=$1; shift; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      timeout "${MKCODEC_TIMEOUT:-240}" python3 -m benchmarks.megakernel_codec --commit "${TILEVOX_COMMIT:-unknown}" \
        --out "$OUT/$name.json" "${extra[@]}" > "$OUT/$name.log" 2>&1
      echo "mkcodec $name rc $?"; grep -v "^ \|^V1\|^I1\|^W1" "$OUT/$name.log" | tail -12 ;;
    layoutab)  # layoutab BATCHES: benchmarks/device/codec_layout_ab.py (the codec state's layouts, served decode)
      batches=$1; shift
      timeout "${LAYOUTAB_TIMEOUT:-150}" python3 -m benchmarks.device.codec_layout_ab --batches "$batches" \
        --commit "${TILEVOX_COMMIT:-unknown}" \
        --out "$OUT/codec_layout.json" > "$OUT/codec_layout.log" 2>&1
      echo "layoutab rc $?"; tail -7 "$OUT/codec_layout.log" ;;
    mkcorrect)
      timeout 150 python3 -m benchmarks.megakernel_correctness --commit "${TILEVOX_COMMIT:-unknown}" \
        --out "$OUT/megakernel_correctness.json" > "$OUT/correctness.log" 2>&1
      echo "mkcorrect rc $?"; tail -27 "$OUT/correctness.log" ;;
    mkcorrectx)  # mkcorrectx NAME ARGS... -- : the correctness matrix with extra flags (e.g. --split-qkv on)
      name=$1; shift; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      timeout 150 python3 -m benchmarks.megakernel_correctness --commit "${TILEVOX_COMMIT:-unknown}" "${extra[@]}" \
        --out "$OUT/megakernel_correctness_$name.json" > "$OUT/correctness_$name.log" 2>&1
      echo "mkcorrectx $name rc $?"; tail -27 "$OUT/correctness_$name.log" ;;
    mkcorrectq)  # mkcorrectq NAME ARGS... -- : the Qwen3-TTS correctness matrix with ARGS
      name=$1; shift; extra=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift || true
      timeout "${MKCORRECTQ_TIMEOUT:-300}" python3 -m benchmarks.megakernel_correctness_qwen \
        --commit "${TILEVOX_COMMIT:-unknown}" "${extra[@]}" \
        --out "$OUT/megakernel_correctness_qwen_$name.json" > "$OUT/correctness_qwen_$name.log" 2>&1
      echo "mkcorrectq $name rc $?"; tail -50 "$OUT/correctness_qwen_$name.log" ;;
    restore)
      paths=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do paths+=("$1"); shift; done; shift || true
      (cd "$repo" && git checkout HEAD -- "${paths[@]}" && git status --short | head -20) ;;
    pack)  # everything so far into one archive (a call brings back 8 files at most)
      (cd "$OUT" && tar czf results.tgz --exclude results.tgz --remove-files -- *) ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
