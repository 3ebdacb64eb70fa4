//! Conversion plans on in-memory images: round trips, every crash point, every refusal.

use super::*;
use crate::luks::luks2::{format, FormatLuks2};
use crate::luks::tests::fast_kdf;
use crate::luks::{apply_to_image, parse_any, unlock, HashAlg, NewKeyslot};
use crate::sector::{CipherSpec, SectorSize};
use crate::SecretBytes;

const MIB: u64 = 1 << 20;
const UUID: &str = "11111111-2222-4333-8444-555555555555";

fn reader(img: &[u8]) -> impl FnMut(u64, u64) -> Result<Vec<u8>> + '_ {
    move |off, len| {
        img.get(off as usize..(off + len) as usize)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| Error::BadHeader {
                check: "truncated",
                detail: "read beyond the image".into(),
            })
    }
}

/// The LUKS version whose header opens with `pass` and yields `vk`, if any does.
fn opens(img: &[u8], pass: &[u8], vk: &[u8]) -> Option<u32> {
    let hdr = parse_any(img).ok()?;
    let (_, got) = unlock(&hdr, pass, None, &mut reader(img)).ok()?;
    (got.bytes() == vk).then(|| hdr.version())
}

fn file(img: &[u8]) -> MetadataDevice {
    MetadataDevice {
        size_bytes: img.len() as u64,
        growable: true,
    }
}

/// A LUKS1 image as cryptsetup lays it out (2 MiB payload for a 512-bit key), "pass0" in
/// slot 0 and "pass5" in slot 5.
fn image_luks1(key: &[u8]) -> (Vec<u8>, Luks1Header) {
    let (mut h, vk) = luks1::format(
        CipherSpec::AES_XTS_PLAIN64,
        HashAlg::Sha256,
        UUID.into(),
        SecretBytes::from_slice(key),
        &fast_kdf(),
        None,
    )
    .expect("format");
    let mut img = vec![0u8; h.payload_offset as usize * 512 + 4096];
    apply_to_image(
        &mut img,
        &[WriteOp::Write {
            offset: 0,
            data: h.encode().expect("encode"),
        }],
    );
    for (slot, pass) in [(0, b"pass0"), (5, b"pass5")] {
        let (_, ops) = h
            .add_keyslot(NewKeyslot {
                vk: &vk,
                passphrase: pass,
                kdf: &fast_kdf(),
                slot: Some(slot),
            })
            .expect("add");
        apply_to_image(&mut img, &ops);
    }
    (img, h)
}

/// A LUKS2 image LUKS1 can express: 512-byte sectors, pbkdf2, 16 KiB copies; "pass0" in
/// slot 0, "pass3" in slot 3.
fn image_luks2(key: &[u8], sector: SectorSize) -> Vec<u8> {
    let mut o = FormatLuks2::defaults(UUID.into());
    o.kdf = fast_kdf();
    o.sector_size = sector;
    o.data_offset = 2 * MIB;
    o.keyslots_size = 2 * MIB - 2 * o.hdr_size;
    let (mut hdr, vk) = format(&o, SecretBytes::from_slice(key)).expect("format");
    let mut img = vec![0u8; 2 * MIB as usize + 4096];
    for (slot, pass) in [(0, b"pass0"), (3, b"pass3")] {
        let (_, ops) = hdr
            .add_keyslot(
                NewKeyslot {
                    vk: &vk,
                    passphrase: pass,
                    kdf: &fast_kdf(),
                    slot: Some(slot),
                },
                None,
            )
            .expect("add");
        apply_to_image(&mut img, &ops);
    }
    img
}

fn plan(img: &[u8], to: ConvertTo) -> Result<Conversion> {
    let hdr = parse_any(img)?;
    convert(&hdr, to, file(img), &mut reader(img))
}

