//! The daemon's life: build the volume, start the front end, name the device, answer the
//! control socket, and on `close` (or SIGTERM) flush, detach and remove every trace.
//!
//! Runs in the forked child of `ucrypt open` (or in `open --foreground` itself), after the
//! passphrase was read: this is where the first threads are made.
//!
//! The main thread runs the main loop (`main_loop.rs`), which decides when the daemon ends;
//! each control connection is served on a thread of its own that ends with it (a `resume`
//! derives a key for seconds, a client may take its time to send its line: the main loop never
//! waits for one). So an idle daemon has the main thread and its front end's: with `--nbd` the
//! main loop serves the NBD side too.

use ucrypt_nbd::server::Listen;

use crate::metrics::{SharedNbdSocket, Volumes};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use ucrypt::luks::reencrypt::run::RunOptions;
use ucrypt::luks::{self, Unlock};
use ucrypt::sync::lock;
use ucrypt::{BlockDev, Stop};
use ucrypt_fuse::{
    ActiveTransport, MountOptions, Mounted, PunchHole, SizeNotifier, Transport, Unmount,
};

use super::loopdev::{self, LoopDevice};
use super::main_loop::{self, wake_pair, Beside, Event, Exit, NbdSide, WakeOnEnd};
use super::proto::{
    Closed, Counters, NbdSocketReport, Ready, ReencryptionReport, RefreshSettings, Request,
    Response, ResumeKey, StatusReport, VolumeInfo,
};
use super::resize::{self, NbdClients, Notice};
use super::state::{Claim, Identity, RunDir};
use super::{mounts, server, FrontEnd};
use crate::error::{CliError, CliResult};
use crate::open::{HeaderAt, Opened, Prepared};
use crate::volume_key;

/// How long the ublk device may take to appear once the volume is open.
const UBLK_READY_WAIT: Duration = Duration::from_secs(30);

/// Requests waiting for the main loop, at most: one close at a time is all that makes sense;
/// a second one is told the daemon is already closing.
const EVENTS_MAX: usize = 1;

/// How the daemon tells the `open` that started it how things went.
pub enum Reporter {
    /// The forked child: one line through the pipe to the waiting parent.
    Pipe(std::fs::File),
    /// `--foreground`: the ready line on stdout; failures are returned as errors.
    Foreground,
}

impl Reporter {
    fn ready(&mut self, name: &str, r: &Ready) {
        match self {
            Reporter::Pipe(f) => {
                use std::io::Write;
                let _ = f.write_all(&super::proto::encode_response(&Response::Ready(r.clone())));
            }
            Reporter::Foreground => {
                use std::io::Write;
                println!("{}", super::ready_line(name, r));
                let _ = std::io::stdout().flush();
                // Under systemd (the ucrypt@ unit is Type=notify): the device is there.
                ucrypt_nbd::server::sd_notify_ready();
            }
        }
    }

    pub(super) fn failed(&mut self, e: &CliError) {
        if let Reporter::Pipe(f) = self {
            use std::io::Write;
            let _ = f.write_all(&super::proto::encode_response(&Response::Error {
                code: e.exit_code(),
                error: e.message(),
            }));
        }
    }
}

/// What the daemon serves, and how it was opened.
pub struct Daemon {
    /// The mark that says this process serves the volume (`crate::in_use`), held for its
    /// life; none for a remote volume. The first field, so dropped first: before the claim,
    /// whose release `close` waits for, so that a verb run after `close` never sees the mark.
    pub served: Option<crate::in_use::InUse>,
    pub name: String,
    pub run: RunDir,
    pub claim: Claim,
    pub ident: Identity,
    /// Everything but the size, known from the header before the volume is built.
    pub info: VolumeInfo,
    pub front_end: FrontEnd,
    /// Where to answer Prometheus scrapes, if anywhere.
    pub metrics: Option<Listen>,
    /// Also serve the volume to NBD clients on this unix socket.
    pub nbd: Option<Listen>,
    /// The detached header (`--header`), written by an online reencryption.
    pub header: Option<PathBuf>,
    /// `--memory-budget`: the bytes all budgeted volumes of this user may grow their buffers
    /// to beyond their reserves, accounted in [`super::budget::MEMORY_BUDGET_FILE`] of the state
    /// directory.
    pub memory_budget: Option<u64>,
}

/// The NBD socket as `status` reports it: where, and this export's part there (read live: a
/// member takes the socket over when its owner leaves).
fn nbd_socket_report(n: &SharedNbdSocket) -> NbdSocketReport {
    use ucrypt_nbd::server::share::Standing;
    let (role, exports, owner_pid) = match n.state.standing() {
        Standing::Owner { exports } => ("owner", Some(exports as u64), None),
        Standing::Member { owner_pid } => ("member", None, Some(owner_pid)),
        Standing::TakingOver => ("taking over", None, None),
        Standing::Detached => ("detached", None, None),
    };
    NbdSocketReport {
        listen: n.listen.clone(),
        role: role.into(),
        exports,
        owner_pid,
    }
}

