//! BitLocker volumes (cryptsetup's BITLK), sans I/O: the boot sector, the FVE metadata and its
//! entries parsed into [`Metadata`]; the volume key (FVEK) unlocked from a passphrase, a
//! recovery passphrase or a startup key (`keys.rs`); the plaintext layout as cryptsetup maps
//! it (`layout.rs`). [`read_metadata`] is the small driver that reads the bytes from a
//! backend.
//!
//! What cryptsetup reads is read here, and what it refuses is refused with its words: BitLocker
//! version 1 (Vista), encrypt-on-write volumes and volumes in conversion (the FVE state), a
//! volume with a clear-key VMK (partially decrypted), encryption types other than AES-CBC
//! (with or without the Elephant diffuser) and AES-XTS. Every loop over metadata entries is
//! bounded by the entry area's length (each entry is at least one header long), so hostile
//! metadata ends in a typed error, never a panic or a hang.

mod entries;
mod keys;
mod layout;
#[cfg(test)]
mod tests;

pub use keys::{recovery_key, unlock};
pub use layout::{segments, Segment, SegmentKind};

use crate::backend::Backend;
use crate::sector::{CipherSpec, SectorSize};
use crate::{Error, Result};

use entries::parse_entries;

/// Bytes read from the start of the volume: the boot sector with the signature and the
/// metadata offsets (at 160, or 424 for BitLocker To Go).
pub const BOOT_SECTOR_BYTES: usize = 512;
/// Bytes of each of the three FVE metadata areas (cryptsetup maps each as zeros).
pub const FVE_METADATA_AREA_BYTES: u64 = 64 * 1024;
/// The FVE block header and the metadata header before the entries.
const FVE_BLOCK_HEADER_BYTES: usize = 64;
const FVE_HEADER_BYTES: usize = 48;
/// Bytes of the FVE metadata to read at the first metadata offset: both headers and the
/// largest entry area cryptsetup accepts.
pub const FVE_READ_BYTES: usize = FVE_BLOCK_HEADER_BYTES + FVE_METADATA_AREA_BYTES as usize;

const SIGNATURE: &[u8; 8] = b"-FVE-FS-";
const SIGNATURE_TOGO: &[u8; 8] = b"MSWIN4.1";
const BOOTCODE_V1: &[u8; 3] = b"\xeb\x52\x90";
const BOOTCODE_V2: &[u8; 3] = b"\xeb\x58\x90";
const METADATA_OFFSET: usize = 160;
const METADATA_OFFSET_TOGO: usize = 424;
/// The FVE state of a volume neither being encrypted nor decrypted.
const STATE_NORMAL: u16 = 0x0004;
const GUID_NORMAL: [u8; 16] = [
    0x3b, 0xd6, 0x67, 0x49, 0x29, 0x2e, 0xd8, 0x4a, 0x83, 0x99, 0xf6, 0xa3, 0x39, 0xe3, 0xd0, 0x01,
];
const GUID_EOW: [u8; 16] = [
    0x3b, 0x4d, 0xa8, 0x92, 0x80, 0xdd, 0x0e, 0x4d, 0x9e, 0x4e, 0xb1, 0xe3, 0x28, 0x4e, 0xae, 0xd8,
];
/// January 1, 1970 as a Windows FILETIME (100 ns units since 1601).
const EPOCH_AS_FILETIME: u64 = 116_444_736_000_000_000;

/// Why BitLocker metadata was not read or a key not unlocked: the typed reasons, turned into
/// [`Error`] at the module's public functions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BitlkError {
    /// The bytes are not what the format says: which check, and what was found.
    #[error("BITLK metadata check '{check}' failed: {detail}")]
    Malformed { check: &'static str, detail: String },
    /// Something cryptsetup refuses, with its message.
    #[error("{0}")]
    Refused(String),
    /// No key source opened any VMK, or the FVEK did not decrypt.
    #[error("No key available with this passphrase.")]
    WrongKey,
}

impl From<BitlkError> for Error {
    fn from(e: BitlkError) -> Error {
        match e {
            BitlkError::Malformed { check, detail } => Error::BadHeader { check, detail },
            BitlkError::Refused(m) => Error::UnsupportedFormat(m),
            BitlkError::WrongKey => Error::WrongPassphrase,
        }
    }
}

