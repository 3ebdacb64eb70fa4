//! A volume's life cycle as cryptsetup users know it: `ucrypt open VOLUME NAME` starts a
//! daemon that serves the volume as a block device until `ucrypt close NAME`; `status NAME`
//! and `list` look at it.
//!
//! - `open` reads the header (and prints its warnings) and the passphrase or key file in the
//!   foreground, then forks: the child builds the volume (unlocking a keyslot there; a wrong
//!   passphrase comes back through a pipe as exit 2), starts the front end, names the device
//!   and answers a control socket; the parent returns once the device is ready. Forking
//!   before any thread exists is what makes the fork safe (see [`fork_daemon`]). A remote
//!   volume (NBD, RBD) starts threads as soon as it connects, so for it only the passphrase
//!   is read before the fork; the daemon connects, checks the header and unlocks
//!   ([`open_remote_in_daemon`]).
//! - Front ends, best first (`--front-end auto`): ublk (`/dev/ublkbN`) as root when
//!   `/dev/ublk-control` exists; else as root the FUSE file attached to a loop device with
//!   direct I/O; else (rootless) the FUSE file alone.
//! - State and names: `state.rs`. Control protocol: `proto.rs` (sans I/O) and `server.rs`.
//!   The daemon itself: `serve.rs`. Loop devices: `loopdev.rs`. In use or not: `mounts.rs`.
//!
//! - Control verbs over the socket: `close` (`--deferred`, `--cancel-deferred`), `status`,
//!   `refresh`, `suspend`/`resume` (the daemon re-derives the key from the passphrase the
//!   verb sends; the volume key never crosses the socket), `resize`, `reencrypt` (online key
//!   rotation in the daemon, followed through `status`: `online.rs`).

pub mod budget;
pub mod control;
mod loopdev;
mod main_loop;
mod mounts;
pub mod online;
mod proto;
mod resize;
mod serve;
mod server;
mod state;
pub mod worker;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ucrypt::luks::Header;
use ucrypt::open::{Format, Luks};
use ucrypt::Error;

use crate::error::{CliError, CliResult};
use crate::open::{Prepared, VolumeArgs};
use crate::target::Target;
use proto::{Ready, Request, Response, StatusReport, VolumeInfo};
use state::{Identity, RunDir};
use ucrypt::luks::json::KeyslotKind;

/// How long `close` waits for the daemon to exit after it answered.
const CLOSE_EXIT_WAIT: Duration = Duration::from_secs(10);
const CLOSE_EXIT_POLL: Duration = Duration::from_millis(20);

/// `ucrypt open` (`luksOpen`): cryptsetup's options, plus the front end's.
#[derive(Args, Debug)]
pub struct OpenArgs {
    #[command(flatten)]
    pub v: VolumeArgs,
    /// The device's name: /dev/ucrypt/NAME (root), $XDG_RUNTIME_DIR/ucrypt/NAME/device
    /// (rootless).
    pub name: Option<String>,
    /// Only check the passphrase (no device, no NAME needed).
    #[arg(long)]
    pub test_passphrase: bool,
    /// With --test-passphrase: unbound keyslots (keys no data segment uses) may answer too.
    #[arg(long, requires = "test_passphrase")]
    pub unbound: bool,
    /// Stay in the foreground (for service managers): print the ready line, serve until
    /// SIGTERM/SIGINT or `ucrypt close NAME`.
    #[arg(long)]
    pub foreground: bool,
    /// auto: ublk when /dev/ublk-control exists (root), else as root FUSE + loop device, else
    /// the FUSE file alone. vhost-user: a vhost-user-blk socket in the state directory, for a
    /// VMM (qemu's vhost-user-blk-pci) to give a guest the volume as a virtio-blk disk.
    #[arg(long, value_enum, default_value_t = FrontEnd::Auto)]
    pub front_end: FrontEnd,
    /// luks (the header decides), luks1 or luks2 (the header must be that version), or plain
    /// (with --cipher and --volume-key-file), tcrypt, fvault2 or loopaes (`fvault2Open`,
    /// `loopaesOpen`), bitlk (`bitlkOpen`).
    #[arg(long = "type", short = 'M')]
    pub dev_type: Option<crate::open::DeviceType>,
    /// Accepted for compatibility (no confirmation is asked).
    #[arg(long, short = 'q')]
    pub batch_mode: bool,
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// How many times a passphrase typed on a terminal is asked for (default 3); a key file
    /// or a pipe is read once. A remote volume's passphrase is asked once (its header is read
    /// only after the daemon starts).
    #[arg(long, short = 'T')]
    pub tries: Option<u32>,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
    /// Also serve the volume to NBD clients on this socket: unix:PATH (mode 0600; export NAME).
    #[arg(long, value_name = "unix:PATH")]
    pub nbd: Option<ucrypt_nbd::server::Listen>,
    /// LUKS2: store the activation flags given (--allow-discards, --perf-no_read_workqueue,
    /// --perf-no_write_workqueue) in the header, replacing the stored ones, before opening.
    #[arg(long)]
    pub persistent: bool,
    /// NAME is open already: apply the flags given (--allow-discards, --policy, --spin-us,
    /// --perf-no_*_workqueue) to it, as `ucrypt refresh NAME` does (cryptsetup's
    /// `open --refresh`).
    #[arg(long)]
    pub refresh: bool,
    #[command(flatten)]
    pub budget: budget::MemoryBudgetArgs,
    /// Plain mode (`--type plain`): map the volume beside other mappings of it (each its own
    /// `--offset`/`--size`), as cryptsetup's `--shared`; a later open without it still finds
    /// the volume in use.
    #[arg(long)]
    pub shared: bool,
}

/// An option `open` refuses in this combination, with cryptsetup's words: checked before
/// anything runs (`--test-args` included), as cryptsetup checks its options.
pub fn refusal(a: &OpenArgs) -> Option<&'static str> {
    if let Some(why) = crate::volume_args::key_files_refusal(&a.v.key_files, a.dev_type) {
        return Some(why);
    }
    (a.shared && a.dev_type != Some(crate::open::DeviceType::Plain))
        .then_some("Option --shared is allowed only for open of plain device.")
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontEnd {
    Auto,
    Ublk,
    /// The FUSE file on a loop device (root).
    Loop,
    /// The FUSE file alone.
    Fuse,
    /// A vhost-user-blk socket (no root needed): the device path names the socket.
    VhostUser,
}

