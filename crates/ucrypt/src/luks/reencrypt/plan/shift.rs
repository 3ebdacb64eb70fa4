//! The plan of an encryption that moves the data up (`--reduce-device-size`, datashift): the
//! header goes in front, each hotzone is read a shift below where it is written.

use crate::luks::json::SegmentKind;
use crate::luks::json::{Metadata, Segment, SegmentSize};
use crate::luks::reencrypt::{Mode, ReencryptState, Resilience, SegmentFlag};
use crate::{Error, Result};

use super::in_place::key_digests;
use super::{
    advanced, bad, check_supported, has_flag, live_segments, moving_hotzone, note_hotzone,
    segment_of, template, Position, Protect, Step, IV_UNIT_BYTES,
};

pub(super) fn shift_bad(detail: impl Into<String>) -> Error {
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

/// The [`Shift`] of a data-moving encryption, `None` for a reencryption in place. Every
/// relation the protocol relies on is checked (named check `reencrypt-datashift`): the shift
/// is the moved segment's size and the distance between the old and the new data offset, the
/// moved segment lies past every byte a hotzone writes, there is at least one shift of data.
/// The reencryption digest covers these segments; this refuses a header whose digest is right
/// but whose layout is not one cryptsetup (or ucrypt) writes.
pub fn shift_geometry(meta: &Metadata, st: &ReencryptState) -> Result<Option<Shift>> {
    // A rotation that moves the data is a [`super::Relocate`].
    if check_supported(st)? != Protect::Datashift || st.keyslot.mode == Mode::Reencrypt {
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

/// [`position`] of a data-moving encryption: the crypt segments are the hotzone (flagged) and
/// the done part, at the new data offset; whatever is below them is not done yet. The exact
/// layout (moved segment, the rest at its old place) is [`check_layout`]'s.
pub(super) fn position_shift(meta: &Metadata, sh: &Shift, data_bytes: u64) -> Result<Position> {
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

/// [`set_segments`] of a data-moving encryption, as cryptsetup 2.6 lays them out (seen
/// after `--init-only` and after SIGKILLs between and inside hotzones; `reencrypt_interop`'s
/// `INITS` and `KILLS` rows of the data shift (`Shift`)
/// compare the two tools): the moved segment
/// (until the last hotzone, which encrypts it), the plaintext still at its old place beyond
/// the first shift, the hotzone (`in-reencryption`), the done part (fixed size; `dynamic`
/// once all is done); then backup-previous, backup-final and backup-moved-segment. The new
/// key's digest lists backup-final, then every crypt segment.
pub(super) fn set_segments_shift(
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
    let d_new = d_new.ok_or(Error::Bug("an encryption without a new key"))?;
    let moving = MovingSegments {
        live,
        in_reencryption: hot_id,
        backups: [prev, fin, moved],
    };
    moving.commit(meta, st, d_new, &[SegmentFlag::BackupFinal])
}

/// The segments of a reencryption that moves data, as they are committed: the live ones in
/// order, then the three backups.
pub(super) struct MovingSegments {
    pub(super) live: Vec<Segment>,
    /// Which of `live` is the hotzone.
    pub(super) in_reencryption: Option<u32>,
    /// backup-previous, backup-final, backup-moved-segment.
    pub(super) backups: [Segment; 3],
}

impl MovingSegments {
    /// Writes the segments (the backups numbered after the live ones, each flagged), points
    /// `digest` at the `listed` backups and then every live crypt segment, and records the
    /// ids in `st`.
    pub(super) fn commit(
        self,
        meta: &mut Metadata,
        st: &mut ReencryptState,
        digest: u32,
        listed: &[SegmentFlag],
    ) -> Result<()> {
        let n = self.live.len() as u32;
        let flags = [
            SegmentFlag::BackupPrevious,
            SegmentFlag::BackupFinal,
            SegmentFlag::BackupMovedSegment,
        ];
        let id = |f: &SegmentFlag| n + flags.iter().position(|g| g == f).unwrap_or(0) as u32;
        let mut list: Vec<String> = listed.iter().map(|f| id(f).to_string()).collect();
        list.extend(
            self.live
                .iter()
                .enumerate()
                .filter(|(_, s)| s.kind == SegmentKind::Crypt)
                .map(|(i, _)| i.to_string()),
        );
        let mut segments: std::collections::BTreeMap<String, Segment> = self
            .live
            .into_iter()
            .enumerate()
            .map(|(i, s)| (i.to_string(), s))
            .collect();
        for (mut s, flag) in self.backups.into_iter().zip(flags) {
            s.flags = Some(vec![flag.name().into()]);
            segments.insert(id(&flag).to_string(), s);
        }
        meta.digests
            .get_mut(&digest.to_string())
            .ok_or_else(|| bad(format!("digest {digest} missing")))?
            .segments = list;
        meta.segments = segments;
        st.backup_previous = n;
        st.backup_final = n + 1;
        st.backup_moved = Some(n + 2);
        st.in_reencryption = self.in_reencryption;
        Ok(())
    }
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
    Ok(Some(moving_hotzone(pos, from, h, len)))
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
