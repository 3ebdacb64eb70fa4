//! LUKS2: the binary header codec, reading and choosing between the two copies, and header
//! updates returned as write plans.

use serde_json::Map;

use super::json::{
    af_area_bytes, kdf_to_json, round_up, AfJson, Area, Config, DigestJson, KeyslotParams,
    Metadata, Segment, SegmentSize, U64Str,
};
use super::kdf::{Kdf, KdfRequest, PBKDF2_ITERATIONS_MIN, SALT_BYTES};
use super::keyslot::SlotCrypto;
use super::util::{b64_decode, b64_encode, c_string, put_c_string, random_fill, HashAlg};
use super::{VolumeKey, WriteOp, BIN_HDR_BYTES, DIGEST_TIME_MS, HDR2_OFFSETS, KEYSLOTS_MAX};
use crate::{Error, Result, SecretBytes};

pub const MAGIC_1ST: &[u8; 6] = b"LUKS\xba\xbe";
pub const MAGIC_2ND: &[u8; 6] = b"SKUL\xba\xbe";
/// Header copy sizes (binary header + JSON area) cryptsetup supports: 16 KiB .. 4 MiB.
pub const HDR_SIZES: [u64; 9] = HDR2_OFFSETS;
/// The header copy size cryptsetup writes by default.
pub const HDR_SIZE_DEFAULT: u64 = 0x4000;

/// The fixed 4096-byte binary part of one header copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinHeader {
    pub hdr_size: u64,
    pub seqid: u64,
    pub label: String,
    pub checksum_alg: String,
    pub salt: [u8; 64],
    pub uuid: String,
    pub subsystem: String,
    pub hdr_offset: u64,
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn bad(check: &'static str, detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check,
        detail: detail.into(),
    }
}

