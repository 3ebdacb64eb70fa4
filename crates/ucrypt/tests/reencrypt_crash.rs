//! Offline key rotation (`luks::reencrypt_run`) and power cuts during it.
//!
//! A LUKS2 volume on a `CrashBackend` is filled with known plaintext, then rotated: init, the
//! hotzones, finalisation. The power goes after every write and flush of the whole run (the
//! run is cut there; seeded choices of which unsynced writes landed, whole or torn at the
//! device's atomic unit). From what the device kept, recovery (`recover`, as `repair`) and
//! `resume` finish the rotation; then every byte must read back as the original plaintext with
//! the passphrase, and the header must be plain LUKS2 again. Per resilience mode; `none`
//! cannot recover a hotzone cut mid-write (cryptsetup's semantics too), so for it the cuts
//! inside a hotzone's rewrite are only checked to leave a volume that finishes.
//!
//! The seed is printed; `REENCRYPT_CRASH_SEED=n` replays one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::blockdev::BlockDev;
use ucrypt::luks::luks2::{format, FormatLuks2};
use ucrypt::luks::reencrypt_run::{
    init, recover, resume, InitOptions, Recovery, ResilienceKind, RunOptions,
};
use ucrypt::luks::{self, HashAlg, Header, KdfRequest, NewKeyslot, OpenOptions, Unlock};
use ucrypt::sector::SectorSize;
use ucrypt::{Error, Result, SecretBytes};

const DATA_OFFSET: u64 = 1 << 20;
const HDR_SIZE: u64 = 0x4000;
const DATA_BYTES: u64 = 256 << 10;
const DEVICE_BYTES: u64 = DATA_OFFSET + DATA_BYTES;
/// Small hotzones: several per run, so cuts land between and inside them.
const HOTZONE_BYTES: u64 = 64 << 10;
const PASS: &[u8] = b"rotate me";

fn fast_kdf() -> KdfRequest {
    KdfRequest {
        kind: "pbkdf2".into(),
        hash: HashAlg::Sha256,
        iter_time_ms: 1,
        memory_kib: 32,
        parallel: 1,
        force_iterations: Some(1000),
    }
}

fn plaintext() -> Vec<u8> {
    (0..DATA_BYTES)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect()
}

/// A volume with one keyslot (`PASS`) holding [`plaintext`].
fn base(sector: u32) -> Vec<u8> {
    let mut o = FormatLuks2::defaults("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0".into());
    o.kdf = fast_kdf();
    o.data_offset = DATA_OFFSET;
    o.hdr_size = HDR_SIZE;
    o.keyslots_size = DATA_OFFSET - 2 * HDR_SIZE;
    o.sector_size = SectorSize::new(u64::from(sector)).unwrap();
    let vk: Vec<u8> = (0..64u8).collect();
    let (mut hdr, key) = format(&o, SecretBytes::from_slice(&vk)).expect("format");
    let dev = Arc::new(CrashBackend::new(DEVICE_BYTES, 512).expect("device"));
    let (_, ops) = hdr
        .add_keyslot(
            NewKeyslot {
                vk: &key,
                passphrase: PASS,
                kdf: &fast_kdf(),
                slot: None,
            },
            None,
        )
        .expect("keyslot");
    luks::apply(dev.as_ref(), &ops).expect("apply");
    let vol = luks::open(
        dev.clone(),
        Unlock::Passphrase(SecretBytes::from_slice(PASS)),
        &OpenOptions::default(),
    )
    .expect("open");
    vol.write_at(&plaintext(), 0).expect("fill");
    vol.flush().expect("flush");
    drop(vol);
    dev.crash_image(0)
}

/// Reads the whole volume back with the passphrase; the header must be plain LUKS2.
fn contents(img: Vec<u8>) -> Result<Vec<u8>> {
    let dev: Arc<dyn Backend> = Arc::new(CrashBackend::from_image(img, 512));
    let hdr = luks::read_header(dev.as_ref())?;
    if !hdr.unmet_requirements().is_empty() {
        return Err(Error::InReencryption);
    }
    let vol = luks::open(
        dev,
        Unlock::Passphrase(SecretBytes::from_slice(PASS)),
        &OpenOptions::default(),
    )?;
    let mut out = vec![0u8; DATA_BYTES as usize];
    vol.read_at(&mut out, 0)?;
    Ok(out)
}

/// The whole rotation: init, then every hotzone and finalisation.
fn rotate(dev: &dyn Backend, kind: ResilienceKind) -> Result<()> {
    init(
        dev,
        PASS,
        &InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
        },
    )?;
    resume(
        dev,
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
        },
        &mut |_| {},
    )
}

