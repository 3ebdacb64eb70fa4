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
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use ucrypt::backend::{Backend, CacheMode};
use ucrypt::engine::{Policies, Policy};
use ucrypt::integrity::{self, superblock::flags as sb_flags, IntegrityVolume};
use ucrypt::luks::{self, OpenOptions, Unlock};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, Error, SecretBytes};

use crate::error::{CliError, CliResult};
use crate::luks_cli::open_header;
use crate::pass::{self, Source};
use crate::target::{RemoteArgs, Target};

/// Largest volume key file accepted (a 512-bit key is 64 bytes; leave room for hex forms).
const VOLUME_KEY_FILE_BYTES_MAX: u64 = 4096;

/// The default dispatch policy of every verb and front end. `auto` is `inline` for requests
/// below a threshold calibrated at start (a 4 KiB request takes the same direct path) and
/// splits larger ones across cores when one is idle: measured, one 1 MiB stream reads
/// 1.3-1.6x faster than inline, and with many streams auto stays within noise of the best
/// static policy (BENCHMARKS.md, `bench engine` scenarios 4 and 6).
pub const DEFAULT_POLICY: Policy = Policy::Auto;

#[derive(Args, Debug, Clone)]
pub struct VolumeArgs {
    /// The volume: an image file, a block device, or an RBD image (rbd:POOL/IMAGE[@SNAP]).
    pub volume: Target,
    /// Raw (plain) mode: dm-crypt cipher spec of a volume without a header, e.g. aes-xts-plain64.
    #[arg(long, requires = "volume_key_file")]
    pub cipher: Option<String>,
    /// Raw mode: file holding the volume key (raw bytes).
    #[arg(long)]
    pub volume_key_file: Option<PathBuf>,
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
    #[arg(long, conflicts_with = "cipher")]
    pub keyfile_size: Option<u64>,
    /// LUKS: try only this keyslot.
    #[arg(long, conflicts_with = "cipher")]
    pub key_slot: Option<u32>,
    /// LUKS: detached header file.
    #[arg(long, conflicts_with = "cipher")]
    pub header: Option<PathBuf>,
    /// LUKS: pass discards (TRIM) down to the backing store even if the header does not
    /// carry the allow-discards flag. Discards reveal which blocks are unused.
    #[arg(long)]
    pub allow_discards: bool,
    /// Open read-only (`--readonly` as cryptsetup spells it).
    #[arg(long, alias = "readonly")]
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
}

pub(crate) fn read_volume_key(path: &std::path::Path) -> CliResult<SecretBytes> {
    let ctx = |e| Error::io(format!("volume key file {}", path.display()), e);
    let meta = std::fs::metadata(path).map_err(ctx)?;
    if meta.len() > VOLUME_KEY_FILE_BYTES_MAX {
        return Err(CliError::Usage(format!(
            "volume key file {} is {} bytes; expected a raw key of at most 64",
            path.display(),
            meta.len()
        )));
    }
    Ok(SecretBytes::from_vec(std::fs::read(path).map_err(ctx)?))
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
    },
    /// Raw dm-crypt mapping (cryptsetup's plain mode): the key is already the volume key.
    Raw {
        backend: Arc<dyn Backend>,
        cfg: VolumeConfig,
    },
}

/// An opened volume: the engine's dm-crypt [`Volume`], or a LUKS2 volume with authenticated
/// encryption (dm-crypt over dm-integrity, [`IntegrityVolume`]). Front ends need only
/// [`Opened::dev`]; statistics, metrics and run-time policy changes exist for plain volumes
/// only ([`Opened::plain`]).
#[derive(Clone)]
pub enum Opened {
    Plain(Arc<Volume>),
    Integrity(Arc<Authenticated>),
}

impl Opened {
    /// The volume as the front ends serve it.
    pub fn dev(&self) -> Arc<dyn BlockDev> {
        match self {
            Opened::Plain(v) => v.clone(),
            Opened::Integrity(v) => v.clone(),
        }
    }

    /// The engine's volume, for statistics and metrics; `None` for an authenticated volume,
    /// which has neither yet.
    pub fn plain(&self) -> Option<&Arc<Volume>> {
        match self {
            Opened::Plain(v) => Some(v),
            Opened::Integrity(_) => None,
        }
    }
}

/// An [`IntegrityVolume`] as the command line serves it: a block that fails authentication
/// is logged as one line on standard error (the request fails with the error's errno,
/// EILSEQ; NBD, which has no such error, sends NBD_EIO).
pub struct Authenticated {
    name: String,
    inner: IntegrityVolume,
}

