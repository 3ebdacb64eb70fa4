//! `--metrics tcp:HOST:PORT|unix:PATH`: every served volume's counters and timing histograms
//! in Prometheus' text format, answered to `GET /metrics` over HTTP/1.x.
//!
//! Read at scrape time from `Volume::stats()` (an authenticated volume: the counters
//! `ucrypt::open::Opened::stats` keeps for it), nothing is recorded twice. Per volume (label
//! `volume`) and direction (label `op`: read; write, which also counts write-zeroes and
//! discards):
//! - `ucrypt_requests_total`, `ucrypt_bytes_total`;
//! - `ucrypt_errors_total` by `kind` (who can act: bad_input, wrong_key, bad_data, device,
//!   peer, internal);
//! - `ucrypt_integrity_mismatches_total` (authenticated volumes only, label `volume`): blocks
//!   whose tag did not verify, dm-integrity's "number of integrity mismatches";
//! - `ucrypt_nbd_socket_role` (a state set by `role`) and `ucrypt_nbd_socket_exports` of an
//!   `open --nbd` daemon's shared NBD socket (label `socket`), once the socket is attached;
//! - `ucrypt_request_seconds` histograms by `phase` (wait, queue, crypto, backend, total). As
//!   the engine times one request in `SAMPLE_EVERY` (32) at random, their counts are of the
//!   sampled requests; bucket edges are the engine's log2 clock-tick buckets in seconds.
//!
//! The HTTP side is deliberately small: a thread per connection, at most
//! [`CONNECTIONS_MAX`] at once (more are answered 503 at once), a request head of at most
//! [`REQUEST_HEAD_BYTES_MAX`] that must arrive whole within [`REQUEST_HEAD_TIMEOUT`], the
//! answer written within [`ANSWER_TIMEOUT`], `Connection: close`. So a client that dribbles
//! its request holds one slot for one head deadline, and a scrape beside it is not delayed.
//!
//! The metrics name every volume and show its I/O pattern: a TCP address that is not
//! loopback is served, as asked, but with a warning on stderr.

use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::Args;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use ucrypt::engine::{OpStats, Phase};
use ucrypt::ErrorKind;
use ucrypt_nbd::server::share::{ShareState, Standing};
use ucrypt_nbd::server::{bind_unix, BoundSocket, Listen};

use crate::error::{CliError, CliResult};
use crate::open::Opened;

/// Longest request head (request line and headers) read from a scraper.
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 << 10;
/// How long a scraper may take to send its whole request head, counted from its accept:
/// a deadline for the head, not a timeout per read, so sending a byte now and then does not
/// extend it. A scraper sends its few hundred bytes at once; this is far below Prometheus'
/// default scrape timeout (10 s), so a slot held by a slow client frees well before a
/// scrape waiting on it would time out.
pub const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// How long writing the answer may block on a scraper that does not read it.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once, each on its own thread. Scrapers are few (a Prometheus
/// server or two and a person with curl); the bound keeps a flood of connections from
/// costing a thread each. One over it is answered 503 and closed without being read.
pub const CONNECTIONS_MAX: usize = 16;
/// Pause after a failed accept (out of file descriptors, say), so the loop does not spin.
const ACCEPT_RETRY_PAUSE: Duration = Duration::from_millis(100);

#[derive(Args, Debug, Clone, Default)]
pub struct MetricsArgs {
    /// Expose Prometheus metrics (HTTP GET /metrics) at tcp:HOST:PORT or unix:PATH (mode 0600).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<Listen>,
}

/// The volumes a process serves, named as their `volume` label, and the shared NBD socket an
/// `open --nbd` daemon exports its volume on, once that is attached (after the metrics start).
#[derive(Clone)]
pub struct Volumes {
    vols: Vec<(String, Opened)>,
    nbd_socket: Arc<OnceLock<SharedNbdSocket>>,
}

/// The shared NBD socket an `open --nbd` daemon's export is attached to: where, and this
/// process's part there, read live (`status` reports the same).
pub struct SharedNbdSocket {
    pub listen: String,
    pub state: ShareState,
}

impl Volumes {
    pub fn new(vols: Vec<(String, Opened)>) -> Volumes {
        Volumes {
            vols,
            nbd_socket: Arc::default(),
        }
    }

    /// The one volume of a front end, labelled with its file or image name.
    pub fn one(args: &crate::open::VolumeArgs, vol: &Opened) -> Volumes {
        Volumes::new(vec![(args.volume.label(), vol.clone())])
    }

    /// Where the shared NBD socket goes once attached: set at most once.
    pub fn nbd_socket_slot(&self) -> Arc<OnceLock<SharedNbdSocket>> {
        self.nbd_socket.clone()
    }
}

impl std::fmt::Debug for Volumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.vols.iter().map(|(n, _)| n))
            .finish()
    }
}

