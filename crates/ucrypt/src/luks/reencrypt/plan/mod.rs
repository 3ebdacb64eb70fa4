//! The planner of reencryption, sans I/O: where a reencryption stands ([`position`]), the
//! segments and digests for a position ([`set_segments`]), the steps of the next hotzone
//! ([`Movement::next_hotzone`]) as effects a driver performs in order, and the plain header it
//! ends with ([`finalise`]), for modes `reencrypt`, `encrypt` and `decrypt`, directions
//! `forward` and `backward`, resilience `checksum`, `journal` or `none`. What changes the
//! geometry of every step is how the data moves, one [`Movement`] matched in one place: in
//! place (`in_place.rs`), shifted up by an encryption that makes room for the header in front
//! (resilience `datashift`, [`Shift`], `shift.rs`), or back by a decryption that moves it to
//! the start of the device (`datashift-checksum`/`-journal`, [`Unshift`], `unshift.rs`). The
//! driver is [`crate::luks::reencrypt::run`].
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
use crate::luks::reencrypt::{Direction, Mode, ReencryptState, Resilience, SegmentFlag};
use crate::luks::util::HashAlg;
use crate::{Error, Result};

mod in_place;
mod relocate;
mod shift;
#[cfg(test)]
mod tests;
mod unshift;

use in_place::key_digests;
pub use in_place::last_backward_hotzone;
use in_place::{next_hotzone_in_place, position_in_place, set_segments_in_place};
use relocate::next_hotzone_relocate;
pub use relocate::{relocate_geometry, Relocate};
use shift::shift_bad;
use shift::{next_hotzone_shift, position_shift, set_segments_shift};
pub use shift::{shift_geometry, shift_source, Shift};
use unshift::{next_hotzone_unshift, position_unshift, set_segments_unshift};
pub use unshift::{unshift_geometry, Unshift, UNSHIFT_REQUIREMENT_VERSION};

/// How the data moves while it is reencrypted: what gives every step its geometry. Read once
/// from the metadata ([`Movement::of`]) and matched here, in one place, for the position,
/// the segments each step commits and the next hotzone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Movement {
    /// The data stays where it is: a key rotation, or an encryption or decryption with a
    /// detached header. `bounded`: only the first `data_bytes` of a data area that may be
    /// longer are reencrypted (cryptsetup's `reencrypt --device-size`), so the part that
    /// ends there gets a fixed size where it would otherwise be `dynamic`, as cryptsetup's
    /// fixed-size mode writes it ([`bounded_data_bytes`] reads it back; [`Movement::of`]
    /// leaves it `false`: the header alone does not say how long the data area is).
    InPlace { bounded: bool },
    /// An encryption that moves the data up to put the header in front (datashift).
    Shift(Shift),
    /// A key rotation that moves the data up by the shift (datashift, no moved segment):
    /// laid out as a backward rotation in place whose new side lies a shift above the old.
    Relocate(Relocate),
    /// A decryption that moves the data back to offset 0 (datashift-checksum or -journal).
    Unshift(Unshift),
}

impl Movement {
    /// The movement the header in reencryption describes, for `data_bytes` bytes of data.
    pub fn of(meta: &Metadata, st: &ReencryptState, data_bytes: u64) -> Result<Movement> {
        if let Some(sh) = shift_geometry(meta, st)? {
            return Ok(Movement::Shift(sh));
        }
        if let Some(r) = relocate_geometry(meta, st)? {
            return Ok(Movement::Relocate(r));
        }
        if let Some(u) = unshift_geometry(meta, st, data_bytes)? {
            return Ok(Movement::Unshift(u));
        }
        Ok(Movement::InPlace { bounded: false })
    }

    /// Where the reencryption is, read back from the live segments.
    pub fn position(
        &self,
        meta: &Metadata,
        st: &ReencryptState,
        data_bytes: u64,
    ) -> Result<Position> {
        match self {
            Movement::InPlace { .. } | Movement::Relocate(_) => {
                position_in_place(meta, st, data_bytes)
            }
            Movement::Shift(sh) => position_shift(meta, sh, data_bytes),
            Movement::Unshift(u) => position_unshift(meta, u),
        }
    }

