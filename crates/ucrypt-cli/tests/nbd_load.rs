//! Memory under load, against a running `ucrypt serve` of an encrypted volume:
//! - a client that sends writes and never reads a reply: the server stops reading its requests
//!   once the connection's share of the server's buffer budget (`CONNECTION_BYTES_MAX` in
//!   ucrypt-nbd's `server/budget.rs`, 64 MiB of payload) is in flight, so its memory stays
//!   within that share above what it used idle;
//! - fio, 4 KiB random writes at QD 256 over 4 connections: the peak RSS stays within the
//!   volume's buffer pool (16 MiB) + 32 MiB above the idle server.
//!
//! The RSS figures are printed; they are bounds checked in a test, not speed targets.

mod nbd_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

use nbd_common::*;

const SIZE: usize = 256 << 20;
const MIB: u64 = 1 << 20;
/// A connection's share of the server's payload budget (ucrypt-nbd's
/// `budget::CONNECTION_BYTES_MAX`).
const INFLIGHT_BYTES_MAX: u64 = 64 * MIB;
const POOL_BYTES: u64 = 16 * MIB;
/// Room for allocator slack, socket buffers and thread stacks touched under load.
const SLACK_BYTES: u64 = 32 * MIB;

/// (VmRSS, VmHWM) of `pid` in bytes.
fn rss(pid: i32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| {
                v.trim()
                    .trim_end_matches(" kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap()
                    * 1024
            })
            .unwrap()
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn serve(dir: &TempDir) -> Server {
    make_image(&dir.path("disk"), SIZE, None);
    std::fs::write(dir.path("key"), [0x42u8; 64]).unwrap();
    let (disk, key) = (dir.s("disk"), dir.s("key"));
    let listen = format!("unix:{}", dir.s("sock"));
    Server::start(
        &[
            &disk,
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &key,
            "--nbd",
            &listen,
            "--export-name",
            "disk",
        ],
        1,
    )
}

/// A fixed-newstyle handshake with NO_ZEROES and EXPORT_NAME "disk"; returns the socket.
fn connect(dir: &TempDir) -> UnixStream {
    let mut s = UnixStream::connect(dir.path("sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greet = [0u8; 18];
    s.read_exact(&mut greet).unwrap();
    assert_eq!(&greet[..8], b"NBDMAGIC");
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
    opt.extend_from_slice(&1u32.to_be_bytes());
    opt.extend_from_slice(&4u32.to_be_bytes());
    opt.extend_from_slice(b"disk");
    s.write_all(&opt).unwrap();
    let mut export = [0u8; 10];
    s.read_exact(&mut export).unwrap();
    assert_eq!(
        u64::from_be_bytes(export[..8].try_into().unwrap()),
        SIZE as u64
    );
    s
}

#[test]
fn a_client_that_never_reads_replies_holds_at_most_its_budget() {
    let dir = TempDir::new("noread");
    let srv = serve(&dir);
    std::thread::sleep(Duration::from_millis(300));
    let (idle, _) = rss(srv.pid());
    let mut s = connect(&dir);
    // Writes until the server stops taking them (the socket's send times out), at most 2 GiB.
    s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let payload = pattern(MIB as usize, 7);
    let mut sent = 0u64;
    let t0 = Instant::now();
    for cookie in 0..2048u64 {
        let mut h = 0x2560_9513u32.to_be_bytes().to_vec();
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&1u16.to_be_bytes());
        h.extend_from_slice(&cookie.to_be_bytes());
        h.extend_from_slice(&((cookie * MIB) % SIZE as u64).to_be_bytes());
        h.extend_from_slice(&(MIB as u32).to_be_bytes());
        if s.write_all(&h)
            .and_then(|()| s.write_all(&payload))
            .is_err()
        {
            break;
        }
        sent += MIB;
    }
    let (now, peak) = rss(srv.pid());
    println!(
        "client that never reads: {} MiB sent in {:.1} s before the server stopped reading; server RSS idle {} MiB, now {} MiB, peak {} MiB (budget {} MiB)",
        sent / MIB,
        t0.elapsed().as_secs_f64(),
        idle / MIB,
        now / MIB,
        peak / MIB,
        INFLIGHT_BYTES_MAX / MIB
    );
    assert!(
        sent < 2048 * MIB,
        "the server kept reading 2 GiB without replies being read"
    );
    assert!(
        peak <= idle + INFLIGHT_BYTES_MAX + POOL_BYTES + SLACK_BYTES,
        "peak RSS {} MiB is more than idle {} MiB + budget + pool + slack",
        peak / MIB,
        idle / MIB
    );
    // The server is still there for others, and goes once the stuck client does.
    drop(s);
    let mut ok = UnixStream::connect(dir.path("sock")).is_ok();
    ok &= srv.stop() == Some(0);
    assert!(ok, "the server did not outlive the stuck client cleanly");
}

#[test]
fn fio_qd256_over_four_connections_stays_within_pool_plus_32_mib() {
    if !need("fio", "fio") {
        return;
    }
    let dir = TempDir::new("qd256");
    let srv = serve(&dir);
    std::thread::sleep(Duration::from_millis(300));
    let (idle, _) = rss(srv.pid());
    let out = Command::new("fio")
        .args([
            "--name=qd256",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=64",
            "--numjobs=4",
            "--group_reporting",
            "--time_based",
            "--runtime=4",
            "--size=64M",
            "--output-format=terse",
        ])
        .arg(format!("--uri={}", srv.uri()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fio: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, peak) = rss(srv.pid());
    println!(
        "fio 4 KiB randwrite QD 4x64: server RSS idle {} MiB, peak {} MiB (pool {} MiB + {} MiB allowed above idle)",
        idle / MIB,
        peak / MIB,
        POOL_BYTES / MIB,
        SLACK_BYTES / MIB
    );
    assert!(
        peak <= idle + POOL_BYTES + SLACK_BYTES,
        "peak RSS {} MiB above idle {} MiB + pool + 32 MiB",
        peak / MIB,
        idle / MIB
    );
    assert_eq!(srv.stop(), Some(0));
}