impl BinHeader {
    /// Decodes the binary header found at `offset` (magic must be the copy's own).
    pub fn decode(b: &[u8], secondary: bool) -> Result<BinHeader> {
        if b.len() < BIN_HDR_BYTES as usize {
            return Err(bad("truncated", "device too small for a LUKS2 header"));
        }
        let magic = if secondary { MAGIC_2ND } else { MAGIC_1ST };
        if &b[0..6] != magic {
            return Err(Error::NotLuks(format!(
                "no {} LUKS2 magic",
                if secondary { "secondary" } else { "primary" }
            )));
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 2 {
            return Err(bad("version", format!("version {version}, expected 2")));
        }
        let mut salt = [0u8; 64];
        salt.copy_from_slice(&b[104..168]);
        Ok(BinHeader {
            hdr_size: be64(b, 8),
            seqid: be64(b, 16),
            label: c_string(&b[24..72], "label")?,
            checksum_alg: c_string(&b[72..104], "checksum_alg")?,
            salt,
            uuid: c_string(&b[168..208], "uuid")?,
            subsystem: c_string(&b[208..256], "subsystem")?,
            hdr_offset: be64(b, 256),
        })
    }

    /// Encodes with a zero checksum field.
    pub fn encode(&self, secondary: bool) -> Result<Vec<u8>> {
        let mut b = vec![0u8; BIN_HDR_BYTES as usize];
        b[0..6].copy_from_slice(if secondary { MAGIC_2ND } else { MAGIC_1ST });
        b[6..8].copy_from_slice(&2u16.to_be_bytes());
        b[8..16].copy_from_slice(&self.hdr_size.to_be_bytes());
        b[16..24].copy_from_slice(&self.seqid.to_be_bytes());
        put_c_string(&mut b[24..72], &self.label, "label")?;
        put_c_string(&mut b[72..104], &self.checksum_alg, "checksum algorithm")?;
        b[104..168].copy_from_slice(&self.salt);
        put_c_string(&mut b[168..208], &self.uuid, "UUID")?;
        put_c_string(&mut b[208..256], &self.subsystem, "subsystem")?;
        b[256..264].copy_from_slice(&self.hdr_offset.to_be_bytes());
        Ok(b)
    }
}

/// Checksum of a header copy: hash over the whole copy with the checksum field zeroed.
fn checksum(alg: HashAlg, copy: &[u8]) -> Vec<u8> {
    let zero = [0u8; 64];
    alg.digest(&[&copy[..448], &zero, &copy[512..]])
}

/// One valid header copy.
#[derive(Debug, Clone)]
pub struct Copy {
    pub bin: BinHeader,
    pub meta: Metadata,
}

/// Reads and fully validates the copy at `offset` of `prefix` (the device's first bytes).
pub fn read_copy(prefix: &[u8], offset: u64, secondary: bool) -> Result<Copy> {
    let start = usize::try_from(offset).map_err(|_| bad("truncated", "offset"))?;
    let first = match prefix.get(start..) {
        None | Some([]) => {
            return Err(Error::NotLuks(format!(
                "device ends before offset {offset}"
            )))
        }
        Some(r) if r.len() < BIN_HDR_BYTES as usize => {
            return Err(bad(
                "truncated",
                format!("device ends inside the header at {offset}"),
            ))
        }
        Some(r) => r,
    };
    let bin = BinHeader::decode(first, secondary)?;
    if bin.hdr_offset != offset {
        return Err(bad(
            "hdr_offset",
            format!("hdr_offset {} but found at {offset}", bin.hdr_offset),
        ));
    }
    if !HDR_SIZES.contains(&bin.hdr_size) {
        return Err(bad(
            "hdr_size",
            format!("unsupported header size {}", bin.hdr_size),
        ));
    }
    if secondary && bin.hdr_size != offset {
        return Err(bad(
            "hdr_size",
            format!(
                "secondary header of size {} at offset {offset}",
                bin.hdr_size
            ),
        ));
    }
    let size = bin.hdr_size as usize;
    let copy = first.get(..size).ok_or_else(|| {
        bad(
            "truncated",
            format!("device ends inside the header at {offset}"),
        )
    })?;
    let alg = HashAlg::from_name(&bin.checksum_alg).map_err(|_| {
        bad(
            "checksum_alg",
            format!("unsupported '{}'", bin.checksum_alg),
        )
    })?;
    let want = checksum(alg, copy);
    let stored = &copy[448..448 + want.len()];
    // Under cargo-fuzz the checksum is not enforced, so mutated inputs reach the JSON
    // checks (a fuzzer cannot forge SHA-256); normal builds always enforce it.
    if !cfg!(fuzzing) && !bool::from(subtle::ConstantTimeEq::ct_eq(stored, &want[..])) {
        return Err(bad("checksum", format!("{} checksum mismatch", alg.name())));
    }
    let json_area = &copy[BIN_HDR_BYTES as usize..];
    let end = json_area
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| bad("json-unterminated", "JSON area has no terminating NUL"))?;
    let meta = Metadata::parse(&json_area[..end])?;
    meta.validate(bin.hdr_size)?;
    Ok(Copy { bin, meta })
}

/// Which copy a reader uses, and which one it should rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Primary,
    Secondary,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    pub use_copy: Which,
    /// The other copy is invalid or stale and should be rewritten from `use_copy`.
    pub repair: Option<Which>,
}

/// Chooses between the copies given their validity (`Some(seqid)` when valid). Pure, so it is
/// tested as a truth table: the higher seqid wins; equal seqids prefer the primary; a single
/// valid copy wins and the other is repaired; none valid is an error (`None`).
pub fn select_copy(primary: Option<u64>, secondary: Option<u64>) -> Option<Selection> {
    use Which::*;
    let sel = |use_copy, repair| Some(Selection { use_copy, repair });
    match (primary, secondary) {
        (Some(p), Some(s)) if p > s => sel(Primary, Some(Secondary)),
        (Some(p), Some(s)) if s > p => sel(Secondary, Some(Primary)),
        (Some(_), Some(_)) => sel(Primary, None),
        (Some(_), None) => sel(Primary, Some(Secondary)),
        (None, Some(_)) => sel(Secondary, Some(Primary)),
        (None, None) => None,
    }
}

/// A parsed LUKS2 header: the winning copy, plus what a reader should know about the other.
#[derive(Debug, Clone)]
pub struct Luks2Header {
    pub bin: BinHeader,
    pub meta: Metadata,
    /// Salt of the secondary copy (each copy has its own).
    pub salt2: [u8; 64],
    /// Warnings for the user (a damaged or stale copy recovered from the other one).
    pub warnings: Vec<String>,
    /// Which copy is damaged or stale and will be rewritten by the next update or `repair`.
    pub repair: Option<Which>,
}