/// The `role` label values of `ucrypt_nbd_socket_role`, one series each (a state set).
const NBD_ROLES: [&str; 4] = ["owner", "member", "taking_over", "detached"];

/// `ucrypt_nbd_socket_role` and `ucrypt_nbd_socket_exports` of the shared socket `n`, whose
/// export is named `volume`.
fn encode_nbd_socket(
    enc: &mut DescriptorEncoder,
    volume: &str,
    n: &SharedNbdSocket,
) -> Result<(), std::fmt::Error> {
    let (role, exports) = match n.state.standing() {
        Standing::Owner { exports } => ("owner", exports),
        Standing::Member { .. } => ("member", 0),
        Standing::TakingOver => ("taking_over", 0),
        Standing::Detached => ("detached", 0),
    };
    let mut m = enc.encode_descriptor(
        "ucrypt_nbd_socket_role",
        "This export's part on its shared NBD socket (open --nbd): 1 for the current role. The \
         owner listens and negotiates for every export there; a member is passed its clients; \
         a member whose owner left is taking over; detached serves only earlier connections.",
        None,
        MetricType::Gauge,
    )?;
    for r in NBD_ROLES {
        m.encode_family(&[("volume", volume), ("socket", &n.listen), ("role", r)])?
            .encode_gauge(&i64::from(r == role))?;
    }
    enc.encode_descriptor(
        "ucrypt_nbd_socket_exports",
        "Exports the owner of the shared NBD socket negotiates for, its own included (0 when \
         this process is not the owner).",
        None,
        MetricType::Gauge,
    )?
    .encode_family(&[("volume", volume), ("socket", &n.listen)])?
    .encode_gauge(&(exports as i64))?;
    Ok(())
}

/// A counter of each direction: name, help, and where its value is.
type Counter = (&'static str, &'static str, fn(&OpStats) -> u64);

const PHASES: [(Phase, &str); 5] = [
    (Phase::Wait, "wait"),
    (Phase::Queue, "queue"),
    (Phase::Crypto, "crypto"),
    (Phase::Backend, "backend"),
    (Phase::Total, "total"),
];

impl Collector for Volumes {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // Volumes on the engine: its statistics. Authenticated ones: the counters the library
        // keeps for them (no timings: they do not run on the engine).
        let snaps: Vec<(&str, [(&str, OpStats); 2])> = self
            .vols
            .iter()
            .filter_map(|(n, v)| v.engine().map(|v| (n, v.stats())))
            .map(|(n, s)| (n.as_str(), [("read", s.read), ("write", s.write)]))
            .collect();
        let auth: Vec<(&str, &Opened)> = self
            .vols
            .iter()
            .filter(|(_, v)| v.engine().is_none())
            .map(|(n, v)| (n.as_str(), v))
            .collect();
        let counters: [Counter; 2] = [
            ("ucrypt_requests", "Requests served.", |o| o.requests),
            ("ucrypt_bytes", "Bytes of plaintext moved.", |o| o.bytes),
        ];
        for (i, (name, help, value)) in counters.into_iter().enumerate() {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (vol, ops) in &snaps {
                for (op, o) in ops {
                    m.encode_family(&[("volume", *vol), ("op", *op)])?
                        .encode_counter::<NoLabelSet, _, u64>(&value(o), None)?;
                }
            }
            for (vol, a) in &auth {
                let stats = a.stats();
                for (op, c) in [("read", stats.read), ("write", stats.write)] {
                    let v = if i == 0 { c.requests } else { c.bytes };
                    m.encode_family(&[("volume", *vol), ("op", op)])?
                        .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
                }
            }
        }
        let mut m = enc.encode_descriptor(
            "ucrypt_errors",
            "Failed requests, by who can act on the error.",
            None,
            MetricType::Counter,
        )?;
        for (vol, ops) in &snaps {
            for (op, o) in ops {
                for k in ErrorKind::ALL {
                    m.encode_family(&[("volume", *vol), ("op", *op), ("kind", k.name())])?
                        .encode_counter::<NoLabelSet, _, u64>(&o.errors_of(k), None)?;
                }
            }
        }
        for (vol, a) in &auth {
            let stats = a.stats();
            for (op, c) in [("read", stats.read), ("write", stats.write)] {
                for k in ErrorKind::ALL {
                    m.encode_family(&[("volume", *vol), ("op", op), ("kind", k.name())])?
                        .encode_counter::<NoLabelSet, _, u64>(&c.errors_of(k), None)?;
                }
            }
        }
        if !auth.is_empty() {
            let mut m = enc.encode_descriptor(
                "ucrypt_integrity_mismatches",
                "Blocks whose authentication tag did not verify (dm-integrity's number of \
                 integrity mismatches).",
                None,
                MetricType::Counter,
            )?;
            for (vol, a) in &auth {
                m.encode_family(&[("volume", *vol)])?
                    .encode_counter::<NoLabelSet, _, u64>(
                        &a.integrity_mismatches().unwrap_or(0),
                        None,
                    )?;
            }
        }
        let mut m = enc.encode_descriptor(
            "ucrypt_request_seconds",
            "Time per phase of the sampled requests (one in 32).",
            None,
            MetricType::Histogram,
        )?;
        for (vol, ops) in &snaps {
            for (op, o) in ops {
                for (phase, pname) in PHASES {
                    let p = o.phase(phase);
                    let buckets: Vec<(f64, u64)> = p
                        .cumulative_ns()
                        .into_iter()
                        .map(|(le, c)| (le / 1e9, c))
                        .collect();
                    m.encode_family(&[("volume", *vol), ("op", *op), ("phase", pname)])?
                        .encode_histogram::<NoLabelSet>(p.sum_ns / 1e9, p.count, &buckets, None)?;
                }
            }
        }
        if let (Some(n), [(volume, _)]) = (self.nbd_socket.get(), self.vols.as_slice()) {
            encode_nbd_socket(&mut enc, volume, n)?;
        }
        // `--memory-budget`: one per process (every volume of this process charges it).
        if let Some(b) = ucrypt::pool::process_budget_usage() {
            let gauges = [
                (
                    "ucrypt_memory_budget_bytes",
                    "The buffer memory budget shared by the budgeted volumes of this user.",
                    b.limit_bytes,
                ),
                (
                    "ucrypt_memory_budget_used_bytes",
                    "Buffer memory charged to the budget by all its volumes.",
                    b.used_bytes,
                ),
                (
                    "ucrypt_memory_budget_charged_bytes",
                    "Buffer memory charged to the budget by this process.",
                    b.charged_bytes,
                ),
            ];
            for (name, help, v) in gauges {
                enc.encode_descriptor(name, help, None, MetricType::Gauge)?
                    .encode_gauge(&(v as i64))?;
            }
            let counters = [
                (
                    "ucrypt_memory_budget_refused_charges",
                    "Charges this process asked of the budget and was refused (a request \
                     waited for its volume's own buffers).",
                    b.refused_charges,
                ),
                (
                    "ucrypt_memory_budget_forced_charges",
                    "Charges this process made beyond the budget (a volume holding no buffer \
                     served its oldest request).",
                    b.forced_charges,
                ),
            ];
            for (name, help, v) in counters {
                enc.encode_descriptor(name, help, None, MetricType::Counter)?
                    .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
            }
        }
        Ok(())
    }
}

