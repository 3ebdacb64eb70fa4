//! dm-integrity's superblock: the first 4 KiB of an integrity device (for LUKS2, at the data
//! segment's offset), parsed once into a [`Superblock`] and written back byte for byte.
//!
//! Little-endian, packed, 64 bytes used, the rest of the 4 KiB zero:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `integrt\0` |
//! | 8 | version (1..=5 understood here) |
//! | 9 | log2 of the interleave sectors (size of a data area, in 512-byte sectors) |
//! | 10..12 | tag bytes per block |
//! | 12..16 | journal sections |
//! | 16..24 | provided data sectors (512-byte sectors the device offers) |
//! | 24..28 | flags |
//! | 28 | log2 of 512-byte sectors per block (0 for 512-byte blocks, 3 for 4096) |
//! | 29 | log2 of blocks per bitmap bit (bitmap mode) |
//! | 30..32 | padding |
//! | 32..40 | recalculation position (with the recalculating flag) |
//! | 40..48 | padding |
//! | 48..64 | salt (with the fixed-HMAC flag) |

use crate::{Error, Result};

/// The superblock occupies this many 512-byte sectors before the journal.
pub const SB_SECTORS: u64 = 8;
/// Bytes the superblock occupies on disk (all but the first 64 are zero).
pub const SB_BYTES: usize = 4096;
/// Bytes of the superblock that carry fields.
pub const SB_FIELDS_BYTES: usize = 64;
pub const SB_MAGIC: &[u8; 8] = b"integrt\0";
/// The newest on-disk version this code understands. Version 6 (inline tags on devices with
/// per-sector metadata) has no journal or tag area of this layout and is refused.
pub const SB_VERSION_MAX: u8 = 5;

/// Flag bits of [`Superblock::flags`].
pub mod flags {
    /// The journal carries a MAC per sector (journal_integrity set).
    pub const HAVE_JOURNAL_MAC: u32 = 1 << 0;
    /// Tags are being recalculated from `recalc_sector` on (version 2+).
    pub const RECALCULATING: u32 = 1 << 1;
    /// The bitmap is dirty (bitmap mode, version 3+).
    pub const DIRTY_BITMAP: u32 = 1 << 2;
    /// Metadata runs are padded to 4 KiB rather than to 128 KiB (version 4+). cryptsetup sets
    /// it on every new LUKS2 volume.
    pub const FIXED_PADDING: u32 = 1 << 3;
    /// The journal MAC covers the superblock salt (version 5+).
    pub const FIXED_HMAC: u32 = 1 << 4;
    pub const KNOWN: u32 =
        HAVE_JOURNAL_MAC | RECALCULATING | DIRTY_BITMAP | FIXED_PADDING | FIXED_HMAC;
}

/// Smallest and largest log2 interleave the kernel accepts (8 sectors .. 2^31 sectors).
pub const LOG2_INTERLEAVE_MIN: u8 = 3;
pub const LOG2_INTERLEAVE_MAX: u8 = 31;
/// Blocks are 512..=4096 bytes: log2 of sectors per block 0..=3.
pub const LOG2_SECTORS_PER_BLOCK_MAX: u8 = 3;

/// A dm-integrity superblock, every on-disk field as it is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub version: u8,
    pub log2_interleave_sectors: u8,
    pub tag_bytes: u16,
    pub journal_sections: u32,
    pub provided_data_sectors: u64,
    pub flags: u32,
    pub log2_sectors_per_block: u8,
    pub log2_blocks_per_bitmap_bit: u8,
    pub recalc_sector: u64,
    pub salt: [u8; 16],
}

fn bad(check: &'static str, detail: String) -> Error {
    Error::BadHeader { check, detail }
}

