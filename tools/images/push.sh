#!/usr/bin/env bash
# Pushes the images `make images` built to a registry of the platform team's:
#   tools/images/push.sh REGISTRY [operator|sandbox|trainer|rollout ...]
# ghcr.io/posttrain/<name>:<tag> becomes REGISTRY/<name>:<tag>; the chart then takes
# --set images.<name>.repository=REGISTRY/<name> (docs/images.md). Log in first
# (`podman login REGISTRY`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
export CONTAINERS_CONF="$repo/tools/images/containers.conf"
registry="${1:?usage: push.sh REGISTRY [image ...]}"; shift
tag="${TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$repo/charts/posttrain/Chart.yaml")}"
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=(operator sandbox trainer rollout)
for name in "${names[@]}"; do
  podman tag "ghcr.io/posttrain/$name:$tag" "$registry/$name:$tag"
  echo "[images] pushing $registry/$name:$tag..."
  podman push "$registry/$name:$tag"
done
