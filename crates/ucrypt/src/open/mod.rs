//! Opening any volume ucrypt reads, in one call, into one managed type.
//!
//! [`open`] takes an [`OpenRequest`]: the data backend, the volume's [`Format`] with what
//! unlocks it, and how to serve it (read-only, discards, dispatch policy). It returns an
//! [`Opened`], whatever the volume turned out to be ([`VolumeKind`]): a raw dm-crypt mapping,
//! LUKS1, LUKS2, LUKS2 in reencryption (two segments served at once), or LUKS2 with
//! authenticated encryption (dm-crypt over dm-integrity). Every kind has the same life cycle
//! through that one type: a [`BlockDev`] for front ends ([`Opened::dev`]), request and byte
//! counters with errors by [`crate::ErrorKind`] ([`Opened::stats`]), suspend and resume, the
//! dispatch policy, the integrity mismatches; what a kind cannot do is refused with a typed
//! [`crate::Refusal`] (an authenticated volume is not resized).
//!
//! ```no_run
//! use std::sync::Arc;
//! use ucrypt::backend::{Backend, DirectMode, FileBackend};
//! use ucrypt::luks::Unlock;
//! use ucrypt::open::{open, Format, Luks, OpenRequest};
//! use ucrypt::{BlockDev, SecretBytes};
//!
//! # fn main() -> ucrypt::Result<()> {
//! let data: Arc<dyn Backend> =
//!     Arc::new(FileBackend::open("disk.img", true, DirectMode::Never)?);
//! let unlock = Unlock::Passphrase(SecretBytes::from_slice(b"passphrase"));
//! let vol = open(OpenRequest::new(data, Format::Luks(Luks::new(unlock))))?;
//! let mut buf = vec![0u8; 4096];
//! vol.dev().read_at(&mut buf, 0)?;
//! println!("{:?}: {} reads", vol.kind(), vol.stats().read.requests);
//! # Ok(())
//! # }
//! ```
//!
//! The format is the caller's choice, not guessed from the bytes, as cryptsetup's `open
//! --type` is: a raw mapping has no signature to find. Each [`Format`] carries what unlocks
//! it. The result is one struct, not an enum of volume types, so that a caller suspends a
//! volume or counts its requests without matching on its kind; what differs by kind is in
//! [`VolumeKind`] and in the typed refusals. [`OpenRequest`] has public fields and a
//! constructor with the defaults (as [`crate::luks::OpenOptions`] has), and is
//! `#[non_exhaustive]`, so that a new setting does not break callers.
//!
//! The lower-level pieces stay public for callers that need one step only:
//! [`crate::luks::open`] (a LUKS volume on the engine; it refuses authenticated segments),
//! [`crate::integrity::open_luks2`] (an [`crate::integrity::IntegrityVolume`] from a volume key)
//! and [`crate::volume::Volume::new`]. The wrapper that gives an authenticated volume its life
//! cycle is private:
//!
//! ```compile_fail
//! use ucrypt::open::authenticated::Authenticated;
//! ```
//!
//! ```compile_fail
//! use ucrypt::open::Authenticated;
//! ```

mod authenticated;
mod segmented;
#[cfg(test)]
pub(crate) mod tests;

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::engine::{Policies, StatsSnapshot};
use crate::integrity::{self, WriteMode};
use crate::luks::{self, Header, OpenOptions, Unlock, VolumeKey};
use crate::sector::{CipherSpec, Geometry};
use crate::volume::{Volume, VolumeConfig};
use crate::{BlockDev, Error, ErrorKind, Refusal, Result, SecretBytes};

use authenticated::Authenticated;
use segmented::SegmentedDev;

/// Called with the data sector (512-byte units) of each block of an authenticated volume that
/// fails authentication, on the thread whose request read it (the request fails with
/// [`Error::Integrity`] either way). The library prints nothing; a caller that wants a log
/// line writes it here.
pub type OnIntegrityError = Arc<dyn Fn(u64) + Send + Sync>;

