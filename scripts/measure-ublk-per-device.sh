#!/usr/bin/env bash
# scripts/measure-ublk-per-device.sh [N] [UCRYPT]
#
# What an idle volume costs as a kernel block device, ucrypt's ublk front end beside dm-crypt,
# in one boot of the test VM on Debian trixie's stock kernel (the kernel ublk needs;
# tests/vm/run-in-vm.sh, qemu TCG, 2 vCPUs). N (default 100) 1 MiB brd RAM disks that are never
# written; on them, in turn:
#   1. N plain dm-crypt devices (aes-xts-plain64, 512-bit key, `cryptsetup open --type plain`);
#   2. the same N as `ucrypt open --type plain ... --front-end ublk` (a daemon each, serving
#      /dev/ublkbI), measured 2 s after the last open and again once every daemon has passed
#      its idle period.
# Before and after each set, with the page cache dropped: MemAvailable, SUnreclaim, Percpu and
# the number of threads (kernel and user); for the daemons also the sum of their RssAnon,
# VmLck and threads from /proc/PID/status. Prints one line per figure, total and per device.
# UCRYPT: the binary to measure (default target/release/ucrypt; build it first).
set -euo pipefail
n=${1:-100}
here=$(cd "$(dirname "$0")/.." && pwd)
ucrypt=${2:-$here/target/release/ucrypt}
[ -x "$ucrypt" ] || { echo "no $ucrypt: cargo build --release -p ucrypt-cli" >&2; exit 2; }
trixie=$here/tests/vm/cache/trixie
kernel=$(bash "$here/tests/vm/trixie-kernel.sh")
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
mkdir "$w/share"
cp "$ucrypt" "$w/share/ucrypt"
head -c 64 /dev/urandom >"$w/share/key"
cat >"$w/t.sh" <<VM
set -eu
modprobe brd rd_nr=$n rd_size=1024
modprobe ublk_drv
mkdir -p /run
U=/mnt/host/ucrypt
snap() {
  sync; echo 3 >/proc/sys/vm/drop_caches; sleep 1
  awk '/^(MemAvailable|SUnreclaim|Percpu):/{printf "%s %s ", \$1, \$2}' /proc/meminfo
  echo "threads \$(ls /proc/[0-9]*/task | grep -c '^[0-9]')"
}
daemons() {
  for p in \$(cat /run/ucrypt/*/pid 2>/dev/null); do cat /proc/\$p/status; done |
    awk '/^RssAnon:/{r+=\$2} /^VmLck:/{l+=\$2} /^Threads:/{t+=\$2; d++}
         END{printf "daemons %d RssAnon %d VmLck %d dthreads %d\n", d, r, l, t}'
}
echo "BASE \$(snap)"
i=0
while [ \$i -lt $n ]; do
  cryptsetup open --type plain --cipher aes-xts-plain64 --key-size 512 --key-file /mnt/host/key \
    /dev/ram\$i c\$i
  i=\$((i+1))
done
echo "DMCRYPT \$(snap)"
echo "DMDEVICES \$(ls /dev/mapper | grep -c '^c[0-9]')"
i=0
while [ \$i -lt $n ]; do cryptsetup close c\$i; i=\$((i+1)); done
echo "BASE2 \$(snap)"
i=0
while [ \$i -lt $n ]; do
  \$U open --type plain --cipher aes-xts-plain64 --key-size 512 --key-file /mnt/host/key \
    /dev/ram\$i u\$i --front-end ublk >/tmp/open.out 2>&1 || { cat /tmp/open.out; exit 11; }
  i=\$((i+1))
done
sleep 2
echo "UBLKDEVICES \$(ls /dev | grep -c '^ublkb')"
echo "FRESH \$(snap) \$(daemons)"
sleep 8
echo "IDLE \$(snap) \$(daemons)"
i=0
while [ \$i -lt $n ]; do \$U close u\$i; i=\$((i+1)); done
echo "CLOSED \$(ls /dev | grep -c '^ublkb')"
VM
out=$(MODROOT=$trixie "$here/tests/vm/run-in-vm.sh" -k "$kernel" -s "$w/share" -m 3072 -c 2 \
  -t 1800 -i 300 "$w/t.sh")
echo "$out" | grep -E '^(BASE|BASE2|DMCRYPT|DMDEVICES|UBLKDEVICES|FRESH|IDLE|CLOSED) '
python3 - "$n" <<PY
import sys
n = int(sys.argv[1])
keys = ("BASE", "BASE2", "DMCRYPT", "DMDEVICES", "UBLKDEVICES", "FRESH", "IDLE", "CLOSED")
lines = {l.split()[0]: l.split()[1:] for l in """$out""".splitlines() if l.split() and l.split()[0] in keys}
assert int(lines["DMDEVICES"][0]) == n, "not every dm-crypt device opened"
assert int(lines["UBLKDEVICES"][0]) == n, "not every ublk device opened"
assert int(lines["CLOSED"][0]) == 0, "a ublk device outlived its close"
def kv(f): return {f[i].rstrip(":"): int(f[i + 1]) for i in range(0, len(f), 2)}
def diff(label, before, after):
    b, a = kv(lines[before]), kv(lines[after])
    for k in ("MemAvailable", "SUnreclaim", "Percpu", "threads"):
        d = b[k] - a[k] if k == "MemAvailable" else a[k] - b[k]
        unit = "" if k == "threads" else " kB"
        print(f"{label:24s} {k:12s} {d:9d}{unit} for {n}, {d / n:8.1f}{unit} per device")
diff("dm-crypt", "BASE", "DMCRYPT")
for when in ("FRESH", "IDLE"):
    diff(f"ucrypt ublk ({when.lower()})", "BASE2", when)
    d = kv(lines[when])
    assert d["daemons"] == n, f"{when}: {d['daemons']} daemons"
    for k in ("RssAnon", "VmLck", "dthreads"):
        unit = "" if k == "dthreads" else " kB"
        print(f"{'ucrypt daemons (' + when.lower() + ')':24s} {k:12s} {d[k]:9d}{unit} for {n}, {d[k] / n:8.1f}{unit} per device")
PY
