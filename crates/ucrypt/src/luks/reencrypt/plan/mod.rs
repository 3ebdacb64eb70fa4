//! The planner of offline reencryption (modes `reencrypt`, `encrypt` and `decrypt`, directions
//! `forward` and `backward`, resilience `checksum`, `journal` or `none`; and the encryption
//! that moves the data to make room for the header in front of it, resilience `datashift`,
//! [`Shift`]; and the decryption that moves the data back to the start of the device,
//! resilience `datashift-checksum`, [`Unshift`]), sans I/O: where it stands ([`position`]), the segments and digests for a position
//! ([`set_segments`]), the steps of the next hotzone ([`next_hotzone`]) as effects a driver
//! performs in order, and the plain header it ends with ([`finalise`]). The driver is
//! `luks::reencrypt_run`.
//!
//! The step order is cryptsetup's: read the old hotzone, store its resilience data (checksums
//! of the old bytes on the disk, or a copy of them) in the reencrypt keyslot area and flush it,
//! commit the metadata with the hotzone flagged `in-reencryption` (a crash after this point
//! needs recovery), write the hotzone in its new form, flush, then commit the metadata with
//! the boundary moved past the hotzone (after the last hotzone: finalise).
//!
//! A [`Position`] counts in the direction of the walk: forward, the first `done` bytes are new
//! and the hotzone follows them; backward, the last `done` bytes are new and the hotzone ends
//! where they begin ([`hotzone_offset`]).

use crate::luks::json::SegmentKind;
use crate::luks::json::{Metadata, Segment, SegmentSize, U64Str};
use crate::luks::reencrypt::{
    digest_of_segment, Direction, Mode, ReencryptState, Resilience, SegmentFlag,
};
use crate::luks::util::HashAlg;
use crate::{Error, Result};

fn bad(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt-plan",
        detail: detail.into(),
    }
}

/// Why the state cryptsetup 2.6.1's `reencrypt --encrypt --header HDR --reduce-device-size
/// SIZE` leaves is refused: an encryption from the end with `datashift` resilience whose data
/// does not move (the old and new segments both at the data offset), so nothing protects a
/// hotzone: cryptsetup SIGKILLed inside a hotzone, then its own `repair` and `--resume-only`,
/// leave the hotzone holding the plaintext one shift below it (a 512 MiB file with an 8 MiB
/// shift shows it). `reencrypt_interop`'s
/// `reduce_device_size_with_a_detached_header_is_refused_by_name` pins the refusal.
pub const UNMOVED_DATASHIFT: &str =
    "reencryption encrypt backward with resilience datashift and the data not moved \
     (cryptsetup's reencrypt --encrypt --header with --reduce-device-size): ucrypt does not \
     serve or resume it, as nothing protects its hotzones (the data does not move, so a crash \
     inside one loses it: cryptsetup 2.6.1's own repair rewrites it with the data one shift \
     below). Finish it with cryptsetup reencrypt --resume-only; ucrypt encrypts with a \
     detached header without --reduce-device-size, crash-safe (resilience checksum or \
     journal)";

fn unsupported(detail: impl Into<String>) -> Error {
    Error::UnsupportedLuks(detail.into())
}

/// Bytes per IV step of `iv_tweak` (the kernel's 512-byte sectors).
const IV_UNIT_BYTES: u64 = 512;

/// Where a reencryption stands, in bytes in the direction of its walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Bytes already in their new form (from the start going forward, from the end going
    /// backward).
    pub done: u64,
    /// Length of the hotzone after `done`, when the metadata was committed inside one.
    pub hotzone: Option<u64>,
}

/// One effect of a hotzone step. Offsets are from the start of the data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Read `len` bytes of ciphertext at `offset` through the old segment.
    ReadOld { offset: u64, len: u64 },
    /// Read `len` bytes of old data for data offset `offset` at the absolute device offset
    /// `from`, where they are now (a decryption that moves the data: the moved segment, a
    /// copy of the first bytes of ciphertext at the start of the device).
    ReadAt { from: u64, offset: u64, len: u64 },
    /// Hash each `block` bytes of what was read with `hash`, and write the hashes one after
    /// the other at `area_offset` (absolute, inside the reencrypt keyslot area).
    WriteChecksums {
        area_offset: u64,
        block: u32,
        hash: HashAlg,
    },
    /// Rewrite the segments for `Position` ([`set_segments`]) and commit the header (both
    /// copies, as `Luks2Header::commit` plans it).
    CommitSegments(Position),
    /// Decrypt what was read with the old key, encrypt it with the new, write it at `offset`.
    WriteNew { offset: u64, len: u64 },
    /// Copy what was read (the old ciphertext, as it is on the disk) to `area_offset`
    /// (absolute, inside the reencrypt keyslot area): the journal.
    WriteJournal { area_offset: u64 },
    /// A data shift's hotzone: read `len` bytes of plaintext at the absolute device offset
    /// `from` (where they are now: their old place, or the moved segment), encrypt them for
    /// data offset `offset` and write them through the new segment. The two never overlap
    /// (a hotzone is at most the shift), so the driver may do it in pieces, in any order, and
    /// recovery does it again from the same source.
    MoveNew { from: u64, offset: u64, len: u64 },
    /// Flush the data device.
    SyncData,
    /// Every byte is under the new key: commit the plain header ([`finalise`]), then wipe the
    /// retired keyslots' areas.
    Finalise,
}

/// How a hotzone is protected, typed from the reencrypt keyslot's area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protect {
    None,
    /// One `hash` of each `block` bytes of the old ciphertext.
    Checksum {
        hash: HashAlg,
        block: u32,
    },
    /// A copy of the old ciphertext.
    Journal,
    /// The data moves by the shift: the source of a hotzone stays intact until the hotzone is
    /// committed done, so it needs no copy ([`Shift`]).
    Datashift,
    /// A decryption that moves the data back ([`Unshift`]): the hotzones that move data are
    /// protected as [`Protect::Datashift`]; the moved segment's, rewritten in place, as
    /// [`MovedGuard`] says.
    Unshift(MovedGuard),
}

/// How the moved segment's hotzone of a decryption that moves the data (rewritten in place)
/// is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MovedGuard {
    /// One `hash` of each `block` bytes of its old ciphertext (`datashift-checksum`).
    Checksum { hash: HashAlg, block: u32 },
    /// A copy of its old ciphertext in the reencrypt keyslot's area (`datashift-journal`).
    Journal,
}

fn live_segments(meta: &Metadata) -> Vec<(u32, &Segment)> {
    let mut v: Vec<(u32, &Segment)> = meta
        .segments
        .iter()
        .filter(|(_, s)| {
            !s.flags
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f.starts_with("backup-")))
        })
        .filter_map(|(k, s)| k.parse().ok().map(|n| (n, s)))
        .collect();
    v.sort_unstable_by_key(|(n, _)| *n);
    v
}

/// Records segment `s`, in reencryption at `at` (from the new data offset), as the hotzone
/// `(at, len)`: refused if its size is dynamic or a hotzone was found already.
fn note_hotzone(hot: &mut Option<(u64, u64)>, s: &Segment, at: u64) -> Result<()> {
    let SegmentSize::Bytes(len) = s.size else {
        return Err(bad("the hotzone has dynamic size"));
    };
    if hot.replace((at, len)).is_some() {
        return Err(bad("two segments in reencryption"));
    }
    Ok(())
}

fn has_flag(s: &Segment, f: SegmentFlag) -> bool {
    s.flags
        .as_ref()
        .is_some_and(|v| v.iter().any(|x| x == f.name()))
}

/// Only what this planner handles: modes `reencrypt`, `encrypt` and `decrypt`, either
/// direction, in place; and the encryption that moves the data backward (`datashift` with a
/// `backup-moved-segment`, as cryptsetup's `--encrypt --reduce-device-size` writes it).
pub fn check_supported(st: &ReencryptState) -> Result<Protect> {
    let k = &st.keyslot;
    let moved_guard = match &k.resilience {
        Resilience::DatashiftChecksum {
            hash, sector_size, ..
        } => Some(MovedGuard::Checksum {
            hash: HashAlg::from_name(hash)?,
            block: *sector_size,
        }),
        Resilience::DatashiftJournal { .. } => Some(MovedGuard::Journal),
        _ => None,
    };
    if let (Some(guard), Mode::Decrypt, Direction::Forward, Some(_)) =
        (moved_guard, k.mode, k.direction, st.backup_moved)
    {
        // The resilience types were added with the version: cryptsetup writes them under v3
        // only, and the version is part of the reencryption digest.
        if st.version != UNSHIFT_REQUIREMENT_VERSION {
            return Err(shift_bad(format!(
                "resilience {} under requirement version {} (cryptsetup writes it under \
                 online-reencrypt-v{UNSHIFT_REQUIREMENT_VERSION})",
                k.resilience.name(),
                st.version
            )));
        }
        return Ok(Protect::Unshift(guard));
    }
    if st.backup_moved.is_some()
        || matches!(
            k.resilience,
            Resilience::Datashift { .. }
                | Resilience::DatashiftChecksum { .. }
                | Resilience::DatashiftJournal { .. }
        )
    {
        return match (&k.resilience, k.mode, k.direction, st.backup_moved) {
            (Resilience::Datashift { .. }, Mode::Encrypt, Direction::Backward, Some(_)) => {
                Ok(Protect::Datashift)
            }
            (Resilience::Datashift { .. }, Mode::Encrypt, Direction::Backward, None) => {
                Err(unsupported(UNMOVED_DATASHIFT))
            }
            _ => Err(unsupported(format!(
                "reencryption {} {} with resilience {}{} (ucrypt moves the data to encrypt \
                 with the header in front: encrypt, backward, datashift; and to decrypt it \
                 back to the start: decrypt, forward, datashift-checksum or datashift-journal; \
                 each with a moved segment)",
                k.mode.name(),
                k.direction.name(),
                k.resilience.name(),
                if st.backup_moved.is_some() {
                    " and a moved segment"
                } else {
                    ""
                }
            ))),
        };
    }
    match &k.resilience {
        Resilience::Checksum { hash, sector_size } => Ok(Protect::Checksum {
            hash: HashAlg::from_name(hash)?,
            block: *sector_size,
        }),
        Resilience::Journal => Ok(Protect::Journal),
        Resilience::None => Ok(Protect::None),
        r => Err(Error::Bug(match r {
            Resilience::Datashift { .. } => "datashift resilience past its check",
            _ => "datashift-checksum or datashift-journal resilience past its check",
        })),
    }
}

