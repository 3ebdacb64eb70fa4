//! `--metrics`: `ucrypt serve` exposes Prometheus text that Prometheus' own Python parser
//! (Debian's python3-prometheus-client) reads, with byte counters equal to what fio moved
//! through the volume and timing histograms that add up. Debian packages: fio,
//! python3-prometheus-client.

mod nbd_common;

use std::io::{Read, Write};
use std::net::TcpStream;

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
