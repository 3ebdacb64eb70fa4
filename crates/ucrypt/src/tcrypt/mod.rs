//! TrueCrypt and VeraCrypt volumes (cryptsetup's TCRYPT), sans I/O: a 512-byte header is
//! decrypted with a key derived from the passphrase and keyfiles ([`decrypt_header`]), and the
//! result says where the data is and with which cipher and key ([`Header::mapping`]); the
//! small driver [`unlock`] reads the header copies from a backend.
//!
//! The on-disk facts (from cryptsetup's lib/tcrypt and TrueCrypt's format description): a
//! header is a 64-byte salt and 448 encrypted bytes; decrypted, they start with `TRUE` or
//! `VERA`, and carry big-endian fields, two CRC-32s and the 256-byte key area. Neither hash
//! nor cipher is written anywhere: every KDF and chain of the tables is tried
//! (`kdf::KDFS` × `algs::ALGS`, in cryptsetup's order) until the magic appears.
//!
//! Where the headers are: the volume's at byte 0, the hidden volume's at 64 KiB (TrueCrypt
//! before 6.0: 1536 bytes before the end), the backups 128 KiB and 64 KiB before the end, and
//! a system volume's in sector 62 of the drive.

mod algs;
mod kdf;

use std::fmt::Write as _;

pub use algs::{Algs, Chain, Cipher};

pub use kdf::{Hash, KEYFILE_BYTES_MAX};

use crate::backend::Backend;
use crate::sector::crc32;
use crate::sector::{
    BlockCipher, BlockCipher64, Cascade, CascadeChain, CipherSpec, Geometry, IvMode, Mode,
    SectorSize,
};
use crate::{Error, Result, SecretBytes};

/// Bytes of a header (salt and encrypted part).
pub const HEADER_BYTES: usize = 512;
const SALT_BYTES: usize = 64;
/// The hidden volume's header offset (TrueCrypt 6.0 and later, VeraCrypt).
pub const HIDDEN_HEADER_OFFSET: u64 = 65536;
/// The hidden volume's header before TrueCrypt 6.0: this many bytes before the end.
pub const HIDDEN_HEADER_FROM_END_OLD: u64 = 1536;
/// The backup headers: this many bytes before the end (normal, hidden).
pub const BACKUP_HEADER_FROM_END: u64 = 131072;
pub const BACKUP_HIDDEN_HEADER_FROM_END: u64 = 65536;
/// A system volume's header, in the drive's first track.
pub const SYSTEM_HEADER_OFFSET: u64 = 31744;
const SECTOR: u64 = 512;

/// What to look for, as cryptsetup's TCRYPT options say.
#[derive(Debug, Clone)]
pub struct Options {
    /// Try VeraCrypt's KDFs and magic too (cryptsetup's default; `--disable-veracrypt`).
    pub veracrypt: bool,
    /// VeraCrypt's PIM: only VeraCrypt KDFs, with the iterations it gives.
    pub pim: Option<u32>,
    /// The hidden volume's header (`--tcrypt-hidden`).
    pub hidden: bool,
    /// The system volume's header (`--tcrypt-system`).
    pub system: bool,
    /// The backup header (`--tcrypt-backup`).
    pub backup: bool,
    /// Only KDFs whose hash name contains this (`--hash`).
    pub hash: Option<String>,
    /// Only chains whose name contains this (`--cipher`).
    pub cipher: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            veracrypt: true,
            pim: None,
            hidden: false,
            system: false,
            backup: false,
            hash: None,
            cipher: None,
        }
    }
}

/// Where the header copies to try are, in order, on a device of `device_bytes`.
pub fn header_offsets(opts: &Options, device_bytes: u64) -> Vec<u64> {
    let from_end = |n: u64| device_bytes.checked_sub(n);
    if opts.system {
        return vec![SYSTEM_HEADER_OFFSET];
    }
    let offsets = match (opts.hidden, opts.backup) {
        (true, true) => vec![from_end(BACKUP_HIDDEN_HEADER_FROM_END)],
        (true, false) => vec![
            Some(HIDDEN_HEADER_OFFSET),
            from_end(HIDDEN_HEADER_FROM_END_OLD),
        ],
        (false, true) => vec![from_end(BACKUP_HEADER_FROM_END)],
        (false, false) => vec![Some(0)],
    };
    offsets.into_iter().flatten().collect()
}