fn shift_bad(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt-datashift",
        detail: detail.into(),
    }
}

/// The geometry of an encryption that moves the data (cryptsetup's `reencrypt --encrypt
/// --reduce-device-size 2S`), read from the backup segments and checked:
///
/// ```text
/// before:  [ plaintext, D bytes                      ][ free, 2S ]
/// init:    [ header, S ][ plaintext S..D at its place ][ free, S ][ moved: plaintext 0..S ]
/// after:   [ header, S ][ ciphertext of 0..D                     ][ wiped           ]
/// ```
///
/// Data byte `x` moves from device offset `x` to `S + x`, hotzone by hotzone from the end
/// (backward), each hotzone at most `S` so that it never overlaps its source; the first `S`
/// bytes, whose place the header took, are encrypted last, from the moved segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shift {
    /// `shift_size`: how far the data moves, and the new data offset.
    pub shift_bytes: u64,
    /// The plaintext's old offset (backup-previous: 0).
    pub old_offset: u64,
    /// The data offset of the encrypted volume (backup-final: old offset + shift).
    pub new_offset: u64,
    /// Where the moved segment (a copy of the first `shift_bytes` of data) lies.
    pub moved_offset: u64,
    /// Bytes of plaintext to move (backup-previous's size, `D`).
    pub data_bytes: u64,
}

impl Shift {
    /// The device bytes the moved segment needs: its end.
    pub fn device_bytes_min(&self) -> u64 {
        self.moved_offset + self.shift_bytes
    }

    /// Refuses a device of `have` bytes that ends before the moved segment does.
    pub fn check_device(&self, have: u64) -> Result<()> {
        if have < self.device_bytes_min() {
            return Err(Error::BadHeader {
                check: "reencrypt-datashift",
                detail: format!(
                    "the moved segment ends at {}, past the device's {have} bytes",
                    self.device_bytes_min()
                ),
            });
        }
        Ok(())
    }
}

fn segment_of(meta: &Metadata, id: u32) -> Result<&Segment> {
    meta.segments
        .get(&id.to_string())
        .ok_or_else(|| bad(format!("segment {id} missing")))
}

/// The [`Shift`] of a data-moving encryption, `None` for a reencryption in place. Every
/// relation the protocol relies on is checked (named check `reencrypt-datashift`): the shift
/// is the moved segment's size and the distance between the old and the new data offset, the
/// moved segment lies past every byte a hotzone writes, there is at least one shift of data.
/// The reencryption digest covers these segments; this refuses a header whose digest is right
/// but whose layout is not one cryptsetup (or ucrypt) writes.
pub fn shift_geometry(meta: &Metadata, st: &ReencryptState) -> Result<Option<Shift>> {
    if check_supported(st)? != Protect::Datashift {
        return Ok(None);
    }
    let Resilience::Datashift { shift_size } = st.keyslot.resilience else {
        return Err(Error::Bug("datashift protection without a shift"));
    };
    let moved_id = st
        .backup_moved
        .ok_or(Error::Bug("datashift protection without a moved segment"))?;
    let prev = segment_of(meta, st.backup_previous)?;
    let fin = segment_of(meta, st.backup_final)?;
    let moved = segment_of(meta, moved_id)?;
    if prev.kind != SegmentKind::Linear
        || moved.kind != SegmentKind::Linear
        || fin.kind != SegmentKind::Crypt
    {
        return Err(shift_bad(format!(
            "backup-previous {}, backup-moved-segment {}, backup-final {} (an encryption \
             moves linear data into a crypt segment)",
            prev.kind, moved.kind, fin.kind
        )));
    }
    let SegmentSize::Bytes(data_bytes) = prev.size else {
        return Err(shift_bad(
            "backup-previous has dynamic size (the data to move has a fixed size)",
        ));
    };
    let SegmentSize::Bytes(moved_bytes) = moved.size else {
        return Err(shift_bad("backup-moved-segment has dynamic size"));
    };
    let (old_offset, new_offset, moved_offset) = (prev.offset.0, fin.offset.0, moved.offset.0);
    if fin.iv_tweak.map_or(0, |t| t.0) != 0 {
        return Err(shift_bad("backup-final has a non-zero iv_tweak"));
    }
    if new_offset.checked_sub(old_offset) != Some(shift_size) {
        return Err(shift_bad(format!(
            "the data moves from offset {old_offset} to {new_offset}, not by the shift_size \
             {shift_size}"
        )));
    }
    if moved_bytes != shift_size {
        return Err(shift_bad(format!(
            "the moved segment holds {moved_bytes} bytes, not the shift_size {shift_size}"
        )));
    }
    if data_bytes < shift_size || data_bytes % IV_UNIT_BYTES != 0 {
        return Err(shift_bad(format!(
            "{data_bytes} bytes of data for a shift of {shift_size} (ucrypt moves at least one \
             shift of data, in 512-byte units)"
        )));
    }
    let written_end = new_offset
        .checked_add(data_bytes)
        .ok_or_else(|| shift_bad("data end overflows"))?;
    if moved_offset < written_end || moved_offset.checked_add(moved_bytes).is_none() {
        return Err(shift_bad(format!(
            "the moved segment at {moved_offset} is inside the {written_end} bytes the \
             hotzones write"
        )));
    }
    Ok(Some(Shift {
        shift_bytes: shift_size,
        old_offset,
        new_offset,
        moved_offset,
        data_bytes,
    }))
}

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
fn position_unshift(meta: &Metadata, u: &Unshift) -> Result<Position> {
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
/// `unshift_init_matches_cryptsetup_and_each_finishes_the_other` and the `unshift_*` kill
/// tests compare the two tools): the moved segment (crypt, until its
/// hotzone), the plaintext done (linear at `M`: fixed size, `dynamic` once the walk is done),
/// the hotzone (linear, `in-reencryption`), the ciphertext left (crypt at its old place, IV
/// tweak its data offset, backup-previous's size rule); then backup-previous, backup-final and
/// backup-moved-segment. The old key's digest lists backup-previous, backup-moved-segment,
/// then every live crypt segment. Once all is done: one linear segment at the new data offset.
fn set_segments_unshift(
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
    let n = live.len() as u32;
    let mut list = vec![n.to_string(), (n + 2).to_string()];
    list.extend(
        live.iter()
            .enumerate()
            .filter(|(_, s)| s.kind == SegmentKind::Crypt)
            .map(|(i, _)| i.to_string()),
    );
    let mut segments: std::collections::BTreeMap<String, Segment> = live
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i.to_string(), s))
        .collect();
    let moved_backup = template(meta, moved_id)?;
    for (id, mut s, flag) in [
        (n, prev, SegmentFlag::BackupPrevious),
        (n + 1, fin, SegmentFlag::BackupFinal),
        (n + 2, moved_backup, SegmentFlag::BackupMovedSegment),
    ] {
        s.flags = Some(vec![flag.name().into()]);
        segments.insert(id.to_string(), s);
    }
    meta.digests
        .get_mut(&d_old.to_string())
        .ok_or_else(|| bad(format!("digest {d_old} missing")))?
        .segments = list;
    meta.segments = segments;
    st.backup_previous = n;
    st.backup_final = n + 1;
    st.backup_moved = Some(n + 2);
    st.in_reencryption = hot_id;
    Ok(())
}

/// The steps of the next hotzone of a decryption that moves the data, as cryptsetup 2.6 walks
/// it (seen with `--debug` and by stopping it between and inside hotzones; pinned by the
/// `unshift_*` tests of `reencrypt_interop`): forward from
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

/// What a live segment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Old,
    Hot,
    New,
}

/// The digests of the old and new keys (`None`: encryption has no old key, decryption no new
/// one).
fn key_digests(meta: &Metadata, st: &ReencryptState) -> Result<(Option<u32>, Option<u32>)> {
    let d_old = digest_of_segment(meta, st.backup_previous);
    let d_new = digest_of_segment(meta, st.backup_final);
    let want_old = st.keyslot.mode != Mode::Encrypt;
    let want_new = st.keyslot.mode != Mode::Decrypt;
    if d_old.is_some() != want_old || d_new.is_some() != want_new {
        return Err(bad(format!(
            "mode {} with backup-previous digest {d_old:?} and backup-final digest {d_new:?}",
            st.keyslot.mode.name()
        )));
    }
    if d_old.is_some() && d_old == d_new {
        return Err(bad("old and new keys share a digest: nothing to rotate"));
    }
    Ok((d_old, d_new))
}

/// Which part a live segment is: the hotzone by its flag; otherwise new if the new key's
/// digest lists it (or, for decryption, if it is linear), old if not.
fn part_of(meta: &Metadata, st: &ReencryptState, id: u32, s: &Segment) -> Result<Part> {
    if has_flag(s, SegmentFlag::InReencryption) {
        return Ok(Part::Hot);
    }
    let (_, d_new) = key_digests(meta, st)?;
    let new = match d_new {
        Some(d) => meta
            .digests
            .get(&d.to_string())
            .is_some_and(|x| x.segments.contains(&id.to_string())),
        None => s.kind == SegmentKind::Linear,
    };
    Ok(if new { Part::New } else { Part::Old })
}

