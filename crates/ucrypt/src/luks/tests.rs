//! LUKS tests: round trips, the copy-selection truth table, crash injection at every write
//! step, a table of hostile headers, and a seeded mutation run through the parser.

use super::json::SegmentSize;
use super::luks2::{format, FormatLuks2};
use super::*;

/// Fast KDF for tests: pbkdf2-sha256, 1000 iterations (cryptsetup's minimum).
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

const DATA_OFFSET: u64 = 1 << 20;

/// A LUKS2 image with 1 MiB of metadata and two keyslots ("pass0" in 0, "pass1" in 1).
fn image_luks2() -> (Vec<u8>, Vec<u8>) {
    let mut o = FormatLuks2::defaults("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0".into());
    o.kdf = fast_kdf();
    o.data_offset = DATA_OFFSET;
    o.keyslots_size = DATA_OFFSET - 2 * o.hdr_size;
    let vk_bytes: Vec<u8> = (0..64u8).collect();
    let (mut hdr, vk) = format(&o, SecretBytes::from_slice(&vk_bytes)).expect("format");
    let mut img = vec![0u8; DATA_OFFSET as usize + 4096];
    let (_, ops) = hdr
        .add_keyslot(&vk, b"pass0", &fast_kdf(), None, None)
        .expect("add 0");
    apply_to_image(&mut img, &ops);
    let (_, ops) = hdr
        .add_keyslot(&vk, b"pass1", &fast_kdf(), None, None)
        .expect("add 1");
    apply_to_image(&mut img, &ops);
    (img, vk_bytes)
}

fn open(img: &[u8], pass: &[u8]) -> Result<(u32, Vec<u8>)> {
    let hdr = parse_any(img)?;
    let mut read = |off: u64, len: u64| -> Result<Vec<u8>> {
        img.get(off as usize..(off + len) as usize)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| Error::BadHeader {
                check: "truncated",
                detail: "keyslot area beyond the device".into(),
            })
    };
    let (slot, vk) = unlock(&hdr, pass, None, &mut read)?;
    Ok((slot, vk.bytes().to_vec()))
}

#[test]
fn luks2_format_add_unlock_remove() {
    let (mut img, vk) = image_luks2();
    assert_eq!(open(&img, b"pass0").expect("pass0"), (0, vk.clone()));
    assert_eq!(open(&img, b"pass1").expect("pass1"), (1, vk.clone()));
    assert!(matches!(open(&img, b"nope"), Err(Error::WrongPassphrase)));
    let Header::Luks2(mut h) = parse_any(&img).expect("parse") else {
        panic!("not LUKS2")
    };
    assert_eq!(h.bin.seqid, 2);
    let ops = h.remove_keyslot(0).expect("remove");
    apply_to_image(&mut img, &ops);
    assert!(matches!(open(&img, b"pass0"), Err(Error::WrongPassphrase)));
    assert_eq!(open(&img, b"pass1").expect("pass1").1, vk);
}

#[test]
fn luks1_format_add_unlock_remove() {
    let vk_bytes: Vec<u8> = (100..132u8).collect();
    let (mut h, vk) = luks1::format(
        "aes-cbc-essiv:sha256".parse().expect("spec"),
        HashAlg::Sha1,
        "11111111-2222-4333-8444-555555555555".into(),
        SecretBytes::from_slice(&vk_bytes),
        &fast_kdf(),
        None,
    )
    .expect("format");
    let mut img = vec![0u8; h.payload_offset as usize * 512];
    apply_to_image(
        &mut img,
        &[WriteOp::Write {
            offset: 0,
            data: h.encode().expect("encode"),
        }],
    );
    let (s, ops) = h.add_keyslot(&vk, b"a", &fast_kdf(), None).expect("add");
    assert_eq!(s, 0);
    apply_to_image(&mut img, &ops);
    let (s, ops) = h.add_keyslot(&vk, b"b", &fast_kdf(), Some(5)).expect("add");
    assert_eq!(s, 5);
    apply_to_image(&mut img, &ops);
    assert_eq!(open(&img, b"a").expect("a"), (0, vk_bytes.clone()));
    assert_eq!(open(&img, b"b").expect("b"), (5, vk_bytes.clone()));
    assert!(matches!(open(&img, b"c"), Err(Error::WrongPassphrase)));
    apply_to_image(&mut img, &h.remove_keyslot(0).expect("kill"));
    assert!(matches!(open(&img, b"a"), Err(Error::WrongPassphrase)));
}

#[test]
fn copy_selection_truth_table() {
    use Which::*;
    // (primary seqid if valid, secondary seqid if valid) -> (use, repair)
    type Row = (Option<u64>, Option<u64>, Option<(Which, Option<Which>)>);
    let rows: &[Row] = &[
        (Some(5), Some(5), Some((Primary, None))),
        (Some(6), Some(5), Some((Primary, Some(Secondary)))),
        (Some(5), Some(6), Some((Secondary, Some(Primary)))),
        (Some(0), Some(u64::MAX), Some((Secondary, Some(Primary)))),
        (Some(5), None, Some((Primary, Some(Secondary)))),
        (None, Some(5), Some((Secondary, Some(Primary)))),
        (None, None, None),
    ];
    for (i, (p, s, want)) in rows.iter().enumerate() {
        let got = select_copy(*p, *s).map(|x| (x.use_copy, x.repair));
        assert_eq!(&got, want, "row {i}: primary {p:?} secondary {s:?}");
    }
}

