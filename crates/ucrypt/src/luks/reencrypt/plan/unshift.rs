//! The plan of a decryption that moves the data back to offset 0 (datashift-checksum or
//! datashift-journal, requirement v3): the header in front is exported, each hotzone is read
//! a shift above where it is written, the first one through the moved segment.

use crate::luks::json::SegmentKind;
use crate::luks::json::{Metadata, Segment, SegmentSize};
use crate::luks::reencrypt::{ReencryptState, Resilience, SegmentFlag};
use crate::{Error, Result};

use super::in_place::key_digests;
use super::shift::{shift_bad, MovingSegments};
use super::{
    advanced, bad, check_supported, has_flag, live_segments, note_hotzone, segment_of, template,
    MovedGuard, Position, Protect, Step, IV_UNIT_BYTES,
};

/// The requirement version of a decryption that moves the data (`online-reencrypt-v3`).
pub const UNSHIFT_REQUIREMENT_VERSION: u8 = 3;

/// The geometry of a decryption that moves the data back to the start of the device, as
/// cryptsetup 2.6 does it for `reencrypt --decrypt --header NEW.hdr` of a volume whose header
/// is in front (the header is exported to NEW.hdr), read from the backup segments and checked:
///
/// ```text
/// before:  [ header, S ][ ciphertext of 0..D                              ]
/// init:    [ ct 0..M ][  ][ ciphertext of 0..D at its place                ]  (header: NEW.hdr)
/// after:   [ plaintext of 0..D                              ][ wiped, S    ]
/// ```
///
/// Data byte `x` moves from device offset `S + x` (ciphertext, old data offset) to `x`
/// (plaintext, new data offset). The init copies the ciphertext of the first `M <= S` bytes
/// over the header (the *moved segment*, at the new data offset); the walk then goes forward
/// from `M` in hotzones of at most `S`, each never overlapping its source (resilience
/// datashift: nothing stored, recovery moves it again), and ends with the moved segment,
/// decrypted in place (resilience checksum: one hash per block of its ciphertext, stored
/// before it is rewritten).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unshift {
    /// `shift_size`: how far the data moves (the old data offset minus the new one).
    pub shift_bytes: u64,
    /// Where the ciphertext is (backup-previous).
    pub old_offset: u64,
    /// Where the plaintext goes (backup-final), and where the moved segment lies.
    pub new_offset: u64,
    /// `M`: bytes of ciphertext copied to the moved segment (backup-moved-segment's size).
    pub moved_bytes: u64,
    /// `D`: bytes of data.
    pub data_bytes: u64,
}

impl Unshift {
    /// Bytes the forward walk moves before the moved segment's hotzone: `D - M`.
    pub fn walk_bytes(&self) -> u64 {
        self.data_bytes - self.moved_bytes
    }

    /// The data offset of the hotzone that follows `done` bytes done: `M + done` during the
    /// walk, 0 (the moved segment) once the walk is done.
    pub fn hotzone_offset(&self, done: u64) -> u64 {
        if done >= self.walk_bytes() {
            0
        } else {
            self.moved_bytes + done
        }
    }

    /// The absolute device offset where the ciphertext of data offset `offset` is read: the
    /// moved segment for the first `M` bytes, its old place otherwise.
    pub fn source(&self, offset: u64) -> u64 {
        if offset < self.moved_bytes {
            self.new_offset + offset
        } else {
            self.old_offset + offset
        }
    }

    /// Refuses a device of `have` bytes that ends before the data does.
    pub fn check_device(&self, have: u64) -> Result<()> {
        if have < self.old_offset + self.data_bytes {
            return Err(Error::BadHeader {
                check: "reencrypt-datashift",
                detail: format!(
                    "the data ends at {}, past the device's {have} bytes",
                    self.old_offset + self.data_bytes
                ),
            });
        }
        Ok(())
    }

    /// What the end leaves behind the plaintext: the last `S` bytes of the device, the old
    /// ciphertext of the last `S` bytes of data (cryptsetup wipes them with random bytes).
    pub fn tail(&self) -> (u64, u64) {
        (self.new_offset + self.data_bytes, self.shift_bytes)
    }
}

