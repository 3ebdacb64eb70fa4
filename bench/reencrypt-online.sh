#!/bin/sh
# Online key rotation under fio (root; FUSE + loop): fio 4 KiB QD1 random read and 1 MiB QD4
# sequential read on /dev/ucrypt/NAME, each for $SECS s before a rotation and during one; and
# the rotation's own time online (under the 4 KiB job) against offline on the same file.
# Prints ratios (during / before; offline / online). Usage: [UCRYPT=...] [SIZE=1G] [SECS=5]
# bench/reencrypt-online.sh
set -e
U=${UCRYPT:-target/release/ucrypt}
D=${DIR:-/var/tmp/ucrypt-online-bench}; mkdir -p $D
SIZE=${SIZE:-1G}; SECS=${SECS:-5}; N=bench-online-$$
HOT=${HOTZONE:-64M}
printf 'pw' > $D/k
P="--pbkdf pbkdf2 --pbkdf-force-iterations 1000"
now() { date +%s.%N; }
mk() { rm -f $D/a.img; truncate -s $SIZE $D/a.img; $U format -q $P --key-file $D/k $D/a.img;
       $U open $D/a.img $N --key-file $D/k --front-end loop >/dev/null;
       fio --name=fill --filename=/dev/ucrypt/$N --rw=write --bs=1M --direct=1 --ioengine=libaio \
           --iodepth=4 --output=/dev/null; }
fio_start() { # $1 = 4k|1m, $2 = seconds; runs fio in the background (its pid in $FIO)
  case $1 in
    4k) a="--rw=randread --bs=4k --iodepth=1 --ioengine=psync" ;;
    1m) a="--rw=read --bs=1M --iodepth=4 --ioengine=libaio" ;;
  esac
  fio --name=j --filename=/dev/ucrypt/$N $a --direct=1 --time_based --runtime=$2 \
      --output-format=json --output=$D/$1.json >/dev/null 2>&1 & FIO=$!
}
mibs() { python3 -c "
t = open('$D/$1.json').read(); import json
j = json.loads(t[t.index('{'):])['jobs'][0]['read']; print('%.1f' % (j['bw'] / 1024))"; }
rotate() { $U reencrypt -q $P --hotzone-size $HOT --key-file $D/k $D/a.img; }
echo "host load before: $(cut -d' ' -f1-3 /proc/loadavg)"
# Offline rotation of the same bytes.
mk; $U close $N
s=$(now); rotate; off=$(echo "$(now) - $s" | bc)
echo "offline rotation: $off s"
for J in 4k 1m; do
  mk
  fio_start $J $SECS; wait $FIO || true; before=$(mibs $J)
  # During: fio runs until the rotation ends (stopped with SIGINT, it writes its report).
  fio_start $J 3600; sleep 1
  s=$(now); rotate; on=$(echo "$(now) - $s" | bc)
  kill -INT $FIO; wait $FIO || true; during=$(mibs $J)
  echo "$J: before $before MiB/s, during $during MiB/s, ratio $(echo "scale=2; $during / $before" | bc);" \
       "rotation online $on s, offline/online $(echo "scale=2; $off / $on" | bc)"
  $U close $N
done
echo "host load after: $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf $D
