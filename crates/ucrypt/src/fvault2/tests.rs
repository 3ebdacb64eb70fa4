use super::*;
use crate::backend::MemBackend;

/// Writes Core Storage's checksum (seed 0xffffffff, CRC-32C of the rest) into `b`.
fn seal(b: &mut [u8]) {
    b[4..8].copy_from_slice(&0xffff_ffffu32.to_le_bytes());
    let c = crc32c(0xffff_ffff, &b[8..]);
    b[0..4].copy_from_slice(&c.to_le_bytes());
}

/// A valid volume header: block size 4096, disk label at block 1.
fn header() -> Vec<u8> {
    let mut b = vec![0u8; VOLUME_HEADER_BYTES];
    b[8..10].copy_from_slice(&1u16.to_le_bytes());
    b[88..90].copy_from_slice(b"CS");
    b[96..100].copy_from_slice(&4096u32.to_le_bytes());
    b[104..112].copy_from_slice(&1u64.to_le_bytes());
    b[168..172].copy_from_slice(&16u32.to_le_bytes());
    b[304..320].copy_from_slice(&[0x11; 16]);
    seal(&mut b);
    b
}

#[test]
fn crc32c_known_answer() {
    // The standard CRC-32C check value of "123456789" (with the usual inversions).
    assert_eq!(!crc32c(!0, b"123456789"), 0xE306_9283);
}

#[test]
fn volume_header_parses_and_each_check_fails() {
    let h = VolumeHeader::parse(&header()).unwrap();
    assert_eq!(h.block_bytes, 4096);
    assert_eq!(h.disklabel_offset().unwrap(), 4096);
    assert_eq!(
        uuid_text(&h.physical_volume_uuid),
        "11111111-1111-1111-1111-111111111111"
    );
    assert!(matches!(
        VolumeHeader::parse(&header()[..100]),
        Err(Fault::Truncated(_))
    ));
    let mut b = header();
    b[200] ^= 1;
    assert!(matches!(VolumeHeader::parse(&b), Err(Fault::Crc(_))));
    let cases: [(usize, &[u8], Fault); 3] = [
        (8, &[2, 0], Fault::UnsupportedVersion(2)),
        (88, b"XX", Fault::Magic),
        (168, &[32, 0, 0, 0], Fault::KeySize(32)),
    ];
    for (at, bytes, want) in cases {
        let mut b = header();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        seal(&mut b);
        assert_eq!(VolumeHeader::parse(&b).err(), Some(want));
    }
    // A disk label beyond the 1 GiB bound, and one whose offset overflows.
    for block in [(1u64 << 30) / 4096 + 1, u64::MAX] {
        let mut b = header();
        b[104..112].copy_from_slice(&block.to_le_bytes());
        seal(&mut b);
        let h = VolumeHeader::parse(&b).unwrap();
        assert!(matches!(h.disklabel_offset(), Err(Fault::Offset(_))));
    }
}

#[test]
fn disk_label_bounds_its_descriptor() {
    let mut b = vec![0u8; MD_BLOCK_BYTES];
    b[220..224].copy_from_slice(&512u32.to_le_bytes());
    seal(&mut b);
    assert_eq!(DiskLabel::parse(&b, 4096).unwrap().descriptor_offset, 4608);
    assert!(matches!(
        DiskLabel::parse(&b, OFFSET_MAX),
        Err(Fault::Offset(_))
    ));
    assert!(matches!(
        DiskLabel::parse(&b[..MD_BLOCK_BYTES - 1], 0),
        Err(Fault::Truncated(_))
    ));
    b[300] = 1;
    assert!(matches!(DiskLabel::parse(&b, 0), Err(Fault::Crc(_))));
}

fn block(kind: u16, xml_at: usize, xml: &str) -> Vec<u8> {
    let mut b = vec![0u8; MD_BLOCK_BYTES];
    b[10..12].copy_from_slice(&kind.to_le_bytes());
    b[xml_at..xml_at + 4].copy_from_slice(&1024u32.to_le_bytes());
    b[xml_at + 4..xml_at + 8].copy_from_slice(&(xml.len() as u32).to_le_bytes());
    b[1024..1024 + xml.len()].copy_from_slice(xml.as_bytes());
    seal(&mut b);
    b
}

