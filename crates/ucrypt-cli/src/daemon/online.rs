//! `ucrypt reencrypt` on a volume a live daemon serves: the verb starts the rotation in the
//! header itself (init), then hands the hotzones to the daemon over its control socket (the
//! passphrase as `resume` sends it) and follows the progress through `status` until the
//! daemon reports the end. The daemon is an `ucrypt open` daemon (found by the volume's file
//! or `--active-name`), or a `serve`, `mount` or `ublk` process with `--control PATH` (named
//! by `reencrypt --control PATH`); [`start_rotation`] is their side of it.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ucrypt::luks;
use ucrypt::luks::reencrypt::run::RunOptions;
use ucrypt::sync::lock;
use ucrypt::volume::Volume;
use ucrypt::{BlockDev, SecretBytes};

use super::proto::{self, ReencryptionReport, Request, Response, ResumeKey};
use super::state::{self, Identity, RunDir};
use super::worker::{self, Ended};
use super::{expect_status_at, live_dir};
use crate::error::{CliError, CliResult};

/// How often the verb asks the daemon how far the rotation got.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// The online rotation a process runs or ran on its volume, shared with the thread that runs
/// it (`status` reports it).
pub type Rotation = Arc<Mutex<Option<ReencryptionReport>>>;

fn refused(code: i32, error: impl Into<String>) -> Response {
    Response::Error {
        code,
        error: error.into(),
    }
}

/// `reencrypt` on a control socket (the `ucrypt open` daemon's, or `--control` of `serve`,
/// `mount` and `ublk`): starts rotating the key of `vol`, whose header the verb already put in
/// reencryption, on a thread of its own (`ucrypt-reencrypt`; for a local volume that thread
/// has the hotzones run in a worker process, `worker`) while the front end serves, and
/// returns; `rotation` follows it. A rotation that stops before its end (its worker killed,
/// its loop failed) has its hotzone recovered here and is reported stopped, with `resume`,
/// the command that resumes it. The refusal to answer otherwise (one already running, the
/// volume suspended, no passphrase).
pub fn start_rotation(
    name: &str,
    (vol, volume): (&Arc<Volume>, &Path),
    rotation: &Rotation,
    key: ResumeKey,
    opts: RunOptions,
    header: Option<&Path>,
    resume: String,
) -> Result<(), Response> {
    let ResumeKey::Passphrase(pass) = key else {
        return Err(refused(
            1,
            "reencrypt needs the passphrase (both keys come from keyslots)",
        ));
    };
    if vol.is_suspended() {
        return Err(refused(
            5,
            format!("Device {name} is suspended: resume it first."),
        ));
    }
    {
        let mut r = lock(rotation);
        if r.as_ref().is_some_and(|r| r.running) {
            return Err(refused(
                5,
                format!("Device {name} is already being reencrypted."),
            ));
        }
        *r = Some(ReencryptionReport {
            done_bytes: vol.reencrypted_bytes().unwrap_or(0),
            total_bytes: vol.size(),
            running: true,
            ..Default::default()
        });
    }
    // A detached header: a writable handle of the rotation's own. The header in front is
    // written through the volume's backend. Either way cryptsetup's lock is held shared on
    // the header's file for the whole rotation (on a handle of its own): another writer (a
    // keyslot verb, an offline reencrypt) waits for the end, readers (`luksDump`, `status`)
    // do not, as beside cryptsetup's own reencryption. A remote volume has none.
    let lock_at = header.unwrap_or(volume).to_path_buf();
    let header_path = header;
    let header = match header {
        None => None,
        Some(p) => {
            match ucrypt::backend::FileBackend::open(p, true, ucrypt::backend::DirectMode::Never) {
                Ok(h) => Some(h),
                Err(e) => {
                    *lock(rotation) = None;
                    let e = CliError::from(e);
                    return Err(refused(e.exit_code(), format!("{}: {e}", p.display())));
                }
            }
        }
    };
    // A local volume's hotzones run in a worker process of their own session (`worker`); a
    // remote one's (`rbd:`, `nbd:`) on a thread here, through this process's connection.
    let local = std::fs::metadata(volume)
        .is_ok_and(|m| m.is_file() || m.file_type().is_block_device())
        .then(|| (volume.to_path_buf(), header_path.map(Path::to_path_buf)));
    let (vol, report) = (vol.clone(), rotation.clone());
    let spawned = std::thread::Builder::new()
        .name("ucrypt-reencrypt".into())
        .spawn(move || {
            let _ends = EndsReport(report.clone());
            let header = header.as_ref().map(|h| h as &dyn ucrypt::backend::Backend);
            let locked = if lock_at.exists() {
                crate::header_dev::open_header_file(&lock_at, false).map(Some)
            } else {
                Ok(None)
            };
            let mut progress = |p: luks::reencrypt::run::Progress| {
                if let Some(rep) = lock(&report).as_mut() {
                    rep.done_bytes = p.done;
                    rep.total_bytes = p.total;
                }
            };
            let outcome = match locked {
                Err(e) => Outcome::failed(worker::reported(e)),
                Ok(locked) => {
                    let r = match &local {
                        Some((data, hdr)) => {
                            let at = (data.as_path(), hdr.as_deref());
                            worker::serve_worker(&vol, at, pass.as_ref(), opts, &mut progress)
                        }
                        None => luks::reencrypt::online::rotate(
                            &vol,
                            header,
                            pass.as_ref(),
                            opts,
                            &mut progress,
                        )
                        .map_err(|e| {
                            let (code, message) = worker::reported(e);
                            Ended::Failed(code, message)
                        }),
                    };
                    // Still under cryptsetup's lock: the hotzone a stopped rotation left is
                    // recovered before another writer may touch the header.
                    let outcome = match r {
                        Ok(()) => Outcome::FINISHED,
                        Err(end) => after_stop(&vol, header, pass.as_ref(), end, &resume),
                    };
                    drop(locked);
                    outcome
                }
            };
            drop(pass);
            if let Some(rep) = lock(&report).as_mut() {
                outcome.report(rep, &vol);
            }
        });
    if let Err(e) = spawned {
        *lock(rotation) = None;
        let e = CliError::Usage(format!("starting the reencryption: {e}"));
        return Err(refused(e.exit_code(), e.to_string()));
    }
    Ok(())
}

