#!/usr/bin/env bash
# Builds the Debian packages of ucrypt from this tree:
#   ucrypt          /usr/bin/ucrypt (stripped), man pages, bash/zsh/fish completions, the
#                   systemd template unit, ucrypttab.example and the user guide
#   ucrypt-bench    /usr/bin/ucrypt-bench (`ucrypt bench` runs it from beside ucrypt), its man
#                   pages (ucrypt-bench(1), one per scenario)
#   *-dbgsym        each binary's debug symbols under /usr/lib/debug/.build-id/, as Debian's
#                   automatic -dbgsym packages lay them out (gdb finds them by build id)
#
#   bash scripts/package-deb.sh [--bin-dir DIR] [--out DIR] [--fast]
#
# Without --bin-dir it builds the release profile first (`cargo build --release`) and packages
# target/release; with it, it packages the binaries already in DIR (the test suite passes its
# own debug build, so it needs no second, release build). ucrypt-bench is packaged when its
# binary is there. --out is where the .debs go (default target/debian); --fast compresses with
# gzip -1 instead of xz (for tests: the debug build's symbols are large). Prints the .debs'
# paths, one a line, last.
#
# Why dpkg-deb from a script, not cargo-deb or a debian/ folder for dpkg-buildpackage: the
# package is one binary and a few generated files, which `dpkg-deb --build` of a staged tree
# makes with only what Debian's dpkg and binutils already provide (cargo-deb would be one more
# tool to build from crates.io on every CI machine); dpkg-shlibdeps still computes the shared
# library dependencies, and the -dbgsym split is done here as dh_strip does it. A
# distribution's own source package would use debhelper; this script is what such a
# debian/rules would run between build and install.
set -euo pipefail
cd "$(dirname "$0")/.."

bin_dir= out=target/debian fast=
while [ $# -gt 0 ]; do
  case $1 in
    --bin-dir) bin_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --fast) fast=1; shift ;;
    *) echo "usage: bash scripts/package-deb.sh [--bin-dir DIR] [--out DIR] [--fast]" >&2; exit 2 ;;
  esac
done
for tool in dpkg-deb dpkg-shlibdeps objcopy readelf gzip; do
  command -v "$tool" >/dev/null || { echo "package-deb: $tool not found (apt-get install dpkg-dev binutils)" >&2; exit 1; }
done
if [ -z "$bin_dir" ]; then
  CARGO_INCREMENTAL=0 cargo build --release -p ucrypt-cli -p ucrypt-bench >&2
  bin_dir=target/release
fi
[ -x "$bin_dir/ucrypt" ] || { echo "package-deb: no $bin_dir/ucrypt" >&2; exit 1; }

umask 022
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
# "ucrypt 0.1.0 (commit, AWS-LC x.y.z)": the version is the second word.
version=$("$bin_dir/ucrypt" --version | awk '{print $2}')
arch=$(dpkg --print-architecture)
maintainer=${UCRYPT_DEB_MAINTAINER:-"ucrypt maintainers <maintainers@ucrypt.invalid>"}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
mkdir -p "$work/debian"
trap 'rm -rf "$work"' EXIT

# install_bin STAGE DBGSTAGE SRC DEST: DEST stripped as dh_strip does, its debug sections
# (compressed) into DBGSTAGE at the build id's path, linked back by .gnu_debuglink.
install_bin() {
  local stage=$1 dbg=$2 src=$3 dest=$4 id
  install -d "$stage/DEBIAN"
  install -D -m 0755 "$src" "$stage$dest"
  id=$(readelf -n "$stage$dest" | awk '/Build ID:/ {print $3}')
  [ -n "$id" ] || { echo "package-deb: $src has no build id" >&2; exit 1; }
  local debug=$dbg/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug
  mkdir -p "$(dirname "$debug")"
  objcopy --only-keep-debug --compress-debug-sections "$stage$dest" "$debug"
  chmod 0644 "$debug"
  objcopy --strip-unneeded --remove-section=.comment --remove-section=.note \
    --add-gnu-debuglink="$debug" "$stage$dest"
  echo "$id"
}

# shlibs_depends BINARY: the Depends dpkg-shlibdeps derives from its NEEDED libraries. It
# wants a debian/control beside the packages' trees (debian/PACKAGE/), as in a source package.
shlibs_depends() {
  [ -f "$work/debian/control" ] ||
    printf 'Source: ucrypt\n\nPackage: ucrypt\nArchitecture: any\n' >"$work/debian/control"
  (cd "$work" && dpkg-shlibdeps -O "${1#"$work/"}") | sed -n 's/^shlibs:Depends=//p'
}

# docs STAGE PACKAGE: copyright and changelog, as every Debian package carries them.
docs() {
  local doc=$1/usr/share/doc/$2
  install -d "$doc"
  cat >"$doc/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: ucrypt

Files: *
Copyright: the ucrypt authors
License: Apache-2.0

License: Apache-2.0
 On Debian systems, the full text of the Apache License, Version 2.0 can be found in
 /usr/share/common-licenses/Apache-2.0.
EOF
  {
    echo "$2 ($version) unstable; urgency=medium"
    echo
    echo "  * Built from the ucrypt tree at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
    echo
    echo " -- $maintainer  $(date -u -R -d "@$SOURCE_DATE_EPOCH")"
  } | gzip -9n >"$doc/changelog.gz"
}

