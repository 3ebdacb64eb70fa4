//! The driver of offline reencryption (key rotation, optionally to a new cipher, key size or
//! sector size; decryption and encryption with a detached header): performs what
//! `reencrypt_plan` plans against a [`Backend`] holding the header and the data, or two
//! ([`Devices`]) for a detached header, with the engine's sector ciphers.
//!
//! - [`init`] turns a plain LUKS2 volume into one in reencryption, as cryptsetup 2.6's
//!   `reencrypt --init-only` does: a new random volume key with its digest, a new keyslot for
//!   the passphrase (first free id), a `reencrypt` keyslot whose area is the rest of the
//!   keyslots area, the segments (`0` = the whole device under the old key, then
//!   backup-previous and backup-final), the `online-reencrypt-v2` requirement and the
//!   reencryption digest. The new keyslot's material is written and flushed first, then one
//!   header commit makes it all visible: a crash leaves the old header or the new one.
//! - [`resume`] rewrites hotzone after hotzone and finalises (the old keyslots, the reencrypt
//!   keyslot, the backups and the requirement removed: a plain LUKS2 header is left). One
//!   hotzone buffer (page-aligned, locked, wiped) is taken at the start and reused. Offline,
//!   `none` and data shift hotzones run back to back (`reencrypt_run/walk.rs`): the lanes
//!   read and rekey the next hotzone while the last one's writes and commits finish.
//! - [`recover`] brings a volume whose metadata was committed inside a hotzone (a crash there)
//!   back to a consistent state from the resilience data, as cryptsetup's `repair` does.
//! - [`init_on`] with [`Mode::Decrypt`] starts a decryption, [`init_encrypt`] an encryption
//!   with a new detached header; [`resume_on`] and [`recover_on`] take the two devices.
//! - [`init_encrypt_shift`] starts an encryption that moves the data up to put the header in
//!   front, [`init_decrypt_unshift`] a decryption that exports the header in front to a new
//!   file and moves the data back to the start of the device.

use super::serving::{Offline, Serving};
use crate::backend::Backend;
use crate::engine::crew::Crew;
use crate::luks::json::{Keyslot, Metadata, Requirements, U64Str};
use crate::luks::json::{KeyslotKind, SegmentKind};
use crate::luks::kdf::{KdfRequest, PBKDF2_ITERATIONS_MIN};
use crate::luks::luks2::digest::{free_id, make_digest, make_digest_with};
use crate::luks::reencrypt::pieces::{
    hash_blocks, pieces, read_summing, rewrite_pieces, share_out,
};
use crate::luks::reencrypt::plan::{
    area_limit, check_layout, check_supported, finalise, hotzone_offset, last_backward_hotzone,
    next_hotzone, next_hotzone_shift, next_hotzone_unshift, position, set_segments, shift_geometry,
    shift_source, unshift_geometry, MovedGuard, Position, Protect, Shift, Step, Unshift,
    UNSHIFT_REQUIREMENT_VERSION,
};
use crate::luks::reencrypt::{
    digest_of_segment, verification_data, Direction, Mode, ReencryptState,
};
use crate::luks::util::{random_secret, HashAlg, Noise};
use crate::luks::{
    apply, read_area, read_header, unlock, Header, Luks2Header, NewKeyslot, VolumeKey, WriteOp,
    KEYSLOTS_MAX,
};
use crate::pool::BufferPool;
use crate::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use crate::sync::TakeTurns;
use crate::{Error, Result};

/// The requirement cryptsetup 2.6 writes for key rotation.
pub const REQUIREMENT_V2: &str = "online-reencrypt-v2";
/// The requirement cryptsetup 2.6 writes for a decryption that moves the data back
/// (`datashift-checksum`): version 3, part of the reencryption digest.
pub const REQUIREMENT_V3: &str = "online-reencrypt-v3";
const _: () = assert!(UNSHIFT_REQUIREMENT_VERSION == 3);
/// The checksum cryptsetup uses when `--resilience-hash` is not given.
pub const CHECKSUM_HASH: HashAlg = HashAlg::Sha256;
/// Bytes per checksum: cryptsetup's alignment of the hotzone (4 KiB, also for 512-byte
/// sectors, in cryptsetup 2.6.1).
pub const CHECKSUM_BLOCK_BYTES: u32 = 4096;
/// The hotzone when `--hotzone-size` is not given. cryptsetup's default is as large as the
/// resilience data allows (the whole device for checksum on most volumes), bounded by a share
/// of the memory; ucrypt bounds its one hotzone buffer by this instead.
pub const HOTZONE_BYTES_DEFAULT: u64 = 64 << 20;
/// The largest hotzone buffer (the buffer pool's limit).
pub const HOTZONE_BYTES_MAX: u64 = crate::pool::POOL_BYTES_MAX as u64;
/// Most threads a hotzone's crypto is spread over (one per CPU up to this).
const REKEY_LANES_MAX: usize = 16;
/// Smaller buffers are rekeyed on one thread (a thread costs more than it saves).
const LANE_BYTES_MIN: usize = 256 << 10;
/// Bytes a rekeying thread reads, decrypts, encrypts and writes at a time: small enough to
/// stay in a core's cache between the steps, large enough that a system call per chunk costs
/// nothing (whole 4096-byte sectors). Also the most one lane can be left working on when the
/// others have run out of chunks: each step of a hotzone ends when its last chunk does, and
/// beside busy threads that last chunk may run on half a core. Smaller chunks only add
/// claims and system calls (the busy rows of `bench reencrypt`, BENCHMARKS.md).
const LANE_CHUNK_BYTES: usize = 256 << 10;
/// The buffer of an offline `none` rotation, whatever its hotzone: 64 slots of
/// [`LANE_CHUNK_BYTES`]: a buffer of the whole hotzone would cost its allocation, wipes and
/// page faults on every rotation for no gain, since the lanes reuse slots as writes finish;
/// 16 MiB also stays closer to the caches the chunks go through.
const NONE_BUFFER_BYTES: u64 = 16 << 20;
/// Largest piece of random bytes written at a time when finalisation wipes retired areas.
const WIPE_PIECE_BYTES: u64 = 1 << 20;
/// Bytes of the keyslot area alignment cryptsetup uses.
const AREA_ALIGN_BYTES: u64 = 4096;

mod walk;

fn bad(detail: impl Into<String>) -> Error {
    Error::BadHeader {
        check: "reencrypt",
        detail: detail.into(),
    }
}

/// The resilience of a new rotation (`--resilience`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResilienceKind {
    None,
    Checksum,
    Journal,
}

impl ResilienceKind {
    pub fn from_name(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(ResilienceKind::None),
            "checksum" => Ok(ResilienceKind::Checksum),
            "journal" => Ok(ResilienceKind::Journal),
            o => Err(Error::InvalidArgument(format!(
                "resilience '{o}' (ucrypt rotates keys with checksum, journal or none)"
            ))),
        }
    }
}

/// A resilience named when a reencryption is resumed (cryptsetup 2.6's `--resilience` with
/// `--resume-only`), to replace the reencryption's own before its next hotzone
/// ([`RunOptions::resilience`]). `checksum`, `journal` and `none` replace each other; a data
/// shift's resilience cannot be switched to or away from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResilienceAsked {
    /// `checksum` (with its hash), `journal` or `none`.
    InPlace(ResilienceKind, HashAlg),
    /// `datashift`.
    Datashift,
    /// `datashift-checksum` (with its hash).
    DatashiftChecksum(HashAlg),
    /// `datashift-journal`.
    DatashiftJournal,
}

impl ResilienceAsked {
    /// cryptsetup's name of it.
    pub fn name(self) -> &'static str {
        match self {
            ResilienceAsked::InPlace(ResilienceKind::None, _) => "none",
            ResilienceAsked::InPlace(ResilienceKind::Checksum, _) => "checksum",
            ResilienceAsked::InPlace(ResilienceKind::Journal, _) => "journal",
            ResilienceAsked::Datashift => "datashift",
            ResilienceAsked::DatashiftChecksum(_) => "datashift-checksum",
            ResilienceAsked::DatashiftJournal => "datashift-journal",
        }
    }

    /// The checksum's hash, for the kinds that have one.
    pub fn hash(self) -> Option<HashAlg> {
        match self {
            ResilienceAsked::InPlace(ResilienceKind::Checksum, h)
            | ResilienceAsked::DatashiftChecksum(h) => Some(h),
            _ => None,
        }
    }

    /// How the moved segment of a decryption that moves the data back is guarded when this
    /// is asked: `checksum` and `datashift-checksum` by a checksum, `journal` and
    /// `datashift-journal` by a copy (as cryptsetup's command line maps them); `None` for
    /// `none` and `datashift`, which cannot guard it.
    pub fn moved_guard(self) -> Option<ResilienceKind> {
        match self {
            ResilienceAsked::InPlace(ResilienceKind::Checksum, _)
            | ResilienceAsked::DatashiftChecksum(_) => Some(ResilienceKind::Checksum),
            ResilienceAsked::InPlace(ResilienceKind::Journal, _)
            | ResilienceAsked::DatashiftJournal => Some(ResilienceKind::Journal),
            ResilienceAsked::InPlace(ResilienceKind::None, _) | ResilienceAsked::Datashift => None,
        }
    }

    /// From cryptsetup's name and `--resilience-hash` (for the checksum kinds).
    pub fn from_name(name: &str, hash: HashAlg) -> Result<Self> {
        Ok(match name {
            "datashift" => ResilienceAsked::Datashift,
            "datashift-checksum" => ResilienceAsked::DatashiftChecksum(hash),
            "datashift-journal" => ResilienceAsked::DatashiftJournal,
            // cryptsetup 2.6.1's words.
            "checksum" | "journal" | "none" => {
                ResilienceAsked::InPlace(ResilienceKind::from_name(name)?, hash)
            }
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "Unsupported resilience mode {name}"
                )))
            }
        })
    }
}

/// What the new segment changes (`--cipher`, `--key-size`, `--sector-size`); `None` keeps
/// the old segment's. As cryptsetup: a new cipher without a key size gets that cipher's
/// default key size, the same cipher keeps the old key size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentChange {
    pub cipher: Option<CipherSpec>,
    pub key_bytes: Option<usize>,
    pub sector_size: Option<SectorSize>,
}

/// How to start a rotation ([`init`]).
pub struct InitOptions<'a> {
    pub resilience: ResilienceKind,
    /// The KDF of the new keyslot (and whether digests are calibrated: forced iterations use
    /// the minimum, as cryptsetup does).
    pub kdf: &'a KdfRequest,
    /// The keyslot the passphrase opens (`--key-slot`); without it the volume must have
    /// exactly one keyslot.
    pub key_slot: Option<u32>,
    /// The new segment's cipher, key size and sector size.
    pub change: SegmentChange,
    /// [`Mode::Reencrypt`] (a new key) or [`Mode::Decrypt`] (to plaintext, detached header).
    pub mode: Mode,
    /// Where each new keyslot's PBKDF comes from.
    pub keyslot_kdf: KeyslotKdf,
    /// The checksum of [`ResilienceKind::Checksum`] (`--resilience-hash`; cryptsetup's
    /// default [`CHECKSUM_HASH`]); not read for the other kinds.
    pub resilience_hash: HashAlg,
}

/// Where the PBKDF of a rotation's new keyslots comes from (as cryptsetup 2.6.1's
/// `set_keyslot_params` chooses it; `reencrypt_interop`'s
/// `argon2_keyslot_copied_as_cryptsetup_copies_it` compares the two tools' keyslots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyslotKdf {
    /// [`InitOptions::kdf`]: cryptsetup's choice when `--pbkdf`, `--hash`, `--iter-time` or
    /// `--pbkdf-force-iterations` is given.
    Given,
    /// Each new keyslot copies the type and costs of the old keyslot whose passphrase it
    /// takes, uncalibrated, and the new digests get the least iterations (cryptsetup's
    /// default: no benchmark runs).
    SameAsOld,
}

/// A passphrase that opens one keyslot of the volume's key: made only by
/// [`check_passphrase`], which unlocks that keyslot with it. A rotation gives each such
/// keyslot a twin for the new key, with the same passphrase (cryptsetup asks one per active
/// keyslot). Not `Clone`, not printable; the passphrase and the key are wiped on drop.
pub struct SlotPassphrase {
    slot: u32,
    passphrase: crate::SecretBytes,
    vk: VolumeKey,
}

impl SlotPassphrase {
    /// The keyslot the passphrase opens.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    pub fn passphrase(&self) -> &[u8] {
        self.passphrase.as_ref()
    }
}

impl std::fmt::Debug for SlotPassphrase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotPassphrase(keyslot {}, redacted)", self.slot)
    }
}

/// Unlocks keyslot `slot` of the header on `dev` with `passphrase` (cryptsetup's check after
/// each "Enter passphrase for key slot N: "): the proof a rotation takes, or
/// [`Error::WrongPassphrase`].
pub fn check_passphrase(
    dev: &dyn Backend,
    hdr: &Header,
    slot: u32,
    passphrase: crate::SecretBytes,
) -> Result<SlotPassphrase> {
    let mut read = |offset: u64, len: u64| read_area(dev, offset, len);
    let (slot, vk) = unlock(hdr, passphrase.as_ref(), Some(slot), &mut read)?;
    Ok(SlotPassphrase {
        slot,
        passphrase,
        vk,
    })
}

