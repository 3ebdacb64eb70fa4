//! Fuzzes the LUKS2 JSON metadata straight, past the binary header's checksum (which a
//! mutated header would fail first): `Metadata::parse` and `luks2::validate` must never panic, and
//! whatever validates must answer every question the unlock and dump paths ask of it.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none luks2_json`
#![no_main]

use libfuzzer_sys::fuzz_target;
use ucrypt::luks::json::Metadata;
use ucrypt::luks::luks2;

/// The metadata area of the smallest LUKS2 header (16 KiB copy, 4 KiB binary part).
const HDR_SIZE: u64 = 16 << 10;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = Metadata::parse(data) else { return };
    if luks2::validate(&m, HDR_SIZE).is_err() {
        return;
    }
    let _ = m.crypt_segment();
    let _ = m.requirements();
    let _ = m.used_keyslots();
    for k in m.keyslots.keys() {
        let _ = m.keyslot_params(k);
        let _ = m.digest_for_keyslot(k);
    }
});
