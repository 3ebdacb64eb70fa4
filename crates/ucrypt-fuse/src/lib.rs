//! FUSE front end: serves any [`BlockDev`] as one regular file that `losetup` (also with
//! `--direct-io=on`), VMs and `mkfs` can use.
//!
//! - [`mount`] blocks until the file is unmounted (`fusermount3 -u`, `umount`) or the process
//!   gets SIGINT/SIGTERM, then flushes the device: everything acknowledged is durable on return.
//! - [`spawn`] mounts and returns a [`Mounted`] handle (for tests and embedding).
//!
//! Own FUSE implementation (no libfuse): [`proto`] is the wire codec, `fs` the sans-I/O request
//! handler, `transport` the kernel side. Two transports share the handler:
//! - classic `/dev/fuse`: up to one reader thread per CPU, each with its own cloned fd
//!   (FUSE_DEV_IOC_CLONE); one runs always, the others start under load and end when idle
//!   (`readers`);
//! - FUSE-over-io_uring (Linux >= 6.14, `/sys/module/fuse/parameters/enable_uring` = Y): one
//!   thread and ring per kernel queue (one queue per CPU), [`URING_ENTRIES_PER_QUEUE`] entries
//!   each, plus one classic thread for FORGET/INTERRUPT, which the kernel still sends there.

#![deny(unsafe_code)]

mod fs;
pub mod proto;
mod readers;
#[allow(unsafe_code)] // the one module that talks to the kernel (see its docs)
mod transport;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ucrypt::{BlockDev, Error, Result};

pub use fs::{
    plan_fallocate, plan_read, plan_write, FallocPlan, FsConfig, Outcome, PunchHole, VolumeFs,
    REQUEST_BYTES_MAX,
};
pub use readers::READER_IDLE;
use readers::{worker, Readers, WorkerError};
pub use transport::URING_ENTRIES_PER_QUEUE;

/// Upper bound on FUSE worker threads: each classic one holds one request buffer of about
/// REQUEST_BYTES_MAX, so 16 threads cost at most ~17 MiB. With io_uring, queues beyond this
/// many share threads; each queue costs URING_ENTRIES_PER_QUEUE payload buffers of
/// REQUEST_BYTES_MAX.
pub const THREADS_MAX: usize = 16;

/// How often [`mount`] checks whether the session ended while it waits for a stop request.
const STOP_POLL: Duration = Duration::from_millis(200);

/// The kernel switch for FUSE-over-io_uring.
pub const ENABLE_URING_PATH: &str = "/sys/module/fuse/parameters/enable_uring";

/// How requests travel between the kernel and this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// io_uring when the kernel has it enabled and registration succeeds, else classic.
    #[default]
    Auto,
    /// read(2)/writev(2) on `/dev/fuse`.
    Classic,
    /// FUSE-over-io_uring; mounting fails, naming the reason, when it is not available.
    IoUring,
}

/// The transport a mount ended up with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActiveTransport {
    Classic {
        threads: usize,
        /// Why io_uring is not in use (None when classic was asked for).
        io_uring_unused: Option<String>,
    },
    IoUring {
        queues: usize,
        threads: usize,
    },
}

impl std::fmt::Display for ActiveTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActiveTransport::Classic {
                threads,
                io_uring_unused,
            } => {
                write!(f, "transport: classic /dev/fuse, {threads} threads")?;
                if let Some(r) = io_uring_unused {
                    write!(f, " (FUSE-over-io_uring not used: {r})")?;
                }
                Ok(())
            }
            ActiveTransport::IoUring { queues, threads } => write!(
                f,
                "transport: FUSE-over-io_uring, {queues} queues x {URING_ENTRIES_PER_QUEUE} entries on {threads} threads (+1 classic thread for FORGET/INTERRUPT)"
            ),
        }
    }
}

