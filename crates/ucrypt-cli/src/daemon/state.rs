//! Where open volumes keep their state, and the locks that make a NAME and a volume belong to
//! one daemon at a time.
//!
//! ```text
//! /run/ucrypt/                 (root)   or  $XDG_RUNTIME_DIR/ucrypt/   (rootless), mode 0700
//!   .lock                      held (flock) while an `open` checks and claims a NAME
//!   NAME/                      mode 0700
//!     lock                     an OFD lock held by the daemon for its whole life: the liveness
//!     pid                      proof (the kernel drops it when the daemon dies, however it dies)
//!     identity.json            the volume (canonical path, st_dev, st_ino), header, device,
//!                              front end, policy, start time: what `close` cleans after a crash
//!     control.sock             the control socket, mode 0600
//!     volume                   the FUSE mount point (a regular file) for FUSE front ends
//!     daemon.log               the daemon's stderr (its warnings after it went to background)
//!     device                   rootless only: symlink to the FUSE file
//! /dev/ucrypt/NAME             root only: symlink to the device (/dev/loopN, /dev/ublkbN)
//! ```
//!
//! A daemon is alive exactly while `NAME/lock` is locked; `pid` is only what `status` prints.
//! The lock is an open-file-description lock, so it survives the fork from `open` into the
//! daemon, and `F_OFD_GETLK` tells whether it is held without taking it.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{CliError, CliResult};

/// Longest NAME, bytes: device-mapper's limit (DM_NAME_LEN 128, with its NUL), so a name that
/// works with cryptsetup works here and the other way round.
pub const NAME_BYTES_MAX: usize = 127;

/// Open volumes `list` and the volume check of `open` look at, at most: far more than a
/// machine serves, and it bounds what a directory full of junk costs.
pub const ENTRIES_MAX: usize = 4096;

/// Largest identity.json read, bytes: three paths of at most PATH_MAX and a few numbers.
const IDENTITY_BYTES_MAX: u64 = 64 << 10;

/// The stable names' directory for root.
pub const DEV_DIR: &str = "/dev/ucrypt";

/// The control socket's name in NAME's state directory.
pub const CONTROL_SOCKET: &str = "control.sock";

/// The vhost-user socket's name there (`open --front-end vhost-user`): no longer than the
/// control socket's, so it fits in a unix socket's path wherever that does.
pub const VHOST_SOCKET: &str = "vhost.sock";
const _: () = assert!(VHOST_SOCKET.len() <= CONTROL_SOCKET.len());

/// Longest path a unix socket can be bound at, bytes: `sun_path` holds 108 with the NUL.
const SOCKET_PATH_BYTES_MAX: usize = 107;

