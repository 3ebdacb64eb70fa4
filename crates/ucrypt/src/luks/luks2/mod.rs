//! LUKS2, one file per on-disk concept (as cryptsetup's lib/luks2 does):
//! - `binary`: the 4096-byte binary header, its checksum, and reading one checked copy;
//! - `select`: which of the two copies wins (a pure function);
//! - this file: the parsed header ([`Luks2Header`]), parsing both copies, and serialising
//!   an update as a write plan;
//! - `digest`: the pbkdf2 digest that proves a key right, and new digests;
//! - `config`: label, subsystem, UUID, keyslot priority, persistent flags;
//! - `keyslots`: unlock order, adding/removing/changing keyslots (unbound ones too);
//! - `tokens`: tokens kept as they are (key order too), added, imported, assigned, removed;
//! - `format`: a new header.

mod binary;
mod config;
pub(crate) mod digest;
mod format;
mod keyslots;
mod select;
mod tokens;

pub use binary::{read_copy, BinHeader, Copy, HDR_SIZES, MAGIC_1ST, MAGIC_2ND};
pub use config::Priority;
pub use format::{format, FormatIntegrity, FormatLuks2, HDR_SIZE_DEFAULT};
pub use keyslots::{keyslot_kdf, KeyslotArea};
pub use select::{select_copy, Selection, Which};
pub use tokens::{KeyringToken, TokenFilter, KEYRING_TOKEN};

use super::json::Metadata;
use super::util::HashAlg;
use super::{WriteOp, BIN_HDR_BYTES, HDR2_OFFSETS};
use crate::{Error, Result};
use binary::checksum;

/// Every check a header's metadata passes on load and before it is written: the passes every
/// object type shares, with each keyslot type's own in the keyslot pass (the `reencrypt`
/// keyslot's, [`crate::luks::reencrypt::validate`]), as cryptsetup's keyslot handlers add
/// theirs.
pub fn validate(meta: &Metadata, hdr_size: u64) -> Result<()> {
    meta.validate(hdr_size, &crate::luks::reencrypt::validate)
}

/// A header that failed `check` (the name tests and callers match on).
fn bad(check: &'static str, detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check,
        detail: detail.into(),
    }
}

/// A parsed LUKS2 header: the winning copy, plus what a reader should know about the other.
///
/// The binary header and the metadata are read through [`Luks2Header::bin`] and
/// [`Luks2Header::meta`]; they change only through the header's own methods (keyslots,
/// settings, reencryption), each of which keeps the header valid, and reach the device only
/// through [`Luks2Header::commit`]'s plan. A caller cannot edit a validated header:
///
/// ```compile_fail
/// fn edit(h: &mut ucrypt::luks::Luks2Header) {
///     h.meta.config.flags = None;
/// }
/// ```
///
/// ```compile_fail
/// fn edit(h: &mut ucrypt::luks::Luks2Header) {
///     h.bin.seqid += 1;
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Luks2Header {
    pub(crate) bin: BinHeader,
    pub(crate) meta: Metadata,
    /// Salt of the secondary copy (each copy has its own).
    pub salt2: [u8; 64],
    /// Warnings for the user (a damaged or stale copy recovered from the other one).
    pub warnings: Vec<String>,
    /// Which copy is damaged or stale and will be rewritten by the next update or `repair`.
    pub repair: Option<Which>,
}

impl Luks2Header {
    /// The winning copy's binary header.
    pub fn bin(&self) -> &BinHeader {
        &self.bin
    }

    /// The metadata (keyslots, digests, segments, tokens, config), as validated.
    pub fn meta(&self) -> &Metadata {
        &self.meta
    }