impl Luks2Header {
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

    /// Validates, bumps seqid and returns the writes of an update in cryptsetup's order:
    /// primary, sync, secondary, sync. A crash between them leaves one valid copy with the
    /// old or the new content.
    pub fn commit(&mut self) -> Result<Vec<WriteOp>> {
        self.meta.validate(self.bin.hdr_size)?;
        self.bin.seqid = self
            .bin
            .seqid
            .checked_add(1)
            .ok_or_else(|| bad("seqid", "seqid overflow"))?;
        let (p, s) = self.to_disk()?;
        self.repair = None;
        Ok(vec![
            WriteOp::Write { offset: 0, data: p },
            WriteOp::Sync,
            WriteOp::Write {
                offset: self.bin.hdr_size,
                data: s,
            },
            WriteOp::Sync,
        ])
    }

    /// Keyslots usable with a passphrase, in the order cryptsetup tries them: high priority
    /// first, then normal; priority 0 ("ignore") only when asked for by number.
    pub fn unlock_order(&self, slot: Option<u32>) -> Result<Vec<KeyslotParams>> {
        if let Some(id) = slot {
            return Ok(vec![self.meta.keyslot_params(&id.to_string())?]);
        }
        let mut v: Vec<KeyslotParams> = self
            .meta
            .keyslots
            .iter()
            .filter(|(_, k)| k.kind == "luks2")
            .filter_map(|(id, _)| self.meta.keyslot_params(id).ok())
            .filter(|p| p.priority > 0)
            .collect();
        v.sort_by_key(|p| (std::cmp::Reverse(p.priority), p.id));
        Ok(v)
    }

    pub fn slot_crypto(p: &KeyslotParams) -> SlotCrypto {
        SlotCrypto {
            key_bytes: p.key_bytes,
            area_cipher: p.area_cipher,
            area_key_bytes: p.area_key_bytes,
            kdf: p.kdf.clone(),
            af_hash: p.af_hash,
            stripes: p.stripes,
        }
    }

    /// Checks a candidate key against the digest of `keyslot`; the only way to get a
    /// [`VolumeKey`] for this header.
    pub fn verify_key(&self, keyslot: Option<u32>, candidate: SecretBytes) -> Result<VolumeKey> {
        let digest = match keyslot {
            Some(id) => self.meta.digest_for_keyslot(&id.to_string()),
            None => self
                .meta
                .digests
                .iter()
                .find(|(_, d)| !d.segments.is_empty()),
        };
        let (id, d) = digest.ok_or(Error::WrongPassphrase)?;
        if d.kind != "pbkdf2" {
            return Err(Error::UnsupportedLuks(format!("digest type '{}'", d.kind)));
        }
        let hash = HashAlg::from_name(d.hash.as_deref().unwrap_or(""))?;
        let salt = b64_decode(d.salt.as_deref().unwrap_or(""))
            .ok_or_else(|| bad("digests", format!("digest {id} salt is not base64")))?;
        let want = b64_decode(d.digest.as_deref().unwrap_or(""))
            .ok_or_else(|| bad("digests", format!("digest {id} value is not base64")))?;
        let iterations = d
            .iterations
            .filter(|&n| n > 0)
            .ok_or_else(|| bad("digests", format!("digest {id} has no iterations")))?;
        if want.is_empty()
            || want.len() > super::DIGEST_BYTES_MAX
            || salt.len() > super::kdf::SALT_BYTES_MAX
        {
            return Err(bad("digests", format!("digest {id} value or salt length")));
        }
        let mut got = SecretBytes::zeroed(want.len());
        hash.pbkdf2(candidate.as_ref(), &salt, iterations, got.as_mut());
        if got.ct_eq(&want) {
            Ok(VolumeKey::new_verified(candidate, id.parse().unwrap_or(0)))
        } else {
            Err(Error::WrongPassphrase)
        }
    }

