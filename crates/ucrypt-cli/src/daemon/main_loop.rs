//! The daemon's main loop: one thread that waits in one `poll` on SIGINT/SIGTERM (a
//! signalfd), the control socket's listener, a wake-up socket (close requests, the end of a
//! ublk or vhost-user thread, the volume's first request after the heap's trim) and a FUSE
//! mount's connection, and decides when the daemon ends ([`Exit`]); `serve.rs` then tears it
//! down. With `--nbd` it runs inside the NBD server's waits ([`NbdSide`], [`MainWatch`]), so
//! the NBD side needs no thread of its own. It sleeps until an event or the heap's trim
//! ([`main_loop_sleep`]), and looks every [`POLL`] only while a deferred close waits for the
//! last user or an ended FUSE mount's workers finish.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use ucrypt::{BlockDev, Stop};
use ucrypt_nbd::server::{Interest, Listen};

use super::proto::Response;
use super::server;
use crate::error::{CliError, CliResult};
use crate::metrics::SharedNbdSocket;

/// How often the main loop looks at a pending deferred close and at the workers of a FUSE
/// mount whose connection ended (signals, control connections, close requests, the end of a
/// ublk or vhost-user thread and of a FUSE connection wake it at once).
const POLL: Duration = Duration::from_millis(200);

/// What a control connection asks of the main loop.
pub(super) enum Event {
    Close {
        force: bool,
        reply: SyncSender<Response>,
        /// Dropped by the connection's thread once the answer is written: only then may the
        /// daemon exit.
        written: Receiver<()>,
    },
}

/// What the main loop watches: signals, close requests, a pending deferred close (and whether
/// the device is in use), the control socket, the volume's use, and the NBD server to stop
/// first.
pub(super) struct Beside<'a> {
    pub(super) signals: &'a crate::signals::SignalFd,
    pub(super) events: &'a Receiver<Event>,
    /// The volume's name, for the log.
    pub(super) name: &'a str,
    /// A FUSE mount's connection (-1 for other front ends): it reports an error once the
    /// mount ended (unmounted from outside).
    pub(super) fuse_fd: RawFd,
    pub(super) deferred: &'a AtomicBool,
    pub(super) in_use: &'a dyn Fn() -> bool,
    pub(super) nbd: Option<NbdSide>,
    /// The control socket, served from the main loop.
    pub(super) control: server::Acceptor,
    /// Readable when a control connection sent an event.
    pub(super) wake: UnixStream,
    /// The volume's requests so far (reads and writes): unchanged for [`HEAP_TRIM_IDLE`], the
    /// heap's free pages go back to the kernel.
    pub(super) requests: &'a dyn Fn() -> u64,
    /// The volume's activity, armed once the heap is trimmed: its next request wakes the
    /// main loop (through `wake`), which otherwise sleeps with no timeout.
    pub(super) activity: &'a ucrypt::sync::Tripwire,
}

/// How long the volume is idle before the daemon gives the heap's free pages back: long
/// enough that the threads started under load (engine workers, FUSE readers, the pool's
/// reaper: `ucrypt::pool::POOL_IDLE_RELEASE` each) have ended and freed theirs.
const HEAP_TRIM_IDLE: Duration = Duration::from_secs(2 * ucrypt::pool::POOL_IDLE_RELEASE.as_secs());

/// Gives the heap's free pages back to the kernel (glibc keeps what a busy moment freed: a
/// megabyte of an idle daemon's anonymous memory).
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: malloc_trim takes no pointers; it only returns the allocator's free memory.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// The NBD server a daemon runs beside its device (`open --nbd`): stopped before teardown.
/// Its socket may be shared with other daemons' exports (`ucrypt_nbd::server::share`): the
/// first to name PATH listens and negotiates for all; the others join it. It is served on the
/// main thread, with the main loop's events in the same `poll` ([`MainWatch`]), so an idle
/// daemon has no thread for it.
pub(super) struct NbdSide {
    attached: ucrypt_nbd::server::share::Attached,
    opts: ucrypt_nbd::server::ServerOptions,
}

