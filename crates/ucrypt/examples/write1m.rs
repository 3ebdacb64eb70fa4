//! N writes of 1 MiB through a volume on a memory backend, beside the same writes without
//! ucrypt (each thread encrypts into a buffer of its own and writes it to the backend: the
//! `raw+crypt x64` row of `ucrypt-bench engine` scenario 2). For counting instructions, copies
//! and memsets per MiB with callgrind, and for `perf record`:
//!
//! ```text
//! cargo build --release -p ucrypt --example write1m
//! # write1m MODE CIPHER N [THREADS] [POLICY] [POOL_MIB]
//! #   MODE: vol (Volume::write_at), volmut (Volume::write_at_mut, as the NBD server calls it),
//! #         vol256 (each MiB as four 256 KiB writes), bare (encrypt into an own buffer +
//! #         backend write); CIPHER: null | xts
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.a target/release/examples/write1m vol xts 200
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.b target/release/examples/write1m vol xts 400
//! ```
//!
//! (total(b) - total(a)) / 200 is the cost of one 1 MiB write; start-up cancels out.

use std::sync::Arc;

use ucrypt::backend::{Backend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

const WRITE_BYTES: usize = 1 << 20;
/// Each thread writes its own region of this many 1 MiB slots (as scenario 2 does).
const SLOTS_PER_THREAD: u64 = 4;

/// A page-aligned buffer of `len` bytes filled with `byte`.
struct Aligned {
    store: Vec<u8>,
    at: usize,
}

impl Aligned {
    fn new(len: usize, byte: u8) -> Self {
        let store = vec![byte; len + 4096];
        let at = store.as_ptr().align_offset(4096);
        Aligned { store, at }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.store[self.at..self.at + WRITE_BYTES]
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let mode = arg(1, "vol");
    let spec = match arg(2, "xts").as_str() {
        "null" => CipherSpec::NULL,
        "xts" => CipherSpec::AES_XTS_PLAIN64,
        other => panic!("cipher {other}: null or xts"),
    };
    let n: u64 = arg(3, "200").parse().expect("N");
    let threads: u64 = arg(4, "1").parse().expect("THREADS");
    let policy: Policy = arg(5, "inline").parse().expect("POLICY");
    let pool_mib: usize = arg(6, "16").parse().expect("POOL_MIB");
    let geometry = Geometry::new(SectorSize::S4096);
    // Halves that differ: AWS-LC refuses an XTS key whose halves are equal.
    let key: Vec<u8> = (0..spec.default_key_bytes()).map(|i| i as u8).collect();
    let bytes = threads * SLOTS_PER_THREAD * WRITE_BYTES as u64;
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new(bytes));
    let vol = (mode != "bare").then(|| {
        let mut cfg = VolumeConfig::new(spec, SecretBytes::from_slice(&key), geometry);
        cfg.policy = policy.into();
        cfg.pool_bytes = pool_mib << 20;
        Arc::new(Volume::new(backend.clone(), cfg).expect("volume"))
    });
    let per_thread = n.div_ceil(threads);
    let workers: Vec<_> = (0..threads)
        .map(|th| {
            let (vol, backend, key, mode) =
                (vol.clone(), backend.clone(), key.clone(), mode.clone());
            std::thread::spawn(move || {
                let mut src = Aligned::new(WRITE_BYTES, 0x5a + th as u8);
                let mut own = (mode == "bare").then(|| {
                    let c = SectorCipher::new(spec, &key, geometry).expect("cipher");
                    (c, Aligned::new(WRITE_BYTES, 0))
                });
                let base = th * SLOTS_PER_THREAD * WRITE_BYTES as u64;
                for i in 0..per_thread {
                    let off = base + (i % SLOTS_PER_THREAD) * WRITE_BYTES as u64;
                    match (&vol, own.as_mut()) {
                        (_, Some((c, dst))) => {
                            if spec.mode == ucrypt::sector::Mode::Null {
                                dst.get().copy_from_slice(src.get());
                            } else {
                                c.encrypt_to(off / 4096, src.get(), dst.get())
                                    .expect("encrypt");
                            }
                            backend.write_at(dst.get(), off).expect("write");
                        }
                        (Some(v), None) if mode == "volmut" => {
                            // The NBD server's payload buffer: refilled by each request.
                            src.get()[..64].fill(i as u8);
                            v.write_at_mut(src.get(), off).expect("write");
                        }
                        (Some(v), None) if mode == "vol256" => {
                            // The same MiB as four writes of 256 KiB.
                            for (k, part) in src.get().chunks(256 << 10).enumerate() {
                                v.write_at(part, off + (k as u64) * (256 << 10))
                                    .expect("write");
                            }
                        }
                        (Some(v), None) => v.write_at(src.get(), off).expect("write"),
                        (None, None) => unreachable!("a volume or a bare cipher"),
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("writer");
    }
    println!(
        "{mode}: {} x 1 MiB writes, {threads} threads",
        per_thread * threads
    );
}
