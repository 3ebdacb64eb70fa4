//! Headers written by cryptsetup and by other programs: parsed, dumped and probed as
//! cryptsetup does (the fuzz seeds and cryptsetup's validation suite among them).

use super::*;

/// Real cryptsetup 2.6 headers (also the fuzz seeds), parsed without cryptsetup installed.
#[test]
fn cryptsetup_written_headers_parse() {
    let l2 = include_bytes!("../../../../../fuzz/seeds/luks_parse/luks2-pbkdf2");
    let a2 = include_bytes!("../../../../../fuzz/seeds/luks_parse/luks2-argon2id");
    let l1 = include_bytes!("../../../../../fuzz/seeds/luks_parse/luks1");
    let Header::Luks2(h) = parse_any(l2).expect("luks2-pbkdf2") else {
        panic!("not LUKS2")
    };
    assert_eq!(h.bin.label, "seed");
    assert!(h.warnings.is_empty());
    let p = h.meta.keyslot_params("0").expect("keyslot 0");
    assert!(matches!(
        p.kdf,
        Kdf::Pbkdf2 {
            iterations: 1000,
            ..
        }
    ));
    assert_eq!((p.key_bytes, p.area_offset, p.stripes), (64, 32768, 4000));
    let l = Header::Luks2(h.clone()).data_layout().expect("layout");
    assert_eq!(
        (l.offset_bytes, l.sector_size.bytes(), l.size_bytes),
        (16 << 20, 4096, None)
    );
    let Header::Luks2(h) = parse_any(a2).expect("luks2-argon2id") else {
        panic!("not LUKS2")
    };
    let p = h.meta.keyslot_params("0").expect("keyslot 0");
    assert_eq!(p.priority, 2);
    assert!(matches!(
        p.kdf,
        Kdf::Argon2 {
            variant: kdf::Argon2Variant::Id,
            cost: kdf::Argon2Cost {
                time: 4,
                memory_kib: 32,
                ..
            },
            ..
        }
    ));
    let h = parse_any(l1).expect("luks1");
    assert_eq!(h.version(), 1);
    assert_eq!(h.active_keyslots(), vec![0]);
    assert_eq!(h.data_layout().expect("layout").offset_bytes, 4096 * 512);
    // The same bytes with the primary header destroyed: recovered from the secondary.
    let mut bad = l2.to_vec();
    bad[..4096].fill(0);
    assert_eq!(parse_any(&bad).expect("secondary").warnings().len(), 1);
}

// ------------------------------------------------------------------ dump text

/// `luksDump` output of known headers, pinned byte for byte: scripts parse it (the "MK dump:"
/// line above all), so reshaping `dump` must not change a character. Trailing spaces after
/// hex bytes are part of the format.
#[test]
fn dump_text_is_pinned() {
    let text = |lines: &[&str]| lines.iter().map(|l| format!("{l}\n")).collect::<String>();
    let l1 = include_bytes!("../../../../../fuzz/seeds/luks_parse/luks1");
    let l2 = include_bytes!("../../../../../fuzz/seeds/luks_parse/luks2-pbkdf2");
    let h1 = parse_any(l1).expect("luks1 seed");
    assert_eq!(dump(&h1, "seed", None), text(DUMP_LUKS1_SEED));
    let h2 = parse_any(l2).expect("luks2-pbkdf2 seed");
    assert_eq!(dump(&h2, "seed", None), text(DUMP_LUKS2_PBKDF2_SEED));
    let (img, vk) = image_luks2();
    let h = parse_any(&img).expect("image");
    let vk = h.verify_key(SecretBytes::from_slice(&vk)).expect("vk");
    assert_eq!(dump(&h, "img", Some(&vk)), text(DUMP_VOLUME_KEY));
}

const DUMP_LUKS1_SEED: &[&str] = &[
    "LUKS header information for seed",
    "",
    "Version:       \t1",
    "Cipher name:   \taes",
    "Cipher mode:   \txts-plain64",
    "Hash spec:     \tsha256",
    "Payload offset:\t4096",
    "MK bits:       \t512",
    "MK digest:     \t83 c0 b8 8e 6e c7 84 c9 9b e0 9c 7c b8 49 78 a9 89 32 33 32 ",
    "MK salt:       \t01 f2 20 2b d2 a8 a8 1e 74 82 86 41 19 52 91 0e ",
    "               \t85 1a e2 23 3b de 04 e9 0c ec 6f ea bf 8c d1 91 ",
    "MK iterations: \t1000",
    "UUID:          \tfa6ba24d-83bb-4f36-9017-dbf83a1a7f62",
    "",
    "Key Slot 0: ENABLED",
    "\tIterations:         \t1000",
    "\tSalt:               \tee f9 28 27 85 36 e7 41 a8 07 2b 7a b3 16 c5 df ",
    "\t                      \t3a 09 c8 9f 97 20 36 d5 4e 61 c4 4b ca e7 0e 3c ",
    "\tKey material offset:\t8",
    "\tAF stripes:            \t4000",
    "Key Slot 1: DISABLED",
    "Key Slot 2: DISABLED",
    "Key Slot 3: DISABLED",
    "Key Slot 4: DISABLED",
    "Key Slot 5: DISABLED",
    "Key Slot 6: DISABLED",
    "Key Slot 7: DISABLED",
];