/// The whole exposition, as a scrape gets it.
pub fn render(volumes: &Volumes) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(volumes.clone()));
    let mut out = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug in the collector.
    if prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).is_err() {
        out = "# ucrypt: encoding the metrics failed\n".into();
    }
    out
}

/// A listening socket of either kind.
enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// An accepted connection of either kind.
trait Conn: Read + Write + Send + 'static {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
}

impl Conn for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
}

impl Conn for UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_write_timeout(self, t)
    }
}

impl Listener {
    fn accept(&self) -> std::io::Result<Box<dyn Conn>> {
        Ok(match self {
            Listener::Tcp(l) => Box::new(l.accept()?.0),
            Listener::Unix(l) => Box::new(l.accept()?.0),
        })
    }
}

/// The metrics endpoint of a process: its unix socket, if it has one, is removed when this
/// is dropped (if it is still the socket bound), so keep it for as long as the volumes are
/// served.
pub struct Started {
    _socket: Option<BoundSocket>,
}

/// Starts answering scrapes for `volumes` at `at` on a background thread that lives as long
/// as the process. A unix socket is bound by the rule every ucrypt socket follows
/// (`ucrypt_nbd::server::unix_socket`: mode 0600; a file or a live socket at the path is
/// refused, a stale socket replaced). A TCP address that is not loopback gets a warning on
/// stderr.
pub fn start(at: &Listen, volumes: Volumes) -> CliResult<Started> {
    let (listener, socket) = match at {
        Listen::Tcp { host, port } => {
            let ctx = |e| CliError::Core(ucrypt::Error::io(format!("metrics at {at}"), e));
            let l = TcpListener::bind((host.as_str(), *port)).map_err(ctx)?;
            let bound = l.local_addr().map_err(ctx)?;
            if let Some(w) = exposure_warning(bound) {
                eprintln!("WARNING: {w}");
            }
            (Listener::Tcp(l), None)
        }
        Listen::Unix(path) => {
            let (l, bound) = bind_unix(path)?;
            (Listener::Unix(l), Some(bound))
        }
    };
    let volumes = Arc::new(volumes);
    std::thread::Builder::new()
        .name("ucrypt-metrics".into())
        .spawn(move || serve(listener, volumes))
        .map_err(|e| CliError::Core(ucrypt::Error::io("starting the metrics thread", e)))?;
    Ok(Started { _socket: socket })
}

