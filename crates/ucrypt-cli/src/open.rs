//! Opening a volume from command-line arguments: the one place the CLI turns a path and
//! options into an `Arc<dyn BlockDev>`, for every front end (NBD, FUSE, ublk) and data verb
//! (export, import).
//!
//! Raw mode (`--cipher` with `--volume-key-file`) mirrors `cryptsetup open --type plain`:
//! `--offset` is the data start and `--skip` the IV offset, both in 512-byte sectors.
//! Without `--cipher` the volume is LUKS1/LUKS2, unlocked like `cryptsetup open`: passphrase
//! from `--key-file` (or asked), or `--volume-key-file`; `--header` for a detached header.
//! Opening itself, of every kind, is one library call, `ucrypt::open::open`; this module
//! turns arguments into its request, reads the header first (to print its warnings and check
//! `--type`) and asks for the passphrase.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use ucrypt::backend::{Backend, CacheMode, FileBackend};
use ucrypt::engine::{Policies, Policy};
use ucrypt::integrity::WriteMode;
use ucrypt::luks::{self, Unlock};
use ucrypt::open::{Format, Luks, OpenRequest, Plain};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::{Error, SecretBytes};

use crate::error::{CliError, CliResult};
use crate::header_dev::open_header_file;
use crate::pass::{self, Source};
use crate::target::{RemoteArgs, Target};
use crate::token::TokenOutcome;

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
    /// BitLocker (`crate::bitlk`).
    Bitlk,
    /// FileVault2 (`crate::fvault2`).
    Fvault2,
    /// loop-AES (`crate::loopaes`).
    Loopaes,
}

impl std::str::FromStr for DeviceType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "luks" => Ok(DeviceType::Luks),
            "luks1" => Ok(DeviceType::Luks1),
            "luks2" => Ok(DeviceType::Luks2),
            "plain" => Ok(DeviceType::Plain),
            "tcrypt" => Ok(DeviceType::Tcrypt),
            "bitlk" => Ok(DeviceType::Bitlk),
            "fvault2" => Ok(DeviceType::Fvault2),
            "loopaes" => Ok(DeviceType::Loopaes),
            _ => Err(format!(
                "unknown device type '{s}' (cryptsetup's types: luks, luks1, luks2, plain, \
                 tcrypt, bitlk, fvault2, loopaes)"
            )),
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
            DeviceType::Bitlk => "bitlk",
            DeviceType::Fvault2 => "fvault2",
            DeviceType::Loopaes => "loopaes",
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
    /// serpent-xts-plain64, aes-lrw-benbi, xchacha12,aes-adiantum-plain64 (with `--type
    /// plain` and no --cipher: cryptsetup 2.6's aes-cbc-essiv:sha256). `--type tcrypt`: only
    /// cipher chains whose name contains this.
    #[arg(long)]
    pub cipher: Option<String>,
    /// The volume key (raw bytes) from this file, instead of a passphrase; exactly the key's
    /// size is read (the header's, or in raw mode --key-size), so /dev/urandom works.
    #[arg(long)]
    pub volume_key_file: Option<PathBuf>,
    /// Raw mode: the key's size in bits (default: 256 from a passphrase or key file, as
    /// cryptsetup's plain mode; the cipher's with --volume-key-file, 512 for aes-xts-plain64).
    #[arg(long, short = 's')]
    pub key_size: Option<u32>,
    /// Plain mode: how a passphrase becomes the key: a hash (default ripemd160), `plain`
    /// (the passphrase itself), or HASH:LEN (LEN bytes of hash, zeros after). A key file is
    /// the key itself and is never hashed. `--type tcrypt`: only KDFs whose hash name
    /// contains this.
    #[arg(long, short = 'h', value_name = "HASH")]
    pub hash: Option<String>,
    /// Raw mode: encryption sector size in bytes (512, 1024, 2048, 4096).
    #[arg(long, default_value_t = 512)]
    pub sector_size: u64,
    /// Raw mode: start of the encrypted data on the device, in 512-byte sectors.
    #[arg(long, short = 'o', default_value_t = 0)]
    pub offset: u64,
    /// Raw mode: IV offset, in 512-byte sectors (cryptsetup's --skip; default 0, for
    /// `--type loopaes` the --offset).
    #[arg(long, short = 'p')]
    pub skip: Option<u64>,
    /// Raw mode: map only this many 512-byte sectors from --offset (cryptsetup's --size);
    /// default: to the end of the device.
    #[arg(long, short = 'b', value_name = "SECTORS")]
    pub size: Option<u64>,
    /// Raw mode: the IV counts encryption sectors, not 512-byte units.
    #[arg(long)]
    pub iv_large_sectors: bool,
    /// Passphrase from this file ("-" = stdin); without it the passphrase is asked. Plain
    /// mode: the file holds the key itself (exactly the key's size is read).
    #[arg(long, short = 'd')]
    pub key_file: Option<String>,
    /// Skip this many bytes of the key file.
    #[arg(long)]
    pub keyfile_offset: Option<u64>,
    /// Read at most this many bytes of the key file (plain mode: of stdin).
    #[arg(long, short = 'l')]
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
    #[command(flatten)]
    pub token: crate::token::TokenOpts,
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
    /// What `ucrypt::open::open` builds the volume from.
    pub req: OpenRequest,
    /// LUKS: the header device, a local one under cryptsetup's shared lock until released.
    header: Option<HeaderAt>,
    /// The type `status` names, as cryptsetup's status does (a foreign format is served as a
    /// raw mapping; `None`: as the request's format says).
    pub kind: Option<&'static str>,
}

