//! `ucrypt reencrypt`: offline reencryption on cryptsetup's on-disk protocol (key rotation,
//! cipher / key size / sector size change, `--decrypt` and `--encrypt` with a detached
//! `--header`, `--encrypt --reduce-device-size` with the header in front of the data moved
//! by half of it, a rotation with `--reduce-device-size` that moves the data up by it;
//! `ucrypt::luks::reencrypt::run` does the work), and the recovery `repair` runs on a volume
//! left inside a hotzone.

use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use clap::Args;
use ucrypt::backend::{Backend, CacheMode};
use ucrypt::luks::reencrypt::run::{
    Devices, InitOptions, KeyslotKdf, Progress, Recovery, ResilienceAsked, ResilienceKind,
    RunOptions, SegmentChange,
};
use ucrypt::luks::reencrypt::Mode;
use ucrypt::luks::reencrypt::ReencryptState;
use ucrypt::luks::HashAlg;
use ucrypt::luks::Header;
use ucrypt::sector::{CipherSpec, SectorSize};
use ucrypt::{Error, Result};

use super::progress_json::JsonProgress;
use super::{existing_source, kdf_request, load, LuksOpts};
use crate::daemon::online::Holder;
use crate::pass;
use crate::target::Target;
use ucrypt::luks::reencrypt;

/// Options of `reencrypt` beyond the common LUKS ones (cryptsetup's spellings).
#[derive(Args, Debug, Clone, Default)]
pub struct ReencryptOpts {
    /// Reencrypt only the first SIZE bytes of the data area (a multiple of the sector size;
    /// units as --hotzone-size, or S for 512-byte sectors). Destructive: once done, what lies
    /// beyond SIZE is read through the new key though still in its old form.
    #[arg(
        long = "device-size",
        value_name = "SIZE",
        conflicts_with = "reduce_device_size",
        value_parser = crate::volume_args::device_size_sectors
    )]
    pub device_size_sectors: Option<u64>,
    /// Keep the volume key: reencrypt the data to the new --cipher or --sector-size under
    /// the key it has (no keyslot is added; one passphrase opens it).
    #[arg(long, conflicts_with_all = ["encrypt", "decrypt"])]
    pub keep_key: bool,
    /// Only write the reencryption metadata; `--resume-only` rewrites the data later.
    #[arg(long)]
    pub init_only: bool,
    /// Continue a reencryption started before (by ucrypt or by cryptsetup).
    #[arg(long)]
    pub resume_only: bool,
    /// How a hotzone survives a crash: checksum (default), journal or none.
    #[arg(long)]
    pub resilience: Option<String>,
    /// Checksum hash of a new reencryption's checksum resilience: sha256 (cryptsetup's
    /// default), sha1, sha224, sha384, sha512, sha3-224/256/384/512, ripemd160, whirlpool,
    /// blake2b-512, blake2s-256 or sm3. A reencryption in progress keeps its own.
    #[arg(long)]
    pub resilience_hash: Option<String>,
    /// Largest hotzone, in bytes or with a unit (4M, 64MiB...); for a decryption that moves
    /// the data, the moved segment's size (as cryptsetup reads it there).
    #[arg(long)]
    pub hotzone_size: Option<String>,
    /// Accepted for scripts on a volume no ucrypt daemon serves (that one is reencrypted
    /// offline anyway); refused on one a daemon serves (reencrypted online, through it).
    #[arg(long)]
    pub force_offline_reencrypt: bool,
    /// Encrypt a plaintext device in place (needs a detached `--header`, created here).
    #[arg(long, short = 'N', alias = "new")]
    pub encrypt: bool,
    /// Decrypt the device in place (needs `--header`, as cryptsetup 2.6: a detached header,
    /// or a file that does not exist yet: the header in front is exported to it and the data
    /// moved back to the start of the device).
    #[arg(long)]
    pub decrypt: bool,
    /// With --encrypt: the last SIZE bytes of the device are free; the header takes the first
    /// SIZE/2 and the data moves up by SIZE/2 (datashift), as cryptsetup does. Without it, on
    /// a LUKS2 volume: the data moves up by SIZE as it is reencrypted, and the volume loses
    /// its last SIZE bytes (shrink what it holds first).
    #[arg(long)]
    pub reduce_device_size: Option<String>,
    /// Reencrypt online the volume the daemon of this name serves (`ucrypt open VOLUME NAME`);
    /// without it, a volume a daemon serves is found by its file. With a new --encrypt:
    /// the name the volume is opened as once the encryption is initialised, to be encrypted
    /// online (cryptsetup's `reencrypt --encrypt DEVICE NAME`).
    #[arg(long)]
    pub active_name: Option<String>,
    /// Reencrypt online the volume a `serve`, `mount` or `ublk` process serves with this
    /// control socket (their `--control PATH`).
    #[arg(long, value_name = "PATH", conflicts_with = "active_name")]
    pub control: Option<std::path::PathBuf>,
}

/// A size option of `reencrypt` as cryptsetup reads it ([`crate::volume_args::cryptsetup_size`]);
/// a bad one is refused with cryptsetup's message, which names the option.
pub(crate) fn parse_size(s: &str, option: &str) -> Result<u64> {
    crate::volume_args::cryptsetup_size(s).map_err(|_| {
        Error::InvalidArgument(format!(
            "Invalid size specification in parameter --{option}."
        ))
    })
}

/// `--hotzone-size` in bytes, if given.
fn hotzone_bytes(r: &ReencryptOpts) -> Result<Option<u64>> {
    (r.hotzone_size.as_deref())
        .map(|s| parse_size(s, "hotzone-size"))
        .transpose()
}

fn not_built(what: &str) -> Error {
    Error::InvalidArgument(format!(
        "ucrypt reencrypt does not support {what} yet (it reencrypts, decrypts or encrypts \
         in place)."
    ))
}

