//! FileVault2 volumes (Apple Core Storage, cryptsetup's FVAULT2), sans I/O: the metadata is
//! parsed from bytes handed in ([`VolumeHeader::parse`], [`DiskLabel::parse`],
//! [`Metadata::parse_block`]), the volume key is derived from a passphrase
//! ([`Params::volume_key`]), and [`Params::mapping`] says where the data is and how it is
//! encrypted. The small driver [`read_params`] performs the reads against a backend.
//!
//! The on-disk facts (from cryptsetup's lib/fvault2): a 512-byte physical volume header at
//! byte 0 (CRC-32C, version 1, magic `CS`) gives the block size, the disk label's block and
//! the first half of the metadata's AES-XTS key (the second half is the physical volume UUID).
//! The disk label (an 8 KiB block) points at the volume groups descriptor, which says where
//! the encrypted metadata blocks are and how many. Each 8 KiB metadata block is AES-128-XTS
//! encrypted with its index as the tweak and carries a CRC-32C; three kinds are read: 0x0019
//! (an XML plist with the passphrase-wrapped KEK and the KEK-wrapped volume key), 0x001A
//! (a plist with the logical volume's size and family UUID) and 0x0305 (the logical volume's
//! block). The data is AES-XTS-plain64 with a 256-bit key: the unwrapped 128-bit key, then
//! the first half of SHA-256(key || family UUID).
//!
//! Hostile metadata: every offset is bounded by [`OFFSET_MAX`] (cryptsetup's limit), the block
//! loop by [`MD_BLOCKS_MAX`], every field read is range-checked, and a missing plist key or a
//! wrong-sized structure is an error naming the check.

mod plist;
#[cfg(test)]
mod tests;

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use crate::backend::Backend;
use crate::luks::util::uuid_text;
use crate::sector::block::Ecb;
use crate::sector::crc32;
use crate::sector::modes::gf128_mul_x;
use crate::sector::{BlockCipher, CipherSpec, Geometry, SectorSize};
use crate::tcrypt::Mapping;
use crate::{Error, Result, SecretBytes};

/// Bytes of the physical volume header.
pub const VOLUME_HEADER_BYTES: usize = 512;
/// Bytes of a metadata block (the disk label, each encrypted block).
pub const MD_BLOCK_BYTES: usize = 8192;
/// No metadata is read beyond this byte offset (cryptsetup's bound).
pub const OFFSET_MAX: u64 = 1 << 30;
/// The most encrypted metadata blocks read: all that fit below [`OFFSET_MAX`].
pub const MD_BLOCKS_MAX: u64 = OFFSET_MAX / MD_BLOCK_BYTES as u64;
/// Bytes of the volume groups descriptor read at the disk label's offset.
pub const VOL_GROUPS_DESCRIPTOR_BYTES: usize = 40;
/// Bytes of the PBKDF2 salt.
pub const SALT_BYTES: usize = 16;
/// Bytes of the volume key (AES-128-XTS: two 128-bit keys).
pub const VOLUME_KEY_BYTES: usize = 32;
const AES_KEY_BYTES: usize = 16;
const WRAPPED_KEY_BYTES: usize = 24;
/// Decoded sizes of the plist's PassphraseWrappedKEKStruct and KEKWrappedVolumeKeyStruct.
const PWK_BYTES: usize = 284;
const KWVK_BYTES: usize = 256;
const CORE_STORAGE_MAGIC: [u8; 2] = *b"CS";
const SECTOR: u64 = 512;

