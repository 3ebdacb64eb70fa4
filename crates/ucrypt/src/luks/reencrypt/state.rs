//! A header's reencryption state, typed, sans I/O (cryptsetup's `luks2_segment.c` and the
//! reencryption's reading of it): the live segments (old part, a hotzone flagged
//! `in-reencryption` while one is being rewritten, new part), then the backups flagged
//! `backup-previous` (the old layout), `backup-final` (the new layout) and, for a data shift,
//! `backup-moved-segment`, read with the keyslot into one [`ReencryptState`].

use super::keyslot::{bad, parse_keyslot, requirement_version, ReencryptKeyslot};
use super::keyslot::{REQUIREMENT_PREFIX, REQUIREMENT_VERSIONS};
use crate::luks::json::{Keyslot, KeyslotKind, Metadata, Segment};
use crate::Result;

/// A segment flag cryptsetup's reencryption sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentFlag {
    /// The hotzone: being rewritten now.
    InReencryption,
    /// The whole device as it was before (old key, cipher, offset).
    BackupPrevious,
    /// The whole device as it will be (new key, cipher, offset).
    BackupFinal,
    /// Where the moved first segment of a datashift went.
    BackupMovedSegment,
}

impl SegmentFlag {
    pub const ALL: [SegmentFlag; 4] = [
        SegmentFlag::InReencryption,
        SegmentFlag::BackupPrevious,
        SegmentFlag::BackupFinal,
        SegmentFlag::BackupMovedSegment,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SegmentFlag::InReencryption => "in-reencryption",
            SegmentFlag::BackupPrevious => "backup-previous",
            SegmentFlag::BackupFinal => "backup-final",
            SegmentFlag::BackupMovedSegment => "backup-moved-segment",
        }
    }
}

/// The id of the first segment (in numeric order) that carries `flag`.
pub fn segment_with_flag(meta: &Metadata, flag: SegmentFlag) -> Option<u32> {
    let mut ids: Vec<(u32, &Segment)> = meta
        .segments
        .iter()
        .filter_map(|(k, s)| k.parse::<u32>().ok().map(|n| (n, s)))
        .collect();
    ids.sort_unstable_by_key(|(n, _)| *n);
    ids.into_iter()
        .find(|(_, s)| {
            s.flags
                .as_ref()
                .is_some_and(|f| f.iter().any(|x| x == flag.name()))
        })
        .map(|(n, _)| n)
}

/// The state of a header in reencryption, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReencryptState {
    /// From the requirement name (1, 2 or 3).
    pub version: u8,
    pub keyslot: ReencryptKeyslot,
    /// The hotzone segment, when the metadata was written inside one (a crash there needs
    /// recovery before anything else).
    pub in_reencryption: Option<u32>,
    pub backup_previous: u32,
    pub backup_final: u32,
    pub backup_moved: Option<u32>,
}

impl ReencryptState {
    /// `None` for a header without a reencryption requirement; the typed state, or the check
    /// that failed, otherwise.
    pub fn from_metadata(meta: &Metadata) -> Result<Option<ReencryptState>> {
        let Some(version) = requirement_version(meta) else {
            // A reencryption requirement of a version no cryptsetup release writes: the
            // header is in reencryption, under rules nobody here knows.
            if let Some(r) = meta
                .requirements()
                .iter()
                .find(|r| r.starts_with(REQUIREMENT_PREFIX))
            {
                return Err(bad(format!(
                    "unknown reencryption requirement '{r}' (known: {})",
                    REQUIREMENT_VERSIONS
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            return Ok(None);
        };
        let slots: Vec<(&String, &Keyslot)> = meta
            .keyslots
            .iter()
            .filter(|(_, k)| k.kind == KeyslotKind::Reencrypt)
            .collect();
        let [(id, ks)] = slots[..] else {
            return Err(bad(format!(
                "{} keyslots of type reencrypt (a header in reencryption has exactly one)",
                slots.len()
            )));
        };
        let id: u32 = id.parse().map_err(|_| bad(format!("keyslot id '{id}'")))?;
        let keyslot = parse_keyslot(id, ks)?;
        let need = |f: SegmentFlag| {
            segment_with_flag(meta, f)
                .ok_or_else(|| bad(format!("no segment flagged {}", f.name())))
        };
        Ok(Some(ReencryptState {
            version,
            keyslot,
            in_reencryption: segment_with_flag(meta, SegmentFlag::InReencryption),
            backup_previous: need(SegmentFlag::BackupPrevious)?,
            backup_final: need(SegmentFlag::BackupFinal)?,
            backup_moved: segment_with_flag(meta, SegmentFlag::BackupMovedSegment),
        }))
    }

    /// Whether the metadata was committed inside a hotzone: cryptsetup calls this a crash and
    /// requires `repair` (recovery) before resuming.
    pub fn needs_recovery(&self) -> bool {
        self.in_reencryption.is_some()
    }
}