/// How a rotation ended, as `status` reports it.
struct Outcome {
    finished: bool,
    /// Ended before its end with the volume and its header consistent: `--resume-only`
    /// continues it online.
    stopped: bool,
    /// The exit code and message the verb reports.
    error: Option<(i32, String)>,
}

impl Outcome {
    const FINISHED: Outcome = Outcome {
        finished: true,
        stopped: false,
        error: None,
    };

    fn failed(error: (i32, String)) -> Self {
        Outcome {
            finished: false,
            stopped: false,
            error: Some(error),
        }
    }

    fn report(self, rep: &mut ReencryptionReport, vol: &Volume) {
        rep.running = false;
        rep.finished = Some(self.finished);
        rep.stopped = self.stopped;
        if self.finished {
            rep.done_bytes = rep.total_bytes;
        } else if self.stopped {
            // The bytes the header says done, after the recovery.
            if let Some(done) = vol.reencrypted_bytes() {
                rep.done_bytes = done;
            }
        }
        if let Some((code, message)) = self.error {
            rep.code = Some(code);
            rep.error = Some(message);
        }
    }
}

/// After a rotation of `vol` that ended before its end (`end`): the hotzone its driver held,
/// or the one the header records, is recovered while the volume serves on
/// ([`luks::reencrypt::online::recover_stopped`], the recovery `repair` and `open` run), and
/// the outcome says what is true and what to do (`resume`: the command that resumes it).
fn after_stop(
    vol: &Volume,
    header: Option<&dyn ucrypt::backend::Backend>,
    pass: &[u8],
    end: Ended,
    resume: &str,
) -> Outcome {
    use luks::reencrypt::online::Stopped;
    let (code, cause, died) = match end {
        Ended::Died(how) => (1, format!("the rotation worker died ({how})"), true),
        Ended::Failed(code, message) => (code, message, false),
    };
    let stopped = |what: String| Outcome {
        finished: false,
        stopped: true,
        error: Some((code, format!("{cause}{what}; resume with `{resume}`"))),
    };
    match luks::reencrypt::online::recover_stopped(vol, header, pass) {
        // Nothing held: a worker that died between hotzones stopped the rotation there; a
        // failure that held nothing (a refusal before the first hotzone) is reported as it is.
        Ok(Stopped::Consistent) if died => stopped(String::new()),
        Ok(Stopped::Consistent) => Outcome::failed((code, cause)),
        Ok(Stopped::Released {
            offset,
            len,
            recovered,
            ..
        }) => stopped(format!(
            "; its hotzone (bytes {offset}..{}) was {}",
            offset + len,
            if recovered {
                "recovered from the reencryption's resilience data"
            } else {
                "released as the header has it (its rewrite not yet begun, or already \
                 committed)"
            }
        )),
        Ok(Stopped::Finished) => Outcome::FINISHED,
        Ok(Stopped::Unrecoverable { offset, len }) => Outcome::failed((
            code,
            format!(
                "{cause} inside its hotzone (bytes {offset}..{}), and the reencryption has no \
                 resilience data (resilience none): the old data of the hotzone is nowhere and \
                 which of its sectors were rewritten is not known, so it is not recovered \
                 online and reads of it fail. Close the volume and open it again: the open \
                 takes the hotzone as rewritten, as cryptsetup's repair does (its data may be \
                 lost); then resume with `{resume}`",
                offset + len
            ),
        )),
        Err(e) => Outcome::failed((
            code,
            format!(
                "{cause}; recovering its hotzone failed: {}; close the volume and open it \
                 again, which recovers it, then resume with `{resume}`",
                CliError::from(e).message()
            ),
        )),
    }
}