pub(crate) fn malformed(check: &'static str, detail: impl Into<String>) -> BitlkError {
    BitlkError::Malformed {
        check,
        detail: detail.into(),
    }
}

/// The volume type from the boot sector's GUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeType {
    Normal,
    /// Encrypt-on-write (used space only, being encrypted as it is written).
    EncryptOnWrite,
    Unknown,
}

impl VolumeType {
    /// cryptsetup's name.
    pub fn name(self) -> &'static str {
        match self {
            VolumeType::Normal => "normal",
            VolumeType::EncryptOnWrite => "encrypt-on-write",
            VolumeType::Unknown => "unknown",
        }
    }
}

/// How a VMK is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    ClearKey,
    Tpm,
    StartupKey,
    TpmPin,
    RecoveryPassphrase,
    Passphrase,
    SmartCard,
    Unknown,
}

impl Protection {
    fn from_raw(v: u16) -> Protection {
        match v {
            0x0000 => Protection::ClearKey,
            0x0100 => Protection::Tpm,
            0x0200 => Protection::StartupKey,
            0x0500 => Protection::TpmPin,
            0x0800 => Protection::RecoveryPassphrase,
            0x1000 => Protection::SmartCard,
            0x2000 => Protection::Passphrase,
            _ => Protection::Unknown,
        }
    }

    /// cryptsetup's `bitlkDump` wording.
    pub fn describe(self) -> &'static str {
        match self {
            Protection::ClearKey => "VMK protected with clear key",
            Protection::Tpm => "VMK protected with TPM",
            Protection::StartupKey => "VMK protected with startup key",
            Protection::TpmPin => "VMK protected with TPM and PIN",
            Protection::Passphrase => "VMK protected with passphrase",
            Protection::RecoveryPassphrase => "VMK protected with recovery passphrase",
            Protection::SmartCard => "VMK protected with smart card",
            Protection::Unknown => "VMK with unknown protection",
        }
    }

    /// Whether a key source here can open it (cryptsetup's "supported" VMKs).
    pub fn supported(self) -> bool {
        matches!(
            self,
            Protection::Passphrase | Protection::RecoveryPassphrase | Protection::StartupKey
        )
    }
}

/// A key encrypted with AES-CCM (a VMK under its stretched key, the FVEK under the VMK).
#[derive(Clone, PartialEq, Eq)]
pub struct CcmKey {
    pub nonce: [u8; entries::NONCE_BYTES],
    pub tag: [u8; entries::TAG_BYTES],
    pub ciphertext: Vec<u8>,
}

impl std::fmt::Debug for CcmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CcmKey")
            .field("bytes", &self.ciphertext.len())
            .finish_non_exhaustive()
    }
}

/// One Volume Master Key entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vmk {
    pub guid: String,
    /// The VMK's name (its first string property), if any.
    pub name: Option<String>,
    pub protection: Protection,
    /// The stretch key's salt (zeros when the VMK has no stretch key).
    pub salt: [u8; 16],
    /// The encrypted keys of this VMK, in metadata order (normally one).
    pub keys: Vec<CcmKey>,
}

/// The encryption of the data, from the metadata's encryption type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encryption {
    /// AES-CBC with the Elephant diffuser; 128 or 256-bit AES.
    CbcElephant { aes_bits: u16 },
    /// AES-CBC with the eboiv IV.
    Cbc { aes_bits: u16 },
    /// AES-XTS with plain64.
    Xts { aes_bits: u16 },
}

impl Encryption {
    fn from_raw(v: u16) -> std::result::Result<Encryption, BitlkError> {
        Ok(match v {
            0x8000 => Encryption::CbcElephant { aes_bits: 128 },
            0x8001 => Encryption::CbcElephant { aes_bits: 256 },
            0x8002 => Encryption::Cbc { aes_bits: 128 },
            0x8003 => Encryption::Cbc { aes_bits: 256 },
            0x8004 => Encryption::Xts { aes_bits: 128 },
            0x8005 => Encryption::Xts { aes_bits: 256 },
            _ => {
                return Err(BitlkError::Refused(
                    "Unknown or unsupported encryption type.".into(),
                ))
            }
        })
    }