/// After a crash: what an operator does (repair, then resume), when the header says a
/// rotation is under way.
fn finish(dev: &dyn Backend) -> Result<Recovery> {
    let hdr = luks::read_header(dev)?;
    if hdr.unmet_requirements().is_empty() {
        return Ok(Recovery::NotNeeded);
    }
    let r = recover(dev, PASS)?;
    // Recovering the last hotzone finalises.
    if luks::read_header(dev)?.unmet_requirements().is_empty() {
        return Ok(r);
    }
    resume(
        dev,
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
        },
        &mut |_| {},
    )?;
    Ok(r)
}

/// A backend that loses power after `budget` writes and flushes: from then on every call
/// fails, as the process would be gone.
struct Cut {
    inner: Arc<CrashBackend>,
    budget: u64,
    used: AtomicU64,
}

impl Cut {
    fn spend(&self) -> Result<()> {
        if self.used.fetch_add(1, Ordering::SeqCst) >= self.budget {
            Err(Error::InvalidArgument("power cut".into()))
        } else {
            Ok(())
        }
    }
}

impl Backend for Cut {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.spend()?;
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<()> {
        self.spend()?;
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.spend()?;
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.spend()?;
        self.inner.write_zeroes(offset, len)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_bytes(&self) -> u32 {
        self.inner.logical_block_bytes()
    }
    fn describe(&self) -> String {
        "cut".into()
    }
}

fn seed() -> u64 {
    std::env::var("REENCRYPT_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        })
}

#[test]
fn rotation_keeps_the_data() {
    for sector in [512u32, 4096] {
        for kind in [
            ResilienceKind::Checksum,
            ResilienceKind::Journal,
            ResilienceKind::None,
        ] {
            let img = base(sector);
            let dev = CrashBackend::from_image(img, 512);
            rotate(&dev, kind).expect("rotate");
            let after = dev.crash_image(0);
            let hdr = luks::read_header(&CrashBackend::from_image(after.clone(), 512)).unwrap();
            let Header::Luks2(h) = hdr else { panic!() };
            assert_eq!(h.meta.segments.len(), 1, "{kind:?}");
            assert_eq!(
                h.meta.keyslots.len(),
                1,
                "{kind:?}: old keyslot and reencrypt gone"
            );
            assert!(h.meta.config.requirements.is_none());
            let got = contents(after).expect("read back");
            assert!(got == plaintext(), "{kind:?} {sector}: data changed");
        }
    }
}

/// The key really changed: the old volume key no longer verifies.
#[test]
fn rotation_changes_the_key() {
    let img = base(4096);
    let dev = CrashBackend::from_image(img, 512);
    rotate(&dev, ResilienceKind::Checksum).expect("rotate");
    let hdr = luks::read_header(&dev).unwrap();
    let old: Vec<u8> = (0..64u8).collect();
    assert!(matches!(
        hdr.verify_key(SecretBytes::from_slice(&old)),
        Err(Error::WrongPassphrase)
    ));
}

/// Power cut at every write and flush of a whole rotation, per resilience and sector size,
/// at atomic units of 4 KiB (cryptsetup's checksum block: a torn block inside it cannot be
/// told apart) and, for the journal, 512 bytes too.
#[test]
fn power_cut_at_every_write() {
    let seed = seed();
    println!("REENCRYPT_CRASH_SEED={seed}");
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let want = plaintext();
    for (kind, unit) in [
        (ResilienceKind::Checksum, 4096u64),
        (ResilienceKind::Journal, 4096),
        (ResilienceKind::Journal, 512),
        (ResilienceKind::None, 4096),
    ] {
        for sector in [512u32, 4096] {
            let img = base(sector);
            // Count the run's writes and flushes.
            let counter = Cut {
                inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                budget: u64::MAX,
                used: AtomicU64::new(0),
            };
            rotate(&counter, kind).expect("uncut rotation");
            let total = counter.used.load(Ordering::SeqCst);
            let mut lost_in_hotzone = 0;
            for budget in 0..=total {
                let cut = Cut {
                    inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                    budget,
                    used: AtomicU64::new(0),
                };
                let r = rotate(&cut, kind);
                assert_eq!(r.is_ok(), budget == total, "budget {budget} of {total}");
                let s = next();
                let kept = cut.inner.crash_image(s);
                let dev = CrashBackend::from_image(kept, unit);
                let rec = finish(&dev).unwrap_or_else(|e| {
                    panic!("{kind:?} sector {sector} unit {unit}: cut after {budget} of {total} (crash seed {s}): recovery failed: {e}")
                });
                let got = contents(dev.crash_image(0)).expect("finished volume opens");
                if got != want {
                    if kind == ResilienceKind::None && matches!(rec, Recovery::Recovered { .. }) {
                        lost_in_hotzone += 1;
                        continue;
                    }
                    panic!(
                        "{kind:?} sector {sector} unit {unit}: cut after {budget} of {total} \
                         (crash seed {s}): data differs after recovery ({rec:?})"
                    );
                }
            }
            println!(
                "{kind:?} sector {sector} unit {unit}: {} cuts, {lost_in_hotzone} lost a hotzone",
                total + 1
            );
        }
    }
}
