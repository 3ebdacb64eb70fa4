#!/bin/bash
# Download Debian's cryptsetup source package (bookworm: 2.6.1) and unpack its tests/ folder
# (the LUKS2 validation suite: tests/luks2-validation-test, tests/generators/ and the base
# image luks2_valid_hdr.img.xz, the other images and compat scripts) and the files of src/
# that list its command line's options and verbs (three headers, cryptsetup.c), without touching the system's apt configuration:
# a private deb-src list on the mirror the system's own apt sources already use, as
# tests/vm/fetch-kernel.sh fetches its kernel.
#
# usage: fetch-cryptsetup-tests.sh DEST [SUITE]   -> DEST/cryptsetup-VERSION/tests/...
# crates/ucrypt-cli/tests/luks2_validation.rs calls it when it finds no unpacked copy.
set -euo pipefail
DEST=${1:?usage: fetch-cryptsetup-tests.sh DEST [SUITE]}
SUITE=${2:-bookworm}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
A=$(mktemp -d /tmp/aptcs.XXXXXX); trap 'rm -rf "$A"' EXIT
mkdir -p "$A/lists/partial" "$A/cache/archives/partial"
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list)
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $SUITE main" > "$A/sources.list"
O=(-o Dir::Etc::SourceList="$A/sources.list" -o Dir::Etc::SourceParts=/dev/null
   -o Dir::State::Lists="$A/lists" -o Dir::Cache="$A/cache")
apt-get "${O[@]}" update -qq
(cd "$A" && apt-get "${O[@]}" source --download-only -qq cryptsetup)
tarball=$(ls "$A"/cryptsetup_*.orig.tar.*)
# tests/, and the option and verb tables of cryptsetup's command line
# (tests/cryptsetup_options.rs).
tar -xf "$tarball" -C "$DEST" --wildcards '*/tests/*' '*/src/cryptsetup_arg_list.h' \
  '*/src/cryptsetup_args.h' '*/src/utils_arg_names.h' '*/src/cryptsetup.c'
ls -d "$DEST"/cryptsetup-*/tests
