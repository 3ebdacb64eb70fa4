//! Direct mode's crash guarantee, with the crash simulator (`CrashBackend`): after a power cut
//! at a seeded point, every block of an authenticated volume either reads its last flushed
//! plaintext, or (only if it was written since that flush) one of the plaintexts written to it
//! since, or fails with the integrity error. Never wrong plaintext, never a failure of a block
//! left alone since the flush. Both tag modes, 512- and 4096-byte blocks, 512- and 4096-byte
//! atomic units; areas of 512 KiB so writes cross area boundaries.

use std::collections::BTreeSet;
use std::sync::Arc;

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::integrity::superblock::flags;
use ucrypt::integrity::{HmacHash, IntegrityVolume, Layout, Superblock, TagMode};
use ucrypt::{BlockDev, Error, SecretBytes};

const DEVICE_BYTES: u64 = 4 << 20;
/// Where the superblock sits (as after a LUKS2 header).
const START_BYTES: u64 = 64 << 10;
const ROUNDS: u64 = 12;
const WRITES_PER_ROUND: u64 = 40;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn superblock(mode: TagMode, log2_spb: u8) -> Superblock {
    let mut sb = Superblock {
        version: 4,
        log2_interleave_sectors: 10,
        tag_bytes: mode.tuple_bytes() as u16,
        journal_sections: 1,
        provided_data_sectors: 8,
        flags: flags::FIXED_PADDING,
        log2_sectors_per_block: log2_spb,
        log2_blocks_per_bitmap_bit: 0,
        recalc_sector: 0,
        salt: [0; 16],
    };
    let l = Layout::new(sb).expect("layout");
    sb.provided_data_sectors = l.max_provided_sectors(START_BYTES / 512, DEVICE_BYTES / 512);
    sb
}

fn volume(be: Arc<dyn Backend>, sb: Superblock, mode: TagMode, key: &[u8]) -> IntegrityVolume {
    IntegrityVolume::new(
        be,
        START_BYTES,
        sb,
        mode,
        SecretBytes::from_slice(key),
        false,
    )
    .expect("volume")
}

#[test]
fn after_any_crash_each_block_is_flushed_written_or_an_integrity_error() {
    let seed: u64 = std::env::var("UCRYPT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1f2e_3d4c);
    println!("seed: UCRYPT_TEST_SEED={seed}");
    let modes = [
        TagMode::AesGcmRandom { key_bytes: 32 },
        TagMode::AesXtsRandomHmac(HmacHash::Sha256),
    ];
    let mut failed_reads = 0u64;
    for mode in modes {
        for log2_spb in [0u8, 3] {
            for unit in [512u64, 4096] {
                let mut rng = seed ^ (u64::from(log2_spb) << 8) ^ unit ^ mode.tuple_bytes() as u64;
                let key: Vec<u8> = (0..mode.key_bytes())
                    .map(|_| splitmix(&mut rng) as u8)
                    .collect();
                let sb = superblock(mode, log2_spb);
                let bb = 512usize << log2_spb;
                let blocks = (sb.provided_data_sectors * 512) as usize / bb;
                let crash = Arc::new(CrashBackend::new(DEVICE_BYTES, unit).expect("crash backend"));
                crash
                    .write_at(&sb.serialize(), START_BYTES)
                    .expect("superblock");
                let v = volume(crash.clone(), sb, mode, &key);
                // Every block written once and flushed: the durable state.
                let mut durable = vec![0u8; blocks * bb];
                for (i, b) in durable.iter_mut().enumerate() {
                    *b = (i % 251) as u8;
                }
                v.write_at(&durable, 0).expect("fill");
                v.flush().expect("flush");
                for round in 0..ROUNDS {
                    // Since the last flush: the plaintexts each block may hold.
                    let mut current = durable.clone();
                    let mut since: Vec<BTreeSet<Vec<u8>>> = vec![BTreeSet::new(); blocks];
                    for w in 0..WRITES_PER_ROUND {
                        let first = (splitmix(&mut rng) % blocks as u64) as usize;
                        let n = (1 + splitmix(&mut rng) % 9).min((blocks - first) as u64) as usize;
                        let fill = (round * 1000 + w) as u8;
                        let data = vec![fill; n * bb];
                        v.write_at(&data, (first * bb) as u64).expect("write");
                        for b in first..first + n {
                            since[b].insert(data[..bb].to_vec());
                            current[b * bb..(b + 1) * bb].copy_from_slice(&data[..bb]);
                        }
                        if splitmix(&mut rng) % 16 == 0 {
                            v.flush().expect("flush");
                            durable.copy_from_slice(&current);
                            since.iter_mut().for_each(BTreeSet::clear);
                        }
                    }
                    let img = crash.crash_image(splitmix(&mut rng));
                    let after: Arc<dyn Backend> = Arc::new(CrashBackend::from_image(img, unit));
                    let v2 = volume(after, sb, mode, &key);
                    let mut blk = vec![0u8; bb];
                    for b in 0..blocks {
                        let old = &durable[b * bb..(b + 1) * bb];
                        let what =
                            format!("{mode:?} block {bb} unit {unit} round {round} block {b}");
                        match v2.read_at(&mut blk, (b * bb) as u64) {
                            Ok(()) => assert!(
                                blk == old || since[b].contains(&blk),
                                "seed {seed}: {what}: plaintext neither flushed nor written"
                            ),
                            Err(Error::Integrity { .. }) => {
                                assert!(
                                    !since[b].is_empty(),
                                    "seed {seed}: {what}: a block untouched since the flush fails"
                                );
                                failed_reads += 1;
                            }
                            Err(e) => panic!("seed {seed}: {what}: {e}"),
                        }
                    }
                    // Go on from what reads see now (the volume before the crash).
                    v.flush().expect("flush");
                    durable = current;
                }
            }
        }
    }
    println!("blocks failing verification after a crash (allowed, written since the flush): {failed_reads}");
    assert!(
        failed_reads > 0,
        "the simulator never tore a block: the test proves nothing"
    );
}
