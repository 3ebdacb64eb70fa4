//! Hostile and synthetic metadata: every malformed input ends in a typed error (no panic, no
//! hang), and the pieces with fixed answers (recovery keys, AES-CCM, segments) give them.

use super::entries::parse_entries;
use super::entries::TAG_BYTES;
use super::keys::ccm_decrypt;
use super::*;

/// A boot sector of a normal BitLocker volume with its metadata at 64 KiB, 1 MiB and 2 MiB.
fn boot_sector() -> Vec<u8> {
    let mut b = vec![0u8; BOOT_SECTOR_BYTES];
    b[..3].copy_from_slice(BOOTCODE_V2);
    b[3..11].copy_from_slice(SIGNATURE);
    b[11..13].copy_from_slice(&512u16.to_le_bytes());
    b[METADATA_OFFSET..METADATA_OFFSET + 16].copy_from_slice(&GUID_NORMAL);
    for (i, o) in [0x1_0000u64, 0x10_0000, 0x20_0000].iter().enumerate() {
        let at = METADATA_OFFSET + 16 + 8 * i;
        b[at..at + 8].copy_from_slice(&o.to_le_bytes());
    }
    b
}

fn entry(kind: u16, value: u16, data: &[u8]) -> Vec<u8> {
    let mut e = Vec::new();
    e.extend_from_slice(&((8 + data.len()) as u16).to_le_bytes());
    e.extend_from_slice(&kind.to_le_bytes());
    e.extend_from_slice(&value.to_le_bytes());
    e.extend_from_slice(&1u16.to_le_bytes());
    e.extend_from_slice(data);
    e
}

/// FVE metadata with `entries` after the headers.
fn fve(entries: &[u8], encryption: u16) -> Vec<u8> {
    let mut f = vec![0u8; FVE_BLOCK_HEADER_BYTES + FVE_HEADER_BYTES];
    f[..8].copy_from_slice(SIGNATURE);
    f[10..12].copy_from_slice(&2u16.to_le_bytes());
    f[12..14].copy_from_slice(&STATE_NORMAL.to_le_bytes());
    f[14..16].copy_from_slice(&STATE_NORMAL.to_le_bytes());
    f[16..24].copy_from_slice(&(100u64 << 20).to_le_bytes());
    let h = FVE_BLOCK_HEADER_BYTES;
    f[h..h + 4].copy_from_slice(&((FVE_HEADER_BYTES + entries.len()) as u32).to_le_bytes());
    f[h + 36..h + 38].copy_from_slice(&encryption.to_le_bytes());
    f.extend_from_slice(entries);
    f
}

fn fvek_entry() -> Vec<u8> {
    entry(3, 5, &[0u8; 12 + 16 + 44])
}

#[test]
fn good_synthetic_metadata_parses() {
    let bs = parse_boot_sector(&boot_sector()).unwrap();
    assert_eq!(bs.metadata_offsets, [0x1_0000, 0x10_0000, 0x20_0000]);
    let mut entries = fvek_entry();
    entries.extend(entry(
        0xf,
        0xf,
        &[0x00, 0x20, 0, 0, 0, 0, 0, 0, 0x00, 0x20, 0, 0, 0, 0, 0, 0],
    ));
    let m = parse_metadata(&bs, &fve(&entries, 0x8004)).unwrap();
    assert_eq!(m.encryption, Encryption::Xts { aes_bits: 128 });
    assert_eq!(
        (m.volume_header_offset, m.volume_header_bytes),
        (0x2000, 0x2000)
    );
    assert!(m.check_activation().is_ok());
    let segs = segments(&m, 100 << 20).unwrap();
    assert_eq!(
        segs[0],
        Segment {
            offset: 0,
            len: 0x2000,
            kind: SegmentKind::Crypt {
                device_offset: 0x2000
            }
        }
    );
    assert_eq!(segs[1].kind, SegmentKind::Zero);
    let covered: u64 = segs.iter().map(|s| s.len).sum();
    assert_eq!(covered, 100 << 20);
}