impl FrontEnd {
    pub fn label(self) -> &'static str {
        match self {
            FrontEnd::Auto => "auto",
            FrontEnd::Ublk => "ublk",
            FrontEnd::Loop => "fuse+loop",
            FrontEnd::Fuse => "fuse",
            FrontEnd::VhostUser => "vhost-user",
        }
    }

    fn resolve(self, root: bool) -> CliResult<FrontEnd> {
        let ublk = Path::new("/dev/ublk-control").exists();
        match self {
            FrontEnd::Auto if root && ublk => Ok(FrontEnd::Ublk),
            FrontEnd::Auto if root => Ok(FrontEnd::Loop),
            FrontEnd::Auto => Ok(FrontEnd::Fuse),
            FrontEnd::Ublk if !ublk => Err(ucrypt_ublk::Error::NoDriver.into()),
            FrontEnd::Ublk | FrontEnd::Loop if !root => Err(CliError::Usage(format!(
                "--front-end {} needs root",
                self.label()
            ))),
            f => Ok(f),
        }
    }
}

/// `ucrypt close NAME`: a device that is mounted, held by another device or open in a
/// process is busy (exit 5), as cryptsetup's close of a dm device whose open count is not zero.
#[derive(Args, Debug)]
pub struct CloseArgs {
    /// The device: NAME, or its stable path (/dev/ucrypt/NAME;
    /// $XDG_RUNTIME_DIR/ucrypt/NAME/device rootless), as cryptsetup takes /dev/mapper/NAME.
    pub name: String,
    /// Close even while the device is mounted or held: it is flushed, then fails every
    /// request (as `dmsetup remove --force` does).
    #[arg(long, conflicts_with = "deferred")]
    pub force: bool,
    /// Close once the device's last user goes (now if there is none), and return at once.
    #[arg(long)]
    pub deferred: bool,
    /// Cancel a pending --deferred close.
    #[arg(long, conflicts_with_all = ["deferred", "force"])]
    pub cancel_deferred: bool,
}

#[derive(Args, Debug)]
pub struct SuspendArgs {
    /// The device: NAME, or its stable path (/dev/ucrypt/NAME;
    /// $XDG_RUNTIME_DIR/ucrypt/NAME/device rootless), as cryptsetup takes /dev/mapper/NAME.
    pub name: String,
}

#[derive(Args, Debug)]
pub struct ResumeArgs {
    /// The device: NAME, or its stable path (/dev/ucrypt/NAME;
    /// $XDG_RUNTIME_DIR/ucrypt/NAME/device rootless), as cryptsetup takes /dev/mapper/NAME.
    pub name: String,
    #[command(flatten)]
    pub key: crate::pass::KeyFileArgs,
    /// Try only this keyslot.
    #[arg(long, short = 'S')]
    pub key_slot: Option<u32>,
    /// Resume with the volume key in this file (checked against the header's digest).
    #[arg(long, conflicts_with_all = ["key_file", "key_slot"])]
    pub volume_key_file: Option<PathBuf>,
    /// How many times a passphrase typed on a terminal is asked for (default 3), as
    /// cryptsetup's luksResume does; a key file or a pipe is read once.
    #[arg(long, short = 'T')]
    pub tries: Option<u32>,
    /// Accepted for compatibility.
    #[arg(long, short = 'q')]
    pub batch_mode: bool,
}

#[derive(Args, Debug)]
pub struct ResizeArgs {
    /// The device: NAME, or its stable path (/dev/ucrypt/NAME;
    /// $XDG_RUNTIME_DIR/ucrypt/NAME/device rootless), as cryptsetup takes /dev/mapper/NAME;
    /// with --control, the volume the process serves (its file).
    pub name: String,
    /// The new size in 512-byte sectors; default: all of the backing file or device after
    /// the data offset.
    #[arg(long, short = 'b')]
    pub size: Option<u64>,
    /// The new size in bytes, a multiple of 512 (cryptsetup's --device-size).
    #[arg(
        long = "device-size",
        value_name = "BYTES",
        conflicts_with = "size",
        value_parser = crate::volume_args::device_size_sectors
    )]
    pub device_size_sectors: Option<u64>,
    /// Resize the volume a `serve`, `mount`, `ublk` or `vhost` process serves with this
    /// control socket (their `--control PATH`).
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The device: NAME, or its stable path (/dev/ucrypt/NAME;
    /// $XDG_RUNTIME_DIR/ucrypt/NAME/device rootless), as cryptsetup takes /dev/mapper/NAME.
    pub name: String,
}

#[derive(Args, Debug)]
pub struct RefreshArgs {
    /// The device: NAME, or its stable path (/dev/ucrypt/NAME;
    /// $XDG_RUNTIME_DIR/ucrypt/NAME/device rootless), as cryptsetup takes /dev/mapper/NAME.
    pub name: String,
    /// The new dispatch policy: inline, parallel, ordered, queued, auto, or read=P,write=Q.
    #[arg(long)]
    pub policy: Option<ucrypt::engine::Policies>,
    /// Pass discards down (`--allow-discards`), or stop (`--allow-discards=false`).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub allow_discards: Option<bool>,
    /// The engine's spin before sleeping, µs (as `open --spin-us`).
    #[arg(long, value_name = "US")]
    pub spin_us: Option<u64>,
    /// Reads run inline from now on (dm-crypt's flag, as `cryptsetup refresh` takes it).
    #[arg(long = "perf-no_read_workqueue")]
    pub perf_no_read_workqueue: bool,
    /// Writes run inline from now on.
    #[arg(long = "perf-no_write_workqueue")]
    pub perf_no_write_workqueue: bool,
}

fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn io_err(what: impl Into<String>, e: std::io::Error) -> CliError {
    CliError::Core(ucrypt::Error::io(what, e))
}

/// The line `open` prints once the device is ready.
pub fn ready_line(name: &str, r: &Ready) -> String {
    let mut s = format!(
        "{name}: {} -> {} ({})",
        r.stable_path, r.device, r.front_end
    );
    if let Some(n) = &r.note {
        s.push_str(&format!("; {n}"));
    }
    s
}

