//! `--metrics`: `ucrypt serve` exposes Prometheus text that Prometheus' own Python parser
//! (Debian's python3-prometheus-client) reads, with byte counters equal to what fio moved
//! through the volume and timing histograms that add up. Debian packages: fio,
//! python3-prometheus-client.

mod nbd_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use nbd_common::*;

/// Debian's python modules are seen by this interpreter only.
const PYTHON: &str = "/usr/bin/python3";

/// Parses a scrape with prometheus_client and prints `name{labels} value` lines, sorted.
const PARSE: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        print(f"{fam.type} {s.name}{{{labels}}} {s.value}")
"#;

fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to metrics");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    let (head, body) = out.split_once("\r\n\r\n").expect("HTTP head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.to_string()
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// One parsed sample's value, by its line prefix `TYPE name{labels}`.
fn value(parsed: &str, prefix: &str) -> f64 {
    parsed
        .lines()
        .find_map(|l| l.strip_prefix(prefix)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in\n{parsed}"))
}

#[test]
fn prometheus_parser_reads_counters_that_match_fio() {
    if !need("fio", "fio") {
        return;
    }
    let parser_ok = std::process::Command::new(PYTHON)
        .args(["-c", "import prometheus_client.parser"])
        .status()
        .is_ok_and(|s| s.success());
    if !parser_ok {
        println!("SKIPPED: python3-prometheus-client is not installed (Prometheus' text parser)");
        return;
    }
    let dir = TempDir::new("metrics");
    make_image(&dir.path("disk"), 32 << 20, None);
    std::fs::write(dir.path("key"), [0x5au8; 64]).expect("key");
    let port = free_port();
    let (sock, key, at) = (
        format!("unix:{}", dir.s("sock")),
        dir.s("key"),
        format!("tcp:127.0.0.1:{port}"),
    );
    let srv = Server::start(
        &[
            &dir.s("disk"),
            "--nbd",
            &sock,
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &key,
            "--metrics",
            &at,
        ],
        1,
    );
    // 8 MiB written in 64 KiB requests, then read back and verified: 128 requests each way.
    ok(
        "fio",
        &[
            "--name=m",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri()),
            "--rw=write",
            "--bs=64k",
            "--size=8M",
            "--iodepth=4",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
        ],
    );
    let text = scrape(port);
    let out = std::process::Command::new(PYTHON)
        .args(["-c", PARSE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().expect("stdin").write_all(text.as_bytes())?;
            c.wait_with_output()
        })
        .expect("run the parser");
    assert!(out.status.success(), "parser failed on:\n{text}");
    let parsed = String::from_utf8_lossy(&out.stdout).to_string();
    let v = "volume=disk";
    let bytes = |op: &str| {
        value(
            &parsed,
            &format!("counter ucrypt_bytes_total{{op={op},{v}}}"),
        )
    };
    let reqs = |op: &str| {
        value(
            &parsed,
            &format!("counter ucrypt_requests_total{{op={op},{v}}}"),
        )
    };
    assert_eq!(bytes("write"), (8 << 20) as f64, "{parsed}");
    assert_eq!(bytes("read"), (8 << 20) as f64, "{parsed}");
    assert_eq!(reqs("write"), 128.0, "{parsed}");
    assert_eq!(reqs("read"), 128.0, "{parsed}");
    for kind in ["bad_input", "device", "internal"] {
        for op in ["read", "write"] {
            let e = value(
                &parsed,
                &format!("counter ucrypt_errors_total{{kind={kind},op={op},{v}}}"),
            );
            assert_eq!(e, 0.0);
        }
    }
    // The histogram of whole reads: its +Inf bucket is its count, its count is some of the
    // 128 reads (one in 32 is timed, at random), and its sum is positive.
    let hist = |s: &str| {
        value(
            &parsed,
            &format!("histogram ucrypt_request_seconds_{s}{{op=read,phase=total,{v}}}"),
        )
    };
    let count = hist("count");
    assert!(count <= 128.0, "{parsed}");
    let inf = value(
        &parsed,
        &format!("histogram ucrypt_request_seconds_bucket{{le=+Inf,op=read,phase=total,{v}}}"),
    );
    assert_eq!(inf, count);
    if count > 0.0 {
        assert!(hist("sum") > 0.0);
    }
    // Anything but GET /metrics is refused.
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(b"GET /nothing HTTP/1.1\r\n\r\n")
        .expect("request");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("response");
    assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
    drop(srv);
}

