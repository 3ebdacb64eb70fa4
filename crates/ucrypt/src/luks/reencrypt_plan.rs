//! The planner for offline key rotation (mode `reencrypt`, direction `forward`, resilience
//! `checksum`, `journal` or `none`, no data shift), sans I/O: where the rotation stands
//! ([`position`]), the segments and digests for a position ([`set_segments`]), the steps of
//! the next hotzone ([`next_hotzone`]) as effects a driver performs in order, and the plain
//! header the rotation ends with ([`finalise`]). The driver is `luks::reencrypt_run`.
//!
//! The step order is cryptsetup's: read the old hotzone, store its resilience data (checksums
//! of the old ciphertext, or a copy of it) in the reencrypt keyslot area and flush it, commit
//! the metadata with the hotzone flagged `in-reencryption` (a crash after this point needs
//! recovery), write the hotzone under the new key, flush, then commit the metadata with the
//! boundary moved past the hotzone (after the last hotzone: finalise).

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

/// Where a forward rotation stands, in bytes from the start of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Bytes already under the new key.
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

fn fixed(s: &Segment) -> Result<u64> {
    match s.size {
        SegmentSize::Bytes(n) => Ok(n),
        SegmentSize::Dynamic => Err(bad("a done or hotzone segment has dynamic size")),
    }
}

/// Only what this planner handles: forward key rotation, no data shift.
pub fn check_supported(st: &ReencryptState) -> Result<Protect> {
    let k = &st.keyslot;
    if k.mode != Mode::Reencrypt || k.direction != Direction::Forward || st.backup_moved.is_some() {
        return Err(unsupported(format!(
            "reencryption {} {} (the planner does forward key rotation only)",
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
            "resilience {} (a data shift; the planner rotates keys in place)",
            r.name()
        ))),
    }
}