/// cryptsetup's status fields of a prepared volume (the size is known once it is open).
fn describe(p: &Prepared, volume: &Path, read_only: bool) -> CliResult<VolumeInfo> {
    let mut info = VolumeInfo {
        kind: String::new(),
        cipher: String::new(),
        key_bits: 0,
        device: volume.display().to_string(),
        sector_size: 512,
        offset_sectors: 0,
        size_sectors: 0,
        skipped_sectors: 0,
        read_only,
        flags: Vec::new(),
        integrity: None,
        integrity_key_bits: 0,
    };
    let allow_discards = p.req.allow_discards;
    match &p.req.format {
        Format::Luks(Luks {
            header: Some(hdr), ..
        }) => {
            if let Header::Luks2(h) = &**hdr {
                if let Some(seg) = h.meta().segments.values().find(|s| s.integrity.is_some()) {
                    // dm-crypt over dm-integrity, as cryptsetup's status shows it: the whole
                    // volume key's size, then the integrity type and its key's size.
                    let integ = seg.integrity.as_ref().map(|i| i.kind.clone());
                    let integ = integ.unwrap_or_default();
                    let recorded = seg.integrity.as_ref().and_then(|i| i.key_size);
                    let total_bits = h
                        .meta()
                        .keyslots
                        .values()
                        .find(|k| k.kind == KeyslotKind::Luks2)
                        .map(|k| k.key_size * 8)
                        .unwrap_or(0);
                    // The HMAC key: the segment's recorded size (cryptsetup 2.8's
                    // --integrity-key-size) or the hash's output size.
                    let mac_bits = ucrypt::format::IntegrityKind::from_name(&integ)
                        .filter(|k| k.mac_key_bytes() > 0)
                        .map_or(0, |k| {
                            recorded
                                .filter(|&b| b > 0)
                                .unwrap_or(k.mac_key_bytes() as u32)
                                * 8
                        });
                    info.kind = "LUKS2".into();
                    info.cipher = seg.encryption.clone().unwrap_or_default();
                    info.key_bits = total_bits;
                    info.integrity = Some(integ);
                    info.integrity_key_bits = mac_bits;
                    info.sector_size = seg.sector_size.unwrap_or(512);
                    info.offset_sectors = seg.offset.0 / 512;
                    return Ok(info);
                }
            }
            if let Header::Luks2(h) = &**hdr {
                // In reencryption: the volume as it was (backup-previous; a key rotation keeps
                // cipher, sector size and offset).
                let st = ucrypt::luks::reencrypt::ReencryptState::from_metadata(h.meta())?;
                if let Some(seg) =
                    st.and_then(|st| h.meta().segments.get(&st.backup_previous.to_string()))
                {
                    info.kind = "LUKS2".into();
                    info.cipher = seg.encryption.clone().unwrap_or_default();
                    info.key_bits = h
                        .meta()
                        .keyslots
                        .values()
                        .find(|k| k.kind == KeyslotKind::Luks2)
                        .map(|k| k.key_size * 8)
                        .unwrap_or(0);
                    info.sector_size = seg.sector_size.unwrap_or(512);
                    info.offset_sectors = seg.offset.0 / 512;
                    let flags = hdr.activation_flags();
                    if allow_discards || flags.iter().any(|f| f == "allow-discards") {
                        info.flags.push("discards".into());
                    }
                    return Ok(info);
                }
            }
            let layout = hdr.data_layout()?;
            info.kind = format!("LUKS{}", hdr.version());
            info.cipher = layout.cipher.to_string();
            info.key_bits = match &**hdr {
                Header::Luks1(h) => h.key_bytes * 8,
                Header::Luks2(h) => h
                    .meta()
                    .keyslots
                    .values()
                    .find(|k| k.kind == KeyslotKind::Luks2)
                    .map(|k| k.key_size * 8)
                    .unwrap_or(0),
            };
            info.sector_size = layout.sector_size.bytes();
            info.offset_sectors = layout.offset_bytes / 512;
            info.skipped_sectors = layout.iv_tweak;
            let flags = hdr.activation_flags();
            if allow_discards || flags.iter().any(|f| f == "allow-discards") {
                info.flags.push("discards".into());
            }
        }
        Format::Plain(cfg) => {
            info.kind = p.kind.unwrap_or("PLAIN").into();
            info.cipher = cfg.cipher.to_string();
            info.key_bits = (cfg.key.len() * 8) as u32;
            info.sector_size = cfg.geometry.sector_size.bytes();
            info.offset_sectors = cfg.data_offset_bytes / 512;
            info.skipped_sectors = cfg.geometry.iv_offset;
            if allow_discards {
                info.flags.push("discards".into());
            }
        }
        Format::Bitlk(b) => {
            info.kind = "BITLK".into();
            if let Some(m) = &b.metadata {
                info.cipher = format!("aes-{}", m.encryption.mode_name());
                info.key_bits = u32::from(m.encryption.key_bits());
                info.sector_size = m.sector_size.bytes();
            }
        }
        // `VolumeArgs::prepare` reads a LUKS header before it asks for the key.
        _ => {
            return Err(CliError::from(Error::Bug(
                "a prepared LUKS volume without its header",
            )))
        }
    }
    Ok(info)
}

/// The `--type` of `open` against the other options: a format ucrypt does not read, or a LUKS
/// type with --cipher, is refused (exit 1).
pub(crate) fn check_type(t: Option<crate::open::DeviceType>, cipher: bool) -> CliResult<()> {
    use crate::open::DeviceType;
    match (t, cipher) {
        (Some(DeviceType::Tcrypt | DeviceType::Loopaes), _)
        | (Some(DeviceType::Bitlk | DeviceType::Fvault2), false) => Ok(()),
        (None | Some(DeviceType::Plain), true) | (Some(DeviceType::Plain), false) => Ok(()),
        (None | Some(DeviceType::Luks | DeviceType::Luks1 | DeviceType::Luks2), false) => Ok(()),
        (Some(t), _) => Err(CliError::Usage(format!(
            "--type {} does not take --cipher (its header says its cipher)",
            t.name()
        ))),
    }
}

