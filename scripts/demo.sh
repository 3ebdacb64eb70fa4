#!/usr/bin/env bash
# ucrypt's main job on an embedded default, explained step by step:
# a LUKS2 volume in a local file, served over FUSE and NBD, with a filesystem on it, data
# written and verified, and a short benchmark. Sets up what it needs (as root, the Debian
# packages ucrypt needs to build and run: `deps.sh run`, which leaves the host's kernel and
# boot files alone; without root it uses what is installed and skips the steps that need root).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${UCRYPT_DEMO_DIR:-/tmp/ucrypt-demo}
say() { printf '\n== %s\n' "$*"; }
note() { printf '   %s\n' "$*"; }
cleanup() {
  set +e
  [ -n "${MNT_FS:-}" ] && mountpoint -q "$MNT_FS" && umount "$MNT_FS"
  [ -n "${LOOP:-}" ] && losetup -d "$LOOP" 2>/dev/null
  [ -n "${FUSE_PID:-}" ] && kill -TERM "$FUSE_PID" 2>/dev/null && wait "$FUSE_PID" 2>/dev/null
  [ -n "${NBD_PID:-}" ] && kill -TERM "$NBD_PID" 2>/dev/null && wait "$NBD_PID" 2>/dev/null
}
trap cleanup EXIT
wait_for() { # wait_for SECONDS COMMAND...: poll until COMMAND succeeds
  local t=$(( $1 * 10 )); shift
  while ! "$@" 2>/dev/null; do t=$((t - 1)); [ $t -gt 0 ] || return 1; sleep 0.1; done
}

say "1. Dependencies and a release build"
if [ "$(id -u)" = 0 ]; then
  bash scripts/deps.sh run
else
  note "not root: using installed packages"
  # As root ucrypt mounts FUSE with mount(2); without root it goes through fusermount3.
  command -v fusermount3 >/dev/null \
    || { echo "demo: without root, step 3 needs fusermount3 (Debian package fuse3)" >&2; exit 1; }
fi
cargo build --release -q
U=$PWD/target/release/ucrypt
rm -rf "$DIR" && mkdir -p "$DIR"
printf 'correct horse battery staple' > "$DIR/passphrase"

say "2. Format a 256 MiB LUKS2 volume in a local file ($DIR/volume.img)"
note "cryptsetup's defaults: aes-xts-plain64, 512-bit key, 4096-byte sectors, 16 MiB data offset;"
note "argon2id here with 64 MiB and 200 ms so the demo is quick (cryptsetup uses 1 GiB, 2 s)."
truncate -s 256M "$DIR/volume.img"
$U format -q --key-file "$DIR/passphrase" --pbkdf argon2id --pbkdf-memory 65536 --iter-time 200 "$DIR/volume.img"
$U dump "$DIR/volume.img" | sed -n '1,12p' | sed 's/^/   /'
if command -v cryptsetup >/dev/null; then
  cryptsetup open --test-passphrase --key-file "$DIR/passphrase" "$DIR/volume.img" \
    && note "cryptsetup accepts the volume and the passphrase."
fi

say "3. Serve the decrypted volume as a file over FUSE and put ext4 on it"
touch "$DIR/plain"
$U mount "$DIR/volume.img" "$DIR/plain" --key-file "$DIR/passphrase" --direct-io &
FUSE_PID=$!
has_size() { [ "$(stat -c %s "$1")" -gt 0 ]; }
wait_for 30 has_size "$DIR/plain"
note "$DIR/plain is the plaintext volume: $(stat -c %s "$DIR/plain") bytes"
mkfs.ext4 -q -F -L ucrypt-demo "$DIR/plain"
head -c 8M /dev/urandom > "$DIR/random.bin"
if [ "$(id -u)" = 0 ]; then
  LOOP=$(losetup --find --show --direct-io=on "$DIR/plain")
  MNT_FS=$DIR/fs; mkdir -p "$MNT_FS"; mount "$LOOP" "$MNT_FS"
  note "attached as $LOOP and mounted on $MNT_FS"
  echo "hello from ucrypt" > "$MNT_FS/hello.txt"
  cp "$DIR/random.bin" "$MNT_FS/random.bin"
  umount "$MNT_FS"; MNT_FS=; losetup -d "$LOOP"; LOOP=
else
  note "not root: writing the files with debugfs instead of a loop mount"
  echo "hello from ucrypt" > "$DIR/hello.txt"
  debugfs -w -R "write $DIR/hello.txt hello.txt" "$DIR/plain" >/dev/null
  debugfs -w -R "write $DIR/random.bin random.bin" "$DIR/plain" >/dev/null
fi
kill -TERM $FUSE_PID; wait $FUSE_PID; FUSE_PID=
note "unmounted; everything acknowledged was flushed to $DIR/volume.img"

say "4. Serve the same volume over NBD and verify the data through it"
$U serve "$DIR/volume.img" --key-file "$DIR/passphrase" --nbd "unix:$DIR/nbd.sock" > "$DIR/serve.log" &
NBD_PID=$!
wait_for 30 grep -q '^ready' "$DIR/serve.log"
note "$(head -1 "$DIR/serve.log")"
URI="nbd+unix:///?socket=$DIR/nbd.sock"
if command -v nbdcopy >/dev/null; then
  nbdcopy "$URI" "$DIR/copy.img"
else
  qemu-img convert -f raw -O raw "$URI" "$DIR/copy.img"
fi
kill -TERM $NBD_PID; wait $NBD_PID; NBD_PID=
e2fsck -f -n "$DIR/copy.img" >/dev/null && note "e2fsck: the filesystem read over NBD is clean"
note "hello.txt over NBD: $(debugfs -R 'cat hello.txt' "$DIR/copy.img" 2>/dev/null)"
debugfs -R "dump random.bin $DIR/random.back" "$DIR/copy.img" >/dev/null 2>&1
cmp "$DIR/random.bin" "$DIR/random.back" && note "random.bin (8 MiB) read back over NBD: identical"
if cmp -s <(head -c 64M "$DIR/volume.img" | tail -c 1M) <(head -c 64M "$DIR/copy.img" | tail -c 1M); then
  echo "error: the volume file holds plaintext" >&2; exit 1
fi
note "and the volume file itself holds only ciphertext"

say "5. Short benchmark (this machine, side by side in one run)"
$U bench cipher --quick 2>/dev/null | grep -E '^(Machine|memcpy|\| (spec|---|aes-xts-plain64 \| 512))'
note "the volume engine: 4 KiB QD1 reads, one 1 MiB stream, QD1 latency under CPU load; raw vs policies"
note "each target beside what this machine allows (the same work without ucrypt, in the same run): missed only when missed against that"
$U bench engine --quick --only 1,4,5 2>/dev/null | sed '/^## Where time went/,$d'
note "every scenario with plots and the FUSE/NBD peers: ucrypt bench all --quick (about 3 minutes)"
say "Done. Files are in $DIR."