/// Turns transparent huge pages off for the daemon. Where the kernel makes them for every
/// mapping (`transparent_hugepage=always`, Debian's default since trixie), khugepaged fills
/// each 2 MiB range that has one page in use into a whole huge page: the mostly untouched
/// heaps of the front end's threads (the ublk queues' 512 KiB bounce buffers) become resident
/// seconds after the open, and an idle daemon costs megabytes more than its pages in use
/// (BENCHMARKS.md, "Idle volumes", the ublk rows). Best effort: an old kernel without the
/// option leaves huge pages as they were.
fn no_huge_pages() {
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and changes no memory.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

/// A running front end.
enum Front {
    Ublk {
        thread: JoinHandle<Result<(), ucrypt_ublk::Error>>,
        stop: Stop,
    },
    Fuse {
        mounted: Mounted,
        loopdev: Option<LoopDevice>,
    },
    Vhost {
        thread: JoinHandle<Result<(), ucrypt_vhost::Error>>,
        stop: Stop,
    },
}

impl Front {
    fn ended(&self) -> bool {
        match self {
            Front::Ublk { thread, .. } => thread.is_finished(),
            Front::Vhost { thread, .. } => thread.is_finished(),
            Front::Fuse { mounted, .. } => mounted.finished(),
        }
    }
}

/// What the control connections share with the main loop.
struct Shared {
    name: String,
    vol: Opened,
    /// Changes with resize (size) and refresh (flags).
    info: Mutex<VolumeInfo>,
    /// LUKS: the device the header is on, read again (under cryptsetup's shared lock) to
    /// unlock on resume. None for a plain volume, which cannot be suspended (a wrong key
    /// could not be told on resume).
    header_dev: Option<HeaderAt>,
    /// Resize: tells the FUSE file's users the new size (None for ublk and vhost-user).
    size_notifier: Option<SizeNotifier>,
    /// vhost-user: whether a VMM is connected (then the volume is in use).
    vhost: Option<ucrypt_vhost::Handle>,
    ident: Identity,
    note: Option<String>,
    events: SyncSender<Event>,
    /// Wakes the main loop after an event is sent (non-blocking: a full socket is awake
    /// already).
    wake: UnixStream,
    /// A deferred close is pending: the main loop closes once nothing uses the device.
    deferred: Arc<AtomicBool>,
    /// The online key rotation this daemon runs or ran (`reencrypt`), shared with its thread.
    rotation: Arc<Mutex<Option<ReencryptionReport>>>,
    /// The detached header (`--header`), written by an online reencryption.
    header: Option<PathBuf>,
    /// Held by a `resume` from its key derivation to its end: attempts run one at a time, so
    /// that concurrent ones never need their KDFs' memory (Argon2's, up to 4 GiB each) at
    /// once. The waiters are bounded by the control connections (`server::CONNECTIONS_MAX`).
    resuming: Mutex<()>,
    /// Set (under `resuming`) by `close --force` of the suspended volume: no resume after it.
    aborted: AtomicBool,
    /// `open --nbd`: set once the export is attached to its socket (the metrics read the same).
    nbd_socket: Arc<OnceLock<SharedNbdSocket>>,
}

impl Shared {
    fn device(&self) -> PathBuf {
        self.ident.device.clone().unwrap_or_default()
    }

    /// The status report of this volume now.
    fn status(&self) -> Response {
        self.report(self.in_use())
    }

    /// [`Request::Brief`].
    fn status_without_in_use(&self) -> Response {
        self.report(None)
    }

    fn report(&self, in_use: Option<String>) -> Response {
        let stats = self.vol.stats();
        let (r, w) = (stats.read, stats.write);
        let mut volume = lock(&self.info).clone();
        // An online reencryption that changed the cipher: the volume serves with the new one
        // once it ends.
        if let Some(v) = self.vol.engine() {
            let (spec, key_bytes) = v.cipher();
            if volume.cipher.parse::<ucrypt::sector::CipherSpec>().ok() != Some(spec) {
                volume.cipher = spec.to_string();
            }
            volume.key_bits = key_bytes as u32 * 8;
            // One that changed the sector size or the data offset: served with the new ones
            // until the volume is closed.
            if v.reopen_needed() {
                let (sector, offset) = v.serving_layout();
                volume.sector_size = sector.bytes();
                volume.offset_sectors = offset / 512;
            }
        }
        Response::Status(Box::new(StatusReport {
            volume,
            front_end: self.ident.front_end.clone().unwrap_or_default(),
            device: self.device().display().to_string(),
            stable_path: self.ident.stable_path.display().to_string(),
            note: self.note.clone(),
            policy: self.vol.policy().to_string(),
            in_use,
            counters: Counters {
                read_requests: r.requests,
                read_bytes: r.bytes,
                write_requests: w.requests,
                write_bytes: w.bytes,
            },
            pid: std::process::id(),
            started_unix_s: self.ident.started_unix_s,
            suspended: self.vol.is_suspended(),
            integrity_mismatches: self.vol.integrity_mismatches(),
            reencryption: self.reencryption(),
            header: self.header.as_ref().map(|h| h.display().to_string()),
            buffer_lock_failures: self.vol.buffer_lock_failures(),
            memory_budget: super::budget::report(),
            nbd_socket: self.nbd_socket.get().map(nbd_socket_report),
        }))
    }

    /// The rotation's report: the one this daemon runs or ran, else the volume's own state (a
    /// volume opened in reencryption, not rotating now).
    fn reencryption(&self) -> Option<ReencryptionReport> {
        let vol = self.vol.engine()?;
        if let Some(mut r) = lock(&self.rotation).clone() {
            r.reopen_needed = vol.reopen_needed();
            return Some(r);
        }
        vol.reencrypted_bytes().map(|done| ReencryptionReport {
            done_bytes: done,
            total_bytes: vol.size(),
            ..Default::default()
        })
    }

    /// `reencrypt`: rotates the key while the front end serves (`online::start_rotation`); the
    /// verb follows it through `status`.
    fn reencrypt(&self, key: ResumeKey, opts: RunOptions) -> Response {
        let Some(vol) = self.vol.engine() else {
            return Response::error(
                1,
                format!(
                    "{} has authenticated encryption: ucrypt reencrypts it offline only",
                    self.name
                ),
            );
        };
        let header = self.header.as_deref();
        let at = (vol, self.ident.volume.as_path());
        let resume = format!("ucrypt reencrypt --resume-only --active-name {}", self.name);
        let rotation = &self.rotation;
        match super::online::start_rotation(&self.name, at, rotation, key, opts, header, resume) {
            Ok(()) => self.status(),
            Err(e) => e,
        }
    }

    fn rotating(&self) -> bool {
        lock(&self.rotation).as_ref().is_some_and(|r| r.running)
    }

    fn refresh(&self, r: RefreshSettings) -> Response {
        let Some(vol) = self.vol.engine() else {
            if r.spin_us.is_some() || r.allow_discards.is_some() {
                return Response::error(
                    1,
                    format!(
                        "refresh: {} has authenticated encryption (integrity): it passes no \
                         discards and its workers spin as the engine's default; only --policy \
                         changes",
                        self.name
                    ),
                );
            }
            if let Some(p) = r.policy {
                self.vol.set_policy(p);
            }
            return self.status();
        };
        if let Some(us) = r.spin_us {
            if let Err(e) = vol.set_spin(Duration::from_micros(us)) {
                return Response::failed(e);
            }
        }
        if let Some(p) = r.policy {
            vol.set_policy(p);
        }
        if let Some(on) = r.allow_discards {
            vol.set_allow_discards(on);
            let mut info = lock(&self.info);
            info.flags.retain(|f| f != "discards");
            if on {
                info.flags.push("discards".into());
            }
        }
        self.status()
    }

    fn suspend(&self) -> Response {
        if self.header_dev.is_none() {
            return Response::error(
                1,
                format!(
                    "Device {} is a plain volume: suspend needs a LUKS header to check the key on resume.",
                    self.name
                ),
            );
        }
        if self.vol.is_suspended() {
            return Response::error(5, format!("Device {} is already suspended.", self.name));
        }
        match self.vol.suspend() {
            Ok(()) => self.status(),
            Err(e) => Response::failed(e),
        }
    }

    /// `resume`: one attempt at a time (see `resuming`); a failed one is logged (why, never
    /// the key) to the daemon's log.
    fn resume(&self, key: ResumeKey, key_slot: Option<u32>) -> Response {
        let r = self.try_resume(key, key_slot);
        if let Response::Error { code, error } = &r {
            eprintln!(
                "ucrypt daemon {}: resume refused (exit {code}): {error}",
                self.name
            );
        }
        r
    }

    fn try_resume(&self, key: ResumeKey, key_slot: Option<u32>) -> Response {
        let Some(dev) = &self.header_dev else {
            return Response::error(1, format!("Device {} is not suspended.", self.name));
        };
        if !self.vol.is_suspended() {
            return Response::error(1, format!("Device {} is not suspended.", self.name));
        }
        let key_given = matches!(key, ResumeKey::VolumeKeyFile(_));
        let unlock = match key {
            ResumeKey::Passphrase(p) => Unlock::Passphrase(p),
            // As many bytes as the header's key has: the header is read first (under
            // cryptsetup's lock), the file after it without the lock, as its read may wait
            // (bounded) for a FIFO's writer.
            ResumeKey::VolumeKeyFile(f) => {
                let bytes = dev.read(|dev| {
                    luks::read_header(dev).and_then(|h| volume_key::key_bytes_for(&h, None))
                });
                let key = match bytes {
                    Ok(Ok(n)) => volume_key::read(&f, n),
                    Ok(Err(e)) => Err(e),
                    Err(e) => return Response::failed(e),
                };
                match key {
                    Ok(k) => Unlock::VolumeKey(k),
                    Err(e) => return Response::failed(e),
                }
            }
        };
        // One attempt at a time, from here (the key derivation) to the end; whether the volume
        // is still suspended is asked again under it (an attempt before may have resumed it).
        let _one = lock(&self.resuming);
        if self.aborted.load(Ordering::Relaxed) {
            return Response::error(5, format!("Device {} is being closed.", self.name));
        }
        if !self.vol.is_suspended() {
            return Response::error(1, format!("Device {} is not suspended.", self.name));
        }
        // The header is read again: a keyslot may have changed since the volume was opened.
        let vk = dev.read(|dev| {
            luks::read_header(dev).and_then(|hdr| {
                luks::unlock_key(dev, &hdr, unlock, key_slot).map(|(_, vk)| (hdr, vk))
            })
        });
        let vk = match vk {
            Ok(vk) => vk,
            Err(e) => return Response::failed(e),
        };
        match vk {
            Ok((hdr, vk)) => match self.vol.resume(&hdr, &vk) {
                Ok(()) => self.status(),
                Err(e) => Response::failed(e),
            },
            Err(e) if key_given => Response::failed(volume_key::mismatch(e)),
            Err(e) => Response::failed(e),
        }
    }

    fn resize(&self, size_sectors: Option<u64>) -> Response {
        let front = match (&self.size_notifier, &self.vhost) {
            (Some(n), _) => Notice::Fuse {
                file: Some(n),
                loop_device: self.ident.loop_device.as_deref(),
            },
            (None, Some(h)) => Notice::Vhost(h),
            (None, None) => Notice::Ublk,
        };
        let nbd = match self.nbd_socket.get().map(|s| s.state.standing()) {
            None => NbdClients::None,
            Some(ucrypt_nbd::server::share::Standing::Member { .. }) => NbdClients::SharedSocket,
            Some(_) => NbdClients::OwnSocket,
        };
        let log = format!("ucrypt daemon {}", self.name);
        let named = (self.name.as_str(), log.as_str());
        match resize::resize(named, &self.vol, size_sectors, front, nbd) {
            Ok(new) => {
                lock(&self.info).size_sectors = new / 512;
                self.status()
            }
            Err(answer) => answer,
        }
    }

    /// Why the device cannot be closed now, if it cannot: mounted, held by another device, or
    /// open in a process (the device, or the FUSE file behind a loop device).
    fn in_use(&self) -> Option<String> {
        let device = self.device();
        if self.vhost.as_ref().is_some_and(|h| h.connected()) {
            return Some(format!("a VMM is connected to {}", device.display()));
        }
        mounts::in_use(&device, self.ident.loop_device.as_deref()).or_else(|| {
            let mut held = vec![device.as_path()];
            if let Some(f) = self.ident.fuse_file.as_deref().filter(|f| *f != device) {
                held.push(f);
            }
            mounts::opener(&held)
        })
    }

    /// [`Self::in_use`], looked at again for up to [`HELD_SETTLE`] while it says yes: a
    /// program that probes a new device (udev's blkid) holds it for a moment, and libdevmapper
    /// retries a busy remove for the same reason.
    fn in_use_settled(&self) -> Option<String> {
        let t0 = std::time::Instant::now();
        loop {
            let why = self.in_use()?;
            if t0.elapsed() >= HELD_SETTLE {
                return Some(why);
            }
            std::thread::sleep(HELD_POLL);
        }
    }
}

/// How long `close` waits for a device in use to be let go before it calls it busy.
const HELD_SETTLE: Duration = Duration::from_secs(2);
const HELD_POLL: Duration = Duration::from_millis(100);

impl server::Handler for Shared {
    fn handle(&self, req: Request, respond: &mut dyn FnMut(&Response)) {
        match req {
            Request::Status => respond(&self.status()),
            Request::Brief => respond(&self.status_without_in_use()),
            Request::Refresh(r) => respond(&self.refresh(r)),
            Request::Suspend => respond(&self.suspend()),
            Request::Resume { key, key_slot } => respond(&self.resume(key, key_slot)),
            Request::Resize { size_sectors } => respond(&self.resize(size_sectors)),
            Request::Reencrypt {
                key,
                hotzone_bytes,
                resilience,
            } => respond(&self.reencrypt(
                key,
                RunOptions {
                    hotzone_bytes,
                    resilience,
                    device_size: None,
                },
            )),
            Request::Close { force: false } | Request::CloseDeferred if self.rotating() => {
                respond(&Response::error(
                    5,
                    format!(
                        "Device {} is being reencrypted: wait for it to finish (or close \
                         --force: the rotation resumes after the next open).",
                        self.name
                    ),
                ))
            }
            Request::Close { force: false } | Request::CloseDeferred if self.vol.is_suspended() => {
                // Closing flushes, and a flush waits at the closed gate like any request.
                respond(&Response::error(
                    5,
                    format!(
                        "Device {} is suspended: resume it first (or close --force: the \
                         requests it holds fail).",
                        self.name
                    ),
                ))
            }
            Request::Close { force: true } if self.vol.is_suspended() => {
                // The held requests (and the flush of the teardown) fail with EIO instead of
                // waiting for a resume that will not come. Not beside a resume deriving its
                // key: before it or after it.
                let one = lock(&self.resuming);
                if self.vol.is_suspended() {
                    if let Err(e) = self.vol.abort_suspended() {
                        return respond(&Response::failed(e));
                    }
                    self.aborted.store(true, Ordering::Relaxed);
                    eprintln!(
                        "ucrypt daemon {}: closed by force while suspended: the requests held \
                         fail with EIO",
                        self.name
                    );
                }
                drop(one);
                self.close(true, respond)
            }
            Request::CloseDeferred if self.in_use().is_some() => {
                self.deferred.store(true, Ordering::Relaxed);
                // The main loop looks for the last user's going from now on.
                let _ = (&self.wake).write(&[1]);
                respond(&Response::Closed(Closed {
                    note: Some("deferred: the device closes when its last user goes".into()),
                }))
            }
            Request::CloseDeferred => self.handle(Request::Close { force: false }, respond),
            Request::CancelDeferred => {
                let was = self.deferred.swap(false, Ordering::Relaxed);
                respond(&Response::Closed(Closed {
                    note: Some(
                        if was {
                            "deferred close cancelled"
                        } else {
                            "no deferred close was pending"
                        }
                        .into(),
                    ),
                }))
            }
            Request::Close { force } => self.close(force, respond),
        }
    }
}

impl Shared {
    /// `close` (`--force`): refused while the device is in use, unless forced; else the main
    /// loop tears the device down and answers.
    fn close(&self, force: bool, respond: &mut dyn FnMut(&Response)) {
        // A device still in use is busy, as dm's remove says (exit 5): closing it
        // anyway when its last user goes is `close --deferred`.
        if !force {
            if let Some(why) = self.in_use_settled() {
                return respond(&Response::Error {
                    code: 5,
                    error: format!(
                        "Cannot close {}: {why} (stop using it first, or close \
                         --deferred or --force).",
                        self.name
                    ),
                });
            }
        }
        let (reply, reply_rx) = sync_channel(1);
        let (written_tx, written) = sync_channel::<()>(1);
        if self
            .events
            .try_send(Event::Close {
                force,
                reply,
                written,
            })
            .is_err()
        {
            return respond(&Response::Error {
                code: 5,
                error: format!("Device {} is already being closed.", self.name),
            });
        }
        let _ = (&self.wake).write(&[1]);
        let resp = reply_rx.recv().unwrap_or(Response::Error {
            code: 1,
            error: "the daemon ended without answering".into(),
        });
        respond(&resp);
        drop(written_tx);
    }
}

/// The daemon: returns its exit code (0 after a clean close). Failures before the device is
/// ready go to the reporter and remove the claim.
pub fn run(d: Daemon, prepared: Prepared, mut reporter: Reporter) -> CliResult<()> {
    let claim_dir = d.claim.dir.clone();
    match start(d, prepared, &mut reporter) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&claim_dir);
            reporter.failed(&e);
            Err(e)
        }
    }
}