    /// Parses from the device's first bytes (see [`super::probe_len`]).
    pub fn parse(prefix: &[u8]) -> Result<Luks2Header> {
        let p = read_copy(prefix, 0, false);
        // With a readable primary, the secondary sits right after it; otherwise probe every
        // offset cryptsetup may have used.
        let candidates: Vec<u64> = match &p {
            Ok(c) => vec![c.bin.hdr_size],
            Err(_) => match BinHeader::decode(prefix, false) {
                Ok(b) if HDR_SIZES.contains(&b.hdr_size) => std::iter::once(b.hdr_size)
                    .chain(HDR2_OFFSETS.iter().copied().filter(|&o| o != b.hdr_size))
                    .collect(),
                _ => HDR2_OFFSETS.to_vec(),
            },
        };
        let mut s: Result<Copy> = Err(Error::NotLuks("no secondary LUKS2 header found".into()));
        // Keep the most informative failure: a copy with the right magic that failed a
        // check beats "truncated", which beats "no magic here".
        let rank = |r: &Result<Copy>| match r {
            Ok(_) => 3,
            Err(Error::BadHeader { check, .. }) if *check != "truncated" => 2,
            Err(Error::BadHeader { .. }) => 1,
            Err(_) => 0,
        };
        for off in candidates {
            let r = read_copy(prefix, off, true);
            if rank(&r) > rank(&s) {
                s = r;
            }
            if s.is_ok() {
                break;
            }
        }
        let sel = select_copy(
            p.as_ref().ok().map(|c| c.bin.seqid),
            s.as_ref().ok().map(|c| c.bin.seqid),
        );
        let Some(sel) = sel else {
            // Report the primary's failure, naming the secondary's too.
            return Err(match (p, s) {
                (Err(Error::NotLuks(m)), Err(Error::NotLuks(_))) => Error::NotLuks(m),
                (Err(Error::NotLuks(_)), Err(e2)) => e2,
                (Err(Error::BadHeader { check, detail }), Err(e2)) => Error::BadHeader {
                    check,
                    detail: format!("{detail} (secondary header: {e2})"),
                },
                (Err(e), Err(_)) => e,
                _ => Error::Bug("copy selection disagrees with copy validity"),
            });
        };
        let mut warnings = Vec::new();
        let (p_salt, s_salt) = (
            p.as_ref().map(|c| c.bin.salt).ok(),
            s.as_ref().map(|c| c.bin.salt).ok(),
        );
        let why = |r: &Result<Copy>| match r {
            Ok(_) => "it is older".to_string(),
            Err(e) => e.to_string(),
        };
        match sel.repair {
            Some(Which::Primary) => warnings.push(format!(
                "Primary LUKS2 header is damaged or stale ({}); using the secondary header.",
                why(&p)
            )),
            Some(Which::Secondary) => warnings.push(format!(
                "Secondary LUKS2 header is damaged or stale ({}); using the primary header.",
                why(&s)
            )),
            None => {}
        }
        let chosen = match sel.use_copy {
            Which::Primary => p?,
            Which::Secondary => s?,
        };
        let mut bin = chosen.bin;
        let salt1 = p_salt.unwrap_or(bin.salt);
        let salt2 = s_salt.unwrap_or(bin.salt);
        bin.salt = salt1;
        bin.hdr_offset = 0;
        Ok(Luks2Header {
            bin,
            meta: chosen.meta,
            salt2,
            warnings,
            repair: sel.repair,
        })
    }

    pub fn hdr_size(&self) -> u64 {
        self.bin.hdr_size
    }

    /// Bytes of the header area: both copies plus the keyslots area (what header-backup saves).
    pub fn metadata_area_bytes(&self) -> u64 {
        2 * self.bin.hdr_size + self.meta.config.keyslots_size.0
    }

    /// Both serialised copies (primary, secondary), each `hdr_size` bytes, checksummed.
    pub fn to_disk(&self) -> Result<(Vec<u8>, Vec<u8>)> {
        let json = serde_json::to_vec(&self.meta)
            .map_err(|_| Error::Bug("LUKS2 metadata does not serialise"))?;
        let area = (self.bin.hdr_size - BIN_HDR_BYTES) as usize;
        if json.len() >= area {
            return Err(Error::InvalidArgument(format!(
                "LUKS2 JSON metadata ({} bytes) does not fit the {area}-byte JSON area",
                json.len()
            )));
        }
        let alg = HashAlg::from_name(&self.bin.checksum_alg)?;
        let mut out = Vec::new();
        for secondary in [false, true] {
            let mut b = self.bin.clone();
            b.hdr_offset = if secondary { self.bin.hdr_size } else { 0 };
            if secondary {
                b.salt = self.salt2;
            }
            let mut copy = b.encode(secondary)?;
            copy.extend_from_slice(&json);
            copy.resize(self.bin.hdr_size as usize, 0);
            let sum = checksum(alg, &copy);
            copy[448..448 + sum.len()].copy_from_slice(&sum);
            out.push(copy);
        }
        let s = out.pop().ok_or(Error::Bug("two copies"))?;
        let p = out.pop().ok_or(Error::Bug("two copies"))?;
        Ok((p, s))
    }

    /// Validates, bumps seqid and returns the writes of an update: one copy, sync, the other,
    /// sync (cryptsetup writes the primary first). A crash between them leaves one valid copy
    /// with the old or the new content, so the copy written first must be one the reader can
    /// lose: the damaged or stale copy when there is one ([`Luks2Header::repair`]; writing the
    /// only valid copy first would leave none if that write tore), else the primary.
    pub fn commit(&mut self) -> Result<Vec<WriteOp>> {
        validate(&self.meta, self.bin.hdr_size)?;
        self.bin.seqid = self
            .bin
            .seqid
            .checked_add(1)
            .ok_or_else(|| bad("seqid", "seqid overflow"))?;
        let (p, s) = self.to_disk()?;
        let primary = WriteOp::Write { offset: 0, data: p };
        let secondary = WriteOp::Write {
            offset: self.bin.hdr_size,
            data: s,
        };
        let (first, second) = match self.repair.take() {
            Some(Which::Secondary) => (secondary, primary),
            Some(Which::Primary) | None => (primary, secondary),
        };
        Ok(vec![first, WriteOp::Sync, second, WriteOp::Sync])
    }

    /// Rewrites both copies from the chosen one (cryptsetup's `repair`).
    pub fn repair_plan(&mut self) -> Result<Vec<WriteOp>> {
        self.commit()
    }
}