/// TrueCrypt or VeraCrypt, as the magic says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    TrueCrypt,
    VeraCrypt,
}

/// A decrypted header: its fields, the KDF hash and chain that opened it, and the key area.
pub struct Header {
    pub flavour: Flavour,
    pub version: u16,
    pub version_tc: u16,
    pub hidden_volume_bytes: u64,
    pub volume_bytes: u64,
    /// Where the data starts, in bytes (512 when the header says 0, as TrueCrypt meant).
    pub mk_offset: u64,
    pub mk_size: u64,
    pub flags: u32,
    pub sector_bytes: u32,
    pub hash: Hash,
    pub algs: &'static Algs,
    /// Which header this is (hidden, system, ...), for the data layout.
    opts_hidden: bool,
    opts_system: bool,
    keys: SecretBytes,
}

impl std::fmt::Debug for Header {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tcrypt::Header")
            .field("flavour", &self.flavour)
            .field("version", &self.version)
            .field("chain", &self.algs.long_name)
            .field("mode", &self.algs.chain.name())
            .field("hash", &self.hash.name())
            .finish_non_exhaustive()
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Decrypted-header field offsets (within the 448 encrypted bytes).
mod field {
    pub const VERSION: usize = 4;
    pub const VERSION_TC: usize = 6;
    pub const KEYS_CRC: usize = 8;
    pub const HIDDEN_SIZE: usize = 28;
    pub const VOLUME_SIZE: usize = 36;
    pub const MK_OFFSET: usize = 44;
    pub const MK_SIZE: usize = 52;
    pub const FLAGS: usize = 60;
    pub const SECTOR_SIZE: usize = 64;
    pub const HEADER_CRC: usize = 188;
    pub const KEYS: usize = 192;
    pub const KEYS_BYTES: usize = 256;
}

fn no_header() -> Error {
    Error::NoFormatHeader
}

/// Decrypts one header copy (`raw`, 512 bytes) with the passphrase and keyfiles (each the
/// first [`KEYFILE_BYTES_MAX`] bytes of a keyfile), trying every KDF and chain the options
/// allow. A wrong passphrase is [`Error::NoFormatHeader`].
pub fn decrypt_header(
    raw: &[u8],
    passphrase: &[u8],
    keyfiles: &[SecretBytes],
    opts: &Options,
) -> Result<Header> {
    if raw.len() < HEADER_BYTES {
        return Err(Error::InvalidArgument(format!(
            "a TCRYPT header is {HEADER_BYTES} bytes, not {}",
            raw.len()
        )));
    }
    let pwd = kdf::password(passphrase, keyfiles, opts.veracrypt)?;
    let salt = &raw[..SALT_BYTES];
    let mut enc = [0u8; algs::HDR_BYTES];
    enc.copy_from_slice(&raw[SALT_BYTES..HEADER_BYTES]);
    let kdfs: Vec<&kdf::Kdf> = kdf::KDFS
        .iter()
        .filter(|k| {
            opts.hash
                .as_deref()
                .is_none_or(|h| k.hash.name().contains(h))
        })
        .filter(|k| opts.veracrypt || !k.veracrypt)
        .filter(|k| !(opts.veracrypt && opts.pim.is_some() && !k.veracrypt))
        .collect();
    let chains: Vec<&'static Algs> = algs::ALGS
        .iter()
        .filter(|a| {
            opts.cipher
                .as_deref()
                .is_none_or(|c| a.long_name.contains(c))
        })
        .collect();
    let candidates: Vec<(Hash, u32)> = kdfs
        .iter()
        .map(|k| {
            (
                k.hash,
                kdf::iterations(k, opts.pim.filter(|_| opts.veracrypt)),
            )
        })
        .collect();
    let veracrypt = opts.veracrypt;
    let try_key = |_c: usize, key: &[u8]| -> Option<(usize, SecretBytes)> {
        for (i, a) in chains.iter().enumerate() {
            let mut buf = SecretBytes::from_slice(&enc);
            let b: &mut [u8; algs::HDR_BYTES] = buf.as_mut().try_into().ok()?;
            if algs::decrypt_header(a, key, b).is_err() {
                continue;
            }
            if &b[..4] == b"TRUE" || (veracrypt && &b[..4] == b"VERA") {
                return Some((i, buf));
            }
        }
        None
    };
    let (c, (chain, plain)) =
        kdf::search(&candidates, pwd.as_ref(), salt, &try_key).ok_or_else(no_header)?;
    parse_decrypted(plain.as_ref(), candidates[c].0, chains[chain], opts)
}

/// The fields of a decrypted header, its checksums checked.
fn parse_decrypted(d: &[u8], hash: Hash, algs: &'static Algs, opts: &Options) -> Result<Header> {
    let version = be16(d, field::VERSION);
    let bad = |check: &'static str| Error::BadHeader {
        check,
        detail: "the TCRYPT header decrypted but its checksum does not match".into(),
    };
    if version > 3 && crc32::checksum(&d[..field::HEADER_CRC]) != be32(d, field::HEADER_CRC) {
        return Err(bad("header crc32"));
    }
    let keys = &d[field::KEYS..field::KEYS + field::KEYS_BYTES];
    if crc32::checksum(keys) != be32(d, field::KEYS_CRC) {
        return Err(bad("keys crc32"));
    }
    let mk_offset = match be64(d, field::MK_OFFSET) {
        0 => SECTOR,
        n => n,
    };
    let sector_bytes = match be32(d, field::SECTOR_SIZE) {
        0 => SECTOR as u32,
        n => n,
    };
    Ok(Header {
        flavour: if d[0] == b'T' {
            Flavour::TrueCrypt
        } else {
            Flavour::VeraCrypt
        },
        version,
        version_tc: be16(d, field::VERSION_TC),
        hidden_volume_bytes: be64(d, field::HIDDEN_SIZE),
        volume_bytes: be64(d, field::VOLUME_SIZE),
        mk_offset,
        mk_size: be64(d, field::MK_SIZE),
        flags: be32(d, field::FLAGS),
        sector_bytes,
        hash,
        algs,
        opts_hidden: opts.hidden,
        opts_system: opts.system,
        keys: SecretBytes::from_slice(keys),
    })
}