fn b64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in data.chunks(3) {
        let n = c.len();
        let v = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= n {
                s.push(T[(v >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

#[test]
fn metadata_blocks_and_missing_kinds() {
    let mut md = Metadata::default();
    let mut pwk = vec![0u8; PWK_BYTES];
    pwk[8..24].copy_from_slice(&[7; 16]);
    pwk[168..172].copy_from_slice(&1000u32.to_le_bytes());
    let kwvk = vec![0u8; KWVK_BYTES];
    let xml = format!(
        "<dict><key>PassphraseWrappedKEKStruct</key><data>\n\t{}\n</data>\
         <key>KEKWrappedVolumeKeyStruct</key><data>{}</data></dict>",
        b64(&pwk),
        b64(&kwvk)
    );
    md.parse_block(&block(0x0019, 112, &xml)).unwrap();
    let hdr = VolumeHeader::parse(&header()).unwrap();
    assert_eq!(
        Metadata {
            pbkdf2: md.pbkdf2,
            ..Default::default()
        }
        .finish(&hdr)
        .err(),
        Some(Fault::Missing("0x001A"))
    );
    let xml = "<key>com.apple.corestorage.lv.size</key><integer>0xA000000</integer>\
               <key>com.apple.corestorage.lv.familyUUID</key>\
               <string ID=\"3\">33A76CAA-1481-4BC5-8D04-1AC1707C19C0</string>";
    md.parse_block(&block(0x001A, 128, xml)).unwrap();
    let mut lv = block(0x0305, 0, "");
    lv[104..108].copy_from_slice(&16384u32.to_le_bytes());
    seal(&mut lv);
    md.parse_block(&lv).unwrap();
    let p = md.finish(&hdr).unwrap();
    assert_eq!(p.logical_volume_offset_bytes, 16384 * 4096);
    assert_eq!(p.logical_volume_bytes, 0xA000000);
    assert_eq!(p.pbkdf2_iterations, 1000);
    assert_eq!(p.pbkdf2_salt, [7; 16]);
    assert!(p
        .dump("dev")
        .contains("Family UUID:          \t33a76caa-1481-4bc5-8d04-1ac1707c19c0\n"));
}

#[test]
fn hostile_metadata_blocks_are_refused() {
    let mut md = Metadata::default();
    // A plist reaching past the block.
    let mut b = block(0x0019, 112, "x");
    b[116..120].copy_from_slice(&u32::MAX.to_le_bytes());
    seal(&mut b);
    assert!(matches!(md.parse_block(&b), Err(Fault::Offset(_))));
    // Keys missing, values malformed, structures of the wrong size.
    let cases = [
        (0x0019, 112, "<key>Other</key><data>AA==</data>".to_string()),
        (
            0x0019,
            112,
            "<key>PassphraseWrappedKEKStruct</key><data>AAAA</data>".to_string(),
        ),
        (
            0x0019,
            112,
            "<key>PassphraseWrappedKEKStruct</key><data>!!</data>".to_string(),
        ),
        (
            0x001A,
            128,
            "<key>com.apple.corestorage.lv.size</key><integer>0</integer>".to_string(),
        ),
        (
            0x001A,
            128,
            "<key>com.apple.corestorage.lv.size</key><integer>10</integer>\
             <key>com.apple.corestorage.lv.familyUUID</key><string>nope</string>"
                .to_string(),
        ),
    ];
    for (kind, at, xml) in cases {
        let r = md.parse_block(&block(kind, at, &xml));
        assert!(
            matches!(r, Err(Fault::Plist(_) | Fault::StructSize(_))),
            "{xml}: {r:?}"
        );
    }
    let mut b = block(0x0305, 0, "");
    b[500] ^= 1;
    assert!(matches!(md.parse_block(&b), Err(Fault::Crc(_))));
    assert!(matches!(md.parse_block(&b[..10]), Err(Fault::Truncated(_))));
}

#[test]
fn plist_values_as_cryptsetup_finds_them() {
    let x = b"<key>k</key><integer>1</integer><key>k</key><string>s</string>";
    assert_eq!(plist::value(x, "k", "string"), Some("s"));
    assert_eq!(plist::value(x, "k", "integer"), Some("1"));
    assert_eq!(
        plist::value(b"<key>k</key><string></string>", "k", "string"),
        None
    );
    assert_eq!(plist::value(b"<key>k</key><string>s", "k", "string"), None);
    assert_eq!(plist::strtoull_hex(" 0x1f"), Some(31));
    assert_eq!(plist::strtoull_hex("ff zz"), Some(255));
    assert_eq!(plist::strtoull_hex("zz"), None);
    assert_eq!(plist::strtoull_hex("fffffffffffffffff"), Some(u64::MAX));
    assert_eq!(
        plist::base64_decode("aGVs bG8=").as_deref(),
        Some(&b"hello"[..])
    );
    assert_eq!(plist::base64_decode("aGVsbG8=x"), None);
}

#[test]
fn rfc3394_unwrap_known_answer() {
    // RFC 3394 section 4.1: 128-bit key data with a 128-bit KEK.
    let kek: Vec<u8> = (0u8..16).collect();
    let wrapped: [u8; 24] = [
        0x1F, 0xA6, 0x8B, 0x0A, 0x81, 0x12, 0xB4, 0x47, 0xAE, 0xF3, 0x4B, 0xD8, 0xFB, 0x5A, 0x7B,
        0x82, 0x9D, 0x3E, 0x86, 0x23, 0x71, 0xD2, 0xCF, 0xE5,
    ];
    let k = unwrap_key(&kek, &wrapped).unwrap().unwrap();
    assert_eq!(
        k.as_ref(),
        &[
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xAA, 0xBB, 0xCC, 0xDD,
            0xEE, 0xFF
        ]
    );
    let mut bad = wrapped;
    bad[5] ^= 1;
    assert!(unwrap_key(&kek, &bad).unwrap().is_none());
}

#[test]
fn read_params_of_hostile_devices() {
    // Empty, a header alone, and a header whose disk label is outside the device.
    let dev = MemBackend::new(0);
    assert!(read_params(&dev).is_err());
    let dev = MemBackend::new(4096);
    dev.write_at(&header(), 0).unwrap();
    assert!(read_params(&dev).is_err());
    // A disk label pointing at a descriptor that asks for 2^64-1 blocks, all zero: the loop
    // stops at the first zero block and reports the missing kinds.
    let dev = MemBackend::new(4 * 4096 + 4 * MD_BLOCK_BYTES as u64);
    dev.write_at(&header(), 0).unwrap();
    let mut dl = vec![0u8; MD_BLOCK_BYTES];
    dl[220..224].copy_from_slice(&8192u32.to_le_bytes());
    seal(&mut dl);
    dev.write_at(&dl, 4096).unwrap();
    let mut gd = [0u8; VOL_GROUPS_DESCRIPTOR_BYTES];
    gd[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    gd[32..40].copy_from_slice(&4u64.to_le_bytes());
    dev.write_at(&gd, 12288).unwrap();
    let e = read_params(&dev).unwrap_err();
    assert!(e.to_string().contains("0x0019"), "{e}");
}
