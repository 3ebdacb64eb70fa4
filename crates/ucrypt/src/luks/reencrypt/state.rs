//! LUKS2 reencryption metadata, sans I/O: the `reencrypt` keyslot, the segment flags, the
//! `online-reencrypt` requirement and the reencryption digest, as cryptsetup 2.x stores them.
//!
//! A header in reencryption carries (docs/reencryption.md has the whole protocol):
//! - a mandatory requirement `online-reencrypt-v2` (or `-v3` for a decryption that moves the
//!   data, or the unversioned `online-reencrypt` of cryptsetup 2.2);
//! - one keyslot of type `reencrypt` that holds no key: its `mode`, `direction` and `area`
//!   (resilience type and its fields) describe the operation;
//! - the live segments (old part, optionally a hotzone flagged `in-reencryption`, new part)
//!   followed by backup segments flagged `backup-previous` (the old layout), `backup-final`
//!   (the new layout) and, for a data shift, `backup-moved-segment`;
//! - a pbkdf2 digest bound to the reencrypt keyslot over the volume keys and those fields
//!   ([`verification_data`]), so metadata edited without the keys is refused.

use crate::luks::json::{AreaKind, KeyslotKind, SegmentKind};
use crate::luks::json::{Keyslot, Metadata, Segment, SegmentSize};
use crate::{Error, Result, SecretBytes};

fn bad(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt",
        detail: detail.into(),
    }
}

/// The requirement names cryptsetup uses for reencryption, with the version each stands for.
/// The version is part of the digest input ([`verification_data`]).
pub const REQUIREMENT_VERSIONS: &[(&str, u8)] = &[
    ("online-reencrypt", 1),
    ("online-reencrypt-v2", 2),
    ("online-reencrypt-v3", 3),
];
/// What every reencryption requirement name starts with.
const REQUIREMENT_PREFIX: &str = "online-reencrypt";
/// The legacy offline requirement of cryptsetup 2.0/2.1 (never resumable by 2.6).
pub const OFFLINE_REENCRYPT: &str = "offline-reencrypt";
/// The largest requirement version the digest encoding allows (one byte `0x30 + version`).
pub const REQUIREMENT_VERSION_MAX: u8 = 207;
/// First byte of the digest input.
const VERIFICATION_MAGIC: u8 = 0x76;
/// Longest string field the digest input takes (cryptsetup refuses longer ones).
pub const DIGEST_STRING_MAX: usize = 64;

/// What the reencryption does (keyslot field `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Old key (and cipher) to new.
    Reencrypt,
    /// Plaintext to encrypted.
    Encrypt,
    /// Encrypted to plaintext.
    Decrypt,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Reencrypt => "reencrypt",
            Mode::Encrypt => "encrypt",
            Mode::Decrypt => "decrypt",
        }
    }
}

/// Which way the hotzone walks (keyslot field `direction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the start of the data to its end.
    Forward,
    /// From the end to the start (used when data moves toward higher offsets).
    Backward,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Forward => "forward",
            Direction::Backward => "backward",
        }
    }
}

/// How a hotzone survives a crash (the reencrypt keyslot's `area.type` and its fields).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resilience {
    /// Nothing saved: a crash inside a hotzone loses it.
    None,
    /// One hash per `sector_size` bytes of the old hotzone data in the keyslot area; recovery
    /// tells old from new per block by its hash.
    Checksum { hash: String, sector_size: u32 },
    /// A full copy of the old hotzone in the keyslot area.
    Journal,
    /// Data moves by `shift_size` bytes; the hotzone never overlaps the data it came from.
    Datashift { shift_size: u64 },
    /// Decryption with a moved first segment, its hotzone protected by checksums (v3).
    DatashiftChecksum {
        hash: String,
        sector_size: u32,
        shift_size: u64,
    },
    /// Decryption with a moved first segment, its hotzone journaled (v3).
    DatashiftJournal { shift_size: u64 },
}

impl Resilience {
    pub fn name(&self) -> &'static str {
        match self {
            Resilience::None => "none",
            Resilience::Checksum { .. } => "checksum",
            Resilience::Journal => "journal",
            Resilience::Datashift { .. } => "datashift",
            Resilience::DatashiftChecksum { .. } => "datashift-checksum",
            Resilience::DatashiftJournal { .. } => "datashift-journal",
        }
    }
}

/// The `reencrypt` keyslot, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReencryptKeyslot {
    pub id: u32,
    pub mode: Mode,
    pub direction: Direction,
    /// The keyslot area the resilience data lives in.
    pub area_offset: u64,
    pub area_bytes: u64,
    pub resilience: Resilience,
}

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

/// The reencryption requirement's version, if the header names one (v1 = `online-reencrypt`).
pub fn requirement_version(meta: &Metadata) -> Option<u8> {
    meta.requirements().iter().find_map(|r| {
        REQUIREMENT_VERSIONS
            .iter()
            .find(|(n, _)| n == r)
            .map(|&(_, v)| v)
    })
}