/// Where the data is and how it is encrypted: what a `Volume` needs.
pub struct Mapping {
    pub spec: CipherSpec,
    pub key: SecretBytes,
    pub geometry: Geometry,
    pub data_offset_bytes: u64,
    /// `None`: to the end of the device.
    pub size_bytes: Option<u64>,
}

impl Header {
    /// The volume key as cryptsetup reports it: each layer's dm-crypt key, outermost first.
    pub fn volume_key(&self) -> SecretBytes {
        let mut k = Vec::with_capacity(self.algs.chain_key_bytes);
        for layer in self.algs.layers {
            let mut part = algs::layer_key(layer, self.algs.chain, self.keys.as_ref());
            k.extend_from_slice(&part);
            zeroize::Zeroize::zeroize(&mut part);
        }
        SecretBytes::from_vec(k)
    }

    /// The data start in 512-byte sectors, as cryptsetup computes it; `device_bytes` is the
    /// size of the device the header was read from (old hidden volumes count from its end).
    pub fn data_offset_sectors(&self, device_bytes: u64) -> u64 {
        let old_hidden = || {
            device_bytes
                .saturating_sub(self.hidden_volume_bytes)
                .saturating_sub(HIDDEN_HEADER_FROM_END_OLD)
                / SECTOR
        };
        if self.opts_system {
            return self.mk_offset / SECTOR;
        }
        if self.algs.chain == Chain::Xts {
            if self.version < 3 {
                return 1;
            }
            if self.opts_hidden {
                return if self.version > 3 {
                    self.mk_offset / SECTOR
                } else {
                    old_hidden()
                };
            }
        } else if self.opts_hidden {
            return old_hidden();
        }
        self.mk_offset / SECTOR
    }