/// Reads the live segments back into a [`Position`] for a volume of `data_bytes` bytes of
/// data: forward `[new] [hotzone] [old]`, backward `[old] [hotzone] [new]`, each part
/// optional but not all.
pub fn position(meta: &Metadata, st: &ReencryptState, data_bytes: u64) -> Result<Position> {
    if let Some(sh) = shift_geometry(meta, st)? {
        return position_shift(meta, &sh, data_bytes);
    }
    if let Some(u) = unshift_geometry(meta, st, data_bytes)? {
        return position_unshift(meta, &u);
    }
    let live = live_segments(meta);
    let mut parts = Vec::with_capacity(live.len());
    for (id, s) in &live {
        parts.push((part_of(meta, st, *id, s)?, *s));
    }
    let order: &[Part] = match st.keyslot.direction {
        Direction::Forward => &[Part::New, Part::Hot, Part::Old],
        Direction::Backward => &[Part::Old, Part::Hot, Part::New],
    };
    // Each part at most once, in the direction's order.
    let mut at = 0;
    for (p, _) in &parts {
        match order[at..].iter().position(|o| o == p) {
            Some(i) => at += i + 1,
            None => {
                return Err(bad(format!(
                    "live segments {:?} are not a {} layout",
                    parts.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
                    st.keyslot.direction.name()
                )))
            }
        }
    }
    let size_of = |want: Part| -> Result<Option<u64>> {
        match parts.iter().find(|(p, _)| *p == want) {
            None => Ok(None),
            Some((_, s)) => match s.size {
                SegmentSize::Bytes(n) => Ok(Some(n)),
                // Only the part that ends at the end of the data may be dynamic.
                SegmentSize::Dynamic if parts.last().is_some_and(|(p, _)| *p == want) => Ok(Some(
                    data_bytes.saturating_sub(s.offset.0 - parts[0].1.offset.0),
                )),
                SegmentSize::Dynamic => Err(bad("a segment before the last has dynamic size")),
            },
        }
    };
    let hotzone = size_of(Part::Hot)?;
    if hotzone == Some(0) {
        return Err(bad("an empty hotzone"));
    }
    let done = match st.keyslot.direction {
        Direction::Forward => size_of(Part::New)?.unwrap_or(0),
        Direction::Backward => {
            let not_done = size_of(Part::Old)?.unwrap_or(0) + hotzone.unwrap_or(0);
            data_bytes.checked_sub(not_done).ok_or_else(|| {
                bad(format!(
                    "{not_done} bytes left is past the {data_bytes}-byte data"
                ))
            })?
        }
    };
    if done + hotzone.unwrap_or(0) > data_bytes {
        return Err(bad(format!(
            "position {done} + hotzone {hotzone:?} is past the {data_bytes}-byte data"
        )));
    }
    Ok(Position { done, hotzone })
}

/// [`position`] of a data-moving encryption: the crypt segments are the hotzone (flagged) and
/// the done part, at the new data offset; whatever is below them is not done yet. The exact
/// layout (moved segment, the rest at its old place) is [`check_layout`]'s.
fn position_shift(meta: &Metadata, sh: &Shift, data_bytes: u64) -> Result<Position> {
    if data_bytes != sh.data_bytes {
        return Err(bad(format!(
            "{data_bytes} bytes of data where backup-previous holds {}",
            sh.data_bytes
        )));
    }
    let (mut hot, mut done_start) = (None, None);
    for (id, s) in live_segments(meta) {
        if s.kind != SegmentKind::Crypt {
            continue;
        }
        let start = s.offset.0.checked_sub(sh.new_offset).ok_or_else(|| {
            bad(format!(
                "crypt segment {id} at {} is before the new data offset {}",
                s.offset.0, sh.new_offset
            ))
        })?;
        if has_flag(s, SegmentFlag::InReencryption) {
            note_hotzone(&mut hot, s, start)?;
        } else if done_start.replace(start).is_some() {
            return Err(bad("two encrypted segments besides the hotzone"));
        }
    }
    let low = match (done_start, hot) {
        (Some(b), _) => b,
        (None, Some((h, len))) => h
            .checked_add(len)
            .ok_or_else(|| bad("hotzone end overflows"))?,
        (None, None) => data_bytes,
    };
    if low > data_bytes {
        return Err(bad(format!(
            "the encrypted part begins at {low}, past the {data_bytes}-byte data"
        )));
    }
    let hotzone = match hot {
        None => None,
        Some((_, 0)) => return Err(bad("an empty hotzone")),
        Some((h, len)) if h.checked_add(len) != Some(low) => {
            return Err(bad(format!(
                "the hotzone [{h}, +{len}) does not end where the done part begins ({low})"
            )))
        }
        Some((_, len)) => Some(len),
    };
    Ok(Position {
        done: data_bytes - low,
        hotzone,
    })
}

/// Where `pos`'s hotzone of `len` bytes lies in the data (offset from its start): after the
/// done part going forward, before it going backward.
pub fn hotzone_offset(st: &ReencryptState, pos: Position, len: u64, data_bytes: u64) -> u64 {
    match st.keyslot.direction {
        Direction::Forward => pos.done,
        Direction::Backward => data_bytes - pos.done - len,
    }
}

fn template(meta: &Metadata, id: u32) -> Result<Segment> {
    let mut s = meta
        .segments
        .get(&id.to_string())
        .ok_or_else(|| bad(format!("segment {id} missing")))?
        .clone();
    s.flags = None;
    Ok(s)
}

/// `s` moved `skip` bytes into the data: offset (and a crypt segment's IV tweak) advanced,
/// size as given.
fn advanced(s: &Segment, skip: u64, size: SegmentSize) -> Result<Segment> {
    if skip % IV_UNIT_BYTES != 0 {
        return Err(bad(format!("boundary {skip} is not 512-byte aligned")));
    }
    let mut out = s.clone();
    out.offset = U64Str(
        s.offset
            .0
            .checked_add(skip)
            .ok_or_else(|| bad("offset overflow"))?,
    );
    if s.kind == SegmentKind::Crypt {
        out.iv_tweak = Some(U64Str(s.iv_tweak.map_or(0, |v| v.0) + skip / IV_UNIT_BYTES));
    }
    out.size = size;
    Ok(out)
}

/// Rewrites the segments (and the keys' digests' segment lists) for `pos` on `data_bytes`
/// bytes of data, as cryptsetup lays them out: forward done part (new), hotzone
/// (`in-reencryption`), rest (old); backward rest (old), hotzone, done part (new); then
/// backup-previous and backup-final. The part that ends at the end of the data keeps its
/// backup's size (`dynamic` as a rule), the others get fixed sizes. A key rotation lists the
/// hotzone first in both keys' digests; encryption and decryption list the key's backup
/// first, then every crypt segment. `st` is updated to the new backup ids.
pub fn set_segments(
    meta: &mut Metadata,
    st: &mut ReencryptState,
    pos: Position,
    data_bytes: u64,
) -> Result<()> {
    if let Some(sh) = shift_geometry(meta, st)? {
        return set_segments_shift(meta, st, &sh, pos);
    }
    if let Some(u) = unshift_geometry(meta, st, data_bytes)? {
        return set_segments_unshift(meta, st, &u, pos);
    }
    let old = template(meta, st.backup_previous)?;
    let new = template(meta, st.backup_final)?;
    let (d_old, d_new) = key_digests(meta, st)?;
    let hot = pos.hotzone.unwrap_or(0);
    let moved = pos
        .done
        .checked_add(hot)
        .filter(|&m| m <= data_bytes)
        .ok_or_else(|| {
            bad(format!(
                "position {} + {hot} is not inside the {data_bytes}-byte data",
                pos.done
            ))
        })?;
    let forward = st.keyslot.direction == Direction::Forward;
    // (part, start, length) in data order.
    let spans: Vec<(Part, u64, u64)> = if forward {
        vec![
            (Part::New, 0, pos.done),
            (Part::Hot, pos.done, hot),
            (Part::Old, moved, data_bytes - moved),
        ]
    } else {
        let b = data_bytes - moved;
        vec![
            (Part::Old, 0, b),
            (Part::Hot, b, hot),
            (Part::New, b + hot, pos.done),
        ]
    };
    let mut live: Vec<(Segment, Part)> = Vec::new();
    for (part, start, len) in spans.into_iter().filter(|s| s.2 > 0) {
        let base = if part == Part::Old { &old } else { &new };
        let size = match base.size {
            SegmentSize::Dynamic if part != Part::Hot && start + len == data_bytes => {
                SegmentSize::Dynamic
            }
            _ => SegmentSize::Bytes(len),
        };
        let mut seg = advanced(base, start, size)?;
        if part == Part::Hot {
            seg.flags = Some(vec![SegmentFlag::InReencryption.name().into()]);
        }
        live.push((seg, part));
    }
    let n = live.len() as u32;
    let (mut old_list, mut new_list) = (Vec::new(), Vec::new());
    if st.keyslot.mode == Mode::Reencrypt {
        // cryptsetup lists the hotzone first in both digests, then the key's own segment.
        if let Some(h) = live.iter().position(|(_, p)| *p == Part::Hot) {
            old_list.push(h.to_string());
            new_list.push(h.to_string());
        }
        for (i, (_, p)) in live.iter().enumerate() {
            match p {
                Part::Old => old_list.push(i.to_string()),
                Part::New => new_list.push(i.to_string()),
                Part::Hot => {}
            }
        }
        old_list.push(n.to_string());
        new_list.push((n + 1).to_string());
    } else {
        let (list, backup) = if d_new.is_some() {
            (&mut new_list, n + 1)
        } else {
            (&mut old_list, n)
        };
        list.push(backup.to_string());
        for (i, (s, _)) in live.iter().enumerate() {
            if s.kind == SegmentKind::Crypt {
                list.push(i.to_string());
            }
        }
    }
    st.in_reencryption = live
        .iter()
        .position(|(_, p)| *p == Part::Hot)
        .map(|h| h as u32);
    let mut segments: std::collections::BTreeMap<String, Segment> = live
        .into_iter()
        .enumerate()
        .map(|(i, (s, _))| (i.to_string(), s))
        .collect();
    let mut prev = old;
    prev.flags = Some(vec![SegmentFlag::BackupPrevious.name().into()]);
    let mut fin = new;
    fin.flags = Some(vec![SegmentFlag::BackupFinal.name().into()]);
    segments.insert(n.to_string(), prev);
    segments.insert((n + 1).to_string(), fin);
    for (id, list) in [(d_old, old_list), (d_new, new_list)] {
        if let Some(id) = id {
            meta.digests
                .get_mut(&id.to_string())
                .ok_or_else(|| bad(format!("digest {id} missing")))?
                .segments = list;
        }
    }
    meta.segments = segments;
    st.backup_previous = n;
    st.backup_final = n + 1;
    Ok(())
}

