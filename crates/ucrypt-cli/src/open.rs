//! Opening a volume from command-line arguments: the one place the CLI turns a path and
//! options into an `Arc<dyn BlockDev>`, for every front end (NBD, FUSE, ublk) and data verb
//! (export, import).
//!
//! Raw mode (`--cipher` with `--volume-key-file`) mirrors `cryptsetup open --type plain`:
//! `--offset` is the data start and `--skip` the IV offset, both in 512-byte sectors.
//! Without `--cipher` the volume is LUKS1/LUKS2, unlocked like `cryptsetup open`: passphrase
//! from `--key-file` (or asked), or `--volume-key-file`; `--header` for a detached header.
//! The LUKS work itself is one library call, `ucrypt::luks::open`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use clap::Args;
use ucrypt::backend::{Backend, CacheMode, FileBackend};
use ucrypt::engine::{Policies, Policy};
use ucrypt::integrity::{self, superblock::flags as sb_flags, IntegrityVolume};
use ucrypt::luks::{self, OpenOptions, Unlock};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::sync::lock;
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, Error, ErrorKind, SecretBytes};

use crate::error::{CliError, CliResult};
use crate::header_dev::open_header_file;
use crate::pass::{self, Source};
use crate::target::{RemoteArgs, Target};

/// The default dispatch policy of every verb and front end. `auto` is `inline` for requests
/// below a threshold calibrated at start (a 4 KiB request takes the same direct path) and
/// splits larger ones across cores when one is idle: one stream of large requests then gets
/// more than one core, and many streams, which keep every core busy already, are served as
/// `inline` would (BENCHMARKS.md, `bench engine` scenarios 4 and 6).
pub const DEFAULT_POLICY: Policy = Policy::Auto;

/// cryptsetup's `--type` for `open`: what the volume is. Parsed once here; a type ucrypt does
/// not read is refused by name before anything is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceType {
    /// LUKS of either version, as the header says.
    Luks,
    Luks1,
    Luks2,
    /// No header: a raw dm-crypt mapping (`--cipher`, `--volume-key-file`).
    Plain,
    /// TrueCrypt/VeraCrypt (`crate::formats`).
    Tcrypt,
    /// A format cryptsetup opens and ucrypt does not: its cryptsetup name and what it is.
    Foreign(&'static str, &'static str),
}

/// The formats cryptsetup's `open --type` takes that ucrypt does not read.
const FOREIGN_TYPES: [(&str, &str); 3] = [
    ("bitlk", "BitLocker"),
    ("fvault2", "FileVault2"),
    ("loopaes", "loop-AES"),
];

impl std::str::FromStr for DeviceType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "luks" => Ok(DeviceType::Luks),
            "luks1" => Ok(DeviceType::Luks1),
            "luks2" => Ok(DeviceType::Luks2),
            "plain" => Ok(DeviceType::Plain),
            "tcrypt" => Ok(DeviceType::Tcrypt),
            _ => FOREIGN_TYPES
                .iter()
                .find(|(name, _)| *name == s)
                .map(|&(name, what)| DeviceType::Foreign(name, what))
                .ok_or_else(|| {
                    format!(
                        "unknown device type '{s}' (cryptsetup's types: luks, luks1, luks2, \
                         plain, tcrypt, bitlk, fvault2, loopaes)"
                    )
                }),
        }
    }
}

