//! FUSE front end: serves any [`BlockDev`] as one regular file that `losetup` (also with
//! `--direct-io=on`), VMs and `mkfs` can use.
//!
//! - [`mount`] blocks until the file is unmounted (`fusermount3 -u`, `umount`) or the process
//!   gets SIGINT/SIGTERM, then flushes the device: everything acknowledged is durable on return.
//! - [`spawn`] mounts and returns a [`Mounted`] handle (for tests and embedding).
//!
//! Transport: classic `/dev/fuse`, one worker thread per CPU, each with its own cloned fd
//! (FUSE_DEV_IOC_CLONE). FUSE-over-io_uring (Linux >= 6.14) would need a server speaking it;
//! fuser 0.18 does not (see [`transport_note`]).

mod fs;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fuser::{BackgroundSession, Config, MountOption, Session, SessionACL};
use ucrypt::{BlockDev, Error, Result};

pub use fs::{plan_fallocate, plan_read, plan_write, FallocPlan, PunchHole, REQUEST_BYTES_MAX};

/// Upper bound on FUSE worker threads: each holds one request buffer of up to
/// REQUEST_BYTES_MAX plus fuser's own read buffer, so 16 threads cost at most ~48 MiB.
pub const THREADS_MAX: usize = 16;

/// How often [`mount`] checks whether the session ended while it waits for signals.
const SIGNAL_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Clone)]
pub struct MountOptions {
    /// `Some(name)`: the mount point is a directory and the volume appears in it as `name`;
    /// `None`: the mount point (a regular file) becomes the volume.
    pub file_name: Option<String>,
    /// FUSE worker threads (0 = one per CPU, at least 2, at most [`THREADS_MAX`]).
    pub threads: usize,
    /// Let other users than the mounting one open the file (FUSE `allow_other`).
    pub allow_other: bool,
    /// Bypass the page cache for every open (FOPEN_DIRECT_IO, parallel direct writes).
    pub direct_io: bool,
    pub punch_hole: PunchHole,
    /// Shown as the source in /proc/mounts.
    pub fs_name: String,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            file_name: None,
            threads: 0,
            allow_other: false,
            direct_io: false,
            punch_hole: PunchHole::Zeroes,
            fs_name: "ucrypt".into(),
        }
    }
}

impl MountOptions {
    fn thread_count(&self) -> usize {
        if self.threads != 0 {
            return self.threads.clamp(1, THREADS_MAX);
        }
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(2, THREADS_MAX)
    }
}

/// Which transport is in use and why, for the user.
pub fn transport_note() -> String {
    let uring = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .map(|s| s.trim().to_string())
        .ok();
    let kernel = match uring.as_deref() {
        Some("Y") => "enabled in this kernel",
        Some(_) => "available in this kernel but disabled (enable_uring=N)",
        None => "not available in this kernel",
    };
    format!(
        "transport: classic /dev/fuse (FUSE-over-io_uring {kernel}; the fuser crate does not speak it)"
    )
}

/// A mounted volume file. Dropping it unmounts lazily; prefer [`Mounted::unmount`].
pub struct Mounted {
    session: Option<BackgroundSession>,
    dev: Arc<dyn BlockDev>,
    mountpoint: PathBuf,
    /// The file users open: the mount point, or `mountpoint/file_name`.
    pub file: PathBuf,
    pub threads: usize,
}

impl std::fmt::Debug for Mounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mounted")
            .field("mountpoint", &self.mountpoint)
            .field("file", &self.file)
            .field("threads", &self.threads)
            .finish()
    }
}

/// Mounts `dev` at `mountpoint` and serves it from background threads until unmounted.
pub fn spawn(dev: Arc<dyn BlockDev>, mountpoint: &Path, opts: &MountOptions) -> Result<Mounted> {
    let meta = std::fs::metadata(mountpoint)
        .map_err(|e| Error::io(format!("mount point {}", mountpoint.display()), e))?;
    match (&opts.file_name, meta.is_dir()) {
        (None, true) => {
            return Err(Error::InvalidArgument(format!(
                "mount point {} is a directory: give --file-name NAME, or mount on a regular file",
                mountpoint.display()
            )))
        }
        (Some(_), false) => {
            return Err(Error::InvalidArgument(format!(
                "--file-name needs a directory as mount point; {} is not one",
                mountpoint.display()
            )))
        }
        (Some(n), true) if n.is_empty() || n.contains('/') || n == "." || n == ".." => {
            return Err(Error::InvalidArgument(format!("bad file name '{n}'")))
        }
        _ => {}
    }
    let threads = opts.thread_count();
    let mut mount_options = vec![
        MountOption::FSName(opts.fs_name.clone()),
        MountOption::Subtype("ucrypt".into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
    ];
    if dev.read_only() {
        mount_options.push(MountOption::RO);
    }
    let mut config = Config::default();
    config.mount_options = mount_options;
    config.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(threads);
    config.clone_fd = true;
    let fs_cfg = fs::FsConfig {
        file_name: opts.file_name.clone(),
        direct_io: opts.direct_io,
        punch_hole: opts.punch_hole,
        // SAFETY: getuid/getgid cannot fail and touch no memory.
        uid: unsafe { libc::getuid() },
        // SAFETY: as above.
        gid: unsafe { libc::getgid() },
    };
    let fs = fs::VolumeFs::new(dev.clone(), fs_cfg);
    let session = Session::new(fs, mountpoint, &config)
        .map_err(|e| Error::io(format!("FUSE mount on {}", mountpoint.display()), e))?;
    let session = session
        .spawn()
        .map_err(|e| Error::io("start FUSE worker threads", e))?;
    let file = match &opts.file_name {
        Some(n) => mountpoint.join(n),
        None => mountpoint.to_path_buf(),
    };
    Ok(Mounted {
        session: Some(session),
        dev,
        mountpoint: mountpoint.to_path_buf(),
        file,
        threads,
    })
}

/// What [`Mounted::request_unmount`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmount {
    /// Unmounted; the session ends now.
    Done,
    /// The file is still in use (e.g. a loop device): detached from the namespace; the session
    /// keeps serving until the last user closes it.
    Detached,
}

