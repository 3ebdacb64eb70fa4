#!/usr/bin/env bash
# scripts/measure-idle-connections.sh [UCRYPT] [IDLE] [ROUNDS]
#
# What idle NBD connections cost a busy one: `ucrypt serve` of one LUKS2 volume in /dev/shm,
# fio --ioengine=nbd 4 KiB random reads at QD32 for 8 s alone, then with IDLE (default 1,000)
# clients beside it that finished the handshake (NBD_OPT_GO) and send nothing, alternating,
# ROUNDS times (default 3). Also: the server's RssAnon and threads before and with the idle
# clients, and how long a newcomer takes to connect and read 4 KiB while they sit there.
set -euo pipefail
bin=${1:-target/release/ucrypt} idle=${2:-1000} rounds=${3:-3}
d=$(mktemp -d /dev/shm/idleconn.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; pkill -f "serve $d/vol.img" 2>/dev/null || true; rm -rf "$d"' EXIT
ulimit -n 8192
printf 'idle connections' >"$d/pass"
truncate -s 288M "$d/vol.img"
"$bin" format -q --key-file "$d/pass" --pbkdf pbkdf2 --pbkdf-force-iterations 1000 "$d/vol.img"
"$bin" serve "$d/vol.img" --nbd "unix:$d/s.sock" --export-name x --key-file "$d/pass" >"$d/serve.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -S "$d/s.sock" ] && break; sleep 0.05; done
status() { awk '/^RssAnon|^Threads/{printf "%s %s ", $1, $2}' /proc/$pid/status; echo; }
fio_iops() {
  fio --name=j --ioengine=nbd --uri="nbd+unix:///x?socket=$d/s.sock" --rw=randread --bs=4k \
    --iodepth=32 --size=256M --time_based --runtime=8 --ramp_time=1 --output-format=json \
    >"$d/fio.json" 2>/dev/null
  python3 -c 'import json,sys; t=open(sys.argv[1]).read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))' "$d/fio.json"
}
# Holds IDLE handshaken connections open until its stdin closes; prints "ready" when they are.
cat >"$d/idle.py" <<'PY'
import socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
def handshake():
    s = socket.socket(socket.AF_UNIX); s.connect(path)
    def rd(k):
        b = b""
        while len(b) < k:
            c = s.recv(k - len(b)); assert c, "closed"; b += c
        return b
    rd(18); s.sendall(struct.pack(">I", 3))            # fixed newstyle, no zeroes
    name = b"x"
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, len(data)) + data)   # NBD_OPT_GO
    while True:
        _, _, rtype, ln = struct.unpack(">QIII", rd(20)); rd(ln)
        if rtype == 1: return s                           # NBD_REP_ACK
        assert rtype < 0x80000000, "refused"
if n == 0:
    # A newcomer: connect, read 4 KiB (NBD_CMD_READ), print how long it all took.
    import time
    t = time.monotonic()
    s = handshake()
    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, 1, 0, 4096))
    got = b""
    while len(got) < 16 + 4096:
        c = s.recv(16 + 4096 - len(got)); assert c, "closed"; got += c
    assert struct.unpack(">II", got[:8]) == (0x67446698, 0), "read failed"
    print(f"newcomer connected and read 4 KiB in {(time.monotonic() - t) * 1000:.1f} ms")
    sys.exit(0)
conns = [handshake() for _ in range(n)]
print("ready", flush=True)
sys.stdin.read()
PY
newcomer() { python3 "$d/idle.py" "$d/s.sock" 0 </dev/null; }
echo "server alone: $(status)"
for r in $(seq "$rounds"); do
  echo "round $r alone: $(fio_iops) IOPS"
  coproc IDLE { python3 "$d/idle.py" "$d/s.sock" "$idle"; }
  read -r ready <&"${IDLE[0]}"
  [ "$ready" = ready ] || { echo "idle clients failed" >&2; exit 1; }
  [ "$r" = 1 ] && { echo "with $idle idle clients: $(status)"; newcomer; }
  echo "round $r beside $idle idle: $(fio_iops) IOPS"
  exec {IDLE[1]}>&-
  wait "$IDLE_PID" 2>/dev/null || true
  sleep 1
done