/// Which check of the metadata failed (bad data from the device).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Fewer bytes than the structure needs.
    Truncated(&'static str),
    /// A CRC-32C that does not match (or a seed other than 0xffffffff).
    Crc(&'static str),
    UnsupportedVersion(u16),
    Magic,
    /// The header's metadata key is not 128-bit.
    KeySize(u32),
    /// A block offset or count that overflows or points beyond [`OFFSET_MAX`].
    Offset(&'static str),
    /// A plist key not found, or its value malformed.
    Plist(&'static str),
    /// A decoded structure of the wrong size.
    StructSize(&'static str),
    /// A metadata block kind the volume needs is missing.
    Missing(&'static str),
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Truncated(what) => write!(f, "{what} is truncated"),
            Fault::Crc(what) => write!(f, "{what}: CRC mismatch"),
            Fault::UnsupportedVersion(v) => write!(f, "Unsupported FVAULT2 version {v}."),
            Fault::Magic => f.write_str("invalid Core Storage magic"),
            Fault::KeySize(n) => write!(f, "unsupported AES key size: {n} bytes"),
            Fault::Offset(what) => write!(f, "{what}: device offset overflow"),
            Fault::Plist(what) => write!(f, "plist: {what} not found or malformed"),
            Fault::StructSize(what) => write!(f, "{what} has the wrong size"),
            Fault::Missing(what) => write!(f, "necessary metadata block {what} not found"),
        }
    }
}

impl From<Fault> for Error {
    fn from(f: Fault) -> Self {
        Error::UnsupportedFormat(format!("FVAULT2 metadata: {f}"))
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}
fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// CRC-32C (Castagnoli, reflected 0x82F63B78) as a raw register update, no inversions: the
/// checksum cryptsetup's `crypt_crc32c(0xffffffff, ...)` gives.
fn crc32c(crc: u32, data: &[u8]) -> u32 {
    static TABLE: [u32; 256] = crc32::table(0x82F6_3B78);
    crc32::update_with(&TABLE, crc, data)
}

/// A block that starts with Core Storage's checksum: value, then seed (0xffffffff), then the
/// checksummed bytes.
fn check_crc(block: &[u8], what: &'static str) -> std::result::Result<(), Fault> {
    if block.len() < 8 {
        return Err(Fault::Truncated(what));
    }
    let (value, seed) = (le32(block, 0), le32(block, 4));
    if seed != 0xffff_ffff || crc32c(seed, &block[8..]) != value {
        return Err(Fault::Crc(what));
    }
    Ok(())
}

/// A UUID in its text form (libuuid's `uuid_parse`: exactly 36 characters, dashes at 8, 13,
/// 18 and 23, hex digits elsewhere).
fn uuid_parse(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    let mut n = 0;
    let mut i = 0;
    while i < 36 {
        if matches!(i, 8 | 13 | 18 | 23) {
            if b[i] != b'-' {
                return None;
            }
            i += 1;
            continue;
        }
        let hi = (b[i] as char).to_digit(16)?;
        let lo = (b[i + 1] as char).to_digit(16)?;
        out[n] = (hi << 4 | lo) as u8;
        n += 1;
        i += 2;
    }
    Some(out)
}

/// The physical volume header's fields ucrypt uses.
pub struct VolumeHeader {
    pub block_bytes: u32,
    pub disklabel_block: u64,
    pub physical_volume_uuid: [u8; 16],
    /// The encrypted metadata's AES-XTS key: the header's key data, then the PV UUID.
    metadata_key: SecretBytes,
}

impl VolumeHeader {
    /// Parses and checks the first [`VOLUME_HEADER_BYTES`] of the device.
    pub fn parse(b: &[u8]) -> std::result::Result<Self, Fault> {
        let b = b
            .get(..VOLUME_HEADER_BYTES)
            .ok_or(Fault::Truncated("volume header"))?;
        check_crc(b, "volume header")?;
        let version = le16(b, 8);
        if version != 1 {
            return Err(Fault::UnsupportedVersion(version));
        }
        if b[88..90] != CORE_STORAGE_MAGIC {
            return Err(Fault::Magic);
        }
        let key_bytes = le32(b, 168);
        if key_bytes != AES_KEY_BYTES as u32 {
            return Err(Fault::KeySize(key_bytes));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[304..320]);
        let mut key = SecretBytes::zeroed(2 * AES_KEY_BYTES);
        key.as_mut()[..16].copy_from_slice(&b[176..192]);
        key.as_mut()[16..].copy_from_slice(&uuid);
        Ok(VolumeHeader {
            block_bytes: le32(b, 96),
            disklabel_block: le64(b, 104),
            physical_volume_uuid: uuid,
            metadata_key: key,
        })
    }

    /// The disk label's byte offset.
    pub fn disklabel_offset(&self) -> std::result::Result<u64, Fault> {
        block_offset(self.disklabel_block, self.block_bytes, "disk label")
    }
}

fn block_offset(
    block: u64,
    block_bytes: u32,
    what: &'static str,
) -> std::result::Result<u64, Fault> {
    block
        .checked_mul(u64::from(block_bytes))
        .filter(|&o| o <= OFFSET_MAX)
        .ok_or(Fault::Offset(what))
}

/// The disk label block: where the volume groups descriptor is.
pub struct DiskLabel {
    /// The descriptor's byte offset on the device.
    pub descriptor_offset: u64,
}

impl DiskLabel {
    /// Parses the [`MD_BLOCK_BYTES`] read at `offset` (the volume header's disk label).
    pub fn parse(b: &[u8], offset: u64) -> std::result::Result<Self, Fault> {
        let b = b
            .get(..MD_BLOCK_BYTES)
            .ok_or(Fault::Truncated("disk label"))?;
        check_crc(b, "disk label")?;
        let descriptor_offset = offset
            .checked_add(u64::from(le32(b, 220)))
            .filter(|&o| o <= OFFSET_MAX)
            .ok_or(Fault::Offset("volume groups descriptor"))?;
        Ok(DiskLabel { descriptor_offset })
    }
}

/// The volume groups descriptor: where the encrypted metadata is.
pub struct GroupsDescriptor {
    pub metadata_blocks: u64,
    pub metadata_block: u64,
}

impl GroupsDescriptor {
    pub fn parse(b: &[u8]) -> std::result::Result<Self, Fault> {
        let b = b
            .get(..VOL_GROUPS_DESCRIPTOR_BYTES)
            .ok_or(Fault::Truncated("volume groups descriptor"))?;
        Ok(GroupsDescriptor {
            metadata_blocks: le64(b, 8),
            metadata_block: le64(b, 32),
        })
    }
}

/// AES-XTS over one whole metadata block (8 KiB, one data unit), tweak = block index.
fn decrypt_md_block(key: &SecretBytes, index: u64, data: &mut [u8]) -> Result<()> {
    let k = key.as_ref();
    let mut data_ecb = Ecb::new(BlockCipher::Aes, &k[..AES_KEY_BYTES])?;
    let mut tweak_ecb = Ecb::new(BlockCipher::Aes, &k[AES_KEY_BYTES..])?;
    let mut t0 = [0u8; 16];
    t0[..8].copy_from_slice(&index.to_le_bytes());
    tweak_ecb.encrypt_block(&mut t0)?;
    let mut t = u128::from_le_bytes(t0);
    let mut tweaks = vec![0u8; data.len()];
    for (tw, block) in tweaks.chunks_exact_mut(16).zip(data.chunks_exact_mut(16)) {
        tw.copy_from_slice(&t.to_le_bytes());
        for (d, x) in block.iter_mut().zip(tw.iter()) {
            *d ^= x;
        }
        t = gf128_mul_x(t);
    }
    data_ecb.decrypt(data)?;
    for (block, tw) in data.chunks_exact_mut(16).zip(tweaks.chunks_exact(16)) {
        for (d, x) in block.iter_mut().zip(tw) {
            *d ^= x;
        }
    }
    Ok(())
}

/// What block 0x0019 gives: PBKDF2 iterations and salt, the wrapped KEK and volume key.
type Pbkdf2Block = (
    u32,
    [u8; SALT_BYTES],
    [u8; WRAPPED_KEY_BYTES],
    [u8; WRAPPED_KEY_BYTES],
);

/// What the encrypted metadata says, gathered block by block.
#[derive(Default)]
pub struct Metadata {
    pbkdf2: Option<Pbkdf2Block>,
    volume: Option<(u64, [u8; 16])>,
    logical_block: Option<u32>,
}

impl Metadata {
    /// Reads one decrypted metadata block; kinds other than the three needed are skipped.
    pub fn parse_block(&mut self, b: &[u8]) -> std::result::Result<(), Fault> {
        let b = b
            .get(..MD_BLOCK_BYTES)
            .ok_or(Fault::Truncated("metadata block"))?;
        check_crc(b, "metadata block")?;
        match le16(b, 10) {
            0x0019 => {
                let xml = xml_at(b, 112)?;
                let pwk = plist::data(xml, "PassphraseWrappedKEKStruct")
                    .ok_or(Fault::Plist("PassphraseWrappedKEKStruct"))?;
                if pwk.len() != PWK_BYTES {
                    return Err(Fault::StructSize("PassphraseWrappedKEKStruct"));
                }
                let kwvk = plist::data(xml, "KEKWrappedVolumeKeyStruct")
                    .ok_or(Fault::Plist("KEKWrappedVolumeKeyStruct"))?;
                if kwvk.len() != KWVK_BYTES {
                    return Err(Fault::StructSize("KEKWrappedVolumeKeyStruct"));
                }
                let mut salt = [0u8; SALT_BYTES];
                salt.copy_from_slice(&pwk[8..24]);
                let mut kek = [0u8; WRAPPED_KEY_BYTES];
                kek.copy_from_slice(&pwk[32..56]);
                let mut vk = [0u8; WRAPPED_KEY_BYTES];
                vk.copy_from_slice(&kwvk[8..32]);
                self.pbkdf2 = Some((le32(&pwk, 168), salt, kek, vk));
            }
            0x001A => {
                let xml = xml_at(b, 128)?;
                let size = plist::value(xml, "com.apple.corestorage.lv.size", "integer")
                    .and_then(plist::strtoull_hex)
                    .filter(|&s| s != 0 && s != u64::MAX)
                    .ok_or(Fault::Plist("com.apple.corestorage.lv.size"))?;
                let family = plist::value(xml, "com.apple.corestorage.lv.familyUUID", "string")
                    .and_then(uuid_parse)
                    .ok_or(Fault::Plist("com.apple.corestorage.lv.familyUUID"))?;
                self.volume = Some((size, family));
            }
            0x0305 => self.logical_block = Some(le32(b, 104)),
            _ => {}
        }
        Ok(())
    }

    /// The parameters, once every needed block was read.
    pub fn finish(self, hdr: &VolumeHeader) -> std::result::Result<Params, Fault> {
        let (iterations, salt, wrapped_kek, wrapped_vk) =
            self.pbkdf2.ok_or(Fault::Missing("0x0019"))?;
        let (lv_bytes, family) = self.volume.ok_or(Fault::Missing("0x001A"))?;
        let lv_block = self.logical_block.ok_or(Fault::Missing("0x0305"))?;
        let lv_offset = u64::from(lv_block)
            .checked_mul(u64::from(hdr.block_bytes))
            .ok_or(Fault::Offset("logical volume"))?;
        Ok(Params {
            physical_volume_uuid: hdr.physical_volume_uuid,
            family_uuid: family,
            logical_volume_offset_bytes: lv_offset,
            logical_volume_bytes: lv_bytes,
            pbkdf2_iterations: iterations,
            pbkdf2_salt: salt,
            wrapped_kek,
            wrapped_vk,
        })
    }
}

/// The plist text of a block: `xml_off` and `xml_size` at `at`, bounded by the block, cut at
/// the first NUL (as cryptsetup's `strndup`).
fn xml_at(b: &[u8], at: usize) -> std::result::Result<&[u8], Fault> {
    let off = le32(b, at) as usize;
    let size = le32(b, at + 4) as usize;
    let end = off
        .checked_add(size)
        .filter(|&e| e <= MD_BLOCK_BYTES)
        .ok_or(Fault::Offset("plist"))?;
    let xml = &b[off..end];
    Ok(xml.split(|&c| c == 0).next().unwrap_or(&[]))
}

/// A FileVault2 volume's parameters, as read from its metadata.
#[derive(Clone)]
pub struct Params {
    pub physical_volume_uuid: [u8; 16],
    pub family_uuid: [u8; 16],
    pub logical_volume_offset_bytes: u64,
    pub logical_volume_bytes: u64,
    pub pbkdf2_iterations: u32,
    pub pbkdf2_salt: [u8; SALT_BYTES],
    wrapped_kek: [u8; WRAPPED_KEY_BYTES],
    wrapped_vk: [u8; WRAPPED_KEY_BYTES],
}

impl std::fmt::Debug for Params {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("fvault2::Params")
            .field("family_uuid", &uuid_text(&self.family_uuid))
            .field("offset", &self.logical_volume_offset_bytes)
            .field("size", &self.logical_volume_bytes)
            .finish_non_exhaustive()
    }
}

/// RFC 3394 AES key unwrap of a 128-bit key wrapped with a 128-bit KEK; `None` when the
/// integrity check value does not come out (a wrong KEK).
fn unwrap_key(kek: &[u8], wrapped: &[u8; WRAPPED_KEY_BYTES]) -> Result<Option<SecretBytes>> {
    let mut ecb = Ecb::new(BlockCipher::Aes, kek)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(&wrapped[..8]);
    let mut r = SecretBytes::from_slice(&wrapped[8..]);
    let n = 2u64;
    let mut block = [0u8; 16];
    for j in (0..6u64).rev() {
        for i in (1..=n).rev() {
            let t = n * j + i;
            let x = u64::from_be_bytes(a) ^ t;
            block[..8].copy_from_slice(&x.to_be_bytes());
            let ri = (i as usize - 1) * 8;
            block[8..].copy_from_slice(&r.as_ref()[ri..ri + 8]);
            ecb.decrypt(&mut block)?;
            a.copy_from_slice(&block[..8]);
            r.as_mut()[ri..ri + 8].copy_from_slice(&block[8..]);
        }
    }
    zeroize::Zeroize::zeroize(&mut block);
    Ok((a == [0xA6; 8]).then_some(r))
}

impl Params {
    /// The volume key from a passphrase: PBKDF2-SHA256 gives the key that unwraps the KEK,
    /// the KEK unwraps the 128-bit data key, and the tweak key is the first half of
    /// SHA-256(data key || family UUID). A wrong passphrase fails the unwrap's check.
    pub fn volume_key(&self, passphrase: &[u8]) -> Result<SecretBytes> {
        let mut pk = SecretBytes::zeroed(AES_KEY_BYTES);
        pbkdf2::pbkdf2_hmac::<Sha256>(
            passphrase,
            &self.pbkdf2_salt,
            self.pbkdf2_iterations,
            pk.as_mut(),
        );
        let kek = unwrap_key(pk.as_ref(), &self.wrapped_kek)?.ok_or(Error::WrongPassphrase)?;
        let vk = unwrap_key(kek.as_ref(), &self.wrapped_vk)?.ok_or(Error::WrongPassphrase)?;
        let mut h = Sha256::new();
        h.update(vk.as_ref());
        h.update(self.family_uuid);
        let mut digest = h.finalize();
        let mut key = SecretBytes::zeroed(VOLUME_KEY_BYTES);
        key.as_mut()[..AES_KEY_BYTES].copy_from_slice(vk.as_ref());
        key.as_mut()[AES_KEY_BYTES..].copy_from_slice(&digest[..AES_KEY_BYTES]);
        zeroize::Zeroize::zeroize(digest.as_mut_slice());
        Ok(key)
    }

    /// The data: AES-XTS-plain64 from the logical volume's offset, its IV counted from there,
    /// for its size in whole 512-byte sectors.
    pub fn mapping(&self, key: SecretBytes) -> Result<Mapping> {
        let spec = CipherSpec::AES_XTS_PLAIN64;
        spec.check_key_len(key.len())?;
        Ok(Mapping {
            spec,
            key,
            geometry: Geometry::new(SectorSize::S512),
            data_offset_bytes: self.logical_volume_offset_bytes / SECTOR * SECTOR,
            size_bytes: Some(self.logical_volume_bytes / SECTOR * SECTOR),
        })
    }

    /// `cryptsetup fvault2Dump`'s text for the device named `device`.
    pub fn dump(&self, device: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "Header information for FVAULT2 device {device}.");
        let _ = writeln!(
            s,
            "Physical volume UUID: \t{}",
            uuid_text(&self.physical_volume_uuid)
        );
        let _ = writeln!(
            s,
            "Family UUID:          \t{}",
            uuid_text(&self.family_uuid)
        );
        let _ = writeln!(
            s,
            "Logical volume offset:\t{} [bytes]",
            self.logical_volume_offset_bytes
        );
        let _ = writeln!(
            s,
            "Logical volume size:  \t{} [bytes]",
            self.logical_volume_bytes
        );
        let _ = writeln!(s, "Cipher:               \taes");
        let _ = writeln!(s, "Cipher mode:          \txts-plain64");
        let _ = writeln!(s, "PBKDF2 iterations:    \t{}", self.pbkdf2_iterations);
        let _ = writeln!(
            s,
            "PBKDF2 salt:          \t{}",
            hex_spaced(&self.pbkdf2_salt)
        );
        s
    }

    /// The dump with the volume key's line after it.
    pub fn dump_volume_key(&self, device: &str, key: &SecretBytes) -> String {
        let mut s = self.dump(device);
        let _ = writeln!(s, "Volume key:       \t{}", hex_spaced(key.as_ref()));
        s
    }
}

/// Bytes as cryptsetup's `crypt_log_hex` with a " " separator prints them (one after each).
fn hex_spaced(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x} ")).collect()
}

/// Reads and parses the metadata of `dev`: volume header, disk label, groups descriptor, then
/// the encrypted blocks until an all-zero one or the descriptor's count.
pub fn read_params(dev: &dyn Backend) -> Result<Params> {
    let mut buf = vec![0u8; MD_BLOCK_BYTES];
    read(dev, &mut buf[..VOLUME_HEADER_BYTES], 0, "volume header")?;
    let hdr = VolumeHeader::parse(&buf[..VOLUME_HEADER_BYTES])?;
    let dl_off = hdr.disklabel_offset()?;
    read(dev, &mut buf, dl_off, "disk label")?;
    let dl = DiskLabel::parse(&buf, dl_off)?;
    read(
        dev,
        &mut buf[..VOL_GROUPS_DESCRIPTOR_BYTES],
        dl.descriptor_offset,
        "volume groups descriptor",
    )?;
    let gd = GroupsDescriptor::parse(&buf[..VOL_GROUPS_DESCRIPTOR_BYTES])?;
    let start = block_offset(gd.metadata_block, hdr.block_bytes, "encrypted metadata")?;
    let mut md = Metadata::default();
    for i in 0..gd.metadata_blocks.min(MD_BLOCKS_MAX) {
        let off = start
            .checked_add(i * MD_BLOCK_BYTES as u64)
            .filter(|&o| o <= OFFSET_MAX)
            .ok_or(Fault::Offset("encrypted metadata block"))?;
        read(dev, &mut buf, off, "encrypted metadata block")?;
        if buf.iter().all(|&b| b == 0) {
            break;
        }
        decrypt_md_block(&hdr.metadata_key, i, &mut buf)?;
        md.parse_block(&buf)?;
    }
    Ok(md.finish(&hdr)?)
}

fn read(dev: &dyn Backend, buf: &mut [u8], off: u64, what: &'static str) -> Result<()> {
    let end = off.checked_add(buf.len() as u64);
    if end.is_none_or(|e| e > dev.size()) {
        return Err(Fault::Truncated(what).into());
    }
    dev.read_exact_at(buf, off)
}
