//! The format plan's decisions, each as cryptsetup makes it, and plans that open again.

use std::sync::Arc;

use super::*;
use crate::backend::{Backend, MemBackend};
use crate::luks::Unlock;
use crate::open::tests::request;
use crate::open::{open, Format, Luks, OpenRequest, VolumeKind};

const PASS: &[u8] = b"format me";
const MIB: u64 = 1 << 20;

fn planned(req: &FormatRequest) -> Result<FormatPlan> {
    let key = luks::random_secret(req.check()?)?;
    plan(req, PASS, key)
}

fn data_layout(p: &FormatPlan) -> luks::DataLayout {
    p.header.data_layout().expect("layout")
}

#[test]
fn cryptsetup_picks_4096_byte_sectors_when_the_data_area_allows() {
    let p = planned(&request(LuksVersion::Luks2)).expect("plan");
    assert_eq!(data_layout(&p).sector_size, SectorSize::S4096);
    assert_eq!(data_layout(&p).offset_bytes, MIB);
    // A device whose size is not whole 4 KiB: 512-byte sectors.
    let mut req = request(LuksVersion::Luks2);
    req.data_bytes += 512;
    let p = planned(&req).expect("plan");
    assert_eq!(data_layout(&p).sector_size, SectorSize::S512);
    // Asked for, it is what it was asked.
    let mut req = request(LuksVersion::Luks2);
    req.sector_size = Some(SectorSize::new(1024).unwrap());
    let p = planned(&req).expect("plan");
    assert_eq!(data_layout(&p).sector_size.bytes(), 1024);
    // LUKS1 has 512 only.
    let mut req = request(LuksVersion::Luks1);
    req.sector_size = Some(SectorSize::S4096);
    let e = planned(&req).err().expect("LUKS1 4096");
    assert!(
        e.to_string()
            .contains("LUKS1 supports only 512-byte sectors"),
        "{e}"
    );
}

#[test]
fn data_offsets_are_aligned_as_cryptsetup_and_librbd_align_them() {
    let mut req = request(LuksVersion::Luks2);
    assert_eq!(
        req.alignment().unwrap(),
        Alignment {
            bytes: DEFAULT_ALIGN_BYTES,
            by_object: false
        }
    );
    // An RBD image's object size (4 MiB): the data offset follows it.
    req.object_bytes = Some(4 * MIB);
    assert_eq!(
        req.alignment().unwrap(),
        Alignment {
            bytes: 4 * MIB,
            by_object: true
        }
    );
    assert_eq!(data_layout(&planned(&req).unwrap()).offset_bytes, 4 * MIB);
    // --align-payload wins over the object size.
    req.align_payload_sectors = Some(4096);
    assert_eq!(req.alignment().unwrap().bytes, 2 * MIB);
    assert_eq!(data_layout(&planned(&req).unwrap()).offset_bytes, 2 * MIB);
    // --offset is the offset.
    let mut req = request(LuksVersion::Luks2);
    req.offset_sectors = Some(3 * 2048);
    assert_eq!(data_layout(&planned(&req).unwrap()).offset_bytes, 3 * MIB);
    // With a detached header --align-payload is the offset itself.
    let mut req = request(LuksVersion::Luks2);
    req.detached = true;
    req.align_payload_sectors = Some(2 * 2048);
    assert_eq!(data_layout(&planned(&req).unwrap()).offset_bytes, 2 * MIB);
    // (one inside the metadata's size is refused by the header's validation, as cryptsetup's)
    req.align_payload_sectors = Some(8);
    assert!(planned(&req).is_err());
    req.align_payload_sectors = None;
    assert_eq!(data_layout(&planned(&req).unwrap()).offset_bytes, 0);
    // LUKS1: the keyslots end, aligned to 1 MiB.
    let p = planned(&request(LuksVersion::Luks1)).unwrap();
    assert_eq!(data_layout(&p).offset_bytes, 2 * MIB);
}

