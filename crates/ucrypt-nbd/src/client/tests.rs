//! Client driver tests against this crate's own server in the same process (no external
//! tools): URI table, many threads on two connections, error mapping, reconnection with
//! resend, and the remote timeout. Interop with nbdkit and qemu is in `tests/nbd_client.rs`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ucrypt::backend::Backend;
use ucrypt::{BlockDev, Stop};

use super::*;
use crate::server::{serve, Listen, ServerOptions};

#[test]
fn uri_table() {
    let tcp = |h: &str, p| Transport::Tcp {
        host: h.into(),
        port: p,
    };
    // (uri, transport, tls, export, certificate name)
    let good: Vec<(&str, Transport, bool, &str, &str)> = vec![
        (
            "nbd://example.com/disk",
            tcp("example.com", 10809),
            false,
            "disk",
            "example.com",
        ),
        (
            "nbd://example.com",
            tcp("example.com", 10809),
            false,
            "",
            "example.com",
        ),
        (
            "nbd://example.com/",
            tcp("example.com", 10809),
            false,
            "",
            "example.com",
        ),
        (
            "nbd://example.com//disk",
            tcp("example.com", 10809),
            false,
            "/disk",
            "example.com",
        ),
        (
            "nbd://h:1234/hello%20world",
            tcp("h", 1234),
            false,
            "hello world",
            "h",
        ),
        ("NBD://h/a+b", tcp("h", 10809), false, "a+b", "h"),
        ("nbd://[::1]:99/x", tcp("::1", 99), false, "x", "::1"),
        (
            "nbd://[fe80::1]/x",
            tcp("fe80::1", 10809),
            false,
            "x",
            "fe80::1",
        ),
        (
            "nbds://10.0.0.1:7/x?tls-type=x509&tls-verify-peer=1",
            tcp("10.0.0.1", 7),
            true,
            "x",
            "10.0.0.1",
        ),
        (
            "nbds://h/x?tls-hostname=srv.example",
            tcp("h", 10809),
            true,
            "x",
            "srv.example",
        ),
        (
            "nbd+unix:///disk?socket=/tmp/s",
            Transport::Unix("/tmp/s".into()),
            false,
            "disk",
            "localhost",
        ),
        (
            "nbd+unix:///?socket=rel%2Fs%20p",
            Transport::Unix("rel/s p".into()),
            false,
            "",
            "localhost",
        ),
        (
            "nbds+unix:///e?socket=%00abs",
            Transport::UnixAbstract(b"abs".to_vec()),
            true,
            "e",
            "localhost",
        ),
        (
            "nbds+unix:///e?socket=/s&tls-hostname=a.b",
            Transport::Unix("/s".into()),
            true,
            "e",
            "a.b",
        ),
    ];
    for (s, transport, tls, export, name) in good {
        let u = NbdUri::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(u.transport, transport, "{s}");
        assert_eq!(u.tls, tls, "{s}");
        assert_eq!(u.export, export, "{s}");
        assert_eq!(u.server_name(), name, "{s}");
        assert_eq!(u.to_string(), s);
    }
    // (uri, error must mention)
    let bad = [
        ("http://h/x", "unsupported scheme"),
        ("nbd:/x", "expected nbd://"),
        ("nbd+vsock://2/x", "unsupported scheme"),
        ("nbd+unix:///x", "socket=PATH parameter is required"),
        ("nbd+unix://host/x?socket=/s", "has no host"),
        ("nbd+unix:///x?socket=", "empty socket path"),
        ("nbd://h/x?socket=/s", "only for the nbd+unix"),
        ("nbd:///x", "needs a host"),
        ("nbd://h:0/x", "bad port '0'"),
        ("nbd://h:99999/x", "bad port '99999'"),
        ("nbd://h:p/x", "bad port 'p'"),
        ("nbd://[::1/x", "unterminated"),
        ("nbd://user@h/x", "user name"),
        ("nbd://h/x?foo=1", "unknown query parameter 'foo'"),
        ("nbd://h/x?x-thing=1", "unknown query parameter 'x-thing'"),
        ("nbd://h/x?tls-hostname=a", "need an nbds scheme"),
        ("nbds://h/x?tls-type=psk", "tls-type 'psk'"),
        ("nbds://h/x?tls-verify-peer=0", "always verified"),
        ("nbds://h/x?tls-verify-peer=yes", "must be 0 or 1"),
        ("nbd://h/%zz", "bad percent escape"),
        ("nbd://h/a%00b", "NUL"),
        ("nbd://h/%ff", "not UTF-8"),
        ("nbd://h/x#frag", "fragment"),
        ("nbd+unix:///x?socket=/a&socket=/b", "given twice"),
    ];
    for (s, needle) in bad {
        match NbdUri::parse(s) {
            Err(e) => assert!(e.to_string().contains(needle), "{s}: {e}"),
            Ok(u) => panic!("{s}: accepted as {u:?}"),
        }
    }
    let long = format!("nbd://h/{}", "x".repeat(URI_MAX_BYTES));
    assert!(NbdUri::parse(&long).is_err());
}