/// The keyslots a rotation asks a passphrase for, by number: those whose digest covers a
/// segment (cryptsetup's "active" keyslots, of any type). Unbound keyslots (a digest of no
/// segment) are not asked for and are kept as they are.
pub fn passphrase_keyslots(hdr: &Header) -> Vec<u32> {
    let Header::Luks2(h) = hdr else {
        return Vec::new();
    };
    let mut v: Vec<u32> = h
        .meta
        .keyslots
        .keys()
        .filter(|id| {
            h.meta
                .digest_for_keyslot(id)
                .is_some_and(|(_, d)| !d.segments.is_empty())
        })
        .filter_map(|id| id.parse().ok())
        .collect();
    v.sort_unstable();
    v
}

/// cryptsetup's words when a rotation would need more keyslots than are free.
pub const NOT_ENOUGH_KEYSLOTS: &str = "Not enough free keyslots for reencryption.";

/// cryptsetup 2.6.1's count before it asks any passphrase (`_check_luks2_keyslots`): a
/// rotation needs, beside the keyslots there are, one for the reencryption and one for the
/// new key, and without `--key-slot` (`one_keyslot` false) one new keyslot per active
/// keyslot. [`NOT_ENOUGH_KEYSLOTS`] otherwise.
pub fn check_free_keyslots(hdr: &Header, one_keyslot: bool) -> Result<()> {
    let Header::Luks2(h) = hdr else {
        return Ok(());
    };
    let there = h.meta.keyslots.len();
    let active = passphrase_keyslots(hdr).len();
    let new = if one_keyslot { 1 } else { active.max(1) };
    if there + new + 1 > KEYSLOTS_MAX as usize {
        return Err(Error::InvalidArgument(NOT_ENOUGH_KEYSLOTS.into()));
    }
    Ok(())
}

/// What [`init`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    /// The keyslot the passphrase opened (old key); the first one given to [`init_slots`].
    pub old_keyslot: u32,
    /// The new keyslot (new key) of `old_keyslot`; none for a decryption.
    pub new_keyslot: Option<u32>,
    /// Each old keyslot given and the new keyslot made for its passphrase, in order (a
    /// rotation; empty for a decryption or an encryption).
    pub new_keyslots: Vec<(u32, u32)>,
    pub reencrypt_keyslot: u32,
}

fn luks2(hdr: Header) -> Result<Luks2Header> {
    match hdr {
        Header::Luks2(h) => Ok(h),
        Header::Luks1(_) => Err(Error::UnsupportedLuks(
            "reencryption of LUKS1 (convert it to LUKS2 first)".into(),
        )),
    }
}

/// The reencrypt keyslot's area: the rest of the keyslots area after the last used area
/// (4 KiB aligned), as `(offset, end)`.
fn reencrypt_area(h: &Luks2Header) -> Result<(u64, u64)> {
    let start = 2 * h.bin.hdr_size;
    let end = start + h.meta.config.keyslots_size.0;
    let used_end = h
        .meta
        .keyslots
        .values()
        .filter_map(|k| k.area.as_ref().map(|a| a.offset.0 + a.size.0))
        .max()
        .unwrap_or(start)
        .div_ceil(AREA_ALIGN_BYTES)
        * AREA_ALIGN_BYTES;
    if used_end >= end {
        return Err(Error::InvalidArgument(
            "no room left in the keyslots area for the reencryption data".into(),
        ));
    }
    Ok((used_end, end))
}

/// The reencrypt keyslot for `mode`, `direction` and `kind` (checksums with `hash`) over the
/// area `[offset, offset + size)`.
fn reencrypt_keyslot(
    mode: Mode,
    direction: Direction,
    kind: ResilienceKind,
    hash: HashAlg,
    offset: u64,
    size: u64,
) -> Keyslot {
    let mut area_extra = serde_json::Map::new();
    let area_kind = match kind {
        ResilienceKind::None => "none",
        ResilienceKind::Journal => "journal",
        ResilienceKind::Checksum => {
            area_extra.insert("hash".into(), hash.name().into());
            area_extra.insert("sector_size".into(), CHECKSUM_BLOCK_BYTES.into());
            "checksum"
        }
    };
    let mut extra = serde_json::Map::new();
    extra.insert("mode".into(), mode.name().into());
    extra.insert("direction".into(), direction.name().into());
    Keyslot {
        kind: "reencrypt".into(),
        key_size: 1,
        af: None,
        area: Some(crate::luks::json::Area {
            kind: area_kind.into(),
            offset: U64Str(offset),
            size: U64Str(size),
            encryption: None,
            key_size: None,
            extra: area_extra,
        }),
        kdf: None,
        priority: Some(0),
        extra,
    }
}

/// Starts a key rotation on the plain LUKS2 volume whose header is on `dev` (cryptsetup's
/// `reencrypt --init-only`). Nothing is rewritten yet; [`resume`] does that.
pub fn init(dev: &dyn Backend, passphrase: &[u8], opts: &InitOptions<'_>) -> Result<Started> {
    init_on(Devices::one(dev), passphrase, opts)
}

/// The message cryptsetup 2.6 refuses a decryption with, unless the header is detached.
pub const DECRYPT_NEEDS_DETACHED_HEADER: &str =
    "LUKS2 decryption is supported with detached header device only (with data offset set to 0).";

/// [`init`] with the header on its own device. `opts.mode` [`Mode::Decrypt`] starts a
/// decryption as cryptsetup 2.6 does (a detached header with data offset 0 only): no new key
/// or keyslot; the reencrypt keyslot says `decrypt`, `backward`; backup-final is a `linear`
/// segment; the reencryption digest covers the old key alone.
pub fn init_on(devs: Devices<'_>, passphrase: &[u8], opts: &InitOptions<'_>) -> Result<Started> {
    let header = read_header(devs.header)?;
    // A rotation gives every active keyslot a twin for the new key, so one passphrase can
    // start it only on a volume with one active keyslot, or for the one `key_slot` names
    // (cryptsetup's rule for a key file); a decryption takes any keyslot's passphrase.
    if opts.mode == Mode::Reencrypt
        && opts.key_slot.is_none()
        && passphrase_keyslots(&header).len() > 1
    {
        return Err(Error::InvalidArgument(KEY_FILE_NEEDS_ONE_KEYSLOT.into()));
    }
    let mut read = |offset: u64, len: u64| read_area(devs.header, offset, len);
    let (slot, vk) = unlock(&header, passphrase, opts.key_slot, &mut read)?;
    let one = SlotPassphrase {
        slot,
        passphrase: crate::SecretBytes::from_slice(passphrase),
        vk,
    };
    init_checked(devs, header, std::slice::from_ref(&one), opts)
}

/// cryptsetup's words when a key file (one passphrase) is given for a rotation of a volume
/// with several active keyslots and no `--key-slot`.
pub const KEY_FILE_NEEDS_ONE_KEYSLOT: &str =
    "Key file can be used only with --key-slot or with exactly one key slot active.";

/// [`init_on`] with a passphrase for each of several keyslots of the old key (cryptsetup's
/// prompt per active keyslot): each gets a new keyslot for the new key with its passphrase
/// (first free id, in the order given), and the tokens of each old keyslot are assigned to
/// its new one too. The old keyslots, and every other keyslot of the old key, are removed at
/// finalisation, as cryptsetup does. `opts.key_slot` is not read.
pub fn init_slots(
    devs: Devices<'_>,
    slots: &[SlotPassphrase],
    opts: &InitOptions<'_>,
) -> Result<Started> {
    let header = read_header(devs.header)?;
    init_checked(devs, header, slots, opts)
}

fn init_checked(
    devs: Devices<'_>,
    header: Header,
    slots: &[SlotPassphrase],
    opts: &InitOptions<'_>,
) -> Result<Started> {
    let dev = devs.header;
    header.check_requirements()?;
    let mut h = luks2(header)?;
    let seg = h.meta.crypt_segment()?;
    let decrypt = match opts.mode {
        Mode::Reencrypt => false,
        Mode::Decrypt => true,
        Mode::Encrypt => {
            return Err(Error::InvalidArgument(
                "encryption starts from a plaintext device (not from a LUKS2 header)".into(),
            ))
        }
    };
    if decrypt && (!devs.detached() || seg.offset_bytes != 0) {
        return Err(Error::InvalidArgument(DECRYPT_NEEDS_DETACHED_HEADER.into()));
    }
    let Some(first) = slots.first() else {
        return Err(Error::InvalidArgument(
            "a reencryption needs the passphrase of a keyslot".into(),
        ));
    };
    let (old_slot, old_vk) = (first.slot, &first.vk);
    // Each proof still holds for this header: its keyslot is there, of the old key, once.
    let old_did = old_vk.digest_id();
    for (i, sp) in slots.iter().enumerate() {
        let bound = h
            .meta
            .digest_for_keyslot(&sp.slot.to_string())
            .is_some_and(|(id, d)| id == &old_did.to_string() && !d.segments.is_empty());
        if !bound || sp.vk.digest_id() != old_did || slots[..i].iter().any(|o| o.slot == sp.slot) {
            return Err(Error::InvalidArgument(format!(
                "keyslot {} is not an active keyslot of the volume key, or is given twice",
                sp.slot
            )));
        }
    }
    if decrypt && slots.len() != 1 {
        return Err(Error::InvalidArgument(
            "a decryption takes the passphrase of one keyslot".into(),
        ));
    }
    // cryptsetup's bound: the new keyslots and the reencrypt keyslot must fit.
    let new_ids_needed = if decrypt { 0 } else { slots.len() } + 1;
    if h.meta.keyslots.len() + new_ids_needed > KEYSLOTS_MAX as usize {
        return Err(Error::InvalidArgument(NOT_ENOUGH_KEYSLOTS.into()));
    }
    // The PBKDF of each new keyslot, and the digests' (cryptsetup makes the new key's digest
    // with the first keyslot's settings and the reencryption digest with the last one's).
    let kdfs: Vec<KdfRequest> = slots
        .iter()
        .map(|sp| match opts.keyslot_kdf {
            KeyslotKdf::Given => Ok(opts.kdf.clone()),
            KeyslotKdf::SameAsOld => h
                .meta
                .keyslot_params(&sp.slot.to_string())
                .map(|p| KdfRequest::same_as(&p.kdf)),
        })
        .collect::<Result<_>>()?;

    // The new segment's parameters, checked before anything is written.
    let new_cipher = opts.change.cipher.unwrap_or(seg.cipher);
    let new_key_bytes = match opts.change.key_bytes {
        Some(n) => n,
        None if new_cipher != seg.cipher => new_cipher.default_key_bytes(),
        None => old_vk.len(),
    };
    let new_sector = opts.change.sector_size.unwrap_or(seg.sector_size);
    if decrypt {
        if opts.change != SegmentChange::default() {
            return Err(Error::InvalidArgument(
                "a decryption has no new cipher, key size or sector size".into(),
            ));
        }
    } else {
        new_cipher.check_key_len(new_key_bytes)?;
    }
    let align = u64::from(new_sector.bytes().max(seg.sector_size.bytes()));
    let data_bytes = match seg.size {
        crate::luks::json::SegmentSize::Bytes(n) => n,
        crate::luks::json::SegmentSize::Dynamic => {
            devs.data.size().saturating_sub(seg.offset_bytes)
        }
    };
    if data_bytes % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data device is not aligned to encryption sector size ({align} bytes)."
        )));
    }

    // The new key, its digest (bound to backup-final, segment 2, below) and a keyslot for each
    // passphrase, whose material is written first; the header write comes below.
    let mut new_keyslots = Vec::new();
    let (new_vk, mut ops) = if decrypt {
        (None, Vec::new())
    } else {
        let new_key = random_secret(new_key_bytes)?;
        let new_did = free_id(h.meta.digests.keys())?;
        h.meta.digests.insert(
            new_did.to_string(),
            make_digest(&kdfs[0], new_key.as_ref(), vec![], vec![])?,
        );
        let new_vk = VolumeKey::new_verified(new_key, new_did, true);
        let mut ops = Vec::new();
        for (sp, kdf) in slots.iter().zip(&kdfs) {
            let seqid = h.bin.seqid;
            // Its area is encrypted as the old keyslot's is (cryptsetup adds it while the
            // old segment is the default one, with the old keyslot's encryption; a
            // cipher_null one gets cryptsetup's default keyslot cipher).
            let old = h.meta.keyslot_params(&sp.slot.to_string())?;
            let area = if old.area_cipher == CipherSpec::NULL {
                (CipherSpec::AES_XTS_PLAIN64, KEYSLOT_AREA_KEY_BYTES_DEFAULT)
            } else {
                (old.area_cipher, old.area_key_bytes)
            };
            let (new_slot, mut more) = h.add_keyslot_with_area(
                NewKeyslot {
                    vk: &new_vk,
                    passphrase: sp.passphrase(),
                    kdf,
                    slot: None,
                },
                None,
                Some(area),
            )?;
            more.truncate(2); // the material and its flush
            ops.extend(more);
            h.bin.seqid = seqid;
            assign_tokens(&mut h.meta, sp.slot, new_slot);
            new_keyslots.push((sp.slot, new_slot));
        }
        (Some(new_vk), ops)
    };
    let new_slot = new_keyslots.first().map(|&(_, n)| n);

    // The reencrypt keyslot: the rest of the keyslots area after the last used area.
    let (used_end, end) = reencrypt_area(&h)?;
    let rk = free_id(h.meta.keyslots.keys())?;
    let (mode, direction) = if decrypt {
        (Mode::Decrypt, Direction::Backward)
    } else {
        (Mode::Reencrypt, Direction::Forward)
    };
    h.meta.keyslots.insert(
        rk.to_string(),
        reencrypt_keyslot(
            mode,
            direction,
            opts.resilience,
            opts.resilience_hash,
            used_end,
            end - used_end,
        ),
    );

    // Segments: the whole device as it is, then the two backups.
    let live = h
        .meta
        .segments
        .get("0")
        .cloned()
        .ok_or_else(|| bad("segment 0 missing"))?;
    let flagged = |f: &str| {
        let mut s = live.clone();
        s.flags = Some(vec![f.to_string()]);
        s
    };
    let mut fin = flagged("backup-final");
    if decrypt {
        fin.kind = "linear".into();
        fin.iv_tweak = None;
        fin.encryption = None;
        fin.sector_size = None;
    } else {
        fin.encryption = Some(new_cipher.to_string());
        fin.sector_size = Some(new_sector.bytes());
    }
    h.meta.segments = std::collections::BTreeMap::from([
        ("0".to_string(), live.clone()),
        ("1".to_string(), flagged("backup-previous")),
        ("2".to_string(), fin),
    ]);
    h.meta
        .digests
        .get_mut(&old_vk.digest_id().to_string())
        .ok_or(Error::Bug("old key digest vanished"))?
        .segments = vec!["0".into(), "1".into()];
    if let Some(vk) = &new_vk {
        h.meta
            .digests
            .get_mut(&vk.digest_id().to_string())
            .ok_or(Error::Bug("new key digest vanished"))?
            .segments = vec!["2".into()];
    }
    let reqs = h
        .meta
        .config
        .requirements
        .get_or_insert_with(Requirements::default);
    reqs.mandatory
        .get_or_insert_with(Vec::new)
        .push(REQUIREMENT_V2.into());

    // The reencryption digest over the keys and the metadata.
    let st = ReencryptState::from_metadata(&h.meta)?
        .ok_or(Error::Bug("reencryption state not recognised"))?;
    let data = verification_data(
        &h.meta,
        &st,
        Some(old_vk.bytes()),
        new_vk.as_ref().map(VolumeKey::bytes),
    )?;
    let rdid = free_id(h.meta.digests.keys())?;
    let last_kdf = kdfs.last().unwrap_or(opts.kdf);
    h.meta.digests.insert(
        rdid.to_string(),
        make_digest(last_kdf, data.as_ref(), vec![rk.to_string()], vec![])?,
    );
    ops.extend(h.commit()?);
    apply(dev, &ops)?;
    Ok(Started {
        old_keyslot: old_slot,
        new_keyslot: new_slot,
        new_keyslots,
        reencrypt_keyslot: rk,
    })
}