    /// dm-crypt's IV offset in 512-byte sectors.
    pub fn iv_offset_sectors(&self, device_bytes: u64) -> u64 {
        match self.algs.chain {
            Chain::Xts => self.data_offset_sectors(device_bytes),
            Chain::Lrw => 0,
            _ => self.mk_offset / SECTOR,
        }
    }

    /// The mapping of the data, for a device of `device_bytes` holding both header and data
    /// (a system volume: the whole drive image, mapped over the whole encrypted area).
    /// Refused as cryptsetup refuses: the `-tcrypt` legacy modes, a sector size not a
    /// multiple of 512; and kuznyechik, which no Debian kernel has.
    pub fn mapping(&self, device_bytes: u64) -> Result<Mapping> {
        if self.sector_bytes as u64 % SECTOR != 0 {
            return Err(Error::UnsupportedFormat(format!(
                "Activation is not supported for {} sector size.",
                self.sector_bytes
            )));
        }
        let spec = self.data_spec()?;
        let key = self.volume_key();
        spec.check_key_len(key.len())?;
        // A system volume is mapped, as cryptsetup maps it, from its data to the end of the
        // device (the whole-drive mapping), whatever size its header records.
        let size_sectors = if self.opts_system {
            0
        } else if self.opts_hidden {
            self.hidden_volume_bytes / SECTOR
        } else {
            self.volume_bytes / SECTOR
        };
        Ok(Mapping {
            spec,
            key,
            geometry: Geometry {
                sector_size: SectorSize::S512,
                iv_offset: self.iv_offset_sectors(device_bytes),
                iv_large_sectors: false,
            },
            data_offset_bytes: self.data_offset_sectors(device_bytes) * SECTOR,
            size_bytes: (size_sectors != 0).then_some(size_sectors * SECTOR),
        })
    }

    /// The data's cipher: XTS or LRW over one cipher or a cascade, or TrueCrypt's
    /// single-cipher CBC with dm-crypt's `tcw` IV (a 128-bit cipher, CAST5 or triple DES).
    fn data_spec(&self) -> Result<CipherSpec> {
        if matches!(self.algs.chain, Chain::CbciTcrypt | Chain::CbcTcrypt) {
            return Err(Error::UnsupportedFormat(
                "Kernel does not support activation for this TCRYPT legacy mode.".into(),
            ));
        }
        if self
            .algs
            .layers
            .iter()
            .any(|l| l.cipher == Cipher::Kuznyechik)
        {
            return Err(Error::UnsupportedFormat(
                "cipher kuznyechik is not supported by ucrypt (no Debian kernel has it)".into(),
            ));
        }
        let wide = |l: &algs::Layer| match l.cipher {
            Cipher::Wide(c) => Ok(c),
            _ => Err(Error::Bug("a 64-bit cipher in an XTS or LRW chain")),
        };
        let (chain, iv) = match (self.algs.chain, self.algs.layers) {
            (Chain::CbcTcw, [layer]) => {
                let mode = match layer.cipher {
                    Cipher::Wide(c) => Mode::Cbc(c),
                    Cipher::Cast5 => Mode::Cbc64(BlockCipher64::Cast5),
                    Cipher::Des3Ede => Mode::Cbc64(BlockCipher64::Des3Ede),
                    Cipher::BlowfishLe | Cipher::Kuznyechik => {
                        return Err(Error::Bug("a cbc-tcw chain of blowfish or kuznyechik"))
                    }
                };
                return Ok(CipherSpec {
                    mode,
                    iv: IvMode::Tcw,
                });
            }
            (Chain::Xts, _) => (CascadeChain::Xts, IvMode::Plain64),
            (Chain::Lrw, _) => (CascadeChain::Lrw, IvMode::Benbi),
            _ => return Err(Error::Bug("a TCRYPT chain without a data mapping")),
        };
        let ciphers = self
            .algs
            .layers
            .iter()
            .map(wide)
            .collect::<Result<Vec<BlockCipher>>>()?;
        let mode = match (chain, ciphers.as_slice()) {
            (CascadeChain::Xts, [c]) => Mode::Xts(*c),
            (CascadeChain::Lrw, [c]) => Mode::Lrw(*c),
            (_, cs) => Mode::Cascade(Cascade::new(chain, cs)?),
        };
        Ok(CipherSpec { mode, iv })
    }