impl NbdSide {
    /// Attaches export `name` to the socket at `at` here (so that a path refused, or a name
    /// served there already, is the open's error); [`NbdSide::serve`] serves it.
    pub(super) fn start(
        name: &str,
        dev: &Arc<dyn BlockDev>,
        at: &Listen,
    ) -> CliResult<(NbdSide, SharedNbdSocket)> {
        let Listen::Unix(path) = at else {
            return Err(CliError::Usage(
                "open --nbd takes unix:PATH; NBD over TCP (with TLS) is `ucrypt serve`".into(),
            ));
        };
        let attached = ucrypt_nbd::server::share::attach(path, name, dev.clone(), dev.read_only())?;
        let socket = SharedNbdSocket {
            listen: at.to_string(),
            state: attached.state(),
        };
        if !attached.owner() {
            eprintln!(
                "ucrypt daemon {name}: NBD export joined the listener at {}",
                path.display()
            );
        }
        let opts = ucrypt_nbd::server::ServerOptions {
            read_only: dev.read_only(),
            tls: None,
            insecure_plaintext: false,
            pid_file: None,
            announce: false,
            poll: Duration::ZERO,
            poll_backoff: true,
            workers: ucrypt_nbd::server::WORKERS_PER_CONNECTION,
            idle_timeout: ucrypt_nbd::server::IDLE_TIMEOUT_DEFAULT,
            connections_max: ucrypt_nbd::server::CONNECTIONS_MAX_DEFAULT,
        };
        Ok((NbdSide { attached, opts }, socket))
    }

    /// Serves the socket on this thread, with `main`'s events in every wait, until `main`
    /// decides to end; then lets every NBD connection finish and returns how the main loop
    /// ends (`None`: the NBD side ended first, with an error, and the main loop goes on
    /// alone).
    fn serve(self, main: &mut MainLoop<'_>, front_ended: &dyn Fn() -> bool) -> Option<Exit> {
        let stop = Stop::new();
        let mut watch = MainWatch {
            main,
            front_ended,
            stop: stop.clone(),
            exit: None,
        };
        let r =
            ucrypt_nbd::server::share::serve_watching(self.attached, self.opts, stop, &mut watch);
        if let Err(e) = r {
            eprintln!("ucrypt daemon: NBD server: {e}");
        }
        watch.exit
    }
}

/// The main loop as the NBD server's [`ucrypt_nbd::server::Watch`]: once it decides to end,
/// it stops the NBD side (NBD clients go first: after that nothing reaches the volume but the
/// device's users).
struct MainWatch<'m, 'a> {
    main: &'m mut MainLoop<'a>,
    front_ended: &'m dyn Fn() -> bool,
    stop: Stop,
    exit: Option<Exit>,
}

impl ucrypt_nbd::server::Watch for MainWatch<'_, '_> {
    fn fds(&mut self, out: &mut Vec<(RawFd, Interest)>) {
        if self.exit.is_some() {
            return;
        }
        out.extend(self.main.fds());
    }

    fn ready(&mut self, events: &[bool]) {
        if self.exit.is_some() {
            return;
        }
        let mut seen = [false; MAIN_FDS];
        for (s, e) in seen.iter_mut().zip(events) {
            *s = *e;
        }
        if let Some(exit) = self.main.ready(seen, self.front_ended) {
            self.exit = Some(exit);
            self.stop.request();
        }
    }

    fn timeout_ms(&self) -> i32 {
        if self.exit.is_some() {
            return -1;
        }
        poll_ms(self.main.sleep())
    }
}

/// Wakes the main loop when dropped: a front end's thread holds one, so that its end (however
/// it ends) is seen at once.
pub(super) struct WakeOnEnd(pub(super) UnixStream);

impl Drop for WakeOnEnd {
    fn drop(&mut self) {
        // Non-blocking: a full socket is awake already.
        let _ = (&self.0).write(&[1]);
    }
}

