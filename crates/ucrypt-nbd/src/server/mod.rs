//! The NBD server: serves any number of [`BlockDev`]s by name over a unix socket or TCP
//! (TLS via `NBD_OPT_STARTTLS`, required on TCP unless explicitly waived).
//!
//! Threads, all bounded by named limits:
//! - the accept loop (the caller's thread) polls the listener and the stop flag;
//! - one thread per connection ([`ServerOptions::connections_max`]) runs the handshake, then reads requests;
//!   when every slot is taken, a new client takes the slot of the connection idle longest
//!   (nothing received and nothing in flight for [`ServerOptions::idle_timeout`]), else it is
//!   refused with a log line;
//!   a request arriving alone (queue depth 1) it serves itself, and then polls the socket for
//!   up to 50 µs (yielding the CPU) before sleeping, since waking a sleeping thread on another
//!   CPU costs more than serving 4 KiB;
//! - up to [`WORKERS_PER_CONNECTION`] workers per connection execute requests and write each
//!   reply as soon as it completes (replies serialised by a writer lock), so many requests are
//!   in flight; they start when requests queue up and end when idle, so an idle connection is
//!   its reader thread and socket only;
//! - request buffers come from one budget for the whole server, charged per request (a
//!   request waits for room, never fails for want of it), so the connection limit is large;
//! - for a TLS connection, one relay thread moves bytes between the socket and rustls.
//!
//! A unix socket may also be shared by several processes, each serving its own exports
//! ([`share`]): one negotiates for all and passes each client to the process of its export.
//!
//! The protocol itself (parsing, validation, replies) is the sans-I/O codec in [`crate::proto`].
//! The server stops when its [`Stop`] is requested (the `ucrypt` command ties SIGINT and
//! SIGTERM to it). Its accept loop waits in `poll` on the listener and an eventfd the stop
//! writes to (`stop_fd`), never on a timer: an idle server does not wake.

mod budget;
mod buf;
mod conn;
pub mod dev;
mod fdpass;
mod queue;
pub mod share;
mod sock;
mod stop_fd;
pub(crate) mod tls;
pub mod unix_socket;

#[cfg(test)]
mod tests;

use std::io::{self, Write};
use std::net::{TcpListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ucrypt::sync::lock;
use ucrypt::{BlockDev, Stop};

use crate::proto::{self as nbd, ExportInfo};
use crate::{Error, Result};

pub use sock::Sock;
pub use tls::{load_tls_config, TlsFiles};
pub use unix_socket::{bind_unix, BoundSocket};

/// Where a connection starts.
pub(crate) enum Entry {
    /// A new client: the handshake first.
    Handshake,
    /// A client whose handshake another process ran (a shared socket's owner): the
    /// transmission phase of this export.
    Transmit(usize),
}

/// Simultaneous connections by default ([`ServerOptions::connections_max`]); more take an
/// idle one's slot or are closed at once. A connection holds request buffers only while it
/// has requests, from the server's one budget (`budget::SERVER_BYTES_MAX` in use plus
/// `buf::SPARE_BYTES_MAX` kept for reuse, whatever the number of connections): what bounds
/// connections is their reader thread and socket.
pub const CONNECTIONS_MAX_DEFAULT: usize = 1024;
/// Requests executed at once per connection, by default. Two cores here; the device may
/// parallelise further inside. Four keeps a queue-depth-32 client busy without
/// oversubscribing, when the device's time is CPU time.
pub const WORKERS_PER_CONNECTION: usize = 4;
/// The most workers a connection may have ([`ServerOptions::workers`]). A device on remote
/// storage spends its time waiting for the network, not on a core: there each request in
/// flight needs a worker (a QD32 client, 32).
pub const WORKERS_PER_CONNECTION_MAX: usize = 64;
/// A connection idle this long (nothing received, nothing in flight) gives its slot up to a
/// new client when all [`ServerOptions::connections_max`] are taken (`ucrypt serve --idle-timeout`). Idle
/// connections are never closed while slots are free: a kernel NBD client on a quiet file
/// system sends nothing for hours, and a closed connection is an I/O error to it.
pub const IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// Where to listen: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    Unix(PathBuf),
    Tcp { host: String, port: u16 },
}