/// `ucrypt open VOLUME NAME`.
pub fn open(mut a: OpenArgs) -> CliResult<i32> {
    a.v.tries = a.tries;
    let name = a.name.clone().ok_or_else(|| {
        CliError::Usage("open needs a NAME for the device (or --test-passphrase)".into())
    })?;
    if a.refresh {
        if a.persistent {
            a.v.store_activation_flags()?;
        }
        return refresh(RefreshArgs {
            name,
            policy: a.v.policy,
            allow_discards: a.v.allow_discards.then_some(true),
            spin_us: None,
            perf_no_read_workqueue: a.v.perf_no_read_workqueue,
            perf_no_write_workqueue: a.v.perf_no_write_workqueue,
        });
    }
    state::check_name(&name)?;
    let run = RunDir::locate()?;
    run.check_name_fits(&name)?;
    check_type(a.dev_type, a.v.cipher.is_some())?;
    if a.dev_type == Some(crate::open::DeviceType::Plain) && a.v.cipher.is_none() {
        a.v.cipher = Some(ucrypt::plain::DEFAULT_CIPHER.to_string());
    }
    a.v.device_type = a.dev_type;
    a.v.shared = a.shared;
    if matches!(a.nbd, Some(ucrypt_nbd::server::Listen::Tcp { .. })) {
        return Err(CliError::Usage(
            "open --nbd takes unix:PATH; NBD over TCP (with TLS) is `ucrypt serve`".into(),
        ));
    }
    let front_end = a.front_end.resolve(run.root)?;
    if a.persistent {
        a.v.store_activation_flags()?;
    }
    // A local volume is known by its device and inode; a remote one by its name.
    let (volume, st_dev, st_ino) = match &a.v.volume {
        Target::Path(p) => {
            let volume = std::fs::canonicalize(p).map_err(|e| {
                io_err(
                    format!("Device {} does not exist or access denied", p.display()),
                    e,
                )
            })?;
            let meta = std::fs::metadata(&volume)
                .map_err(|e| io_err(format!("stat {}", volume.display()), e))?;
            (volume, meta.dev(), meta.ino())
        }
        remote => (PathBuf::from(remote.to_string()), 0, 0),
    };
    let header = match &a.v.header {
        Some(h) => Some(std::fs::canonicalize(h).map_err(|e| {
            io_err(
                format!("Device {} does not exist or access denied", h.display()),
                e,
            )
        })?),
        None => None,
    };
    let ident = Identity {
        name: name.clone(),
        volume: volume.clone(),
        st_dev,
        st_ino,
        header,
        stable_path: run.stable_path(&name),
        policy: a.v.policies(&[]).to_string(),
        pid: std::process::id(),
        started_unix_s: unix_now_s(),
        shared: a.shared,
        ..Identity::default()
    };
    // Name and volume checked before any prompt, as cryptsetup does: the volume also against
    // the other processes that serve it (`serve`, `mount`, `ublk`, and a daemon that `close
    // --deferred` left serving).
    let claim = state::claim(&run, &ident)?;
    if let Err(e) = a.v.check_servable() {
        claim.abandon();
        return Err(e);
    }
    if a.v.volume.is_remote() && !a.foreground {
        return open_remote_in_daemon(a, name, run, claim, ident, front_end);
    }
    let pbkdf_lock = match crate::compat::memory_hard_pbkdf_lock() {
        Ok(l) => l,
        Err(e) => {
            claim.abandon();
            return Err(e);
        }
    };
    let prepared = match a.v.prepare() {
        Ok(p) => p,
        Err(e) => {
            claim.abandon();
            return Err(e);
        }
    };
    drop(pbkdf_lock);
    let info = match describe(&prepared, &volume, a.v.read_only) {
        Ok(i) => i,
        Err(e) => {
            claim.abandon();
            return Err(e);
        }
    };
    // Marked before the fork: the daemon shares the lock's description and holds it for its
    // life (this process only closes its copy).
    let served = match a.v.mark_served() {
        Ok(m) => m,
        Err(e) => {
            claim.abandon();
            return Err(e);
        }
    };
    let log = claim.dir.join("daemon.log");
    let mut d = daemon_for(&a, name.clone(), run, claim, ident, info, front_end);
    d.served = Some(served);
    if a.foreground {
        serve::run(d, prepared, serve::Reporter::Foreground)?;
        return Ok(0);
    }
    match fork_daemon(&log)? {
        Forked::Child(pipe) => run_forked(d, prepared, serve::Reporter::Pipe(pipe)),
        Forked::Parent { child, ready } => {
            let dir = d.claim.dir.clone();
            // The daemon holds the claim now (the lock's description is shared): only close
            // our copies.
            drop(d);
            drop(prepared);
            wait_ready(&name, child, ready, &dir)
        }
    }
}

/// The daemon of `open` NAME, built from its options and what was checked or opened.
fn daemon_for(
    a: &OpenArgs,
    name: String,
    run: RunDir,
    claim: state::Claim,
    ident: Identity,
    info: VolumeInfo,
    front_end: FrontEnd,
) -> serve::Daemon {
    serve::Daemon {
        name,
        run,
        claim,
        ident,
        info,
        front_end,
        metrics: a.metrics.metrics.clone(),
        // Absolute: the daemon runs in /.
        nbd: a.nbd.clone().map(|l| match l {
            ucrypt_nbd::server::Listen::Unix(p) => {
                ucrypt_nbd::server::Listen::Unix(std::path::absolute(&p).unwrap_or(p))
            }
            tcp => tcp,
        }),
        // Absolute too.
        header: a
            .v
            .header
            .as_ref()
            .map(|h| std::path::absolute(h).unwrap_or(h.clone())),
        served: None,
        memory_budget: a.budget.memory_budget,
    }
}

/// The forked daemon: serves until closed, then exits with the code of how it ended.
fn run_forked(d: serve::Daemon, prepared: Prepared, reporter: serve::Reporter) -> ! {
    let name = d.name.clone();
    let code = match serve::run(d, prepared, reporter) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ucrypt daemon {name}: {e}");
            e.exit_code()
        }
    };
    std::process::exit(code)
}

/// `open` of a remote volume without `--foreground`. A remote backend starts its
/// connection's threads as soon as it connects, and the daemon must fork while only one thread
/// exists: so the passphrase (or key file) is read here, before any connection, and the daemon
/// connects, reads and checks the header, unlocks and serves. A failure there (not LUKS, a
/// wrong passphrase, an unreachable server) comes back through the readiness pipe with its
/// exit code, as a local volume's would.
fn open_remote_in_daemon(
    mut a: OpenArgs,
    name: String,
    run: RunDir,
    claim: state::Claim,
    ident: Identity,
    front_end: FrontEnd,
) -> CliResult<i32> {
    if a.v.cipher.is_none() && a.v.volume_key_file.is_none() && !a.v.token.only() {
        match a.v.read_passphrase() {
            Ok(p) => a.v.passphrase_read = Some(std::sync::Arc::new(p)),
            Err(e) => {
                claim.abandon();
                return Err(e);
            }
        }
    }
    let log = claim.dir.join("daemon.log");
    let volume = ident.volume.clone();
    match fork_daemon(&log)? {
        Forked::Child(pipe) => {
            let mut reporter = serve::Reporter::Pipe(pipe);
            let opened = crate::compat::memory_hard_pbkdf_lock()
                .and_then(|_lock| a.v.prepare())
                .and_then(|p| {
                    let info = describe(&p, &volume, a.v.read_only)?;
                    Ok((p, info))
                });
            match opened {
                Ok((prepared, info)) => run_forked(
                    daemon_for(&a, name, run, claim, ident, info, front_end),
                    prepared,
                    reporter,
                ),
                Err(e) => {
                    eprintln!("ucrypt daemon {name}: {e}");
                    reporter.failed(&e);
                    claim.abandon();
                    std::process::exit(e.exit_code());
                }
            }
        }
        Forked::Parent { child, ready } => {
            let dir = claim.dir.clone();
            // The daemon holds the claim now: only close our copies.
            drop(claim);
            drop(a);
            wait_ready(&name, child, ready, &dir)
        }
    }
}

enum Forked {
    Parent {
        child: libc::pid_t,
        ready: std::fs::File,
    },
    Child(std::fs::File),
}

/// Threads of this process, from /proc (1 when only the main thread exists).
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|rd| rd.count())
        .unwrap_or(0)
}

