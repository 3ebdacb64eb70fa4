//! Fuzzes the metadata readers of the headerless foreign formats: FileVault2's whole metadata
//! chain (`fvault2::read_params` over the bytes as a device: volume header, disk label,
//! groups descriptor, encrypted blocks), its decrypted-block parser (`Metadata::parse_block`,
//! the plists) and loop-AES's key file parser. None may panic or loop without bound.
//!
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none foreign_meta`
#![no_main]

use libfuzzer_sys::fuzz_target;
use ucrypt::backend::{Backend, MemBackend};
use ucrypt::{fvault2, loopaes};

fuzz_target!(|data: &[u8]| {
    let dev = MemBackend::new(data.len() as u64);
    if dev.write_at(data, 0).is_ok() {
        if let Ok(p) = fvault2::read_params(&dev) {
            let _ = p.dump("fuzz");
        }
    }
    let _ = fvault2::VolumeHeader::parse(data);
    let _ = fvault2::DiskLabel::parse(data, 0);
    let mut md = fvault2::Metadata::default();
    let _ = md.parse_block(data);
    if let Ok(kf) = loopaes::KeyFile::parse(data) {
        for bytes in loopaes::KEY_BYTES {
            let _ = kf.volume_key(bytes, None);
        }
    }
});
