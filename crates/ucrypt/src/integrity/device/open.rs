//! Opening the authenticated segment of a LUKS2 volume, and making a new dm-integrity
//! device's superblock.

use std::sync::Arc;

use crate::backend::Backend;
use crate::integrity::journal::Geometry;
use crate::integrity::layout::Layout;
use crate::integrity::superblock::{Superblock, SB_BYTES, SB_SECTORS};
use crate::integrity::tag::TagMode;
use crate::luks::json::SegmentKind;
use crate::luks::{read_area, Header, VolumeKey};
use crate::{Error, Result, SecretBytes};

use super::{AlignedBuf, IntegrityVolume, WriteMode};

/// Writes the superblock of `l` at `start_bytes` and its journal as the kernel initialises it
/// when it formats (every section in sequence 0, every entry unused), then flushes: a new
/// dm-integrity device. Without a valid journal the kernel (and ucrypt) refuse the device.
pub fn write_new_device(backend: &dyn Backend, start_bytes: u64, l: &Layout) -> Result<()> {
    backend.write_at(&l.sb.serialize(), start_bytes)?;
    let geo = Geometry::new(l)?;
    let mut sec = AlignedBuf::new(geo.section_bytes());
    for i in 0..geo.sections {
        geo.init_section(sec.as_mut_slice(), i, 0);
        let at = start_bytes + (SB_SECTORS + u64::from(i) * u64::from(geo.section_sectors)) * 512;
        backend.write_at(sec.as_slice(), at)?;
    }
    backend.flush()
}

/// The byte offset of the dm-integrity superblock of a LUKS2 header's authenticated data
/// segment (the segment offset); `None` if the header has none.
pub fn superblock_offset(hdr: &Header) -> Option<u64> {
    let Header::Luks2(h) = hdr else {
        return None;
    };
    h.meta
        .segments
        .values()
        .find(|s| s.kind == SegmentKind::Crypt && s.integrity.is_some())
        .map(|s| s.offset.0)
}

/// The dm-integrity superblock under a LUKS2 header's authenticated segment (at the segment
/// offset of `data`), with its layout checked against `data`'s size; `None` if the header has
/// no authenticated segment.
pub fn read_superblock(data: &dyn Backend, hdr: &Header) -> Result<Option<Layout>> {
    let Some(start) = superblock_offset(hdr) else {
        return Ok(None);
    };
    let sb = Superblock::parse(&read_area(data, start, SB_BYTES as u64)?)?;
    Layout::for_device(sb, start / 512, data.size() / 512).map(Some)
}

/// The write mode cryptsetup would activate a LUKS2 volume in: direct when its persistent
/// flags say `no-journal` (`cryptsetup refresh --integrity-no-journal --persistent`), else
/// the journal.
pub fn luks2_write_mode(hdr: &Header) -> WriteMode {
    if hdr.activation_flags().iter().any(|f| f == "no-journal") {
        WriteMode::Direct
    } else {
        WriteMode::Journal
    }
}

/// Opens the authenticated data segment of a LUKS2 volume whose key is already unlocked:
/// reads the dm-integrity superblock at the segment offset and checks it against the header;
/// writes in the mode the header's flags ask ([`luks2_write_mode`]). Replays the journal.
pub fn open_luks2(
    backend: Arc<dyn Backend>,
    hdr: &Header,
    vk: &VolumeKey,
    read_only: bool,
) -> Result<IntegrityVolume> {
    open_luks2_mode(backend, hdr, vk, read_only, luks2_write_mode(hdr))
}

/// [`open_luks2`] in an explicit write mode (cryptsetup's `open --integrity-no-journal` asks
/// for [`WriteMode::Direct`]).
pub fn open_luks2_mode(
    backend: Arc<dyn Backend>,
    hdr: &Header,
    vk: &VolumeKey,
    read_only: bool,
    write_mode: WriteMode,
) -> Result<IntegrityVolume> {
    vk.require_bound()?;
    let Header::Luks2(h) = hdr else {
        return Err(Error::UnsupportedLuks(
            "LUKS1 has no authenticated encryption".into(),
        ));
    };
    let crypt: Vec<_> = h
        .meta
        .segments
        .values()
        .filter(|s| s.kind == SegmentKind::Crypt)
        .collect();
    let [seg] = crypt[..] else {
        return Err(Error::UnsupportedLuks(format!(
            "{} crypt segments (ucrypt opens volumes with exactly one)",
            crypt.len()
        )));
    };
    let integ = seg.integrity.as_ref().ok_or_else(|| {
        Error::InvalidArgument("the data segment has no integrity protection".into())
    })?;
    if integ.journal_encryption != "none" || integ.journal_integrity != "none" {
        return Err(Error::UnsupportedLuks(format!(
            "journal encryption '{}' / journal integrity '{}' (ucrypt supports 'none')",
            integ.journal_encryption, integ.journal_integrity
        )));
    }
    if seg.iv_tweak.is_some_and(|t| t.0 != 0) {
        return Err(Error::UnsupportedLuks(
            "an authenticated segment with an IV tweak".into(),
        ));
    }
    let mode = TagMode::from_luks2_keyed(
        seg.encryption.as_deref().unwrap_or(""),
        &integ.kind,
        vk.bytes().len(),
        integ.key_size.map(|b| b as usize),
    )?;
    let sector = u64::from(seg.sector_size.unwrap_or(512));
    let start = seg.offset.0;
    let sb_bytes = read_area(backend.as_ref(), start, SB_BYTES as u64)?;
    let sb = Superblock::parse(&sb_bytes)?;
    if u64::from(sb.block_bytes()) != sector {
        return Err(Error::BadHeader {
            check: "integrity block size",
            detail: format!(
                "the superblock's blocks are {} bytes, the segment's sectors {sector}",
                sb.block_bytes()
            ),
        });
    }
    hdr.check_requirements()?;
    IntegrityVolume::with_write_mode(
        backend,
        start,
        sb,
        mode,
        SecretBytes::from_slice(vk.bytes()),
        read_only,
        write_mode,
    )
}
