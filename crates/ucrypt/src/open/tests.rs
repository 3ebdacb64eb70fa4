//! Each kind of volume opened through [`open`] from memory, made by [`crate::format::plan`]
//! (and, for reencryption, `reencrypt::run::init`): what it serves, what it counts, and what
//! it refuses.

use std::sync::{Arc, Mutex};

use super::*;
use crate::backend::MemBackend;
use crate::format::{self, FormatRequest, Integrity, IntegrityKind, IntegrityWipe, LuksVersion};
use crate::luks::reencrypt::run::{
    init, InitOptions, KeyslotKdf, ResilienceKind, SegmentChange, CHECKSUM_HASH,
};
use crate::luks::reencrypt::Mode;
use crate::luks::{HashAlg, KdfRequest};
use crate::sector::SectorSize;

const PASS: &[u8] = b"open sesame";
const DEVICE_BYTES: u64 = 8 << 20;
/// Two 16 KiB header copies and keyslots: 1 MiB of LUKS2 metadata.
const LUKS2_KEYSLOTS_BYTES: u64 = (1 << 20) - 2 * 0x4000;

/// PBKDF2 with few iterations: the tests are about opening, not about the KDF.
pub(crate) fn fast_kdf() -> KdfRequest {
    KdfRequest {
        kind: "pbkdf2".into(),
        hash: HashAlg::Sha256,
        iter_time_ms: 1,
        memory_kib: 32,
        parallel: 1,
        force_iterations: Some(1000),
    }
}

/// A format request for a memory device of [`DEVICE_BYTES`] with small metadata.
pub(crate) fn request(version: LuksVersion) -> FormatRequest {
    let mut req = FormatRequest::new(version, "memory");
    req.data_bytes = DEVICE_BYTES;
    req.kdf = fast_kdf();
    req.luks2_keyslots_bytes = Some(LUKS2_KEYSLOTS_BYTES);
    req
}

/// Formats `dev` as `req` says (an authenticated volume wiped), with [`PASS`] in keyslot 0.
pub(crate) fn format_on(dev: &Arc<dyn Backend>, req: &FormatRequest) -> format::FormatPlan {
    let key = luks::random_secret(req.check().expect("check")).expect("key");
    let plan = format::plan(req, PASS, key).expect("plan");
    format::write_header(dev.as_ref(), &plan).expect("header");
    if plan.integrity.is_some() {
        format::write_integrity(dev.clone(), &plan, IntegrityWipe::Zeroes, &mut |_, _| {})
            .expect("integrity");
    }
    plan
}

fn mem() -> Arc<dyn Backend> {
    Arc::new(MemBackend::new(DEVICE_BYTES))
}

fn luks_request(dev: &Arc<dyn Backend>, unlock: Unlock) -> OpenRequest {
    OpenRequest::new(dev.clone(), Format::Luks(Luks::new(unlock)))
}

fn passphrase() -> Unlock {
    Unlock::Passphrase(SecretBytes::from_slice(PASS))
}

/// Writes a pattern at `offset` and reads it back.
fn round_trip(vol: &Opened, offset: u64) {
    let dev = vol.dev();
    let data: Vec<u8> = (0..8192u32)
        .map(|i| (i * 7 + offset as u32) as u8)
        .collect();
    dev.write_at(&data, offset).expect("write");
    dev.flush().expect("flush");
    let mut back = vec![0u8; data.len()];
    dev.read_at(&mut back, offset).expect("read");
    assert_eq!(back, data);
}

#[test]
fn a_raw_mapping_opens_and_refuses_a_suspend() {
    let dev = mem();
    let key = SecretBytes::from_slice(&[7u8; 64]);
    let geometry = Geometry {
        sector_size: SectorSize::S4096,
        iv_offset: 0,
        iv_large_sectors: false,
    };
    let mut plain = Plain::new(CipherSpec::AES_XTS_PLAIN64, key, geometry);
    plain.data_offset_bytes = 1 << 20;
    let vol = open(OpenRequest::new(dev.clone(), Format::Plain(plain))).expect("open");
    assert_eq!(vol.kind(), VolumeKind::Plain);
    assert_eq!(vol.dev().size(), DEVICE_BYTES - (1 << 20));
    round_trip(&vol, 4096);
    let s = vol.stats();
    assert_eq!((s.read.requests, s.write.requests), (1, 1));
    assert_eq!((s.read.bytes, s.write.bytes), (8192, 8192));
    assert!(vol.engine().is_some());
    assert_eq!(vol.integrity_mismatches(), None);
    // The ciphertext is not the plaintext.
    let mut raw = vec![0u8; 8192];
    dev.read_at(&mut raw, (1 << 20) + 4096).expect("raw");
    assert_ne!(
        raw[..16],
        (0..16u32).map(|i| (i * 7 + 4096) as u8).collect::<Vec<_>>()[..]
    );
    assert!(matches!(
        vol.suspend(),
        Err(Error::Refused(Refusal::SuspendWithoutHeader))
    ));
    assert!(!vol.is_suspended());
}