/// What to open and how to serve it. [`OpenRequest::new`] starts from: read-write, no
/// discards beyond what the header allows, the `inline` policy and the engine's default spin
/// (those of [`VolumeConfig::new`]), the backend's own description as the volume's name.
#[non_exhaustive]
pub struct OpenRequest {
    /// Where the ciphertext is (and the header, unless the format names a detached one).
    pub data: Arc<dyn Backend>,
    /// What the volume is, with what unlocks it.
    pub format: Format,
    /// Serve reads only.
    pub read_only: bool,
    /// Pass discards down to the backend. LUKS: also when false if the header's
    /// `allow-discards` flag says so (cryptsetup's `--allow-discards` adds to the flag). An
    /// authenticated volume passes none either way.
    pub allow_discards: bool,
    /// How reads and writes are dispatched (see [`Policies`]).
    pub policy: Policies,
    /// How long idle engine workers busy-wait before they sleep (see [`VolumeConfig::spin`]).
    pub spin: Duration,
    /// How messages about the volume name it (an authenticated volume's errors after a
    /// suspend).
    pub name: String,
    /// See [`OnIntegrityError`]; `None`: nobody is told beyond the failed request.
    pub on_integrity_error: Option<OnIntegrityError>,
}

impl OpenRequest {
    pub fn new(data: Arc<dyn Backend>, format: Format) -> OpenRequest {
        let defaults = OpenOptions::default();
        OpenRequest {
            name: data.describe(),
            data,
            format,
            read_only: defaults.read_only,
            allow_discards: false,
            policy: defaults.policy,
            spin: defaults.spin,
            on_integrity_error: None,
        }
    }
}

impl std::fmt::Debug for OpenRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenRequest")
            .field("data", &self.data.describe())
            .field("format", &self.format)
            .field("read_only", &self.read_only)
            .field("allow_discards", &self.allow_discards)
            .field("policy", &self.policy)
            .field("spin", &self.spin)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What the volume is: the caller's choice, as cryptsetup's `open --type` is. Each variant
/// carries what unlocks its format.
#[non_exhaustive]
#[derive(Debug)]
pub enum Format {
    /// A raw dm-crypt mapping (cryptsetup's `--type plain`): no header, the key given is the
    /// volume key.
    Plain(Plain),
    /// LUKS1 or LUKS2, whichever the header is (a caller that requires one version checks
    /// [`Header::version`] after [`luks::read_header`] and passes the header in
    /// [`Luks::header`]).
    Luks(Luks),
    /// A BitLocker volume (cryptsetup's `--type bitlk`).
    Bitlk(Bitlk),
}

/// A BitLocker volume and what unlocks it. Served as cryptsetup maps it
/// ([`crate::bitlk::segments`]); what cryptsetup refuses to activate is refused
/// ([`crate::bitlk::Metadata::check_activation`]).
#[non_exhaustive]
pub struct Bitlk {
    /// A passphrase, a recovery passphrase or the bytes of a `.BEK` startup key file
    /// ([`crate::bitlk::unlock`]), or the volume key itself.
    pub unlock: Unlock,
    /// The metadata, already read by [`crate::bitlk::read_metadata`]; `None`: [`open`] reads it.
    pub metadata: Option<Box<crate::bitlk::Metadata>>,
}

impl Bitlk {
    pub fn new(unlock: Unlock) -> Bitlk {
        Bitlk {
            unlock,
            metadata: None,
        }
    }
}

impl std::fmt::Debug for Bitlk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bitlk")
            .field("unlock", &self.unlock)
            .finish_non_exhaustive()
    }
}

/// A raw dm-crypt mapping: `cryptsetup open --type plain` with a volume key.
#[non_exhaustive]
#[derive(Debug)]
pub struct Plain {
    pub cipher: CipherSpec,
    /// The volume key, as many bytes as `cipher` takes.
    pub key: SecretBytes,
    /// Sector size and IV offset (cryptsetup's `--sector-size`, `--skip`,
    /// `--iv-large-sectors`).
    pub geometry: Geometry,
    /// Where the encrypted data starts on the backend, bytes (cryptsetup's `--offset`).
    pub data_offset_bytes: u64,
    /// How many bytes from there are mapped (cryptsetup's `--size`; a TrueCrypt header's
    /// volume size); `None`: to the end of the backend.
    pub size_bytes: Option<u64>,
}

impl Plain {
    /// The mapping of the whole backend from byte 0.
    pub fn new(cipher: CipherSpec, key: SecretBytes, geometry: Geometry) -> Plain {
        Plain {
            cipher,
            key,
            geometry,
            data_offset_bytes: 0,
            size_bytes: None,
        }
    }
}

