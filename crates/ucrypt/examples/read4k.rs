//! N sequential 4 KiB reads through a null-cipher volume on a memory backend, one thread, the
//! direct path: for counting instructions per read with callgrind. Run it for two N and divide
//! the difference of the totals by the difference of N (start-up cancels out):
//!
//! ```text
//! cargo build --release -p ucrypt --example read4k
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.a target/release/examples/read4k 100000
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.b target/release/examples/read4k 200000
//! ```

use std::sync::Arc;

use ucrypt::backend::MemBackend;
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

/// The volume's size: small enough to stay in cache.
const VOLUME_BYTES: u64 = 4 << 20;
const READ_BYTES: usize = 4096;

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let spec: CipherSpec = "cipher_null-ecb".parse().expect("null cipher spec");
    let geometry = Geometry {
        sector_size: SectorSize::new(4096).expect("4096 is a sector size"),
        iv_offset: 0,
        iv_large_sectors: false,
    };
    let cfg = VolumeConfig::new(spec, SecretBytes::from_slice(&[]), geometry);
    let vol = Volume::new(Arc::new(MemBackend::new(VOLUME_BYTES)), cfg).expect("volume");
    // Page-aligned buffer, as front ends hand in.
    let mut store = vec![0u8; READ_BYTES * 2];
    let off = store.as_ptr().align_offset(4096);
    let buf = &mut store[off..off + READ_BYTES];
    let slots = VOLUME_BYTES / READ_BYTES as u64;
    for i in 0..n {
        vol.read_at(buf, (i % slots) * READ_BYTES as u64)
            .expect("read");
    }
    println!("{n} reads");
}