#[derive(Debug, Clone)]
pub struct MountOptions {
    /// `Some(name)`: the mount point is a directory and the volume appears in it as `name`;
    /// `None`: the mount point (a regular file) becomes the volume.
    pub file_name: Option<String>,
    /// Classic FUSE worker threads (0 = one per CPU, at least 2, at most [`THREADS_MAX`]).
    /// The io_uring transport ignores it: it runs one thread per kernel queue (one queue per
    /// possible CPU, at most [`THREADS_MAX`] threads) plus one classic thread.
    pub threads: usize,
    /// Let other users than the mounting one open the file (FUSE `allow_other`).
    pub allow_other: bool,
    /// Bypass the page cache for every open (FOPEN_DIRECT_IO, parallel direct writes).
    pub direct_io: bool,
    pub punch_hole: PunchHole,
    /// Shown as the source in /proc/mounts.
    pub fs_name: String,
    pub transport: Transport,
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
            transport: Transport::Auto,
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

/// Whether this kernel and process can use FUSE-over-io_uring; Err names the reason and the fix.
pub fn io_uring_availability() -> std::result::Result<(), String> {
    match std::fs::read_to_string(ENABLE_URING_PATH) {
        Err(_) => Err(format!(
            "this kernel has no FUSE-over-io_uring ({ENABLE_URING_PATH} missing; needs Linux >= 6.14)"
        )),
        Ok(v) if v.trim() != "Y" => Err(format!(
            "enable_uring is {}: echo Y > {ENABLE_URING_PATH}",
            v.trim()
        )),
        Ok(_) => transport::probe_io_uring()
            .map_err(|e| format!("cannot create an io_uring with 128-byte SQEs: {e}")),
    }
}

/// What the kernel offers, for the user (the transport a mount uses is [`Mounted::transport`]).
pub fn transport_note() -> String {
    match io_uring_availability() {
        Ok(()) => "FUSE-over-io_uring available (enable_uring=Y)".into(),
        Err(r) => format!("FUSE-over-io_uring unavailable: {r}"),
    }
}

/// A mounted volume file. Dropping it unmounts lazily; prefer [`Mounted::unmount`].
pub struct Mounted {
    workers: Vec<JoinHandle<()>>,
    /// The classic readers (their first one is in `workers`).
    readers: Option<Arc<Readers>>,
    fs: Arc<fs::VolumeFs>,
    /// The first error a worker ended with.
    worker_error: WorkerError,
    dev: Arc<dyn BlockDev>,
    mountpoint: PathBuf,
    /// The file users open: the mount point, or `mountpoint/file_name`.
    pub file: PathBuf,
    /// Worker threads serving requests, at most (classic readers beyond the first start on
    /// demand and end when idle).
    pub threads: usize,
    pub transport: ActiveTransport,
    fd: Arc<OwnedFd>,
}

/// Tells the kernel the volume's size changed (after `Volume::resize`): it drops the file's
/// cached attributes, and a `stat` then reads the new size. Cloneable, usable from any
/// thread but the FUSE workers.
#[derive(Clone)]
pub struct SizeNotifier {
    fd: Arc<OwnedFd>,
    ino: u64,
    file: PathBuf,
}

impl SizeNotifier {
    /// Sends FUSE_NOTIFY_INVAL_INODE for the file, then stats it so that the kernel's size
    /// (which the loop driver reads) is the new one. Returns the size the kernel now has.
    pub fn size_changed(&self) -> Result<u64> {
        use std::os::fd::AsRawFd;
        transport::notify_inval_inode(self.fd.as_raw_fd(), self.ino)
            .map_err(|e| Error::io("FUSE notify (inval inode)", e))?;
        std::fs::metadata(&self.file)
            .map(|m| m.len())
            .map_err(|e| Error::io(format!("stat {}", self.file.display()), e))
    }
}

impl std::fmt::Debug for Mounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mounted")
            .field("mountpoint", &self.mountpoint)
            .field("file", &self.file)
            .field("threads", &self.threads)
            .field("transport", &self.transport)
            .finish()
    }
}

fn check_mountpoint(mountpoint: &Path, opts: &MountOptions) -> Result<bool> {
    let meta = std::fs::metadata(mountpoint)
        .map_err(|e| Error::io(format!("mount point {}", mountpoint.display()), e))?;
    match (&opts.file_name, meta.is_dir()) {
        (None, true) => Err(Error::InvalidArgument(format!(
            "mount point {} is a directory: give --file-name NAME, or mount on a regular file",
            mountpoint.display()
        ))),
        (Some(_), false) => Err(Error::InvalidArgument(format!(
            "--file-name needs a directory as mount point; {} is not one",
            mountpoint.display()
        ))),
        (Some(n), true) if n.is_empty() || n.contains('/') || n == "." || n == ".." => {
            Err(Error::InvalidArgument(format!("bad file name '{n}'")))
        }
        (_, is_dir) => Ok(is_dir),
    }
}