/// Forks the daemon: the child starts a session, puts /dev/null on stdin and stdout and
/// `log` on stderr (so that the `open` it came from, and whoever reads that one's output,
/// never wait on it), and moves to `/`. A pipe carries the one readiness line back.
fn fork_daemon(log: &Path) -> CliResult<Forked> {
    // After fork only the calling thread exists in the child: any lock another thread held
    // (the allocator's, stdout's) would stay held forever. No other thread may exist yet.
    let threads = thread_count();
    if threads != 1 {
        return Err(CliError::Core(ucrypt::Error::Bug(
            "ucrypt open: a thread exists before the fork",
        )));
    }
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array, which lives across the call.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io_err("pipe", std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just returned by pipe2 and are owned by nothing else.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(log)
        .map_err(|e| io_err(format!("opening {}", log.display()), e))?;
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| io_err("opening /dev/null", e))?;
    // SAFETY: the process has one thread (checked above), so the child inherits no lock held
    // by another thread and may run ordinary Rust code.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(io_err("fork", std::io::Error::last_os_error())),
        0 => {
            drop(rd);
            // SAFETY: setsid, dup2 and chdir take descriptors and a NUL-terminated literal
            // and touch no Rust-owned memory; their failures leave the daemon usable (with
            // the parent's terminal), so they are not fatal.
            unsafe {
                libc::setsid();
                libc::dup2(null.as_raw_fd(), 0);
                libc::dup2(null.as_raw_fd(), 1);
                libc::dup2(log_file.as_raw_fd(), 2);
                libc::chdir(c"/".as_ptr());
            }
            Ok(Forked::Child(std::fs::File::from(wr)))
        }
        child => {
            drop(wr);
            Ok(Forked::Parent {
                child,
                ready: std::fs::File::from(rd),
            })
        }
    }
}

/// Waits for the daemon's readiness line; prints it, or returns the daemon's error.
fn wait_ready(name: &str, child: libc::pid_t, ready: std::fs::File, dir: &Path) -> CliResult<i32> {
    use std::io::{BufRead, BufReader, Read};
    let mut line = Vec::new();
    let got = BufReader::new(ready.take(proto::RESPONSE_LINE_BYTES_MAX as u64))
        .read_until(b'\n', &mut line);
    let reap = || {
        let mut status = 0;
        // SAFETY: waitpid writes one int; `child` is our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        status
    };
    match got.ok().and_then(|_| proto::parse_response(&line).ok()) {
        Some(Response::Ready(r)) => {
            println!("{}", ready_line(name, &r));
            Ok(0)
        }
        Some(Response::Error { code, error }) => {
            reap();
            Err(CliError::Remote {
                code,
                message: error,
            })
        }
        _ => {
            let status = reap();
            // Whatever it left behind (a mount, a loop device) is cleaned as after a crash.
            let run = RunDir::locate()?;
            if dir.exists() {
                let _ = close_stale(&run, name, true);
            }
            Err(CliError::Usage(format!(
                "the daemon for {name} ended before the device was ready (wait status {status})"
            )))
        }
    }
}

/// `ucrypt close NAME`.
pub fn close(mut a: CloseArgs) -> CliResult<i32> {
    a.name = resolve_name(&a.name)?;
    let run = RunDir::locate()?;
    let dir = run.dir(&a.name);
    let not_active = || CliError::NotActive(format!("Device {} is not active.", a.name));
    if !dir.is_dir() {
        return Err(not_active());
    }
    if !state::is_alive(&dir) {
        return close_stale(&run, &a.name, a.force);
    }
    let pid = Identity::read(&dir).map_or(0, |i| i.pid);
    let sock = dir.join(state::CONTROL_SOCKET);
    let req = if a.cancel_deferred {
        Request::CancelDeferred
    } else if a.deferred {
        Request::CloseDeferred
    } else {
        Request::Close { force: a.force }
    };
    match server::request(&sock, &req) {
        Ok(Response::Closed(c)) => {
            if let Some(n) = c.note {
                eprintln!("{}: {n}", a.name);
                if a.deferred || a.cancel_deferred {
                    return Ok(0);
                }
            }
            // The name and the volume are free once the daemon has exited: its state
            // directory goes first, its hold on the volume (`crate::in_use`) with the process.
            // Bounded: it may still serve a device someone opened after the close looked.
            let t0 = Instant::now();
            while (state::is_alive(&dir) || process_lives(pid)) && t0.elapsed() < CLOSE_EXIT_WAIT {
                std::thread::sleep(CLOSE_EXIT_POLL);
            }
            Ok(0)
        }
        Ok(Response::Error { code, error }) => Err(CliError::Remote {
            code,
            message: error,
        }),
        Ok(_) => Err(CliError::Usage(
            "the daemon answered close with something else".into(),
        )),
        Err(server::ClientError::Connect { .. }) if !sock.exists() => Err(CliError::Busy(format!(
            "Device {} is busy (being opened).",
            a.name
        ))),
        Err(e) => Err(CliError::Usage(e.to_string())),
    }
}

