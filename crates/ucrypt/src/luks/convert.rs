//! In-place conversion between LUKS1 and LUKS2 (cryptsetup's `convert --type luks1|luks2`),
//! sans I/O: a parsed header and the keyslot area bytes in, the new header and its write plan
//! out.
//!
//! The on-disk facts (cryptsetup's `luks2_luks1_convert.c`, whose results both tools read):
//! - A LUKS1 header's keyslot material starts at sector 8 (4096 bytes); a converted LUKS2
//!   header has two 16 KiB copies, so its keyslot areas start at 32768. Conversion moves the
//!   whole keyslot region by [`AREA_SHIFT_BYTES`] (up to LUKS2, down to LUKS1); every keyslot
//!   keeps its place relative to the others, so LUKS1 keyslot `i` at sector `s` is the LUKS2
//!   keyslot `i` at byte `512 * s + 28672`.
//! - Up: each active LUKS1 keyslot becomes a `luks2` keyslot with a pbkdf2 KDF, a `luks1` AF
//!   of 4000 stripes, a `raw` area of the material rounded up to 4096 bytes; one crypt segment
//!   at the payload offset with 512-byte sectors; the LUKS1 volume key digest becomes digest 0
//!   as it is (its 20 bytes: a pbkdf2 digest is checked over its own length). The keyslots
//!   area reaches the data offset (a detached header: the end of the header device).
//! - Down: only what LUKS1 can say converts: one pbkdf2 digest, one segment with 512-byte
//!   sectors, no tokens, keyslots 0-7 only, each pbkdf2 with the digest's hash, 4000 stripes,
//!   the segment's cipher and key size and an area of exactly the LUKS1 material size. The
//!   inactive LUKS1 keyslots get the first free gaps of the keyslots area, in slot order, as
//!   cryptsetup allocates them.
//!
//! Crash safety is cryptsetup's: the keyslot region is moved first (one write, then a sync),
//! then the new header is written. The two regions overlap, so a crash after the move began
//! and before the new header is complete leaves neither header usable; the unit tests below
//! state exactly which crash points are recoverable. A header backup first is the user's
//! protection, as cryptsetup's manual says.

use serde_json::Map;

use super::af::AF_STRIPES;
use super::json::{
    af_area_bytes, AfJson, Area, Config, DigestJson, DigestKind, KdfJson, KdfKind, Keyslot,
    KeyslotKind, Metadata, Segment, SegmentSize, U64Str,
};
use super::kdf::SALT_BYTES;
use super::luks1::{self, Luks1Header, Luks1Slot};
use super::luks2::{BinHeader, Luks2Header};
use super::util::{b64_decode, b64_encode, random_fill};
use super::{Header, WriteOp, BIN_HDR_BYTES, KEYSLOTS_AREA_BYTES_MAX};
use crate::{Error, Result};

/// The header copy size of a converted LUKS2 header (cryptsetup's smallest, 16 KiB).
pub const CONVERTED_HDR_BYTES: u64 = 0x4000;
/// Where LUKS1 keyslot material starts (sector 8): the only layout cryptsetup converts.
pub const LUKS1_KEYSLOTS_OFFSET_BYTES: u64 = 4096;
/// Where the keyslot areas of a converted LUKS2 header start: after both copies.
pub const LUKS2_KEYSLOTS_OFFSET_BYTES: u64 = 2 * CONVERTED_HDR_BYTES;
/// How far conversion moves the keyslot region (up to LUKS2, down to LUKS1).
pub const AREA_SHIFT_BYTES: u64 = LUKS2_KEYSLOTS_OFFSET_BYTES - LUKS1_KEYSLOTS_OFFSET_BYTES;
/// luksmeta (clevis's LUKS1 metadata store) writes this right after the keyslot areas; a
/// LUKS2 header would overwrite it, so cryptsetup refuses to convert such a header.
const LUKSMETA_MAGIC: &[u8; 8] = b"LUKSMETA";
/// LUKS1 keyslots, as LUKS2 numbers them.
const LUKS1_KEYSLOTS: u32 = luks1::KEYSLOTS as u32;

