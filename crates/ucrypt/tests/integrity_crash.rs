//! Power cuts under authenticated volumes, with the crash simulator (`CrashBackend`).
//!
//! Journal mode (dm-integrity's 'J', the default): the power goes at seeded points *inside*
//! the volume's work (after any backend write or flush: in the middle of filling, committing
//! or writing back a journal section), the device keeps what the simulator chooses of the
//! writes since its last flush (whole, torn at 512-byte or 4 KiB units, or not at all), and
//! the volume is opened again on that: the journal is replayed. Every block must then read
//! back, with a tag that verifies, the plaintext it held at the last acknowledged flush or one
//! written since; never an integrity error. `UCRYPT_CRASH_POINTS` sets the number of crash
//! points (default 1200, spread over the cases), `UCRYPT_TEST_SEED` the seed.
//!
//! Direct mode ('D', `--integrity-no-journal`): after a power cut between requests every block
//! either reads its last flushed plaintext, or (only if it was written since that flush) one
//! of the plaintexts written to it since, or fails with the integrity error. Never wrong
//! plaintext, never a failure of a block left alone since the flush.
//!
//! GCM, ChaCha20-Poly1305 and XTS + HMAC-SHA256 tags, 512- and 4096-byte blocks, 512- and
//! 4096-byte atomic units; areas of 512 KiB so writes cross area boundaries; journals of a few
//! sections so the ring wraps.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::integrity::superblock::flags;
use ucrypt::integrity::{
    write_new_device, HmacHash, IntegrityVolume, Layout, Superblock, TagMode, WriteMode,
};
use ucrypt::{BlockDev, Error, SecretBytes};

