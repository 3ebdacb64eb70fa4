//! Power cuts under the engine: seeded workloads (writes of random sizes and alignments,
//! write-zeroes, discards, FUA writes, reads checked against a model, flushes) run through a
//! `Volume` over a `CrashBackend`, under every dispatch policy, both sector sizes and both
//! atomic units of the device; then the power goes at a seeded point, the volume is opened
//! again on what the device kept, and every encryption sector must hold its plaintext as of the
//! last flush or as one of the writes since: never garbage, and nothing acknowledged before the
//! last acknowledged flush (or by a FUA write) lost.
//!
//! What the Volume promises, and this checks:
//! - a flush makes every write acknowledged before it durable; a FUA write (`write_fua`) makes
//!   the encryption sectors it touched durable when acknowledged, and nothing else (each of
//!   its backend writes is FUA; the device writes whole atomic units);
//! - a discard (volume opened with discards allowed) passes the whole encryption sectors of its
//!   range to the device, which may then read back anything: the volume reads back the
//!   decryption of that, unspecified bytes, until the sector is written again; the partial
//!   sectors at the ends of the range and every other sector are untouched. A discard is no more
//!   durable than a write: after a power cut a sector discarded since the last flush holds its
//!   flushed plaintext, what the discard made it read, or a later write;
//! - with a device atomic unit at least the encryption sector (512-byte sectors on 512-byte or
//!   4 KiB units, 4 KiB sectors on 4 KiB units) a sector is never torn. With 4 KiB sectors on
//!   512-byte units a power cut can tear a sector written since the last flush (dm-crypt
//!   cannot hide that either): then only sectors not written since the flush are checked.
//!
//! The simulator's own tests plant two bugs (a device that acknowledges a flush without keeping
//! the data; writes reordered across a flush) and show it catches both.
//!
//! `UCRYPT_CRASH_POINTS` sets the number of crash points (default 1000; the long mode recorded
//! in BENCHMARKS.md runs 100,000 in release); `UCRYPT_TEST_SEED` the first seed.

mod common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::engine::Policy;
use ucrypt::sector::SectorSize;
use ucrypt::volume::Volume;
use ucrypt::BlockDev;

/// The plaintext the volume serves.
const VOLUME_BYTES: usize = 64 << 10;
/// Room before it (the data offset), as a header would take.
const DATA_OFFSET: u64 = 4096;
const OPS_MAX: u64 = 40;
/// (encryption sector, device atomic unit) pairs the crash points cycle through.
const GEOMETRIES: [(u64, u64); 4] = [(512, 512), (512, 4096), (4096, 4096), (4096, 512)];

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn volume(backend: Arc<dyn Backend>, sector: SectorSize, policy: Policy) -> Volume {
    common::crash_volume(
        backend,
        sector,
        policy,
        DATA_OFFSET,
        VOLUME_BYTES as u64,
        true,
    )
}

/// Per encryption sector: its plaintext as of the last flush, and each plaintext written to
/// it since.
struct Model {
    sector: usize,
    plain: Vec<u8>,
    durable: Vec<Vec<u8>>,
    since: Vec<Vec<Vec<u8>>>,
}

impl Model {
    fn new(sector: usize) -> Model {
        let n = VOLUME_BYTES / sector;
        Model {
            sector,
            plain: vec![0; VOLUME_BYTES],
            durable: vec![vec![0; sector]; n],
            since: vec![Vec::new(); n],
        }
    }

    fn wrote(&mut self, offset: usize, data: &[u8]) {
        self.plain[offset..offset + data.len()].copy_from_slice(data);
        let sz = self.sector;
        for s in offset / sz..(offset + data.len()).div_ceil(sz) {
            let now = self.plain[s * sz..(s + 1) * sz].to_vec();
            self.since[s].push(now);
        }
    }

    /// A FUA write: every encryption sector it touched is durable as it is now (the volume
    /// writes whole sectors, each backend write FUA), nothing else is.
    fn wrote_fua(&mut self, offset: usize, data: &[u8]) {
        self.wrote(offset, data);
        let sz = self.sector;
        for s in offset / sz..(offset + data.len()).div_ceil(sz) {
            self.durable[s].copy_from_slice(&self.plain[s * sz..(s + 1) * sz]);
            self.since[s].clear();
        }
    }

    fn flushed(&mut self) {
        let sz = self.sector;
        for (s, d) in self.durable.iter_mut().enumerate() {
            d.copy_from_slice(&self.plain[s * sz..(s + 1) * sz]);
        }
        self.since.iter_mut().for_each(Vec::clear);
    }
}

/// What a crash point ran on: the seed's policy and geometry.
fn describe(seed: u64, policy: Policy, sector: usize, unit: u64) -> String {
    format!("seed {seed} ({policy}, {sector}-byte sectors, {unit}-byte atomic units)")
}

