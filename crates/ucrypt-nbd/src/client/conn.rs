//! One connection to the server, shared by every caller thread, kept alive across drops.
//!
//! Who does what:
//! - **Callers** (the volume's threads) register a request as a [`Slot`] under a fresh cookie
//!   ([`Conn::start`]; at most [`INFLIGHT_PER_CONNECTION_MAX`] slots, callers beyond wait for
//!   room), write it to the socket themselves under the writer lock, and wait for their slot
//!   to be answered ([`Conn::finish`]). A caller keeps its own payload: it is the only one who
//!   ever writes it, including when the request must be sent again after a reconnection, so
//!   no buffer is shared between threads.
//! - **The reader thread** reads simple replies, matches each to its slot by cookie (a reply
//!   to no request in flight ends the connection), reads a read's data into a buffer it hands
//!   to the caller, and wakes the caller (thread unpark: no thundering herd on a condvar).
//!   When the connection drops (EOF, error, `NBD_ESHUTDOWN`, or no reply within the remote
//!   timeout while requests wait) it becomes the reconnector: every unanswered request goes
//!   back to `Unsent`, and it dials again with backoff ([`BACKOFF_FIRST`] doubling to
//!   [`BACKOFF_MAX`]) until the remote timeout has passed since the drop. Then every waiting
//!   request fails with a message naming the URI and the timeout, and the connection sleeps
//!   until a new request arrives, which arms a new attempt with a new deadline.
//!
//! Stopping: once the process stops ([`Conn::stopping`]), an unreachable server is given up
//! on within one remote timeout of the stop, and stays given up on. Without that, each request
//! a stopping process still makes (a connection's last flush, each export's flush, the
//! volume's own) would re-arm a fresh remote timeout after the one before had expired, and a
//! stop would wait one remote timeout per request. Requests still unanswered at that
//! deadline fail as lost (they are not reported done), so the stop reports what it could not
//! flush.
//!
//! Resending after a reconnection: writes, trims and zeroings that were in flight are sent
//! again by their callers; flushes that were in flight wait until all of those have been sent
//! (`replay_pending`), so a resent flush follows the resent writes on the wire. A request is
//! reported successful only on the server's reply to it; a dropped connection never turns into
//! success.
//!
//! Limit of reconnection: writes the old server acknowledged but had not flushed are not
//! replayed (we do not keep their data). A server process that was killed keeps them in the
//! page cache of its file; a server machine that lost power may not, exactly as with a disk's
//! volatile cache, and a later flush succeeding on the new connection does not bring them
//! back.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use ucrypt::sync::{lock, WaitCell};

use super::dial::{dial, Dialed, Target};
use crate::proto::transmission::SIMPLE_REPLY_BYTES;
use crate::proto::{
    ExportGeometry, NbdError, RequestHeader, SimpleReply, CMD_DISC, CMD_FLUSH, CMD_READ,
};
use crate::server::Sock;

/// Requests in flight on one connection: the pipelining depth. 64 covers a queue depth of 32
/// on each of two callers' paths with room to spare. (A read's data lands in its caller's
/// buffer: the connection holds no data buffers of its own.)
pub const INFLIGHT_PER_CONNECTION_MAX: usize = 64;
/// First pause between reconnection attempts.
pub const BACKOFF_FIRST: Duration = Duration::from_millis(50);
/// Longest pause between reconnection attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How often a sleeping reader or waiting caller looks at the clock (stop flag, watchdog,
/// deadline); it also bounds how late a close is noticed.
const TICK: Duration = Duration::from_millis(200);
/// Longest single connection attempt, so a black-holed address cannot use up the whole
/// remote timeout in one try.
const DIAL_ATTEMPT_MAX: Duration = Duration::from_secs(10);

