//! One connection: the handshake (driven over the codec), then the transmission phase with a
//! reader (this thread), a bounded worker pool and a writer lock.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::proto::transmission::{REQUEST_HEADER_BYTES, SIMPLE_REPLY_BYTES};
use crate::proto::{
    self as nbd, Command, Decoded, ExportInfo, Handshake, NbdError, RequestHeader, Step, TlsPolicy,
};
use crate::{Error, Result};
use ucrypt::BlockDev;

use super::budget::{Budget, Charge, ConnBudget};
use super::buf::{IoBuf, Spares};
use super::queue::{Pushed, Queue};
use super::sock::Sock;
use super::{tls, Activity, Entry, Export, Shared};
use ucrypt::sync::{lock, SpinGovernor};

/// Requests parsed but not yet picked up by a worker; beyond this the reader stops reading
/// and the client's socket buffer fills (back-pressure).
pub const QUEUED_REQUESTS_MAX: usize = 64;
/// A client must finish option haggling within this time, so a silent client cannot hold a
/// connection slot forever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// A reply that cannot be written for this long means the client stopped reading: the
/// connection is dropped, so a stuck client cannot pin workers (or block server shutdown).
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Reader buffer while requests come in bursts (requests queued for workers): many 28-byte
/// headers (and small writes) per syscall.
const READ_BUFFER_BYTES: usize = 256 * 1024;
/// Reader buffer otherwise (an idle connection, or one request at a time): room for a request
/// header and a write of up to 8 KiB in one read. The buffer is zeroed when first filled, so
/// its size is most of what an idle connection holds.
const READ_BUFFER_IDLE_BYTES: usize = 12 * 1024;
/// Chunk used to read and drop the payload of a refused write.
const DISCARD_CHUNK_BYTES: usize = 64 * 1024;

// After serving a request on the reader's own thread (a client with one request at a time),
// the reader polls the socket for the next request for `Shared::poll` (`--spin-us`, default
// 50 µs) before it sleeps: a sleeping thread costs a wake-up on every request, which on
// virtual machines (an inter-processor interrupt through the hypervisor) is several times the
// whole cost of serving 4 KiB.

/// Requests at least this large check for a waiting next request before running on the
/// reader's thread (one system call, small beside the work of such a request).
const INLINE_PEEK_MIN_BYTES: u64 = 64 << 10;
/// Write payloads at least this large are received straight into their buffer (after what
/// the read buffer already holds of them), never through the read buffer: with the read
/// buffer's read-ahead, part of every large payload would be copied once more, the only copy
/// the server would add to a write beside the cipher's own pass.
const DIRECT_PAYLOAD_MIN_BYTES: u64 = 64 << 10;

/// The request stream: a socket whose reads may first poll without sleeping.
struct RequestStream {
    sock: Sock,
    /// Poll for up to `poll_for` before a sleeping read.
    poll: bool,
    poll_for: Duration,
    /// Backs polling off when it does not pay (`None`: always poll, `--spin-always`).
    governor: Option<SpinGovernor>,
}

impl RequestStream {
    /// Whether bytes (the next request) are waiting in the socket, without reading them.
    fn pending(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: recv writes at most 1 byte into `byte`, which lives across the call.
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n > 0
    }
}

impl Read for RequestStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let may_poll = self.poll
            && !self.poll_for.is_zero()
            && !buf.is_empty()
            && self.governor.as_mut().is_none_or(SpinGovernor::may_spin);
        if may_poll {
            let fd = self.sock.as_raw_fd();
            let start = std::time::Instant::now();
            let mut waited = false;
            loop {
                // SAFETY: recv writes at most buf.len() bytes into buf, which we borrow
                // mutably for the call.
                let n = unsafe {
                    libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
                };
                if n >= 0 {
                    if let (true, Some(g)) = (waited, self.governor.as_mut()) {
                        g.record(true);
                    }
                    return Ok(n as usize);
                }
                let e = io::Error::last_os_error();
                if !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) {
                    return Err(e);
                }
                if start.elapsed() >= self.poll_for {
                    if let Some(g) = self.governor.as_mut() {
                        g.record(false);
                    }
                    break;
                }
                waited = true;
                // Let a client sharing this CPU run (it is what we wait for).
                // SAFETY: sched_yield takes no arguments and cannot fail in a harmful way.
                unsafe { libc::sched_yield() };
            }
        }
        self.sock.read(buf)
    }
}