    /// Rewrites the segments (and the keys' digests' segment lists) for `pos`; `st` is
    /// updated to the new backup ids.
    pub fn set_segments(
        &self,
        meta: &mut Metadata,
        st: &mut ReencryptState,
        pos: Position,
        data_bytes: u64,
    ) -> Result<()> {
        match self {
            Movement::InPlace { bounded } => {
                set_segments_in_place(meta, st, pos, data_bytes, *bounded)
            }
            Movement::Relocate(_) => set_segments_in_place(meta, st, pos, data_bytes, false),
            Movement::Shift(sh) => set_segments_shift(meta, st, sh, pos),
            Movement::Unshift(u) => set_segments_unshift(meta, st, u, pos),
        }
    }

    /// The steps of the next hotzone after `pos` (hotzones of at most `hotzone_max` bytes in
    /// place, each a multiple of `align`); `None` when every byte is done.
    pub fn next_hotzone(
        &self,
        st: &ReencryptState,
        pos: Position,
        data_bytes: u64,
        hotzone_max: u64,
        align: u64,
    ) -> Result<Option<Vec<Step>>> {
        match self {
            Movement::InPlace { .. } => {
                next_hotzone_in_place(st, pos, data_bytes, hotzone_max, align)
            }
            Movement::Shift(sh) => next_hotzone_shift(sh, pos, align),
            Movement::Relocate(r) => next_hotzone_relocate(r, pos, data_bytes, align),
            Movement::Unshift(u) => next_hotzone_unshift(st, u, pos, align),
        }
    }
}

/// [`Movement::position`] of the movement the header describes.
pub fn position(meta: &Metadata, st: &ReencryptState, data_bytes: u64) -> Result<Position> {
    Movement::of(meta, st, data_bytes)?.position(meta, st, data_bytes)
}

/// [`Movement::set_segments`] of the movement the header describes.
pub fn set_segments(
    meta: &mut Metadata,
    st: &mut ReencryptState,
    pos: Position,
    data_bytes: u64,
) -> Result<()> {
    Movement::of(meta, st, data_bytes)?.set_segments(meta, st, pos, data_bytes)
}

pub(super) fn bad(detail: impl Into<String>) -> Error {
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

pub(super) fn unsupported(detail: impl Into<String>) -> Error {
    Error::UnsupportedLuks(detail.into())
}

/// Bytes per IV step of `iv_tweak` (the kernel's 512-byte sectors).
pub(super) const IV_UNIT_BYTES: u64 = 512;

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

/// The steps that follow a hotzone's rewrite at `pos` (its `len` bytes written): the plain
/// header after the last one, else the boundary committed past it.
pub(super) fn past_hotzone(pos: Position, len: u64, last: bool) -> Step {
    if last {
        Step::Finalise
    } else {
        Step::CommitSegments(Position {
            done: pos.done + len,
            hotzone: None,
        })
    }
}

/// The steps of a hotzone of a data shift at `pos`: commit it, move its `len` bytes from the
/// device offset `from` to data offset `offset` ([`Step::MoveNew`]), flush, then
/// [`past_hotzone`]. No resilience data: a hotzone's source stays intact until it is
/// committed done.
pub(super) fn moving_hotzone(pos: Position, from: u64, offset: u64, len: u64) -> Vec<Step> {
    vec![
        Step::CommitSegments(Position {
            done: pos.done,
            hotzone: Some(len),
        }),
        Step::MoveNew { from, offset, len },
        Step::SyncData,
        past_hotzone(pos, len, offset == 0),
    ]
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

/// The data a reencryption in place covers when its header bounds it: the sum of the live
/// segments' sizes when none of them is `dynamic` though a backup is (cryptsetup's
/// `LUKS2_get_data_size`, as a run with `--device-size` leaves it after its first hotzone).
/// `None` where a live segment, or neither backup, is `dynamic`. A sum short of the data area
/// is a bound; one that reaches its end is an unbounded walk whose hotzone ends there.
pub fn bounded_data_bytes(meta: &Metadata) -> Option<u64> {
    let live = live_segments(meta);
    let backup_dynamic = meta.segments.values().any(|s| {
        s.size == SegmentSize::Dynamic
            && s.flags
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f.starts_with("backup-")))
    });
    if live.is_empty() || !backup_dynamic {
        return None;
    }
    live.iter().try_fold(0u64, |sum, (_, s)| match s.size {
        SegmentSize::Bytes(n) => sum.checked_add(n),
        SegmentSize::Dynamic => None,
    })
}

