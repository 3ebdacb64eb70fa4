//! Offline key rotation (`luks::reencrypt::run`) and power cuts during it.
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

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ucrypt::backend::{Backend, CrashBackend};
use ucrypt::blockdev::BlockDev;
use ucrypt::luks::reencrypt::run::{
    init, init_decrypt_unshift, init_encrypt, init_encrypt_shift, init_on, recover, recover_on,
    resume, resume_on, Devices, EncryptOptions, InitOptions, KeyslotKdf, Recovery, ResilienceAsked,
    ResilienceKind, RunOptions, SegmentChange, UnshiftOptions, CHECKSUM_HASH,
};
use ucrypt::luks::reencrypt::{Mode, ReencryptState};
use ucrypt::luks::{self, HashAlg, Header, OpenOptions, Unlock};
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use ucrypt::{Error, Result, SecretBytes};

mod common;
use common::{fast_kdf, format_detached, format_filled, Cut, Slice};
const DATA_OFFSET: u64 = 1 << 20;
const HDR_SIZE: u64 = 0x4000;
const DATA_BYTES: u64 = 256 << 10;
const DEVICE_BYTES: u64 = DATA_OFFSET + DATA_BYTES;
/// Small hotzones: several per run, so cuts land between and inside them.
const HOTZONE_BYTES: u64 = 64 << 10;
const PASS: &[u8] = b"rotate me";

fn plaintext() -> Vec<u8> {
    (0..DATA_BYTES)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect()
}

/// A volume with one keyslot (`PASS`) holding [`plaintext`].
fn base(sector: u32) -> Vec<u8> {
    let dev = Arc::new(CrashBackend::new(DEVICE_BYTES, 512).expect("device"));
    let vk: Vec<u8> = (0..64u8).collect();
    format_filled(
        &(dev.clone() as Arc<dyn Backend>),
        "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0",
        (DATA_OFFSET, HDR_SIZE, sector),
        &vk,
        PASS,
        &plaintext(),
    );
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
    rotate_to(dev, kind, SegmentChange::default())
}

/// [`rotate`] to a new cipher, key size or sector size.
fn rotate_to(dev: &dyn Backend, kind: ResilienceKind, change: SegmentChange) -> Result<()> {
    rotate_hashed(dev, kind, CHECKSUM_HASH, change)
}

/// [`rotate_to`] with checksums of `hash` (`--resilience-hash`).
fn rotate_hashed(
    dev: &dyn Backend,
    kind: ResilienceKind,
    hash: HashAlg,
    change: SegmentChange,
) -> Result<()> {
    init(
        dev,
        PASS,
        &InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
            change,
            mode: Mode::Reencrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: hash,
            shift_bytes: None,
        },
    )?;
    resume(
        dev,
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
            ..Default::default()
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
            ..Default::default()
        },
        &mut |_| {},
    )?;
    Ok(r)
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
            let dev = CrashBackend::from_image(img.clone(), 512);
            rotate(&dev, kind).expect("rotate");
            let after = dev.crash_image(0);
            // The reencrypt area (the rest of the keyslots area, up to the data) is wiped
            // with random bytes at finalisation, as cryptsetup does: its tail, which no
            // resilience data reached, changed.
            let tail = (DATA_OFFSET - (64 << 10)) as usize..DATA_OFFSET as usize;
            let changed = img[tail.clone()]
                .iter()
                .zip(&after[tail])
                .filter(|(a, b)| a != b)
                .count();
            assert!(
                changed > 60 << 10,
                "{kind:?}: reencrypt area not wiped ({changed})"
            );
            let hdr = luks::read_header(&CrashBackend::from_image(after.clone(), 512)).unwrap();
            let Header::Luks2(h) = hdr else { panic!() };
            assert_eq!(h.meta().segments.len(), 1, "{kind:?}");
            assert_eq!(
                h.meta().keyslots.len(),
                1,
                "{kind:?}: old keyslot and reencrypt gone"
            );
            assert!(h.meta().config.requirements.is_none());
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

