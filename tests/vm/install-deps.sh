#!/bin/bash
# Installs the Debian packages the kernel-in-a-VM tests need on the host (run as root, e.g. by CI).
# qemu-system-x86: the emulator (TCG); linux-image-amd64: a stock kernel with dm-crypt and its
# modules; the rest go into (or build) the guest's initramfs. This is the only installer of
# ucrypt's that installs a kernel, and with it (and busybox-static's and dmsetup's initramfs
# hooks) rebuilds the host's initramfs. `--print` lists the packages and installs nothing.
set -euo pipefail
PKGS="qemu-system-x86 linux-image-amd64 busybox-static cryptsetup-bin dmsetup util-linux \
  e2fsprogs kmod cpio binutils zstd xz-utils"
if [ "${1:-}" = --print ]; then printf '%s\n' $PKGS; exit 0; fi
missing=
for p in $PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"; done
[ -z "$missing" ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends keeps qemu's GUI/audio stack out; seabios and ipxe-qemu are hard deps.
apt-get install -y -qq --no-install-recommends $missing