/// Checks a device NAME: what dm accepts (no '/', not "." or "..", at most 127 bytes), and
/// no control characters or leading '-' (so it prints on one line and is not an option).
pub fn check_name(name: &str) -> CliResult<()> {
    let why = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > NAME_BYTES_MAX {
        Some("it is longer than 127 bytes")
    } else if name.contains('/') {
        Some("it contains '/'")
    } else if name == "." || name == ".." {
        Some("it is '.' or '..'")
    } else if name.starts_with('-') {
        Some("it starts with '-'")
    } else if name.chars().any(|c| c.is_control()) {
        Some("it contains a control character")
    } else {
        None
    };
    match why {
        Some(w) => Err(CliError::Usage(format!(
            "Device name {name:?} is invalid: {w}."
        ))),
        None => Ok(()),
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CliError {
    let what = what.into();
    move |e| CliError::Core(ucrypt::Error::io(what, e))
}

/// The state directory of this user: root's or the rootless one.
#[derive(Debug, Clone)]
pub struct RunDir {
    pub base: PathBuf,
    pub root: bool,
}

impl RunDir {
    /// `/run/ucrypt` for root, `$XDG_RUNTIME_DIR/ucrypt` otherwise.
    pub fn locate() -> CliResult<RunDir> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        if root {
            return Ok(RunDir {
                base: PathBuf::from("/run/ucrypt"),
                root,
            });
        }
        match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(d) if Path::new(&d).is_absolute() => Ok(RunDir {
                base: Path::new(&d).join("ucrypt"),
                root,
            }),
            _ => Err(CliError::Usage(
                "XDG_RUNTIME_DIR is not set (or not absolute): rootless ucrypt keeps the state of open volumes there".into(),
            )),
        }
    }

    /// Creates the base directory (mode 0700) if needed.
    pub fn create(&self) -> CliResult<()> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.base)
            .map_err(io(format!("creating {}", self.base.display())))
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        self.base.join(name)
    }

    /// The NAME a verb's argument names: NAME itself, or NAME's stable path
    /// (`/dev/ucrypt/NAME` for root, `BASE/NAME/device` rootless), as cryptsetup takes
    /// `/dev/mapper/NAME` for NAME. None for any other path. Pure: for tests.
    pub fn name_in(&self, arg: &str) -> Option<String> {
        if !arg.contains('/') {
            return Some(arg.to_string());
        }
        let p = Path::new(arg);
        let rest: Vec<&std::ffi::OsStr> = if self.root {
            p.strip_prefix(DEV_DIR).ok()?.iter().collect()
        } else {
            let r: Vec<_> = p.strip_prefix(&self.base).ok()?.iter().collect();
            match r.as_slice() {
                [name, device] if *device == "device" => vec![*name],
                _ => return None,
            }
        };
        match rest.as_slice() {
            [name] => name.to_str().map(str::to_string),
            _ => None,
        }
    }

    /// The longest NAME whose control socket (`BASE/NAME/control.sock`) still fits in a unix
    /// socket's path: 82 bytes under /run/ucrypt, less under a long $XDG_RUNTIME_DIR.
    pub fn name_bytes_max(&self) -> usize {
        let fixed = self.base.as_os_str().len() + 1 + 1 + CONTROL_SOCKET.len();
        SOCKET_PATH_BYTES_MAX
            .saturating_sub(fixed)
            .min(NAME_BYTES_MAX)
    }

    /// Refuses, before anything is made, a NAME longer than [`Self::name_bytes_max`].
    pub fn check_name_fits(&self, name: &str) -> CliResult<()> {
        let max = self.name_bytes_max();
        if name.len() <= max {
            return Ok(());
        }
        Err(CliError::Usage(format!(
            "Device name {name:?} is too long: {} bytes; at most {max} fit, as its control \
             socket {} must fit in a unix socket's path ({SOCKET_PATH_BYTES_MAX} bytes).",
            name.len(),
            self.base.join("NAME").join(CONTROL_SOCKET).display()
        )))
    }

    /// The stable path of NAME: `/dev/ucrypt/NAME` (root) or `NAME/device` in the state dir.
    pub fn stable_path(&self, name: &str) -> PathBuf {
        if self.root {
            Path::new(DEV_DIR).join(name)
        } else {
            self.dir(name).join("device")
        }
    }

    /// The names with a state directory (live or dead), sorted, at most [`ENTRIES_MAX`].
    pub fn names(&self) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(&self.base) else {
            return Vec::new();
        };
        let mut out: Vec<String> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| check_name(n).is_ok())
            .take(ENTRIES_MAX)
            .collect();
        out.sort();
        out
    }

    /// Takes the directory-wide lock that serialises claims (blocks while another `open`
    /// claims; that takes milliseconds: nobody holds it across a prompt).
    pub fn lock_all(&self) -> CliResult<File> {
        let path = self.base.join(".lock");
        let f = open_lock_file(&path)?;
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io(format!("locking {}", path.display()))(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(f)
    }
}

/// The state of one open volume, as `open` records it for `status`, `list` and the clean-up
/// after a crash.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Identity {
    pub name: String,
    /// The volume, canonical path.
    pub volume: PathBuf,
    pub st_dev: u64,
    /// 0 for a remote volume (then `volume` is its name, e.g. `rbd:pool/image`).
    pub st_ino: u64,
    /// Detached header, canonical path.
    pub header: Option<PathBuf>,
    /// "ublk", "fuse+loop", "fuse"; None until the device is ready.
    pub front_end: Option<String>,
    /// What serves the plaintext: /dev/ublkbN, /dev/loopN or the FUSE file.
    pub device: Option<PathBuf>,
    pub stable_path: PathBuf,
    /// The FUSE mount point (a regular file), for the FUSE front ends.
    pub fuse_file: Option<PathBuf>,
    /// The loop device attached to the FUSE file (fuse+loop).
    pub loop_device: Option<PathBuf>,
    /// The ublk device id (ublk).
    pub ublk_id: Option<u32>,
    pub policy: String,
    pub pid: u32,
    pub started_unix_s: u64,
    /// A plain mapping opened with `--shared`: other mappings of the same volume may exist
    /// beside it.
    #[serde(default)]
    pub shared: bool,
}