/// Refuses what is not built, naming it.
fn check_supported(r: &ReencryptOpts, o: &LuksOpts, hdr: &Header) -> Result<()> {
    if r.reduce_device_size.is_some() && r.keep_key {
        // cryptsetup asks a --keep-key reencryption for a new cipher or sector size before
        // anything else; moving the data is no change of the segment's parameters.
        let change = segment_change(o, hdr)?;
        let old_sector = match hdr {
            Header::Luks2(h) => h.meta().crypt_segment().ok().map(|s| s.sector_size),
            Header::Luks1(_) => None,
        };
        if change.cipher.is_none() && change.sector_size.is_none_or(|s| Some(s) == old_sector) {
            return Err(Error::InvalidArgument(
                reencrypt::run::KEEP_KEY_CHANGES_NOTHING.into(),
            ));
        }
    }
    if r.reduce_device_size.is_some() && r.decrypt {
        return Err(not_built(
            "--decrypt with --reduce-device-size (ucrypt moves the data back to the start of \
             the device with --decrypt --header NEW-FILE)",
        ));
    }
    if r.decrypt && o.header.is_none() {
        return Err(Error::InvalidArgument(
            reencrypt::run::DECRYPT_NEEDS_DETACHED_HEADER.into(),
        ));
    }
    resilience_hash(r)?;
    let Header::Luks2(_) = hdr else {
        return Err(Error::UnsupportedLuks(
            "reencryption of LUKS1 (convert it to LUKS2 first)".into(),
        ));
    };
    Ok(())
}

/// The new segment's parameters from `--cipher`, `--key-size` and `--sector-size`, as
/// cryptsetup reads them: a cipher equal to the old one is no change; `--key-size` is in bits.
fn segment_change(o: &LuksOpts, hdr: &Header) -> Result<SegmentChange> {
    let old = match hdr {
        Header::Luks2(h) => h.meta().crypt_segment().ok(),
        Header::Luks1(_) => None,
    };
    let cipher = match o.cipher.as_deref() {
        None => None,
        Some(c) => {
            let spec: CipherSpec = c.parse()?;
            (old.as_ref().map(|s| s.cipher) != Some(spec)).then_some(spec)
        }
    };
    let key_bytes = match o.key_size {
        None => None,
        Some(bits) if bits % 8 == 0 => Some(bits as usize / 8),
        Some(bits) => {
            return Err(Error::InvalidArgument(format!(
                "Key size in bits must be a multiple of 8 bits ({bits})."
            )))
        }
    };
    let sector_size = o.sector_size.map(SectorSize::new).transpose()?;
    Ok(SegmentChange {
        cipher,
        key_bytes,
        sector_size,
    })
}

/// Prints progress as cryptsetup does: a line every `every` (`--progress-frequency`), or an
/// updated line on a terminal, nothing otherwise.
/// With `--progress-json`, cryptsetup's JSON lines on standard output instead.
struct Meter {
    start: Instant,
    last: Instant,
    every: Option<Duration>,
    tty: bool,
    first_done: Option<u64>,
    json: Option<JsonProgress>,
}

impl Meter {
    /// The meter `o`'s options ask for; `device` names the data device in JSON lines.
    fn new(o: &LuksOpts, device: &dyn std::fmt::Display) -> Self {
        let now = Instant::now();
        Meter {
            start: now,
            last: now,
            every: o.progress_frequency.map(Duration::from_secs),
            tty: !o.batch_mode && std::io::stderr().is_terminal(),
            first_done: None,
            json: o
                .progress_json
                .then(|| JsonProgress::new(device.to_string(), o.progress_frequency)),
        }
    }

    fn show(&mut self, p: Progress) {
        if let Some(j) = &mut self.json {
            return j.report(p.done, p.total);
        }
        let first = *self.first_done.get_or_insert(p.done);
        let now = Instant::now();
        let end = p.done == p.total;
        let due = match self.every {
            Some(d) => now.duration_since(self.last) >= d || end,
            None => self.tty,
        };
        if !due || p.total == 0 {
            return;
        }
        self.last = now;
        let secs = now.duration_since(self.start).as_secs_f64().max(1e-3);
        let mib = (p.done - first) as f64 / f64::from(1 << 20);
        let rate = mib / secs;
        let left = (p.total - p.done) as f64 / f64::from(1 << 20);
        let eta = if rate > 0.0 { left / rate } else { 0.0 } as u64;
        let line = format!(
            "Progress: {:5.1}%, ETA {:02}:{:02}, {:.0} MiB written, speed {:5.1} MiB/s",
            p.done as f64 * 100.0 / p.total as f64,
            eta / 60,
            eta % 60,
            mib,
            rate
        );
        if self.every.is_some() {
            eprintln!("{line}");
        } else {
            eprint!("\r{line}");
            if end {
                eprintln!();
            }
        }
    }
}

/// The data device when the header is detached (`--header`): the volume itself, opened
/// buffered (the driver flushes it at each step); `None` when the header is in front of the
/// data on one device.
fn data_dev(device: &Target, o: &LuksOpts) -> Result<Option<std::sync::Arc<dyn Backend>>> {
    o.header
        .as_ref()
        .map(|_| device.open_data(true, &o.remote, CacheMode::Writeback))
        .transpose()
}

/// `reencrypt [DEVICE]`: without DEVICE, `--active-name` names the daemon and so the volume.
pub fn reencrypt_cmd(device: Option<Target>, r: &ReencryptOpts, o: &LuksOpts) -> Result<i32> {
    match (device, &r.active_name) {
        (Some(d), _) => reencrypt(&d, r, o),
        (None, Some(name)) => match crate::daemon::online::by_name(name) {
            Ok(h) => match h.volume() {
                Some(v) => reencrypt(&Target::Path(v), r, o),
                None => Err(Error::InvalidArgument(format!(
                    "Device {name}: its daemon does not say which volume it serves."
                ))),
            },
            Err(e) => Ok(crate::daemon::report(Err(e))),
        },
        (None, None) => Err(Error::InvalidArgument(
            "Command requires device as argument.".into(),
        )),
    }
}

