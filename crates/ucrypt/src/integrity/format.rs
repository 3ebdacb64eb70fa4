//! A new dm-integrity superblock, with the parameters the kernel chooses when cryptsetup
//! formats a LUKS2 volume with integrity (sans I/O): version 4 with fixed padding (version 1
//! without it: cryptsetup's `--integrity-legacy-padding`), 2^15-sector interleave, the default
//! journal size and the largest data area that fits.

use super::layout::{
    Layout, JOURNAL_BLOCK_SECTORS, JOURNAL_ENTRY_ROUNDUP_BYTES, JOURNAL_SECTOR_DATA_BYTES,
};
use super::superblock::{flags, Superblock, SB_SECTORS};
use crate::{Error, Result};

/// The kernel's default interleave: 2^15 sectors (16 MiB) of data per metadata run.
pub const DEFAULT_LOG2_INTERLEAVE_SECTORS: u8 = 15;
/// The kernel's default journal: the device's size shifted right by this...
pub const DEFAULT_JOURNAL_SIZE_FACTOR: u32 = 7;
/// ...at most this many sectors (64 MiB).
pub const DEFAULT_MAX_JOURNAL_SECTORS: u64 = 131_072;
/// log2 of the kernel's default sectors per bitmap bit (32768).
pub const DEFAULT_LOG2_SECTORS_PER_BITMAP_BIT: u8 = 15;
/// The superblock version the kernel writes with fixed padding and no journal MAC.
pub const FORMAT_VERSION: u8 = 4;
/// The version it writes without fixed padding (its `fix_padding` option not given), no
/// journal MAC, no bitmap and no recalculation.
pub const FORMAT_VERSION_LEGACY_PADDING: u8 = 1;

/// The superblock (and its layout) the kernel writes for a dm-integrity device starting at
/// `start_sectors` of a device of `device_sectors` 512-byte sectors, keeping `tag_bytes` per
/// block of `block_bytes`. As the kernel: the journal is `device_sectors >> 7` sectors (at
/// most 64 MiB) in whole sections (at least one); the provided data sectors are the largest
/// multiple of 8 that fits; bitmap bits cover 2^15 sectors, or more if the journal area
/// could not hold the bitmap. `fixed_padding`: the kernel's `fix_padding` option, which
/// cryptsetup passes unless `--integrity-legacy-padding` is given.
pub fn new_superblock(
    tag_bytes: u16,
    block_bytes: u32,
    start_sectors: u64,
    device_sectors: u64,
    fixed_padding: bool,
) -> Result<Layout> {
    let log2_sectors_per_block = match block_bytes {
        512 => 0,
        1024 => 1,
        2048 => 2,
        4096 => 3,
        b => {
            return Err(Error::InvalidArgument(format!(
                "integrity block size {b} (512, 1024, 2048 or 4096)"
            )))
        }
    };
    let mut sb = Superblock {
        version: if fixed_padding {
            FORMAT_VERSION
        } else {
            FORMAT_VERSION_LEGACY_PADDING
        },
        log2_interleave_sectors: DEFAULT_LOG2_INTERLEAVE_SECTORS,
        tag_bytes,
        journal_sections: 1,
        // Placeholder for the layout's geometry; replaced below.
        provided_data_sectors: 1 << log2_sectors_per_block,
        flags: if fixed_padding {
            flags::FIXED_PADDING
        } else {
            0
        },
        log2_sectors_per_block,
        log2_blocks_per_bitmap_bit: 0,
        recalc_sector: 0,
        salt: [0; 16],
    };
    let section = Layout::new(sb)?.journal_section_sectors;
    let journal_sectors =
        (device_sectors >> DEFAULT_JOURNAL_SIZE_FACTOR).min(DEFAULT_MAX_JOURNAL_SECTORS);
    sb.journal_sections = u32::try_from((journal_sectors / section).max(1))
        .map_err(|_| Error::InvalidArgument("integrity journal too large".into()))?;
    let provided = Layout::new(sb)?.max_provided_sectors(start_sectors, device_sectors);
    if provided < u64::from(block_bytes / 512) || start_sectors + SB_SECTORS >= device_sectors {
        return Err(Error::InvalidArgument(format!(
            "the device ({device_sectors} sectors) is too small for dm-integrity at sector \
             {start_sectors}"
        )));
    }
    sb.provided_data_sectors = provided;
    let bits_in_journal =
        ((section * u64::from(sb.journal_sections)) << (9 + 3)).min(u64::from(u32::MAX));
    let mut log2_sectors_per_bit = DEFAULT_LOG2_SECTORS_PER_BITMAP_BIT;
    while bits_in_journal < provided.div_ceil(1 << log2_sectors_per_bit) {
        log2_sectors_per_bit += 1;
    }
    sb.log2_blocks_per_bitmap_bit = log2_sectors_per_bit - log2_sectors_per_block;
    let l = Layout::for_device(sb, start_sectors, device_sectors)?;
    Ok(l)
}