/// The key size of cryptsetup's default keyslot cipher (aes-xts-plain64, 512 bits), which
/// replaces a cipher_null keyslot's encryption in the new keyslot.
const KEYSLOT_AREA_KEY_BYTES_DEFAULT: usize = 64;

/// Assigns every token of keyslot `old` to keyslot `new` as well (appended to its list), as
/// cryptsetup's reencrypt does for each new keyslot; finalisation then drops `old`.
fn assign_tokens(meta: &mut Metadata, old: u32, new: u32) {
    let (old, new) = (old.to_string(), new.to_string());
    for t in meta.tokens.values_mut() {
        if let Some(serde_json::Value::Array(a)) = t.get_mut("keyslots") {
            if a.iter().any(|v| v.as_str() == Some(old.as_str()))
                && !a.iter().any(|v| v.as_str() == Some(new.as_str()))
            {
                a.push(new.clone().into());
            }
        }
    }
}

/// How to start an encryption of a plaintext device ([`init_encrypt`]).
pub struct EncryptOptions<'a> {
    pub resilience: ResilienceKind,
    /// The checksum of [`ResilienceKind::Checksum`] (`--resilience-hash`).
    pub resilience_hash: HashAlg,
    pub kdf: &'a KdfRequest,
    /// The new segment: cipher, key size in bytes, sector size.
    pub cipher: CipherSpec,
    pub key_bytes: usize,
    pub sector_size: SectorSize,
    /// The new header's UUID.
    pub uuid: String,
}

/// The message cryptsetup 2.6 refuses an encryption with, without a detached header.
pub const ENCRYPT_NEEDS_DETACHED_HEADER: &str = "Encryption without detached header (--header) \
     is not possible without data device size reduction (--reduce-device-size).";

/// Starts the encryption of the plaintext on `devs.data` in place, with a new detached LUKS2
/// header on `devs.header` (cryptsetup 2.6's `reencrypt --encrypt --header --init-only`): a
/// header with data offset 0 and a new random volume key, a keyslot for the passphrase, a
/// `reencrypt` keyslot with mode `encrypt`, direction `forward`; segments `0` (the whole
/// device, `linear`), `1` backup-previous (`linear`) and `2` backup-final (`crypt`, the new
/// cipher); the new key's digest listing `2`; the requirement and the reencryption digest over
/// the new key alone. The keyslot's material is written and flushed first, then one header
/// write makes the whole header visible: a crash leaves no header (or the old bytes of the
/// header device) or a header in reencryption, never one that calls the plaintext encrypted.
pub fn init_encrypt(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: &EncryptOptions<'_>,
) -> Result<Started> {
    if !devs.detached() {
        return Err(Error::InvalidArgument(ENCRYPT_NEEDS_DETACHED_HEADER.into()));
    }
    opts.cipher.check_key_len(opts.key_bytes)?;
    let data_bytes = devs.data.size();
    let align = u64::from(opts.sector_size.bytes());
    if data_bytes == 0 || data_bytes % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data device is not aligned to encryption sector size ({align} bytes)."
        )));
    }
    let mut f = crate::luks::luks2::FormatLuks2::defaults(opts.uuid.clone());
    f.cipher = opts.cipher;
    f.key_bytes = opts.key_bytes;
    f.sector_size = opts.sector_size;
    f.kdf = opts.kdf.clone();
    f.data_offset = 0;
    f.detached = true;
    // cryptsetup's default keyslots area, or what a smaller header device holds.
    let room =
        devs.header.size().saturating_sub(2 * f.hdr_size) / AREA_ALIGN_BYTES * AREA_ALIGN_BYTES;
    f.keyslots_size = f.keyslots_size.min(room);
    let (mut h, vk) = crate::luks::luks2::format(&f, random_secret(opts.key_bytes)?)?;
    let seqid = h.bin.seqid;
    let (slot, mut ops) = h.add_keyslot(
        NewKeyslot {
            vk: &vk,
            passphrase,
            kdf: opts.kdf,
            slot: None,
        },
        None,
    )?;
    ops.truncate(2); // the material and its flush; the one header write comes below
    h.bin.seqid = seqid;

    let (used_end, end) = reencrypt_area(&h)?;
    let rk = free_id(h.meta.keyslots.keys())?;
    h.meta.keyslots.insert(
        rk.to_string(),
        reencrypt_keyslot(
            Mode::Encrypt,
            Direction::Forward,
            opts.resilience,
            opts.resilience_hash,
            used_end,
            end - used_end,
        ),
    );
    let crypt = h
        .meta
        .segments
        .get("0")
        .cloned()
        .ok_or(Error::Bug("format made no segment 0"))?;
    let linear = |flag: Option<&str>| crate::luks::json::Segment {
        kind: "linear".into(),
        offset: crypt.offset,
        size: crypt.size,
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        flags: flag.map(|f| vec![f.to_string()]),
        integrity: None,
        extra: Default::default(),
    };
    let mut fin = crypt.clone();
    fin.flags = Some(vec!["backup-final".into()]);
    h.meta.segments = std::collections::BTreeMap::from([
        ("0".to_string(), linear(None)),
        ("1".to_string(), linear(Some("backup-previous"))),
        ("2".to_string(), fin),
    ]);
    h.meta
        .digests
        .get_mut(&vk.digest_id().to_string())
        .ok_or(Error::Bug("new key digest vanished"))?
        .segments = vec!["2".into()];
    h.meta
        .config
        .requirements
        .get_or_insert_with(Requirements::default)
        .mandatory
        .get_or_insert_with(Vec::new)
        .push(REQUIREMENT_V2.into());
    let st = ReencryptState::from_metadata(&h.meta)?
        .ok_or(Error::Bug("reencryption state not recognised"))?;
    let data = verification_data(&h.meta, &st, None, Some(vk.bytes()))?;
    let rdid = free_id(h.meta.digests.keys())?;
    h.meta.digests.insert(
        rdid.to_string(),
        make_digest(opts.kdf, data.as_ref(), vec![rk.to_string()], vec![])?,
    );
    ops.extend(h.commit()?);
    apply(devs.header, &ops)?;
    Ok(Started {
        old_keyslot: slot,
        new_keyslot: Some(slot),
        new_keyslots: Vec::new(),
        reencrypt_keyslot: rk,
    })
}

/// The largest `--reduce-device-size` cryptsetup accepts (1 GiB: a shift of 512 MiB).
pub const REDUCE_BYTES_MAX: u64 = 1 << 30;
/// The reencrypt keyslot's area of a data shift: it holds nothing, so cryptsetup gives it the
/// first free gap of the keyslots area, 4 KiB (cryptsetup 2.6.1 puts it 4096 bytes after
/// keyslot 0's area; `reencrypt_interop`'s
/// `shift_init_matches_cryptsetup_and_each_finishes_the_other` compares the two tools' init).
const SHIFT_AREA_BYTES: u64 = 4096;
/// Largest piece of the first shift copied at a time into the moved segment at init.
const COPY_PIECE_BYTES: u64 = 4 << 20;

/// Copies `len` bytes from `from` to `to` on `dev` (ranges that do not overlap) and flushes,
/// then writes random bytes over `[wipe.0, wipe.0 + wipe.1)` ([`wipe_random`]).
fn copy_then_wipe(dev: &dyn Backend, from: u64, to: u64, len: u64, wipe: (u64, u64)) -> Result<()> {
    copy_across(dev, from, dev, to, len)?;
    dev.flush()?;
    wipe_random(std::iter::once((dev, wipe)))
}