const SIZE: u64 = 8 << 20;
/// Reads here fail with EIO on the server's device.
const BAD: std::ops::Range<u64> = (4 << 20)..(4 << 20) + 4096;

/// The device behind the in-process server; it outlives server restarts.
struct Dev {
    data: Mutex<Vec<u8>>,
    flushes: AtomicU32,
}

impl BlockDev for Dev {
    fn size(&self) -> u64 {
        SIZE
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
        if BAD.contains(&offset) {
            return Err(ucrypt::Error::io(
                "injected",
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        let d = self.data.lock().unwrap();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.data.lock().unwrap()[offset as usize..offset as usize + buf.len()]
            .copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> ucrypt::Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.data.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0xdd);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.data.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

struct Server {
    stop: Stop,
    thread: Option<JoinHandle<crate::Result<()>>>,
}

impl Server {
    fn start(dev: &Arc<Dev>, sock: &Path) -> Server {
        let stop = Stop::new();
        let (d, s, p) = (
            dev.clone() as Arc<dyn BlockDev>,
            stop.clone(),
            sock.to_path_buf(),
        );
        let thread = std::thread::spawn(move || {
            let opts = ServerOptions {
                read_only: false,
                tls: None,
                insecure_plaintext: false,
                pid_file: None,
                announce: false,
                poll: Duration::ZERO,
                poll_backoff: true,
                workers: crate::server::WORKERS_PER_CONNECTION,
                idle_timeout: crate::server::IDLE_TIMEOUT_DEFAULT,
                connections_max: crate::server::CONNECTIONS_MAX_DEFAULT,
            };
            serve(vec![("m".into(), d)], &Listen::Unix(p), opts, s)
        });
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(sock).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "server did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Server {
            stop,
            thread: Some(thread),
        }
    }

    fn kill(mut self) {
        self.stop.request();
        if let Some(t) = self.thread.take() {
            t.join().unwrap().unwrap();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.request();
    }
}

fn dir(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "ucrypt-nbdc-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn new_dev() -> Arc<Dev> {
    Arc::new(Dev {
        data: Mutex::new(vec![0x11; SIZE as usize]),
        flushes: AtomicU32::new(0),
    })
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

fn uri(sock: &Path) -> NbdUri {
    NbdUri::parse(&format!("nbd+unix:///m?socket={}", sock.display())).unwrap()
}

fn opts(connections: usize, timeout_ms: u64) -> ClientOptions {
    ClientOptions {
        connections,
        remote_timeout: Duration::from_millis(timeout_ms),
        ..ClientOptions::default()
    }
}

#[test]
fn threads_connections_flush_trim_zeroes_and_errors() {
    let d = dir("basic");
    let sock = d.join("s");
    let dev = new_dev();
    let server = Server::start(&dev, &sock);
    let b = Arc::new(NbdBackend::connect(&uri(&sock), &opts(2, 5000)).unwrap());
    assert_eq!(b.connections(), 2, "the server advertises CAN_MULTI_CONN");
    assert_eq!(b.size(), SIZE);
    assert_eq!(b.logical_block_bytes(), 512);
    assert!(b.describe().contains("2 connections"), "{}", b.describe());

    // 8 threads, each its own 512 KiB region, writes of 512 B .. 64 KiB.
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                let base = t * (512 << 10);
                let mut at = 0u64;
                let mut k = 0;
                while at < 512 << 10 {
                    let len = (512usize << (k % 8)).min(((512 << 10) - at) as usize);
                    let p = pattern(len, t * 1000 + k);
                    b.write_at(&p, base + at).unwrap();
                    let mut r = vec![0u8; len];
                    assert_eq!(b.read_at(&mut r, base + at).unwrap(), len);
                    assert!(r == p, "thread {t} piece {k}");
                    at += len as u64;
                    k += 1;
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // What the server's device holds equals what a whole read returns.
    let mut all = vec![0u8; 4 << 20];
    b.read_exact_at(&mut all, 0).unwrap();
    assert!(all == dev.data.lock().unwrap()[..4 << 20]);

    let before = dev.flushes.load(Ordering::SeqCst);
    b.flush().unwrap();
    assert!(
        dev.flushes.load(Ordering::SeqCst) >= before + 2,
        "a flush per connection"
    );

    b.write_zeroes(4096, 8192).unwrap();
    b.discard(65536, 4096).unwrap();
    {
        let data = dev.data.lock().unwrap();
        assert!(data[4096..12288].iter().all(|&x| x == 0));
        assert!(data[65536..69632].iter().all(|&x| x == 0xdd));
    }

    // A server error names the command, the URI and the NBD error; the errno survives.
    let mut r = vec![0u8; 4096];
    let e = b.read_at(&mut r, BAD.start).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("NBD_CMD_READ") && msg.contains("NBD_EIO"),
        "{msg}"
    );
    assert!(msg.contains(&sock.display().to_string()), "{msg}");
    assert_eq!(e.errno(), libc::EIO);
    // The connection is still in sync after the error.
    b.read_at(&mut r, 0).unwrap();

    // Caller misuse: unaligned, out of range; reads past the end are short.
    assert!(matches!(
        b.write_at(&[0u8; 100], 0),
        Err(ucrypt::Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.write_at(&[0u8; 512], SIZE),
        Err(ucrypt::Error::OutOfRange { .. })
    ));
    assert_eq!(b.read_at(&mut r, SIZE - 512).unwrap(), 512);
    assert_eq!(b.read_at(&mut r, SIZE).unwrap(), 0);

    drop(b);
    server.kill();
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn reconnects_and_resends_across_a_server_restart() {
    let d = dir("reconnect");
    let sock = d.join("s");
    let dev = new_dev();
    let server = Server::start(&dev, &sock);
    let b = Arc::new(NbdBackend::connect(&uri(&sock), &opts(2, 20_000)).unwrap());
    let acked: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let stop_writers = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..6u64)
        .map(|t| {
            let (b, acked, stop) = (b.clone(), acked.clone(), stop_writers.clone());
            std::thread::spawn(move || {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let off = (t * 128 + k % 128) * 4096;
                    let seed = t << 32 | k;
                    b.write_at(&pattern(4096, seed), off).unwrap();
                    acked.lock().unwrap().push((off, seed));
                    if k % 16 == 0 {
                        b.flush().unwrap();
                    }
                    k += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    server.kill();
    std::thread::sleep(Duration::from_millis(400));
    let server = Server::start(&dev, &sock);
    std::thread::sleep(Duration::from_millis(300));
    stop_writers.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    // Every write that returned Ok is on the device (the last one per offset wins).
    let mut last = std::collections::HashMap::new();
    for (off, seed) in acked.lock().unwrap().iter() {
        last.insert(*off, *seed);
    }
    assert!(last.len() > 100, "too few writes: {}", last.len());
    assert!(b.reconnections() >= 2, "both connections came back");
    let data = dev.data.lock().unwrap().clone();
    for (off, seed) in last {
        assert!(
            data[off as usize..off as usize + 4096] == pattern(4096, seed)[..],
            "acknowledged write at {off} lost"
        );
    }
    drop(b);
    server.kill();
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn requests_fail_after_the_remote_timeout_and_later_ones_retry() {
    let d = dir("timeout");
    let sock = d.join("s");
    let dev = new_dev();
    let server = Server::start(&dev, &sock);
    let u = uri(&sock);
    let b = NbdBackend::connect(&u, &opts(1, 600)).unwrap();
    b.write_at(&[7u8; 512], 0).unwrap();
    server.kill();
    let t0 = Instant::now();
    let e = b.write_at(&[8u8; 512], 512).unwrap_err();
    let took = t0.elapsed();
    let msg = e.to_string();
    assert!(msg.contains(&u.to_string()), "{msg}");
    assert!(msg.contains("remote timeout of 600 ms"), "{msg}");
    assert_eq!(e.errno(), libc::ETIMEDOUT);
    assert!(took < Duration::from_secs(5), "failed only after {took:?}");
    // The next request, with the server back, reconnects.
    let server = Server::start(&dev, &sock);
    b.write_at(&[9u8; 512], 1024).unwrap();
    assert_eq!(b.reconnections(), 1);
    assert_eq!(dev.data.lock().unwrap()[1024], 9);
    drop(b);
    server.kill();
    // Connecting to nothing fails at once with the URI in the message.
    let e = NbdBackend::connect(&u, &opts(1, 600)).unwrap_err();
    assert!(e.to_string().contains(&u.to_string()), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Once the process stops (`give_up_on`), a server that has gone is given up on within one
/// remote timeout of the stop, and the requests made after that (a stopping process's last
/// flushes) fail at once instead of re-arming a remote timeout each.
#[test]
fn once_stopping_a_gone_server_costs_one_remote_timeout() {
    const TIMEOUT_MS: u64 = 1500;
    /// Loose, for a loaded machine; below a second remote timeout.
    const SLACK: Duration = Duration::from_millis(1200);
    let d = dir("stopping");
    let sock = d.join("s");
    let dev = new_dev();
    let server = Server::start(&dev, &sock);
    let u = uri(&sock);
    let b = NbdBackend::connect(&u, &opts(1, TIMEOUT_MS)).unwrap();
    let stop = Stop::new();
    b.give_up_on(&stop);
    b.write_at(&[7u8; 512], 0).unwrap();
    server.kill();
    let t0 = Instant::now();
    stop.request();
    let e = b.write_at(&[8u8; 512], 512).unwrap_err();
    assert_eq!(e.errno(), libc::ETIMEDOUT, "{e}");
    for _ in 0..3 {
        let e = b.flush().unwrap_err();
        assert!(e.to_string().contains("before the process stopped"), "{e}");
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(TIMEOUT_MS) + SLACK,
        "a write and three flushes took {took:?} after the stop"
    );
    drop(b);
    let _ = std::fs::remove_dir_all(&d);
}

/// A scripted server: the first connection takes requests and never answers, then drops;
/// the second records the order in which requests arrive and answers them all.
fn scripted_server(listener: std::os::unix::net::UnixListener, held: usize) -> Vec<(u16, u64)> {
    use crate::proto::transmission::REQUEST_HEADER_BYTES;
    use crate::proto::{encode_simple_reply, ExportInfo, Handshake, Step, TlsPolicy};
    use std::io::{Read, Write};

    let info = ExportInfo {
        name: "m".into(),
        description: String::new(),
        size_bytes: SIZE,
        tx_flags: crate::server::tx_flags(false) & !crate::proto::TX_CAN_MULTI_CONN,
        min_block_bytes: 512,
        preferred_block_bytes: 4096,
        max_payload_bytes: 1 << 20,
    };
    let accept = || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut hs = Handshake::new(vec![info.clone()], TlsPolicy::Disabled);
        loop {
            s.write_all(&hs.take_output()).unwrap();
            let mut b = vec![0u8; hs.bytes_wanted()];
            s.read_exact(&mut b).unwrap();
            if let Step::Transmission(_) = hs.feed(&b).unwrap() {
                s.write_all(&hs.take_output()).unwrap();
                return s;
            }
        }
    };
    let read_req = |s: &mut std::os::unix::net::UnixStream| {
        let mut h = [0u8; REQUEST_HEADER_BYTES];
        s.read_exact(&mut h).unwrap();
        let h = crate::proto::RequestHeader::parse(&h).unwrap();
        if h.kind == crate::proto::CMD_WRITE {
            let mut payload = vec![0u8; h.length as usize];
            s.read_exact(&mut payload).unwrap();
        }
        h
    };
    // 1: swallow `held` requests, answer none, drop the connection.
    let mut s = accept();
    for _ in 0..held {
        read_req(&mut s);
    }
    drop(s);
    // 2: the resent requests, in arrival order.
    let mut s = accept();
    let mut order = Vec::new();
    for _ in 0..held {
        let h = read_req(&mut s);
        order.push((h.kind, h.offset));
        s.write_all(&encode_simple_reply(h.cookie, None)).unwrap();
    }
    // Keep answering until the client hangs up.
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut h = [0u8; REQUEST_HEADER_BYTES];
    while s.read_exact(&mut h).is_ok() {}
    order
}

#[test]
fn a_flush_in_flight_at_a_drop_is_resent_after_the_writes() {
    let d = dir("order");
    let sock = d.join("s");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    const WRITERS: u64 = 6;
    let server = std::thread::spawn(move || scripted_server(listener, WRITERS as usize + 1));
    let b = Arc::new(NbdBackend::connect(&uri(&sock), &opts(4, 20_000)).unwrap());
    assert_eq!(b.connections(), 1, "no CAN_MULTI_CONN, one connection");
    // The writes go out first, then the flush, all unanswered on the first connection.
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || b.write_at(&pattern(4096, t), t * 4096).unwrap())
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let flusher = {
        let b = b.clone();
        std::thread::spawn(move || b.flush().unwrap())
    };
    for w in writers {
        w.join().unwrap();
    }
    flusher.join().unwrap();
    drop(b);
    let order = server.join().unwrap();
    let flush_at = order
        .iter()
        .position(|(kind, _)| *kind == crate::proto::CMD_FLUSH)
        .expect("flush resent");
    assert_eq!(flush_at, WRITERS as usize, "resend order: {order:?}");
    let _ = std::fs::remove_dir_all(&d);
}