/// Ends the report of a rotation whose thread unwinds (a ucrypt bug): `status` then says it
/// failed, and the verb following it returns instead of waiting for ever.
struct EndsReport(Rotation);

impl Drop for EndsReport {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        if let Some(rep) = lock(&self.0).as_mut().filter(|r| r.running) {
            rep.running = false;
            rep.finished = Some(false);
            rep.code = Some(1);
            rep.error = Some(
                "the reencryption stopped on an internal error (a ucrypt bug; the daemon's log \
                 says where): close the volume and open it again, then resume it"
                    .into(),
            );
        }
    }
}

/// A live daemon serving a volume: an `ucrypt open` daemon, or a `serve`, `mount` or `ublk`
/// process with a control socket (`--control`).
pub struct Holder {
    pub name: String,
    /// Its control socket.
    sock: PathBuf,
    ident: Option<Identity>,
    /// The volume a `--control` process serves, as its status names it.
    volume: Option<PathBuf>,
    /// The detached header a `--control` process was started with, as its status names it.
    header: Option<PathBuf>,
}

/// The live daemon serving the local volume at `path` (by device and inode, whatever path
/// named it), if any.
pub fn holder_of(path: &Path) -> Option<Holder> {
    let md = std::fs::metadata(path).ok()?;
    let run = RunDir::locate().ok()?;
    run.names().into_iter().find_map(|name| {
        let dir = run.dir(&name);
        let ident = Identity::read(&dir)?;
        let serves = ident.st_ino != 0
            && ident.st_dev == md.dev()
            && ident.st_ino == md.ino()
            && state::is_alive(&dir);
        serves.then_some(Holder {
            name,
            sock: dir.join(state::CONTROL_SOCKET),
            ident: Some(ident),
            volume: None,
            header: None,
        })
    })
}

/// The live daemon named `name` (cryptsetup's `--active-name`): "not active" (exit 4) if none.
pub fn by_name(name: &str) -> CliResult<Holder> {
    let name = &super::resolve_name(name)?;
    let (_, dir) = live_dir(name)?;
    let ident = Identity::read(&dir);
    Ok(Holder {
        name: name.to_string(),
        sock: dir.join(state::CONTROL_SOCKET),
        ident,
        volume: None,
        header: None,
    })
}