impl Mounted {
    /// True once the session ended (unmounted from outside, or after [`Self::request_unmount`]).
    pub fn finished(&self) -> bool {
        self.session.as_ref().is_none_or(|s| s.guard.is_finished())
    }

    /// Unmounts without waiting: a plain unmount, or a lazy one if the file is busy.
    pub fn request_unmount(&self) -> Result<Unmount> {
        let c = CString::new(self.mountpoint.as_os_str().as_bytes())
            .map_err(|_| Error::InvalidArgument("mount point contains a NUL byte".into()))?;
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            return Ok(Unmount::Done);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EBUSY) => {
                // SAFETY: as above.
                if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
                    Ok(Unmount::Detached)
                } else {
                    Err(Error::io("lazy unmount", std::io::Error::last_os_error()))
                }
            }
            Some(libc::EPERM) => {
                // Not root: the setuid helper unmounts (lazily) for the mounting user.
                let st = std::process::Command::new("fusermount3")
                    .arg("-u")
                    .arg("-z")
                    .arg(&self.mountpoint)
                    .status()
                    .map_err(|e| Error::io("run fusermount3 -u", e))?;
                if st.success() {
                    Ok(Unmount::Detached)
                } else {
                    Err(Error::io(
                        "fusermount3 -u",
                        std::io::Error::other(st.to_string()),
                    ))
                }
            }
            Some(libc::EINVAL) if self.finished() => Ok(Unmount::Done),
            _ => Err(Error::io(
                format!("unmount {}", self.mountpoint.display()),
                err,
            )),
        }
    }

    /// Waits for the session to end, then flushes the device.
    pub fn join(mut self) -> Result<()> {
        if let Some(s) = self.session.take() {
            s.join().map_err(|e| Error::io("FUSE session", e))?;
        }
        self.dev.flush()
    }

    /// Unmounts (lazily if busy), waits until the last user is gone, and flushes.
    pub fn unmount(self) -> Result<()> {
        if !self.finished() {
            self.request_unmount()?;
        }
        self.join()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            // BackgroundSession's own drop detaches the mount; the workers then end by ENODEV.
            drop(s);
            let _ = self.dev.flush();
        }
    }
}

/// Serves `dev` at `mountpoint` until it is unmounted or the process receives SIGINT/SIGTERM;
/// returns after every acknowledged write is flushed. Prints one line when ready.
pub fn mount(dev: Arc<dyn BlockDev>, mountpoint: &Path, opts: &MountOptions) -> Result<()> {
    let sigs = SignalBlock::new(&[libc::SIGINT, libc::SIGTERM])?;
    let m = spawn(dev, mountpoint, opts)?;
    eprintln!(
        "ucrypt mount: serving {} ({} bytes) with {} threads; {}",
        m.file.display(),
        m.dev.size(),
        m.threads,
        transport_note()
    );
    let mut asked = false;
    while !m.finished() {
        if let Some(sig) = sigs.wait(SIGNAL_POLL) {
            if !asked {
                asked = true;
                match m.request_unmount() {
                    Ok(Unmount::Done) => eprintln!("ucrypt mount: signal {sig}: unmounted"),
                    Ok(Unmount::Detached) => eprintln!(
                        "ucrypt mount: signal {sig}: {} is busy (loop device?); detached, serving until its last user closes it",
                        m.file.display()
                    ),
                    Err(e) => {
                        eprintln!("ucrypt mount: signal {sig}: unmount failed: {e}");
                        asked = false;
                    }
                }
            }
        }
    }
    m.join()?;
    eprintln!("ucrypt mount: unmounted, all writes flushed");
    drop(sigs);
    Ok(())
}

/// Blocks signals in this thread (and the threads it starts) so they can be taken
/// synchronously with `sigtimedwait`; restores the previous mask on drop.
struct SignalBlock {
    set: libc::sigset_t,
    old: libc::sigset_t,
}

impl SignalBlock {
    fn new(signals: &[i32]) -> Result<Self> {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it before use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t owned by this frame.
        unsafe { libc::sigemptyset(&mut set) };
        for &s in signals {
            // SAFETY: as above; `s` is a valid signal number.
            unsafe { libc::sigaddset(&mut set, s) };
        }
        // SAFETY: both pointers are valid sigset_t values for the duration of the call.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) };
        if rc != 0 {
            return Err(Error::io(
                "block signals",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(SignalBlock { set, old })
    }

    fn wait(&self, timeout: Duration) -> Option<i32> {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `self.set` and `ts` are valid for the call; siginfo may be null.
        let s = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &ts) };
        (s > 0).then_some(s)
    }
}

impl Drop for SignalBlock {
    fn drop(&mut self) {
        // SAFETY: `self.old` is the mask saved by pthread_sigmask in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}
