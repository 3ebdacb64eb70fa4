//! The plan of a reencryption whose data stays where it is (a key rotation; an encryption or
//! decryption with a detached header): forward `[new] [hotzone] [old]`, backward `[old]
//! [hotzone] [new]`, then the backups.

use crate::luks::json::SegmentKind;
use crate::luks::json::{Metadata, Segment, SegmentSize};
use crate::luks::reencrypt::{digest_of_segment, Direction, Mode, ReencryptState, SegmentFlag};
use crate::{Error, Result};

use super::{
    advanced, area_limit, bad, check_supported, has_flag, hotzone_offset, live_segments,
    past_hotzone, template, Position, Protect, Step, CRYPTSETUP_HOTZONE_BYTES_MAX,
};

/// What a live segment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    Old,
    Hot,
    New,
}

/// The digests of the old and new keys (`None`: encryption has no old key, decryption no new
/// one).
pub(super) fn key_digests(
    meta: &Metadata,
    st: &ReencryptState,
) -> Result<(Option<u32>, Option<u32>)> {
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
    if d_old.is_some() && d_old == d_new && !segment_params_change(meta, st)? {
        return Err(bad(
            "old and new segments share a key digest and their cipher and sector size: \
             nothing to reencrypt",
        ));
    }
    Ok((d_old, d_new))
}

/// Whether the backups differ in cipher or sector size: what a reencryption that keeps the
/// key (`--keep-key`, the old and new segments under one digest) changes.
fn segment_params_change(meta: &Metadata, st: &ReencryptState) -> Result<bool> {
    let (p, f) = (
        template(meta, st.backup_previous)?,
        template(meta, st.backup_final)?,
    );
    Ok(p.encryption != f.encryption || p.sector_size != f.sector_size)
}

/// Whether the reencryption keeps the volume key (`--keep-key`): one digest for both sides.
pub(super) fn keeps_key(d_old: Option<u32>, d_new: Option<u32>) -> bool {
    d_old.is_some() && d_old == d_new
}

/// Which part a live segment is: the hotzone by its flag; otherwise new if the new key's
/// digest lists it (or, for decryption, if it is linear; with a kept key, if it has the new
/// cipher and sector size), old if not.
pub(super) fn part_of(meta: &Metadata, st: &ReencryptState, id: u32, s: &Segment) -> Result<Part> {
    if has_flag(s, SegmentFlag::InReencryption) {
        return Ok(Part::Hot);
    }
    let (d_old, d_new) = key_digests(meta, st)?;
    if keeps_key(d_old, d_new) {
        let fin = template(meta, st.backup_final)?;
        let new = s.encryption == fin.encryption && s.sector_size == fin.sector_size;
        return Ok(if new { Part::New } else { Part::Old });
    }
    let new = match d_new {
        Some(d) => meta
            .digests
            .get(&d.to_string())
            .is_some_and(|x| x.segments.contains(&id.to_string())),
        None => s.kind == SegmentKind::Linear,
    };
    Ok(if new { Part::New } else { Part::Old })
}

/// Reads the live segments of data left in place back into a [`Position`] for a volume of
/// `data_bytes` bytes of data: forward `[new] [hotzone] [old]`, backward `[old] [hotzone]
/// [new]`, each part optional but not all.
pub(super) fn position_in_place(
    meta: &Metadata,
    st: &ReencryptState,
    data_bytes: u64,
) -> Result<Position> {
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
    // Where data offset 0 lies on each side (apart only in a rotation that moves the data).
    let old_base = template(meta, st.backup_previous)?.offset.0;
    let new_base = template(meta, st.backup_final)?.offset.0;
    let size_of = |want: Part| -> Result<Option<u64>> {
        match parts.iter().find(|(p, _)| *p == want) {
            None => Ok(None),
            Some((_, s)) => match s.size {
                SegmentSize::Bytes(n) => Ok(Some(n)),
                // Only the part that ends at the end of the data may be dynamic.
                SegmentSize::Dynamic if parts.last().is_some_and(|(p, _)| *p == want) => {
                    let base = if want == Part::Old {
                        old_base
                    } else {
                        new_base
                    };
                    let start = s.offset.0.checked_sub(base).ok_or_else(|| {
                        bad(format!(
                            "segment at {} is below its side's data offset {base}",
                            s.offset.0
                        ))
                    })?;
                    Ok(Some(data_bytes.saturating_sub(start)))
                }
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

/// Rewrites the segments (and the keys' digests' segment lists) for `pos` on `data_bytes`
/// bytes of data, as cryptsetup lays them out: forward done part (new), hotzone
/// (`in-reencryption`), rest (old); backward rest (old), hotzone, done part (new); then
/// backup-previous and backup-final. The part that ends at the end of the data keeps its
/// backup's size (`dynamic` as a rule) unless the walk is `bounded` (it ends before the data
/// area does: cryptsetup's `--device-size`), the others get fixed sizes. A key rotation lists the
/// hotzone first in both keys' digests; encryption and decryption list the key's backup
/// first, then every crypt segment. `st` is updated to the new backup ids.
pub(super) fn set_segments_in_place(
    meta: &mut Metadata,
    st: &mut ReencryptState,
    pos: Position,
    data_bytes: u64,
    bounded: bool,
) -> Result<()> {
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
            SegmentSize::Dynamic if !bounded && part != Part::Hot && start + len == data_bytes => {
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
    if keeps_key(d_old, d_new) {
        // One digest: cryptsetup assigns the hotzone first, then the other live segments
        // and the backups, each once.
        let hot = live.iter().position(|(_, p)| *p == Part::Hot);
        let mut one: Vec<String> = hot.iter().map(|h| h.to_string()).collect();
        one.extend(
            (0..live.len())
                .filter(|&i| Some(i) != hot)
                .map(|i| i.to_string()),
        );
        one.extend([n.to_string(), (n + 1).to_string()]);
        old_list = one;
        new_list = Vec::new();
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
    let d_new = if keeps_key(d_old, d_new) { None } else { d_new };
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
/// `reencrypt_interop_kill_points`'s
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
pub(super) fn next_hotzone_in_place(
    st: &ReencryptState,
    pos: Position,
    data_bytes: u64,
    hotzone_max: u64,
    align: u64,
) -> Result<Option<Vec<Step>>> {
    let protect = check_supported(st)?;
    if matches!(protect, Protect::Datashift | Protect::Unshift { .. }) {
        return Err(Error::Bug("a data shift is planned by its Movement"));
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
        past_hotzone(pos, len, pos.done + len == data_bytes),
    ]);
    Ok(Some(steps))
}