/// The `serve`, `mount` or `ublk` process answering on the control socket `sock`
/// (`--control`); it says which volume it serves.
pub fn by_control(sock: &Path) -> CliResult<Holder> {
    let name = sock.display().to_string();
    let s = expect_status_at(&name, sock, &Request::Status)?;
    Ok(Holder {
        name,
        sock: sock.to_path_buf(),
        ident: None,
        volume: Some(PathBuf::from(s.volume.device)),
        header: s.header.map(PathBuf::from),
    })
}

impl Holder {
    /// True if this daemon serves the local volume at `path`.
    pub fn serves(&self, path: &Path) -> bool {
        let Ok(md) = std::fs::metadata(path) else {
            return false;
        };
        if let Some(v) = &self.volume {
            return std::fs::metadata(v).is_ok_and(|m| m.dev() == md.dev() && m.ino() == md.ino());
        }
        self.ident
            .as_ref()
            .is_some_and(|i| i.st_ino != 0 && i.st_dev == md.dev() && i.st_ino == md.ino())
    }

    /// The detached header the daemon serves the volume with, if any.
    pub fn header(&self) -> Option<PathBuf> {
        self.header
            .clone()
            .or_else(|| self.ident.as_ref().and_then(|i| i.header.clone()))
    }

    /// Whether `given` (`--header`, or none) names the daemon's own header: the same file,
    /// or none for a daemon whose header is in front of the data.
    pub fn same_header(&self, given: Option<&Path>) -> bool {
        match (self.header(), given) {
            (None, None) => true,
            (Some(a), Some(b)) => match (std::fs::metadata(&a), std::fs::metadata(b)) {
                (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether the daemon's volume changed its sector size or data offset online and must be
    /// closed and opened again before another reencryption (see
    /// `ReencryptionReport::reopen_needed`), and whether a reencryption runs in it now.
    pub fn reopen_needed_or_running(&self) -> CliResult<(bool, bool)> {
        let s = expect_status_at(&self.name, &self.sock, &Request::Status)?;
        let r = s.reencryption.as_ref();
        Ok((
            r.is_some_and(|r| r.reopen_needed),
            r.is_some_and(|r| r.running),
        ))
    }

    /// The volume the daemon serves, as it named it.
    pub fn volume(&self) -> Option<PathBuf> {
        self.volume
            .clone()
            .or_else(|| self.ident.as_ref().map(|i| i.volume.clone()))
    }

    /// Has the daemon rotate the key (the header already in reencryption) and waits for the
    /// end; `progress` gets (bytes done, bytes in all) as the daemon reports them.
    pub fn rotate(
        &self,
        passphrase: SecretBytes,
        opts: RunOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> CliResult<i32> {
        if passphrase.len() > proto::RESUME_KEY_BYTES_MAX {
            return Err(CliError::Usage(format!(
                "online reencryption takes a passphrase or key file of at most {} bytes",
                proto::RESUME_KEY_BYTES_MAX
            )));
        }
        let req = Request::Reencrypt {
            key: ResumeKey::Passphrase(passphrase),
            hotzone_bytes: opts.hotzone_bytes,
            resilience: opts.resilience,
        };
        expect_status_at(&self.name, &self.sock, &req)?;
        loop {
            let s = expect_status_at(&self.name, &self.sock, &Request::Status)?;
            let Some(r) = s.reencryption else {
                return Err(CliError::Usage(format!(
                    "the daemon of {} lost track of the reencryption",
                    self.name
                )));
            };
            progress(r.done_bytes, r.total_bytes);
            match r.finished {
                Some(true) => return Ok(0),
                Some(false) => {
                    return Err(CliError::Remote {
                        code: r.code.unwrap_or(1),
                        message: r.error.unwrap_or_else(|| "reencryption failed".into()),
                    })
                }
                None => std::thread::sleep(POLL_INTERVAL),
            }
        }
    }
}
