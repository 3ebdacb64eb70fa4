//! An idle volume gives back what it took: its engine threads end and its pool's memory, but
//! for its first chunk, goes back to the kernel after `VolumeConfig::idle_release` without requests; the next request
//! starts them again and is served correctly, for every policy, from several threads at once.

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ucrypt::engine::Policy;
use ucrypt::pool::IDLE_KEPT_BYTES;
use ucrypt::volume::Volume;
use ucrypt::BlockDev;

const IDLE: Duration = Duration::from_millis(100);
/// Generous on a loaded machine: the threads end after IDLE, the pool within 2 * IDLE.
const WAIT_MAX: Duration = Duration::from_secs(20);

/// Writes then reads back `rounds` 256 KiB blocks (a pattern of `tag`) from 4 threads.
fn busy(vol: &Arc<Volume>, tag: u8, rounds: u64) {
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let vol = vol.clone();
            std::thread::spawn(move || {
                for i in 0..rounds {
                    // Each thread its own four blocks.
                    let off = (t * 4 + i % 4) * (256 << 10);
                    let data: Vec<u8> = (0..256 << 10)
                        .map(|j: usize| (j as u8) ^ tag ^ (i as u8))
                        .collect();
                    vol.write_at(&data, off).unwrap();
                    let mut back = vec![0u8; data.len()];
                    vol.read_at(&mut back, off).unwrap();
                    assert!(back == data, "block at {off} reads back wrong");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn wait_idle(vol: &Volume, what: &str) {
    let t0 = Instant::now();
    while (vol.threads_running() > 0 || vol.pool_resident_bytes() > IDLE_KEPT_BYTES)
        && t0.elapsed() < WAIT_MAX
    {
        std::thread::sleep(IDLE / 4);
    }
    assert_eq!(vol.threads_running(), 0, "{what}: threads still running");
    assert_eq!(
        vol.pool_resident_bytes(),
        IDLE_KEPT_BYTES,
        "{what}: pool memory kept beyond its first chunk"
    );
}

#[test]
fn idle_volume_releases_threads_and_memory_and_serves_again() {
    for policy in [
        Policy::Inline,
        Policy::Parallel,
        Policy::Ordered,
        Policy::Queued,
        Policy::Auto,
    ] {
        let r = rig(RigCfg {
            policy,
            size: 4 << 20,
            pool_bytes: 2 << 20,
            idle_release: IDLE,
            ..RigCfg::default()
        });
        let what = format!("{policy}");
        for round in 0..3u8 {
            busy(&r.vol, round.wrapping_mul(31), 16);
            if policy == Policy::Parallel {
                // Work was handed to workers started for it (they may have ended since, on a
                // slow machine: the counter is what is certain).
                assert!(r.vol.stats().split > 0, "{what}: nothing split");
            }
            wait_idle(&r.vol, &what);
        }
        r.vol.flush().unwrap();
    }
}