impl Superblock {
    /// Parses and checks the superblock from the first bytes of an integrity device (at least
    /// [`SB_FIELDS_BYTES`]).
    pub fn parse(b: &[u8]) -> Result<Self> {
        if b.len() < SB_FIELDS_BYTES {
            return Err(bad(
                "integrity superblock",
                format!("{} bytes, need {SB_FIELDS_BYTES}", b.len()),
            ));
        }
        if &b[0..8] != SB_MAGIC {
            return Err(bad(
                "integrity superblock magic",
                "no \"integrt\" superblock at the data offset".into(),
            ));
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let sb = Superblock {
            version: b[8],
            log2_interleave_sectors: b[9],
            tag_bytes: u16_at(10),
            journal_sections: u32_at(12),
            provided_data_sectors: u64_at(16),
            flags: u32_at(24),
            log2_sectors_per_block: b[28],
            log2_blocks_per_bitmap_bit: b[29],
            recalc_sector: u64_at(32),
            salt: b[48..64].try_into().expect("16 bytes"),
        };
        sb.check()?;
        Ok(sb)
    }

    /// The checks the kernel makes before it trusts a superblock, plus the ones this layout
    /// code relies on.
    pub fn check(&self) -> Result<()> {
        if self.version == 0 || self.version > SB_VERSION_MAX {
            return Err(bad(
                "integrity superblock version",
                format!(
                    "version {} (ucrypt reads 1..={SB_VERSION_MAX})",
                    self.version
                ),
            ));
        }
        if !(LOG2_INTERLEAVE_MIN..=LOG2_INTERLEAVE_MAX).contains(&self.log2_interleave_sectors) {
            return Err(bad(
                "integrity interleave",
                format!("log2 interleave sectors {}", self.log2_interleave_sectors),
            ));
        }
        if self.tag_bytes == 0 {
            return Err(bad("integrity tag size", "tag size 0".into()));
        }
        if self.log2_sectors_per_block > LOG2_SECTORS_PER_BLOCK_MAX
            || self.log2_sectors_per_block > self.log2_interleave_sectors
        {
            return Err(bad(
                "integrity block size",
                format!("log2 sectors per block {}", self.log2_sectors_per_block),
            ));
        }
        if self.flags & !flags::KNOWN != 0 {
            return Err(bad(
                "integrity flags",
                format!("unknown flags {:#x}", self.flags & !flags::KNOWN),
            ));
        }
        if self.provided_data_sectors == 0
            || self.provided_data_sectors & ((1 << self.log2_sectors_per_block) - 1) != 0
        {
            return Err(bad(
                "integrity provided data sectors",
                format!(
                    "{} is not a positive multiple of the block",
                    self.provided_data_sectors
                ),
            ));
        }
        if self.journal_sections == 0 {
            return Err(bad("integrity journal", "zero journal sections".into()));
        }
        Ok(())
    }

    /// The 4 KiB on-disk image.
    pub fn serialize(&self) -> [u8; SB_BYTES] {
        let mut b = [0u8; SB_BYTES];
        b[0..8].copy_from_slice(SB_MAGIC);
        b[8] = self.version;
        b[9] = self.log2_interleave_sectors;
        b[10..12].copy_from_slice(&self.tag_bytes.to_le_bytes());
        b[12..16].copy_from_slice(&self.journal_sections.to_le_bytes());
        b[16..24].copy_from_slice(&self.provided_data_sectors.to_le_bytes());
        b[24..28].copy_from_slice(&self.flags.to_le_bytes());
        b[28] = self.log2_sectors_per_block;
        b[29] = self.log2_blocks_per_bitmap_bit;
        b[32..40].copy_from_slice(&self.recalc_sector.to_le_bytes());
        b[48..64].copy_from_slice(&self.salt);
        b
    }

    /// Block size in bytes (the dm-crypt sector size above it).
    pub fn block_bytes(&self) -> u32 {
        512 << self.log2_sectors_per_block
    }

    pub fn interleave_sectors(&self) -> u64 {
        1 << self.log2_interleave_sectors
    }

    pub fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }

    /// Flag names, for `dump`.
    pub fn flag_names(&self) -> Vec<&'static str> {
        [
            (flags::HAVE_JOURNAL_MAC, "journal_mac"),
            (flags::RECALCULATING, "recalculating"),
            (flags::DIRTY_BITMAP, "dirty_bitmap"),
            (flags::FIXED_PADDING, "fix_padding"),
            (flags::FIXED_HMAC, "fix_hmac"),
        ]
        .into_iter()
        .filter(|(f, _)| self.has(*f))
        .map(|(_, n)| n)
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first 64 bytes of the superblock the kernel (Linux 6.1) wrote under cryptsetup 2.6.1
    /// `luksFormat --cipher aes-xts-random --integrity hmac-sha256 --sector-size 512` on a
    /// 48 MiB device.
    const KERNEL_SB_HMAC512: &str = "696e746567727400040f30000c000000f8e400000000000008000000000f0000\
                                     0000000000000000000000000000000000000000000000000000000000000000";

    use crate::test_util::unhex as hex;

    #[test]
    fn parses_kernel_superblock_and_writes_it_back() {
        let raw = hex(KERNEL_SB_HMAC512);
        let sb = Superblock::parse(&raw).expect("parse");
        assert_eq!(sb.version, 4);
        assert_eq!(sb.log2_interleave_sectors, 15);
        assert_eq!(sb.tag_bytes, 48);
        assert_eq!(sb.journal_sections, 12);
        assert_eq!(sb.provided_data_sectors, 58616);
        assert_eq!(sb.flags, flags::FIXED_PADDING);
        assert_eq!(sb.log2_sectors_per_block, 0);
        assert_eq!(sb.log2_blocks_per_bitmap_bit, 15);
        let out = sb.serialize();
        assert_eq!(&out[..64], &raw[..]);
        assert!(out[64..].iter().all(|&b| b == 0));
    }

    #[test]
    fn refuses_bad_superblocks() {
        let good = hex(KERNEL_SB_HMAC512);
        let cases: &[(usize, u8, &str)] = &[
            (0, b'x', "magic"),
            (8, 0, "version"),
            (8, 6, "version"),
            (9, 2, "interleave"),
            (9, 32, "interleave"),
            (28, 4, "block size"),
            (27, 0x80, "flags"),
        ];
        for &(at, v, what) in cases {
            let mut b = good.clone();
            b[at] = v;
            let e = Superblock::parse(&b).expect_err(what);
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        let mut b = good.clone();
        b[10] = 0;
        b[11] = 0;
        assert!(Superblock::parse(&b).is_err(), "tag size 0");
        assert!(Superblock::parse(&good[..63]).is_err(), "short");
    }
}