fn start(mut d: Daemon, prepared: Prepared, reporter: &mut Reporter) -> CliResult<()> {
    // Before any thread is made: SIGINT/SIGTERM are blocked in all, and read by the main loop.
    // A signal during the open stops in order too (the main loop sees it first thing): the
    // daemon's claim is undone on the way out.
    let signals = crate::signals::SignalFd::new()?;
    no_huge_pages();
    let header_dev = prepared.header_device();
    // In the daemon, before the volume's pools are made: the slot is this process's.
    super::budget::join(d.memory_budget, &d.run)?;
    let opened = prepared.open()?;
    if let Some(w) = memlock_warning() {
        // The daemon's stderr is its log.
        eprintln!("{}: {w}", d.name);
    }
    // cryptsetup's lock was held from the header's read to the unlock: released now, so that
    // keyslot verbs work on the open volume; the resume takes it again to read.
    if let Some(h) = &header_dev {
        h.release()?;
    }
    let vol = opened.dev();
    d.info.size_sectors = vol.size() / 512;
    // Its socket (if any) is removed when this goes, at the end of the daemon.
    let volumes = Volumes::new(vec![(d.name.clone(), opened.clone())]);
    // The NBD side starts after the front end: its socket reaches the metrics through this.
    let nbd_socket = volumes.nbd_socket_slot();
    let _metrics = match &d.metrics {
        Some(at) => Some(crate::metrics::start(at, volumes)?),
        None => None,
    };
    let dev: Arc<dyn BlockDev> = vol.clone();
    let wake_err = |e| io_err("making the main loop's wake-up socket", e);
    let (wake_tx, wake_rx) = wake_pair().map_err(wake_err)?;
    let front_wake = WakeOnEnd(wake_tx.try_clone().map_err(wake_err)?);
    // The volume's next request after the heap's trim wakes the main loop.
    let trip_wake = wake_tx.try_clone().map_err(wake_err)?;
    opened.activity().on_trip(Box::new(move || {
        // Non-blocking: a full socket is awake already.
        let _ = (&trip_wake).write(&[1]);
    }));
    let (front, device, notes) = match d.front_end {
        FrontEnd::Ublk => start_ublk(dev, front_wake)?,
        FrontEnd::Loop | FrontEnd::Fuse => start_fuse(&d, dev)?,
        FrontEnd::VhostUser => start_vhost(&d, &opened, dev, front_wake)?,
        FrontEnd::Auto => return Err(CliError::Usage("front end not chosen".into())),
    };
    let ident = served_identity(&d, &front, &device);
    // Recorded before the name is made, so that a crash from here on is cleaned by `close`.
    let named = ident
        .write(&d.claim.dir)
        .and_then(|()| make_stable_path(&d.run, &ident.stable_path, &device))
        .and_then(|()| server::bind(&d.claim.dir.join(super::state::CONTROL_SOCKET)));
    let (listener, _control_socket) = match named {
        Ok(l) => l,
        Err(e) => {
            let _ = teardown(front, &vol, true, &ident, &d.claim.dir);
            return Err(e);
        }
    };
    let (events_tx, events) = sync_channel(EVENTS_MAX);
    let deferred = Arc::new(AtomicBool::new(false));
    let size_notifier = match &front {
        Front::Fuse { mounted, .. } => Some(mounted.size_notifier()),
        Front::Ublk { .. } | Front::Vhost { .. } => None,
    };
    let shared = Arc::new(Shared {
        name: d.name.clone(),
        vol: opened,
        info: Mutex::new(d.info.clone()),
        header_dev,
        size_notifier,
        vhost: notes.vhost,
        ident: ident.clone(),
        note: notes.status,
        events: events_tx,
        wake: wake_tx,
        deferred: deferred.clone(),
        rotation: Arc::new(Mutex::new(None)),
        header: d.header.clone(),
        resuming: Mutex::new(()),
        aborted: AtomicBool::new(false),
        nbd_socket,
    });
    let control = match server::Acceptor::new(listener, shared.clone()) {
        Ok(c) => c,
        Err(e) => {
            let _ = teardown(front, &vol, true, &ident, &d.claim.dir);
            return Err(e);
        }
    };
    let nbd = match &d.nbd {
        Some(at) => match NbdSide::start(&d.name, &vol, at) {
            Ok((n, socket)) => {
                let _ = shared.nbd_socket.set(socket);
                Some(n)
            }
            Err(e) => {
                let _ = teardown(front, &vol, true, &ident, &d.claim.dir);
                return Err(e);
            }
        },
        None => None,
    };
    let note = ready_note(&d, notes.ready);
    reporter.ready(
        &d.name,
        &Ready {
            front_end: d.front_end.label().into(),
            device: device.display().to_string(),
            stable_path: ident.stable_path.display().to_string(),
            note,
        },
    );
    let in_use = {
        let s = shared.clone();
        move || s.in_use().is_some()
    };
    let requests = {
        let s = shared.clone();
        move || {
            let st = s.vol.stats();
            st.read.requests + st.write.requests
        }
    };
    let fuse_fd = match &front {
        Front::Fuse { mounted, .. } => mounted.connection_fd().as_raw_fd(),
        Front::Ublk { .. } | Front::Vhost { .. } => -1,
    };
    let exit = main_loop::run(
        Beside {
            signals: &signals,
            events: &events,
            name: &ident.name,
            fuse_fd,
            deferred: &deferred,
            in_use: &in_use,
            nbd,
            control,
            wake: wake_rx,
            requests: &requests,
            activity: shared.vol.activity(),
        },
        &|| front.ended(),
    );
    end(exit, front, &vol, &ident, &d.claim.dir);
    Ok(())
}

