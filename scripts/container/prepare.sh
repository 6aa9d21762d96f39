#!/usr/bin/env bash
# Make this machine ready to build the CPU variant of the tilevox image (Dockerfile target `cpu`) with no
# container registry: only the Debian archive and PyPI are reachable (see scripts/container/build-cpu.sh).
#
#   bash scripts/container/prepare.sh
#
# 1. installs docker.io (dockerd 20.10 + containerd + runc) and mmdebstrap with apt-get if missing;
# 2. starts dockerd in the background if none answers, and leaves it running (stop it with
#    scripts/container/stop-dockerd.sh PID, by the PID printed below);
# 3. builds the stand-in runtime base ($BASE_TAG) from the Debian archive if it is missing: the
#    nvidia/cuda base of the GPU image cannot be pulled here. Debian bookworm minbase (Python 3.11) with
#    python3, python3-venv, ca-certificates and passwd (useradd), and this host's CAs: outgoing TLS may be
#    re-signed by a proxy whose CA only this machine has, so the CAs are copied in at build time (never
#    committed, never in the Dockerfile) and the image is rebuilt when the host's CA set changes;
# 4. picks where the image's CPU torch comes from, like scripts/install_cpu_torch.sh: PyTorch's CPU index
#    ($TORCH_CPU_INDEX) when it answers, otherwise a local torch-2.13.0+cpu wheel for Python 3.11 (from
#    $TORCH_WHEEL_DIR, pip's $PIP_FIND_LINKS, or /opt/wheels) imported as a one-file image ($WHEELS_TAG)
#    that the build mounts (build arg TORCH_WHEELS), with PyPI as the index for torch's dependencies.
#
# stdout: key=value lines for scripts/container/build-cpu.sh and tests/test_container.py:
#   dockerd_pid= (empty unless this script started dockerd)  dockerd_log=  runtime_base=  torch_wheels=
#   torch_index_url=  torch_version=
# Progress and errors go to stderr. Needs root (apt-get, dockerd).
set -euo pipefail

BASE_TAG=${BASE_TAG:-tilevox-ci/runtime-base:bookworm}
WHEELS_TAG=${WHEELS_TAG:-tilevox-ci/torch-wheels:2.13.0-cpu-cp311}
SUITE=bookworm  # Python 3.11: the local CPU wheel is cp311
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/tilevox-container.XXXXXX)}

log() { printf '[%(%H:%M:%S)T] prepare: %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

# 1. tools -------------------------------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v curl >/dev/null ||
  [ ! -x /usr/bin/docker ]; then
  log "installing docker.io mmdebstrap curl (apt-get; log: $LOGDIR/apt.log)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io mmdebstrap ca-certificates curl; } \
    >"$LOGDIR/apt.log" 2>&1 || { tail -20 "$LOGDIR/apt.log" >&2; die "apt-get install docker.io mmdebstrap failed"; }
fi
# /usr/bin/docker is the 20.10 client shipped with the engine: it drives the engine's built-in BuildKit
# (a newer client elsewhere on PATH may need buildx, which is not installed).
docker() { /usr/bin/docker "$@"; }
export DOCKER_BUILDKIT=1

# 2. engine ------------------------------------------------------------------------------------------
dockerd_pid=
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd (log: $LOGDIR/dockerd.log)"
  # its own session, output to a file: it outlives this script, and a caller reading our stdout gets EOF
  setsid dockerd >"$LOGDIR/dockerd.log" 2>&1 </dev/null &
  dockerd_pid=$!
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 "$LOGDIR/dockerd.log" >&2; kill "$dockerd_pid" 2>/dev/null; die "dockerd did not answer within 60 s"; }
fi
echo "dockerd_pid=$dockerd_pid"
echo "dockerd_log=${dockerd_pid:+$LOGDIR/dockerd.log}"

# 3. stand-in runtime base ---------------------------------------------------------------------------
CA_SUM=$(cat /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -c1-16)
have=$(docker image inspect -f '{{index .Config.Labels "host-ca"}}' "$BASE_TAG" 2>/dev/null || true)
if [ "$have" != "$CA_SUM" ]; then
  log "building the stand-in base $BASE_TAG from Debian $SUITE (mmdebstrap; log: $LOGDIR/mmdebstrap.log)"
  # shellcheck disable=SC2016  # "$1" in the hooks is mmdebstrap's: the chroot directory
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1"/usr/local/share/ca-certificates/ 2>/dev/null || true' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null 2>&1' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    "$SUITE" - 2>"$LOGDIR/mmdebstrap.log" |
    docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' \
      --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
      --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
      --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
      --change "LABEL host-ca=$CA_SUM" \
      --change 'CMD ["bash"]' - "$BASE_TAG" >/dev/null ||
    { tail -20 "$LOGDIR/mmdebstrap.log" >&2; die "could not build the stand-in base $BASE_TAG"; }
fi
echo "runtime_base=$BASE_TAG"

# 4. the CPU torch -----------------------------------------------------------------------------------
if curl -fsS --max-time 5 -o /dev/null "${TORCH_CPU_INDEX%/}/torch/" 2>/dev/null; then
  log "torch $TORCH_VERSION+cpu from $TORCH_CPU_INDEX"
  echo "torch_wheels=scratch"
  echo "torch_index_url=$TORCH_CPU_INDEX"
else
  wheel=
  for dir in ${TORCH_WHEEL_DIR:-} ${PIP_FIND_LINKS:-} /opt/wheels; do
    for w in "$dir"/torch-"$TORCH_VERSION"+cpu-cp311-cp311-*linux*_x86_64.whl; do
      [ -f "$w" ] && { wheel=$w; break 2; }
    done
  done
  [ -n "$wheel" ] || die "$TORCH_CPU_INDEX is unreachable and no torch-$TORCH_VERSION+cpu-cp311 wheel was found (set TORCH_WHEEL_DIR)"
  sum=$(sha256sum "$wheel" | cut -c1-16)
  if [ "$(docker image inspect -f '{{index .Config.Labels "wheel-sha256"}}' "$WHEELS_TAG" 2>/dev/null || true)" != "$sum" ]; then
    log "$TORCH_CPU_INDEX is unreachable: importing $wheel as $WHEELS_TAG"
    tar -C "$(dirname "$wheel")" -c "$(basename "$wheel")" |
      docker import --change "LABEL wheel-sha256=$sum" - "$WHEELS_TAG" >/dev/null
  fi
  echo "torch_wheels=$WHEELS_TAG"
  echo "torch_index_url=https://pypi.org/simple"
fi
echo "torch_version=$TORCH_VERSION+cpu"
