#!/usr/bin/env bash
# Installs ucrypt's Debian packages into a clean Debian root and uses them there, as a user of
# the packages would on a fresh machine:
#   1. the root: `mmdebstrap --variant=minbase` of this host's release from the sources apt
#      uses here (the files under /etc/apt, passed as they are, and apt's proxy settings),
#      with the packages' Depends and Recommends and man-db; kept as a tarball in the cache
#      directory, named after everything it is made from, so a rerun only unpacks it;
#   2. unpacked into a temporary directory with /dev (for /dev/fuse, /dev/loop*), /proc and
#      /sys bind-mounted; `dpkg -i` of the packages inside (so their Depends must be met by
#      what they name);
#   3. in the root: `ucrypt format`, `ucrypt open --front-end fuse`, a write through
#      /dev/ucrypt/NAME and its read-back, `ucrypt close`; open again and read back what was
#      written, close; `man -l` of every man page the packages install.
# Everything mounted under the root is unmounted and the volume closed on every exit (trap);
# the root is removed only once nothing is mounted under it.
#
#   bash scripts/package-smoke.sh DEB...
#
# Needs root, mmdebstrap, and the mirror (the first time, and whenever what the root is made
# from changes). UCRYPT_SMOKE_CACHE is the cache directory (default target/package-smoke; it
# keeps the newest root only). Exit status: 0 passed, 1 failed, 2 usage, 75 the root could not
# be made because the mirror is unreachable (the test suite reports it as SKIPPED).
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -gt 0 ] || { echo "usage: bash scripts/package-smoke.sh DEB..." >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "package-smoke: needs root (chroot, mounts, dpkg)" >&2; exit 1; }
for tool in mmdebstrap dpkg-deb chroot mount umount sha256sum; do
  command -v "$tool" >/dev/null || { echo "package-smoke: $tool not found (apt-get install mmdebstrap)" >&2; exit 1; }
done
debs=()
for d in "$@"; do
  [ -f "$d" ] || { echo "package-smoke: no such package: $d" >&2; exit 2; }
  debs+=("$(cd "$(dirname "$d")" && pwd)/$(basename "$d")")
done

# How long one step in the root may take before it counts as hung.
STEP_TIMEOUT_S=120

