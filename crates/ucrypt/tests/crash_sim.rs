//! Power cuts under the engine: seeded workloads (writes of random sizes and alignments,
//! write-zeroes, reads checked against a model, flushes) run through a `Volume` over a
//! `CrashBackend`, under every dispatch policy and both sector sizes; then the power goes at a
//! seeded point, the volume is opened again on what the device kept, and every encryption
//! sector must hold its plaintext as of the last flush or as one of the writes since: never
//! garbage, and nothing acknowledged before the last acknowledged flush lost.
//!
//! The device's atomic unit equals the encryption sector here, so a sector is never torn (with
//! a smaller unit a sector can be, as on a real disk, and dm-crypt does not hide that either).
//! `UCRYPT_CRASH_POINTS` sets the number of crash points (default 1000); `UCRYPT_SEED` the first
//! seed.

mod common;

use std::sync::Arc;

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::engine::Policy;
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

/// The plaintext the volume serves.
const VOLUME_BYTES: usize = 64 << 10;
/// Room before it (the data offset), as a header would take.
const DATA_OFFSET: u64 = 4096;
const OPS_MAX: u64 = 40;

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn volume(backend: Arc<dyn Backend>, sector: SectorSize, policy: Policy) -> Volume {
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(29) ^ 0x5a).collect();
    let mut cfg = VolumeConfig::new(
        CipherSpec::AES_XTS_PLAIN64,
        SecretBytes::from_slice(&key),
        Geometry::new(sector),
    );
    cfg.data_offset_bytes = DATA_OFFSET;
    cfg.size_bytes = Some(VOLUME_BYTES as u64);
    cfg.policy = policy.into();
    Volume::new(backend, cfg).expect("volume")
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

    fn flushed(&mut self) {
        let sz = self.sector;
        for (s, d) in self.durable.iter_mut().enumerate() {
            d.copy_from_slice(&self.plain[s * sz..(s + 1) * sz]);
        }
        self.since.iter_mut().for_each(Vec::clear);
    }
}

fn one_crash_point(seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let policy = Policy::ALL[(seed % Policy::ALL.len() as u64) as usize];
    let sector = if (seed / Policy::ALL.len() as u64) % 2 == 0 {
        SectorSize::new(512).unwrap()
    } else {
        SectorSize::S4096
    };
    let sz = sector.bytes() as usize;
    let device = Arc::new(
        CrashBackend::new(DATA_OFFSET + VOLUME_BYTES as u64, sz as u64).expect("crash backend"),
    );
    let vol = volume(device.clone(), sector, policy);
    let mut m = Model::new(sz);
    // A fresh device holds zeroes, which decrypt to noise: that noise is the volume's
    // initial plaintext.
    vol.read_at(&mut m.plain, 0).expect("initial read");
    m.flushed();
    let ops = 1 + xorshift(&mut x) % OPS_MAX;
    for _ in 0..ops {
        let r = xorshift(&mut x);
        match r % 8 {
            // Writes of any size and alignment (the engine reads, modifies and writes partial
            // sectors).
            0..=3 => {
                let len = 1 + (xorshift(&mut x) % 9000) as usize;
                let off = (xorshift(&mut x) as usize) % (VOLUME_BYTES - len.min(VOLUME_BYTES - 1));
                let len = len.min(VOLUME_BYTES - off);
                let data: Vec<u8> = (0..len).map(|_| xorshift(&mut x) as u8).collect();
                vol.write_at(&data, off as u64).expect("write");
                m.wrote(off, &data);
            }
            4 => {
                let first = (xorshift(&mut x) as usize) % (VOLUME_BYTES / sz);
                let n = 1 + (xorshift(&mut x) as usize) % 4;
                let n = n.min(VOLUME_BYTES / sz - first);
                vol.write_zeroes((first * sz) as u64, (n * sz) as u64)
                    .expect("write zeroes");
                m.wrote(first * sz, &vec![0; n * sz]);
            }
            5 | 6 => {
                let len = 1 + (xorshift(&mut x) % 20000) as usize;
                let off = (xorshift(&mut x) as usize) % (VOLUME_BYTES - len.min(VOLUME_BYTES - 1));
                let len = len.min(VOLUME_BYTES - off);
                let mut buf = vec![0u8; len];
                vol.read_at(&mut buf, off as u64).expect("read");
                if buf != m.plain[off..off + len] {
                    let i = (0..len).find(|&i| buf[i] != m.plain[off + i]).unwrap();
                    panic!(
                        "seed {seed} ({policy}, {sz}-byte sectors): a read of {len} at {off} \
                         differs from byte {} (volume offset {}): got {}, wrote {}",
                        i,
                        off + i,
                        buf[i],
                        m.plain[off + i]
                    );
                }
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
        Arc::new(CrashBackend::from_image(image, sz as u64)),
        sector,
        policy,
    );
    let mut got = vec![0u8; VOLUME_BYTES];
    after.read_at(&mut got, 0).expect("read after the crash");
    for s in 0..VOLUME_BYTES / sz {
        let sec = &got[s * sz..(s + 1) * sz];
        let ok = sec == &m.durable[s][..] || m.since[s].iter().any(|v| sec == &v[..]);
        assert!(
            ok,
            "seed {seed} ({policy}, {sz}-byte sectors): sector {s} after the crash is neither \
             its flushed plaintext nor one written since ({} writes since the flush)",
            m.since[s].len()
        );
    }
}

#[test]
fn power_cuts_keep_flushed_data_and_never_make_garbage() {
    let points: u64 = std::env::var("UCRYPT_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let first = common::seed(1);
    let t0 = std::time::Instant::now();
    for seed in first..first + points {
        one_crash_point(seed);
    }
    eprintln!(
        "{points} crash points (seeds {first}..{}) in {:.1} s",
        first + points,
        t0.elapsed().as_secs_f64()
    );
}