pub fn reencrypt(device: &Target, r: &ReencryptOpts, o: &LuksOpts) -> Result<i32> {
    if r.init_only && r.resume_only {
        return Err(Error::InvalidArgument(
            "Options --init-only and --resume-only cannot be combined.".into(),
        ));
    }
    if r.encrypt && !encryption_in_progress(o) && !shift_in_progress(device, o) {
        return start_encryption(device, r, o);
    }
    // cryptsetup 2.6: `--decrypt --header NEW` with NEW not existing exports the header in
    // front to NEW and moves the data back to the start of the device (datashift-checksum,
    // online-reencrypt-v3).
    let unshift = match (&o.header, r.decrypt) {
        (Some(h), true) if !h.exists() => Some(h.clone()),
        _ => None,
    };
    let holder = match find_holder(device, r, unshift.is_some())? {
        ControlFlow::Continue(h) => h,
        ControlFlow::Break(code) => return Ok(code),
    };
    match &holder {
        Some(_) if r.device_size_sectors.is_some() => {
            return Err(not_built(
                "--device-size on a volume a daemon serves (it reencrypts all of the data \
                 the daemon serves)",
            ))
        }
        Some(_) if r.reduce_device_size.is_some() && !r.resume_only => {
            return Err(not_built(
                "--reduce-device-size on a volume a daemon serves (the data moves, and the \
                 volume shrinks by that size: close it first)",
            ))
        }
        Some(h) => {
            if let ControlFlow::Break(code) = check_holder(h, device, r, o, unshift.is_some())? {
                return Ok(code);
            }
        }
        None => refuse_offline_if_served(device, o)?,
    }
    if let Some(h) = unshift {
        if r.device_size_sectors.is_some() {
            return Err(not_built(
                "--device-size with a decryption that moves the data back",
            ));
        }
        return decrypt_unshift(device, r, o, &h);
    }
    // Under cryptsetup's exclusive lock, also when a daemon serves the volume (it holds the
    // lock only around its own header reads and for its rotation, which starts once this
    // process has written the init and let the lock go).
    let (dev, hdr) = load(device, o, true)?;
    check_supported(r, o, &hdr)?;
    let data = data_dev(device, o)?;
    let devs = Devices {
        header: dev.as_ref(),
        data: data.as_deref().unwrap_or(dev.as_ref()),
    };
    let in_progress = match &hdr {
        Header::Luks2(h) => ReencryptState::from_metadata(h.meta())?,
        Header::Luks1(_) => None,
    };
    if r.resume_only && in_progress.is_none() {
        // cryptsetup 2.6.1's words.
        return Err(Error::InvalidArgument(
            "Device reencryption not in progress.".into(),
        ));
    }
    let hotzone_bytes = hotzone_bytes(r)?;
    if let Some(n) = hotzone_bytes {
        if n == 0 || n % 512 != 0 {
            return Err(Error::InvalidArgument(
                "Hotzone size must be multiple of calculated zone alignment (512 bytes).".into(),
            ));
        }
    }
    let device_size = device_size_bytes(r, o, devs, &hdr, in_progress.is_none())?;
    let passphrase = match &in_progress {
        Some(st) => resume_passphrase(st, holder.as_ref(), o)?,
        None => match init_new(devs, &hdr, r, o)? {
            ControlFlow::Continue(p) => p,
            ControlFlow::Break(code) => return Ok(code),
        },
    };
    // On resume, `--resilience` switches the reencryption's resilience (cryptsetup 2.6); a
    // new one was made with it already.
    let switch = match (&in_progress, r.resilience.as_deref()) {
        (Some(_), Some(name)) => Some(ResilienceAsked::from_name(name, resilience_hash(r)?)?),
        _ => None,
    };
    if let Some(h) = holder {
        drop(dev);
        let opts = RunOptions {
            hotzone_bytes,
            resilience: switch,
            device_size: None,
        };
        return Ok(run_in_daemon(&h, passphrase, opts, o, device));
    }
    let mut meter = Meter::new(o, device);
    reencrypt::run::resume_on(
        devs,
        passphrase.as_ref(),
        RunOptions {
            hotzone_bytes,
            resilience: switch,
            device_size,
        },
        &mut |p| meter.show(p),
    )
    .map_err(|e| match e {
        // cryptsetup 2.6.1 reads the passphrase of a reencryption it resumes once, and
        // answers a wrong one with exit code 1 (on a terminal too), as its `open` does on a
        // header in reencryption (`tries`' `resume_and_decrypt_ask_once` pins it).
        Error::WrongPassphrase if in_progress.is_some() => Error::NoUsableKeyslot,
        e => e,
    })?;
    if o.verbose {
        eprintln!("Command successful.");
    }
    Ok(0)
}

/// `--device-size` in bytes. For a new reencryption (`new`), checked against the data area
/// as cryptsetup 2.6.1's init checks it (the run checks it against the header's alignment).
fn device_size_bytes(
    r: &ReencryptOpts,
    o: &LuksOpts,
    devs: Devices<'_>,
    hdr: &Header,
    new: bool,
) -> Result<Option<u64>> {
    let Some(bytes) = r.device_size_sectors.map(|s| s * 512) else {
        return Ok(None);
    };
    if let (true, Header::Luks2(h)) = (new, hdr) {
        let seg = h.meta().crypt_segment()?;
        let area = devs.data.size().saturating_sub(seg.offset_bytes);
        if bytes > area {
            return Err(Error::InvalidArgument(
                "Reduced data size is larger than real device size.".into(),
            ));
        }
        let new_sector = o.sector_size.map_or(Ok(seg.sector_size), SectorSize::new)?;
        let sector = u64::from(seg.sector_size.bytes().max(new_sector.bytes()));
        if bytes % sector != 0 {
            return Err(Error::InvalidArgument(format!(
                "Data device is not aligned to encryption sector size ({sector} bytes)."
            )));
        }
    }
    Ok(Some(bytes))
}

/// Refuses an offline run on a volume a ucrypt process serves (`crate::in_use`): it is
/// reencrypted through that process or not at all, since an offline run under it would be
/// overwritten by the old key's writes.
fn refuse_offline_if_served(device: &Target, o: &LuksOpts) -> Result<()> {
    super::refuse_if_served(
        device,
        o,
        "reencrypt it online through that process (an `ucrypt open` daemon is found by \
         the file or by --active-name; serve, mount and ublk need their --control PATH), \
         or stop it first",
    )
}