    /// `cryptsetup tcryptDump`'s text for the device named `device`.
    pub fn dump(&self, device: &str) -> String {
        let mut s = String::new();
        let kind = match self.flavour {
            Flavour::TrueCrypt => "TCRYPT",
            Flavour::VeraCrypt => "VERACRYPT",
        };
        let _ = writeln!(s, "{kind} header information for {device}");
        let _ = writeln!(s, "Version:       \t{}", self.version);
        let _ = writeln!(
            s,
            "Driver req.:\t{:x}.{:x}",
            self.version_tc >> 8,
            self.version_tc & 0xff
        );
        let _ = writeln!(s, "Flags:       \t0x{:x}", self.flags);
        let _ = writeln!(s, "Sector size:\t{} [bytes]", self.sector_bytes);
        let _ = writeln!(s, "MK offset:\t{} [bytes]", self.mk_offset);
        if self.volume_bytes != 0 {
            let _ = writeln!(s, "Volume size:\t{} [bytes]", self.volume_bytes);
        }
        if self.hidden_volume_bytes != 0 {
            let _ = writeln!(s, "Hidden size:\t{} [bytes]", self.hidden_volume_bytes);
        }
        let _ = writeln!(s, "PBKDF2 hash:\t{}", self.hash.name());
        let _ = writeln!(s, "Cipher chain:\t{}", self.algs.long_name);
        let _ = writeln!(s, "Cipher mode:\t{}", self.algs.chain.name());
        let _ = writeln!(s, "MK bits:       \t{}", self.algs.chain_key_bytes * 8);
        s
    }

    /// `tcryptDump --dump-volume-key`'s text.
    pub fn dump_volume_key(&self, device: &str, device_bytes: u64) -> String {
        let vk = self.volume_key();
        let mut s = String::new();
        let _ = writeln!(s, "TCRYPT header information for {device}");
        let _ = writeln!(s, "Cipher chain:  \t{}", self.algs.long_name);
        let _ = writeln!(s, "Cipher mode:   \t{}", self.algs.chain.name());
        let _ = writeln!(
            s,
            "Payload offset:\t{}",
            self.data_offset_sectors(device_bytes)
        );
        let _ = writeln!(s, "MK bits:       \t{}", vk.len() * 8);
        s.push_str("MK dump:\t");
        for (i, chunk) in vk.as_ref().chunks(16).enumerate() {
            if i > 0 {
                s.push_str("\n\t\t");
            }
            let hex: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
            s.push_str(&hex.join(" "));
        }
        s.push('\n');
        s
    }
}

/// Reads the header copies the options name from `dev` and decrypts the first that opens.
pub fn unlock(
    dev: &dyn Backend,
    passphrase: &[u8],
    keyfiles: &[SecretBytes],
    opts: &Options,
) -> Result<Header> {
    let size = dev.size();
    let mut last = no_header();
    for off in header_offsets(opts, size) {
        if off
            .checked_add(HEADER_BYTES as u64)
            .is_none_or(|end| end > size)
        {
            continue;
        }
        let mut raw = [0u8; HEADER_BYTES];
        dev.read_exact_at(&mut raw, off)?;
        match decrypt_header(&raw, passphrase, keyfiles, opts) {
            Ok(h) => return Ok(h),
            Err(e) => last = e,
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests;