const DEVICE_BYTES: u64 = 4 << 20;
/// Where the superblock sits (as after a LUKS2 header).
const START_BYTES: u64 = 64 << 10;
const ROUNDS: u64 = 12;
const WRITES_PER_ROUND: u64 = 40;
/// Journal mode: crash points over all cases unless `UCRYPT_CRASH_POINTS` says otherwise.
const JOURNAL_CRASH_POINTS_DEFAULT: u64 = 1200;
/// Journal sections of the test volumes: the ring wraps many times.
const JOURNAL_SECTIONS: u32 = 3;
/// Journal mode: the largest write, in blocks (more than a section of 4 KiB blocks).
const JOURNAL_WRITE_BLOCKS_MAX: u64 = 40;
/// Journal mode: a workload step is a flush with probability 1 / this.
const FLUSH_ONE_IN: u64 = 6;
/// Journal mode: a crash point is taken after a backend call with probability 1 / this.
const CRASH_ONE_IN: u64 = 3;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn seed() -> u64 {
    let seed: u64 = std::env::var("UCRYPT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1f2e_3d4c);
    println!("seed: UCRYPT_TEST_SEED={seed}");
    seed
}

const MODES: [TagMode; 3] = [
    TagMode::AesGcmRandom { key_bytes: 32 },
    TagMode::ChaCha20RandomPoly1305,
    TagMode::xts_random_hmac(HmacHash::Sha256),
];

fn superblock(mode: TagMode, log2_spb: u8, journal_sections: u32) -> Superblock {
    let mut sb = Superblock {
        version: 4,
        log2_interleave_sectors: 10,
        tag_bytes: mode.tuple_bytes() as u16,
        journal_sections,
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

fn volume(
    be: Arc<dyn Backend>,
    sb: Superblock,
    mode: TagMode,
    key: &[u8],
    wm: WriteMode,
) -> ucrypt::Result<IntegrityVolume> {
    IntegrityVolume::with_write_mode(
        be,
        START_BYTES,
        sb,
        mode,
        SecretBytes::from_slice(key),
        false,
        wm,
    )
}

fn new_device(unit: u64, sb: Superblock) -> Arc<CrashBackend> {
    let crash = Arc::new(CrashBackend::new(DEVICE_BYTES, unit).expect("crash backend"));
    write_new_device(
        crash.as_ref(),
        START_BYTES,
        &Layout::new(sb).expect("layout"),
    )
    .expect("format");
    crash
}

#[test]
fn direct_mode_after_any_crash_each_block_is_flushed_written_or_an_integrity_error() {
    let seed = seed();
    let mut failed_reads = 0u64;
    for mode in MODES {
        for log2_spb in [0u8, 3] {
            for unit in [512u64, 4096] {
                let mut rng = seed ^ (u64::from(log2_spb) << 8) ^ unit ^ mode.tuple_bytes() as u64;
                let key: Vec<u8> = (0..mode.key_bytes())
                    .map(|_| splitmix(&mut rng) as u8)
                    .collect();
                let sb = superblock(mode, log2_spb, 1);
                let bb = 512usize << log2_spb;
                let blocks = (sb.provided_data_sectors * 512) as usize / bb;
                let crash = new_device(unit, sb);
                let v = volume(crash.clone(), sb, mode, &key, WriteMode::Direct).expect("volume");
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
                    let v2 = volume(after, sb, mode, &key, WriteMode::Direct).expect("reopen");
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

/// Each block's plaintext is a fill byte; the values a block may hold after a crash.
#[derive(Clone)]
struct Model {
    /// As of the last acknowledged flush.
    durable: Vec<u8>,
    /// Written since (including a write in progress), as 256-bit sets of fill bytes.
    since: Vec<[u64; 4]>,
}

impl Model {
    fn allows(&self, b: usize, fill: u8) -> bool {
        self.durable[b] == fill || self.since[b][usize::from(fill / 64)] >> (fill % 64) & 1 == 1
    }
}

type Hook = Box<dyn FnMut(&CrashBackend) + Send>;

/// A backend that calls a hook after every write and flush: where the power may go.
struct Tap {
    inner: Arc<CrashBackend>,
    hook: Mutex<Hook>,
}

impl Tap {
    fn after(&self) {
        (self.hook.lock().expect("hook"))(&self.inner);
    }
}

impl Backend for Tap {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.inner.write_at(buf, offset)?;
        self.after();
        Ok(())
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.inner.flush()?;
        self.after();
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_bytes(&self) -> u32 {
        512
    }
    fn describe(&self) -> String {
        "tapped crash simulator".into()
    }
}

/// What the crash points of one case saw.
#[derive(Default)]
struct Tally {
    points: u64,
    replayed_entries: u64,
    failures: Vec<String>,
}

#[test]
fn journal_mode_never_gives_an_integrity_error_after_a_crash() {
    let seed = seed();
    let total: u64 = std::env::var("UCRYPT_CRASH_POINTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(JOURNAL_CRASH_POINTS_DEFAULT);
    let cases: Vec<(TagMode, u8, u64)> = MODES
        .iter()
        .flat_map(|&m| [0u8, 3].into_iter().map(move |s| (m, s)))
        .flat_map(|(m, s)| [512u64, 4096].into_iter().map(move |u| (m, s, u)))
        .collect();
    let per_case = total.div_ceil(cases.len() as u64);
    let (mut points, mut replayed) = (0u64, 0u64);
    for (mode, log2_spb, unit) in cases {
        let mut rng = seed ^ (u64::from(log2_spb) << 8) ^ unit ^ mode.tuple_bytes() as u64;
        let key: Vec<u8> = (0..mode.key_bytes())
            .map(|_| splitmix(&mut rng) as u8)
            .collect();
        let sb = superblock(mode, log2_spb, JOURNAL_SECTIONS);
        let bb = 512usize << log2_spb;
        let blocks = (sb.provided_data_sectors * 512) as usize / bb;
        let crash = new_device(unit, sb);
        {
            // Every block written once (zeroes) and flushed, as a wipe leaves it.
            let v0 = volume(crash.clone(), sb, mode, &key, WriteMode::Direct).expect("volume");
            v0.write_zeroes(0, v0.size()).expect("wipe");
            v0.flush().expect("flush");
        }
        let model = Arc::new(Mutex::new(Model {
            durable: vec![0; blocks],
            since: vec![[0; 4]; blocks],
        }));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let hook: Hook = {
            let (model, tally, key) = (model.clone(), tally.clone(), key.clone());
            let mut hrng = rng ^ 0x5eed;
            Box::new(move |dev: &CrashBackend| {
                if splitmix(&mut hrng) % CRASH_ONE_IN != 0 {
                    return;
                }
                let m = model.lock().expect("model").clone();
                let img = dev.crash_image(splitmix(&mut hrng));
                let mut t = tally.lock().expect("tally");
                t.points += 1;
                let after: Arc<dyn Backend> = Arc::new(CrashBackend::from_image(img, unit));
                let v2 = match volume(after, sb, mode, &key, WriteMode::Journal) {
                    Ok(v) => v,
                    Err(e) => {
                        t.failures.push(format!("reopen: {e}"));
                        return;
                    }
                };
                t.replayed_entries += v2.replay_report().entries;
                let mut blk = vec![0u8; bb];
                for b in 0..blocks {
                    match v2.read_at(&mut blk, (b * bb) as u64) {
                        Ok(()) if blk.iter().all(|&x| x == blk[0]) && m.allows(b, blk[0]) => {}
                        Ok(()) => t.failures.push(format!(
                            "block {b}: plaintext {:#04x}.. neither flushed ({:#04x}) nor written since",
                            blk[0], m.durable[b]
                        )),
                        Err(e) => t.failures.push(format!("block {b}: {e}")),
                    }
                }
            })
        };
        let tap: Arc<dyn Backend> = Arc::new(Tap {
            inner: crash.clone(),
            hook: Mutex::new(hook),
        });
        let v = volume(tap, sb, mode, &key, WriteMode::Journal).expect("volume");
        let mut current = vec![0u8; blocks];
        let mut step = 0u64;
        while tally.lock().expect("tally").points < per_case {
            step += 1;
            if splitmix(&mut rng) % FLUSH_ONE_IN == 0 {
                v.flush().expect("flush");
                let mut m = model.lock().expect("model");
                m.durable.copy_from_slice(&current);
                m.since.iter_mut().for_each(|s| *s = [0; 4]);
                continue;
            }
            let first = (splitmix(&mut rng) % blocks as u64) as usize;
            let n = (1 + splitmix(&mut rng) % JOURNAL_WRITE_BLOCKS_MAX).min((blocks - first) as u64)
                as usize;
            let fill = splitmix(&mut rng) as u8;
            {
                // Before the write starts: a crash inside it may keep it.
                let mut m = model.lock().expect("model");
                for b in first..first + n {
                    m.since[b][usize::from(fill / 64)] |= 1 << (fill % 64);
                }
            }
            v.write_at(&vec![fill; n * bb], (first * bb) as u64)
                .expect("write");
            current[first..first + n].fill(fill);
            assert!(step < 1_000_000, "no crash points taken");
        }
        let t = tally.lock().expect("tally");
        assert!(
            t.failures.is_empty(),
            "seed {seed}: {mode:?}, {bb}-byte blocks, {unit}-byte units: {} failures at {} \
             crash points, first: {:?}",
            t.failures.len(),
            t.points,
            &t.failures[..t.failures.len().min(5)]
        );
        println!(
            "{mode:?}, {bb}-byte blocks, {unit}-byte units: {} crash points, {} entries replayed, {step} steps",
            t.points, t.replayed_entries
        );
        points += t.points;
        replayed += t.replayed_entries;
    }
    println!("journal mode: {points} crash points, {replayed} journal entries replayed, no integrity error");
    assert!(points >= total, "{points} crash points, want {total}");
    assert!(
        replayed > 0,
        "no crash point needed a replay: the test proves nothing"
    );
}