/// Why a request did not succeed.
#[derive(Debug)]
pub(crate) enum ReqError {
    /// The server answered with an error.
    Server(NbdError),
    /// The connection was lost and not restored in time (the message says which and why).
    Unavailable(String),
    /// The backend is being dropped.
    Closed,
    /// Our own bug.
    Bug(&'static str),
}

pub(crate) type Outcome = std::result::Result<(), ReqError>;

enum Phase {
    /// Not on the current connection: new, or lost with a dropped one.
    Unsent,
    /// Written on connection generation `gen`; no reply yet.
    Sent { gen: u64, at: Instant },
    /// Answered (or given up on): the caller takes it.
    Done(Outcome),
}

/// Where a read's data lands: the buffer the caller of [`Conn::read_into`] lends for the
/// whole request. Only the reader thread writes through it, and only while the slot is sent
/// on the connection it reads; the caller returns (and the borrow ends) only once that thread
/// has marked the slot done or failed, which it does after its last write there.
#[derive(Clone, Copy)]
struct Dest {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Dest is a borrowed `&mut [u8]` of the caller of `read_into`, which stays blocked
// in `finish` until the reader thread is done with it (see `Dest`); moving the pointer to the
// reader thread is what the borrow was lent for, and no two threads write through it.
unsafe impl Send for Dest {}

struct Slot {
    kind: u16,
    /// Command flags (`CMD_FLAG_FUA`), sent again on a resend.
    flags: u16,
    offset: u64,
    len: u32,
    phase: Phase,
    waiter: Thread,
    /// Counted in `replay_pending`: was in flight when the connection dropped, and must be
    /// resent before any flush is.
    replay: bool,
    /// A read's destination (`read_into`); None for other commands.
    dest: Option<Dest>,
}

enum Link {
    Up,
    Down {
        since: Instant,
        cause: String,
    },
    /// Gave up after the remote timeout; the next request re-arms a `Down`.
    Failed {
        cause: String,
    },
}

struct State {
    /// Generation of the current (or last) connection; bumped by every reconnection.
    gen: u64,
    link: Link,
    next_cookie: u64,
    slots: HashMap<u64, Slot>,
    replay_pending: usize,
    /// Set when the process stops ([`Conn::stopping`]): a lost connection is given up on no
    /// later than this, a connection given up on is not tried again, and requests sent but
    /// unanswered by then count as lost.
    give_up_by: Option<Instant>,
}

struct Writer {
    gen: u64,
    sock: Sock,
}

pub(crate) struct Conn {
    target: Arc<Target>,
    /// What the first connection negotiated; a reconnection must find the same export.
    geometry: ExportGeometry,
    remote_timeout: Duration,
    state: Mutex<State>,
    /// Callers waiting for a free slot.
    room: WaitCell,
    /// The reconnector waiting for its next attempt, or (after giving up) for a new request.
    kick: WaitCell,
    /// Lock order: never taken while `state` is held by the same thread.
    writer: Mutex<Option<Writer>>,
    stop: AtomicBool,
    /// Successful reconnections, for tests and statistics.
    reconnections: AtomicU64,
}

/// Why requests fail after the deadline; the caller's error adds the command and the URI.
/// `stopping`: the deadline was the stop's (see [`Conn::stopping`]).
fn unavailable_message(cause: &str, timeout: Duration, stopping: bool) -> String {
    let within = if stopping {
        "before the process stopped, within the remote timeout of"
    } else {
        "within the remote timeout of"
    };
    format!(
        "server unreachable: connection lost ({cause}) and not restored {within} {} ms",
        timeout.as_millis()
    )
}

impl Conn {
    /// Wraps a freshly dialed connection; the caller starts [`Conn::run_reader`] on a thread
    /// with the returned reader socket.
    pub fn new(
        target: Arc<Target>,
        d: Dialed,
        remote_timeout: Duration,
    ) -> io::Result<(Arc<Conn>, Sock)> {
        prepare(&d.reader, &d.writer, remote_timeout)?;
        let c = Arc::new(Conn {
            target,
            geometry: d.geometry,
            remote_timeout,
            state: Mutex::new(State {
                gen: 0,
                link: Link::Up,
                next_cookie: 1,
                slots: HashMap::with_capacity(INFLIGHT_PER_CONNECTION_MAX),
                replay_pending: 0,
                give_up_by: None,
            }),
            room: WaitCell::new(),
            kick: WaitCell::new(),
            writer: Mutex::new(Some(Writer {
                gen: 0,
                sock: d.writer,
            })),
            stop: AtomicBool::new(false),
            reconnections: AtomicU64::new(0),
        });
        Ok((c, d.reader))
    }

    /// Successful reconnections so far.
    pub fn reconnections(&self) -> u64 {
        self.reconnections.load(Ordering::Relaxed)
    }

    /// Requests on this connection now (in flight or waiting to be resent).
    pub fn load(&self) -> usize {
        lock(&self.state).slots.len()
    }

    /// Registers a request other than a read and sends it if the connection is up. `payload`
    /// is a write's data.
    pub fn start(
        &self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Option<&[u8]>,
    ) -> Result<u64, ReqError> {
        debug_assert!(kind != CMD_READ, "reads go through read_into");
        self.start_with(kind, flags, offset, len, payload, None)
    }

