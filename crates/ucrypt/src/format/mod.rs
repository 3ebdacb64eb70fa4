//! Making a volume, in one call: cryptsetup's `luksFormat` decisions (data offset and its
//! alignment, the sector size cryptsetup picks, LUKS1 and LUKS2 layouts, authenticated
//! encryption with its dm-integrity superblock and journal) turned from a [`FormatRequest`]
//! into a [`FormatPlan`]: the writes of the new header with its first keyslot, the writes of
//! the dm-integrity area, and the volume key the header's digest accepts.
//!
//! [`plan`] does no I/O, as the header code it calls ([`luks2::format`], [`luks1::format`],
//! [`integrity::new_superblock`]) does none: the caller measured the device
//! ([`FormatRequest::data_bytes`]) and asked the passphrase. `driver` performs a plan:
//! [`write_header`] on the header device, then, for an authenticated volume,
//! [`write_integrity`] on the data device, which also wipes the data area through the
//! integrity layer so that every block's tag verifies.
//!
//! ```no_run
//! use std::sync::Arc;
//! use ucrypt::backend::{Backend, DirectMode, FileBackend};
//! use ucrypt::format::{plan, write_header, FormatRequest, LuksVersion};
//! use ucrypt::luks::random_secret;
//!
//! # fn main() -> ucrypt::Result<()> {
//! let dev: Arc<dyn Backend> = Arc::new(FileBackend::open("disk.img", true, DirectMode::Never)?);
//! let mut req = FormatRequest::new(LuksVersion::Luks2, "disk.img");
//! req.data_bytes = dev.size();
//! let key_bytes = req.check()?;
//! let p = plan(&req, b"passphrase", random_secret(key_bytes)?)?;
//! write_header(dev.as_ref(), &p)?;
//! # Ok(())
//! # }
//! ```

mod driver;
#[cfg(test)]
mod tests;

pub use driver::{write_header, write_integrity, IntegrityWipe, INTEGRITY_WIPE_CHUNK_BYTES};

use crate::integrity::{self, Layout, TagMode};
use crate::luks::json::SegmentKind;
use crate::luks::{self, luks1, luks2, Header, KdfRequest, NewKeyslot, VolumeKey, WriteOp};
use crate::sector::{CipherSpec, SectorSize};
use crate::{Error, Result, SecretBytes};

/// cryptsetup's default data alignment.
pub const DEFAULT_ALIGN_BYTES: u64 = 1 << 20;
/// cryptsetup's largest LUKS2 keyslots area (`LUKS2_MAX_KEYSLOTS_SIZE`).
pub const LUKS2_KEYSLOTS_BYTES_MAX: u64 = 128 << 20;

/// The LUKS version to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LuksVersion {
    Luks1,
    Luks2,
}

impl LuksVersion {
    /// 1 or 2, as [`Header::version`] says.
    pub fn number(self) -> u32 {
        match self {
            LuksVersion::Luks1 => 1,
            LuksVersion::Luks2 => 2,
        }
    }
}

/// The integrity type of an authenticated volume (cryptsetup's `--integrity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntegrityKind {
    /// The cipher is an AEAD (`aes-gcm-random`, `aes-ccm-random`).
    Aead,
    /// An AEAD too (`chacha20-random`, `chacha20-plain64`), named by its MAC as cryptsetup
    /// names it.
    Poly1305,
    /// A block cipher mode (`aes-xts-*`, `aes-cbc-*`) with an HMAC; its key follows the
    /// cipher's in the volume key.
    HmacSha1,
    HmacSha256,
    HmacSha512,
}

impl IntegrityKind {
    /// From cryptsetup's spellings: `aead`, `poly1305`, `hmac-sha1` or `hmac(sha1)`,
    /// `hmac-sha256` or `hmac(sha256)`, `hmac-sha512` or `hmac(sha512)`.
    pub fn from_name(s: &str) -> Option<IntegrityKind> {
        match s {
            "aead" => Some(IntegrityKind::Aead),
            "poly1305" => Some(IntegrityKind::Poly1305),
            "hmac-sha1" | "hmac(sha1)" => Some(IntegrityKind::HmacSha1),
            "hmac-sha256" | "hmac(sha256)" => Some(IntegrityKind::HmacSha256),
            "hmac-sha512" | "hmac(sha512)" => Some(IntegrityKind::HmacSha512),
            _ => None,
        }
    }

