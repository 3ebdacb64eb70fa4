#!/usr/bin/env bash
# scripts/measure-elephant.sh OLD_BENCH NEW_BENCH [ROUNDS]
#
# Two builds of `ucrypt-bench` (e.g. before and after a change to the Elephant diffuser) side
# by side: `cipher --only elephant,aes-xts-plain64 --runs 5 --json`, OLD then NEW, ROUNDS times
# (default 3), alternating so that the machine's load hits both alike. Prints, per build, the
# median over the rounds of each row's median GB/s per CPU-second (encrypt, decrypt) for
# aes-cbc-elephant and AWS-LC's aes-xts-plain64 (512-bit key), and elephant's share of XTS,
# taken within each round.
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
for r in $(seq "$rounds"); do
  for which in old new; do
    bin=$old; [ "$which" = new ] && bin=$new
    "$bin" cipher --only elephant,aes-xts-plain64 --runs 5 --json >"$d/$which.$r.json" 2>/dev/null
  done
done
python3 - "$d" "$rounds" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def rows(path):
    out = {}
    for x in json.load(open(path))["results"]:
        if x["spec"] == "aes-xts-plain64" and x["provider"] != "aws-lc-xts":
            continue
        if x["spec"] not in ("aes-xts-plain64", "aes-cbc-elephant"):
            continue
        k = (x["spec"], x["key_bits"], x["sector_bytes"])
        out[k] = (x["hot_cpu_gbps"]["median"], x["hot_decrypt_cpu_gbps"]["median"])
    return out
med = statistics.median
print("| build | spec | key bits | sector | encrypt GB/s per CPU-s | decrypt GB/s per CPU-s | encrypt ÷ XTS | decrypt ÷ XTS |")
print("|---|---|---|---|---|---|---|---|")
for which in ("old", "new"):
    runs = [rows(f"{d}/{which}.{r}.json") for r in range(1, rounds + 1)]
    for k in sorted(runs[0]):
        enc = [r[k][0] for r in runs]
        dec = [r[k][1] for r in runs]
        xts = lambda r, i: r[("aes-xts-plain64", 512, k[2])][i]
        re = [r[k][0] / xts(r, 0) for r in runs]
        rd = [r[k][1] / xts(r, 1) for r in runs]
        print(f"| {which} | {k[0]} | {k[1]} | {k[2]} | {med(enc):.3f} ({min(enc):.3f}–{max(enc):.3f}) "
              f"| {med(dec):.3f} ({min(dec):.3f}–{max(dec):.3f}) | {med(re):.3f} | {med(rd):.3f} |")
PY