#[test]
fn requests_that_cannot_be_made_are_refused_before_anything_is_written() {
    let mut req = request(LuksVersion::Luks2);
    req.data_bytes = MIB;
    let e = planned(&req).err().expect("too small");
    assert_eq!(
        e.to_string(),
        "invalid argument: Device memory is too small. (LUKS2 requires at least 1052672 bytes.)"
    );
    let mut req = request(LuksVersion::Luks2);
    req.offset_sectors = Some(8);
    assert!(planned(&req)
        .err()
        .expect("offset in metadata")
        .to_string()
        .contains("inside the LUKS2 metadata"));
    let mut req = request(LuksVersion::Luks2);
    req.key_bits = Some(511);
    assert!(req.check().is_err());
    req.key_bits = Some(200);
    assert!(req.check().is_err());
    let mut req = request(LuksVersion::Luks2);
    req.uuid = Some("not-a-uuid".into());
    assert!(req.check().is_err());
    let mut req = request(LuksVersion::Luks1);
    req.integrity = Some(Integrity {
        kind: IntegrityKind::Aead,
        encryption: "aes-gcm-random".into(),
        legacy_padding: false,
        mac_key_bits: None,
    });
    assert!(req.check().is_err());
    // A key of the wrong length for the request.
    let req = request(LuksVersion::Luks2);
    assert!(plan(&req, PASS, SecretBytes::zeroed(32)).is_err());
}

#[test]
fn integrity_keys_are_the_ciphers_then_the_macs() {
    let hmac = Integrity {
        kind: IntegrityKind::from_name("hmac-sha256").unwrap(),
        encryption: "aes-xts-random".into(),
        legacy_padding: false,
        mac_key_bits: None,
    };
    assert_eq!(hmac.kind, IntegrityKind::HmacSha256);
    assert_eq!(hmac.kind.luks2_name(), "hmac(sha256)");
    assert_eq!(hmac.key_bytes(None).unwrap(), 64 + 32);
    // AES-128-XTS or AES-256-XTS.
    assert_eq!(hmac.key_bytes(Some(256)).unwrap(), 32 + 32);
    assert!(hmac.key_bytes(Some(384)).is_err());
    assert!(hmac.key_bytes(Some(255)).is_err());
    let gcm = Integrity {
        kind: IntegrityKind::Aead,
        encryption: "aes-gcm-random".into(),
        legacy_padding: false,
        mac_key_bits: None,
    };
    assert_eq!(gcm.key_bytes(None).unwrap(), 32);
    assert_eq!(
        IntegrityKind::from_name("hmac(sha512)"),
        Some(IntegrityKind::HmacSha512)
    );
    assert_eq!(IntegrityKind::from_name("crc32"), None);
}

#[test]
fn the_uuid_label_and_subsystem_are_written() {
    let mut req = request(LuksVersion::Luks2);
    req.uuid = Some("0F1E2D3C-4B5A-4978-8695-A4B3C2D1E0F0".into());
    req.label = Some("disk".into());
    req.subsystem = Some("tests".into());
    req.key_slot = Some(3);
    let dev: Arc<dyn Backend> = Arc::new(MemBackend::new(req.data_bytes));
    let p = planned(&req).unwrap();
    assert_eq!(p.keyslot, 3);
    write_header(dev.as_ref(), &p).unwrap();
    let hdr = luks::read_header(dev.as_ref()).unwrap();
    assert_eq!(hdr.uuid(), "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0");
    let Header::Luks2(h) = &hdr else {
        panic!("LUKS2 expected")
    };
    assert_eq!(h.bin().label, "disk");
    assert_eq!(h.bin().subsystem, "tests");
    assert_eq!(hdr.active_keyslots(), vec![3]);
}

#[test]
fn an_authenticated_volume_not_wiped_fails_authentication_until_written() {
    let mut req = request(LuksVersion::Luks2);
    req.integrity = Some(Integrity {
        kind: IntegrityKind::HmacSha256,
        encryption: "aes-xts-random".into(),
        legacy_padding: false,
        mac_key_bits: None,
    });
    let dev: Arc<dyn Backend> = Arc::new(MemBackend::new(req.data_bytes));
    let p = planned(&req).unwrap();
    let ip = p.integrity.as_ref().expect("integrity plan");
    assert_eq!(ip.start_bytes, MIB);
    write_header(dev.as_ref(), &p).unwrap();
    let mut calls = 0;
    let total =
        write_integrity(dev.clone(), &p, IntegrityWipe::Skip, &mut |_, _| calls += 1).unwrap();
    assert_eq!(calls, 0);
    assert_eq!(total, ip.layout.sb.provided_data_sectors * 512);
    let unlock = Unlock::Passphrase(SecretBytes::from_slice(PASS));
    let vol = open(OpenRequest::new(
        dev.clone(),
        Format::Luks(Luks::new(unlock)),
    ))
    .unwrap();
    assert_eq!(vol.kind(), VolumeKind::Luks2Authenticated);
    assert_eq!(vol.dev().size(), total);
    let mut b = vec![0u8; 4096];
    assert!(matches!(
        vol.dev().read_at(&mut b, 0),
        Err(Error::Integrity { .. })
    ));
    vol.dev().write_at(&[5u8; 4096], 0).unwrap();
    vol.dev().read_at(&mut b, 0).unwrap();
    assert_eq!(b, vec![5u8; 4096]);
    drop(vol);
    // Wiped, progress is told from 0 to the end.
    let mut seen = Vec::new();
    let p = planned(&req).unwrap();
    write_header(dev.as_ref(), &p).unwrap();
    write_integrity(dev.clone(), &p, IntegrityWipe::Zeroes, &mut |d, t| {
        seen.push((d, t))
    })
    .unwrap();
    assert_eq!(seen.first(), Some(&(0, total)));
    assert_eq!(seen.last(), Some(&(total, total)));
    // A plan without an integrity part has nothing to write there.
    let plain = planned(&request(LuksVersion::Luks2)).unwrap();
    assert!(write_integrity(dev, &plain, IntegrityWipe::Zeroes, &mut |_, _| {}).is_err());
}