    /// The integrity type as LUKS2 writes it in the segment.
    pub fn luks2_name(self) -> &'static str {
        match self {
            IntegrityKind::Aead => "aead",
            IntegrityKind::Poly1305 => "poly1305",
            IntegrityKind::HmacSha1 => "hmac(sha1)",
            IntegrityKind::HmacSha256 => "hmac(sha256)",
            IntegrityKind::HmacSha512 => "hmac(sha512)",
        }
    }

    /// Bytes of the MAC key that follows the cipher's key in the volume key by default (0 for
    /// an AEAD): the hash's output size.
    pub fn mac_key_bytes(self) -> usize {
        match self {
            IntegrityKind::Aead | IntegrityKind::Poly1305 => 0,
            IntegrityKind::HmacSha1 => 20,
            IntegrityKind::HmacSha256 => 32,
            IntegrityKind::HmacSha512 => 64,
        }
    }
}

/// The cipher cryptsetup formats an authenticated volume with when `--cipher` is not given.
pub const INTEGRITY_DEFAULT_CIPHER: &str = "aes-xts-plain64";

/// The smallest HMAC key cryptsetup formats with (`LUKS2_MIN_INTEGRITY_KEY_BYTES`).
pub const INTEGRITY_KEY_BYTES_MIN: u32 = 16;

/// Authenticated encryption (dm-crypt over dm-integrity): the segment's cipher and its
/// integrity type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Integrity {
    pub kind: IntegrityKind,
    /// The segment's cipher as LUKS2 spells it (`aes-gcm-random`, `aes-xts-plain64`, ...):
    /// see [`TagMode::from_luks2`] for the combinations served.
    pub encryption: String,
    /// Format dm-integrity without the fixed-padding flag, as kernels before 5.7 did
    /// (cryptsetup's `--integrity-legacy-padding`): each area's tags padded to 128 KiB
    /// instead of 4 KiB, superblock version 1.
    pub legacy_padding: bool,
    /// The HMAC key's size in bits (cryptsetup 2.8's `--integrity-key-size`): recorded in the
    /// segment (`integrity.key_size`, bytes) and used instead of the hash's output size.
    /// `None`: the default, not recorded.
    pub mac_key_bits: Option<u32>,
}

impl Integrity {
    /// The MAC key's size in bytes when one was asked for, checked as cryptsetup 2.8 checks
    /// `--integrity-key-size`: a whole number of bytes, only for an HMAC, at least
    /// [`INTEGRITY_KEY_BYTES_MIN`].
    pub fn mac_key_size(&self) -> Result<Option<u32>> {
        let Some(bits) = self.mac_key_bits else {
            return Ok(None);
        };
        if bits == 0 || bits % 8 != 0 {
            return Err(Error::InvalidArgument(
                "Key size must be a multiple of 8 bits".into(),
            ));
        }
        if self.kind.mac_key_bytes() == 0 {
            return Err(Error::InvalidArgument(
                "No known integrity specification pattern detected.\n\
                 Cannot use specified integrity key size."
                    .into(),
            ));
        }
        if bits / 8 < INTEGRITY_KEY_BYTES_MIN {
            return Err(Error::InvalidArgument(
                "Integrity key size is too small.".into(),
            ));
        }
        Ok(Some(bits / 8))
    }

    /// The volume key's length for a cipher key of `key_bits`: the cipher's key, then the MAC
    /// key (the hash's output size, or [`Integrity::mac_key_bits`]), as cryptsetup lays it out.
    /// The default cipher key is cryptsetup's: 512 bits for an `xts-` mode, 256 for the others.
    /// Refuses a cipher, type or key size the integrity layer cannot serve.
    pub fn key_bytes(&self, key_bits: Option<u32>) -> Result<usize> {
        let xts = self
            .encryption
            .split('-')
            .nth(1)
            .is_some_and(|mode| mode == "xts");
        let bits = key_bits.unwrap_or(if xts { 512 } else { 256 });
        if bits % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "key size {bits} bits is not a multiple of 8"
            )));
        }
        let mac_key_bytes = self.mac_key_size()?.map(|b| b as usize);
        let key_bytes = bits as usize / 8 + mac_key_bytes.unwrap_or(self.kind.mac_key_bytes());
        TagMode::from_luks2_keyed(
            &self.encryption,
            self.kind.luks2_name(),
            key_bytes,
            mac_key_bytes,
        )?;
        Ok(key_bytes)
    }
}

