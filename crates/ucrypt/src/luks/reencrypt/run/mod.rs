//! The driver of reencryption (key rotation, optionally to a new cipher, key size or sector
//! size; decryption and encryption, with a detached header or moving the data): performs what
//! [`crate::luks::reencrypt::plan`] plans against a [`Backend`] holding the header and the
//! data, or two ([`Devices`]) for a detached header, with the engine's sector ciphers. One
//! file per phase:
//!
//! - `init`: [`init`] turns a plain LUKS2 volume into one in reencryption, as cryptsetup 2.6's
//!   `reencrypt --init-only` does: a new random volume key with its digest, a new keyslot per
//!   passphrase, a `reencrypt` keyslot whose area is the rest of the keyslots area, the
//!   segments (`0` = the whole device under the old key, then backup-previous and
//!   backup-final), the `online-reencrypt-v2` requirement and the reencryption digest. The new
//!   keyslots' material is written and flushed first, then one header commit makes it all
//!   visible: a crash leaves the old header or the new one. [`init_on`] with
//!   [`crate::luks::reencrypt::Mode::Decrypt`] starts a decryption;
//! - `encrypt`: [`init_encrypt`] an encryption with a new detached header,
//!   [`init_encrypt_shift`] one that moves the data up to put the header in front;
//! - `decrypt`: [`init_decrypt_unshift`] a decryption that exports the header in front to a
//!   new file and moves the data back to the start of the device;
//! - `unlock`: the keys every segment needs, checked against the reencryption digest, and the
//!   state a run carries (`Unlocked`);
//! - `resilience`: a resilience switched on resume, as cryptsetup allows;
//! - `lanes`: a hotzone's bytes read, rekeyed and written in chunks by lanes of threads;
//! - `hotzones`: [`resume`] rewrites hotzone after hotzone and finalises (the old keyslots, the
//!   reencrypt keyslot, the backups and the requirement removed: a plain LUKS2 header is
//!   left); one hotzone buffer (page-aligned, locked, wiped) is taken at the start and reused;
//!   [`resume_on`] takes two devices, [`resume_serving`] a [`crate::luks::reencrypt::Serving`];
//! - `walk`: offline, `none` and data shift hotzones run back to back: the lanes read and rekey
//!   the next hotzone while the last one's writes and commits finish;
//! - `recovery`: [`recover`] brings a volume whose metadata was committed inside a hotzone (a
//!   crash there) back to a consistent state from the resilience data, as cryptsetup's
//!   `repair` does.

use crate::backend::Backend;
use crate::luks::reencrypt::pieces::share_out;
use crate::luks::reencrypt::plan::UNSHIFT_REQUIREMENT_VERSION;
use crate::luks::util::HashAlg;
use crate::luks::util::Noise;
use crate::luks::{Header, Luks2Header};
use crate::pool::BufferPool;
use crate::{Error, Result};

mod decrypt;
mod encrypt;
mod hotzones;
mod init;
mod lanes;
mod recovery;
mod resilience;
mod seal;
mod unlock;