impl DeviceType {
    /// cryptsetup's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::Luks => "luks",
            DeviceType::Luks1 => "luks1",
            DeviceType::Luks2 => "luks2",
            DeviceType::Plain => "plain",
            DeviceType::Tcrypt => "tcrypt",
            DeviceType::Foreign(name, _) => name,
        }
    }

    /// Refuses a format ucrypt does not read (exit 1, before any passphrase is asked).
    pub fn check_readable(self) -> CliResult<()> {
        match self {
            DeviceType::Foreign(name, what) => Err(CliError::Usage(format!(
                "--type {name}: ucrypt does not open {what} volumes (it opens luks, luks1, luks2, \
                 plain and tcrypt)"
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses a LUKS header of another version than the type names, as cryptsetup's
    /// `crypt_load` with that type does ("not a valid LUKS device", exit 1), saying which it
    /// is.
    pub fn check_header(self, hdr: &luks::Header, device: &str) -> ucrypt::Result<()> {
        let want = match self {
            DeviceType::Luks1 => 1,
            DeviceType::Luks2 => 2,
            _ => return Ok(()),
        };
        if hdr.version() == want {
            return Ok(());
        }
        Err(Error::NotLuks(format!(
            "{device} (it is LUKS{}, and --type {} was given)",
            hdr.version(),
            self.name()
        )))
    }
}

#[derive(Args, Debug, Clone)]
pub struct VolumeArgs {
    /// The volume: an image file, a block device, or an RBD image (rbd:POOL/IMAGE[@SNAP]).
    pub volume: Target,
    /// Raw (plain) mode: dm-crypt cipher spec of a volume without a header, e.g. aes-xts-plain64,
    /// serpent-xts-plain64, aes-lrw-benbi, xchacha12,aes-adiantum-plain64 (with
    /// --volume-key-file). `--type tcrypt`: only cipher chains whose name contains this.
    #[arg(long)]
    pub cipher: Option<String>,
    /// The volume key (raw bytes) from this file, instead of a passphrase; exactly the key's
    /// size is read (the header's, or in raw mode --key-size), so /dev/urandom works.
    #[arg(long)]
    pub volume_key_file: Option<PathBuf>,
    /// Raw mode: the key's size in bits (default: the cipher's, 512 for aes-xts-plain64).
    #[arg(long, short = 's', requires = "cipher")]
    pub key_size: Option<u32>,
    /// Raw mode: encryption sector size in bytes (512, 1024, 2048, 4096).
    #[arg(long, default_value_t = 512)]
    pub sector_size: u64,
    /// Raw mode: start of the encrypted data on the device, in 512-byte sectors.
    #[arg(long, short = 'o', default_value_t = 0)]
    pub offset: u64,
    /// Raw mode: IV offset, in 512-byte sectors (cryptsetup's --skip).
    #[arg(long, short = 'p', default_value_t = 0)]
    pub skip: u64,
    /// Raw mode: the IV counts encryption sectors, not 512-byte units.
    #[arg(long)]
    pub iv_large_sectors: bool,
    /// LUKS: passphrase from this file ("-" = stdin); without it the passphrase is asked.
    #[arg(long, short = 'd', conflicts_with = "cipher")]
    pub key_file: Option<String>,
    /// LUKS: skip this many bytes of the key file.
    #[arg(long, conflicts_with = "cipher")]
    pub keyfile_offset: Option<u64>,
    /// LUKS: read at most this many bytes of the key file.
    #[arg(long, short = 'l', conflicts_with = "cipher")]
    pub keyfile_size: Option<u64>,
    /// LUKS: try only this keyslot.
    #[arg(long, short = 'S', conflicts_with = "cipher")]
    pub key_slot: Option<u32>,
    /// LUKS: detached header file.
    #[arg(long, conflicts_with = "cipher")]
    pub header: Option<PathBuf>,
    /// LUKS: pass discards (TRIM) down to the backing store even if the header does not
    /// carry the allow-discards flag. Discards reveal which blocks are unused.
    #[arg(long)]
    pub allow_discards: bool,
    /// Open read-only (`--readonly` as cryptsetup spells it).
    #[arg(long, short = 'r', alias = "readonly")]
    pub read_only: bool,
    /// Dispatch policy: inline, parallel, ordered, queued, auto (inline for small requests,
    /// split across cores for large ones when a core is idle), or one per direction,
    /// `read=P,write=Q`. Default: auto, but a direction a LUKS2 header flags
    /// no-read-workqueue or no-write-workqueue (`config --persistent`) runs inline.
    #[arg(long, value_name = "POLICY")]
    pub policy: Option<Policies>,
    /// Reads run inline, whatever --policy says (dm-crypt's flag: no read workqueue).
    #[arg(long = "perf-no_read_workqueue")]
    pub perf_no_read_workqueue: bool,
    /// Writes run inline, whatever --policy says (dm-crypt's flag: no write workqueue).
    #[arg(long = "perf-no_write_workqueue")]
    pub perf_no_write_workqueue: bool,
    /// How long idle engine workers (and callers waiting for them, and for `serve` an NBD
    /// connection's reader) busy-wait for more work before they sleep, in µs; at most 10000.
    /// 0 never spins: no CPU time after the last request, but each hand-off pays a wake-up
    /// (tens of µs on a VM).
    #[arg(long, value_name = "US", default_value_t = 50)]
    pub spin_us: u64,
    /// A local volume's use of the host's page cache, as qemu spells it: none (O_DIRECT; the
    /// default: whoever reads the plaintext caches it already), writeback (page cache, durable
    /// at a flush), writethrough (page cache, every write durable), directsync (O_DIRECT,
    /// every write durable), unsafe (flushes ignored: scratch volumes only).
    #[arg(long, value_name = "MODE", default_value_t = CacheMode::None)]
    pub cache: CacheMode,
    /// Authenticated volumes: write in dm-integrity's direct mode (no journal: faster, but a
    /// crash mid-write may leave blocks that fail authentication), as cryptsetup's open does.
    /// Without it, writes go through the journal (unless the header's persistent flags say
    /// `no-journal`).
    #[arg(long)]
    pub integrity_no_journal: bool,
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// The passphrase, already read (`ucrypt open` of a remote volume reads it before it
    /// forks, and the daemon connects and unlocks with it): used instead of asking again.
    #[arg(skip)]
    pub passphrase_read: Option<std::sync::Arc<SecretBytes>>,
    /// `ucrypt open --tries`: how many times a passphrase typed on a terminal is asked for.
    #[arg(skip)]
    pub tries: Option<u32>,
    /// `ucrypt open --type luks1|luks2`: the LUKS version the header must have.
    #[arg(skip)]
    pub device_type: Option<DeviceType>,
    #[command(flatten)]
    pub tcrypt: crate::formats::TcryptArgs,
}

/// A volume whose header was read (and its warnings shown) and whose key material is in hand,
/// but which is not built yet: nothing here has spawned a thread, so the process may still
/// fork (`ucrypt open` asks for the passphrase, forks, and opens in the daemon).
pub struct Prepared {
    /// The volume as the user named it, for error messages.
    name: String,
    pub kind: PreparedKind,
}

pub enum PreparedKind {
    /// LUKS1/LUKS2: unlocked (or refused) by `luks::open_parsed`.
    Luks {
        data: Arc<dyn Backend>,
        /// Boxed: a parsed header is large next to the raw variant.
        hdr: Box<luks::Header>,
        unlock: Unlock,
        opts: OpenOptions,
        /// Authenticated volumes: dm-integrity's direct mode (`--integrity-no-journal`).
        integrity_no_journal: bool,
        /// The local file the header was read from (`opts.header`), under cryptsetup's shared
        /// lock until released ([`HeaderAt`]); `None` for a remote volume.
        header_file: Option<Arc<FileBackend>>,
    },
    /// Raw dm-crypt mapping (cryptsetup's plain mode, and the foreign formats whose header
    /// gave the key): the key is already the volume key.
    Raw {
        backend: Arc<dyn Backend>,
        cfg: VolumeConfig,
    },
}

/// An opened volume: the engine's dm-crypt [`Volume`], or a LUKS2 volume with authenticated
/// encryption (dm-crypt over dm-integrity, [`IntegrityVolume`] behind [`Authenticated`]).
/// Front ends need only [`Opened::dev`]; the life-cycle daemon and metrics use the rest.
#[derive(Clone)]
pub enum Opened {
    Plain(Arc<Volume>),
    Integrity(Arc<Authenticated>),
}

/// Requests and bytes of one direction, as `status` reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub requests: u64,
    pub bytes: u64,
}

impl Opened {
    /// The volume as the front ends serve it.
    pub fn dev(&self) -> Arc<dyn BlockDev> {
        match self {
            Opened::Plain(v) => v.clone(),
            Opened::Integrity(v) => v.clone(),
        }
    }

    /// The engine's volume (statistics with timings, run-time policy); `None` for an
    /// authenticated volume, which does not run on the engine.
    pub fn plain(&self) -> Option<&Arc<Volume>> {
        match self {
            Opened::Plain(v) => Some(v),
            Opened::Integrity(_) => None,
        }
    }

    /// Reads and writes (write-zeroes and discards count as writes) served so far.
    pub fn op_counts(&self) -> [OpCounts; 2] {
        match self {
            Opened::Plain(v) => {
                let s = v.stats();
                [
                    OpCounts {
                        requests: s.read.requests,
                        bytes: s.read.bytes,
                    },
                    OpCounts {
                        requests: s.write.requests,
                        bytes: s.write.bytes,
                    },
                ]
            }
            Opened::Integrity(a) => a.op_counts(),
        }
    }

    /// dm-integrity's "number of integrity mismatches" (the first field of `dmsetup status`
    /// of an integrity target): blocks whose tag did not verify since the volume was opened.
    /// `None` for a volume without authentication.
    pub fn integrity_mismatches(&self) -> Option<u64> {
        match self {
            Opened::Plain(_) => None,
            Opened::Integrity(a) => Some(a.integrity_mismatches()),
        }
    }

    /// The dispatch policy as `status` prints it.
    pub fn policy(&self) -> String {
        match self {
            Opened::Plain(v) => v.policy().to_string(),
            Opened::Integrity(a) => a.policy().to_string(),
        }
    }

    pub fn is_suspended(&self) -> bool {
        match self {
            Opened::Plain(v) => v.is_suspended(),
            Opened::Integrity(a) => a.is_suspended(),
        }
    }

    /// Holds new requests, waits for those inside, flushes and drops every copy of the key
    /// (the cipher contexts of a plain volume; the whole tag layer of an authenticated one).
    pub fn suspend(&self) -> ucrypt::Result<()> {
        match self {
            Opened::Plain(v) => v.suspend(),
            Opened::Integrity(a) => a.suspend(),
        }
    }

    /// Ends a suspended volume for good (`close --force` of a suspended device): the requests
    /// held since the suspend, and every later one, fail with EIO.
    pub fn abort_suspended(&self) -> ucrypt::Result<()> {
        match self {
            Opened::Plain(v) => v.abort_suspended(),
            Opened::Integrity(a) => a.abort_suspended(),
        }
    }

    /// Rebuilds what `suspend` dropped from the volume key (verified against `hdr`, the header
    /// as read again) and lets the held requests go.
    pub fn resume(&self, hdr: &luks::Header, vk: &luks::VolumeKey) -> ucrypt::Result<()> {
        match self {
            Opened::Plain(v) => v.resume(SecretBytes::from_slice(vk.bytes())),
            Opened::Integrity(a) => a.resume(hdr, vk),
        }
    }
}

/// How often `suspend` looks whether the requests inside an authenticated volume are done.
const SUSPEND_POLL: Duration = Duration::from_millis(1);

/// Requests and bytes of one direction, counted as they are served.
#[derive(Default)]
struct OpCounters {
    requests: AtomicU64,
    bytes: AtomicU64,
    /// Failed requests by [`ucrypt::ErrorKind`] (indexed as `ErrorKind::ALL`).
    errors: [AtomicU64; ErrorKind::ALL.len()],
}

impl OpCounters {
    fn count<T>(&self, bytes: u64, r: &ucrypt::Result<T>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(_) => {
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Err(e) => {
                self.errors[e.kind() as usize].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn snapshot(&self) -> OpCounts {
        OpCounts {
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

/// An [`IntegrityVolume`] as the command line serves it: a block that fails authentication
/// is logged as one line on standard error (the request fails with the error's errno,
/// EILSEQ; NBD, which has no such error, sends NBD_EIO); requests, bytes and errors are
/// counted for `status` and metrics; and it can be suspended: the whole `IntegrityVolume`
/// (its key, its keyed tag ciphers) is dropped and built again from the volume key on
/// resume, while requests wait.
pub struct Authenticated {
    name: String,
    /// The dm-integrity device (the LUKS2 data device), kept to rebuild the volume on resume.
    data: Arc<dyn Backend>,
    read_only: bool,
    /// Journal or direct, as opened; kept for resume.
    write_mode: integrity::WriteMode,
    /// The dispatch policies (docs/integrity.md, "Dispatch"): set at open and by `refresh`,
    /// given to the volume built again on resume.
    policy: Mutex<Policies>,
    /// Fixed by the dm-integrity superblock: known while suspended too.
    size: u64,
    block_size: u32,
    /// `None` while suspended.
    inner: Mutex<Option<Arc<IntegrityVolume>>>,
    resumed: Condvar,
    /// Set (under `inner`'s lock) by [`Authenticated::abort_suspended`]: the waiting requests
    /// and every later one fail with EIO.
    aborted: AtomicBool,
    /// Mismatches counted by the volumes dropped at earlier suspends.
    mismatches_before: AtomicU64,
    ops: [OpCounters; 2],
}

const READ: usize = 0;
const WRITE: usize = 1;

impl Authenticated {
    fn new(
        name: &str,
        data: Arc<dyn Backend>,
        vol: IntegrityVolume,
        write_mode: integrity::WriteMode,
    ) -> Self {
        Authenticated {
            name: name.to_string(),
            data,
            read_only: vol.read_only(),
            write_mode,
            policy: Mutex::new(vol.policy()),
            size: vol.size(),
            block_size: vol.block_size(),
            inner: Mutex::new(Some(Arc::new(vol))),
            resumed: Condvar::new(),
            aborted: AtomicBool::new(false),
            mismatches_before: AtomicU64::new(0),
            ops: Default::default(),
        }
    }

    /// The volume to serve a request with; waits while suspended.
    /// The volume to serve a request with; waits while suspended, EIO once aborted.
    fn vol(&self) -> ucrypt::Result<Arc<IntegrityVolume>> {
        let mut g = lock(&self.inner);
        loop {
            if let Some(v) = &*g {
                return Ok(v.clone());
            }
            if self.aborted.load(Ordering::Relaxed) {
                return Err(Error::io(
                    format!("{}: the volume was closed while suspended", self.name),
                    std::io::Error::from_raw_os_error(libc::EIO),
                ));
            }
            g = self.resumed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Ends a suspended volume for good (`close --force`): the requests waiting for the
    /// resume, and every later one, fail with EIO.
    pub fn abort_suspended(&self) -> ucrypt::Result<()> {
        let g = lock(&self.inner);
        if g.is_some() {
            return Err(Error::InvalidArgument("not suspended".into()));
        }
        // Under the lock the waiters hold between their look and their wait: none misses it.
        self.aborted.store(true, Ordering::Relaxed);
        drop(g);
        self.resumed.notify_all();
        Ok(())
    }

    fn logged<T>(&self, r: ucrypt::Result<T>) -> ucrypt::Result<T> {
        if let Err(Error::Integrity { sector }) = &r {
            eprintln!(
                "{}: integrity error: block at data sector {sector} failed authentication",
                self.name
            );
        }
        r
    }

    fn served<T>(&self, op: usize, bytes: u64, r: ucrypt::Result<T>) -> ucrypt::Result<T> {
        self.ops[op].count(bytes, &r);
        self.logged(r)
    }

    /// Reads and writes served so far (write-zeroes and discards count as writes).
    pub fn op_counts(&self) -> [OpCounts; 2] {
        [self.ops[READ].snapshot(), self.ops[WRITE].snapshot()]
    }

    /// Failed reads (or writes, with `write`) whose error is of `kind`.
    pub fn errors_of(&self, write: bool, kind: ErrorKind) -> u64 {
        self.ops[usize::from(write)].errors[kind as usize].load(Ordering::Relaxed)
    }

    /// Blocks whose tag did not verify since opening (across suspends).
    pub fn integrity_mismatches(&self) -> u64 {
        let now = lock(&self.inner)
            .as_ref()
            .map_or(0, |v| v.integrity_errors());
        self.mismatches_before.load(Ordering::Relaxed) + now
    }

    pub fn is_suspended(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// The dispatch policies requests run with (also while suspended: those of the resume).
    pub fn policy(&self) -> Policies {
        *lock(&self.policy)
    }

    /// Switches the dispatch policies for the next requests (and the volume built on resume).
    pub fn set_policy(&self, p: Policies) {
        let mut g = lock(&self.policy);
        *g = p;
        if let Some(v) = &*lock(&self.inner) {
            v.set_policy(p);
        }
    }

    /// Takes the volume away from new requests, waits for the requests inside to finish,
    /// flushes and drops it: its `SecretBytes` key and keyed contexts are wiped on drop.
    pub fn suspend(&self) -> ucrypt::Result<()> {
        let Some(mut v) = lock(&self.inner).take() else {
            return Err(Error::InvalidArgument("already suspended".into()));
        };
        let vol = loop {
            match Arc::try_unwrap(v) {
                Ok(vol) => break vol,
                Err(still_used) => {
                    v = still_used;
                    std::thread::sleep(SUSPEND_POLL);
                }
            }
        };
        if let Err(e) = vol.flush() {
            // Not suspended: the volume serves on.
            *lock(&self.inner) = Some(Arc::new(vol));
            self.resumed.notify_all();
            return Err(e);
        }
        self.mismatches_before
            .fetch_add(vol.integrity_errors(), Ordering::Relaxed);
        drop(vol);
        Ok(())
    }

    /// Builds the volume again from `vk` and lets the waiting requests in.
    pub fn resume(&self, hdr: &luks::Header, vk: &luks::VolumeKey) -> ucrypt::Result<()> {
        let vol = integrity::open_luks2_mode(
            self.data.clone(),
            hdr,
            vk,
            self.read_only,
            self.write_mode,
        )?;
        check_superblock_flags(&vol)?;
        if vol.size() != self.size || vol.block_size() != self.block_size {
            return Err(Error::InvalidArgument(format!(
                "{}: the dm-integrity superblock changed while suspended",
                self.name
            )));
        }
        let mut g = lock(&self.inner);
        if g.is_some() || self.aborted.load(Ordering::Relaxed) {
            return Err(Error::InvalidArgument("not suspended".into()));
        }
        vol.set_policy(self.policy());
        *g = Some(Arc::new(vol));
        drop(g);
        self.resumed.notify_all();
        Ok(())
    }
}

impl BlockDev for Authenticated {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        let n = buf.len() as u64;
        let r = self.vol().and_then(|v| v.read_at(buf, offset));
        self.served(READ, n, r)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        // An unaligned write reads (and verifies) the blocks at its ends.
        let r = self.vol().and_then(|v| v.write_at(buf, offset));
        self.served(WRITE, buf.len() as u64, r)
    }
    fn write_at_mut(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        let n = buf.len() as u64;
        let r = self.vol().and_then(|v| v.write_at_mut(buf, offset));
        self.served(WRITE, n, r)
    }
    fn write_fua(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        let n = buf.len() as u64;
        let r = self.vol().and_then(|v| v.write_fua(buf, offset));
        self.served(WRITE, n, r)
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.vol()?.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        let r = self.vol().and_then(|v| v.discard(offset, len));
        self.served(WRITE, len, r)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        let r = self.vol().and_then(|v| v.write_zeroes(offset, len));
        self.served(WRITE, len, r)
    }
}

/// Refuses a dm-integrity superblock whose flags say its tags are not all valid:
/// recalculation in progress (tags beyond `recalc_sector` were never written) or a dirty
/// bitmap (bitmap mode left blocks whose tags are stale).
fn check_superblock_flags(vol: &IntegrityVolume) -> ucrypt::Result<()> {
    let sb = &vol.layout().sb;
    for (flag, what) in [
        (
            sb_flags::RECALCULATING,
            "its tags are being recalculated (not all are valid)",
        ),
        (
            sb_flags::DIRTY_BITMAP,
            "its bitmap is dirty (tags of some blocks are stale)",
        ),
    ] {
        if sb.has(flag) {
            return Err(Error::UnsupportedLuks(format!(
                "the dm-integrity superblock says {what}; let the kernel finish with it \
                 (cryptsetup open, then close) before ucrypt opens it"
            )));
        }
    }
    Ok(())
}

/// Opens the authenticated segment of a LUKS2 volume (see [`check_superblock_flags`] for the
/// superblocks refused), in dm-integrity's direct mode with cryptsetup's
/// `--integrity-no-journal` (or the header's persistent `no-journal` flag), else through its
/// journal; a journal left with committed entries is replayed first (docs/integrity.md).
fn open_authenticated(
    name: &str,
    data: Arc<dyn Backend>,
    hdr: &luks::Header,
    unlock: Unlock,
    opts: &OpenOptions,
    integrity_no_journal: bool,
) -> ucrypt::Result<Opened> {
    let hdr_dev: &dyn Backend = match &opts.header {
        Some(h) => h.as_ref(),
        None => data.as_ref(),
    };
    hdr.check_requirements()?;
    let (_, vk) = luks::unlock_key(hdr_dev, hdr, unlock, opts.key_slot)?;
    let write_mode = if integrity_no_journal {
        integrity::WriteMode::Direct
    } else {
        integrity::luks2_write_mode(hdr)
    };
    let vol = integrity::open_luks2_mode(data.clone(), hdr, &vk, opts.read_only, write_mode)?;
    drop(vk);
    vol.set_policy(opts.policy);
    check_superblock_flags(&vol)?;
    Ok(Opened::Integrity(Arc::new(Authenticated::new(
        name, data, vol, write_mode,
    ))))
}

/// The header a process serving a LUKS volume reads again (the key checked on resume): the
/// local file it was opened from, kept open but under cryptsetup's shared lock only while
/// read, so that keyslot verbs of either tool work on the open volume as on an active
/// dm-crypt device; or a remote volume's data connection.
#[derive(Clone)]
pub struct HeaderAt {
    dev: Arc<dyn Backend>,
    file: Option<Arc<FileBackend>>,
}

impl HeaderAt {
    /// Releases cryptsetup's lock, held since the header was read at open.
    pub fn release(&self) -> CliResult<()> {
        if let Some(f) = &self.file {
            f.unlock()?;
        }
        Ok(())
    }

    /// Runs `f` on the header device under cryptsetup's shared lock.
    pub fn read<T>(&self, f: impl FnOnce(&dyn Backend) -> T) -> CliResult<T> {
        if let Some(file) = &self.file {
            file.lock(ucrypt::backend::FileLock::Shared)?;
        }
        let r = f(self.dev.as_ref());
        self.release()?;
        Ok(r)
    }
}

impl Prepared {
    /// LUKS: the device the header is read from (the volume, or --header).
    pub fn header_device(&self) -> Option<HeaderAt> {
        match &self.kind {
            PreparedKind::Luks {
                data,
                opts,
                header_file,
                ..
            } => Some(HeaderAt {
                dev: opts.header.clone().unwrap_or_else(|| data.clone()),
                file: header_file.clone(),
            }),
            PreparedKind::Raw { .. } => None,
        }
    }

    /// Builds the volume: unlocks a keyslot (LUKS) and starts the engine's threads.
    pub fn open(self) -> CliResult<Opened> {
        let vol = match self.kind {
            PreparedKind::Luks {
                data,
                hdr,
                unlock,
                opts,
                integrity_no_journal,
                header_file: _,
            } => {
                // A volume key given as such that the digest refuses is no wrong passphrase.
                let key_given = matches!(unlock, Unlock::VolumeKey(_));
                let opened = if integrity::superblock_offset(&hdr).is_some() {
                    open_authenticated(&self.name, data, &hdr, unlock, &opts, integrity_no_journal)
                } else {
                    luks::open_parsed(data, &hdr, unlock, &opts).map(|v| Opened::Plain(Arc::new(v)))
                };
                opened
                    .map_err(|e| {
                        if key_given {
                            crate::volume_key::mismatch(e)
                        } else {
                            e
                        }
                    })
                    .map_err(CliError::from)
            }
            PreparedKind::Raw { backend, cfg } => Volume::new(backend, cfg)
                .map(|v| Opened::Plain(Arc::new(v)))
                .map_err(CliError::from),
        };
        // Name the volume in the one line the user sees, keeping the error's type (and so its
        // exit code).
        vol.map_err(|e| e.at(self.name))
    }
}

impl VolumeArgs {
    /// The policies to open with: --policy, else the default with the header's persistent
    /// no-*-workqueue flags applied; then the --perf-no_*_workqueue flags.
    pub fn policies(&self, header_flags: &[String]) -> Policies {
        let flagged = |f: &str| header_flags.iter().any(|h| h == f);
        let mut p = self.policy.unwrap_or_else(|| {
            let mut p = Policies::from(DEFAULT_POLICY);
            if flagged("no-read-workqueue") {
                p.read = Policy::Inline;
            }
            if flagged("no-write-workqueue") {
                p.write = Policy::Inline;
            }
            p
        });
        if self.perf_no_read_workqueue {
            p.read = Policy::Inline;
        }
        if self.perf_no_write_workqueue {
            p.write = Policy::Inline;
        }
        p
    }

    fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us)
    }

    /// Marks the volume (and its detached header) as served by this process (read-only or
    /// read-write, as opened) while the returned guard lives, so that a second serving
    /// process, an offline `reencrypt` or a `format` refuses it (`crate::in_use`); refuses
    /// (exit 5) a volume another process serves in a way that conflicts. Taken by the
    /// processes that serve it: the `open` daemon, `serve`, `mount`, `ublk`.
    pub fn mark_served(&self) -> CliResult<crate::in_use::InUse> {
        crate::in_use::mark(&self.local_paths(), self.access())
    }

    /// [`Self::mark_served`] for `serve --unencrypted` (the file served as it is, a test and
    /// benchmark baseline): a shared mark, whatever the access. Such a server writes no
    /// ciphertext, so it may sit beside another one of the same file (a baseline serves one
    /// file over unix and TCP at once), but never beside a process that writes the file as a
    /// volume, and `format` or an offline `reencrypt` still refuse the file.
    pub fn mark_served_unencrypted(&self) -> CliResult<crate::in_use::InUse> {
        crate::in_use::mark(&self.local_paths(), crate::in_use::Access::Read)
    }

    /// Refuses (exit 5) what [`Self::mark_served`] would refuse, without marking: checked
    /// before the passphrase is asked.
    pub fn check_servable(&self) -> CliResult<()> {
        crate::in_use::check_servable(&self.local_paths(), self.access())
    }

    fn access(&self) -> crate::in_use::Access {
        crate::in_use::Access::of(self.read_only)
    }

    /// Refuses (exit 5) when a ucrypt process serves the volume or its detached header;
    /// `what` says what was refused and how to go on.
    pub fn refuse_if_served(&self, what: &str) -> CliResult<()> {
        Ok(crate::in_use::refuse_if_served(&self.local_paths(), what)?)
    }

    /// Refuses (exit 5) when a ucrypt process serves the volume or its detached header
    /// read-write (a reader's check: one serving it read-only does not count).
    pub fn refuse_if_served_for_reading(&self, what: &str) -> CliResult<()> {
        Ok(crate::in_use::refuse_if_served_for(
            &self.local_paths(),
            crate::in_use::Access::Read,
            what,
        )?)
    }

    /// The volume's file or device node and its detached header, where they are local paths.
    fn local_paths(&self) -> Vec<&std::path::Path> {
        let mut paths: Vec<&std::path::Path> = Vec::with_capacity(2);
        if let Target::Path(p) = &self.volume {
            paths.push(p);
        }
        if let Some(h) = &self.header {
            paths.push(h);
        }
        paths
    }

    /// Opens the volume for a front end or a data verb.
    pub fn open(&self) -> CliResult<Opened> {
        let opened = self.prepare()?.open()?;
        // Nothing to serve: a header backup, or a detached header given as the volume.
        if opened.dev().size() == 0 {
            return Err(CliError::Usage(format!(
                "{}: the volume has no data (the device ends where its data would begin: a \
                 header backup, or a detached header to give with --header beside the data \
                 device?)",
                self.volume
            )));
        }
        Ok(opened)
    }

    /// Everything of opening that happens before the volume's threads exist: the header read
    /// (its warnings printed) and the passphrase or key read.
    pub fn prepare(&self) -> CliResult<Prepared> {
        // This process is about to hold key material: keep it out of core dumps.
        ucrypt::secret::disable_core_dumps();
        let name = self.volume.to_string();
        let kind = match (&self.cipher, self.device_type) {
            (_, Some(DeviceType::Tcrypt)) => crate::formats::prepare_tcrypt(self),
            (None, _) => self.prepare_luks(),
            (Some(cipher), _) => self.prepare_raw(cipher),
        };
        let kind = kind.map_err(|e| e.at(name.clone()))?;
        Ok(Prepared { name, kind })
    }

    /// The passphrase from --key-file (with its offset and size) or, without one, asked on
    /// the terminal.
    pub fn read_passphrase(&self) -> CliResult<SecretBytes> {
        Ok(pass::read_passphrase(
            &Source {
                key_file: self.key_file.as_deref(),
                offset: self.keyfile_offset.unwrap_or(0),
                size: self.keyfile_size,
            },
            &format!("Enter passphrase for {}: ", self.volume),
            false,
        )?)
    }

    /// The passphrase, asked for on the terminal (or read from a key file or a pipe). Typed on
    /// a terminal, it is tried here against the header, and a wrong one asked for again up to
    /// `--tries` times, as cryptsetup's open does; the volume is then unlocked with the key
    /// found (one key derivation, not two), or with the passphrase when the volume is in
    /// reencryption (its two segments need both keys).
    fn ask_passphrase(&self, header: &dyn Backend, hdr: &luks::Header) -> CliResult<Unlock> {
        let tries = pass::tries(self.tries, self.key_file.as_deref());
        if tries <= 1 {
            return Ok(Unlock::Passphrase(self.read_passphrase()?));
        }
        let reencrypting = hdr.in_reencryption();
        pass::retry_wrong(
            tries,
            |e| matches!(e, CliError::Core(Error::WrongPassphrase)),
            || {
                let p = self.read_passphrase()?;
                let test = Unlock::Passphrase(SecretBytes::from_slice(p.as_ref()));
                let (_, vk) = luks::unlock_key(header, hdr, test, self.key_slot)?;
                Ok(if reencrypting {
                    Unlock::Passphrase(p)
                } else {
                    Unlock::VolumeKey(SecretBytes::from_slice(vk.bytes()))
                })
            },
        )
    }

    /// LUKS1/LUKS2: unlock with the passphrase (or --volume-key-file) like cryptsetup open.
    fn prepare_luks(&self) -> CliResult<PreparedKind> {
        let data = self
            .volume
            .open_data(!self.read_only, &self.remote, self.cache)?;
        // The header device (--header, else the volume itself), a local one under
        // cryptsetup's shared lock until the volume is unlocked, so that a concurrent keyslot
        // change is never half seen. A remote volume's header is read through its data
        // connection.
        let header_file = match (&self.header, &self.volume) {
            (Some(h), _) => Some(open_header_file(h, false)?),
            (None, Target::Path(p)) => Some(open_header_file(p, false)?),
            (None, _) => None,
        };
        let header: Arc<dyn Backend> = match &header_file {
            Some(f) => f.clone(),
            None => data.clone(),
        };
        // The header first (a device that is not LUKS fails before any prompt); read once
        // here, to show a damaged or stale copy's warnings as cryptsetup does.
        let hdr = luks::read_header(header.as_ref())?;
        if let Some(t) = self.device_type {
            t.check_header(&hdr, &self.volume.to_string())?;
        }
        for w in hdr.warnings() {
            eprintln!("WARNING: {w}");
        }
        let unlock = match (&self.volume_key_file, &self.passphrase_read) {
            (Some(p), _) => Unlock::VolumeKey(crate::volume_key::read(
                p,
                crate::volume_key::key_bytes_for(&hdr, None)?,
            )?),
            (None, Some(read)) => {
                Unlock::Passphrase(SecretBytes::from_slice(read.as_ref().as_ref()))
            }
            (None, None) => self.ask_passphrase(header.as_ref(), &hdr)?,
        };
        let mut opts = OpenOptions::default();
        opts.key_slot = self.key_slot;
        opts.read_only = self.read_only;
        opts.allow_discards = self.allow_discards;
        opts.policy = self.policies(&match &hdr {
            luks::Header::Luks2(h) => h.flags(),
            luks::Header::Luks1(_) => Vec::new(),
        });
        opts.spin = self.spin();
        opts.header = Some(header);
        Ok(PreparedKind::Luks {
            data,
            hdr: Box::new(hdr),
            unlock,
            opts,
            integrity_no_journal: self.integrity_no_journal,
            header_file,
        })
    }

    /// Raw dm-crypt mapping (cryptsetup's plain mode).
    fn prepare_raw(&self, cipher: &str) -> CliResult<PreparedKind> {
        let spec: CipherSpec = cipher.parse()?;
        let key_file = self
            .volume_key_file
            .as_ref()
            .ok_or_else(|| CliError::Usage("--cipher needs --volume-key-file".into()))?;
        let key_bytes = match self.key_size {
            Some(bits) if bits % 8 == 0 => bits as usize / 8,
            Some(bits) => {
                return Err(CliError::Usage(format!(
                    "key size {bits} bits is not a multiple of 8"
                )))
            }
            None => spec.default_key_bytes(),
        };
        spec.check_key_len(key_bytes)?;
        let key = crate::volume_key::read(key_file, key_bytes)?;
        let geometry = Geometry {
            sector_size: SectorSize::new(self.sector_size)?,
            iv_offset: self.skip,
            iv_large_sectors: self.iv_large_sectors,
        };
        let backend = self
            .volume
            .open_data(!self.read_only, &self.remote, self.cache)?;
        let mut cfg = VolumeConfig::new(spec, key, geometry);
        cfg.data_offset_bytes = self
            .offset
            .checked_mul(512)
            .ok_or_else(|| CliError::Usage("--offset too large".into()))?;
        cfg.policy = self.policies(&[]);
        cfg.spin = self.spin();
        cfg.read_only = self.read_only;
        Ok(PreparedKind::Raw { backend, cfg })
    }
}