/// Whether a mandatory requirement has reencryption's shape, of a known version or not:
/// `online-reencrypt`, or `online-reencrypt-v` and digits (as cryptsetup tells them).
pub fn is_requirement_candidate(name: &str) -> bool {
    name == REQUIREMENT_PREFIX
        || name
            .strip_prefix("online-reencrypt-v")
            .is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a mandatory requirement is one of reencryption's (the online ones).
pub fn is_reencrypt_requirement(name: &str) -> bool {
    REQUIREMENT_VERSIONS.iter().any(|(n, _)| *n == name)
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

fn str_field<'a>(
    ks: &'a serde_json::Map<String, serde_json::Value>,
    name: &str,
) -> Result<&'a str> {
    ks.get(name)
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad(format!("reencrypt keyslot lacks string '{name}'")))
}

fn u32_field(m: &serde_json::Map<String, serde_json::Value>, name: &str) -> Result<u32> {
    m.get(name)
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| bad(format!("reencrypt area lacks integer '{name}'")))
}

fn u64_str_field(m: &serde_json::Map<String, serde_json::Value>, name: &str) -> Result<u64> {
    m.get(name)
        .and_then(|v| v.as_str())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("reencrypt area lacks decimal string '{name}'")))
}

fn checksum_fields(m: &serde_json::Map<String, serde_json::Value>) -> Result<(String, u32)> {
    let hash = str_field(m, "hash")?.to_string();
    let sector_size = u32_field(m, "sector_size")?;
    if sector_size < 512 || !sector_size.is_power_of_two() {
        return Err(bad(format!(
            "checksum sector_size {sector_size} is not a power of two of at least 512"
        )));
    }
    Ok((hash, sector_size))
}

fn shift_field(m: &serde_json::Map<String, serde_json::Value>) -> Result<u64> {
    let shift = u64_str_field(m, "shift_size")?;
    if shift == 0 || shift % 512 != 0 {
        return Err(bad(format!(
            "shift_size {shift} is not a non-zero multiple of 512"
        )));
    }
    Ok(shift)
}

/// The `reencrypt` keyslot with the checks cryptsetup applies to it.
pub fn parse_keyslot(id: u32, ks: &Keyslot) -> Result<ReencryptKeyslot> {
    let mode = match str_field(&ks.extra, "mode")? {
        "reencrypt" => Mode::Reencrypt,
        "encrypt" => Mode::Encrypt,
        "decrypt" => Mode::Decrypt,
        m => return Err(bad(format!("reencrypt mode '{m}'"))),
    };
    let direction = match str_field(&ks.extra, "direction")? {
        "forward" => Direction::Forward,
        "backward" => Direction::Backward,
        d => return Err(bad(format!("reencrypt direction '{d}'"))),
    };
    let area = ks
        .area
        .as_ref()
        .ok_or_else(|| bad("reencrypt keyslot lacks 'area'"))?;
    let resilience = match &area.kind {
        AreaKind::None => Resilience::None,
        AreaKind::Journal => Resilience::Journal,
        AreaKind::Checksum => {
            let (hash, sector_size) = checksum_fields(&area.extra)?;
            Resilience::Checksum { hash, sector_size }
        }
        AreaKind::Datashift => Resilience::Datashift {
            shift_size: shift_field(&area.extra)?,
        },
        AreaKind::DatashiftChecksum => {
            let (hash, sector_size) = checksum_fields(&area.extra)?;
            Resilience::DatashiftChecksum {
                hash,
                sector_size,
                shift_size: shift_field(&area.extra)?,
            }
        }
        AreaKind::DatashiftJournal => Resilience::DatashiftJournal {
            shift_size: shift_field(&area.extra)?,
        },
        t @ (AreaKind::Raw | AreaKind::Other(_)) => {
            return Err(bad(format!("reencrypt area type '{t}'")))
        }
    };
    Ok(ReencryptKeyslot {
        id,
        mode,
        direction,
        area_offset: area.offset.0,
        area_bytes: area.size.0,
        resilience,
    })
}

// ---------------------------------------------------------------- the digest input