#[test]
fn luks1_and_luks2_open_with_a_passphrase_or_the_volume_key() {
    for (version, kind) in [
        (LuksVersion::Luks1, VolumeKind::Luks1),
        (LuksVersion::Luks2, VolumeKind::Luks2),
    ] {
        let dev = mem();
        let plan = format_on(&dev, &request(version));
        let vol = open(luks_request(&dev, passphrase())).expect("open");
        assert_eq!(vol.kind(), kind, "{version:?}");
        round_trip(&vol, 0);
        drop(vol);
        // The volume key itself opens it, and reads what the passphrase's volume wrote.
        let vk = SecretBytes::from_slice(plan.volume_key.bytes());
        let vol = open(luks_request(&dev, Unlock::VolumeKey(vk))).expect("open by key");
        let mut first = [0u8; 4];
        vol.dev().read_at(&mut first, 0).expect("read");
        assert_eq!(first, [0, 7, 14, 21]);
        drop(vol);
        // A wrong key is named as such, a wrong passphrase as that.
        let wrong = SecretBytes::from_slice(&vec![1u8; plan.volume_key.len()]);
        let e = open(luks_request(&dev, Unlock::VolumeKey(wrong))).expect_err("wrong key");
        assert!(matches!(e, Error::VolumeKeyMismatch), "{version:?}: {e}");
        let wrong = Unlock::Passphrase(SecretBytes::from_slice(b"not it"));
        let e = open(luks_request(&dev, wrong)).expect_err("wrong passphrase");
        assert!(matches!(e, Error::WrongPassphrase), "{version:?}: {e}");
    }
}

#[test]
fn a_luks2_volume_suspends_and_resumes_with_a_key_checked_against_its_header() {
    let dev = mem();
    format_on(&dev, &request(LuksVersion::Luks2));
    let mut req = luks_request(&dev, passphrase());
    req.policy = crate::engine::Policy::Parallel.into();
    let vol = open(req).expect("open");
    assert_eq!(vol.policy().to_string(), "parallel");
    vol.set_policy(crate::engine::Policy::Inline);
    assert_eq!(vol.policy().to_string(), "inline");
    round_trip(&vol, 1 << 20);
    vol.suspend().expect("suspend");
    assert!(vol.is_suspended());
    let hdr = luks::read_header(dev.as_ref()).expect("header");
    let (_, vk) = luks::unlock_key(dev.as_ref(), &hdr, passphrase(), None).expect("unlock");
    vol.resume(&hdr, &vk).expect("resume");
    assert!(!vol.is_suspended());
    round_trip(&vol, 2 << 20);
    assert_eq!(vol.check_resize().ok(), Some(()));
    assert_eq!(vol.resize(None).expect("resize"), vol.dev().size());
}

#[test]
fn a_detached_header_is_read_from_its_own_device() {
    let hdr_dev: Arc<dyn Backend> = Arc::new(MemBackend::new(2 << 20));
    let data = mem();
    let mut req = request(LuksVersion::Luks2);
    req.detached = true;
    let key = luks::random_secret(req.check().expect("check")).expect("key");
    let plan = format::plan(&req, PASS, key).expect("plan");
    assert!(plan.header_end_bytes() <= 2 << 20);
    format::write_header(hdr_dev.as_ref(), &plan).expect("header");
    let mut l = Luks::new(passphrase());
    l.header_dev = Some(hdr_dev.clone());
    let vol = open(OpenRequest::new(data.clone(), Format::Luks(l))).expect("open");
    // Data offset 0: the whole data device is the volume.
    assert_eq!(vol.dev().size(), DEVICE_BYTES);
    round_trip(&vol, 0);
    // Without the header the data device is not LUKS.
    let e = open(luks_request(&data, passphrase())).expect_err("no header");
    assert!(matches!(e, Error::NotLuks(_)), "{e}");
}

