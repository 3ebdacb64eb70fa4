#!/usr/bin/env bash
# What an idle open volume costs: formats N small LUKS2 volumes with a cheap PBKDF, opens each
# with `ucrypt open --front-end fuse` (a daemon each), lets them sit idle, and reads every
# daemon's /proc/PID/status (RssAnon, VmLck, Threads) and per-thread names; then times 4 KiB
# O_DIRECT reads: warm (back to back) against the first read after an idle period; closes them.
#
# usage: scripts/measure-idle.sh [N] [IDLE_S]
#   N       volumes (default 10)
#   IDLE_S  seconds to stay idle before measuring (default 12: longer than the engine's idle
#           period, so pools and worker threads have been given back)
# env: UCRYPT (binary, default target/release/ucrypt), KEEP=1 keeps the work directory,
#      OPEN_ARGS (extra `open` options, e.g. "--fuse-threads 1").
# Needs root (FUSE mounts at /dev/ucrypt/NAME) and python3 (timing).
set -euo pipefail

N=${1:-10}
IDLE_S=${2:-12}
here=$(cd "$(dirname "$0")/.." && pwd)
UCRYPT=${UCRYPT:-$here/target/release/ucrypt}
[ -x "$UCRYPT" ] || { echo "no ucrypt binary at $UCRYPT (cargo build --release -p ucrypt-cli)" >&2; exit 2; }
work=$(mktemp -d /tmp/measure-idle.XXXXXX)
names=()
cleanup() {
	for n in "${names[@]}"; do "$UCRYPT" close "$n" >/dev/null 2>&1 || true; done
	[ "${KEEP:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT

printf 'secret' >"$work/pass"
for i in $(seq 1 "$N"); do
	img=$work/v$i.img
	truncate -s 64M "$img"
	"$UCRYPT" luksFormat --batch-mode --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 \
		--key-file "$work/pass" "$img" >/dev/null
done

t0=$(date +%s.%N)
for i in $(seq 1 "$N"); do
	n=idle$$-$i
	# shellcheck disable=SC2086
	"$UCRYPT" open "$work/v$i.img" "$n" --key-file "$work/pass" --front-end fuse ${OPEN_ARGS:-} >/dev/null
	names+=("$n")
done
t1=$(date +%s.%N)
echo "opened $N volumes in $(echo "$t1 - $t0" | bc) s"

pid_of() { "$UCRYPT" status "$1" | awk '$1 == "pid:" { print $2 }'; }

# Touch every volume once (a read and a write), so the pool and threads have been used, then
# stay idle.
for n in "${names[@]}"; do
	dd if=/dev/zero of="/dev/ucrypt/$n" bs=1M count=4 oflag=direct conv=notrunc status=none
	dd if="/dev/ucrypt/$n" of=/dev/null bs=1M count=4 iflag=direct status=none
done
# The pids before the idle period: a `status` answered just before /proc is read would count
# its control connection's thread, which ends with the connection.
pids=()
for n in "${names[@]}"; do pids+=("$(pid_of "$n")"); done
sleep "$IDLE_S"

echo
echo "per idle daemon (after ${IDLE_S} s idle):"
printf '%-16s %8s %10s %9s %8s  %s\n' name pid RssAnon_kB VmLck_kB Threads thread-names
tot_rss=0
tot_lck=0
tot_thr=0
for i in "${!names[@]}"; do
	n=${names[$i]}
	p=${pids[$i]}
	st=/proc/$p/status
	rss=$(awk '/^RssAnon:/ { print $2 }' "$st")
	lck=$(awk '/^VmLck:/ { print $2 }' "$st")
	thr=$(awk '/^Threads:/ { print $2 }' "$st")
	tn=$(cat /proc/"$p"/task/*/comm | sort | uniq -c | awk '{ printf "%s%s×%s", sep, $2, $1; sep="," }')
	printf '%-16s %8s %10s %9s %8s  %s\n' "$n" "$p" "$rss" "$lck" "$thr" "$tn"
	tot_rss=$((tot_rss + rss))
	tot_lck=$((tot_lck + lck))
	tot_thr=$((tot_thr + thr))
done
echo "total: RssAnon ${tot_rss} kB, VmLck ${tot_lck} kB, threads ${tot_thr}"
echo "mean per volume: RssAnon $((tot_rss / N)) kB, VmLck $((tot_lck / N)) kB, threads $(echo "scale=1; $tot_thr / $N" | bc)"

# Latency: per volume, 20 warm reads back to back, then (after IDLE_S idle, all volumes at
# once) one read each. Medians across volumes, in microseconds.
files=()
for n in "${names[@]}"; do files+=("/dev/ucrypt/$n"); done
python3 - "$IDLE_S" "${files[@]}" <<'EOF'
import mmap, os, statistics, sys, time
idle = float(sys.argv[1])
files = sys.argv[2:]
buf = mmap.mmap(-1, 4096)
fds = [os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files]
def read_us(fd, off):
    t = time.perf_counter_ns()
    os.preadv(fd, [buf], off)
    return (time.perf_counter_ns() - t) / 1000
warm, cold = [], []
for round in range(3):
    time.sleep(idle)
    for i, fd in enumerate(fds):
        cold.append(read_us(fd, (round * 7 + i) * 65536 % (32 << 20)))
    for i, fd in enumerate(fds):
        w = [read_us(fd, ((round * 20 + k) * 4096 * 17) % (32 << 20)) for k in range(20)]
        warm.append(statistics.median(w[1:]))
print(f"4 KiB O_DIRECT read, median over {len(fds)} volumes x 3 rounds: "
      f"warm {statistics.median(warm):.1f} us, first after {idle:g} s idle "
      f"{statistics.median(cold):.1f} us (extra {statistics.median(cold) - statistics.median(warm):.1f} us)")
EOF