/// Starts the encryption of the plaintext on `dev` in place with the header in front of the
/// data, as cryptsetup 2.6's `reencrypt --encrypt --reduce-device-size R` (without
/// `--header`) does: the last `R` bytes of the device must be free (the filesystem shrunk by
/// `R`); the data moves by the shift `S = R / 2` (the new data offset), and the data grows by
/// `S` when done. `D = size - R` bytes of plaintext are encrypted.
///
/// The header (a new random volume key, keyslot 0 for the passphrase, a `reencrypt` keyslot
/// with mode `encrypt`, direction `backward`, resilience `datashift` with `shift_size` S over
/// a 4 KiB area; the segments of [`crate::luks::reencrypt::plan::Shift`]: `0` the moved segment
/// (linear at `D + S`, S bytes), `1` the plaintext beyond the first shift at its place
/// (linear at S), then backup-moved-segment, backup-previous (linear at 0, D bytes) and
/// backup-final (crypt at S); the `online-reencrypt-v2` requirement; the reencryption digest
/// over the new key) is what cryptsetup 2.6.1 writes (compared field by field in the
/// interop test).
///
/// Writes, in order: the first S bytes of plaintext copied to the moved segment (free
/// space), flush; the header area's keyslots area filled with random bytes (it held that
/// plaintext, as cryptsetup's header restore overwrites it); the keyslot's material, flush;
/// the header. A crash before the header's commit leaves no header, the plaintext beyond the
/// first shift untouched and its first shift in the moved segment.
pub fn init_encrypt_shift(
    dev: &dyn Backend,
    passphrase: &[u8],
    opts: &EncryptOptions<'_>,
    reduce_bytes: u64,
) -> Result<Started> {
    if reduce_bytes == 0 || reduce_bytes % 512 != 0 {
        return Err(Error::InvalidArgument(
            "Reduce size must be multiple of 512 bytes sector.".into(),
        ));
    }
    if reduce_bytes > REDUCE_BYTES_MAX {
        return Err(Error::InvalidArgument(
            "Maximum device reduce size is 1 GiB.".into(),
        ));
    }
    opts.cipher.check_key_len(opts.key_bytes)?;
    if read_header(dev).is_ok() {
        return Err(Error::InvalidArgument(
            "Device is already LUKS device. Aborting operation.".into(),
        ));
    }
    let shift = reduce_bytes / 2;
    let ss = u64::from(opts.sector_size.bytes());
    if shift % ss != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data shift value is not aligned to encryption sector size ({ss} bytes)."
        )));
    }
    let dev_bytes = dev.size();
    // At least one shift of data: cryptsetup 2.6.1 starts with less, but its first hotzone
    // then reads past the moved segment (a layout ucrypt does not take).
    let data_bytes = dev_bytes
        .checked_sub(reduce_bytes)
        .filter(|&d| d >= shift)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "Device is too small: {dev_bytes} bytes hold less than one shift ({shift} \
                 bytes) of data besides the {reduce_bytes} bytes of --reduce-device-size."
            ))
        })?;
    if data_bytes % ss != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data device is not aligned to encryption sector size ({ss} bytes)."
        )));
    }
    let mut f = crate::luks::luks2::FormatLuks2::defaults(opts.uuid.clone());
    f.cipher = opts.cipher;
    f.key_bytes = opts.key_bytes;
    f.sector_size = opts.sector_size;
    f.kdf = opts.kdf.clone();
    f.data_offset = shift;
    // As cryptsetup: the keyslots area is what the shift leaves after the two copies.
    f.keyslots_size = shift
        .checked_sub(2 * f.hdr_size)
        .filter(|&n| n >= AREA_ALIGN_BYTES)
        .ok_or_else(|| {
            Error::InvalidArgument("LUKS2 metadata size is larger than data shift value.".into())
        })?
        / AREA_ALIGN_BYTES
        * AREA_ALIGN_BYTES;
    let (mut h, vk) = crate::luks::luks2::format(&f, random_secret(opts.key_bytes)?)?;
    let seqid = h.bin.seqid;
    let (slot, mut ops) = h.add_keyslot(
        NewKeyslot {
            vk: &vk,
            passphrase,
            kdf: opts.kdf,
            slot: None,
        },
        None,
    )?;
    ops.truncate(2); // the material and its flush; the one header write comes below
    h.bin.seqid = seqid;

    let (used_end, end) = reencrypt_area(&h)?;
    if end - used_end < SHIFT_AREA_BYTES {
        return Err(Error::InvalidArgument(
            "no room left in the keyslots area for the reencrypt keyslot".into(),
        ));
    }
    let rk = free_id(h.meta.keyslots.keys())?;
    let mut ks = reencrypt_keyslot(
        Mode::Encrypt,
        Direction::Backward,
        ResilienceKind::None,
        CHECKSUM_HASH,
        used_end,
        SHIFT_AREA_BYTES,
    );
    if let Some(a) = ks.area.as_mut() {
        a.kind = "datashift".into();
        a.extra
            .insert("shift_size".into(), shift.to_string().into());
    }
    h.meta.keyslots.insert(rk.to_string(), ks);
    let crypt = h
        .meta
        .segments
        .get("0")
        .cloned()
        .ok_or(Error::Bug("format made no segment 0"))?;
    let linear = |offset: u64, size: u64, flag: Option<&str>| crate::luks::json::Segment {
        kind: "linear".into(),
        offset: U64Str(offset),
        size: crate::luks::json::SegmentSize::Bytes(size),
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        flags: flag.map(|f| vec![f.to_string()]),
        integrity: None,
        extra: Default::default(),
    };
    let moved_offset = data_bytes + shift;
    let mut segs = vec![linear(moved_offset, shift, None)];
    if data_bytes > shift {
        segs.push(linear(shift, data_bytes - shift, None));
    }
    segs.push(linear(moved_offset, shift, Some("backup-moved-segment")));
    segs.push(linear(0, data_bytes, Some("backup-previous")));
    let mut fin = crypt;
    fin.flags = Some(vec!["backup-final".into()]);
    segs.push(fin);
    let final_id = segs.len() - 1;
    h.meta.segments = segs
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i.to_string(), s))
        .collect();
    h.meta
        .digests
        .get_mut(&vk.digest_id().to_string())
        .ok_or(Error::Bug("new key digest vanished"))?
        .segments = vec![final_id.to_string()];
    h.meta
        .config
        .requirements
        .get_or_insert_with(Requirements::default)
        .mandatory
        .get_or_insert_with(Vec::new)
        .push(REQUIREMENT_V2.into());
    let st = ReencryptState::from_metadata(&h.meta)?
        .ok_or(Error::Bug("reencryption state not recognised"))?;
    let data = verification_data(&h.meta, &st, None, Some(vk.bytes()))?;
    let rdid = free_id(h.meta.digests.keys())?;
    h.meta.digests.insert(
        rdid.to_string(),
        make_digest(opts.kdf, data.as_ref(), vec![rk.to_string()], vec![])?,
    );
    // What is written is what the planner reads back: the start of the walk.
    check_layout(&h.meta, &st, data_bytes)?;
    if position(&h.meta, &st, data_bytes)?
        != (Position {
            done: 0,
            hotzone: None,
        })
    {
        return Err(Error::Bug("a new data shift does not start at the end"));
    }
    ops.extend(h.commit()?);
    let hdr_end = 2 * h.bin.hdr_size;
    copy_then_wipe(dev, 0, moved_offset, shift, (hdr_end, shift - hdr_end))?;
    apply(dev, &ops)?;
    Ok(Started {
        old_keyslot: slot,
        new_keyslot: Some(slot),
        new_keyslots: Vec::new(),
        reencrypt_keyslot: rk,
    })
}

/// The moved segment of a decryption that moves the data, unless `--hotzone-size` says
/// otherwise: the shift, at most this (cryptsetup 2.6's `LUKS2_DEFAULT_NONE_REENCRYPTION_LENGTH`,
/// 20 MiB), at most the data.
pub const MOVED_BYTES_DEFAULT: u64 = 20 << 20;

/// How to start a decryption that moves the data back ([`init_decrypt_unshift`]).
pub struct UnshiftOptions<'a> {
    /// Whether the reencryption digest is calibrated (forced iterations use the minimum).
    pub kdf: &'a KdfRequest,
    /// The keyslot the passphrase opens (`--key-slot`); without it the volume must have
    /// exactly one keyslot.
    pub key_slot: Option<u32>,
    /// `--hotzone-size`: the moved segment's size (at most the shift); `None`:
    /// [`MOVED_BYTES_DEFAULT`] or less.
    pub moved_bytes: Option<u64>,
    /// How the moved segment's hotzone is protected: [`ResilienceKind::Checksum`]
    /// (`datashift-checksum`, cryptsetup's default) or [`ResilienceKind::Journal`]
    /// (`datashift-journal`: its old ciphertext copied to the reencrypt keyslot's area, which
    /// must hold the whole moved segment); `None` is refused, as cryptsetup refuses it.
    pub resilience: ResilienceKind,
    /// The checksum of the moved segment (`--resilience-hash`).
    pub resilience_hash: HashAlg,
}

/// Copies `len` bytes from `src` at `from` to `dst` at `to` through one buffer of at most
/// [`COPY_PIECE_BYTES`] (the ranges do not overlap if `src` is `dst`). No flush.
fn copy_across(src: &dyn Backend, from: u64, dst: &dyn Backend, to: u64, len: u64) -> Result<()> {
    let page = crate::pool::POOL_PAGE_BYTES as u64;
    let piece = len.clamp(page, COPY_PIECE_BYTES).div_ceil(page) * page;
    let pool = BufferPool::new(piece as usize)?;
    let mut g = pool.take(piece as usize)?;
    let buf = g.as_mut_slice();
    let mut at = 0;
    while at < len {
        let n = (len - at).min(piece) as usize;
        src.read_exact_at(&mut buf[..n], from + at)?;
        dst.write_at(&buf[..n], to + at)?;
        at += n as u64;
    }
    Ok(())
}

/// Bytes zeroed over each binary header copy left on the data device (a whole 512-byte
/// sector holding the magic), so that nothing finds a LUKS header there once the data is
/// moved: cryptsetup wipes the signatures too before it moves anything.
const MAGIC_WIPE_BYTES: usize = 512;

/// Starts the decryption of the LUKS2 volume whose header is in front of its data on
/// `devs.data`, moving the plaintext to the start of the device, as cryptsetup 2.6's
/// `reencrypt --decrypt --header NEW.hdr` does when NEW.hdr does not exist: the header is
/// exported to `devs.header` (a new file of at least the metadata and keyslots area) and
/// carries the reencryption from then on; the walk is [`Unshift`]'s.
///
/// The exported header, as cryptsetup 2.6.1 writes it (compared field by field in the interop
/// test): the old header, plus a `reencrypt` keyslot (mode `decrypt`, direction `forward`,
/// area `datashift-checksum` with sha256 (or `--resilience-hash`) over 4096-byte blocks and `shift_size` = the old data
/// offset `S`, over the rest of the keyslots area); segments `0` crypt at 0 (the moved
/// segment: `M` bytes, IV tweak 0), `1` crypt at `S + M` (the rest of the ciphertext, IV tweak
/// `M / 512`, dynamic), `2` backup-moved-segment (as `0`), `3` backup-previous (crypt at `S`,
/// dynamic), `4` backup-final (linear at 0, dynamic); the old key's digest listing 0-3; the
/// `online-reencrypt-v3` requirement; the reencryption digest (version 3) over the old key.
///
/// Everything is checked before the first write. Writes, in order: the old header and
/// keyslots area copied to `devs.header`, flushed (from here the volume opens with the new
/// file as its detached header); the magic of both header copies on the data device zeroed;
/// the ciphertext of the first `M` bytes copied over the header (the moved segment), flushed;
/// the new header committed. A crash before that commit leaves the data at its place and a
/// plain detached header describing it.
pub fn init_decrypt_unshift(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: &UnshiftOptions<'_>,
) -> Result<Started> {
    if !devs.detached() {
        return Err(Error::InvalidArgument(
            "a decryption that moves the data exports the header to a new file (--header)".into(),
        ));
    }
    let header = read_header(devs.data)?;
    header.check_requirements()?;
    let mut h = luks2(header)?;
    let seg = h.meta.crypt_segment()?;
    if h.meta.segments.len() != 1 || seg.iv_tweak != 0 {
        return Err(Error::UnsupportedLuks(
            "a decryption that moves the data of a volume with more than one segment or an \
             IV tweak"
                .into(),
        ));
    }
    let s = seg.offset_bytes;
    if s == 0 {
        return Err(Error::InvalidArgument(
            "the data starts at offset 0: there is no header in front to move it over".into(),
        ));
    }
    let crate::luks::json::SegmentSize::Dynamic = seg.size else {
        return Err(Error::UnsupportedLuks(
            "a decryption that moves the data of a segment with a fixed size (ucrypt moves a \
             segment that runs to the end of the device)"
                .into(),
        ));
    };
    let luks2_slots = h
        .meta
        .keyslots
        .values()
        .filter(|k| k.kind == KeyslotKind::Luks2)
        .count();
    if opts.key_slot.is_none() && luks2_slots != 1 {
        return Err(Error::InvalidArgument(
            "Key file can be used only with --key-slot or with exactly one key slot active.".into(),
        ));
    }
    let hdr_any = Header::Luks2(h.clone());
    let mut read = |offset: u64, len: u64| read_area(devs.data, offset, len);
    let (old_slot, old_vk) = unlock(&hdr_any, passphrase, opts.key_slot, &mut read)?;

    let ss = u64::from(seg.sector_size.bytes());
    let data_bytes = devs.data.size().saturating_sub(s) / ss * ss;
    if data_bytes == 0 {
        return Err(Error::InvalidArgument(format!(
            "Device is too small: no data past the data offset {s}."
        )));
    }
    // Every hotzone is a whole number of checksum blocks and sectors (cryptsetup's zone
    // alignment, 4096 bytes on files for both sector sizes in cryptsetup 2.6.1).
    let align = ss.max(u64::from(CHECKSUM_BLOCK_BYTES));
    let moved_bytes = match opts.moved_bytes {
        Some(m) if m > s => {
            return Err(Error::InvalidArgument(
                "Moved segment size can not be greater than data shift value.".into(),
            ))
        }
        Some(m) => m,
        None => s.min(MOVED_BYTES_DEFAULT),
    }
    .min(data_bytes);
    if moved_bytes == 0 || moved_bytes % align != 0 || s % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "Hotzone size must be multiple of calculated zone alignment ({align} bytes)."
        )));
    }
    if moved_bytes > HOTZONE_BYTES_MAX {
        return Err(Error::InvalidArgument(format!(
            "A moved segment of {moved_bytes} bytes is larger than ucrypt's hotzone buffer \
             ({HOTZONE_BYTES_MAX} bytes): give a smaller --hotzone-size."
        )));
    }
    let meta_bytes = 2 * h.bin.hdr_size + h.meta.config.keyslots_size.0;
    if meta_bytes > s {
        return Err(Error::BadHeader {
            check: "reencrypt-datashift",
            detail: format!("the metadata ({meta_bytes} bytes) runs past the data offset {s}"),
        });
    }
    if devs.header.size() < meta_bytes {
        return Err(Error::InvalidArgument(format!(
            "The header device holds {} bytes, the header to export {meta_bytes}.",
            devs.header.size()
        )));
    }

    // The reencrypt keyslot: datashift-checksum (or -journal) over the rest of the keyslots
    // area, which must hold the moved segment's checksums (or the moved segment).
    let (used_end, end) = reencrypt_area(&h)?;
    let area_bytes = end - used_end;
    let (room, kind) = match opts.resilience {
        ResilienceKind::Checksum => (
            area_bytes / opts.resilience_hash.output_bytes() as u64
                * u64::from(CHECKSUM_BLOCK_BYTES),
            "datashift-checksum",
        ),
        ResilienceKind::Journal => (area_bytes, "datashift-journal"),
        // cryptsetup 2.6.1's words.
        ResilienceKind::None => {
            return Err(Error::InvalidArgument(
                "Requested --resilience option cannot be applied to current reencryption \
                 operation."
                    .into(),
            ))
        }
    };
    if moved_bytes > room {
        return Err(Error::InvalidArgument(format!(
            "Moved segment too large. Requested size {moved_bytes}, available space for: \
             {room}."
        )));
    }
    let rk = free_id(h.meta.keyslots.keys())?;
    let mut ks = reencrypt_keyslot(
        Mode::Decrypt,
        Direction::Forward,
        opts.resilience,
        opts.resilience_hash,
        used_end,
        area_bytes,
    );
    if let Some(a) = ks.area.as_mut() {
        a.kind = kind.into();
        a.extra.insert("shift_size".into(), s.to_string().into());
    }
    h.meta.keyslots.insert(rk.to_string(), ks);

    // Segments, in cryptsetup's order at init: the moved segment, the rest of the ciphertext
    // at its place, then backup-moved-segment, backup-previous, backup-final.
    let crypt = |offset: u64, size: crate::luks::json::SegmentSize, iv: u64, flag: Option<&str>| {
        crate::luks::json::Segment {
            kind: "crypt".into(),
            offset: U64Str(offset),
            size,
            iv_tweak: Some(U64Str(iv)),
            encryption: Some(seg.cipher.to_string()),
            sector_size: Some(seg.sector_size.bytes()),
            flags: flag.map(|f| vec![f.to_string()]),
            integrity: None,
            extra: Default::default(),
        }
    };
    let moved = crate::luks::json::SegmentSize::Bytes(moved_bytes);
    let dynamic = crate::luks::json::SegmentSize::Dynamic;
    let mut segs = vec![crypt(0, moved, 0, None)];
    if data_bytes > moved_bytes {
        segs.push(crypt(s + moved_bytes, dynamic, moved_bytes / 512, None));
    }
    segs.push(crypt(0, moved, 0, Some("backup-moved-segment")));
    segs.push(crypt(s, dynamic, 0, Some("backup-previous")));
    segs.push(crate::luks::json::Segment {
        kind: "linear".into(),
        offset: U64Str(0),
        size: dynamic,
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        flags: Some(vec!["backup-final".into()]),
        integrity: None,
        extra: Default::default(),
    });
    let old_list: Vec<String> = (0..segs.len() - 1).map(|i| i.to_string()).collect();
    h.meta.segments = segs
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i.to_string(), s))
        .collect();
    h.meta
        .digests
        .get_mut(&old_vk.digest_id().to_string())
        .ok_or(Error::Bug("old key digest vanished"))?
        .segments = old_list;
    h.meta
        .config
        .requirements
        .get_or_insert_with(Requirements::default)
        .mandatory
        .get_or_insert_with(Vec::new)
        .push(REQUIREMENT_V3.into());
    let st = ReencryptState::from_metadata(&h.meta)?
        .ok_or(Error::Bug("reencryption state not recognised"))?;
    let data = verification_data(&h.meta, &st, Some(old_vk.bytes()), None)?;
    let rdid = free_id(h.meta.digests.keys())?;
    h.meta.digests.insert(
        rdid.to_string(),
        make_digest(opts.kdf, data.as_ref(), vec![rk.to_string()], vec![])?,
    );
    // What is written is what the planner reads back: the start of the walk.
    let geometry = unshift_geometry(&h.meta, &st, data_bytes)?.ok_or(Error::Bug(
        "a new decryption that moves the data is not one",
    ))?;
    check_layout(&h.meta, &st, data_bytes)?;
    if position(&h.meta, &st, data_bytes)?
        != (Position {
            done: 0,
            hotzone: None,
        })
        || geometry.moved_bytes != moved_bytes
    {
        return Err(Error::Bug(
            "a new decryption that moves the data does not start",
        ));
    }
    let ops = h.commit()?;

    copy_across(devs.data, 0, devs.header, 0, meta_bytes)?;
    devs.header.flush()?;
    let zeros = [0u8; MAGIC_WIPE_BYTES];
    for copy in [0, h.bin.hdr_size] {
        devs.data.write_at(&zeros, copy)?;
    }
    copy_across(devs.data, s, devs.data, 0, moved_bytes)?;
    devs.data.flush()?;
    apply(devs.header, &ops)?;
    Ok(Started {
        old_keyslot: old_slot,
        new_keyslot: None,
        new_keyslots: Vec::new(),
        reencrypt_keyslot: rk,
    })
}