impl std::fmt::Display for Listen {
    /// As it is written on the command line: `unix:PATH`, `tcp:HOST:PORT`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
            Listen::Tcp { host, port } if host.contains(':') => write!(f, "tcp:[{host}]:{port}"),
            Listen::Tcp { host, port } => write!(f, "tcp:{host}:{port}"),
        }
    }
}

impl FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            return Ok(Listen::Unix(PathBuf::from(p)));
        }
        if let Some(hp) = s.strip_prefix("tcp:") {
            let (host, port) = hp.rsplit_once(':').ok_or("tcp: needs HOST:PORT")?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if host.is_empty() {
                return Err("tcp: needs a host".into());
            }
            let port = port.parse().map_err(|_| format!("bad port '{port}'"))?;
            return Ok(Listen::Tcp {
                host: host.into(),
                port,
            });
        }
        Err(format!("'{s}': expected unix:PATH or tcp:HOST:PORT"))
    }
}

pub struct ServerOptions {
    pub read_only: bool,
    /// TLS server configuration; `None` serves plaintext.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Allow plaintext on TCP (without it, TCP without TLS is refused).
    pub insecure_plaintext: bool,
    pub pid_file: Option<PathBuf>,
    /// Print `ready: URI` lines on stdout and notify systemd once accepting.
    pub announce: bool,
    /// How long a connection's reader polls for the next request after serving one on its
    /// own thread, before it sleeps (`--spin-us`; zero = never poll).
    pub poll: Duration,
    /// Stop polling on a connection for a while when its polls rarely see the next request
    /// arrive (the client's requests come further apart than `poll`); false polls after every
    /// request served inline (`--spin-always`).
    pub poll_backoff: bool,
    /// Requests executed at once per connection (1 to [`WORKERS_PER_CONNECTION_MAX`]).
    pub workers: usize,
    /// How long a connection must be idle before a new client may take its slot when all
    /// are taken ([`IDLE_TIMEOUT_DEFAULT`]).
    pub idle_timeout: Duration,
    /// Simultaneous connections at most ([`CONNECTIONS_MAX_DEFAULT`]; at least 1).
    pub connections_max: usize,
}

/// One export at run time.
pub(crate) struct Export {
    pub dev: Arc<dyn BlockDev>,
    pub info: ExportInfo,
}

/// What every connection thread shares.
pub(crate) struct Shared {
    pub exports: Vec<Export>,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    pub stop: Stop,
    /// Readable once `stop` is requested: the accept and registration loops wait on it.
    pub stop_fd: stop_fd::StopFd,
    /// The live connections: their sockets (clones, to shut their read side down on stop or
    /// to close an idle one) and activity.
    pub live: Mutex<Vec<LiveConn>>,
    /// `ServerOptions::poll`.
    pub poll: Duration,
    /// `ServerOptions::poll_backoff`.
    pub poll_backoff: bool,
    /// `ServerOptions::workers`.
    pub workers: usize,
    /// `ServerOptions::idle_timeout`.
    pub idle_timeout: Duration,
    /// `ServerOptions::connections_max`.
    pub connections_max: usize,
    /// Request buffers: the budget every request is charged to, and the spare buffers
    /// reused between requests, both the whole server's.
    pub budget: Arc<budget::Budget>,
    pub spares: Arc<buf::Spares>,
    /// A shared socket's members, whose exports this process negotiates too (`None`: a
    /// server of its own exports only).
    pub share: Option<Arc<share::Registry>>,
    /// Connections in their handshake, and how many may be (further clients wait in the
    /// backlog).
    pub handshakes: AtomicUsize,
    pub handshakes_max: usize,
}

/// A live connection as the accept loop sees it.
pub(crate) struct LiveConn {
    id: u64,
    sock: Sock,
    activity: Arc<Activity>,
    /// Closed to make room for a new client; no longer counted against the limit.
    evicted: bool,
}