/// xorshift64 from the printed seed.
fn rng() -> impl FnMut() -> u64 {
    let seed = seed();
    println!("REENCRYPT_CRASH_SEED={seed}");
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Cuts the power after every write and flush of one whole run (`rotate_to` with `change`,
/// from a volume of `sector`-byte sectors), keeps a seeded choice of the unsynced writes at
/// atomic `unit`s, recovers and resumes, and checks every byte. Returns (cuts, cuts that
/// lost a `none` hotzone).
fn cut_everywhere(
    kind: ResilienceKind,
    unit: u64,
    sector: u32,
    change: SegmentChange,
    next: &mut dyn FnMut() -> u64,
) -> (u64, u64) {
    cut_everywhere_hashed(kind, CHECKSUM_HASH, unit, sector, change, next)
}

/// [`cut_everywhere`] with checksums of `hash`.
fn cut_everywhere_hashed(
    kind: ResilienceKind,
    hash: HashAlg,
    unit: u64,
    sector: u32,
    change: SegmentChange,
    next: &mut dyn FnMut() -> u64,
) -> (u64, u64) {
    let want = plaintext();
    let img = base(sector);
    // Count the run's writes and flushes.
    let counter = Cut {
        inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
        budget: u64::MAX,
        used: AtomicU64::new(0),
    };
    rotate_hashed(&counter, kind, hash, change).expect("uncut rotation");
    let total = counter.used.load(Ordering::SeqCst);
    let mut lost_in_hotzone = 0;
    for budget in 0..=total {
        let cut = Cut {
            inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
            budget,
            used: AtomicU64::new(0),
        };
        let r = rotate_hashed(&cut, kind, hash, change);
        assert_eq!(r.is_ok(), budget == total, "budget {budget} of {total}");
        let s = next();
        let kept = cut.inner.crash_image(s);
        let dev = CrashBackend::from_image(kept, unit);
        check_layout(
            &dev,
            &dev,
            DATA_OFFSET,
            &want,
            &format!("{kind:?} {change:?} budget {budget}"),
        );
        let rec = finish(&dev).unwrap_or_else(|e| {
            panic!(
                "{kind:?} sector {sector} unit {unit} {change:?}: cut after {budget} of {total} \
                 (crash seed {s}): recovery failed: {e}"
            )
        });
        let got = contents(dev.crash_image(0)).expect("finished volume opens");
        if got != want {
            if kind == ResilienceKind::None && matches!(rec, Recovery::Recovered { .. }) {
                lost_in_hotzone += 1;
                continue;
            }
            panic!(
                "{kind:?} sector {sector} unit {unit} {change:?}: cut after {budget} of {total} \
                 (crash seed {s}): data differs after recovery ({rec:?})"
            );
        }
    }
    (total + 1, lost_in_hotzone)
}

/// Power cut at every write and flush of a whole rotation, per resilience and sector size,
/// at atomic units of 4 KiB (cryptsetup's checksum block: a torn block inside it cannot be
/// told apart) and, for the journal, 512 bytes too.
#[test]
fn power_cut_at_every_write() {
    let mut next = rng();
    for (kind, unit) in [
        (ResilienceKind::Checksum, 4096u64),
        (ResilienceKind::Journal, 4096),
        (ResilienceKind::Journal, 512),
        (ResilienceKind::None, 4096),
    ] {
        for sector in [512u32, 4096] {
            let (cuts, lost) =
                cut_everywhere(kind, unit, sector, SegmentChange::default(), &mut next);
            println!("{kind:?} sector {sector} unit {unit}: {cuts} cuts, {lost} lost a hotzone");
        }
    }
}

/// Checksums of another hash than sha256 (`--resilience-hash`): the reencrypt keyslot names
/// it, and a power cut at every write and flush of a rotation recovers with it (at atomic
/// units of 4 KiB, as above).
#[test]
fn power_cut_with_other_checksum_hashes() {
    let mut next = rng();
    for (hash, sector) in [
        (HashAlg::Sha512, 512u32),
        (HashAlg::Sha1, 4096),
        (HashAlg::Whirlpool, 512),
        (HashAlg::Blake2s256, 4096),
    ] {
        let dev = CrashBackend::from_image(base(sector), 512);
        init(
            &dev,
            PASS,
            &InitOptions {
                resilience: ResilienceKind::Checksum,
                kdf: &fast_kdf(),
                key_slot: None,
                change: SegmentChange::default(),
                mode: Mode::Reencrypt,
                keyslot_kdf: KeyslotKdf::Given,
                resilience_hash: hash,
                shift_bytes: None,
            },
        )
        .expect("init");
        let Header::Luks2(h) = luks::read_header(&dev).expect("header") else {
            panic!("LUKS2")
        };
        let st = ucrypt::luks::reencrypt::ReencryptState::from_metadata(h.meta())
            .expect("state")
            .expect("in reencryption");
        assert_eq!(
            st.keyslot.resilience,
            ucrypt::luks::reencrypt::Resilience::Checksum {
                hash: hash.name().into(),
                sector_size: 4096
            }
        );
        let (cuts, _) = cut_everywhere_hashed(
            ResilienceKind::Checksum,
            hash,
            4096,
            sector,
            SegmentChange::default(),
            &mut next,
        );
        println!("{hash:?} sector {sector}: {cuts} cuts recovered");
    }
}

/// The cipher, key size and sector size changes the tests make: (old sector size, change,
/// what the new segment's `encryption` and `sector_size` and the new key size must be).
fn changes() -> Vec<(u32, SegmentChange, &'static str, u32, u32)> {
    let ss = |n| Some(SectorSize::new(n).unwrap());
    vec![
        (
            512,
            SegmentChange {
                cipher: None,
                key_bytes: Some(32),
                sector_size: ss(4096),
            },
            "aes-xts-plain64",
            4096,
            32,
        ),
        (
            4096,
            SegmentChange {
                cipher: Some("aes-cbc-essiv:sha256".parse::<CipherSpec>().unwrap()),
                key_bytes: None,
                sector_size: ss(512),
            },
            "aes-cbc-essiv:sha256",
            512,
            32,
        ),
    ]
}

/// A cipher, key size or sector size change keeps the data; the plain header left has the
/// new segment, and the new keyslot's area keeps the old cipher (as cryptsetup's).
#[test]
fn cipher_change_keeps_the_data() {
    for (sector, change, enc, new_sector, key_bytes) in changes() {
        for kind in [
            ResilienceKind::Checksum,
            ResilienceKind::Journal,
            ResilienceKind::None,
        ] {
            let dev = CrashBackend::from_image(base(sector), 512);
            rotate_to(&dev, kind, change).expect("rotate");
            let after = dev.crash_image(0);
            let hdr = luks::read_header(&CrashBackend::from_image(after.clone(), 512)).unwrap();
            let Header::Luks2(h) = hdr else { panic!() };
            let seg = &h.meta().segments["0"];
            assert_eq!(seg.encryption.as_deref(), Some(enc), "{kind:?}");
            assert_eq!(seg.sector_size, Some(new_sector), "{kind:?}");
            let ks: Vec<_> = h.meta().keyslots.values().collect();
            assert_eq!(ks.len(), 1);
            assert_eq!(ks[0].key_size, key_bytes);
            let area = ks[0].area.as_ref().unwrap();
            assert_eq!(area.encryption.as_deref(), Some("aes-xts-plain64"));
            assert_eq!(area.key_size, Some(64));
            let got = contents(after).expect("read back");
            assert!(got == plaintext(), "{kind:?} {change:?}: data changed");
        }
    }
}

/// A change of the new segment's size the data is not aligned to is refused before anything
/// is written.
#[test]
fn sector_size_change_needs_aligned_data() {
    let img = base(512);
    let dev = CrashBackend::from_image(img, 512);
    // 2 KiB less data: a multiple of 512 but not of 4096.
    let short = CrashBackend::from_image(
        dev.crash_image(0)[..(DEVICE_BYTES - 2048) as usize].to_vec(),
        512,
    );
    let before = short.crash_image(0);
    let r = rotate_to(
        &short,
        ResilienceKind::Checksum,
        SegmentChange {
            sector_size: Some(SectorSize::new(4096).unwrap()),
            ..SegmentChange::default()
        },
    );
    assert!(
        matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("not aligned")),
        "{r:?}"
    );
    assert!(short.crash_image(0) == before, "nothing written");
}

/// Power cuts at every write of a cipher and sector size change, checksum and journal.
#[test]
fn power_cut_during_cipher_change() {
    let mut next = rng();
    for (sector, change, ..) in changes() {
        for (kind, unit) in [
            (ResilienceKind::Checksum, 4096u64),
            (ResilienceKind::Journal, 512),
        ] {
            let (cuts, lost) = cut_everywhere(kind, unit, sector, change, &mut next);
            assert_eq!(lost, 0);
            println!("{kind:?} sector {sector} {change:?} unit {unit}: {cuts} cuts");
        }
    }
}

// ---------------------------------------------------------------- decryption (detached header)

/// Bytes of the header device of a detached-header volume: both header copies and the
/// keyslots area (which holds the reencrypt area).
const DETACHED_HDR_BYTES: u64 = 1 << 20;

/// A window `[offset, offset + len)` of another backend: the header device and the data
/// device of a detached-header volume as two devices on one crash-simulated disk, so that a
/// power cut hits both at the same moment.
/// The header and data devices of a detached-header disk image.
fn split(disk: Arc<dyn Backend>) -> (Slice, Slice) {
    (
        Slice {
            inner: disk.clone(),
            offset: 0,
            len: DETACHED_HDR_BYTES,
        },
        Slice {
            inner: disk,
            offset: DETACHED_HDR_BYTES,
            len: DATA_BYTES,
        },
    )
}

/// A disk image holding a detached LUKS2 header (data offset 0, one keyslot for `PASS`) in
/// its first [`DETACHED_HDR_BYTES`] and the ciphertext of [`plaintext`] after it.
fn base_detached(sector: u32) -> Vec<u8> {
    let vk: Vec<u8> = (0..64u8).collect();
    let disk = Arc::new(CrashBackend::new(DETACHED_HDR_BYTES + DATA_BYTES, 512).expect("disk"));
    let (h, d) = split(disk.clone());
    format_detached(
        &h,
        "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f1",
        (HDR_SIZE, DETACHED_HDR_BYTES, sector),
        &vk,
        PASS,
    );
    let mut c = SectorCipher::new(
        CipherSpec::AES_XTS_PLAIN64,
        &vk,
        Geometry {
            sector_size: SectorSize::new(u64::from(sector)).unwrap(),
            iv_offset: 0,
            iv_large_sectors: false,
        },
    )
    .expect("cipher");
    let mut data = plaintext();
    c.encrypt(0, &mut data).expect("encrypt");
    d.write_at(&data, 0).expect("fill");
    disk.flush().expect("flush");
    disk.crash_image(0)
}

fn decrypt_all(disk: Arc<dyn Backend>, kind: ResilienceKind) -> Result<()> {
    let (h, d) = split(disk);
    let devs = Devices {
        header: &h,
        data: &d,
    };
    init_on(
        devs,
        PASS,
        &InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
            change: SegmentChange::default(),
            mode: Mode::Decrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        },
    )?;
    resume_on(
        devs,
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
            ..Default::default()
        },
        &mut |_| {},
    )
}

/// After a crash during a decryption: repair, then resume, if the header says one is under
/// way. Returns what recovery found, and the data device's bytes and header after it.
fn finish_decrypt(disk: Arc<CrashBackend>) -> Result<(Recovery, Vec<u8>, luks::Header)> {
    let (h, d) = split(disk.clone());
    let devs = Devices {
        header: &h,
        data: &d,
    };
    let mut rec = Recovery::NotNeeded;
    if !luks::read_header(&h)?.unmet_requirements().is_empty() {
        rec = recover_on(devs, PASS)?;
        if !luks::read_header(&h)?.unmet_requirements().is_empty() {
            resume_on(
                devs,
                PASS,
                RunOptions {
                    hotzone_bytes: Some(HOTZONE_BYTES),
                    ..Default::default()
                },
                &mut |_| {},
            )?;
        }
    }
    let mut out = vec![0u8; DATA_BYTES as usize];
    d.read_exact_at(&mut out, 0)?;
    Ok((rec, out, luks::read_header(&h)?))
}

/// The header a finished decryption leaves: one linear segment, no keyslot, no digest, no
/// requirement (as cryptsetup 2.6.1 leaves it).
fn assert_decrypted_header(hdr: &luks::Header) {
    let Header::Luks2(h) = hdr else {
        panic!("not LUKS2")
    };
    assert_eq!(h.meta().segments.len(), 1);
    assert_eq!(h.meta().segments["0"].kind.as_str(), "linear");
    assert!(
        h.meta().keyslots.is_empty(),
        "{:?}",
        h.meta().keyslots.keys()
    );
    assert!(h.meta().digests.is_empty());
    assert!(h.meta().config.requirements.is_none());
}