/// Ends the daemon as the main loop decided: tears the volume's device down, and answers a
/// `close` once it is down.
fn end(exit: Exit, front: Front, vol: &Arc<dyn BlockDev>, ident: &Identity, dir: &Path) {
    match exit {
        Exit::Close {
            force,
            reply,
            written,
        } => {
            let (resp, rest) = teardown(front, vol, force, ident, dir);
            let _ = reply.send(resp);
            // Wait (bounded) until the answer is on its way before anything exits.
            let _ = written.recv_timeout(server::REQUEST_TIMEOUT);
            finish(rest);
        }
        Exit::Deferred | Exit::Signal => {
            let (_, rest) = teardown(front, vol, false, ident, dir);
            finish(rest);
        }
        Exit::FrontEnded => {
            let _ = teardown(front, vol, true, ident, dir);
        }
        Exit::Orphaned => {}
    }
}

/// The daemon's identity once its front end serves `device`.
fn served_identity(d: &Daemon, front: &Front, device: &Path) -> Identity {
    let mut ident = d.ident.clone();
    ident.front_end = Some(d.front_end.label().into());
    ident.device = Some(device.to_path_buf());
    ident.pid = std::process::id();
    match front {
        Front::Ublk { .. } => {
            ident.ublk_id = device
                .to_str()
                .and_then(|s| s.strip_prefix("/dev/ublkb"))
                .and_then(|n| n.parse().ok());
        }
        Front::Fuse { mounted, loopdev } => {
            ident.fuse_file = Some(mounted.file.clone());
            ident.loop_device = loopdev.as_ref().map(|l| l.path.clone());
        }
        Front::Vhost { .. } => {}
    }
    ident
}