/// The format to convert to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvertTo {
    Luks1,
    Luks2,
}

impl ConvertTo {
    /// cryptsetup's name of the type (`LUKS1`, `LUKS2`), as its messages print it.
    pub fn name(self) -> &'static str {
        match self {
            ConvertTo::Luks1 => "LUKS1",
            ConvertTo::Luks2 => "LUKS2",
        }
    }
}

/// The header device, as far as conversion needs to know it.
#[derive(Debug, Clone, Copy)]
pub struct MetadataDevice {
    /// Its size in bytes.
    pub size_bytes: u64,
    /// A regular file, which grows when written past its end (cryptsetup fallocates it);
    /// a block device cannot.
    pub growable: bool,
}

/// A conversion: the new header and the writes that put it on the device, in order.
#[derive(Debug)]
pub struct Conversion {
    pub header: Header,
    pub ops: Vec<WriteOp>,
    /// The device must be at least this long before `ops` are applied (a detached header file
    /// may need to grow, as cryptsetup grows it).
    pub device_bytes_needed: u64,
}

/// A refusal in cryptsetup's words (exit code 1).
fn refuse(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// Plans the conversion of `hdr` to `to`. `read(offset, len)` reads the header device (the
/// keyslot region to move, and the luksmeta probe).
pub fn convert(
    hdr: &Header,
    to: ConvertTo,
    dev: MetadataDevice,
    read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<Conversion> {
    match (hdr, to) {
        (Header::Luks1(h), ConvertTo::Luks2) => luks1_to_luks2(h, dev, read),
        (Header::Luks2(h), ConvertTo::Luks1) => {
            hdr.check_requirements()?;
            luks2_to_luks1(h, read)
        }
        _ => Err(refuse(format!("Device is already {} type.", to.name()))),
    }
}

// ---------------------------------------------------------------- LUKS1 -> LUKS2

/// The end of the LUKS1 keyslot region, rounded up to 4096 bytes (cryptsetup's LUKS1 "full
/// header" size).
fn luks1_region_end(h: &Luks1Header) -> u64 {
    let material = h.material_bytes();
    let end = h
        .slots
        .iter()
        .map(|s| u64::from(s.key_material_offset) * 512 + material)
        .max()
        .unwrap_or(LUKS1_KEYSLOTS_OFFSET_BYTES);
    end.div_ceil(4096) * 4096
}

/// The cipher as LUKS2 spells it: `name-mode`, or the name alone when the mode is empty.
fn luks1_encryption(h: &Luks1Header) -> String {
    if h.cipher_mode.is_empty() {
        h.cipher_name.clone()
    } else {
        format!("{}-{}", h.cipher_name, h.cipher_mode)
    }
}

fn luks1_to_luks2(
    h: &Luks1Header,
    dev: MetadataDevice,
    read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<Conversion> {
    let first = h
        .slots
        .iter()
        .map(|s| s.key_material_offset)
        .min()
        .unwrap_or(0);
    if u64::from(first) * 512 != LUKS1_KEYSLOTS_OFFSET_BYTES {
        return Err(refuse(format!(
            "Cannot convert to LUKS2 format - unsupported keyslots material offset {first} \
             (a legacy LUKS1 layout; only keyslots starting at sector 8 can be moved)."
        )));
    }
    // The keyslot areas must stay readable by whoever opens the LUKS2 header: a cipher ucrypt
    // cannot run is refused, as cryptsetup refuses one its crypto backend lacks.
    if h.cipher()
        .and_then(|c| c.check_key_len(h.key_bytes as usize))
        .is_err()
    {
        return Err(refuse(format!(
            "Unable to use cipher specification {}-{} for LUKS2.",
            h.cipher_name, h.cipher_mode
        )));
    }
    let region_end = luks1_region_end(h);
    // A short read (the probe past the device's end) means no luksmeta.
    if read(region_end, LUKSMETA_MAGIC.len() as u64).is_ok_and(|b| b == LUKSMETA_MAGIC) {
        return Err(refuse(
            "Unable to convert header with LUKSMETA additional metadata.",
        ));
    }
    let required = region_end + AREA_SHIFT_BYTES;
    let mut max = match u64::from(h.payload_offset) * 512 {
        0 => dev.size_bytes,
        data => data,
    };
    if max < required {
        if !dev.growable {
            return Err(refuse("Unable to move keyslot area. Not enough space."));
        }
        max = required;
    }
    let keyslots_size = (max - LUKS2_KEYSLOTS_OFFSET_BYTES) / 4096 * 4096;
    let mut salt1 = [0u8; 64];
    let mut salt2 = [0u8; 64];
    random_fill(&mut salt1)?;
    random_fill(&mut salt2)?;
    let mut new = Luks2Header {
        bin: BinHeader {
            hdr_size: CONVERTED_HDR_BYTES,
            // cryptsetup's: the first write makes it 2.
            seqid: 1,
            label: String::new(),
            checksum_alg: "sha256".into(),
            salt: salt1,
            uuid: h.uuid.clone(),
            subsystem: String::new(),
            hdr_offset: 0,
        },
        meta: luks1_metadata(h, keyslots_size),
        salt2,
        warnings: vec![],
        repair: None,
    };
    if super::luks2::validate(&new.meta, CONVERTED_HDR_BYTES).is_err() {
        return Err(refuse("Cannot convert to LUKS2 format - invalid metadata."));
    }
    let move_bytes = region_end - LUKS1_KEYSLOTS_OFFSET_BYTES;
    // Bounds the buffer a hostile LUKS1 header (a keyslot far out on a detached header) could
    // make us read: no LUKS2 keyslots area is larger.
    if move_bytes > keyslots_size || move_bytes > KEYSLOTS_AREA_BYTES_MAX {
        return Err(refuse(
            "Unable to move keyslot area. LUKS2 keyslots area too small.",
        ));
    }
    let moved = read(LUKS1_KEYSLOTS_OFFSET_BYTES, move_bytes)?;
    if moved.len() as u64 != move_bytes {
        return Err(Error::Bug("keyslot region read returned a short buffer"));
    }
    let mut ops = vec![
        WriteOp::Write {
            offset: LUKS2_KEYSLOTS_OFFSET_BYTES,
            data: moved,
        },
        WriteOp::Sync,
    ];
    ops.extend(new.commit()?);
    Ok(Conversion {
        header: Header::Luks2(new),
        ops,
        device_bytes_needed: required,
    })
}

/// The LUKS2 metadata describing a LUKS1 header, keyslot areas moved by [`AREA_SHIFT_BYTES`].
fn luks1_metadata(h: &Luks1Header, keyslots_size: u64) -> Metadata {
    let encryption = luks1_encryption(h);
    let area_bytes = h.material_bytes().div_ceil(4096) * 4096;
    let mut keyslots = std::collections::BTreeMap::new();
    let mut active = Vec::new();
    for (i, s) in h.slots.iter().enumerate().filter(|(_, s)| s.active) {
        active.push(i.to_string());
        keyslots.insert(
            i.to_string(),
            Keyslot {
                kind: KeyslotKind::Luks2,
                key_size: h.key_bytes,
                kdf: Some(KdfJson {
                    kind: KdfKind::Pbkdf2,
                    hash: Some(h.hash_spec.clone()),
                    iterations: Some(s.iterations),
                    time: None,
                    memory: None,
                    cpus: None,
                    salt: b64_encode(&s.salt),
                    extra: Map::new(),
                }),
                af: Some(AfJson {
                    kind: "luks1".into(),
                    hash: h.hash_spec.clone(),
                    stripes: AF_STRIPES,
                    extra: Map::new(),
                }),
                area: Some(Area {
                    kind: "raw".into(),
                    encryption: Some(encryption.clone()),
                    key_size: Some(h.key_bytes),
                    offset: U64Str(u64::from(s.key_material_offset) * 512 + AREA_SHIFT_BYTES),
                    size: U64Str(area_bytes),
                    extra: Map::new(),
                }),
                priority: None,
                extra: Map::new(),
            },
        );
    }
    let mut segments = std::collections::BTreeMap::new();
    segments.insert(
        "0".to_string(),
        Segment {
            kind: "crypt".into(),
            offset: U64Str(u64::from(h.payload_offset) * 512),
            size: SegmentSize::Dynamic,
            iv_tweak: Some(U64Str(0)),
            encryption: Some(encryption),
            sector_size: Some(512),
            flags: None,
            integrity: None,
            extra: Map::new(),
        },
    );
    let mut digests = std::collections::BTreeMap::new();
    digests.insert(
        "0".to_string(),
        DigestJson {
            kind: DigestKind::Pbkdf2,
            keyslots: active,
            segments: vec!["0".into()],
            hash: Some(h.hash_spec.clone()),
            iterations: Some(h.mk_digest_iterations),
            salt: Some(b64_encode(&h.mk_digest_salt)),
            digest: Some(b64_encode(&h.mk_digest)),
            extra: Map::new(),
        },
    );
    Metadata {
        keyslots,
        tokens: Default::default(),
        segments,
        digests,
        config: Config {
            json_size: U64Str(CONVERTED_HDR_BYTES - BIN_HDR_BYTES),
            keyslots_size: U64Str(keyslots_size),
            flags: None,
            requirements: None,
            extra: Map::new(),
        },
        extra: Map::new(),
    }
}

// ---------------------------------------------------------------- LUKS2 -> LUKS1

/// Splits a cipher spec into name and mode as cryptsetup's `crypt_parse_name_and_mode` does:
/// `name-mode`; a bare `plain` mode is `cbc-plain`; `null` is `cipher_null-ecb`; a name alone
/// gets `cbc-plain`. Each part fits LUKS1's 32-byte fields.
fn name_and_mode(spec: &str) -> Option<(String, String)> {
    const PART_BYTES_MAX: usize = 31;
    let spec = spec.split_whitespace().next()?;
    let (name, mode) = match spec.split_once('-') {
        Some((n, m)) if !n.is_empty() && !m.is_empty() => {
            (n, if m == "plain" { "cbc-plain" } else { m })
        }
        _ if spec == "null" || spec == "cipher_null" => ("cipher_null", "ecb"),
        Some((n, _)) if !n.is_empty() => (n, "cbc-plain"),
        None if !spec.is_empty() => (spec, "cbc-plain"),
        _ => return None,
    };
    (name.len() <= PART_BYTES_MAX && mode.len() <= PART_BYTES_MAX)
        .then(|| (name.to_string(), mode.to_string()))
}

/// Ciphers whose key is wrapped by hardware (s390's protected-key AES): LUKS1 has no place to
/// say so.
fn wrapped_key_cipher(name: &str) -> bool {
    name.starts_with("paes")
}

fn down(msg: impl std::fmt::Display) -> Error {
    refuse(format!("Cannot convert to LUKS1 format - {msg}"))
}

/// Whether LUKS2 keyslot `ks` says nothing a LUKS1 keyslot cannot (cryptsetup's checks).
fn keyslot_luks1_compatible(ks: &Keyslot, key_size: u32, hash: &str, data_cipher: &str) -> bool {
    let kdf_ok = ks.kdf.as_ref().is_some_and(|k| {
        k.kind == KdfKind::Pbkdf2
            && k.hash.as_deref() == Some(hash)
            && k.iterations.is_some_and(|n| n > 0)
            && b64_decode(&k.salt).is_some_and(|s| s.len() == SALT_BYTES)
    });
    let af_ok = ks
        .af
        .as_ref()
        .is_some_and(|a| a.stripes == AF_STRIPES && a.hash == hash);
    let area_ok = ks.area.as_ref().is_some_and(|a| {
        a.encryption.as_deref() == Some(data_cipher)
            && a.key_size == Some(key_size)
            && a.size.0 == af_area_bytes(key_size as usize, AF_STRIPES).div_ceil(4096) * 4096
    });
    ks.kind == KeyslotKind::Luks2 && ks.key_size == key_size && kdf_ok && af_ok && area_ok
}

/// The first gap of `len` bytes in the keyslots area not used by `taken` (cryptsetup's
/// `LUKS2_find_area_gap`).
fn find_area_gap(taken: &[(u64, u64)], start: u64, end: u64, len: u64) -> Option<u64> {
    let mut sorted = taken.to_vec();
    sorted.sort_unstable();
    let mut offset = start;
    for &(o, l) in &sorted {
        if offset < o && offset + len <= o {
            break;
        }
        offset = offset.max(o + l);
    }
    (offset + len <= end).then_some(offset)
}

fn luks2_to_luks1(
    h: &Luks2Header,
    read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<Conversion> {
    let meta = &h.meta;
    let digest = meta.digests.get("0").ok_or_else(|| down("no digest 0."))?;
    let segment = meta
        .segments
        .get("0")
        .ok_or_else(|| down("no segment 0."))?;
    if segment.sector_size != Some(512) {
        return Err(down(
            "default segment encryption sector size is not 512 bytes.",
        ));
    }
    if digest.kind != DigestKind::Pbkdf2 || meta.digests.len() != 1 {
        return Err(down("key slot digests are not LUKS1 compatible."));
    }
    let hash = digest.hash.clone().unwrap_or_default();
    let data_cipher = segment.encryption.clone().unwrap_or_default();
    let (cipher_name, _) =
        name_and_mode(&data_cipher).ok_or_else(|| down(format!("cipher '{data_cipher}'.")))?;
    if wrapped_key_cipher(&cipher_name) {
        return Err(down(format!(
            "device uses wrapped key cipher {cipher_name}."
        )));
    }
    if meta.segments.len() != 1 {
        return Err(down("device uses more segments."));
    }
    if !meta.tokens.is_empty() {
        return Err(down(format!(
            "LUKS2 header contains {} token(s).",
            meta.tokens.len()
        )));
    }
    let key_size = digest
        .keyslots
        .first()
        .and_then(|k| meta.keyslots.get(k))
        .map(|k| k.key_size)
        .filter(|&n| n > 0)
        .ok_or_else(|| down("no keyslot holds the volume key."))?;
    for (id, ks) in &meta.keyslots {
        let i: u32 = id.parse().map_err(|_| Error::Bug("validated keyslot id"))?;
        if i >= LUKS1_KEYSLOTS {
            return Err(down(format!(
                "slot {i} (over maximum slots) is still active."
            )));
        }
        if !keyslot_luks1_compatible(ks, key_size, &hash, &data_cipher) {
            return Err(down(format!("keyslot {i} is not LUKS1 compatible.")));
        }
    }
    let slots = luks1_slots(h, key_size)?;
    let (cipher_name, cipher_mode) =
        name_and_mode(&data_cipher).ok_or(Error::Bug("cipher parsed above"))?;
    let mk = digest
        .digest
        .as_deref()
        .and_then(b64_decode)
        .filter(|d| d.len() >= luks1::DIGEST_BYTES)
        .ok_or_else(|| down("the volume key digest is shorter than LUKS1's."))?;
    let mk_salt = digest
        .salt
        .as_deref()
        .and_then(b64_decode)
        .filter(|s| s.len() == SALT_BYTES)
        .ok_or_else(|| down("the volume key digest's salt is not 32 bytes."))?;
    let payload_offset = u32::try_from(segment.offset.0 / 512)
        .map_err(|_| down("the data offset is beyond LUKS1's reach."))?;
    let new = Luks1Header {
        cipher_name,
        cipher_mode,
        hash_spec: hash,
        payload_offset,
        key_bytes: key_size,
        mk_digest: mk[..luks1::DIGEST_BYTES]
            .try_into()
            .map_err(|_| Error::Bug("digest length checked"))?,
        mk_digest_salt: mk_salt
            .try_into()
            .map_err(|_| Error::Bug("salt length checked"))?,
        mk_digest_iterations: digest.iterations.unwrap_or(0),
        uuid: h.bin.uuid.chars().take(36).collect(),
        slots,
    };
    let mut phdr = new.encode()?;
    // What a reader will make of it, before anything is written (cryptsetup checks the
    // keyslots only after moving them).
    let check = Luks1Header::parse(&phdr).map_err(|e| down(format!("{e}")))?;
    if check != new {
        return Err(Error::Bug("LUKS1 header does not round-trip"));
    }
    // The whole LUKS2 keyslots area moves, wherever the header copies end.
    let from = LUKS2_KEYSLOTS_OFFSET_BYTES;
    let move_bytes = 2 * h.bin.hdr_size + meta.config.keyslots_size.0 - from;
    let moved = read(from, move_bytes)?;
    if moved.len() as u64 != move_bytes {
        return Err(Error::Bug("keyslot region read returned a short buffer"));
    }
    // The phdr and zeros to the first keyslot: nothing of the LUKS2 binary header is left.
    phdr.resize(LUKS1_KEYSLOTS_OFFSET_BYTES as usize, 0);
    let ops = vec![
        WriteOp::Write {
            offset: LUKS1_KEYSLOTS_OFFSET_BYTES,
            data: moved,
        },
        WriteOp::Sync,
        WriteOp::Write {
            offset: 0,
            data: phdr,
        },
        WriteOp::Sync,
    ];
    Ok(Conversion {
        header: Header::Luks1(new),
        ops,
        device_bytes_needed: from + move_bytes,
    })
}

/// The eight LUKS1 keyslots of a LUKS2 header that passed the compatibility checks: active
/// ones where their areas are, inactive ones in the first free gaps (in slot order).
fn luks1_slots(h: &Luks2Header, key_size: u32) -> Result<[Luks1Slot; luks1::KEYSLOTS]> {
    let meta = &h.meta;
    let start = 2 * h.bin.hdr_size;
    let end = start + meta.config.keyslots_size.0;
    let gap_bytes = af_area_bytes(key_size as usize, AF_STRIPES).div_ceil(4096) * 4096;
    let mut taken: Vec<(u64, u64)> = meta
        .keyslots
        .values()
        .filter_map(|k| k.area.as_ref())
        .map(|a| (a.offset.0, a.size.0))
        .collect();
    let mut slots = Vec::with_capacity(luks1::KEYSLOTS);
    for i in 0..LUKS1_KEYSLOTS {
        let ks = meta.keyslots.get(&i.to_string());
        let offset = match ks.and_then(|k| k.area.as_ref()) {
            Some(a) => a.offset.0,
            None => {
                let o = find_area_gap(&taken, start, end, gap_bytes).ok_or_else(|| {
                    down(format!(
                        "no room in the keyslots area for LUKS1 keyslot {i}."
                    ))
                })?;
                taken.push((o, gap_bytes));
                o
            }
        };
        if offset % 512 != 0 {
            return Err(down(format!(
                "keyslot {i} area offset {offset} is not in sectors."
            )));
        }
        let sector = (offset / 512)
            .checked_sub(AREA_SHIFT_BYTES / 512)
            .and_then(|s| u32::try_from(s).ok())
            .ok_or_else(|| down(format!("keyslot {i} area offset {offset}.")))?;
        let mut slot = Luks1Slot {
            active: false,
            iterations: 0,
            salt: [0u8; SALT_BYTES],
            key_material_offset: sector,
            stripes: AF_STRIPES,
        };
        if let Some(kdf) = ks.and_then(|k| k.kdf.as_ref()) {
            let salt = b64_decode(&kdf.salt).ok_or(Error::Bug("salt checked"))?;
            slot.active = true;
            slot.iterations = kdf.iterations.unwrap_or(0);
            slot.salt.copy_from_slice(&salt);
        }
        slots.push(slot);
    }
    slots.try_into().map_err(|_| Error::Bug("eight keyslots"))
}

#[cfg(test)]
#[path = "convert_tests.rs"]
mod tests;