#[test]
fn decryption_leaves_the_plaintext() {
    for sector in [512u32, 4096] {
        for kind in [
            ResilienceKind::Checksum,
            ResilienceKind::Journal,
            ResilienceKind::None,
        ] {
            let disk = Arc::new(CrashBackend::from_image(base_detached(sector), 512));
            decrypt_all(disk.clone(), kind).expect("decrypt");
            let (rec, data, hdr) = finish_decrypt(disk).expect("read back");
            assert_eq!(rec, Recovery::NotNeeded);
            assert_decrypted_header(&hdr);
            assert!(data == plaintext(), "{kind:?} {sector}: data differs");
        }
    }
}

/// Decryption needs a detached header (cryptsetup 2.6's rule), refused before any write.
#[test]
fn decryption_needs_a_detached_header() {
    let dev = CrashBackend::from_image(base(4096), 512);
    let before = dev.crash_image(0);
    let r = init(
        &dev,
        PASS,
        &InitOptions {
            resilience: ResilienceKind::Checksum,
            kdf: &fast_kdf(),
            key_slot: None,
            change: SegmentChange::default(),
            mode: Mode::Decrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        },
    );
    assert!(matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("detached header")));
    assert!(dev.crash_image(0) == before);
}

/// Before any recovery: every live segment of a header in reencryption but the hotzone says
/// what its bytes are: a linear one holds the plaintext, a crypt one decrypts to it with the
/// key of its digest (unlocked with the passphrase), its cipher, sector size and IV tweak.
/// `data_offset` is where the data starts on `data`.
fn check_layout(
    hdr_dev: &dyn Backend,
    data: &dyn Backend,
    data_offset: u64,
    want: &[u8],
    what: &str,
) {
    let Ok(hdr_any) = luks::read_header(hdr_dev) else {
        return;
    };
    let Header::Luks2(hdr) = &hdr_any else {
        return;
    };
    if ucrypt::luks::reencrypt::ReencryptState::from_metadata(hdr.meta())
        .unwrap()
        .is_none()
    {
        return;
    }
    let mut bytes = vec![0u8; DATA_BYTES as usize];
    data.read_exact_at(&mut bytes, data_offset).unwrap();
    for (id, seg) in &hdr.meta().segments {
        if seg.flags.as_ref().is_some_and(|f| !f.is_empty()) {
            continue; // backups, and the hotzone (old or new per block)
        }
        let start = (seg.offset.0 - data_offset) as usize;
        let end = match seg.size {
            ucrypt::luks::json::SegmentSize::Bytes(n) => start + n as usize,
            ucrypt::luks::json::SegmentSize::Dynamic => DATA_BYTES as usize,
        };
        let mut part = bytes[start..end].to_vec();
        if seg.kind.as_str() == "crypt" {
            let n: u32 = id.parse().unwrap();
            let d = ucrypt::luks::reencrypt::digest_of_segment(hdr.meta(), n).unwrap();
            let slot: u32 = hdr.meta().digests[&d.to_string()].keyslots[0]
                .parse()
                .unwrap();
            let mut read = |o: u64, l: u64| luks::read_area(hdr_dev, o, l);
            let (_, vk) = luks::unlock(&hdr_any, PASS, Some(slot), &mut read).unwrap();
            let mut c = SectorCipher::new(
                seg.encryption.as_deref().unwrap().parse().unwrap(),
                vk.bytes(),
                Geometry {
                    sector_size: SectorSize::new(u64::from(seg.sector_size.unwrap())).unwrap(),
                    iv_offset: seg.iv_tweak.unwrap().0,
                    iv_large_sectors: false,
                },
            )
            .unwrap();
            c.decrypt(0, &mut part).unwrap();
        }
        assert!(
            part == want[start..end],
            "{what}: segment {id} ({} at {start}..{end}) does not hold what it says",
            seg.kind
        );
    }
}

/// Power cut at every write and flush of a whole decryption (header and data on one
/// simulated disk), recovery and resume: every byte is the plaintext, the header plain.
#[test]
fn power_cut_during_decryption() {
    let mut next = rng();
    let want = plaintext();
    for (kind, unit) in [
        (ResilienceKind::Checksum, 4096u64),
        (ResilienceKind::Journal, 512),
        (ResilienceKind::None, 4096),
    ] {
        for sector in [512u32, 4096] {
            let img = base_detached(sector);
            let counter = Arc::new(Cut {
                inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                budget: u64::MAX,
                used: AtomicU64::new(0),
            });
            decrypt_all(counter.clone(), kind).expect("uncut decryption");
            let total = counter.used.load(Ordering::SeqCst);
            let mut lost = 0;
            for budget in 0..=total {
                let cut = Arc::new(Cut {
                    inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                    budget,
                    used: AtomicU64::new(0),
                });
                let r = decrypt_all(cut.clone(), kind);
                assert_eq!(r.is_ok(), budget == total, "budget {budget} of {total}");
                let s = next();
                let kept = Arc::new(CrashBackend::from_image(cut.inner.crash_image(s), unit));
                let (h, d) = split(kept.clone());
                check_layout(&h, &d, 0, &want, &format!("decrypt budget {budget}"));
                let (rec, got, hdr) = finish_decrypt(kept).unwrap_or_else(|e| {
                    panic!(
                        "{kind:?} sector {sector} unit {unit}: cut after {budget} of {total} \
                         (crash seed {s}): recovery failed: {e}"
                    )
                });
                let Header::Luks2(h) = &hdr else { panic!() };
                if h.meta().segments["0"].kind.as_str() == "crypt"
                    && h.meta().config.requirements.is_none()
                {
                    // Cut before the init's commit: still the encrypted volume.
                    let (_, d) = split(Arc::new(CrashBackend::from_image(img.clone(), unit)));
                    let mut was = vec![0u8; DATA_BYTES as usize];
                    d.read_exact_at(&mut was, 0).unwrap();
                    assert!(got == was, "budget {budget}: untouched volume changed");
                    continue;
                }
                assert_decrypted_header(&hdr);
                if got != want {
                    if kind == ResilienceKind::None && matches!(rec, Recovery::Recovered { .. }) {
                        lost += 1;
                        continue;
                    }
                    panic!(
                        "{kind:?} sector {sector} unit {unit}: cut after {budget} of {total} \
                         (crash seed {s}): data differs after recovery ({rec:?})"
                    );
                }
            }
            println!(
                "decrypt {kind:?} sector {sector} unit {unit}: {} cuts, {lost} lost a hotzone",
                total + 1
            );
        }
    }
}

// ---------------------------------------------------------------- encryption (detached header)

/// A disk image with an empty header region and [`plaintext`] as the data.
fn base_plain() -> Vec<u8> {
    let mut img = vec![0u8; (DETACHED_HDR_BYTES + DATA_BYTES) as usize];
    img[DETACHED_HDR_BYTES as usize..].copy_from_slice(&plaintext());
    img
}

fn encrypt_all(disk: Arc<dyn Backend>, kind: ResilienceKind, sector: u32) -> Result<()> {
    let (h, d) = split(disk);
    let devs = Devices {
        header: &h,
        data: &d,
    };
    init_encrypt(
        devs,
        PASS,
        &EncryptOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            cipher: CipherSpec::AES_XTS_PLAIN64,
            key_bytes: 64,
            sector_size: SectorSize::new(u64::from(sector)).unwrap(),
            uuid: "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f2".into(),
            keyslot_area: None,
            resilience_hash: CHECKSUM_HASH,
        },
    )?;
    resume_on(
        devs,
        PASS,
        RunOptions {
            hotzone_bytes: Some(HOTZONE_BYTES),
            ..Default::default()
        },
        &mut |_| {},
    )
}

/// After a crash during an encryption: repair and resume if the header says one is under
/// way. Returns what recovery found and the plaintext read through the header, or `None`
/// when no header was written (the data device must then be untouched plaintext).
fn finish_encrypt(disk: Arc<CrashBackend>) -> Result<(Recovery, Option<Vec<u8>>)> {
    let (h, d) = split(disk.clone());
    let Ok(hdr) = luks::read_header(&h) else {
        return Ok((Recovery::NotNeeded, None));
    };
    let devs = Devices {
        header: &h,
        data: &d,
    };
    let mut rec = Recovery::NotNeeded;
    if !hdr.unmet_requirements().is_empty() {
        rec = recover_on(devs, PASS)?;
        if !luks::read_header(&h)?.unmet_requirements().is_empty() {
            resume_on(
                devs,
                PASS,
                RunOptions {
                    hotzone_bytes: Some(HOTZONE_BYTES),
                    ..Default::default()
                },
                &mut |_| {},
            )?;
        }
    }
    if !luks::read_header(&h)?.unmet_requirements().is_empty() {
        return Err(Error::InReencryption);
    }
    let (h, d) = split(disk);
    let mut opts = OpenOptions::default();
    opts.header = Some(Arc::new(h));
    let vol = luks::open(
        Arc::new(d),
        Unlock::Passphrase(SecretBytes::from_slice(PASS)),
        &opts,
    )?;
    let mut out = vec![0u8; DATA_BYTES as usize];
    vol.read_at(&mut out, 0)?;
    Ok((rec, Some(out)))
}

