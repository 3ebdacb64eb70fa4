#!/usr/bin/env bash
# NBD server benchmark: ucrypt vs qemu-storage-daemon (luks driver) vs nbdkit (luks filter),
# side by side in one run, each on its own image in /dev/shm, all over unix sockets, all
# measured by the same fio with --ioengine=nbd. Tests are interleaved round-robin (test by
# test, server by server) because this machine's clock drifts over minutes.
#
# Servers (all AES-256-XTS, plain64 IVs):
#   ucrypt-inline   `ucrypt serve --cipher aes-xts-plain64` (raw mode like cryptsetup plain, 512-bit
#                   key, 4096-byte sectors) on the engine's Volume, dispatch policy inline
#   ucrypt-auto     the same with --policy auto (large requests split across cores)
#   qsd-luks1       qemu-storage-daemon, LUKS1 image made by `qemu-img create -f luks`
#   nbdkit-luks1    nbdkit --filter=luks file, same kind of LUKS1 image
#   ucrypt-plain    ucrypt --unencrypted (protocol and server overhead only, no cipher)
#   nbdkit-file     nbdkit file plugin, no encryption (reference for the NBD path alone)
#
# Usage: bench/nbd.sh [RUNTIME_SECONDS (default 5)] [IMAGE_MIB (default 512)]
# Needs: fio, qemu-utils, qemu-system-common (qemu-storage-daemon), nbdkit, python3.
# Output: a markdown table (MiB/s and IOPS per test and server) on stdout; raw fio JSON in
# $OUT (default /dev/shm/ucrypt-nbd-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNTIME=${1:-5}
IMG_MIB=${2:-512}
OUT=${OUT:-/dev/shm/ucrypt-nbd-bench}
PASS=bench-passphrase
UCRYPT=${UCRYPT:-target/release/ucrypt}

for p in fio qemu-img qemu-storage-daemon nbdkit python3; do
  command -v "$p" >/dev/null || { echo "bench: $p not found" >&2; exit 1; }
done
[ -x "$UCRYPT" ] || cargo build --release -q -p ucrypt-cli

rm -rf "$OUT"
mkdir -p "$OUT"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -f "$OUT"/*.img "$OUT"/*.key
}
trap cleanup EXIT

wait_sock() {
  for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done
  echo "bench: $1 did not appear" >&2
  exit 1
}

# --- images -----------------------------------------------------------------------------
head -c 64 /dev/urandom >"$OUT/vol.key"
truncate -s "${IMG_MIB}M" "$OUT/ucrypt.img" "$OUT/ucrypt-auto.img" "$OUT/plain.img" "$OUT/nbdkit-file.img"
for name in qsd nbdkit; do
  # iter-time 10 ms: key derivation speed is not what is measured here. qemu-img's PBKDF
  # calibration sometimes fails on a busy machine ("Unable to get accurate CPU usage"): retry.
  for try in 1 2 3 4 5 6 7 8; do
    qemu-img create -q -f luks --object secret,id=sec0,data=$PASS \
      -o key-secret=sec0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=10 \
      "$OUT/$name.img" "${IMG_MIB}M" && break
    [ "$try" = 8 ] && exit 1
    rm -f "$OUT/$name.img"
  done
done

# --- servers ----------------------------------------------------------------------------
"$UCRYPT" serve "$OUT/ucrypt.img" --nbd "unix:$OUT/ucrypt.sock" --export-name disk \
  --cipher aes-xts-plain64 --volume-key-file "$OUT/vol.key" --sector-size 4096 >/dev/null &
pids+=($!)
"$UCRYPT" serve "$OUT/ucrypt-auto.img" --nbd "unix:$OUT/ucrypt-auto.sock" --export-name disk \
  --cipher aes-xts-plain64 --volume-key-file "$OUT/vol.key" --sector-size 4096 --policy auto >/dev/null &
pids+=($!)
"$UCRYPT" serve "$OUT/plain.img" --nbd "unix:$OUT/plain.sock" --export-name disk \
  --unencrypted >/dev/null &
pids+=($!)
qemu-storage-daemon --object secret,id=sec0,data=$PASS \
  --blockdev driver=file,filename="$OUT/qsd.img",node-name=file0,cache.direct=off \
  --blockdev driver=luks,file=file0,key-secret=sec0,node-name=luks0 \
  --nbd-server addr.type=unix,addr.path="$OUT/qsd.sock" \
  --export type=nbd,id=exp0,node-name=luks0,name=disk,writable=on &
pids+=($!)
nbdkit -f -U "$OUT/nbdkit.sock" -e disk --filter=luks file "$OUT/nbdkit.img" passphrase=$PASS &
pids+=($!)
nbdkit -f -U "$OUT/nbdkit-file.sock" -e disk file "$OUT/nbdkit-file.img" &
pids+=($!)
servers=(ucrypt-inline ucrypt-auto qsd-luks1 nbdkit-luks1 ucrypt-plain nbdkit-file)
declare -A sock=([ucrypt-inline]=ucrypt [ucrypt-auto]=ucrypt-auto [qsd-luks1]=qsd [nbdkit-luks1]=nbdkit [ucrypt-plain]=plain [nbdkit-file]=nbdkit-file)
for s in "${servers[@]}"; do wait_sock "$OUT/${sock[$s]}.sock"; done

# Fill every image once so reads hit written (encrypted) data, not holes.
for s in "${servers[@]}"; do
  fio --name=fill --ioengine=nbd --uri="nbd+unix:///disk?socket=$OUT/${sock[$s]}.sock" \
    --rw=write --bs=1M --iodepth=8 --size="${IMG_MIB}M" --output=/dev/null
done

# --- tests: name rw bs iodepth numjobs ----------------------------------------------------
tests=(
  "randread-4k-qd1 randread 4k 1 1"
  "randread-4k-qd32 randread 4k 32 1"
  "randwrite-4k-qd1 randwrite 4k 1 1"
  "randwrite-4k-qd32 randwrite 4k 32 1"
  "seqread-1m-qd4 read 1M 4 1"
  "seqwrite-1m-qd4 write 1M 4 1"
)
for t in "${tests[@]}"; do
  read -r name rw bs qd jobs <<<"$t"
  for s in "${servers[@]}"; do
    fio --name="$name" --ioengine=nbd --uri="nbd+unix:///disk?socket=$OUT/${sock[$s]}.sock" \
      --rw="$rw" --bs="$bs" --iodepth="$qd" --numjobs="$jobs" --size="${IMG_MIB}M" \
      --time_based --runtime="$RUNTIME" --ramp_time=1 --group_reporting \
      --output-format=json --output="$OUT/$name.$s.json"
  done
done

# --- table --------------------------------------------------------------------------------
python3 - "$OUT" "${servers[*]}" "$(printf '%s\n' "${tests[@]}" | cut -d' ' -f1 | tr '\n' ' ')" <<'PY'
import json, sys
out, servers, tests = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
print("| test | " + " | ".join(servers) + " |")
print("|---|" + "---|" * len(servers))
for t in tests:
    row = []
    for s in servers:
        j = json.load(open(f"{out}/{t}.{s}.json"))["jobs"][0]
        side = j["read"] if "read" in t else j["write"]
        mib = side["bw_bytes"] / 2**20
        row.append(f"{mib:.0f} MiB/s, {side['iops']/1000:.1f}k IOPS" if "4k" in t else f"{mib:.0f} MiB/s")
    print(f"| {t} | " + " | ".join(row) + " |")
PY