#[test]
fn luks1_to_luks2_and_back_gives_the_same_luks1_header() {
    let key = [7u8; 64];
    let (mut img, original) = image_luks1(&key);
    let up = plan(&img, ConvertTo::Luks2).expect("up");
    assert!(up.device_bytes_needed <= img.len() as u64);
    apply_to_image(&mut img, &up.ops);
    let Header::Luks2(h2) = parse_any(&img).expect("parse") else {
        panic!("not LUKS2")
    };
    assert_eq!(h2.bin.seqid, 2);
    assert_eq!(h2.meta.config.keyslots_size.0, 2 * MIB - 32768);
    assert_eq!(
        h2.meta.keyslots["5"].area.as_ref().map(|a| a.offset.0),
        Some(u64::from(original.slots[5].key_material_offset) * 512 + AREA_SHIFT_BYTES)
    );
    assert_eq!(opens(&img, b"pass0", &key), Some(2));
    assert_eq!(opens(&img, b"pass5", &key), Some(2));
    let down = plan(&img, ConvertTo::Luks1).expect("down");
    apply_to_image(&mut img, &down.ops);
    let Header::Luks1(h1) = parse_any(&img).expect("parse") else {
        panic!("not LUKS1")
    };
    assert_eq!(h1, original);
    assert_eq!(opens(&img, b"pass0", &key), Some(1));
    assert_eq!(opens(&img, b"pass5", &key), Some(1));
}

#[test]
fn luks2_to_luks1_puts_inactive_slots_in_the_first_gaps() {
    for key in [vec![1u8; 32], vec![2u8; 64]] {
        let mut img = image_luks2(&key, SectorSize::new(512).expect("512"));
        let down = plan(&img, ConvertTo::Luks1).expect("down");
        apply_to_image(&mut img, &down.ops);
        let Header::Luks1(h1) = parse_any(&img).expect("parse") else {
            panic!("not LUKS1")
        };
        let stride = (h1.material_bytes().div_ceil(4096) * 4096 / 512) as u32;
        let offsets: Vec<u32> = h1.slots.iter().map(|s| s.key_material_offset).collect();
        // Slots 0 and 3 where ucrypt allocated them (the first two areas); the others fill
        // the gaps from the start.
        assert_eq!(offsets[0], 8);
        assert_eq!(offsets[3], 8 + stride);
        assert_eq!(offsets[1], 8 + 2 * stride);
        assert_eq!(offsets[7], 8 + 7 * stride);
        assert_eq!(opens(&img, b"pass0", &key), Some(1));
        assert_eq!(opens(&img, b"pass3", &key), Some(1));
        let up = plan(&img, ConvertTo::Luks2).expect("up");
        apply_to_image(&mut img, &up.ops);
        assert_eq!(opens(&img, b"pass3", &key), Some(2));
    }
}

/// After how many of the plan's writes a crash happens: which header opens then. The keyslot
/// region and the headers overlap, so the crash points between the move and the first new
/// header copy lose the volume, in cryptsetup's conversion as in this one.
fn crash_table(img: &[u8], ops: &[WriteOp], pass: &[u8], key: &[u8]) -> Vec<Option<u32>> {
    let writes = ops.iter().filter(|o| !matches!(o, WriteOp::Sync)).count();
    (0..=writes)
        .map(|done| {
            let mut crashed = img.to_vec();
            let mut n = 0;
            for op in ops {
                if !matches!(op, WriteOp::Sync) {
                    if n == done {
                        break;
                    }
                    n += 1;
                }
                apply_to_image(&mut crashed, std::slice::from_ref(op));
            }
            opens(&crashed, pass, key)
        })
        .collect()
}

#[test]
fn crash_points_of_both_directions() {
    let key = [9u8; 64];
    let (img1, _) = image_luks1(&key);
    let up = plan(&img1, ConvertTo::Luks2).expect("up");
    assert_eq!(
        crash_table(&img1, &up.ops, b"pass5", &key),
        [Some(1), None, Some(2), Some(2)]
    );
    let img2 = image_luks2(&key, SectorSize::new(512).expect("512"));
    let down = plan(&img2, ConvertTo::Luks1).expect("down");
    assert_eq!(
        crash_table(&img2, &down.ops, b"pass3", &key),
        [Some(2), None, Some(1)]
    );
}

fn refusal(r: Result<Conversion>) -> String {
    match r {
        Err(Error::InvalidArgument(m)) => m,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("converted"),
    }
}