/// What a connection is doing, for choosing which idle one gives up its slot.
pub(crate) struct Activity {
    /// When the server started, the origin of `last_ms`.
    origin: Instant,
    /// Milliseconds since `origin` of the connection's last request (or its accept).
    last_ms: AtomicU64,
    /// Requests received and not yet finished (replied to or dropped).
    busy: AtomicUsize,
}

impl Activity {
    fn new(origin: Instant) -> Activity {
        let a = Activity {
            origin,
            last_ms: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
        };
        a.touch();
        a
    }
    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
    /// A request arrived: busy until [`Activity::done`].
    pub fn begin(&self) {
        self.busy.fetch_add(1, Ordering::AcqRel);
        self.touch();
    }
    /// A request begun with [`Activity::begin`] finished.
    pub fn done(&self) {
        self.touch();
        self.busy.fetch_sub(1, Ordering::AcqRel);
    }
    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Release);
    }
    /// How long the connection has been idle; `None` while it has requests.
    fn idle_for(&self) -> Option<Duration> {
        if self.busy.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last = self.last_ms.load(Ordering::Acquire);
        Some(Duration::from_millis(self.now_ms().saturating_sub(last)))
    }
}

/// Transmission flags for a device. CAN_MULTI_CONN holds because every connection reaches the
/// same `BlockDev` (no per-connection cache) and its `flush` makes every acknowledged write
/// durable, whichever connection made it.
pub fn tx_flags(read_only: bool) -> u16 {
    let mut f = nbd::TX_HAS_FLAGS | nbd::TX_SEND_FLUSH | nbd::TX_SEND_FUA | nbd::TX_CAN_MULTI_CONN;
    if read_only {
        f |= nbd::TX_READ_ONLY;
    } else {
        f |= nbd::TX_SEND_TRIM | nbd::TX_SEND_WRITE_ZEROES;
    }
    f
}

fn export_info(name: &str, dev: &dyn BlockDev, read_only: bool) -> Result<ExportInfo> {
    if name.len() > nbd::EXPORT_NAME_MAX_BYTES {
        return Err(Error::Config(format!(
            "export name longer than {} bytes",
            nbd::EXPORT_NAME_MAX_BYTES
        )));
    }
    let size = dev.size();
    if size % u64::from(nbd::MIN_BLOCK_BYTES) != 0 {
        return Err(Error::Config(format!(
            "export '{name}': size {size} is not a multiple of {} bytes",
            nbd::MIN_BLOCK_BYTES
        )));
    }
    let preferred = dev
        .block_size()
        .clamp(nbd::PREFERRED_BLOCK_BYTES, 65536)
        .next_power_of_two();
    Ok(ExportInfo {
        name: name.to_string(),
        description: format!("ucrypt volume, {} byte sectors", dev.block_size()),
        size_bytes: size,
        tx_flags: tx_flags(read_only || dev.read_only()),
        min_block_bytes: nbd::MIN_BLOCK_BYTES,
        preferred_block_bytes: preferred,
        max_payload_bytes: nbd::MAX_PAYLOAD_BYTES,
    })
}

enum Listener {
    Unix(UnixListener, BoundSocket),
    Tcp(TcpListener),
}

/// A listener bound before it serves ([`bind`], then [`serve_on`]), so that its caller learns
/// at once whether the address can be used.
pub struct Bound(Listener);

/// Binds `listen`: a unix socket by [`bind_unix`]'s rule, or a TCP address.
pub fn bind(listen: &Listen) -> Result<Bound> {
    Listener::bind(listen).map(Bound)
}

/// URIs a client would use, one per export.
fn uris(listen: &Listener, names: &[&str], tls: bool) -> Vec<String> {
    names
        .iter()
        .map(|n| match listen {
            Listener::Unix(_, p) => {
                let s = if tls { "nbds+unix" } else { "nbd+unix" };
                format!("{s}:///{n}?socket={}", p.path().display())
            }
            Listener::Tcp(l) => {
                let s = if tls { "nbds" } else { "nbd" };
                match l.local_addr() {
                    Ok(a) if a.is_ipv6() => format!("{s}://[{}]:{}/{n}", a.ip(), a.port()),
                    Ok(a) => format!("{s}://{}:{}/{n}", a.ip(), a.port()),
                    Err(_) => format!("{s}://?/{n}"),
                }
            }
        })
        .collect()
}

