//! Several `ucrypt open ... --nbd unix:PATH` naming one PATH share its listener: each daemon
//! serves its own volume, the first to bind PATH negotiates for all, and `nbdinfo --list` shows
//! every export.
//!
//! - `opens_share_one_socket_and_outlive_its_owner`: two volumes on one socket, each written
//!   and read back whole by `nbdcopy` through its own export (data checked, and not seen through
//!   the other); the owner closed, the other export still serves new clients and the socket
//!   stays until the last daemon closes. `status` says which daemon owns the socket (and how
//!   many exports it has) and whose member each other one is, and follows the change of owner;
//!   so do the daemons' metrics (`ucrypt_nbd_socket_role`, `ucrypt_nbd_socket_exports`).
//! - `a_killed_daemon_leaves_the_others_serving`: SIGKILL of a member's daemon leaves the
//!   owner's export serving (and the list without the dead one); SIGKILL of the owner's daemon
//!   leaves the member to take the socket over and serve (and `status` to say it owns it).
//! - `idle_daemons_never_wake`: an idle owner and member each run one NBD thread, which (and
//!   the daemon's main thread too) makes no context switch over 2 s of idleness, but for one
//!   heap trim (a loop that looked at a stop flag every 200 ms would make 10).
//! - `a_name_served_already_is_refused`: a daemon of the same user whose state directory is
//!   elsewhere (another `XDG_RUNTIME_DIR`, so NAME is free there) cannot export NAME on the
//!   socket again: exit 5, and the first export still serves. Runs as user nobody (`setpriv`).
//!
//! The daemons use the vhost-user front end (a socket in the state directory: no root, no
//! mount). Needs nbdinfo and nbdcopy (libnbd-bin); as a non-root user an `XDG_RUNTIME_DIR`; the
//! last test root and setpriv. SKIPPED otherwise. Names carry the test's pid.

mod nbd_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nbd_common::*;

const MIB: usize = 1 << 20;
/// Each image: LUKS2's 16 MiB of metadata and 4 MiB of data.
const IMAGE_MIB: usize = 20;
const DATA_BYTES: usize = 4 * MIB;
/// How long a departure or a takeover may take to show on a loaded machine.
const SETTLE: Duration = Duration::from_secs(30);

/// Who runs the daemons: this user, or user nobody with its own runtime directory.
#[derive(Clone)]
enum As {
    Me,
    Nobody { xdg: PathBuf },
}

impl As {
    fn command(&self, prog: &str) -> Command {
        match self {
            As::Me => Command::new(prog),
            As::Nobody { xdg } => {
                let mut c = Command::new("setpriv");
                c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "env"])
                    .arg(format!("XDG_RUNTIME_DIR={}", xdg.display()))
                    .arg(prog);
                c
            }
        }
    }

    fn run(&self, prog: &str, args: &[&str]) -> Output {
        self.command(prog)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("running {prog}: {e}"))
    }
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\n{}{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Why this test cannot run here, if it cannot.
fn missing() -> Option<String> {
    for p in ["nbdinfo", "nbdcopy"] {
        if !need(p, "libnbd-bin") {
            return Some(format!("{p} missing"));
        }
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root && std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        return Some("rootless ucrypt open needs XDG_RUNTIME_DIR".into());
    }
    None
}

fn luks(dir: &TempDir, name: &str) -> PathBuf {
    let img = dir.path(name);
    make_image(&img, IMAGE_MIB * MIB, None);
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            "--type",
            "luks2",
            "--key-file",
            &dir.s("pass"),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            &img.to_string_lossy(),
        ],
    );
    img
}

/// The daemons opened, closed (forcibly, a dead one cleaned up) whatever happens.
struct Opened {
    who: As,
    names: Vec<String>,
    /// Where each daemon answers scrapes (`--metrics unix:DIR/NAME.m`), if anywhere.
    metrics_dir: Option<PathBuf>,
}

impl Opened {
    fn new(who: As) -> Opened {
        Opened {
            who,
            names: Vec::new(),
            metrics_dir: None,
        }
    }

