#!/usr/bin/env bash
# A throw-away single-node Ceph cluster for tests and benchmarks, from Debian 12's packages
# (ceph-mon ceph-osd ceph-common: `bash scripts/deps.sh test` installs them):
#   bash scripts/ceph-cluster.sh start DIR   make DIR, start the cluster, print its env lines
#   bash scripts/ceph-cluster.sh env DIR     print `export CEPH_CONF=...` lines for a shell
#   bash scripts/ceph-cluster.sh stop DIR    kill its daemons by pid and remove DIR
# One ceph-mon and one ceph-osd whose objects live in its RAM (memstore), no mgr, no systemd,
# cephx on 127.0.0.1, ports chosen free at run time, and everything (conf, keyrings, data,
# logs, run dir, pid files) under DIR, so that several clusters can run side by side and
# nothing lands in /etc. A pool `rbd` is created and initialised.
#
# DIR/env holds KEY=VALUE lines (CEPH_CONF, CEPH_KEYRING, ...); with CEPH_CONF set, the
# `ceph` and `rbd` commands and librados find the cluster and the client.admin keyring.
#
# `start` on a running cluster only prints its env; on a DIR left by a failed or killed run
# it cleans up and starts afresh; on any other non-empty DIR it refuses. A failed start stops
# what it started, prints the log's tail and keeps DIR/log for a look. `stop` on a missing DIR
# does nothing. Mgr-served commands (`ceph osd pool stats`, `ceph -s` pool counts) hang or
# show nothing without a mgr: call them with a timeout.
set -euo pipefail

# Seconds each wait may take before start gives up (the whole start takes ~8 s here).
MON_UP_SECONDS=30
OSD_UP_SECONDS=60
POOL_READY_SECONDS=60
# Seconds a ceph/rbd command may take: without this a command sent to a dead or not yet
# started mon retries forever.
COMMAND_SECONDS=30
# RAM the OSD may keep objects in (memstore); tests and benchmarks stay well under it.
MEMSTORE_BYTES=${CEPH_MEMSTORE_BYTES:-$((4 << 30))}
[[ $MEMSTORE_BYTES =~ ^[0-9]+$ ]] || { echo "ceph-cluster: CEPH_MEMSTORE_BYTES must be a number of bytes" >&2; exit 2; }
# Lines of a log shown when start fails.
LOG_TAIL_LINES=30
# Names this script leaves in DIR, so that `start` and `stop` only ever wipe a DIR it made.
MARKER=.ucrypt-ceph-cluster

usage() { echo "usage: bash scripts/ceph-cluster.sh start|stop|env DIR" >&2; exit 2; }
die() { echo "ceph-cluster: $*" >&2; exit 1; }

[ $# -eq 2 ] || usage
verb=$1
# Ceph's conf expands `$name` and splits on some characters: keep DIR to plain path characters.
case $2 in
  *[!A-Za-z0-9/._+-]*) die "DIR '$2' must hold only letters, digits and / . _ + -" ;;
  "") usage ;;
esac
mkdir -p -- "$(dirname -- "$2")"
DIR=$(cd -- "$(dirname -- "$2")" && pwd)/$(basename -- "$2")
CONF=$DIR/ceph.conf
KEYRING=$DIR/client.admin.keyring

