#!/usr/bin/env bash
# Measures the release profile's link-time optimisation choices: for each variant, the
# release build of ucrypt and ucrypt-bench with that LTO and codegen-units setting (cargo's
# CARGO_PROFILE_RELEASE_* overrides, each variant in its own target directory), then
#   - the size of `ucrypt` as built and stripped (`strip --strip-unneeded`, as the package ships it),
#   - the start-up time of `ucrypt --version`: ROUNDS rounds of RUNS runs; the fastest round's
#     mean per run (the least disturbed by the other work of a shared machine),
#   - the sector cipher's hot throughput (`ucrypt-bench cipher --quick --only aes-xts-plain64`,
#     AES-XTS and AES-CBC rows), to see that the choice does not slow the crypto path.
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
src=$top/target/lto/src
rm -rf "$src"
mkdir -p "$src"
git archive HEAD | tar -x -C "$src"
echo "measure-lto: commit $(git rev-parse --short HEAD)" >&2

RUNS=${RUNS:-200}
ROUNDS=${ROUNDS:-5}
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(off:4 thin:4 fat:4 fat:1)

# mean_us BIN: the fastest of ROUNDS rounds' mean start-up time of `BIN --version`, in µs.
mean_us() {
  local best= r t0 t1 us
  for ((r = 0; r < ROUNDS; r++)); do
    t0=$(date +%s%N)
    for ((i = 0; i < RUNS; i++)); do "$1" --version >/dev/null; done
    t1=$(date +%s%N)
    us=$(((t1 - t0) / RUNS / 1000))
    if [ -z "$best" ] || [ "$us" -lt "$best" ]; then best=$us; fi
  done
  echo "$best"
}

echo "| lto | codegen-units | ucrypt MB (as built) | ucrypt MB (stripped) | \`ucrypt --version\` µs | aes-xts-plain64 512-bit 4096 B encrypt hot GB/s |"
echo "|---|---|---|---|---|---|"
for v in "${variants[@]}"; do
  lto=${v%%:*} cgu=${v##*:}
  dir=$top/target/lto/$lto-$cgu
  (cd "$src" && CARGO_INCREMENTAL=0 CARGO_TARGET_DIR=$dir CARGO_PROFILE_RELEASE_LTO=$lto \
    CARGO_PROFILE_RELEASE_CODEGEN_UNITS=$cgu \
    cargo build --release -q --locked -p ucrypt-cli -p ucrypt-bench >&2)
  bin=$dir/release/ucrypt
  strip --strip-unneeded -o "$dir/ucrypt.stripped" "$bin"
  mb() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.1f", b / 1e6 }'; }
  startup=$(mean_us "$dir/ucrypt.stripped")
  "$dir/release/ucrypt-bench" cipher --quick --only aes-xts-plain64 >"$dir/cipher.md" 2>/dev/null
  cipher=$(awk -F'|' '$2 ~ /aes-xts-plain64 *$/ && $3 ~ /512/ && $4 ~ /4096/ && $5 ~ /aws-lc/ { gsub(/ /, "", $6); print $6; exit }' "$dir/cipher.md")
  echo "| $lto | $cgu | $(mb "$bin") | $(mb "$dir/ucrypt.stripped") | $startup | ${cipher:-?} |"
done