/// (name, boot sector mutation, FVE bytes, what must come out)
#[test]
fn hostile_table() {
    let bs = parse_boot_sector(&boot_sector()).unwrap();
    let good = fvek_entry();
    let malformed_check = |r: std::result::Result<Metadata, BitlkError>, want: &str| match r {
        Err(BitlkError::Malformed { check, .. }) => assert_eq!(check, want),
        other => panic!("{want}: {other:?}"),
    };
    // Truncated: nothing past the headers, and entries cut short.
    assert!(matches!(
        parse_metadata(&bs, &fve(&good, 0x8004)[..50]),
        Err(BitlkError::Refused(_))
    ));
    let full = fve(&good, 0x8004);
    assert!(matches!(
        parse_metadata(&bs, &full[..full.len() - 10]),
        Err(BitlkError::Refused(_))
    ));
    // Metadata size below the minimum and above 64 KiB.
    for size in [10u32, 0x1_0001, u32::MAX] {
        let mut f = fve(&good, 0x8004);
        f[64..68].copy_from_slice(&size.to_le_bytes());
        malformed_check(parse_metadata(&bs, &f), "metadata size");
    }
    // An entry larger than what is left.
    let mut big = good.clone();
    big[..2].copy_from_slice(&0xffffu16.to_le_bytes());
    malformed_check(parse_metadata(&bs, &fve(&big, 0x8004)), "entry size");
    // Entries of size 4 (shorter than their own header) over the whole area: the walk ends,
    // no FVEK found.
    let tiny: Vec<u8> = [4u8, 0, 0, 0].repeat(1024);
    malformed_check(parse_metadata(&bs, &fve(&tiny, 0x8004)), "FVEK");
    // A VMK whose properties claim more than the entry.
    let mut vmk = vec![0u8; 28];
    vmk[26..28].copy_from_slice(&0x2000u16.to_le_bytes());
    vmk.extend_from_slice(&[0xff, 0x7f, 0, 0, 3, 0, 1, 0]);
    let mut entries = entry(2, 8, &vmk);
    entries.extend(&good);
    malformed_check(parse_metadata(&bs, &fve(&entries, 0x8004)), "entry size");
    // A VMK entry shorter than its own header.
    let entries = entry(2, 8, &[0u8; 10]);
    malformed_check(parse_metadata(&bs, &fve(&entries, 0x8004)), "VMK entry");
    // An FVEK shorter than nonce and tag.
    let entries = entry(3, 5, &[0u8; 20]);
    malformed_check(parse_metadata(&bs, &fve(&entries, 0x8004)), "FVEK entry");
    // Unknown encryption type: cryptsetup's words.
    assert_eq!(
        parse_metadata(&bs, &fve(&good, 0x1234)),
        Err(BitlkError::Refused(
            "Unknown or unsupported encryption type.".into()
        ))
    );
    // A volume header entry at the very end, its offsets cut off.
    let mut entries = good.clone();
    entries.extend(&[12, 0, 0xf, 0, 0xf, 0, 1, 0, 0, 0, 0, 0]);
    malformed_check(
        parse_metadata(&bs, &fve(&entries, 0x8004)),
        "volume header entry",
    );
}

#[test]
fn every_truncation_of_good_metadata_is_an_error() {
    let bs = parse_boot_sector(&boot_sector()).unwrap();
    let full = fve(&fvek_entry(), 0x8004);
    for n in 0..full.len() {
        assert!(parse_metadata(&bs, &full[..n]).is_err(), "{n} bytes");
    }
    for n in 0..BOOT_SECTOR_BYTES {
        assert!(parse_boot_sector(&boot_sector()[..n]).is_err());
    }
}

#[test]
fn random_entry_areas_never_panic() {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..2000 {
        let mut area = vec![0u8; (x % 600) as usize];
        for b in area.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        // Small sizes and the VMK/FVEK types, so the nested walks run too.
        for at in (0..area.len().saturating_sub(4)).step_by(37) {
            area[at] = (x % 90) as u8;
            area[at + 1] = 0;
            area[at + 2] = [2, 3, 7, 0xf][(x % 4) as usize];
            area[at + 3] = 0;
        }
        let _ = parse_entries(&area);
    }
}

#[test]
fn boot_sector_refusals() {
    let mut b = boot_sector();
    b[..3].copy_from_slice(BOOTCODE_V1);
    assert_eq!(
        parse_boot_sector(&b),
        Err(BitlkError::Refused(
            "BITLK version 1 is currently not supported.".into()
        ))
    );
    let mut b = boot_sector();
    b[11..13].copy_from_slice(&1024u16.to_le_bytes());
    assert_eq!(
        parse_boot_sector(&b),
        Err(BitlkError::Refused("Unsupported sector size 1024.".into()))
    );
    let mut b = boot_sector();
    b[3] = b'X';
    assert!(matches!(
        parse_boot_sector(&b),
        Err(BitlkError::Malformed {
            check: "signature",
            ..
        })
    ));
}