/// A volume in rotation, unlocked: header, state, both keys checked against the
/// reencryption digest.
struct Unlocked {
    h: Luks2Header,
    st: ReencryptState,
    protect: Protect,
    /// One (old, new) cipher pair per worker thread, keyed once; `None` for a linear
    /// (plaintext) side: the old one of an encryption, the new one of a decryption.
    lanes: Vec<Lane>,
    /// The threads of every lane but the first, started when the hotzones start
    /// ([`run_hotzones`]); `None` before, and with one lane.
    crew: Option<Crew>,
    /// Where the data is read (backup-previous's offset) and written (backup-final's): the
    /// same but for a data shift.
    data_offset: u64,
    new_offset: u64,
    data_bytes: u64,
    align: u64,
    /// The geometry of a data shift ([`Shift`]); `None` in place.
    shift: Option<Shift>,
    /// The geometry of a decryption that moves the data back ([`Unshift`]).
    unshift: Option<Unshift>,
    /// The new cipher, volume key and sector size, for a volume that serves the data
    /// meanwhile ([`Serving::start`]); `None` for a decryption (the new side is linear).
    new_key: Option<NewKey>,
}

/// The new side of a reencryption, for a volume that serves the data meanwhile.
type NewKey = (CipherSpec, crate::SecretBytes, SectorSize);

/// The ciphers of one worker thread.
type Lane = (Option<SectorCipher>, Option<SectorCipher>);

/// How a step spreads over threads: its lanes, and the crew that runs all but the first
/// ([`share_out`]; scoped threads without one).
#[derive(Clone, Copy)]
struct Spread<'a> {
    lanes: usize,
    crew: Option<&'a Crew>,
}

impl Unlocked {
    fn spread(&self) -> Spread<'_> {
        Spread {
            lanes: self.lanes.len(),
            crew: self.crew.as_ref(),
        }
    }
}

/// The header device and the data device of a reencryption: the same backend for a volume
/// with its header in front, two for a detached header (`--header`).
#[derive(Clone, Copy)]
pub struct Devices<'a> {
    pub header: &'a dyn Backend,
    pub data: &'a dyn Backend,
}

impl<'a> Devices<'a> {
    /// Header and data on one device.
    pub fn one(dev: &'a dyn Backend) -> Self {
        Devices {
            header: dev,
            data: dev,
        }
    }

    fn detached(&self) -> bool {
        !std::ptr::addr_eq(
            self.header as *const dyn Backend,
            self.data as *const dyn Backend,
        )
    }

    /// Flushes the data device, and the header device when it is another one.
    fn flush(&self) -> Result<()> {
        self.data.flush()?;
        if self.detached() {
            self.header.flush()?;
        }
        Ok(())
    }
}

pub(crate) fn unlock_digest(
    dev: &dyn Backend,
    hdr: &Header,
    meta: &Metadata,
    did: u32,
    passphrase: &[u8],
) -> Result<VolumeKey> {
    let slots = meta
        .digests
        .get(&did.to_string())
        .map(|d| d.keyslots.clone())
        .unwrap_or_default();
    let mut read = |offset: u64, len: u64| read_area(dev, offset, len);
    let mut last = Error::NoUsableKeyslot;
    for s in slots.iter().filter_map(|s| s.parse::<u32>().ok()) {
        match unlock(hdr, passphrase, Some(s), &mut read) {
            Ok((_, vk)) => return Ok(vk),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The cipher of segment `seg` (`None` for a linear one, with no key), its offset and its
/// sector size (512 for linear, as cryptsetup counts it).
fn cipher_of(
    meta: &Metadata,
    seg: u32,
    key: Option<&VolumeKey>,
) -> Result<(Option<SectorCipher>, u64, u64)> {
    let s = meta
        .segments
        .get(&seg.to_string())
        .ok_or_else(|| bad(format!("segment {seg} missing")))?;
    let key = match (&s.kind, key) {
        (SegmentKind::Linear, None) => return Ok((None, s.offset.0, 512)),
        (SegmentKind::Crypt, Some(k)) => k,
        (kind, k) => {
            return Err(bad(format!(
                "segment {seg} of type {kind} with{} a key",
                if k.is_some() { "" } else { "out" }
            )))
        }
    };
    let spec = s
        .encryption
        .as_deref()
        .ok_or_else(|| bad("crypt segment lacks encryption"))?
        .parse()?;
    let ss = SectorSize::new(u64::from(s.sector_size.unwrap_or(512)))?;
    let geometry = Geometry {
        sector_size: ss,
        iv_offset: s.iv_tweak.map_or(0, |v| v.0),
        iv_large_sectors: false,
    };
    Ok((
        Some(SectorCipher::new(spec, key.bytes(), geometry)?),
        s.offset.0,
        u64::from(ss.bytes()),
    ))
}

fn open_rotation(
    devs: Devices<'_>,
    passphrase: &[u8],
    asked: Option<ResilienceAsked>,
) -> Result<Unlocked> {
    let dev = devs.header;
    let header = read_header(dev)?;
    let hdr_any = header.clone();
    let mut h = luks2(header)?;
    let mut st = ReencryptState::from_metadata(&h.meta)?.ok_or_else(|| {
        Error::InvalidArgument("the device is not in reencryption (nothing to resume)".into())
    })?;
    let mut protect = check_supported(&st)?;
    let d_old = digest_of_segment(&h.meta, st.backup_previous);
    let d_new = digest_of_segment(&h.meta, st.backup_final);
    let new_vk = d_new
        .map(|d| unlock_digest(dev, &hdr_any, &h.meta, d, passphrase))
        .transpose()?;
    let old_vk = d_old
        .map(|d| unlock_digest(dev, &hdr_any, &h.meta, d, passphrase))
        .transpose()?;
    h.verify_reencrypt_digest(old_vk.as_ref(), new_vk.as_ref())?;
    if let Some(asked) = asked {
        let keys = (old_vk.as_ref(), new_vk.as_ref());
        if switch_resilience(dev, &mut h, &mut st, asked, keys)? {
            protect = check_supported(&st)?;
        }
    }
    let (old, off_old, ss_old) = cipher_of(&h.meta, st.backup_previous, old_vk.as_ref())?;
    let (new, off_new, ss_new) = cipher_of(&h.meta, st.backup_final, new_vk.as_ref())?;
    let new_key = new.as_ref().zip(new_vk.as_ref()).map(|(c, k)| {
        let ss = c.geometry().sector_size;
        (c.spec(), crate::SecretBytes::from_slice(k.bytes()), ss)
    });
    let shift = shift_geometry(&h.meta, &st)?;
    let align = ss_old.max(ss_new);
    let data_bytes = match shift {
        Some(sh) => {
            // The moved segment must be on the device, and the data a whole number of
            // sectors (cryptsetup checks both at init).
            sh.check_device(devs.data.size())?;
            if sh.data_bytes % align != 0 || sh.shift_bytes % align != 0 {
                return Err(bad(format!(
                    "data of {} bytes shifted by {} is not aligned to {align}-byte sectors",
                    sh.data_bytes, sh.shift_bytes
                )));
            }
            sh.data_bytes
        }
        None => {
            if off_old != off_new && !matches!(protect, Protect::Unshift(_)) {
                return Err(Error::UnsupportedLuks(
                    "reencryption that moves the data other than an encryption with the \
                     header in front (ucrypt reencrypts in place)"
                        .into(),
                ));
            }
            let seg = &h.meta.segments[&st.backup_previous.to_string()];
            let n = match seg.size {
                crate::luks::json::SegmentSize::Bytes(n) => n,
                crate::luks::json::SegmentSize::Dynamic => devs
                    .data
                    .size()
                    .checked_sub(off_old)
                    .ok_or_else(|| bad("the device ends before its data offset"))?,
            };
            n / align * align
        }
    };
    let unshift = unshift_geometry(&h.meta, &st, data_bytes)?;
    if let Some(us) = unshift {
        us.check_device(devs.data.size())?;
        // The moved segment's hotzone is rewritten in place from one buffer.
        if us.moved_bytes > HOTZONE_BYTES_MAX {
            return Err(Error::UnsupportedLuks(format!(
                "a moved segment of {} bytes (ucrypt's hotzone buffer holds at most {})",
                us.moved_bytes, HOTZONE_BYTES_MAX
            )));
        }
    }
    check_layout(&h.meta, &st, data_bytes)?;
    let n = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, REKEY_LANES_MAX);
    let mut lanes = Vec::with_capacity(n);
    for _ in 1..n {
        lanes.push((
            old.as_ref().map(SectorCipher::try_clone).transpose()?,
            new.as_ref().map(SectorCipher::try_clone).transpose()?,
        ));
    }
    lanes.push((old, new));
    Ok(Unlocked {
        h,
        st,
        protect,
        lanes,
        crew: None,
        data_offset: off_old,
        new_offset: off_new,
        data_bytes,
        align,
        shift,
        unshift,
        new_key,
    })
}

/// Rewrites the reencrypt keyslot's area for the resilience `asked` (its offset and size
/// kept) and the reencryption digest over it with the volume `keys` (old, new), and commits
/// the header: what cryptsetup 2.6 does when a resume names another resilience. Returns
/// whether anything changed; nothing is written when `asked` is what the header has.
///
/// In place, `checksum`, `journal` and `none` replace each other. A decryption that moves the
/// data back switches between `datashift-checksum` and `datashift-journal` (asked as those
/// or as `checksum` and `journal`, as cryptsetup's command line maps them) when the area
/// holds the moved segment's checksums or copy. Refused with nothing written: a volume left
/// inside a hotzone (its recovery needs the resilience it was written with), any other
/// change (cryptsetup's words), and a moved segment the new type's area cannot hold.
/// Crash-safe as any header commit: both copies, the new one or the old one.
fn switch_resilience(
    dev: &dyn Backend,
    h: &mut Luks2Header,
    st: &mut ReencryptState,
    asked: ResilienceAsked,
    keys: (Option<&VolumeKey>, Option<&VolumeKey>),
) -> Result<bool> {
    use crate::luks::reencrypt::Resilience as R;
    use ResilienceAsked as A;
    // cryptsetup 2.6.1's words (its command line's).
    let cannot = || {
        Error::InvalidArgument(
            "Requested --resilience option cannot be applied to current reencryption operation."
                .into(),
        )
    };
    let wanted = match (&st.keyslot.resilience, asked) {
        (R::Datashift { .. }, A::Datashift) => return Ok(false),
        // cryptsetup 2.6.1's words.
        (R::Datashift { .. }, _) => {
            return Err(Error::InvalidArgument(
                "Device is in reencryption using datashift resilience. Requested --resilience \
                 option cannot be applied."
                    .into(),
            ))
        }
        (
            R::DatashiftChecksum { shift_size, .. } | R::DatashiftJournal { shift_size },
            A::DatashiftChecksum(hash) | A::InPlace(ResilienceKind::Checksum, hash),
        ) => R::DatashiftChecksum {
            hash: hash.name().into(),
            sector_size: CHECKSUM_BLOCK_BYTES,
            shift_size: *shift_size,
        },
        (
            R::DatashiftChecksum { shift_size, .. } | R::DatashiftJournal { shift_size },
            A::DatashiftJournal | A::InPlace(ResilienceKind::Journal, _),
        ) => R::DatashiftJournal {
            shift_size: *shift_size,
        },
        (R::None | R::Checksum { .. } | R::Journal, A::InPlace(kind, hash)) => match kind {
            ResilienceKind::None => R::None,
            ResilienceKind::Journal => R::Journal,
            ResilienceKind::Checksum => R::Checksum {
                hash: hash.name().into(),
                sector_size: CHECKSUM_BLOCK_BYTES,
            },
        },
        _ => return Err(cannot()),
    };
    if wanted == st.keyslot.resilience {
        return Ok(false);
    }
    if st.needs_recovery() {
        return Err(Error::NeedsRecovery);
    }
    // The moved segment's hotzone must fit what the new type keeps in the area.
    if let Some(moved) = st.backup_moved {
        let moved_bytes = match h.meta.segments.get(&moved.to_string()).map(|s| s.size) {
            Some(crate::luks::json::SegmentSize::Bytes(n)) => n,
            _ => return Err(bad("the moved segment has no fixed size")),
        };
        let area = st.keyslot.area_bytes;
        let max = match &wanted {
            R::DatashiftChecksum { hash, .. } => {
                area / HashAlg::from_name(hash)?.output_bytes() as u64
                    * u64::from(CHECKSUM_BLOCK_BYTES)
            }
            _ => area,
        };
        if moved_bytes > max {
            // cryptsetup 2.6.1's words.
            return Err(Error::InvalidArgument(format!(
                "Can not update resilience type. New type only provides {max} bytes, required \
                 space is: {moved_bytes} bytes."
            )));
        }
    }
    let rk = st.keyslot.id.to_string();
    let area = h
        .meta
        .keyslots
        .get_mut(&rk)
        .and_then(|k| k.area.as_mut())
        .ok_or(Error::Bug("the reencrypt keyslot has no area"))?;
    for field in ["hash", "sector_size", "shift_size"] {
        area.extra.remove(field);
    }
    area.kind = wanted.name().into();
    let (sums, shift) = match &wanted {
        R::Checksum { hash, sector_size } => (Some((hash, sector_size)), None),
        R::DatashiftChecksum {
            hash,
            sector_size,
            shift_size,
        } => (Some((hash, sector_size)), Some(shift_size)),
        R::DatashiftJournal { shift_size } => (None, Some(shift_size)),
        _ => (None, None),
    };
    if let Some((hash, sector_size)) = sums {
        area.extra.insert("hash".into(), hash.as_str().into());
        area.extra
            .insert("sector_size".into(), (*sector_size).into());
    }
    if let Some(shift) = shift {
        // A string, as cryptsetup writes 64-bit numbers.
        area.extra
            .insert("shift_size".into(), shift.to_string().into());
    }
    *st = ReencryptState::from_metadata(&h.meta)?
        .ok_or(Error::Bug("reencryption state not recognised"))?;
    let data = verification_data(
        &h.meta,
        st,
        keys.0.map(VolumeKey::bytes),
        keys.1.map(VolumeKey::bytes),
    )?;
    let (id, old_digest) = h
        .meta
        .digest_for_keyslot(&rk)
        .ok_or(Error::Bug("the reencrypt keyslot has no digest"))?;
    let id = id.clone();
    // The digest's hash and cost kept (it was verified with them), with a new salt.
    let hash = old_digest
        .hash
        .as_deref()
        .map(HashAlg::from_name)
        .transpose()?
        .unwrap_or(HashAlg::Sha256);
    let iterations = old_digest
        .iterations
        .unwrap_or(PBKDF2_ITERATIONS_MIN)
        .max(PBKDF2_ITERATIONS_MIN);
    let digest = make_digest_with(hash, iterations, data.as_ref(), vec![rk], vec![])?;
    h.meta.digests.insert(id, digest);
    let mut ops = h.commit()?;
    ops.push(WriteOp::Sync);
    apply(dev, &ops)?;
    Ok(true)
}

/// Progress of a rotation: bytes under the new key, of `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// How to run the hotzones ([`resume`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// `--hotzone-size`: the largest hotzone; `None`: [`HOTZONE_BYTES_DEFAULT`].
    pub hotzone_bytes: Option<u64>,
    /// A resilience to switch to before the next hotzone ([`ResilienceAsked`]); `None` keeps
    /// the reencryption's own.
    pub resilience: Option<ResilienceAsked>,
}

/// Where the lanes hand each chunk they finished (its data offset, or its offset in the
/// buffer; its bytes): a write, made one lane at a time where the backend it goes to takes
/// writes one at a time anyway ([`Backend::serializes_writes`], [`TakeTurns`]), else by each
/// lane for its own chunks.
#[derive(Clone, Copy)]
struct Sink<'a> {
    write: &'a (dyn Fn(u64, &[u8]) -> Result<()> + Sync),
    in_turns: bool,
}