/// A LUKS volume and what unlocks it.
#[non_exhaustive]
pub struct Luks {
    /// A passphrase, or the volume key itself (a wrong one is [`Error::VolumeKeyMismatch`],
    /// a wrong passphrase [`Error::WrongPassphrase`]). A volume in reencryption needs the
    /// passphrase: its two segments have two keys.
    pub unlock: Unlock,
    /// Try only this keyslot with a passphrase (cryptsetup's `--key-slot`).
    pub key_slot: Option<u32>,
    /// A detached header (cryptsetup's `--header`); `None`: the header is on the data backend.
    pub header_dev: Option<Arc<dyn Backend>>,
    /// The header, already read by [`luks::read_header`] from the header device (a caller that
    /// showed its warnings or checked its version first); `None`: [`open`] reads it.
    pub header: Option<Box<Header>>,
    /// Authenticated volumes: how writes reach the disk; `None`: as the header's persistent
    /// flags say ([`integrity::luks2_write_mode`]). Cryptsetup's `--integrity-no-journal` is
    /// `Some(WriteMode::Direct)`.
    pub integrity_write_mode: Option<WriteMode>,
}

impl Luks {
    pub fn new(unlock: Unlock) -> Luks {
        Luks {
            unlock,
            key_slot: None,
            header_dev: None,
            header: None,
            integrity_write_mode: None,
        }
    }
}

impl std::fmt::Debug for Luks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Luks")
            .field("unlock", &self.unlock)
            .field("key_slot", &self.key_slot)
            .field(
                "header_dev",
                &self.header_dev.as_ref().map(|h| h.describe()),
            )
            .field("header", &self.header.as_ref().map(|h| h.version()))
            .field("integrity_write_mode", &self.integrity_write_mode)
            .finish()
    }
}

/// What [`open`] found and serves.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeKind {
    /// A raw dm-crypt mapping.
    Plain,
    Luks1,
    /// LUKS2 with a dm-crypt data segment.
    Luks2,
    /// LUKS2 in reencryption: the old and the new segment served at once.
    Luks2Reencrypting,
    /// LUKS2 with authenticated encryption (dm-crypt over dm-integrity).
    Luks2Authenticated,
    /// BitLocker: dm-crypt and dm-zero segments.
    Bitlk,
}

/// Requests and bytes of one direction, and its failed requests by who can act.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub requests: u64,
    /// Bytes of the requests that succeeded.
    pub bytes: u64,
    /// Failed requests, indexed as [`ErrorKind::ALL`] (see [`OpCounts::errors_of`]).
    pub errors: [u64; ErrorKind::ALL.len()],
}

impl OpCounts {
    /// Failed requests of one kind.
    pub fn errors_of(&self, kind: ErrorKind) -> u64 {
        self.errors[kind as usize]
    }
}

/// What an opened volume served so far: reads, and writes (write-zeroes and discards count as
/// writes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub read: OpCounts,
    pub write: OpCounts,
}

impl From<&StatsSnapshot> for Stats {
    fn from(s: &StatsSnapshot) -> Stats {
        let op = |o: &crate::engine::OpStats| OpCounts {
            requests: o.requests,
            bytes: o.bytes,
            errors: o.errors,
        };
        Stats {
            read: op(&s.read),
            write: op(&s.write),
        }
    }
}

/// An opened volume of any kind, with its life cycle. Cheap to clone (every clone is the same
/// volume); the volume closes when the last clone and the last [`Opened::dev`] are dropped.
#[derive(Clone)]
pub struct Opened {
    kind: VolumeKind,
    served: Served,
    /// The device front ends see when it is not the engine's volume itself: the segments of
    /// a BitLocker volume over it.
    segmented: Option<Arc<SegmentedDev>>,
}

/// What runs the volume: the engine, or the dm-integrity layer behind its life-cycle wrapper.
#[derive(Clone)]
enum Served {
    Engine(Arc<Volume>),
    Authenticated(Arc<Authenticated>),
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("kind", &self.kind)
            .field("size", &self.dev().size())
            .finish_non_exhaustive()
    }
}

impl Opened {
    fn engine_volume(kind: VolumeKind, v: Volume) -> Opened {
        Opened {
            kind,
            served: Served::Engine(Arc::new(v)),
            segmented: None,
        }
    }

    pub fn kind(&self) -> VolumeKind {
        self.kind
    }

    /// The volume as front ends serve it.
    pub fn dev(&self) -> Arc<dyn BlockDev> {
        if let Some(s) = &self.segmented {
            return s.clone();
        }
        match &self.served {
            Served::Engine(v) => v.clone(),
            Served::Authenticated(a) => a.clone(),
        }
    }

    /// The engine's [`Volume`] behind every kind but an authenticated one, for what only the
    /// engine does: online reencryption, timing statistics, the run-time spin and discards.
    /// `None` for an authenticated volume, which does not run on the engine.
    pub fn engine(&self) -> Option<&Arc<Volume>> {
        match &self.served {
            Served::Engine(v) => Some(v),
            Served::Authenticated(_) => None,
        }
    }

