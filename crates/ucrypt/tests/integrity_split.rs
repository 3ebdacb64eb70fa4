//! Authenticated volumes with large requests split across lanes (the caller and the volume's
//! crew of workers; docs/integrity.md, "Dispatch").
//!
//! - Concurrent verified I/O: every mode, 512- and 4096-byte blocks, journal and direct mode,
//!   policies `parallel`, `queued` and `auto`: writers (each owning a region that crosses area
//!   boundaries) write large and unaligned ranges and read each back whole (split), checking
//!   it byte for byte against their model, while a reader reads across every region (split)
//!   and must never meet an integrity error; at the end the volume is closed and opened again
//!   and read against the models. Backends that accept any buffer address (reads land in the
//!   caller's buffer) and that ask for 4 KiB alignment (reads go through bounce buffers).
//! - Tampering under split reads: a flipped ciphertext, tag or IV bit, two swapped blocks,
//!   and old data under a newer tag each fail exactly the requests that cover the block, with
//!   the lowest damaged sector named whatever lane met it first; other requests read their
//!   plaintext; no unauthenticated plaintext is left in the caller's buffer.
//!
//! Seeded (`UCRYPT_TEST_SEED`).

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ucrypt::backend::{Backend, MemBackend};
use ucrypt::engine::Policy;
use ucrypt::integrity::superblock::flags;
use ucrypt::integrity::{
    write_new_device, HmacHash, IntegrityVolume, Layout, Superblock, TagMode, WriteMode,
};
use ucrypt::{BlockDev, Error, SecretBytes};

const DEVICE_BYTES: u64 = 12 << 20;
/// Where the superblock sits (as after a LUKS2 header).
const START_BYTES: u64 = 64 << 10;
/// Each writer's region: four 512 KiB areas, so requests cross area boundaries.
const REGION_BYTES: u64 = 2 << 20;
const WRITERS: u64 = 2;
const WRITES_PER_WRITER: u64 = 8;
/// The largest write or read-back (several chunks per lane, more than one area).
const REQUEST_BYTES_MAX: u64 = 768 << 10;
/// The default seed.
const SEED_DEFAULT: u64 = 0x5eed_0021;

const MODES: [TagMode; 4] = [
    TagMode::AesGcmRandom { key_bytes: 32 },
    TagMode::ChaCha20RandomPoly1305,
    TagMode::xts_random_hmac(HmacHash::Sha256),
    TagMode::xts_random_hmac(HmacHash::Sha512),
];

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
        .unwrap_or(SEED_DEFAULT);
    println!("seed: UCRYPT_TEST_SEED={seed}");
    seed
}

/// Memory that asks for 4 KiB-aligned buffers, as O_DIRECT does: reads into a caller's buffer
/// at another address go through the volume's bounce buffers. Once `strict` (after the device
/// is formatted and opened), an unaligned buffer fails the test.
struct AlignedMem(MemBackend, AtomicBool);

impl AlignedMem {
    fn check(&self, p: *const u8) {
        if self.1.load(Ordering::Relaxed) {
            assert_eq!(p as usize % 4096, 0, "I/O buffer not aligned");
        }
    }
}

impl Backend for AlignedMem {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        self.check(buf.as_ptr());
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.check(buf.as_ptr());
        self.0.write_at(buf, offset)
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
        512
    }
    fn mem_align_bytes(&self) -> usize {
        4096
    }
    fn describe(&self) -> String {
        "memory asking for 4 KiB-aligned buffers".into()
    }
}