pub use decrypt::{init_decrypt_unshift, UnshiftOptions, MOVED_BYTES_DEFAULT};
pub use encrypt::{
    init_encrypt, init_encrypt_shift, EncryptOptions, ENCRYPT_NEEDS_DETACHED_HEADER,
};
pub use hotzones::{resume, resume_on, resume_serving};
pub use init::{
    check_free_keyslots, check_passphrase, init, init_keep_key, init_on, init_slots,
    passphrase_keyslots, InitOptions, KeyslotKdf, SegmentChange, SlotPassphrase, Started,
    DECRYPT_NEEDS_DETACHED_HEADER, KEEP_KEY_CHANGES_NOTHING, KEY_FILE_NEEDS_ONE_KEYSLOT,
    NOT_ENOUGH_KEYSLOTS,
};
pub(crate) use recovery::prepare_recovery;
pub use recovery::{recover, recover_on, Recovery};
pub(crate) use unlock::unlock_digest;

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
pub(super) const REKEY_LANES_MAX: usize = 16;
/// Smaller buffers are rekeyed on one thread (a thread costs more than it saves).
pub(super) const LANE_BYTES_MIN: usize = 256 << 10;
/// Bytes a rekeying thread reads, decrypts, encrypts and writes at a time: small enough to
/// stay in a core's cache between the steps, large enough that a system call per chunk costs
/// nothing (whole 4096-byte sectors). Also the most one lane can be left working on when the
/// others have run out of chunks: each step of a hotzone ends when its last chunk does, and
/// beside busy threads that last chunk may run on half a core. Smaller chunks only add
/// claims and system calls (the busy rows of `bench reencrypt`, BENCHMARKS.md).
pub(super) const LANE_CHUNK_BYTES: usize = 256 << 10;
/// The buffer of an offline `none` rotation, whatever its hotzone: 64 slots of
/// [`LANE_CHUNK_BYTES`]: a buffer of the whole hotzone would cost its allocation, wipes and
/// page faults on every rotation for no gain, since the lanes reuse slots as writes finish;
/// 16 MiB also stays closer to the caches the chunks go through.
pub(super) const NONE_BUFFER_BYTES: u64 = 16 << 20;
/// Largest piece of random bytes written at a time when finalisation wipes retired areas.
pub(super) const WIPE_PIECE_BYTES: u64 = 1 << 20;
/// Bytes of the keyslot area alignment cryptsetup uses.
pub(super) const AREA_ALIGN_BYTES: u64 = 4096;
/// The largest `--reduce-device-size` cryptsetup accepts (1 GiB).
pub const REDUCE_BYTES_MAX: u64 = 1 << 30;
/// The reencrypt keyslot's area of a data shift (an encryption with the header in front, a
/// rotation that moves the data): it holds nothing, so cryptsetup gives it the first free gap
/// of the keyslots area, 4 KiB (cryptsetup 2.6.1 puts it 4096 bytes after keyslot 0's area;
/// `reencrypt_interop`'s `INITS` rows of both compare the two tools' init).
pub(super) const SHIFT_AREA_BYTES: u64 = 4096;

mod walk;

pub(super) fn bad(detail: impl Into<String>) -> Error {
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

pub(super) fn luks2(hdr: Header) -> Result<Luks2Header> {
    match hdr {
        Header::Luks2(h) => Ok(h),
        Header::Luks1(_) => Err(Error::UnsupportedLuks(
            "reencryption of LUKS1 (convert it to LUKS2 first)".into(),
        )),
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

    pub(super) fn detached(&self) -> bool {
        !std::ptr::addr_eq(
            self.header as *const dyn Backend,
            self.data as *const dyn Backend,
        )
    }

    /// Flushes the data device, and the header device when it is another one.
    pub(super) fn flush(&self) -> Result<()> {
        self.data.flush()?;
        if self.detached() {
            self.header.flush()?;
        }
        Ok(())
    }
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
    /// `--device-size`: reencrypt only this many bytes from the start of the data area (the
    /// rest keeps its old form under the new key's segment once done: cryptsetup's warning
    /// "data beyond --device-size limit may be lost"); `None`: all of it, or the bound a
    /// reencryption started with it left in the header.
    pub device_size: Option<u64>,
}

/// Copies `len` bytes from `from` to `to` on `dev` (ranges that do not overlap) and flushes,
/// then writes random bytes over `[wipe.0, wipe.0 + wipe.1)` ([`wipe_random`]).
pub(super) fn copy_then_wipe(
    dev: &dyn Backend,
    from: u64,
    to: u64,
    len: u64,
    wipe: (u64, u64),
) -> Result<()> {
    copy_across(dev, from, dev, to, len)?;
    dev.flush()?;
    wipe_random(std::iter::once((dev, wipe)))
}

/// Copies `len` bytes from `src` at `from` to `dst` at `to` through one buffer of at most
/// [`COPY_PIECE_BYTES`] (the ranges do not overlap if `src` is `dst`). No flush.
pub(super) fn copy_across(
    src: &dyn Backend,
    from: u64,
    dst: &dyn Backend,
    to: u64,
    len: u64,
) -> Result<()> {
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

/// Largest piece of a shift copied at a time (the moved segment at an encryption's init, a
/// decryption's header and moved data).
pub(super) const COPY_PIECE_BYTES: u64 = 4 << 20;

/// Writes random bytes ([`Noise`]) over each (device, (offset, length)), a bounded piece
/// ([`WIPE_PIECE_BYTES`]) at a time from one page-aligned buffer (the pool's, as a device
/// opened with O_DIRECT needs: the `open` daemon's is). No flush.
pub(super) fn wipe_random<'a>(
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