/// A random range of the volume: (offset, len), len in 1..=max.
fn range(x: &mut u64, max: usize) -> (usize, usize) {
    let len = 1 + (xorshift(x) as usize) % max;
    let off = (xorshift(x) as usize) % (VOLUME_BYTES - len.min(VOLUME_BYTES - 1));
    (off, len.min(VOLUME_BYTES - off))
}

/// The first difference of a read from the model, as an error.
fn compare(got: &[u8], want: &[u8], off: usize, what: &str) -> Result<(), String> {
    match (0..got.len()).find(|&i| got[i] != want[i]) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what} of {} bytes at {off} differs from byte {i} (volume offset {}): got {}, \
             wrote {}",
            got.len(),
            off + i,
            got[i],
            want[i]
        )),
    }
}

/// One seeded workload, power cut and check, on a device `wrap` may put a faulty layer over
/// (the planted bugs). Err says what was lost or garbled.
fn one_crash_point(
    seed: u64,
    wrap: &dyn Fn(Arc<CrashBackend>) -> Arc<dyn Backend>,
) -> Result<(), String> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let policy = Policy::ALL[(seed % Policy::ALL.len() as u64) as usize];
    let (sz, unit) =
        GEOMETRIES[((seed / Policy::ALL.len() as u64) % GEOMETRIES.len() as u64) as usize];
    let sector = SectorSize::new(sz).expect("sector size");
    let sz = sz as usize;
    let who = describe(seed, policy, sz, unit);
    let device = Arc::new(
        CrashBackend::new(DATA_OFFSET + VOLUME_BYTES as u64, unit).expect("crash backend"),
    );
    let vol = volume(wrap(device.clone()), sector, policy);
    let mut m = Model::new(sz);
    // A fresh device holds zeroes, which decrypt to noise: that noise is the volume's
    // initial plaintext.
    vol.read_at(&mut m.plain, 0).expect("initial read");
    m.flushed();
    let ops = 1 + xorshift(&mut x) % OPS_MAX;
    for _ in 0..ops {
        let r = xorshift(&mut x);
        match r % 12 {
            // Writes of any size and alignment (the engine reads, modifies and writes partial
            // sectors); some with FUA (`write_fua`: durable by itself, with no flush).
            0..=4 => {
                let (off, len) = range(&mut x, 9000);
                let mut data: Vec<u8> = (0..len).map(|_| xorshift(&mut x) as u8).collect();
                if r % 12 == 4 {
                    let want = data.clone();
                    vol.write_fua(&mut data, off as u64).expect("FUA write");
                    m.wrote_fua(off, &want);
                } else {
                    vol.write_at(&data, off as u64).expect("write");
                    m.wrote(off, &data);
                }
            }
            5 => {
                let first = (xorshift(&mut x) as usize) % (VOLUME_BYTES / sz);
                let n = 1 + (xorshift(&mut x) as usize) % 4;
                let n = n.min(VOLUME_BYTES / sz - first);
                vol.write_zeroes((first * sz) as u64, (n * sz) as u64)
                    .expect("write zeroes");
                m.wrote(first * sz, &vec![0; n * sz]);
            }
            // A discard of any range: its whole sectors now read as anything (taken from the
            // volume as their new plaintext), the rest must not change.
            6 => {
                let (off, len) = range(&mut x, 12000);
                vol.discard(off as u64, len as u64).expect("discard");
                let mut now = vec![0u8; len];
                vol.read_at(&mut now, off as u64)
                    .expect("read after discard");
                let (a, b) = (off.div_ceil(sz) * sz, (off + len) / sz * sz);
                if a < b {
                    compare(&now[..a - off], &m.plain[off..a], off, "discard's head")
                        .map_err(|e| format!("{who}: {e}"))?;
                    compare(&now[b - off..], &m.plain[b..off + len], b, "discard's tail")
                        .map_err(|e| format!("{who}: {e}"))?;
                    m.wrote(a, &now[a - off..b - off]);
                } else {
                    compare(
                        &now,
                        &m.plain[off..off + len],
                        off,
                        "a discard inside one sector",
                    )
                    .map_err(|e| format!("{who}: {e}"))?;
                }
            }
            7..=9 => {
                let (off, len) = range(&mut x, 20000);
                let mut buf = vec![0u8; len];
                vol.read_at(&mut buf, off as u64).expect("read");
                compare(&buf, &m.plain[off..off + len], off, "a read")
                    .map_err(|e| format!("{who}: {e}"))?;
            }
            _ => {
                vol.flush().expect("flush");
                m.flushed();
            }
        }
    }
    // The power goes now: what the device kept, chosen by the seed.
    let image = device.crash_image(xorshift(&mut x));
    drop(vol);
    let after = volume(
        Arc::new(CrashBackend::from_image(image, unit)),
        sector,
        policy,
    );
    let mut got = vec![0u8; VOLUME_BYTES];
    after.read_at(&mut got, 0).expect("read after the crash");
    // A sector on smaller atomic units can tear: only sectors left alone since the flush
    // are then known.
    let may_tear = unit < sz as u64;
    for s in 0..VOLUME_BYTES / sz {
        let sec = &got[s * sz..(s + 1) * sz];
        if may_tear && !m.since[s].is_empty() {
            continue;
        }
        let ok = sec == &m.durable[s][..] || m.since[s].iter().any(|v| sec == &v[..]);
        if !ok {
            return Err(format!(
                "{who}: sector {s} after the crash is neither its flushed plaintext nor one \
                 written since ({} writes since the flush)",
                m.since[s].len()
            ));
        }
    }
    Ok(())
}

