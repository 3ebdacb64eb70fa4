#!/usr/bin/env bash
# Measures the release profile's link-time optimisation choices. First it builds, for each
# variant, ucrypt and ucrypt-bench with that LTO and codegen-units setting (cargo's
# CARGO_PROFILE_RELEASE_* overrides, each variant in its own target directory); then it
# measures the variants side by side, round-robin, so that the load of a shared machine falls
# on each alike:
#   - the size of `ucrypt` as built and stripped (`strip --strip-unneeded`, as the package ships it),
#   - the start-up time of `ucrypt --version` (stripped): ROUNDS rounds, each running every
#     variant RUNS times; per variant the fastest round's mean per run (the least disturbed),
#   - the sector cipher's hot throughput per CPU-second (`ucrypt-bench cipher --quick --only
#     aes-xts-plain64`, 512-bit key, 4096-byte sectors; AWS-LC's XTS and ucrypt's own XTS over
#     AES-ECB, whose loop is Rust that LTO can inline into), once per round for CIPHER_ROUNDS
#     rounds, the best median, to see that the choice does not slow the crypto path.
# Prints one markdown row per variant (BENCHMARKS.md, "Package sizes").
#
#   bash scripts/measure-lto.sh [VARIANT...]     VARIANT = LTO:CODEGEN_UNITS, e.g. fat:1
#
# Default variants: off:4 thin:4 fat:4 fat:1. It builds the committed tree (HEAD, unpacked
# into target/lto/src), so that edits made while it runs do not enter a build; target
# directories: target/lto/LTO-CGU.
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)

RUNS=${RUNS:-200}
ROUNDS=${ROUNDS:-5}
CIPHER_ROUNDS=${CIPHER_ROUNDS:-3}
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(off:4 thin:4 fat:4 fat:1)
dir_of() { echo "$top/target/lto/${1%%:*}-${1##*:}"; }

if [ -z "${SKIP_BUILD:-}" ]; then
  src=$top/target/lto/src
  rm -rf "$src"
  mkdir -p "$src"
  git archive HEAD | tar -x -C "$src"
  echo "measure-lto: commit $(git rev-parse --short HEAD)" >&2
  for v in "${variants[@]}"; do
    (cd "$src" && CARGO_INCREMENTAL=0 CARGO_TARGET_DIR=$(dir_of "$v") \
      CARGO_PROFILE_RELEASE_LTO=${v%%:*} CARGO_PROFILE_RELEASE_CODEGEN_UNITS=${v##*:} \
      cargo build --release -q --locked -p ucrypt-cli -p ucrypt-bench >&2)
  done
fi

declare -A best_us best_gbps
for v in "${variants[@]}"; do
  d=$(dir_of "$v")
  strip --strip-unneeded -o "$d/ucrypt.stripped" "$d/release/ucrypt"
done
for ((r = 0; r < ROUNDS; r++)); do
  for v in "${variants[@]}"; do
    bin=$(dir_of "$v")/ucrypt.stripped
    t0=$(date +%s%N)
    for ((i = 0; i < RUNS; i++)); do "$bin" --version >/dev/null; done
    us=$((($(date +%s%N) - t0) / RUNS / 1000))
    if [ -z "${best_us[$v]:-}" ] || [ "$us" -lt "${best_us[$v]}" ]; then best_us[$v]=$us; fi
  done
done
for ((r = 0; r < CIPHER_ROUNDS; r++)); do
  for v in "${variants[@]}"; do
    d=$(dir_of "$v")
    "$d/release/ucrypt-bench" cipher --quick --only aes-xts-plain64 >"$d/cipher-$r.md" 2>/dev/null
    for p in aws-lc-xts ecb-xts; do
      # The median of the 512-bit, 4096-byte-sector row's hot encrypt GB/s per CPU-second (the
      # CPU time, not the wall clock: what other load on the machine disturbs least).
      g=$(awk -F'|' -v p="$p" '$2 ~ /aes-xts-plain64 *$/ && $3 ~ /512/ && $4 ~ /4096/ && $5 ~ p { split($9, a, "("); gsub(/ /, "", a[1]); print a[1]; exit }' "$d/cipher-$r.md")
      k="$v $p"
      if [ -n "$g" ] && { [ -z "${best_gbps[$k]:-}" ] || awk -v a="$g" -v b="${best_gbps[$k]}" 'BEGIN { exit !(a > b) }'; }; then
        best_gbps[$k]=$g
      fi
    done
  done
done

mb() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.1f", b / 1e6 }'; }
echo "| lto | codegen-units | ucrypt MB (as built) | ucrypt MB (stripped) | \`ucrypt --version\` µs | AES-XTS aws-lc-xts GB/s per CPU-s | AES-XTS ecb-xts GB/s per CPU-s |"
echo "|---|---|---|---|---|---|---|"
for v in "${variants[@]}"; do
  d=$(dir_of "$v")
  echo "| ${v%%:*} | ${v##*:} | $(mb "$d/release/ucrypt") | $(mb "$d/ucrypt.stripped") | ${best_us[$v]} | ${best_gbps[$v aws-lc-xts]:-?} | ${best_gbps[$v ecb-xts]:-?} |"
done