/// What `open` prints about the served volume: the front end's note, and the NBD URI.
fn ready_note(d: &Daemon, front_note: Option<String>) -> Option<String> {
    match (&d.nbd, front_note) {
        (Some(Listen::Unix(p)), n) => Some(format!(
            "{}NBD: nbd+unix:///{}?socket={}",
            n.map(|n| format!("{n}; ")).unwrap_or_default(),
            d.name,
            p.display()
        )),
        (_, n) => n,
    }
}

/// Why the volume's buffers may not all be locked in this process, if they may not: a
/// RLIMIT_MEMLOCK below the bounce-buffer pool's bound, without CAP_IPC_LOCK (which lifts the
/// limit). `status` counts the chunks that then failed to lock.
fn memlock_warning() -> Option<String> {
    const CAP_IPC_LOCK: u32 = 14;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
        || lim.rlim_cur >= ucrypt::pool::POOL_BYTES_DEFAULT as u64
    {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())?;
    if cap_eff >> CAP_IPC_LOCK & 1 == 1 {
        return None;
    }
    Some(format!(
        "RLIMIT_MEMLOCK is {} KiB, below the {} KiB the bounce buffers may use: buffers past \
         the limit are not locked, and plaintext in them may be swapped out (`status` counts \
         them; raise the limit, e.g. LimitMEMLOCK= in a systemd unit)",
        lim.rlim_cur / 1024,
        ucrypt::pool::POOL_BYTES_DEFAULT / 1024
    ))
}