impl Identity {
    /// The same volume: a local one by device and inode (whatever path named it), a remote
    /// one by its name.
    pub fn same_volume(&self, other: &Identity) -> bool {
        if self.st_ino != 0 && other.st_ino != 0 {
            self.st_dev == other.st_dev && self.st_ino == other.st_ino
        } else {
            self.st_ino == other.st_ino && self.volume == other.volume
        }
    }

    pub fn read(dir: &Path) -> Option<Identity> {
        let f = File::open(dir.join("identity.json")).ok()?;
        let mut s = String::new();
        use std::io::Read;
        f.take(IDENTITY_BYTES_MAX).read_to_string(&mut s).ok()?;
        serde_json::from_str(&s).ok()
    }

    /// Writes identity.json (and pid) atomically: a reader sees the old or the new file.
    pub fn write(&self, dir: &Path) -> CliResult<()> {
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| CliError::Usage(format!("identity.json: {e}")))?;
        write_atomic(&dir.join("identity.json"), &text)?;
        write_atomic(&dir.join("pid"), format!("{}\n", self.pid).as_bytes())
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> CliResult<()> {
    let tmp = path.with_extension("tmp");
    let ctx = io(format!("writing {}", path.display()));
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(format!("writing {}", tmp.display())))?;
    f.write_all(bytes)
        .map_err(io(format!("writing {}", tmp.display())))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(ctx)
}

/// `struct flock` for an OFD write lock on the whole file.
fn whole_file_lock(kind: libc::c_short) -> libc::flock {
    // SAFETY: flock is plain data; all-zero is a valid value (l_start = l_len = 0: the whole
    // file; l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl
}

/// The daemon's hold on NAME: alive while this (or a forked copy of its descriptor) is open.
#[derive(Debug)]
pub struct NameLock {
    /// Never read: held (closing the last descriptor of it releases the lock).
    _file: File,
}

impl NameLock {
    /// Takes NAME's lock, or returns None if a live daemon (or an `open` in progress) holds
    /// it. Checks afterwards that the lock file is still the one in the directory: a `close`
    /// may have removed the directory between our open and our lock.
    pub fn try_take(dir: &Path) -> CliResult<Option<NameLock>> {
        let path = dir.join("lock");
        let file = open_lock_file(&path)?;
        let fl = whole_file_lock(libc::F_WRLCK as libc::c_short);
        // SAFETY: F_OFD_SETLK reads one struct flock that lives across the call.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) } != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(None),
                _ => Err(io(format!("locking {}", path.display()))(e)),
            };
        }
        let same = match (file.metadata(), std::fs::metadata(&path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if !same {
            return Ok(None);
        }
        Ok(Some(NameLock { _file: file }))
    }
}

/// True if a live process holds NAME's lock (a daemon, or an `open` still prompting).
pub fn is_alive(dir: &Path) -> bool {
    let Ok(file) = File::open(dir.join("lock")) else {
        return false;
    };
    let mut fl = whole_file_lock(libc::F_WRLCK as libc::c_short);
    // SAFETY: F_OFD_GETLK reads and rewrites one struct flock that lives across the call.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) } != 0 {
        return false;
    }
    fl.l_type != libc::F_UNLCK as libc::c_short
}

/// What a claimed NAME is: its directory, with the lock held.
#[derive(Debug)]
pub struct Claim {
    pub dir: PathBuf,
    /// Never read: held. The lock lives while this descriptor (or the forked daemon's copy
    /// of it) is open.
    _lock: NameLock,
}

