//! No heap allocation per I/O in steady state on authenticated volumes, split or not: a
//! counting global allocator sees zero allocations across thousands of mixed reads and writes
//! (aligned and unaligned, 512 B .. 1 MiB, flushes) after a warm-up, for the policies
//! `inline`, `parallel`, `queued` and `auto`, in journal and direct mode. (One binary, one
//! test: nothing else runs in the process while counting.)
//!
//! One-time allocations happen when the volume opens (its pool, journal section, crew threads
//! and their tag ciphers) and during warm-up (the callers' cached tag ciphers).

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use ucrypt::backend::{Backend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::integrity::HmacHash;
use ucrypt::integrity::{new_superblock, write_new_device, IntegrityVolume, TagMode, WriteMode};
use ucrypt::{BlockDev, SecretBytes};

struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: AllocLayout) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            ALLOCS.fetch_add(1, Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: AllocLayout) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            ALLOCS.fetch_add(1, Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: AllocLayout, n: usize) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            ALLOCS.fetch_add(1, Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: AllocLayout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const DEVICE_BYTES: u64 = 24 << 20;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Sizes and offsets: aligned and unaligned, 512 B .. 1 MiB (large ones split), a flush now
/// and then.
fn mixed(v: &IntegrityVolume, rng: &mut u64, buf: &mut [u8], n: usize) {
    let size = v.size();
    for i in 0..n {
        let len = match splitmix(rng) % 4 {
            0 => 4096,
            1 => 1 + splitmix(rng) % 20_000,
            2 => 1 << 20,
            _ => 1 + splitmix(rng) % (512 << 10),
        };
        let mut off = splitmix(rng) % (size - len);
        if splitmix(rng) % 2 == 0 {
            off &= !4095;
        }
        let b = &mut buf[..len as usize];
        if splitmix(rng) % 3 == 0 {
            v.write_at(b, off).unwrap();
        } else {
            v.read_at(b, off).unwrap();
        }
        if i % 50 == 49 {
            v.flush().unwrap();
        }
    }
}

#[test]
fn steady_state_io_does_not_allocate() {
    let mut report = Vec::new();
    let mut rng = 0x0a11_0c8e_u64;
    for mode in [
        TagMode::AesGcmRandom { key_bytes: 32 },
        TagMode::xts_random_hmac(HmacHash::Sha256),
    ] {
        for wm in [WriteMode::Journal, WriteMode::Direct] {
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
            let mut buf = vec![0u8; 1 << 20];
            v.write_zeroes(0, v.size()).unwrap();
            for policy in [
                Policy::Inline,
                Policy::Parallel,
                Policy::Queued,
                Policy::Auto,
            ] {
                v.set_policy(policy);
                // Warm-up: every path once.
                mixed(&v, &mut rng, &mut buf, 200);
                v.flush().unwrap();
                ALLOCS.store(0, Relaxed);
                COUNTING.store(true, Relaxed);
                mixed(&v, &mut rng, &mut buf, 1000);
                v.flush().unwrap();
                v.write_zeroes(12345, 3 << 20).unwrap();
                COUNTING.store(false, Relaxed);
                let n = ALLOCS.load(Relaxed);
                report.push(format!(
                    "{mode:?} {wm:?} {policy}: {n} allocations in 1,002 I/Os"
                ));
            }
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        report.iter().all(|l| l.contains(": 0 allocations")),
        "{}",
        report.join("\n")
    );
}