/// Serves a detached FUSE file until its last user closes it.
fn finish(rest: Option<Mounted>) {
    if let Some(m) = rest {
        if let Err(e) = m.join() {
            eprintln!("ucrypt daemon: {e}");
        }
    }
}

fn io_err(what: impl Into<String>, e: std::io::Error) -> CliError {
    CliError::Core(ucrypt::Error::io(what, e))
}

/// What is worth saying about how a front end runs. `status`'s notes get all of it; the line
/// `open` prints (and `tab start` once per volume) leaves out why FUSE-over-io_uring is not
/// used: a hint about the kernel, not about the volume, said once, in `status`.
struct FrontNotes {
    status: Option<String>,
    ready: Option<String>,
    /// vhost-user: the served device's handle.
    vhost: Option<ucrypt_vhost::Handle>,
}

fn start_ublk(dev: Arc<dyn BlockDev>, wake: WakeOnEnd) -> CliResult<(Front, PathBuf, FrontNotes)> {
    let stop = Stop::new();
    let s2 = stop.clone();
    let (tx, rx) = sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("ucrypt-ublk".into())
        .spawn(move || {
            let _wake = wake;
            ucrypt_ublk::serve(dev, ucrypt_ublk::UblkOptions::default(), &s2, move |r| {
                let _ = tx.send(r);
            })
        })
        .map_err(|e| io_err("starting the ublk thread", e))?;
    match rx.recv_timeout(UBLK_READY_WAIT) {
        Ok(r) => Ok((
            Front::Ublk { thread, stop },
            r.path,
            FrontNotes {
                status: None,
                ready: None,
                vhost: None,
            },
        )),
        Err(_) => {
            stop.request();
            match thread.join() {
                Ok(Err(e)) => Err(e.into()),
                _ => Err(CliError::Usage(format!(
                    "the ublk device did not become ready within {} s",
                    UBLK_READY_WAIT.as_secs()
                ))),
            }
        }
    }
}