impl Claim {
    /// Gives NAME up after a failed open: removes its directory (the lock goes when the
    /// process exits or the lock is dropped).
    pub fn abandon(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Claims NAME for `ident`'s volume: NAME must have no directory (a live or a dead daemon),
/// and no live daemon may serve the same volume (st_dev, st_ino) under another name, unless
/// `ident` is a shared plain mapping (`open --shared`, which cryptsetup maps beside any other). Writes
/// the first identity.json (without a device) under the lock, so that a concurrent `open`
/// of the same volume sees the claim.
pub fn claim(run: &RunDir, ident: &Identity) -> CliResult<Claim> {
    run.create()?;
    let all = run.lock_all()?;
    let name = &ident.name;
    let dir = run.dir(name);
    if dir.exists() {
        return Err(if is_alive(&dir) {
            CliError::Busy(format!("Device {name} already exists."))
        } else {
            CliError::Busy(format!(
                "Device {name} already exists (its daemon is dead: 'ucrypt close {name}' cleans up)."
            ))
        });
    }
    for other in run.names() {
        let odir = run.dir(&other);
        if !is_alive(&odir) {
            continue;
        }
        if let Some(o) = Identity::read(&odir) {
            if o.same_volume(ident) && !ident.shared {
                return Err(CliError::Busy(format!(
                    "Cannot use device {} which is in use (already mapped or mounted).",
                    ident.volume.display()
                )));
            }
        }
    }
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(io(format!("creating {}", dir.display())))?;
    let lock = match NameLock::try_take(&dir)? {
        Some(l) => l,
        None => {
            return Err(CliError::Busy(format!("Device {name} already exists.")));
        }
    };
    let claim = Claim { dir, _lock: lock };
    if let Err(e) = ident.write(&claim.dir) {
        claim.abandon();
        return Err(e);
    }
    drop(all);
    Ok(claim)
}

/// Opens (creating, owner-only) a file that exists to be locked.
fn open_lock_file(path: &Path) -> CliResult<File> {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(io(format!("opening {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_table() {
        let long = "n".repeat(NAME_BYTES_MAX);
        let too_long = "n".repeat(NAME_BYTES_MAX + 1);
        let rows: &[(&str, bool)] = &[
            ("data", true),
            ("my-vol_2.x", true),
            (&long, true),
            (&too_long, false),
            ("", false),
            (".", false),
            ("..", false),
            ("...", true),
            ("a/b", false),
            ("/", false),
            ("-q", false),
            ("a\nb", false),
            ("a\tb", false),
        ];
        for (name, ok) in rows {
            assert_eq!(check_name(name).is_ok(), *ok, "{name:?}");
        }
    }

    #[test]
    fn names_fit_the_control_sockets_path() {
        let root = RunDir {
            base: PathBuf::from("/run/ucrypt"),
            root: true,
        };
        assert_eq!(root.name_bytes_max(), 82);
        assert!(root.check_name_fits(&"n".repeat(82)).is_ok());
        let e = root.check_name_fits(&"n".repeat(83)).unwrap_err();
        assert!(e.to_string().contains("at most 82 fit"), "{e}");
        // The path itself, at the limit, is one a socket can be bound at.
        let p = root.dir(&"n".repeat(82)).join(CONTROL_SOCKET);
        assert_eq!(p.as_os_str().len(), SOCKET_PATH_BYTES_MAX);
        let long = RunDir {
            base: PathBuf::from(format!("/{}", "d".repeat(120))),
            root: false,
        };
        assert_eq!(long.name_bytes_max(), 0);
    }

    #[test]
    fn stable_paths_name_their_name() {
        let root = RunDir {
            base: PathBuf::from("/run/ucrypt"),
            root: true,
        };
        let user = RunDir {
            base: PathBuf::from("/run/user/1000/ucrypt"),
            root: false,
        };
        let rows: &[(&RunDir, &str, Option<&str>)] = &[
            (&root, "data", Some("data")),
            (&root, "/dev/ucrypt/data", Some("data")),
            (&root, "/dev/ucrypt/data/", Some("data")),
            (&root, "/dev/ucrypt", None),
            (&root, "/dev/ucrypt/a/b", None),
            (&root, "/dev/mapper/data", None),
            (&root, "/dev/ucryptdata", None),
            (&root, "/run/user/1000/ucrypt/data/device", None),
            (&user, "data", Some("data")),
            (&user, "/run/user/1000/ucrypt/data/device", Some("data")),
            (&user, "/run/user/1000/ucrypt/data", None),
            (&user, "/run/user/1000/ucrypt/data/volume", None),
            (&user, "/dev/ucrypt/data", None),
        ];
        for (run, arg, want) in rows {
            assert_eq!(
                run.name_in(arg).as_deref(),
                *want,
                "{arg} (root {})",
                run.root
            );
        }
    }

    #[test]
    fn lock_is_seen_and_released() {
        let dir = std::env::temp_dir().join(format!("ucrypt-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!is_alive(&dir));
        let l = NameLock::try_take(&dir).unwrap().expect("first lock");
        assert!(is_alive(&dir));
        // A second description cannot take it (OFD locks conflict even within a process).
        assert!(NameLock::try_take(&dir).unwrap().is_none());
        drop(l);
        assert!(!is_alive(&dir));
        // Removed under a holder: the next taker's file is a new one.
        let l = NameLock::try_take(&dir).unwrap().expect("again");
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        assert!(NameLock::try_take(&dir).unwrap().is_some());
        drop(l);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
