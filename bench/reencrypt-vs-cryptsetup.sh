#!/bin/sh
# 1 GiB file key rotation: ucrypt reencrypt vs cryptsetup reencrypt, per resilience; and
# ucrypt export + import of the same bytes.
set -e
U=${UCRYPT:-target/release/ucrypt}
D=${DIR:-/dev/shm/ucrypt-reencrypt-bench}; mkdir -p $D
printf 'pw' > $D/k
t() { s=$(date +%s.%N); "$@" >/dev/null 2>&1; e=$(date +%s.%N); echo "$e - $s" | bc; }
for R in checksum journal none; do
  rm -f $D/a.img; truncate -s 1040M $D/a.img
  cryptsetup luksFormat -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 $D/a.img $D/k
  cp $D/a.img $D/b.img
  tu=$(t $U reencrypt -q --resilience $R --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file $D/k $D/a.img)
  tc=$(t cryptsetup reencrypt -q --force-offline-reencrypt --resilience $R --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file $D/k $D/b.img)
  echo "$R ucrypt=$tu cryptsetup=$tc"
done
te=$(t $U export --key-file $D/k $D/a.img $D/plain)
ti=$(t $U import $D/plain $D/a.img --key-file $D/k)
echo "export=$te import=$ti"
rm -rf $D