# build STAGE PACKAGE DEPENDS EXTRA-CONTROL-LINES DESCRIPTION: DEBIAN/control, md5sums, .deb.
build() {
  local stage=$1 pkg=$2 depends=$3 extra=$4 desc=$5 deb
  install -d "$stage/DEBIAN"
  (cd "$stage" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z |
    xargs -0 -r md5sum) >"$stage/DEBIAN/md5sums"
  {
    echo "Package: $pkg"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: $maintainer"
    echo "Installed-Size: $(du -sk --exclude=DEBIAN "$stage" | cut -f1)"
    [ -z "$depends" ] || echo "Depends: $depends"
    [ -z "$extra" ] || printf '%s\n' "$extra"
    printf '%s\n' "$desc"
  } >"$stage/DEBIAN/control"
  deb=$out/${pkg}_${version}_${arch}.deb
  if [ -n "$fast" ]; then
    dpkg-deb --root-owner-group -Zgzip -z1 --build "$stage" "$deb" >/dev/null
  else
    dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
  fi
  echo "$deb"
}

# dbgsym STAGE OF-PACKAGE BUILD-ID: the -dbgsym package of a package's binary.
dbgsym() {
  # As dh_strip's: the docs are the package's own, through a symlink (a debug package holds
  # debug files only).
  install -d "$1/usr/share/doc"
  ln -s "$2" "$1/usr/share/doc/$2-dbgsym"
  build "$1" "$2-dbgsym" "$2 (= $version)" "Section: debug
Priority: optional
Auto-Built-Package: debug-symbols
Build-Ids: $3" "Description: debug symbols for $2"
}

debs=()

# --- ucrypt
s=$work/debian/ucrypt d=$work/debian/ucrypt-dbgsym
id=$(install_bin "$s" "$d" "$bin_dir/ucrypt" /usr/bin/ucrypt)
"$bin_dir/ucrypt" generate-docs "$work/gen" >&2
install -d "$s/usr/share/man/man8" "$s/usr/share/man/man5"
for page in "$work"/gen/man/*.8; do
  gzip -9n <"$page" >"$s/usr/share/man/man8/$(basename "$page").gz"
done
gzip -9n <docs/man/ucrypttab.5 >"$s/usr/share/man/man5/ucrypttab.5.gz"
install -D -m 0644 "$work/gen/completions/ucrypt.bash" "$s/usr/share/bash-completion/completions/ucrypt"
install -D -m 0644 "$work/gen/completions/_ucrypt" "$s/usr/share/zsh/vendor-completions/_ucrypt"
install -D -m 0644 "$work/gen/completions/ucrypt.fish" "$s/usr/share/fish/vendor_completions.d/ucrypt.fish"
# Debian 12 keeps units in /lib/systemd/system; the packaged binary is in /usr/bin, and the
# unit's copy-it-yourself note is for installs from source.
install -d "$s/lib/systemd/system"
sed -e 's#/usr/local/bin/ucrypt#/usr/bin/ucrypt#g' -e '/^# Install: copy to/d' \
  contrib/systemd/ucrypt@.service >"$s/lib/systemd/system/ucrypt@.service"
chmod 0644 "$s/lib/systemd/system/ucrypt@.service"
docs "$s" ucrypt
install -D -m 0644 contrib/systemd/ucrypttab.example "$s/usr/share/doc/ucrypt/examples/ucrypttab.example"
install -m 0644 README.md docs/using.md "$s/usr/share/doc/ucrypt/"
# fuse3 brings fusermount3, which only a non-root `ucrypt mount`/`open --front-end fuse`
# needs (as root ucrypt mounts with mount(2)); librbd1 is loaded at run time for rbd: volumes.
depends=$(shlibs_depends "$s/usr/bin/ucrypt")
deb=$(build "$s" ucrypt "$depends" "Section: admin
Priority: optional
Recommends: fuse3
Suggests: librbd1, cryptsetup-bin" "Description: userspace dm-crypt and LUKS2 compatible disk encryption
 ucrypt makes and opens the volumes cryptsetup makes, encrypts sectors byte for
 byte as the kernel's dm-crypt does, and serves them where dm-crypt cannot run
 (containers, micro-VMs, hosts without root) as a block device (ublk, or a loop
 device over FUSE), a FUSE file or an NBD export. cryptsetup's verb spellings,
 options and exit codes are accepted.")
debs+=("$deb")
deb=$(dbgsym "$d" ucrypt "$id")
debs+=("$deb")

# --- ucrypt-bench
if [ -x "$bin_dir/ucrypt-bench" ]; then
  s=$work/debian/ucrypt-bench d=$work/debian/ucrypt-bench-dbgsym
  id=$(install_bin "$s" "$d" "$bin_dir/ucrypt-bench" /usr/bin/ucrypt-bench)
  "$bin_dir/ucrypt-bench" generate-man "$work/gen-bench" >&2
  install -d "$s/usr/share/man/man1"
  for page in "$work"/gen-bench/*.1; do
    gzip -9n <"$page" >"$s/usr/share/man/man1/$(basename "$page").gz"
  done
  docs "$s" ucrypt-bench
  depends="$(shlibs_depends "$s/usr/bin/ucrypt-bench"), ucrypt (= $version)"
  deb=$(build "$s" ucrypt-bench "$depends" "Section: admin
Priority: optional
Suggests: fio, qemu-system-common, nbdkit, qemu-utils, cryptsetup-bin, fuse3, dislocker" "Description: benchmarks of ucrypt (ucrypt bench)
 Runs ucrypt's benchmark scenarios (cipher, engine, FUSE, NBD, integrity,
 foreign formats, remote storage) side by side with their peers and writes reports and plots.")
  debs+=("$deb")
  deb=$(dbgsym "$d" ucrypt-bench "$id")
  debs+=("$deb")
fi

printf '%s\n' "${debs[@]}"
