#!/usr/bin/env bash
# bench/regression/nbd-qd32.sh OLD_BIN NEW_BIN [ROUNDS]
#
# The NBD rows bench/regression.sh found slower, at full length: `ucrypt serve` of one LUKS2
# volume in /dev/shm (policy inline, O_DIRECT off: the file is in memory) by each build in
# turn, fio --ioengine=nbd 4 KiB random reads then writes at iodepth 32 for 10 s each after a
# 2 s warm-up, old then new in every round. Prints one line per run: build job IOPS.
set -euo pipefail
old=$1 new=$2 rounds=${3:-4}
d=$(mktemp -d /dev/shm/nbdqd32.XXXXXX)
trap 'pkill -f "serve $d/vol.img" 2>/dev/null || true; rm -rf "$d"' EXIT
printf 'regression passphrase' >"$d/pass"
truncate -s 288M "$d/vol.img"
"$new" format -q --key-file "$d/pass" --pbkdf pbkdf2 --pbkdf-force-iterations 1000 "$d/vol.img"
run() { # BUILD BIN RW SECONDS
  "$2" serve "$d/vol.img" --nbd "unix:$d/s.sock" --export-name x --key-file "$d/pass" \
    --policy inline >"$d/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 100); do [ -S "$d/s.sock" ] && break; sleep 0.05; done
  fio --name=j --ioengine=nbd --uri="nbd+unix:///x?socket=$d/s.sock" --rw="$3" --bs=4k \
    --iodepth=32 --size=256M --time_based --runtime="$4" --ramp_time=2 --output-format=json \
    >"$d/fio.json" 2>/dev/null
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$d/s.sock"
  # fio's nbd engine prints a line before the JSON.
  python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(sys.argv[2], sys.argv[3], round(j["read"]["iops"]+j["write"]["iops"]))' "$d/fio.json" "$1" "$3"
}
for r in $(seq "$rounds"); do
  for rw in randread randwrite; do
    run old "$old" "$rw" 10
    run new "$new" "$rw" 10
  done
done