fn net(context: &str, e: io::Error) -> Error {
    Error::io(context.to_string(), e)
}

/// The export a handshake chose.
enum Chosen {
    /// One of this server's, by index, with the size the client was told.
    Local(usize, u64),
    /// A member's of the shared socket this server owns.
    Member(Arc<super::share::Member>),
}

/// Counts a handshake in progress (taken by `Conns::admit`) until dropped.
struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves one connection to its end, keeping `activity` up to date.
pub fn run(sock: Sock, shared: &Shared, activity: &Arc<Activity>, entry: Entry) -> Result<()> {
    // The size the client was told: a client handed over by the socket's owner was told the
    // size this export registered with.
    let (sock, export, size_bytes) = match entry {
        Entry::Transmit(i) => {
            let size = shared.exports.get(i).map_or(0, |e| e.info.size_bytes);
            (sock, i, size)
        }
        Entry::Handshake => {
            let pending = Pending(&shared.handshakes);
            let chosen = negotiate(sock, shared);
            drop(pending);
            match chosen? {
                None => return Ok(()),
                Some((sock, Chosen::Local(i, size))) => (sock, i, size),
                Some((sock, Chosen::Member(m))) => {
                    return m.pass(&sock).map_err(|e| {
                        net(&format!("passing a client to export '{}'", m.info.name), e)
                    });
                }
            }
        }
    };
    let Some(export) = shared.exports.get(export) else {
        return Err(Error::Bug("a connection for an export this server lacks"));
    };
    transmit(sock, export, size_bytes, shared, activity.clone())
}