need_tools() {
  local t missing=()
  for t in ceph-authtool monmaptool ceph-mon ceph-osd ceph rbd uuidgen timeout; do
    command -v "$t" >/dev/null || missing+=("$t")
  done
  [ ${#missing[@]} -eq 0 ] ||
    die "missing ${missing[*]}: install the Debian packages ceph-mon ceph-osd ceph-common (bash scripts/deps.sh test)"
}

# The pid in DIR/run/NAME.pid if that process is alive and is one of this cluster's daemons
# (its command line names this DIR's conf), so a recycled pid is never killed.
live_pid() {
  local f=$DIR/run/$1.pid pid
  [ -s "$f" ] || return 1
  pid=$(cat -- "$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$CONF" || return 1
  echo "$pid"
}

kill_daemons() {
  local name pid pids=()
  for name in osd.0 mon.a; do
    pid=$(live_pid "$name") && pids+=("$pid")
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  # SIGKILL: the data is thrown away anyway, and a clean shutdown takes seconds.
  kill -KILL "${pids[@]}" 2>/dev/null || true
  local i
  for i in $(seq 50); do
    local alive=0
    for pid in "${pids[@]}"; do [ -e "/proc/$pid" ] && alive=1; done
    [ $alive = 0 ] && return 0
    sleep 0.1
  done
  die "daemons ${pids[*]} still alive 5 s after SIGKILL"
}

write_env() {
  {
    echo "CEPH_CONF=$CONF"
    echo "CEPH_KEYRING=$KEYRING"
    echo "CEPH_CLUSTER_DIR=$DIR"
    echo "CEPH_MON_PID_FILE=$DIR/run/mon.a.pid"
    echo "CEPH_OSD_PID_FILE=$DIR/run/osd.0.pid"
  } >"$DIR/env.tmp"
  mv -- "$DIR/env.tmp" "$DIR/env"
}

print_env() { sed 's/^/export /' "$DIR/env"; }

running() { [ -s "$DIR/env" ] && live_pid mon.a >/dev/null && live_pid osd.0 >/dev/null; }

c() { timeout "$COMMAND_SECONDS" ceph -c "$CONF" "$@"; }

# Waits up to $1 seconds for the command after it to succeed quietly; returns 1 on time-out.
wait_for() {
  local seconds=$1 deadline
  shift
  deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

osd_up() { c osd stat -f json 2>/dev/null | grep -q '"num_up_osds":1'; }

fail_start() {
  local f
  echo "ceph-cluster: start failed: $*" >&2
  for f in "$DIR"/log/*.log; do
    [ -s "$f" ] || continue
    echo "---- last $LOG_TAIL_LINES lines of $f" >&2
    tail -n "$LOG_TAIL_LINES" -- "$f" >&2
  done
  kill_daemons || true
  echo "ceph-cluster: daemons stopped; logs kept in $DIR/log (stop DIR removes them)" >&2
  exit 1
}

# Two TCP ports free on 127.0.0.1 now (the kernel picks them). Another process could take one
# before the mon binds it; the mon's log then says so and start fails with that tail.
free_ports() {
  local py=/usr/bin/python3
  [ -x $py ] || py=python3
  $py -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))'
}

start() {
  need_tools
  if running; then
    print_env
    return 0
  fi
  if [ -e "$DIR" ]; then
    if [ -e "$DIR/$MARKER" ]; then
      kill_daemons
      rm -rf -- "$DIR"
    elif [ -n "$(ls -A -- "$DIR")" ]; then
      die "$DIR exists and is not a cluster directory this script made: refusing to use it"
    fi
  fi
  mkdir -p -- "$DIR"/{run,log,mon,osd}
  : >"$DIR/$MARKER"
  local t0=$SECONDS fsid v2 v1
  fsid=$(uuidgen)
  read -r v2 v1 < <(free_ports)
  cat >"$CONF" <<EOF
# Written by scripts/ceph-cluster.sh: a single-node test cluster, all of it under $DIR.
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$v2,v1:127.0.0.1:$v1]
public addr = 127.0.0.1
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
run dir = $DIR/run
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
# No admin socket line: the default puts a client's socket name under run dir with its pid,
# while one fixed name here would make concurrent clients collide.
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
# The disk under DIR may be fuller than a production mon would accept: the mon refuses to
# start (and a running one shuts down) when the free percentage, rounded down, is at or under
# crit. The mon's store here takes ~40 MiB, so only a full disk should stop it: -1 turns the
# check off (a CI disk at 1% free but 4.8 GiB stopped a crit of 1).
mon data avail warn = 0
mon data avail crit = -1
mon data = $DIR/mon/\$cluster-\$id
osd data = $DIR/osd/\$cluster-\$id
osd objectstore = memstore
memstore device bytes = $MEMSTORE_BYTES

[client]
keyring = $KEYRING
EOF
  echo "ceph-cluster: starting in $DIR (mon on 127.0.0.1:$v2 v2, :$v1 v1)" >&2

  ceph-authtool --create-keyring "$DIR/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool --create-keyring "$KEYRING" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
  ceph-authtool "$DIR/mon.keyring" --import-keyring "$KEYRING" >/dev/null
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$v2,v1:127.0.0.1:$v1]" \
    "$DIR/monmap" >/dev/null
  ceph-mon -c "$CONF" -i a --mkfs --monmap "$DIR/monmap" --keyring "$DIR/mon.keyring" \
    >"$DIR/log/mon-mkfs.log" 2>&1 || fail_start "ceph-mon --mkfs"
  # Without -f/-d the daemons fork into the background once they are set up.
  ceph-mon -c "$CONF" -i a >"$DIR/log/mon-start.log" 2>&1 || fail_start "ceph-mon"
  wait_for "$MON_UP_SECONDS" c mon stat || fail_start "the mon did not answer within $MON_UP_SECONDS s"

  local osd_uuid id
  osd_uuid=$(uuidgen)
  id=$(c osd new "$osd_uuid") || fail_start "ceph osd new"
  [ "$id" = 0 ] || fail_start "ceph osd new gave id '$id', expected 0"
  mkdir -p -- "$DIR/osd/ceph-0"
  ceph-osd -c "$CONF" -i 0 --mkfs --mkkey --osd-uuid "$osd_uuid" --no-mon-config \
    >"$DIR/log/osd-mkfs.log" 2>&1 || fail_start "ceph-osd --mkfs"
  c auth add osd.0 osd 'allow *' mon 'allow profile osd' mgr 'allow profile osd' \
    -i "$DIR/osd/ceph-0/keyring" >/dev/null 2>&1 || fail_start "ceph auth add osd.0"
  ceph-osd -c "$CONF" -i 0 >"$DIR/log/osd-start.log" 2>&1 || fail_start "ceph-osd"
  wait_for "$OSD_UP_SECONDS" osd_up || fail_start "the OSD was not up within $OSD_UP_SECONDS s"

  c osd pool create rbd 8 8 >/dev/null 2>&1 || fail_start "ceph osd pool create rbd"
  timeout "$POOL_READY_SECONDS" rbd -c "$CONF" pool init rbd >/dev/null 2>&1 ||
    fail_start "rbd pool init rbd (within $POOL_READY_SECONDS s)"
  write_env
  echo "ceph-cluster: ready in $((SECONDS - t0)) s" >&2
  print_env
}

stop() {
  [ -e "$DIR" ] || return 0
  [ -e "$DIR/$MARKER" ] || die "$DIR is not a cluster directory this script made: not removing it"
  kill_daemons
  rm -rf -- "$DIR"
}

case $verb in
  start) start ;;
  stop) stop ;;
  env)
    [ -s "$DIR/env" ] || die "no cluster in $DIR (start it first)"
    running || die "the cluster in $DIR is not running"
    print_env
    ;;
  *) usage ;;
esac