/// Starts `ucrypt serve` of a fresh 4 MiB image with `--metrics AT`, its stderr in `log`.
fn serve_with_metrics(dir: &TempDir, at: &str, log: std::process::Stdio) -> Server {
    make_image(&dir.path("disk"), 4 << 20, None);
    std::fs::write(dir.path("key"), [0x5au8; 64]).expect("key");
    let (sock, key) = (format!("unix:{}", dir.s("sock")), dir.s("key"));
    Server::try_start_logged(
        &[
            &dir.s("disk"),
            "--nbd",
            &sock,
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &key,
            "--metrics",
            at,
        ],
        1,
        log,
    )
    .unwrap_or_else(|e| panic!("server did not start: {e}"))
}

/// Slow clients that each send a byte now and then (a request head that never ends) hold
/// neither the scrape beside them nor the server: the scrape is answered at once, and each
/// slow one is cut at the request head's deadline (2 s), not kept as long as it dribbles.
#[test]
fn slow_clients_do_not_hold_up_a_scrape() {
    const SLOW_CLIENTS: usize = 4;
    /// How long a slow client dribbles before it counts itself as never cut.
    const DRIBBLE_MAX: Duration = Duration::from_secs(30);
    /// Loose bounds, for a loaded machine: the scrape must not wait for the slow clients'
    /// deadlines, and a slow client must be cut well before it stops by itself.
    const SCRAPE_MAX: Duration = Duration::from_secs(5);
    const CUT_MAX: Duration = Duration::from_secs(15);
    let dir = TempDir::new("metrics-slow");
    let port = free_port();
    let srv = serve_with_metrics(
        &dir,
        &format!("tcp:127.0.0.1:{port}"),
        std::process::Stdio::inherit(),
    );
    let (connected_tx, connected_rx) = std::sync::mpsc::channel();
    let slow: Vec<_> = (0..SLOW_CLIENTS)
        .map(|i| {
            let connected = connected_tx.clone();
            std::thread::spawn(move || -> Option<Duration> {
                let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                s.set_read_timeout(Some(Duration::from_millis(250)))
                    .expect("timeout");
                let start = Instant::now();
                connected.send(i).expect("tell");
                let head = b"GET /metrics HTTP/1.1\r\nX-Slow: ";
                let mut sent = 0usize;
                let mut buf = [0u8; 256];
                while start.elapsed() < DRIBBLE_MAX {
                    let byte = head.get(sent).copied().unwrap_or(b'a');
                    if s.write_all(&[byte]).is_err() {
                        return Some(start.elapsed());
                    }
                    sent += 1;
                    match s.read(&mut buf) {
                        // The server closed (or answered): cut.
                        Ok(_) => return Some(start.elapsed()),
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) => {}
                        Err(_) => return Some(start.elapsed()),
                    }
                }
                None
            })
        })
        .collect();
    for _ in 0..SLOW_CLIENTS {
        connected_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("slow clients connected");
    }
    // Let the server accept them all and start reading from them before the scrape comes.
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to metrics");
    s.set_read_timeout(Some(DRIBBLE_MAX)).expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("request");
    let mut out = String::new();
    let read = s.read_to_string(&mut out);
    let took = t.elapsed();
    assert!(
        read.is_ok() && out.starts_with("HTTP/1.1 200"),
        "scrape beside {SLOW_CLIENTS} slow clients failed after {took:?}: {read:?} {out:?}"
    );
    assert!(out.contains("ucrypt_requests_total"), "{out}");
    assert!(
        took < SCRAPE_MAX,
        "a scrape beside {SLOW_CLIENTS} slow clients took {took:?}"
    );
    for (i, h) in slow.into_iter().enumerate() {
        let cut = h.join().expect("slow client");
        let cut = cut.unwrap_or_else(|| panic!("slow client {i} was never cut"));
        assert!(cut < CUT_MAX, "slow client {i} was cut only after {cut:?}");
    }
    drop(srv);
}

/// `--metrics tcp:0.0.0.0:PORT` is served, with a warning that the metrics are reachable
/// from beyond this machine; a loopback address gets none.
#[test]
fn a_non_loopback_address_is_warned_about() {
    for (host, warned) in [("0.0.0.0", true), ("127.0.0.1", false)] {
        let dir = TempDir::new("metrics-warn");
        let log = std::fs::File::create(dir.path("log")).expect("log");
        let port = free_port();
        let srv = serve_with_metrics(&dir, &format!("tcp:{host}:{port}"), log.into());
        // The address is served all the same.
        let text = scrape(port);
        assert!(text.contains("ucrypt_requests_total"), "{text}");
        assert_eq!(srv.stop(), Some(0));
        let log = std::fs::read_to_string(dir.path("log")).expect("log");
        assert_eq!(
            log.contains("not a loopback address"),
            warned,
            "{host}: stderr was:\n{log}"
        );
    }
}