/// Mounts `dev` at `mountpoint` and serves it from background threads until unmounted.
pub fn spawn(dev: Arc<dyn BlockDev>, mountpoint: &Path, opts: &MountOptions) -> Result<Mounted> {
    let is_dir = check_mountpoint(mountpoint, opts)?;
    let asked = |r: &str| Error::KernelFeature(format!("FUSE-over-io_uring asked for, but {r}"));
    // Why io_uring will not be tried (None: it will be, or classic was asked for).
    let unavailable = match opts.transport {
        Transport::Classic => None,
        Transport::Auto => io_uring_availability().err(),
        Transport::IoUring => match io_uring_availability() {
            Ok(()) => None,
            Err(r) => return Err(asked(&r)),
        },
    };
    let try_uring = opts.transport != Transport::Classic && unavailable.is_none();
    let (mut m, reason) = match spawn_with(dev.clone(), mountpoint, opts, is_dir, try_uring)? {
        Ok(m) => (m, unavailable),
        Err(r) if opts.transport == Transport::IoUring => return Err(asked(&r)),
        // The io_uring mount was taken down again: mount classic.
        Err(r) => match spawn_with(dev, mountpoint, opts, is_dir, false)? {
            Ok(m) => (m, Some(r)),
            Err(_) => {
                return Err(Error::Bug(
                    "classic FUSE mount reported an io_uring failure",
                ))
            }
        },
    };
    if let ActiveTransport::Classic {
        io_uring_unused, ..
    } = &mut m.transport
    {
        if io_uring_unused.is_none() {
            *io_uring_unused = reason;
        }
    }
    Ok(m)
}

/// One mount attempt. Outer Err: mounting failed. Inner Err (only when io_uring was wanted and
/// the options demand it, or its queues failed to register): the mount was taken down again,
/// with the reason.
fn spawn_with(
    dev: Arc<dyn BlockDev>,
    mountpoint: &Path,
    opts: &MountOptions,
    is_dir: bool,
    want_io_uring: bool,
) -> Result<std::result::Result<Mounted, String>> {
    let fs_cfg = fs::FsConfig {
        file_name: opts.file_name.clone(),
        direct_io: opts.direct_io,
        punch_hole: opts.punch_hole,
        uid: transport::ids().0,
        gid: transport::ids().1,
        want_io_uring,
    };
    let fs = Arc::new(fs::VolumeFs::new(dev.clone(), fs_cfg));
    let spec = transport::MountSpec {
        fs_name: &opts.fs_name,
        read_only: dev.read_only(),
        allow_other: opts.allow_other,
        is_dir,
    };
    let fd: Arc<OwnedFd> = Arc::new(
        transport::mount(mountpoint, &spec)
            .map_err(|e| Error::io(format!("FUSE mount on {}", mountpoint.display()), e))?,
    );
    if let Err(e) = transport::serve_init(&fd, &fs) {
        let _ = detach(mountpoint);
        return Err(Error::io("FUSE INIT", e));
    }
    let file = match &opts.file_name {
        Some(n) => mountpoint.join(n),
        None => mountpoint.to_path_buf(),
    };
    let worker_error = Arc::new(Mutex::new(None));
    let mut workers = Vec::new();
    let mut not_offered = None;
    if want_io_uring && !fs.io_uring_negotiated() {
        let reason = "the kernel did not offer FUSE_OVER_IO_URING in FUSE_INIT".to_string();
        if opts.transport == Transport::IoUring {
            let _ = detach(mountpoint);
            return Ok(Err(reason));
        }
        not_offered = Some(reason);
    }
    let notify_fd = fd.clone();
    let (transport, readers) = if fs.io_uring_negotiated() {
        match start_uring(fd, &fs, &worker_error, &mut workers, mountpoint)? {
            Ok(t) => t,
            Err(reason) => return Ok(Err(reason)),
        }
    } else {
        start_classic(fd, &fs, &worker_error, &mut workers, opts, not_offered)?
    };
    let threads = match &transport {
        ActiveTransport::Classic { threads, .. } => *threads,
        ActiveTransport::IoUring { .. } => workers.len(),
    };
    Ok(Ok(Mounted {
        workers,
        readers: Some(readers),
        fs,
        worker_error,
        dev,
        mountpoint: mountpoint.to_path_buf(),
        file,
        threads,
        transport,
        fd: notify_fd,
    }))
}