#[test]
fn encryption_keeps_the_data() {
    for sector in [512u32, 4096] {
        for kind in [
            ResilienceKind::Checksum,
            ResilienceKind::Journal,
            ResilienceKind::None,
        ] {
            let disk = Arc::new(CrashBackend::from_image(base_plain(), 512));
            encrypt_all(disk.clone(), kind, sector).expect("encrypt");
            let (_, d) = split(disk.clone());
            let mut raw = vec![0u8; DATA_BYTES as usize];
            d.read_exact_at(&mut raw, 0).unwrap();
            assert!(raw != plaintext(), "{kind:?} {sector}: still plaintext");
            let (rec, got) = finish_encrypt(disk).expect("read back");
            assert_eq!(rec, Recovery::NotNeeded);
            assert!(
                got.unwrap() == plaintext(),
                "{kind:?} {sector}: data differs"
            );
        }
    }
}

/// Power cut at every write and flush of a whole encryption (header and data on one
/// simulated disk), recovery and resume: every byte reads back as the plaintext.
#[test]
fn power_cut_during_encryption() {
    let mut next = rng();
    let want = plaintext();
    for (kind, unit) in [
        (ResilienceKind::Checksum, 4096u64),
        (ResilienceKind::Journal, 512),
        (ResilienceKind::None, 4096),
    ] {
        for sector in [512u32, 4096] {
            let img = base_plain();
            let counter = Arc::new(Cut {
                inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                budget: u64::MAX,
                used: AtomicU64::new(0),
            });
            encrypt_all(counter.clone(), kind, sector).expect("uncut encryption");
            let total = counter.used.load(Ordering::SeqCst);
            let mut lost = 0;
            for budget in 0..=total {
                let cut = Arc::new(Cut {
                    inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                    budget,
                    used: AtomicU64::new(0),
                });
                let r = encrypt_all(cut.clone(), kind, sector);
                assert_eq!(r.is_ok(), budget == total, "budget {budget} of {total}");
                let s = next();
                let kept = Arc::new(CrashBackend::from_image(cut.inner.crash_image(s), unit));
                let (h, d) = split(kept.clone());
                check_layout(&h, &d, 0, &want, &format!("encrypt budget {budget}"));
                let (rec, got) = finish_encrypt(kept.clone()).unwrap_or_else(|e| {
                    panic!(
                        "{kind:?} sector {sector} unit {unit}: cut after {budget} of {total} \
                         (crash seed {s}): recovery failed: {e}"
                    )
                });
                let got = match got {
                    Some(g) => g,
                    None => {
                        // No header yet: the data must be the untouched plaintext.
                        let (_, d) = split(kept);
                        let mut raw = vec![0u8; DATA_BYTES as usize];
                        d.read_exact_at(&mut raw, 0).unwrap();
                        assert!(raw == want, "budget {budget}: no header, data changed");
                        continue;
                    }
                };
                if got != want {
                    if kind == ResilienceKind::None && matches!(rec, Recovery::Recovered { .. }) {
                        lost += 1;
                        continue;
                    }
                    panic!(
                        "{kind:?} sector {sector} unit {unit}: cut after {budget} of {total} \
                         (crash seed {s}): data differs after recovery ({rec:?})"
                    );
                }
            }
            println!(
                "encrypt {kind:?} sector {sector} unit {unit}: {} cuts, {lost} lost a hotzone",
                total + 1
            );
        }
    }
}

// ---------------------------------------------------------------- encryption moving the data

/// The shift of the data-moving encryption tests: the smallest power of two that holds two
/// 16 KiB header copies, keyslot 0's area (258048 bytes) and the 4 KiB reencrypt area.
const SHIFT_BYTES: u64 = 512 << 10;
/// Plaintext to move: two shifts and a half, so the walk has a whole hotzone, a shortened one
/// (what is left above the first shift) and the moved segment's.
const SHIFT_DATA_BYTES: u64 = 2 * SHIFT_BYTES + 384 * 1024;
/// The device: the data, then the `--reduce-device-size` (2 shifts) of free space.
const SHIFT_DEVICE_BYTES: u64 = SHIFT_DATA_BYTES + 2 * SHIFT_BYTES;

fn shift_plaintext() -> Vec<u8> {
    (0..SHIFT_DATA_BYTES)
        .map(|i| (i.wrapping_mul(0x9e37_79b1) >> 11) as u8 ^ 0xa5)
        .collect()
}

/// The plaintext device: the data, then free space holding a pattern of its own.
fn base_shift() -> Vec<u8> {
    let mut img = shift_plaintext();
    img.extend((0..2 * SHIFT_BYTES).map(|i| (i % 251) as u8));
    img
}

/// `reencrypt --encrypt --reduce-device-size 2S` of the whole device: init, then every
/// hotzone. The driver's buffer (`--hotzone-size`) is smaller than the shift, so a hotzone is
/// moved in several pieces (one chunk slot at a time, offline).
fn encrypt_shift_all(dev: &dyn Backend, sector: u32) -> Result<()> {
    encrypt_shift_all_in(dev, sector, Some(128 << 10))
}

/// [`encrypt_shift_all`] with a buffer of `hotzone_bytes` (`None`: the default, larger than
/// the data: offline, the lanes then read and encrypt chunks of the next hotzone while the
/// last one's are written and committed).
fn encrypt_shift_all_in(dev: &dyn Backend, sector: u32, hotzone_bytes: Option<u64>) -> Result<()> {
    init_encrypt_shift(
        dev,
        PASS,
        &EncryptOptions {
            resilience: ResilienceKind::None,
            kdf: &fast_kdf(),
            cipher: CipherSpec::AES_XTS_PLAIN64,
            key_bytes: 64,
            sector_size: SectorSize::new(u64::from(sector)).unwrap(),
            uuid: "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f3".into(),
            keyslot_area: None,
            resilience_hash: CHECKSUM_HASH,
        },
        2 * SHIFT_BYTES,
    )?;
    resume(
        dev,
        PASS,
        RunOptions {
            hotzone_bytes,
            ..Default::default()
        },
        &mut |_| {},
    )
}

/// The volume's data (`SHIFT_DATA_BYTES` and the shift it grew by) through its header, which
/// must be plain LUKS2 with the data at the shift.
fn shift_contents(dev: Arc<dyn Backend>) -> Result<Vec<u8>> {
    let hdr = luks::read_header(dev.as_ref())?;
    if !hdr.unmet_requirements().is_empty() {
        return Err(Error::InReencryption);
    }
    let Header::Luks2(h) = &hdr else {
        panic!("LUKS1")
    };
    assert_eq!(h.meta().segments.len(), 1);
    assert_eq!(h.meta().segments["0"].offset.0, SHIFT_BYTES);
    let vol = luks::open(
        dev,
        Unlock::Passphrase(SecretBytes::from_slice(PASS)),
        &OpenOptions::default(),
    )?;
    assert_eq!(
        vol.size(),
        SHIFT_DATA_BYTES + SHIFT_BYTES,
        "the data grew by the shift"
    );
    let mut out = vec![0u8; SHIFT_DATA_BYTES as usize];
    vol.read_at(&mut out, 0)?;
    Ok(out)
}

/// Before recovery: the live segments, laid end to end as cryptsetup maps them, hold the
/// data in order: a linear one its plaintext, a crypt one its ciphertext under the new key
/// (its IV tweak), the hotzone skipped.
fn check_shift_layout(dev: &dyn Backend, want: &[u8], what: &str) {
    check_moved_layout(dev, dev, want, what)
}

