#!/usr/bin/env bash
# Build the CPU variant of the tilevox image (Dockerfile target `cpu`) on a machine with no container
# registry, as CI does (tests/test_container.py):
#
#   bash scripts/container/build-cpu.sh            # image tilevox:cpu (IMAGE=... to name it otherwise)
#   docker run --rm -p 8000:8000 -p 50051:50051 tilevox:cpu     # /usr/bin/docker; serves random:llama-tiny
#
# scripts/container/prepare.sh first (docker engine, the Debian stand-in for the nvidia/cuda runtime base,
# the CPU torch's source); then `docker build --target cpu` of the repository's Dockerfile with those
# build arguments (the kernels stage and its nvidia/cuda base are never built). Everything else in the
# Dockerfile is what the GPU image runs. A dockerd started here is left running: its PID is printed
# (stop it with scripts/container/stop-dockerd.sh PID).
#
# stdout: prepare.sh's key=value lines, then image= and build_log=. Progress and errors go to stderr;
# on a failed build, the tail of the build log. Needs root.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-tilevox:cpu}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/tilevox-container.XXXXXX)}
export LOGDIR

log() { printf '[%(%H:%M:%S)T] build-cpu: %s\n' -1 "$*" >&2; }

prepared=$(bash scripts/container/prepare.sh) || { printf '%s\n' "$prepared"; exit 1; }
printf '%s\n' "$prepared"
get() { printf '%s\n' "$prepared" | sed -n "s/^$1=//p"; }

log "docker build --target cpu -t $IMAGE . (log: $LOGDIR/build.log)"
if ! DOCKER_BUILDKIT=1 /usr/bin/docker build --progress=plain --target cpu -t "$IMAGE" \
  --build-arg "RUNTIME_BASE=$(get runtime_base)" \
  --build-arg "TORCH_WHEELS=$(get torch_wheels)" \
  --build-arg "TORCH_INDEX_URL=$(get torch_index_url)" \
  --build-arg "TORCH_VERSION=$(get torch_version)" \
  . >"$LOGDIR/build.log" 2>&1; then
  tail -40 "$LOGDIR/build.log" >&2
  log "error: docker build failed (full log: $LOGDIR/build.log)"
  exit 1
fi
echo "image=$IMAGE"
echo "build_log=$LOGDIR/build.log"
log "built $IMAGE"
