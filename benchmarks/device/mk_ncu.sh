#!/usr/bin/env bash
# Nsight Compute on one megakernel launch per workload (issue 13: where a small instruction's time goes): warp stall
# reasons (WarpStateStats), scheduler and instruction statistics, and the PC-sampled stalls per SASS instruction
# (SourceCounters), for the second (warm) launch of benchmarks.megakernel_profile's program at batch 1.
#   bash benchmarks/device/mk_ncu.sh NAME PROFILE_ARGS... -- [NAME PROFILE_ARGS... --]...
# e.g. `mk_ncu.sh llama --model llama -- pred --model qwen3-tts-0.6b-predictor --`. Per NAME, in $OUT:
# NAME_details.txt (every section's body), NAME_raw.csv.gz (every collected metric), NAME_sass.csv.gz (the source page,
# SASS with per-instruction samples), NAME_functions.json (ncu_functions.py: samples and stall reasons per
# function, and the hottest code spans of NCU_FUNCTION, default op_qkv); once, megakernel_sass.txt.gz (the kernel's SASS,
# whose labels place each instruction in its function).
# Caches are not flushed between replay passes (--cache-control none): the kernel's code stays in L2 as it does
# between the steps of a served stream. Clocks are left alone (METHOD.md).
# Carried: .whl, .kernels (the library under test, or TILEVOX_KERNELS_LIB).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
source benchmarks/device/shim.sh  # tilevox importable without installing it; sets repo and PYTHONPATH
export TILEVOX_KERNELS_LIB=${TILEVOX_KERNELS_LIB:-$repo/.kernels/libtilevox_kernels.so}
cd /tmp/tilevox-src
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; echo "commit ${TILEVOX_COMMIT:-unknown}"; ncu --version | tail -1; } > "$OUT/ncu_gpu.txt"
# The megakernel's SASS with its function labels (the library's cubin that holds the kernel), for
# ncu_functions.py: which function each sampled instruction belongs to.
mkdir -p /tmp/cubins && (cd /tmp/cubins && cuobjdump -xelf all "$TILEVOX_KERNELS_LIB" > /dev/null)
cubin=$(grep -l megakernel_params /tmp/cubins/*.cubin | head -1)
nvdisasm -c "$cubin" > /tmp/megakernel.sass && gzip -c /tmp/megakernel.sass > "$OUT/megakernel_sass.txt.gz"
while [ $# -gt 0 ]; do
  name=$1; shift; args=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done; shift || true
  start=$(date +%s)
  timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --cache-control none -k regex:megakernel --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section LaunchStats \
    --section SourceCounters --section MemoryWorkloadAnalysis -f -o "/tmp/$name" \
    python3 -m benchmarks.megakernel_profile --out "/tmp/$name.profile.json" --batches 1 --iters 3 "${args[@]}" \
    > "$OUT/${name}_ncu.log" 2>&1
  echo "ncu $name rc $? ($(( $(date +%s) - start )) s)"; grep -i "error\|warn" "$OUT/${name}_ncu.log" | head -5
  ncu --import "/tmp/$name.ncu-rep" --page details --print-details all > "$OUT/${name}_details.txt" 2>&1
  ncu --import "/tmp/$name.ncu-rep" --page raw --csv 2>&1 | gzip > "$OUT/${name}_raw.csv.gz"
  ncu --import "/tmp/$name.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/${name}_sass.csv.gz"
  grep -i "duration\|stall\|warp cycles per\|issued ipc\|no instruction\|branch" "$OUT/${name}_details.txt" | head -40
  python3 "$repo/benchmarks/device/ncu_functions.py" "$OUT/${name}_sass.csv.gz" /tmp/megakernel.sass \
    --json "$OUT/${name}_functions.json" --function "${NCU_FUNCTION:-op_qkv}" | head -50
done