    /// First gap in the keyslots area that holds `len` bytes (4096-aligned).
    fn find_area(&self, len: u64) -> Result<u64> {
        let start = 2 * self.bin.hdr_size;
        let end = start + self.meta.config.keyslots_size.0;
        let mut used: Vec<(u64, u64)> = self
            .meta
            .keyslots
            .values()
            .filter_map(|k| k.area.as_ref().map(|a| (a.offset.0, a.offset.0 + a.size.0)))
            .collect();
        used.sort();
        let mut at = start;
        for (s, e) in used {
            if at + len <= s {
                break;
            }
            at = at.max(round_up(e, 4096).unwrap_or(u64::MAX));
        }
        if at.checked_add(len).is_some_and(|e| e <= end) {
            Ok(at)
        } else {
            Err(Error::InvalidArgument(
                "no space for a new keyslot in the LUKS2 keyslots area".into(),
            ))
        }
    }

    /// Adds a passphrase keyslot for `vk`. Returns the writes: key material first, then the
    /// header update, so a crash never leaves a header pointing at missing material.
    pub fn add_keyslot(
        &mut self,
        vk: &VolumeKey,
        passphrase: &[u8],
        kdf: &KdfRequest,
        slot: Option<u32>,
        priority: Option<u32>,
    ) -> Result<(u32, Vec<WriteOp>)> {
        let used = self.meta.used_keyslots();
        let id = match slot {
            Some(id) if id >= KEYSLOTS_MAX => {
                return Err(Error::InvalidArgument(format!(
                    "keyslot {id} is out of range (0..{KEYSLOTS_MAX})"
                )))
            }
            Some(id) if used.contains(&id) => {
                return Err(Error::Keyslot {
                    slot: id,
                    reason: "keyslot is already in use".into(),
                })
            }
            Some(id) => id,
            None => (0..KEYSLOTS_MAX)
                .find(|i| !used.contains(i))
                .ok_or_else(|| Error::InvalidArgument("all keyslots are full".into()))?,
        };
        let seg = self.meta.crypt_segment()?;
        let key_bytes = vk.len();
        let stripes = super::af::AF_STRIPES;
        let area_len = round_up(af_area_bytes(key_bytes, stripes), 4096)
            .ok_or(Error::Bug("area length overflow"))?;
        let offset = self.find_area(area_len)?;
        let kdf_params = kdf.resolve(key_bytes)?;
        let crypto = SlotCrypto {
            key_bytes,
            area_cipher: seg.cipher,
            area_key_bytes: key_bytes,
            kdf: kdf_params.clone(),
            af_hash: kdf.hash,
            stripes,
        };
        let material = crypto.seal(passphrase, vk.bytes())?;
        let ks = super::json::Keyslot {
            kind: "luks2".into(),
            key_size: key_bytes as u32,
            af: Some(AfJson {
                kind: "luks1".into(),
                stripes,
                hash: kdf.hash.name().into(),
                extra: Map::new(),
            }),
            area: Some(Area {
                kind: "raw".into(),
                offset: U64Str(offset),
                size: U64Str(area_len),
                encryption: Some(seg.cipher.to_string()),
                key_size: Some(key_bytes as u32),
                extra: Map::new(),
            }),
            kdf: Some(kdf_to_json(&kdf_params)),
            priority: priority.filter(|&p| p != 1),
            extra: Map::new(),
        };
        let key = id.to_string();
        self.meta.keyslots.insert(key.clone(), ks);
        let did = vk.digest_id().to_string();
        let d = self
            .meta
            .digests
            .get_mut(&did)
            .ok_or(Error::Bug("volume key digest vanished"))?;
        if !d.keyslots.contains(&key) {
            d.keyslots.push(key);
        }
        let mut ops = vec![
            WriteOp::Write {
                offset,
                data: material,
            },
            WriteOp::Sync,
        ];
        ops.extend(self.commit()?);
        Ok((id, ops))
    }

