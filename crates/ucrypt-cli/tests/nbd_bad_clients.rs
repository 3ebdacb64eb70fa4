//! Hostile and broken clients against a running server, over a raw unix socket: truncated and
//! malformed handshakes, unknown options and commands, out-of-range, unaligned and oversized
//! requests, clients that vanish mid-request. After each, the server must still be alive and
//! serve a well-behaved client; nothing acknowledged may be lost.

mod nbd_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nbd_common::*;

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const SIZE: u64 = 4 << 20;

struct Raw(UnixStream);

impl Raw {
    fn connect(dir: &TempDir) -> Raw {
        let s = UnixStream::connect(dir.path("sock")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = Raw(s);
        let mut greet = [0u8; 18];
        r.0.read_exact(&mut greet).unwrap();
        assert_eq!(&greet[..8], b"NBDMAGIC");
        r
    }
    fn send(&mut self, b: &[u8]) -> bool {
        self.0.write_all(b).is_ok()
    }
    fn option(&mut self, code: u32, data: &[u8]) -> bool {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&code.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        self.send(&v)
    }
    /// Reads one option reply: (option, type, data).
    fn opt_reply(&mut self) -> Option<(u32, u32, Vec<u8>)> {
        let mut h = [0u8; 20];
        self.0.read_exact(&mut h).ok()?;
        assert_eq!(
            u64::from_be_bytes(h[..8].try_into().unwrap()),
            OPT_REPLY_MAGIC
        );
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut d = vec![0u8; len];
        self.0.read_exact(&mut d).ok()?;
        Some((
            u32::from_be_bytes(h[8..12].try_into().unwrap()),
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
            d,
        ))
    }
    /// Sends GO for `name` and reads replies up to the final one; returns its type.
    fn go(&mut self, name: &str) -> u32 {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes()); // NBD_INFO_BLOCK_SIZE
        assert!(self.option(7, &d));
        loop {
            let (_, t, _) = self.opt_reply().expect("GO reply");
            if t != 3 {
                return t;
            }
        }
    }
    fn start(dir: &TempDir) -> Raw {
        let mut r = Raw::connect(dir);
        assert!(r.send(&1u32.to_be_bytes()));
        assert_eq!(r.go("disk"), 1, "GO not acknowledged");
        r
    }
    fn request(&mut self, kind: u16, flags: u16, cookie: u64, offset: u64, len: u32) -> bool {
        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        self.send(&b)
    }
    /// Reads a simple reply: (error, cookie).
    fn reply(&mut self) -> Option<(u32, u64)> {
        let mut h = [0u8; 16];
        self.0.read_exact(&mut h).ok()?;
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), 0x6744_6698);
        Some((
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        ))
    }
    /// True if the server closed the connection (EOF) within the read timeout.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}

fn serve(dir: &TempDir) -> Server {
    serve_with(dir, &["--unencrypted"])
}

fn serve_with(dir: &TempDir, extra: &[&str]) -> Server {
    make_image(&dir.path("disk"), SIZE as usize, Some(0xbad));
    let disk = dir.s("disk");
    let listen = format!("unix:{}", dir.s("sock"));
    let mut args = vec![disk.as_str(), "--nbd", &listen, "--export-name", "disk"];
    args.extend_from_slice(extra);
    Server::start(&args, 1)
}

