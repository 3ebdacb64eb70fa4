#!/usr/bin/env bash
# Runs the whole test suite and ends with one summary line: "tests: N passed, N failed, N skipped".
# A test that cannot run here (missing kernel feature, missing tool) prints "SKIPPED ..." with
# the reason; those are counted as skipped. Under CI=true missing Debian packages fail instead.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh all || exit 1
log=$(mktemp)
cargo test --workspace --no-fail-fast -- --show-output 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
sum() { grep -E '^test result:' "$log" | sed -E "s/.* ([0-9]+) $1.*/\\1/" | awk '{s+=$1} END {print s+0}'; }
passed=$(sum passed)
failed=$(sum failed)
skipped=$(grep -cE "^SKIPPED" "$log")
# A skipping test returns early and so counts as passed in cargo's own tally: move it over.
passed=$(( passed > skipped ? passed - skipped : 0 ))
echo
grep -E '^SKIPPED' "$log" | sort -u | sed 's/^/  /'
# Each failing test's own output again, its last lines, next to the summary (after the list of
# skips): a long run's log is often read from its end, and the failures' details are otherwise
# far up in it.
grep -E '^test .* \.\.\. FAILED$' "$log" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/' | sort -u |
  while read -r name; do
    echo
    echo "== failed: $name (its output's last 40 lines)"
    awk -v want="---- $name stdout ----" '
      $0 == want { on = 1; next }
      on && (/^---- .* stdout ----$/ || /^failures:$/ || /^successes:$/) { on = 0 }
      on { print }' "$log" | tail -n 40
  done
echo "tests: ${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
rm -f "$log"
exit "$rc"