/// Serves over FUSE-over-io_uring: one thread per CPU queue (at most [`THREADS_MAX`], queues
/// shared beyond), plus one classic thread for FORGET and INTERRUPT. `Ok(Err(reason))` when
/// registration failed; the mount is then taken down.
fn start_uring(
    fd: Arc<OwnedFd>,
    fs: &Arc<fs::VolumeFs>,
    worker_error: &WorkerError,
    workers: &mut Vec<JoinHandle<()>>,
    mountpoint: &Path,
) -> Result<std::result::Result<(ActiveTransport, Arc<Readers>), String>> {
    let queues = transport::possible_cpus();
    let threads = queues.min(THREADS_MAX);
    let (tx, rx) = std::sync::mpsc::channel::<std::result::Result<(), String>>();
    for t in 0..threads {
        let qids: Vec<u16> = (t..queues).step_by(threads).map(|q| q as u16).collect();
        let (fd, fs, tx) = (fd.clone(), fs.clone(), tx.clone());
        workers.push(worker(
            format!("fuse-uring-{t}"),
            worker_error,
            move || {
                if qids.len() == 1 {
                    transport::pin_to_cpu(usize::from(qids[0]));
                }
                let mut q =
                    match transport::UringQueues::new(std::os::fd::AsRawFd::as_raw_fd(&*fd), &qids)
                    {
                        Ok(q) => q,
                        Err(e) => {
                            let _ = tx.send(Err(format!("io_uring setup: {e}")));
                            return Ok(());
                        }
                    };
                let registered = q.register(&fs);
                let _ = tx.send(registered.as_ref().map(|_| ()).map_err(|e| {
                    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                        format!("the kernel refused registration ({e}; enable_uring switched off?)")
                    } else {
                        format!("FUSE_IO_URING_CMD_REGISTER failed: {e}")
                    }
                }));
                drop(tx);
                // Serve what did register; at unmount every entry comes back and this ends.
                q.run(&fs)
            },
        )?);
    }
    drop(tx);
    let mut failure = None;
    for _ in 0..threads {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(r)) => {
                failure.get_or_insert(r);
            }
            Err(_) => {
                failure.get_or_insert("an io_uring queue thread died".to_string());
            }
        }
    }
    if let Some(reason) = failure {
        // Take this mount down; the caller remounts classic (auto) or reports (io-uring).
        let _ = detach(mountpoint);
        drop(fd);
        for w in workers.drain(..) {
            let _ = w.join();
        }
        return Ok(Err(reason));
    }
    // FORGET and INTERRUPT still come over /dev/fuse: one reader, on the blocking fd that the
    // rings use too.
    let (readers, first) = Readers::start(fd, fs, 1, "fuse-classic", worker_error)?;
    workers.push(first);
    Ok(Ok((ActiveTransport::IoUring { queues, threads }, readers)))
}

/// Serves over classic /dev/fuse: up to `opts.thread_count()` readers, one running always,
/// the others on demand (`readers.rs`), each with its own clone of the descriptor where the
/// kernel allows.
fn start_classic(
    fd: Arc<OwnedFd>,
    fs: &Arc<fs::VolumeFs>,
    worker_error: &WorkerError,
    workers: &mut Vec<JoinHandle<()>>,
    opts: &MountOptions,
    not_offered: Option<String>,
) -> Result<(ActiveTransport, Arc<Readers>)> {
    let threads = opts.thread_count();
    let (readers, first) = Readers::start(fd, fs, threads, "fuse-0", worker_error)?;
    workers.push(first);
    Ok((
        ActiveTransport::Classic {
            threads,
            io_uring_unused: not_offered,
        },
        readers,
    ))
}