/// [`check_shift_layout`] with the header on `hdr` and the data on `data`.
fn check_moved_layout(hdr_dev: &dyn Backend, dev: &dyn Backend, want: &[u8], what: &str) {
    let Ok(hdr_any) = luks::read_header(hdr_dev) else {
        return;
    };
    let Header::Luks2(hdr) = &hdr_any else {
        return;
    };
    if ucrypt::luks::reencrypt::ReencryptState::from_metadata(hdr.meta())
        .unwrap()
        .is_none()
    {
        return;
    }
    let mut live: Vec<(u32, &ucrypt::luks::json::Segment)> = hdr
        .meta()
        .segments
        .iter()
        .map(|(k, s)| (k.parse().unwrap(), s))
        .filter(|(_, s)| {
            !s.flags
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f.starts_with("backup-")))
        })
        .collect();
    live.sort_by_key(|(k, _)| *k);
    let mut at = 0usize;
    for (id, seg) in live {
        let len = match seg.size {
            ucrypt::luks::json::SegmentSize::Bytes(n) => n as usize,
            ucrypt::luks::json::SegmentSize::Dynamic => want.len() - at,
        };
        let hot = seg.flags.as_ref().is_some_and(|f| !f.is_empty());
        if !hot {
            let mut part = vec![0u8; len];
            dev.read_exact_at(&mut part, seg.offset.0).unwrap();
            if seg.kind.as_str() == "crypt" {
                let d = ucrypt::luks::reencrypt::digest_of_segment(hdr.meta(), id).unwrap();
                let slot: u32 = hdr.meta().digests[&d.to_string()].keyslots[0]
                    .parse()
                    .unwrap();
                let mut read = |o: u64, l: u64| luks::read_area(hdr_dev, o, l);
                let (_, vk) = luks::unlock(&hdr_any, PASS, Some(slot), &mut read).unwrap();
                let mut c = SectorCipher::new(
                    seg.encryption.as_deref().unwrap().parse().unwrap(),
                    vk.bytes(),
                    Geometry {
                        sector_size: SectorSize::new(u64::from(seg.sector_size.unwrap())).unwrap(),
                        iv_offset: seg.iv_tweak.unwrap().0,
                        iv_large_sectors: false,
                    },
                )
                .unwrap();
                c.decrypt(0, &mut part).unwrap();
            }
            assert!(
                part == want[at..at + len],
                "{what}: segment {id} ({} at device {} for data {at}..{}) does not hold what \
                 it says",
                seg.kind,
                seg.offset.0,
                at + len
            );
        }
        at += len;
    }
    assert_eq!(at, want.len(), "{what}: the live segments cover the data");
}

/// After a crash during a data-moving encryption: repair and resume if the header says one is
/// under way; `None` when no header was written.
fn finish_shift(dev: Arc<CrashBackend>) -> Result<(Recovery, Option<Vec<u8>>)> {
    let Ok(hdr) = luks::read_header(dev.as_ref()) else {
        return Ok((Recovery::NotNeeded, None));
    };
    let mut rec = Recovery::NotNeeded;
    if !hdr.unmet_requirements().is_empty() {
        rec = recover(dev.as_ref(), PASS)?;
        if !luks::read_header(dev.as_ref())?
            .unmet_requirements()
            .is_empty()
        {
            resume(dev.as_ref(), PASS, RunOptions::default(), &mut |_| {})?;
        }
    }
    Ok((rec, Some(shift_contents(dev)?)))
}

#[test]
fn shift_encryption_keeps_the_data() {
    let want = shift_plaintext();
    for sector in [512u32, 4096] {
        let dev = Arc::new(CrashBackend::from_image(base_shift(), 512));
        encrypt_shift_all(dev.as_ref(), sector).expect("encrypt");
        let img = dev.crash_image(0);
        // No plaintext left: not at its old place, not in the moved segment (wiped).
        let moved = (SHIFT_DATA_BYTES + SHIFT_BYTES) as usize;
        assert!(img[moved..moved + SHIFT_BYTES as usize] != want[..SHIFT_BYTES as usize]);
        assert!(img[..SHIFT_DATA_BYTES as usize] != want[..]);
        let Header::Luks2(h) = luks::read_header(dev.as_ref()).unwrap() else {
            panic!()
        };
        assert_eq!(h.meta().segments["0"].sector_size, Some(sector));
        assert_eq!(h.meta().keyslots.len(), 1, "reencrypt keyslot gone");
        let got = shift_contents(dev).expect("read back");
        assert!(got == want, "{sector}: data differs");
    }
}

/// What cannot be shifted is refused before anything is written: less than one shift of
/// data, a shift not aligned to the sector size, a device that already holds LUKS.
#[test]
fn shift_encryption_refusals_write_nothing() {
    let enc = |dev: &dyn Backend, reduce: u64, sector: u32| {
        init_encrypt_shift(
            dev,
            PASS,
            &EncryptOptions {
                resilience: ResilienceKind::None,
                kdf: &fast_kdf(),
                cipher: CipherSpec::AES_XTS_PLAIN64,
                key_bytes: 64,
                sector_size: SectorSize::new(u64::from(sector)).unwrap(),
                uuid: "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f4".into(),
                keyslot_area: None,
                resilience_hash: CHECKSUM_HASH,
            },
            reduce,
        )
    };
    for (reduce, sector, what) in [
        (SHIFT_DEVICE_BYTES, 512, "too small"),
        (2 * SHIFT_DATA_BYTES, 512, "too small"),
        (2 * (SHIFT_BYTES + 512), 4096, "aligned"),
        (1000, 512, "multiple of 512"),
        (4 << 30, 512, "1 GiB"),
        (64 << 10, 512, "metadata"),
    ] {
        let dev = CrashBackend::from_image(base_shift(), 512);
        let e = enc(&dev, reduce, sector).unwrap_err().to_string();
        assert!(e.contains(what), "{reduce} {sector}: {e}");
        assert!(dev.crash_image(0) == base_shift(), "{reduce}: written");
    }
    let dev = CrashBackend::from_image(base_shift(), 512);
    encrypt_shift_all(&dev, 512).unwrap();
    let img = dev.crash_image(0);
    let e = enc(&dev, 2 * SHIFT_BYTES, 512).unwrap_err().to_string();
    assert!(e.contains("already LUKS"), "{e}");
    assert!(dev.crash_image(0) == img);
}

/// Power cut at every write and flush of a whole data-moving encryption (init, three
/// hotzones, finalisation), at atomic units of 512 and 4096 bytes, sector sizes 512 and
/// 4096: before recovery the live segments hold what they say; recovery and resume give
/// the plaintext through the header; with no header written, the plaintext beyond the first
/// shift is untouched and the first shift is at its place or in the moved segment.
#[test]
fn power_cut_during_shift_encryption() {
    let mut next = rng();
    let want = shift_plaintext();
    let s = SHIFT_BYTES as usize;
    for (sector, unit, hotzone) in [
        (512u32, 512u64, Some(128 << 10)),
        (4096, 4096, Some(128 << 10)),
        (512, 4096, Some(128 << 10)),
        (512, 512, None),
        (4096, 4096, None),
    ] {
        let img = base_shift();
        let counter = Cut {
            inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
            budget: u64::MAX,
            used: AtomicU64::new(0),
        };
        encrypt_shift_all_in(&counter, sector, hotzone).expect("uncut encryption");
        let total = counter.used.load(Ordering::SeqCst);
        let (mut no_header, mut recovered) = (0, 0);
        for budget in 0..=total {
            let cut = Cut {
                inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                budget,
                used: AtomicU64::new(0),
            };
            let r = encrypt_shift_all_in(&cut, sector, hotzone);
            assert_eq!(r.is_ok(), budget == total, "budget {budget} of {total}");
            let seed = next();
            let kept = Arc::new(CrashBackend::from_image(cut.inner.crash_image(seed), unit));
            let what = format!(
                "sector {sector} unit {unit} hotzone {hotzone:?} cut after {budget} of {total} \
                 (crash seed {seed})"
            );
            check_shift_layout(kept.as_ref(), &want, &what);
            let (rec, got) = finish_shift(kept.clone())
                .unwrap_or_else(|e| panic!("{what}: recovery failed: {e}"));
            match got {
                Some(g) => assert!(g == want, "{what}: data differs after recovery ({rec:?})"),
                None => {
                    no_header += 1;
                    let raw = kept.crash_image(0);
                    let moved = (SHIFT_DATA_BYTES + SHIFT_BYTES) as usize;
                    assert!(
                        raw[s..SHIFT_DATA_BYTES as usize] == want[s..],
                        "{what}: no header, data beyond the first shift changed"
                    );
                    assert!(
                        raw[..s] == want[..s] || raw[moved..moved + s] == want[..s],
                        "{what}: no header, the first shift neither in place nor moved"
                    );
                }
            }
            if matches!(rec, Recovery::Recovered { .. }) {
                recovered += 1;
            }
        }
        println!(
            "shift sector {sector} unit {unit} hotzone {hotzone:?}: {} cuts, {no_header} before \
             the header, \
             {recovered} inside a hotzone recovered",
            total + 1
        );
        assert!(recovered > 0, "no cut landed inside a hotzone");
    }
}