/// CPU time (user + system) the process has used so far.
fn cpu_time(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start at its closing ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of stat (11 and 12 after the name and state).
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// A well-behaved session: write, read back, flush.
fn healthy(dir: &TempDir) {
    let mut c = Raw::start(dir);
    let data = pattern(8192, 42);
    assert!(c.request(1, 0, 1, SIZE - 8192, 8192) && c.send(&data));
    assert_eq!(c.reply(), Some((0, 1)));
    assert!(c.request(0, 0, 2, SIZE - 8192, 8192));
    assert_eq!(c.reply(), Some((0, 2)));
    let mut back = vec![0u8; 8192];
    c.0.read_exact(&mut back).unwrap();
    assert_eq!(back, data);
    assert!(c.request(3, 0, 3, 0, 0));
    assert_eq!(c.reply(), Some((0, 3)));
    assert!(c.request(2, 0, 4, 0, 0));
    assert!(c.closed());
}

#[test]
fn malformed_handshakes_are_disconnected_and_server_survives() {
    let dir = TempDir::new("bad-hs");
    let mut srv = serve(&dir);
    type Case = (&'static str, fn(&mut Raw) -> bool);
    #[rustfmt::skip]
    let cases: Vec<Case> = vec![
        ("close at once", |_| true),
        ("truncated client flags", |c| c.send(&[0, 0])),
        ("unknown client flags", |c| c.send(&0xffff_ffffu32.to_be_bytes())),
        ("bad option magic", |c| c.send(&1u32.to_be_bytes()) && c.send(&[0u8; 16])),
        ("4 GiB option length", |c| c.send(&1u32.to_be_bytes()) && c.send(&IHAVEOPT.to_be_bytes()) && c.send(&[0, 0, 0, 9, 0xff, 0xff, 0xff, 0xff])),
        ("truncated option data", |c| c.send(&1u32.to_be_bytes()) && c.send(&IHAVEOPT.to_be_bytes()) && c.send(&[0, 0, 0, 7, 0, 0, 1, 0, 1, 2, 3])),
        ("EXPORT_NAME of unknown export", |c| c.send(&1u32.to_be_bytes()) && c.option(1, b"nope")),
        ("EXPORT_NAME of 5000 bytes", |c| c.send(&1u32.to_be_bytes()) && c.option(1, &[b'x'; 5000])),
    ];
    for (name, act) in cases {
        let mut c = Raw::connect(&dir);
        act(&mut c);
        drop(c);
        assert!(srv.alive(), "server died after '{name}'");
        healthy(&dir);
    }
    // Disconnects that the server must cause itself (not just notice).
    for (name, payload) in [
        ("unknown client flags", vec![0xffu8; 4]),
        (
            "bad option magic",
            [1u32.to_be_bytes().to_vec(), vec![0u8; 16]].concat(),
        ),
    ] {
        let mut c = Raw::connect(&dir);
        c.send(&payload);
        assert!(c.closed(), "'{name}' did not disconnect");
    }
    assert_eq!(srv.stop(), Some(0));
}

#[test]
fn option_errors_are_replies_not_disconnects() {
    let dir = TempDir::new("bad-opt");
    let srv = serve(&dir);
    let mut c = Raw::connect(&dir);
    assert!(c.send(&1u32.to_be_bytes()));
    #[rustfmt::skip]
    let cases: Vec<(&str, u32, Vec<u8>, u32)> = vec![
        ("unknown option", 0x4242, b"junk".to_vec(), 0x8000_0001),
        ("structured replies unsupported", 8, vec![], 0x8000_0001),
        ("STARTTLS without TLS", 5, vec![], 0x8000_0002),
        ("LIST with data", 3, vec![1], 0x8000_0003),
        ("INFO too short", 6, vec![0, 0], 0x8000_0003),
        ("INFO name past end", 6, vec![0, 0, 1, 0, 0, 0], 0x8000_0003),
        ("INFO unknown export", 6, [3u32.to_be_bytes().to_vec(), b"zzz".to_vec(), vec![0, 0]].concat(), 0x8000_0006),
        ("GO unknown export", 7, [3u32.to_be_bytes().to_vec(), b"zzz".to_vec(), vec![0, 0]].concat(), 0x8000_0006),
    ];
    for (name, code, data, want) in cases {
        assert!(c.option(code, &data));
        let (o, t, _) = c
            .opt_reply()
            .unwrap_or_else(|| panic!("'{name}': no reply"));
        assert_eq!((o, t), (code, want), "case '{name}'");
    }
    assert_eq!(c.go("disk"), 1);
    assert!(c.request(2, 0, 0, 0, 0));
    drop(srv);
}

#[test]
fn bad_requests_get_errors_and_the_stream_stays_in_sync() {
    let dir = TempDir::new("bad-req");
    let mut srv = serve(&dir);
    let mut c = Raw::start(&dir);
    const EPERM: u32 = 1;
    const EINVAL: u32 = 22;
    const ENOSPC: u32 = 28;
    let _ = EPERM;
    #[rustfmt::skip]
    let cases: Vec<(&str, u16, u16, u64, u32, bool, u32)> = vec![
        // name, kind, flags, offset, len, sends payload, expected error
        ("unknown command", 0x55, 0, 0, 0, false, EINVAL),
        ("block status not negotiated", 7, 0, 0, 512, false, EINVAL),
        ("read past end", 0, 0, SIZE - 512, 1024, false, EINVAL),
        ("read offset overflow", 0, 0, u64::MAX - 511, 1024, false, EINVAL),
        ("read unaligned", 0, 0, 100, 512, false, EINVAL),
        ("read over max payload", 0, 0, 0, (32 << 20) + 512, false, EINVAL),
        ("write past end (payload skipped)", 1, 0, SIZE, 4096, true, ENOSPC),
        ("write unaligned (payload skipped)", 1, 0, 3, 512, true, EINVAL),
        ("write with unknown flag", 1, 0x80, 0, 512, true, EINVAL),
        ("trim past end", 4, 0, SIZE, 512, false, EINVAL),
        ("write zeroes past end", 6, 0, SIZE - 512, 4096, false, ENOSPC),
        ("flush with a length", 3, 0, 0, 512, false, EINVAL),
    ];
    for (i, (name, kind, flags, off, len, payload, want)) in cases.into_iter().enumerate() {
        let cookie = 0x1000 + i as u64;
        assert!(c.request(kind, flags, cookie, off, len));
        if payload {
            assert!(c.send(&vec![0xee; len as usize]));
        }
        assert_eq!(c.reply(), Some((want, cookie)), "case '{name}'");
    }
    // Still in sync: a valid read returns the original data.
    assert!(c.request(0, 0, 9, 0, 4096));
    assert_eq!(c.reply(), Some((0, 9)));
    let mut back = vec![0u8; 4096];
    c.0.read_exact(&mut back).unwrap();
    assert_eq!(back, pattern(SIZE as usize, 0xbad)[..4096]);
    // A write larger than the maximum payload cannot be skipped safely: disconnect.
    assert!(c.request(1, 0, 10, 0, (32 << 20) + 1));
    assert!(c.closed());
    // Bad request magic: disconnect.
    let mut c = Raw::start(&dir);
    assert!(c.send(&[0u8; 28]));
    assert!(c.closed());
    assert!(srv.alive());
    healthy(&dir);
    drop(srv);
}

#[test]
fn vanishing_clients_lose_nothing_acknowledged() {
    let dir = TempDir::new("vanish");
    let mut srv = serve(&dir);
    // Acknowledged write, then a second write whose payload is cut off, then gone.
    let mut c = Raw::start(&dir);
    assert!(c.request(1, 0, 1, 0, 4096) && c.send(&[0x61; 4096]));
    assert_eq!(c.reply(), Some((0, 1)));
    assert!(c.request(1, 0, 2, 4096, 1 << 20) && c.send(&[0x62; 1000]));
    drop(c);
    // A client that pipelines many reads and never reads the replies.
    let mut c = Raw::start(&dir);
    for i in 0..200 {
        if !c.request(0, 0, i, 0, 1 << 20) {
            break;
        }
    }
    drop(c);
    // A client that sends half a header.
    let mut c = Raw::start(&dir);
    assert!(c.send(&[0x25, 0x60, 0x95]));
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    assert!(srv.alive());
    healthy(&dir);
    assert_eq!(srv.stop(), Some(0));
    let data = std::fs::read(dir.path("disk")).unwrap();
    assert!(
        data[..4096].iter().all(|&b| b == 0x61),
        "acknowledged write lost"
    );
    assert_eq!(
        data[4096..8192],
        pattern(SIZE as usize, 0xbad)[4096..8192],
        "unacknowledged partial write applied"
    );
}

#[test]
fn many_connections_are_bounded_and_recover() {
    let dir = TempDir::new("many");
    let mut srv = serve_with(&dir, &["--unencrypted", "--max-connections", "16"]);
    // Open more handshaking connections than the limit; the extra ones are closed.
    let mut conns: Vec<UnixStream> = Vec::new();
    for _ in 0..24 {
        let s = UnixStream::connect(dir.path("sock")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        conns.push(s);
    }
    std::thread::sleep(Duration::from_millis(800));
    let mut served = 0;
    for s in conns.iter_mut() {
        let mut g = [0u8; 18];
        if s.read_exact(&mut g).is_ok() {
            served += 1;
        }
    }
    assert!(served <= 16, "{served} connections served at once");
    drop(conns);
    std::thread::sleep(Duration::from_millis(300));
    assert!(srv.alive());
    healthy(&dir);
}

#[test]
fn idle_clients_give_their_slots_to_a_new_client() {
    let dir = TempDir::new("idle");
    let mut srv = serve_with(
        &dir,
        &[
            "--unencrypted",
            "--idle-timeout",
            "1",
            "--max-connections",
            "16",
        ],
    );
    // Every slot taken by a client that finished its handshake and then sends nothing.
    let idle: Vec<Raw> = (0..16).map(|_| Raw::start(&dir)).collect();
    std::thread::sleep(Duration::from_millis(1500));
    // A good client is served within a bounded time: it takes the slot of an idle one.
    let t0 = std::time::Instant::now();
    healthy(&dir);
    assert!(t0.elapsed() < Duration::from_secs(10), "new client waited");
    assert!(srv.alive());
    // One idle client gave its slot up (closed); the others are still connected.
    let closed = idle
        .into_iter()
        .filter_map(|mut c| {
            c.0.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            let mut b = [0u8; 1];
            match c.0.read(&mut b) {
                Ok(0) => Some(()),
                _ => None,
            }
        })
        .count();
    assert!((1..16).contains(&closed), "{closed} idle clients closed");
    assert_eq!(srv.stop(), Some(0));
}

/// Idle connections opened beside the busy client (the load: 1,000).
const IDLE_CONNECTIONS: usize = 1000;
/// How long the busy client's throughput is measured, alone and beside the idle ones.
const BUSY_WINDOW: Duration = Duration::from_millis(1500);

/// The busy client's loop for `dur`: a 64 KiB write, then reading it back. Returns MiB/s.
fn busy_rate(c: &mut Raw, dur: Duration, seed: u64) -> f64 {
    const LEN: u32 = 64 << 10;
    let data = pattern(LEN as usize, seed);
    let mut back = vec![0u8; LEN as usize];
    let t0 = std::time::Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < dur {
        let off = (n % (SIZE / u64::from(LEN))) * u64::from(LEN);
        assert!(c.request(1, 0, 2 * n, off, LEN) && c.send(&data));
        assert_eq!(c.reply(), Some((0, 2 * n)));
        assert!(c.request(0, 0, 2 * n + 1, off, LEN));
        assert_eq!(c.reply(), Some((0, 2 * n + 1)));
        c.0.read_exact(&mut back).unwrap();
        assert!(back == data, "read back differs at {off}");
        n += 1;
    }
    (n * u64::from(LEN) * 2) as f64 / t0.elapsed().as_secs_f64() / f64::from(1 << 20)
}

#[test]
fn a_thousand_idle_connections_beside_a_busy_client() {
    let started = std::time::Instant::now();
    let dir = TempDir::new("thousand");
    make_image(&dir.path("disk"), SIZE as usize, Some(0xbad));
    let (disk, listen) = (dir.s("disk"), format!("unix:{}", dir.s("sock")));
    let log = std::fs::File::create(dir.path("log")).unwrap();
    let args = [disk.as_str(), "--nbd", &listen, "--export-name", "disk"];
    let mut args = args.to_vec();
    args.push("--unencrypted");
    let mut srv = Server::try_start_logged(&args, 1, log.into()).expect("server");
    let mut busy = Raw::start(&dir);
    let alone = busy_rate(&mut busy, BUSY_WINDOW, 1);
    // Every client connects and, if greeted, finishes its handshake and then sends nothing.
    // An idle connection holds no request buffers, so the server admits them all (its
    // default limit is above a thousand).
    let (mut idle, mut refused) = (Vec::new(), 0usize);
    for _ in 0..IDLE_CONNECTIONS {
        let mut s = UnixStream::connect(dir.path("sock")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greet = [0u8; 18];
        match s.read_exact(&mut greet) {
            Ok(()) => {
                let mut r = Raw(s);
                assert!(r.send(&1u32.to_be_bytes()));
                assert_eq!(r.go("disk"), 1, "GO not acknowledged");
                idle.push(r);
            }
            // Refused: closed before the greeting (EOF, or a reset).
            Err(_) => refused += 1,
        }
    }
    let during = busy_rate(&mut busy, BUSY_WINDOW, 2);
    let ratio = during / alone;
    eprintln!(
        "busy client: {alone:.0} MiB/s alone, {during:.0} MiB/s beside {IDLE_CONNECTIONS} idle \
         connection attempts ({} admitted, {refused} refused): ratio {ratio:.2}",
        idle.len()
    );
    assert!(
        srv.alive(),
        "server died under {IDLE_CONNECTIONS} connections"
    );
    assert_eq!(idle.len() + refused, IDLE_CONNECTIONS);
    assert_eq!(refused, 0, "idle connections refused beside the busy one");
    // A newcomer connects and is served at once.
    let t0 = std::time::Instant::now();
    healthy(&dir);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "newcomer waited {:?}",
        t0.elapsed()
    );
    // The admitted idle ones still hold working sessions; the busy client is still served.
    let mut one = idle.pop().expect("some idle connection admitted");
    assert!(one.request(0, 0, 7, 0, 4096));
    assert_eq!(one.reply(), Some((0, 7)));
    drop((idle, one));
    healthy_beside(&mut busy);
    assert_eq!(srv.stop(), Some(0));
    let log = std::fs::read_to_string(dir.path("log")).unwrap();
    let lines = log.matches("refusing connection").count();
    assert_eq!(
        lines, refused,
        "one log line per refused connection:\n{log}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
}

/// The busy client's session is still in sync: a flush is acknowledged.
fn healthy_beside(c: &mut Raw) {
    assert!(c.request(3, 0, u64::MAX, 0, 0));
    assert_eq!(c.reply(), Some((0, u64::MAX)));
}

#[test]
fn a_vanished_clients_queued_requests_are_dropped() {
    let dir = TempDir::new("gone");
    // An encrypted volume (plain dm-crypt mapping), so that each read costs CPU time.
    std::fs::write(dir.path("key"), pattern(64, 7)).unwrap();
    let size = 64u64 << 20;
    make_image(&dir.path("disk"), size as usize, None);
    let disk = dir.s("disk");
    let key = dir.s("key");
    let listen = format!("unix:{}", dir.s("sock"));
    let srv = Server::start(
        &[
            &disk,
            "--nbd",
            &listen,
            "--export-name",
            "disk",
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &key,
        ],
        1,
    );
    let pid = srv.pid();
    // Thousands of pipelined 32 MiB reads (a few hundred KiB of headers), then gone.
    // (The server's first reply blocks: nobody reads it. The client sends what the socket
    // buffers take, at most 10,000 requests.)
    let mut c = Raw::start(&dir);
    c.0.set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut reqs = Vec::new();
    for i in 0..10_000u64 {
        reqs.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        reqs.extend_from_slice(&[0, 0, 0, 0]); // flags, NBD_CMD_READ
        reqs.extend_from_slice(&i.to_be_bytes());
        reqs.extend_from_slice(&0u64.to_be_bytes());
        reqs.extend_from_slice(&(32u32 << 20).to_be_bytes());
    }
    let mut sent = 0;
    while sent < reqs.len() {
        match c.0.write(&reqs[sent..]) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(sent >= 1000 * 28, "only {sent} bytes of requests sent");
    drop(c);
    std::thread::sleep(Duration::from_millis(1000));
    // Nobody can read the replies: the server stops working on them at once.
    let before = cpu_time(pid);
    std::thread::sleep(Duration::from_secs(2));
    let spent = cpu_time(pid) - before;
    assert!(
        spent < Duration::from_millis(250),
        "server still busy for a vanished client: {spent:?} CPU in 2 s"
    );
    let t0 = std::time::Instant::now();
    assert_eq!(srv.stop(), Some(0));
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "SIGTERM took {:?}",
        t0.elapsed()
    );
}

/// Where in `pid`'s memory that a core dump would include (readable mappings not marked
/// `dd`, MADV_DONTDUMP, in /proc/PID/smaps) `needle` occurs: one line per hit.
fn dumpable_copies(pid: i32, needle: &[u8]) -> Vec<String> {
    use std::os::unix::fs::FileExt;
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    // (start, end, description, dumpable)
    let mut maps: Vec<(u64, u64, String, bool)> = Vec::new();
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                let readable = line
                    .split_whitespace()
                    .nth(1)
                    .is_some_and(|p| p.starts_with('r'));
                maps.push((a, b, line.to_string(), readable));
                continue;
            }
        }
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(m) = maps.last_mut() {
                m.3 &= !flags.split_whitespace().any(|f| f == "dd");
            }
        }
    }
    let mut hits = Vec::new();
    for (a, b, desc, dumpable) in maps {
        if !dumpable || desc.contains("[vsyscall]") || desc.contains("[vvar") {
            continue;
        }
        let mut buf = vec![0u8; (b - a) as usize];
        if mem.read_exact_at(&mut buf, a).is_err() {
            continue;
        }
        for (i, w) in buf.windows(needle.len()).enumerate() {
            if w == needle {
                hits.push(format!("{:#x} in {desc}", a + i as u64));
            }
        }
    }
    hits
}

