#!/usr/bin/env bash
# tests/vm/trixie-kernel.sh: prints the path of Debian trixie's stock kernel image in the VM
# kit's cache (tests/vm/cache/trixie, which is also the MODROOT for run-in-vm.sh), fetching
# it first when the cache has none. ublk needs this kernel; the kit's default lacks it.
set -euo pipefail
vm=$(cd "$(dirname "$0")" && pwd)
trixie=$vm/cache/trixie
kernel=$(ls "$trixie"/boot/vmlinuz-* 2>/dev/null | head -n1 || true)
if [ -z "$kernel" ]; then
  bash "$vm/fetch-kernel.sh" "$trixie" trixie >/dev/null
  kernel=$(ls "$trixie"/boot/vmlinuz-* | head -n1)
fi
echo "$kernel"