    /// `NBD_CMD_READ` of `buf.len()` bytes at `offset`, straight into `buf`: the reader thread
    /// reads the reply's data from the socket into it (no copy through a buffer of ours).
    pub fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReqError> {
        let len = u32::try_from(buf.len()).map_err(|_| ReqError::Bug("NBD read over 4 GiB"))?;
        let dest = Dest {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        };
        let cookie = self.start_with(CMD_READ, 0, offset, len, None, Some(dest))?;
        // `finish` returns only after the reader thread marked the slot done or failed (or it
        // vanished), i.e. after the reader's last write into `buf`: the borrow covers it.
        self.finish(cookie, None)
    }

    fn start_with(
        &self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Option<&[u8]>,
        dest: Option<Dest>,
    ) -> Result<u64, ReqError> {
        debug_assert!(dest.is_none_or(|d| kind == CMD_READ && d.len == len as usize));
        let mut st = lock(&self.state);
        while st.slots.len() >= INFLIGHT_PER_CONNECTION_MAX {
            if self.stop.load(Ordering::Acquire) {
                return Err(ReqError::Closed);
            }
            st = self.room.wait_timeout(st, TICK);
        }
        if self.stop.load(Ordering::Acquire) {
            return Err(ReqError::Closed);
        }
        if let Link::Failed { cause } = &st.link {
            // A new request after giving up: try again, with a fresh deadline; but not once
            // stopping, when the request fails at once (in `finish`).
            if st.give_up_by.is_none() {
                st.link = Link::Down {
                    since: Instant::now(),
                    cause: cause.clone(),
                };
                self.kick.notify_all();
            }
        }
        let cookie = st.next_cookie;
        st.next_cookie += 1;
        st.slots.insert(
            cookie,
            Slot {
                kind,
                flags,
                offset,
                len,
                phase: Phase::Unsent,
                waiter: thread::current(),
                replay: false,
                dest,
            },
        );
        self.try_send(st, cookie, payload);
        Ok(cookie)
    }

    /// Waits for the request's answer, sending it again whenever a reconnection asks for it.
    /// Must be called by the thread that called [`Conn::start`] (it is the one woken).
    pub fn finish(&self, cookie: u64, payload: Option<&[u8]>) -> Outcome {
        loop {
            let mut st = lock(&self.state);
            let Some(slot) = st.slots.get(&cookie) else {
                return Err(ReqError::Bug("an NBD request vanished before its answer"));
            };
            match &slot.phase {
                Phase::Done(_) => {
                    let Some(slot) = st.slots.remove(&cookie) else {
                        continue;
                    };
                    if slot.replay {
                        self.replayed_one(&mut st);
                    }
                    self.room.notify_one();
                    let Phase::Done(outcome) = slot.phase else {
                        continue;
                    };
                    return outcome;
                }
                Phase::Sent { .. } => {
                    drop(st);
                    thread::park_timeout(TICK);
                }
                Phase::Unsent => match &st.link {
                    Link::Up => {
                        let gated = slot.kind == CMD_FLUSH && st.replay_pending > 0;
                        if gated {
                            drop(st);
                            thread::park_timeout(TICK);
                        } else {
                            self.try_send(st, cookie, payload);
                        }
                    }
                    Link::Down { since, .. } => {
                        // The reconnector fails the request when the deadline passes.
                        let wait = self
                            .remote_timeout
                            .saturating_sub(since.elapsed())
                            .clamp(Duration::from_millis(1), TICK);
                        drop(st);
                        thread::park_timeout(wait);
                    }
                    Link::Failed { cause } => {
                        let msg = unavailable_message(
                            cause,
                            self.remote_timeout,
                            st.give_up_by.is_some(),
                        );
                        if let Some(slot) = st.slots.remove(&cookie) {
                            if slot.replay {
                                self.replayed_one(&mut st);
                            }
                        }
                        self.room.notify_one();
                        return Err(ReqError::Unavailable(msg));
                    }
                },
            }
        }
    }

    /// One request counted in `replay_pending` was resent or dropped; the last one lets the
    /// waiting flushes go.
    fn replayed_one(&self, st: &mut State) {
        st.replay_pending = st.replay_pending.saturating_sub(1);
        if st.replay_pending == 0 {
            for s in st.slots.values() {
                if s.kind == CMD_FLUSH {
                    s.waiter.unpark();
                }
            }
        }
    }