/// What a new volume should be: cryptsetup's `luksFormat` options, parsed. Start from
/// [`FormatRequest::new`] (cryptsetup's defaults) and set what the caller was asked for.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct FormatRequest {
    pub version: LuksVersion,
    /// The data segment's cipher (not read with `integrity`, whose encryption replaces it).
    pub cipher: CipherSpec,
    /// The volume key's size in bits (cryptsetup's `--key-size`); `None`: the cipher's
    /// default. With `integrity`, the cipher's part of the key.
    pub key_bits: Option<u32>,
    /// Authenticated encryption (LUKS2 only).
    pub integrity: Option<Integrity>,
    /// `None`: as cryptsetup picks it (LUKS2: 4096 bytes when the data area's offset and size
    /// allow it, else 512; LUKS1: 512, its only size).
    pub sector_size: Option<SectorSize>,
    /// The data offset in 512-byte sectors (`--offset`); `None`: after the metadata, aligned.
    pub offset_sectors: Option<u64>,
    /// `--align-payload`: align the data offset to this many 512-byte sectors; with a
    /// detached header it is the data offset itself, as in cryptsetup.
    pub align_payload_sectors: Option<u64>,
    /// The object size of an RBD image: librbd's encryption aligns the data offset to it, and
    /// so does a format of such an image, to produce what librbd's own format would.
    pub object_bytes: Option<u64>,
    /// The header goes to a device of its own (`--header`).
    pub detached: bool,
    /// Size of the data device in bytes.
    pub data_bytes: u64,
    pub label: Option<String>,
    pub subsystem: Option<String>,
    /// `None`: a random UUID.
    pub uuid: Option<String>,
    /// The first keyslot's KDF (and whether the digest is calibrated).
    pub kdf: KdfRequest,
    /// The first keyslot's number; `None`: the first free one (0).
    pub key_slot: Option<u32>,
    /// LUKS2 header copy size in bytes (`--luks2-metadata-size`).
    pub luks2_metadata_bytes: Option<u64>,
    /// LUKS2 keyslots area size in bytes (`--luks2-keyslots-size`).
    pub luks2_keyslots_bytes: Option<u64>,
    /// LUKS2: the first keyslot's area encryption, a cipher and its key size in bytes
    /// (`--keyslot-cipher`, `--keyslot-key-size`); `None`: the data segment's.
    pub keyslot_area: Option<(CipherSpec, usize)>,
    /// How messages name the device.
    pub name: String,
}

impl FormatRequest {
    /// cryptsetup's defaults for `version`: aes-xts-plain64 with its default key, the
    /// version's default KDF, 1 MiB alignment, a random UUID. `data_bytes` is 0 until set.
    pub fn new(version: LuksVersion, name: impl Into<String>) -> FormatRequest {
        FormatRequest {
            version,
            cipher: CipherSpec::AES_XTS_PLAIN64,
            key_bits: None,
            integrity: None,
            sector_size: None,
            offset_sectors: None,
            align_payload_sectors: None,
            object_bytes: None,
            detached: false,
            data_bytes: 0,
            label: None,
            subsystem: None,
            uuid: None,
            kdf: match version {
                LuksVersion::Luks1 => KdfRequest::luks1_default(),
                LuksVersion::Luks2 => KdfRequest::luks2_default(),
            },
            key_slot: None,
            luks2_metadata_bytes: None,
            luks2_keyslots_bytes: None,
            keyslot_area: None,
            name: name.into(),
        }
    }

