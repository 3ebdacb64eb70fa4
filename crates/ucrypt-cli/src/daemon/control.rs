//! `--control PATH` of `serve`, `mount`, `ublk` and `vhost`: the `ucrypt open` daemon's control
//! protocol (`proto.rs`, served by `server.rs`) on a socket the caller names, answering
//! `status`, `reencrypt` and `resize` for the volume the process serves, so that `ucrypt
//! reencrypt VOLUME --control PATH` rotates its key online and `ucrypt resize VOLUME --control
//! PATH` resizes it as they do through an `ucrypt open` daemon (the resize is the daemon's own,
//! `resize.rs`). The other requests (close, suspend, resume, refresh) belong to the open
//! daemon's life cycle and are refused by name: these processes stop on SIGINT or SIGTERM.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use clap::Args;
use ucrypt::luks::reencrypt::run::RunOptions;
use ucrypt::BlockDev;
use ucrypt_fuse::SizeNotifier;

use super::online::{start_rotation, Rotation};
use super::proto::{Counters, Request, Response, StatusReport, VolumeInfo};
use super::resize::{self, NbdClients, Notice};
use super::server;
use crate::error::CliResult;
use crate::open::{Opened, VolumeArgs};

#[derive(Args, Clone, Debug, Default)]
pub struct ControlArgs {
    /// Answer `status`, `reencrypt` and `resize` on this unix socket (mode 0600; the open
    /// daemon's protocol), so that `ucrypt reencrypt VOLUME --control PATH` rotates the key
    /// online and `ucrypt resize VOLUME --control PATH` resizes the volume.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
}

/// The front end the process serves the volume through, as a resize tells it of the new size.
pub enum Serving {
    /// `ucrypt serve`: NBD clients are not told.
    Nbd,
    /// `ucrypt mount`: the FUSE file's notifier, set once it is mounted.
    Fuse(Arc<OnceLock<SizeNotifier>>),
    /// `ucrypt ublk`: not resized.
    Ublk,
    /// `ucrypt vhost`: the VMM is sent a config-change notice.
    Vhost(ucrypt_vhost::Handle),
}

impl Serving {
    /// The front end's name in `status`.
    fn name(&self) -> &'static str {
        match self {
            Serving::Nbd => "nbd",
            Serving::Fuse(_) => "fuse",
            Serving::Ublk => "ublk",
            Serving::Vhost(_) => "vhost",
        }
    }

    fn front(&self) -> Notice<'_> {
        match self {
            Serving::Nbd => Notice::Nbd,
            Serving::Fuse(file) => Notice::Fuse {
                file: file.get(),
                loop_device: None,
            },
            Serving::Ublk => Notice::Ublk,
            Serving::Vhost(handle) => Notice::Vhost(handle),
        }
    }
}

/// What the control socket answers for.
struct Control {
    name: String,
    vol: Opened,
    volume: String,
    read_only: bool,
    serving: Serving,
    sock: PathBuf,
    started_unix_s: u64,
    rotation: Rotation,
    /// The detached header (`--header`), written by an online reencryption.
    header: Option<PathBuf>,
}

impl Control {
    fn status(&self) -> Response {
        let stats = self.vol.stats();
        let (r, w) = (stats.read, stats.write);
        let size = self.vol.dev().size();
        let reencryption = self.vol.engine().and_then(|v| {
            let ran = lock_clone(&self.rotation).map(|mut r| {
                r.reopen_needed = v.reopen_needed();
                r
            });
            ran.or_else(|| {
                v.reencrypted_bytes()
                    .map(|done| super::proto::ReencryptionReport {
                        done_bytes: done,
                        total_bytes: v.size(),
                        ..Default::default()
                    })
            })
        });
        // The cipher served (an online reencryption may have changed it).
        let (cipher, key_bits) = self.vol.engine().map_or((String::new(), 0), |v| {
            let (spec, key_bytes) = v.cipher();
            (spec.to_string(), key_bytes as u32 * 8)
        });
        Response::Status(Box::new(StatusReport {
            // The header's fields are `ucrypt dump`'s; this status says what is served.
            volume: VolumeInfo {
                kind: String::new(),
                cipher,
                key_bits,
                device: self.volume.clone(),
                sector_size: 512,
                offset_sectors: 0,
                size_sectors: size / 512,
                skipped_sectors: 0,
                read_only: self.read_only,
                flags: Vec::new(),
                integrity: None,
                integrity_key_bits: 0,
            },
            front_end: self.serving.name().into(),
            device: self.sock.display().to_string(),
            stable_path: String::new(),
            note: None,
            policy: self.vol.policy().to_string(),
            in_use: None,
            counters: Counters {
                read_requests: r.requests,
                read_bytes: r.bytes,
                write_requests: w.requests,
                write_bytes: w.bytes,
            },
            pid: std::process::id(),
            started_unix_s: self.started_unix_s,
            suspended: false,
            integrity_mismatches: self.vol.integrity_mismatches(),
            reencryption,
            header: self.header.as_ref().map(|h| h.display().to_string()),
            buffer_lock_failures: self.vol.buffer_lock_failures(),
            nbd_socket: None,
            memory_budget: super::budget::report(),
        }))
    }
}

