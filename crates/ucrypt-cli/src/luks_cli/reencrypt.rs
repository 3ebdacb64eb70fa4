//! `ucrypt reencrypt`: offline key rotation on cryptsetup's on-disk protocol
//! (`ucrypt::luks::reencrypt_run` does the work), and the recovery `repair` runs on a volume
//! left inside a hotzone.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use clap::Args;
use ucrypt::luks::reencrypt::ReencryptState;
use ucrypt::luks::reencrypt_run::{
    self, InitOptions, Progress, Recovery, ResilienceKind, RunOptions,
};
use ucrypt::luks::Header;
use ucrypt::{Error, Result};

use super::{existing_source, kdf_request, load, LuksOpts};
use crate::pass;
use crate::target::Target;

/// Options of `reencrypt` beyond the common LUKS ones (cryptsetup's spellings).
#[derive(Args, Debug, Clone, Default)]
pub struct ReencryptOpts {
    /// Only write the reencryption metadata; `--resume-only` rewrites the data later.
    #[arg(long)]
    pub init_only: bool,
    /// Continue a reencryption started before (by ucrypt or by cryptsetup).
    #[arg(long)]
    pub resume_only: bool,
    /// How a hotzone survives a crash: checksum (default), journal or none.
    #[arg(long)]
    pub resilience: Option<String>,
    /// Checksum hash (only sha256, cryptsetup's default, is written).
    #[arg(long)]
    pub resilience_hash: Option<String>,
    /// Largest hotzone, in bytes or with a unit (4M, 64MiB...).
    #[arg(long)]
    pub hotzone_size: Option<String>,
    /// Accepted for scripts on a volume no ucrypt daemon serves (that one is reencrypted
    /// offline anyway); refused on one a daemon serves (reencrypted online, through it).
    #[arg(long)]
    pub force_offline_reencrypt: bool,
    /// Encrypt a plaintext device in place (not built yet in ucrypt).
    #[arg(long, short = 'N', alias = "new")]
    pub encrypt: bool,
    /// Decrypt the device in place (not built yet in ucrypt).
    #[arg(long)]
    pub decrypt: bool,
    /// Move the data to make room for a header (datashift; not built yet in ucrypt).
    #[arg(long)]
    pub reduce_device_size: Option<String>,
    /// Reencrypt online the volume the daemon of this name serves (`ucrypt open VOLUME NAME`);
    /// without it, a volume a daemon serves is found by its file.
    #[arg(long)]
    pub active_name: Option<String>,
}

/// cryptsetup's size syntax: a number with an optional unit (K, M, G, T with or without
/// "iB"; binary multiples; "B" or none for bytes; "s" for 512-byte sectors is not accepted).
fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("Invalid size specification '{s}'.")))?;
    let shift = match unit.trim_end_matches("iB").trim_end_matches('B') {
        "" => 0,
        "k" | "K" => 10,
        "m" | "M" => 20,
        "g" | "G" => 30,
        "t" | "T" => 40,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "Invalid size specification '{s}'."
            )))
        }
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| Error::InvalidArgument(format!("Invalid size specification '{s}'.")))
}

fn not_built(what: &str) -> Error {
    Error::InvalidArgument(format!(
        "ucrypt reencrypt does not support {what} yet (it rotates the volume key of a LUKS2 \
         volume in place)."
    ))
}

/// Refuses what is not built, naming it.
fn check_supported(r: &ReencryptOpts, o: &LuksOpts, hdr: &Header) -> Result<()> {
    if r.encrypt {
        return Err(not_built("--encrypt (encrypting a plaintext device)"));
    }
    if r.decrypt {
        return Err(not_built("--decrypt"));
    }
    if r.reduce_device_size.is_some() {
        return Err(not_built(
            "--reduce-device-size (moving the data: datashift)",
        ));
    }
    if o.header.is_some() {
        return Err(not_built("--header (a detached header)"));
    }
    if let Some(h) = &r.resilience_hash {
        if h != reencrypt_run::CHECKSUM_HASH.name() {
            return Err(not_built("--resilience-hash other than sha256"));
        }
    }
    let Header::Luks2(h) = hdr else {
        return Err(Error::UnsupportedLuks(
            "reencryption of LUKS1 (convert it to LUKS2 first)".into(),
        ));
    };
    // A cipher, key size or sector size change: refused unless it changes nothing.
    if let Ok(seg) = h.meta.crypt_segment() {
        if o.cipher
            .as_deref()
            .is_some_and(|c| c != seg.cipher.to_string())
        {
            return Err(not_built("--cipher (a cipher change)"));
        }
        if o.sector_size
            .is_some_and(|s| s != u64::from(seg.sector_size.bytes()))
        {
            return Err(not_built("--sector-size (a sector size change)"));
        }
        if let Some(bits) = o.key_size {
            let have = h
                .meta
                .keyslots
                .values()
                .find(|k| k.kind == "luks2")
                .map(|k| k.key_size * 8);
            if have.is_some_and(|b| b != bits) {
                return Err(not_built("--key-size (a key size change)"));
            }
        }
    }
    Ok(())
}

/// Prints progress as cryptsetup does: a line every `every` (`--progress-frequency`), or an
/// updated line on a terminal, nothing otherwise.
struct Meter {
    start: Instant,
    last: Instant,
    every: Option<Duration>,
    tty: bool,
    first_done: Option<u64>,
}