# --- 1. The base root, cached.
# shellcheck disable=SC1091
suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ -n "$suite" ] || { echo "package-smoke: /etc/os-release names no release (VERSION_CODENAME)" >&2; exit 1; }
arch=$(dpkg --print-architecture)
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && grep -qvE '^[[:space:]]*(#|$)' "$f" && sources+=("$f")
done
[ ${#sources[@]} -gt 0 ] || { echo "package-smoke: apt has no sources here (/etc/apt/sources.list*)" >&2; exit 1; }
aptopts=()
while IFS= read -r line; do aptopts+=(--aptopt="$line"); done < <(
  apt-config dump 2>/dev/null | grep -E '^Acquire::[a-z]+::Proxy' || true)

# The packages' own names, and what they ask for besides each other: their Depends and
# Recommends (the first of each set of alternatives, without versions).
own=()
for d in "${debs[@]}"; do own+=("$(dpkg-deb -f "$d" Package)"); done
packages=$(
  for d in "${debs[@]}"; do dpkg-deb -f "$d" Depends Recommends; done |
    sed -E 's/^(Depends|Recommends)://' | tr ',' '\n' | sed -E 's/\|.*//; s/\(.*\)//; s/:any//; s/[[:space:]]//g' |
    { grep -vxF -f <(printf '%s\n' "${own[@]}") || true; } | { cat; echo man-db; } | grep -v '^$' |
    sort -u | paste -sd, -
)
key=$({
  mmdebstrap --version
  echo "$suite $arch $packages"
  printf '%s\n' "${aptopts[@]}"
  cat "${sources[@]}"
} | sha256sum | cut -c1-16)
cache=${UCRYPT_SMOKE_CACHE:-target/package-smoke}
mkdir -p "$cache"
base=$cache/$suite-$arch-$key.tar
if [ ! -f "$base" ]; then
  echo "package-smoke: making the $suite root ($packages) from ${sources[*]}" >&2
  log=$cache/mmdebstrap.log
  if ! mmdebstrap --variant=minbase --format=tar --include="$packages" --skip=output/dev "${aptopts[@]}" \
    "$suite" "$base.part" "${sources[@]}" >"$log" 2>&1; then
    rm -rf --one-file-system "$base.part"
    if grep -qE "Failed to fetch|Could not resolve|Temporary failure resolving|Could not connect|Unable to connect|Connection timed out|Network is unreachable" "$log"; then
      echo "package-smoke: the mirror is unreachable: $(grep -m1 -E 'Failed to fetch|Could not|Temporary failure|Unable to connect|timed out|unreachable' "$log")" >&2
      exit 75
    fi
    tail -n 30 "$log" >&2
    echo "package-smoke: mmdebstrap failed (log: $log)" >&2
    exit 1
  fi
  # The newest root only: older ones were made from what is no longer asked for.
  find "$cache" -maxdepth 1 -name '*.tar' ! -name "$(basename "$base")" -delete
  mv "$base.part" "$base"
fi

# --- 2. A root of its own for this run.
root=$(mktemp -d "${TMPDIR:-/tmp}/ucrypt-smoke.XXXXXX")
# /dev is the host's: the volume's name must not meet another's under /dev/ucrypt.
name=pkgsmoke$$
opened=

# Mount points under the root, deepest first.
mounts_under_root() {
  awk -v r="$root" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}
cleanup() {
  local rc=$? m
  set +e
  if [ -n "$opened" ]; then
    timeout "$STEP_TIMEOUT_S" chroot "$root" /usr/bin/ucrypt close "$name" >/dev/null 2>&1 ||
      timeout "$STEP_TIMEOUT_S" chroot "$root" /usr/bin/ucrypt close --force "$name" >/dev/null 2>&1
    pid=$(cat "$root/run/ucrypt/$name/pid" 2>/dev/null)
    [ -z "$pid" ] || kill -9 "$pid" 2>/dev/null
    for l in $(losetup -n -O NAME -j "$root/run/ucrypt/$name/volume" 2>/dev/null); do losetup -d "$l"; done
    rm -f "/dev/ucrypt/$name"
  fi
  for m in $(mounts_under_root); do umount "$m" 2>/dev/null || umount -l "$m"; done
  if [ -n "$(mounts_under_root)" ]; then
    echo "package-smoke: still mounted under $root, left in place: $(mounts_under_root | tr '\n' ' ')" >&2
  else
    rm -rf --one-file-system "$root"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

tar -xf "$base" -C "$root" --numeric-owner
mkdir -p "$root/dev" "$root/proc" "$root/sys" "$root/tmp/debs"
mount --bind /dev "$root/dev"
mount -t proc proc "$root/proc"
mount --bind /sys "$root/sys"
cp "${debs[@]}" "$root/tmp/debs/"

# in_root CMD...: CMD in the root, with a clean environment and a bound on its time.
in_root() {
  timeout "$STEP_TIMEOUT_S" chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 "$@"
}
step() { echo "package-smoke: $*" >&2; }

step "dpkg -i ${own[*]}"
in_root sh -c 'dpkg -i /tmp/debs/*.deb' >&2
in_root dpkg-query -W -f='${Package} ${Version} ${Status}\n' "${own[@]}" >&2
in_root ucrypt --version

# --- 3. The smoke test.
step "format, open --front-end fuse, write, read back, close"
in_root truncate -s 64M /root/vol.img
printf 'package smoke passphrase' >"$root/root/pass"
in_root ucrypt format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file /root/pass /root/vol.img
opened=1
in_root ucrypt open --front-end fuse --key-file /root/pass /root/vol.img "$name" >&2
in_root ucrypt status "$name" >&2
in_root dd if=/dev/urandom of=/root/data bs=1M count=8 status=none
in_root dd if=/root/data of="/dev/ucrypt/$name" bs=1M conv=fsync,notrunc status=none
in_root dd if="/dev/ucrypt/$name" of=/root/back bs=1M count=8 status=none
in_root cmp /root/data /root/back
in_root ucrypt close "$name"
opened=
[ ! -e "/dev/ucrypt/$name" ] || { echo "package-smoke: /dev/ucrypt/$name still there after close" >&2; exit 1; }
# What was written is on the volume, encrypted: a second open reads it back, and the image
# does not hold it in the clear.
opened=1
in_root ucrypt open --front-end fuse --key-file /root/pass /root/vol.img "$name" >&2
in_root dd if="/dev/ucrypt/$name" of=/root/back bs=1M count=8 status=none
in_root cmp /root/data /root/back
in_root ucrypt close "$name"
opened=
probe=$(head -c 32 "$root/root/data" | od -An -tx1 -v | tr -d ' \n')
# (grep -c reads to the end: with -q, od would die of SIGPIPE and pipefail hide the match.)
if [ "$(od -An -tx1 -v "$root/root/vol.img" | tr -d ' \n' | grep -cF "$probe" || true)" != 0 ]; then
  echo "package-smoke: the written bytes are in the image in the clear" >&2
  exit 1
fi

step "man -l of every page"
pages=$(in_root dpkg -L "${own[@]}" | grep -E '^/usr/share/man/man[0-9]/.+\.[0-9]\.gz$' || true)
[ -n "$pages" ] || { echo "package-smoke: the packages install no man page" >&2; exit 1; }
n=0
for p in $pages; do
  # Without col(1) in the root, man keeps its overstrikes (X\bX bold, _\bX underlined).
  out=$(in_root env MANWIDTH=80 man -l "$p" 2>&1 | sed $'s/.\b//g') ||
    { echo "package-smoke: man -l $p: $out" >&2; exit 1; }
  grep -q 'NAME' <<<"$out" || { echo "package-smoke: man -l $p has no NAME section: $out" >&2; exit 1; }
  n=$((n + 1))
done
echo "package-smoke: passed in a clean $suite root: ${own[*]} installed; format, open --front-end fuse, 8 MiB written and read back, close, reopen and read back; $n man pages render"