/// Reads the live segments back into a [`Position`]: `[old]`, `[new, old]` or
/// `[new, hotzone, old]` (the first `new` absent at the start).
pub fn position(meta: &Metadata, st: &ReencryptState) -> Result<Position> {
    check_supported(st)?;
    let live = live_segments(meta);
    let segs: Vec<&Segment> = live.iter().map(|(_, s)| *s).collect();
    let hot_at = segs
        .iter()
        .position(|s| has_flag(s, SegmentFlag::InReencryption));
    match (segs.len(), hot_at) {
        (1, None) => Ok(Position {
            done: 0,
            hotzone: None,
        }),
        (2, None) => Ok(Position {
            done: fixed(segs[0])?,
            hotzone: None,
        }),
        (2, Some(0)) => Ok(Position {
            done: 0,
            hotzone: Some(fixed(segs[0])?),
        }),
        (3, Some(1)) => Ok(Position {
            done: fixed(segs[0])?,
            hotzone: Some(fixed(segs[1])?),
        }),
        (n, h) => Err(bad(format!(
            "{n} live segments with the hotzone at {h:?}: not a forward rotation's layout"
        ))),
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

/// `s` moved `skip` bytes into the data: offset and IV tweak advanced, size as given.
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
    out.iv_tweak = Some(U64Str(s.iv_tweak.map_or(0, |v| v.0) + skip / IV_UNIT_BYTES));
    out.size = size;
    Ok(out)
}

/// Rewrites the segments (and the old and new digests' segment lists) for `pos`, as
/// cryptsetup lays them out: done part (new key), hotzone (`in-reencryption`, both keys), rest
/// (old key), then backup-previous and backup-final. `st` is updated to the new backup ids.
pub fn set_segments(meta: &mut Metadata, st: &mut ReencryptState, pos: Position) -> Result<()> {
    check_supported(st)?;
    let old = template(meta, st.backup_previous)?;
    let new = template(meta, st.backup_final)?;
    let d_old = digest_of_segment(meta, st.backup_previous)
        .ok_or_else(|| bad("backup-previous has no digest"))?;
    let d_new = digest_of_segment(meta, st.backup_final)
        .ok_or_else(|| bad("backup-final has no digest"))?;
    if d_old == d_new {
        return Err(bad("old and new keys share a digest: nothing to rotate"));
    }
    let hot = pos.hotzone.unwrap_or(0);
    let moved = pos
        .done
        .checked_add(hot)
        .ok_or_else(|| bad("position overflow"))?;
    let rest_size = match old.size {
        SegmentSize::Dynamic => SegmentSize::Dynamic,
        SegmentSize::Bytes(n) if n > moved => SegmentSize::Bytes(n - moved),
        SegmentSize::Bytes(n) => {
            return Err(bad(format!(
                "position {moved} is not inside the {n}-byte data"
            )))
        }
    };
    let mut live: Vec<(Segment, bool, bool)> = Vec::new(); // (segment, old key, new key)
    if pos.done > 0 {
        live.push((
            advanced(&new, 0, SegmentSize::Bytes(pos.done))?,
            false,
            true,
        ));
    }
    if hot > 0 {
        let mut h = advanced(&new, pos.done, SegmentSize::Bytes(hot))?;
        h.flags = Some(vec![SegmentFlag::InReencryption.name().into()]);
        live.push((h, true, true));
    }
    live.push((advanced(&old, moved, rest_size)?, true, false));

    let mut segments = std::collections::BTreeMap::new();
    // cryptsetup lists the hotzone first in both digests, then the key's own segment.
    let (mut old_list, mut new_list) = (Vec::new(), Vec::new());
    let hot_id = live.iter().position(|(s, _, _)| {
        s.flags
            .as_ref()
            .is_some_and(|f| f.iter().any(|x| x == SegmentFlag::InReencryption.name()))
    });
    if let Some(h) = hot_id {
        old_list.push(h.to_string());
        new_list.push(h.to_string());
    }
    for (i, (s, o, n)) in live.into_iter().enumerate() {
        if Some(i) != hot_id {
            if o {
                old_list.push(i.to_string());
            }
            if n {
                new_list.push(i.to_string());
            }
        }
        segments.insert(i.to_string(), s);
    }
    let n = segments.len() as u32;
    let mut prev = old;
    prev.flags = Some(vec![SegmentFlag::BackupPrevious.name().into()]);
    let mut fin = new;
    fin.flags = Some(vec![SegmentFlag::BackupFinal.name().into()]);
    segments.insert(n.to_string(), prev);
    segments.insert((n + 1).to_string(), fin);
    old_list.push(n.to_string());
    new_list.push((n + 1).to_string());

    for (id, list) in [(d_old, old_list), (d_new, new_list)] {
        meta.digests
            .get_mut(&id.to_string())
            .ok_or_else(|| bad(format!("digest {id} missing")))?
            .segments = list;
    }
    meta.segments = segments;
    st.backup_previous = n;
    st.backup_final = n + 1;
    st.in_reencryption = hot_id.map(|h| h as u32);
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
    let mut steps = vec![Step::ReadOld {
        offset: pos.done,
        len,
    }];
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
        Step::WriteNew {
            offset: pos.done,
            len,
        },
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

/// What finalisation retires: keyslot areas to wipe (offset, length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    pub keyslots: Vec<u32>,
    pub areas: Vec<(u64, u64)>,
}

/// The plain LUKS2 metadata a finished rotation leaves (as cryptsetup leaves it): one segment
/// `0` (backup-final without its flag), the new key's digest listing it, the old key's
/// keyslots and digest gone, the reencrypt keyslot and its digest gone, the requirement gone.
/// Digest and keyslot ids are kept, not renumbered.
pub fn finalise(meta: &mut Metadata, st: &ReencryptState) -> Result<Retired> {
    check_supported(st)?;
    let mut fin = template(meta, st.backup_final)?;
    fin.flags = None;
    let d_old = digest_of_segment(meta, st.backup_previous)
        .ok_or_else(|| bad("backup-previous has no digest"))?;
    let d_new = digest_of_segment(meta, st.backup_final)
        .ok_or_else(|| bad("backup-final has no digest"))?;
    let rk = st.keyslot.id.to_string();
    let d_reenc = meta
        .digest_for_keyslot(&rk)
        .map(|(id, _)| id.clone())
        .ok_or_else(|| bad("the reencrypt keyslot has no digest"))?;
    let old = meta
        .digests
        .remove(&d_old.to_string())
        .ok_or_else(|| bad(format!("digest {d_old} missing")))?;
    meta.digests.remove(&d_reenc);
    let mut retired = Retired {
        keyslots: Vec::new(),
        areas: Vec::new(),
    };
    for k in old.keyslots.iter().chain(std::iter::once(&rk)) {
        if let Some(ks) = meta.keyslots.remove(k) {
            retired.keyslots.push(k.parse().unwrap_or(u32::MAX));
            if let Some(a) = ks.area.filter(|_| ks.kind == "luks2") {
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
    meta.digests
        .get_mut(&d_new.to_string())
        .ok_or_else(|| bad(format!("digest {d_new} missing")))?
        .segments = vec!["0".into()];
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
    let pos = position(meta, st)?;
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
    set_segments(&mut want_meta, &mut want_st, pos)?;
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
            position(&m, &state(&m)).unwrap(),
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
        let pos = position(&m, &st).unwrap();
        // From another layout (the start) back to cryptsetup's position.
        let mut rebuilt = m.clone();
        let start = Position {
            done: 0,
            hotzone: None,
        };
        set_segments(&mut rebuilt, &mut st, start).unwrap();
        assert_eq!(rebuilt.segments.len(), 3);
        set_segments(&mut rebuilt, &mut st, pos).unwrap();
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
            position(&m, &st).unwrap(),
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
        assert!(next_hotzone(&st, position(&m, &st).unwrap(), data, 4 * MIB, 4096).is_err());
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
        assert!(position(&m, &st).is_err());
    }
}
