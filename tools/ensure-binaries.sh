#!/usr/bin/env bash
# Builds (once per pin) etcd, the Kubernetes components (kube-apiserver, and for the real
# single-node cluster of `posttrain dev up`: kubelet, kube-scheduler, kube-controller-manager,
# kube-proxy), CoreDNS, KubeRay's operator, Kueue and the MinIO server from Go modules into
# $POSTTRAIN_BIN_DIR (default ~/.cache/posttrain/bin) as <name>-<version>. A binary already
# there is reused; the build is skipped entirely.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=lib.sh
source "$here/lib.sh"
bin_dir="${POSTTRAIN_BIN_DIR:-$HOME/.cache/posttrain/bin}"
mkdir -p "$bin_dir"

if ! command -v go >/dev/null 2>&1; then
  echo "error: the Go toolchain is missing; install Go >= 1.26 (https://go.dev/doc/install) and re-run" >&2
  exit 2
fi

build() {  # name version description command...
  local name="$1" version="$2" what="$3"; shift 3
  local target="$bin_dir/$name-$version"
  if [[ -x "$target" ]]; then
    echo "[binaries] $name $version: cached at $target"
    return
  fi
  echo "[binaries] $name $version: building $what (first time only; several minutes on 2 cores)..."
  local start=$SECONDS tmp
  tmp="$(mktemp -d)"
  run_logged "[binaries] building $name $version" "$tmp.log" 30 "$@" "$tmp"
  mv "$tmp/$name" "$target.partial" && mv "$target.partial" "$target"
  rm -rf "$tmp"
  echo "[binaries] $name $version: built in $((SECONDS - start)) s -> $target"
}

build_controlplane() {  # name out_dir; builds one command of our wrapper module
  # gitVersion: without it the components report v0.0.0-master (kubelet puts it in the node).
  (cd "$here/controlplane" && go build -trimpath \
    -ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION" \
    -o "$2/$1" "./cmd/$1")
}
build_apiserver() { build_controlplane kube-apiserver "$1"; }
build_etcd() { build_controlplane etcd "$1"; }
build_kubelet() { build_controlplane kubelet "$1"; }
build_scheduler() { build_controlplane kube-scheduler "$1"; }
build_controller_manager() { build_controlplane kube-controller-manager "$1"; }
build_proxy() { build_controlplane kube-proxy "$1"; }
build_coredns() {
  GOBIN="$1" GOFLAGS="-trimpath" go install -ldflags="-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
}
build_kuberay() {
  GOBIN="$1" GOFLAGS="-trimpath" go install -ldflags="-s -w" \
    "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
  mv "$1/ray-operator" "$1/kuberay-operator"
}
build_kueue() {
  GOBIN="$1" GOFLAGS="-trimpath" go install -ldflags="-s -w" "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
}
build_minio() {
  # MinIO (AGPL-3.0) is installed unmodified as a separate program, never linked.
  GOBIN="$1" GOFLAGS="-trimpath" go install -ldflags="-s -w" "github.com/minio/minio@$MINIO_VERSION"
}

build etcd "$ETCD_VERSION" "etcd from go.etcd.io/etcd/server/v3" build_etcd
build kube-apiserver "$K8S_VERSION" "kube-apiserver from k8s.io/kubernetes" build_apiserver
build minio "$MINIO_VERSION" "the MinIO server from github.com/minio/minio" build_minio
build kubelet "$K8S_VERSION" "kubelet from k8s.io/kubernetes" build_kubelet
build kube-scheduler "$K8S_VERSION" "kube-scheduler from k8s.io/kubernetes" build_scheduler
build kube-controller-manager "$K8S_VERSION" "kube-controller-manager from k8s.io/kubernetes" build_controller_manager
build kube-proxy "$K8S_VERSION" "kube-proxy from k8s.io/kubernetes" build_proxy
build coredns "$COREDNS_VERSION" "CoreDNS from github.com/coredns/coredns" build_coredns
build kuberay-operator "$KUBERAY_VERSION" "KubeRay's operator from github.com/ray-project/kuberay/ray-operator" build_kuberay
build kueue "$KUEUE_VERSION" "Kueue from sigs.k8s.io/kueue" build_kueue