#[test]
fn recovery_passphrase_rows() {
    let ok = "042647-302313-590458-071500-554323-116567-412181-516978";
    let k = recovery_key(ok.as_bytes()).unwrap();
    assert_eq!(
        &k.as_ref()[..4],
        &[
            (42647u32 / 11) as u8,
            ((42647u32 / 11) >> 8) as u8,
            (302313u32 / 11) as u8,
            ((302313u32 / 11) >> 8) as u8
        ]
    );
    assert!(recovery_key(format!("{ok}\n").as_bytes()).is_some());
    // Not a multiple of 11, a wrong separator, a wrong length.
    assert!(recovery_key(b"042648-302313-590458-071500-554323-116567-412181-516978").is_none());
    assert!(recovery_key(b"042647+302313-590458-071500-554323-116567-412181-516978").is_none());
    assert!(recovery_key(b"042647-302313").is_none());
    assert!(recovery_key(b"anaconda").is_none());
}

/// RFC 3610's packet vector 1 has an 8-byte tag and a 13-byte nonce; BitLocker's CCM is fixed
/// at 12 and 16, so the check is a round trip through an independent encryption written here
/// from NIST SP 800-38C's definition, and a flipped tag bit refused.
#[test]
fn ccm_round_trip_and_tag() {
    use crate::sector::block::Ecb;
    let key = [7u8; 32];
    let nonce = [9u8; 12];
    let plain: Vec<u8> = (0..44u8).collect();
    let mut aes = Ecb::new(crate::sector::BlockCipher::Aes, &key).unwrap();
    let mut ctr = |i: u32| {
        let mut a = [0u8; 16];
        a[0] = 2;
        a[1..13].copy_from_slice(&nonce);
        a[13..].copy_from_slice(&i.to_be_bytes()[1..]);
        aes.encrypt_block(&mut a).unwrap();
        a
    };
    let mut ct = plain.clone();
    for (i, c) in ct.chunks_mut(16).enumerate() {
        let s = ctr(i as u32 + 1);
        for (x, y) in c.iter_mut().zip(s) {
            *x ^= y;
        }
    }
    let s0 = ctr(0);
    let mut aes = Ecb::new(crate::sector::BlockCipher::Aes, &key).unwrap();
    let mut mac = [0u8; 16];
    mac[0] = 0x3a;
    mac[1..13].copy_from_slice(&nonce);
    mac[15] = plain.len() as u8;
    aes.encrypt_block(&mut mac).unwrap();
    for c in plain.chunks(16) {
        for (m, p) in mac.iter_mut().zip(c) {
            *m ^= p;
        }
        aes.encrypt_block(&mut mac).unwrap();
    }
    let mut tag = [0u8; TAG_BYTES];
    for i in 0..16 {
        tag[i] = mac[i] ^ s0[i];
    }
    let mut k = CcmKey {
        nonce,
        tag,
        ciphertext: ct,
    };
    assert_eq!(ccm_decrypt(&key, &k).unwrap().as_ref(), &plain[..]);
    k.tag[3] ^= 1;
    assert_eq!(ccm_decrypt(&key, &k).unwrap_err(), BitlkError::WrongKey);
}

#[test]
fn overlapping_segments_refused() {
    let bs = parse_boot_sector(&boot_sector()).unwrap();
    let mut entries = fvek_entry();
    // The moved header's place overlaps the first metadata area.
    entries.extend(entry(
        0xf,
        0xf,
        &[
            0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0x00, 0x20, 0, 0, 0, 0, 0, 0,
        ],
    ));
    let mut m = parse_metadata(&bs, &fve(&entries, 0x8004)).unwrap();
    m.volume_header_offset = 0x1_1000;
    assert!(matches!(
        segments(&m, 100 << 20),
        Err(BitlkError::Malformed {
            check: "segments",
            ..
        })
    ));
    m.volume_header_offset = u64::MAX - 10;
    assert!(segments(&m, 100 << 20).is_err());
}