/// cryptsetup 2.8's `--integrity-key-size`: the MAC key's size follows the cipher's key in the
/// volume key, is written to the segment in bytes (only when asked for), and the volume opens
/// and authenticates with it; refused as cryptsetup refuses it.
#[test]
fn an_integrity_key_size_is_recorded_and_used() {
    let integrity = |kind, bits| Integrity {
        kind,
        encryption: "aes-xts-plain64".into(),
        legacy_padding: false,
        mac_key_bits: bits,
    };
    let i = integrity(IntegrityKind::HmacSha256, Some(264));
    assert_eq!(i.key_bytes(Some(512)).unwrap(), 64 + 33);
    assert_eq!(i.key_bytes(None).unwrap(), 64 + 33);
    for (kind, bits, why) in [
        (IntegrityKind::HmacSha256, Some(120), "too small"),
        (IntegrityKind::HmacSha256, Some(260), "multiple of 8"),
        (IntegrityKind::HmacSha256, Some(0), "multiple of 8"),
    ] {
        let e = integrity(kind, bits)
            .key_bytes(None)
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{bits:?}: {e}");
    }
    let aead = Integrity {
        encryption: "aes-gcm-random".into(),
        ..integrity(IntegrityKind::Aead, Some(256))
    };
    let e = aead.key_bytes(None).unwrap_err().to_string();
    assert!(
        e.contains("Cannot use specified integrity key size."),
        "{e}"
    );
    // 128 bits is the smallest taken.
    assert_eq!(
        integrity(IntegrityKind::HmacSha512, Some(128))
            .key_bytes(Some(256))
            .unwrap(),
        32 + 16
    );

    let mut req = request(LuksVersion::Luks2);
    req.integrity = Some(i);
    req.key_bits = Some(512);
    let dev: Arc<dyn Backend> = Arc::new(MemBackend::new(req.data_bytes));
    let p = planned(&req).unwrap();
    let Header::Luks2(h) = &p.header else {
        panic!("LUKS2 expected")
    };
    let json = serde_json::to_string(h.meta()).unwrap();
    assert!(
        json.contains(r#""journal_integrity":"none","key_size":33}"#),
        "{json}"
    );
    write_header(dev.as_ref(), &p).unwrap();
    write_integrity(dev.clone(), &p, IntegrityWipe::Zeroes, &mut |_, _| {}).unwrap();
    let vol = open(OpenRequest::new(
        dev.clone(),
        Format::Luks(Luks::new(Unlock::Passphrase(SecretBytes::from_slice(PASS)))),
    ))
    .unwrap();
    assert_eq!(vol.kind(), VolumeKind::Luks2Authenticated);
    vol.dev().write_at(&[7u8; 4096], 8192).unwrap();
    let mut b = vec![0u8; 4096];
    vol.dev().read_at(&mut b, 8192).unwrap();
    assert_eq!(b, vec![7u8; 4096]);
    // Without --integrity-key-size nothing is recorded, as cryptsetup writes it.
    let mut req2 = req.clone();
    if let Some(i) = &mut req2.integrity {
        i.mac_key_bits = None;
    }
    let p = planned(&req2).unwrap();
    let Header::Luks2(h) = &p.header else {
        panic!("LUKS2 expected")
    };
    let integ = h.meta().segments.get("0").and_then(|s| s.integrity.clone());
    assert_eq!(integ.map(|i| i.key_size), Some(None));
}