impl<'a> Sink<'a> {
    /// Nothing: the chunk stays in the buffer.
    const KEEP: Sink<'static> = Sink {
        write: &|_, _| Ok(()),
        in_turns: false,
    };

    /// `write`, which writes to `dev`.
    fn to(dev: &dyn Backend, write: &'a (dyn Fn(u64, &[u8]) -> Result<()> + Sync)) -> Self {
        Sink {
            write,
            in_turns: dev.serializes_writes(),
        }
    }
}

/// A [`Sink`] for one share-out of `chunks` chunks of a buffer that lives for `'b`.
struct Handing<'a, 'b> {
    sink: Sink<'a>,
    turns: TakeTurns<(u64, &'b [u8])>,
}

impl<'a, 'b> Handing<'a, 'b> {
    fn new(sink: Sink<'a>, chunks: usize) -> Self {
        let cap = if sink.in_turns { chunks } else { 0 };
        Handing {
            sink,
            turns: TakeTurns::new(cap),
        }
    }

    fn hand(&self, at: u64, bytes: &'b [u8]) -> Result<()> {
        if self.sink.in_turns {
            self.turns
                .take((at, bytes), &|(o, c)| (self.sink.write)(o, c))
        } else {
            (self.sink.write)(at, bytes)
        }
    }

    /// After every lane returned `Ok`: each chunk handed was written.
    fn finished(&self) -> Result<()> {
        match self.turns.left() {
            0 => Ok(()),
            _ => Err(Error::Bug(
                "a chunk handed to the writing lane was not written",
            )),
        }
    }
}

/// Decrypts `buf` (the old bytes at data offset `offset`) with the old key and encrypts it
/// with the new one, in place (a linear side is left as it is): cut into chunks of
/// [`LANE_CHUNK_BYTES`] (whole `align` units) shared out among the lanes ([`share_out`]), each
/// on its own thread with its own ciphers; one lane for buffers under [`LANE_BYTES_MIN`].
fn rekey(u: &mut Unlocked, offset: u64, buf: &mut [u8]) -> Result<()> {
    rekey_then(u, offset, buf, Sink::KEEP)
}

/// [`rekey`], each lane then handing its bytes (data offset, bytes) to `then` — the write of
/// the new ciphertext, so that the lanes' writes overlap each other's crypto and the copies
/// into the device run on every lane (or on one lane at a time, where the backend takes
/// writes one at a time anyway: [`Sink`]). Each chunk is decrypted, encrypted and handed on
/// while it is in the CPU's cache: one pass over memory instead of three.
fn rekey_then(u: &mut Unlocked, offset: u64, buf: &mut [u8], then: Sink<'_>) -> Result<()> {
    rekey_stream(u, offset, buf, &|_, _| Ok(()), then)
}

/// [`rekey_then`], each chunk first filled by `fill` (data offset, bytes): the read of the
/// old ciphertext, where nothing else needs the hotzone whole in memory (no resilience data),
/// so that every byte is read, rekeyed and written while it is in the cache.
fn rekey_stream(
    u: &mut Unlocked,
    offset: u64,
    buf: &mut [u8],
    fill: &(dyn Fn(u64, &mut [u8]) -> Result<()> + Sync),
    then: Sink<'_>,
) -> Result<()> {
    let lanes = if buf.len() < LANE_BYTES_MIN {
        1
    } else {
        u.lanes.len()
    };
    let align = u.align as usize;
    assert!(
        align > 0 && LANE_CHUNK_BYTES % align == 0,
        "a lane's chunk holds whole sectors"
    );
    let then = Handing::new(then, buf.len().div_ceil(LANE_CHUNK_BYTES));
    let chunks = buf
        .chunks_mut(LANE_CHUNK_BYTES)
        .enumerate()
        .map(|(i, c)| (offset + (i * LANE_CHUNK_BYTES) as u64, c));
    share_out(
        u.crew.as_ref(),
        u.lanes.iter_mut().take(lanes),
        chunks,
        "rekey thread panicked",
        |lane: &mut &mut Lane, (o, c)| {
            fill(o, c)?;
            rekey_chunk(lane, o, c)?;
            then.hand(o, c)
        },
    )?;
    then.finished()
}

/// One lane's rekey of `b`, the old bytes at data offset `offset`: decrypted with the old
/// cipher and encrypted with the new one, in place, sector numbers counted from the data
/// offset (a linear side, `None`, is left as it is).
fn rekey_chunk((old, new): &mut Lane, offset: u64, b: &mut [u8]) -> Result<()> {
    if let Some(old) = old {
        old.decrypt(offset / old.sector_bytes() as u64, b)?;
    }
    if let Some(new) = new {
        new.encrypt(offset / new.sector_bytes() as u64, b)?;
    }
    Ok(())
}

/// The lanes `spread` has, or one for a buffer of `len` bytes under [`LANE_BYTES_MIN`].
fn lanes_for(len: usize, spread: Spread<'_>) -> std::iter::RepeatN<()> {
    let n = if len < LANE_BYTES_MIN {
        1
    } else {
        spread.lanes.max(1)
    };
    std::iter::repeat_n((), n)
}

/// Reads `buf` from `at` in chunks of [`LANE_CHUNK_BYTES`] shared out among the lanes (the
/// copies out of the device run on every CPU); one lane for buffers under [`LANE_BYTES_MIN`].
fn read_lanes(dev: &dyn Backend, buf: &mut [u8], at: u64, lanes: Spread<'_>) -> Result<()> {
    read_lanes_then(dev, buf, at, lanes, Sink::KEEP)
}

/// [`read_lanes`], each lane handing every [`LANE_CHUNK_BYTES`] it read (offset in `buf`,
/// bytes) to `then` while they are in its cache: the journal's copy of the hotzone.
fn read_lanes_then(
    dev: &dyn Backend,
    buf: &mut [u8],
    at: u64,
    spread: Spread<'_>,
    then: Sink<'_>,
) -> Result<()> {
    let lanes = lanes_for(buf.len(), spread);
    let then = Handing::new(then, buf.len().div_ceil(LANE_CHUNK_BYTES));
    let chunks = buf.chunks_mut(LANE_CHUNK_BYTES).enumerate();
    share_out(
        spread.crew,
        lanes,
        chunks,
        "read thread panicked",
        |_, (i, c)| {
            let o = (i * LANE_CHUNK_BYTES) as u64;
            dev.read_exact_at(c, at + o)?;
            then.hand(o, c)
        },
    )?;
    then.finished()
}

/// [`read_lanes`], each lane hashing every `block` bytes of a chunk it read into that chunk's
/// part of `sums` (one digest after the other, as [`checksums`]) while they are in its cache.
fn read_lanes_summing(
    dev: &dyn Backend,
    buf: &mut [u8],
    at: u64,
    spread: Spread<'_>,
    (hash, block): (HashAlg, usize),
    sums: &mut [u8],
) -> Result<()> {
    let hb = hash.output_bytes();
    assert!(
        block > 0 && buf.len() % block == 0 && sums.len() >= buf.len() / block * hb,
        "whole checksum blocks, a digest for each"
    );
    assert!(
        LANE_CHUNK_BYTES % block == 0,
        "chunks of whole checksum blocks"
    );
    let lanes = lanes_for(buf.len(), spread);
    let chunks = buf
        .chunks_mut(LANE_CHUNK_BYTES)
        .zip(sums.chunks_mut(LANE_CHUNK_BYTES / block * hb))
        .enumerate();
    share_out(
        spread.crew,
        lanes,
        chunks,
        "read thread panicked",
        |_, (i, (c, out))| {
            dev.read_exact_at(c, at + (i * LANE_CHUNK_BYTES) as u64)?;
            hash_blocks(c, block, hash, out);
            Ok(())
        },
    )
}

/// Writes `buf` at `at`, in chunks shared out among the lanes as [`read_lanes`] reads.
fn write_lanes(dev: &dyn Backend, buf: &[u8], at: u64, spread: Spread<'_>) -> Result<()> {
    let lanes = lanes_for(buf.len(), spread);
    let chunks = buf.chunks(LANE_CHUNK_BYTES).enumerate();
    share_out(
        spread.crew,
        lanes,
        chunks,
        "write thread panicked",
        |_, (i, c)| dev.write_at(c, at + (i * LANE_CHUNK_BYTES) as u64),
    )
}

/// [`hash_blocks`] on up to `lanes` threads.
fn checksums(
    data: &[u8],
    block: usize,
    hash: HashAlg,
    out: &mut [u8],
    spread: Spread<'_>,
) -> Result<()> {
    let hb = hash.output_bytes();
    let n = data.len() / block;
    let per = (LANE_CHUNK_BYTES / block).max(1);
    let chunks = data[..n * block]
        .chunks(per * block)
        .zip(out[..n * hb].chunks_mut(per * hb));
    let lanes = lanes_for(data.len(), spread);
    share_out(
        spread.crew,
        lanes,
        chunks,
        "checksum thread panicked",
        |_, (d, o)| {
            hash_blocks(d, block, hash, o);
            Ok(())
        },
    )
}

fn commit(dev: &dyn Backend, u: &mut Unlocked, pos: Position) -> Result<()> {
    set_segments(&mut u.h.meta, &mut u.st, pos, u.data_bytes)?;
    let ops = u.h.commit()?;
    apply(dev, &ops)
}

fn finish(dev: &dyn Backend, data: &dyn Backend, u: &mut Unlocked) -> Result<()> {
    let retired = finalise(&mut u.h.meta, &u.st)?;
    // A decryption that moved the data back leaves the old ciphertext of its last shift past
    // the plaintext: wiped before the commit, as cryptsetup does. No recovery reads it (the
    // last hotzone, the moved segment's, is rewritten in place), so a crash between the wipe
    // and the commit finalises again on resume.
    if let Some(us) = u.unshift {
        wipe_random(std::iter::once((data, us.tail())))?;
        data.flush()?;
    }
    let mut ops = u.h.commit()?;
    ops.push(WriteOp::Sync);
    apply(dev, &ops)?;
    // Then the retired areas (up to the whole reencrypt area, megabytes) get random bytes.
    // A data shift's moved segment (a plaintext copy of the first shift) goes after the
    // commit, unlike cryptsetup, which wipes it first: a crash between its wipe and its
    // commit would leave a header whose last hotzone a resume redoes from wiped bytes. Here a
    // crash between them leaves that copy readable past the data until wiped by hand.
    let areas = retired.areas.iter().map(|a| (dev, *a));
    let data_areas = retired.data_areas.iter().map(|a| (data, *a));
    wipe_random(areas.chain(data_areas))?;
    data.flush()?;
    dev.flush()
}

/// Writes random bytes ([`Noise`]) over each (device, (offset, length)), a bounded piece
/// ([`WIPE_PIECE_BYTES`]) at a time from one page-aligned buffer (the pool's, as a device
/// opened with O_DIRECT needs: the `open` daemon's is). No flush.
fn wipe_random<'a>(
    ranges: impl Iterator<Item = (&'a dyn Backend, (u64, u64))> + Clone,
) -> Result<()> {
    let Some(longest) = ranges.clone().map(|(_, a)| a.1).max() else {
        return Ok(());
    };
    let piece = WIPE_PIECE_BYTES.min(longest).max(AREA_ALIGN_BYTES) as usize;
    let pool = BufferPool::new(piece)?;
    let mut g = pool.take(piece)?;
    let buf = g.as_mut_slice();
    let mut noise = Noise::new()?;
    for (d, (offset, len)) in ranges {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            noise.fill(&mut buf[..n])?;
            d.write_at(&buf[..n], offset + at)?;
            at += n as u64;
        }
    }
    Ok(())
}