fn superblock(mode: TagMode, log2_spb: u8) -> Superblock {
    let mut sb = Superblock {
        version: 4,
        log2_interleave_sectors: 10,
        tag_bytes: mode.tuple_bytes() as u16,
        journal_sections: 4,
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

fn key(mode: TagMode, rng: &mut u64) -> Vec<u8> {
    (0..mode.key_bytes()).map(|_| splitmix(rng) as u8).collect()
}

fn open(
    be: Arc<dyn Backend>,
    sb: Superblock,
    mode: TagMode,
    key: &[u8],
    wm: WriteMode,
    policy: Policy,
) -> IntegrityVolume {
    let v = IntegrityVolume::with_write_mode(
        be,
        START_BYTES,
        sb,
        mode,
        SecretBytes::from_slice(key),
        false,
        wm,
    )
    .expect("volume");
    v.set_policy(policy);
    v
}

/// A formatted device; with `aligned`, one asking for 4 KiB-aligned buffers (and the switch
/// that makes it strict).
fn new_device(sb: Superblock, aligned: bool) -> (Arc<dyn Backend>, Option<Arc<AlignedMem>>) {
    let (be, strict): (Arc<dyn Backend>, _) = if aligned {
        let a = Arc::new(AlignedMem(
            MemBackend::new(DEVICE_BYTES),
            AtomicBool::new(false),
        ));
        (a.clone(), Some(a))
    } else {
        (Arc::new(MemBackend::new(DEVICE_BYTES)), None)
    };
    write_new_device(be.as_ref(), START_BYTES, &Layout::new(sb).expect("layout")).expect("format");
    (be, strict)
}

/// A random range inside `0..limit`: large (up to REQUEST_BYTES_MAX), starting anywhere, or on
/// a block boundary half the time.
fn range(rng: &mut u64, limit: u64, bb: u64) -> (u64, u64) {
    let len = 1 + splitmix(rng) % REQUEST_BYTES_MAX.min(limit);
    let mut off = splitmix(rng) % (limit - len + 1);
    if splitmix(rng) % 2 == 0 {
        off = off / bb * bb;
    }
    (off, len.min(limit - off))
}

#[test]
fn concurrent_verified_io_with_the_split_active() {
    let seed = seed();
    let mut case = 0u64;
    for mode in MODES {
        for log2_spb in [0u8, 3] {
            for wm in [WriteMode::Journal, WriteMode::Direct] {
                for policy in [Policy::Parallel, Policy::Queued, Policy::Auto] {
                    case += 1;
                    let aligned = case % 2 == 0;
                    let mut rng = seed ^ case.wrapping_mul(0x9e37_79b9);
                    let sb = superblock(mode, log2_spb);
                    let bb = 512u64 << log2_spb;
                    let k = key(mode, &mut rng);
                    let (be, strict) = new_device(sb, aligned);
                    let v = Arc::new(open(be.clone(), sb, mode, &k, wm, policy));
                    if let Some(a) = &strict {
                        a.1.store(true, Ordering::Relaxed);
                    }
                    let what = format!("{mode:?} {bb} {wm:?} {policy} aligned={aligned}");
                    assert!(
                        v.size() >= WRITERS * REGION_BYTES,
                        "{what}: device too small"
                    );
                    // Every block written once, so that reads verify.
                    v.write_zeroes(0, WRITERS * REGION_BYTES).expect("fill");
                    let stop = Arc::new(AtomicBool::new(false));
                    let reader = {
                        let (v, stop, what) = (v.clone(), stop.clone(), what.clone());
                        let mut rng = rng ^ 0xabcd;
                        std::thread::spawn(move || {
                            let mut buf = vec![0u8; REQUEST_BYTES_MAX as usize];
                            let mut reads = 0u64;
                            while !stop.load(Ordering::Relaxed) || reads == 0 {
                                let (off, len) = range(&mut rng, WRITERS * REGION_BYTES, bb);
                                v.read_at(&mut buf[..len as usize], off)
                                    .unwrap_or_else(|e| panic!("{what}: read {off}+{len}: {e}"));
                                reads += 1;
                            }
                            reads
                        })
                    };
                    let writers: Vec<_> = (0..WRITERS)
                        .map(|w| {
                            let (v, what) = (v.clone(), what.clone());
                            let mut rng = rng ^ (w + 1).wrapping_mul(0x1234_5678_9abc);
                            std::thread::spawn(move || {
                                let base = w * REGION_BYTES;
                                let mut model = vec![0u8; REGION_BYTES as usize];
                                let mut back = vec![0u8; REQUEST_BYTES_MAX as usize];
                                for i in 0..WRITES_PER_WRITER {
                                    let (off, len) = range(&mut rng, REGION_BYTES, bb);
                                    let (o, l) = (off as usize, len as usize);
                                    for b in &mut model[o..o + l] {
                                        *b = splitmix(&mut rng) as u8;
                                    }
                                    v.write_at(&model[o..o + l], base + off)
                                        .unwrap_or_else(|e| panic!("{what}: write: {e}"));
                                    if i % 3 == 2 {
                                        v.flush().expect("flush");
                                    }
                                    let (roff, rlen) = range(&mut rng, REGION_BYTES, bb);
                                    let (ro, rl) = (roff as usize, rlen as usize);
                                    v.read_at(&mut back[..rl], base + roff)
                                        .unwrap_or_else(|e| panic!("{what}: read back: {e}"));
                                    assert!(
                                        back[..rl] == model[ro..ro + rl],
                                        "{what}: writer {w} read back {roff}+{rlen} differs"
                                    );
                                }
                                model
                            })
                        })
                        .collect();
                    let models: Vec<Vec<u8>> = writers
                        .into_iter()
                        .map(|h| h.join().expect("writer"))
                        .collect();
                    stop.store(true, Ordering::Relaxed);
                    assert!(reader.join().expect("reader") > 0);
                    assert_eq!(v.integrity_errors(), 0, "{what}");
                    // parallel and queued hand work to the crew (auto may not, on a busy host).
                    assert!(
                        policy == Policy::Auto || v.split_pieces() > 0,
                        "{what}: nothing was split"
                    );
                    drop(Arc::into_inner(v).expect("the only reference"));
                    // Closed (the journal written back and marked empty), opened again.
                    let v = open(be, sb, mode, &k, wm, Policy::Parallel);
                    let mut all = vec![0u8; REGION_BYTES as usize];
                    for (w, model) in models.iter().enumerate() {
                        v.read_at(&mut all, w as u64 * REGION_BYTES)
                            .expect("read after reopening");
                        assert!(all == *model, "{what}: region {w} after reopening");
                    }
                }
            }
        }
    }
}

/// What one damage does to the backend bytes of blocks `k` (and `k + 1`).
#[derive(Debug, Clone, Copy)]
enum Damage {
    CiphertextBit,
    TagBit,
    IvBit,
    Swap,
    OldDataNewTag,
}

#[test]
fn damaged_blocks_fail_only_the_requests_that_cover_them_when_split() {
    let seed = seed();
    let mut rng = seed ^ 0x7a3e;
    for mode in MODES {
        for log2_spb in [0u8, 3] {
            let sb = superblock(mode, log2_spb);
            let bb = 512u64 << log2_spb;
            let tb = mode.tuple_bytes();
            let k = key(mode, &mut rng);
            let (be, _) = new_device(sb, false);
            let v = open(
                be.clone(),
                sb,
                mode,
                &k,
                WriteMode::Direct,
                Policy::Parallel,
            );
            let size = 4 * REGION_BYTES;
            let plain: Vec<u8> = (0..size).map(|_| splitmix(&mut rng) as u8).collect();
            v.write_at(&plain, 0).expect("fill");
            let blocks = size / bb;
            for damage in [
                Damage::CiphertextBit,
                Damage::TagBit,
                Damage::IvBit,
                Damage::Swap,
                Damage::OldDataNewTag,
            ] {
                let what = format!("{mode:?} {bb} {damage:?}");
                // Two damaged blocks, far apart, so that a split read meets them on different
                // lanes: the lower one must be reported.
                let lo = 1 + splitmix(&mut rng) % (blocks / 4);
                let hi = blocks / 2 + splitmix(&mut rng) % (blocks / 4);
                let mut saved = Vec::new();
                for b in [lo, hi] {
                    let (d, t) = v.locate(b * bb / 512).expect("locate");
                    let (d2, t2) = v.locate((b + 1) * bb / 512).expect("locate");
                    let mut data = vec![0u8; bb as usize];
                    let mut tag = vec![0u8; tb];
                    be.read_exact_at(&mut data, d).unwrap();
                    be.read_exact_at(&mut tag, t).unwrap();
                    let mut data2 = vec![0u8; bb as usize];
                    let mut tag2 = vec![0u8; tb];
                    be.read_exact_at(&mut data2, d2).unwrap();
                    be.read_exact_at(&mut tag2, t2).unwrap();
                    saved.push((d, t, d2, t2, data.clone(), tag.clone(), data2.clone(), tag2));
                    match damage {
                        Damage::CiphertextBit => {
                            data[17] ^= 0x10;
                            be.write_at(&data, d).unwrap();
                        }
                        Damage::TagBit => {
                            tag[3] ^= 0x01;
                            be.write_at(&tag, t).unwrap();
                        }
                        Damage::IvBit => {
                            tag[mode.auth_bytes()] ^= 0x80;
                            be.write_at(&tag, t).unwrap();
                        }
                        Damage::Swap => {
                            be.write_at(&data2, d).unwrap();
                            be.write_at(&data, d2).unwrap();
                            let (tag2, tag) = (saved.last().unwrap().7.clone(), tag.clone());
                            be.write_at(&tag2, t).unwrap();
                            be.write_at(&tag, t2).unwrap();
                        }
                        Damage::OldDataNewTag => {
                            // Block b rewritten with the same plaintext (new IV and tag), then
                            // its old ciphertext put back under the new tag.
                            let at = b * bb;
                            v.write_at(&plain[at as usize..(at + bb) as usize], at)
                                .expect("rewrite");
                            be.write_at(&data, d).unwrap();
                        }
                    }
                }
                let errors_before = v.integrity_errors();
                let first_bad = |b: u64| b * bb / 512;
                // Whole requests covering the damage fail naming the lowest damaged block,
                // every time, whichever lane runs which chunk.
                let mut buf = vec![0u8; size as usize];
                for _ in 0..4 {
                    buf.fill(0xee);
                    match v.read_at(&mut buf, 0) {
                        Err(Error::Integrity { sector }) => {
                            assert_eq!(sector, first_bad(lo), "{what}: lowest block named")
                        }
                        r => panic!("{what}: whole read gave {r:?}"),
                    }
                    // No unauthenticated plaintext in the caller's buffer: a damaged block
                    // never holds its plaintext (wiped, or never copied out).
                    for b in [lo, hi] {
                        let r = (b * bb) as usize..((b + 1) * bb) as usize;
                        assert!(
                            buf[r.clone()] != plain[r],
                            "{what}: block {b} left in the buffer"
                        );
                    }
                }
                // A request starting after the first damage names the second.
                let from = (lo + 2) * bb;
                match v.read_at(&mut buf[..(size - from) as usize], from) {
                    Err(Error::Integrity { sector }) => {
                        assert_eq!(sector, first_bad(hi), "{what}: second block named")
                    }
                    r => panic!("{what}: read after the first damage gave {r:?}"),
                }
                // Requests that avoid the damaged blocks read their plaintext, split too.
                let spans = [
                    (0, lo * bb),
                    ((lo + 2) * bb, hi * bb),
                    ((hi + 2) * bb, size),
                ];
                for (a, z) in spans {
                    if z <= a {
                        continue;
                    }
                    let n = (z - a) as usize;
                    v.read_at(&mut buf[..n], a)
                        .unwrap_or_else(|e| panic!("{what}: undamaged {a}..{z}: {e}"));
                    assert!(
                        buf[..n] == plain[a as usize..z as usize],
                        "{what}: {a}..{z}"
                    );
                }
                assert!(v.integrity_errors() > errors_before, "{what}: counted");
                assert!(v.split_pieces() > 0, "{what}: nothing was split");
                // Put the blocks back (and rewrite the rewritten ones as they were).
                for (d, t, d2, t2, data, tag, data2, tag2) in saved.into_iter().rev() {
                    be.write_at(&data, d).unwrap();
                    be.write_at(&tag, t).unwrap();
                    be.write_at(&data2, d2).unwrap();
                    be.write_at(&tag2, t2).unwrap();
                }
                if matches!(damage, Damage::OldDataNewTag) {
                    v.write_at(&plain, 0).expect("rewrite all");
                }
                v.read_at(&mut buf, 0).expect("repaired");
                assert!(buf == plain, "{what}: repaired");
            }
        }
    }
}
