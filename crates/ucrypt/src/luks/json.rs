//! LUKS2 JSON metadata as typed structs, and the validation passes cryptsetup applies.
//!
//! Every object keeps the fields we do not know in an `extra` map, so a header rewritten by
//! ucrypt keeps what a newer cryptsetup stored there. u64 values are decimal strings on disk
//! ([`U64Str`]); binary values are base64 strings, decoded where they are used.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use super::af::AF_STRIPES;
use super::kdf::{Argon2Cost, Argon2Variant, Kdf};
use super::util::{b64_decode, HashAlg};
use super::{
    BIN_HDR_BYTES, DIGESTS_MAX, KEYSLOTS_AREA_BYTES_MAX, KEYSLOTS_MAX, KEY_BYTES_MAX, SEGMENTS_MAX,
    TOKENS_MAX,
};
use crate::sector::{CipherSpec, SectorSize};
use crate::{Error, Result};

fn bad(check: &'static str, detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check,
        detail: detail.into(),
    }
}

/// A u64 stored as a decimal string, as LUKS2 requires (JSON numbers lose precision above 2^53).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct U64Str(pub u64);

impl Serialize for U64Str {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.0.to_string())
    }
}

fn parse_numbered(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

impl<'de> Deserialize<'de> for U64Str {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_numbered(&s)
            .map(U64Str)
            .ok_or_else(|| serde::de::Error::custom(format!("'{s}' is not a decimal u64 string")))
    }
}

/// The `type` of a JSON object, typed: the values ucrypt acts on as variants, any other kept
/// as it is (a newer cryptsetup's) in `Other`, so that a rewrite keeps it and a comparison
/// cannot be misspelt.
macro_rules! json_kind {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vm])* $variant,)+
            /// A type ucrypt does not know, kept as written.
            Other(String),
        }

        impl $name {
            /// As written on disk.
            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$variant => $s,)+
                    $name::Other(s) => s,
                }
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                match s {
                    $($s => $name::$variant,)+
                    other => $name::Other(other.to_string()),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                Ok($name::from(String::deserialize(d)?.as_str()))
            }
        }
    };
}

json_kind!(
    /// A keyslot's `type`.
    KeyslotKind {
        /// A passphrase keyslot.
        Luks2 = "luks2",
        /// The reencryption's own keyslot (its area holds the resilience data).
        Reencrypt = "reencrypt",
    }
);
json_kind!(
    /// A segment's `type`.
    SegmentKind {
        /// Encrypted data.
        Crypt = "crypt",
        /// Plaintext data (a reencryption's decrypted or not yet encrypted part).
        Linear = "linear",
    }
);
json_kind!(
    /// A digest's `type`.
    DigestKind { Pbkdf2 = "pbkdf2" }
);
json_kind!(
    /// An anti-forensic splitter's `type`.
    AfKind { Luks1 = "luks1" }
);
json_kind!(
    /// A keyslot area's `type`: `raw` for a passphrase keyslot; a reencrypt keyslot's names
    /// its resilience.
    AreaKind {
        Raw = "raw",
        None = "none",
        Journal = "journal",
        Checksum = "checksum",
        Datashift = "datashift",
        DatashiftChecksum = "datashift-checksum",
        DatashiftJournal = "datashift-journal",
    }
);
json_kind!(
    /// A keyslot's KDF `type`.
    KdfKind {
        Pbkdf2 = "pbkdf2",
        Argon2i = "argon2i",
        Argon2id = "argon2id",
    }
);

/// A segment's size: bytes, or "dynamic" (to the end of the device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentSize {
    Dynamic,
    Bytes(u64),
}

