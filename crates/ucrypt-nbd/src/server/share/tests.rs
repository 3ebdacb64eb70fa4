//! Shared sockets in one process (each export served from its own thread, as each daemon
//! would be from its own process): the owner lists and negotiates every export, a member's
//! clients are passed to it and read and write its device only, a name served already is
//! refused, a member that leaves leaves the list, and when the owner leaves a member takes
//! the socket over with PATH kept until the last one goes. Each export's [`Standing`] follows,
//! and an idle owner's or member's serving thread never wakes.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ucrypt::backend::Backend;
use ucrypt::{BlockDev, Stop};

use super::{attach, serve, serve_watching, ShareState, Standing};
use crate::client::{ClientOptions, NbdBackend, NbdUri};
use crate::proto::{IHAVEOPT, OPT_ABORT, OPT_LIST, REP_ACK, REP_SERVER};
use crate::server::{Interest, ServerOptions, Watch};

const SIZE: u64 = 1 << 20;
/// How long a takeover or a departure may take to show.
const SETTLE: Duration = Duration::from_secs(10);

struct MemDev(Mutex<Vec<u8>>);

impl BlockDev for MemDev {
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
        let d = self.0.lock().unwrap();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.0.lock().unwrap()[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> ucrypt::Result<()> {
        Ok(())
    }
    fn discard(&self, _offset: u64, _len: u64) -> ucrypt::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.0.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

fn mem() -> Arc<MemDev> {
    Arc::new(MemDev(Mutex::new(vec![0; SIZE as usize])))
}

fn opts() -> ServerOptions {
    ServerOptions {
        read_only: false,
        tls: None,
        insecure_plaintext: false,
        pid_file: None,
        announce: false,
        poll: Duration::ZERO,
        poll_backoff: true,
        workers: 2,
        idle_timeout: Duration::from_secs(10),
        connections_max: 16,
    }
}

/// An export served from its own thread until [`Running::stop`].
struct Running {
    stop: Stop,
    thread: Option<JoinHandle<crate::Result<()>>>,
    state: ShareState,
    /// The serving thread's id (`gettid`), once it runs.
    tid: Arc<AtomicI32>,
}

impl Running {
    fn stop(mut self) {
        self.stop.request();
        if let Some(t) = self.thread.take() {
            t.join().unwrap().unwrap();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.request();
    }
}

/// Attaches `name` at `path` and serves it; `owner` says which role it must have taken.
fn start(path: &Path, name: &str, dev: &Arc<MemDev>, owner: bool) -> Running {
    start_watching(path, name, dev, owner, None)
}

/// The caller's events, as a daemon's main loop would give them ([`serve_watching`]): each
/// byte that arrives on `bell` is noted with the thread that read it; a `q` stops the server.
struct Doorbell {
    bell: UnixStream,
    stop: Stop,
    rung: Rung,
}

/// The bytes a [`Doorbell`] read, each with the thread that read it.
type Rung = Arc<Mutex<Vec<(u8, i32)>>>;

impl Watch for Doorbell {
    fn fds(&mut self, out: &mut Vec<(std::os::fd::RawFd, Interest)>) {
        use std::os::fd::AsRawFd;
        out.push((self.bell.as_raw_fd(), Interest::Input));
    }

    fn ready(&mut self, events: &[bool]) {
        if events != [true] {
            return;
        }
        let mut b = [0u8; 16];
        let n = self.bell.read(&mut b).unwrap_or(0);
        for &c in &b[..n] {
            // SAFETY: gettid has no arguments and cannot fail.
            self.rung
                .lock()
                .unwrap()
                .push((c, unsafe { libc::gettid() }));
            if c == b'q' {
                self.stop.request();
            }
        }
    }
}

/// [`start`], with a [`Doorbell`] fed through `bell` when given.
fn start_watching(
    path: &Path,
    name: &str,
    dev: &Arc<MemDev>,
    owner: bool,
    bell: Option<(UnixStream, Rung)>,
) -> Running {
    let dev: Arc<dyn BlockDev> = dev.clone();
    let a = attach(path, name, dev, false).unwrap();
    assert_eq!(a.owner(), owner, "{name}: owner");
    let state = a.state();
    let stop = Stop::new();
    let s2 = stop.clone();
    let tid = Arc::new(AtomicI32::new(0));
    let t2 = tid.clone();
    let thread = std::thread::spawn(move || {
        // SAFETY: gettid has no arguments and cannot fail.
        t2.store(unsafe { libc::gettid() }, Ordering::Release);
        match bell {
            Some((bell, rung)) => {
                let mut watch = Doorbell {
                    bell,
                    stop: s2.clone(),
                    rung,
                };
                serve_watching(a, opts(), s2, &mut watch)
            }
            None => serve(a, opts(), s2),
        }
    });
    // Its id is known before anything asks for it.
    let t0 = Instant::now();
    while tid.load(Ordering::Acquire) == 0 {
        assert!(
            t0.elapsed() < SETTLE,
            "{name}: the serving thread did not start"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    Running {
        stop,
        thread: Some(thread),
        state,
        tid,
    }
}

/// Waits until one of `rs` owns the socket with all their exports and the others are its
/// members.
fn settled(rs: &[Running]) {
    let t0 = Instant::now();
    loop {
        let got: Vec<Standing> = rs.iter().map(|r| r.state.standing()).collect();
        let owners = got
            .iter()
            .filter(|s| **s == Standing::Owner { exports: rs.len() })
            .count();
        let members = got
            .iter()
            .filter(|s| matches!(s, Standing::Member { .. }))
            .count();
        if owners == 1 && members == rs.len() - 1 {
            return;
        }
        assert!(t0.elapsed() < SETTLE, "not settled: {got:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `r` stands as `want`.
fn stands(r: &Running, want: Standing) {
    let t0 = Instant::now();
    loop {
        let got = r.state.standing();
        if got == want {
            return;
        }
        assert!(t0.elapsed() < SETTLE, "stands {got:?}, want {want:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Context switches of thread `tid` of this process so far, voluntary and not
/// (`/proc/self/task/TID/status`).
fn switches(tid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    s.lines()
        .filter(|l| l.contains("ctxt_switches:"))
        .map(|l| l.split(':').nth(1).unwrap().trim().parse::<u64>().unwrap())
        .sum()
}

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("ucrypt-share-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The export names the server at `path` lists (`NBD_OPT_LIST`), sorted.
fn list(path: &Path) -> Vec<String> {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(SETTLE)).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let option = |s: &mut UnixStream, code: u32| {
        let mut o = IHAVEOPT.to_be_bytes().to_vec();
        o.extend_from_slice(&code.to_be_bytes());
        o.extend_from_slice(&0u32.to_be_bytes());
        s.write_all(&o).unwrap();
    };
    option(&mut s, OPT_LIST);
    let mut names = Vec::new();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut d = vec![0u8; len];
        s.read_exact(&mut d).unwrap();
        match kind {
            REP_SERVER => {
                let n = u32::from_be_bytes(d[..4].try_into().unwrap()) as usize;
                names.push(String::from_utf8(d[4..4 + n].to_vec()).unwrap());
            }
            REP_ACK => break,
            k => panic!("LIST reply {k:#x}"),
        }
    }
    option(&mut s, OPT_ABORT);
    names.sort();
    names
}

/// Waits until the listing at `path` is `want`.
fn list_becomes(path: &Path, want: &[&str]) {
    let t0 = Instant::now();
    loop {
        let got = list(path);
        if got == want {
            return;
        }
        assert!(t0.elapsed() < SETTLE, "listed {got:?}, want {want:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn client(path: &Path, name: &str) -> NbdBackend {
    let uri = NbdUri::parse(&format!("nbd+unix:///{name}?socket={}", path.display())).unwrap();
    let o = ClientOptions {
        connections: 1,
        ..ClientOptions::default()
    };
    NbdBackend::connect(&uri, &o).unwrap()
}

/// Writes `byte` over 64 KiB at `offset` of export `name` and reads it back, through the
/// socket; the device itself must hold it.
fn write_read(path: &Path, name: &str, dev: &MemDev, offset: u64, byte: u8) {
    let c = client(path, name);
    let data = vec![byte; 65536];
    c.write_at(&data, offset).unwrap();
    c.flush().unwrap();
    let mut back = vec![0u8; 65536];
    assert_eq!(c.read_at(&mut back, offset).unwrap(), back.len());
    assert_eq!(back, data, "{name}: read back");
    let d = dev.0.lock().unwrap();
    assert_eq!(
        &d[offset as usize..offset as usize + 65536],
        &data[..],
        "{name}: device"
    );
}

#[test]
fn two_exports_on_one_socket_each_served_by_its_own_server() {
    let dir = Dir::new("two");
    let path = dir.0.join("nbd.sock");
    let (da, db) = (mem(), mem());
    let a = start(&path, "a", &da, true);
    let b = start(&path, "b", &db, false);
    list_becomes(&path, &["a", "b"]);
    write_read(&path, "a", &da, 0, 0xa1);
    write_read(&path, "b", &db, 131072, 0xb2);
    // Each write reached its own device only.
    assert_eq!(da.0.lock().unwrap()[131072], 0);
    assert_eq!(db.0.lock().unwrap()[0], 0);

    // A name served already is refused, whichever process serves it; nothing changes.
    for name in ["a", "b"] {
        let e = match attach(&path, name, mem(), false) {
            Ok(_) => panic!("{name}: a second export of that name was taken"),
            Err(e) => e,
        };
        assert!(super::is_busy(&e), "{name}: {e}");
        assert!(e.to_string().contains("is served there already"), "{e}");
    }
    list_becomes(&path, &["a", "b"]);

    // A member that leaves leaves the list; the owner serves on.
    b.stop();
    list_becomes(&path, &["a"]);
    write_read(&path, "a", &da, 262144, 0xa3);
    a.stop();
    assert!(!path.exists(), "the socket outlived its last server");
}

#[test]
fn a_member_takes_the_socket_over_when_the_owner_leaves() {
    let dir = Dir::new("takeover");
    let path = dir.0.join("nbd.sock");
    let (da, db, dc) = (mem(), mem(), mem());
    let a = start(&path, "a", &da, true);
    let b = start(&path, "b", &db, false);
    let c = start(&path, "c", &dc, false);
    list_becomes(&path, &["a", "b", "c"]);
    let me = std::process::id();
    stands(&a, Standing::Owner { exports: 3 });
    stands(&b, Standing::Member { owner_pid: me });
    // A client of b connected before the owner leaves keeps being served after.
    let early = client(&path, "b");
    a.stop();
    assert!(
        path.exists(),
        "the owner removed a socket its members serve"
    );
    list_becomes(&path, &["b", "c"]);
    // One of the members took over; the other joined it.
    let t0 = Instant::now();
    let (new_owner, member) = loop {
        match (b.state.standing(), c.state.standing()) {
            (Standing::Owner { exports: 2 }, Standing::Member { .. }) => break (&b, &c),
            (Standing::Member { .. }, Standing::Owner { exports: 2 }) => break (&c, &b),
            got => assert!(t0.elapsed() < SETTLE, "after the takeover: {got:?}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    stands(member, Standing::Member { owner_pid: me });
    stands(new_owner, Standing::Owner { exports: 2 });
    write_read(&path, "b", &db, 0, 0xb1);
    write_read(&path, "c", &dc, 0, 0xc1);
    let mut back = vec![0u8; 4096];
    early.read_at(&mut back, 0).unwrap();
    assert_eq!(back, vec![0xb1; 4096]);
    drop(early);
    // A newcomer joins the new owner.
    let d = start(&path, "a", &da, false);
    list_becomes(&path, &["a", "b", "c"]);
    write_read(&path, "a", &da, 0, 0xa2);
    stands(&d, Standing::Member { owner_pid: me });
    let state = b.state.clone();
    // Each leaves once those left have settled (one owner of them all, the rest its
    // members): the last to leave is then an owner, which removes the socket. (A member
    // told to stop in the middle of a takeover leaves the path to the one taking over.)
    let mut left = vec![b, c, d];
    while !left.is_empty() {
        settled(&left);
        left.remove(0).stop();
    }
    assert_eq!(state.standing(), Standing::Detached);
    assert!(!path.exists(), "the socket outlived its last server");
}

/// Context switches an idle serving thread may make in [`IDLE_SPAN`]: a loop that woke every
/// 200 ms to look at its stop flag makes 10.
const IDLE_SWITCHES_MAX: u64 = 3;
const IDLE_SPAN: Duration = Duration::from_secs(2);

#[test]
fn an_idle_owner_and_member_never_wake() {
    let dir = Dir::new("idle");
    let path = dir.0.join("nbd.sock");
    let (da, db) = (mem(), mem());
    let a = start(&path, "a", &da, true);
    let b = start(&path, "b", &db, false);
    list_becomes(&path, &["a", "b"]);
    stands(&a, Standing::Owner { exports: 2 });
    // Nothing reaches the serving threads from here on: the listing's connection was accepted
    // (and is served, then ends, on a thread of its own).
    let tids = [&a, &b].map(|r| r.tid.load(Ordering::Acquire));
    assert!(tids.iter().all(|&t| t > 0));
    let before = tids.map(switches);
    std::thread::sleep(IDLE_SPAN);
    let after = tids.map(switches);
    for (name, (b0, a0)) in ["owner", "member"].iter().zip(before.iter().zip(&after)) {
        assert!(
            a0 - b0 <= IDLE_SWITCHES_MAX,
            "the idle {name}'s thread switched {} times in {IDLE_SPAN:?}",
            a0 - b0
        );
    }
    // And each still answers at once.
    write_read(&path, "b", &db, 0, 0xb4);
    b.stop();
    stands(&a, Standing::Owner { exports: 1 });
    a.stop();
}

/// An owner that leaves while a join is under way keeps PATH for the joiner (which may be a
/// member taking over); a later attach still binds it, the socket left behind being dead.
#[test]
fn an_owner_leaving_during_a_join_keeps_the_socket() {
    let dir = Dir::new("joining");
    let path = dir.0.join("nbd.sock");
    let a = start(&path, "a", &mem(), true);
    stands(&a, Standing::Owner { exports: 1 });
    // A join under way: connected to the registration, its `Join` not sent yet.
    let addr = super::registration_addr(&path).unwrap();
    let joiner = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    a.stop();
    assert!(path.exists(), "the owner removed the socket a joiner needs");
    drop(joiner);
    // Nobody listens there now: the next export binds it again.
    let b = start(&path, "b", &mem(), true);
    list_becomes(&path, &["b"]);
    b.stop();
    assert!(!path.exists(), "the socket outlived its last server");
}

#[test]
fn a_live_socket_that_is_no_shared_listener_is_refused() {
    let dir = Dir::new("foreign");
    let path = dir.0.join("nbd.sock");
    let _other = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let t0 = Instant::now();
    let e = match attach(&path, "a", mem(), false) {
        Ok(_) => panic!("attached to another server's socket"),
        Err(e) => e,
    };
    assert!(super::is_busy(&e), "{e}");
    assert!(e.to_string().contains("live server"), "{e}");
    assert!(t0.elapsed() < SETTLE);
}

/// Rounds of [`an_owner_and_member_stopping_at_once_remove_the_socket`]: the two stops race,
/// and each round is one draw.
const STOP_TOGETHER_ROUNDS: usize = 20;

/// An owner and its member told to stop at the same moment leave no socket file behind,
/// whichever sees the other go first.
#[test]
fn an_owner_and_member_stopping_at_once_remove_the_socket() {
    let dir = Dir::new("together");
    for round in 0..STOP_TOGETHER_ROUNDS {
        let path = dir.0.join(format!("nbd{round}.sock"));
        let rs = [
            start(&path, "a", &mem(), true),
            start(&path, "b", &mem(), false),
        ];
        settled(&rs);
        let [mut a, mut b] = rs;
        // Either first: the member first, the owner may still count it when it closes; the
        // owner first, the member may find the registration name still held.
        let (first, second) = if round % 2 == 0 { (&b, &a) } else { (&a, &b) };
        first.stop.request();
        second.stop.request();
        for r in [&mut b, &mut a] {
            r.thread.take().unwrap().join().unwrap().unwrap();
        }
        assert!(
            !path.exists(),
            "round {round}: the socket outlived both its servers"
        );
    }
}

/// Rings `bell` with `c` and waits until `rung` notes it; returns the thread that read it.
fn ring(bell: &mut UnixStream, rung: &Mutex<Vec<(u8, i32)>>, c: u8) -> i32 {
    let before = rung.lock().unwrap().len();
    bell.write_all(&[c]).unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(&(got, tid)) = rung.lock().unwrap().get(before) {
            assert_eq!(got, c);
            return tid;
        }
        assert!(t0.elapsed() < SETTLE, "'{}' was not read", c as char);
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_callers_events_are_served_on_the_serving_thread_in_every_role() {
    let dir = Dir::new("watching");
    let path = dir.0.join("nbd.sock");
    let (a_dev, b_dev) = (mem(), mem());
    let (mut a_bell, a_read) = UnixStream::pair().unwrap();
    let (mut b_bell, b_read) = UnixStream::pair().unwrap();
    let (a_rung, b_rung): (Rung, Rung) = (Arc::default(), Arc::default());
    let a = start_watching(&path, "a", &a_dev, true, Some((a_read, a_rung.clone())));
    let b = start_watching(&path, "b", &b_dev, false, Some((b_read, b_rung.clone())));
    let rs = [a, b];
    settled(&rs);
    let [a, b] = rs;
    // The owner's accept loop and the member's wait read the bell on the serving thread.
    let own = |r: &Running| r.tid.load(Ordering::Acquire);
    assert_eq!(ring(&mut a_bell, &a_rung, b'x'), own(&a));
    assert_eq!(ring(&mut b_bell, &b_rung, b'x'), own(&b));
    write_read(&path, "b", &b_dev, 0, 0xb1);
    // The bell stops the owner; the member takes over and its bell is read as owner.
    assert_eq!(ring(&mut a_bell, &a_rung, b'q'), own(&a));
    a.stop();
    stands(&b, Standing::Owner { exports: 1 });
    assert_eq!(ring(&mut b_bell, &b_rung, b'x'), own(&b));
    write_read(&path, "b", &b_dev, 4096, 0xb2);
    assert_eq!(ring(&mut b_bell, &b_rung, b'q'), own(&b));
    b.stop();
    assert!(!path.exists(), "the last server left PATH behind");
}
