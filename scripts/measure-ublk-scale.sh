#!/usr/bin/env bash
# scripts/measure-ublk-scale.sh [NS] [UCRYPT]
#
# `bench scale` with ucrypt's ublk front end, beside dm-crypt, in one boot of the test VM on
# Debian trixie's stock kernel (the kernel ublk needs; tests/vm/run-in-vm.sh, qemu TCG, 2
# vCPUs). NS (default "1 10 100"): the volume counts. The volumes are LUKS2 (aes-xts-plain64,
# PBKDF2 1,000 iterations, a 512 KiB keyslots area, as `bench scale` formats them) on RAM
# disks of 1 MiB of header and 16 MiB of data, formatted by `ucrypt format` in the guest.
#
# For each N: the N opened in turn with `ucrypt open ... --front-end ublk` (a daemon each,
# serving /dev/ublkbI) and timed; 2 s later the daemons' RssAnon, VmLck and threads
# (/proc/PID/status); `ucrypt list` and `ucrypt status NAME` timed (10 calls each), beside
# `ucrypt --version` (what starting the binary costs under emulation); then all closed
# (timed), except the largest N. The largest N are looked at again once idle (14 s after the
# last open), then read: fio 4 KiB random O_DIRECT
# reads at QD1 (psync, 3 s) on 1, 10 and 100 of them at once (one fio job per device), and
# the same N opened as dm-crypt devices (`cryptsetup open`, timed) and read the same way.
# Prints, per N and per device, what the issue's scale scenario reports, and for the reads the
# aggregate IOPS ÷ (one device's IOPS × min(devices read, vCPUs)) and the median of the
# devices' p99 beside one device's p99.
# UCRYPT: the binary to measure (default target/release/ucrypt; build it first).
set -euo pipefail
ns=${1:-"1 10 100"}
here=$(cd "$(dirname "$0")/.." && pwd)
ucrypt=${2:-$here/target/release/ucrypt}
[ -x "$ucrypt" ] || { echo "no $ucrypt: cargo build --release -p ucrypt-cli" >&2; exit 2; }
command -v fio >/dev/null || { echo "SKIPPED: no fio on the host to copy into the guest" >&2; exit 0; }
max=0
for n in $ns; do [ "$n" -gt "$max" ] && max=$n; done
cpus=2
trixie=$here/tests/vm/cache/trixie
kernel=$(bash "$here/tests/vm/trixie-kernel.sh")
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
mkdir "$w/share"
cp "$ucrypt" "$w/share/ucrypt"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$w/share/pass"
cat >"$w/t.sh" <<VM
set -eu
modprobe brd rd_nr=$max rd_size=17408
modprobe ublk_drv
mkdir -p /run
U=/mnt/host/ucrypt
K=/mnt/host/pass
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="\$1" -v b="\$(now)" 'BEGIN{printf "%.2f", b - a}'; }
daemons() {
  for p in \$(cat /run/ucrypt/*/pid 2>/dev/null); do cat /proc/\$p/status; done |
    awk '/^RssAnon:/{r+=\$2} /^VmLck:/{l+=\$2} /^Threads:/{t+=\$2; d++}
         END{printf "daemons %d RssAnon %d VmLck %d threads %d", d, r, l, t}'
}
t=\$(now); i=0
while [ \$i -lt $max ]; do
  \$U format -q --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 \
    --luks2-keyslots-size 524288 --key-file \$K /dev/ram\$i
  i=\$((i+1))
done
echo "FORMAT $max \$(since \$t)"
for n in $ns; do
  t=\$(now); i=0
  while [ \$i -lt \$n ]; do
    \$U open /dev/ram\$i u\$i --front-end ublk --key-file \$K >/tmp/open.out 2>&1 ||
      { cat /tmp/open.out; exit 11; }
    i=\$((i+1))
  done
  o=\$(since \$t)
  sleep 2
  echo "UBLK \$n open \$o devices \$(ls /dev | grep -c '^ublkb') \$(daemons)"
  t=\$(now); for k in 1 2 3 4 5 6 7 8 9 10; do \$U list >/dev/null; done; l=\$(since \$t)
  t=\$(now)
  for k in 0 1 2 3 4 5 6 7 8 9; do \$U status u\$((k * n / 10)) >/dev/null; done
  s=\$(since \$t)
  t=\$(now); for k in 1 2 3 4 5 6 7 8 9 10; do \$U --version >/dev/null; done
  echo "TOOLS \$n list10 \$l status10 \$s version10 \$(since \$t)"
  if [ \$n -lt $max ]; then
    t=\$(now); i=0
    while [ \$i -lt \$n ]; do \$U close u\$i; i=\$((i+1)); done
    echo "CLOSE \$n \$(since \$t) left \$(ls /dev | grep -c '^ublkb' || true)"
  fi
done
reads() {
  for a in 1 10 100; do
    [ \$a -le $max ] || continue
    args=""; i=0
    while [ \$i -lt \$a ]; do args="\$args --name=d\$i --filename=\$1\$i"; i=\$((i+1)); done
    fio --output-format=json --output=/mnt/host/fio-\$2-\$a.json --rw=randread --bs=4k \
      --ioengine=psync --iodepth=1 --direct=1 --size=16M --runtime=3 --time_based \
      --percentile_list=99 \$args >/dev/null
    echo "READ \$2 \$a"
  done
}
sleep 12
echo "IDLE $max \$(daemons)"
reads /dev/ublkb ublk
t=\$(now); i=0
while [ \$i -lt $max ]; do \$U close u\$i; i=\$((i+1)); done
echo "CLOSE $max \$(since \$t) left \$(ls /dev | grep -c '^ublkb' || true)"
t=\$(now); i=0
while [ \$i -lt $max ]; do
  cryptsetup open --key-file \$K /dev/ram\$i c\$i
  i=\$((i+1))
done
echo "DMCRYPT $max open \$(since \$t) devices \$(ls /dev/mapper | grep -c '^c[0-9]')"
reads /dev/mapper/c dmcrypt
t=\$(now); i=0
while [ \$i -lt $max ]; do cryptsetup close c\$i; i=\$((i+1)); done
echo "DMCLOSE $max \$(since \$t)"
VM
set +e
out=$(EXTRA_BINS=$(command -v fio) MODROOT=$trixie "$here/tests/vm/run-in-vm.sh" -k "$kernel" \
  -s "$w/share" -m 3072 -c $cpus -t 3600 -i 600 "$w/t.sh")
rc=$?
set -e
echo "$out" | grep -E '^(FORMAT|UBLK|TOOLS|CLOSE|IDLE|READ|DMCRYPT|DMCLOSE) '
[ $rc -eq 0 ] || { echo "$out" | tail -20; echo "the VM run failed: exit $rc" >&2; exit 1; }
python3 - "$w/share" "$cpus" "$max" <<PY
import json, statistics, sys
share, cpus, top = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lines = [l.split() for l in """$out""".splitlines() if l.strip()]
def fields(l, start):
    return {l[i]: l[i + 1] for i in range(start, len(l) - 1, 2)}
tools = {int(l[1]): fields(l, 2) for l in lines if l[0] == "TOOLS"}
closes = {int(l[1]): float(l[2]) for l in lines if l[0] == "CLOSE"}
print("| N | open all | per open | RssAnon (per volume) | VmLck (per volume) | threads (per volume) | list | status NAME | \`--version\` | close all |")
print("|---|---|---|---|---|---|---|---|---|---|")
for l in lines:
    if l[0] != "UBLK":
        continue
    n = int(l[1]); f = fields(l, 2)
    assert int(f["devices"]) == n and int(f["daemons"]) == n, f"N={n}: {f}"
    o = float(f["open"]); r, k, t = (int(f[x]) for x in ("RssAnon", "VmLck", "threads"))
    tl = tools[n]
    print(f"| {n} | {o:.2f} s | {o / n * 1000:.0f} ms | {r:,} kB ({r // n:,}) | {k:,} kB ({k // n}) "
          f"| {t} ({t / n:.1f}) | {float(tl['list10']) * 100:.0f} ms | {float(tl['status10']) * 100:.0f} ms "
          f"| {float(tl['version10']) * 100:.0f} ms | {closes.get(n, float('nan')):.2f} s |")
for l in lines:
    if l[0] == "IDLE":
        f = fields(l, 2); n = int(l[1])
        r, k, t = (int(f[x]) for x in ("RssAnon", "VmLck", "threads"))
        print(f"\nThe {n} once idle: RssAnon {r:,} kB ({r // n:,} per volume), VmLck {k:,} kB ({k // n}), threads {t} ({t / n:.1f})")
    if l[0] == "DMCRYPT":
        print(f"\ndm-crypt: {l[1]} opened with cryptsetup in {float(l[3]):.2f} s ({float(l[3]) / int(l[1]) * 1000:.0f} ms each)")
print("\n| devices read at once | ublk IOPS | ÷ (one × min(devices, vCPUs)) | p99 median, µs | dm-crypt IOPS | ÷ (one × min) | p99 median, µs |")
print("|---|---|---|---|---|---|---|")
def load(kind, a):
    j = json.load(open(f"{share}/fio-{kind}-{a}.json"))
    iops = sum(x["read"]["iops"] for x in j["jobs"])
    p99 = statistics.median(x["read"]["clat_ns"]["percentile"]["99.000000"] / 1000 for x in j["jobs"])
    return iops, p99
one = {k: load(k, 1)[0] for k in ("ublk", "dmcrypt")}
for a in (1, 10, 100):
    if a > top:
        continue
    row = [str(a)]
    for k in ("ublk", "dmcrypt"):
        iops, p99 = load(k, a)
        row += [f"{iops:,.0f}", f"{iops / (one[k] * min(a, cpus)):.2f}", f"{p99:,.0f}"]
    print("| " + " | ".join(row) + " |")
PY
