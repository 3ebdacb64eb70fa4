#!/usr/bin/env bash
# The long fuzz run whose results docs/fuzzing.md records: every target (or those named) for
# RUNS executions (default 10 million), from the committed seeds plus the local corpus, with
# libFuzzer's final statistics; one result line per target is appended to docs/fuzzing.md.
#   bash scripts/fuzz-long.sh [TARGET...]        RUNS=10000000 JOBS=1 by default
# A crash stops the run and leaves the reproducer under fuzz/artifacts/TARGET/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"
RUNS=${RUNS:-10000000}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(luks_parse luks2_json cipher_spec nbd_session nbd_client fuse_session)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked -q
RUSTC_BOOTSTRAP=1 cargo fuzz build -s none -O >/dev/null
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target"
  seeds=(); [ -d "seeds/$target" ] && seeds=("seeds/$target")
  log="corpus/$target.long.log"
  start=$(date -u +%FT%TZ); t0=$SECONDS
  if ! RUSTC_BOOTSTRAP=1 cargo fuzz run -s none -O "$target" "corpus/$target" "${seeds[@]}" -- \
      -runs="$RUNS" -max_len=40000 -print_final_stats=1 -close_fd_mask=3 >"$log" 2>&1; then
    tail -40 "$log"; echo "fuzz $target: CRASH (see above; reproducer under fuzz/artifacts/$target/)"; exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -1)
  line="| $start | $target | $execs | $((SECONDS - t0)) s | $rate/s | $cov | 0 |"
  echo "$line"
  echo "$line" >> "$root/docs/fuzzing.md"
done