#[test]
fn refusals_in_cryptsetups_words() {
    let key = [3u8; 64];
    // Already the type asked for.
    let (img1, _) = image_luks1(&key);
    assert_eq!(
        refusal(plan(&img1, ConvertTo::Luks1)),
        "Device is already LUKS1 type."
    );
    // A legacy layout: keyslot material right after the phdr.
    let mut legacy = img1.clone();
    legacy[208 + 40..208 + 44].copy_from_slice(&2u32.to_be_bytes());
    assert!(refusal(plan(&legacy, ConvertTo::Luks2)).contains("keyslots material offset 2"));
    // No room for the moved areas before the data, on a device that cannot grow.
    let hdr = parse_any(&img1).expect("parse");
    let Header::Luks1(mut tight) = hdr else {
        panic!("LUKS1")
    };
    let end = luks1_region_end(&tight);
    tight.payload_offset = (end / 512) as u32;
    let dev = MetadataDevice {
        size_bytes: img1.len() as u64,
        growable: false,
    };
    let r = convert(
        &Header::Luks1(tight.clone()),
        ConvertTo::Luks2,
        dev,
        &mut reader(&img1),
    );
    assert_eq!(refusal(r), "Unable to move keyslot area. Not enough space.");
    let r = convert(
        &Header::Luks1(tight),
        ConvertTo::Luks2,
        file(&img1),
        &mut reader(&img1),
    );
    assert_eq!(
        refusal(r),
        "Cannot convert to LUKS2 format - invalid metadata."
    );
    // luksmeta after the keyslots.
    let mut lm = img1.clone();
    let at = luks1_region_end(&image_luks1(&key).1) as usize;
    lm[at..at + 8].copy_from_slice(LUKSMETA_MAGIC);
    assert_eq!(
        refusal(plan(&lm, ConvertTo::Luks2)),
        "Unable to convert header with LUKSMETA additional metadata."
    );
    // LUKS2 features LUKS1 lacks.
    let img4k = image_luks2(&key, SectorSize::S4096);
    assert!(refusal(plan(&img4k, ConvertTo::Luks1)).contains("sector size is not 512 bytes"));
    assert_eq!(
        refusal(plan(&img4k, ConvertTo::Luks2)),
        "Device is already LUKS2 type."
    );
    let img2 = image_luks2(&key, SectorSize::new(512).expect("512"));
    let Header::Luks2(h2) = parse_any(&img2).expect("parse") else {
        panic!("LUKS2")
    };
    let refuse_with = |edit: &dyn Fn(&mut Luks2Header)| {
        let mut h = h2.clone();
        edit(&mut h);
        refusal(convert(
            &Header::Luks2(h),
            ConvertTo::Luks1,
            file(&img2),
            &mut reader(&img2),
        ))
    };
    let token: Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"type":"x","keyslots":[]}"#).expect("json");
    assert_eq!(
        refuse_with(&|h| {
            h.meta.tokens.insert("0".into(), token.clone());
        }),
        "Cannot convert to LUKS1 format - LUKS2 header contains 1 token(s)."
    );
    assert_eq!(
        refuse_with(&|h| {
            let k = h.meta.keyslots.get_mut("3").expect("3");
            k.kdf.as_mut().expect("kdf").kind = KdfKind::Argon2id;
        }),
        "Cannot convert to LUKS1 format - keyslot 3 is not LUKS1 compatible."
    );
    assert_eq!(
        refuse_with(&|h| {
            let k = h.meta.keyslots.remove("3").expect("3");
            h.meta.keyslots.insert("9".into(), k);
            h.meta.digests.get_mut("0").expect("d").keyslots = vec!["0".into(), "9".into()];
        }),
        "Cannot convert to LUKS1 format - slot 9 (over maximum slots) is still active."
    );
    assert_eq!(
        refuse_with(&|h| {
            let d = h.meta.digests["0"].clone();
            h.meta.digests.insert("1".into(), d);
        }),
        "Cannot convert to LUKS1 format - key slot digests are not LUKS1 compatible."
    );
    assert_eq!(
        refuse_with(&|h| {
            let s = h.meta.segments.get_mut("0").expect("0");
            s.encryption = Some("paes-xts-plain64".into());
        }),
        "Cannot convert to LUKS1 format - device uses wrapped key cipher paes."
    );
    assert_eq!(
        refuse_with(&|h| {
            let s = h.meta.segments["0"].clone();
            h.meta.segments.insert("1".into(), s);
        }),
        "Cannot convert to LUKS1 format - device uses more segments."
    );
}

#[test]
fn cipher_names_split_as_cryptsetup_splits_them() {
    let s = |x: &str| name_and_mode(x).map(|(a, b)| format!("{a}|{b}"));
    assert_eq!(s("aes-xts-plain64").as_deref(), Some("aes|xts-plain64"));
    assert_eq!(s("aes-plain").as_deref(), Some("aes|cbc-plain"));
    assert_eq!(s("null").as_deref(), Some("cipher_null|ecb"));
    assert_eq!(s("twofish").as_deref(), Some("twofish|cbc-plain"));
    assert_eq!(s(""), None);
}