impl Serialize for SegmentSize {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            SegmentSize::Dynamic => s.serialize_str("dynamic"),
            SegmentSize::Bytes(n) => s.serialize_str(&n.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for SegmentSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "dynamic" {
            return Ok(SegmentSize::Dynamic);
        }
        parse_numbered(&s)
            .map(SegmentSize::Bytes)
            .ok_or_else(|| serde::de::Error::custom(format!("segment size '{s}'")))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Metadata {
    pub keyslots: BTreeMap<String, Keyslot>,
    pub tokens: BTreeMap<String, Map<String, Value>>,
    pub segments: BTreeMap<String, Segment>,
    pub digests: BTreeMap<String, DigestJson>,
    pub config: Config,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Keyslot {
    #[serde(rename = "type")]
    pub kind: KeyslotKind,
    pub key_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub af: Option<AfJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub area: Option<Area>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kdf: Option<KdfJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AfJson {
    #[serde(rename = "type")]
    pub kind: AfKind,
    pub stripes: u32,
    pub hash: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Area {
    #[serde(rename = "type")]
    pub kind: AreaKind,
    pub offset: U64Str,
    pub size: U64Str,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_size: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KdfJson {
    #[serde(rename = "type")]
    pub kind: KdfKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iterations: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    pub salt: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Segment {
    #[serde(rename = "type")]
    pub kind: SegmentKind,
    pub offset: U64Str,
    pub size: SegmentSize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iv_tweak: Option<U64Str>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sector_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flags: Option<Vec<String>>,
    /// Authenticated encryption on dm-integrity (LUKS2 format document, section 3.3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<SegmentIntegrity>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A segment's `integrity` object: the tag algorithm dm-crypt uses over dm-integrity, and how
/// dm-integrity's journal is protected ("none" when dm-crypt makes the tags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentIntegrity {
    /// "aead", or a MAC such as "hmac(sha256)".
    #[serde(rename = "type")]
    pub kind: String,
    pub journal_encryption: String,
    pub journal_integrity: String,
    /// Bytes of the HMAC key at the end of the volume key (cryptsetup 2.8's
    /// `--integrity-key-size`, dm-crypt's `integrity_key_size`); absent (or 0): the hash's
    /// output size. cryptsetup writes it only when the size was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_size: Option<u32>,
    /// Kept through a rewrite: fields newer cryptsetup versions add.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DigestJson {
    #[serde(rename = "type")]
    pub kind: DigestKind,
    pub keyslots: Vec<String>,
    pub segments: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iterations: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Config {
    pub json_size: U64Str,
    pub keyslots_size: U64Str,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flags: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirements: Option<Requirements>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Requirements {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mandatory: Option<Vec<String>>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The persistent activation flags cryptsetup knows (`config.flags`).
pub const KNOWN_FLAGS: &[&str] = &[
    "allow-discards",
    "same-cpu-crypt",
    "submit-from-crypt-cpus",
    "no-read-workqueue",
    "no-write-workqueue",
    "no-journal",
    "high_priority",
];

/// A usable LUKS2 keyslot of type "luks2", with every field checked and typed.
#[derive(Debug, Clone)]
pub struct KeyslotParams {
    pub id: u32,
    pub key_bytes: usize,
    pub area_offset: u64,
    pub area_bytes: u64,
    pub area_cipher: CipherSpec,
    pub area_key_bytes: usize,
    pub kdf: Kdf,
    pub af_hash: HashAlg,
    pub stripes: u32,
    /// 0 = ignore (only used when asked by slot number), 1 = normal, 2 = high.
    pub priority: u32,
}

/// The data segment the volume is activated with.
#[derive(Debug, Clone, Copy)]
pub struct CryptSegment {
    pub offset_bytes: u64,
    pub size: SegmentSize,
    pub iv_tweak: u64,
    pub cipher: CipherSpec,
    pub sector_size: SectorSize,
}

fn numbered_key(section: &'static str, key: &str, max: u32) -> Result<u32> {
    match parse_numbered(key) {
        Some(n) if n < u64::from(max) => Ok(n as u32),
        Some(n) => Err(bad(section, format!("id {n} is not below the limit {max}"))),
        None => Err(bad(
            section,
            format!("key \"{key}\" is not in numbered form"),
        )),
    }
}

/// Round up to a multiple of `align` (a power of two), checked.
pub fn round_up(x: u64, align: u64) -> Option<u64> {
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// Bytes of keyslot material for a key (AF split, rounded up to 512-byte sectors).
pub fn af_area_bytes(key_bytes: usize, stripes: u32) -> u64 {
    (key_bytes as u64 * u64::from(stripes)).div_ceil(512) * 512
}

impl Metadata {
    /// Parses the JSON text of one header copy (bounded by the JSON area size).
    pub fn parse(text: &[u8]) -> Result<Metadata> {
        let v: Value = serde_json::from_slice(text)
            .map_err(|e| bad("json-syntax", format!("JSON area does not parse: {e}")))?;
        if !v.is_object() {
            return Err(bad("json-syntax", "JSON area is not an object"));
        }
        for section in ["keyslots", "tokens", "segments", "digests", "config"] {
            match v.get(section) {
                Some(Value::Object(_)) => {}
                Some(_) => return Err(bad("json-schema", format!("'{section}' is not an object"))),
                None => return Err(bad("json-schema", format!("missing '{section}' section"))),
            }
        }
        serde_json::from_value(v).map_err(|e| bad("json-schema", e.to_string()))
    }

    /// The validation passes cryptsetup runs, in its order, plus the reader-protecting bounds
    /// ucrypt adds. `hdr_size` is the binary header's size field (header + JSON area).
    /// `keyslot_types` runs after the keyslot pass: each keyslot type's own checks, which live
    /// with the type (the reencrypt keyslot's in `luks::reencrypt`), as cryptsetup's keyslot
    /// handlers validate their own.
    pub(crate) fn validate(
        &self,
        hdr_size: u64,
        keyslot_types: &dyn Fn(&Metadata) -> Result<()>,
    ) -> Result<()> {
        self.validate_tokens()?;
        self.validate_digests()?;
        self.validate_segments()?;
        self.validate_keyslots()?;
        keyslot_types(self)?;
        self.validate_config(hdr_size)?;
        self.validate_areas()?;
        Ok(())
    }

    fn validate_tokens(&self) -> Result<()> {
        for (k, t) in &self.tokens {
            numbered_key("tokens", k, TOKENS_MAX)?;
            if !matches!(t.get("type"), Some(Value::String(_))) {
                return Err(bad("tokens", format!("token {k} has no string 'type'")));
            }
            let Some(Value::Array(ks)) = t.get("keyslots") else {
                return Err(bad("tokens", format!("token {k} has no 'keyslots' array")));
            };
            for s in ks {
                match s {
                    Value::String(s) if self.keyslots.contains_key(s) => {}
                    _ => {
                        return Err(bad(
                            "tokens",
                            format!("token {k} references missing keyslot {s}"),
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    fn validate_digests(&self) -> Result<()> {
        for (k, d) in &self.digests {
            numbered_key("digests", k, DIGESTS_MAX)?;
            for s in &d.keyslots {
                if !self.keyslots.contains_key(s) {
                    return Err(bad(
                        "digests",
                        format!("digest {k} references missing keyslot {s}"),
                    ));
                }
            }
            if d.kind == DigestKind::Pbkdf2 {
                let ok =
                    d.hash
                        .as_deref()
                        .is_some_and(|h| HashAlg::from_name(h).is_ok())
                        && d.iterations.is_some_and(|n| n > 0)
                        && d.salt.as_deref().and_then(b64_decode).is_some_and(|s| {
                            !s.is_empty() && s.len() <= super::kdf::SALT_BYTES_MAX
                        })
                        && d.digest
                            .as_deref()
                            .and_then(b64_decode)
                            .is_some_and(|v| !v.is_empty() && v.len() <= super::DIGEST_BYTES_MAX);
                if !ok {
                    return Err(bad(
                        "digests",
                        format!("pbkdf2 digest {k} lacks a valid hash, iterations, salt or digest"),
                    ));
                }
            }
            for s in &d.segments {
                if !self.segments.contains_key(s) {
                    return Err(bad(
                        "digests",
                        format!("digest {k} references missing segment {s}"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_segments(&self) -> Result<()> {
        if self.segments.is_empty() {
            return Err(bad("segments", "empty segments section"));
        }
        // Keys 0..n without a gap: the regular segments first, then the backups (a flag
        // "backup-..."), which reencryption keeps.
        let is_backup = |s: &Segment| {
            s.flags
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f.starts_with("backup-")))
        };
        let mut ids: Vec<(u64, bool)> = Vec::with_capacity(self.segments.len());
        for (k, s) in &self.segments {
            ids.push((
                u64::from(numbered_key("segments", k, u32::MAX)?),
                is_backup(s),
            ));
        }
        ids.sort_unstable();
        for (i, &(id, backup)) in ids.iter().enumerate() {
            if id != i as u64 {
                return Err(bad("segments", format!("gap in segment keys before {id}")));
            }
            if i == 0 && backup {
                return Err(bad("segments", "no regular segment"));
            }
            if !backup && i > 0 && ids[i - 1].1 {
                return Err(bad(
                    "segments",
                    format!("regular segment {id} after a backup segment"),
                ));
            }
        }
        for (k, s) in &self.segments {
            numbered_key("segments", k, SEGMENTS_MAX)?;
            if s.offset.0 % 512 != 0 {
                return Err(bad(
                    "segments",
                    format!("segment {k} offset {} not aligned to 512", s.offset.0),
                ));
            }
            let size = match s.size {
                SegmentSize::Dynamic => 0,
                SegmentSize::Bytes(0) => {
                    return Err(bad("segments", format!("segment {k} has size 0")))
                }
                SegmentSize::Bytes(n) => n,
            };
            if size % 512 != 0 {
                return Err(bad(
                    "segments",
                    format!("segment {k} size {size} not aligned to 512"),
                ));
            }
            if s.kind == SegmentKind::Crypt {
                if s.iv_tweak.is_none() || s.encryption.as_deref().is_none_or(str::is_empty) {
                    return Err(bad(
                        "segments",
                        format!("crypt segment {k} lacks iv_tweak or encryption"),
                    ));
                }
                let ss = s.sector_size.ok_or_else(|| {
                    bad("segments", format!("crypt segment {k} lacks sector_size"))
                })?;
                if ss == 0 || ss % 512 != 0 {
                    return Err(bad("segments", format!("segment {k} sector size {ss}")));
                }
                if size % u64::from(ss) != 0 {
                    return Err(bad(
                        "segments",
                        format!("segment {k} size {size} not a multiple of sector size {ss}"),
                    ));
                }
                if !self.digests.values().any(|d| d.segments.contains(k)) {
                    return Err(bad("segments", format!("segment {k} has no digest")));
                }
            }
        }
        Ok(())
    }

    fn validate_keyslots(&self) -> Result<()> {
        for (k, ks) in &self.keyslots {
            numbered_key("keyslots", k, KEYSLOTS_MAX)?;
            if ks.kind == KeyslotKind::Luks2 {
                // A KDF of a type ucrypt does not know ("argon2", an old name) passes, as in
                // cryptsetup: such a keyslot is listed but cannot be unlocked.
                let _kdf_known_or_not = self.keyslot_checked(k)?;
                let digests = self
                    .digests
                    .values()
                    .filter(|d| d.keyslots.iter().any(|s| s == k))
                    .count();
                if digests != 1 {
                    return Err(bad(
                        "keyslots",
                        format!("keyslot {k} is in {digests} digests (must be in exactly one)"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_config(&self, hdr_size: u64) -> Result<()> {
        let json_size = self.config.json_size.0;
        if Some(json_size) != hdr_size.checked_sub(BIN_HDR_BYTES) {
            return Err(bad(
                "json_size",
                format!(
                    "config.json_size {json_size} does not match the binary header size {hdr_size}"
                ),
            ));
        }
        let ks = self.config.keyslots_size.0;
        if ks % 4096 != 0 || ks > KEYSLOTS_AREA_BYTES_MAX {
            return Err(bad(
                "keyslots_size",
                format!("keyslots_size {ks} not 4096-aligned or above {KEYSLOTS_AREA_BYTES_MAX}"),
            ));
        }
        // The keyslots area must fit between the two header copies and the first data segment
        // (a detached header has data offset 0).
        let first_data = self
            .segments
            .values()
            .filter(|s| s.kind == SegmentKind::Crypt)
            .map(|s| s.offset.0)
            .min()
            .unwrap_or(0);
        if first_data != 0 {
            let need = 2 * hdr_size + ks;
            if first_data < need {
                return Err(bad(
                    "keyslots_size",
                    format!(
                        "headers and keyslots ({need} bytes) overlap the data offset {first_data}"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_areas(&self) -> Result<()> {
        let hdr_size = self.config.json_size.0 + BIN_HDR_BYTES;
        let start = 2 * hdr_size;
        let end = start + self.config.keyslots_size.0;
        let mut iv: Vec<(u64, u64, &str)> = Vec::new();
        for (k, ks) in &self.keyslots {
            let Some(a) = &ks.area else {
                return Err(bad("areas", format!("keyslot {k} has no area")));
            };
            let (off, len) = (a.offset.0, a.size.0);
            if off < start {
                return Err(bad(
                    "areas",
                    format!("keyslot {k} area offset {off} overlaps the headers (below {start})"),
                ));
            }
            if len == 0 {
                return Err(bad("areas", format!("keyslot {k} area has length 0")));
            }
            match off.checked_add(len) {
                Some(e) if e <= end => {}
                _ => {
                    return Err(bad(
                        "areas",
                        format!("keyslot {k} area [{off}, +{len}) overflows the keyslots area ending at {end}"),
                    ))
                }
            }
            iv.push((off, len, k));
        }
        iv.sort();
        for w in iv.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(bad(
                    "areas",
                    format!("keyslot areas {} and {} overlap", w[0].2, w[1].2),
                ));
            }
        }
        Ok(())
    }

    /// The typed parameters of a "luks2" keyslot whose KDF ucrypt can run.
    pub fn keyslot_params(&self, key: &str) -> Result<KeyslotParams> {
        self.keyslot_checked(key)?.map_err(|kind| Error::Keyslot {
            slot: numbered_key("keyslots", key, KEYSLOTS_MAX).unwrap_or(0),
            reason: format!("unknown kdf type '{kind}'"),
        })
    }

    /// A "luks2" keyslot with every field checked (an error if one is invalid): its typed
    /// parameters, or the type name of a KDF ucrypt does not know. The fields of known KDF
    /// types are checked; an unknown type passes, as cryptsetup lets it.
    fn keyslot_checked(&self, key: &str) -> Result<std::result::Result<KeyslotParams, String>> {
        let id = numbered_key("keyslots", key, KEYSLOTS_MAX)?;
        let ks = self.keyslots.get(key).ok_or_else(|| Error::Keyslot {
            slot: id,
            reason: "keyslot is not in use".into(),
        })?;
        let kb = |d: String| bad("keyslots", format!("keyslot {key}: {d}"));
        if ks.kind != KeyslotKind::Luks2 {
            return Err(Error::Keyslot {
                slot: id,
                reason: format!(
                    "keyslot type '{}' cannot be unlocked with a passphrase",
                    ks.kind
                ),
            });
        }
        let key_bytes = ks.key_size as usize;
        if key_bytes == 0 || key_bytes > KEY_BYTES_MAX {
            return Err(kb(format!(
                "key_size {key_bytes} outside 1..={KEY_BYTES_MAX}"
            )));
        }
        let af = ks.af.as_ref().ok_or_else(|| kb("missing af".into()))?;
        if af.kind != AfKind::Luks1 {
            return Err(kb(format!("af type '{}'", af.kind)));
        }
        if af.stripes != AF_STRIPES {
            return Err(kb(format!(
                "af stripes {} (must be {AF_STRIPES})",
                af.stripes
            )));
        }
        let af_hash =
            HashAlg::from_name(&af.hash).map_err(|_| kb(format!("af hash '{}'", af.hash)))?;
        let area = ks.area.as_ref().ok_or_else(|| kb("missing area".into()))?;
        if area.kind != AreaKind::Raw {
            return Err(kb(format!("area type '{}'", area.kind)));
        }
        let enc = area
            .encryption
            .as_deref()
            .ok_or_else(|| kb("area lacks encryption".into()))?;
        let area_cipher: CipherSpec = enc
            .parse()
            .map_err(|_| kb(format!("unsupported area encryption '{enc}'")))?;
        let area_key_bytes = area
            .key_size
            .ok_or_else(|| kb("area lacks key_size".into()))? as usize;
        if area_key_bytes > KEY_BYTES_MAX || area_cipher.check_key_len(area_key_bytes).is_err() {
            return Err(kb(format!("area key_size {area_key_bytes} for {enc}")));
        }
        let need = af_area_bytes(key_bytes, af.stripes);
        if area.size.0 < need {
            return Err(kb(format!(
                "area of {} bytes is smaller than the {need} bytes of key material",
                area.size.0
            )));
        }
        let kj = ks.kdf.as_ref().ok_or_else(|| kb("missing kdf".into()))?;
        let priority = ks.priority.unwrap_or(1);
        if priority > 2 {
            return Err(kb(format!("priority {priority}")));
        }
        if let KdfKind::Other(other) = &kj.kind {
            return Ok(Err(other.clone()));
        }
        let kdf = kdf_from_json(kj).map_err(|e| kb(e.to_string()))?;
        Ok(Ok(KeyslotParams {
            id,
            key_bytes,
            area_offset: area.offset.0,
            area_bytes: area.size.0,
            area_cipher,
            area_key_bytes,
            kdf,
            af_hash,
            stripes: af.stripes,
            priority,
        }))
    }

    /// Unknown mandatory requirements (everything: ucrypt implements none of cryptsetup's
    /// optional features such as online reencryption).
    pub fn requirements(&self) -> Vec<String> {
        self.config
            .requirements
            .as_ref()
            .and_then(|r| r.mandatory.clone())
            .unwrap_or_default()
    }

    /// The single crypt segment a plain LUKS2 volume has.
    pub fn crypt_segment(&self) -> Result<CryptSegment> {
        let crypt: Vec<_> = self
            .segments
            .values()
            .filter(|s| s.kind == SegmentKind::Crypt)
            .collect();
        let [s] = crypt[..] else {
            return Err(Error::UnsupportedLuks(format!(
                "{} crypt segments (ucrypt activates volumes with exactly one)",
                crypt.len()
            )));
        };
        if let Some(i) = &s.integrity {
            return Err(Error::UnsupportedLuks(format!(
                "the data segment is authenticated ({} with integrity {}): it has no plain \
                 dm-crypt mapping; open it with ucrypt's integrity support (ucrypt::integrity)",
                s.encryption.as_deref().unwrap_or("?"),
                i.kind
            )));
        }
        let enc = s.encryption.as_deref().unwrap_or("");
        Ok(CryptSegment {
            offset_bytes: s.offset.0,
            size: s.size,
            iv_tweak: s.iv_tweak.map_or(0, |v| v.0),
            cipher: enc.parse()?,
            sector_size: SectorSize::new(u64::from(s.sector_size.unwrap_or(512)))?,
        })
    }

    /// The digest that verifies the key of `keyslot`.
    pub fn digest_for_keyslot(&self, keyslot: &str) -> Option<(&String, &DigestJson)> {
        self.digests
            .iter()
            .find(|(_, d)| d.keyslots.iter().any(|k| k == keyslot))
    }

    /// Ids in use per section, for allocation.
    pub fn used_keyslots(&self) -> BTreeSet<u32> {
        self.keyslots
            .keys()
            .filter_map(|k| parse_numbered(k))
            .map(|n| n as u32)
            .collect()
    }
}

/// Typed KDF from its JSON object.
pub fn kdf_from_json(k: &KdfJson) -> Result<Kdf> {
    let salt = b64_decode(&k.salt).ok_or_else(|| bad("kdf", "salt is not valid base64"))?;
    let kdf = match &k.kind {
        KdfKind::Pbkdf2 => Kdf::Pbkdf2 {
            hash: HashAlg::from_name(k.hash.as_deref().unwrap_or(""))?,
            iterations: k
                .iterations
                .ok_or_else(|| bad("kdf", "pbkdf2 lacks iterations"))?,
            salt,
        },
        KdfKind::Argon2i | KdfKind::Argon2id => Kdf::Argon2 {
            variant: if k.kind == KdfKind::Argon2i {
                Argon2Variant::I
            } else {
                Argon2Variant::Id
            },
            cost: Argon2Cost {
                time: k.time.ok_or_else(|| bad("kdf", "argon2 lacks time"))?,
                memory_kib: k.memory.ok_or_else(|| bad("kdf", "argon2 lacks memory"))?,
                cpus: k.cpus.ok_or_else(|| bad("kdf", "argon2 lacks cpus"))?,
            },
            salt,
        },
        KdfKind::Other(other) => return Err(bad("kdf", format!("unknown kdf type '{other}'"))),
    };
    kdf.check()?;
    Ok(kdf)
}

/// JSON object for a typed KDF.
pub fn kdf_to_json(k: &Kdf) -> KdfJson {
    let mut j = KdfJson {
        kind: KdfKind::from(k.name()),
        hash: None,
        iterations: None,
        time: None,
        memory: None,
        cpus: None,
        salt: String::new(),
        extra: Map::new(),
    };
    match k {
        Kdf::Pbkdf2 {
            hash,
            iterations,
            salt,
        } => {
            j.hash = Some(hash.name().into());
            j.iterations = Some(*iterations);
            j.salt = super::util::b64_encode(salt);
        }
        Kdf::Argon2 { cost, salt, .. } => {
            j.time = Some(cost.time);
            j.memory = Some(cost.memory_kib);
            j.cpus = Some(cost.cpus);
            j.salt = super::util::b64_encode(salt);
        }
    }
    j
}