    /// cryptsetup's cipher mode name.
    pub fn mode_name(self) -> &'static str {
        match self {
            Encryption::CbcElephant { .. } => "cbc-elephant",
            Encryption::Cbc { .. } => "cbc-eboiv",
            Encryption::Xts { .. } => "xts-plain64",
        }
    }

    /// The volume key size cryptsetup reports, bits (XTS and Elephant: both halves).
    pub fn key_bits(self) -> u16 {
        match self {
            Encryption::Cbc { aes_bits } => aes_bits,
            Encryption::CbcElephant { aes_bits } | Encryption::Xts { aes_bits } => aes_bits * 2,
        }
    }

    /// The dm-crypt cipher spec of the data.
    pub fn cipher_spec(self) -> Result<CipherSpec> {
        format!("aes-{}", self.mode_name()).parse()
    }
}

/// Everything `bitlkDump` shows and an open needs, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    /// BitLocker To Go (the FAT-looking boot sector).
    pub togo: bool,
    pub sector_size: SectorSize,
    pub volume_type: VolumeType,
    /// The three FVE metadata areas, bytes from the start of the volume.
    pub metadata_offsets: [u64; 3],
    /// The FVE state is normal (not being encrypted or decrypted).
    pub state_normal: bool,
    pub volume_size_bytes: u64,
    pub version: u16,
    pub encryption: Encryption,
    pub guid: String,
    /// Seconds since the Unix epoch.
    pub creation_time: i64,
    pub description: Option<String>,
    /// Where the first sectors of the volume live (encrypted), and how many bytes.
    pub volume_header_offset: u64,
    pub volume_header_bytes: u64,
    pub vmks: Vec<Vmk>,
    pub fvek: CcmKey,
}

pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// A GUID as text, its first three fields little-endian (Microsoft's layout).
pub(crate) fn guid_string(g: &[u8]) -> String {
    format!(
        "{:08x}-{:04x}-{:04x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        le32(g, 0),
        le16(g, 4),
        le16(g, 6),
        g[8],
        g[9],
        g[10],
        g[11],
        g[12],
        g[13],
        g[14],
        g[15]
    )
}

/// What the boot sector says: the signature, the sector size, the type and where the
/// metadata is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootSector {
    pub togo: bool,
    pub sector_size: SectorSize,
    pub volume_type: VolumeType,
    pub metadata_offsets: [u64; 3],
}

/// Parses the first [`BOOT_SECTOR_BYTES`] of the volume.
pub fn parse_boot_sector(b: &[u8]) -> std::result::Result<BootSector, BitlkError> {
    if b.len() < BOOT_SECTOR_BYTES {
        return Err(malformed(
            "boot sector",
            format!("{} bytes, fewer than {BOOT_SECTOR_BYTES}", b.len()),
        ));
    }
    let (togo, fve_at) = match &b[3..11] {
        s if s == SIGNATURE => (false, METADATA_OFFSET),
        s if s == SIGNATURE_TOGO => (true, METADATA_OFFSET_TOGO),
        _ => return Err(malformed("signature", "no BitLocker signature")),
    };
    if &b[..3] == BOOTCODE_V1 {
        return Err(BitlkError::Refused(
            "BITLK version 1 is currently not supported.".into(),
        ));
    }
    if &b[..3] != BOOTCODE_V2 {
        return Err(BitlkError::Refused(
            "Invalid or unknown boot signature for BITLK device.".into(),
        ));
    }
    let sector_size = match le16(b, 11) {
        0 | 512 => SectorSize::S512,
        4096 => SectorSize::S4096,
        n => return Err(BitlkError::Refused(format!("Unsupported sector size {n}."))),
    };
    let guid: [u8; 16] = b[fve_at..fve_at + 16]
        .try_into()
        .map_err(|_| malformed("boot sector", "GUID"))?;
    let volume_type = match guid {
        GUID_NORMAL => VolumeType::Normal,
        GUID_EOW => VolumeType::EncryptOnWrite,
        _ => VolumeType::Unknown,
    };
    let mut metadata_offsets = [0u64; 3];
    for (i, o) in metadata_offsets.iter_mut().enumerate() {
        *o = le64(b, fve_at + 16 + 8 * i);
    }
    Ok(BootSector {
        togo,
        sector_size,
        volume_type,
        metadata_offsets,
    })
}