/// Applies `ops` as if the machine died at step `crash_at`: ops before it are complete; the
/// op at `crash_at` is written only for its first `torn` bytes (0 = missing write).
fn apply_crashed(img: &mut Vec<u8>, ops: &[WriteOp], crash_at: usize, torn: usize) {
    apply_to_image(img, &ops[..crash_at]);
    if let Some(WriteOp::Write { offset, data }) = ops.get(crash_at) {
        let n = torn.min(data.len());
        apply_to_image(
            img,
            &[WriteOp::Write {
                offset: *offset,
                data: data[..n].to_vec(),
            }],
        );
    }
}

#[test]
fn crash_at_every_write_step_leaves_old_or_new_keyslots() {
    let (base, vk) = image_luks2();
    // Update 1: add a keyslot "pass2". Update 2: remove keyslot 0.
    for update in ["add", "remove"] {
        let Header::Luks2(mut h) = parse_any(&base).expect("parse") else {
            panic!("not LUKS2")
        };
        let vkey = h
            .verify_key(None, SecretBytes::from_slice(&vk))
            .expect("vk");
        let ops = match update {
            "add" => {
                h.add_keyslot(&vkey, b"pass2", &fast_kdf(), None, None)
                    .expect("add")
                    .1
            }
            _ => h.remove_keyslot(0).expect("remove"),
        };
        for crash_at in 0..=ops.len() {
            let lens: Vec<usize> = match ops.get(crash_at) {
                Some(WriteOp::Write { data, .. }) => {
                    vec![0, 1, 512, 4096, 4097, data.len() / 2, data.len() - 1]
                }
                _ => vec![0],
            };
            for torn in lens {
                let mut img = base.clone();
                apply_crashed(&mut img, &ops, crash_at, torn);
                let row = format!(
                    "{update}: crash at op {crash_at} ({:?}) after {torn} bytes",
                    ops.get(crash_at)
                );
                let hdr = parse_any(&img).unwrap_or_else(|e| panic!("{row}: no header: {e}"));
                let Header::Luks2(h2) = &hdr else {
                    panic!("{row}")
                };
                let old = h2.bin.seqid == 2;
                let new = h2.bin.seqid == 3;
                assert!(old || new, "{row}: seqid {}", h2.bin.seqid);
                // pass1 is never touched: it must always open.
                assert_eq!(open(&img, b"pass1").expect(&row).1, vk, "{row}");
                match (update, new) {
                    ("add", true) => assert_eq!(open(&img, b"pass2").expect(&row).1, vk),
                    ("add", false) => assert!(open(&img, b"pass2").is_err(), "{row}"),
                    (_, true) => assert!(open(&img, b"pass0").is_err(), "{row}"),
                    (_, false) => assert_eq!(open(&img, b"pass0").expect(&row).1, vk),
                }
            }
        }
    }
}

#[test]
fn damaged_primary_or_secondary_is_recovered_with_a_warning() {
    let (img, vk) = image_luks2();
    for (name, off) in [("primary", 0usize), ("secondary", 0x4000)] {
        let mut bad = img.clone();
        bad[off + 4096 + 10] ^= 0xff; // inside the JSON: checksum breaks
        let hdr = parse_any(&bad).expect(name);
        assert_eq!(hdr.warnings().len(), 1, "{name}");
        assert!(
            hdr.warnings()[0].to_lowercase().contains(name),
            "{name}: {:?}",
            hdr.warnings()
        );
        assert_eq!(open(&bad, b"pass0").expect(name).1, vk);
    }
}

#[test]
fn unknown_fields_survive_a_rewrite() {
    let (img, _) = image_luks2();
    let Header::Luks2(mut h) = parse_any(&img).expect("parse") else {
        panic!()
    };
    h.meta
        .extra
        .insert("future".into(), serde_json::json!({"x": [1, 2]}));
    h.meta
        .keyslots
        .get_mut("0")
        .expect("ks0")
        .extra
        .insert("vendor_field".into(), serde_json::json!("kept"));
    h.meta
        .config
        .extra
        .insert("cfg_extra".into(), serde_json::json!(7));
    let mut img2 = img.clone();
    apply_to_image(&mut img2, &h.commit().expect("commit"));
    let Header::Luks2(mut h2) = parse_any(&img2).expect("parse") else {
        panic!()
    };
    apply_to_image(
        &mut img2,
        &h2.set_flags(vec!["allow-discards".into()]).expect("flags"),
    );
    let Header::Luks2(h3) = parse_any(&img2).expect("parse") else {
        panic!()
    };
    assert_eq!(h3.meta.extra["future"], serde_json::json!({"x": [1, 2]}));
    assert_eq!(h3.meta.keyslots["0"].extra["vendor_field"], "kept");
    assert_eq!(h3.meta.config.extra["cfg_extra"], 7);
    assert_eq!(h3.flags(), vec!["allow-discards".to_string()]);
    assert!(matches!(h3.meta.segments["0"].size, SegmentSize::Dynamic));
}