    /// What can be refused before a passphrase is asked: authenticated encryption on LUKS1, a
    /// key size the cipher (or the integrity layer) cannot take, a malformed UUID. Returns the
    /// volume key's length in bytes (to read a given key, or make a random one).
    pub fn check(&self) -> Result<usize> {
        let key_bytes = match &self.integrity {
            Some(_) if self.version == LuksVersion::Luks1 => {
                return Err(Error::InvalidArgument(
                    "authenticated encryption needs LUKS2".into(),
                ))
            }
            Some(i) => i.key_bytes(self.key_bits)?,
            None => {
                let key_bytes = match self.key_bits {
                    Some(bits) if bits % 8 == 0 => bits as usize / 8,
                    Some(bits) => {
                        return Err(Error::InvalidArgument(format!(
                            "key size {bits} bits is not a multiple of 8"
                        )))
                    }
                    None => self.cipher.default_key_bytes(),
                };
                self.cipher.check_key_len(key_bytes)?;
                key_bytes
            }
        };
        if let Some((cipher, bytes)) = self.keyslot_area {
            if self.version == LuksVersion::Luks1 {
                return Err(Error::InvalidArgument(
                    "Keyslot encryption parameters can be set only for LUKS2 device.".into(),
                ));
            }
            cipher.check_key_len(bytes)?;
        }
        if let Some(u) = &self.uuid {
            luks::check_uuid(u)?;
        }
        Ok(key_bytes)
    }

    /// What default data offsets are aligned to: `--align-payload`, else an RBD image's
    /// object size (at least [`DEFAULT_ALIGN_BYTES`]) when the offset is not given and the
    /// header is not detached, else [`DEFAULT_ALIGN_BYTES`].
    pub fn alignment(&self) -> Result<Alignment> {
        match self.object_bytes {
            _ if self.align_payload_sectors.is_some_and(|a| a > 0) => Ok(Alignment {
                bytes: self
                    .align_payload_sectors
                    .unwrap_or(0)
                    .checked_mul(512)
                    .ok_or_else(|| Error::InvalidArgument("--align-payload is too large".into()))?,
                by_object: false,
            }),
            Some(obj) if self.offset_sectors.is_none() && !self.detached => Ok(Alignment {
                bytes: obj.max(DEFAULT_ALIGN_BYTES),
                by_object: true,
            }),
            _ => Ok(Alignment {
                bytes: DEFAULT_ALIGN_BYTES,
                by_object: false,
            }),
        }
    }
}

/// The alignment of a default data offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alignment {
    pub bytes: u64,
    /// Chosen by an RBD image's object size (librbd's rule), not cryptsetup's default.
    pub by_object: bool,
}

/// A new volume, planned: what to write where, and its key.
pub struct FormatPlan {
    /// The new header with its first keyslot, for the header device, in order: the metadata
    /// area zeroed, the header, the keyslot.
    pub header_ops: Vec<WriteOp>,
    /// The header as written.
    pub header: Header,
    /// The keyslot the passphrase opens.
    pub keyslot: u32,
    /// The volume key, verified by the new header's digest.
    pub volume_key: VolumeKey,
    /// An authenticated volume's dm-integrity area.
    pub integrity: Option<IntegrityPlan>,
}

