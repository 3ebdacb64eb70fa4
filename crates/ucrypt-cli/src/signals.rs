//! The one stop mechanism of the long-running verbs (serve, mount, ublk): SIGINT and SIGTERM
//! become a request on a [`Stop`], which every front end takes.
//!
//! The signals are blocked in the main thread before the volume is opened, so every thread
//! spawned afterwards (the engine's workers included) inherits the mask and none takes the
//! default action (killing the process with acknowledged writes unflushed). One thread takes
//! them synchronously (`sigwait`) and requests the stop; a second signal requests it again
//! (FUSE then retries an unmount that failed).
//!
//! The `open` daemon takes them on its main loop instead, through a signalfd ([`SignalFd`]),
//! beside its control socket: one thread less.
//!
//! Until the verb calls [`started`], the volume is still being opened (a slow KDF, a FIFO or a
//! device that does not answer): nothing has been acknowledged to anyone, so a signal then
//! ends the process at once (exit 128 + signal, as a shell reports a signal's death), after
//! removing the files registered with [`remove_if_interrupted`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use ucrypt::Stop;

use crate::error::CliError;

/// Set by [`started`]: from then on a signal is a stop request.
static STARTED: AtomicBool = AtomicBool::new(false);
/// Files made during start-up that an interrupted start-up removes.
static STARTUP_FILES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The volume is open and the service about to run: SIGINT and SIGTERM now stop it in order.
pub fn started() {
    STARTED.store(true, Ordering::SeqCst);
}

/// Removes `path` if a signal ends the start-up.
pub fn remove_if_interrupted(path: PathBuf) {
    ucrypt::sync::lock(&STARTUP_FILES).push(path);
}

/// Blocks SIGINT and SIGTERM in the calling thread (and so in every thread it spawns after).
fn block_stop_signals() -> Result<libc::sigset_t, CliError> {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it; pthread_sigmask only
    // reads it.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(CliError::Core(ucrypt::Error::io(
                "blocking SIGINT/SIGTERM",
                std::io::Error::from_raw_os_error(rc),
            )));
        }
        set
    };
    Ok(set)
}

/// SIGINT and SIGTERM, blocked in every thread, readable from a file descriptor that `poll`
/// can wait on (signalfd(2)).
pub struct SignalFd {
    fd: std::os::fd::OwnedFd,
}

impl SignalFd {
    /// Blocks the signals and opens the descriptor. Call it first, before any other thread is
    /// spawned: a thread made before would take the signals' default action.
    pub fn new() -> Result<SignalFd, CliError> {
        use std::os::fd::FromRawFd;
        let set = block_stop_signals()?;
        // SAFETY: `set` is an initialised sigset; -1 asks for a new descriptor.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if fd < 0 {
            return Err(CliError::Core(ucrypt::Error::io(
                "signalfd",
                std::io::Error::last_os_error(),
            )));
        }
        // SAFETY: just opened, owned by nobody else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        Ok(SignalFd { fd })
    }

    /// The signal pending, if any (without waiting), taken off the queue.
    pub fn take(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        // SAFETY: plain data, filled by read below.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let len = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: `info` is a live buffer of `len` bytes.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut info as *mut libc::signalfd_siginfo).cast(),
                len,
            )
        };
        (n == len as isize).then_some(info.ssi_signo as i32)
    }
}

impl std::os::fd::AsRawFd for SignalFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.fd)
    }
}

/// Blocks SIGINT and SIGTERM in the calling thread and starts the thread that turns them into
/// stop requests. Call it first, before any other thread is spawned.
pub fn stop_on_signals() -> Result<Stop, CliError> {
    let set = block_stop_signals()?;
    let stop = Stop::new();
    let s = stop.clone();
    std::thread::Builder::new()
        .name("ucrypt-signals".into())
        .spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is a valid, initialised sigset owned by this closure; sigwait
            // writes one int.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                if !STARTED.load(Ordering::SeqCst) {
                    eprintln!("ucrypt: signal {sig} while opening the volume: exiting");
                    for p in ucrypt::sync::lock(&STARTUP_FILES).iter() {
                        let _ = std::fs::remove_file(p);
                    }
                    std::process::exit(128 + sig);
                }
                eprintln!("ucrypt: signal {sig}: stopping");
                s.request();
            }
        })
        .map_err(|e| CliError::Core(ucrypt::Error::io("starting the signal thread", e)))?;
    Ok(stop)
}