/// The [`Unshift`] of a decryption that moves the data, for `data_bytes` bytes of data (the
/// device's bytes past the old data offset, or backup-previous's fixed size); `None` for any
/// other reencryption. Every relation the walk relies on is checked (named check
/// `reencrypt-datashift`): the shift is the distance from the new data offset to the old; the
/// moved segment lies at the new data offset, holds at most one shift and at most the data,
/// under the old key with backup-previous's cipher and sector size (both IV tweaks 0, as
/// cryptsetup's recovery assumes); its checksums fit the reencrypt keyslot's area.
pub fn unshift_geometry(
    meta: &Metadata,
    st: &ReencryptState,
    data_bytes: u64,
) -> Result<Option<Unshift>> {
    let Protect::Unshift(guard) = check_supported(st)? else {
        return Ok(None);
    };
    let (Resilience::DatashiftChecksum { shift_size, .. }
    | Resilience::DatashiftJournal { shift_size }) = st.keyslot.resilience
    else {
        return Err(Error::Bug(
            "unshift protection without a datashift- resilience",
        ));
    };
    // A journal copies whole 512-byte units; checksums cover whole blocks.
    let block = match guard {
        MovedGuard::Checksum { block, .. } => block,
        MovedGuard::Journal => IV_UNIT_BYTES as u32,
    };
    let moved_id = st
        .backup_moved
        .ok_or(Error::Bug("unshift protection without a moved segment"))?;
    let prev = segment_of(meta, st.backup_previous)?;
    let fin = segment_of(meta, st.backup_final)?;
    let moved = segment_of(meta, moved_id)?;
    if prev.kind != SegmentKind::Crypt
        || moved.kind != SegmentKind::Crypt
        || fin.kind != SegmentKind::Linear
    {
        return Err(shift_bad(format!(
            "backup-previous {}, backup-moved-segment {}, backup-final {} (a decryption moves \
             crypt data into a linear segment)",
            prev.kind, moved.kind, fin.kind
        )));
    }
    let tweak = |s: &Segment| s.iv_tweak.map_or(0, |t| t.0);
    if tweak(prev) != 0 || tweak(moved) != 0 {
        return Err(shift_bad(format!(
            "IV tweak {} of backup-previous, {} of the moved segment (both start the data: 0)",
            tweak(prev),
            tweak(moved)
        )));
    }
    if moved.encryption != prev.encryption || moved.sector_size != prev.sector_size {
        return Err(shift_bad(format!(
            "the moved segment is {:?} in {:?}-byte sectors, the data {:?} in {:?}",
            moved.encryption, moved.sector_size, prev.encryption, prev.sector_size
        )));
    }
    let (old_offset, new_offset) = (prev.offset.0, fin.offset.0);
    if old_offset.checked_sub(new_offset) != Some(shift_size) {
        return Err(shift_bad(format!(
            "the data moves from offset {old_offset} to {new_offset}, not back by the \
             shift_size {shift_size}"
        )));
    }
    if moved.offset.0 != new_offset {
        return Err(shift_bad(format!(
            "the moved segment at {} is not at the new data offset {new_offset}",
            moved.offset.0
        )));
    }
    let SegmentSize::Bytes(moved_bytes) = moved.size else {
        return Err(shift_bad("backup-moved-segment has dynamic size"));
    };
    if moved_bytes == 0
        || moved_bytes > shift_size
        || moved_bytes > data_bytes
        || moved_bytes % u64::from(block) != 0
    {
        return Err(shift_bad(format!(
            "a moved segment of {moved_bytes} bytes for a shift of {shift_size} and \
             {data_bytes} bytes of data (it holds at most both, in whole {block}-byte \
             checksum blocks)"
        )));
    }
    if let SegmentSize::Bytes(n) = prev.size {
        if n != data_bytes {
            return Err(shift_bad(format!(
                "backup-previous holds {n} bytes, the device {data_bytes}"
            )));
        }
    }
    if data_bytes % IV_UNIT_BYTES != 0 {
        return Err(shift_bad(format!(
            "{data_bytes} bytes of data is not a whole number of 512-byte units"
        )));
    }
    let (kept, what) = match guard {
        MovedGuard::Checksum { hash, block } => (
            moved_bytes / u64::from(block) * hash.output_bytes() as u64,
            "checksums",
        ),
        MovedGuard::Journal => (moved_bytes, "journal copy"),
    };
    if kept > st.keyslot.area_bytes {
        return Err(shift_bad(format!(
            "the moved segment's {kept}-byte {what} does not fit the {}-byte reencrypt area",
            st.keyslot.area_bytes
        )));
    }
    Ok(Some(Unshift {
        shift_bytes: shift_size,
        old_offset,
        new_offset,
        moved_bytes,
        data_bytes,
    }))
}