/// A new `--encrypt`: with `--reduce-device-size` the header goes in front and the data
/// moves up, else the header is detached.
fn start_encryption(device: &Target, r: &ReencryptOpts, o: &LuksOpts) -> Result<i32> {
    refuse_offline_if_served(device, o)?;
    // cryptsetup's `reencrypt --encrypt DEVICE NAME`: NAME is activated once the init is
    // written, and the encryption runs online in it.
    if let Some(name) = &r.active_name {
        if crate::daemon::online::by_name(name).is_ok() {
            return Err(Error::io(
                format!("Device {name} already exists."),
                std::io::Error::from_raw_os_error(libc::EBUSY),
            ));
        }
        if r.init_only {
            return Err(Error::InvalidArgument(
                "--init-only and --active-name: the init activates nothing; open the \
                 volume after it (ucrypt open DEVICE NAME)."
                    .into(),
            ));
        }
    }
    match (&r.reduce_device_size, &o.header) {
        // Refused: cryptsetup 2.6.1 makes a header of that size
        // and encrypts from the end with `datashift` resilience while the data stays
        // where it is, so no hotzone is protected (`reencrypt::plan::UNMOVED_DATASHIFT`).
        (Some(_), Some(_)) => Err(Error::InvalidArgument(
            "--reduce-device-size with a detached --header is refused: cryptsetup 2.6.1 \
             then encrypts from the end with datashift resilience while the data stays \
             where it is, so a crash inside a hotzone loses it (its own repair rewrites \
             the hotzone with the data one shift below). Encrypt with the detached \
             --header alone (resilience checksum by default, or journal): the same result, \
             crash-safe."
                .into(),
        )),
        (Some(size), None) => encrypt_shift(device, r, o, parse_size(size, "reduce-device-size")?),
        (None, _) => encrypt(device, r, o),
    }
}

/// The live daemon that serves the volume (by `--control`, `--active-name` or the volume's
/// file), which then rotates it online; `Break` carries the exit code of a failed look-up.
/// `unshift`: a new decryption that moves the data back.
fn find_holder(
    device: &Target,
    r: &ReencryptOpts,
    unshift: bool,
) -> Result<ControlFlow<i32, Option<Holder>>> {
    let found = |h: crate::error::CliResult<Holder>| match h {
        Ok(h) => ControlFlow::Continue(Some(h)),
        Err(e) => ControlFlow::Break(crate::daemon::report(Err(e))),
    };
    if let Some(sock) = &r.control {
        return Ok(found(crate::daemon::online::by_control(sock)));
    }
    Ok(match (&r.active_name, device) {
        // A new decryption that moves the data back, under a NAME not open: opened as
        // NAME once initialised (by `decrypt_unshift`), as a new encryption is.
        (Some(name), _) if unshift && crate::daemon::online::by_name(name).is_err() => {
            if r.init_only {
                return Err(Error::InvalidArgument(
                    "--init-only and --active-name: the init activates nothing; open the \
                     volume after it (ucrypt open --header NEW DEVICE NAME)."
                        .into(),
                ));
            }
            ControlFlow::Continue(None)
        }
        (Some(name), _) => found(crate::daemon::online::by_name(name)),
        (None, Target::Path(p)) => ControlFlow::Continue(crate::daemon::online::holder_of(p)),
        (None, _) => ControlFlow::Continue(None),
    })
}

/// Refuses what a daemon `h` serving the volume cannot reencrypt online, before the init is
/// written; `Break` carries the exit code of a refusal reported as cryptsetup does.
fn check_holder(
    h: &Holder,
    device: &Target,
    r: &ReencryptOpts,
    o: &LuksOpts,
    unshift: bool,
) -> Result<ControlFlow<i32>> {
    if let Target::Path(p) = device {
        if !h.serves(p) {
            return Err(Error::InvalidArgument(format!(
                "Device {} serves {}, not {device}.",
                h.name,
                h.volume().unwrap_or_default().display()
            )));
        }
    }
    if unshift {
        return Err(Error::InvalidArgument(format!(
            "Device {} serves the volume from its header in front of the data: a \
             decryption that exports it to a new file starts with the volume closed (ucrypt \
             close {}; then ucrypt reencrypt --decrypt --header NEW DEVICE --active-name \
             NAME decrypts it online under NAME).",
            h.name, h.name
        )));
    }
    // The init goes to the header the verb was given, the rotation to the daemon's: they
    // must be one file.
    if !h.same_header(o.header.as_deref()) {
        let theirs = h.header().map_or_else(
            || "its header in front of the data".to_string(),
            |p| format!("the detached header {}", p.display()),
        );
        let ours = o.header.as_ref().map_or_else(
            || "no --header".to_string(),
            |p| format!("--header {}", p.display()),
        );
        return Err(Error::InvalidArgument(format!(
            "Device {} serves {} with {theirs}, not {ours}.",
            h.name,
            h.volume().unwrap_or_default().display()
        )));
    }
    // Online: a new key, cipher, key size or sector size, its header in front or
    // detached; an encryption or a decryption with a detached header; an encryption with
    // the header put in front, once started (`--init-only`, then `ucrypt open`: the
    // volume serves the plaintext from the start). Not a decryption that moves the data
    // back (the header in front is what the daemon serves from).
    if o.header.is_none() && r.encrypt && !shift_in_progress(device, o) {
        return Err(not_built(
            "a new encryption of a volume a ucrypt daemon serves (it is encrypted already)",
        ));
    }
    // Checked before the init is written: the daemon would refuse the rotation after it.
    let (reopen, running) = match h.reopen_needed_or_running() {
        Ok(b) => b,
        Err(e) => return Ok(ControlFlow::Break(crate::daemon::report(Err(e)))),
    };
    // The daemon holds cryptsetup's lock shared while it reencrypts: refused here rather
    // than waiting for the end (the daemon's own words and code).
    if running {
        eprintln!("Device {} is already being reencrypted.", h.name);
        return Ok(ControlFlow::Break(5));
    }
    if reopen {
        return Err(Error::InvalidArgument(format!(
            "Device {} changed its sector size or data offset online and serves the new \
             layout until it is closed: close it and open it again before another \
             reencryption.",
            h.name
        )));
    }
    if r.force_offline_reencrypt {
        eprintln!(
            "Device {device} is in use by the ucrypt daemon {}: it is reencrypted online \
             through it (drop --force-offline-reencrypt, or close it first).",
            h.name
        );
        return Ok(ControlFlow::Break(5));
    }
    Ok(ControlFlow::Continue(()))
}