/// Rewrites the rest of a reencryption [`init`] (or cryptsetup) started, hotzone after
/// hotzone, then finalises. `progress` is called after each hotzone. A volume whose metadata
/// was committed inside a hotzone needs [`recover`] first (as cryptsetup's `--resume-only`
/// requires `repair`).
pub fn resume(
    dev: &dyn Backend,
    passphrase: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    resume_on(Devices::one(dev), passphrase, opts, progress)
}

/// [`resume`] with the header on its own device (`--header`).
pub fn resume_on(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    resume_serving(devs, passphrase, opts, progress, &mut Offline)
}

/// [`resume_on`] while `serving` serves the data: each hotzone is held from before its read
/// to after its last commit.
pub fn resume_serving(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
    serving: &mut dyn Serving,
) -> Result<()> {
    let mut u = open_rotation(devs, passphrase, opts.resilience)?;
    let pos = position(&u.h.meta, &u.st, u.data_bytes)?;
    if pos.hotzone.is_some() {
        return Err(Error::NeedsRecovery);
    }
    let backward = u.st.keyslot.direction == Direction::Backward;
    let new_key = u.new_key.as_ref().map(|(c, k, ss)| (*c, k.as_ref(), *ss));
    serving.start(new_key, pos.done, backward)?;
    if let Some(n) = serving.rekey_lanes_max() {
        u.lanes.truncate(n.max(1));
    }
    // Set once a hold succeeded (a refused one holds nothing, and nothing of ours is broken
    // on failure then), cleared at the release.
    let mut held = false;
    let r = run_hotzones(devs, &mut u, pos, opts, progress, serving, &mut held);
    if r.is_err() && held {
        serving.failed();
    }
    r
}

fn run_hotzones(
    devs: Devices<'_>,
    u: &mut Unlocked,
    mut pos: Position,
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
    serving: &mut dyn Serving,
    held: &mut bool,
) -> Result<()> {
    let hot_max = opts
        .hotzone_bytes
        .unwrap_or(HOTZONE_BYTES_DEFAULT)
        .clamp(1, HOTZONE_BYTES_MAX);
    // One buffer for every hotzone, and one for the checksums of a hotzone.
    // A decryption that moves the data rewrites its moved segment in place, whole.
    let in_place_min = match u.unshift {
        Some(us) if pos.done <= us.walk_bytes() => us.moved_bytes,
        _ => 0,
    };
    // Offline, a `none` hotzone is read, rekeyed and written a buffer at a time (below, and
    // `walk`): its buffer need not hold it whole.
    let none_cap = match (u.protect, u.shift, u.unshift, serving.serves()) {
        (Protect::None, None, None, false) => NONE_BUFFER_BYTES,
        _ => u64::MAX,
    };
    let buf_len = hot_max
        .min(area_limit(&u.st)?)
        .min(u.data_bytes.saturating_sub(pos.done))
        .min(none_cap)
        .max(u.align)
        .max(in_place_min)
        .div_ceil(crate::pool::POOL_PAGE_BYTES as u64)
        * crate::pool::POOL_PAGE_BYTES as u64;
    // A backward walk's last hotzone may be longer than the buffer (up to a journal area, or
    // up to 1 GiB of checksum blocks: [`last_backward_hotzone`]); it is read twice, below.
    let longest = last_backward_hotzone(&u.st, u.data_bytes, u.align)?.max(buf_len);
    let sums_len = match u.protect {
        Protect::Checksum { hash, block }
        | Protect::Unshift(MovedGuard::Checksum { hash, block }) => {
            (longest / u64::from(block) * hash.output_bytes() as u64).div_ceil(AREA_ALIGN_BYTES)
                * AREA_ALIGN_BYTES
        }
        _ => 0,
    };
    let pool = BufferPool::new((buf_len + sums_len.max(AREA_ALIGN_BYTES)) as usize)?;
    if u.crew.is_none() && u.lanes.len() > 1 {
        // Between steps its threads sleep at once: a busy host's CPU is not spun away.
        let spin = std::time::Duration::ZERO;
        u.crew = Some(Crew::new("ucrypt-rekey", u.lanes.len() - 1, spin)?);
    }
    let mut hot = pool.take(buf_len as usize)?;
    let mut sums = pool.take(sums_len.max(AREA_ALIGN_BYTES) as usize)?;
    // The hotzone's pieces: whole sectors and pages (the buffer's O_DIRECT alignment).
    let unit = u.align.max(AREA_ALIGN_BYTES);
    let piece_max = serving
        .piece_bytes(buf_len)
        .map_or(buf_len, |p| (p / unit).max(1) * unit);
    progress(Progress {
        done: pos.done,
        total: u.data_bytes,
    });
    let mut run_bytes = walk::RUN_BYTES_FIRST;
    loop {
        if !serving.serves() {
            let started = std::time::Instant::now();
            if let Some(p) = walk::run(devs, u, pos, hot_max, run_bytes, hot.as_mut_slice())? {
                run_bytes = walk::next_run_bytes(p.done - pos.done, started.elapsed());
                pos = p;
                progress(Progress {
                    done: pos.done,
                    total: u.data_bytes,
                });
                continue;
            }
        }
        let next = match (&u.shift, &u.unshift) {
            (Some(sh), _) => next_hotzone_shift(sh, pos, u.align)?,
            (None, Some(us)) => next_hotzone_unshift(&u.st, us, pos, u.align)?,
            (None, None) => next_hotzone(&u.st, pos, u.data_bytes, hot_max, u.align)?,
        };
        let Some(steps) = next else {
            // Every byte done, but not finalised (left so by a crash or by cryptsetup).
            return finish(devs.header, devs.data, u);
        };
        let mut cur = 0u64;
        // The checksums of the hotzone were taken while it was read.
        let mut summed = false;
        // Without resilience data nothing needs the hotzone whole in memory before it is
        // rewritten: its read is left to the rewrite, chunk by chunk ([`rekey_stream`]). No
        // step between the two writes to the data.
        let mut read_later = false;
        // Where this hotzone's journal goes, if it has one: written while the hotzone is
        // read, each chunk while it is in the cache.
        let journal_area = steps.iter().find_map(|s| match s {
            Step::WriteJournal { area_offset } => Some(*area_offset),
            _ => None,
        });
        let mut journaled = false;
        for step in steps {
            match step {
                // Without resilience data, read later by the rewrite, a buffer at a time
                // offline (the buffer may be shorter than the hotzone: `NONE_BUFFER_BYTES`).
                Step::ReadOld { offset, len }
                    if matches!(u.protect, Protect::None)
                        && (len <= piece_max || !serving.serves()) =>
                {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    read_later = true;
                }
                // Longer than the buffer: read for its resilience data (checksums or journal)
                // a buffer at a time, and read again for its rewrite (`read_later`).
                Step::ReadOld { offset, len } if len > buf_len => {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    let at = u.data_offset + offset;
                    let buf = hot.as_mut_slice();
                    let lanes = u.spread();
                    for r in pieces(len, buf_len) {
                        let (b, a) = (&mut buf[..r.len()], at + r.start as u64);
                        match (u.protect, journal_area) {
                            (Protect::Checksum { hash, block }, _) => {
                                let hb = hash.output_bytes();
                                let out = &mut sums.as_mut_slice()[r.start / block as usize * hb..];
                                read_lanes_summing(
                                    devs.data,
                                    b,
                                    a,
                                    lanes,
                                    (hash, block as usize),
                                    out,
                                )?;
                                summed = true;
                            }
                            (Protect::Journal, Some(area)) => {
                                let area = area + r.start as u64;
                                let journal = |o: u64, c: &[u8]| devs.header.write_at(c, area + o);
                                let journal = Sink::to(devs.header, &journal);
                                read_lanes_then(devs.data, b, a, lanes, journal)?;
                                journaled = true;
                            }
                            _ => return Err(Error::Bug(
                                "a hotzone longer than the buffer without a journal or checksums",
                            )),
                        }
                    }
                    read_later = true;
                }
                Step::ReadOld { offset, len } => {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    let buf = &mut hot.as_mut_slice()[..len as usize];
                    let at = u.data_offset + offset;
                    summed = false;
                    match u.protect {
                        // In pieces: the checksums of each piece are taken while the next one
                        // is read.
                        Protect::Checksum { hash, block }
                            if len > piece_max && piece_max % u64::from(block) == 0 =>
                        {
                            let block = block as usize;
                            let sums = sums.as_mut_slice();
                            read_summing(devs.data, buf, at, piece_max, block, hash, sums)?;
                            summed = true;
                        }
                        // Offline: the checksums taken as the hotzone is read, on every lane.
                        Protect::Checksum { hash, block }
                            if AREA_ALIGN_BYTES % u64::from(block) == 0
                                && len % u64::from(block) == 0 =>
                        {
                            let sums = sums.as_mut_slice();
                            let how = (hash, block as usize);
                            read_lanes_summing(devs.data, buf, at, u.spread(), how, sums)?;
                            summed = true;
                        }
                        // The journal's copy written as the hotzone is read.
                        Protect::Journal if len <= piece_max && journal_area.is_some() => {
                            let area = journal_area.expect("tested in the guard");
                            let journal = |o: u64, b: &[u8]| devs.header.write_at(b, area + o);
                            let journal = Sink::to(devs.header, &journal);
                            read_lanes_then(devs.data, buf, at, u.spread(), journal)?;
                            journaled = true;
                        }
                        _ => {
                            for r in pieces(len, piece_max) {
                                let a = at + r.start as u64;
                                read_lanes(devs.data, &mut buf[r], a, u.spread())?;
                            }
                        }
                    }
                }
                Step::ReadAt { from, offset, len } => {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    read_lanes(
                        devs.data,
                        &mut hot.as_mut_slice()[..len as usize],
                        from,
                        u.spread(),
                    )?;
                }
                Step::WriteChecksums {
                    area_offset,
                    block,
                    hash,
                } => {
                    let hb = hash.output_bytes();
                    let n = (cur / u64::from(block)) as usize;
                    let out = sums.as_mut_slice();
                    if !summed {
                        let data = &hot.as_mut_slice()[..cur as usize];
                        checksums(data, block as usize, hash, out, u.spread())?;
                    }
                    let len = ((n * hb) as u64).div_ceil(AREA_ALIGN_BYTES) * AREA_ALIGN_BYTES;
                    out[n * hb..len as usize].fill(0);
                    devs.header.write_at(&out[..len as usize], area_offset)?;
                }
                Step::WriteJournal { .. } if journaled => journaled = false,
                Step::WriteJournal { area_offset } => {
                    let buf = &hot.as_mut_slice()[..cur as usize];
                    for r in pieces(cur, piece_max) {
                        let at = area_offset + r.start as u64;
                        write_lanes(devs.header, &buf[r], at, u.spread())?;
                    }
                }
                Step::SyncData => devs.flush()?,
                Step::CommitSegments(p) => {
                    commit(devs.header, u, p)?;
                    pos = p;
                    if p.hotzone.is_none() {
                        *held = false;
                        serving.release(p.done)?;
                    }
                }
                Step::MoveNew { from, offset, len } => {
                    serving.hold(offset, len)?;
                    *held = true;
                    serving.rewrite(offset, len)?;
                    move_new(devs.data, u, from, offset, len, hot.as_mut_slice())?;
                }
                Step::WriteNew { offset, len } if read_later => {
                    assert!(
                        len <= cur,
                        "the rewrite stays inside the hotzone read later"
                    );
                    read_later = false;
                    serving.rewrite(offset, len)?;
                    let (from, to) = (u.data_offset, u.new_offset);
                    // Each chunk is read, then written where it was: nothing read later was
                    // overwritten before.
                    assert_eq!(from, to, "a hotzone read later is rewritten in place");
                    for r in pieces(len, buf_len) {
                        rekey_stream(
                            u,
                            offset + r.start as u64,
                            &mut hot.as_mut_slice()[..r.len()],
                            &|at, b| devs.data.read_exact_at(b, from + at),
                            Sink::to(devs.data, &|at, b| devs.data.write_at(b, to + at)),
                        )?;
                    }
                    serving.rewritten(offset, len)?;
                }
                Step::WriteNew { offset, len } if len > piece_max => {
                    let buf = &mut hot.as_mut_slice()[..len as usize];
                    let base = u.new_offset;
                    let backward = u.st.keyslot.direction == Direction::Backward;
                    let rekey = &mut |at, b: &mut [u8]| rekey(u, at, b);
                    rewrite_pieces(
                        devs.data, base, offset, buf, piece_max, backward, serving, rekey,
                    )?;
                }
                Step::WriteNew { offset, len } => {
                    serving.rewrite(offset, len)?;
                    let buf = &mut hot.as_mut_slice()[..len as usize];
                    let base = u.new_offset;
                    let write = |at, b: &[u8]| devs.data.write_at(b, base + at);
                    rekey_then(u, offset, buf, Sink::to(devs.data, &write))?;
                    serving.rewritten(offset, len)?;
                }
                Step::Finalise => {
                    finish(devs.header, devs.data, u)?;
                    *held = false;
                    serving.release(u.data_bytes)?;
                    progress(Progress {
                        done: u.data_bytes,
                        total: u.data_bytes,
                    });
                    return Ok(());
                }
            }
        }
        progress(Progress {
            done: pos.done,
            total: u.data_bytes,
        });
    }
}

