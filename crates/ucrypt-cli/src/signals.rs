//! The one stop mechanism of the long-running verbs (serve, mount, ublk): SIGINT and SIGTERM
//! become a request on a [`Stop`], which every front end takes.
//!
//! The signals are blocked in the main thread before the volume is opened, so every thread
//! spawned afterwards (the engine's workers included) inherits the mask and none takes the
//! default action (killing the process with acknowledged writes unflushed). One thread takes
//! them synchronously (`sigwait`) and requests the stop; a second signal requests it again
//! (FUSE then retries an unmount that failed).

use ucrypt::Stop;

use crate::error::CliError;

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
                eprintln!("ucrypt: signal {sig}: stopping");
                s.request();
            }
        })
        .map_err(|e| CliError::Core(ucrypt::Error::io("starting the signal thread", e)))?;
    Ok(stop)
}