fn lock_clone<T: Clone>(m: &Mutex<T>) -> T {
    ucrypt::sync::lock(m).clone()
}

impl server::Handler for Control {
    fn handle(&self, req: Request, respond: &mut dyn FnMut(&Response)) {
        match req {
            Request::Status | Request::Brief => respond(&self.status()),
            Request::Reencrypt {
                key,
                hotzone_bytes,
                resilience,
            } => {
                let Some(vol) = self.vol.engine() else {
                    return respond(&Response::Error {
                        code: 1,
                        error: format!(
                            "{} has authenticated encryption: ucrypt reencrypts it offline only",
                            self.name
                        ),
                    });
                };
                let header = self.header.as_deref();
                let opts = RunOptions {
                    hotzone_bytes,
                    resilience,
                    device_size: None,
                };
                let at = (vol, Path::new(&self.volume));
                let resume = format!(
                    "ucrypt reencrypt --resume-only {} --control {}",
                    self.volume,
                    self.sock.display()
                );
                let rotation = &self.rotation;
                match start_rotation(&self.name, at, rotation, key, opts, header, resume) {
                    Ok(()) => respond(&self.status()),
                    Err(e) => respond(&e),
                }
            }
            Request::Resize { size_sectors } => {
                let (front, log) = (self.serving.front(), format!("ucrypt {}", self.name));
                let named = (self.name.as_str(), log.as_str());
                match resize::resize(named, &self.vol, size_sectors, front, NbdClients::None) {
                    Ok(_) => respond(&self.status()),
                    Err(answer) => respond(&answer),
                }
            }
            other => respond(&Response::Error {
                code: 1,
                error: format!(
                    "{}: the control socket of serve, mount, ublk and vhost answers status, \
                     reencrypt and resize only ({} belongs to `ucrypt open`'s daemon; stop \
                     this process with SIGTERM)",
                    self.name,
                    request_name(&other)
                ),
            }),
        }
    }
}

fn request_name(r: &Request) -> &'static str {
    match r {
        Request::Status | Request::Brief => "status",
        Request::Close { .. } | Request::CloseDeferred | Request::CancelDeferred => "close",
        Request::Refresh(_) => "refresh",
        Request::Suspend => "suspend",
        Request::Resume { .. } => "resume",
        Request::Resize { .. } => "resize",
        Request::Reencrypt { .. } => "reencrypt",
    }
}

/// The control socket while the process serves; removed on drop (if it is still ours).
pub struct Served {
    _socket: ucrypt_nbd::server::BoundSocket,
}

/// Starts answering on `a.control`, if given, for the volume `vol` opened from `v`, served
/// through `serving`. The socket is bound at once (mode 0600) and served from a thread until
/// the process exits.
pub fn start(
    a: &ControlArgs,
    v: &VolumeArgs,
    vol: &Opened,
    serving: Serving,
) -> CliResult<Option<Served>> {
    let Some(path) = &a.control else {
        return Ok(None);
    };
    let (l, bound) = server::bind(path)?;
    let volume = v.volume.to_string();
    let h = Control {
        name: volume.clone(),
        vol: vol.clone(),
        volume: canonical(&volume),
        read_only: v.read_only,
        serving,
        sock: path.clone(),
        started_unix_s: super::unix_now_s(),
        rotation: Arc::new(Mutex::new(None)),
        // Absolute: the rotation opens it from this process, the verb compares it from its own
        // working directory.
        header: v
            .header
            .as_ref()
            .map(|h| std::fs::canonicalize(h).unwrap_or_else(|_| h.clone())),
    };
    server::spawn(l, Arc::new(h))?;
    Ok(Some(Served { _socket: bound }))
}

/// The volume's canonical path when it is a local file or device (the verb compares it with
/// the file it was given), else its name as given.
fn canonical(volume: &str) -> String {
    std::fs::canonicalize(Path::new(volume))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| volume.to_string())
}
