//! LUKS2 and LUKS1, sans I/O: bytes in, typed headers and write plans out.
//!
//! This module never opens a file. A caller:
//! 1. reads the first [`PROBE_BYTES`] of the header device and asks [`probe_len`] how many
//!    bytes the header needs (`parse_any` is the same function on whatever it is given);
//! 2. parses them with [`parse_any`] into a [`Header`], which says which copy it used and
//!    why (damaged/stale copies are reported in `warnings`);
//! 3. unlocks with [`unlock`], passing a closure that reads keyslot areas; the result is a
//!    [`VolumeKey`], which exists only after a digest check succeeded;
//! 4. applies the [`WriteOp`]s an update returns, in order, syncing where told.
//!
//! `driver` is that caller for a [`crate::backend::Backend`]: [`read_header`], [`unlock_key`]
//! and [`apply`] perform steps 1-2, 3 and 4 through it, and [`open`] goes from a backend and a
//! passphrase to a [`crate::volume::Volume`] in one call. It is the only part of `luks` that
//! performs I/O, and only through the backend.

pub mod af;
pub mod convert;
mod driver;
mod dump;
pub mod json;
pub mod kdf;
pub mod keyslot;
pub mod luks1;
pub mod luks2;
pub mod reencrypt;
mod sha256_x16;
mod signatures;
pub(crate) mod util;

#[cfg(test)]
mod tests;

pub use driver::{
    apply, open, open_parsed, read_area, read_header, read_header_to_repair, unlock_key,
    unlock_key_for, OpenOptions, Unlock,
};
pub use dump::{dump, dump_json, dump_unbound};
pub use kdf::{Kdf, KdfRequest};
pub use luks1::Luks1Header;
pub use luks2::{select_copy, Luks2Header, Selection, Which};
pub use signatures::foreign_signature;
pub use util::{check_uuid, random_secret, random_uuid, HashAlg};

use crate::sector::{CipherSpec, SectorSize};
use crate::{Error, Result, SecretBytes};

/// Size of the LUKS2 binary header (and of the read a probe starts with).
pub const BIN_HDR_BYTES: u64 = 4096;
/// Bytes to read first: enough for a LUKS1 phdr or a LUKS2 binary header.
pub const PROBE_BYTES: u64 = 4096;
/// Where cryptsetup may put the LUKS2 secondary header (= the primary's size).
pub const HDR2_OFFSETS: [u64; 9] = [
    0x4000, 0x8000, 0x10000, 0x20000, 0x40000, 0x80000, 0x100000, 0x200000, 0x400000,
];
/// Most bytes a header parse ever needs: the largest secondary (4 MiB) at the largest
/// offset (4 MiB). Bounds what a hostile header can make us read and hold.
pub const HEADER_BYTES_MAX: u64 = 2 * 0x400000;
/// LUKS2 limits (cryptsetup's).
pub const KEYSLOTS_MAX: u32 = 32;
pub const TOKENS_MAX: u32 = 32;
pub const SEGMENTS_MAX: u32 = 32;
pub const DIGESTS_MAX: u32 = 32;
/// cryptsetup's largest keyslots area (128 MiB).
pub const KEYSLOTS_AREA_BYTES_MAX: u64 = 128 << 20;
/// Largest volume key we accept from a header (cryptsetup's limit is 512 bytes for LUKS2
/// keys it creates; AF material is 4000× this, so it bounds memory too).
pub const KEY_BYTES_MAX: usize = 512;
/// Largest digest value accepted (sha512 gives 64 bytes).
pub const DIGEST_BYTES_MAX: usize = 256;
/// Target time for calibrating a volume key digest (cryptsetup: 1/8 of a second).
pub const DIGEST_TIME_MS: u32 = 125;