impl Meter {
    fn new(freq: Option<u64>, batch: bool) -> Self {
        let now = Instant::now();
        Meter {
            start: now,
            last: now,
            every: freq.map(Duration::from_secs),
            tty: !batch && std::io::stderr().is_terminal(),
            first_done: None,
        }
    }

    fn show(&mut self, p: Progress) {
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
    // A volume a live daemon serves is rotated by that daemon, online.
    let holder = match (&r.active_name, device) {
        (Some(name), _) => match crate::daemon::online::by_name(name) {
            Ok(h) => Some(h),
            Err(e) => return Ok(crate::daemon::report(Err(e))),
        },
        (None, Target::Path(p)) => crate::daemon::online::holder_of(p),
        (None, _) => None,
    };
    if let Some(h) = &holder {
        if let Target::Path(p) = device {
            if !h.serves(p) {
                return Err(Error::InvalidArgument(format!(
                    "Device {} serves {}, not {device}.",
                    h.name,
                    h.volume().unwrap_or_default().display()
                )));
            }
        }
        if r.force_offline_reencrypt {
            eprintln!(
                "Device {device} is in use by the ucrypt daemon {}: it is reencrypted online \
                 through it (drop --force-offline-reencrypt, or close it first).",
                h.name
            );
            return Ok(5);
        }
    }
    let (dev, hdr) = match (&holder, device) {
        // The daemon holds cryptsetup's shared lock on the header for its whole life (it
        // checks the key on resume), so the exclusive one would wait for ever: the init is
        // written without it. The daemon is the header's only other user, and writes it only
        // once asked to rotate, after the init.
        (Some(_), Target::Path(p)) => {
            let d: std::sync::Arc<dyn ucrypt::backend::Backend> = std::sync::Arc::new(
                ucrypt::backend::FileBackend::open(p, true, ucrypt::backend::DirectMode::Never)?,
            );
            let h = ucrypt::luks::read_header(d.as_ref())?;
            (d, h)
        }
        _ => load(device, o, true)?,
    };
    check_supported(r, o, &hdr)?;
    let in_progress = match &hdr {
        Header::Luks2(h) => ReencryptState::from_metadata(&h.meta)?,
        Header::Luks1(_) => None,
    };
    if r.resume_only && in_progress.is_none() {
        return Err(Error::InvalidArgument(format!(
            "Device {device} is not in reencryption."
        )));
    }
    let hotzone_bytes = r.hotzone_size.as_deref().map(parse_size).transpose()?;
    if let Some(n) = hotzone_bytes {
        if n == 0 || n % 512 != 0 {
            return Err(Error::InvalidArgument(
                "Hotzone size must be multiple of calculated zone alignment (512 bytes).".into(),
            ));
        }
    }
    let prompt = match o.key_slot {
        Some(s) => format!("Enter passphrase for key slot {s}: "),
        None => "Enter passphrase: ".to_string(),
    };
    let passphrase = pass::read_passphrase(&existing_source(o, None), &prompt, false)?;
    match &in_progress {
        Some(st) => {
            if st.needs_recovery() {
                return Err(Error::NeedsRecovery);
            }
            // cryptsetup resumes an interrupted reencryption when asked to reencrypt again.
        }
        None => {
            let resilience =
                ResilienceKind::from_name(r.resilience.as_deref().unwrap_or("checksum"))?;
            let kdf = kdf_request(o, 2)?;
            let started = reencrypt_run::init(
                dev.as_ref(),
                passphrase.as_ref(),
                &InitOptions {
                    resilience,
                    kdf: &kdf,
                    key_slot: o.key_slot,
                },
            )?;
            if o.verbose {
                eprintln!(
                    "Key slot {} created. Reencryption keyslot {}.",
                    started.new_keyslot, started.reencrypt_keyslot
                );
            }
            if r.init_only {
                return Ok(0);
            }
        }
    }
    let mut meter = Meter::new(o.progress_frequency, o.batch_mode);
    if let Some(h) = holder {
        drop(dev);
        let r = h.rotate(passphrase, hotzone_bytes, &mut |done, total| {
            meter.show(Progress { done, total })
        });
        if r.is_ok() && o.verbose {
            eprintln!("Command successful.");
        }
        return Ok(crate::daemon::report(r));
    }
    reencrypt_run::resume(
        dev.as_ref(),
        passphrase.as_ref(),
        RunOptions { hotzone_bytes },
        &mut |p| meter.show(p),
    )?;
    if o.verbose {
        eprintln!("Command successful.");
    }
    Ok(0)
}

/// `repair` of a volume in reencryption: recovers the hotzone from the resilience data (as
/// cryptsetup's `repair` does), then rewrites the header copies.
pub fn repair_reencryption(device: &Target, o: &LuksOpts) -> Result<i32> {
    let passphrase = pass::read_passphrase(
        &existing_source(o, None),
        "Enter passphrase for reencryption recovery: ",
        false,
    )?;
    let (dev, _) = load(device, o, true)?;
    match reencrypt_run::recover(dev.as_ref(), passphrase.as_ref())? {
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
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert!(parse_size("4X").is_err());
        assert!(parse_size("").is_err());
    }
}
