#!/usr/bin/env bash
# bench/regression.sh OLD_DIR NEW_DIR [ROUNDS]
#
# Does a change make ucrypt slower? Runs the engine, NBD and offline reencryption benchmarks
# on two builds, interleaved, and prints each headline figure's median per build and the
# ratio new ÷ old (higher is faster: every figure is a throughput).
#
# OLD_DIR and NEW_DIR each hold a release `ucrypt` and `ucrypt-bench` (a `target/release`).
#
# Why interleaved: this machine's clock and its other work change over minutes, so two builds
# measured one after the other differ by more than a regression worth finding. Each round runs
# every scenario once per build, old then new, and the medians are taken over the rounds: a
# slow minute lands on both builds alike.
#
# What each run is (one sample per run, --runs 1; ROUNDS runs of each build):
# - engine: OLD_DIR/ucrypt-bench and NEW_DIR/ucrypt-bench, each with its own library linked
#   in (`ucrypt-bench engine --only 1,2,3,4`: 4 KiB QD1 reads, 1 MiB writes at depth 64,
#   12 jobs of 256 KiB, one stream of 1 MiB; shm file and memory backends; about 40 s).
# - nbd and reencrypt with --quick (about 3 and 2 minutes on a loaded machine):
#   NEW_DIR/ucrypt-bench drives both builds' `ucrypt` (UCRYPT_BIN), so only
#   the binary under test differs. nbd: every job on every target; the rows of the ucrypt
#   targets are compared, and the peers' (qemu-storage-daemon, nbdkit: the same binaries for
#   both runs) show the noise. reencrypt: `ucrypt reencrypt` of a 256 MiB volume per
#   resilience mode and the datashift encryption, idle and beside 2 busy threads; wall time
#   turned into MiB/s.
#
# The table (bench/regression-table.py, which can be rerun on a results folder) gives for each
# row the medians, new ÷ old, and new ÷ old of each run's figure divided by its reference in
# the same run (see there).
#
# Environment: OUT (default bench/regression) gets raw/<scenario>-<build>-<round>.json, the
# runs' stderr in runs.log, and table.md; SCENARIOS (default "engine nbd reencrypt") picks
# and orders the scenarios; ENGINE_ONLY (default 1,2,3,4) the engine's scenarios. Needs what
# the scenarios need (fio, cryptsetup, qemu-img, nbdkit, qemu-storage-daemon; see
# BENCHMARKS.md) and python3.
set -euo pipefail

# The whole script is one block, read before it runs: editing the file during a run is safe.
{

usage() { echo "usage: $0 OLD_DIR NEW_DIR [ROUNDS]" >&2; exit 2; }
[ $# -ge 2 ] && [ $# -le 3 ] || usage
old=$(realpath "$1")
new=$(realpath "$2")
rounds=${3:-3}
out=${OUT:-bench/regression}
scenarios=${SCENARIOS:-engine nbd reencrypt}
engine_only=${ENGINE_ONLY:-1,2,3,4}
for d in "$old" "$new"; do
    for b in ucrypt ucrypt-bench; do
        [ -x "$d/$b" ] || { echo "$0: $d/$b is not an executable" >&2; exit 2; }
    done
done
for s in $scenarios; do
    case $s in engine | nbd | reencrypt) ;; *) echo "$0: unknown scenario $s" >&2; exit 2 ;; esac
done
mkdir -p "$out/raw"
rm -f "$out"/raw/*.json "$out/runs.log" "$out/table.md"

# run SCENARIO BUILD_DIR LABEL ROUND
run() {
    local s=$1 dir=$2 label=$3 round=$4 json="$out/raw/$1-$3-$4.json"
    local started=$SECONDS
    case $s in
    engine) "$dir/ucrypt-bench" engine --json --runs 1 --only "$engine_only" ;;
    nbd) UCRYPT_BIN="$dir/ucrypt" "$new/ucrypt-bench" nbd --json --quick --runs 1 ;;
    reencrypt) UCRYPT_BIN="$dir/ucrypt" "$new/ucrypt-bench" reencrypt --json --quick --runs 1 ;;
    esac >"$json" 2>>"$out/runs.log" || {
        echo "round $round/$rounds: $s $label FAILED (its stderr is in $out/runs.log)" |
            tee -a "$out/runs.log" >&2
        rm -f "$json"
        return 0
    }
    echo "round $round/$rounds: $s $label $((SECONDS - started)) s" | tee -a "$out/runs.log" >&2
}

{
    echo "old: $old ($("$old/ucrypt" --version 2>/dev/null | head -1))"
    echo "new: $new ($("$new/ucrypt" --version 2>/dev/null | head -1))"
    echo "rounds: $rounds; scenarios: $scenarios; start: $(date -u +%FT%TZ); load: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee -a "$out/runs.log" >&2
for round in $(seq 1 "$rounds"); do
    for s in $scenarios; do
        run "$s" "$old" old "$round"
        run "$s" "$new" new "$round"
    done
done
echo "end: $(date -u +%FT%TZ); load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/runs.log" >&2

python3 "$(dirname "$0")/regression-table.py" "$out" $scenarios | tee "$out/table.md"
exit
}