/// Tells systemd we are ready if it asked (`NOTIFY_SOCKET`); a datagram, no library needed.
/// Any long-running ucrypt process that systemd starts as `Type=notify` calls it once ready.
pub fn sd_notify_ready() {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    let bytes = path.as_encoded_bytes();
    let r = if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name)
            .and_then(|a| sock.send_to_addr(b"READY=1", &a))
    } else {
        sock.send_to(b"READY=1", Path::new(&path))
    };
    if let Err(e) = r {
        eprintln!("ucrypt: sd_notify failed: {e}");
    }
}

/// Serves `exports` (the first is the default export) until `stop` is requested, then stops
/// accepting, lets every connection finish its in-flight requests, flushes every device and
/// returns.
pub fn serve(
    exports: Vec<(String, Arc<dyn BlockDev>)>,
    listen: &Listen,
    opts: ServerOptions,
    stop: Stop,
) -> Result<()> {
    serve_on(exports, bind(listen)?, opts, stop)
}

/// [`serve`] on a listener already bound.
pub fn serve_on(
    exports: Vec<(String, Arc<dyn BlockDev>)>,
    listener: Bound,
    opts: ServerOptions,
    stop: Stop,
) -> Result<()> {
    let Bound(listener) = listener;
    if exports.is_empty() {
        return Err(Error::Config("no export to serve".into()));
    }
    let mut rt = Vec::new();
    for (name, dev) in exports {
        if rt.iter().any(|e: &Export| e.info.name == name) {
            return Err(Error::Config(format!("export name '{name}' given twice")));
        }
        let info = export_info(&name, dev.as_ref(), opts.read_only)?;
        rt.push(Export { dev, info });
    }
    if matches!(listener, Listener::Tcp(_)) && opts.tls.is_none() && !opts.insecure_plaintext {
        return Err(Error::Config(
            "TCP without TLS exposes the plaintext volume to the network: give --tls-cert and \
             --tls-key, or --insecure-plaintext"
                .into(),
        ));
    }
    raise_open_files_limit(opts.connections_max);
    if let Some(pf) = &opts.pid_file {
        std::fs::write(pf, format!("{}\n", std::process::id()))
            .map_err(|e| Error::io(format!("writing pid file {}", pf.display()), e))?;
    }
    let names: Vec<&str> = rt.iter().map(|e| e.info.name.as_str()).collect();
    let announce = uris(&listener, &names, opts.tls.is_some());
    let shared = new_shared(rt, &opts, &stop, None)?;
    if opts.announce {
        let mut out = io::stdout().lock();
        for u in &announce {
            let _ = writeln!(out, "ready: {u}");
        }
        let _ = out.flush();
        sd_notify_ready();
    }

    let mut conns = Conns::new();
    accept_loop(&listener, &shared, &mut conns, &mut ());
    listener_close(listener);
    let result = finish_conns(&shared, conns.into_threads());
    if let Some(pf) = &opts.pid_file {
        let _ = std::fs::remove_file(pf);
    }
    result
}

/// What the connections of a server share, from its options.
fn new_shared(
    exports: Vec<Export>,
    opts: &ServerOptions,
    stop: &Stop,
    share: Option<Arc<share::Registry>>,
) -> Result<Arc<Shared>> {
    let handshakes_max = match share {
        Some(_) => share::HANDSHAKES_PENDING_MAX,
        None => usize::MAX,
    };
    let stop_fd = stop_fd::StopFd::new(stop)
        .map_err(|e| Error::io("making the server's stop descriptor", e))?;
    Ok(Arc::new(Shared {
        exports,
        tls: opts.tls.clone(),
        stop: stop.clone(),
        stop_fd,
        live: Mutex::new(Vec::new()),
        poll: opts.poll,
        poll_backoff: opts.poll_backoff,
        workers: opts.workers.clamp(1, WORKERS_PER_CONNECTION_MAX),
        idle_timeout: opts.idle_timeout,
        connections_max: opts.connections_max.max(1),
        budget: Arc::new(budget::Budget::new()),
        spares: Arc::new(buf::Spares::new(nbd::transmission::SIMPLE_REPLY_BYTES)),
        share,
        handshakes: AtomicUsize::new(0),
        handshakes_max,
    }))
}