const DUMP_LUKS2_PBKDF2_SEED: &[&str] = &[
    "LUKS header information",
    "Version:       \t2",
    "Epoch:         \t3",
    "Metadata area: \t16384 [bytes]",
    "Keyslots area: \t16744448 [bytes]",
    "UUID:          \teb168cdb-ee75-447c-9d58-eef17290a310",
    "Label:         \tseed",
    "Subsystem:     \t(no subsystem)",
    "Flags:       \t(no flags)",
    "",
    "Data segments:",
    "  0: crypt",
    "\toffset: 16777216 [bytes]",
    "\tlength: (whole device)",
    "\tcipher: aes-xts-plain64",
    "\tsector: 4096 [bytes]",
    "",
    "Keyslots:",
    "  0: luks2",
    "\tKey:        512 bits",
    "\tPriority:   normal",
    "\tCipher:     aes-xts-plain64",
    "\tCipher key: 512 bits",
    "\tPBKDF:      pbkdf2",
    "\tHash:       sha256",
    "\tIterations: 1000",
    "\tSalt:       7c 22 e4 72 c7 d2 93 82 b7 af 99 17 83 a7 08 df ",
    "\t            bf c5 72 56 75 69 a0 bc e9 a4 11 f1 d7 a6 54 db ",
    "\tAF stripes: 4000",
    "\tAF hash:    sha256",
    "\tArea offset:32768 [bytes]",
    "\tArea length:258048 [bytes]",
    "\tDigest ID:  0",
    "Tokens:",
    "Digests:",
    "  0: pbkdf2",
    "\tHash:       sha256",
    "\tIterations: 1000",
    "\tSalt:       b1 c6 de 7b 79 30 4c eb 74 1a 3c b2 27 5a 64 22 ",
    "\t            8d 77 13 e7 5d 98 0c f1 d5 a2 d0 cf a8 c1 c1 67 ",
    "\tDigest:     50 e1 d3 79 ad 2e e9 5f 28 fb ac 50 15 3c 83 64 ",
    "\t            dc 3e fe a0 11 fa e9 41 44 37 96 17 31 d5 70 0d ",
];

const DUMP_VOLUME_KEY: &[&str] = &[
    "LUKS header information for img",
    "Cipher name:   \taes",
    "Cipher mode:   \txts-plain64",
    "Payload offset:\t2048",
    "UUID:          \t0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0",
    "MK bits:       \t512",
    "MK dump:\t00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f ",
    "\t\t10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f ",
    "\t\t20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f ",
    "\t\t30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f ",
];

/// Short devices without a magic are not LUKS (exit 1, "not a valid LUKS device"), not
/// damaged headers: a 0-, 7-, 1000- and 4095-byte prefix of random bytes or zeroes.
#[test]
fn short_devices_without_magic_are_not_luks() {
    for len in [0usize, 7, 1000, 4095, 5000] {
        for fill in [0u8, 0xa5] {
            let img = vec![fill; len];
            match parse_any(&img) {
                Err(Error::NotLuks(_)) => {}
                other => panic!("{len} bytes of {fill:#x}: {other:?}"),
            }
        }
    }
}

