//! Starting a reencryption in place (a new key, cipher or sector size): the checks before
//! anything is written, a keyslot per passphrase for the new key, the reencrypt keyslot, the
//! digest and the segments of cryptsetup's layout, committed in one header write.

use crate::backend::Backend;
use crate::luks::json::{CryptSegment, Keyslot, Metadata, U64Str};
use crate::luks::kdf::KdfRequest;
use crate::luks::luks2::digest::{free_id, make_digest};
use crate::luks::luks2::KeyslotArea;
use crate::luks::reencrypt::{Direction, Mode};
use crate::luks::util::{random_secret, HashAlg};
use crate::luks::{
    apply, read_area, read_header, unlock, Header, Luks2Header, NewKeyslot, VolumeKey, WriteOp,
    KEYSLOTS_MAX,
};
use crate::sector::{CipherSpec, SectorSize};
use crate::{Error, Result};

use super::seal::{add_reencryption_digest, assign_segments, require};
use super::{
    bad, luks2, Devices, ResilienceKind, AREA_ALIGN_BYTES, CHECKSUM_BLOCK_BYTES, REQUIREMENT_V2,
};

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
    /// default [`super::CHECKSUM_HASH`]); not read for the other kinds.
    pub resilience_hash: HashAlg,
    /// A rotation that also moves the data up by this many bytes (cryptsetup's `reencrypt
    /// --reduce-device-size SIZE` on a LUKS2 volume): walked backward with resilience
    /// `datashift` (`resilience` is not read), the data area's last shift given up
    /// ([`crate::luks::reencrypt::plan::Relocate`]). `None`: the data stays in place.
    pub shift_bytes: Option<u64>,
}

/// Where the PBKDF of a rotation's new keyslots comes from (as cryptsetup 2.6.1's
/// `set_keyslot_params` chooses it; `reencrypt_interop_keyslots`'s
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
    pub(super) slot: u32,
    pub(super) passphrase: crate::SecretBytes,
    pub(super) vk: VolumeKey,
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