/// The volume key, proven correct: only a successful digest check creates one.
///
/// A LUKS2 keyslot may hold a key that no data segment uses (`luksAddKey --unbound`): its
/// digest names no segment. Such a key is verified like any other but is *unbound*
/// ([`VolumeKey::is_bound`] is false): the data paths ([`volume_config`], the integrity and
/// reencryption opens) refuse it, and the passphrase unlock they use ([`unlock`]) never tries
/// an unbound keyslot. Only [`unlock_any_segment`] (a passphrase test, a dump of the unbound
/// key, a passphrase change) returns one.
pub struct VolumeKey {
    key: SecretBytes,
    digest_id: u32,
    bound: bool,
}

impl VolumeKey {
    /// Crate-private: called only by the digest checks in `luks1`/`luks2`. `bound`: the
    /// digest names at least one segment.
    pub(crate) fn new_verified(key: SecretBytes, digest_id: u32, bound: bool) -> Self {
        VolumeKey {
            key,
            digest_id,
            bound,
        }
    }

    /// Whether the key encrypts a data segment (its digest is assigned to one). An unbound key
    /// opens nothing.
    pub fn is_bound(&self) -> bool {
        self.bound
    }

    /// Refuses an unbound key where the data is about to be read or written with it.
    pub(crate) fn require_bound(&self) -> Result<()> {
        if self.bound {
            Ok(())
        } else {
            Err(Error::NoUsableKeyslot)
        }
    }

    pub fn bytes(&self) -> &[u8] {
        self.key.as_ref()
    }

    pub fn len(&self) -> usize {
        self.key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.key.is_empty()
    }

    pub fn digest_id(&self) -> u32 {
        self.digest_id
    }

    /// A second copy, for a run whose old and new segments share one digest
    /// (`reencrypt --keep-key`): the keyslot is unlocked once.
    pub(crate) fn duplicate(&self) -> VolumeKey {
        VolumeKey {
            key: SecretBytes::from_slice(self.key.as_ref()),
            digest_id: self.digest_id,
            bound: self.bound,
        }
    }
}

impl std::fmt::Debug for VolumeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VolumeKey({} bytes, redacted)", self.key.len())
    }
}

/// A passphrase keyslot to add ([`Header::add_keyslot`]).
#[derive(Clone, Copy)]
pub struct NewKeyslot<'a> {
    /// The volume key the slot will open.
    pub vk: &'a VolumeKey,
    pub passphrase: &'a [u8],
    pub kdf: &'a KdfRequest,
    /// This keyslot, or (`None`) the first free one.
    pub slot: Option<u32>,
}

/// One step of a header update. Drivers apply them in order.
#[derive(Clone, PartialEq, Eq)]
pub enum WriteOp {
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    /// Zero `len` bytes (format's wipe of the metadata area).
    Zero {
        offset: u64,
        len: u64,
    },
    /// fsync: everything before is durable before anything after is written.
    Sync,
}

impl std::fmt::Debug for WriteOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteOp::Write { offset, data } => write!(f, "Write({offset}, {} bytes)", data.len()),
            WriteOp::Zero { offset, len } => write!(f, "Zero({offset}, {len})"),
            WriteOp::Sync => write!(f, "Sync"),
        }
    }
}

/// Applies a plan to an in-memory image (tests, simulations), growing it as needed.
pub fn apply_to_image(image: &mut Vec<u8>, ops: &[WriteOp]) {
    for op in ops {
        match op {
            WriteOp::Write { offset, data } => {
                let o = *offset as usize;
                if image.len() < o + data.len() {
                    image.resize(o + data.len(), 0);
                }
                image[o..o + data.len()].copy_from_slice(data);
            }
            WriteOp::Zero { offset, len } => {
                let (o, n) = (*offset as usize, *len as usize);
                if image.len() < o + n {
                    image.resize(o + n, 0);
                }
                image[o..o + n].fill(0);
            }
            WriteOp::Sync => {}
        }
    }
}

/// A parsed LUKS header of either version.
#[derive(Debug, Clone)]
pub enum Header {
    Luks1(Luks1Header),
    Luks2(Luks2Header),
}

