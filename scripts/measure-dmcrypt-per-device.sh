#!/usr/bin/env bash
# scripts/measure-dmcrypt-per-device.sh [N]
#
# What one idle dm-crypt device costs the kernel, the figure `bench scale` puts beside an idle
# ucrypt volume: in the test VM (tests/vm/run-in-vm.sh, a stock Debian kernel), N (default 100)
# plain dm-crypt devices (aes-xts-plain64, `cryptsetup open --type plain`) over 1 MiB brd RAM
# disks that are never written, so the disks themselves hold no pages. Before and after the N
# opens, with the page cache dropped: MemAvailable, MemFree, Slab (SUnreclaim), Percpu and the
# number of kernel threads. Prints one line per figure: total difference and per device.
set -euo pipefail
n=${1:-100}
here=$(cd "$(dirname "$0")/.." && pwd)
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
cat >"$w/t.sh" <<VM
set -eu
modprobe brd rd_nr=$n rd_size=1024
head -c 64 /dev/urandom >/tmp/key
snap() {
  sync; echo 3 >/proc/sys/vm/drop_caches; sleep 1
  awk '/^(MemAvailable|MemFree|SUnreclaim|Percpu):/{printf "%s %s ", \$1, \$2}' /proc/meminfo
  echo "threads \$(ls /proc | grep -c '^[0-9]')"
}
echo "BEFORE \$(snap)"
i=0
while [ \$i -lt $n ]; do
  cryptsetup open --type plain --cipher aes-xts-plain64 --key-size 512 --key-file /tmp/key \
    /dev/ram\$i c\$i
  i=\$((i+1))
done
echo "AFTER \$(snap)"
echo "DEVICES \$(ls /dev/mapper | grep -c '^c[0-9]')"
VM
out=$("$here/tests/vm/run-in-vm.sh" -m 2048 -t 900 -i 300 "$w/t.sh")
echo "$out" | grep -E '^(BEFORE|AFTER|DEVICES)'
python3 - "$n" <<PY
import sys
n = int(sys.argv[1])
lines = {l.split()[0]: l.split()[1:] for l in """$out""".splitlines() if l.split() and l.split()[0] in ("BEFORE", "AFTER", "DEVICES")}
assert int(lines["DEVICES"][0]) == n, "not every device opened"
def kv(f): return {f[i].rstrip(":"): int(f[i + 1]) for i in range(0, len(f), 2)}
b, a = kv(lines["BEFORE"]), kv(lines["AFTER"])
for k in ("MemAvailable", "MemFree", "SUnreclaim", "Percpu"):
    d = b[k] - a[k] if k.startswith("Mem") else a[k] - b[k]
    print(f"{k:12s} {d:8d} kB for {n} devices, {d / n:7.1f} kB per device")
t = a["threads"] - b["threads"]
print(f"{'threads':12s} {t:8d}    for {n} devices, {t / n:7.1f} per device")
PY