    /// `ucrypt open IMG NAME --front-end vhost-user --nbd unix:SOCK` (and `--metrics`).
    fn open(&mut self, img: &Path, name: &str, pass: &Path, sock: &Path) -> Output {
        self.names.push(name.to_string());
        let mut args = vec![
            "open".to_string(),
            img.to_string_lossy().into_owned(),
            name.to_string(),
            "--key-file".into(),
            pass.to_string_lossy().into_owned(),
            "--front-end".into(),
            "vhost-user".into(),
            "--nbd".into(),
            format!("unix:{}", sock.display()),
        ];
        if let Some(m) = self.metrics_socket(name) {
            args.extend(["--metrics".into(), format!("unix:{}", m.display())]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.who.run(UCRYPT, &args)
    }

    fn metrics_socket(&self, name: &str) -> Option<PathBuf> {
        Some(self.metrics_dir.as_ref()?.join(format!("{name}.m")))
    }

    /// NAME's `ucrypt_nbd_socket_*` series as scraped, without their labels `volume` and
    /// `socket`: `role="owner"} 1`, `exports 2`, sorted.
    fn nbd_metrics(&self, name: &str) -> Vec<String> {
        let at = self.metrics_socket(name).expect("opened with --metrics");
        let mut c = std::os::unix::net::UnixStream::connect(&at)
            .unwrap_or_else(|e| panic!("metrics of {name} at {}: {e}", at.display()));
        use std::io::{Read, Write};
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        let mut series: Vec<String> = got
            .lines()
            .filter_map(|l| l.strip_prefix("ucrypt_nbd_socket_"))
            .map(|l| {
                let (metric, rest) = l.split_once('{').unwrap_or((l, ""));
                let (labels, value) = rest.rsplit_once("} ").unwrap_or(("", rest));
                let role = labels
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("role="))
                    .map(|r| r.trim_matches('"'));
                match role {
                    Some(r) => format!("{metric} {r} {value}"),
                    None => format!("{metric} {value}"),
                }
            })
            .collect();
        series.sort();
        series
    }

    /// NAME's metrics say it is `role` on its socket with `exports` exports.
    fn metered_as(&self, name: &str, role: &str, exports: usize) {
        let mut want: Vec<String> = ["owner", "member", "taking_over", "detached"]
            .iter()
            .map(|r| format!("role {r} {}", u8::from(*r == role)))
            .chain([format!("exports {exports}")])
            .collect();
        want.sort();
        assert_eq!(self.nbd_metrics(name), want, "{name}'s NBD socket metrics");
    }

    fn open_ok(&mut self, img: &Path, name: &str, pass: &Path, sock: &Path) {
        let o = self.open(img, name, pass, sock);
        assert_eq!(o.status.code(), Some(0), "open {name}: {}", text(&o));
        let uri = format!("nbd+unix:///{name}?socket={}", sock.display());
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(&uri),
            "open {name} names its URI: {}",
            text(&o)
        );
    }

    fn close(&self, name: &str) {
        let o = self.who.run(UCRYPT, &["close", name]);
        assert_eq!(o.status.code(), Some(0), "close {name}: {}", text(&o));
    }

    /// `ucrypt status NAME`'s line about the NBD socket, without its indent.
    fn nbd_line(&self, name: &str) -> String {
        let o = self.who.run(UCRYPT, &["status", name]);
        assert_eq!(o.status.code(), Some(0), "status {name}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .find(|l| l.trim_start().starts_with("nbd socket:"))
            .map(|l| l.trim().to_string())
            .unwrap_or_else(|| panic!("no nbd socket line in the status of {name}: {}", text(&o)))
    }

    /// Waits until NAME's status says `part` of `sock` ("owner (2 exports)", "member (owner
    /// pid N)").
    fn stands(&self, name: &str, sock: &Path, part: &str) {
        let want = format!("nbd socket: unix:{} shared, {part}", sock.display());
        let t0 = Instant::now();
        loop {
            let got = self.nbd_line(name);
            if got == want {
                return;
            }
            assert!(t0.elapsed() < SETTLE, "{name}: {got:?}, want {want:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The pid of NAME's daemon (`ucrypt status NAME`).
    fn pid(&self, name: &str) -> i32 {
        let o = self.who.run(UCRYPT, &["status", name]);
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "pid").then(|| v.trim().parse().ok())?
            })
            .unwrap_or_else(|| panic!("no pid in the status of {name}: {}", text(&o)))
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = self.who.run(UCRYPT, &["close", "--force", n]);
        }
    }
}

