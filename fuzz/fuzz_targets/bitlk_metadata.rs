//! Fuzzes the BitLocker metadata parser: the FVE metadata (headers and entries, with the
//! nested VMK properties) under a fixed good boot sector, then the segments of what parses.
//! Parsing never panics or hangs; segments that are returned cover the device exactly.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none bitlk_metadata`
#![no_main]

use libfuzzer_sys::fuzz_target;
use ucrypt::bitlk::{parse_boot_sector, parse_metadata, segments, BOOT_SECTOR_BYTES};

fn boot_sector() -> Vec<u8> {
    let mut b = vec![0u8; BOOT_SECTOR_BYTES];
    b[..3].copy_from_slice(b"\xeb\x58\x90");
    b[3..11].copy_from_slice(b"-FVE-FS-");
    b[11..13].copy_from_slice(&512u16.to_le_bytes());
    for (i, o) in [0x1_0000u64, 0x10_0000, 0x20_0000].iter().enumerate() {
        let at = 160 + 16 + 8 * i;
        b[at..at + 8].copy_from_slice(&o.to_le_bytes());
    }
    b
}

fuzz_target!(|data: &[u8]| {
    // The boot sector's checks are a unit-test table (`bitlk/tests.rs`); it stays good here.
    let Ok(bs) = parse_boot_sector(&boot_sector()) else { return };
    let Ok(m) = parse_metadata(&bs, data) else { return };
    let device_bytes = 100 << 20;
    if let Ok(segs) = segments(&m, device_bytes) {
        let covered: u64 = segs.iter().map(|s| s.len).sum();
        assert_eq!(covered, device_bytes);
    }
});
