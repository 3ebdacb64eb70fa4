#!/usr/bin/env bash
# Keeps the demo's set-up light: `deps.sh run` (all scripts/demo.sh installs) must hold nothing
# of the VM test kit (a kernel, qemu-system-x86, busybox-static, dmsetup, cpio, ...: installing
# them regenerates the host's initramfs), `deps.sh test` must hold all of it, and the demo must
# ask for `deps.sh run` and nothing else. Installs nothing and needs no root; prints one verdict
# line and exits 0 when all of that holds, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=()

run=$(bash scripts/deps.sh run --print) || fail+=("deps.sh run --print failed")
test=$(bash scripts/deps.sh test --print) || fail+=("deps.sh test --print failed")
vm_kit=$(bash tests/vm/install-deps.sh --print) || fail+=("install-deps.sh --print failed")
[ -n "$run" ] || fail+=("the run set is empty")

has() { # has GLOB LIST: a line of LIST matches GLOB
  local p
  while IFS= read -r p; do [[ $p == $1 ]] && return 0; done <<<"$2"
  return 1
}
# In the VM kit because the guest's initramfs copies their host binaries, and in `run` because
# the demo runs mkfs.ext4, debugfs, e2fsck and mountpoint itself. Both are Priority: required,
# on every Debian system already, so listing them installs nothing.
shared=" util-linux e2fsprogs "
while IFS= read -r p; do
  [[ $shared == *" $p "* ]] && continue
  has "$p" "$run" && fail+=("run set holds $p")
  has "$p" "$test" || fail+=("test set lacks $p")
done < <(printf '%s\n' 'linux-image*' qemu-system-x86 busybox-static dmsetup cpio $vm_kit | awk '!seen[$0]++')
# Never for the demo either: the kernel's own tooling, and fuse3 (its postinst runs
# update-initramfs; as root ucrypt mounts without fusermount3).
for p in 'initramfs-tools*' 'linux-headers*' fuse3; do
  has "$p" "$run" && fail+=("run set holds $p")
done

# Ceph is for the tests (and `ucrypt bench remote`) only: ucrypt loads librbd at run time, so
# the demo's machine builds and runs it without any of Ceph's ~200 MB.
for p in 'ceph*' 'librbd*' 'librados*' qemu-block-extra; do
  has "$p" "$run" && fail+=("run set holds $p")
done
for p in ceph-mon ceph-osd ceph-common librbd-dev; do
  has "$p" "$test" || fail+=("test set lacks $p")
done

# The demo installs through `deps.sh run` only: every call of a deps script in its code (not
# its comments) must be exactly that, and it must not run apt-get itself.
code=$(grep -v '^[[:space:]]*#' scripts/demo.sh)
calls=$(grep -oE '[^[:space:]]*deps\.sh[^;&|)]*' <<<"$code" | sed 's/[[:space:]]*$//' || true)
[ -n "$calls" ] || fail+=("demo.sh does not call scripts/deps.sh run")
while IFS= read -r c; do
  [ -z "$c" ] || [ "$c" = "scripts/deps.sh run" ] || fail+=("demo.sh calls '$c'")
done <<<"$calls"
grep -qE '(^|[^[:alnum:]-])apt(-get)?[[:space:]]' <<<"$code" && fail+=("demo.sh runs apt itself")

if [ ${#fail[@]} -eq 0 ]; then
  echo "check-deps-sets: OK: run holds $(wc -l <<<"$run") packages and none of the VM kit; test holds all $(wc -l <<<"$vm_kit") of it; demo.sh calls deps.sh run only"
else
  printf -v why '%s; ' "${fail[@]}"
  echo "check-deps-sets: FAILED: ${why%; }"
  exit 1
fi