/// Where the encrypted data is and how it is encrypted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataLayout {
    /// Offset of the data area on the data device, bytes.
    pub offset_bytes: u64,
    /// Fixed size in bytes, or `None` for "to the end of the device".
    pub size_bytes: Option<u64>,
    pub cipher: CipherSpec,
    pub sector_size: SectorSize,
    /// dm-crypt iv_offset, in 512-byte units.
    pub iv_tweak: u64,
}

/// How many bytes from offset 0 [`parse_any`] needs, given the first [`PROBE_BYTES`].
pub fn probe_len(first: &[u8]) -> Result<u64> {
    if first.len() < 8 {
        return Err(Error::NotLuks("device too small".into()));
    }
    refuse_rbd_clone(first)?;
    if &first[0..6] != luks1::MAGIC {
        // Maybe the primary is gone and a secondary survives: read the whole probe range.
        return Ok(HEADER_BYTES_MAX);
    }
    match u16::from_be_bytes([first[6], first[7]]) {
        1 => Ok(luks1::PHDR_BYTES as u64),
        2 => match luks2::BinHeader::decode(first, false) {
            Ok(b) if luks2::HDR_SIZES.contains(&b.hdr_size) => Ok(2 * b.hdr_size),
            _ => Ok(HEADER_BYTES_MAX),
        },
        v => Err(Error::UnsupportedLuks(format!("LUKS version {v}"))),
    }
}

/// The magic librbd writes instead of LUKS's on a clone image formatted with its own
/// encryption (`rbd encryption format` on a clone): the header is LUKS2, but the image's data
/// below the clone's own writes is its parent's, under the parent's key.
pub const RBD_CLONE_MAGIC: &[u8; 6] = b"RBDL\xba\xbe";

/// Names a librbd clone header instead of calling it "not LUKS": ucrypt does not open
/// layered (parent + clone) encryption, which only librbd itself resolves.
fn refuse_rbd_clone(first: &[u8]) -> Result<()> {
    if first.starts_with(RBD_CLONE_MAGIC) {
        return Err(Error::UnsupportedLuks(
            "librbd clone encryption header (magic RBDL): the image is a clone whose data is \
             partly its parent's under the parent's key; open it with librbd (rbd, qemu) and \
             the parent's passphrase too"
                .into(),
        ));
    }
    Ok(())
}

/// Parses a header from the first bytes of a device (any length; the fuzz entry point).
/// Never panics; reads at most [`HEADER_BYTES_MAX`] bytes of the input.
pub fn parse_any(bytes: &[u8]) -> Result<Header> {
    let bytes = &bytes[..bytes.len().min(HEADER_BYTES_MAX as usize)];
    refuse_rbd_clone(bytes)?;
    if bytes.len() >= 8 && &bytes[0..6] == luks1::MAGIC {
        match u16::from_be_bytes([bytes[6], bytes[7]]) {
            1 => return Ok(Header::Luks1(Luks1Header::parse(bytes)?)),
            2 => {}
            v => return Err(Error::UnsupportedLuks(format!("LUKS version {v}"))),
        }
    }
    Ok(Header::Luks2(Luks2Header::parse(bytes)?))
}

impl Header {
    /// Persistent activation flags (LUKS2 `config.flags`; LUKS1 has none).
    pub fn activation_flags(&self) -> Vec<String> {
        match self {
            Header::Luks1(_) => Vec::new(),
            Header::Luks2(h) => h.flags(),
        }
    }

    pub fn version(&self) -> u32 {
        match self {
            Header::Luks1(_) => 1,
            Header::Luks2(_) => 2,
        }
    }

    pub fn uuid(&self) -> &str {
        match self {
            Header::Luks1(h) => &h.uuid,
            Header::Luks2(h) => &h.bin.uuid,
        }
    }

    pub fn warnings(&self) -> &[String] {
        match self {
            Header::Luks1(_) => &[],
            Header::Luks2(h) => &h.warnings,
        }
    }