/// Lazy unmount that works for root (umount2) and for the mounting user (`fusermount3 -u -z`).
fn detach(mountpoint: &Path) -> Result<()> {
    match transport::umount(mountpoint, true) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            let st = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(mountpoint)
                .status()
                .map_err(|e| Error::io("run fusermount3 -u", e))?;
            if st.success() {
                Ok(())
            } else {
                Err(Error::io(
                    "fusermount3 -u",
                    std::io::Error::other(st.to_string()),
                ))
            }
        }
        Err(e) => Err(Error::io(format!("unmount {}", mountpoint.display()), e)),
    }
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
    /// A handle to tell the kernel the size changed.
    pub fn size_notifier(&self) -> SizeNotifier {
        SizeNotifier {
            fd: self.fd.clone(),
            ino: self.fs.file_ino(),
            file: self.file.clone(),
        }
    }

    /// Requests served so far: (over classic /dev/fuse, over io_uring).
    pub fn requests_served(&self) -> (u64, u64) {
        self.fs.served()
    }

    /// The mount's `/dev/fuse` descriptor, to `poll` with no events: it reports `POLLERR`
    /// once the connection ended (unmounted, or aborted), when the workers end too (then
    /// [`Mounted::finished`]). Never read from it: the workers do.
    pub fn connection_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// True once the session ended (unmounted from outside, or after [`Self::request_unmount`]).
    pub fn finished(&self) -> bool {
        self.workers.iter().all(|w| w.is_finished())
            && self.readers.as_ref().is_none_or(|r| r.finished())
    }

    /// Unmounts without waiting: a plain unmount, or a lazy one if the file is busy.
    pub fn request_unmount(&self) -> Result<Unmount> {
        let err = match transport::umount(&self.mountpoint, false) {
            Ok(()) => return Ok(Unmount::Done),
            Err(e) => e,
        };
        match err.raw_os_error() {
            Some(libc::EBUSY) => transport::umount(&self.mountpoint, true)
                .map(|_| Unmount::Detached)
                .map_err(|e| Error::io("lazy unmount", e)),
            // Not root: the setuid helper unmounts (lazily) for the mounting user.
            Some(libc::EPERM) => detach(&self.mountpoint).map(|_| Unmount::Detached),
            Some(libc::EINVAL) if self.finished() => Ok(Unmount::Done),
            _ => Err(Error::io(
                format!("unmount {}", self.mountpoint.display()),
                err,
            )),
        }
    }

    /// Waits for the session to end, then flushes the device.
    pub fn join(mut self) -> Result<()> {
        for w in std::mem::take(&mut self.workers) {
            w.join()
                .map_err(|_| Error::Bug("a FUSE worker thread panicked"))?;
        }
        if let Some(r) = self.readers.take() {
            r.join()?;
        }
        let err = self.worker_error.lock().ok().and_then(|mut g| g.take());
        self.dev.flush()?;
        match err {
            Some(e) => Err(Error::io("FUSE session", std::io::Error::other(e))),
            None => Ok(()),
        }
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
        if !self.workers.is_empty() {
            // Detach the mount; the workers end once its last user is gone.
            if !self.finished() {
                let _ = detach(&self.mountpoint);
            }
            let _ = self.dev.flush();
        }
    }
}

/// Serves `dev` at `mountpoint` until it is unmounted or `stop` is requested (the `ucrypt`
/// command ties SIGINT and SIGTERM to it); returns after every acknowledged write is flushed.
/// Prints one line when ready.
pub fn mount(
    dev: Arc<dyn BlockDev>,
    mountpoint: &Path,
    opts: &MountOptions,
    stop: &ucrypt::Stop,
) -> Result<()> {
    serve(dev, mountpoint, opts, stop, |_| {})
}

/// [`mount`] that hands the mount to `on_mounted` once it serves, before waiting for its end:
/// the caller may keep what it needs of it, such as a [`SizeNotifier`] to tell the kernel of a
/// resize.
pub fn serve(
    dev: Arc<dyn BlockDev>,
    mountpoint: &Path,
    opts: &MountOptions,
    stop: &ucrypt::Stop,
    on_mounted: impl FnOnce(&Mounted),
) -> Result<()> {
    let m = spawn(dev, mountpoint, opts)?;
    on_mounted(&m);
    eprintln!(
        "ucrypt mount: serving {} ({} bytes); {}",
        m.file.display(),
        m.dev.size(),
        m.transport
    );
    // Stop requests acted on so far: an unmount that failed is tried again on the next one.
    let mut handled = 0;
    while !m.finished() {
        let seen = stop.wait_timeout(handled, STOP_POLL);
        if seen > handled {
            handled = seen;
            match m.request_unmount() {
                Ok(Unmount::Done) => eprintln!("ucrypt mount: stop requested: unmounted"),
                Ok(Unmount::Detached) => eprintln!(
                    "ucrypt mount: stop requested: {} is busy (loop device?); detached, serving until its last user closes it",
                    m.file.display()
                ),
                Err(e) => eprintln!("ucrypt mount: stop requested: unmount failed: {e}"),
            }
        }
    }
    m.join()?;
    eprintln!("ucrypt mount: unmounted, all writes flushed");
    Ok(())
}
