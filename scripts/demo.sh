#!/usr/bin/env bash
# ucrypt's main job on an embedded default, explained step by step. Sets up what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\n== %s\n' "$*"; }

say "1. Installing dependencies and building ucrypt (release)"
bash scripts/deps.sh
cargo build --release -q
UCRYPT=target/release/ucrypt

say "2. Sector cipher speed on this CPU (aes-xts-plain64 and the other dm-crypt specs, beside memcpy)"
$UCRYPT bench cipher --quick
