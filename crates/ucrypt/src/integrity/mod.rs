//! Authenticated encryption: LUKS2 volumes whose data segment has an `integrity` object,
//! stored on dm-integrity's on-disk format exactly as cryptsetup and the kernel (dm-crypt over
//! dm-integrity) lay it out, served in userspace.
//!
//! - [`superblock`]: dm-integrity's superblock, parsed and serialised (sans I/O).
//! - [`layout`]: where each block's data and tag live, and the size the kernel provides.
//! - [`aegis128`]: AEGIS-128 as the kernel's `aegis128` computes it (sans I/O).
//! - [`tag`]: the per-sector AEAD / XTS+HMAC with random IVs, as dm-crypt does it (sans I/O).
//! - [`device`]: [`IntegrityVolume`], the [`crate::BlockDev`] that reads, verifies, encrypts
//!   and writes through a [`crate::backend::Backend`]; [`open_luks2`] builds one from a header.
//!
//! - [`journal`]: dm-integrity's journal layout and replay decision (sans I/O).
//!
//! dm-integrity's journal mode (the default) and direct mode are implemented; see
//! docs/integrity.md.

pub mod aegis128;
pub mod device;
pub mod format;
pub mod journal;
pub mod layout;
pub mod superblock;
pub mod tag;

pub use device::{
    luks2_write_mode, open_luks2, open_luks2_mode, read_superblock, superblock_offset,
    write_new_device, IntegrityVolume, ReplayReport, WriteMode,
};
pub use format::new_superblock;
pub use layout::Layout;
pub use superblock::Superblock;
pub use tag::{HmacHash, TagCipher, TagMode};

/// The integrity parameters for `dump`: the superblock's fields and the layout derived from
/// them (sectors are 512 bytes, counted from the superblock).
pub fn dump(l: &Layout) -> String {
    use std::fmt::Write as _;
    let sb = &l.sb;
    let mut o = String::new();
    let flags = sb.flag_names();
    let _ = writeln!(o, "\nIntegrity superblock (dm-integrity):");
    let _ = writeln!(o, "\tversion:        {}", sb.version);
    let _ = writeln!(o, "\ttag size:       {} [bytes]", sb.tag_bytes);
    let _ = writeln!(o, "\tblock size:     {} [bytes]", sb.block_bytes());
    let _ = writeln!(o, "\tinterleave:     {} [sectors]", sb.interleave_sectors());
    let _ = writeln!(
        o,
        "\tjournal:        {} sections of {} [sectors]",
        sb.journal_sections, l.journal_section_sectors
    );
    let _ = writeln!(o, "\tmetadata run:   {} [sectors]", l.metadata_run_sectors);
    let _ = writeln!(
        o,
        "\tprovided data:  {} [sectors] ({} [bytes])",
        sb.provided_data_sectors,
        sb.provided_data_sectors * 512
    );
    let _ = writeln!(
        o,
        "\tflags:          {}",
        if flags.is_empty() {
            "(none)".to_string()
        } else {
            flags.join(" ")
        }
    );
    o
}

#[cfg(test)]
mod tests {
    use super::superblock::flags;
    use super::*;

    #[test]
    fn dump_text_is_pinned() {
        let sb = Superblock {
            version: 4,
            log2_interleave_sectors: 15,
            tag_bytes: 28,
            journal_sections: 2,
            provided_data_sectors: 64552,
            flags: flags::FIXED_PADDING,
            log2_sectors_per_block: 3,
            log2_blocks_per_bitmap_bit: 12,
            recalc_sector: 0,
            salt: [0; 16],
        };
        let want = [
            "",
            "Integrity superblock (dm-integrity):",
            "\tversion:        4",
            "\ttag size:       28 [bytes]",
            "\tblock size:     4096 [bytes]",
            "\tinterleave:     32768 [sectors]",
            "\tjournal:        2 sections of 264 [sectors]",
            "\tmetadata run:   224 [sectors]",
            "\tprovided data:  64552 [sectors] (33050624 [bytes])",
            "\tflags:          fix_padding",
        ];
        let want: String = want.iter().map(|l| format!("{l}\n")).collect();
        assert_eq!(dump(&Layout::new(sb).expect("layout")), want);
    }
}
