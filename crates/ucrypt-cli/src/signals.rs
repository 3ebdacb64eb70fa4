//! Stop signals for the long-running verbs (serve, mount, ublk).
//!
//! SIGINT and SIGTERM are blocked in the main thread before the volume is opened, so every
//! thread spawned afterwards (the engine's workers included) inherits the mask and none takes
//! the default action (killing the process with acknowledged writes unflushed). Each front end
//! then waits for them in one place (`sigwait`/`sigtimedwait`) and shuts down cleanly.

/// Blocks SIGINT and SIGTERM in the calling thread and returns the set. Call it first, before
/// any thread is spawned.
pub fn block_stop_signals() -> Result<libc::sigset_t, String> {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it; pthread_sigmask only
    // reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err("cannot block SIGINT/SIGTERM".into());
        }
        Ok(set)
    }
}
