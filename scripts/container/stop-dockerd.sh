#!/usr/bin/env bash
# Stop a dockerd that scripts/container/prepare.sh started, by its PID (never by name: another engine on
# the machine is left alone), then what it leaves behind: the removed containers' shims and the netns mount.
#
#   bash scripts/container/stop-dockerd.sh PID
set -uo pipefail
pid=${1:?usage: stop-dockerd.sh PID}
[ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] || { echo "stop-dockerd: $pid is not a running dockerd" >&2; exit 0; }
kill "$pid"
for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$pid" 2>/dev/null; then
  echo "stop-dockerd: dockerd $pid did not exit within 30 s" >&2
  exit 1
fi
for _ in $(seq 10); do pgrep -f 'containerd-shim-runc-v2 -namespace moby' >/dev/null || break; sleep 0.5; done
umount /run/docker/netns/default 2>/dev/null
exit 0
