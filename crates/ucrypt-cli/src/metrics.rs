//! `--metrics tcp:HOST:PORT|unix:PATH`: every served volume's counters and timing histograms
//! in Prometheus' text format, answered to `GET /metrics` over HTTP/1.x.
//!
//! Read at scrape time from `Volume::stats()` (an authenticated volume: the counters of
//! `open::Authenticated`), nothing is recorded twice. Per volume (label
//! `volume`) and direction (label `op`: read; write, which also counts write-zeroes and
//! discards):
//! - `ucrypt_requests_total`, `ucrypt_bytes_total`;
//! - `ucrypt_errors_total` by `kind` (who can act: bad_input, wrong_key, bad_data, device,
//!   peer, internal);
//! - `ucrypt_integrity_mismatches_total` (authenticated volumes only, label `volume`): blocks
//!   whose tag did not verify, dm-integrity's "number of integrity mismatches";
//! - `ucrypt_request_seconds` histograms by `phase` (wait, queue, crypto, backend, total). As
//!   the engine times one request in `SAMPLE_EVERY` (32) at random, their counts are of the
//!   sampled requests; bucket edges are the engine's log2 clock-tick buckets in seconds.
//!
//! The HTTP side is deliberately small: one connection at a time, a request head of at most
//! [`REQUEST_HEAD_BYTES_MAX`] read within [`REQUEST_TIMEOUT`], `Connection: close`.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::time::Duration;

use clap::Args;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use ucrypt::engine::{OpStats, Phase};
use ucrypt::ErrorKind;
use ucrypt_nbd::server::{bind_unix, BoundSocket, Listen};

use crate::error::{CliError, CliResult};
use crate::open::{Authenticated, Opened};

/// Longest request head (request line and headers) read from a scraper.
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 << 10;
/// How long a scraper may take to send its request and take the answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Args, Debug, Clone, Default)]
pub struct MetricsArgs {
    /// Expose Prometheus metrics (HTTP GET /metrics) at tcp:HOST:PORT or unix:PATH (mode 0600).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<Listen>,
}

/// The volumes a process serves, named as their `volume` label.
#[derive(Clone)]
pub struct Volumes(pub Vec<(String, Opened)>);

impl Volumes {
    /// The one volume of a front end, labelled with its file or image name.
    pub fn one(args: &crate::open::VolumeArgs, vol: &Opened) -> Volumes {
        Volumes(vec![(args.volume.label(), vol.clone())])
    }
}

impl std::fmt::Debug for Volumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(n, _)| n))
            .finish()
    }
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
        // Plain volumes: the engine's statistics. Authenticated ones: the counters their
        // wrapper keeps (no timings: they do not run on the engine).
        let snaps: Vec<(&str, [(&str, OpStats); 2])> = self
            .0
            .iter()
            .filter_map(|(n, v)| v.plain().map(|v| (n, v.stats())))
            .map(|(n, s)| (n.as_str(), [("read", s.read), ("write", s.write)]))
            .collect();
        let auth: Vec<(&str, &Authenticated)> = self
            .0
            .iter()
            .filter_map(|(n, v)| match v {
                Opened::Integrity(a) => Some((n.as_str(), &**a)),
                Opened::Plain(_) => None,
            })
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
                for (op, c) in ["read", "write"].into_iter().zip(a.op_counts()) {
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
            for (op, write) in [("read", false), ("write", true)] {
                for k in ErrorKind::ALL {
                    m.encode_family(&[("volume", *vol), ("op", op), ("kind", k.name())])?
                        .encode_counter::<NoLabelSet, _, u64>(&a.errors_of(write, k), None)?;
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
                    .encode_counter::<NoLabelSet, _, u64>(&a.integrity_mismatches(), None)?;
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

/// The metrics endpoint of a process: its unix socket, if it has one, is removed when this
/// is dropped (if it is still the socket bound), so keep it for as long as the volumes are
/// served.
pub struct Started {
    _socket: Option<BoundSocket>,
}

/// Starts answering scrapes for `volumes` at `at` on a background thread that lives as long
/// as the process. A unix socket is bound by the rule every ucrypt socket follows
/// (`ucrypt_nbd::server::unix_socket`: mode 0600; a file or a live socket at the path is
/// refused, a stale socket replaced).
pub fn start(at: &Listen, volumes: Volumes) -> CliResult<Started> {
    let (listener, socket) = match at {
        Listen::Tcp { host, port } => {
            let l = TcpListener::bind((host.as_str(), *port))
                .map_err(|e| CliError::Core(ucrypt::Error::io(format!("metrics at {at}"), e)))?;
            (Listener::Tcp(l), None)
        }
        Listen::Unix(path) => {
            let (l, bound) = bind_unix(path)?;
            (Listener::Unix(l), Some(bound))
        }
    };
    std::thread::Builder::new()
        .name("ucrypt-metrics".into())
        .spawn(move || serve(listener, &volumes))
        .map_err(|e| CliError::Core(ucrypt::Error::io("starting the metrics thread", e)))?;
    Ok(Started { _socket: socket })
}

fn serve(listener: Listener, volumes: &Volumes) {
    loop {
        let r = match &listener {
            Listener::Tcp(l) => l.accept().and_then(|(s, _)| {
                s.set_read_timeout(Some(REQUEST_TIMEOUT))?;
                s.set_write_timeout(Some(REQUEST_TIMEOUT))?;
                answer(s, volumes)
            }),
            Listener::Unix(l) => l.accept().and_then(|(s, _)| {
                s.set_read_timeout(Some(REQUEST_TIMEOUT))?;
                s.set_write_timeout(Some(REQUEST_TIMEOUT))?;
                answer(s, volumes)
            }),
        };
        if let Err(e) = r {
            // A scraper that went away or misbehaved; the next one is served all the same.
            eprintln!("ucrypt metrics: {e}");
        }
    }
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

fn answer(mut s: impl Read + Write, volumes: &Volumes) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() >= REQUEST_HEAD_BYTES_MAX {
            break;
        }
        let n = s.read(&mut buf)?;
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