// ---------------------------------------------------------- decryption moving the data back

/// The old data offset of the tests of a decryption that moves the data back: the shift, and
/// the header file's size (two 16 KiB copies and the keyslots area: keyslot 0's 258048 bytes
/// and the reencrypt area after it).
const UNSHIFT_S: u64 = 512 << 10;
/// Ciphertext to move: two shifts and a bit, so the walk has a whole hotzone and a
/// shortened one before the moved segment's.
const UNSHIFT_DATA: u64 = 2 * UNSHIFT_S + (384 << 10);
/// The volume: the header in front, then the data.
const UNSHIFT_DEV: u64 = UNSHIFT_S + UNSHIFT_DATA;
/// The driver's buffer (`--hotzone-size`): smaller than the shift, so that a hotzone of the
/// walk is moved in several pieces.
const UNSHIFT_PIECE: u64 = 128 << 10;

fn unshift_plaintext() -> Vec<u8> {
    (0..UNSHIFT_DATA)
        .map(|i| (i.wrapping_mul(0x2545_f491) >> 9) as u8 ^ 0x3c)
        .collect()
}

/// The new header file and the volume as two devices on one crash-simulated disk:
/// `[header file, UNSHIFT_S][volume: header in front, then the data]`.
fn unshift_devs(disk: &Arc<dyn Backend>) -> (Arc<Slice>, Arc<Slice>) {
    (
        Arc::new(Slice {
            inner: disk.clone(),
            offset: 0,
            len: UNSHIFT_S,
        }),
        Arc::new(Slice {
            inner: disk.clone(),
            offset: UNSHIFT_S,
            len: UNSHIFT_DEV,
        }),
    )
}

/// A disk image: an empty header file, then a LUKS2 volume (`sector`-byte sectors, data
/// offset [`UNSHIFT_S`], one keyslot for `PASS`) holding [`unshift_plaintext`].
fn base_unshift(sector: u32) -> Vec<u8> {
    let disk: Arc<dyn Backend> =
        Arc::new(CrashBackend::new(UNSHIFT_S + UNSHIFT_DEV, 512).expect("disk"));
    let (_, vol) = unshift_devs(&disk);
    let vk: Vec<u8> = (0..64u8).map(|i| i ^ 0x6b).collect();
    format_filled(
        &(vol as Arc<dyn Backend>),
        "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f5",
        (UNSHIFT_S, HDR_SIZE, sector),
        &vk,
        PASS,
        &unshift_plaintext(),
    );
    disk.flush().expect("flush");
    let mut img = vec![0u8; (UNSHIFT_S + UNSHIFT_DEV) as usize];
    disk.read_exact_at(&mut img, 0).expect("image");
    img
}

/// `reencrypt --decrypt --header NEW` of the volume: init (the header exported, the moved
/// segment copied; `moved` is `--hotzone-size`), then every hotzone.
fn unshift_all(disk: Arc<dyn Backend>, moved: Option<u64>) -> Result<()> {
    unshift_all_with(disk, moved, ResilienceKind::Checksum)
}

/// [`unshift_all`] with the moved segment protected by `kind`: `datashift-checksum` or
/// `datashift-journal`.
fn unshift_all_with(
    disk: Arc<dyn Backend>,
    moved: Option<u64>,
    kind: ResilienceKind,
) -> Result<()> {
    let (h, d) = unshift_devs(&disk);
    let devs = Devices {
        header: h.as_ref(),
        data: d.as_ref(),
    };
    init_decrypt_unshift(
        devs,
        PASS,
        &UnshiftOptions {
            kdf: &fast_kdf(),
            key_slot: None,
            moved_bytes: moved,
            resilience: kind,
            resilience_hash: CHECKSUM_HASH,
        },
    )?;
    resume_on(
        devs,
        PASS,
        RunOptions {
            hotzone_bytes: Some(UNSHIFT_PIECE),
            ..Default::default()
        },
        &mut |_| {},
    )
}

/// Where a cut decryption that moves the data was left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unshifted {
    /// No header exported yet: the volume is untouched.
    NoHeader,
    /// The header exported, the reencryption not committed: the volume opens through it.
    Exported,
    /// Recovered (if inside a hotzone) and finished: the plaintext at the start.
    Decrypted,
}

/// After a crash during a decryption that moves the data: what an operator finds and does
/// (repair and resume when the new header is in reencryption). Checks the plaintext in each
/// case; `base` is the disk before the run.
fn finish_unshift(disk: Arc<CrashBackend>, base: &[u8]) -> Result<(Recovery, Unshifted)> {
    let whole: Arc<dyn Backend> = disk.clone();
    let (h, d) = unshift_devs(&whole);
    let want = unshift_plaintext();
    let untouched = || {
        let img = disk.crash_image(0);
        let s = UNSHIFT_S as usize;
        assert!(
            img[s..] == base[s..],
            "no header exported, the volume changed"
        );
        Ok((Recovery::NotNeeded, Unshifted::NoHeader))
    };
    let Ok(hdr) = luks::read_header(h.as_ref()) else {
        return untouched();
    };
    let devs = Devices {
        header: h.as_ref(),
        data: d.as_ref(),
    };
    let mut rec = Recovery::NotNeeded;
    if hdr.unmet_requirements().is_empty() {
        let Header::Luks2(plain) = &hdr else {
            panic!("LUKS1")
        };
        if plain.meta().segments["0"].kind.as_str() == "crypt" {
            // The export, complete (the volume then opens through it) or cut (the volume is
            // then untouched: the export is flushed before the volume is written).
            let mut o = OpenOptions::default();
            o.header = Some(h.clone());
            let Ok(vol) = luks::open(
                d.clone(),
                Unlock::Passphrase(SecretBytes::from_slice(PASS)),
                &o,
            ) else {
                return untouched();
            };
            let mut out = vec![0u8; UNSHIFT_DATA as usize];
            vol.read_at(&mut out, 0)?;
            assert!(out == want, "exported header: the data differs");
            return Ok((Recovery::NotNeeded, Unshifted::Exported));
        }
    } else {
        rec = recover_on(devs, PASS)?;
        if !luks::read_header(h.as_ref())?
            .unmet_requirements()
            .is_empty()
        {
            resume_on(devs, PASS, RunOptions::default(), &mut |_| {})?;
        }
    }
    assert_decrypted_header(&luks::read_header(h.as_ref())?);
    // The old ciphertext of the last shift, past the plaintext, is wiped before the header
    // says done.
    let (tail, base_tail) = (
        disk.crash_image(0)[(UNSHIFT_S + UNSHIFT_DATA) as usize..].to_vec(),
        &base[(UNSHIFT_S + UNSHIFT_DATA) as usize..],
    );
    assert!(
        tail.chunks(4096)
            .zip(base_tail.chunks(4096))
            .all(|(a, b)| a != b),
        "finished with old ciphertext left past the data"
    );
    let mut out = vec![0u8; UNSHIFT_DATA as usize];
    d.read_exact_at(&mut out, 0)?;
    if out != want {
        return Err(Error::InvalidArgument(format!(
            "data differs after recovery ({rec:?}) from byte {}",
            out.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0)
        )));
    }
    Ok((rec, Unshifted::Decrypted))
}

/// The decryption leaves the plaintext at the start of the device (sector sizes 512 and
/// 4096; the moved segment of one shift, cryptsetup's default here, and of 128 KiB), the
/// stale tail wiped, no LUKS header on the device, and the exported header plain.
#[test]
fn unshift_decryption_leaves_the_plaintext() {
    let want = unshift_plaintext();
    for (sector, moved, kind) in [
        (512u32, None, ResilienceKind::Checksum),
        (512, Some(128 << 10), ResilienceKind::Checksum),
        (4096, None, ResilienceKind::Checksum),
        (4096, Some(128 << 10), ResilienceKind::Checksum),
        (512, Some(128 << 10), ResilienceKind::Journal),
        (4096, Some(64 << 10), ResilienceKind::Journal),
    ] {
        {
            let base = base_unshift(sector);
            let disk = Arc::new(CrashBackend::from_image(base.clone(), 512));
            unshift_all_with(disk.clone(), moved, kind).expect("decrypt");
            let img = disk.crash_image(0);
            let v = UNSHIFT_S as usize;
            assert!(
                img[v..v + want.len()] == want[..],
                "{sector} {moved:?}: data"
            );
            let tail = v + want.len();
            assert!(
                img[tail..] != base[tail..],
                "{sector} {moved:?}: old ciphertext left in the tail"
            );
            let whole: Arc<dyn Backend> = disk.clone();
            let (h, d) = unshift_devs(&whole);
            assert!(
                luks::read_header(d.as_ref()).is_err(),
                "a header left on the device"
            );
            assert_decrypted_header(&luks::read_header(h.as_ref()).unwrap());
            assert_eq!(
                finish_unshift(disk, &base).unwrap(),
                (Recovery::NotNeeded, Unshifted::Decrypted)
            );
        }
    }
}

