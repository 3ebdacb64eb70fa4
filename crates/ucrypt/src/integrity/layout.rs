//! Where dm-integrity keeps each block's data and tag, computed as the kernel computes it
//! (stand-alone metadata, no separate metadata device, tags not inline).
//!
//! From the start of the integrity device (for LUKS2, the data segment offset), in 512-byte
//! sectors:
//!
//! ```text
//! [superblock: 8][journal: sections x section sectors][tags 0][data 0][tags 1][data 1]...
//! ```
//!
//! Each data area holds `2^log2_interleave_sectors` sectors (the last may be shorter) and is
//! preceded by a metadata run holding the tags of its blocks back to back, `tag_bytes` each,
//! padded to 4 KiB (with the fixed-padding flag) or to 128 KiB (volumes made before it).

use super::superblock::{flags, Superblock, SB_SECTORS};
use crate::{Error, Result};

/// Journal geometry constants of dm-integrity's on-disk format.
/// Each journal sector ends with an 8-byte commit id, leaving this for entries.
pub const JOURNAL_SECTOR_DATA_BYTES: u32 = 512 - 8;
/// With a journal MAC, each journal sector gives up this much more.
pub const JOURNAL_MAC_PER_SECTOR_BYTES: u32 = 8;
/// Journal entries are rounded up to this.
pub const JOURNAL_ENTRY_ROUNDUP_BYTES: u32 = 8;
/// A journal section is this many sectors of entries, then one block of data per entry.
pub const JOURNAL_BLOCK_SECTORS: u64 = 8;
/// The kernel keeps this many sectors free after the journal at least.
pub const METADATA_PADDING_SECTORS: u64 = 8;
/// Metadata run padding with [`flags::FIXED_PADDING`], bytes.
pub const METADATA_PAD_FIXED_BYTES: u64 = METADATA_PADDING_SECTORS << 9;
/// Metadata run padding without it (older volumes), bytes.
pub const METADATA_PAD_LEGACY_BYTES: u64 = 512 << METADATA_PADDING_SECTORS;

/// The placement of data and tags on one integrity device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub sb: Superblock,
    /// Sectors of one journal section.
    pub journal_section_sectors: u64,
    /// Superblock + journal, sectors: where the first metadata run starts.
    pub initial_sectors: u64,
    /// Sectors of one metadata run (the tags before each data area, padded).
    pub metadata_run_sectors: u64,
}

/// Where the data and the tags of a run of blocks inside one area lie, in bytes from the start
/// of the integrity device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub data_byte: u64,
    pub tag_byte: u64,
    /// Blocks in the run (all in one area).
    pub blocks: u64,
}

fn bad(check: &'static str, detail: String) -> Error {
    Error::BadHeader { check, detail }
}

/// Sectors of a journal section for these superblock parameters, as the kernel computes it.
fn journal_section_sectors(sb: &Superblock) -> Result<u64> {
    let spb = 1u32 << sb.log2_sectors_per_block;
    // An entry: the 8-byte target sector, the last 8 bytes of each 512-byte sector of the block
    // (their place in the journal block holds the commit id), then the tag.
    let entry =
        (8 + 8 * spb + u32::from(sb.tag_bytes)).next_multiple_of(JOURNAL_ENTRY_ROUNDUP_BYTES);
    let mut space = JOURNAL_SECTOR_DATA_BYTES;
    if sb.has(flags::HAVE_JOURNAL_MAC) {
        space -= JOURNAL_MAC_PER_SECTOR_BYTES;
    }
    let per_sector = u64::from(space / entry);
    if per_sector == 0 {
        return Err(bad(
            "integrity tag size",
            format!(
                "a {}-byte tag leaves no room for a journal entry",
                sb.tag_bytes
            ),
        ));
    }
    let section_entries = per_sector * JOURNAL_BLOCK_SECTORS;
    Ok((section_entries << sb.log2_sectors_per_block) + JOURNAL_BLOCK_SECTORS)
}

