//! The plan of a key rotation that moves the data up (`reencrypt --reduce-device-size` on a
//! LUKS2 volume, resilience `datashift`, no moved segment): each hotzone is read under the
//! old key at its old place and written under the new key a shift above it.

use crate::luks::json::Metadata;
use crate::luks::json::SegmentKind;
use crate::luks::reencrypt::{Direction, Mode, ReencryptState, Resilience};
use crate::{Error, Result};

use super::shift::shift_bad;
use super::{bad, check_supported, moving_hotzone, segment_of, Position, Protect, Step};

/// The geometry of a rotation that moves the data up by `S` (cryptsetup's `reencrypt
/// --reduce-device-size S` on a LUKS2 volume):
///
/// ```text
/// before:  [ header ][ old key: data 0..D+S                       ]
/// during:  [ header ][ old: 0..b ][ . . . ][ new key: data b..D   ]
/// after:   [ header ][ S        ][ new key: data 0..D             ]
/// ```
///
/// Data byte `x` moves from `old_offset + x` to `new_offset + x = old_offset + S + x`,
/// hotzone by hotzone from the end (backward), each at most `S`, so that a hotzone never
/// overlaps its source and a crash inside one is recovered by doing it again. The data area
/// loses its last `S` bytes: the volume is `D` = the device past the new offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Relocate {
    /// `shift_size`: how far the data moves.
    pub shift_bytes: u64,
    /// Where the data is under the old key (backup-previous).
    pub old_offset: u64,
    /// Where it goes under the new key (backup-final): the old offset + the shift.
    pub new_offset: u64,
}

impl Relocate {
    /// Where the old bytes of data offset `offset` are.
    pub fn source(&self, offset: u64) -> u64 {
        self.old_offset + offset
    }
}

/// The [`Relocate`] of a rotation that moves the data, `None` for any other reencryption.
/// Checked (named check `reencrypt-datashift`): both backups are crypt segments, the new one
/// lies a shift above the old one, and neither has a fixed size (the data area is the
/// device's rest).
pub fn relocate_geometry(meta: &Metadata, st: &ReencryptState) -> Result<Option<Relocate>> {
    let k = &st.keyslot;
    let (Resilience::Datashift { shift_size }, Mode::Reencrypt, Direction::Backward, None) =
        (&k.resilience, k.mode, k.direction, st.backup_moved)
    else {
        return Ok(None);
    };
    if check_supported(st)? != Protect::Datashift {
        return Err(Error::Bug(
            "a data-moving rotation not protected by its shift",
        ));
    }
    let prev = segment_of(meta, st.backup_previous)?;
    let fin = segment_of(meta, st.backup_final)?;
    if prev.kind != SegmentKind::Crypt || fin.kind != SegmentKind::Crypt {
        return Err(shift_bad(format!(
            "backup-previous {}, backup-final {} (a rotation moves crypt data into a crypt \
             segment)",
            prev.kind, fin.kind
        )));
    }
    if prev.size != crate::luks::json::SegmentSize::Dynamic
        || fin.size != crate::luks::json::SegmentSize::Dynamic
    {
        return Err(shift_bad(
            "a backup segment of fixed size (a rotation that moves the data covers the \
             device's rest)",
        ));
    }
    let (old_offset, new_offset) = (prev.offset.0, fin.offset.0);
    if new_offset.checked_sub(old_offset) != Some(*shift_size) || *shift_size == 0 {
        return Err(shift_bad(format!(
            "the data moves from offset {old_offset} to {new_offset}, not by the shift_size \
             {shift_size}"
        )));
    }
    Ok(Some(Relocate {
        shift_bytes: *shift_size,
        old_offset,
        new_offset,
    }))
}

/// The steps of the next hotzone of a rotation that moves the data, as cryptsetup 2.6.1
/// walks it: backward from the end of the `data_bytes` in hotzones of the shift (the last
/// one, at offset 0, what is left), each: commit the hotzone, move it under the new key
/// ([`Step::MoveNew`] from its old place), flush, commit past it (finalise after the last).
/// No resilience data: a hotzone's source stays intact until it is committed done. `align`
/// is the sector size every hotzone must be a multiple of. `None` when every byte is done.
pub(super) fn next_hotzone_relocate(
    r: &Relocate,
    pos: Position,
    data_bytes: u64,
    align: u64,
) -> Result<Option<Vec<Step>>> {
    if pos.hotzone.is_some() {
        return Err(bad(
            "the metadata was committed inside a hotzone: recover it first (repair)",
        ));
    }
    if pos.done >= data_bytes {
        return Ok(None);
    }
    if align == 0 || !align.is_power_of_two() {
        return Err(bad(format!("alignment {align} is not a power of two")));
    }
    let remaining = data_bytes - pos.done;
    let len = r.shift_bytes.min(remaining);
    let offset = remaining - len;
    if len % align != 0 || offset % align != 0 {
        return Err(bad(format!(
            "hotzone [{offset}, +{len}) is not aligned to {align} bytes"
        )));
    }
    Ok(Some(moving_hotzone(pos, r.source(offset), offset, len)))
}