/// What cannot start is refused before anything is written: a moved segment larger than the
/// shift or not a whole number of 4 KiB blocks, no separate header device, a wrong
/// passphrase, a volume already in reencryption.
#[test]
fn unshift_refusals_write_nothing() {
    let base = base_unshift(4096);
    for (moved, what) in [
        (Some(UNSHIFT_S + 4096), "greater than data shift"),
        (Some(6000), "zone alignment"),
    ] {
        let disk = Arc::new(CrashBackend::from_image(base.clone(), 512));
        let e = unshift_all(disk.clone(), moved).unwrap_err().to_string();
        assert!(e.contains(what), "{moved:?}: {e}");
        assert!(disk.crash_image(0) == base, "{moved:?}: written");
    }
    // A journal must hold the whole moved segment (one shift here, more than the area), and
    // `none` protects nothing: cryptsetup's words for both.
    for (kind, what) in [
        (ResilienceKind::Journal, "Moved segment too large"),
        (ResilienceKind::None, "cannot be applied"),
    ] {
        let disk = Arc::new(CrashBackend::from_image(base.clone(), 512));
        let e = unshift_all_with(disk.clone(), None, kind)
            .unwrap_err()
            .to_string();
        assert!(e.contains(what), "{kind:?}: {e}");
        assert!(disk.crash_image(0) == base, "{kind:?}: written");
    }
    let disk: Arc<dyn Backend> = Arc::new(CrashBackend::from_image(base.clone(), 512));
    let (h, d) = unshift_devs(&disk);
    let opts = UnshiftOptions {
        kdf: &fast_kdf(),
        key_slot: None,
        moved_bytes: None,
        resilience: ResilienceKind::Checksum,
        resilience_hash: CHECKSUM_HASH,
    };
    let e = init_decrypt_unshift(Devices::one(d.as_ref()), PASS, &opts).unwrap_err();
    assert!(e.to_string().contains("new file"), "{e}");
    let devs = Devices {
        header: h.as_ref(),
        data: d.as_ref(),
    };
    let e = init_decrypt_unshift(devs, b"wrong", &opts).unwrap_err();
    assert!(
        matches!(e, Error::NoUsableKeyslot | Error::WrongPassphrase),
        "{e}"
    );
    let mut img = vec![0u8; base.len()];
    disk.read_exact_at(&mut img, 0).unwrap();
    assert!(img == base, "written");
    // Started, then asked again (the exported header in front of nothing): the volume has no
    // header left to export.
    init_decrypt_unshift(devs, PASS, &opts).unwrap();
    disk.read_exact_at(&mut img, 0).unwrap();
    assert!(init_decrypt_unshift(devs, PASS, &opts).is_err());
    let mut again = vec![0u8; base.len()];
    disk.read_exact_at(&mut again, 0).unwrap();
    assert!(again == img, "written by a refused init");
}

/// Power cut at every write and flush of a whole decryption that moves the data (init: the
/// export, the wipe of the old header's magic, the moved segment; two hotzones of the walk,
/// each moved in pieces; the moved segment's hotzone, decrypted in place; finalisation), at
/// atomic units of 4 KiB (the checksum block: a torn block of the moved segment's hotzone
/// cannot be told apart, in cryptsetup as here), sector sizes 512 and 4096, the moved segment
/// of one shift and of 128 KiB: before recovery the live segments hold what they say; then
/// the plaintext is at the start of the device after `recover` and `resume`, or (cut before
/// the reencryption was committed) the volume reads the plaintext through the exported
/// header, or (cut before the export) is untouched.
#[test]
fn power_cut_during_unshift_decryption() {
    let mut next = rng();
    let want = unshift_plaintext();
    for (sector, unit, moved, kind) in [
        (512u32, 4096u64, None, ResilienceKind::Checksum),
        (4096, 4096, None, ResilienceKind::Checksum),
        (4096, 4096, Some(128 << 10), ResilienceKind::Checksum),
        // datashift-journal: the moved segment's old ciphertext whole in the area, so a
        // torn 512-byte unit is recovered too.
        (512, 512, Some(128 << 10), ResilienceKind::Journal),
        (4096, 4096, Some(128 << 10), ResilienceKind::Journal),
    ] {
        let base = base_unshift(sector);
        let counter = Arc::new(Cut::new(base.clone(), unit, u64::MAX));
        unshift_all_with(counter.clone(), moved, kind).expect("uncut decryption");
        let total = counter.used.load(Ordering::SeqCst);
        let mut seen = std::collections::BTreeMap::new();
        let mut moved_recovered = 0;
        for budget in 0..=total {
            let cut = Arc::new(Cut::new(base.clone(), unit, budget));
            let r = unshift_all_with(cut.clone(), moved, kind);
            assert_eq!(r.is_ok(), budget == total, "budget {budget} of {total}");
            let seed = next();
            let kept = Arc::new(CrashBackend::from_image(cut.inner.crash_image(seed), unit));
            let what = format!(
                "{kind:?} sector {sector} unit {unit} moved {moved:?}: cut after {budget} of \
                 {total} (crash seed {seed})"
            );
            let whole: Arc<dyn Backend> = kept.clone();
            let (h, d) = unshift_devs(&whole);
            let mut in_order = Vec::with_capacity(want.len());
            in_order.extend_from_slice(&want);
            check_moved_layout(h.as_ref(), d.as_ref(), &in_order, &what);
            let (rec, at) = finish_unshift(kept, &base)
                .unwrap_or_else(|e| panic!("{what}: recovery failed: {e}"));
            if let Recovery::Recovered { offset: 0, .. } = rec {
                moved_recovered += 1;
            }
            *seen
                .entry(format!(
                    "{at:?} {}",
                    matches!(rec, Recovery::Recovered { .. })
                ))
                .or_insert(0) += 1;
        }
        println!(
            "unshift {kind:?} sector {sector} unit {unit} moved {moved:?}: {} cuts: {seen:?}, {moved_recovered} \
             inside the moved segment's hotzone",
            total + 1
        );
        assert!(
            seen.contains_key("NoHeader false"),
            "no cut before the export"
        );
        assert!(
            seen.contains_key("Exported false"),
            "no cut after the export"
        );
        assert!(
            moved_recovered > 0,
            "no cut inside the moved segment's hotzone"
        );
        assert!(
            seen.get("Decrypted true").copied().unwrap_or(0) > moved_recovered,
            "no cut inside a hotzone of the walk"
        );
    }
}

