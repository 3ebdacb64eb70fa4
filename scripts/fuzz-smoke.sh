#!/usr/bin/env bash
# A short run of every fuzz target (LUKS1/LUKS2 headers, LUKS2 JSON metadata, the cipher-spec
# parser, the NBD server session, the NBD client's handshake and replies, the FUSE request
# handler, FileVault2 metadata and loop-AES key files), fed bytes straight from libFuzzer, starting from the committed seeds. Long runs:
# scripts/fuzz-long.sh. One target by hand:
#   cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none TARGET -- -max_total_time=600
# cargo-fuzz needs nightly-only compiler flags; RUSTC_BOOTSTRAP lets this stable toolchain
# accept them. Sanitizers are off (-s none): the targets are safe Rust.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
SECONDS_PER_TARGET=${FUZZ_SECONDS:-10}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked -q
for target in luks_parse luks2_json cipher_spec nbd_session nbd_client fuse_session foreign_meta; do
  mkdir -p "corpus/$target"
  seeds=(); [ -d "seeds/$target" ] && seeds=("seeds/$target")
  log=$(mktemp)
  if RUSTC_BOOTSTRAP=1 cargo fuzz run -s none "$target" "corpus/$target" "${seeds[@]}" -- \
      -max_total_time="$SECONDS_PER_TARGET" -max_len=40000 >"$log" 2>&1; then
    echo "fuzz $target: $(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1), no crash"
  else
    tail -40 "$log"; echo "fuzz $target: FAILED (see above)"; exit 1
  fi
  rm -f "$log"
done