impl Authenticated {
    fn logged<T>(&self, r: ucrypt::Result<T>) -> ucrypt::Result<T> {
        if let Err(Error::Integrity { sector }) = &r {
            eprintln!(
                "{}: integrity error: block at data sector {sector} failed authentication",
                self.name
            );
        }
        r
    }
}

impl BlockDev for Authenticated {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        self.logged(self.inner.read_at(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        // An unaligned write reads (and verifies) the blocks at its ends.
        self.logged(self.inner.write_at(buf, offset))
    }
    fn write_at_mut(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        self.logged(self.inner.write_at_mut(buf, offset))
    }
    fn write_fua(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        self.logged(self.inner.write_fua(buf, offset))
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.logged(self.inner.write_zeroes(offset, len))
    }
}

/// Opens the authenticated segment of a LUKS2 volume. Refuses a dm-integrity superblock whose
/// flags say its tags are not all valid: recalculation in progress (tags beyond
/// `recalc_sector` were never written) or a dirty bitmap (bitmap mode left blocks whose tags
/// are stale). dm-integrity keeps no "journal dirty" flag in the superblock: a journal left
/// with committed, unapplied entries can only be told by reading the journal, which ucrypt
/// does not do (docs/integrity.md).
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
    if !opts.read_only {
        hdr.check_requirements()?;
    }
    let (_, vk) = luks::unlock_key(hdr_dev, hdr, unlock, opts.key_slot)?;
    // cryptsetup's `--integrity-no-journal` (or the header's persistent `no-journal` flag):
    // dm-integrity's direct mode; else its journal.
    let write_mode = if integrity_no_journal {
        integrity::WriteMode::Direct
    } else {
        integrity::luks2_write_mode(hdr)
    };
    let vol = integrity::open_luks2_mode(data, hdr, &vk, opts.read_only, write_mode)?;
    drop(vk);
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
    Ok(Opened::Integrity(Arc::new(Authenticated {
        name: name.to_string(),
        inner: vol,
    })))
}

impl Prepared {
    /// LUKS: the device the header is read from (the volume, or --header).
    pub fn header_device(&self) -> Option<Arc<dyn Backend>> {
        match &self.kind {
            PreparedKind::Luks { data, opts, .. } => {
                Some(opts.header.clone().unwrap_or_else(|| data.clone()))
            }
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
            } => {
                if integrity::superblock_offset(&hdr).is_some() {
                    open_authenticated(&self.name, data, &hdr, unlock, &opts, integrity_no_journal)
                        .map_err(CliError::from)
                } else {
                    luks::open_parsed(data, &hdr, unlock, &opts)
                        .map(|v| Opened::Plain(Arc::new(v)))
                        .map_err(CliError::from)
                }
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
        let kind = match &self.cipher {
            None => self.prepare_luks(),
            Some(cipher) => self.prepare_raw(cipher),
        };
        let kind = kind.map_err(|e| e.at(name.clone()))?;
        Ok(Prepared { name, kind })
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
        let header = match (&self.header, &self.volume) {
            (Some(h), _) => open_header(h, false)?,
            (None, Target::Path(p)) => open_header(p, false)?,
            (None, _) => data.clone(),
        };
        // The header first (a device that is not LUKS fails before any prompt); read once
        // here, to show a damaged or stale copy's warnings as cryptsetup does.
        let hdr = luks::read_header(header.as_ref())?;
        for w in hdr.warnings() {
            eprintln!("WARNING: {w}");
        }
        let unlock = match &self.volume_key_file {
            Some(p) => Unlock::VolumeKey(read_volume_key(p)?),
            None => Unlock::Passphrase(pass::read_passphrase(
                &Source {
                    key_file: self.key_file.as_deref(),
                    offset: self.keyfile_offset.unwrap_or(0),
                    size: self.keyfile_size,
                },
                &format!("Enter passphrase for {}: ", self.volume),
                false,
            )?),
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
        })
    }

    /// Raw dm-crypt mapping (cryptsetup's plain mode).
    fn prepare_raw(&self, cipher: &str) -> CliResult<PreparedKind> {
        let spec: CipherSpec = cipher.parse()?;
        let key_file = self
            .volume_key_file
            .as_ref()
            .ok_or_else(|| CliError::Usage("--cipher needs --volume-key-file".into()))?;
        let key = read_volume_key(key_file)?;
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