    /// Whether the header carries an unfinished reencryption (its requirement).
    pub fn in_reencryption(&self) -> bool {
        match self {
            Header::Luks1(_) => false,
            Header::Luks2(h) => reencrypt::requirement_version(h.meta()).is_some(),
        }
    }

    /// Mandatory requirements this implementation does not meet (an unfinished
    /// reencryption's among them): the header may be read, its keyslots unlocked, but the
    /// volume is neither activated nor its header written until they are met.
    pub fn unmet_requirements(&self) -> Vec<String> {
        match self {
            Header::Luks1(_) => vec![],
            Header::Luks2(h) => h.meta.requirements(),
        }
    }

    /// The unmet requirements other than an unfinished reencryption's (which ucrypt
    /// implements: the volume opens as two segments, the reencryption resumes).
    pub fn unknown_requirements(&self) -> Vec<String> {
        self.unmet_requirements()
            .into_iter()
            .filter(|r| !reencrypt::is_reencrypt_requirement(r))
            .collect()
    }

    /// Refuses activation and every header write when requirements are unmet, as cryptsetup
    /// does (api-test-2's Luks2Requirements): an unknown requirement is
    /// [`Error::UnmetRequirements`], an unfinished reencryption [`Error::InReencryption`]
    /// (verbs that can continue it call [`Self::check_known_requirements`] instead).
    pub fn check_requirements(&self) -> Result<()> {
        self.check_known_requirements()?;
        if self.unmet_requirements().is_empty() {
            Ok(())
        } else {
            // An unfinished reencryption: cryptsetup's words (exit code 1).
            Err(Error::InReencryption)
        }
    }

    /// Refuses a header with requirements ucrypt does not know ([`Error::UnmetRequirements`]);
    /// an unfinished reencryption passes (opening such a volume, resuming, repairing it).
    pub fn check_known_requirements(&self) -> Result<()> {
        let unknown = self.unknown_requirements();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(Error::UnmetRequirements(unknown))
        }
    }

    pub fn data_layout(&self) -> Result<DataLayout> {
        match self {
            Header::Luks1(h) => Ok(DataLayout {
                offset_bytes: u64::from(h.payload_offset) * 512,
                size_bytes: None,
                cipher: h.cipher()?,
                sector_size: SectorSize::new(512)?,
                iv_tweak: 0,
            }),
            Header::Luks2(h) => {
                let s = h.meta.crypt_segment()?;
                Ok(DataLayout {
                    offset_bytes: s.offset_bytes,
                    size_bytes: match s.size {
                        json::SegmentSize::Dynamic => None,
                        json::SegmentSize::Bytes(n) => Some(n),
                    },
                    cipher: s.cipher,
                    sector_size: s.sector_size,
                    iv_tweak: s.iv_tweak,
                })
            }
        }
    }

    /// Bytes of the whole metadata area (headers + keyslots), what a header backup holds.
    pub fn metadata_area_bytes(&self) -> u64 {
        match self {
            Header::Luks1(h) => {
                let end_of_slots = h
                    .slots
                    .iter()
                    .map(|s| u64::from(s.key_material_offset) * 512 + h.material_bytes())
                    .max()
                    .unwrap_or(4096);
                if h.payload_offset != 0 {
                    u64::from(h.payload_offset) * 512
                } else {
                    end_of_slots.div_ceil(4096) * 4096
                }
            }
            Header::Luks2(h) => h.metadata_area_bytes(),
        }
    }

    /// Where the header copies and keyslot areas end: a device must be at least this large
    /// (cryptsetup's check). LUKS2: both header copies and `keyslots_size`; LUKS1: the end of
    /// the last keyslot's key material.
    pub fn areas_end(&self) -> u64 {
        match self {
            Header::Luks1(h) => h
                .slots
                .iter()
                .map(|s| u64::from(s.key_material_offset) * 512 + h.material_bytes())
                .max()
                .unwrap_or(0),
            Header::Luks2(h) => {
                2 * (h.meta.config.json_size.0 + BIN_HDR_BYTES) + h.meta.config.keyslots_size.0
            }
        }
    }

    /// The volume key's size in bytes, as the header says it (cryptsetup's
    /// `crypt_get_volume_key_size`): LUKS1's key_bytes; LUKS2's first keyslot of the data
    /// segment's key. `None` for a LUKS2 header without such a keyslot.
    pub fn volume_key_bytes(&self) -> Option<usize> {
        match self {
            Header::Luks1(h) => Some(h.key_bytes as usize),
            Header::Luks2(h) => h.volume_key_bytes(),
        }
    }

    /// Keyslot ids in use (LUKS2: all types; LUKS1: active).
    pub fn active_keyslots(&self) -> Vec<u32> {
        match self {
            Header::Luks1(h) => (0..luks1::KEYSLOTS as u32)
                .filter(|&i| h.slots[i as usize].active)
                .collect(),
            Header::Luks2(h) => h.meta.used_keyslots().into_iter().collect(),
        }
    }

    /// Adds a passphrase keyslot; returns its id and the write plan (material first).
    pub fn add_keyslot(&mut self, new: NewKeyslot<'_>) -> Result<(u32, Vec<WriteOp>)> {
        self.check_requirements()?;
        match self {
            Header::Luks1(h) => h.add_keyslot(new),
            Header::Luks2(h) => h.add_keyslot(new, None),
        }
    }

    /// Removes a keyslot. Unlike the other header writes this one is allowed under
    /// requirements ucrypt does not know, as cryptsetup's `luksKillSlot` and `luksRemoveKey`
    /// allow it; not during a reencryption.
    pub fn remove_keyslot(&mut self, slot: u32) -> Result<Vec<WriteOp>> {
        if self
            .unmet_requirements()
            .iter()
            .any(|r| reencrypt::is_reencrypt_requirement(r))
        {
            return Err(Error::InReencryption);
        }
        match self {
            Header::Luks1(h) => h.remove_keyslot(slot),
            Header::Luks2(h) => h.remove_keyslot(slot),
        }
    }

    /// Verifies a candidate volume key (e.g. from --volume-key-file).
    pub fn verify_key(&self, candidate: SecretBytes) -> Result<VolumeKey> {
        match self {
            Header::Luks1(h) => h.verify_key(candidate),
            Header::Luks2(h) => h.verify_key(None, candidate),
        }
    }
}