/// The passphrase prompt, naming `--key-slot` when given.
fn passphrase_prompt(o: &LuksOpts) -> String {
    match o.key_slot {
        Some(s) => format!("Enter passphrase for key slot {s}: "),
        None => "Enter passphrase: ".to_string(),
    }
}

/// The passphrase of a reencryption in progress, which cryptsetup resumes when asked to
/// reencrypt again; one stopped inside a hotzone needs its recovery first.
fn resume_passphrase(
    st: &ReencryptState,
    holder: Option<&Holder>,
    o: &LuksOpts,
) -> Result<ucrypt::SecretBytes> {
    let passphrase =
        pass::read_passphrase(&existing_source(o, None), &passphrase_prompt(o), false)?;
    if st.needs_recovery() {
        // A daemon recovers the hotzone its rotation stopped in, unless it cannot
        // (resilience none); `repair` is refused on a volume it serves.
        if let Some(h) = holder {
            return Err(Error::InvalidArgument(format!(
                "The reencryption of {} stopped inside a hotzone its daemon could not \
                 recover (its status says why): close the volume and open it again, \
                 which recovers the hotzone, then resume.",
                h.name
            )));
        }
        return Err(Error::NeedsRecovery);
    }
    Ok(passphrase)
}

/// Writes the init of a new reencryption or decryption (with its detached header) and
/// returns the passphrase that resumes it; `Break(0)` after `--init-only`.
fn init_new(
    devs: Devices<'_>,
    hdr: &Header,
    r: &ReencryptOpts,
    o: &LuksOpts,
) -> Result<ControlFlow<i32, ucrypt::SecretBytes>> {
    let resilience = ResilienceKind::from_name(r.resilience.as_deref().unwrap_or("checksum"))?;
    let change = segment_change(o, hdr)?;
    let mode = if r.decrypt {
        Mode::Decrypt
    } else {
        Mode::Reencrypt
    };
    // A rotation's new keyslots copy the old ones' PBKDF unless one is asked for (as
    // cryptsetup 2.6.1); the decryption's digest follows the options.
    let keyslot_kdf = if new_kdf_given(o) || mode == Mode::Decrypt {
        KeyslotKdf::Given
    } else {
        KeyslotKdf::SameAsOld
    };
    let kdf = if keyslot_kdf == KeyslotKdf::Given {
        kdf_request(o, 2)?
    } else {
        ucrypt::luks::kdf::KdfRequest::luks2_default()
    };
    let opts = InitOptions {
        resilience,
        kdf: &kdf,
        key_slot: o.key_slot,
        change,
        mode,
        keyslot_kdf,
        resilience_hash: resilience_hash(r)?,
        shift_bytes: r
            .reduce_device_size
            .as_deref()
            .map(|s| parse_size(s, "reduce-device-size"))
            .transpose()?,
    };
    let (started, passphrase) = if mode == Mode::Decrypt {
        let passphrase =
            pass::read_passphrase(&existing_source(o, None), &passphrase_prompt(o), false)?;
        (
            reencrypt::run::init_on(devs, passphrase.as_ref(), &opts)?,
            passphrase,
        )
    } else if r.keep_key {
        let slot = keep_key_passphrase(devs.header, hdr, o)?;
        let first = ucrypt::SecretBytes::from_slice(slot.passphrase());
        (reencrypt::run::init_keep_key(devs, &slot, &opts)?, first)
    } else {
        let slots = slot_passphrases(devs.header, hdr, o)?;
        let first = slots
            .first()
            .map(|sp| ucrypt::SecretBytes::from_slice(sp.passphrase()))
            .ok_or(Error::Bug("a rotation with no passphrase"))?;
        (reencrypt::run::init_slots(devs, &slots, &opts)?, first)
    };
    if o.verbose {
        for (_, k) in &started.new_keyslots {
            eprintln!("Key slot {k} created.");
        }
        eprintln!("Reencryption keyslot {}.", started.reencrypt_keyslot);
    }
    if r.init_only {
        return Ok(ControlFlow::Break(0));
    }
    Ok(ControlFlow::Continue(passphrase))
}

/// Whether a PBKDF option was given (`--pbkdf`, `--hash`, `--iter-time`,
/// `--pbkdf-force-iterations`): then cryptsetup 2.6.1 makes every new keyslot with it, else
/// each copies the old keyslot's (`set_keyslot_params`).
fn new_kdf_given(o: &LuksOpts) -> bool {
    o.pbkdf.is_some()
        || o.hash.is_some()
        || o.iter_time.is_some()
        || o.pbkdf_force_iterations.is_some()
}

/// `--resilience-hash`, or cryptsetup's default; refused unless ucrypt computes it.
fn resilience_hash(r: &ReencryptOpts) -> Result<HashAlg> {
    match r.resilience_hash.as_deref() {
        None => Ok(reencrypt::run::CHECKSUM_HASH),
        Some(h) => HashAlg::from_name(h).map_err(|_| {
            let names: Vec<&str> = HashAlg::ALL.iter().map(|a| a.name()).collect();
            Error::InvalidArgument(format!(
                "Hash algorithm {h} is not available (ucrypt checksums with {}).",
                names.join(", ")
            ))
        }),
    }
}