/// A librbd clone header (magic `RBDL\xba\xbe`) is named as such, not called "not LUKS".
#[test]
fn rbd_clone_header_is_named() {
    let (mut img, _) = image_luks2();
    img[..6].copy_from_slice(RBD_CLONE_MAGIC);
    for r in [parse_any(&img).map(|_| ()), probe_len(&img).map(|_| ())] {
        match r {
            Err(Error::UnsupportedLuks(m)) => assert!(m.contains("RBDL"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}

/// The images of cryptsetup 2.6.1's LUKS2 validation suite with 16 KiB headers (first 32 KiB,
/// kept as fuzz seeds, named by the suite's verdict: `cryptsetup-2.6.1-loads-*` or
/// `-refused-*`) parse or are refused as cryptsetup's `luksDump` does, without fetching the
/// suite (`ucrypt-cli/tests/luks2_validation.rs` runs all 83 from cryptsetup's source).
#[test]
fn cryptsetup_validation_suite_seeds_agree() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/luks_parse");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("seed dir") {
        let p = e.expect("entry").path();
        let name = p
            .file_name()
            .and_then(|s| s.to_str())
            .unwrap_or("")
            .to_string();
        let Some(rest) = name.strip_prefix("cryptsetup-2.6.1-") else {
            continue;
        };
        let loads = rest.starts_with("loads-");
        assert!(
            loads || rest.starts_with("refused-"),
            "{name}: no verdict in the name"
        );
        let got = parse_any(&std::fs::read(&p).expect("seed"));
        assert_eq!(got.is_ok(), loads, "{name}: {:?}", got.map(|h| h.version()));
        n += 1;
    }
    assert!(n >= 60, "only {n} suite images among the seeds");
}

/// A segment with an `integrity` object (as cryptsetup writes it for `--integrity aead`): typed
/// on parse, printed by dump as cryptsetup prints it, and never opened as plain dm-crypt.
#[test]
fn integrity_segment_is_typed_dumped_and_not_opened_plain() {
    let (mut img, _) = image_luks2();
    mutate_json(&mut img, &[0, 1], &|v| {
        let s = &mut v["segments"]["0"];
        s["encryption"] = "aes-gcm-random".into();
        s["integrity"] = serde_json::json!({
            "type": "aead", "journal_encryption": "none", "journal_integrity": "none"
        });
    });
    let h = parse_any(&img).expect("parse");
    let Header::Luks2(l2) = &h else {
        panic!("LUKS2")
    };
    let i = l2.meta.segments["0"]
        .integrity
        .as_ref()
        .expect("typed integrity");
    assert_eq!(
        (
            i.kind.as_str(),
            i.journal_encryption.as_str(),
            i.journal_integrity.as_str()
        ),
        ("aead", "none", "none")
    );
    let text = dump(&h, "img", None);
    assert!(
        text.contains("\tcipher: aes-gcm-random\n\tsector: 4096 [bytes]\n\tintegrity: aead\n"),
        "{text}"
    );
    let e = h.data_layout().expect_err("no plain mapping");
    assert!(
        matches!(e, Error::UnsupportedLuks(ref m) if m.contains("authenticated")),
        "{e}"
    );
}

/// `read_header` skips the 8 MiB probe when no secondary magic is anywhere: it must say what
/// parsing the whole probe range says, and still find a lone secondary copy at any offset.
#[test]
fn read_header_probes_secondaries_as_the_whole_range_would() {
    use crate::backend::{Backend, MemBackend};
    let dev_of = |bytes: &[u8]| {
        let dev = MemBackend::new(HEADER_BYTES_MAX + (1 << 20));
        dev.write_at(bytes, 0).expect("write");
        dev
    };
    let whole = |dev: &MemBackend| {
        let mut b = vec![0u8; HEADER_BYTES_MAX as usize];
        dev.read_exact_at(&mut b, 0).expect("read");
        parse_any(&b)
    };
    // Plaintext; plaintext with a LUKS2 primary magic and a bad header size.
    let plain: Vec<u8> = (0..(2 << 20)).map(|i| (i * 7 % 251) as u8).collect();
    let mut bad_size = plain.clone();
    bad_size[..6].copy_from_slice(luks2::MAGIC_1ST);
    bad_size[6..8].copy_from_slice(&2u16.to_be_bytes());
    for (name, bytes) in [("plaintext", &plain), ("bad hdr_size", &bad_size)] {
        let dev = dev_of(bytes);
        let (got, want) = (driver::read_header(&dev), whole(&dev));
        assert!(got.is_err() && want.is_err(), "{name}");
        assert_eq!(
            got.unwrap_err().to_string(),
            want.unwrap_err().to_string(),
            "{name}"
        );
    }
    // A lone secondary copy (the primary wiped) is found at every offset it may sit, and a
    // lone primary (the secondary wiped) of every size is read whole (4 MiB of metadata
    // needs all 8 MiB).
    for (hdr_size, wipe_primary) in luks2::HDR_SIZES
        .into_iter()
        .flat_map(|h| [(h, true), (h, false)])
    {
        let mut o = FormatLuks2::defaults("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0".into());
        o.kdf = fast_kdf();
        o.hdr_size = hdr_size;
        o.data_offset = (2 * hdr_size).max(DATA_OFFSET).next_multiple_of(1 << 20) * 2;
        o.keyslots_size = o.data_offset - 2 * hdr_size;
        let (mut hdr, _) = format(&o, SecretBytes::from_slice(&[7u8; 64])).expect("format");
        let dev = MemBackend::new(o.data_offset + (1 << 20));
        driver::apply(&dev, &hdr.commit().expect("commit")).expect("apply");
        let wipe_at = if wipe_primary { 0 } else { hdr_size };
        dev.write_at(&[0u8; 4096], wipe_at).expect("wipe a copy");
        let h = driver::read_header(&dev).unwrap_or_else(|e| panic!("{hdr_size}: {e}"));
        assert_eq!(
            h.uuid(),
            "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0",
            "{hdr_size}"
        );
        assert_eq!(h.warnings().len(), 1, "{hdr_size}: {:?}", h.warnings());
    }
}