/// How long the main loop may sleep before it must look again (`None`: until an event), with
/// `idle_for` since the volume's requests last changed and `trimmed` whether the heap was
/// trimmed since: every [`POLL`] while a deferred close is pending (the last user's going is
/// no event) or the front end is ending (`looks_at_front`: a FUSE connection ended, its
/// workers not yet); otherwise until the trim is due, and after it until an event (the
/// volume's next request is one: the loop arms the volume's activity wire when it trims).
fn main_loop_sleep(
    deferred: bool,
    looks_at_front: bool,
    idle_for: Duration,
    trimmed: bool,
) -> Option<Duration> {
    if deferred || looks_at_front {
        Some(POLL)
    } else if trimmed {
        None
    } else {
        Some(
            HEAP_TRIM_IDLE
                .saturating_sub(idle_for)
                .max(Duration::from_millis(1)),
        )
    }
}

/// The main loop's wake-up socket pair (both ends non-blocking).
pub(super) fn wake_pair() -> std::io::Result<(UnixStream, UnixStream)> {
    let (a, b) = UnixStream::pair()?;
    a.set_nonblocking(true)?;
    b.set_nonblocking(true)?;
    Ok((a, b))
}

/// `timeout` in milliseconds for `poll` (-1: none).
fn poll_ms(timeout: Option<Duration>) -> i32 {
    timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32)
}

/// Waits up to `timeout` (`None`: no limit) until one of `fds` has an event (`(fd, events)`:
/// `POLLIN`, or 0 for errors and hang-ups only); returns which have (all false after the
/// timeout or an interrupted wait). A negative fd is left out.
fn wait_events<const N: usize>(
    fds: [(i32, libc::c_short); N],
    timeout: Option<Duration>,
) -> [bool; N] {
    let mut p = fds.map(|(fd, events)| libc::pollfd {
        fd,
        events,
        revents: 0,
    });
    let ms = poll_ms(timeout);
    // SAFETY: `p` is a live array of N pollfds, the count given.
    let n = unsafe { libc::poll(p.as_mut_ptr(), N as libc::nfds_t, ms) };
    if n <= 0 {
        return [false; N];
    }
    p.map(|q| q.revents != 0)
}

/// Why the main loop ends.
pub(super) enum Exit {
    /// `close` (or `close --force`): answered once the volume is down.
    Close {
        force: bool,
        reply: SyncSender<Response>,
        written: Receiver<()>,
    },
    /// A deferred close whose last user went.
    Deferred,
    /// SIGINT or SIGTERM.
    Signal,
    /// The front end ended on its own (unmounted from outside, a failed ublk or vhost
    /// thread).
    FrontEnded,
    /// Every sender of events is gone: nothing more can reach the daemon.
    Orphaned,
}

/// Descriptors the main loop waits on: the signals, the control socket, the wake-up socket,
/// a FUSE mount's connection.
const MAIN_FDS: usize = 4;

/// The main loop between two waits: what it watches and what it saw last. It runs in its own
/// `poll` ([`main_loop`]) or, with `--nbd`, inside the NBD server's ([`MainWatch`]).
struct MainLoop<'a> {
    signals: &'a crate::signals::SignalFd,
    events: &'a Receiver<Event>,
    deferred: &'a AtomicBool,
    in_use: &'a dyn Fn() -> bool,
    control: server::Acceptor,
    wake: UnixStream,
    requests: &'a dyn Fn() -> u64,
    activity: &'a ucrypt::sync::Tripwire,
    name: &'a str,
    /// The requests last seen, since when, and whether the heap was trimmed since.
    seen: u64,
    seen_at: std::time::Instant,
    trimmed: bool,
    /// A FUSE mount's connection, which reports an error once it ended (unmounted from
    /// outside); -1 from then on (and for other front ends).
    fuse_fd: RawFd,
    /// The FUSE connection ended, its workers not yet: the loop looks every [`POLL`].
    front_ending: bool,
}

