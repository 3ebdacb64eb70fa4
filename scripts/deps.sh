#!/usr/bin/env bash
# Installs, idempotently, the Debian 12 packages one purpose needs:
#   bash scripts/deps.sh run     build ucrypt and run it: what scripts/demo.sh needs
#   bash scripts/deps.sh bench   run + the peers `ucrypt bench` measures against
#   bash scripts/deps.sh test    bench + the test suite's other references + the VM kit
#   bash scripts/deps.sh all     all of the above (what no argument means)
# `--print` (or `--dry-run`) lists the set's packages, one a line, installed or not, and
# installs nothing. `run` leaves the host's kernel and boot files alone: the demo must not
# rebuild a newcomer's initramfs before it has shown anything. Only `test` and `all` install a
# kernel (through tests/vm/install-deps.sh); `bench` has fuse3, whose postinst also rebuilds
# the initramfs.
set -euo pipefail
VM_KIT=$(dirname "$0")/../tests/vm/install-deps.sh

# Each package is listed once, in the smallest set that needs it; bigger sets include smaller
# ones (every set builds ucrypt, and the test suite runs `ucrypt bench all`: bench_all.rs).
RUN=(
  # a C toolchain: rustc links through `cc`, and aws-lc-sys (the ciphers) compiles C; a
  # minimal Debian root has none (docs/architecture.md, "What the demo needs on a fresh machine")
  build-essential
  # the ublk crate generates its kernel bindings with bindgen, which needs libclang;
  # build scripts ask pkg-config for system libraries (aws-lc-sys, for a system AWS-LC)
  libclang-dev pkg-config
  # the demo's filesystem steps: mkfs.ext4, debugfs, e2fsck (e2fsprogs); losetup, mount,
  # umount (Debian ships them in `mount`); mountpoint (util-linux)
  e2fsprogs mount util-linux
  # the demo reads the volume back over NBD with nbdcopy (else it falls back to qemu-img);
  # the tests' NBD clients too (nbdinfo, nbdcopy, nbdfuse)
  libnbd-bin
)
# Deliberately not in RUN, though the demo can use them:
# - fuse3: as root ucrypt mounts FUSE with mount(2) and needs no fusermount3 (without root the
#   demo installs nothing and needs an installed one); and fuse3's postinst runs
#   update-initramfs, which is the test rig's business, not the demo's.
# - cryptsetup-bin: ucrypt needs no cryptsetup, and the demo's cross-check with it runs only
#   where it is installed; it would also bring device-mapper's dmsetup (which has an initramfs
#   hook) where systemd has not already. BENCH has it.
BENCH=(
  # the peers: qemu-storage-daemon (qemu-system-common; LUKS1 over NBD and FUSE) and
  # nbdkit's luks filter (LUKS1 over NBD); qemu-img bench as a second NBD client
  qemu-system-common nbdkit qemu-utils
  # fio drives the jobs; cryptsetup makes the LUKS images; fusermount3 unmounts the peers' FUSE
  fio cryptsetup-bin fuse3
  # the font PNG plots are drawn with (SVGs need none)
  fonts-dejavu-core
)
TEST=(
  # independent references for the sector layer: differential test and NIST XTSVS vectors
  python3-cryptography python3-cryptography-vectors
  # Prometheus' own text-format parser reads `--metrics` scrapes (tests/metrics_scrape.rs)
  python3-prometheus-client
  # TLS test certificates
  openssl
  # suspend/resume (tests/lifecycle.rs): fio writes through a suspend and verifies after
  # resume; gdb's gcore dumps the daemon to look for the volume key
  fio gdb
  # the single-node Ceph cluster of scripts/ceph-cluster.sh (mon, OSD, the ceph and rbd
  # commands, librbd and librados) and librbd's header for the FFI declarations of ucrypt-rbd;
  # qemu's rbd driver, which reads images librbd's own LUKS encryption made (ucrypt-rbd tests)
  ceph-mon ceph-osd ceph-common librbd-dev qemu-block-extra
  # libnbd's Python binding: the client of the NBD kill -9 test (tests/kill9.rs)
  python3-libnbd
  # cryptsetup's LUKS2 validation suite (tests/luks2_validation.rs): its generators edit the
  # base header with jq and dd, unpacked with xz
  jq xz-utils
  # BitLocker's userspace peer (tests/bitlk_images.rs compares dislocker-file's plaintext)
  dislocker
  # the Debian packages (tests/package_deb.rs): man renders each page, lintian checks the
  # package (dpkg-deb, dpkg-shlibdeps and objcopy come with build-essential); mmdebstrap makes
  # the clean Debian root they are installed into (scripts/package-smoke.sh)
  man-db lintian mmdebstrap
)
# The kernel-in-a-VM tests (dm-crypt, ublk) add tests/vm/install-deps.sh's packages: qemu,
# a stock kernel, busybox, cryptsetup, dmsetup.

usage() { echo "usage: bash scripts/deps.sh [run|test|bench|all] [--print]" >&2; exit 2; }
set_name= print=
for a in "$@"; do
  case $a in
    run | test | bench | all) [ -z "$set_name" ] || usage; set_name=$a ;;
    --print | --dry-run) print=1 ;;
    *) usage ;;
  esac
done
# No argument means everything, as before the sets existed.
set_name=${set_name:-all}
vm=
case $set_name in
  run) APT_PACKAGES=("${RUN[@]}") ;;
  bench) APT_PACKAGES=("${RUN[@]}" "${BENCH[@]}") ;;
  test | all) APT_PACKAGES=("${RUN[@]}" "${BENCH[@]}" "${TEST[@]}"); vm=1 ;;
esac

if [ -n "$print" ]; then
  { printf '%s\n' "${APT_PACKAGES[@]}"; [ -z "$vm" ] || bash "$VM_KIT" --print; } | awk '!seen[$0]++'
  exit 0
fi

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
# Without root the VM tests print SKIPPED (CI runs as root and fails instead).
if [ -n "$vm" ] && [ "$(id -u)" = 0 ]; then bash "$VM_KIT"; fi
command -v cargo >/dev/null || { echo "deps: cargo not found (install Rust with rustup)" >&2; exit 1; }