/// [`set_segments`] of a data-moving encryption, as cryptsetup 2.6 lays them out (seen
/// after `--init-only` and after SIGKILLs between and inside hotzones; `reencrypt_interop`'s
/// `shift_init_matches_cryptsetup_and_each_finishes_the_other` and the shift kill tests
/// compare the two tools): the moved segment
/// (until the last hotzone, which encrypts it), the plaintext still at its old place beyond
/// the first shift, the hotzone (`in-reencryption`), the done part (fixed size; `dynamic`
/// once all is done); then backup-previous, backup-final and backup-moved-segment. The new
/// key's digest lists backup-final, then every crypt segment.
fn set_segments_shift(
    meta: &mut Metadata,
    st: &mut ReencryptState,
    sh: &Shift,
    pos: Position,
) -> Result<()> {
    let moved_id = st
        .backup_moved
        .ok_or(Error::Bug("datashift protection without a moved segment"))?;
    let prev = template(meta, st.backup_previous)?;
    let fin = template(meta, st.backup_final)?;
    let moved = template(meta, moved_id)?;
    let (_, d_new) = key_digests(meta, st)?;
    let d = sh.data_bytes;
    let hot = pos.hotzone.unwrap_or(0);
    let b = d
        .checked_sub(pos.done)
        .ok_or_else(|| bad(format!("{} bytes done of {d}", pos.done)))?;
    let h = b
        .checked_sub(hot)
        .ok_or_else(|| bad(format!("hotzone of {hot} bytes below {b}")))?;
    let mut live: Vec<Segment> = Vec::new();
    if h > 0 {
        live.push(moved.clone());
    }
    if h > sh.shift_bytes {
        live.push(advanced(
            &prev,
            sh.shift_bytes,
            SegmentSize::Bytes(h - sh.shift_bytes),
        )?);
    }
    let mut hot_id = None;
    if hot > 0 {
        let mut seg = advanced(&fin, h, SegmentSize::Bytes(hot))?;
        seg.flags = Some(vec![SegmentFlag::InReencryption.name().into()]);
        hot_id = Some(live.len() as u32);
        live.push(seg);
    }
    if pos.done > 0 {
        let size = if b == 0 {
            SegmentSize::Dynamic
        } else {
            SegmentSize::Bytes(pos.done)
        };
        live.push(advanced(&fin, b, size)?);
    }
    let n = live.len() as u32;
    let mut list = vec![(n + 1).to_string()];
    list.extend(
        live.iter()
            .enumerate()
            .filter(|(_, s)| s.kind == SegmentKind::Crypt)
            .map(|(i, _)| i.to_string()),
    );
    let mut segments: std::collections::BTreeMap<String, Segment> = live
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i.to_string(), s))
        .collect();
    for (id, mut s, flag) in [
        (n, prev, SegmentFlag::BackupPrevious),
        (n + 1, fin, SegmentFlag::BackupFinal),
        (n + 2, moved, SegmentFlag::BackupMovedSegment),
    ] {
        s.flags = Some(vec![flag.name().into()]);
        segments.insert(id.to_string(), s);
    }
    let d_new = d_new.ok_or(Error::Bug("an encryption without a new key"))?;
    meta.digests
        .get_mut(&d_new.to_string())
        .ok_or_else(|| bad(format!("digest {d_new} missing")))?
        .segments = list;
    meta.segments = segments;
    st.backup_previous = n;
    st.backup_final = n + 1;
    st.backup_moved = Some(n + 2);
    st.in_reencryption = hot_id;
    Ok(())
}

/// The largest hotzone the reencrypt keyslot area can protect: as many checksum blocks as
/// hashes fit, the area's size for a journal, unbounded for `none`.
pub fn area_limit(st: &ReencryptState) -> Result<u64> {
    Ok(match check_supported(st)? {
        Protect::None => u64::MAX,
        Protect::Checksum { hash, block } => {
            st.keyslot.area_bytes / hash.output_bytes() as u64 * u64::from(block)
        }
        Protect::Journal => st.keyslot.area_bytes,
        // The shift bounds the hotzone, not the area (which holds nothing).
        Protect::Datashift | Protect::Unshift { .. } => match st.keyslot.resilience {
            Resilience::Datashift { shift_size }
            | Resilience::DatashiftChecksum { shift_size, .. }
            | Resilience::DatashiftJournal { shift_size } => shift_size,
            _ => return Err(Error::Bug("datashift protection without a shift")),
        },
    })
}

/// The longest hotzone cryptsetup 2.6 cuts (its `LUKS2_REENCRYPT_MAX_HOTZONE_LENGTH`).
pub const CRYPTSETUP_HOTZONE_BYTES_MAX: u64 = 1 << 30;

/// How long a backward walk's last hotzone (the one at data offset 0) is made, in bytes
/// (whole units of `align`, the larger sector size, or of the checksum block where larger);
/// 0 where it is cut as any other (forward walks, no resilience data, data shifts).
///
/// cryptsetup 2.6.1 repairs a hotzone and then counts as done the length it would have cut
/// itself (the whole journal area, or as many checksum blocks as the area holds hashes, at
/// most [`CRYPTSETUP_HOTZONE_BYTES_MAX`] and the data), not the hotzone's own. Repairing a
/// shorter last hotzone, it leaves the reencryption unfinished over one linear segment,
/// which its `--resume-only` takes for the old one and decrypts again: every byte lost
/// (a decryption cryptsetup was killed in at its last hotzone, with its default journal, and
/// one ucrypt was killed in at a short last hotzone, both repaired and resumed by cryptsetup;
/// `reencrypt_interop`'s
/// `cryptsetup_repairs_a_decryption_ucrypt_was_killed_in_at_its_last_hotzone` pins the
/// second). So a backward walk with a journal or checksums leaves that length
/// for its last hotzone, and cryptsetup's repair finishes it. A reencryption found with less
/// than that left keeps what is left.
pub fn last_backward_hotzone(st: &ReencryptState, data_bytes: u64, align: u64) -> Result<u64> {
    if st.keyslot.direction != Direction::Backward || align == 0 {
        return Ok(0);
    }
    let (theirs, align) = match check_supported(st)? {
        Protect::Journal => (st.keyslot.area_bytes, align),
        Protect::Checksum { hash, block } => (
            st.keyslot.area_bytes / hash.output_bytes() as u64 * u64::from(block),
            align.max(u64::from(block)),
        ),
        Protect::None | Protect::Datashift | Protect::Unshift { .. } => return Ok(0),
    };
    let want = theirs
        .min(CRYPTSETUP_HOTZONE_BYTES_MAX)
        .min(data_bytes)
        .div_ceil(align)
        * align;
    Ok(want.min(area_limit(st)? / align * align).min(data_bytes))
}

/// The steps of the next hotzone of `data_bytes` bytes of data, hotzones of at most
/// `hotzone_max` bytes, each a multiple of `align` (the larger sector size, and the checksum
/// block), but for a backward walk's last one ([`last_backward_hotzone`]); `None` when every
/// byte is done. The last hotzone ends with [`Step::Finalise`]. Refuses a position inside a
/// hotzone: that needs recovery first.
pub fn next_hotzone(
    st: &ReencryptState,
    pos: Position,
    data_bytes: u64,
    hotzone_max: u64,
    align: u64,
) -> Result<Option<Vec<Step>>> {
    let protect = check_supported(st)?;
    if matches!(protect, Protect::Datashift | Protect::Unshift { .. }) {
        return Err(Error::Bug(
            "a data shift is planned by next_hotzone_shift or next_hotzone_unshift",
        ));
    }
    if pos.hotzone.is_some() {
        return Err(bad(
            "the metadata was committed inside a hotzone: recover it first (repair)",
        ));
    }
    if pos.done >= data_bytes {
        return Ok(None);
    }
    let align = match protect {
        Protect::Checksum { block, .. } => align.max(u64::from(block)),
        _ => align,
    };
    if align == 0 || !align.is_power_of_two() {
        return Err(bad(format!("alignment {align} is not a power of two")));
    }
    let remaining = data_bytes - pos.done;
    if remaining % align != 0 {
        return Err(bad(format!(
            "{remaining} bytes left is not a multiple of the {align}-byte alignment"
        )));
    }
    let area = area_limit(st)?;
    let last = last_backward_hotzone(st, data_bytes, align)?;
    let len = if last == 0 {
        hotzone_max.min(remaining).min(area) / align * align
    } else if remaining > last {
        // Up to the last hotzone's start, and no further.
        hotzone_max.min(remaining - last).min(area) / align * align
    } else {
        remaining.min(area) / align * align
    };
    if len == 0 {
        return Err(bad(format!(
            "no whole {align}-byte block fits a hotzone (remaining {remaining}, hotzone \
             {hotzone_max}, area {} bytes)",
            st.keyslot.area_bytes
        )));
    }
    let offset = hotzone_offset(st, pos, len, data_bytes);
    let mut steps = vec![Step::ReadOld { offset, len }];
    let area_offset = st.keyslot.area_offset;
    match protect {
        Protect::Checksum { hash, block } => steps.extend([
            Step::WriteChecksums {
                area_offset,
                block,
                hash,
            },
            Step::SyncData,
        ]),
        Protect::Journal => steps.extend([Step::WriteJournal { area_offset }, Step::SyncData]),
        Protect::None | Protect::Datashift | Protect::Unshift { .. } => {}
    }
    steps.extend([
        Step::CommitSegments(Position {
            done: pos.done,
            hotzone: Some(len),
        }),
        Step::WriteNew { offset, len },
        Step::SyncData,
    ]);
    steps.push(if pos.done + len == data_bytes {
        Step::Finalise
    } else {
        Step::CommitSegments(Position {
            done: pos.done + len,
            hotzone: None,
        })
    });
    Ok(Some(steps))
}