/// The export names the socket lists, sorted.
fn listed(who: &As, sock: &Path) -> Result<Vec<String>, String> {
    let o = who.run(
        "nbdinfo",
        &[
            "--json",
            "--list",
            &format!("nbd+unix:///?socket={}", sock.display()),
        ],
    );
    if !o.status.success() {
        return Err(text(&o));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).map_err(|e| format!("{e}: {}", text(&o)))?;
    let mut names: Vec<String> = v["exports"]
        .as_array()
        .ok_or("no exports array")?
        .iter()
        .filter_map(|e| e["export-name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    Ok(names)
}

/// Waits until the socket lists exactly `want` (sorted).
fn listed_becomes(who: &As, sock: &Path, want: &[&str]) {
    let t0 = Instant::now();
    loop {
        let got = listed(who, sock);
        if got.as_ref().is_ok_and(|g| g == want) {
            return;
        }
        assert!(t0.elapsed() < SETTLE, "listed {got:?}, want {want:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Writes seeded data over export `name` with nbdcopy, reads it back whole and checks it.
fn write_read(who: &As, dir: &TempDir, sock: &Path, name: &str, seed: u64) {
    let uri = format!("nbd+unix:///{name}?socket={}", sock.display());
    let src = dir.path(&format!("src-{name}-{seed}"));
    let back = dir.path(&format!("back-{name}-{seed}"));
    make_image(&src, DATA_BYTES, Some(seed));
    let (src_s, back_s) = (src.to_string_lossy(), back.to_string_lossy());
    for (from, to) in [(&*src_s, uri.as_str()), (uri.as_str(), &*back_s)] {
        let o = who.run("nbdcopy", &[from, to]);
        assert!(o.status.success(), "nbdcopy {from} {to}: {}", text(&o));
    }
    let (a, b) = (std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());
    assert!(
        b.len() >= a.len() && b[..a.len()] == a[..],
        "{name}: read back differs"
    );
}

/// What export `name` holds now (its first `DATA_BYTES`).
fn contents(who: &As, dir: &TempDir, sock: &Path, name: &str) -> Vec<u8> {
    let uri = format!("nbd+unix:///{name}?socket={}", sock.display());
    let out = dir.path(&format!("now-{name}"));
    let o = who.run("nbdcopy", &[&uri, &out.to_string_lossy()]);
    assert!(o.status.success(), "nbdcopy {uri}: {}", text(&o));
    let mut v = std::fs::read(&out).unwrap();
    v.truncate(DATA_BYTES);
    v
}

fn names(tag: &str) -> (String, String, String) {
    let p = std::process::id();
    (
        format!("{tag}a-{p}"),
        format!("{tag}b-{p}"),
        format!("{tag}c-{p}"),
    )
}

/// Two LUKS2 volumes opened as this user on one socket in `dir` (`tag` in their names), and
/// listed there: the socket, the names, and the daemons (with `--metrics` in `dir` if
/// `metered`). The first owns the socket.
fn two_on_one_socket(dir: &TempDir, tag: &str, metered: bool) -> (PathBuf, String, String, Opened) {
    std::fs::write(dir.path("pass"), b"shared socket passphrase").unwrap();
    let (img_a, img_b) = (luks(dir, "a.img"), luks(dir, "b.img"));
    let sock = dir.path("nbd.sock");
    let (a, b, _) = names(tag);
    let me = As::Me;
    let mut opened = Opened::new(me.clone());
    opened.metrics_dir = metered.then(|| dir.0.clone());
    opened.open_ok(&img_a, &a, &dir.path("pass"), &sock);
    opened.open_ok(&img_b, &b, &dir.path("pass"), &sock);
    let mut want = [a.as_str(), b.as_str()];
    want.sort();
    listed_becomes(&me, &sock, &want);
    opened.stands(&a, &sock, "owner (2 exports)");
    (sock, a, b, opened)
}

#[test]
fn opens_share_one_socket_and_outlive_its_owner() {
    if let Some(why) = missing() {
        println!("SKIPPED: {why}");
        return;
    }
    let dir = TempDir::new("shared");
    let (sock, a, b, opened) = two_on_one_socket(&dir, "sh", true);
    let me = As::Me;
    let owner = opened.pid(&a);
    opened.stands(&b, &sock, &format!("member (owner pid {owner})"));
    opened.metered_as(&a, "owner", 2);
    opened.metered_as(&b, "member", 0);

    write_read(&me, &dir, &sock, &a, 0xa);
    write_read(&me, &dir, &sock, &b, 0xb);
    // Each export reached its own volume.
    let now_a = contents(&me, &dir, &sock, &a);
    assert!(
        now_a == pattern(DATA_BYTES, 0xa),
        "{a} changed by {b}'s writes"
    );

    // The owner (the first) closes: the other export serves new clients, the socket stays.
    opened.close(&a);
    assert!(sock.exists(), "the socket went with its owner");
    listed_becomes(&me, &sock, &[b.as_str()]);
    opened.stands(&b, &sock, "owner (1 export)");
    opened.metered_as(&b, "owner", 1);
    write_read(&me, &dir, &sock, &b, 0xb2);
    opened.close(&b);
    assert!(!sock.exists(), "the socket outlived the last daemon");
}

#[test]
fn a_killed_daemon_leaves_the_others_serving() {
    if let Some(why) = missing() {
        println!("SKIPPED: {why}");
        return;
    }
    let dir = TempDir::new("sharedkill");
    std::fs::write(dir.path("pass"), b"shared socket passphrase").unwrap();
    let imgs = [
        luks(&dir, "a.img"),
        luks(&dir, "b.img"),
        luks(&dir, "c.img"),
    ];
    let sock = dir.path("nbd.sock");
    let (a, b, c) = names("sk");
    let me = As::Me;
    let mut opened = Opened::new(me.clone());
    opened.open_ok(&imgs[0], &a, &dir.path("pass"), &sock);
    opened.open_ok(&imgs[1], &b, &dir.path("pass"), &sock);
    opened.open_ok(&imgs[2], &c, &dir.path("pass"), &sock);
    let mut all = [a.as_str(), b.as_str(), c.as_str()];
    all.sort();
    listed_becomes(&me, &sock, &all);

    // A member dies: the owner and the other member serve on.
    let kill = |name: &str| {
        // SAFETY: kill sends a signal to a pid; no memory is involved.
        assert_eq!(unsafe { libc::kill(opened.pid(name), libc::SIGKILL) }, 0);
    };
    kill(&b);
    let mut left = [a.as_str(), c.as_str()];
    left.sort();
    listed_becomes(&me, &sock, &left);
    opened.stands(&a, &sock, "owner (2 exports)");
    let owner = opened.pid(&a);
    opened.stands(&c, &sock, &format!("member (owner pid {owner})"));
    write_read(&me, &dir, &sock, &a, 0xa);
    write_read(&me, &dir, &sock, &c, 0xc);

    // The owner dies: the member left takes the socket over.
    kill(&a);
    listed_becomes(&me, &sock, &[c.as_str()]);
    opened.stands(&c, &sock, "owner (1 export)");
    write_read(&me, &dir, &sock, &c, 0xc2);
    opened.close(&c);
}

/// The threads of process `pid` whose name (`/proc/PID/task/*/comm`) `pick` takes: (thread
/// id, name).
fn threads_named(pid: i32, pick: impl Fn(&str) -> bool) -> Vec<(String, String)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| {
            let t = t.ok()?.path();
            let c = std::fs::read_to_string(t.join("comm")).ok()?;
            let c = c.trim();
            let tid = t.file_name()?.to_string_lossy().into_owned();
            pick(c).then(|| (tid, c.to_string()))
        })
        .collect()
}

/// Context switches of thread `tid` of `pid` so far, voluntary and not.
fn switches(pid: i32, tid: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
    s.lines()
        .filter(|l| l.contains("ctxt_switches:"))
        .map(|l| l.split(':').nth(1).unwrap().trim().parse::<u64>().unwrap())
        .sum()
}

/// The process's thread count (`Threads:` of `/proc/PID/status`).
fn threads(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// Context switches an idle daemon's thread may make in [`IDLE_SPAN`] (the main thread wakes
/// once to trim the heap): a loop that woke every 200 ms to look at its stop flag makes 10.
const IDLE_SWITCHES_MAX: u64 = 3;
/// Threads of an idle vhost-user daemon with `--nbd`: the main loop (serving the NBD socket
/// too) and the vhost-user listener.
const IDLE_THREADS_MAX: usize = 2;
/// How long the threads started by the open may take to end: the engine's workers end after
/// `ucrypt::pool::POOL_IDLE_RELEASE` (5 s) idle; a minute leaves room for a loaded machine.
const IDLE_SETTLE: Duration = Duration::from_secs(60);
const IDLE_SPAN: Duration = Duration::from_secs(2);

#[test]
fn idle_daemons_never_wake() {
    if let Some(why) = missing() {
        println!("SKIPPED: {why}");
        return;
    }
    let dir = TempDir::new("sharedidle");
    let (sock, a, b, opened) = two_on_one_socket(&dir, "si", false);
    let me = As::Me;
    let pids = [opened.pid(&a), opened.pid(&b)];
    // The listings' connections end on their own threads (`nbd-conn-N`), and the engine's
    // workers once idle for their idle period. Then each daemon has its main thread, which
    // serves the NBD side too (the owner's registration included), and the vhost-user
    // listener: no thread of its own for NBD.
    let t0 = Instant::now();
    for (p, part) in pids.iter().zip(["owner", "member"]) {
        loop {
            let all = threads_named(*p, |_| true);
            if all.len() <= IDLE_THREADS_MAX {
                break;
            }
            assert!(
                t0.elapsed() < IDLE_SETTLE,
                "the idle {part} keeps {} threads: {all:?}",
                all.len()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let count = |i: usize| {
        threads_named(pids[i], |_| true)
            .into_iter()
            .map(|(tid, name)| (switches(pids[i], &tid), tid, name))
            .collect::<Vec<_>>()
    };
    let before = [count(0), count(1)];
    std::thread::sleep(IDLE_SPAN);
    let after = [count(0), count(1)];
    for (i, part) in ["owner", "member"].iter().enumerate() {
        for (n1, tid, name) in &after[i] {
            let n0 = before[i]
                .iter()
                .find(|(_, t, _)| t == tid)
                .map_or(0, |(n, _, _)| *n);
            let n = n1 - n0;
            println!(
                "{part} ({} threads): thread {name}, {n} switches in {IDLE_SPAN:?}",
                threads(pids[i])
            );
            assert!(
                n <= IDLE_SWITCHES_MAX,
                "the idle {part}'s thread {name} switched {n} times in {IDLE_SPAN:?}"
            );
        }
    }
    // Both still serve at once.
    write_read(&me, &dir, &sock, &b, 0xb);
    write_read(&me, &dir, &sock, &a, 0xa);
    opened.close(&b);
    opened.close(&a);
}

#[test]
fn a_name_served_already_is_refused() {
    if let Some(why) = missing() {
        println!("SKIPPED: {why}");
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !need("setpriv", "util-linux") {
        println!("SKIPPED: needs root (to run the daemons as user nobody) and setpriv");
        return;
    }
    let dir = TempDir::new("shareddup");
    // User nobody reads and writes the images and makes its sockets here.
    let open_to_all = |p: &Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    open_to_all(&dir.0, 0o777);
    std::fs::write(dir.path("pass"), b"shared socket passphrase").unwrap();
    open_to_all(&dir.path("pass"), 0o644);
    let (img_a, img_b) = (luks(&dir, "a.img"), luks(&dir, "b.img"));
    for img in [&img_a, &img_b] {
        open_to_all(img, 0o666);
    }
    let runtime = |n: &str| {
        let p = dir.path(n);
        std::fs::create_dir(&p).unwrap();
        open_to_all(&p, 0o777);
        p
    };
    let (one, two) = (
        As::Nobody {
            xdg: runtime("xdg1"),
        },
        As::Nobody {
            xdg: runtime("xdg2"),
        },
    );
    let sock = dir.path("nbd.sock");
    let (a, _, _) = names("sd");
    let mut first = Opened::new(one.clone());
    first.open_ok(&img_a, &a, &dir.path("pass"), &sock);
    let mut second = Opened::new(two.clone());
    let o = second.open(&img_b, &a, &dir.path("pass"), &sock);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is served there already"),
        "{}",
        text(&o)
    );
    listed_becomes(&one, &sock, &[a.as_str()]);
    write_read(&one, &dir, &sock, &a, 0xd);
    first.close(&a);
}
