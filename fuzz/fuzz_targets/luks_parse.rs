//! Fuzz the LUKS header parser straight from bytes: `ucrypt::luks::parse_any` must never
//! panic, and whatever parses must dump and describe its data layout without panicking.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run luks_parse -- -max_total_time=60`
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = ucrypt::luks::parse_any(data) {
        let _ = ucrypt::luks::dump(&h, "fuzz", None);
        let _ = h.data_layout();
        let _ = h.metadata_area_bytes();
        let _ = h.unmet_requirements();
    }
});
