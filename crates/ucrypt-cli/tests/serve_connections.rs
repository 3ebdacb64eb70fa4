//! Connections cost little: clients that finish the handshake and sit idle hold no request
//! buffers and no workers, so hundreds of them neither stop a newcomer from connecting and
//! doing I/O at once nor slow a busy client beside them. The clients here are a minimal NBD
//! client (fixed newstyle handshake, NBD_OPT_GO, simple replies) over the unix socket.

mod nbd_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nbd_common::*;

const MIB: usize = 1 << 20;
/// Idle clients beside the busy one.
const IDLE_CLIENTS: usize = 200;
/// What an idle connection may add to the server's anonymous memory (the goal of issue 44;
/// BENCHMARKS.md has the measured figure).
const IDLE_CONNECTION_RSS_MAX_KIB: u64 = 64;

const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

fn be32(s: &mut UnixStream) -> u32 {
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    u32::from_be_bytes(b)
}

fn be64(s: &mut UnixStream) -> u64 {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).unwrap();
    u64::from_be_bytes(b)
}

/// Connects to `sock` and negotiates export `name` (fixed newstyle, no zeroes, NBD_OPT_GO).
fn handshake(sock: &str, name: &str) -> UnixStream {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    assert_eq!(be64(&mut s), u64::from_be_bytes(*b"NBDMAGIC"));
    assert_eq!(be64(&mut s), IHAVEOPT);
    let mut flags = [0u8; 2];
    s.read_exact(&mut flags).unwrap();
    let mut out = 3u32.to_be_bytes().to_vec(); // FIXED_NEWSTYLE | NO_ZEROES
    out.extend(IHAVEOPT.to_be_bytes());
    out.extend(7u32.to_be_bytes()); // NBD_OPT_GO
    out.extend((4 + name.len() as u32 + 2).to_be_bytes());
    out.extend((name.len() as u32).to_be_bytes());
    out.extend(name.as_bytes());
    out.extend(0u16.to_be_bytes());
    s.write_all(&out).unwrap();
    loop {
        assert_eq!(be64(&mut s), OPT_REPLY_MAGIC);
        let _opt = be32(&mut s);
        let kind = be32(&mut s);
        let len = be32(&mut s);
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).unwrap();
        assert!(kind & 0x8000_0000 == 0, "option refused: {kind:#x}");
        if kind == 1 {
            return s; // NBD_REP_ACK: transmission
        }
    }
}

fn request(s: &mut UnixStream, kind: u16, cookie: u64, offset: u64, len: u32) {
    let mut h = REQUEST_MAGIC.to_be_bytes().to_vec();
    h.extend(0u16.to_be_bytes());
    h.extend(kind.to_be_bytes());
    h.extend(cookie.to_be_bytes());
    h.extend(offset.to_be_bytes());
    h.extend(len.to_be_bytes());
    s.write_all(&h).unwrap();
}

fn reply(s: &mut UnixStream, cookie: u64) {
    assert_eq!(be32(s), SIMPLE_REPLY_MAGIC);
    assert_eq!(be32(s), 0, "request failed");
    assert_eq!(be64(s), cookie);
}

/// Writes `data` at `offset` and reads it back.
fn write_read(s: &mut UnixStream, cookie: u64, offset: u64, data: &[u8]) {
    request(s, 1, cookie, offset, data.len() as u32);
    s.write_all(data).unwrap();
    reply(s, cookie);
    request(s, 0, cookie + 1, offset, data.len() as u32);
    reply(s, cookie + 1);
    let mut back = vec![0u8; data.len()];
    s.read_exact(&mut back).unwrap();
    assert!(back == data, "read back differs at {offset}");
}

/// The server's resident anonymous memory (the binary's text is not counted), in KiB.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn idle_clients_do_not_stop_a_newcomer_or_slow_a_busy_client() {
    let dir = TempDir::new("conns");
    make_image(&dir.path("disk"), 64 * MIB, None);
    let sock = dir.s("sock");
    let listen = format!("unix:{sock}");
    let disk = dir.s("disk");
    // Unencrypted: what is measured is the connections, not the volume's engine (whose
    // threads start and end with its load, moving the server's RSS by megabytes).
    let mut srv = Server::start(&[&disk, "--unencrypted", "--nbd", &listen], 1);
    // Warm the server up (its first requests allocate buffers) before measuring what idle
    // connections add.
    let mut warm = handshake(&sock, "disk");
    write_read(&mut warm, 1, 32 * MIB as u64, &[0x5a; 4096]);
    drop(warm);
    std::thread::sleep(Duration::from_millis(200));
    let rss_before = rss_kib(srv.pid());
    let t = Instant::now();
    let idle: Vec<UnixStream> = (0..IDLE_CLIENTS)
        .map(|_| handshake(&sock, "disk"))
        .collect();
    let connect_all = t.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let rss_after = rss_kib(srv.pid());
    let per_conn_kib = rss_after.saturating_sub(rss_before) / IDLE_CLIENTS as u64;
    println!(
        "{IDLE_CLIENTS} idle clients connected in {connect_all:?}; server RssAnon {rss_before} -> \
         {rss_after} KiB, {per_conn_kib} KiB per idle connection"
    );
    // A busy client writes and reads back 64 KiB at a time for the whole test.
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let busy = {
        let (sock, stop, ops) = (sock.clone(), stop.clone(), ops.clone());
        std::thread::spawn(move || {
            let mut s = handshake(&sock, "disk");
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let data = vec![(i % 251) as u8; 64 << 10];
                write_read(&mut s, 2 * i, (i % 256) * (64 << 10), &data);
                ops.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    // A newcomer connects and does I/O at once.
    let ops_before = ops.load(Ordering::Relaxed);
    let t = Instant::now();
    let mut newcomer = handshake(&sock, "disk");
    write_read(&mut newcomer, 1, 48 * MIB as u64, &[0xa5; 4096]);
    let newcomer_took = t.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    let busy_ops = ops.load(Ordering::Relaxed) - ops_before;
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap();
    assert!(
        newcomer_took < Duration::from_secs(2),
        "newcomer took {newcomer_took:?}"
    );
    assert!(busy_ops > 0, "the busy client made no progress");
    assert!(srv.alive(), "server exited");
    assert!(
        per_conn_kib <= IDLE_CONNECTION_RSS_MAX_KIB,
        "{per_conn_kib} KiB per idle connection (RssAnon {rss_before} -> {rss_after} KiB)"
    );
    drop(idle);
    assert_eq!(srv.stop(), Some(0));
}
