//! N requests of one size through an authenticated volume on a memory backend (direct mode,
//! 4096-byte blocks), for counting instructions per request with callgrind. Run it for two N
//! and divide the difference of the totals by the difference of N (start-up cancels out):
//!
//! ```text
//! cargo build --release -p ucrypt --example integrity_cost
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.a \
//!     target/release/examples/integrity_cost chacha read 4096 1000
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.b \
//!     target/release/examples/integrity_cost chacha read 4096 2000
//! ```
//!
//! Modes: `gcm`, `chacha`, `aegis`, `hmac256`, `hmac512`; operations: `read`, `write`; the size in bytes
//! (a multiple of 4096). A fifth argument `journal` sends writes through the journal (a flush
//! every request; default `direct`); a sixth names the dispatch policy (default `inline`:
//! everything on this thread; callgrind counts every thread's instructions either way, so
//! `parallel` shows what a split adds in total).

use std::sync::Arc;

use ucrypt::backend::{Backend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::integrity::WriteMode;
use ucrypt::integrity::{new_superblock, write_new_device, HmacHash, IntegrityVolume, TagMode};
use ucrypt::{BlockDev, SecretBytes};

/// The device: small enough that a memory backend stays cheap, large enough for 4 MiB requests.
const DEVICE_BYTES: u64 = 48 << 20;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let mode = match arg(1, "gcm").as_str() {
        "gcm" => TagMode::AesGcmRandom { key_bytes: 32 },
        "chacha" => TagMode::ChaCha20RandomPoly1305,
        "aegis" => TagMode::Aegis128Random,
        "hmac256" => TagMode::xts_random_hmac(HmacHash::Sha256),
        "hmac512" => TagMode::xts_random_hmac(HmacHash::Sha512),
        m => panic!("unknown mode {m}: gcm, chacha, aegis, hmac256, hmac512"),
    };
    let write = match arg(2, "read").as_str() {
        "read" => false,
        "write" => true,
        o => panic!("unknown operation {o}: read, write"),
    };
    let size: usize = arg(3, "4096").parse().expect("size in bytes");
    let n: u64 = arg(4, "1000").parse().expect("number of requests");
    let wm = if arg(5, "direct") == "journal" {
        WriteMode::Journal
    } else {
        WriteMode::Direct
    };
    assert!(size > 0 && size % 4096 == 0, "size: a multiple of 4096");
    let be: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
    let l = new_superblock(mode.tuple_bytes() as u16, 4096, 0, DEVICE_BYTES / 512, true)
        .expect("superblock");
    write_new_device(be.as_ref(), 0, &l).expect("format");
    let key: Vec<u8> = (0..mode.key_bytes() as u8).collect();
    let v = IntegrityVolume::with_write_mode(
        be,
        0,
        l.sb,
        mode,
        SecretBytes::from_slice(&key),
        false,
        wm,
    )
    .expect("volume");
    let policy: Policy = arg(6, "inline").parse().expect("policy");
    v.set_policy(policy);
    let mut store = vec![0u8; size + 4096];
    let off = store.as_ptr().align_offset(4096);
    let buf = &mut store[off..off + size];
    let slots = (v.size() / size as u64).min(16);
    // Every block read below written once, so that its tag verifies.
    for i in 0..slots {
        v.write_at(buf, i * size as u64).expect("fill");
    }
    for i in 0..n {
        let at = (i % slots) * size as u64;
        if write {
            v.write_at(buf, at).expect("write");
            if wm == WriteMode::Journal {
                v.flush().expect("flush");
            }
        } else {
            v.read_at(buf, at).expect("read");
        }
    }
    std::hint::black_box(&buf);
}