#[test]
fn an_authenticated_volume_counts_reports_and_refuses_a_resize() {
    let dev = mem();
    let mut req = request(LuksVersion::Luks2);
    req.integrity = Some(Integrity {
        kind: IntegrityKind::Aead,
        encryption: "aes-gcm-random".into(),
        legacy_padding: false,
        mac_key_bits: None,
    });
    let plan = format_on(&dev, &req);
    let ip = plan.integrity.as_ref().expect("integrity plan");
    let failed = Arc::new(Mutex::new(Vec::new()));
    let seen = failed.clone();
    let mut req = luks_request(&dev, passphrase());
    req.on_integrity_error = Some(Arc::new(move |sector| seen.lock().unwrap().push(sector)));
    let vol = open(req).expect("open");
    assert_eq!(vol.kind(), VolumeKind::Luks2Authenticated);
    assert!(vol.engine().is_none());
    assert_eq!(vol.integrity_mismatches(), Some(0));
    // The wipe made every block readable.
    let mut zeroes = vec![1u8; 4096];
    vol.dev().read_at(&mut zeroes, 4096).expect("wiped block");
    assert!(zeroes.iter().all(|&b| b == 0));
    round_trip(&vol, 8192);
    assert!(matches!(
        vol.resize(None),
        Err(Error::Refused(Refusal::ResizeAuthenticated))
    ));
    assert!(matches!(
        vol.check_resize(),
        Err(Error::Refused(Refusal::ResizeAuthenticated))
    ));

    // Suspended, it holds nothing; resumed from the header, it serves the same data.
    vol.suspend().expect("suspend");
    assert!(vol.is_suspended());
    let hdr = luks::read_header(dev.as_ref()).expect("header");
    let (_, vk) = luks::unlock_key(dev.as_ref(), &hdr, passphrase(), None).expect("unlock");
    vol.resume(&hdr, &vk).expect("resume");
    let mut back = vec![0u8; 4];
    vol.dev()
        .read_at(&mut back, 8192)
        .expect("read after resume");
    assert_eq!(back, [0, 7, 14, 21]);

    // One ciphertext byte of data sector 16 changed: the read fails, the hook hears of it,
    // the counters count it.
    let at = ip.start_bytes + ip.layout.data_sector(16).expect("sector") * 512 + 100;
    let mut b = [0u8; 1];
    dev.read_at(&mut b, at).expect("raw read");
    b[0] ^= 1;
    dev.write_at(&b, at).expect("raw write");
    let mut block = vec![0u8; 4096];
    let e = vol.dev().read_at(&mut block, 8192).expect_err("tampered");
    assert!(matches!(e, Error::Integrity { .. }), "{e}");
    assert_eq!(failed.lock().unwrap().len(), 1);
    assert_eq!(vol.integrity_mismatches(), Some(1));
    let s = vol.stats();
    assert_eq!(s.read.errors_of(ErrorKind::BadData), 1);
    assert_eq!(s.write.requests, 1);
    assert_eq!(s.write.bytes, 8192);
}

#[test]
fn a_volume_in_reencryption_opens_as_two_segments() {
    let dev = mem();
    format_on(&dev, &request(LuksVersion::Luks2));
    let vol = open(luks_request(&dev, passphrase())).expect("open");
    round_trip(&vol, 0);
    drop(vol);
    init(
        dev.as_ref(),
        PASS,
        &InitOptions {
            resilience: ResilienceKind::Checksum,
            kdf: &fast_kdf(),
            key_slot: None,
            change: SegmentChange::default(),
            mode: Mode::Reencrypt,
            keyslot_kdf: KeyslotKdf::Given,
            resilience_hash: CHECKSUM_HASH,
            shift_bytes: None,
        },
    )
    .expect("init");
    let vol = open(luks_request(&dev, passphrase())).expect("open in reencryption");
    assert_eq!(vol.kind(), VolumeKind::Luks2Reencrypting);
    let mut first = [0u8; 4];
    vol.dev().read_at(&mut first, 0).expect("read");
    assert_eq!(first, [0, 7, 14, 21]);
    drop(vol);
    // Both keys are needed: the volume key alone is refused.
    let hdr = luks::read_header(dev.as_ref()).expect("header");
    assert!(hdr.in_reencryption());
    let e = open(luks_request(
        &dev,
        Unlock::VolumeKey(SecretBytes::from_slice(&[0u8; 64])),
    ))
    .expect_err("a volume key");
    assert!(matches!(e, Error::UnsupportedLuks(_)), "{e}");
}

/// The refusal's words are the ones `ucrypt resize` has always printed.
#[test]
fn the_resize_refusal_reads_as_before() {
    assert_eq!(
        Error::Refused(Refusal::ResizeAuthenticated).to_string(),
        "resize: the volume has authenticated encryption (integrity): its size is the data \
         area recorded in its dm-integrity superblock, which ucrypt does not grow or shrink \
         (the tags of a new area would have to be written first)"
    );
}