/// The export's size for a new client: its volume's size now, in whole NBD blocks.
fn size_now(e: &Export) -> u64 {
    let block = u64::from(nbd::MIN_BLOCK_BYTES);
    e.dev.size() / block * block
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` on a clean EOF before the first byte.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Runs the handshake over this server's exports and, on a shared socket it owns, its
/// members' (as registered when the client connected); `None` if the client left or aborted.
fn negotiate(mut sock: Sock, shared: &Shared) -> Result<Option<(Sock, Chosen)>> {
    let policy = if shared.tls.is_some() {
        TlsPolicy::Required
    } else {
        TlsPolicy::Disabled
    };
    let members = shared
        .share
        .as_ref()
        .map(|r| r.snapshot())
        .unwrap_or_default();
    // This server's exports with the size their volume has now (it may have been resized
    // since the server started); each client keeps the size it was told.
    let infos: Vec<ExportInfo> = shared
        .exports
        .iter()
        .map(|e| ExportInfo {
            size_bytes: size_now(e),
            ..e.info.clone()
        })
        .chain(members.iter().map(|m| m.info.clone()))
        .collect();
    let infos_sizes: Vec<u64> = infos.iter().map(|i| i.size_bytes).collect();
    let mut hs = Handshake::new(infos, policy);
    sock.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| net("socket", e))?;
    let mut buf = Vec::new();
    loop {
        if shared.stop.requested() {
            hs.set_shutting_down();
        }
        let out = hs.take_output();
        if !out.is_empty() {
            sock.write_all(&out)
                .map_err(|e| net("sending handshake", e))?;
        }
        let want = hs.bytes_wanted();
        buf.resize(want, 0);
        match read_full(&mut sock, &mut buf) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) => return Err(net("reading handshake", e)),
        }
        match hs.feed(&buf)? {
            Step::Continue => {}
            Step::StartTls => {
                sock.write_all(&hs.take_output())
                    .map_err(|e| net("sending handshake", e))?;
                let Some(cfg) = shared.tls.clone() else {
                    return Err(Error::Bug("STARTTLS accepted without a TLS configuration"));
                };
                sock = tls::upgrade(sock, cfg).map_err(|e| net("starting TLS", e))?;
                sock.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
                    .map_err(|e| net("socket", e))?;
                hs.tls_established();
            }
            Step::Transmission(n) => {
                sock.write_all(&hs.take_output())
                    .map_err(|e| net("sending handshake", e))?;
                sock.set_read_timeout(None).map_err(|e| net("socket", e))?;
                let local = shared.exports.len();
                let chosen = match n.export.checked_sub(local) {
                    None => {
                        let size = infos_sizes
                            .get(n.export)
                            .copied()
                            .ok_or(Error::Bug("a handshake chose an export not listed"))?;
                        Chosen::Local(n.export, size)
                    }
                    Some(i) => match members.get(i) {
                        Some(m) => Chosen::Member(m.clone()),
                        None => return Err(Error::Bug("a handshake chose an export not listed")),
                    },
                };
                return Ok(Some((sock, chosen)));
            }
            Step::Abort => {
                let _ = sock.write_all(&hs.take_output());
                return Ok(None);
            }
        }
    }
}

struct Job {
    cookie: u64,
    command: Command,
    /// For writes: the payload. For reads: None, the worker takes a buffer.
    payload: Option<IoBuf>,
    /// Payload bytes charged to the server's buffer budget, given back when the job ends
    /// (however it ends: dropped, failed, panicked).
    charge: Option<Charge>,
}

/// Everything a worker needs.
struct Ctx {
    dev: Arc<dyn BlockDev>,
    /// A reply could not be sent: the client is gone (or stopped reading), so requests not
    /// yet executed are dropped, not run for nobody.
    dead: AtomicBool,
    /// Requests received and not finished, for the accept loop's idle check.
    activity: Arc<Activity>,
    /// Requests handed to workers and not yet finished.
    queued: AtomicUsize,
    writer: Mutex<Sock>,
    /// The server's buffer budget, and this connection's share of it.
    budget: Arc<Budget>,
    conn_budget: Arc<ConnBudget>,
    /// Buffers for payloads and read replies, reused across requests (the server's).
    spares: Arc<Spares>,
}

impl Ctx {
    /// Sends one reply; on failure the connection is dead: shut it so the reader stops too.
    fn send(&self, bytes: &[u8]) {
        let mut w = lock(&self.writer);
        if w.write_all(bytes).is_err() {
            self.dead.store(true, Ordering::Release);
            let _ = w.shutdown(Shutdown::Both);
        }
    }

    fn dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn reply(&self, cookie: u64, r: ucrypt::Result<()>) {
        let err = r.err().map(|e| NbdError::from_error(&e));
        self.send(&nbd::encode_simple_reply(cookie, err));
    }

    /// Executes a job; a panic inside the device (a bug) becomes an EIO reply for that
    /// request only (its budget is given back as the job unwinds), so the connection keeps
    /// going.
    fn execute_guarded(&self, job: Job) {
        let cookie = job.cookie;
        if self.dead() {
            // Nobody will read the reply: drop the request (never acknowledged) at once.
            if let Some(p) = job.payload {
                self.spares.give(p);
            }
            self.activity.done();
            return;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.execute(job)));
        if r.is_err() {
            self.reply(
                cookie,
                Err(ucrypt::Error::Bug("panic while serving an NBD request")),
            );
        }
        self.activity.done();
    }

    /// Charges `bytes` of payload to the server's budget, waiting for room (after waking the
    /// workers: the jobs they hold give room back).
    fn charge(&self, workers: &Workers, bytes: u64) -> Charge {
        match self.budget.try_charge(&self.conn_budget, bytes) {
            Some(c) => c,
            None => {
                workers.wake();
                self.budget.charge(&self.conn_budget, bytes)
            }
        }
    }

    fn execute(&self, mut job: Job) {
        let dev = self.dev.as_ref();
        let durable =
            |r: ucrypt::Result<()>, fua: bool| if r.is_ok() && fua { dev.flush() } else { r };
        match job.command {
            Command::Read { offset, len } => {
                let len = len as usize;
                // Data page-aligned (the volume decrypts in place) with the header right
                // before it, so the reply is a single write.
                let mut buf = self.spares.take(len);
                match dev.read_at(buf.data_mut(len), offset) {
                    Ok(()) => {
                        let reply = buf.with_head_mut(SIMPLE_REPLY_BYTES, len);
                        reply[..SIMPLE_REPLY_BYTES]
                            .copy_from_slice(&nbd::encode_simple_reply(job.cookie, None));
                        self.send(reply);
                    }
                    // On error no data follows the header (simple replies, spec).
                    Err(e) => self.reply(job.cookie, Err(e)),
                }
                self.spares.give(buf);
            }
            Command::Write { offset, fua, len } => {
                // The payload buffer is ours and read no more: the volume may encrypt in it.
                // A FUA write is made durable by itself, not by flushing everything.
                let r = match &mut job.payload {
                    Some(p) if fua => dev.write_fua(p.data_mut(len as usize), offset),
                    Some(p) => dev.write_at_mut(p.data_mut(len as usize), offset),
                    None => Err(ucrypt::Error::Bug("NBD write job without its payload")),
                };
                self.reply(job.cookie, r);
            }
            Command::Flush => self.reply(job.cookie, dev.flush()),
            Command::Trim { offset, len, fua } => self.reply(
                job.cookie,
                durable(dev.discard(offset, u64::from(len)), fua),
            ),
            // NO_HOLE needs nothing extra: the BlockDev writes zeroes as data (on an encrypted
            // volume, zeroes are ciphertext), so the range is always provisioned.
            Command::WriteZeroes {
                offset, len, fua, ..
            } => self.reply(
                job.cookie,
                durable(dev.write_zeroes(offset, u64::from(len)), fua),
            ),
            Command::Disconnect => {}
        }
        if let Some(p) = job.payload {
            self.spares.give(p);
        }
    }
}

/// A connection's workers: started on demand by the reader, ended when idle (see
/// [`Queue`]).
struct Workers {
    queue: Arc<Queue<Job>>,
    ctx: Arc<Ctx>,
    /// Workers started and not yet joined; finished ones are dropped as new ones start, so
    /// this holds at most the queue's worker limit plus those ending.
    threads: Vec<JoinHandle<()>>,
    started: u64,
}

impl Workers {
    fn new(ctx: Arc<Ctx>, workers_max: usize) -> Workers {
        Workers {
            queue: Arc::new(Queue::new(QUEUED_REQUESTS_MAX, workers_max)),
            ctx,
            threads: Vec::new(),
            started: 0,
        }
    }

    /// Hands `job` to a worker, starting one if none is free. If no worker can start at all,
    /// the jobs left run on the caller's thread. A sleeping worker is woken at the next
    /// [`Workers::wake`], which the reader calls before it could block (see [`Queue`]).
    fn dispatch(&mut self, job: Job) {
        self.ctx.queued.fetch_add(1, Ordering::AcqRel);
        if let Pushed::StartWorker = self.queue.push_deferred(job) {
            self.threads.retain(|t| !t.is_finished());
            let (ctx, queue) = (self.ctx.clone(), self.queue.clone());
            let t = std::thread::Builder::new()
                .name(format!("nbd-worker-{}", self.started))
                .spawn(move || worker(&ctx, &queue));
            self.started += 1;
            match t {
                Ok(t) => self.threads.push(t),
                Err(e) => {
                    let left = self.queue.start_failed();
                    if !left.is_empty() {
                        eprintln!("ucrypt: cannot start an NBD worker ({e}): serving inline");
                    }
                    for job in left {
                        self.ctx.execute_guarded(job);
                        self.ctx.queued.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            }
        }
    }

    /// Wakes sleeping workers for the jobs dispatched since the last call.
    fn wake(&self) {
        self.queue.wake();
    }

    /// Lets the workers finish what is queued, and waits for them.
    fn finish(self) {
        self.queue.close();
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn worker(ctx: &Ctx, queue: &Queue<Job>) {
    while let Some(job) = queue.next() {
        ctx.execute_guarded(job);
        ctx.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads requests until the client disconnects (Ok) or breaks the protocol (Err): each one
/// runs on this thread when nothing else is in flight (QD1), else goes to a worker.
fn read_requests(
    mut reader: BufReader<RequestStream>,
    ctx: &Ctx,
    workers: &mut Workers,
    limits: &nbd::TransmissionLimits,
    stop: &ucrypt::Stop,
) -> Result<()> {
    let mut hdr = [0u8; REQUEST_HEADER_BYTES];
    // The last request was a large write (see `read_payload`).
    let mut after_large_write = false;
    // When requests last went to workers: the read buffer is large from then until the
    // connection has been without such bursts for as long as a worker stays idle.
    let mut last_burst: Option<std::time::Instant> = None;
    // Requests went to workers since the buffer was last empty: the clock is read once per
    // refill, not once per request.
    let mut dispatched = false;
    loop {
        if reader.buffer().is_empty() {
            if std::mem::take(&mut dispatched) {
                last_burst = Some(std::time::Instant::now());
            }
            let want = match last_burst {
                Some(t) if t.elapsed() < super::queue::WORKER_IDLE => READ_BUFFER_BYTES,
                _ => READ_BUFFER_IDLE_BYTES,
            };
            if reader.capacity() != want {
                reader = BufReader::with_capacity(want, reader.into_inner());
            }
        }
        // A dead client's requests still buffered here are never read (see `Ctx::dead`);
        // once the server stops, no new request is taken (those taken finish).
        if ctx.dead() || stop.requested() {
            return Ok(());
        }
        // The next header is not all here: the read may sleep, so the workers must have
        // their jobs first.
        if reader.buffer().len() < REQUEST_HEADER_BYTES {
            workers.wake();
        }
        // After a large write, the next request is likely one too: its header is read alone
        // when nothing is buffered, so that its payload does not land in the read buffer
        // (read ahead with the header) and get copied out of it.
        let header = if after_large_write && reader.buffer().is_empty() {
            read_full(reader.get_mut(), &mut hdr)
        } else {
            read_full(&mut reader, &mut hdr)
        };
        after_large_write = false;
        match header {
            Ok(true) => {}
            // Client closed (or server stopping): finish in-flight work.
            Ok(false) => return Ok(()),
            Err(e) => {
                return Err(net("reading request", e));
            }
        }
        let h = match RequestHeader::parse(&hdr) {
            Ok(h) => h,
            Err(e) => {
                return Err(e);
            }
        };
        match nbd::decode_request(&h, limits) {
            Decoded::Fatal(why) => {
                return Err(Error::Protocol(why.into()));
            }
            Decoded::Reject {
                cookie,
                error,
                skip_payload_bytes,
            } => {
                ctx.activity.begin();
                workers.wake();
                let r = discard(&mut reader, skip_payload_bytes as usize);
                if r.is_ok() {
                    ctx.send(&nbd::encode_simple_reply(cookie, Some(error)));
                }
                ctx.activity.done();
                if let Err(e) = r {
                    return Err(net("reading refused payload", e));
                }
            }
            Decoded::Ok(req) => {
                // Done in `execute_guarded` (or below, if the request ends here).
                ctx.activity.begin();
                let mut job = Job {
                    cookie: req.cookie,
                    command: req.command,
                    payload: None,
                    charge: None,
                };
                let mut charged = 0;
                match req.command {
                    Command::Disconnect => {
                        ctx.activity.done();
                        return Ok(());
                    }
                    Command::Write { len, .. } => {
                        charged = u64::from(len);
                        job.charge = Some(ctx.charge(workers, charged));
                        // A payload not all here: its read may sleep.
                        if reader.buffer().len() < len as usize {
                            workers.wake();
                        }
                        let mut payload = ctx.spares.take(len as usize);
                        let r = if u64::from(len) >= DIRECT_PAYLOAD_MIN_BYTES {
                            after_large_write = true;
                            read_payload(&mut reader, payload.data_mut(len as usize))
                        } else {
                            reader.read_exact(payload.data_mut(len as usize))
                        };
                        job.payload = Some(payload);
                        if let Err(e) = r {
                            drop(job);
                            ctx.activity.done();
                            // A client that vanishes mid-payload: this write was never
                            // acknowledged, so dropping it loses nothing promised.
                            return Err(net("reading write payload", e));
                        }
                    }
                    Command::Read { len, .. } => {
                        charged = u64::from(len);
                        job.charge = Some(ctx.charge(workers, charged));
                    }
                    _ => {}
                }
                // Fast path for a client with one request at a time (QD1): when no worker is
                // busy and no further request is already buffered, executing here saves two
                // thread hand-offs; the next request could not have been read any sooner.
                // A large request first asks the socket whether another request is waiting
                // (a payload read straight into its buffer leaves the reader's buffer empty
                // even then): if so a worker takes it, and receiving the next payload
                // overlaps with this one's crypto and I/O.
                let large = charged >= INLINE_PEEK_MIN_BYTES;
                if ctx.queued.load(Ordering::Acquire) == 0
                    && reader.buffer().is_empty()
                    && !(large && reader.get_ref().pending())
                {
                    ctx.execute_guarded(job);
                    reader.get_mut().poll = true;
                    continue;
                }
                reader.get_mut().poll = false;
                dispatched = true;
                workers.dispatch(job);
            }
        }
    }
}

/// The transmission phase: this thread reads and validates requests; workers execute them.
/// `size_bytes`: the export's size as the client was told it.
fn transmit(
    sock: Sock,
    export: &Export,
    size_bytes: u64,
    shared: &Shared,
    activity: Arc<Activity>,
) -> Result<()> {
    let (poll, workers) = (shared.poll, shared.workers);
    let governor = shared.poll_backoff.then(SpinGovernor::default);
    let info = &export.info;
    let limits = nbd::TransmissionLimits {
        size_bytes,
        tx_flags: info.tx_flags,
        min_block_bytes: info.min_block_bytes,
        max_payload_bytes: info.max_payload_bytes,
    };
    let writer = sock.try_clone().map_err(|e| net("socket", e))?;
    writer
        .set_write_timeout(Some(REPLY_WRITE_TIMEOUT))
        .map_err(|e| net("socket", e))?;
    let ctx = Arc::new(Ctx {
        dev: export.dev.clone(),
        dead: AtomicBool::new(false),
        activity,
        queued: AtomicUsize::new(0),
        writer: Mutex::new(writer),
        budget: shared.budget.clone(),
        conn_budget: Arc::new(ConnBudget::default()),
        spares: shared.spares.clone(),
    });
    let mut workers = Workers::new(ctx.clone(), workers);

    let stream = RequestStream {
        sock,
        poll: false,
        poll_for: poll,
        governor,
    };
    let reader = BufReader::with_capacity(READ_BUFFER_IDLE_BYTES, stream);
    let outcome = read_requests(reader, &ctx, &mut workers, &limits, &shared.stop);
    workers.finish();
    // Every reply is out. Make acknowledged writes durable before the connection goes away,
    // so a client that disconnects without a flush loses nothing it was told succeeded.
    if info.tx_flags & nbd::TX_READ_ONLY == 0 {
        export.dev.flush()?;
    }
    let w = lock(&ctx.writer);
    let _ = w.shutdown(Shutdown::Both);
    // A peer that hangs up is the normal end of a session, not an error worth reporting.
    match outcome {
        Err(Error::Io { ref source, .. })
            if matches!(
                source.kind(),
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
            ) =>
        {
            Ok(())
        }
        o => o,
    }
}

/// Fills `buf` with what `reader` has buffered, then with reads straight from the socket.
fn read_payload(reader: &mut BufReader<RequestStream>, buf: &mut [u8]) -> io::Result<()> {
    let have = reader.buffer().len().min(buf.len());
    buf[..have].copy_from_slice(&reader.buffer()[..have]);
    reader.consume(have);
    if have < buf.len() {
        reader.get_mut().read_exact(&mut buf[have..])?;
    }
    Ok(())
}

/// Reads and drops `n` bytes. The chunk is on the heap, not the stack: a 64 KiB array in a
/// frame inlined into the reader would make every connection's thread touch 64 KiB of stack
/// (stack probes touch each page of a frame on entry), refused writes or not.
fn discard(r: &mut impl Read, mut n: usize) -> io::Result<()> {
    if n == 0 {
        return Ok(());
    }
    let mut sink = vec![0u8; DISCARD_CHUNK_BYTES.min(n)];
    while n > 0 {
        let k = n.min(sink.len());
        r.read_exact(&mut sink[..k])?;
        n -= k;
    }
    Ok(())
}
