//! Waiting on sockets and a [`Stop`] at once, with no timeout: the stop request writes to an
//! eventfd ([`Stop::on_request`]), which the server's loops `poll` beside their sockets. An
//! idle server then sleeps in the kernel until a client, a member or the stop comes: no
//! periodic wakeup, no thread of its own.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use ucrypt::Stop;

/// An eventfd that becomes readable, for good, once its [`Stop`] is requested (it is never
/// read, so every loop that polls it afterwards returns at once).
pub(crate) struct StopFd(Arc<OwnedFd>);

impl StopFd {
    pub(crate) fn new(stop: &Stop) -> io::Result<StopFd> {
        // SAFETY: eventfd takes an initial count and flags and returns a new descriptor (or
        // -1); no memory is involved.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` was just returned by eventfd and is owned by nothing else.
        let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let writer = fd.clone();
        stop.on_request(move || {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes the 8 bytes of a live array to an eventfd the closure keeps
            // open; a full counter (EAGAIN) leaves it readable, which is all that matters.
            unsafe {
                libc::write(writer.as_raw_fd(), one.as_ptr().cast(), one.len());
            }
        });
        Ok(StopFd(fd))
    }

    /// Whether the stop was requested, from the descriptor alone (what a `poll` on it says).
    #[cfg(test)]
    pub(crate) fn signalled(&self) -> bool {
        let mut p = [pollin(self.as_raw_fd())];
        wait(&mut p, 0) > 0
    }
}

impl AsRawFd for StopFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A pollfd waiting for `fd` to become readable (or hung up).
pub(crate) fn pollin(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Waits until one of `fds` has an event, or `timeout_ms` passed (-1: no timeout); returns
/// how many have one (0 after the timeout or a signal: callers loop). A negative fd is
/// skipped, as poll(2) does.
pub(crate) fn wait(fds: &mut [libc::pollfd], timeout_ms: i32) -> usize {
    for p in fds.iter_mut() {
        p.revents = 0;
    }
    // SAFETY: `fds` is a live, initialised array of pollfds of the length given.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    usize::try_from(n).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_stop_request_wakes_a_wait_without_timeout() {
        let stop = Stop::new();
        let fd = StopFd::new(&stop).unwrap();
        assert!(!fd.signalled(), "readable before the request");
        let raw = fd.as_raw_fd();
        let t0 = Instant::now();
        let waiter = std::thread::spawn(move || {
            let mut p = [pollin(raw)];
            while wait(&mut p, -1) == 0 {}
            p[0].revents & libc::POLLIN != 0
        });
        std::thread::sleep(Duration::from_millis(50));
        stop.request();
        assert!(waiter.join().unwrap(), "woken by something else");
        assert!(t0.elapsed() >= Duration::from_millis(50));
        // Readable for good: a later loop sees it at once, a second request changes nothing.
        stop.request();
        assert!(fd.signalled());
        assert!(fd.signalled());
    }

    #[test]
    fn a_stop_requested_before_sets_the_fd_at_once() {
        let stop = Stop::new();
        stop.request();
        assert!(StopFd::new(&stop).unwrap().signalled());
    }
}