/// The passphrases of a rotation, asked as cryptsetup 2.6.1 asks them: after checking that
/// the new keyslots fit, "Enter passphrase for key slot N: " for the keyslot `--key-slot`
/// names, or for each active keyslot in order (a key file only when there is one); each is
/// checked against its keyslot before the next is read. From a pipe, one line each.
fn slot_passphrases(
    dev: &dyn Backend,
    hdr: &Header,
    o: &LuksOpts,
) -> Result<Vec<reencrypt::run::SlotPassphrase>> {
    reencrypt::run::check_free_keyslots(hdr, o.key_slot.is_some())?;
    let active = reencrypt::run::passphrase_keyslots(hdr);
    let slots = match o.key_slot {
        Some(s) => vec![s],
        None if o.key.key_file.is_some() && active.len() > 1 => {
            return Err(Error::InvalidArgument(
                reencrypt::run::KEY_FILE_NEEDS_ONE_KEYSLOT.into(),
            ))
        }
        None => active,
    };
    let src = existing_source(o, None);
    // Each asked for again while wrong, up to `--tries` times on a terminal (as cryptsetup's
    // reencrypt asks each keyslot's).
    let tries = pass::tries(o.tries, src.key_file);
    slots
        .into_iter()
        .map(|slot| {
            let prompt = format!("Enter passphrase for key slot {slot}: ");
            pass::retry_wrong(
                tries,
                |e| matches!(e, Error::WrongPassphrase),
                || {
                    let p = pass::read_passphrase(&src, &prompt, false)?;
                    reencrypt::run::check_passphrase(dev, hdr, slot, p)
                },
            )
        })
        .collect()
}

/// The one passphrase of a reencryption that keeps the volume key, asked as cryptsetup
/// 2.6.1 asks it: "Enter passphrase for key slot N: " for `--key-slot`, or for the first
/// active keyslot; checked against it.
fn keep_key_passphrase(
    dev: &dyn Backend,
    hdr: &Header,
    o: &LuksOpts,
) -> Result<reencrypt::run::SlotPassphrase> {
    let slot = match o.key_slot {
        Some(s) => s,
        None => *reencrypt::run::passphrase_keyslots(hdr)
            .first()
            .ok_or(Error::NoUsableKeyslot)?,
    };
    let src = existing_source(o, None);
    let prompt = format!("Enter passphrase for key slot {slot}: ");
    pass::retry_wrong(
        pass::tries(o.tries, src.key_file),
        |e| matches!(e, Error::WrongPassphrase),
        || {
            let p = pass::read_passphrase(&src, &prompt, false)?;
            reencrypt::run::check_passphrase(dev, hdr, slot, p)
        },
    )
}

/// Bytes of the detached header `--encrypt` makes: cryptsetup's default LUKS2 metadata
/// (two 16 KiB copies and the keyslots area), 16 MiB.
const ENCRYPT_HEADER_BYTES: u64 = 16 << 20;

/// Whether `--header` already holds a LUKS2 header in reencryption (an encryption to resume).
fn encryption_in_progress(o: &LuksOpts) -> bool {
    let Some(h) = &o.header else { return false };
    let Ok(dev) = crate::header_dev::open_header(h, false) else {
        return false;
    };
    matches!(
        ucrypt::luks::read_header(dev.as_ref()),
        Ok(Header::Luks2(h)) if ReencryptState::from_metadata(h.meta()).ok().flatten().is_some()
    )
}

/// Whether, without `--header`, the device holds a LUKS2 header in reencryption (an
/// encryption with the header in front to resume).
fn shift_in_progress(device: &Target, o: &LuksOpts) -> bool {
    if o.header.is_some() {
        return false;
    }
    let Ok(dev) = device.open_header(false, &o.remote) else {
        return false;
    };
    matches!(
        ucrypt::luks::read_header(dev.as_ref()),
        Ok(Header::Luks2(h)) if ReencryptState::from_metadata(h.meta()).ok().flatten().is_some()
    )
}

/// `reencrypt --encrypt --reduce-device-size R DEVICE`: the header in front of the data, the
/// data moved by R/2 (as cryptsetup 2.6; `--init-only` stops after the header).
fn encrypt_shift(device: &Target, r: &ReencryptOpts, o: &LuksOpts, reduce: u64) -> Result<i32> {
    if r.resume_only {
        // cryptsetup 2.6.1's words.
        return Err(Error::InvalidArgument(
            "Device reencryption not in progress.".into(),
        ));
    }
    // `--resilience` is ignored, as cryptsetup 2.6.1 ignores it here: a data shift's
    // resilience is `datashift` (its source stays intact), whatever is asked.
    let (cipher, key_bytes, sector_size) = new_segment(o)?;
    let hotzone_bytes = hotzone_bytes(r)?;
    let dev = device.open_data(true, &o.remote, CacheMode::Writeback)?;
    let passphrase = pass::read_passphrase(&existing_source(o, None), "Enter passphrase: ", true)?;
    let kdf = kdf_request(o, 2)?;
    let uuid = new_uuid(o)?;
    reencrypt::run::init_encrypt_shift(
        dev.as_ref(),
        passphrase.as_ref(),
        &reencrypt::run::EncryptOptions {
            resilience: ResilienceKind::None,
            resilience_hash: reencrypt::run::CHECKSUM_HASH,
            kdf: &kdf,
            cipher,
            key_bytes,
            sector_size,
            uuid,
            keyslot_area: super::keyslot_area::request(o)?,
        },
        reduce,
    )?;
    if r.init_only {
        return Ok(0);
    }
    if let Some(name) = &r.active_name {
        drop(dev);
        return open_and_run_online(device, o, name, passphrase, hotzone_bytes);
    }
    let mut meter = Meter::new(o, device);
    reencrypt::run::resume(
        dev.as_ref(),
        passphrase.as_ref(),
        RunOptions {
            hotzone_bytes,
            resilience: None,
            device_size: None,
        },
        &mut |p| meter.show(p),
    )?;
    Ok(0)
}

/// The new segment of an encryption: `--cipher` (aes-xts-plain64), `--key-size` in bits (the
/// cipher's default), `--sector-size` (512, as cryptsetup 2.6.1 chose on a file).
fn new_segment(o: &LuksOpts) -> Result<(CipherSpec, usize, SectorSize)> {
    let cipher: CipherSpec = o.cipher.as_deref().unwrap_or("aes-xts-plain64").parse()?;
    let key_bytes = match o.key_size {
        None => cipher.default_key_bytes(),
        Some(bits) if bits % 8 == 0 => bits as usize / 8,
        Some(bits) => {
            return Err(Error::InvalidArgument(format!(
                "Key size in bits must be a multiple of 8 bits ({bits})."
            )))
        }
    };
    Ok((
        cipher,
        key_bytes,
        SectorSize::new(o.sector_size.unwrap_or(512))?,
    ))
}

