#!/usr/bin/env bash
# Ray Serve for a device machine (issue 17's two-GPU run; its one-GPU baseline): the image has no Ray, and the
# ray 2.60.0 wheel alone (79 MB) is over what one call may carry (64 MiB). This downloads the Python 3.12 wheels of
# ray[serve]==2.60.0 (the `ray` extra) and its dependencies, unpacks them into one site directory without what the
# image has (numpy; grpcio, whose 1.84 the image keeps, grpcio-health-checking being pinned to it) and what a Serve
# run here does not use (Ray's Java jars, RLlib, virtualenv for runtime environments, py-spy for the dashboard's
# profiler) or what .whl carries already, and writes .device-carry/ray/site.tar.xz. On the device, before the run:
#   mkdir -p /tmp/site && tar -xJf .device-carry/ray/site.tar.xz -C /tmp/site   (then PYTHONPATH=/tmp/site:...)
# Carry .device-carry/ray with .whl: all three with the tilevox tree must stay under 64 MiB (the script prints the sum).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$work/wheels" "ray[serve]==2.60.0"
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do
  name=$(basename "$wheel")
  case $name in
    numpy-* | grpcio-1* | virtualenv-* | py_spy-*) continue ;;
  esac
  # The wheels .whl carries already (benchmarks/device/executor_h200.sh's list: fastapi, pydantic, ...).
  [ -n "$(ls "$repo/.whl/${name%%-*}-"*.whl 2> /dev/null)" ] && continue
  unzip -q -o "$wheel" -d "$work/site"  # keeps the executables' mode bits (raylet, gcs_server)
done
rm -rf "$work/site/ray/jars" "$work/site/ray/rllib"
mkdir -p "$repo/.device-carry/ray"
tar -C "$work/site" -cJf "$repo/.device-carry/ray/site.tar.xz" .
tree=$(cd "$repo" && git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "site.tar.xz $(du -b "$repo/.device-carry/ray/site.tar.xz" | cut -f1) + .whl $(du -sb "$repo/.whl" | cut -f1) + tree $tree bytes"