fn plain(d: Arc<CrashBackend>) -> Arc<dyn Backend> {
    d
}

#[test]
fn power_cuts_keep_flushed_data_and_never_make_garbage() {
    let points: u64 = std::env::var("UCRYPT_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let first = kit::seed_or(1);
    let t0 = std::time::Instant::now();
    for seed in first..first + points {
        if let Err(e) = one_crash_point(seed, &plain) {
            panic!("{e}");
        }
    }
    eprintln!(
        "{points} crash points (seeds {first}..{}) in {:.1} s",
        first + points,
        t0.elapsed().as_secs_f64()
    );
}

// ------------------------------------------------------------------ planted bugs

/// How many of the first `points` crash points a bug planted by `wrap` is caught at.
fn caught(points: u64, wrap: &dyn Fn(Arc<CrashBackend>) -> Arc<dyn Backend>) -> (u64, String) {
    let mut n = 0;
    let mut first = String::new();
    for seed in 1..=points {
        if let Err(e) = one_crash_point(seed, wrap) {
            if n == 0 {
                first = e;
            }
            n += 1;
        }
    }
    (n, first)
}

/// Passes everything through but acknowledges a flush without making anything durable.
struct LyingFlush(Arc<CrashBackend>);

/// Holds writes back and lets them reach the device only after the next flush has: each
/// write is reordered across the flush that follows it. Reads see the held writes.
struct ReorderAcrossFlush {
    inner: Arc<CrashBackend>,
    held: Mutex<Vec<(u64, Vec<u8>)>>,
}

macro_rules! delegate_rest {
    ($field:tt) => {
        fn size(&self) -> u64 {
            self.$field.size()
        }
        fn logical_block_bytes(&self) -> u32 {
            self.$field.logical_block_bytes()
        }
        fn describe(&self) -> String {
            format!("planted bug over {}", self.$field.describe())
        }
    };
}

impl Backend for LyingFlush {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.0.write_at(buf, offset)
    }
    fn flush(&self) -> ucrypt::Result<()> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.0.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.0.write_zeroes(offset, len)
    }
    delegate_rest!(0);
}

impl ReorderAcrossFlush {
    fn hold(&self, offset: u64, data: Vec<u8>) {
        self.held.lock().expect("held").push((offset, data));
    }
}

impl Backend for ReorderAcrossFlush {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        let n = self.inner.read_at(buf, offset)?;
        // The held writes, oldest first, over what the device has.
        let mut by_byte: HashMap<u64, u8> = HashMap::new();
        for (at, d) in self.held.lock().expect("held").iter() {
            for (i, &b) in d.iter().enumerate() {
                by_byte.insert(at + i as u64, b);
            }
        }
        for (i, b) in buf.iter_mut().enumerate().take(n) {
            if let Some(&v) = by_byte.get(&(offset + i as u64)) {
                *b = v;
            }
        }
        Ok(n)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.hold(offset, buf.to_vec());
        Ok(())
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.inner.flush()?;
        for (at, d) in std::mem::take(&mut *self.held.lock().expect("held")) {
            self.inner.write_at(&d, at)?;
        }
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.hold(offset, vec![0; len as usize]);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.hold(offset, vec![0; len as usize]);
        Ok(())
    }
    delegate_rest!(inner);
}

/// Crash points each planted-bug test runs.
const PLANTED_POINTS: u64 = 200;

#[test]
fn a_device_that_acknowledges_a_flush_without_keeping_the_data_is_caught() {
    let (n, first) = caught(PLANTED_POINTS, &|d| Arc::new(LyingFlush(d)));
    eprintln!("a lying flush caught at {n} of {PLANTED_POINTS} crash points; first: {first}");
    assert!(n > PLANTED_POINTS / 10, "caught at only {n} points");
}

#[test]
fn writes_reordered_across_a_flush_are_caught() {
    let (n, first) = caught(PLANTED_POINTS, &|d| {
        Arc::new(ReorderAcrossFlush {
            inner: d,
            held: Mutex::new(Vec::new()),
        })
    });
    eprintln!("writes reordered across a flush caught at {n} of {PLANTED_POINTS} crash points; first: {first}");
    assert!(n > PLANTED_POINTS / 10, "caught at only {n} points");
}
