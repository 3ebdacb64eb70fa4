//! Many threads on one volume: overlapping and disjoint ranges, aligned and unaligned; no torn
//! sector, no lost read-modify-write update, no deadlock with a tiny pool.

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ucrypt::backend::Backend;
use ucrypt::engine::Policy;
use ucrypt::BlockDev;

/// Runs `f` on a thread and fails (naming `what`) if it does not finish in time: a deadlock
/// shows up as a failure, not a hung test run.
fn with_deadline(what: String, secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p)
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: no progress in {secs} s (deadlock?)")
        }
    }
}

/// A backend that writes in 256-byte steps with a yield between, so that two unsynchronised
/// writes of one sector interleave (a real disk may tear the same way).
struct Choppy(Arc<dyn Backend>);

impl Backend for Choppy {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        for (i, c) in buf.chunks(256).enumerate() {
            self.0.write_at(c, offset + i as u64 * 256)?;
            std::thread::yield_now();
        }
        Ok(())
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.0.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.0.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.0.write_zeroes(offset, len)
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn logical_block_bytes(&self) -> u32 {
        self.0.logical_block_bytes()
    }
    fn describe(&self) -> String {
        "choppy".into()
    }
}

/// Each writer fills whole-sector ranges with its own stamp; ranges overlap across threads.
/// Afterwards every sector must hold one stamp entirely.
#[test]
fn overlapping_writers_never_tear_a_sector() {
    let base = kit::seed_or(42);
    for (i, policy) in Policy::ALL.into_iter().enumerate() {
        for sector in [512u32, 4096] {
            let wrap = |b: Arc<dyn Backend>| -> Arc<dyn Backend> { Arc::new(Choppy(b)) };
            let r = rig_over(
                RigCfg {
                    policy,
                    sector,
                    size: 1 << 20,
                    pool_bytes: 512 << 10,
                    seed: base + i as u64,
                    ..RigCfg::default()
                },
                Some(&wrap),
            );
            let ss = sector as u64;
            let sectors = (1u64 << 20) / ss;
            let vol = r.vol.clone();
            // Never-written sectors decrypt to noise: start from all zeroes.
            vol.write_zeroes(0, vol.size()).unwrap();
            with_deadline(format!("{policy} {sector}"), 120, move || {
                let threads: Vec<_> = (0..8u64)
                    .map(|t| {
                        let vol = vol.clone();
                        std::thread::spawn(move || {
                            let mut rng = StdRng::seed_from_u64(base ^ (t << 32));
                            for n in 0..150u64 {
                                // Mostly a small hot region, so that writes really collide.
                                let hot = if n % 8 == 0 { sectors } else { 6 };
                                let first = rng.random_range(0..hot);
                                let count = rng.random_range(1..=(hot - first).min(300));
                                let stamp = (t << 8 | (n & 0xff)) as u16;
                                let buf = stamp.to_le_bytes().repeat((count * ss / 2) as usize);
                                vol.write_at(&buf, first * ss).unwrap();
                            }
                        })
                    })
                    .collect();
                for t in threads {
                    t.join().unwrap();
                }
                let mut all = vec![0u8; 1 << 20];
                vol.read_at(&mut all, 0).unwrap();
                for (s, sec) in all.chunks(ss as usize).enumerate() {
                    assert!(
                        sec.chunks(2).all(|w| w == &sec[..2]),
                        "{policy} sector size {sector}: sector {s} is torn"
                    );
                }
            });
        }
    }
}

