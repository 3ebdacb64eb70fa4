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
use ucrypt::backend::Backend;
use ucrypt::engine::{Policies, Policy};
use ucrypt::luks::{self, OpenOptions, Unlock};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{Error, SecretBytes};

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
    },
    /// Raw dm-crypt mapping (cryptsetup's plain mode): the key is already the volume key.
    Raw {
        backend: Arc<dyn Backend>,
        cfg: VolumeConfig,
    },
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
    pub fn open(self) -> CliResult<Volume> {
        let vol = match self.kind {
            PreparedKind::Luks {
                data,
                hdr,
                unlock,
                opts,
            } => luks::open_parsed(data, &hdr, unlock, &opts).map_err(CliError::from),
            PreparedKind::Raw { backend, cfg } => Volume::new(backend, cfg).map_err(CliError::from),
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
    pub fn open(&self) -> CliResult<Arc<Volume>> {
        Ok(Arc::new(self.prepare()?.open()?))
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
        let data = self.volume.open_data(!self.read_only, &self.remote)?;
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
        let backend = self.volume.open_data(!self.read_only, &self.remote)?;
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
