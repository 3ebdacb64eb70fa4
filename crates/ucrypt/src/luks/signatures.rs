//! Signatures of other formats (filesystems, volume managers, partition tables) at their
//! fixed places, as `blkid` would find them: a LUKS2 header whose copy needs recovery is
//! not recovered over one, because the device may have been reused and the surviving LUKS2
//! copy be a stale leftover (cryptsetup's "ambiguous signatures" rule; `repair` recovers
//! it anyway, on the user's word). Sans I/O: bytes from offset 0 in, a name out.

/// One signature: `magic` at `offset` bytes from the start of the device.
struct Signature {
    name: &'static str,
    offset: usize,
    magic: &'static [u8],
}

const fn sig(name: &'static str, offset: usize, magic: &'static [u8]) -> Signature {
    Signature {
        name,
        offset,
        magic,
    }
}

/// The signatures looked for, named as blkid names them. Each magic is at least four bytes
/// at an offset no LUKS2 binary header or JSON area gives such bytes (the binary header's
/// padding is zero; the JSON area is text from offset 4096 on).
const SIGNATURES: &[Signature] = &[
    // LVM2 physical volume: the label in one of the first four sectors.
    sig("LVM2_member", 24, b"LVM2 001"),
    sig("LVM2_member", 512 + 24, b"LVM2 001"),
    sig("LVM2_member", 1024 + 24, b"LVM2 001"),
    sig("LVM2_member", 1536 + 24, b"LVM2 001"),
    sig("xfs", 0, b"XFSB"),
    sig("squashfs", 0, b"hsqs"),
    sig("ntfs", 3, b"NTFS    "),
    sig("exfat", 3, b"EXFAT   "),
    sig("BitLocker", 3, b"-FVE-FS-"),
    sig("vfat", 54, b"FAT12   "),
    sig("vfat", 54, b"FAT16   "),
    sig("vfat", 82, b"FAT32   "),
    sig("gpt", 512, b"EFI PART"),
    sig("f2fs", 1024, &[0x10, 0x20, 0xf5, 0xf2]),
    // md RAID superblocks 1.1 (at 0) and 1.2 (at 4 KiB).
    sig("linux_raid_member", 0, &[0xfc, 0x4e, 0x2b, 0xa9]),
    sig("linux_raid_member", 4096, &[0xfc, 0x4e, 0x2b, 0xa9]),
    sig("swap", 4096 - 10, b"SWAPSPACE2"),
    sig("swap", 4096 - 10, b"SWAP-SPACE"),
    sig("iso9660", 32769, b"CD001"),
    sig("btrfs", 65536 + 64, b"_BHRfS_M"),
];

/// ext2/3/4: the superblock's magic 0xEF53 at 1080, with a sane revision level and block size
/// (two bytes alone are too weak a sign).
fn ext(bytes: &[u8]) -> bool {
    let le32 = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    bytes.get(1080..1082) == Some(&[0x53, 0xef])
        && le32(1024 + 24).is_some_and(|log_block| log_block <= 6)
        && le32(1024 + 76).is_some_and(|rev| rev <= 1)
}

/// The first foreign signature in `bytes` (the device from offset 0; what is past its end is
/// not looked at), by blkid's name.
pub fn foreign_signature(bytes: &[u8]) -> Option<&'static str> {
    if ext(bytes) {
        return Some("ext4");
    }
    SIGNATURES
        .iter()
        .find(|s| bytes.get(s.offset..s.offset + s.magic.len()) == Some(s.magic))
        .map(|s| s.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_signature_is_found_and_zeroes_carry_none() {
        assert_eq!(foreign_signature(&[0u8; 70_000]), None);
        assert_eq!(foreign_signature(&[]), None);
        for s in SIGNATURES {
            let mut b = vec![0u8; 70_000];
            b[s.offset..s.offset + s.magic.len()].copy_from_slice(s.magic);
            assert_eq!(
                foreign_signature(&b),
                Some(s.name),
                "{} at {}",
                s.name,
                s.offset
            );
            // Cut short before the magic ends: not found, no panic.
            assert_eq!(foreign_signature(&b[..s.offset + s.magic.len() - 1]), None);
        }
        let mut b = vec![0u8; 4096];
        b[1080..1082].copy_from_slice(&[0x53, 0xef]);
        b[1024 + 76] = 1;
        assert_eq!(foreign_signature(&b), Some("ext4"));
        b[1024 + 76] = 9;
        assert_eq!(
            foreign_signature(&b),
            None,
            "an insane revision is no ext superblock"
        );
    }
}