/// Threads write small unaligned pieces that share sectors but never bytes: a read-modify-write
/// that is not locked would lose other threads' bytes.
#[test]
fn unaligned_writers_sharing_sectors_lose_nothing() {
    let base = kit::seed_or(7);
    for policy in Policy::ALL {
        let r = rig(RigCfg {
            policy,
            sector: 4096,
            size: 256 << 10,
            seed: base,
            ..RigCfg::default()
        });
        const THREADS: u64 = 6;
        const SLOT: u64 = 24; // bytes each thread owns in every 144-byte stripe
        let vol = r.vol.clone();
        with_deadline(format!("{policy}"), 120, move || {
            let size = vol.size();
            let threads: Vec<_> = (0..THREADS)
                .map(|t| {
                    let vol = vol.clone();
                    std::thread::spawn(move || {
                        let stripe = SLOT * THREADS;
                        let mut buf = [0u8; SLOT as usize];
                        for k in 0..size / stripe {
                            buf.fill((t as u8 + 1).wrapping_mul(k as u8 | 1));
                            vol.write_at(&buf, k * stripe + t * SLOT).unwrap();
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            let mut all = vec![0u8; size as usize];
            vol.read_at(&mut all, 0).unwrap();
            let stripe = SLOT * THREADS;
            for k in 0..size / stripe {
                for t in 0..THREADS {
                    let o = (k * stripe + t * SLOT) as usize;
                    let want = (t as u8 + 1).wrapping_mul(k as u8 | 1);
                    assert!(
                        all[o..o + SLOT as usize].iter().all(|&b| b == want),
                        "{policy}: lost update at byte {o}"
                    );
                }
            }
        });
    }
}

/// A pool of two sectors and 1 MiB requests from several threads, reads and writes, aligned and
/// not: everything completes and reads back.
#[test]
fn tiny_pool_big_requests_no_deadlock() {
    let base = kit::seed_or(99);
    for policy in Policy::ALL {
        for sector in [512u32, 4096] {
            let r = rig(RigCfg {
                policy,
                sector,
                size: 4 << 20,
                pool_bytes: 2 * sector as usize,
                seed: base,
                ..RigCfg::default()
            });
            let vol = r.vol.clone();
            with_deadline(format!("{policy} {sector}"), 120, move || {
                let threads: Vec<_> = (0..4u64)
                    .map(|t| {
                        let vol = Arc::clone(&vol);
                        std::thread::spawn(move || {
                            // Each thread owns one MiB; writes then reads it back, twice.
                            let off = t << 20;
                            for round in 0..2u8 {
                                let skew = if round == 0 { 0 } else { 100 };
                                let len = (1usize << 20) - skew as usize;
                                let data: Vec<u8> =
                                    (0..len).map(|i| (i as u8) ^ (t as u8) ^ round).collect();
                                vol.write_at(&data, off + skew).unwrap();
                                let mut back = vec![0u8; len];
                                vol.read_at(&mut back, off + skew).unwrap();
                                assert!(back == data, "thread {t} round {round}: data differs");
                            }
                        })
                    })
                    .collect();
                for t in threads {
                    t.join().unwrap();
                }
            });
        }
    }
}

/// The engine benchmark's 12-job mix (256 KiB random reads and writes) under every splitting
/// policy: callers hand chunks to the workers and take back unstarted ones, hard, for a while.
/// Regression: this once hung when taken-back chunks filled the job queue with tombstones.
#[test]
fn many_callers_splitting_requests_no_deadlock() {
    let base = kit::seed_or(12);
    for policy in [
        Policy::Parallel,
        Policy::Ordered,
        Policy::Auto,
        Policy::Queued,
    ] {
        let r = rig(RigCfg {
            policy,
            size: 16 << 20,
            pool_bytes: 2 << 20,
            seed: base,
            ..RigCfg::default()
        });
        let vol = r.vol.clone();
        with_deadline(format!("{policy}"), 120, move || {
            let threads: Vec<_> = (0..12u64)
                .map(|t| {
                    let vol = vol.clone();
                    std::thread::spawn(move || {
                        let mut rng = StdRng::seed_from_u64(base ^ t);
                        let mut buf = vec![t as u8; 256 << 10];
                        for _ in 0..150 {
                            let off = rng.random_range(0..64u64) * (256 << 10);
                            if rng.random_bool(0.5) {
                                vol.read_at(&mut buf, off).unwrap();
                            } else {
                                vol.write_at(&buf, off).unwrap();
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
        });
    }
}

/// More writers of 1 MiB than the pool holds whole pieces for, so each write goes in parts of
/// the pool's fair share: every part lands, encrypted with its own sectors' IVs (the backend
/// holds what a cipher of our own makes of the data), under every policy and both sector sizes.
#[test]
fn writes_in_fair_share_parts_land_whole() {
    let base = kit::seed_or(27);
    for policy in Policy::ALL {
        for sector in [512u32, 4096] {
            let threads = 12u64;
            let r = rig(RigCfg {
                policy,
                sector,
                size: threads << 20,
                // A fair share of 2 MiB / 12: parts of 128 KiB or so.
                pool_bytes: 2 << 20,
                seed: base,
                ..RigCfg::default()
            });
            let (vol, backend) = (r.vol.clone(), r.backend.clone());
            let (key, geometry, spec, data_offset) =
                (r.key.clone(), r.geometry, r.spec, r.data_offset);
            with_deadline(format!("{policy} {sector}"), 120, move || {
                let writers: Vec<_> = (0..threads)
                    .map(|t| {
                        let vol = Arc::clone(&vol);
                        std::thread::spawn(move || {
                            let off = t << 20;
                            for round in 0..4u8 {
                                let data: Vec<u8> = (0..1usize << 20)
                                    .map(|i| (i as u8) ^ (t as u8).wrapping_mul(31) ^ round)
                                    .collect();
                                vol.write_at(&data, off).unwrap();
                                let mut back = vec![0u8; data.len()];
                                vol.read_at(&mut back, off).unwrap();
                                assert!(back == data, "thread {t} round {round}: data differs");
                            }
                        })
                    })
                    .collect();
                for w in writers {
                    w.join().unwrap();
                }
                let mut c = ucrypt::sector::SectorCipher::new(spec, &key, geometry).unwrap();
                for t in 0..threads {
                    let mut want: Vec<u8> = (0..1usize << 20)
                        .map(|i| (i as u8) ^ (t as u8).wrapping_mul(31) ^ 3)
                        .collect();
                    c.encrypt((t << 20) / u64::from(sector), &mut want).unwrap();
                    let mut got = vec![0u8; want.len()];
                    backend
                        .read_exact_at(&mut got, data_offset + (t << 20))
                        .unwrap();
                    assert!(got == want, "thread {t}: ciphertext on the backend differs");
                }
            });
        }
    }
}
