#!/usr/bin/env bash
# bench-vhost.sh — ucrypt vhost-user-blk against qemu-storage-daemon's vhost-user-blk export over
# its luks driver (the same LUKS1 volume, one copy each) and over a raw file (the unencrypted
# ceiling), side by side in one VM run (qemu TCG, 2 vCPUs, 2 queues per disk). fio in the guest;
# all three bypass the host page cache (ucrypt --cache none, its default; qsd cache.direct=on);
# each backend's CPU time (utime+stime from /proc/PID/stat) over the 4 KiB boot, per request.
#
# usage: scripts/bench-vhost.sh [UCRYPT_BINARY]   (default target/release/ucrypt)
# env: RUNTIME (seconds per fio job, default 8)
set -euo pipefail
cd "$(dirname "$0")/.."
UCRYPT=$(realpath "${1:-target/release/ucrypt}")
RUNTIME=${RUNTIME:-8}
for t in qemu-storage-daemon qemu-system-x86_64 cryptsetup fio; do
  command -v $t >/dev/null || { echo "SKIPPED: $t not found"; exit 0; }
done
W=$(mktemp -d /tmp/bench-vhost.XXXXXX)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$W"' EXIT

# Different sizes tell the disks apart in the guest (virtio probe order is not the command's).
printf '%s' "bench-vhost-passphrase-0123456789" > "$W/pass"
truncate -s 258M "$W/ucrypt.img"
cryptsetup luksFormat -q --type luks1 --cipher aes-xts-plain64 --key-size 512 \
  --pbkdf-force-iterations 1000 --key-file "$W/pass" "$W/ucrypt.img"
truncate -s 262M "$W/qsd.img"
cp --sparse=always "$W/ucrypt.img" "$W/qsd.img" && truncate -s 262M "$W/qsd.img"
truncate -s 266M "$W/raw.img"

cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }

"$UCRYPT" vhost "$W/ucrypt.img" --key-file "$W/pass" --socket "$W/u.sock" --queues 2 > "$W/u.out" 2>&1 &
pids+=($!); upid=$!
qemu-storage-daemon --object secret,id=sec0,file="$W/pass" \
  --blockdev driver=file,node-name=f0,filename="$W/qsd.img",cache.direct=on \
  --blockdev driver=luks,node-name=l0,file=f0,key-secret=sec0 \
  --export type=vhost-user-blk,id=e0,node-name=l0,addr.type=unix,addr.path="$W/q.sock",writable=on,num-queues=2 &
pids+=($!); qpid=$!
qemu-storage-daemon --blockdev driver=file,node-name=f1,filename="$W/raw.img",cache.direct=on \
  --export type=vhost-user-blk,id=e1,node-name=f1,addr.type=unix,addr.path="$W/r.sock",writable=on,num-queues=2 &
pids+=($!); rpid=$!
for s in u q r; do for _ in $(seq 1 100); do [ -S "$W/$s.sock" ] && break; sleep 0.1; done; done

guest() { # $1: job lines "name fio-args"
cat <<EOF
set -e
for b in /sys/block/vd*; do
  case \$(cat \$b/size) in
    \$((256*2048))) u=/dev/\${b##*/};; \$((260*2048))) q=/dev/\${b##*/};; \$((266*2048))) r=/dev/\${b##*/};;
  esac
done
echo "disks: ucrypt=\$u qsd-luks=\$q qsd-raw=\$r"
for side in ucrypt:\$u qsd-luks:\$q qsd-raw:\$r; do
  name=\${side%%:*}; dev=\${side#*:}
  echo "BEGIN \$name"
$1
  echo "END \$name"
done
EOF
}
fio_line() { # name, fio args
  echo "  /usr/local/sbin/fio --minimal --name=$1 --filename=\$dev --direct=1 --ioengine=libaio --time_based --runtime=$RUNTIME --group_reporting $2 | awk -F';' -v n=\$name -v j=$1 '{printf \"RESULT %s %s read_iops=%s write_iops=%s read_KiBps=%s write_KiBps=%s ios=%d\\n\", n, j, \$8, \$49, \$7, \$48, \$6/4+\$47/4}'"
}
small=$(fio_line rr4k-qd1 "--rw=randread --bs=4k --iodepth=1"; fio_line rw4k-qd1 "--rw=randwrite --bs=4k --iodepth=1"; \
  fio_line rr4k-qd32x2 "--rw=randread --bs=4k --iodepth=16 --numjobs=2"; fio_line rw4k-qd32x2 "--rw=randwrite --bs=4k --iodepth=16 --numjobs=2")
guest "$small" > "$W/small.sh"
large=$(fio_line sw1m "--rw=write --bs=1M --iodepth=4"; fio_line sr1m "--rw=read --bs=1M --iodepth=4")
guest "$large" > "$W/large.sh"

declare -A c0
for p in $upid $qpid $rpid; do c0[$p]=$(cpu_ticks $p); done
EXTRA_BINS=/usr/bin/fio VMTEST_VHOST_QUEUES=2 tests/vm/run-in-vm.sh -c 2 -m 1024 -t 900 \
  -V "$W/u.sock" -V "$W/q.sock" -V "$W/r.sock" "$W/small.sh" | tee "$W/small.out"
hz=$(getconf CLK_TCK)
for pair in ucrypt:$upid qsd-luks:$qpid qsd-raw:$rpid; do
  n=${pair%%:*}; p=${pair#*:}
  ios=$(awk -v n=$n '$1=="RESULT" && $2==n {sub("ios=","",$NF); s+=$NF} END {print s+0}' "$W/small.out")
  t=$(( $(cpu_ticks $p) - ${c0[$p]} ))
  awk -v n=$n -v t=$t -v hz=$hz -v ios=$ios 'BEGIN {printf "CPU %s: %.2f s over %d requests of 4 KiB: %.1f us per request\n", n, t/hz, ios, ios ? t/hz*1e6/ios : 0}'
done
EXTRA_BINS=/usr/bin/fio VMTEST_VHOST_QUEUES=2 tests/vm/run-in-vm.sh -c 2 -m 1024 -t 900 \
  -V "$W/u.sock" -V "$W/q.sock" -V "$W/r.sock" "$W/large.sh"