/// The steps of the next hotzone of a data-moving encryption, as cryptsetup 2.6 walks it
/// (seen with `--debug` and SIGKILLs; pinned by `reencrypt_interop`'s shift tests): backward
/// from the end of the data in hotzones of
/// the shift, the lowest one above the first shift shortened to what is left, and last the
/// first shift itself, from the moved segment. Each: commit the hotzone, move it
/// ([`Step::MoveNew`]), flush, commit past it (finalise after the last). No resilience data:
/// a hotzone's source stays intact until it is committed done. `align` is the sector size
/// every hotzone must be a multiple of. `None` when every byte is done.
pub fn next_hotzone_shift(sh: &Shift, pos: Position, align: u64) -> Result<Option<Vec<Step>>> {
    if pos.hotzone.is_some() {
        return Err(bad(
            "the metadata was committed inside a hotzone: recover it first (repair)",
        ));
    }
    let s = sh.shift_bytes;
    let b = sh
        .data_bytes
        .checked_sub(pos.done)
        .ok_or_else(|| bad(format!("{} bytes done of {}", pos.done, sh.data_bytes)))?;
    if b == 0 {
        return Ok(None);
    }
    let (h, len, from) = if b == s {
        (0, s, sh.moved_offset)
    } else if b > s {
        let len = s.min(b - s);
        (b - len, len, shift_source(sh, b - len))
    } else {
        return Err(bad(format!(
            "{b} bytes left, less than the {s}-byte shift and not zero"
        )));
    };
    if align == 0 || !align.is_power_of_two() || len % align != 0 || h % align != 0 {
        return Err(bad(format!(
            "hotzone [{h}, +{len}) is not aligned to {align} bytes"
        )));
    }
    let mut steps = vec![
        Step::CommitSegments(Position {
            done: pos.done,
            hotzone: Some(len),
        }),
        Step::MoveNew {
            from,
            offset: h,
            len,
        },
        Step::SyncData,
    ];
    steps.push(if h == 0 {
        Step::Finalise
    } else {
        Step::CommitSegments(Position {
            done: pos.done + len,
            hotzone: None,
        })
    });
    Ok(Some(steps))
}

/// The source of a data shift's hotzone at data offset `offset` ([`Step::MoveNew`]'s `from`):
/// the moved segment for the first shift, the data's old place otherwise.
pub fn shift_source(sh: &Shift, offset: u64) -> u64 {
    if offset == 0 {
        sh.moved_offset
    } else {
        sh.old_offset + offset
    }
}

/// What finalisation retires: keyslot areas to wipe (offset, length), the reencrypt
/// keyslot's among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    pub keyslots: Vec<u32>,
    pub areas: Vec<(u64, u64)>,
    /// Data-device ranges (offset, length) to wipe: the moved segment of a data shift, a
    /// plaintext copy of the first shift (cryptsetup wipes it with random bytes too).
    pub data_areas: Vec<(u64, u64)>,
}

/// The plain LUKS2 metadata a finished reencryption leaves (as cryptsetup leaves it): one
/// segment `0` (backup-final without its flag: linear after a decryption), the new key's
/// digest listing it, the old key's keyslots and digest gone, the reencrypt keyslot and its
/// digest gone, the requirement gone. Digest and keyslot ids are kept, not renumbered. After a
/// decryption no keyslot and no digest is left, as cryptsetup leaves a detached header.
pub fn finalise(meta: &mut Metadata, st: &ReencryptState) -> Result<Retired> {
    let data_areas = match shift_geometry(meta, st)? {
        Some(sh) => vec![(sh.moved_offset, sh.shift_bytes)],
        None => Vec::new(),
    };
    let mut fin = template(meta, st.backup_final)?;
    fin.flags = None;
    let (d_old, d_new) = key_digests(meta, st)?;
    let rk = st.keyslot.id.to_string();
    let d_reenc = meta
        .digest_for_keyslot(&rk)
        .map(|(id, _)| id.clone())
        .ok_or_else(|| bad("the reencrypt keyslot has no digest"))?;
    let old_keyslots = match d_old {
        Some(d) => {
            meta.digests
                .remove(&d.to_string())
                .ok_or_else(|| bad(format!("digest {d} missing")))?
                .keyslots
        }
        None => Vec::new(),
    };
    meta.digests.remove(&d_reenc);
    let mut retired = Retired {
        keyslots: Vec::new(),
        areas: Vec::new(),
        data_areas,
    };
    for k in old_keyslots.iter().chain(std::iter::once(&rk)) {
        if let Some(ks) = meta.keyslots.remove(k) {
            retired.keyslots.push(k.parse().unwrap_or(u32::MAX));
            // The old keys' material and the resilience data (checksums or a journal of
            // old ciphertext, or plaintext for an encryption): cryptsetup overwrites both
            // areas when it destroys the keyslots (the whole reencrypt area).
            if let Some(a) = ks.area {
                retired.areas.push((a.offset.0, a.size.0));
            }
        }
        for t in meta.tokens.values_mut() {
            if let Some(serde_json::Value::Array(a)) = t.get_mut("keyslots") {
                a.retain(|v| v.as_str() != Some(k.as_str()));
            }
        }
    }
    meta.segments = std::collections::BTreeMap::from([("0".to_string(), fin)]);
    if let Some(d) = d_new {
        meta.digests
            .get_mut(&d.to_string())
            .ok_or_else(|| bad(format!("digest {d} missing")))?
            .segments = vec!["0".into()];
    }
    if let Some(r) = meta.config.requirements.as_mut() {
        if let Some(m) = r.mandatory.as_mut() {
            m.retain(|n| !crate::luks::reencrypt::is_reencrypt_requirement(n));
            if m.is_empty() {
                r.mandatory = None;
            }
        }
        if r.mandatory.is_none() && r.extra.is_empty() {
            meta.config.requirements = None;
        }
    }
    Ok(retired)
}

fn layout(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt-segments",
        detail: detail.into(),
    }
}

/// The ids of the digests that list segment `id`.
fn keyed_by(meta: &Metadata, id: u32) -> Vec<&str> {
    let s = id.to_string();
    meta.digests
        .iter()
        .filter(|(_, d)| d.segments.contains(&s))
        .map(|(k, _)| k.as_str())
        .collect()
}

