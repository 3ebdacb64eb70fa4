//! FUA through the engine: a `BlockDev::write_fua` is durable when it returns, under every
//! dispatch policy and both sector sizes, aligned or not, without a flush of the whole device.
//! Checked on a `CrashBackend`: after any seeded power cut the FUA'd range reads back, while
//! the same write without FUA is lost at some crash point (so the check can fail).

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::Arc;

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::engine::Policy;
use ucrypt::sector::SectorSize;
use ucrypt::volume::Volume;
use ucrypt::BlockDev;

const VOLUME_BYTES: usize = 256 << 10;
const DATA_OFFSET: u64 = 4096;
const SEEDS: u64 = 12;

fn volume(backend: Arc<dyn Backend>, sector: SectorSize, policy: Policy) -> Volume {
    common::crash_volume(
        backend,
        sector,
        policy,
        DATA_OFFSET,
        VOLUME_BYTES as u64,
        false,
    )
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

/// Writes `data` at `offset` (FUA or not) after some unflushed traffic, then checks every
/// crash image: returns how many crash points lost the write.
fn lost_after_crash(
    sector: SectorSize,
    policy: Policy,
    offset: usize,
    len: usize,
    fua: bool,
) -> u64 {
    let dev = Arc::new(CrashBackend::new(DATA_OFFSET + VOLUME_BYTES as u64, 512).unwrap());
    let vol = volume(dev.clone(), sector, policy);
    // Unflushed writes before and around it: a FUA write must not depend on them.
    vol.write_at(&pattern(64 << 10, 1), 0).unwrap();
    let mut data = pattern(len, 9);
    let want = data.clone();
    if fua {
        vol.write_fua(&mut data, offset as u64).unwrap();
    } else {
        vol.write_at_mut(&mut data, offset as u64).unwrap();
    }
    drop(vol);
    let mut lost = 0;
    for seed in 0..SEEDS {
        let img = dev.crash_image(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let back = Arc::new(CrashBackend::from_image(img, 512));
        let vol = volume(back, sector, policy);
        let mut got = vec![0u8; len];
        vol.read_at(&mut got, offset as u64).unwrap();
        if got != want {
            lost += 1;
        }
    }
    lost
}

#[test]
fn fua_writes_survive_every_crash_point() {
    let policies = [
        Policy::Inline,
        Policy::Parallel,
        Policy::Ordered,
        Policy::Queued,
        Policy::Auto,
    ];
    // Aligned in place, unaligned (read-modify-write), and large (split into pieces).
    let shapes = [(8192, 4096), (1000, 5000), (0, 200 << 10)];
    for sector in [SectorSize::S512, SectorSize::S4096] {
        for policy in policies {
            for (offset, len) in shapes {
                let lost = lost_after_crash(sector, policy, offset, len, true);
                assert_eq!(
                    lost, 0,
                    "{policy:?}, {sector:?}, {len} bytes at {offset}: a FUA write was lost"
                );
            }
        }
    }
}

#[test]
fn the_same_writes_without_fua_can_be_lost() {
    let lost = lost_after_crash(SectorSize::S4096, Policy::Inline, 8192, 4096, false);
    assert!(
        lost > 0,
        "no crash point lost an unflushed write: the check above proves nothing"
    );
}