/// Which keyslots a passphrase may open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUse {
    /// The data: only keyslots whose digest is assigned to a data segment (cryptsetup's
    /// default segment; in reencryption, the segments the protocol names). A named unbound
    /// keyslot is [`Error::NoUsableKeyslot`].
    Data,
    /// Any keyslot, unbound ones too (cryptsetup's `CRYPT_ANY_SEGMENT`): a passphrase test
    /// with `--key-slot` or `--unbound`, a dump of an unbound key, a passphrase change.
    AnySegment,
}

/// Unlocks with a passphrase for the data ([`KeyUse::Data`]): tries keyslots in cryptsetup's
/// order (or just `slot`), reading each keyslot's material through `read(offset, len)` on the
/// header device. Returns the slot that opened and the verified, bound volume key, or
/// [`Error::WrongPassphrase`] / [`Error::NoUsableKeyslot`].
pub fn unlock(
    hdr: &Header,
    passphrase: &[u8],
    slot: Option<u32>,
    read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<(u32, VolumeKey)> {
    unlock_for(hdr, passphrase, slot, KeyUse::Data, read)
}

/// [`unlock`] with unbound keyslots allowed ([`KeyUse::AnySegment`]): the key returned may
/// be unbound, which no data path takes.
pub fn unlock_any_segment(
    hdr: &Header,
    passphrase: &[u8],
    slot: Option<u32>,
    read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<(u32, VolumeKey)> {
    unlock_for(hdr, passphrase, slot, KeyUse::AnySegment, read)
}

fn unlock_for(
    hdr: &Header,
    passphrase: &[u8],
    slot: Option<u32>,
    key_use: KeyUse,
    read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<(u32, VolumeKey)> {
    let r = try_keyslots(hdr, passphrase, slot, key_use, read);
    // The KDF's output, the keyslot's decrypted material and the merge's pieces were in the
    // frames beneath: they go.
    crate::secret::scrub_stack();
    if let Ok((_, vk)) = &r {
        assert!(
            key_use == KeyUse::AnySegment || vk.is_bound(),
            "a data unlock returned an unbound key"
        );
    }
    r
}

fn try_keyslots(
    hdr: &Header,
    passphrase: &[u8],
    slot: Option<u32>,
    key_use: KeyUse,
    read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<(u32, VolumeKey)> {
    let mut other_err: Option<Error> = None;
    let note = |e: Error, other: &mut Option<Error>| {
        if !matches!(e, Error::WrongPassphrase) && other.is_none() {
            *other = Some(e);
        }
    };
    match hdr {
        Header::Luks1(h) => {
            let order = h.unlock_order(slot)?;
            if order.is_empty() {
                return Err(Error::NoUsableKeyslot);
            }
            for i in order {
                let off = u64::from(h.slots[i].key_material_offset) * 512;
                let crypto = h.slot_crypto(i)?;
                let material = read(off, crypto.material_bytes() as u64)?;
                match crypto
                    .open(passphrase, &material)
                    .and_then(|k| h.verify_key(k))
                {
                    Ok(vk) => return Ok((i as u32, vk)),
                    Err(e) => note(e, &mut other_err),
                }
            }
        }
        Header::Luks2(h) => {
            let order = h.unlock_order(slot, key_use)?;
            if order.is_empty() {
                return Err(Error::NoUsableKeyslot);
            }
            for p in order {
                let crypto = Luks2Header::slot_crypto(&p);
                let material = read(p.area_offset, crypto.material_bytes() as u64)?;
                match crypto
                    .open(passphrase, &material)
                    .and_then(|k| h.verify_key(Some(p.id), k))
                {
                    Ok(vk) => return Ok((p.id, vk)),
                    Err(e) => note(e, &mut other_err),
                }
            }
            let walked_all = slot.is_none()
                && key_use == KeyUse::Data
                && reencrypt::ReencryptState::from_metadata(&h.meta)
                    .ok()
                    .flatten()
                    .is_none();
            if other_err.is_none() && walked_all {
                return Err(h.data_unlock_failure());
            }
        }
    }
    Err(other_err.unwrap_or(Error::WrongPassphrase))
}

/// The engine's input for an unlocked LUKS volume: cipher, key, geometry, data offset and
/// size from the header's data segment. The volume does not depend on LUKS; LUKS adapts to
/// the volume's input type. Policy, pool and read-only are the caller's choice afterwards.
pub fn volume_config(hdr: &Header, vk: &VolumeKey) -> Result<crate::volume::VolumeConfig> {
    vk.require_bound()?;
    // A requirement ucrypt does not know may change what the data means: no activation, not
    // even read-only (cryptsetup's rule).
    hdr.check_known_requirements()?;
    let l = hdr.data_layout()?;
    let geometry = crate::sector::Geometry {
        sector_size: l.sector_size,
        iv_offset: l.iv_tweak,
        // LUKS2 never sets iv_large_sectors; LUKS1 sectors are 512 bytes.
        iv_large_sectors: false,
    };
    let mut cfg =
        crate::volume::VolumeConfig::new(l.cipher, SecretBytes::from_slice(vk.bytes()), geometry);
    cfg.data_offset_bytes = l.offset_bytes;
    cfg.size_bytes = l.size_bytes;
    // Persistent activation flags. Discards leak which blocks are in use, so like dm-crypt they
    // reach the backend only with allow-discards. The workqueue and CPU flags ask for what
    // ucrypt's default inline policy already does (crypto on the submitting thread).
    cfg.allow_discards = hdr.activation_flags().iter().any(|f| f == "allow-discards");
    Ok(cfg)
}
