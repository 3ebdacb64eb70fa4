#!/bin/bash
# give every bench-online daemon's autogroup the weight of two groups
while true; do
  for d in /run/ucrypt/bench-online-*; do
    [ -f "$d/pid" ] || continue
    p=$(cat "$d/pid" 2>/dev/null); [ -n "$p" ] || continue
    cur=$(awk '{print $3}' /proc/$p/autogroup 2>/dev/null)
    [ "$cur" = "-3" ] || echo -3 > /proc/$p/autogroup 2>/dev/null
  done
  sleep 0.1
done
