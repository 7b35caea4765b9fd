#!/usr/bin/env bash
# The local base image every posttrain image builds FROM when no registry serves public bases:
# Debian 12 (bookworm) minbase + Python 3.11 (python3, python3-venv), CA certificates and
# passwd, i.e. what python:3.11-slim-bookworm provides, made from Debian's own packages with
# debootstrap. Cached by its pin (tools/versions.env BASE_IMAGE_*) as a tarball in
# $POSTTRAIN_CACHE_DIR/images, so a fresh podman store re-imports it in seconds.
#
# Usage: tools/images/base.sh            # prints the image reference on its last line
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=../versions.env
source "$here/versions.env"
# shellcheck source=../lib.sh
source "$here/lib.sh"
cache_dir="${POSTTRAIN_CACHE_DIR:-$HOME/.cache/posttrain}/images"
ref="localhost/posttrain/base:${BASE_IMAGE_SUITE}-${BASE_IMAGE_REV}"
tarball="$cache_dir/base-${BASE_IMAGE_SUITE}-${BASE_IMAGE_REV}.tar"
mkdir -p "$cache_dir"

if podman image exists "$ref"; then
  echo "[images] base $ref: present" >&2
  echo "$ref"
  exit 0
fi

if [[ ! -s "$tarball" ]]; then
  command -v debootstrap >/dev/null || { echo "error: debootstrap is missing (apt-get install debootstrap)" >&2; exit 2; }
  root="$(mktemp -d "$cache_dir/.rootfs.XXXXXX")"
  trap 'rm -rf "$root" "$tarball.partial"' EXIT
  echo "[images] base: debootstrap $BASE_IMAGE_SUITE (minbase + $BASE_IMAGE_PACKAGES), ~2 min the first time..." >&2
  start=$SECONDS
  run_logged "[images] base: debootstrap" "$cache_dir/debootstrap.log" 20 \
    debootstrap --variant=minbase --include="$BASE_IMAGE_PACKAGES" "$BASE_IMAGE_SUITE" "$root" \
    "$BASE_IMAGE_MIRROR"
  # What a registry base leaves out: package caches, apt lists, logs, the build's resolv.conf.
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log \
    "$root"/var/cache/debconf/*-old "$root"/usr/share/doc/* "$root"/usr/share/man/* \
    "$root"/usr/share/locale/*
  : >"$root/etc/resolv.conf"
  printf 'deb %s %s main\ndeb %s %s-updates main\n' "$BASE_IMAGE_MIRROR" "$BASE_IMAGE_SUITE" \
    "$BASE_IMAGE_MIRROR" "$BASE_IMAGE_SUITE" >"$root/etc/apt/sources.list"
  tar --numeric-owner -C "$root" -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"
  echo "[images] base: bootstrapped in $((SECONDS - start)) s -> $tarball" >&2
fi

podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$tarball" "$ref" >/dev/null
echo "[images] base $ref: imported from $tarball" >&2
echo "$ref"