/// A data shift's hotzone ([`Step::MoveNew`]): the plaintext at `from` read, encrypted for
/// data offset `offset` and written at the new data offset, in pieces of `buf` (the one
/// hotzone buffer: a hotzone of the shift may be larger). Source and target never overlap,
/// so the pieces' order does not matter, and a crash anywhere is recovered by doing it again.
fn move_new(
    data: &dyn Backend,
    u: &mut Unlocked,
    from: u64,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> Result<()> {
    let piece = (buf.len() as u64 / u.align * u.align).min(len);
    if piece == 0 {
        return Err(Error::Bug("hotzone buffer smaller than a sector"));
    }
    let base = u.new_offset;
    let mut at = 0;
    while at < len {
        let n = piece.min(len - at) as usize;
        let b = &mut buf[..n];
        // Source and target do not overlap: each chunk is read, encrypted and written while
        // it is in the cache.
        let src = from + at;
        let start = offset + at;
        rekey_stream(
            u,
            start,
            b,
            &|o, c| data.read_exact_at(c, src + (o - start)),
            Sink::to(data, &|o, p| data.write_at(p, base + o)),
        )?;
        at += n as u64;
    }
    Ok(())
}

/// What [`recover`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// The metadata was not inside a hotzone: nothing to do.
    NotNeeded,
    /// The hotzone (offset, length) was brought to its new form from the resilience data
    /// (for `none`: taken as written, as cryptsetup does; its data may be lost).
    Recovered { offset: u64, len: u64 },
}

/// Recovers a hotzone the metadata was committed inside (a crash between the hotzone's two
/// commits), as cryptsetup's `repair` does: `checksum` rewrites each block whose bytes still
/// hash to the stored old checksum; `journal` rewrites the whole hotzone from the stored copy
/// of its old bytes; `none` has nothing to recover from. Then the boundary is committed past
/// the hotzone.
pub fn recover(dev: &dyn Backend, passphrase: &[u8]) -> Result<Recovery> {
    recover_on(Devices::one(dev), passphrase)
}

/// [`recover`] with the header on its own device (`--header`).
pub fn recover_on(devs: Devices<'_>, passphrase: &[u8]) -> Result<Recovery> {
    prepare_recovery(devs, passphrase)?.run()
}

/// A reencryption opened for [`recover_on`], its keys unlocked and its position read, before
/// anything is written: [`recover_on`] in two steps, so that a volume served meanwhile can
/// hold the hotzone against its requests between them (`online::recover_stopped`,
/// after an online rotation's driver stopped inside a hotzone).
pub(crate) struct PendingRecovery<'a> {
    devs: Devices<'a>,
    u: Unlocked,
    pos: Position,
    /// The hotzone the metadata was committed inside, `(offset, len)` in bytes of the data.
    hotzone: Option<(u64, u64)>,
}

/// Opens the reencryption on `devs` for recovery: [`PendingRecovery::run`] recovers it.
pub(crate) fn prepare_recovery<'a>(
    devs: Devices<'a>,
    passphrase: &[u8],
) -> Result<PendingRecovery<'a>> {
    let u = open_rotation(devs, passphrase, None)?;
    let pos = position(&u.h.meta, &u.st, u.data_bytes)?;
    let hotzone = match pos.hotzone {
        None => None,
        Some(len) => {
            let offset = match u.unshift {
                Some(us) => us.hotzone_offset(pos.done),
                None => hotzone_offset(&u.st, pos, len, u.data_bytes),
            };
            if len % u.align != 0 || len > area_limit(&u.st)? {
                return Err(bad(format!(
                    "hotzone of {len} bytes does not fit its resilience data"
                )));
            }
            Some((offset, len))
        }
    };
    Ok(PendingRecovery {
        devs,
        u,
        pos,
        hotzone,
    })
}

impl PendingRecovery<'_> {
    /// The hotzone the metadata was committed inside, `(offset, len)` in bytes of the data;
    /// `None`: nothing to recover.
    pub(crate) fn hotzone(&self) -> Option<(u64, u64)> {
        self.hotzone
    }

    /// Whether the hotzone has no resilience data (`none`): its recovery takes it as
    /// rewritten, as cryptsetup's does, whatever was rewritten of it.
    pub(crate) fn without_resilience(&self) -> bool {
        matches!(self.u.protect, Protect::None)
    }

    /// The bytes done once [`PendingRecovery::run`] has run, and whether that is all of them
    /// (the header finalised).
    pub(crate) fn done_after(&self) -> (u64, bool) {
        let done = self.pos.done + self.hotzone.map_or(0, |(_, len)| len);
        (done, done >= self.u.data_bytes)
    }

    /// Recovers the hotzone, if any, and commits the boundary past it (finalises after the
    /// last one).
    pub(crate) fn run(self) -> Result<Recovery> {
        let PendingRecovery {
            devs,
            mut u,
            pos,
            hotzone,
        } = self;
        let Some((offset, len)) = hotzone else {
            return Ok(Recovery::NotNeeded);
        };
        recover_hotzone(devs, &mut u, pos, offset, len)
    }
}

/// Brings the hotzone `[offset, offset + len)` the metadata was committed inside (at `pos`)
/// to its new form from the resilience data, then commits past it.
fn recover_hotzone(
    devs: Devices<'_>,
    u: &mut Unlocked,
    pos: Position,
    offset: u64,
    len: u64,
) -> Result<Recovery> {
    let (hdr_dev, data_dev) = (devs.header, devs.data);
    if let Some(sh) = u.shift {
        // The hotzone's source is intact (nothing writes it before the hotzone is committed
        // done): move it again, as cryptsetup's datashift recovery does.
        let piece = len
            .min(HOTZONE_BYTES_DEFAULT)
            .max(u.align)
            .div_ceil(crate::pool::POOL_PAGE_BYTES as u64)
            * crate::pool::POOL_PAGE_BYTES as u64;
        let pool = BufferPool::new(piece as usize)?;
        let mut g = pool.take(piece as usize)?;
        let from = shift_source(&sh, offset);
        move_new(data_dev, u, from, offset, len, g.as_mut_slice())?;
        drop(g);
        return finish_recovery(devs, u, pos, offset, len);
    }
    if let Some(us) = u.unshift.filter(|_| offset > 0) {
        // A hotzone of the walk: its ciphertext at the old place is intact (the hotzone is
        // at most the shift, so nothing written overlaps it): decrypt and move it again, as
        // cryptsetup's datashift recovery does. The moved segment's (offset 0) is rewritten
        // in place, from its checksums, below.
        let piece = len
            .min(HOTZONE_BYTES_DEFAULT)
            .max(u.align)
            .div_ceil(crate::pool::POOL_PAGE_BYTES as u64)
            * crate::pool::POOL_PAGE_BYTES as u64;
        let pool = BufferPool::new(piece as usize)?;
        let mut g = pool.take(piece as usize)?;
        move_new(
            data_dev,
            u,
            us.source(offset),
            offset,
            len,
            g.as_mut_slice(),
        )?;
        drop(g);
        return finish_recovery(devs, u, pos, offset, len);
    }
    let area = u.st.keyslot.area_offset;
    let pool = BufferPool::new(len.max(u.align) as usize)?;
    let mut g = pool.take(len as usize)?;
    let buf = g.as_mut_slice();
    // The hotzone's place: where its old data is and its new data goes (the same for a
    // reencryption in place; the moved segment of a decryption that moves the data lies at
    // the new data offset).
    let place = u.new_offset + offset;
    match u.protect {
        Protect::None => {}
        Protect::Datashift => return Err(Error::Bug("datashift recovered above")),
        Protect::Journal | Protect::Unshift(MovedGuard::Journal) => {
            hdr_dev.read_exact_at(buf, area)?;
            rekey(u, offset, buf)?;
            data_dev.write_at(buf, place)?;
        }
        Protect::Checksum { hash, block }
        | Protect::Unshift(MovedGuard::Checksum { hash, block }) => {
            let hb = hash.output_bytes();
            let block = u64::from(block);
            let n = (len / block) as usize;
            let sums = read_area(hdr_dev, area, (n * hb) as u64)?;
            data_dev.read_exact_at(buf, place)?;
            for i in 0..n {
                let at = i * block as usize;
                let chunk = &mut buf[at..at + block as usize];
                if hash.digest(&[chunk]) == sums[i * hb..(i + 1) * hb] {
                    let o = offset + at as u64;
                    rekey(u, o, chunk)?;
                    data_dev.write_at(chunk, u.new_offset + o)?;
                }
            }
        }
    }
    drop(g);
    finish_recovery(devs, u, pos, offset, len)
}

/// After a recovered hotzone: flush, then commit the boundary past it (finalise after the
/// last one).
fn finish_recovery(
    devs: Devices<'_>,
    u: &mut Unlocked,
    pos: Position,
    offset: u64,
    len: u64,
) -> Result<Recovery> {
    devs.flush()?;
    let after = Position {
        done: pos.done + len,
        hotzone: None,
    };
    if after.done >= u.data_bytes {
        finish(devs.header, devs.data, u)?;
    } else {
        commit(devs.header, u, after)?;
    }
    Ok(Recovery::Recovered { offset, len })
}
