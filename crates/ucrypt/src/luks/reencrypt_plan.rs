//! The planner of offline reencryption (modes `reencrypt`, `encrypt` and `decrypt`, directions
//! `forward` and `backward`, resilience `checksum`, `journal` or `none`, no data shift), sans
//! I/O: where it stands ([`position`]), the segments and digests for a position
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

use super::json::{Metadata, Segment, SegmentSize, U64Str};
use super::reencrypt::{
    digest_of_segment, Direction, Mode, ReencryptState, Resilience, SegmentFlag,
};
use super::util::HashAlg;
use crate::{Error, Result};

fn bad(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt-plan",
        detail: detail.into(),
    }
}

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

fn has_flag(s: &Segment, f: SegmentFlag) -> bool {
    s.flags
        .as_ref()
        .is_some_and(|v| v.iter().any(|x| x == f.name()))
}

/// Only what this planner handles: modes `reencrypt`, `encrypt` and `decrypt`, either
/// direction, no data shift.
pub fn check_supported(st: &ReencryptState) -> Result<Protect> {
    let k = &st.keyslot;
    if st.backup_moved.is_some() {
        return Err(unsupported(format!(
            "reencryption {} {} with a moved segment (a data shift)",
            k.mode.name(),
            k.direction.name()
        )));
    }
    match &k.resilience {
        Resilience::Checksum { hash, sector_size } => Ok(Protect::Checksum {
            hash: HashAlg::from_name(hash)?,
            block: *sector_size,
        }),
        Resilience::Journal => Ok(Protect::Journal),
        Resilience::None => Ok(Protect::None),
        r => Err(unsupported(format!(
            "resilience {} (a data shift; the planner rewrites data in place)",
            r.name()
        ))),
    }
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
        None => s.kind == "linear",
    };
    Ok(if new { Part::New } else { Part::Old })
}

/// Reads the live segments back into a [`Position`] for a volume of `data_bytes` bytes of
/// data: forward `[new] [hotzone] [old]`, backward `[old] [hotzone] [new]`, each part
/// optional but not all.
pub fn position(meta: &Metadata, st: &ReencryptState, data_bytes: u64) -> Result<Position> {
    check_supported(st)?;
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
    if s.kind == "crypt" {
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
    check_supported(st)?;
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
            if s.kind == "crypt" {
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

/// The largest hotzone the reencrypt keyslot area can protect: as many checksum blocks as
/// hashes fit, the area's size for a journal, unbounded for `none`.
pub fn area_limit(st: &ReencryptState) -> Result<u64> {
    Ok(match check_supported(st)? {
        Protect::None => u64::MAX,
        Protect::Checksum { hash, block } => {
            st.keyslot.area_bytes / hash.output_bytes() as u64 * u64::from(block)
        }
        Protect::Journal => st.keyslot.area_bytes,
    })
}

/// The steps of the next hotzone of `data_bytes` bytes of data, hotzones of at most
/// `hotzone_max` bytes, each a multiple of `align` (the larger sector size, and the checksum
/// block); `None` when every byte is done. The last hotzone ends with [`Step::Finalise`].
/// Refuses a position inside a hotzone: that needs recovery first.
pub fn next_hotzone(
    st: &ReencryptState,
    pos: Position,
    data_bytes: u64,
    hotzone_max: u64,
    align: u64,
) -> Result<Option<Vec<Step>>> {
    let protect = check_supported(st)?;
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
    let len = hotzone_max.min(remaining).min(area_limit(st)?) / align * align;
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
        Protect::None => {}
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

/// What finalisation retires: keyslot areas to wipe (offset, length), the reencrypt
/// keyslot's among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    pub keyslots: Vec<u32>,
    pub areas: Vec<(u64, u64)>,
}

/// The plain LUKS2 metadata a finished reencryption leaves (as cryptsetup leaves it): one
/// segment `0` (backup-final without its flag: linear after a decryption), the new key's
/// digest listing it, the old key's keyslots and digest gone, the reencrypt keyslot and its
/// digest gone, the requirement gone. Digest and keyslot ids are kept, not renumbered. After a
/// decryption no keyslot and no digest is left, as cryptsetup leaves a detached header.
pub fn finalise(meta: &mut Metadata, st: &ReencryptState) -> Result<Retired> {
    check_supported(st)?;
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
    };
    for k in old_keyslots.iter().chain(std::iter::once(&rk)) {
        if let Some(ks) = meta.keyslots.remove(k) {
            retired.keyslots.push(k.parse().unwrap_or(u32::MAX));
            // The old keys' material and the resilience data (checksums or a journal of
            // old ciphertext, or plaintext for an encryption): cryptsetup overwrites both
            // areas when it destroys the keyslots (measured: the whole reencrypt area).
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
            m.retain(|n| !super::reencrypt::is_reencrypt_requirement(n));
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
        let bytes = include_bytes!("../../tests/data/reencrypt-crash-hdr.bin");
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
        let steps = next_hotzone(&st, after, DATA_200M, 4 * MIB, 4096)
            .unwrap()
            .unwrap();
        assert_eq!(
            steps[0],
            Step::ReadOld {
                offset: 116 * MIB,
                len: 4 * MIB
            }
        );
        // Finalising leaves one linear segment and no keyslot or digest.
        finalise(&mut rebuilt, &st).unwrap();
        assert_eq!(rebuilt.segments["0"].kind, "linear");
        assert!(rebuilt.keyslots.is_empty());
        assert!(rebuilt.digests.is_empty());
        assert!(rebuilt.config.requirements.is_none());
    }
}