/// Checks that the live segments are the layout [`set_segments`] gives for their position:
/// contiguous from the data offset, each with its backup's cipher and sector size, IV tweaks
/// at their offsets, each under the key it must be under, nothing past the `data_bytes` of
/// data. The reencryption digest covers the reencrypt keyslot and the backup segments, not
/// the live segments: a header whose live segments disagree with them is refused here, before
/// anything is read or written.
pub fn check_layout(meta: &Metadata, st: &ReencryptState, data_bytes: u64) -> Result<()> {
    let pos = position(meta, st, data_bytes)?;
    let end = pos
        .done
        .checked_add(pos.hotzone.unwrap_or(0))
        .ok_or_else(|| layout("position overflow"))?;
    if end > data_bytes {
        return Err(layout(format!(
            "the done part and the hotzone end at byte {end}, past the {data_bytes} bytes of data"
        )));
    }
    let mut want_meta = meta.clone();
    let mut want_st = st.clone();
    set_segments(&mut want_meta, &mut want_st, pos, data_bytes)?;
    let have = live_segments(meta);
    let want = live_segments(&want_meta);
    if have.len() != want.len() {
        return Err(layout(format!(
            "{} live segments where the position needs {}",
            have.len(),
            want.len()
        )));
    }
    for ((hid, h), (wid, w)) in have.iter().zip(&want) {
        let same = h.kind == w.kind
            && h.offset == w.offset
            && h.size == w.size
            && h.iv_tweak.map_or(0, |t| t.0) == w.iv_tweak.map_or(0, |t| t.0)
            && h.encryption == w.encryption
            && h.sector_size == w.sector_size;
        if !same {
            return Err(layout(format!(
                "segment {hid} is {} at offset {} (size {:?}, IV tweak {:?}, {:?}, sector {:?}); \
                 its position needs {} at offset {} (size {:?}, IV tweak {:?}, {:?}, sector {:?})",
                h.kind,
                h.offset.0,
                h.size,
                h.iv_tweak.map(|t| t.0),
                h.encryption,
                h.sector_size,
                w.kind,
                w.offset.0,
                w.size,
                w.iv_tweak.map(|t| t.0),
                w.encryption,
                w.sector_size,
            )));
        }
        let (hk, wk) = (keyed_by(meta, *hid), keyed_by(&want_meta, *wid));
        if hk != wk {
            return Err(layout(format!(
                "segment {hid} is under the key of digest(s) {hk:?}; its position needs {wk:?}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::luks::{parse_any, Header};

    const MIB: u64 = 1 << 20;
    /// The data size of the volume the stored crash header comes from.
    const DATA: u64 = 192 * MIB;

    /// The first 32 KiB of a volume cryptsetup 2.6.1 was SIGKILLed in, inside its hotzone.
    fn crash() -> Metadata {
        let bytes = include_bytes!("../../../../tests/data/reencrypt-crash-hdr.bin");
        match parse_any(bytes).unwrap() {
            Header::Luks2(h) => h.meta,
            Header::Luks1(_) => unreachable!(),
        }
    }

    fn state(meta: &Metadata) -> ReencryptState {
        ReencryptState::from_metadata(meta).unwrap().unwrap()
    }

    fn digest_lists(meta: &Metadata) -> Vec<Vec<String>> {
        meta.digests.values().map(|d| d.segments.clone()).collect()
    }

    #[test]
    fn position_of_cryptsetups_crash() {
        let m = crash();
        assert_eq!(
            position(&m, &state(&m), DATA).unwrap(),
            Position {
                done: 28 * MIB,
                hotzone: Some(4 * MIB)
            }
        );
    }

    /// Rebuilding the segments for cryptsetup's own position gives cryptsetup's segments and
    /// digest lists, to the byte of the JSON.
    #[test]
    fn set_segments_reproduces_cryptsetups_layout() {
        let m = crash();
        let mut st = state(&m);
        let pos = position(&m, &st, DATA).unwrap();
        // From another layout (the start) back to cryptsetup's position.
        let mut rebuilt = m.clone();
        let start = Position {
            done: 0,
            hotzone: None,
        };
        set_segments(&mut rebuilt, &mut st, start, DATA).unwrap();
        assert_eq!(rebuilt.segments.len(), 3);
        set_segments(&mut rebuilt, &mut st, pos, DATA).unwrap();
        assert_eq!(
            serde_json::to_value(&rebuilt.segments).unwrap(),
            serde_json::to_value(&m.segments).unwrap()
        );
        assert_eq!(digest_lists(&rebuilt), digest_lists(&m));
        assert_eq!(st, state(&m));
    }

    /// After the hotzone: two live segments, the boundary at 32 MiB, the IV tweak of the rest
    /// advanced by 32 MiB / 512, digests as cryptsetup lists them between hotzones.
    #[test]
    fn set_segments_after_the_hotzone() {
        let mut m = crash();
        let mut st = state(&m);
        let done = 32 * MIB;
        set_segments(
            &mut m,
            &mut st,
            Position {
                done,
                hotzone: None,
            },
            DATA,
        )
        .unwrap();
        assert_eq!(m.segments.len(), 4);
        assert_eq!(m.segments["0"].size, SegmentSize::Bytes(done));
        assert_eq!(m.segments["1"].offset.0, 16 * MIB + done);
        assert_eq!(m.segments["1"].iv_tweak, Some(U64Str(done / 512)));
        assert_eq!(m.segments["1"].size, SegmentSize::Dynamic);
        assert_eq!(
            digest_lists(&m),
            vec![vec!["1", "2"], vec!["0", "3"], vec![]]
                .into_iter()
                .map(|v| v.into_iter().map(String::from).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        assert_eq!(
            position(&m, &st, DATA).unwrap(),
            Position {
                done,
                hotzone: None
            }
        );
        assert_eq!((st.backup_previous, st.backup_final), (2, 3));
    }

    #[test]
    fn next_hotzone_steps_in_cryptsetups_order() {
        let m = crash();
        let st = state(&m);
        let data = 80 * MIB;
        let pos = Position {
            done: 32 * MIB,
            hotzone: None,
        };
        let steps = next_hotzone(&st, pos, data, 4 * MIB, 4096)
            .unwrap()
            .unwrap();
        assert_eq!(
            steps,
            vec![
                Step::ReadOld {
                    offset: 32 * MIB,
                    len: 4 * MIB
                },
                Step::WriteChecksums {
                    area_offset: 548864,
                    block: 4096,
                    hash: HashAlg::Sha256
                },
                Step::SyncData,
                Step::CommitSegments(Position {
                    done: 32 * MIB,
                    hotzone: Some(4 * MIB)
                }),
                Step::WriteNew {
                    offset: 32 * MIB,
                    len: 4 * MIB
                },
                Step::SyncData,
                Step::CommitSegments(Position {
                    done: 36 * MIB,
                    hotzone: None
                }),
            ]
        );
        // The last hotzone is what remains; then nothing.
        let last = next_hotzone(
            &st,
            Position {
                done: 78 * MIB,
                hotzone: None,
            },
            data,
            4 * MIB,
            4096,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            last[0],
            Step::ReadOld {
                offset: 78 * MIB,
                len: 2 * MIB
            }
        );
        assert_eq!(last.last(), Some(&Step::Finalise));
        assert_eq!(
            next_hotzone(
                &st,
                Position {
                    done: data,
                    hotzone: None
                },
                data,
                4 * MIB,
                4096
            )
            .unwrap(),
            None
        );
        // Inside a hotzone: recovery first.
        assert!(next_hotzone(&st, position(&m, &st, DATA).unwrap(), data, 4 * MIB, 4096).is_err());
    }

    #[test]
    fn hotzone_is_bounded_by_the_checksum_area() {
        let m = crash();
        let mut st = state(&m);
        // Room for 10 sha256 hashes: 10 blocks of 4096 bytes.
        st.keyslot.area_bytes = 10 * 32;
        let s = next_hotzone(
            &st,
            Position {
                done: 0,
                hotzone: None,
            },
            80 * MIB,
            4 * MIB,
            4096,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            s[0],
            Step::ReadOld {
                offset: 0,
                len: 10 * 4096
            }
        );
    }

    #[test]
    fn other_modes_are_refused() {
        let m = crash();
        let mut st = state(&m);
        st.keyslot.resilience = Resilience::Datashift { shift_size: MIB };
        assert!(matches!(
            next_hotzone(
                &st,
                Position {
                    done: 0,
                    hotzone: None
                },
                MIB,
                MIB,
                4096
            ),
            Err(Error::UnsupportedLuks(_))
        ));
        let mut st = state(&m);
        st.keyslot.direction = Direction::Backward;
        assert!(position(&m, &st, DATA).is_err());
    }

    /// The metadata cryptsetup 2.6.1 left when SIGKILLed inside a hotzone of a decryption
    /// (detached header, 200 MiB of data, `--resilience checksum --hotzone-size 4M`; salts and
    /// digests left out).
    fn decrypt_crash() -> Metadata {
        serde_json::from_str(
            r#"{
  "keyslots": {
    "0": {"type": "luks2", "key_size": 64,
          "af": {"type": "luks1", "stripes": 4000, "hash": "sha256"},
          "area": {"type": "raw", "offset": "32768", "size": "258048",
                   "encryption": "aes-xts-plain64", "key_size": 64},
          "kdf": {"type": "pbkdf2", "hash": "sha256", "iterations": 1000, "salt": "AA=="}},
    "1": {"type": "reencrypt", "key_size": 1, "mode": "decrypt", "direction": "backward",
          "priority": 0,
          "area": {"offset": "290816", "size": "16486400", "type": "checksum",
                   "hash": "sha256", "sector_size": 4096}}
  },
  "tokens": {},
  "segments": {
    "0": {"type": "crypt", "offset": "0", "size": "125829120", "iv_tweak": "0",
          "encryption": "aes-xts-plain64", "sector_size": 4096},
    "1": {"type": "linear", "offset": "125829120", "size": "4194304",
          "flags": ["in-reencryption"]},
    "2": {"type": "linear", "offset": "130023424", "size": "dynamic"},
    "3": {"type": "crypt", "offset": "0", "size": "dynamic", "iv_tweak": "0",
          "encryption": "aes-xts-plain64", "sector_size": 4096, "flags": ["backup-previous"]},
    "4": {"type": "linear", "offset": "0", "size": "dynamic", "flags": ["backup-final"]}
  },
  "digests": {
    "0": {"type": "pbkdf2", "keyslots": ["0"], "segments": ["3", "0"], "hash": "sha256",
          "iterations": 1000, "salt": "AA==", "digest": "AA=="},
    "1": {"type": "pbkdf2", "keyslots": ["1"], "segments": [], "hash": "sha256",
          "iterations": 50257, "salt": "AA==", "digest": "AA=="}
  },
  "config": {"json_size": "12288", "keyslots_size": "16744448",
             "requirements": {"mandatory": ["online-reencrypt-v2"]}}
}"#,
        )
        .unwrap()
    }

    /// A backward decryption: the position read from cryptsetup's segments, the hotzone
    /// before the done part, and the segments and digest lists rebuilt to the byte.
    #[test]
    fn backward_decryption_reproduces_cryptsetups_layout() {
        const DATA_200M: u64 = 200 * MIB;
        let m = decrypt_crash();
        let mut st = state(&m);
        assert_eq!(st.keyslot.direction, Direction::Backward);
        let pos = position(&m, &st, DATA_200M).unwrap();
        let done = DATA_200M - 130023424;
        assert_eq!(
            pos,
            Position {
                done,
                hotzone: Some(4 * MIB)
            }
        );
        assert_eq!(hotzone_offset(&st, pos, 4 * MIB, DATA_200M), 120 * MIB);
        let mut rebuilt = m.clone();
        set_segments(
            &mut rebuilt,
            &mut st,
            Position {
                done: 0,
                hotzone: None,
            },
            DATA_200M,
        )
        .unwrap();
        assert_eq!(rebuilt.segments.len(), 3);
        set_segments(&mut rebuilt, &mut st, pos, DATA_200M).unwrap();
        assert_eq!(
            serde_json::to_value(&rebuilt.segments).unwrap(),
            serde_json::to_value(&m.segments).unwrap()
        );
        assert_eq!(digest_lists(&rebuilt), digest_lists(&m));
        // The next hotzone after this one ends where the done part begins.
        let after = Position {
            done: done + 4 * MIB,
            hotzone: None,
        };
        // The 120 MiB left are fewer than the checksum blocks the area protects: one last
        // hotzone, whole, whatever the hotzone size ([`last_backward_hotzone`]).
        let steps = next_hotzone(&st, after, DATA_200M, 4 * MIB, 4096)
            .unwrap()
            .unwrap();
        assert_eq!(
            steps[0],
            Step::ReadOld {
                offset: 0,
                len: 120 * MIB
            }
        );
        assert_eq!(steps.last(), Some(&Step::Finalise));
        // Finalising leaves one linear segment and no keyslot or digest.
        finalise(&mut rebuilt, &st).unwrap();
        assert_eq!(rebuilt.segments["0"].kind.as_str(), "linear");
        assert!(rebuilt.keyslots.is_empty());
        assert!(rebuilt.digests.is_empty());
        assert!(rebuilt.config.requirements.is_none());
    }

    /// The hotzones (offset, length) of a whole backward walk of `data` bytes.
    fn walk(st: &ReencryptState, data: u64, hot_max: u64) -> Vec<(u64, u64)> {
        let mut pos = Position {
            done: 0,
            hotzone: None,
        };
        let mut out = Vec::new();
        while let Some(steps) = next_hotzone(st, pos, data, hot_max, 4096).unwrap() {
            let Step::ReadOld { offset, len } = steps[0] else {
                panic!("a hotzone starts with its read: {steps:?}")
            };
            out.push((offset, len));
            if steps.last() == Some(&Step::Finalise) {
                break;
            }
            pos.done += len;
        }
        out
    }

    /// A backward walk leaves for its last hotzone the length cryptsetup 2.6.1's repair counts
    /// as done: the journal area, or the checksum blocks the area protects up to 1 GiB (or
    /// what is left); the others keep the hotzone size.
    #[test]
    fn backward_walk_leaves_cryptsetups_length_for_its_last_hotzone() {
        let checksum = decrypt_crash();
        let mut journal = serde_json::to_value(&checksum).unwrap();
        let reenc_area = &mut journal["keyslots"]["1"]["area"];
        reenc_area["type"] = "journal".into();
        for k in ["hash", "sector_size"] {
            reenc_area.as_object_mut().unwrap().remove(k);
        }
        let journal: Metadata = serde_json::from_value(journal).unwrap();
        let area = 16486400;
        let st = state(&journal);
        assert_eq!(st.keyslot.resilience, Resilience::Journal);
        let zones = walk(&st, 40 * MIB, MIB);
        assert_eq!(zones.last(), Some(&(0, area)), "the last one: the area");
        // Whole hotzones from the end, then what is left above the last one.
        let n = zones.len();
        assert!(zones[..n - 2].iter().all(|z| z.1 == MIB), "{zones:?}");
        assert_eq!(zones[n - 2], (area, 40 * MIB - area - (n as u64 - 2) * MIB));
        assert_eq!(zones.iter().map(|z| z.1).sum::<u64>(), 40 * MIB);
        assert_eq!(last_backward_hotzone(&st, 40 * MIB, 4096).unwrap(), area);
        // Less data than the area: one hotzone.
        assert_eq!(walk(&st, 8 * MIB, MIB), vec![(0, 8 * MIB)]);
        // Checksums of 4 KiB blocks: the area protects 2 GiB, cryptsetup cuts 1 GiB.
        let st = state(&checksum);
        let zones = walk(&st, 1536 * MIB, 64 * MIB);
        assert_eq!(zones.len(), 9);
        assert_eq!(zones.last(), Some(&(0, 1024 * MIB)));
        assert_eq!(zones[0], (1472 * MIB, 64 * MIB));
        // Forward walks are cut as before.
        let mut fwd = state(&journal);
        fwd.keyslot.direction = Direction::Forward;
        assert_eq!(last_backward_hotzone(&fwd, 40 * MIB, 4096).unwrap(), 0);
        assert!(walk(&fwd, 40 * MIB, MIB).iter().all(|z| z.1 == MIB));
    }

    /// The metadata cryptsetup 2.6.1 left when SIGKILLed inside a hotzone of `reencrypt
    /// --encrypt --reduce-device-size 32M` on a 300 MiB file (D = 268 MiB of data, S = 16 MiB;
    /// salts and digests left out).
    fn shift_crash() -> Metadata {
        serde_json::from_str(
            r#"{"keyslots": {"0": {"type": "luks2", "key_size": 64,
  "af": {"type": "luks1", "stripes": 4000, "hash": "sha256"},
  "area": {"type": "raw", "offset": "32768", "size": "258048", "encryption": "aes-xts-plain64",
           "key_size": 64},
  "kdf": {"type": "pbkdf2", "hash": "sha256", "iterations": 1000, "salt": "AA=="}},
 "1": {"area": {"offset": "290816", "size": "4096", "type": "datashift",
                "shift_size": "16777216"},
       "type": "reencrypt", "key_size": 1, "mode": "encrypt", "direction": "backward",
       "priority": 0}},
 "tokens": {},
 "segments": {
  "0": {"type": "linear", "offset": "297795584", "size": "16777216"},
  "1": {"type": "linear", "offset": "16777216", "size": "197132288"},
  "2": {"type": "crypt", "offset": "230686720", "size": "16777216", "iv_tweak": "417792",
        "encryption": "aes-xts-plain64", "sector_size": 512, "flags": ["in-reencryption"]},
  "3": {"type": "crypt", "offset": "247463936", "size": "50331648", "iv_tweak": "450560",
        "encryption": "aes-xts-plain64", "sector_size": 512},
  "4": {"type": "linear", "offset": "0", "size": "281018368", "flags": ["backup-previous"]},
  "5": {"type": "crypt", "offset": "16777216", "size": "dynamic", "iv_tweak": "0",
        "encryption": "aes-xts-plain64", "sector_size": 512, "flags": ["backup-final"]},
  "6": {"type": "linear", "offset": "297795584", "size": "16777216",
        "flags": ["backup-moved-segment"]}},
 "digests": {
  "0": {"type": "pbkdf2", "keyslots": ["0"], "segments": ["5", "2", "3"], "hash": "sha256",
        "iterations": 1000, "salt": "AA==", "digest": "AA=="},
  "1": {"type": "pbkdf2", "keyslots": ["1"], "segments": [], "hash": "sha256",
        "iterations": 1000, "salt": "AA==", "digest": "AA=="}},
 "config": {"json_size": "12288", "keyslots_size": "16744448",
            "requirements": {"mandatory": ["online-reencrypt-v2"]}}}"#,
        )
        .unwrap()
    }

    const SHIFT: u64 = 16 * MIB;
    const SHIFT_DATA: u64 = 268 * MIB;

    /// The geometry, position and layout of cryptsetup's datashift crash, rebuilt to the byte
    /// (segments, backup ids, digest lists) from another position.
    #[test]
    fn datashift_reproduces_cryptsetups_layout() {
        let m = shift_crash();
        let mut st = state(&m);
        let sh = shift_geometry(&m, &st).unwrap().unwrap();
        assert_eq!(
            sh,
            Shift {
                shift_bytes: SHIFT,
                old_offset: 0,
                new_offset: SHIFT,
                moved_offset: 284 * MIB,
                data_bytes: SHIFT_DATA,
            }
        );
        let pos = position(&m, &st, SHIFT_DATA).unwrap();
        // Hotzone [204, 220) MiB of data (at 220 MiB on the device), done [220, 268) MiB.
        assert_eq!(
            pos,
            Position {
                done: 48 * MIB,
                hotzone: Some(SHIFT)
            }
        );
        assert_eq!(hotzone_offset(&st, pos, SHIFT, SHIFT_DATA), 204 * MIB);
        check_layout(&m, &st, SHIFT_DATA).unwrap();
        let mut rebuilt = m.clone();
        let start = Position {
            done: 0,
            hotzone: None,
        };
        set_segments(&mut rebuilt, &mut st, start, SHIFT_DATA).unwrap();
        // The start: moved segment, the rest at its place, three backups.
        assert_eq!(rebuilt.segments.len(), 5);
        assert_eq!(rebuilt.segments["1"].offset.0, SHIFT);
        assert_eq!(
            rebuilt.segments["1"].size,
            SegmentSize::Bytes(SHIFT_DATA - SHIFT)
        );
        set_segments(&mut rebuilt, &mut st, pos, SHIFT_DATA).unwrap();
        assert_eq!(
            serde_json::to_value(&rebuilt.segments).unwrap(),
            serde_json::to_value(&m.segments).unwrap()
        );
        assert_eq!(digest_lists(&rebuilt), digest_lists(&m));
        assert_eq!(st, state(&m));
        // Inside a hotzone: recovery first.
        assert!(next_hotzone_shift(&sh, pos, 512).is_err());
    }

    /// The walk cryptsetup 2.6.1 takes (seen with --debug on 68 MiB of data shifted by 16
    /// MiB: hotzones at 52, 36, 20 MiB of 16 MiB, then 16 MiB of 4 MiB, then 0 from the moved
    /// segment), each hotzone's steps, and finalisation to one dynamic crypt segment with the
    /// moved segment's area to wipe.
    #[test]
    fn datashift_walks_as_cryptsetup() {
        let sh = Shift {
            shift_bytes: SHIFT,
            old_offset: 0,
            new_offset: SHIFT,
            moved_offset: 84 * MIB,
            data_bytes: 68 * MIB,
        };
        let mut pos = Position {
            done: 0,
            hotzone: None,
        };
        let mut walk = Vec::new();
        while let Some(steps) = next_hotzone_shift(&sh, pos, 4096).unwrap() {
            let Step::MoveNew { from, offset, len } = steps[1] else {
                panic!("{steps:?}")
            };
            assert_eq!(
                steps[0],
                Step::CommitSegments(Position {
                    done: pos.done,
                    hotzone: Some(len)
                })
            );
            assert_eq!(steps[2], Step::SyncData);
            walk.push((offset / MIB, len / MIB, from / MIB));
            match steps[3] {
                Step::CommitSegments(p) => pos = p,
                Step::Finalise => break,
                ref s => panic!("{s:?}"),
            }
        }
        assert_eq!(
            walk,
            vec![
                (52, 16, 52),
                (36, 16, 36),
                (20, 16, 20),
                (16, 4, 16),
                (0, 16, 84)
            ]
        );
        let mut m = shift_crash();
        let mut st = state(&m);
        let done = Position {
            done: SHIFT_DATA,
            hotzone: None,
        };
        set_segments(&mut m, &mut st, done, SHIFT_DATA).unwrap();
        assert_eq!(m.segments["0"].size, SegmentSize::Dynamic);
        assert_eq!(m.segments["0"].offset.0, SHIFT);
        assert_eq!(position(&m, &st, SHIFT_DATA).unwrap(), done);
        let retired = finalise(&mut m, &st).unwrap();
        assert_eq!(retired.data_areas, vec![(284 * MIB, SHIFT)]);
        assert_eq!(m.segments.len(), 1);
        assert!(m.config.requirements.is_none());
    }

    /// Each relation of the shift is checked by name.
    #[test]
    fn datashift_geometry_is_checked() {
        let check = |f: &dyn Fn(&mut Metadata)| {
            let mut m = shift_crash();
            f(&mut m);
            let st = state(&m);
            match shift_geometry(&m, &st) {
                Err(Error::BadHeader { check, .. }) => check,
                r => panic!("{r:?}"),
            }
        };
        let set = |m: &mut Metadata, id: &str, off: Option<u64>, size: Option<u64>| {
            let s = m.segments.get_mut(id).unwrap();
            if let Some(o) = off {
                s.offset = U64Str(o);
            }
            if let Some(n) = size {
                s.size = SegmentSize::Bytes(n);
            }
        };
        // Moved segment smaller than the shift.
        assert_eq!(
            check(&|m| set(m, "6", None, Some(8 * MIB))),
            "reencrypt-datashift"
        );
        // The new offset is not old + shift.
        assert_eq!(
            check(&|m| set(m, "5", Some(8 * MIB), None)),
            "reencrypt-datashift"
        );
        // The moved segment inside what the hotzones write.
        assert_eq!(
            check(&|m| set(m, "6", Some(200 * MIB), None)),
            "reencrypt-datashift"
        );
        // Less than one shift of data.
        assert_eq!(
            check(&|m| set(m, "4", None, Some(8 * MIB))),
            "reencrypt-datashift"
        );
    }

    // ------------------------------------------------------------ decryption moving the data

    /// The data of the volume cryptsetup 2.6.1 decrypted for the stored states: 256 MiB with
    /// the header in front (data offset 16 MiB).
    const UNSHIFT_DATA: u64 = 240 * MIB;

    /// cryptsetup 2.6.1's exported header after `reencrypt --decrypt --header NEW.hdr
    /// --init-only` of that volume.
    fn unshift_init() -> Metadata {
        Metadata::parse(include_bytes!(
            "../../../../tests/data/reencrypt-unshift-init.json"
        ))
        .unwrap()
    }

    /// The segments and the old key's digest list of every state cryptsetup 2.6.1 committed
    /// while it ran that decryption (read from the exported header while the process was
    /// stopped between its writes, after every header write): (seqid, metadata).
    fn unshift_states() -> Vec<(u64, Metadata)> {
        let v: serde_json::Value = serde_json::from_slice(include_bytes!(
            "../../../../tests/data/reencrypt-unshift-states.json"
        ))
        .unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|st| {
                let mut m = unshift_init();
                m.segments = serde_json::from_value(st["segments"].clone()).unwrap();
                let d = &st["digest_segments"];
                m.digests.get_mut("0").unwrap().segments =
                    serde_json::from_value(d["0"].clone()).unwrap_or_default();
                (st["seqid"].as_u64().unwrap(), m)
            })
            .collect()
    }

    fn unshift_snapshot(m: &Metadata) -> (serde_json::Value, Vec<String>) {
        (
            serde_json::to_value(&m.segments).unwrap(),
            m.digests["0"].segments.clone(),
        )
    }

    #[test]
    fn unshift_geometry_of_cryptsetups_init() {
        let m = unshift_init();
        let st = state(&m);
        assert_eq!(st.version, UNSHIFT_REQUIREMENT_VERSION);
        assert!(matches!(
            check_supported(&st).unwrap(),
            Protect::Unshift(MovedGuard::Checksum {
                hash: HashAlg::Sha256,
                block: 4096
            })
        ));
        let u = unshift_geometry(&m, &st, UNSHIFT_DATA).unwrap().unwrap();
        assert_eq!(
            u,
            Unshift {
                shift_bytes: 16 * MIB,
                old_offset: 16 * MIB,
                new_offset: 0,
                moved_bytes: 16 * MIB,
                data_bytes: UNSHIFT_DATA,
            }
        );
        assert_eq!(
            position(&m, &st, UNSHIFT_DATA).unwrap(),
            Position {
                done: 0,
                hotzone: None
            }
        );
        check_layout(&m, &st, UNSHIFT_DATA).unwrap();
        // Not a plain data shift, nor a reencryption in place.
        assert_eq!(shift_geometry(&m, &st).unwrap(), None);
        assert!(next_hotzone(
            &st,
            Position {
                done: 0,
                hotzone: None
            },
            UNSHIFT_DATA,
            MIB,
            4096
        )
        .is_err());
    }

    /// Every state cryptsetup committed (between and inside each hotzone, the moved segment's
    /// hotzone, and all done before finalisation) is read back to a position, passes the
    /// layout check, and is rebuilt from that position to the byte of its segments and digest
    /// list; and the planner's own walk from the init commits exactly cryptsetup's sequence.
    #[test]
    fn unshift_walk_reproduces_cryptsetups_states() {
        let init = unshift_init();
        let st0 = state(&init);
        let u = unshift_geometry(&init, &st0, UNSHIFT_DATA)
            .unwrap()
            .unwrap();
        let mut theirs = Vec::new();
        for (seqid, m) in unshift_states() {
            // The first two are the init (seqid 4) and the reencryption digest cryptsetup
            // writes again when it resumes (5); the last, the finalised header.
            if !(6..=35).contains(&seqid) {
                continue;
            }
            let st = state(&m);
            let pos =
                position(&m, &st, UNSHIFT_DATA).unwrap_or_else(|e| panic!("seqid {seqid}: {e}"));
            check_layout(&m, &st, UNSHIFT_DATA).unwrap_or_else(|e| panic!("seqid {seqid}: {e}"));
            let mut rebuilt = init.clone();
            let mut st1 = st0.clone();
            set_segments(&mut rebuilt, &mut st1, pos, UNSHIFT_DATA).unwrap();
            assert_eq!(
                unshift_snapshot(&rebuilt),
                unshift_snapshot(&m),
                "seqid {seqid} at {pos:?}"
            );
            assert_eq!(st1, st, "seqid {seqid}");
            theirs.push((pos, unshift_snapshot(&m)));
        }
        assert_eq!(theirs.len(), 30);
        // The planner's walk: each commit as cryptsetup's, in order.
        let (mut meta, mut st) = (init.clone(), st0.clone());
        let mut pos = position(&meta, &st, UNSHIFT_DATA).unwrap();
        let mut mine = Vec::new();
        let mut walk = Vec::new();
        'walk: while let Some(steps) = next_hotzone_unshift(&st, &u, pos, 4096).unwrap() {
            for step in steps {
                match step {
                    Step::CommitSegments(p) => {
                        set_segments(&mut meta, &mut st, p, UNSHIFT_DATA).unwrap();
                        pos = p;
                        mine.push((p, unshift_snapshot(&meta)));
                    }
                    Step::MoveNew { from, offset, len } => {
                        assert_eq!(from, offset + 16 * MIB);
                        walk.push((offset / MIB, len / MIB));
                    }
                    Step::ReadAt { from, offset, len } => {
                        assert_eq!((from, offset, len), (0, 0, 16 * MIB));
                        walk.push((0, len / MIB));
                    }
                    Step::WriteChecksums { area_offset, .. } => {
                        assert_eq!(area_offset, 290816)
                    }
                    Step::Finalise => break 'walk,
                    _ => {}
                }
            }
        }
        let want_walk: Vec<(u64, u64)> = (1..15).map(|i| (i * 16, 16)).chain([(0, 16)]).collect();
        assert_eq!(walk, want_walk);
        // cryptsetup commits "all done" once more before finalising; the planner finalises
        // at once (a header left there finalises on resume: next below).
        assert_eq!(mine.len(), theirs.len() - 1);
        for (i, (m, t)) in mine.iter().zip(&theirs).enumerate() {
            assert_eq!(m, t, "commit {i}");
        }
        let (done, _) = &theirs[theirs.len() - 1];
        assert_eq!(
            *done,
            Position {
                done: UNSHIFT_DATA,
                hotzone: None
            }
        );
        assert_eq!(next_hotzone_unshift(&st, &u, *done, 4096).unwrap(), None);
        // Finalisation: one linear segment, no keyslot, the stale tail to wipe.
        let mut m = meta.clone();
        set_segments(&mut m, &mut st, *done, UNSHIFT_DATA).unwrap();
        let retired = finalise(&mut m, &st).unwrap();
        assert_eq!(retired.keyslots, vec![0, 1]);
        assert_eq!(m.segments.len(), 1);
        assert_eq!(m.segments["0"].kind.as_str(), "linear");
        assert!(m.keyslots.is_empty() && m.digests.is_empty());
        assert!(m.config.requirements.is_none());
        assert_eq!(u.tail(), (UNSHIFT_DATA, 16 * MIB));
    }

    /// A moved segment smaller than the shift (`--hotzone-size`): the walk starts after it and
    /// still moves whole shifts, the last hotzone shortened, then the moved segment.
    #[test]
    fn unshift_walk_with_a_small_moved_segment() {
        let u = Unshift {
            shift_bytes: 16 * MIB,
            old_offset: 16 * MIB,
            new_offset: 0,
            moved_bytes: MIB,
            data_bytes: 48 * MIB,
        };
        let st = state(&unshift_init());
        let mut pos = Position {
            done: 0,
            hotzone: None,
        };
        let mut walk = Vec::new();
        while let Some(steps) = next_hotzone_unshift(&st, &u, pos, 4096).unwrap() {
            let Step::CommitSegments(Position {
                hotzone: Some(len), ..
            }) = steps
                .iter()
                .find(|s| matches!(s, Step::CommitSegments(_)))
                .unwrap()
            else {
                panic!("{steps:?}")
            };
            walk.push((u.hotzone_offset(pos.done) / MIB, len / MIB));
            match steps.last().unwrap() {
                Step::CommitSegments(p) => pos = *p,
                _ => break,
            }
        }
        assert_eq!(walk, vec![(1, 16), (17, 16), (33, 15), (0, 1)]);
    }

    /// Each relation of a decryption that moves the data is checked by name.
    #[test]
    fn unshift_geometry_is_checked() {
        let check = |f: &dyn Fn(&mut Metadata)| {
            let mut m = unshift_init();
            f(&mut m);
            match ReencryptState::from_metadata(&m)
                .and_then(|st| unshift_geometry(&m, &st.unwrap(), UNSHIFT_DATA))
            {
                Err(Error::BadHeader { check, .. }) => check,
                r => panic!("{r:?}"),
            }
        };
        let seg = |m: &mut Metadata, id: &str| m.segments.get_mut(id).unwrap().clone();
        let put = |m: &mut Metadata, id: &str, s: Segment| {
            m.segments.insert(id.into(), s);
        };
        // Moved segment larger than the shift.
        assert_eq!(
            check(&|m| {
                let mut s = seg(m, "2");
                s.size = SegmentSize::Bytes(32 * MIB);
                put(m, "2", s)
            }),
            "reencrypt-datashift"
        );
        // Moved segment away from the new data offset.
        assert_eq!(
            check(&|m| {
                let mut s = seg(m, "2");
                s.offset = U64Str(4096);
                put(m, "2", s)
            }),
            "reencrypt-datashift"
        );
        // The shift is not the distance between the data offsets.
        assert_eq!(
            check(&|m| {
                let mut s = seg(m, "3");
                s.offset = U64Str(8 * MIB);
                put(m, "3", s)
            }),
            "reencrypt-datashift"
        );
        // The moved segment under another cipher.
        assert_eq!(
            check(&|m| {
                let mut s = seg(m, "2");
                s.encryption = Some("aes-cbc-essiv:sha256".into());
                put(m, "2", s)
            }),
            "reencrypt-datashift"
        );
        // A non-zero IV tweak of the data.
        assert_eq!(
            check(&|m| {
                let mut s = seg(m, "3");
                s.iv_tweak = Some(U64Str(8));
                put(m, "3", s)
            }),
            "reencrypt-datashift"
        );
        // datashift-checksum under the v2 requirement.
        assert_eq!(
            check(&|m| {
                m.config.requirements.as_mut().unwrap().mandatory =
                    Some(vec!["online-reencrypt-v2".into()]);
            }),
            "reencrypt-datashift"
        );
        // Checksums of the moved segment that do not fit the area.
        assert_eq!(
            check(&|m| {
                m.keyslots.get_mut("1").unwrap().area.as_mut().unwrap().size = U64Str(4096);
            }),
            "reencrypt-datashift"
        );
    }
}