    /// Sends the request if it is unsent, the link is up and (for a flush) no replay is
    /// pending. Consumes the state guard: the socket write happens without it.
    fn try_send(&self, mut st: MutexGuard<'_, State>, cookie: u64, payload: Option<&[u8]>) {
        let gen = st.gen;
        let replay_pending = st.replay_pending;
        let up = matches!(st.link, Link::Up);
        let Some(slot) = st.slots.get_mut(&cookie) else {
            return;
        };
        if !matches!(slot.phase, Phase::Unsent)
            || !up
            || (slot.kind == CMD_FLUSH && replay_pending > 0)
        {
            return;
        }
        slot.phase = Phase::Sent {
            gen,
            at: Instant::now(),
        };
        let header = RequestHeader {
            flags: slot.flags,
            kind: slot.kind,
            cookie,
            offset: slot.offset,
            length: slot.len,
        }
        .encode();
        let replay = std::mem::take(&mut slot.replay);
        drop(st);
        {
            let mut w = lock(&self.writer);
            // A writer of another generation means the link dropped after we marked the slot:
            // the drop set it back to Unsent, and we send it on the next connection.
            if let Some(wr) = w.as_mut().filter(|wr| wr.gen == gen) {
                if write_request(&mut wr.sock, &header, payload).is_err() {
                    // A half-written request leaves the stream unusable: close both directions
                    // so the reader sees it at once and reconnects.
                    let _ = wr.sock.shutdown(Shutdown::Both);
                    *w = None;
                }
            }
        }
        if replay {
            // Counted only once the bytes are on the wire, so a flush released by the count
            // cannot overtake this request to the writer lock. A count of an older
            // generation is void: the reconnection recounted.
            let mut st = lock(&self.state);
            if st.gen == gen {
                self.replayed_one(&mut st);
            }
        }
    }

    /// The reader thread: reads replies, and reconnects when the connection drops, until the
    /// backend is closed.
    pub fn run_reader(self: Arc<Self>, mut sock: Sock) {
        let mut gen = 0;
        loop {
            let cause = self.read_replies(&mut sock, gen);
            let _ = sock.shutdown(Shutdown::Both);
            self.link_down(gen, cause);
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            match self.reconnect() {
                Some((s, g)) => {
                    sock = s;
                    gen = g;
                }
                None => break,
            }
        }
        // Closed: fail whatever is left (nothing should be: the backend is dropped only when
        // no caller uses it).
        let mut st = lock(&self.state);
        for s in st.slots.values_mut() {
            if !matches!(s.phase, Phase::Done(_)) {
                s.phase = Phase::Done(Err(ReqError::Closed));
                s.waiter.unpark();
            }
        }
    }

    /// Reads replies on connection `gen` until it fails; returns why.
    fn read_replies(&self, sock: &mut Sock, gen: u64) -> String {
        let mut last_rx = Instant::now();
        let mut hdr = [0u8; SIMPLE_REPLY_BYTES];
        loop {
            if let Err(cause) = self.read_full(sock, &mut hdr, gen, &mut last_rx) {
                return cause;
            }
            let reply = match SimpleReply::parse(&hdr) {
                Ok(r) => r,
                Err(e) => return e.to_string(),
            };
            let (kind, len, dest) = {
                let st = lock(&self.state);
                match st.slots.get(&reply.cookie) {
                    Some(s) if matches!(s.phase, Phase::Sent { gen: g, .. } if g == gen) => {
                        (s.kind, s.len, s.dest)
                    }
                    _ => {
                        return format!(
                            "NBD protocol violation by the server: reply to handle {:#x}, \
                             which is not in flight",
                            reply.cookie
                        )
                    }
                }
            };
            if reply.error == Some(NbdError::Shutdown) {
                // The server is going away: the request was not done; it is resent on the
                // next connection like everything else in flight.
                return "the server is shutting down (NBD_ESHUTDOWN)".into();
            }
            let outcome = match reply.error {
                None if kind == CMD_READ => {
                    let Some(d) = dest else {
                        return "an NBD read in flight without its buffer (a ucrypt bug)".into();
                    };
                    assert_eq!(d.len, len as usize, "an NBD read's buffer is its length");
                    // SAFETY: the caller of `read_into` lent this buffer of `d.len` bytes and
                    // waits in `finish` until this thread marks the slot done or failed, which
                    // happens below, after this write (and only this thread does either while
                    // the slot is sent on this connection); nothing else writes it meanwhile.
                    let buf = unsafe { std::slice::from_raw_parts_mut(d.ptr, d.len) };
                    if let Err(cause) = self.read_full(sock, buf, gen, &mut last_rx) {
                        return cause;
                    }
                    Ok(())
                }
                None => Ok(()),
                Some(e) => Err(ReqError::Server(e)),
            };
            let mut st = lock(&self.state);
            if let Some(s) = st.slots.get_mut(&reply.cookie) {
                s.phase = Phase::Done(outcome);
                s.waiter.unpark();
            }
        }
    }