/// [`position`] of a decryption that moves the data: the hotzone (flagged) is the moved
/// segment's once it lies at the new data offset, else the walk's at `M + done`; without one,
/// the done part is the linear segment after the moved one (`dynamic` once the walk is done),
/// or the one linear segment at the start once all is done. The exact layout is
/// [`check_layout`]'s.
pub(super) fn position_unshift(meta: &Metadata, u: &Unshift) -> Result<Position> {
    let (mut moved, mut hot, mut done_part) = (false, None, None);
    for (id, s) in live_segments(meta) {
        let at = s.offset.0.checked_sub(u.new_offset).ok_or_else(|| {
            bad(format!(
                "segment {id} at {} is before the new data offset {}",
                s.offset.0, u.new_offset
            ))
        })?;
        if has_flag(s, SegmentFlag::InReencryption) {
            note_hotzone(&mut hot, s, at)?;
        } else if s.kind == SegmentKind::Crypt && at == 0 {
            moved = true;
        } else if s.kind == SegmentKind::Linear && done_part.replace((at, s.size)).is_some() {
            return Err(bad("two plaintext segments besides the hotzone"));
        }
    }
    let walk = u.walk_bytes();
    let pos = match (hot, done_part) {
        (Some((0, len)), _) if !moved => {
            if len != u.moved_bytes {
                return Err(bad(format!(
                    "the moved segment's hotzone holds {len} bytes, the moved segment {}",
                    u.moved_bytes
                )));
            }
            Position {
                done: walk,
                hotzone: Some(len),
            }
        }
        (Some((at, len)), _) => {
            let done = at.checked_sub(u.moved_bytes).ok_or_else(|| {
                bad(format!(
                    "a hotzone at {at} inside the {}-byte moved segment",
                    u.moved_bytes
                ))
            })?;
            if len == 0 || len > u.shift_bytes || done.checked_add(len).is_none_or(|e| e > walk) {
                return Err(bad(format!(
                    "a hotzone of {len} bytes after {done} done (a shift of {}, a walk of \
                     {walk} bytes)",
                    u.shift_bytes
                )));
            }
            match done_part {
                Some((part_at, SegmentSize::Bytes(n))) if part_at == u.moved_bytes && n == done => {
                }
                None if done == 0 => {}
                _ => {
                    return Err(bad(format!(
                        "the hotzone at {at} does not begin where the plaintext done ends \
                         ({done_part:?})"
                    )))
                }
            }
            Position {
                done,
                hotzone: Some(len),
            }
        }
        (None, None) => Position {
            done: 0,
            hotzone: None,
        },
        (None, Some((0, SegmentSize::Dynamic))) if !moved => Position {
            done: u.data_bytes,
            hotzone: None,
        },
        (None, Some((_, SegmentSize::Dynamic))) => Position {
            done: walk,
            hotzone: None,
        },
        (None, Some((_, SegmentSize::Bytes(n)))) => Position {
            done: n,
            hotzone: None,
        },
    };
    if pos.hotzone.is_none() && pos.done > walk && pos.done != u.data_bytes {
        return Err(bad(format!(
            "{} bytes done, past the {walk} bytes the walk moves",
            pos.done
        )));
    }
    Ok(pos)
}

/// [`set_segments`] of a decryption that moves the data, as cryptsetup 2.6 lays them out
/// (seen between and inside every hotzone of a run; `reencrypt_interop`'s
/// `INITS` rows and `KILLS` rows of the moving decryption (`Unshift`), and `reencrypt_interop_kill_points`'s
/// `unshift_*` tests compare the two tools): the moved segment (crypt, until its
/// hotzone), the plaintext done (linear at `M`: fixed size, `dynamic` once the walk is done),
/// the hotzone (linear, `in-reencryption`), the ciphertext left (crypt at its old place, IV
/// tweak its data offset, backup-previous's size rule); then backup-previous, backup-final and
/// backup-moved-segment. The old key's digest lists backup-previous, backup-moved-segment,
/// then every live crypt segment. Once all is done: one linear segment at the new data offset.
pub(super) fn set_segments_unshift(
    meta: &mut Metadata,
    st: &mut ReencryptState,
    u: &Unshift,
    pos: Position,
) -> Result<()> {
    let moved_id = st
        .backup_moved
        .ok_or(Error::Bug("unshift protection without a moved segment"))?;
    let prev = template(meta, st.backup_previous)?;
    let fin = template(meta, st.backup_final)?;
    let moved = template(meta, moved_id)?;
    let (d_old, _) = key_digests(meta, st)?;
    let d_old = d_old.ok_or(Error::Bug("a decryption without an old key"))?;
    let (m, walk, d) = (u.moved_bytes, u.walk_bytes(), u.data_bytes);
    let hot = pos.hotzone.unwrap_or(0);
    let linear = |at: u64, size: SegmentSize| advanced(&fin, at, size);
    let mut live: Vec<Segment> = Vec::new();
    let mut hot_id = None;
    if pos.done >= walk && (pos.hotzone.is_some() || pos.done >= d) {
        // The moved segment's hotzone, or all done.
        if pos.hotzone.is_some() {
            if hot != m {
                return Err(bad(format!("a moved hotzone of {hot} bytes, not {m}")));
            }
            let mut seg = linear(0, SegmentSize::Bytes(m))?;
            seg.flags = Some(vec![SegmentFlag::InReencryption.name().into()]);
            hot_id = Some(0);
            live.push(seg);
            if d > m {
                live.push(linear(m, SegmentSize::Dynamic)?);
            }
        } else {
            live.push(linear(0, SegmentSize::Dynamic)?);
        }
    } else {
        let end = pos
            .done
            .checked_add(hot)
            .filter(|&e| e <= walk)
            .ok_or_else(|| {
                bad(format!(
                    "position {} + hotzone {hot} is past the {walk} bytes the walk moves",
                    pos.done
                ))
            })?;
        live.push(moved);
        if pos.done > 0 {
            let size = if end == walk && hot == 0 {
                SegmentSize::Dynamic
            } else {
                SegmentSize::Bytes(pos.done)
            };
            live.push(linear(m, size)?);
        }
        if hot > 0 {
            let mut seg = linear(m + pos.done, SegmentSize::Bytes(hot))?;
            seg.flags = Some(vec![SegmentFlag::InReencryption.name().into()]);
            hot_id = Some(live.len() as u32);
            live.push(seg);
        }
        if end < walk {
            let size = match prev.size {
                SegmentSize::Dynamic => SegmentSize::Dynamic,
                SegmentSize::Bytes(_) => SegmentSize::Bytes(walk - end),
            };
            live.push(advanced(&prev, m + end, size)?);
        }
    }
    let moving = MovingSegments {
        live,
        in_reencryption: hot_id,
        backups: [prev, fin, template(meta, moved_id)?],
    };
    let listed = [SegmentFlag::BackupPrevious, SegmentFlag::BackupMovedSegment];
    moving.commit(meta, st, d_old, &listed)
}