/// Parses the FVE metadata read at the first metadata offset (`fve`: up to [`FVE_READ_BYTES`];
/// fewer when the volume ends sooner).
pub fn parse_metadata(boot: &BootSector, fve: &[u8]) -> std::result::Result<Metadata, BitlkError> {
    let headers = FVE_BLOCK_HEADER_BYTES + FVE_HEADER_BYTES;
    let failed = || BitlkError::Refused("Failed to read BITLK FVE metadata.".into());
    if fve.len() < headers || &fve[..8] != SIGNATURE || le16(fve, 10) != 2 {
        return Err(failed());
    }
    let state_normal = le16(fve, 12) == STATE_NORMAL && le16(fve, 14) == STATE_NORMAL;
    let volume_size_bytes = le64(fve, 16);
    let version = le16(fve, 10);
    let h = FVE_BLOCK_HEADER_BYTES;
    let encryption = Encryption::from_raw(le16(fve, h + 36))?;
    let guid = guid_string(&fve[h + 16..h + 32]);
    let filetime = le64(fve, h + 40);
    // cryptsetup subtracts in unsigned arithmetic; a time before 1970 wraps the same way there.
    let creation_time = (filetime.wrapping_sub(EPOCH_AS_FILETIME) / 10_000_000) as i64;
    let metadata_size = le32(fve, h) as usize;
    if metadata_size < FVE_HEADER_BYTES + 4 || metadata_size > FVE_METADATA_AREA_BYTES as usize {
        return Err(malformed(
            "metadata size",
            format!("{metadata_size} bytes, not within 52..=65536"),
        ));
    }
    let entries_len = metadata_size - FVE_HEADER_BYTES;
    let area = fve
        .get(headers..headers + entries_len)
        .ok_or_else(|| BitlkError::Refused("Failed to read BITLK metadata entries.".into()))?;
    let e = parse_entries(area)?;
    let fvek = e
        .fvek
        .ok_or_else(|| malformed("FVEK", "no FVEK entry in the metadata"))?;
    Ok(Metadata {
        togo: boot.togo,
        sector_size: boot.sector_size,
        volume_type: boot.volume_type,
        metadata_offsets: boot.metadata_offsets,
        state_normal,
        volume_size_bytes,
        version,
        encryption,
        guid,
        creation_time,
        description: e.description,
        volume_header_offset: e.volume_header_offset,
        volume_header_bytes: e.volume_header_bytes,
        vmks: e.vmks,
        fvek,
    })
}

impl Metadata {
    /// What cryptsetup checks before it activates: the state, the type, no clear key.
    pub fn check_activation(&self) -> std::result::Result<(), BitlkError> {
        if !self.state_normal {
            return Err(BitlkError::Refused(
                "This BITLK device is in an unsupported state and cannot be activated.".into(),
            ));
        }
        if self.volume_type != VolumeType::Normal {
            return Err(BitlkError::Refused(format!(
                "BITLK devices with type '{}' cannot be activated.",
                self.volume_type.name()
            )));
        }
        if self
            .vmks
            .iter()
            .any(|v| v.protection == Protection::ClearKey)
        {
            return Err(BitlkError::Refused(
                "Activation of partially decrypted BITLK device is not supported.".into(),
            ));
        }
        Ok(())
    }
}

/// Reads and parses the metadata of the BitLocker volume on `dev`.
pub fn read_metadata(dev: &dyn Backend) -> Result<Metadata> {
    let mut boot = vec![0u8; BOOT_SECTOR_BYTES];
    if dev.size() < BOOT_SECTOR_BYTES as u64 {
        return Err(malformed(
            "device size",
            format!("{} bytes, fewer than a boot sector", dev.size()),
        )
        .into());
    }
    dev.read_exact_at(&mut boot, 0)?;
    let bs = parse_boot_sector(&boot)?;
    let at = bs.metadata_offsets[0];
    let avail = dev.size().saturating_sub(at).min(FVE_READ_BYTES as u64) as usize;
    // Backends take whole logical blocks: read the aligned span around it.
    let block = u64::from(dev.logical_block_bytes().max(1));
    let start = at / block * block;
    let end = (at + avail as u64).div_ceil(block) * block;
    let end = end.min(dev.size() / block * block).max(start);
    let mut buf = vec![0u8; (end - start) as usize];
    dev.read_exact_at(&mut buf, start)?;
    let skip = ((at - start) as usize).min(buf.len());
    let fve = &buf[skip..(skip + avail).min(buf.len())];
    Ok(parse_metadata(&bs, fve)?)
}