/// The library's opened volume, of any kind: front ends need only [`Opened::dev`]; the
/// life-cycle daemon and metrics use the rest.
pub use ucrypt::open::Opened;

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
        self.header.clone()
    }

    /// Builds the volume: unlocks a keyslot (LUKS) and starts the threads that serve it.
    pub fn open(self) -> CliResult<Opened> {
        // Name the volume in the one line the user sees, keeping the error's type (and so its
        // exit code).
        ucrypt::open::open(self.req).map_err(|e| CliError::from(e).at(self.name))
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

    pub fn spin(&self) -> Duration {
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
        let raw = self.cipher.is_some() || self.device_type == Some(DeviceType::Plain);
        if self.size.is_some() && (!raw || self.device_type == Some(DeviceType::Tcrypt)) {
            return Err(CliError::Usage(
                "--size maps a part of a plain mapping; LUKS and TCRYPT volumes are mapped \
                 whole"
                    .into(),
            ));
        }
        let prepared = match (&self.cipher, self.device_type) {
            (_, Some(DeviceType::Tcrypt)) => self.prepare_tcrypt().map(|req| (req, None)),
            (_, Some(DeviceType::Bitlk)) => self.prepare_bitlk().map(|req| (req, None)),
            (_, Some(DeviceType::Fvault2)) => self.prepare_fvault2().map(|req| (req, None)),
            (_, Some(DeviceType::Loopaes)) => crate::loopaes::mapping(self)
                .and_then(|m| self.request_from_mapping(m))
                .map(|req| (req, None)),
            (Some(cipher), _) => self.prepare_raw(cipher).map(|req| (req, None)),
            (None, Some(DeviceType::Plain)) => self
                .prepare_raw(ucrypt::plain::DEFAULT_CIPHER)
                .map(|req| (req, None)),
            (None, _) => self.prepare_luks(&name),
        };
        let (mut req, header) = prepared.map_err(|e| e.at(name.clone()))?;
        req.name = name.clone();
        let kind = match self.device_type {
            Some(DeviceType::Tcrypt) => Some("TCRYPT"),
            Some(DeviceType::Fvault2) => Some("FVAULT2"),
            Some(DeviceType::Loopaes) => Some("LOOPAES"),
            _ => None,
        };
        Ok(Prepared {
            name,
            req,
            header,
            kind,
        })
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
        let reencrypting = hdr.in_reencryption();
        if self.key_file.is_none() {
            let by_token = crate::token::unlock_by_token(
                header,
                hdr,
                &self.token,
                self.key_slot,
                luks::KeyUse::Data,
            )?;
            match by_token {
                TokenOutcome::Unlocked(t) if reencrypting => {
                    return Ok(Unlock::Passphrase(t.passphrase))
                }
                TokenOutcome::Unlocked(t) => {
                    return Ok(Unlock::VolumeKey(SecretBytes::from_slice(t.key.bytes())))
                }
                other if self.token.only() => return Err(self.token.failure(&other)),
                _ => {}
            }
        }
        let tries = pass::tries(self.tries, self.key_file.as_deref());
        if tries <= 1 {
            return Ok(Unlock::Passphrase(self.read_passphrase()?));
        }
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
    fn prepare_luks(&self, name: &str) -> CliResult<(OpenRequest, Option<HeaderAt>)> {
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
        let policy = self.policies(&match &hdr {
            luks::Header::Luks2(h) => h.flags(),
            luks::Header::Luks1(_) => Vec::new(),
        });
        let mut luks = Luks::new(unlock);
        luks.key_slot = self.key_slot;
        luks.header_dev = Some(header.clone());
        luks.header = Some(Box::new(hdr));
        luks.integrity_write_mode = self.integrity_no_journal.then_some(WriteMode::Direct);
        let mut req = OpenRequest::new(data, Format::Luks(luks));
        req.read_only = self.read_only;
        req.allow_discards = self.allow_discards;
        req.policy = policy;
        req.spin = self.spin();
        // A block that fails authentication: one line on standard error (the request fails
        // with EILSEQ; NBD, which has no such error, sends NBD_EIO).
        let name = name.to_string();
        req.on_integrity_error = Some(Arc::new(move |sector| {
            eprintln!(
                "{name}: integrity error: block at data sector {sector} failed authentication"
            )
        }));
        let header = HeaderAt {
            dev: header,
            file: header_file,
        };
        Ok((req, Some(header)))
    }

    /// The key of a raw mapping, as cryptsetup's plain mode reads it: --volume-key-file (a
    /// ucrypt option: the key's bytes), a key file (the key itself: exactly `key_bytes` from
    /// --keyfile-offset, never hashed), or a passphrase (typed, a line of stdin, or all of
    /// stdin with `--key-file -`) hashed with --hash.
    fn plain_key(&self, key_bytes: usize) -> CliResult<SecretBytes> {
        if let Some(p) = &self.volume_key_file {
            return Ok(crate::volume_key::read(p, key_bytes)?);
        }
        let offset = self.keyfile_offset.unwrap_or(0);
        match self.key_file.as_deref() {
            Some(f) if f != "-" => {
                if self.hash.is_some() {
                    eprintln!(
                        "WARNING: The --hash parameter is being ignored in plain mode with \
                         keyfile specified."
                    );
                }
                let key = pass::read_key_file(f, offset, Some(key_bytes as u64))?;
                if key.len() != key_bytes {
                    return Err(CliError::Usage(
                        "Cannot read requested amount of data.".into(),
                    ));
                }
                Ok(key)
            }
            stdin_file => {
                let passphrase = if stdin_file.is_some() {
                    pass::read_key_file("-", offset, self.keyfile_size)?
                } else {
                    self.read_passphrase()?
                };
                let hash = self.hash.as_deref().unwrap_or(ucrypt::plain::DEFAULT_HASH);
                Ok(ucrypt::plain::key_from_passphrase(
                    hash,
                    key_bytes,
                    passphrase.as_ref(),
                )?)
            }
        }
    }

    /// `--type tcrypt`: the TrueCrypt/VeraCrypt header decrypted, the data as a raw mapping.
    fn prepare_tcrypt(&self) -> CliResult<OpenRequest> {
        let Target::Path(path) = &self.volume else {
            return Err(CliError::Usage(format!(
                "{}: TCRYPT volumes are opened from local files or devices",
                self.volume
            )));
        };
        let hdr_path = self.header.as_deref().unwrap_or(path);
        let m = crate::formats::tcrypt_mapping(
            hdr_path,
            &self.tcrypt,
            self.key_file.as_deref(),
            self.hash.as_deref(),
            self.cipher.as_deref(),
        )?;
        self.request_from_mapping(m)
    }

    /// `--type fvault2`: the FileVault2 metadata read and the key unwrapped, the data as a raw
    /// mapping.
    fn prepare_fvault2(&self) -> CliResult<OpenRequest> {
        let Target::Path(path) = &self.volume else {
            return Err(CliError::Usage(format!(
                "{}: FVAULT2 volumes are opened from local files or devices",
                self.volume
            )));
        };
        let src = Source {
            key_file: self.key_file.as_deref(),
            offset: self.keyfile_offset.unwrap_or(0),
            size: self.keyfile_size,
        };
        let m = crate::fvault2::mapping(path, &src, self.volume_key_file.as_deref())?;
        self.request_from_mapping(m)
    }

    /// The request of a foreign format's data, mapped as `--type plain` maps its own.
    pub(crate) fn request_from_mapping(
        &self,
        m: ucrypt::tcrypt::Mapping,
    ) -> CliResult<OpenRequest> {
        let backend = self
            .volume
            .open_data(!self.read_only, &self.remote, self.cache)?;
        let mut plain = Plain::new(m.spec, m.key, m.geometry);
        plain.data_offset_bytes = m.data_offset_bytes;
        plain.size_bytes = m.size_bytes;
        let mut req = OpenRequest::new(backend, Format::Plain(plain));
        req.policy = self.policies(&[]);
        req.spin = self.spin();
        req.read_only = self.read_only;
        req.allow_discards = self.allow_discards;
        Ok(req)
    }

    /// `--type bitlk`: the BitLocker metadata read, the volume key unlocked, its segments
    /// served (`crate::bitlk`).
    fn prepare_bitlk(&self) -> CliResult<OpenRequest> {
        let Target::Path(path) = &self.volume else {
            return Err(CliError::Usage(format!(
                "{}: BITLK volumes are opened from local files or devices",
                self.volume
            )));
        };
        let vk = match &self.volume_key_file {
            Some(p) => {
                let meta = crate::bitlk::read_metadata(path)?;
                let bits = usize::from(meta.encryption.key_bits());
                Some(crate::volume_key::read(p, bits / 8)?)
            }
            None => None,
        };
        let backend = self
            .volume
            .open_data(!self.read_only, &self.remote, self.cache)?;
        let mut req = crate::bitlk::open_request(path, backend, self.key_file.as_deref(), vk)?;
        req.policy = self.policies(&[]);
        req.spin = self.spin();
        req.read_only = self.read_only;
        req.allow_discards = self.allow_discards;
        Ok(req)
    }

    /// Raw dm-crypt mapping (cryptsetup's plain mode).
    fn prepare_raw(&self, cipher: &str) -> CliResult<OpenRequest> {
        let spec: CipherSpec = cipher.parse()?;
        let key_bytes = match self.key_size {
            Some(bits) if bits % 8 == 0 => bits as usize / 8,
            Some(bits) => {
                return Err(CliError::Usage(format!(
                    "key size {bits} bits is not a multiple of 8"
                )))
            }
            None if self.volume_key_file.is_some() => spec.default_key_bytes(),
            None => ucrypt::plain::DEFAULT_KEY_BITS as usize / 8,
        };
        spec.check_key_len(key_bytes)?;
        let key = self.plain_key(key_bytes)?;
        let geometry = Geometry {
            sector_size: SectorSize::new(self.sector_size)?,
            iv_offset: self.skip.unwrap_or(0),
            iv_large_sectors: self.iv_large_sectors,
        };
        let backend = self
            .volume
            .open_data(!self.read_only, &self.remote, self.cache)?;
        let mut plain = Plain::new(spec, key, geometry);
        plain.data_offset_bytes = self
            .offset
            .checked_mul(512)
            .ok_or_else(|| CliError::Usage("--offset too large".into()))?;
        plain.size_bytes = match self.size {
            Some(0) => return Err(CliError::Usage("--size must be more than 0".into())),
            Some(n) => Some(
                n.checked_mul(512)
                    .ok_or_else(|| CliError::Usage("--size too large".into()))?,
            ),
            None => None,
        };
        let mut req = OpenRequest::new(backend, Format::Plain(plain));
        req.policy = self.policies(&[]);
        req.spin = self.spin();
        req.read_only = self.read_only;
        // A raw mapping passes discards down (the engine's default for a volume it is given).
        req.allow_discards = true;
        Ok(req)
    }
}