fn new_uuid(o: &LuksOpts) -> Result<String> {
    match &o.uuid {
        Some(u) => {
            ucrypt::luks::check_uuid(u)?;
            Ok(u.clone())
        }
        None => ucrypt::luks::random_uuid(),
    }
}

/// `reencrypt --encrypt --header H`: a new detached header for the plaintext device, then the
/// hotzones (as cryptsetup 2.6; `--init-only` stops after the header).
fn encrypt(device: &Target, r: &ReencryptOpts, o: &LuksOpts) -> Result<i32> {
    let Some(hpath) = &o.header else {
        return Err(Error::InvalidArgument(
            reencrypt::run::ENCRYPT_NEEDS_DETACHED_HEADER.into(),
        ));
    };
    if r.resume_only {
        // cryptsetup 2.6.1's words.
        return Err(Error::InvalidArgument(
            "Device reencryption not in progress.".into(),
        ));
    }
    // cryptsetup 2.6.1 encrypts in 512-byte sectors unless told otherwise.
    let (cipher, key_bytes, sector_size) = new_segment(o)?;
    let resilience = ResilienceKind::from_name(r.resilience.as_deref().unwrap_or("checksum"))?;
    let resilience_hash = resilience_hash(r)?;
    let hotzone_bytes = hotzone_bytes(r)?;
    let data = device.open_data(true, &o.remote, CacheMode::Writeback)?;
    let device_size = r.device_size_sectors.map(|s| s * 512);
    if device_size.is_some_and(|n| n > data.size()) {
        return Err(Error::InvalidArgument(
            "Reduced data size is larger than real device size.".into(),
        ));
    }
    if device_size.is_some() && r.active_name.is_some() {
        return Err(not_built(
            "--device-size with --active-name (the daemon encrypts all of the data it serves)",
        ));
    }
    let passphrase = pass::read_passphrase(&existing_source(o, None), "Enter passphrase: ", true)?;
    let kdf = kdf_request(o, 2)?;
    let uuid = new_uuid(o)?;
    let hdr = crate::header_dev::create_header(hpath, ENCRYPT_HEADER_BYTES)?;
    let devs = Devices {
        header: hdr.as_ref(),
        data: data.as_ref(),
    };
    reencrypt::run::init_encrypt(
        devs,
        passphrase.as_ref(),
        &reencrypt::run::EncryptOptions {
            resilience,
            resilience_hash,
            kdf: &kdf,
            cipher,
            key_bytes,
            sector_size,
            uuid,
            keyslot_area: super::keyslot_area::request(o)?,
        },
    )?;
    if r.init_only {
        return Ok(0);
    }
    if let Some(name) = &r.active_name {
        drop((hdr, data));
        return open_and_run_online(device, o, name, passphrase, hotzone_bytes);
    }
    let mut meter = Meter::new(o, device);
    reencrypt::run::resume_on(
        devs,
        passphrase.as_ref(),
        RunOptions {
            hotzone_bytes,
            resilience: None,
            device_size,
        },
        &mut |p| meter.show(p),
    )?;
    Ok(0)
}

/// After the init of an encryption (or of a decryption that moves the data back), what
/// cryptsetup's `reencrypt --encrypt DEVICE NAME` does: the volume is opened as NAME (an `ucrypt open` daemon with its default front end, the
/// passphrase handed over on a pipe, as `--key-file -`), and that daemon encrypts it while it
/// serves (`--active-name NAME`, since ucrypt's `reencrypt` takes one DEVICE). A failed open
/// leaves the volume in reencryption, to be opened and resumed by hand; its exit code is
/// returned.
fn open_and_run_online(
    device: &Target,
    o: &LuksOpts,
    name: &str,
    passphrase: ucrypt::SecretBytes,
    hotzone_bytes: Option<u64>,
) -> Result<i32> {
    use std::io::Write;
    let Target::Path(path) = device else {
        return Err(Error::InvalidArgument(
            "--active-name with a new --encrypt or --decrypt opens a local volume only".into(),
        ));
    };
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("finding this program to open the volume", e))?;
    let mut open = std::process::Command::new(exe);
    open.arg("open")
        .arg(path)
        .arg(name)
        .args(["--key-file", "-"]);
    if let Some(h) = &o.header {
        open.arg("--header").arg(h);
    }
    let mut child = open
        .stdin(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting ucrypt open {name}"), e))?;
    if let Some(mut pipe) = child.stdin.take() {
        // Closed when dropped: the end of the key file.
        pipe.write_all(passphrase.as_ref())
            .map_err(|e| Error::io(format!("handing the passphrase to ucrypt open {name}"), e))?;
    }
    let st = child
        .wait()
        .map_err(|e| Error::io(format!("waiting for ucrypt open {name}"), e))?;
    if !st.success() {
        eprintln!(
            "The encryption is initialised but {name} was not opened: open it (ucrypt open) \
             and run ucrypt reencrypt again to encrypt it online."
        );
        return Ok(st.code().unwrap_or(1));
    }
    let h = match crate::daemon::online::by_name(name) {
        Ok(h) => h,
        Err(e) => return Ok(crate::daemon::report(Err(e))),
    };
    let opts = RunOptions {
        hotzone_bytes,
        resilience: None,
        device_size: None,
    };
    Ok(run_in_daemon(&h, passphrase, opts, o, device))
}

/// Has the daemon `h` run the reencryption (its header already initialised) while it serves,
/// showing its progress as the offline run does; returns the exit code, the daemon's failure
/// reported.
fn run_in_daemon(
    h: &crate::daemon::online::Holder,
    passphrase: ucrypt::SecretBytes,
    opts: RunOptions,
    o: &LuksOpts,
    device: &Target,
) -> i32 {
    let mut meter = Meter::new(o, device);
    let r = h.rotate(passphrase, opts, &mut |done, total| {
        meter.show(Progress { done, total })
    });
    if r.is_ok() && o.verbose {
        eprintln!("Command successful.");
    }
    crate::daemon::report(r)
}