fn start_fuse(d: &Daemon, dev: Arc<dyn BlockDev>) -> CliResult<(Front, PathBuf, FrontNotes)> {
    let file = d.claim.dir.join("volume");
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&file)
        .map_err(|e| io_err(format!("creating {}", file.display()), e))?;
    let opts = MountOptions {
        file_name: None,
        threads: 0,
        allow_other: false,
        direct_io: false,
        punch_hole: PunchHole::Zeroes,
        fs_name: format!("ucrypt:{}", d.name),
        transport: Transport::Auto,
    };
    let (bs, ro) = (dev.block_size(), dev.read_only());
    let mounted = ucrypt_fuse::spawn(dev, &file, &opts)?;
    let fuse_note = format!("FUSE {}", mounted.transport);
    let fuse_brief = match &mounted.transport {
        ActiveTransport::Classic { threads, .. } => ActiveTransport::Classic {
            threads: *threads,
            io_uring_unused: None,
        },
        t => t.clone(),
    };
    let fuse_brief = format!("FUSE {fuse_brief}");
    if d.front_end != FrontEnd::Loop {
        let path = mounted.file.clone();
        return Ok((
            Front::Fuse {
                mounted,
                loopdev: None,
            },
            path,
            FrontNotes {
                status: Some(fuse_note),
                ready: Some(fuse_brief),
                vhost: None,
            },
        ));
    }
    match loopdev::attach(&file, bs, ro) {
        Ok(l) => {
            let io = match &l.note {
                Some(n) => format!("loop: {n}"),
                None => "loop: direct I/O".into(),
            };
            let path = l.path.clone();
            Ok((
                Front::Fuse {
                    mounted,
                    loopdev: Some(l),
                },
                path,
                FrontNotes {
                    status: Some(format!("{io}; {fuse_note}")),
                    ready: Some(format!("{io}; {fuse_brief}")),
                    vhost: None,
                },
            ))
        }
        Err(e) => {
            let _ = mounted.unmount();
            Err(io_err(
                format!("attaching {} to a loop device", file.display()),
                e,
            ))
        }
    }
}

/// Serves the volume over vhost-user-blk at `vhost.sock` in the state directory, on a thread
/// of its own; returns once the socket listens.
fn start_vhost(
    d: &Daemon,
    opened: &Opened,
    dev: Arc<dyn BlockDev>,
    wake: WakeOnEnd,
) -> CliResult<(Front, PathBuf, FrontNotes)> {
    let socket = d.claim.dir.join(super::state::VHOST_SOCKET);
    let opts = ucrypt_vhost::VhostOptions {
        // Discards are offered where the volume passes them on (allow-discards), as dm-crypt
        // does.
        discard: opened.engine().is_some_and(|v| v.allow_discards()),
        id: ucrypt_vhost::id_of(&d.name),
        ..Default::default()
    };
    let handle = opts.handle.clone();
    let stop = Stop::new();
    let s2 = stop.clone();
    let (tx, rx) = sync_channel(1);
    let at = socket.clone();
    let thread = std::thread::Builder::new()
        .name("ucrypt-vhost".into())
        .spawn(move || {
            let _wake = wake;
            ucrypt_vhost::serve(dev, &at, opts, &s2, move |_| {
                let _ = tx.send(());
            })
        })
        .map_err(|e| io_err("starting the vhost-user thread", e))?;
    match rx.recv_timeout(UBLK_READY_WAIT) {
        Ok(()) => Ok((
            Front::Vhost { thread, stop },
            socket,
            FrontNotes {
                status: Some("vhost-user-blk".into()),
                ready: None,
                vhost: Some(handle),
            },
        )),
        Err(_) => {
            stop.request();
            match thread.join() {
                Ok(Err(e)) => Err(e.into()),
                _ => Err(CliError::Usage(format!(
                    "the vhost-user socket did not listen within {} s",
                    UBLK_READY_WAIT.as_secs()
                ))),
            }
        }
    }
}