/// The warning for metrics bound at `addr`, if anyone beyond this machine may reach it.
fn exposure_warning(addr: SocketAddr) -> Option<String> {
    if addr.ip().is_loopback() {
        return None;
    }
    Some(format!(
        "metrics listen on {addr}, which is not a loopback address: anyone who can reach it \
         sees the volume names and their I/O patterns (bind 127.0.0.1 or a unix: socket, \
         or firewall the port)"
    ))
}

/// Holds one of the [`CONNECTIONS_MAX`] slots; gives it back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(busy: &Arc<AtomicUsize>) -> Option<Slot> {
        busy.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < CONNECTIONS_MAX).then_some(n + 1)
        })
        .ok()
        .map(|_| Slot(busy.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn serve(listener: Listener, volumes: Arc<Volumes>) {
    let busy = Arc::new(AtomicUsize::new(0));
    loop {
        let conn = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ucrypt metrics: accept: {e}");
                std::thread::sleep(ACCEPT_RETRY_PAUSE);
                continue;
            }
        };
        let Some(slot) = Slot::take(&busy) else {
            // Answered without reading: this costs no thread and cannot block for long.
            let _ = conn.set_write_timeout(Some(ACCEPT_RETRY_PAUSE));
            let _ = refuse_busy(conn);
            continue;
        };
        let volumes = volumes.clone();
        let spawned = std::thread::Builder::new()
            .name("ucrypt-metrics-conn".into())
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = answer(conn, &volumes) {
                    // A scraper that went away or misbehaved; the others are served all
                    // the same.
                    eprintln!("ucrypt metrics: {e}");
                }
            });
        if let Err(e) = spawned {
            eprintln!("ucrypt metrics: no thread for a scrape: {e}");
        }
    }
}

fn refuse_busy(mut s: Box<dyn Conn>) -> std::io::Result<()> {
    let body = "too many metrics connections at once\n";
    write!(
        s,
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()
}

/// What a request head asks for, parsed once.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Metrics,
    NotFound,
    Malformed,
}

fn parse_head(head: &[u8]) -> Request {
    let line = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some("GET"), Some("/metrics" | "/"), Some(v)) if v.starts_with("HTTP/1.") => {
            Request::Metrics
        }
        (Some(_), Some(_), Some(v)) if v.starts_with("HTTP/1.") => Request::NotFound,
        _ => Request::Malformed,
    }
}

fn answer(mut s: Box<dyn Conn>, volumes: &Volumes) -> std::io::Result<()> {
    let deadline = Instant::now() + REQUEST_HEAD_TIMEOUT;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() >= REQUEST_HEAD_BYTES_MAX {
            break;
        }
        // Each read may wait only for what is left of the head's deadline (a zero timeout
        // would mean none at all, hence the check first).
        let late = || {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "request head not sent within {} s ({} bytes of it came): closed",
                    REQUEST_HEAD_TIMEOUT.as_secs(),
                    head.len()
                ),
            )
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        s.set_read_timeout(Some(left))?;
        let n = match s.read(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {
                return Err(late())
            }
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let (status, ctype, body) = match parse_head(&head) {
        Request::Metrics => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            render(volumes),
        ),
        Request::NotFound => ("404 Not Found", "text/plain", "GET /metrics\n".into()),
        Request::Malformed => ("400 Bad Request", "text/plain", "GET /metrics\n".into()),
    };
    s.set_write_timeout(Some(ANSWER_TIMEOUT))?;
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_goes_unwarned() {
        let cases: [(&str, bool); 6] = [
            ("127.0.0.1:9100", false),
            ("127.8.0.1:9100", false),
            ("[::1]:9100", false),
            ("0.0.0.0:9100", true),
            ("[::]:9100", true),
            ("192.0.2.7:9100", true),
        ];
        for (addr, warned) in cases {
            let w = exposure_warning(addr.parse().expect("a socket address"));
            assert_eq!(w.is_some(), warned, "{addr}: {w:?}");
        }
    }

    #[test]
    fn request_heads() {
        let cases: [(&[u8], Request); 6] = [
            (
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                Request::Metrics,
            ),
            (b"GET / HTTP/1.0\r\n\r\n", Request::Metrics),
            (b"GET /other HTTP/1.1\r\n\r\n", Request::NotFound),
            (b"POST /metrics HTTP/1.1\r\n\r\n", Request::NotFound),
            (b"GET /metrics\r\n\r\n", Request::Malformed),
            (b"\x00\xff garbage", Request::Malformed),
        ];
        for (head, want) in cases {
            assert_eq!(
                parse_head(head),
                want,
                "{:?}",
                String::from_utf8_lossy(head)
            );
        }
    }
}