impl Listener {
    fn bind(listen: &Listen) -> Result<Listener> {
        Ok(match listen {
            Listen::Unix(p) => {
                let (l, bound) = bind_unix(p)?;
                Listener::Unix(l, bound)
            }
            Listen::Tcp { host, port } => {
                let addrs: Vec<_> = (host.as_str(), *port)
                    .to_socket_addrs()
                    .map_err(|e| Error::io(format!("resolving {host}"), e))?
                    .collect();
                Listener::Tcp(
                    TcpListener::bind(&addrs[..])
                        .map_err(|e| Error::io(format!("binding {host}:{port}"), e))?,
                )
            }
        })
    }
}

/// File descriptors one connection holds: its socket, the accept loop's clone and the reply
/// writer's clone (a TLS connection one more, for its relay).
const FDS_PER_CONNECTION: u64 = 4;
/// File descriptors the rest of the process may hold (volumes, listener, logs).
const FDS_OTHER: u64 = 256;

/// Raises the soft limit on open files (RLIMIT_NOFILE, often 1,024) towards what
/// `connections` need, up to the hard limit; says so on stderr when the hard limit is lower.
fn raise_open_files_limit(connections: usize) {
    let want = (connections as u64)
        .saturating_mul(FDS_PER_CONNECTION)
        .saturating_add(FDS_OTHER);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= want {
        return;
    }
    let new = libc::rlimit {
        rlim_cur: want.min(lim.rlim_max),
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads one rlimit from `new`, which lives across the call.
    let ok = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0;
    if !ok || new.rlim_cur < want {
        eprintln!(
            "ucrypt: open files limited to {} (RLIMIT_NOFILE): fewer than {connections} \
             connections may be served",
            if ok { new.rlim_cur } else { lim.rlim_cur }
        );
    }
}

/// How long the accept loop waits while [`Shared::handshakes_max`] clients are in their
/// handshake.
const HANDSHAKES_FULL_WAIT: Duration = Duration::from_millis(10);

/// The connection threads of a server and what numbers them.
pub(crate) struct Conns {
    next_id: u64,
    origin: Instant,
    threads: Vec<JoinHandle<()>>,
}

impl Conns {
    pub(crate) fn new() -> Conns {
        Conns {
            next_id: 0,
            origin: Instant::now(),
            threads: Vec::new(),
        }
    }

    pub(crate) fn into_threads(self) -> Vec<JoinHandle<()>> {
        self.threads
    }

    /// Gives `sock` a slot ([`ServerOptions::connections_max`] at once) and a thread that
    /// starts it at `entry`.
    pub(crate) fn admit(&mut self, shared: &Arc<Shared>, sock: Sock, entry: Entry) {
        self.threads.retain(|t| !t.is_finished());
        if !make_room(shared) {
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        let activity = Arc::new(Activity::new(self.origin));
        match sock.try_clone() {
            Ok(c) => lock(&shared.live).push(LiveConn {
                id,
                sock: c,
                activity: activity.clone(),
                evicted: false,
            }),
            Err(e) => {
                eprintln!("ucrypt: {e}");
                return;
            }
        }
        let handshake = matches!(entry, Entry::Handshake);
        if handshake {
            shared.handshakes.fetch_add(1, Ordering::AcqRel);
        }
        let sh = shared.clone();
        let t = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                // Deregisters the connection however the thread ends (a panic included).
                struct Live<'a>(&'a Shared, u64);
                impl Drop for Live<'_> {
                    fn drop(&mut self) {
                        lock(&self.0.live).retain(|c| c.id != self.1);
                    }
                }
                let _live = Live(&sh, id);
                if let Err(e) = conn::run(sock, &sh, &activity, entry) {
                    eprintln!("ucrypt: connection {id}: {e}");
                }
            });
        match t {
            Ok(t) => self.threads.push(t),
            Err(e) => {
                eprintln!("ucrypt: cannot start connection thread: {e}");
                if handshake {
                    shared.handshakes.fetch_sub(1, Ordering::AcqRel);
                }
                lock(&shared.live).retain(|c| c.id != id);
            }
        }
    }
}