    /// Removes keyslot `id`: header first, then the area is overwritten with random bytes.
    pub fn remove_keyslot(&mut self, id: u32) -> Result<Vec<WriteOp>> {
        let key = id.to_string();
        let ks = self
            .meta
            .keyslots
            .remove(&key)
            .ok_or_else(|| Error::Keyslot {
                slot: id,
                reason: "keyslot is not in use".into(),
            })?;
        for d in self.meta.digests.values_mut() {
            d.keyslots.retain(|k| k != &key);
        }
        for t in self.meta.tokens.values_mut() {
            if let Some(serde_json::Value::Array(a)) = t.get_mut("keyslots") {
                a.retain(|v| v.as_str() != Some(&key));
            }
        }
        let mut ops = self.commit()?;
        if let Some(a) = ks.area {
            let mut noise = vec![0u8; a.size.0 as usize];
            random_fill(&mut noise)?;
            ops.push(WriteOp::Write {
                offset: a.offset.0,
                data: noise,
            });
            ops.push(WriteOp::Sync);
        }
        Ok(ops)
    }

    /// Replaces the passphrase of keyslot `id`, keeping its number (as cryptsetup does for
    /// LUKS2): the new material goes to a fresh area, one header commit swaps the keyslot,
    /// then the old area is wiped. A crash leaves the old or the new passphrase working.
    pub fn change_keyslot(
        &mut self,
        id: u32,
        vk: &VolumeKey,
        passphrase: &[u8],
        kdf: &KdfRequest,
    ) -> Result<(u32, Vec<WriteOp>)> {
        let key = id.to_string();
        let old = self
            .meta
            .keyslots
            .get(&key)
            .cloned()
            .ok_or(Error::Keyslot {
                slot: id,
                reason: "keyslot is not in use".into(),
            })?;
        let priority = old.priority;
        // Build the new keyslot under a free id, then move it to `id` in the same commit.
        let tmp = (0..KEYSLOTS_MAX)
            .find(|i| !self.meta.used_keyslots().contains(i))
            .ok_or_else(|| Error::InvalidArgument("all keyslots are full".into()))?;
        let saved = self.clone();
        let (_, mut ops) = self.add_keyslot(vk, passphrase, kdf, Some(tmp), priority)?;
        // Drop the header writes add_keyslot planned; keep its material write.
        ops.truncate(2);
        let mut ks = self
            .meta
            .keyslots
            .remove(&tmp.to_string())
            .ok_or(Error::Bug("new keyslot vanished"))?;
        ks.priority = priority;
        self.meta.keyslots.insert(key.clone(), ks);
        for d in self.meta.digests.values_mut() {
            d.keyslots.retain(|k| k != &tmp.to_string());
        }
        self.bin.seqid = saved.bin.seqid;
        ops.extend(self.commit()?);
        if let Some(a) = old.area {
            let mut noise = vec![0u8; a.size.0 as usize];
            random_fill(&mut noise)?;
            ops.push(WriteOp::Write {
                offset: a.offset.0,
                data: noise,
            });
            ops.push(WriteOp::Sync);
        }
        Ok((id, ops))
    }

    /// Sets the persistent activation flags (`config.flags`).
    pub fn set_flags(&mut self, flags: Vec<String>) -> Result<Vec<WriteOp>> {
        self.meta.config.flags = if flags.is_empty() { None } else { Some(flags) };
        self.commit()
    }

    pub fn flags(&self) -> Vec<String> {
        self.meta.config.flags.clone().unwrap_or_default()
    }

    /// Rewrites both copies from the chosen one (cryptsetup's `repair`).
    pub fn repair_plan(&mut self) -> Result<Vec<WriteOp>> {
        self.commit()
    }
}

/// What `format` needs (cryptsetup's luksFormat options for LUKS2).
#[derive(Debug, Clone)]
pub struct FormatLuks2 {
    pub cipher: crate::sector::CipherSpec,
    pub key_bytes: usize,
    pub sector_size: crate::sector::SectorSize,
    pub kdf: KdfRequest,
    pub label: String,
    pub subsystem: String,
    pub uuid: String,
    /// Data offset in bytes (0 with a detached header and no --offset).
    pub data_offset: u64,
    /// Header copy size (binary + JSON).
    pub hdr_size: u64,
    /// Bytes reserved for keyslot material after the two header copies.
    pub keyslots_size: u64,
    pub detached: bool,
}