    /// Passed by every request (as it enters the engine, or as an authenticated volume counts
    /// it): armed, it says when the volume is used again.
    pub fn activity(&self) -> &crate::sync::Tripwire {
        match &self.served {
            Served::Engine(v) => v.activity(),
            Served::Authenticated(a) => a.activity(),
        }
    }

    /// Requests, bytes and errors served so far.
    pub fn stats(&self) -> Stats {
        match &self.served {
            Served::Engine(v) => Stats::from(&v.stats()),
            Served::Authenticated(a) => a.stats(),
        }
    }

    /// dm-integrity's "number of integrity mismatches" (the first field of `dmsetup status`
    /// of an integrity target): blocks whose tag did not verify since the volume was opened,
    /// across suspends. `None` for a volume without authentication.
    pub fn integrity_mismatches(&self) -> Option<u64> {
        match &self.served {
            Served::Engine(_) => None,
            Served::Authenticated(a) => Some(a.integrity_mismatches()),
        }
    }

    /// The dispatch policies requests run with (while suspended: those of the resume).
    pub fn policy(&self) -> Policies {
        match &self.served {
            Served::Engine(v) => v.policy(),
            Served::Authenticated(a) => a.policy(),
        }
    }

    /// Switches the dispatch policies for the next requests; requests already running finish
    /// under the old ones.
    pub fn set_policy(&self, p: impl Into<Policies>) {
        match &self.served {
            Served::Engine(v) => v.set_policy(p),
            Served::Authenticated(a) => a.set_policy(p.into()),
        }
    }

    /// Chunks of the buffers that may hold plaintext whose `mlock` failed (a RLIMIT_MEMLOCK
    /// below what the volume used): 0 when everything is locked. Those chunks still serve, but
    /// the kernel may write them to swap.
    pub fn buffer_lock_failures(&self) -> u64 {
        match &self.served {
            Served::Engine(v) => v.pool_lock_failures(),
            Served::Authenticated(a) => a.buffer_lock_failures(),
        }
    }

    pub fn is_suspended(&self) -> bool {
        match &self.served {
            Served::Engine(v) => v.is_suspended(),
            Served::Authenticated(a) => a.is_suspended(),
        }
    }

    /// Holds new requests (they wait, they do not fail), waits for those inside, flushes and
    /// drops every copy of the key: the cipher contexts of an engine volume, the whole
    /// dm-integrity layer of an authenticated one. A raw mapping is refused
    /// ([`Refusal::SuspendWithoutHeader`]). Must not be called from inside a request.
    pub fn suspend(&self) -> Result<()> {
        if matches!(self.kind, VolumeKind::Plain | VolumeKind::Bitlk) {
            return Err(Error::Refused(Refusal::SuspendWithoutHeader));
        }
        match &self.served {
            Served::Engine(v) => v.suspend(),
            Served::Authenticated(a) => a.suspend(),
        }
    }

    /// Rebuilds what [`Opened::suspend`] dropped from the volume key `vk`, which the caller
    /// unlocked from `hdr`, the header as read again (a keyslot may have changed meanwhile),
    /// and lets the held requests go.
    pub fn resume(&self, hdr: &Header, vk: &VolumeKey) -> Result<()> {
        match &self.served {
            Served::Engine(v) => v.resume(SecretBytes::from_slice(vk.bytes())),
            Served::Authenticated(a) => a.resume(hdr, vk),
        }
    }

    /// Ends a suspended volume for good (a forced close of a suspended device): the requests
    /// held since the suspend, and every later one, fail with EIO. Refused when not suspended.
    pub fn abort_suspended(&self) -> Result<()> {
        match &self.served {
            Served::Engine(v) => v.abort_suspended(),
            Served::Authenticated(a) => a.abort_suspended(),
        }
    }

    /// Whether [`Opened::resize`] can apply to this kind of volume: an authenticated one is
    /// refused ([`Refusal::ResizeAuthenticated`]). For a caller that checks before it does
    /// anything else.
    pub fn check_resize(&self) -> Result<()> {
        if self.kind == VolumeKind::Bitlk {
            return Err(Error::UnsupportedFormat(
                "A BITLK device cannot be resized.".into(),
            ));
        }
        match &self.served {
            Served::Engine(_) => Ok(()),
            Served::Authenticated(_) => Err(Error::Refused(Refusal::ResizeAuthenticated)),
        }
    }

