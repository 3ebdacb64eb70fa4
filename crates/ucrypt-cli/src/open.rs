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

use std::sync::Arc;
use std::time::Duration;

use ucrypt::backend::{Backend, FileBackend};
use ucrypt::engine::{Policies, Policy};
use ucrypt::integrity::WriteMode;
use ucrypt::luks::{self, Unlock};
use ucrypt::open::{Format, Luks, OpenRequest, Plain};
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::{Error, SecretBytes};

use crate::error::{CliError, CliResult};
use crate::header_dev::open_header_file;
use crate::pass::{self, Source};
use crate::target::Target;
use crate::token::TokenOutcome;
pub use crate::volume_args::{DeviceType, VolumeArgs};

/// The default dispatch policy of every verb and front end. `auto` is `inline` for requests
/// below a threshold calibrated at start (a 4 KiB request takes the same direct path) and
/// splits larger ones across cores when one is idle: one stream of large requests then gets
/// more than one core, and many streams, which keep every core busy already, are served as
/// `inline` would (BENCHMARKS.md, `bench engine` scenarios 4 and 6).
pub const DEFAULT_POLICY: Policy = Policy::Auto;

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

    /// `open --persistent`: stores the activation flags the volume is opened with
    /// (--allow-discards, --perf-no_read_workqueue, --perf-no_write_workqueue) in its LUKS2
    /// header, replacing the ones stored before, as cryptsetup's `open --persistent` does.
    pub fn store_activation_flags(&self) -> CliResult<()> {
        let dev = match &self.header {
            Some(h) => crate::header_dev::open_header(h, true)?,
            None => self.volume.open_header(true, &self.remote)?,
        };
        let hdr = ucrypt::luks::read_header(dev.as_ref())?;
        hdr.check_requirements()?;
        let ucrypt::luks::Header::Luks2(mut h) = hdr else {
            return Err(CliError::Usage(
                "--persistent stores activation flags in a LUKS2 header; this is LUKS1".into(),
            ));
        };
        let flags: Vec<&str> = [
            (self.allow_discards, "allow-discards"),
            (self.perf_no_read_workqueue, "no-read-workqueue"),
            (self.perf_no_write_workqueue, "no-write-workqueue"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        h.set_persistent_flags(&flags)?;
        ucrypt::luks::apply(dev.as_ref(), &h.commit()?)?;
        Ok(())
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
        if self.shared {
            crate::in_use::Access::Shared
        } else {
            crate::in_use::Access::of(self.read_only)
        }
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
        if let Some(why) = crate::volume_args::key_files_refusal(&self.key_files, self.device_type)
        {
            return Err(CliError::Usage(why.into()));
        }
        let name = self.volume.to_string();
        let raw = self.cipher.is_some() || self.device_type == Some(DeviceType::Plain);
        if self.size_sectors().is_some() && (!raw || self.device_type == Some(DeviceType::Tcrypt)) {
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
                key_file: self.key_file(),
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
        if self.key_file().is_none() {
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
        let tries = pass::tries(self.tries, self.key_file());
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
        match self.key_file() {
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
            &self.key_files,
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
            key_file: self.key_file(),
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
        let mut req = crate::bitlk::open_request(path, backend, self.key_file(), vk)?;
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
        plain.size_bytes = match self.size_sectors() {
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
