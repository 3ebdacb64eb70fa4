//! SIGINT, SIGTERM and SIGHUP in the scenarios that start servers, daemons or a VM (`scale`,
//! `vhost`, `integrity --vm`): caught, so that the run stops at its next step and closes what it
//! opened on the way out (servers stopped on drop, images removed), and any VM running then is
//! stopped at once (the test kit's [`crate::kit::vm::stop_running_vms`]), so that the step
//! waiting for it returns. Nothing outlives the run however it ends: a process killed with
//! SIGKILL still takes its servers (their parent-death signal, [`crate::server::spawn_logged`])
//! and its VM (run-in-vm.sh's) with it; only its images stay, until the next run removes them
//! ([`crate::disk::run_dir`]).

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first SIGINT, SIGTERM or SIGHUP.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
    crate::kit::vm::stop_running_vms();
}

/// Catches SIGINT, SIGTERM and SIGHUP for the rest of the process.
pub fn catch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic and calls kill(2) (async-signal-safe);
        // `signal` installs it with SA_RESTART, so the waits of this process resume after it.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
    }
}

/// An error once a signal came: the caller returns it, closing what it opened on the way.
pub fn check() -> Result<(), String> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err("interrupted by a signal; what was open has been closed".into())
    } else {
        Ok(())
    }
}