/// The steps of the next hotzone of a decryption that moves the data, as cryptsetup 2.6 walks
/// it (seen with `--debug` and by stopping it between and inside hotzones; pinned by the
/// `Unshift` rows of `reencrypt_interop` and the `unshift_*` tests of `reencrypt_interop_kill_points`): forward from
/// `M` in hotzones of the shift (the last one what is left), each: commit the hotzone, move it
/// ([`Step::MoveNew`]: the ciphertext at its old place decrypted to the new), flush, commit
/// past it; then the moved segment's hotzone in place: read it ([`Step::ReadAt`]), store its
/// checksums, flush, commit the hotzone, decrypt it in place ([`Step::WriteNew`]), flush,
/// finalise. `align` is the sector size every hotzone must be a multiple of. `None` when every
/// byte is done.
pub fn next_hotzone_unshift(
    st: &ReencryptState,
    u: &Unshift,
    pos: Position,
    align: u64,
) -> Result<Option<Vec<Step>>> {
    let Protect::Unshift(guard) = check_supported(st)? else {
        return Err(Error::Bug("next_hotzone_unshift of another reencryption"));
    };
    if pos.hotzone.is_some() {
        return Err(bad(
            "the metadata was committed inside a hotzone: recover it first (repair)",
        ));
    }
    let walk = u.walk_bytes();
    if pos.done >= u.data_bytes {
        return Ok(None);
    }
    let (offset, len) = if pos.done < walk {
        (u.moved_bytes + pos.done, u.shift_bytes.min(walk - pos.done))
    } else if pos.done == walk {
        (0, u.moved_bytes)
    } else {
        return Err(bad(format!(
            "{} bytes done: past the {walk}-byte walk, short of the {}-byte data",
            pos.done, u.data_bytes
        )));
    };
    if align == 0 || !align.is_power_of_two() || len % align != 0 || offset % align != 0 {
        return Err(bad(format!(
            "hotzone [{offset}, +{len}) is not aligned to {align} bytes"
        )));
    }
    let hotzone = Step::CommitSegments(Position {
        done: pos.done,
        hotzone: Some(len),
    });
    if offset > 0 {
        return Ok(Some(vec![
            hotzone,
            Step::MoveNew {
                from: u.source(offset),
                offset,
                len,
            },
            Step::SyncData,
            Step::CommitSegments(Position {
                done: pos.done + len,
                hotzone: None,
            }),
        ]));
    }
    Ok(Some(vec![
        Step::ReadAt {
            from: u.source(0),
            offset: 0,
            len,
        },
        match guard {
            MovedGuard::Checksum { hash, block } => Step::WriteChecksums {
                area_offset: st.keyslot.area_offset,
                block,
                hash,
            },
            MovedGuard::Journal => Step::WriteJournal {
                area_offset: st.keyslot.area_offset,
            },
        },
        Step::SyncData,
        hotzone,
        Step::WriteNew { offset: 0, len },
        Step::SyncData,
        Step::Finalise,
    ]))
}