/// Points the stable path at the device (root: /dev/ucrypt/NAME, made 0755).
fn make_stable_path(run: &RunDir, stable: &Path, device: &Path) -> CliResult<()> {
    if run.root {
        if let Some(parent) = stable.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| io_err(format!("creating {}", parent.display()), e))?;
        }
    }
    // A symlink left by a crashed daemon of this NAME (its state dir was removed by hand).
    if std::fs::symlink_metadata(stable).is_ok_and(|m| m.file_type().is_symlink()) {
        let _ = std::fs::remove_file(stable);
    }
    std::os::unix::fs::symlink(device, stable)
        .map_err(|e| io_err(format!("creating {}", stable.display()), e))
}

/// Removes the stable path if it is a symlink to `device` (nothing else is ours to remove).
pub fn remove_stable_path(stable: &Path, device: Option<&Path>) {
    let ours = match std::fs::read_link(stable) {
        Ok(target) => device.is_none_or(|d| target == d),
        Err(_) => false,
    };
    if ours {
        let _ = std::fs::remove_file(stable);
    }
}

/// How long a lazily unmounted FUSE session gets to end by itself before it counts as still
/// in use.
const DETACH_SETTLE: Duration = Duration::from_secs(2);

fn settled(m: &Mounted) -> bool {
    let t0 = std::time::Instant::now();
    while !m.finished() {
        if t0.elapsed() >= DETACH_SETTLE {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Flushes, detaches the front end and removes the names. Returns the answer to `close`,
/// and a FUSE session to keep serving when something still uses the file (not with force).
fn teardown(
    front: Front,
    vol: &Arc<dyn BlockDev>,
    force: bool,
    ident: &Identity,
    dir: &Path,
) -> (Response, Option<Mounted>) {
    let mut notes: Vec<String> = Vec::new();
    if let Err(e) = vol.flush() {
        notes.push(format!("flush failed: {e}"));
    }
    let mut rest = None;
    match front {
        Front::Ublk { thread, stop } => {
            // Killing the device makes its queues return; run() then flushes and deletes it.
            stop.request();
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => notes.push(e.to_string()),
                Err(_) => notes.push("the ublk thread panicked".into()),
            }
        }
        Front::Vhost { thread, stop } => {
            // Ends the VMM's connection; serve() then flushes and removes the socket.
            stop.request();
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => notes.push(e.to_string()),
                Err(_) => notes.push("the vhost-user thread panicked".into()),
            }
        }
        Front::Fuse { mounted, loopdev } => {
            if let Some(l) = loopdev {
                let path = l.path.clone();
                // With --force nobody waits for users to let go: they will get errors.
                let wait = if force {
                    Duration::ZERO
                } else {
                    loopdev::RELEASE_WAIT
                };
                match l.detach(wait) {
                    Ok(true) => {}
                    Ok(false) => notes.push(format!(
                        "{} is still open: the kernel detaches it when its last user closes it",
                        path.display()
                    )),
                    Err(e) => notes.push(format!("detaching {}: {e}", path.display())),
                }
            }
            let unmounted = match mounted.request_unmount() {
                // A user's unmount (fusermount3 -u -z) is always lazy: the session may still
                // end at once if nothing holds the file.
                Ok(Unmount::Detached) if settled(&mounted) => Ok(Unmount::Done),
                r => r,
            };
            match unmounted {
                Ok(Unmount::Done) => {
                    if let Err(e) = mounted.join() {
                        notes.push(e.to_string());
                    }
                }
                Ok(Unmount::Detached) if force => {
                    notes.push("the device was still in use: it now fails every request".into());
                    // Exiting closes /dev/fuse: the kernel aborts the session.
                    std::mem::forget(mounted);
                }
                // A user that opened the device after `close` found it unused: it keeps being
                // served (the volume's in-use lock held) until it lets go.
                Ok(Unmount::Detached) => {
                    notes.push(
                        "still in use: detached, served until its last user closes it".into(),
                    );
                    rest = Some(mounted);
                }
                Err(e) => notes.push(format!("unmounting the FUSE file: {e}")),
            }
        }
    }
    remove_stable_path(&ident.stable_path, ident.device.as_deref());
    let _ = std::fs::remove_dir_all(dir);
    let note = (!notes.is_empty()).then(|| notes.join("; "));
    if let Some(n) = &note {
        eprintln!("ucrypt daemon {}: {n}", ident.name);
    }
    (Response::Closed(Closed { note }), rest)
}