/// Appends a string field as its bytes, refusing the lengths cryptsetup refuses.
fn put_str(out: &mut Vec<u8>, s: &str) -> Result<()> {
    if s.is_empty() || s.len() > DIGEST_STRING_MAX {
        return Err(bad(format!(
            "field '{s}' is empty or longer than {DIGEST_STRING_MAX} bytes"
        )));
    }
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// One segment as the digest sees it: type, offset (u64 BE), size (u64 BE or the text
/// "dynamic"), and for crypt segments iv_tweak (u64 BE), encryption and sector_size (u32 BE).
fn put_segment(out: &mut Vec<u8>, s: &Segment) -> Result<()> {
    put_str(out, s.kind.as_str())?;
    out.extend_from_slice(&s.offset.0.to_be_bytes());
    match s.size {
        SegmentSize::Dynamic => out.extend_from_slice(b"dynamic"),
        SegmentSize::Bytes(n) => out.extend_from_slice(&n.to_be_bytes()),
    }
    match &s.kind {
        SegmentKind::Linear => Ok(()),
        SegmentKind::Crypt => {
            let iv = s
                .iv_tweak
                .ok_or_else(|| bad("crypt segment lacks iv_tweak"))?;
            out.extend_from_slice(&iv.0.to_be_bytes());
            put_str(
                out,
                s.encryption
                    .as_deref()
                    .ok_or_else(|| bad("crypt segment lacks encryption"))?,
            )?;
            let ss = s
                .sector_size
                .ok_or_else(|| bad("crypt segment lacks sector_size"))?;
            out.extend_from_slice(&ss.to_be_bytes());
            Ok(())
        }
        SegmentKind::Other(k) => Err(bad(format!("segment type '{k}' in reencryption"))),
    }
}

/// The metadata half of the digest input: the reencrypt keyslot's fields, then the backup
/// segments (previous, final, and the moved one if present).
pub fn metadata_bytes(meta: &Metadata, st: &ReencryptState) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let k = &st.keyslot;
    put_str(&mut out, k.mode.name())?;
    put_str(&mut out, k.direction.name())?;
    put_str(&mut out, k.resilience.name())?;
    out.extend_from_slice(&k.area_offset.to_be_bytes());
    out.extend_from_slice(&k.area_bytes.to_be_bytes());
    match &k.resilience {
        Resilience::None | Resilience::Journal => {}
        Resilience::Checksum { hash, sector_size } => {
            put_str(&mut out, hash)?;
            out.extend_from_slice(&sector_size.to_be_bytes());
        }
        Resilience::Datashift { shift_size } | Resilience::DatashiftJournal { shift_size } => {
            out.extend_from_slice(&shift_size.to_be_bytes());
        }
        Resilience::DatashiftChecksum {
            hash,
            sector_size,
            shift_size,
        } => {
            put_str(&mut out, hash)?;
            out.extend_from_slice(&sector_size.to_be_bytes());
            out.extend_from_slice(&shift_size.to_be_bytes());
        }
    }
    let seg = |id: u32| {
        meta.segments
            .get(&id.to_string())
            .ok_or_else(|| bad(format!("segment {id} missing")))
    };
    put_segment(&mut out, seg(st.backup_previous)?)?;
    put_segment(&mut out, seg(st.backup_final)?)?;
    if let Some(m) = st.backup_moved {
        put_segment(&mut out, seg(m)?)?;
    }
    Ok(out)
}

/// The id of the digest that verifies the key of segment `seg`.
pub fn digest_of_segment(meta: &Metadata, seg: u32) -> Option<u32> {
    let s = seg.to_string();
    meta.digests
        .iter()
        .find(|(_, d)| d.segments.contains(&s))
        .and_then(|(k, _)| k.parse().ok())
}

/// The bytes the reencryption digest is computed over: `0x76`, `0x30 + version`, the old
/// volume key (digest of the backup-previous segment), the new one (backup-final's digest, if
/// it differs), then [`metadata_bytes`]. A missing key the layout needs is an error.
pub fn verification_data(
    meta: &Metadata,
    st: &ReencryptState,
    old_key: Option<&[u8]>,
    new_key: Option<&[u8]>,
) -> Result<SecretBytes> {
    if st.version > REQUIREMENT_VERSION_MAX {
        return Err(bad(format!("requirement version {}", st.version)));
    }
    let d_old = digest_of_segment(meta, st.backup_previous);
    let d_new = digest_of_segment(meta, st.backup_final);
    let old = match d_old {
        Some(_) => Some(old_key.ok_or_else(|| bad("the old volume key is needed"))?),
        None => None,
    };
    let new = match d_new {
        Some(_) if d_new != d_old => {
            Some(new_key.ok_or_else(|| bad("the new volume key is needed"))?)
        }
        _ => None,
    };
    if old.is_none() && new.is_none() {
        return Err(bad("neither backup segment has a key digest"));
    }
    let m = metadata_bytes(meta, st)?;
    let len = 2 + old.map_or(0, <[u8]>::len) + new.map_or(0, <[u8]>::len) + m.len();
    let mut out = SecretBytes::zeroed(len);
    let buf = out.as_mut();
    buf[0] = VERIFICATION_MAGIC;
    buf[1] = 0x30 + st.version;
    let mut at = 2;
    for part in [old.unwrap_or(&[]), new.unwrap_or(&[]), &m] {
        buf[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    debug_assert_eq!(at, len);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirement_candidates_are_told_as_cryptsetup_tells_them() {
        for yes in [
            "online-reencrypt",
            "online-reencrypt-v2",
            "online-reencrypt-v3",
            "online-reencrypt-v42",
        ] {
            assert!(is_requirement_candidate(yes), "{yes}");
        }
        for no in [
            "online-reencrypt-v",
            "online-reencrypt-vx",
            "online-reencrypt-v2a",
            "offline-reencrypt",
            "online-reencrypt2",
            "",
        ] {
            assert!(!is_requirement_candidate(no), "{no}");
        }
    }
}