impl MainLoop<'_> {
    fn fds(&self) -> [(RawFd, Interest); MAIN_FDS] {
        [
            (self.signals.as_raw_fd(), Interest::Input),
            (self.control.as_raw_fd(), Interest::Input),
            (self.wake.as_raw_fd(), Interest::Input),
            (self.fuse_fd, Interest::HangUp),
        ]
    }

    fn sleep(&self) -> Option<Duration> {
        main_loop_sleep(
            self.deferred.load(Ordering::Relaxed),
            self.front_ending,
            self.seen_at.elapsed(),
            self.trimmed,
        )
    }

    /// Handles one wait's events; says when the loop ends.
    fn ready(&mut self, events: [bool; MAIN_FDS], front_ended: &dyn Fn() -> bool) -> Option<Exit> {
        let [signalled, connecting, woken, fuse_ended] = events;
        if fuse_ended {
            (self.fuse_fd, self.front_ending) = (-1, true);
        }
        if connecting {
            self.control.accept_pending();
        }
        if woken {
            let _ = self.wake.read(&mut [0u8; 16]);
        }
        match self.events.try_recv() {
            Ok(Event::Close {
                force,
                reply,
                written,
            }) => {
                return Some(Exit::Close {
                    force,
                    reply,
                    written,
                })
            }
            Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => return Some(Exit::Orphaned),
        }
        if self.deferred.load(Ordering::Relaxed) && !(self.in_use)() {
            eprintln!(
                "ucrypt daemon {}: the last user went: deferred close",
                self.name
            );
            return Some(Exit::Deferred);
        }
        if let Some(sig) = signalled.then(|| self.signals.take()).flatten() {
            eprintln!("ucrypt: signal {sig}: stopping");
            eprintln!("ucrypt daemon {}: signal: closing", self.name);
            return Some(Exit::Signal);
        }
        if front_ended() {
            eprintln!(
                "ucrypt daemon {}: the front end ended (unmounted from outside?): closing",
                self.name
            );
            return Some(Exit::FrontEnded);
        }
        let now = (self.requests)();
        if now != self.seen {
            (self.seen, self.seen_at, self.trimmed) = (now, std::time::Instant::now(), false);
        } else if !self.trimmed && self.seen_at.elapsed() >= HEAP_TRIM_IDLE {
            trim_heap();
            self.trimmed = true;
            // From now on the loop sleeps until an event; the next request is one. One that
            // came before the wire was armed is seen here.
            self.activity.arm();
            if (self.requests)() != self.seen {
                self.trimmed = false;
            }
        }
        None
    }
}

/// Runs the main loop until it ends, and says why (the caller tears down): in its own `poll`,
/// or with an NBD side inside the NBD server's waits, whose connections are finished by then.
pub(super) fn run(beside: Beside<'_>, front_ended: &dyn Fn() -> bool) -> Exit {
    let Beside {
        signals,
        events,
        name,
        fuse_fd,
        deferred,
        in_use,
        nbd,
        control,
        wake,
        requests,
        activity,
    } = beside;
    let mut main = MainLoop {
        signals,
        events,
        deferred,
        in_use,
        control,
        wake,
        requests,
        activity,
        name,
        seen: requests(),
        seen_at: std::time::Instant::now(),
        trimmed: false,
        fuse_fd,
        front_ending: false,
    };
    if let Some(exit) = nbd.and_then(|n| n.serve(&mut main, front_ended)) {
        return exit;
    }
    loop {
        let fds = main.fds().map(|(fd, interest)| {
            let events = match interest {
                Interest::Input => libc::POLLIN,
                Interest::HangUp => 0,
            };
            (fd, events)
        });
        if let Some(e) = main.ready(wait_events(fds, main.sleep()), front_ended) {
            return e;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_main_loop_sleeps_until_the_heap_trim_is_due() {
        let s = Duration::from_secs;
        // Nothing pending: until the trim is due, then until an event.
        assert_eq!(
            main_loop_sleep(false, false, s(3), false),
            Some(HEAP_TRIM_IDLE - s(3))
        );
        assert_eq!(
            main_loop_sleep(false, false, HEAP_TRIM_IDLE * 2, false),
            Some(Duration::from_millis(1))
        );
        assert_eq!(main_loop_sleep(false, false, s(3600), true), None);
        // A deferred close or a FUSE front end: looked at every POLL.
        assert_eq!(main_loop_sleep(true, false, s(3600), true), Some(POLL));
        assert_eq!(main_loop_sleep(false, true, s(0), false), Some(POLL));
    }
}