/// What a [`Watch`]ed descriptor wakes the loop for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interest {
    /// Readable, hung up or in error.
    Input,
    /// Hung up or in error only: a descriptor whose input another thread reads.
    HangUp,
}

impl Interest {
    fn pollfd(self, fd: RawFd) -> libc::pollfd {
        libc::pollfd {
            fd,
            events: match self {
                Interest::Input => libc::POLLIN,
                Interest::HangUp => 0,
            },
            revents: 0,
        }
    }
}

/// What a server's loops watch besides their own descriptors, on the same thread and in the
/// same `poll`: a shared socket's registration (`share`, whose owner admits members on the
/// thread that accepts clients), and the caller's own events (a daemon's main loop, given to
/// [`share::serve_watching`], so that an idle daemon needs no thread for its NBD side).
pub trait Watch {
    /// Appends the descriptors to wait on; a negative one is left out.
    fn fds(&mut self, out: &mut Vec<(RawFd, Interest)>);
    /// Handles the events of the descriptors [`Watch::fds`] gave, in order (`true`: an
    /// event); called after every wait, also one that timed out.
    fn ready(&mut self, events: &[bool]);
    /// How long the loop may wait at most (-1: no bound): something this watch waits for
    /// has a deadline.
    fn timeout_ms(&self) -> i32 {
        -1
    }
}

/// A plain server's: nothing besides the listener.
impl Watch for () {
    fn fds(&mut self, _: &mut Vec<(RawFd, Interest)>) {}
    fn ready(&mut self, _: &[bool]) {}
}

/// Two watches as one: `first`'s descriptors, then `second`'s.
pub(crate) struct Both<'a> {
    first: &'a mut dyn Watch,
    second: &'a mut dyn Watch,
    /// How many descriptors `first` gave at the last [`Watch::fds`].
    split: usize,
}

impl<'a> Both<'a> {
    pub(crate) fn new(first: &'a mut dyn Watch, second: &'a mut dyn Watch) -> Both<'a> {
        Both {
            first,
            second,
            split: 0,
        }
    }
}

impl Watch for Both<'_> {
    fn fds(&mut self, out: &mut Vec<(RawFd, Interest)>) {
        let start = out.len();
        self.first.fds(out);
        self.split = out.len() - start;
        self.second.fds(out);
    }

    fn ready(&mut self, events: &[bool]) {
        let (a, b) = events.split_at(self.split.min(events.len()));
        self.first.ready(a);
        self.second.ready(b);
    }

    fn timeout_ms(&self) -> i32 {
        sooner(self.first.timeout_ms(), self.second.timeout_ms())
    }
}

/// The shorter of two `poll` timeouts in milliseconds (-1: none).
fn sooner(a: i32, b: i32) -> i32 {
    match (a, b) {
        (a, -1) => a,
        (-1, b) => b,
        (a, b) => a.min(b),
    }
}

/// Waits on `fixed` (their `revents` set on return) and `watch`'s descriptors, up to
/// `timeout_ms` (-1: none) or the watch's own deadline; hands the watch its events. Returns
/// how many of `fixed` have one.
pub(crate) fn wait_watching(
    fixed: &mut [libc::pollfd],
    watch: &mut dyn Watch,
    timeout_ms: i32,
) -> usize {
    let mut extra = Vec::new();
    watch.fds(&mut extra);
    let mut polled: Vec<libc::pollfd> = fixed.to_vec();
    polled.extend(extra.iter().map(|&(fd, i)| i.pollfd(fd)));
    let timeout = sooner(timeout_ms, watch.timeout_ms());
    stop_fd::wait(&mut polled, timeout);
    let (mine, theirs) = polled.split_at(fixed.len());
    fixed.copy_from_slice(mine);
    let events: Vec<bool> = theirs.iter().map(|p| p.revents != 0).collect();
    watch.ready(&events);
    fixed.iter().filter(|p| p.revents != 0).count()
}