    /// Fills `buf`, waking every [`TICK`] to look at the stop flag and the watchdog: a
    /// connection with requests older than the remote timeout and nothing received for as
    /// long is treated as dropped (a hung server or a silently dead network path).
    fn read_full(
        &self,
        sock: &mut Sock,
        buf: &mut [u8],
        gen: u64,
        last_rx: &mut Instant,
    ) -> Result<(), String> {
        let mut done = 0;
        while done < buf.len() {
            match sock.read(&mut buf[done..]) {
                Ok(0) => return Err("the server closed the connection".into()),
                Ok(n) => {
                    done += n;
                    *last_rx = Instant::now();
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) =>
                {
                    if self.stop.load(Ordering::Acquire) {
                        return Err("closing".into());
                    }
                    if last_rx.elapsed() >= self.remote_timeout && self.oldest_sent(gen) {
                        return Err(format!(
                            "no reply from the server for {} ms",
                            self.remote_timeout.as_millis()
                        ));
                    }
                    if self.stop_deadline_passed(gen) {
                        return Err(format!(
                            "no reply from the server within the remote timeout of {} ms \
                             after the process began to stop",
                            self.remote_timeout.as_millis()
                        ));
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }

    /// True if a request on connection `gen` has waited longer than the remote timeout.
    fn oldest_sent(&self, gen: u64) -> bool {
        let st = lock(&self.state);
        st.slots.values().any(|s| {
            matches!(s.phase, Phase::Sent { gen: g, at } if g == gen && at.elapsed() >= self.remote_timeout)
        })
    }

    /// True if the process is stopping, its deadline has passed, and a request on connection
    /// `gen` is still unanswered.
    fn stop_deadline_passed(&self, gen: u64) -> bool {
        let st = lock(&self.state);
        st.give_up_by.is_some_and(|d| Instant::now() >= d)
            && st
                .slots
                .values()
                .any(|s| matches!(s.phase, Phase::Sent { gen: g, .. } if g == gen))
    }

    /// Connection `gen` is gone: every request on it is unsent again, callers are told.
    fn link_down(&self, gen: u64, cause: String) {
        {
            let mut st = lock(&self.state);
            if st.gen == gen && matches!(st.link, Link::Up) {
                st.link = Link::Down {
                    since: Instant::now(),
                    cause,
                };
            }
            for s in st.slots.values_mut() {
                if matches!(s.phase, Phase::Sent { .. }) {
                    s.phase = Phase::Unsent;
                }
                s.waiter.unpark();
            }
        }
        let mut w = lock(&self.writer);
        if w.as_ref().is_some_and(|w| w.gen == gen) {
            if let Some(wr) = w.take() {
                let _ = wr.sock.shutdown(Shutdown::Both);
            }
        }
    }

    /// Dials until connected, given up on, or closed. Returns the new reader socket and its
    /// generation, or `None` when the backend is closed.
    fn reconnect(&self) -> Option<(Sock, u64)> {
        let mut backoff = BACKOFF_FIRST;
        let mut st = lock(&self.state);
        loop {
            if self.stop.load(Ordering::Acquire) {
                return None;
            }
            let (since, cause) = match &st.link {
                Link::Down { since, cause } => (*since, cause.clone()),
                Link::Failed { .. } => {
                    st = self.kick.wait_timeout(st, TICK);
                    backoff = BACKOFF_FIRST;
                    continue;
                }
                // Only this thread brings the link up; seeing it up here is our bug, and the
                // safest answer is to read on: give up the thread's attempt.
                Link::Up => return None,
            };
            let own = since + self.remote_timeout;
            let deadline = st.give_up_by.map_or(own, |d| d.min(own));
            let now = Instant::now();
            if now >= deadline {
                let msg = unavailable_message(&cause, self.remote_timeout, deadline < own);
                for s in st.slots.values_mut() {
                    if !matches!(s.phase, Phase::Done(_)) {
                        s.phase = Phase::Done(Err(ReqError::Unavailable(msg.clone())));
                        s.waiter.unpark();
                    }
                }
                st.link = Link::Failed { cause };
                continue;
            }
            let left = deadline - now;
            drop(st);
            let attempt = dial(&self.target, Instant::now() + left.min(DIAL_ATTEMPT_MAX));
            let attempt = match attempt {
                Ok(d) if same_export(&self.geometry, &d.geometry) => {
                    prepare(&d.reader, &d.writer, self.remote_timeout)
                        .map(|()| d)
                        .map_err(|e| e.to_string())
                }
                Ok(d) => Err(format!(
                    "the export changed across the reconnection (size {} → {}, flags {:#x} → \
                     {:#x})",
                    self.geometry.size_bytes,
                    d.geometry.size_bytes,
                    self.geometry.tx_flags,
                    d.geometry.tx_flags
                )),
                Err(e) => Err(e.to_string()),
            };
            match attempt {
                Ok(d) => {
                    let gen = lock(&self.state).gen + 1;
                    *lock(&self.writer) = Some(Writer {
                        gen,
                        sock: d.writer,
                    });
                    let mut st = lock(&self.state);
                    st.gen = gen;
                    st.link = Link::Up;
                    let mut pending = 0;
                    for s in st.slots.values_mut() {
                        s.replay = matches!(s.phase, Phase::Unsent) && s.kind != CMD_FLUSH;
                        pending += usize::from(s.replay);
                        s.waiter.unpark();
                    }
                    st.replay_pending = pending;
                    self.reconnections.fetch_add(1, Ordering::Relaxed);
                    return Some((d.reader, gen));
                }
                Err(e) => {
                    st = lock(&self.state);
                    // The first cause (what dropped the connection) is the one worth
                    // reporting; the latest attempt's failure is added to it.
                    if let Link::Down { cause, .. } = &mut st.link {
                        let first = cause.split("; last attempt: ").next().unwrap_or("");
                        *cause = format!("{first}; last attempt: {e}");
                    }
                    st = self.kick.wait_timeout(st, backoff.min(left));
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    /// The process is stopping: from now on an unreachable server is given up on within one
    /// remote timeout (the sooner of that and a drop's own deadline), and not tried again
    /// after; requests unanswered by then fail. A server that answers is used as before.
    pub fn stopping(&self) {
        let by = Instant::now() + self.remote_timeout;
        let mut st = lock(&self.state);
        st.give_up_by = Some(st.give_up_by.map_or(by, |d| d.min(by)));
        for s in st.slots.values() {
            s.waiter.unpark();
        }
        self.kick.notify_all();
    }

    /// Stops the connection: a polite `NBD_CMD_DISC`, then the socket closed for writing so
    /// the server ends the session and the reader sees EOF.
    pub fn close(&self) {
        self.stop.store(true, Ordering::Release);
        {
            let mut w = lock(&self.writer);
            if let Some(wr) = w.as_mut() {
                let disc = RequestHeader {
                    flags: 0,
                    kind: CMD_DISC,
                    cookie: 0,
                    offset: 0,
                    length: 0,
                }
                .encode();
                let _ = wr.sock.write_all(&disc);
                let _ = wr.sock.shutdown(Shutdown::Write);
            }
        }
        let _st = lock(&self.state);
        self.kick.notify_all();
        self.room.notify_all();
    }
}

/// The socket settings of the transmission phase: reads wake every [`TICK`] for the watchdog;
/// a write blocked longer than the remote timeout means the connection is dead.
fn prepare(reader: &Sock, writer: &Sock, remote_timeout: Duration) -> io::Result<()> {
    reader.set_read_timeout(Some(TICK))?;
    writer.set_write_timeout(Some(remote_timeout.max(TICK)))
}

/// A reconnection must reach the same export: same size, same capabilities, same block sizes
/// (requests in flight were cut to the old ones).
fn same_export(a: &ExportGeometry, b: &ExportGeometry) -> bool {
    a.size_bytes == b.size_bytes
        && a.tx_flags == b.tx_flags
        && a.min_block_bytes == b.min_block_bytes
        && a.max_payload_bytes == b.max_payload_bytes
}

/// Writes a request header and its payload, in as few system calls as the socket allows.
fn write_request(sock: &mut Sock, header: &[u8], payload: Option<&[u8]>) -> io::Result<()> {
    let payload = payload.unwrap_or(&[]);
    let total = header.len() + payload.len();
    let mut done = 0;
    while done < total {
        let r = if done < header.len() {
            sock.write_vectored(&[IoSlice::new(&header[done..]), IoSlice::new(payload)])
        } else {
            sock.write(&payload[done - header.len()..])
        };
        match r {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