#[test]
fn no_copy_of_the_volume_key_in_dumpable_memory() {
    let dir = TempDir::new("key-mem");
    let key = pattern(64, 0x006b_6579);
    std::fs::write(dir.path("key"), &key).unwrap();
    std::fs::write(dir.path("pass"), b"passphrase").unwrap();
    let listen = format!("unix:{}", dir.s("sock"));
    let (disk, keyf, pass) = (dir.s("disk"), dir.s("key"), dir.s("pass"));
    // A LUKS2 volume made with that volume key, unlocked by passphrase.
    let luks = dir.s("luks");
    make_image(&dir.path("luks"), 20 << 20, None);
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            "--type",
            "luks2",
            "--key-file",
            &pass,
            "--volume-key-file",
            &keyf,
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            &luks,
        ],
    );
    make_image(&dir.path("disk"), SIZE as usize, None);
    let plain: Vec<&str> = vec![
        &disk,
        "--cipher",
        "aes-xts-plain64",
        "--volume-key-file",
        &keyf,
    ];
    let unlocked: Vec<&str> = vec![&luks, "--key-file", &pass];
    // An authenticated volume (aes-gcm-random + aead) keyed with the first 32 bytes: its
    // AEAD context holds the AES key schedule, whose first round keys are the key itself.
    std::fs::write(dir.path("key32"), &key[..32]).unwrap();
    let aead = dir.s("aead");
    make_image(&dir.path("aead"), 40 << 20, None);
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            "--type",
            "luks2",
            "--cipher",
            "aes-gcm-random",
            "--integrity",
            "aead",
            "--key-size",
            "256",
            "--key-file",
            &pass,
            "--volume-key-file",
            &dir.s("key32"),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            &aead,
        ],
    );
    let authenticated: Vec<&str> = vec![&aead, "--key-file", &pass];
    for (what, volume) in [
        ("plain", plain),
        ("LUKS2", unlocked),
        ("LUKS2 aes-gcm-random", authenticated),
    ] {
        let mut args = volume.clone();
        args.extend(["--nbd", &listen, "--export-name", "disk"]);
        let srv = Server::start(&args, 1);
        // Serve requests (at queue depth 1 and pipelined), so that every context exists.
        healthy(&dir);
        let mut c = Raw::start(&dir);
        for i in 0..64 {
            assert!(c.request(0, 0, i, (i % 32) * 65536, 65536));
        }
        for _ in 0..64 {
            let (err, _) = c.reply().unwrap();
            assert_eq!(err, 0);
            let mut d = vec![0u8; 65536];
            c.0.read_exact(&mut d).unwrap();
        }
        let mut found = Vec::new();
        // The two XTS halves; for the AEAD volume, the halves of its 32-byte key.
        let halves: [(&str, &[u8]); 2] = if what.contains("gcm") {
            [
                ("first AES-GCM", &key[..16]),
                ("second AES-GCM", &key[16..32]),
            ]
        } else {
            [("first XTS", &key[..32]), ("second XTS", &key[32..])]
        };
        for (name, half) in halves {
            for h in dumpable_copies(srv.pid(), half) {
                found.push(format!("{name} key half at {h}"));
            }
        }
        drop(c);
        assert!(
            found.is_empty(),
            "{what}: volume key in memory a core dump would hold:\n{}",
            found.join("\n")
        );
        assert_eq!(srv.stop(), Some(0));
    }
}