/// Accepts connections until the server's stop is requested; each gets a thread from
/// [`Conns::admit`]. Waits in one `poll` on the listener, the stop and `watch`'s descriptors,
/// with no timeout: an idle server never wakes. While [`Shared::handshakes_max`] clients are
/// in their handshake it leaves the listener alone and looks again every
/// [`HANDSHAKES_FULL_WAIT`].
fn accept_loop(
    listener: &Listener,
    shared: &Arc<Shared>,
    conns: &mut Conns,
    watch: &mut dyn Watch,
) {
    let fd = match &listener {
        Listener::Unix(l, _) => l.as_raw_fd(),
        Listener::Tcp(l) => l.as_raw_fd(),
    };
    while !shared.stop.requested() {
        let full = shared.handshakes.load(Ordering::Acquire) >= shared.handshakes_max;
        // The stop, then the listener (ignored, -1, while handshakes are full).
        let mut polled = [
            stop_fd::pollin(shared.stop_fd.as_raw_fd()),
            stop_fd::pollin(if full { -1 } else { fd }),
        ];
        let timeout = if full {
            HANDSHAKES_FULL_WAIT.as_millis() as i32
        } else {
            -1
        };
        if wait_watching(&mut polled, watch, timeout) == 0 {
            continue;
        }
        if polled[0].revents != 0 {
            break;
        }
        if polled[1].revents & libc::POLLIN == 0 {
            continue;
        }
        let sock = match &listener {
            Listener::Unix(l, _) => l.accept().map(|(s, _)| Sock::Unix(s)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Sock::Tcp(s)
            }),
        };
        match sock {
            Ok(s) => conns.admit(shared, s, Entry::Handshake),
            Err(e) => {
                eprintln!("ucrypt: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Whether a new connection may have a slot: yes while fewer than
/// [`ServerOptions::connections_max`] are open; when all are taken, the connection idle longest gives its slot up if it has been
/// idle for `Shared::idle_timeout` (it is shut down and ends on its own). Otherwise the new
/// client is refused (closed at once) with a log line.
fn make_room(shared: &Shared) -> bool {
    let mut live = lock(&shared.live);
    let open = live.iter().filter(|c| !c.evicted).count();
    if open < shared.connections_max {
        return true;
    }
    let idlest = live
        .iter_mut()
        .filter(|c| !c.evicted)
        .filter_map(|c| c.activity.idle_for().map(|d| (d, c)))
        .max_by_key(|(d, _)| *d);
    match idlest {
        Some((idle, c)) if idle >= shared.idle_timeout => {
            eprintln!(
                "ucrypt: closing connection {} (idle for {} s) to admit a new client",
                c.id,
                idle.as_secs()
            );
            let _ = c.sock.shutdown(std::net::Shutdown::Both);
            c.evicted = true;
            true
        }
        _ => {
            eprintln!(
                "ucrypt: refusing connection: {} open, none idle for {} s",
                shared.connections_max,
                shared.idle_timeout.as_secs_f64()
            );
            false
        }
    }
}

/// Stopping, once nothing is accepted any more: every connection's read side is shut so it
/// stops taking requests, finishes what is in flight and replies; then every writable export
/// is flushed.
fn finish_conns(shared: &Shared, threads: Vec<JoinHandle<()>>) -> Result<()> {
    for c in lock(&shared.live).iter() {
        let _ = c.sock.shutdown_read();
    }
    for t in threads {
        let _ = t.join();
    }
    let mut result = Ok(());
    for e in &shared.exports {
        if e.info.tx_flags & nbd::TX_READ_ONLY == 0 {
            if let Err(err) = e.dev.flush() {
                eprintln!("ucrypt: flushing export '{}': {err}", e.info.name);
                result = Err(err.into());
            }
        }
    }
    result
}

fn listener_close(l: Listener) {
    if let Listener::Unix(l, bound) = l {
        drop(l);
        // The path goes with it (if it is still our socket).
        drop(bound);
    }
}