impl Layout {
    /// The layout a superblock describes, without checking it against a device size.
    pub fn new(sb: Superblock) -> Result<Self> {
        sb.check()?;
        let journal_section_sectors = journal_section_sectors(&sb)?;
        let initial_sectors = journal_section_sectors
            .checked_mul(u64::from(sb.journal_sections))
            .and_then(|j| j.checked_add(SB_SECTORS))
            .filter(|&i| i <= u64::from(u32::MAX))
            .ok_or_else(|| bad("integrity journal", "journal too large".into()))?;
        let pad = if sb.has(flags::FIXED_PADDING) {
            METADATA_PAD_FIXED_BYTES
        } else {
            METADATA_PAD_LEGACY_BYTES
        };
        let tags_per_area =
            u64::from(sb.tag_bytes) << (sb.log2_interleave_sectors - sb.log2_sectors_per_block);
        let metadata_run_sectors = tags_per_area.next_multiple_of(pad) >> 9;
        Ok(Layout {
            sb,
            journal_section_sectors,
            initial_sectors,
            metadata_run_sectors,
        })
    }

    /// The layout of the superblock found at `start_sectors` on a device of `device_sectors`,
    /// checked as the kernel checks it when it activates the device: the last provided
    /// sector must lie on the device.
    pub fn for_device(sb: Superblock, start_sectors: u64, device_sectors: u64) -> Result<Self> {
        let l = Layout::new(sb)?;
        if !l.fits(start_sectors, device_sectors, sb.provided_data_sectors) {
            return Err(bad(
                "integrity device size",
                format!(
                    "{} provided sectors do not fit a device of {device_sectors} sectors with the \
                     superblock at sector {start_sectors}",
                    sb.provided_data_sectors
                ),
            ));
        }
        Ok(l)
    }

    /// The kernel's test: do `provided` data sectors fit?
    fn fits(&self, start_sectors: u64, device_sectors: u64, provided: u64) -> bool {
        if self.initial_sectors + METADATA_PADDING_SECTORS >= device_sectors || provided == 0 {
            return false;
        }
        match self
            .data_sector(provided - 1)
            .and_then(|s| s.checked_add(start_sectors))
        {
            Some(last) => last >= start_sectors && last < device_sectors,
            None => false,
        }
    }

    /// The provided data sectors the kernel chooses when it formats this superblock at
    /// `start_sectors` on a device of `device_sectors`: the largest multiple of 8 that fits,
    /// found bit by bit from the top as the kernel does. 0 if nothing fits.
    pub fn max_provided_sectors(&self, start_sectors: u64, device_sectors: u64) -> u64 {
        if device_sectors == 0 {
            return 0;
        }
        let top = 63 - device_sectors.leading_zeros();
        let mut provided = 0u64;
        for bit in (3..=top).rev() {
            let trial = provided | 1 << bit;
            if self.fits(start_sectors, device_sectors, trial) {
                provided = trial;
            }
        }
        provided
    }

    fn area_and_offset(&self, sector: u64) -> (u64, u64) {
        let log2 = self.sb.log2_interleave_sectors;
        (sector >> log2, sector & ((1u64 << log2) - 1))
    }

    /// The 512-byte sector (from the device start) holding data sector `sector`.
    pub fn data_sector(&self, sector: u64) -> Option<u64> {
        let (area, offset) = self.area_and_offset(sector);
        (area << self.sb.log2_interleave_sectors)
            .checked_add((area + 1).checked_mul(self.metadata_run_sectors)?)?
            .checked_add(self.initial_sectors)?
            .checked_add(offset)
    }

    /// The byte (from the device start) where the tag of the block holding data sector
    /// `sector` begins.
    pub fn tag_byte(&self, sector: u64) -> Option<u64> {
        let (area, offset) = self.area_and_offset(sector);
        let run = area
            .checked_mul(
                self.sb
                    .interleave_sectors()
                    .checked_add(self.metadata_run_sectors)?,
            )?
            .checked_add(self.initial_sectors)?;
        let block = offset >> self.sb.log2_sectors_per_block;
        run.checked_mul(512)?
            .checked_add(block * u64::from(self.sb.tag_bytes))
    }