    /// Changes the plaintext size after the backend grew or shrank (cryptsetup's `resize`):
    /// `size_bytes`, or everything the backend holds now. See [`Volume::resize`]; refused for
    /// an authenticated volume ([`Opened::check_resize`]). Returns the new size.
    pub fn resize(&self, size_bytes: Option<u64>) -> Result<u64> {
        self.check_resize()?;
        match &self.served {
            Served::Engine(v) => v.resize(size_bytes),
            Served::Authenticated(_) => Err(Error::Refused(Refusal::ResizeAuthenticated)),
        }
    }
}

/// Opens the volume `req` describes: reads its header (unless given), unlocks it, and builds
/// what serves it. Nothing is printed: a header's warnings are the caller's to show (read the
/// header with [`luks::read_header`] and pass it in [`Luks::header`]).
pub fn open(req: OpenRequest) -> Result<Opened> {
    let OpenRequest {
        data,
        format,
        read_only,
        allow_discards,
        policy,
        spin,
        name,
        on_integrity_error,
    } = req;
    match format {
        Format::Plain(p) => {
            let mut cfg = VolumeConfig::new(p.cipher, p.key, p.geometry);
            cfg.data_offset_bytes = p.data_offset_bytes;
            cfg.size_bytes = p.size_bytes;
            cfg.policy = policy;
            cfg.spin = spin;
            cfg.read_only = read_only;
            cfg.allow_discards = allow_discards;
            Ok(Opened::engine_volume(
                VolumeKind::Plain,
                Volume::new(data, cfg)?,
            ))
        }
        Format::Luks(l) => {
            let hdr = match l.header {
                Some(h) => *h,
                None => luks::read_header(l.header_dev.as_deref().unwrap_or(data.as_ref()))?,
            };
            let opts = OpenOptions {
                key_slot: l.key_slot,
                read_only,
                allow_discards,
                policy,
                spin,
                header: l.header_dev,
            };
            // A volume key given as such that the digest refuses is no wrong passphrase.
            let key_given = matches!(l.unlock, Unlock::VolumeKey(_));
            let opened = if integrity::superblock_offset(&hdr).is_some() {
                let how = authenticated::How {
                    name,
                    write_mode: l.integrity_write_mode,
                    on_integrity_error,
                };
                authenticated::open(data, &hdr, l.unlock, &opts, how).map(|a| Opened {
                    kind: VolumeKind::Luks2Authenticated,
                    served: Served::Authenticated(Arc::new(a)),
                    segmented: None,
                })
            } else {
                let kind = match &hdr {
                    Header::Luks1(_) => VolumeKind::Luks1,
                    Header::Luks2(_) if hdr.in_reencryption() => VolumeKind::Luks2Reencrypting,
                    Header::Luks2(_) => VolumeKind::Luks2,
                };
                luks::open_parsed(data, &hdr, l.unlock, &opts)
                    .map(|v| Opened::engine_volume(kind, v))
            };
            opened.map_err(|e| match e {
                Error::WrongPassphrase if key_given => Error::VolumeKeyMismatch,
                e => e,
            })
        }
        Format::Bitlk(b) => {
            let serve = (read_only, allow_discards, policy, spin);
            open_bitlk(data, b, serve)
        }
    }
}

/// A BitLocker volume: unlocked, one engine volume over the whole device with IVs from byte
/// 0, the segments over it.
fn open_bitlk(
    data: Arc<dyn Backend>,
    b: Bitlk,
    (read_only, allow_discards, policy, spin): (bool, bool, Policies, Duration),
) -> Result<Opened> {
    let meta = match b.metadata {
        Some(m) => *m,
        None => crate::bitlk::read_metadata(data.as_ref())?,
    };
    meta.check_activation()?;
    let key = match b.unlock {
        Unlock::Passphrase(p) => crate::bitlk::unlock(&meta, p.as_ref())?,
        Unlock::VolumeKey(k) => k,
    };
    let spec = meta.encryption.cipher_spec()?;
    let mut geometry = Geometry::new(meta.sector_size);
    // cryptsetup maps 4096-byte BitLocker sectors with IVs counted in sectors.
    geometry.iv_large_sectors = meta.sector_size.bytes() != 512;
    let segments = crate::bitlk::segments(&meta, data.size())?;
    let mut cfg = VolumeConfig::new(spec, key, geometry);
    cfg.policy = policy;
    cfg.spin = spin;
    cfg.read_only = read_only;
    cfg.allow_discards = allow_discards;
    let v = Arc::new(Volume::new(data, cfg)?);
    let dev = SegmentedDev::new(v.clone(), segments)?;
    Ok(Opened {
        kind: VolumeKind::Bitlk,
        served: Served::Engine(v),
        segmented: Some(Arc::new(dev)),
    })
}