/// The kernel's commit id of journal sequence 0; the id of sector `j` of section `i` is this
/// xor `(i << 32) ^ j`, stored little-endian in the last 8 bytes of every journal sector.
pub const COMMIT_ID_SEQ0: u64 = 0x1111_1111_1111_1111;
/// An unused journal entry has all ones in the high half of its target sector (bytes 4..8).
const ENTRY_UNUSED_HI: [u8; 4] = [0xff; 4];

/// Journal section `i` as the kernel initialises it when it formats (sequence 0, every entry
/// unused, no journal encryption or MAC). The kernel checks every journal sector's commit id
/// when it activates the device, also in direct mode, and fails all I/O on a mismatch: a
/// zeroed journal is not accepted.
pub fn initial_journal_section(l: &Layout, i: u32) -> Vec<u8> {
    let sb = &l.sb;
    let spb = 1u32 << sb.log2_sectors_per_block;
    let entry = (8 + 8 * spb + u32::from(sb.tag_bytes))
        .next_multiple_of(JOURNAL_ENTRY_ROUNDUP_BYTES) as usize;
    let per_sector = (JOURNAL_SECTOR_DATA_BYTES as usize) / entry;
    let mut out = vec![0u8; (l.journal_section_sectors * 512) as usize];
    for j in 0..l.journal_section_sectors {
        let id = COMMIT_ID_SEQ0 ^ ((u64::from(i) << 32) ^ j);
        let end = ((j + 1) * 512) as usize;
        out[end - 8..end].copy_from_slice(&id.to_le_bytes());
    }
    // Entry n lies in sector n % 8 at n / 8 entries from its start.
    for n in 0..per_sector * JOURNAL_BLOCK_SECTORS as usize {
        let at = (n % JOURNAL_BLOCK_SECTORS as usize) * 512
            + (n / JOURNAL_BLOCK_SECTORS as usize) * entry;
        out[at + 4..at + 8].copy_from_slice(&ENTRY_UNUSED_HI);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The superblocks the kernel wrote for cryptsetup 2.6.1 on Linux 6.1 (48 MiB devices,
    /// superblock at 16 MiB): journal sections and provided sectors as the kernel chose them.
    #[test]
    fn matches_the_kernel_on_real_volumes() {
        // (what, tag, block, kernel journal sections, kernel provided)
        let rows: &[(&str, u16, u32, u32, u64)] = &[
            ("xts-random+hmac-sha256, 512", 48, 512, 12, 58616),
            ("xts-random+hmac-sha256, 4096", 48, 4096, 2, 64232),
            ("gcm-random aead, 4096", 28, 4096, 2, 64552),
        ];
        for &(what, tag, block, js, provided) in rows {
            let l = new_superblock(tag, block, 32768, 98304, true).expect(what);
            assert_eq!(l.sb.journal_sections, js, "{what}");
            assert_eq!(l.sb.provided_data_sectors, provided, "{what}");
            assert_eq!(l.sb.version, 4, "{what}");
            assert_eq!(l.sb.flags, flags::FIXED_PADDING, "{what}");
            assert_eq!(
                l.sb.log2_blocks_per_bitmap_bit,
                15 - l.sb.log2_sectors_per_block,
                "{what}"
            );
        }
    }

    /// The kernel's bytes for the first row (superblock.rs's KERNEL_SB_HMAC512).
    #[test]
    fn writes_the_kernel_superblock_bytes() {
        let l = new_superblock(48, 512, 32768, 98304, true).expect("layout");
        let want = "696e746567727400040f30000c000000f8e400000000000008000000000f0000";
        let got: String = l.sb.serialize()[..32]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(got, want);
    }

    /// The journal (2 sections of 264 sectors) the kernel wrote when cryptsetup 2.6.1 formatted
    /// `--cipher aes-gcm-random --integrity aead --sector-size 4096` on a 48 MiB device under
    /// Linux 6.1: its SHA-256, read from the device.
    #[test]
    fn writes_the_kernel_journal_bytes() {
        use sha2::Digest as _;
        let l = new_superblock(28, 4096, 32768, 98304, true).expect("layout");
        let mut h = sha2::Sha256::new();
        for i in 0..l.sb.journal_sections {
            h.update(initial_journal_section(&l, i));
        }
        let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            got,
            "3050e1f38618b00125faf975b2cf9519228e1170b56975e4b92e6558dd180e43"
        );
    }

    #[test]
    fn refuses_a_device_too_small() {
        assert!(new_superblock(28, 4096, 32768, 32768 + 64, true).is_err());
    }
}