/// `reencrypt --decrypt --header NEW DEVICE` with NEW not existing, DEVICE a LUKS2 volume
/// whose header is in front of its data: the header is exported to NEW (created, mode 0600)
/// and the data decrypted to the start of the device (as cryptsetup 2.6; `--init-only` stops
/// after the init). `--hotzone-size` is the moved segment's size, as cryptsetup reads it here.
/// An init refused before it wrote anything removes NEW; one that failed after leaves it (it
/// is the volume's header then), saying so in cryptsetup's words.
fn decrypt_unshift(
    device: &Target,
    r: &ReencryptOpts,
    o: &LuksOpts,
    hpath: &std::path::Path,
) -> Result<i32> {
    if r.resume_only {
        // cryptsetup 2.6.1's words.
        return Err(Error::InvalidArgument(
            "Device reencryption not in progress.".into(),
        ));
    }
    let resilience_hash = resilience_hash(r)?;
    let asked = ResilienceAsked::from_name(
        r.resilience.as_deref().unwrap_or("checksum"),
        resilience_hash,
    )?;
    let Some(resilience) = asked.moved_guard() else {
        // cryptsetup 2.6.1's words, for `none` and `datashift` alike.
        return Err(Error::InvalidArgument(
            "Requested --resilience option cannot be applied to current reencryption \
             operation."
                .into(),
        ));
    };
    let moved_bytes = hotzone_bytes(r)?;
    let data = device.open_data(true, &o.remote, CacheMode::Writeback)?;
    let meta_bytes = match ucrypt::luks::read_header(data.as_ref())? {
        Header::Luks2(h) => 2 * h.bin().hdr_size + h.meta().config.keyslots_size.0,
        Header::Luks1(_) => {
            return Err(Error::UnsupportedLuks(
                "reencryption of LUKS1 (convert it to LUKS2 first)".into(),
            ))
        }
    };
    let prompt = match o.key_slot {
        Some(s) => format!("Enter passphrase for key slot {s}: "),
        None => "Enter passphrase: ".to_string(),
    };
    let passphrase = pass::read_passphrase(&existing_source(o, None), &prompt, false)?;
    let kdf = kdf_request(o, 2)?;
    new_header_file(hpath, meta_bytes)?;
    let hdr = crate::header_dev::open_header(hpath, true)?;
    let devs = Devices {
        header: hdr.as_ref(),
        data: data.as_ref(),
    };
    let started = reencrypt::run::init_decrypt_unshift(
        devs,
        passphrase.as_ref(),
        &reencrypt::run::UnshiftOptions {
            kdf: &kdf,
            key_slot: o.key_slot,
            moved_bytes,
            resilience,
            resilience_hash,
        },
    );
    if let Err(e) = started {
        drop(hdr);
        if ucrypt::luks::read_header(data.as_ref()).is_ok() {
            // Refused before the data device was written: its header is still in front.
            let _ = std::fs::remove_file(hpath);
        } else {
            eprintln!(
                "Reencryption initialization failed. Header backup is available in {}.",
                hpath.display()
            );
        }
        return Err(e);
    }
    if r.init_only {
        return Ok(0);
    }
    if let Some(name) = &r.active_name {
        drop((hdr, data));
        return open_and_run_online(device, o, name, passphrase, None);
    }
    let mut meter = Meter::new(o, device);
    reencrypt::run::resume_on(devs, passphrase.as_ref(), RunOptions::default(), &mut |p| {
        meter.show(p)
    })?;
    if o.verbose {
        eprintln!("Command successful.");
    }
    Ok(0)
}

/// Creates the file a header is exported to: new (an existing one is never overwritten),
/// mode 0600 (as cryptsetup leaves its export), `bytes` long.
fn new_header_file(path: &std::path::Path, bytes: u64) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io(format!("Cannot create header file {}", path.display()), e))?;
    f.set_len(bytes)
        .map_err(|e| Error::io(format!("Cannot size header file {}", path.display()), e))
}

/// `repair` of a volume in reencryption: recovers the hotzone from the resilience data (as
/// cryptsetup's `repair` does), then rewrites the header copies.
pub fn repair_reencryption(device: &Target, o: &LuksOpts) -> Result<i32> {
    // The serving process recovered the hotzone when it opened the volume, and owns the
    // reencryption since: a recovery under it would rewrite data it serves.
    super::refuse_if_served(
        device,
        o,
        "its reencryption belongs to that process (it recovered the hotzone when it opened \
         the volume); stop it first to repair offline",
    )?;
    let passphrase = pass::read_passphrase(
        &existing_source(o, None),
        "Enter passphrase for reencryption recovery: ",
        false,
    )?;
    let (dev, _) = load(device, o, true)?;
    let data = data_dev(device, o)?;
    let devs = Devices {
        header: dev.as_ref(),
        data: data.as_deref().unwrap_or(dev.as_ref()),
    };
    match reencrypt::run::recover_on(devs, passphrase.as_ref())? {
        Recovery::NotNeeded => {
            if o.verbose {
                eprintln!("No known problems detected for LUKS header.");
            }
        }
        Recovery::Recovered { offset, len } => {
            if o.verbose {
                eprintln!("Reencryption hotzone at {offset} ({len} bytes) recovered.");
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4M", "x").unwrap(), 4 << 20);
        assert_eq!(parse_size("4MiB", "x").unwrap(), 4 << 20);
        assert_eq!(parse_size("4MB", "x").unwrap(), 4_000_000);
        assert_eq!(parse_size("8S", "x").unwrap(), 4096);
        assert_eq!(parse_size("512", "x").unwrap(), 512);
        assert_eq!(parse_size("1G", "x").unwrap(), 1 << 30);
        let e = parse_size("4X", "hotzone-size").unwrap_err().to_string();
        assert!(
            e.contains("Invalid size specification in parameter --hotzone-size."),
            "{e}"
        );
        assert!(parse_size("", "x").is_err());
    }
}