/// Whether process `pid` still runs (a zombie has let go of everything: it does not). False
/// for 0.
fn process_lives(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "PID (COMM) STATE ...": COMM may hold spaces and parentheses, the state follows the
        // last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// Cleans what a dead daemon left: the loop device on its FUSE file, the FUSE mount, the
/// ublk device, the stable path and the state directory.
fn close_stale(run: &RunDir, name: &str, force: bool) -> CliResult<i32> {
    let dir = run.dir(name);
    let ident = Identity::read(&dir).unwrap_or_default();
    if !force {
        if let Some(dev) = &ident.device {
            if let Some(why) = mounts::in_use(dev, None) {
                return Err(CliError::Busy(format!(
                    "Cannot close {name}: {why} (umount it first, or close --force)."
                )));
            }
        }
    }
    // The FUSE file is at a fixed place: look there even if the daemon died before it wrote
    // down that it mounted it.
    let fuse_file = dir.join("volume");
    let mut loops = loopdev::devices_backed_by(&fuse_file);
    if let Some(l) = &ident.loop_device {
        if !loops.contains(l) {
            loops.push(l.clone());
        }
    }
    let mut problems = Vec::new();
    for l in &loops {
        if let Err(e) = loopdev::clear_if_backed_by(l, &fuse_file) {
            problems.push(format!("detaching {}: {e}", l.display()));
        }
    }
    if let Err(e) = mounts::lazy_unmount(&fuse_file) {
        problems.push(format!("unmounting {}: {e}", fuse_file.display()));
    }
    if let Some(id) = ident.ublk_id {
        if let Err(e) = ucrypt_ublk::delete_device(id) {
            problems.push(format!("deleting /dev/ublkb{id}: {e}"));
        }
    }
    let stable = run.stable_path(name);
    serve::remove_stable_path(&stable, ident.device.as_deref());
    std::fs::remove_dir_all(&dir).map_err(|e| io_err(format!("removing {}", dir.display()), e))?;
    let pid = if ident.pid != 0 {
        format!(" (pid {})", ident.pid)
    } else {
        String::new()
    };
    eprintln!("{name}: its daemon{pid} was dead; cleaned up.");
    if problems.is_empty() {
        Ok(0)
    } else {
        Err(CliError::Usage(problems.join("; ")))
    }
}

/// cryptsetup's `status` layout, then ucrypt's own lines. Pure: for tests.
pub fn status_text(path: &str, s: &StatusReport) -> String {
    let v = &s.volume;
    let mut o = format!(
        "{path} is active{}.\n",
        if s.suspended {
            " and is suspended"
        } else if s.in_use.is_some() {
            " and is in use"
        } else {
            ""
        }
    );
    o += &format!("  type:    {}\n", v.kind);
    o += &format!("  cipher:  {}\n", v.cipher);
    o += &format!("  keysize: {} bits\n", v.key_bits);
    o += "  key location: ucrypt daemon\n";
    if let Some(i) = &v.integrity {
        o += &format!("  integrity: {i}\n");
    }
    if v.integrity_key_bits != 0 {
        o += &format!("  integrity keysize: {} bits\n", v.integrity_key_bits);
    }
    o += &format!("  device:  {}\n", v.device);
    o += &format!("  sector size:  {}\n", v.sector_size);
    o += &format!("  offset:  {} sectors\n", v.offset_sectors);
    o += &format!("  size:    {} sectors\n", v.size_sectors);
    if v.skipped_sectors != 0 {
        o += &format!("  skipped: {} sectors\n", v.skipped_sectors);
    }
    o += &format!(
        "  mode:    {}\n",
        if v.read_only {
            "readonly"
        } else {
            "read/write"
        }
    );
    if !v.flags.is_empty() {
        o += &format!("  flags:   {}\n", v.flags.join(" "));
    }
    o += &format!("  front end: {}\n", s.front_end);
    o += &format!("  device path: {}\n", s.device);
    if let Some(n) = &s.note {
        o += &format!("  front end notes: {n}\n");
    }
    if let Some(u) = &s.in_use {
        o += &format!("  in use:  {u}\n");
    }
    if let Some(n) = &s.nbd_socket {
        o += &nbd_socket_line(n);
    }
    o += &format!("  policy:  {}\n", s.policy);
    let c = &s.counters;
    o += &format!(
        "  reads:   {} requests, {} bytes\n",
        c.read_requests, c.read_bytes
    );
    o += &format!(
        "  writes:  {} requests, {} bytes\n",
        c.write_requests, c.write_bytes
    );
    if let Some(m) = s.integrity_mismatches {
        o += &format!("  integrity mismatches: {m}\n");
    }
    if let Some(r) = &s.reencryption {
        let state = match (r.running, r.finished) {
            (true, _) => "running",
            (false, Some(true)) => "finished",
            (false, Some(false)) if r.stopped => "stopped",
            (false, Some(false)) => "failed",
            (false, None) => "interrupted",
        };
        o += &format!(
            "  reencryption: {} of {} bytes, {state}\n",
            r.done_bytes, r.total_bytes
        );
        // Why it stopped or failed, and what to do.
        if let (false, Some(false), Some(e)) = (r.running, r.finished, &r.error) {
            o += &format!("  {state}: {e}\n");
        }
        if r.reopen_needed {
            o += "  the sector size or data offset changed: close and open the volume to \
                  serve the new layout alone (until then suspend, resize and reencrypt are \
                  refused)\n";
        }
    }
    if let Some(b) = &s.memory_budget {
        o += &format!(
            "  budget:  {} bytes for all volumes, {} used by all, {} by this one; {} charges \
             refused (requests waited), {} forced past it\n",
            b.limit_bytes, b.used_bytes, b.charged_bytes, b.refused_charges, b.forced_charges
        );
    }
    if s.buffer_lock_failures != 0 {
        o += &format!(
            "  memory:  {} buffer chunks could not be locked (RLIMIT_MEMLOCK reached): \
             plaintext in them may be swapped out\n",
            s.buffer_lock_failures
        );
    }
    o += &format!("  pid:     {}\n", s.pid);
    o
}

/// The status line of a volume's NBD socket: who listens on it.
fn nbd_socket_line(n: &proto::NbdSocketReport) -> String {
    let part = match (n.role.as_str(), n.exports, n.owner_pid) {
        ("owner", Some(1), _) => "owner (1 export)".to_string(),
        ("owner", Some(e), _) => format!("owner ({e} exports)"),
        ("member", _, Some(pid)) => format!("member (owner pid {pid})"),
        ("taking over", ..) => "taking over (its owner left)".to_string(),
        ("detached", ..) => "detached (serving the connections made before)".to_string(),
        (role, ..) => role.to_string(),
    };
    format!("  nbd socket: {} shared, {part}\n", n.listen)
}

/// `ucrypt status NAME`: 0 active, 4 inactive (cryptsetup's), 1 when the daemon is dead.
/// `refresh NAME --policy P`: changes the running volume's settings, then prints its status.
pub fn refresh(mut a: RefreshArgs) -> CliResult<i32> {
    a.name = resolve_name(&a.name)?;
    let run = RunDir::locate()?;
    let dir = run.dir(&a.name);
    if !dir.is_dir() || !state::is_alive(&dir) {
        return Err(CliError::NotActive(format!(
            "Device {} is not active.",
            a.name
        )));
    }
    let path = run.stable_path(&a.name).display().to_string();
    let mut policy = a.policy;
    if a.perf_no_read_workqueue || a.perf_no_write_workqueue {
        // On top of --policy, or of the policy the volume runs now.
        let mut p = match policy {
            Some(p) => p,
            None => {
                let now = expect_status(&a.name, &dir, &Request::Status)?.policy;
                now.parse().map_err(|e: ucrypt::Error| {
                    CliError::Usage(format!("the daemon's policy {now:?}: {e}"))
                })?
            }
        };
        if a.perf_no_read_workqueue {
            p.read = ucrypt::engine::Policy::Inline;
        }
        if a.perf_no_write_workqueue {
            p.write = ucrypt::engine::Policy::Inline;
        }
        policy = Some(p);
    }
    let r = proto::RefreshSettings {
        policy,
        allow_discards: a.allow_discards,
        spin_us: a.spin_us,
    };
    if r == proto::RefreshSettings::default() {
        return Err(CliError::Usage(
            "refresh: give --policy, --perf-no_read_workqueue, --perf-no_write_workqueue, \
             --allow-discards or --spin-us"
                .into(),
        ));
    }
    print_status(&path, &a.name, &dir, &Request::Refresh(r))
}

/// The NAME a verb names by NAME or by its stable path (`/dev/ucrypt/NAME`,
/// `$XDG_RUNTIME_DIR/ucrypt/NAME/device`), as cryptsetup takes `/dev/mapper/NAME`; another
/// path is no open device (exit 4).
pub(crate) fn resolve_name(arg: &str) -> CliResult<String> {
    let run = RunDir::locate()?;
    let name = run
        .name_in(arg)
        .ok_or_else(|| CliError::NotActive(format!("Device {arg} is not active.")))?;
    state::check_name(&name)?;
    Ok(name)
}

/// The state directory of a live daemon, or cryptsetup's "not active" (exit 4).
fn live_dir(name: &str) -> CliResult<(RunDir, PathBuf)> {
    state::check_name(name)?;
    let run = RunDir::locate()?;
    let dir = run.dir(name);
    if !dir.is_dir() || !state::is_alive(&dir) {
        return Err(CliError::NotActive(format!("Device {name} is not active.")));
    }
    Ok((run, dir))
}

/// Sends `req` and expects a status back (printed only with `print`).
fn expect_status(name: &str, dir: &Path, req: &Request) -> CliResult<StatusReport> {
    expect_status_at(name, &dir.join(state::CONTROL_SOCKET), req)
}

/// [`expect_status`] over the control socket `sock`.
fn expect_status_at(name: &str, sock: &Path, req: &Request) -> CliResult<StatusReport> {
    match server::request(sock, req) {
        Ok(Response::Status(s)) => Ok(*s),
        Ok(Response::Error { code, error }) => Err(CliError::Remote {
            code,
            message: error,
        }),
        Ok(_) => Err(CliError::Usage(
            "the daemon answered with something else than a status".into(),
        )),
        Err(server::ClientError::Connect { .. }) => Err(not_answering(name, sock)),
        // The connection broke under the request: a daemon that died answers no more.
        Err(e) => {
            let t0 = Instant::now();
            loop {
                match not_answering(name, sock) {
                    CliError::Busy(_) if t0.elapsed() < DEATH_SETTLE => {
                        std::thread::sleep(CLOSE_EXIT_POLL)
                    }
                    CliError::Busy(_) => return Err(CliError::Usage(e.to_string())),
                    gone => return Err(gone),
                }
            }
        }
    }
}

/// How long a client whose connection broke looks whether the daemon died (its locks go as
/// the process ends, a moment after its socket).
const DEATH_SETTLE: Duration = Duration::from_secs(1);

/// Why nobody answers on the control socket `sock` of `name`. An `open` daemon's (in the
/// run directory): closed since (not active), dead (its NAME lock is free: gone, and what
/// to do), or opening or closing (busy). A `--control` socket of serve, mount or ublk: the
/// process is gone, or not listening yet.
fn not_answering(name: &str, sock: &Path) -> CliError {
    let dir = sock.parent().unwrap_or(Path::new("/"));
    let daemon = RunDir::locate().is_ok_and(|r| dir.parent() == Some(r.base.as_path()));
    if !daemon {
        return CliError::Gone(format!(
            "Nothing answers on {}: the serve, mount or ublk process that listened there with \
             --control is gone (or not listening yet).",
            sock.display()
        ));
    }
    if !dir.is_dir() {
        return CliError::NotActive(format!("Device {name} is not active."));
    }
    if state::is_alive(dir) {
        return CliError::Busy(format!("Device {name} is busy (being opened or closed)."));
    }
    let pid = Identity::read(dir).map_or(0, |i| i.pid);
    CliError::Gone(format!(
        "Device {name} has lost its daemon (pid {pid} is gone): its device no longer works. \
         'ucrypt close {name}' cleans up what it left; open the volume again to serve it (a \
         reencryption it ran resumes from where it stopped)."
    ))
}

/// `ucrypt suspend NAME` (`luksSuspend`).
pub fn suspend(mut a: SuspendArgs) -> CliResult<i32> {
    a.name = resolve_name(&a.name)?;
    let (_, dir) = live_dir(&a.name)?;
    expect_status(&a.name, &dir, &Request::Suspend)?;
    Ok(0)
}

/// `ucrypt resume NAME` (`luksResume`): the passphrase (or key file) is read here and sent to
/// the daemon, which unlocks a keyslot with it; a wrong one exits 2, still suspended.
pub fn resume(mut a: ResumeArgs) -> CliResult<i32> {
    a.name = resolve_name(&a.name)?;
    use crate::pass;
    ucrypt::secret::disable_core_dumps();
    let (_, dir) = live_dir(&a.name)?;
    if let Some(f) = &a.volume_key_file {
        let key = proto::ResumeKey::VolumeKeyFile(
            std::fs::canonicalize(f)
                .map_err(|e| io_err(format!("volume key file {}", f.display()), e))?,
        );
        let req = Request::Resume {
            key,
            key_slot: a.key_slot,
        };
        expect_status(&a.name, &dir, &req)?;
        return Ok(0);
    }
    // A wrong passphrase typed on a terminal is asked for again (`--tries`): the daemon
    // answers it with exit code 2 and stays suspended.
    let tries = pass::tries(a.tries, a.key.key_file.as_deref());
    pass::retry_wrong(
        tries,
        |e| matches!(e, CliError::Remote { code: 2, .. }),
        || {
            let p = pass::read_passphrase(
                &a.key.source(),
                &format!("Enter passphrase for {}: ", a.name),
                false,
            )?;
            if p.len() > proto::RESUME_KEY_BYTES_MAX {
                return Err(CliError::Usage(format!(
                    "resume takes a passphrase or key file of at most {} bytes",
                    proto::RESUME_KEY_BYTES_MAX
                )));
            }
            let req = Request::Resume {
                key: proto::ResumeKey::Passphrase(p),
                key_slot: a.key_slot,
            };
            expect_status(&a.name, &dir, &req)
        },
    )?;
    Ok(0)
}

/// `ucrypt resize NAME [--size SECTORS]`.
pub fn resize(mut a: ResizeArgs) -> CliResult<i32> {
    let req = Request::Resize {
        size_sectors: a.size.or(a.device_size_sectors),
    };
    let s = match &a.control {
        Some(sock) => {
            // The process must serve the volume named: a wrong socket resizes nothing.
            let holder = online::by_control(sock)?;
            if !holder.serves(Path::new(&a.name)) {
                return Err(CliError::Usage(format!(
                    "{} serves {}, not {}.",
                    holder.name,
                    holder.volume().unwrap_or_default().display(),
                    a.name
                )));
            }
            expect_status_at(&holder.name, sock, &req)?
        }
        None => {
            a.name = resolve_name(&a.name)?;
            let (_, dir) = live_dir(&a.name)?;
            expect_status(&a.name, &dir, &req)?
        }
    };
    eprintln!("{}: {} sectors", a.name, s.volume.size_sectors);
    let nbd = match &s.nbd_socket {
        _ if s.front_end == "nbd" => resize::NbdClients::OwnSocket,
        Some(n) if n.role == "member" => resize::NbdClients::SharedSocket,
        Some(_) => resize::NbdClients::OwnSocket,
        None => resize::NbdClients::None,
    };
    if let Some(note) = nbd.note() {
        eprintln!("{}: {note}", a.name);
    }
    Ok(0)
}

/// Sends `req` (status, or a change answered with the status) and prints the status.
fn print_status(path: &str, name: &str, dir: &Path, req: &Request) -> CliResult<i32> {
    let s = expect_status(name, dir, req)?;
    print!("{}", status_text(path, &s));
    Ok(0)
}

pub fn status(mut a: StatusArgs) -> CliResult<i32> {
    let run = RunDir::locate()?;
    // A path that is no NAME's stable path is inactive, as cryptsetup's status of a device
    // that is not a mapping says.
    match run.name_in(&a.name) {
        Some(n) => a.name = n,
        None => {
            println!("{} is inactive.", a.name);
            return Ok(4);
        }
    }
    state::check_name(&a.name)?;
    let dir = run.dir(&a.name);
    let path = run.stable_path(&a.name).display().to_string();
    if !dir.is_dir() {
        println!("{path} is inactive.");
        return Ok(4);
    }
    if !state::is_alive(&dir) {
        let ident = Identity::read(&dir).unwrap_or_default();
        println!("{path} is dead.");
        println!("  daemon:  pid {} is gone", ident.pid);
        if let Some(f) = &ident.front_end {
            println!("  front end: {f}");
        }
        if let Some(d) = &ident.device {
            println!("  device path: {}", d.display());
        }
        println!("  device:  {}", ident.volume.display());
        eprintln!(
            "Device {} has no daemon: 'ucrypt close {}' cleans up.",
            a.name, a.name
        );
        return Ok(1);
    }
    print_status(&path, &a.name, &dir, &Request::Status)
}

/// `ucrypt list`: one open volume a line: NAME, stable path, device, front end, state.
pub fn list() -> CliResult<i32> {
    let run = RunDir::locate()?;
    for name in run.names() {
        let dir = run.dir(&name);
        let ident = Identity::read(&dir).unwrap_or_default();
        let state = match (state::is_alive(&dir), &ident.device) {
            // Asked of the daemon: a suspended volume is still active, but its I/O waits.
            (true, Some(_)) => match expect_status(&name, &dir, &Request::Brief) {
                Ok(s) if s.suspended => "suspended",
                _ => "active",
            },
            (true, None) => "opening",
            (false, _) => "dead",
        };
        let dev = ident
            .device
            .as_deref()
            .map(|d| d.display().to_string())
            .unwrap_or_else(|| "-".into());
        println!(
            "{name} {} {dev} {} {state}",
            run.stable_path(&name).display(),
            ident.front_end.as_deref().unwrap_or("-"),
        );
    }
    Ok(0)
}

/// For commands outside the LUKS family: one line, cryptsetup's exit code.
pub fn report(r: CliResult<i32>) -> i32 {
    match r {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}", e.message());
            e.exit_code()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::Counters;

    #[test]
    fn status_layout() {
        let s = StatusReport {
            volume: VolumeInfo {
                kind: "LUKS2".into(),
                cipher: "aes-xts-plain64".into(),
                key_bits: 512,
                device: "/srv/vol.img".into(),
                sector_size: 4096,
                offset_sectors: 32768,
                size_sectors: 6144,
                skipped_sectors: 0,
                read_only: false,
                flags: vec!["discards".into()],
                integrity: None,
                integrity_key_bits: 0,
            },
            front_end: "fuse+loop".into(),
            device: "/dev/loop3".into(),
            stable_path: "/dev/ucrypt/data".into(),
            note: Some("loop: direct I/O".into()),
            policy: "auto".into(),
            in_use: None,
            counters: Counters {
                read_requests: 1,
                read_bytes: 4096,
                write_requests: 2,
                write_bytes: 8192,
            },
            pid: 7,
            started_unix_s: 0,
            suspended: false,
            integrity_mismatches: None,
            reencryption: None,
            header: None,
            buffer_lock_failures: 0,
            memory_budget: None,
            nbd_socket: None,
        };
        let want = "\
/dev/ucrypt/data is active.
  type:    LUKS2
  cipher:  aes-xts-plain64
  keysize: 512 bits
  key location: ucrypt daemon
  device:  /srv/vol.img
  sector size:  4096
  offset:  32768 sectors
  size:    6144 sectors
  mode:    read/write
  flags:   discards
  front end: fuse+loop
  device path: /dev/loop3
  front end notes: loop: direct I/O
  policy:  auto
  reads:   1 requests, 4096 bytes
  writes:  2 requests, 8192 bytes
  pid:     7
";
        assert_eq!(status_text("/dev/ucrypt/data", &s), want);
        // Buffers that could not be locked are said, before the pid.
        let unlocked = StatusReport {
            buffer_lock_failures: 2,
            ..s
        };
        let want = want.replace(
            "  pid:",
            "  memory:  2 buffer chunks could not be locked (RLIMIT_MEMLOCK reached): plaintext \
             in them may be swapped out\n  pid:",
        );
        assert_eq!(status_text("/dev/ucrypt/data", &unlocked), want);
        // An HMAC's key is part of the volume key; cryptsetup's status names its size.
        let mut hmac = unlocked.clone();
        hmac.buffer_lock_failures = 0;
        hmac.volume.key_bits = 768;
        hmac.volume.integrity = Some("hmac(sha256)".into());
        hmac.volume.integrity_key_bits = 256;
        let plain = StatusReport {
            buffer_lock_failures: 0,
            ..unlocked.clone()
        };
        let want = status_text("/dev/ucrypt/data", &plain).replace(
            "  keysize: 512 bits\n  key location: ucrypt daemon\n",
            "  keysize: 768 bits\n  key location: ucrypt daemon\n  integrity: hmac(sha256)\n  \
             integrity keysize: 256 bits\n",
        );
        assert_eq!(status_text("/dev/ucrypt/data", &hmac), want);
    }

    #[test]
    fn nbd_socket_line_says_who_listens() {
        let line = |role: &str, exports, owner_pid| {
            nbd_socket_line(&proto::NbdSocketReport {
                listen: "unix:/run/n.sock".into(),
                role: role.into(),
                exports,
                owner_pid,
            })
        };
        assert_eq!(
            line("owner", Some(3), None),
            "  nbd socket: unix:/run/n.sock shared, owner (3 exports)\n"
        );
        assert_eq!(
            line("owner", Some(1), None),
            "  nbd socket: unix:/run/n.sock shared, owner (1 export)\n"
        );
        assert_eq!(
            line("member", None, Some(42)),
            "  nbd socket: unix:/run/n.sock shared, member (owner pid 42)\n"
        );
        assert_eq!(
            line("taking over", None, None),
            "  nbd socket: unix:/run/n.sock shared, taking over (its owner left)\n"
        );
    }

    #[test]
    fn ready_line_names_everything() {
        let r = Ready {
            front_end: "fuse".into(),
            device: "/run/user/1/ucrypt/x/volume".into(),
            stable_path: "/run/user/1/ucrypt/x/device".into(),
            note: None,
        };
        assert_eq!(
            ready_line("x", &r),
            "x: /run/user/1/ucrypt/x/device -> /run/user/1/ucrypt/x/volume (fuse)"
        );
    }
}
