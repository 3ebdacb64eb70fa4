//! The one stop mechanism of the long-running verbs (serve, mount, ublk): SIGINT and SIGTERM
//! become a request on a [`Stop`], which every front end takes.
//!
//! The signals are blocked in the main thread before the volume is opened, so every thread
//! spawned afterwards (the engine's workers included) inherits the mask and none takes the
//! default action (killing the process with acknowledged writes unflushed). One thread takes
//! them synchronously (`sigwait`) and requests the stop; a second signal requests it again
//! (FUSE then retries an unmount that failed).
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

/// Blocks SIGINT and SIGTERM in the calling thread and starts the thread that turns them into
/// stop requests. Call it first, before any other thread is spawned.
pub fn stop_on_signals() -> Result<Stop, CliError> {
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