impl FormatLuks2 {
    /// cryptsetup's defaults: aes-xts-plain64, 512-bit key, 4096-byte sectors, argon2id,
    /// 16 KiB header copies, 16 MiB data offset.
    pub fn defaults(uuid: String) -> Self {
        FormatLuks2 {
            cipher: crate::sector::CipherSpec::AES_XTS_PLAIN64,
            key_bytes: 64,
            sector_size: crate::sector::SectorSize::S4096,
            kdf: KdfRequest::luks2_default(),
            label: String::new(),
            subsystem: String::new(),
            uuid,
            data_offset: 16 << 20,
            hdr_size: HDR_SIZE_DEFAULT,
            keyslots_size: (16 << 20) - 2 * HDR_SIZE_DEFAULT,
            detached: false,
        }
    }
}

/// Creates a new LUKS2 header around `volume_key` (random from the caller, or a user's
/// --volume-key-file), with a pbkdf2 digest, and no keyslot yet.
pub fn format(opts: &FormatLuks2, volume_key: SecretBytes) -> Result<(Luks2Header, VolumeKey)> {
    opts.cipher.check_key_len(volume_key.len())?;
    if !HDR_SIZES.contains(&opts.hdr_size) {
        return Err(Error::InvalidArgument(format!(
            "header size {}",
            opts.hdr_size
        )));
    }
    let ss = u64::from(opts.sector_size.bytes());
    if opts.data_offset % ss != 0 || opts.data_offset % 512 != 0 {
        return Err(Error::InvalidArgument(format!(
            "data offset {} is not aligned to the {ss}-byte sector size",
            opts.data_offset
        )));
    }
    let mut digest_salt = vec![0u8; SALT_BYTES];
    random_fill(&mut digest_salt)?;
    let hash = opts.kdf.hash;
    let iterations = if opts.kdf.force_iterations.is_some() {
        PBKDF2_ITERATIONS_MIN
    } else {
        super::kdf::calibrate_pbkdf2(hash, DIGEST_TIME_MS, volume_key.len())
    };
    let mut digest = vec![0u8; hash.output_bytes()];
    hash.pbkdf2(volume_key.as_ref(), &digest_salt, iterations, &mut digest);
    let mut segments = std::collections::BTreeMap::new();
    segments.insert(
        "0".to_string(),
        Segment {
            kind: "crypt".into(),
            offset: U64Str(opts.data_offset),
            size: SegmentSize::Dynamic,
            iv_tweak: Some(U64Str(0)),
            encryption: Some(opts.cipher.to_string()),
            sector_size: Some(opts.sector_size.bytes()),
            flags: None,
            extra: Map::new(),
        },
    );
    let mut digests = std::collections::BTreeMap::new();
    digests.insert(
        "0".to_string(),
        DigestJson {
            kind: "pbkdf2".into(),
            keyslots: vec![],
            segments: vec!["0".into()],
            hash: Some(hash.name().into()),
            iterations: Some(iterations),
            salt: Some(b64_encode(&digest_salt)),
            digest: Some(b64_encode(&digest)),
            extra: Map::new(),
        },
    );
    let meta = Metadata {
        keyslots: Default::default(),
        tokens: Default::default(),
        segments,
        digests,
        config: Config {
            json_size: U64Str(opts.hdr_size - BIN_HDR_BYTES),
            keyslots_size: U64Str(opts.keyslots_size),
            flags: None,
            requirements: None,
            extra: Map::new(),
        },
        extra: Map::new(),
    };
    let mut salt1 = [0u8; 64];
    let mut salt2 = [0u8; 64];
    random_fill(&mut salt1)?;
    random_fill(&mut salt2)?;
    let hdr = Luks2Header {
        bin: BinHeader {
            hdr_size: opts.hdr_size,
            seqid: 0,
            label: opts.label.clone(),
            checksum_alg: "sha256".into(),
            salt: salt1,
            uuid: opts.uuid.clone(),
            subsystem: opts.subsystem.clone(),
            hdr_offset: 0,
        },
        meta,
        salt2,
        warnings: vec![],
        repair: None,
    };
    // Check everything a reader will check before anything is written.
    hdr.meta.validate(hdr.bin.hdr_size)?;
    let vk = hdr.verify_key(None, volume_key)?;
    Ok((hdr, vk))
}

/// Used by tests and the fuzz entry: a keyslot's typed KDF.
pub fn keyslot_kdf(hdr: &Luks2Header, id: u32) -> Result<Kdf> {
    Ok(hdr.meta.keyslot_params(&id.to_string())?.kdf)
}