/// A resume that switches resilience (`--resume-only --resilience`, as cryptsetup 2.6): a
/// rotation started with one resilience, cut at every write and flush of the resume that
/// switches it (the header commit of the switch, then the hotzones). After each cut the
/// header names the old resilience or the new one, recovery and a resume (without a switch)
/// finish, and every byte reads back.
#[test]
fn power_cut_around_a_resilience_switch() {
    let mut next = rng();
    let want = plaintext();
    let unit = 4096;
    for (from, to, to_name) in [
        (
            ResilienceKind::Checksum,
            ResilienceAsked::InPlace(ResilienceKind::Journal, CHECKSUM_HASH),
            "journal",
        ),
        (
            ResilienceKind::Journal,
            ResilienceAsked::InPlace(ResilienceKind::Checksum, HashAlg::Sha512),
            "checksum",
        ),
        (
            ResilienceKind::None,
            ResilienceAsked::InPlace(ResilienceKind::Checksum, CHECKSUM_HASH),
            "checksum",
        ),
    ] {
        let started = CrashBackend::from_image(base(4096), unit);
        let opts = InitOptions {
            resilience: from,
            kdf: &fast_kdf(),
            key_slot: None,
            change: SegmentChange::default(),
            mode: Mode::Reencrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        };
        init(&started, PASS, &opts).expect("init");
        let img = started.crash_image(0);
        let run = |dev: &dyn Backend| {
            let opts = RunOptions {
                hotzone_bytes: Some(HOTZONE_BYTES),
                resilience: Some(to),
                device_size: None,
            };
            resume(dev, PASS, opts, &mut |_| {})
        };
        let counter = Cut {
            inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
            budget: u64::MAX,
            used: AtomicU64::new(0),
        };
        run(&counter).expect("uncut resume");
        let total = counter.used.load(Ordering::SeqCst);
        let mut seen_new = 0;
        for budget in 0..=total {
            let cut = Cut {
                inner: Arc::new(CrashBackend::from_image(img.clone(), unit)),
                budget,
                used: AtomicU64::new(0),
            };
            assert_eq!(run(&cut).is_ok(), budget == total, "budget {budget}");
            let s = next();
            let dev = CrashBackend::from_image(cut.inner.crash_image(s), unit);
            let what = format!("{from:?} to {to_name}: cut after {budget} of {total} (seed {s})");
            if let Header::Luks2(h) = luks::read_header(&dev).expect("header") {
                if let Some(st) = ReencryptState::from_metadata(h.meta()).expect("state") {
                    let name = st.keyslot.resilience.name();
                    let from_name = format!("{from:?}").to_lowercase();
                    assert!(name == to_name || name == from_name, "{what}: {name}");
                    seen_new += usize::from(name == to_name);
                }
            }
            finish(&dev).unwrap_or_else(|e| panic!("{what}: recovery failed: {e}"));
            let got = contents(dev.crash_image(0)).expect("finished volume opens");
            assert!(got == want, "{what}: data differs");
        }
        assert!(seen_new > 0, "{from:?} to {to_name}: never switched");
        println!(
            "{from:?} to {to_name}: {} cuts, {seen_new} left it switched",
            total + 1
        );
    }
}

/// A decryption that moves the data back, started with one protection of its moved segment
/// and resumed with the other (`--resume-only --resilience journal|checksum`, which
/// cryptsetup's command line maps to `datashift-journal` and `datashift-checksum`): cut at
/// every write and flush of the switching resume; the header names the old or the new type,
/// and recovery and a resume finish with the plaintext at the start of the device.
#[test]
fn power_cut_around_an_unshift_resilience_switch() {
    let mut next = rng();
    let unit = 4096;
    let moved = Some(128 << 10);
    for (from, to, to_name) in [
        (
            ResilienceKind::Checksum,
            ResilienceAsked::InPlace(ResilienceKind::Journal, CHECKSUM_HASH),
            "datashift-journal",
        ),
        (
            ResilienceKind::Journal,
            ResilienceAsked::DatashiftChecksum(HashAlg::Sha512),
            "datashift-checksum",
        ),
    ] {
        let base = base_unshift(4096);
        let started = Arc::new(CrashBackend::from_image(base.clone(), unit));
        {
            let whole: Arc<dyn Backend> = started.clone();
            let (h, d) = unshift_devs(&whole);
            let opts = UnshiftOptions {
                kdf: &fast_kdf(),
                key_slot: None,
                moved_bytes: moved,
                resilience: from,
                resilience_hash: CHECKSUM_HASH,
            };
            let devs = Devices {
                header: h.as_ref(),
                data: d.as_ref(),
            };
            init_decrypt_unshift(devs, PASS, &opts).expect("init");
        }
        let img = started.crash_image(0);
        let run = |disk: Arc<dyn Backend>| {
            let (h, d) = unshift_devs(&disk);
            let devs = Devices {
                header: h.as_ref(),
                data: d.as_ref(),
            };
            let opts = RunOptions {
                hotzone_bytes: Some(UNSHIFT_PIECE),
                resilience: Some(to),
                device_size: None,
            };
            resume_on(devs, PASS, opts, &mut |_| {})
        };
        let counter = Arc::new(Cut::new(img.clone(), unit, u64::MAX));
        run(counter.clone()).expect("uncut resume");
        let total = counter.used.load(Ordering::SeqCst);
        let mut seen_new = 0;
        for budget in 0..=total {
            let cut = Arc::new(Cut::new(img.clone(), unit, budget));
            assert_eq!(run(cut.clone()).is_ok(), budget == total, "budget {budget}");
            let s = next();
            let kept = Arc::new(CrashBackend::from_image(cut.inner.crash_image(s), unit));
            let what = format!("{from:?} to {to_name}: cut after {budget} of {total} (seed {s})");
            let whole: Arc<dyn Backend> = kept.clone();
            let (h, _) = unshift_devs(&whole);
            if let Header::Luks2(hdr) = luks::read_header(h.as_ref()).expect("header") {
                if let Some(st) = ReencryptState::from_metadata(hdr.meta()).expect("state") {
                    let name = st.keyslot.resilience.name();
                    seen_new += usize::from(name == to_name);
                    assert!(name.starts_with("datashift-"), "{what}: {name}");
                }
            }
            finish_unshift(kept, &base).unwrap_or_else(|e| panic!("{what}: recovery failed: {e}"));
        }
        assert!(seen_new > 0, "{from:?} to {to_name}: never switched");
        println!(
            "unshift {from:?} to {to_name}: {} cuts, {seen_new} left it switched",
            total + 1
        );
    }
}

/// Counts the writes under way at once over a memory device, and says its writes serialize
/// (as a buffered file's do) or not.
struct CountingWrites {
    inner: ucrypt::backend::MemBackend,
    serializes: bool,
    now: std::sync::atomic::AtomicU32,
    most: std::sync::atomic::AtomicU32,
}

impl Backend for CountingWrites {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        // A write that takes a while, as a copy into the page cache does: lanes that write at
        // once overlap here.
        std::thread::sleep(std::time::Duration::from_micros(300));
        let r = self.inner.write_at(buf, offset);
        self.now.fetch_sub(1, Ordering::SeqCst);
        r
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_bytes(&self) -> u32 {
        self.inner.logical_block_bytes()
    }
    fn describe(&self) -> String {
        "memory counting its writes under way".into()
    }
    fn serializes_writes(&self) -> bool {
        self.serializes
    }
}

/// On a backend whose writes serialize, the rotation's lanes write one at a time
/// (`ucrypt::sync::TakeTurns`), and the data survives; on one whose writes may run side by
/// side they write at once (which shows the count above sees lanes overlap).
#[test]
fn lanes_write_in_turns_where_the_backend_serializes_writes() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        println!("SKIPPED: one CPU, so a rotation has one lane and nothing to take turns at");
        return;
    }
    const OFFSET: u64 = 4 << 20;
    const BYTES: u64 = 4 << 20;
    let plain: Vec<u8> = (0..BYTES)
        .map(|i| (i.wrapping_mul(2654435761) >> 9) as u8)
        .collect();
    let run = |serializes: bool, kind: ResilienceKind| -> u32 {
        let dev = Arc::new(CountingWrites {
            inner: ucrypt::backend::MemBackend::new(OFFSET + BYTES),
            serializes,
            now: Default::default(),
            most: Default::default(),
        });
        let as_dyn: Arc<dyn Backend> = dev.clone();
        let vk: Vec<u8> = (0..64u8).collect();
        let uuid = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f1";
        format_filled(&as_dyn, uuid, (OFFSET, HDR_SIZE, 4096), &vk, PASS, &plain);
        dev.most.store(0, Ordering::SeqCst);
        let opts = InitOptions {
            resilience: kind,
            kdf: &fast_kdf(),
            key_slot: None,
            change: SegmentChange::default(),
            mode: Mode::Reencrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        };
        init(dev.as_ref(), PASS, &opts).unwrap();
        let run = RunOptions {
            hotzone_bytes: Some(2 << 20),
            ..Default::default()
        };
        resume(dev.as_ref(), PASS, run, &mut |_| {}).unwrap();
        let vol = luks::open(
            as_dyn,
            Unlock::Passphrase(SecretBytes::from_slice(PASS)),
            &OpenOptions::default(),
        )
        .unwrap();
        let mut out = vec![0u8; BYTES as usize];
        vol.read_at(&mut out, 0).unwrap();
        assert!(out == plain, "{kind:?}: the data changed");
        dev.most.load(Ordering::SeqCst)
    };
    for kind in [ResilienceKind::None, ResilienceKind::Journal] {
        let most = run(true, kind);
        assert_eq!(
            most, 1,
            "{kind:?}: lanes wrote at once to a backend that serializes"
        );
        // Side by side: the lanes overlap (the crew's second lane may start late on a busy
        // host, so a few tries).
        let overlapped = (0..5).any(|_| run(false, kind) > 1);
        assert!(
            overlapped,
            "{kind:?}: the lanes never wrote at once; the count shows nothing"
        );
    }
}
