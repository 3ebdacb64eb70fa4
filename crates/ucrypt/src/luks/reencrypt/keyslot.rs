//! The `reencrypt` keyslot and the `online-reencrypt` requirement, sans I/O (cryptsetup's
//! `luks2_keyslot_reenc.c`): the keyslot holds no key; its `mode`, `direction` and `area`
//! (the resilience and its fields) describe the operation, and the requirement's version
//! says which protocol runs it (v2, or v3 for a decryption that moves the data back; the
//! unversioned `online-reencrypt` of cryptsetup 2.2).

use crate::luks::json::{AreaKind, Keyslot, KeyslotKind, Metadata};
use crate::{Error, Result};

pub(super) fn bad(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt",
        detail: detail.into(),
    }
}

/// The requirement names cryptsetup uses for reencryption, with the version each stands for.
/// The version is part of the digest input ([`super::verification_data`]).
pub const REQUIREMENT_VERSIONS: &[(&str, u8)] = &[
    ("online-reencrypt", 1),
    ("online-reencrypt-v2", 2),
    ("online-reencrypt-v3", 3),
];
/// What every reencryption requirement name starts with.
pub(super) const REQUIREMENT_PREFIX: &str = "online-reencrypt";
/// The legacy offline requirement of cryptsetup 2.0/2.1 (never resumable by 2.6).
pub const OFFLINE_REENCRYPT: &str = "offline-reencrypt";
/// The largest requirement version the digest encoding allows (one byte `0x30 + version`).
pub const REQUIREMENT_VERSION_MAX: u8 = 207;

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

/// The checks cryptsetup makes of a header's reencryption on load (its keyslot handler's
/// `validate` and the requirement's shape): each `reencrypt` keyslot's mode, direction and
/// resilience fields; at most one such keyslot, one whenever a reencryption is required, and
/// none without the requirement. Run after the passes every keyslot type shares, which checks what every
/// keyslot type shares.
pub fn validate(meta: &Metadata) -> Result<()> {
    for (k, ks) in &meta.keyslots {
        if ks.kind == KeyslotKind::Reencrypt {
            let id: u32 = k.parse().map_err(|_| bad(format!("keyslot id '{k}'")))?;
            parse_keyslot(id, ks)?;
        }
    }
    // At most one reencrypt keyslot, and one whenever a reencryption is required.
    let reencrypt = meta
        .keyslots
        .values()
        .filter(|k| k.kind == KeyslotKind::Reencrypt)
        .count();
    let required = requirement_version(meta).is_some();
    // A reencrypt keyslot needs a requirement of reencryption's shape, as cryptsetup
    // 2.6.1 refuses such a header on load ("Missing reencryption requirement flag";
    // `luksDump` and `open --test-passphrase` exit 1). Pinned by the row "reencrypt
    // keyslot without the reencryption requirement" of `luks::tests`.
    let candidate = meta
        .requirements()
        .iter()
        .any(|r| is_requirement_candidate(r));
    if reencrypt > 0 && !candidate {
        return Err(bad(
            "a reencrypt keyslot without the reencryption requirement \
                 (config.requirements.mandatory has no online-reencrypt flag)"
                .to_string(),
        ));
    }
    if reencrypt > 1 || (required && reencrypt == 0) {
        return Err(bad(format!(
            "{reencrypt} reencrypt keyslots with the reencryption requirement {}",
            if required { "set" } else { "absent" }
        )));
    }
    Ok(())
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