/// Where the data starts: the first live segment's offset (0 without one).
fn meta_data_start(live: &[(u32, &Segment)]) -> u64 {
    live.first().map_or(0, |(_, s)| s.offset.0)
}

pub(super) fn live_segments(meta: &Metadata) -> Vec<(u32, &Segment)> {
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
pub(super) fn note_hotzone(hot: &mut Option<(u64, u64)>, s: &Segment, at: u64) -> Result<()> {
    let SegmentSize::Bytes(len) = s.size else {
        return Err(bad("the hotzone has dynamic size"));
    };
    if hot.replace((at, len)).is_some() {
        return Err(bad("two segments in reencryption"));
    }
    Ok(())
}

pub(super) fn has_flag(s: &Segment, f: SegmentFlag) -> bool {
    s.flags
        .as_ref()
        .is_some_and(|v| v.iter().any(|x| x == f.name()))
}

/// Only what this planner handles: modes `reencrypt`, `encrypt` and `decrypt`, either
/// direction, in place; the encryption that moves the data backward (`datashift` with a
/// `backup-moved-segment`, as cryptsetup's `--encrypt --reduce-device-size` writes it); the
/// rotation that moves it backward (`datashift` without one: `--reduce-device-size` alone);
/// the decryption that moves it back to the start (`datashift-checksum`/`-journal`).
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
            (Resilience::Datashift { .. }, Mode::Reencrypt, Direction::Backward, None) => {
                Ok(Protect::Datashift)
            }
            _ => Err(unsupported(format!(
                "reencryption {} {} with resilience {}{} (ucrypt moves the data to encrypt \
                 with the header in front: encrypt, backward, datashift, with a moved \
                 segment; to rotate the key: reencrypt, backward, datashift; and to decrypt \
                 it back to the start: decrypt, forward, datashift-checksum or \
                 datashift-journal, with a moved segment)",
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

pub(super) fn segment_of(meta: &Metadata, id: u32) -> Result<&Segment> {
    meta.segments
        .get(&id.to_string())
        .ok_or_else(|| bad(format!("segment {id} missing")))
}

/// Where `pos`'s hotzone of `len` bytes lies in the data (offset from its start): after the
/// done part going forward, before it going backward.
pub fn hotzone_offset(st: &ReencryptState, pos: Position, len: u64, data_bytes: u64) -> u64 {
    match st.keyslot.direction {
        Direction::Forward => pos.done,
        Direction::Backward => data_bytes - pos.done - len,
    }
}

pub(super) fn template(meta: &Metadata, id: u32) -> Result<Segment> {
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
pub(super) fn advanced(s: &Segment, skip: u64, size: SegmentSize) -> Result<Segment> {
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
    // A kept key (`--keep-key`) keeps its digest and keyslots.
    let old_keyslots = match d_old {
        Some(d) if !in_place::keeps_key(d_old, d_new) => {
            meta.digests
                .remove(&d.to_string())
                .ok_or_else(|| bad(format!("digest {d} missing")))?
                .keyslots
        }
        _ => Vec::new(),
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

pub(super) fn layout(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt-segments",
        detail: detail.into(),
    }
}

/// The ids of the digests that list segment `id`.
pub(super) fn keyed_by(meta: &Metadata, id: u32) -> Vec<&str> {
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
    let last = have.len().saturating_sub(1);
    for (i, ((hid, h), (wid, w))) in have.iter().zip(&want).enumerate() {
        // A walk bounded short of the data area (`--device-size`) gives the part that ends
        // at its bound a fixed size where an unbounded one keeps `dynamic`.
        let bounded_tail = i == last
            && w.size == SegmentSize::Dynamic
            && matches!(h.size, SegmentSize::Bytes(n)
                if h.offset.0.checked_add(n) == meta_data_start(&have).checked_add(data_bytes));
        let same = h.kind == w.kind
            && h.offset == w.offset
            && (h.size == w.size || bounded_tail)
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