/// The reencrypt keyslot's area: the rest of the keyslots area after the last used area
/// (4 KiB aligned), as `(offset, end)`.
pub(super) fn reencrypt_area(h: &Luks2Header) -> Result<(u64, u64)> {
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
pub(super) fn reencrypt_keyslot(
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
/// `reencrypt --init-only`). Nothing is rewritten yet; [`super::resume`] does that.
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
    init_checked(devs, header, std::slice::from_ref(&one), opts, false)
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
    init_checked(devs, header, slots, opts, false)
}

/// cryptsetup's words when `--keep-key` changes neither the cipher nor the sector size.
pub const KEEP_KEY_CHANGES_NOTHING: &str =
    "No data segment parameters changed. Reencryption aborted.";

/// A reencryption that keeps the volume key (cryptsetup's `reencrypt --keep-key`): the data
/// is rewritten to the new cipher or sector size of `opts.change` under the key `slot`
/// opens. No keyslot is added or removed: the key's digest covers the live segment and both
/// backups, and the reencryption digest takes the key once, as cryptsetup 2.6.1 writes it.
/// A new key size in `opts.change` is ignored, as cryptsetup ignores `--key-size` there: the
/// kept key is the new segment's, and a new cipher that cannot take it is refused with
/// cryptsetup's words ("Unable to use cipher specification ... for LUKS2."). Refused, before
/// anything is written, when neither the cipher nor the sector size changes
/// ([`KEEP_KEY_CHANGES_NOTHING`]; cryptsetup 2.8 refuses so whatever the key size asked,
/// 2.6.1 rewrites the data unchanged when only `--key-size` differs).
pub fn init_keep_key(
    devs: Devices<'_>,
    slot: &SlotPassphrase,
    opts: &InitOptions<'_>,
) -> Result<Started> {
    let header = read_header(devs.header)?;
    init_checked(devs, header, std::slice::from_ref(slot), opts, true)
}

pub(super) fn init_checked(
    devs: Devices<'_>,
    header: Header,
    slots: &[SlotPassphrase],
    opts: &InitOptions<'_>,
    keep_key: bool,
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
    if keep_key && (decrypt || slots.len() != 1) {
        return Err(Error::Bug("--keep-key: a rotation with one passphrase"));
    }
    if decrypt && (!devs.detached() || seg.offset_bytes != 0) {
        return Err(Error::InvalidArgument(DECRYPT_NEEDS_DETACHED_HEADER.into()));
    }
    let Some(first) = slots.first() else {
        return Err(Error::InvalidArgument(
            "a reencryption needs the passphrase of a keyslot".into(),
        ));
    };
    let (old_slot, old_vk) = (first.slot, &first.vk);
    check_slots(&h, slots, old_vk.digest_id(), decrypt || keep_key)?;
    let kdfs = slot_kdfs(&h, slots, opts)?;
    if keep_key
        && opts.change.cipher.is_none_or(|c| c == seg.cipher)
        && opts.change.sector_size.is_none_or(|s| s == seg.sector_size)
    {
        return Err(Error::InvalidArgument(KEEP_KEY_CHANGES_NOTHING.into()));
    }
    let (new_cipher, new_key_bytes, new_sector) =
        new_segment_params(devs, &seg, old_vk.len(), opts, decrypt, keep_key)?;
    if let Some(shift) = opts.shift_bytes {
        check_relocation(devs, &seg, shift, new_sector, decrypt)?;
    }

    // The new key, its digest (bound to backup-final, segment 2, below) and a keyslot for each
    // passphrase, whose material is written first; the header write comes below.
    let (new_vk, mut ops, new_keyslots) = if decrypt || keep_key {
        (None, Vec::new(), Vec::new())
    } else {
        let made = add_new_keyslots(&mut h, slots, &kdfs, new_key_bytes)?;
        (Some(made.vk), made.ops, made.new_keyslots)
    };
    let new_slot = new_keyslots.first().map(|&(_, n)| n);

    // The reencrypt keyslot: the rest of the keyslots area after the last used area (a
    // data shift's: one block of it).
    let rk = match opts.shift_bytes {
        Some(shift) => add_shift_keyslot(&mut h, Mode::Reencrypt, shift)?,
        None => {
            let (used_end, end) = reencrypt_area(&h)?;
            let rk = free_id(h.meta.keyslots.keys())?;
            let (mode, direction) = if decrypt {
                (Mode::Decrypt, Direction::Backward)
            } else {
                (Mode::Reencrypt, Direction::Forward)
            };
            let keyslot = reencrypt_keyslot(
                mode,
                direction,
                opts.resilience,
                opts.resilience_hash,
                used_end,
                end - used_end,
            );
            h.meta.keyslots.insert(rk.to_string(), keyslot);
            rk
        }
    };
    let new_final = if decrypt {
        None
    } else {
        Some((new_cipher, new_sector))
    };
    let new_did = match &new_vk {
        Some(vk) => Some(vk.digest_id()),
        None if keep_key => Some(old_vk.digest_id()),
        None => None,
    };
    let shift = opts.shift_bytes.unwrap_or(0);
    set_rotation_segments(&mut h.meta, new_final, shift, old_vk.digest_id(), new_did)?;

    // The reencryption digest over the keys and the metadata (the kept key once).
    let last_kdf = kdfs.last().unwrap_or(opts.kdf);
    let new_key = match &new_vk {
        Some(vk) => Some(vk.bytes()),
        None if keep_key => Some(old_vk.bytes()),
        None => None,
    };
    add_reencryption_digest(&mut h.meta, last_kdf, rk, Some(old_vk.bytes()), new_key)?;
    ops.extend(h.commit()?);
    apply(dev, &ops)?;
    Ok(Started {
        old_keyslot: old_slot,
        new_keyslot: new_slot,
        new_keyslots,
        reencrypt_keyslot: rk,
    })
}

/// Adds the reencrypt keyslot of a data shift by `shift` bytes: mode `mode` (an encryption
/// with the header in front, or a rotation that moves the data), direction `backward`,
/// resilience `datashift`, over [`super::SHIFT_AREA_BYTES`] (it holds nothing); returns its id.
pub(super) fn add_shift_keyslot(h: &mut Luks2Header, mode: Mode, shift: u64) -> Result<u32> {
    let (used_end, end) = reencrypt_area(h)?;
    if end - used_end < super::SHIFT_AREA_BYTES {
        return Err(Error::InvalidArgument(
            "no room left in the keyslots area for the reencrypt keyslot".into(),
        ));
    }
    let rk = free_id(h.meta.keyslots.keys())?;
    let mut ks = reencrypt_keyslot(
        mode,
        Direction::Backward,
        ResilienceKind::None,
        super::CHECKSUM_HASH,
        used_end,
        super::SHIFT_AREA_BYTES,
    );
    if let Some(a) = ks.area.as_mut() {
        a.kind = "datashift".into();
        a.extra
            .insert("shift_size".into(), shift.to_string().into());
    }
    h.meta.keyslots.insert(rk.to_string(), ks);
    Ok(rk)
}

/// cryptsetup's words for a reduce size it refuses before anything else.
const REDUCE_SIZE_NOT_SECTORS: &str = "Reduce size must be multiple of 512 bytes sector.";

/// Checks a rotation that moves the data up by `shift` bytes, as cryptsetup 2.6.1 checks it:
/// a multiple of 512 bytes and of the new sector size, at most 1 GiB, a rotation (not a
/// decryption), and data left past the new offset.
fn check_relocation(
    devs: Devices<'_>,
    seg: &crate::luks::json::CryptSegment,
    shift: u64,
    new_sector: SectorSize,
    decrypt: bool,
) -> Result<()> {
    if decrypt {
        return Err(Error::InvalidArgument(
            "a decryption with --reduce-device-size (ucrypt moves the data back to the start \
             of the device with --decrypt --header NEW-FILE)"
                .into(),
        ));
    }
    if shift == 0 || shift % 512 != 0 {
        return Err(Error::InvalidArgument(REDUCE_SIZE_NOT_SECTORS.into()));
    }
    if shift > super::REDUCE_BYTES_MAX {
        return Err(Error::InvalidArgument(
            "Maximum device reduce size is 1 GiB.".into(),
        ));
    }
    let ss = u64::from(new_sector.bytes());
    if shift % ss != 0 {
        return Err(Error::InvalidArgument(format!(
            "Data shift value is not aligned to encryption sector size ({ss} bytes)."
        )));
    }
    let align = ss.max(u64::from(seg.sector_size.bytes()));
    let new_offset = seg.offset_bytes + shift;
    if devs.data.size().saturating_sub(new_offset) < align {
        return Err(Error::InvalidArgument(format!(
            "--reduce-device-size of {shift} bytes: the device ({} bytes) holds no data past \
             the new data offset {new_offset}.",
            devs.data.size(),
        )));
    }
    Ok(())
}

/// Checks that each proof in `slots` still holds for this header (its keyslot is there, of
/// the old key's digest `old_did`, once), that a decryption has one, and that the new keyslots and the
/// reencrypt keyslot fit (cryptsetup's bound).
fn check_slots(
    h: &Luks2Header,
    slots: &[SlotPassphrase],
    old_did: u32,
    decrypt: bool,
) -> Result<()> {
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
    let new_ids_needed = if decrypt { 0 } else { slots.len() } + 1;
    if h.meta.keyslots.len() + new_ids_needed > KEYSLOTS_MAX as usize {
        return Err(Error::InvalidArgument(NOT_ENOUGH_KEYSLOTS.into()));
    }
    Ok(())
}

/// The PBKDF of each new keyslot, and the digests' (cryptsetup makes the new key's digest
/// with the first keyslot's settings and the reencryption digest with the last one's).
fn slot_kdfs(
    h: &Luks2Header,
    slots: &[SlotPassphrase],
    opts: &InitOptions<'_>,
) -> Result<Vec<KdfRequest>> {
    slots
        .iter()
        .map(|sp| match opts.keyslot_kdf {
            KeyslotKdf::Given => Ok(opts.kdf.clone()),
            KeyslotKdf::SameAsOld => h
                .meta
                .keyslot_params(&sp.slot.to_string())
                .map(|p| KdfRequest::same_as(&p.kdf)),
        })
        .collect()
}

/// The new segment's cipher, key size and sector size (from `opts.change`, else the old
/// segment's `seg`, whose key is `old_key_bytes` long; with `keep_key` the key is the old
/// one whatever size was asked), checked before anything is written: a decryption changes
/// none, and the data must be aligned to both sector sizes.
fn new_segment_params(
    devs: Devices<'_>,
    seg: &CryptSegment,
    old_key_bytes: usize,
    opts: &InitOptions<'_>,
    decrypt: bool,
    keep_key: bool,
) -> Result<(CipherSpec, usize, SectorSize)> {
    let new_cipher = opts.change.cipher.unwrap_or(seg.cipher);
    let new_key_bytes = match opts.change.key_bytes {
        _ if keep_key => old_key_bytes,
        Some(n) => n,
        None if new_cipher != seg.cipher => new_cipher.default_key_bytes(),
        None => old_key_bytes,
    };
    let new_sector = opts.change.sector_size.unwrap_or(seg.sector_size);
    if decrypt {
        if opts.change != SegmentChange::default() {
            return Err(Error::InvalidArgument(
                "a decryption has no new cipher, key size or sector size".into(),
            ));
        }
    } else if keep_key {
        // cryptsetup checks the new cipher with the kept key and says only this.
        new_cipher.check_key_len(new_key_bytes).map_err(|_| {
            Error::InvalidArgument(format!(
                "Unable to use cipher specification {new_cipher} for LUKS2."
            ))
        })?;
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
    Ok((new_cipher, new_key_bytes, new_sector))
}

/// What [`add_new_keyslots`] made.
struct NewKey {
    vk: VolumeKey,
    /// The writes of the keyslots' material, before the header's.
    ops: Vec<WriteOp>,
    /// Each old keyslot with its new one.
    new_keyslots: Vec<(u32, u32)>,
}

/// A new random key of `key_bytes`, its digest (with `kdfs[0]`), and for each passphrase
/// of `slots` a keyslot of it (with its KDF of `kdfs`) that takes over the old keyslot's
/// tokens.
fn add_new_keyslots(
    h: &mut Luks2Header,
    slots: &[SlotPassphrase],
    kdfs: &[KdfRequest],
    key_bytes: usize,
) -> Result<NewKey> {
    let first_kdf = kdfs
        .first()
        .ok_or(Error::Bug("a rotation with no keyslot KDF"))?;
    let new_key = random_secret(key_bytes)?;
    let new_did = free_id(h.meta.digests.keys())?;
    h.meta.digests.insert(
        new_did.to_string(),
        make_digest(first_kdf, new_key.as_ref(), vec![], vec![])?,
    );
    let new_vk = VolumeKey::new_verified(new_key, new_did, true);
    let mut ops = Vec::new();
    let mut new_keyslots = Vec::new();
    for (sp, kdf) in slots.iter().zip(kdfs) {
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
            Some(KeyslotArea::known(area.0, area.1)),
        )?;
        more.truncate(2); // the material and its flush
        ops.extend(more);
        h.bin.seqid = seqid;
        assign_tokens(&mut h.meta, sp.slot, new_slot);
        new_keyslots.push((sp.slot, new_slot));
    }
    Ok(NewKey {
        vk: new_vk,
        ops,
        new_keyslots,
    })
}

/// cryptsetup's segments of a reencryption: the whole device as it is (0), then the two
/// backups, backup-previous (1) and backup-final (2: the new cipher and sector size of
/// `new_final`, or `linear` for a decryption, `None`; `shift` bytes above the old one for a
/// rotation that moves the data); the old key's digest `old_did` covers 0 and 1, the new
/// key's `new_did` covers 2 (all three when it is the old one: a kept key); the reencryption
/// requirement is added.
fn set_rotation_segments(
    meta: &mut Metadata,
    new_final: Option<(CipherSpec, SectorSize)>,
    shift: u64,
    old_did: u32,
    new_did: Option<u32>,
) -> Result<()> {
    let live = meta
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
    fin.offset = U64Str(live.offset.0 + shift);
    match new_final {
        None => {
            fin.kind = "linear".into();
            fin.iv_tweak = None;
            fin.encryption = None;
            fin.sector_size = None;
        }
        Some((cipher, sector)) => {
            fin.encryption = Some(cipher.to_string());
            fin.sector_size = Some(sector.bytes());
        }
    }
    meta.segments = std::collections::BTreeMap::from([
        ("0".to_string(), live.clone()),
        ("1".to_string(), flagged("backup-previous")),
        ("2".to_string(), fin),
    ]);
    let mut old_segs = vec!["0".into(), "1".into()];
    match new_did {
        // A kept key: its digest covers all three (cryptsetup's `--keep-key`).
        Some(did) if did == old_did => old_segs.push("2".into()),
        Some(did) => assign_segments(meta, did, vec!["2".into()], "new key digest vanished")?,
        None => {}
    }
    assign_segments(meta, old_did, old_segs, "old key digest vanished")?;
    require(meta, REQUIREMENT_V2);
    Ok(())
}

/// The key size of cryptsetup's default keyslot cipher (aes-xts-plain64, 512 bits), which
/// replaces a cipher_null keyslot's encryption in the new keyslot.
pub(super) const KEYSLOT_AREA_KEY_BYTES_DEFAULT: usize = 64;

/// Assigns every token of keyslot `old` to keyslot `new` as well (appended to its list), as
/// cryptsetup's reencrypt does for each new keyslot; finalisation then drops `old`.
pub(super) fn assign_tokens(meta: &mut Metadata, old: u32, new: u32) {
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