    /// The longest run of blocks starting at data sector `sector` (block-aligned) that stays in
    /// one area, at most `blocks_max` blocks.
    pub fn extent(&self, sector: u64, blocks_max: u64) -> Option<Extent> {
        let spb_log2 = self.sb.log2_sectors_per_block;
        debug_assert_eq!(sector & ((1 << spb_log2) - 1), 0);
        let (_, offset) = self.area_and_offset(sector);
        let left_in_area = (self.sb.interleave_sectors() - offset) >> spb_log2;
        let left_on_device = self.sb.provided_data_sectors.checked_sub(sector)? >> spb_log2;
        Some(Extent {
            data_byte: self.data_sector(sector)?.checked_mul(512)?,
            tag_byte: self.tag_byte(sector)?,
            blocks: blocks_max.min(left_in_area).min(left_on_device),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb(tag: u16, log2_spb: u8, journal_sections: u32, provided: u64) -> Superblock {
        Superblock {
            version: 4,
            log2_interleave_sectors: 15,
            tag_bytes: tag,
            journal_sections,
            provided_data_sectors: provided,
            flags: flags::FIXED_PADDING,
            log2_sectors_per_block: log2_spb,
            log2_blocks_per_bitmap_bit: 15 - log2_spb,
            recalc_sector: 0,
            salt: [0; 16],
        }
    }

    /// Rows from volumes cryptsetup 2.6.1 formatted on Linux 6.1 (48 MiB devices, superblock at
    /// 16 MiB): the kernel's table line gave journal_sectors, its superblock gave the provided
    /// sectors; the layout must derive the same.
    #[test]
    fn matches_the_kernel_on_real_volumes() {
        // (what, tag, log2 spb, journal sections, kernel journal sectors, kernel provided)
        let rows: &[(&str, u16, u8, u32, u64, u64)] = &[
            ("xts-random+hmac-sha256, 512", 48, 0, 12, 768, 58616),
            ("xts-random+hmac-sha256, 4096", 48, 3, 2, 528, 64232),
            ("gcm-random aead, 4096", 28, 3, 2, 528, 64552),
        ];
        for &(what, tag, spb, js, journal, provided) in rows {
            let l = Layout::new(sb(tag, spb, js, provided)).expect(what);
            assert_eq!(l.journal_section_sectors * u64::from(js), journal, "{what}");
            assert_eq!(l.max_provided_sectors(32768, 98304), provided, "{what}");
            Layout::for_device(l.sb, 32768, 98304).expect(what);
            assert!(
                Layout::for_device(l.sb, 32768, 98303).is_err(),
                "{what}: one short"
            );
        }
    }

    #[test]
    fn places_tags_before_each_area() {
        // 512-byte blocks, 48-byte tags: a metadata run of 32768 * 48 bytes = 3072 sectors.
        let l = Layout::new(sb(48, 0, 12, 58616)).expect("layout");
        assert_eq!(l.initial_sectors, 8 + 768);
        assert_eq!(l.metadata_run_sectors, 3072);
        assert_eq!(l.tag_byte(0), Some(776 * 512));
        assert_eq!(l.tag_byte(1), Some(776 * 512 + 48));
        assert_eq!(l.data_sector(0), Some(776 + 3072));
        assert_eq!(l.data_sector(32767), Some(776 + 3072 + 32767));
        // Area 1 starts after area 0's data, with its own tags first.
        assert_eq!(l.tag_byte(32768), Some((776 + 3072 + 32768) * 512));
        assert_eq!(l.data_sector(32768), Some(776 + 2 * 3072 + 32768));
        let e = l.extent(32760, 100).expect("extent");
        assert_eq!(e.blocks, 8, "a run stops at the area's end");
        let e = l.extent(58616 - 8, 100).expect("extent");
        assert_eq!(e.blocks, 8, "and at the device's end");
        // 4096-byte blocks: one tag per 8 sectors.
        let l = Layout::new(sb(28, 3, 2, 64552)).expect("layout");
        assert_eq!(l.metadata_run_sectors, 224);
        assert_eq!(l.tag_byte(8), Some(536 * 512 + 28));
    }

    #[test]
    fn legacy_padding_is_128k() {
        let mut s = sb(48, 0, 12, 8);
        s.flags = 0;
        let l = Layout::new(s).expect("layout");
        assert_eq!(
            l.metadata_run_sectors, 3072,
            "1.5 MiB is already a multiple of 128 KiB"
        );
        s.tag_bytes = 4;
        s.log2_interleave_sectors = 10;
        let l = Layout::new(s).expect("layout");
        assert_eq!(l.metadata_run_sectors, 256);
    }
}