impl FormatPlan {
    /// Where the header plan ends: the size a new detached header file needs.
    pub fn header_end_bytes(&self) -> u64 {
        self.header_ops
            .iter()
            .map(|op| match op {
                WriteOp::Write { offset, data } => offset + data.len() as u64,
                WriteOp::Zero { offset, len } => offset + len,
                WriteOp::Sync => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

/// The dm-integrity device under an authenticated segment: its superblock as the kernel
/// would write it and its journal as the kernel initialises it (the kernel checks it on every
/// activation, also in direct mode).
pub struct IntegrityPlan {
    /// Where the superblock goes on the data device: the segment offset, bytes.
    pub start_bytes: u64,
    pub layout: Layout,
    /// The superblock, every journal section, then a sync; for the data device.
    pub ops: Vec<WriteOp>,
}

/// Plans the volume `req` asks for around `volume_key` (random, or given by the user), with
/// `passphrase` in its first keyslot. Sans I/O.
pub fn plan(req: &FormatRequest, passphrase: &[u8], volume_key: SecretBytes) -> Result<FormatPlan> {
    let key_bytes = req.check()?;
    if volume_key.len() != key_bytes {
        return Err(Error::InvalidArgument(format!(
            "a volume key of {} bytes for a {key_bytes}-byte key",
            volume_key.len()
        )));
    }
    let uuid = match &req.uuid {
        Some(u) => u.to_lowercase(),
        None => luks::random_uuid()?,
    };
    let align = req.alignment()?.bytes;
    let (header_ops, header, keyslot, volume_key) = match req.version {
        LuksVersion::Luks2 => plan_luks2(req, uuid, align, passphrase, volume_key)?,
        LuksVersion::Luks1 => plan_luks1(req, uuid, key_bytes, align, passphrase, volume_key)?,
    };
    let integrity = match &req.integrity {
        Some(i) => Some(plan_integrity(
            &header,
            &volume_key,
            req.data_bytes,
            !i.legacy_padding,
        )?),
        None => None,
    };
    Ok(FormatPlan {
        header_ops,
        header,
        keyslot,
        volume_key,
        integrity,
    })
}

type Planned = (Vec<WriteOp>, Header, u32, VolumeKey);

/// A new LUKS2 header with its first keyslot.
fn plan_luks2(
    req: &FormatRequest,
    uuid: String,
    align: u64,
    passphrase: &[u8],
    vk_secret: SecretBytes,
) -> Result<Planned> {
    let detached = req.detached;
    let mut ops: Vec<WriteOp> = Vec::new();
    let mut f = luks2::FormatLuks2::defaults(uuid);
    f.cipher = req.cipher;
    f.key_bytes = vk_secret.len();
    f.kdf = req.kdf.clone();
    f.label = req.label.clone().unwrap_or_default();
    f.subsystem = req.subsystem.clone().unwrap_or_default();
    f.detached = detached;
    f.integrity = match &req.integrity {
        Some(i) => Some(luks2::FormatIntegrity {
            encryption: i.encryption.clone(),
            kind: i.kind.luks2_name().into(),
            key_size: i.mac_key_size()?,
        }),
        None => None,
    };
    if let Some(h) = req.luks2_metadata_bytes {
        f.hdr_size = h;
    }
    // cryptsetup's LUKS2_generate_hdr: the keyslots area fills the room a given data offset
    // leaves after the two header copies (whole 4 KiB, at most 128 MiB); else 16 MiB in all.
    let default_keyslots = match req.offset_sectors {
        Some(s) if s > 0 => (s.saturating_mul(512).saturating_sub(2 * f.hdr_size) & !4095)
            .min(LUKS2_KEYSLOTS_BYTES_MAX),
        _ => (16u64 << 20) - 2 * f.hdr_size,
    };
    f.keyslots_size = req.luks2_keyslots_bytes.unwrap_or(default_keyslots);
    let metadata_end = 2 * f.hdr_size + f.keyslots_size;
    f.data_offset = match (req.offset_sectors, detached) {
        (Some(s), _) => s * 512,
        // With a detached header --align-payload is the data offset, as in cryptsetup.
        (None, true) => req.align_payload_sectors.unwrap_or(0) * 512,
        (None, false) => metadata_end.div_ceil(align) * align,
    };
    if !detached && f.data_offset < metadata_end {
        return Err(Error::InvalidArgument(format!(
            "data offset {} is inside the LUKS2 metadata ({metadata_end} bytes)",
            f.data_offset
        )));
    }
    let data_bytes = req.data_bytes.saturating_sub(f.data_offset);
    if data_bytes == 0 {
        return Err(Error::InvalidArgument(format!(
            "Device {} is too small. (LUKS2 requires at least {} bytes.)",
            req.name,
            f.data_offset + 4096
        )));
    }
    f.sector_size = match req.sector_size {
        Some(s) => s,
        // cryptsetup picks 4096 when the data area allows it.
        None if data_bytes % 4096 == 0 && f.data_offset % 4096 == 0 => SectorSize::S4096,
        None => SectorSize::S512,
    };
    let (mut hdr, vk) = luks2::format(&f, vk_secret)?;
    ops.push(WriteOp::Zero {
        offset: 0,
        len: metadata_end,
    });
    let area = req
        .keyslot_area
        .map(|(cipher, bytes)| hdr.keyslot_area(cipher, bytes))
        .transpose()?;
    let (slot, add) = hdr.add_keyslot_with_area(
        NewKeyslot {
            vk: &vk,
            passphrase,
            kdf: &req.kdf,
            slot: req.key_slot,
        },
        None,
        area,
    )?;
    ops.extend(add);
    Ok((ops, Header::Luks2(hdr), slot, vk))
}

/// A new LUKS1 header with its first keyslot.
fn plan_luks1(
    req: &FormatRequest,
    uuid: String,
    key_bytes: usize,
    align: u64,
    passphrase: &[u8],
    vk_secret: SecretBytes,
) -> Result<Planned> {
    if req.sector_size.is_some_and(|s| s.bytes() != 512) {
        return Err(Error::InvalidArgument(
            "LUKS1 supports only 512-byte sectors".into(),
        ));
    }
    let payload = match (req.offset_sectors, req.detached) {
        (Some(s), _) => {
            Some(u32::try_from(s).map_err(|_| Error::InvalidArgument("offset too large".into()))?)
        }
        (None, true) => Some(
            u32::try_from(req.align_payload_sectors.unwrap_or(0))
                .map_err(|_| Error::InvalidArgument("--align-payload is too large".into()))?,
        ),
        (None, false) => {
            let align = u32::try_from(align / 512)
                .map_err(|_| Error::InvalidArgument("alignment too large".into()))?;
            Some(luks1::keyslots_end_sectors(key_bytes).div_ceil(align) * align)
        }
    };
    let (mut hdr, vk) =
        luks1::format(req.cipher, req.kdf.hash, uuid, vk_secret, &req.kdf, payload)?;
    let payload_bytes = u64::from(hdr.payload_offset) * 512;
    if !req.detached && req.data_bytes <= payload_bytes {
        return Err(Error::InvalidArgument(format!(
            "Device {} is too small. (LUKS1 requires at least {} bytes.)",
            req.name,
            payload_bytes + 512
        )));
    }
    let mut ops = vec![
        WriteOp::Zero {
            offset: 0,
            len: Header::Luks1(hdr.clone()).metadata_area_bytes(),
        },
        WriteOp::Write {
            offset: 0,
            data: hdr.encode()?,
        },
    ];
    let (slot, add) = hdr.add_keyslot(NewKeyslot {
        vk: &vk,
        passphrase,
        kdf: &req.kdf,
        slot: req.key_slot,
    })?;
    ops.extend(add);
    Ok((ops, Header::Luks1(hdr), slot, vk))
}

/// The dm-integrity superblock and journal under the authenticated segment of the new header
/// `hdr`, on a data device of `data_bytes`: the kernel's parameters when it formats, with or
/// without its `fix_padding` option.
fn plan_integrity(
    hdr: &Header,
    vk: &VolumeKey,
    data_bytes: u64,
    fixed_padding: bool,
) -> Result<IntegrityPlan> {
    let Some(start) = integrity::superblock_offset(hdr) else {
        return Err(Error::Bug("formatted header has no authenticated segment"));
    };
    let seg = match hdr {
        Header::Luks2(h) => h
            .meta
            .segments
            .values()
            .find(|s| s.kind == SegmentKind::Crypt),
        Header::Luks1(_) => None,
    }
    .ok_or(Error::Bug("formatted header has no crypt segment"))?;
    let integ = seg
        .integrity
        .as_ref()
        .ok_or(Error::Bug("formatted segment has no integrity"))?;
    let mode = TagMode::from_luks2_keyed(
        seg.encryption.as_deref().unwrap_or(""),
        &integ.kind,
        vk.bytes().len(),
        integ.key_size.map(|b| b as usize),
    )?;
    let tag_bytes = u16::try_from(mode.tuple_bytes()).map_err(|_| Error::Bug("tag size"))?;
    let layout = integrity::new_superblock(
        tag_bytes,
        seg.sector_size.unwrap_or(512),
        start / 512,
        data_bytes / 512,
        fixed_padding,
    )?;
    let mut ops = vec![WriteOp::Write {
        offset: start,
        data: layout.sb.serialize().to_vec(),
    }];
    let journal_start = start + integrity::superblock::SB_SECTORS * 512;
    for i in 0..layout.sb.journal_sections {
        ops.push(WriteOp::Write {
            offset: journal_start + u64::from(i) * layout.journal_section_sectors * 512,
            data: integrity::format::initial_journal_section(&layout, i),
        });
    }
    ops.push(WriteOp::Sync);
    Ok(IntegrityPlan {
        start_bytes: start,
        layout,
        ops,
    })
}
