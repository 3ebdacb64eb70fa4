#!/usr/bin/env bash
# Installs what ucrypt's build, tests and benchmarks need on a Debian 12 machine, idempotently.
# The tests prove interoperability against real peers, so they need those peers installed.
set -euo pipefail

APT_PACKAGES=(
  # interop peers and references
  cryptsetup-bin python3-cryptography python3-cryptography-vectors
  qemu-utils nbdkit libnbd-bin python3-libnbd fio
  # TLS test certificates; qemu-storage-daemon (the FUSE/NBD peer in benchmarks)
  openssl qemu-system-common
  # FUSE front end
  fuse3 libfuse3-dev pkg-config
  # filesystems for end-to-end tests
  e2fsprogs util-linux
  # the ublk crate generates its kernel bindings with bindgen, which needs libclang
  libclang-dev
  # the font PNG plots of `ucrypt bench all` are drawn with (SVGs need none)
  fonts-dejavu-core
)

missing_packages() {
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
}
# Two passes: installing one package can remove another (Debian's qemu-system-common replaces
# a qemu-utils from backports), which the second pass puts back in the matching version.
for pass in 1 2; do
  missing_packages
  [ ${#missing[@]} -eq 0 ] && break
  if [ "$(id -u)" != 0 ]; then
    echo "deps: missing Debian packages: ${missing[*]} (run as root or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  [ "$pass" = 1 ] && apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
done
missing_packages
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: still missing after installing: ${missing[*]}" >&2
  exit 1
fi
# the kernel-in-a-VM tests (dm-crypt, ublk): qemu, a stock kernel, busybox, cryptsetup, dmsetup
if [ "$(id -u)" = 0 ]; then bash "$(dirname "$0")/../tests/vm/install-deps.sh"; fi
command -v cargo >/dev/null || { echo "deps: cargo not found (install Rust with rustup)" >&2; exit 1; }
