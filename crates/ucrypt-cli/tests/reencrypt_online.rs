//! Online key rotation through a live `ucrypt open` daemon: `ucrypt reencrypt VOLUME` hands the
//! hotzones to the daemon serving VOLUME, which rotates while fio writes and verifies
//! (crc32c) through the daemon's device; cryptsetup then accepts the result. And a daemon
//! SIGKILLed mid-rotation: the volume opens again in reencryption (recovered), fio's data
//! verifies, `reencrypt --resume-only` finishes online, fio's data verifies again.
//!
//! Runs as root with FUSE + loop (as tests/lifecycle.rs), fio installed; cryptsetup checks
//! run when it is installed. Otherwise each test prints `SKIPPED: reason`.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");
const FAST_PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
const PASSPHRASE: &[u8] = b"online rotation passphrase";
const RUN_DIR: &str = "/run/ucrypt";
const DEV_DIR: &str = "/dev/ucrypt";
/// Small hotzones: many per rotation, each a commit, so the rotation lasts while fio runs.
const HOTZONE: &str = "1M";

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn missing_rig() -> Option<String> {
    if !is_root() {
        return Some("not root (open with FUSE + loop needs root)".into());
    }
    for dev in ["/dev/fuse", "/dev/loop-control"] {
        if !Path::new(dev).exists() {
            return Some(format!("{dev} missing"));
        }
    }
    if !have("fio") {
        return Some("fio not installed (scripts/deps.sh test)".into());
    }
    None
}

macro_rules! skip_unless_rig {
    () => {
        if let Some(why) = missing_rig() {
            println!("SKIPPED: {why}");
            return;
        }
    };
}

struct TempDir(PathBuf);

impl TempDir {
    /// A directory of its own: tests in one process may share a tag (both kill tests call
    /// the same body), so a counter tells them apart.
    fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("ucrypt-online-{tag}-{}-{k}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Closes the volume (forced) and stops fio whatever happens, so that no device is left.
struct Cleanup {
    name: String,
    procs: Vec<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
        }
        let _ = run(UCRYPT, &["close", "--force", &self.name]);
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn run(prog: &str, args: &[&str]) -> Output {
    Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {prog}: {e}"))
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(prog: &str, args: &[&str]) -> Output {
    let o = run(prog, args);
    assert!(o.status.success(), "{prog} {args:?}: {}", text(&o));
    o
}

fn volume(t: &TempDir, mib: u64) -> (PathBuf, PathBuf) {
    let img = t.path("vol.img");
    let key = t.path("key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(mib << 20))
        .unwrap();
    let mut a = vec!["format", "-q", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    (img, key)
}

fn open(img: &Path, key: &Path, name: &str) {
    open_with(img, key, name, &[]);
}

/// [`open`] with the header in the file `hdr` (`--header`).
fn open_detached(img: &Path, hdr: &Path, key: &Path, name: &str) {
    open_with(img, key, name, &["--header", s(hdr)]);
}

fn open_with(img: &Path, key: &Path, name: &str, extra: &[&str]) {
    cli_common::open_loop(img, key, name, extra);
}

fn status(name: &str) -> String {
    String::from_utf8_lossy(&run(UCRYPT, &["status", name]).stdout).to_string()
}

/// fio over the device: `size` written with crc32c verification headers (at `rate` if given),
/// then read back and verified; `verify_only` reads back what such a job wrote and verifies.
fn fio(dev: &str, size: &str, rate: Option<&str>, verify_only: bool, out: &Path) -> Command {
    let mut c = Command::new("fio");
    c.args([
        "--name=online",
        &format!("--filename={dev}"),
        "--rw=randwrite",
        "--bs=4k",
        "--randrepeat=1",
        "--random_generator=tausworthe64",
        &format!("--size={size}"),
        "--direct=1",
        "--ioengine=psync",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        &format!("--output={}", s(out)),
    ]);
    if let Some(r) = rate {
        c.arg(format!("--rate={r}"));
    }
    if verify_only {
        c.arg("--verify_only");
    }
    c.stdin(Stdio::null()).stdout(Stdio::null());
    c
}

/// How long fio runs before a reencryption starts beside it.
const FIO_LEAD: Duration = Duration::from_millis(500);

/// Lets fio (writing a fixed amount at a fixed rate) run for [`FIO_LEAD`], then checks it still
/// runs: the reencryption started next starts under I/O.
fn fio_started(fio: &mut Child) {
    std::thread::sleep(FIO_LEAD);
    if let Some(st) = fio.try_wait().unwrap() {
        panic!("fio ended ({st}) before the reencryption started");
    }
}

/// After a reencryption started by [`fio_started`]: whether fio outlasted it. On a loaded
/// machine (this binary's other tests run beside it) the reencryption can take longer than
/// fio's fixed amount of I/O; it then ran under I/O for its first part only, which is said,
/// not failed. fio's own verification (`fio_ok`) still checks every block it wrote.
fn fio_outlasted(fio: &mut Child, what: &str) {
    if fio.try_wait().unwrap().is_some() {
        println!("NOTE: {what} (a loaded machine): it ran under I/O for its first part only");
    }
}

fn fio_ok(child: &mut Child, out: &Path, what: &str) {
    let st = child.wait().unwrap();
    let report = std::fs::read_to_string(out).unwrap_or_default();
    assert!(st.success(), "fio {what} failed: {report}");
    assert!(!report.contains("verify: bad"), "fio {what}: {report}");
}

fn keyslots(img: &Path) -> String {
    let d = String::from_utf8_lossy(&ok(UCRYPT, &["luksDump", s(img)]).stdout).to_string();
    d.lines()
        .filter(|l| l.trim_end().ends_with(": luks2") || l.contains("reencrypt"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// cryptsetup (when installed) reads the result: no reencryption left, the passphrase opens.
fn cryptsetup_accepts(img: &Path, key: &Path) {
    if !have("cryptsetup") {
        println!("SKIPPED (part): cryptsetup not installed");
        return;
    }
    let d = ok("cryptsetup", &["luksDump", s(img)]);
    let dump = String::from_utf8_lossy(&d.stdout);
    assert!(!dump.contains("reencrypt"), "still in reencryption: {dump}");
    let o = ok(
        "cryptsetup",
        &[
            "open",
            "--test-passphrase",
            "-v",
            "--key-file",
            s(key),
            s(img),
        ],
    );
    println!("cryptsetup: {}", String::from_utf8_lossy(&o.stdout).trim());
}

fn name(tag: &str) -> String {
    format!("online-{tag}-{}", std::process::id())
}

#[test]
fn fio_verifies_during_an_online_key_rotation() {
    skip_unless_rig!();
    let t = TempDir::new("fio");
    let (img, key) = volume(&t, 96);
    let n = name("fio");
    let dev = format!("{DEV_DIR}/{n}");
    open(&img, &key, &n);
    let mut c = Cleanup {
        name: n.clone(),
        procs: vec![],
    };
    let before = keyslots(&img);
    // fio writes 48 MiB at 8 MiB/s (about 6 s), then reads it all back and verifies.
    let out = t.path("fio.out");
    c.procs
        .push(fio(&dev, "48m", Some("8m"), false, &out).spawn().unwrap());
    fio_started(&mut c.procs[0]);
    let t0 = Instant::now();
    let mut a = vec![
        "reencrypt",
        "--batch-mode",
        "--key-file",
        s(&key),
        "--hotzone-size",
        HOTZONE,
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(UCRYPT, &a);
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(o.status.code(), Some(0), "online reencrypt: {}", text(&o));
    fio_outlasted(
        &mut c.procs[0],
        &format!("fio ended before the rotation did ({secs:.1} s)"),
    );
    println!("online rotation of 96 MiB took {secs:.1} s while fio ran");
    let st = status(&n);
    assert!(
        st.contains("reencryption: ") && st.contains(", finished"),
        "{st}"
    );
    fio_ok(&mut c.procs[0], &out, "during the rotation");
    c.procs.clear();
    // The header is plain again, with the new keyslot only.
    let after = keyslots(&img);
    assert_ne!(before, after, "keyslots unchanged:\n{after}");
    assert!(!after.contains("reencrypt"), "{after}");
    // Closed and opened again from the header (new key alone): fio's data verifies.
    ok(UCRYPT, &["close", &n]);
    cryptsetup_accepts(&img, &key);
    open(&img, &key, &n);
    let out2 = t.path("fio2.out");
    let mut v = fio(&dev, "48m", None, true, &out2).spawn().unwrap();
    fio_ok(&mut v, &out2, "after reopening");
    ok(UCRYPT, &["close", &n]);
    drop(c);
}

/// A detached header (`--header`): `ucrypt open --header H` serves the volume, `ucrypt
/// reencrypt --header H` rotates it online (header and resilience data in H) while fio writes
/// and verifies; the data file never holds a LUKS header; after close and open again fio's
/// data verifies, and cryptsetup accepts the header.
#[test]
fn a_detached_header_rotates_online() {
    skip_unless_rig!();
    let t = TempDir::new("detached");
    let (img, hdr, key) = (t.path("data.img"), t.path("hdr.img"), t.path("key"));
    std::fs::write(&key, PASSPHRASE).unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .unwrap();
    let mut a = vec!["format", "-q", "--key-file", s(&key), "--header", s(&hdr)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    let n = name("detached");
    let dev = format!("{DEV_DIR}/{n}");
    open_detached(&img, &hdr, &key, &n);
    let mut c = Cleanup {
        name: n.clone(),
        procs: vec![],
    };
    let before = keyslots(&hdr);
    // The rotation runs on the daemon's header: a copy of it, or none, is refused before
    // anything is written (the init would land on one file, the rotation on the other).
    let copy = t.path("copy.img");
    std::fs::copy(&hdr, &copy).unwrap();
    let copy_before = std::fs::read(&copy).unwrap();
    for given in [Some(s(&copy)), None] {
        let mut a = vec!["reencrypt", "--batch-mode", "--key-file", s(&key)];
        a.extend(given.iter().flat_map(|h| ["--header", *h]));
        a.extend(FAST_PBKDF2);
        a.push(s(&img));
        let o = run(UCRYPT, &a);
        assert_eq!(o.status.code(), Some(1), "{given:?}: {}", text(&o));
        assert!(
            text(&o).contains("with the detached header"),
            "{}",
            text(&o)
        );
    }
    assert!(
        std::fs::read(&copy).unwrap() == copy_before,
        "a refused verb wrote"
    );
    assert_eq!(keyslots(&hdr), before, "a refused verb wrote the header");
    let out = t.path("fio.out");
    c.procs
        .push(fio(&dev, "32m", Some("8m"), false, &out).spawn().unwrap());
    fio_started(&mut c.procs[0]);
    let mut a = vec![
        "reencrypt",
        "--batch-mode",
        "--key-file",
        s(&key),
        "--hotzone-size",
        HOTZONE,
        "--header",
        s(&hdr),
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(0), "online reencrypt: {}", text(&o));
    fio_outlasted(&mut c.procs[0], "fio ended before the rotation did");
    let st = status(&n);
    assert!(st.contains(", finished"), "{st}");
    fio_ok(&mut c.procs[0], &out, "during the rotation");
    c.procs.clear();
    let after = keyslots(&hdr);
    assert_ne!(before, after, "keyslots unchanged:\n{after}");
    assert!(!after.contains("reencrypt"), "{after}");
    let mut magic = [0u8; 6];
    use std::io::Read;
    std::fs::File::open(&img)
        .unwrap()
        .read_exact(&mut magic)
        .unwrap();
    assert_ne!(&magic, b"LUKS\xba\xbe", "a header landed on the data file");
    ok(UCRYPT, &["close", &n]);
    open_detached(&img, &hdr, &key, &n);
    let out2 = t.path("fio2.out");
    let mut v = fio(&dev, "32m", None, true, &out2).spawn().unwrap();
    fio_ok(&mut v, &out2, "after reopening");
    ok(UCRYPT, &["close", &n]);
    cryptsetup_accepts_detached(&img, &hdr, &key);
    drop(c);
}

/// cryptsetup (when installed) reads a detached header: no reencryption left, the passphrase
/// opens it.
fn cryptsetup_accepts_detached(img: &Path, hdr: &Path, key: &Path) {
    if !have("cryptsetup") {
        println!("SKIPPED (part): cryptsetup not installed");
        return;
    }
    let d = ok("cryptsetup", &["luksDump", s(hdr)]);
    let dump = String::from_utf8_lossy(&d.stdout);
    assert!(!dump.contains("reencrypt"), "still in reencryption: {dump}");
    let a = [
        "open",
        "--test-passphrase",
        "--header",
        s(hdr),
        "--key-file",
        s(key),
        s(img),
    ];
    ok("cryptsetup", &a);
}

#[test]
fn offline_reencrypt_is_refused_on_a_volume_a_daemon_serves() {
    skip_unless_rig!();
    let t = TempDir::new("refuse");
    let (img, key) = volume(&t, 24);
    let n = name("refuse");
    open(&img, &key, &n);
    let c = Cleanup {
        name: n.clone(),
        procs: vec![],
    };
    let before = std::fs::read(&img).unwrap();
    let mut a = vec![
        "reencrypt",
        "--batch-mode",
        "--force-offline-reencrypt",
        "--key-file",
        s(&key),
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(text(&o).contains("reencrypted online"), "{}", text(&o));
    assert!(
        std::fs::read(&img).unwrap() == before,
        "the refused verb wrote"
    );
    // --active-name of a name nobody serves: cryptsetup's "not active", exit 4.
    let o = run(
        UCRYPT,
        &[
            "reencrypt",
            "--active-name",
            "no-such-volume",
            "--key-file",
            s(&key),
            s(&img),
        ],
    );
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    ok(UCRYPT, &["close", &n]);
    drop(c);
}

/// Which process a test SIGKILLs mid-rotation.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Victim {
    /// The `ucrypt open` daemon (its rotation worker dies with it).
    Daemon,
    /// The rotation worker alone: the daemon lives on, recovers the hotzone and reports the
    /// rotation stopped.
    Worker,
}

/// The rotation worker the daemon `daemon` (a pid) started: its pid, checked to lead a session
/// of its own (not the daemon's).
fn rotation_worker(daemon: &str) -> String {
    let o = ok("pgrep", &["-P", daemon, "-f", "reencrypt-worker"]);
    let pid = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert!(
        !pid.is_empty() && !pid.contains('\n'),
        "one worker: {pid:?}"
    );
    let sid = |p: &str| {
        let o = ok("ps", &["-o", "sid=", "-p", p]);
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    assert_eq!(sid(&pid), pid, "the worker leads a session of its own");
    assert_ne!(
        sid(&pid),
        sid(daemon),
        "the worker is not in the daemon's session"
    );
    pid
}

#[test]
fn daemon_killed_mid_rotation_reopens_and_resumes() {
    killed_mid_rotation_reopens_and_resumes(Victim::Daemon);
}

#[test]
fn worker_killed_mid_rotation_stops_it_and_the_volume_reopens_and_resumes() {
    killed_mid_rotation_reopens_and_resumes(Victim::Worker);
}

fn killed_mid_rotation_reopens_and_resumes(victim: Victim) {
    skip_unless_rig!();
    let t = TempDir::new("kill");
    let (img, key) = volume(&t, 96);
    let n = name(match victim {
        Victim::Daemon => "kill",
        Victim::Worker => "killw",
    });
    let dev = format!("{DEV_DIR}/{n}");
    open(&img, &key, &n);
    let mut c = Cleanup {
        name: n.clone(),
        procs: vec![],
    };
    // fio's data first (written and verified), then the rotation, killed mid-way.
    let out = t.path("fio.out");
    let mut w = fio(&dev, "64m", None, false, &out).spawn().unwrap();
    fio_ok(&mut w, &out, "writing");
    let mut a = vec![
        "reencrypt",
        "--batch-mode",
        "--key-file",
        s(&key),
        "--hotzone-size",
        "256K",
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let verb = Command::new(UCRYPT)
        .args(&a)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.procs.push(verb);
    let pid = std::fs::read_to_string(Path::new(RUN_DIR).join(&n).join("pid")).unwrap();
    // Wait until some of it is done, then SIGKILL the daemon.
    let deadline = Instant::now() + Duration::from_secs(60);
    let done = loop {
        let st = status(&n);
        let done: u64 = st
            .lines()
            .find_map(|l| l.trim().strip_prefix("reencryption: "))
            .and_then(|r| r.split(' ').next())
            .and_then(|d| d.parse().ok())
            .unwrap_or(0);
        if done > 0 {
            break done;
        }
        assert!(
            Instant::now() < deadline,
            "the rotation never started: {st}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // A second reencryption meanwhile is refused at once, not queued behind the first.
    let started = Instant::now();
    let o = run(UCRYPT, &a);
    assert_eq!(
        o.status.code(),
        Some(5),
        "a second reencryption: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("already being reencrypted"),
        "{}",
        text(&o)
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the second reencryption waited"
    );
    let worker = rotation_worker(pid.trim());
    match victim {
        Victim::Daemon => {
            ok("kill", &["-9", pid.trim()]);
            let st = c.procs[0].wait().unwrap();
            assert!(!st.success(), "the verb succeeded although its daemon died");
            c.procs.clear();
            // The worker dies with its daemon.
            let deadline = Instant::now() + Duration::from_secs(10);
            while Path::new(&format!("/proc/{worker}")).exists() {
                assert!(Instant::now() < deadline, "the worker outlived its daemon");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Victim::Worker => {
            ok("kill", &["-9", &worker]);
            let o = c.procs.remove(0).wait_with_output().unwrap();
            assert_eq!(o.status.code(), Some(1), "the verb: {}", text(&o));
            assert!(
                text(&o).contains("rotation worker died (signal 9)"),
                "the verb says why: {}",
                text(&o)
            );
            // The daemon lives on, recovered the hotzone, and reports the rotation stopped.
            let st = status(&n);
            assert!(st.contains(", stopped"), "{st}");
            assert!(Path::new(&format!("/proc/{}", pid.trim())).exists());
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let dump = String::from_utf8_lossy(&ok(UCRYPT, &["luksDump", s(&img)]).stdout).to_string();
    assert!(
        dump.contains("online-reencrypt"),
        "killed after {done} bytes, but not left in reencryption:\n{dump}"
    );
    println!(
        "killed with {done} bytes reported done; inside a hotzone: {}",
        dump.contains("in-reencryption")
    );
    // The dead daemon cleaned up, then open again: recovered if needed, served in two
    // segments; fio's data verifies.
    let o = run(UCRYPT, &["close", &n]);
    assert_eq!(o.status.code(), Some(0), "close after kill: {}", text(&o));
    open(&img, &key, &n);
    let st = status(&n);
    assert!(
        st.contains("reencryption: ") && st.contains("interrupted"),
        "{st}"
    );
    let out2 = t.path("fio2.out");
    let mut v = fio(&dev, "64m", None, true, &out2).spawn().unwrap();
    fio_ok(&mut v, &out2, "verifying in reencryption");
    // The rotation resumes online and finishes (the daemon named as cryptsetup does, with
    // --active-name and no device), switching its resilience from checksum to journal first
    // (the header shows it while the rotation runs).
    let a = vec![
        "reencrypt",
        "--resume-only",
        "--active-name",
        &n,
        "--batch-mode",
        "--key-file",
        s(&key),
        "--resilience",
        "journal",
        "--hotzone-size",
        "256K",
    ];
    let mut verb = Command::new(UCRYPT)
        .args(&a)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut switched = false;
    while verb.try_wait().unwrap().is_none() {
        let d = run(UCRYPT, &["luksDump", s(&img)]);
        switched |= text(&d).lines().any(|l| l.trim() == "Resilience: journal");
        std::thread::sleep(Duration::from_millis(5));
    }
    let o = verb.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "resume online: {}", text(&o));
    assert!(switched, "the header never showed the journal resilience");
    let mut v = fio(&dev, "64m", None, true, &out2).spawn().unwrap();
    fio_ok(&mut v, &out2, "verifying after the rotation");
    ok(UCRYPT, &["close", &n]);
    cryptsetup_accepts(&img, &key);
    open(&img, &key, &n);
    let mut v = fio(&dev, "64m", None, true, &out2).spawn().unwrap();
    fio_ok(&mut v, &out2, "verifying after reopening");
    ok(UCRYPT, &["close", &n]);
    drop(c);
}

/// Bytes a pattern write or check moves at a time (O_DIRECT: whole pages, page aligned).
const PATTERN_CHUNK_BYTES: usize = 1 << 20;

/// The plaintext a test writes before a rotation: each 8-byte word says where it is, so a
/// byte read from the wrong place, under the wrong key or not rewritten shows.
fn pattern_fill(buf: &mut [u8], at: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        let o = at + (i as u64) * 8;
        w.copy_from_slice(
            &(o.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x0a11_ce5e_ed00_c0de).to_le_bytes(),
        );
    }
}

/// A page-aligned window of `PATTERN_CHUNK_BYTES` in `v` (O_DIRECT needs the address aligned).
fn aligned(v: &mut [u8]) -> &mut [u8] {
    let skip = v.as_ptr().align_offset(4096);
    &mut v[skip..skip + PATTERN_CHUNK_BYTES]
}

/// The device `dev` opened with O_DIRECT (the page cache would answer a read with what this
/// process wrote, not with what the daemon decrypts), and its size.
fn direct(dev: &str, write: bool) -> (std::fs::File, u64) {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap_or_else(|e| panic!("open {dev}: {e}"));
    let bytes = f.seek(SeekFrom::End(0)).unwrap();
    assert!(
        bytes > 0 && bytes % PATTERN_CHUNK_BYTES as u64 == 0,
        "{dev}: {bytes} bytes"
    );
    (f, bytes)
}

/// Writes the pattern over every byte of `dev` and syncs; the bytes written.
fn write_pattern(dev: &str) -> u64 {
    use std::os::unix::fs::FileExt;
    let (f, bytes) = direct(dev, true);
    let mut v = vec![0u8; PATTERN_CHUNK_BYTES + 4096];
    let buf = aligned(&mut v);
    for at in (0..bytes).step_by(PATTERN_CHUNK_BYTES) {
        pattern_fill(buf, at);
        f.write_all_at(buf, at)
            .unwrap_or_else(|e| panic!("write {dev} at {at}: {e}"));
    }
    f.sync_all().unwrap();
    bytes
}

/// Reads every byte of `dev` back: the pattern, or where it is not (or the read failed).
fn check_pattern(dev: &str, bytes: u64) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let (f, size) = direct(dev, false);
    if size != bytes {
        return Err(format!("{dev} has {size} bytes, the pattern {bytes}"));
    }
    let mut v = vec![0u8; PATTERN_CHUNK_BYTES + 4096];
    let mut want = vec![0u8; PATTERN_CHUNK_BYTES];
    let buf = aligned(&mut v);
    for at in (0..bytes).step_by(PATTERN_CHUNK_BYTES) {
        f.read_exact_at(buf, at)
            .map_err(|e| format!("read {dev} at {at}: {e}"))?;
        pattern_fill(&mut want, at);
        if let Some(i) = (0..buf.len()).find(|&i| buf[i] != want[i]) {
            return Err(format!(
                "{dev}: byte {} is not the pattern's",
                at + i as u64
            ));
        }
    }
    Ok(())
}

/// The bytes done that `status` reports, if it reports a reencryption.
fn done_bytes(st: &str) -> Option<u64> {
    st.lines()
        .find_map(|l| l.trim().strip_prefix("reencryption: "))
        .and_then(|r| r.split(' ').next())
        .and_then(|d| d.parse().ok())
}

/// Polls `status NAME` until `want` holds of it (every 50 ms, up to `secs`); the last status.
fn status_until(name: &str, secs: u64, what: &str, want: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let st = status(name);
        if want(&st) {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {secs} s; status:\n{st}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits up to `secs` for `child` to exit; kills it and fails if it does not (a hang).
fn exits_within(mut child: Child, secs: u64, what: &str) -> Output {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!("{what} hung (killed after {secs} s): {}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// The issue "never a hang": the rotation worker SIGKILLed while the daemon serves on. The
/// daemon notices, recovers the hotzone the worker held from the volume's resilience data
/// (checksums), and `status` says the rotation stopped, why, and how to resume it; every
/// byte of the plaintext written before reads back right (the hotzone too, no EIO);
/// `reencrypt --resume-only --active-name` finishes it online, a second one meanwhile is
/// refused as busy; `close` needs no `--force`; cryptsetup finds no reencryption left and
/// opens the header with the passphrase; the data reads back after opening it again. It
/// catches a daemon that leaves the hotzone blocked (EIO), or whose next rotation panics in
/// the zone lock ("two hotzones held at once") and leaves `--resume-only` waiting for ever.
#[test]
fn worker_killed_mid_rotation_is_recovered_and_resumed_by_the_daemon() {
    if let Some(why) = cli_common::missing_root_rig(&["pgrep", "ps", "cryptsetup"]) {
        println!("SKIPPED: {why}");
        return;
    }
    let t = TempDir::new("killw-daemon");
    // Some hundreds of MiB in 1 MiB hotzones: a rotation of many hotzones, each with its
    // checksums and commits, still running when the worker is found and killed.
    let (img, key) = volume(&t, 256);
    let n = name("killwd");
    let dev = format!("{DEV_DIR}/{n}");
    open(&img, &key, &n);
    let c = Cleanup {
        name: n.clone(),
        procs: vec![],
    };
    let bytes = write_pattern(&dev);
    check_pattern(&dev, bytes).unwrap();
    let pid = std::fs::read_to_string(Path::new(RUN_DIR).join(&n).join("pid")).unwrap();
    let pid = pid.trim();
    let mut a = vec![
        "reencrypt",
        "--batch-mode",
        "--key-file",
        s(&key),
        "--hotzone-size",
        "1M",
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let verb = Command::new(UCRYPT)
        .args(&a)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    status_until(&n, 120, "the rotation starts", |st| {
        done_bytes(st).is_some_and(|d| d > 0) && st.contains(", running")
    });
    let worker = rotation_worker(pid);
    ok("kill", &["-9", &worker]);
    // The verb that started it returns, saying why.
    let o = exits_within(verb, 120, "the verb whose worker died");
    assert_eq!(o.status.code(), Some(1), "the verb: {}", text(&o));
    assert!(
        text(&o).contains("worker died (signal 9)"),
        "the verb says why: {}",
        text(&o)
    );
    // The daemon lives on and says the rotation stopped, why, and how to resume it.
    let st = status_until(&n, 120, "status says stopped", |st| {
        !st.contains(", running")
    });
    assert!(st.contains(", stopped"), "{st}");
    assert!(st.contains("worker died (signal 9)"), "{st}");
    let resume = format!("ucrypt reencrypt --resume-only --active-name {n}");
    assert!(st.contains(&resume), "{st}");
    let stopped_at = done_bytes(&st).unwrap();
    assert!(stopped_at < bytes, "stopped after the end: {st}");
    println!("stopped at {stopped_at} of {bytes} bytes: {st}");
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "the daemon died"
    );
    // Every byte reads back, the hotzone the worker held too.
    check_pattern(&dev, bytes).unwrap_or_else(|e| panic!("after the worker died: {e}\n{st}"));
    // Resumed online, through the same daemon.
    let r = [
        "reencrypt",
        "--resume-only",
        "--active-name",
        &n,
        "--batch-mode",
        "--key-file",
        s(&key),
        "--hotzone-size",
        "1M",
    ];
    let verb = Command::new(UCRYPT)
        .args(r)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A second --resume-only while it runs is refused as busy, at once.
    let st = status_until(&n, 120, "the resumed rotation runs or ends", |st| {
        st.contains(", running") || st.contains(", finished") || st.contains(", failed")
    });
    if st.contains(", running") {
        let started = Instant::now();
        let o = run(UCRYPT, &r);
        if o.status.code() != Some(0) || !status(&n).contains(", finished") {
            assert_eq!(
                o.status.code(),
                Some(5),
                "a second --resume-only: {}",
                text(&o)
            );
            assert!(
                text(&o).contains("already being reencrypted"),
                "{}",
                text(&o)
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the second --resume-only waited"
        );
    } else {
        println!("the resumed rotation ended before a second one could be tried: {st}");
    }
    let o = exits_within(verb, 600, "reencrypt --resume-only");
    assert_eq!(o.status.code(), Some(0), "resume online: {}", text(&o));
    let st = status(&n);
    assert!(st.contains(", finished"), "{st}");
    check_pattern(&dev, bytes).unwrap_or_else(|e| panic!("after the resumed rotation: {e}"));
    // Closed without --force; cryptsetup reads a plain header the passphrase opens.
    let o = run(UCRYPT, &["close", &n]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    let d = ok("cryptsetup", &["luksDump", s(&img)]);
    let dump = String::from_utf8_lossy(&d.stdout);
    assert!(!dump.contains("reencrypt"), "still in reencryption: {dump}");
    ok(
        "cryptsetup",
        &["open", "--test-passphrase", "--key-file", s(&key), s(&img)],
    );
    // Opened again (the new key alone): the plaintext is all there.
    open(&img, &key, &n);
    check_pattern(&dev, bytes).unwrap_or_else(|e| panic!("after reopening: {e}"));
    ok(UCRYPT, &["close", &n]);
    drop(c);
}

/// fio with its NBD engine (libnbd), if this fio has it.
fn fio_has_nbd() -> bool {
    Command::new("fio")
        .arg("--enghelp")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == "nbd")
        })
        .unwrap_or(false)
}

/// [`fio`]'s job over NBD: the export at the unix socket `sock`.
fn fio_nbd(sock: &Path, size: &str, rate: Option<&str>, verify_only: bool, out: &Path) -> Command {
    let mut c = Command::new("fio");
    c.args([
        "--name=online-nbd",
        "--ioengine=nbd",
        &format!("--uri=nbd+unix:///?socket={}", s(sock)),
        "--rw=randwrite",
        "--bs=4k",
        "--randrepeat=1",
        "--random_generator=tausworthe64",
        &format!("--size={size}"),
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        &format!("--output={}", s(out)),
    ]);
    if let Some(r) = rate {
        c.arg(format!("--rate={r}"));
    }
    if verify_only {
        c.arg("--verify_only");
    }
    c.stdin(Stdio::null()).stdout(Stdio::null());
    c
}

/// A server process, killed and reaped on drop (a failed test leaves none behind).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One request line on a control socket; the answer line.
fn control(sock: &Path, line: &str) -> String {
    use std::io::{BufRead, Write};
    let mut c = std::os::unix::net::UnixStream::connect(sock).unwrap();
    c.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut answer = String::new();
    std::io::BufReader::new(c).read_line(&mut answer).unwrap();
    answer
}

/// Waits until `path` exists (a socket the server binds), or panics after 30 s.
fn wait_for(path: &Path, server: &mut Child) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            server.try_wait().unwrap().is_none(),
            "the server exited before {} appeared",
            path.display()
        );
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `ucrypt serve --control PATH`: `ucrypt reencrypt VOLUME --control PATH --cipher
/// aes-cbc-essiv:sha256 --key-size 256` moves the volume the server serves over NBD to a new
/// key of another cipher while fio (its nbd engine) writes with crc32c headers and reads back
/// through it; then the server stops, a new one serves the volume under the new cipher alone,
/// and fio's data verifies again. The control socket answers `status` (with the
/// rotation) and refuses the open daemon's other requests by name.
/// The cipher the served volume moves to online.
const NEW_CIPHER: &str = "aes-cbc-essiv:sha256";

#[test]
fn serve_with_a_control_socket_rotates_under_nbd_io() {
    if !have("fio") || !fio_has_nbd() {
        println!("SKIPPED: fio with its nbd engine not installed (scripts/deps.sh test)");
        return;
    }
    let t = TempDir::new("serve");
    let (img, key) = volume(&t, 96);
    let (sock, ctl) = (t.path("nbd.sock"), t.path("control.sock"));
    let serve = || serve_controlled(&img, &key, &sock, &ctl);
    let mut server = Reaped(serve());
    let mut c = Cleanup {
        name: name("serve-none"),
        procs: vec![],
    };
    wait_for(&ctl, &mut server.0);
    wait_for(&sock, &mut server.0);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&ctl).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "control socket mode");
    let before = keyslots(&img);
    // The process serves the header in front of the data: a detached --header (here a copy
    // of that header) is refused, and nothing is written.
    let copy = t.path("copy.img");
    std::fs::copy(&img, &copy).unwrap();
    let mut a = vec!["reencrypt", "--batch-mode", "--key-file", s(&key)];
    a.extend(["--control", s(&ctl), "--header", s(&copy)]);
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("with its header in front"),
        "{}",
        text(&o)
    );
    assert_eq!(keyslots(&copy), before, "a refused verb wrote the copy");
    std::fs::remove_file(&copy).unwrap();
    let out = t.path("fio.out");
    c.procs.push(
        fio_nbd(&sock, "48m", Some("8m"), false, &out)
            .spawn()
            .unwrap(),
    );
    fio_started(&mut c.procs[0]);
    let mut a = vec![
        "reencrypt",
        "--batch-mode",
        "--key-file",
        s(&key),
        "--hotzone-size",
        HOTZONE,
        "--control",
        s(&ctl),
        "--cipher",
        NEW_CIPHER,
        "--key-size",
        "256",
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let t0 = Instant::now();
    let o = run(UCRYPT, &a);
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(o.status.code(), Some(0), "online reencrypt: {}", text(&o));
    fio_outlasted(
        &mut c.procs[0],
        &format!("fio ended before the rotation did ({secs:.1} s)"),
    );
    println!("online rotation of 96 MiB through serve --control took {secs:.1} s while fio ran");
    fio_ok(&mut c.procs[0], &out, "during the rotation");
    c.procs.clear();
    // The status tells how the rotation ended; a request of the open daemon's life cycle is
    // refused by name, and the process goes on; the verb refuses a volume it does not serve.
    let st = control(&ctl, r#"{"v":1,"cmd":"status"}"#);
    assert!(st.contains(r#""finished":true"#), "{st}");
    let served = format!(r#""cipher":"{NEW_CIPHER}","key_bits":256"#);
    assert!(st.contains(&served), "not serving {served}: {st}");
    let cl = control(&ctl, r#"{"v":1,"cmd":"close","force":false}"#);
    assert!(
        cl.contains("answers status, reencrypt and resize only"),
        "{cl}"
    );
    assert!(
        server.0.try_wait().unwrap().is_none(),
        "the server exited on close"
    );
    let other = t.path("other.img");
    std::fs::write(&other, b"").unwrap();
    let o = run(
        UCRYPT,
        &[
            "reencrypt",
            "--control",
            s(&ctl),
            "--key-file",
            s(&key),
            s(&other),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("not "), "{}", text(&o));
    let after = keyslots(&img);
    assert_ne!(before, after, "keyslots unchanged:\n{after}");
    assert!(!after.contains("reencrypt"), "{after}");
    let dump = String::from_utf8_lossy(&ok(UCRYPT, &["luksDump", s(&img)]).stdout).to_string();
    assert!(dump.contains(NEW_CIPHER), "the header's cipher: {dump}");
    // SIGTERM stops the server (flushing); a new one serves the new key, fio verifies.
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
    let st = server.0.wait().unwrap();
    assert!(st.success(), "serve exited with {st}");
    assert!(!ctl.exists(), "the control socket was left behind");
    let _ = std::fs::remove_file(&sock);
    let mut server = Reaped(serve());
    wait_for(&sock, &mut server.0);
    let out2 = t.path("fio2.out");
    let mut v = fio_nbd(&sock, "48m", None, true, &out2).spawn().unwrap();
    fio_ok(&mut v, &out2, "after restarting the server");
    // SAFETY: as above.
    unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
    server.0.wait().unwrap();
    cryptsetup_accepts(&img, &key);
    drop(c);
}

/// A passphrase file and a 64 MiB data file (nothing on it) in `t`, and where the detached
/// header goes: (data, header, key).
fn detached_files(t: &TempDir) -> (PathBuf, PathBuf, PathBuf) {
    let (img, hdr, key) = (t.path("data.img"), t.path("hdr.img"), t.path("key"));
    std::fs::write(&key, PASSPHRASE).unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .unwrap();
    (img, hdr, key)
}

/// fio over `file` from `offset`, as [`fio`] makes it.
fn fio_at(
    file: &Path,
    offset: &str,
    size: &str,
    rate: Option<&str>,
    verify_only: bool,
    out: &Path,
) -> Command {
    let mut c = fio(s(file), size, rate, verify_only, out);
    c.arg(format!("--offset={offset}"));
    c
}

/// Opens `img` with the detached header `hdr` as `n`, starts fio writing 48 MiB at 8 MiB/s
/// from `fio_offset` with verification, runs `ucrypt reencrypt --header hdr` with `extra`
/// (handed to the daemon), and checks that it ended while fio ran and that fio's data
/// verified. Returns the volume (still open) for the caller to close.
fn reencrypt_under_fio(
    t: &TempDir,
    n: &str,
    (img, hdr, key): (&Path, &Path, &Path),
    fio_offset: &str,
    extra: &[&str],
) -> Cleanup {
    let dev = PathBuf::from(format!("{DEV_DIR}/{n}"));
    open_detached(img, hdr, key, n);
    let mut c = Cleanup {
        name: n.to_string(),
        procs: vec![],
    };
    let out = t.path("fio.out");
    let mut job = fio_at(&dev, fio_offset, "48m", Some("8m"), false, &out);
    c.procs.push(job.spawn().unwrap());
    fio_started(&mut c.procs[0]);
    let mut a = vec!["reencrypt", "--batch-mode", "--key-file", s(key)];
    a.extend(["--hotzone-size", HOTZONE, "--header", s(hdr)]);
    a.extend(extra);
    a.extend(FAST_PBKDF2);
    a.push(s(img));
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(0), "online {extra:?}: {}", text(&o));
    fio_outlasted(&mut c.procs[0], "fio ended before the reencryption did");
    let st = status(n);
    assert!(st.contains(", finished"), "{st}");
    fio_ok(&mut c.procs[0], &out, "during the reencryption");
    c.procs.clear();
    c
}

/// A volume with a detached header (`--header`) decrypted online: `ucrypt reencrypt --decrypt
/// --header H` hands the decryption to the daemon, which serves while it goes (backward, from
/// the end); fio writes and verifies throughout; after the close, fio verifies its data on the
/// bare data file, which holds the plaintext.
#[test]
fn a_detached_header_decrypts_online() {
    skip_unless_rig!();
    let t = TempDir::new("decrypt");
    let (img, hdr, key) = detached_files(&t);
    let mut a = vec!["format", "-q", "--key-file", s(&key), "--header", s(&hdr)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    let n = name("decrypt");
    let c = reencrypt_under_fio(&t, &n, (&img, &hdr, &key), "0", &["--decrypt"]);
    let st = status(&n);
    assert!(st.contains("cipher_null"), "{st}");
    ok(UCRYPT, &["close", &n]);
    drop(c);
    // The bare file holds what fio wrote, in plaintext.
    let out = t.path("plain.out");
    let mut v = fio_at(&img, "0", "48m", None, true, &out).spawn().unwrap();
    fio_ok(&mut v, &out, "on the decrypted file");
}

/// A plaintext file encrypted online with a detached header: `ucrypt reencrypt --encrypt
/// --init-only --header H`, `ucrypt open --header H` (served as two segments, the plaintext
/// above the mark), then `ucrypt reencrypt --header H` hands the rest to the daemon. fio's
/// data written before (on the bare file) and during verifies through the volume, and after
/// a close and open; cryptsetup opens the header.
#[test]
fn a_detached_header_encrypts_online() {
    skip_unless_rig!();
    let t = TempDir::new("encrypt");
    let (img, hdr, key) = detached_files(&t);
    let before = t.path("before.out");
    let mut w = fio_at(&img, "0", "16m", None, false, &before)
        .spawn()
        .unwrap();
    fio_ok(&mut w, &before, "on the plaintext file");
    let mut a = vec!["reencrypt", "--encrypt", "--init-only", "--batch-mode"];
    a.extend(["--key-file", s(&key), "--header", s(&hdr)]);
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    let n = name("encrypt");
    let dev = PathBuf::from(format!("{DEV_DIR}/{n}"));
    let c = reencrypt_under_fio(&t, &n, (&img, &hdr, &key), "16m", &[]);
    let out = t.path("fio2.out");
    let mut v = fio_at(&dev, "0", "16m", None, true, &out).spawn().unwrap();
    fio_ok(
        &mut v,
        &out,
        "of the data written before, through the volume",
    );
    ok(UCRYPT, &["close", &n]);
    // The bare file no longer verifies: it is ciphertext.
    let out = t.path("fio3.out");
    let st = fio_at(&img, "0", "16m", None, true, &out).status().unwrap();
    assert!(!st.success(), "the data file still holds the plaintext");
    open_detached(&img, &hdr, &key, &n);
    let out = t.path("fio4.out");
    let mut v = fio_at(&dev, "16m", "48m", None, true, &out)
        .spawn()
        .unwrap();
    fio_ok(&mut v, &out, "after reopening");
    ok(UCRYPT, &["close", &n]);
    drop(c);
    cryptsetup_accepts_detached(&img, &hdr, &key);
}

/// A new sector size online, both ways: 512 → 4096 while fio writes 512-byte blocks (each one
/// a part of a new 4096-byte sector, which the new side read-modify-writes), and 4096 → 512
/// while fio writes 4 KiB blocks. The rotation runs while fio writes and verifies; then the
/// daemon serves the new sectors until it is closed, and refuses to suspend until then, saying
/// why; after close and open fio's data verifies, and cryptsetup accepts the header with the
/// new sector size.
#[test]
fn a_new_sector_size_online() {
    skip_unless_rig!();
    for (from, to, bs) in [("512", "4096", "512"), ("4096", "512", "4k")] {
        let t = TempDir::new(&format!("sector{from}"));
        let (img, key) = (t.path("vol.img"), t.path("key"));
        std::fs::write(&key, PASSPHRASE).unwrap();
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(96 << 20))
            .unwrap();
        let mut a = vec!["format", "-q", "--sector-size", from, "--key-file", s(&key)];
        a.extend(FAST_PBKDF2);
        a.push(s(&img));
        ok(UCRYPT, &a);
        let n = name(&format!("sector{from}"));
        let dev = format!("{DEV_DIR}/{n}");
        open(&img, &key, &n);
        let mut c = Cleanup {
            name: n.clone(),
            procs: vec![],
        };
        let out = t.path("fio.out");
        let mut job = fio(&dev, "32m", Some("4m"), false, &out);
        job.arg(format!("--bs={bs}"));
        c.procs.push(job.spawn().unwrap());
        fio_started(&mut c.procs[0]);
        let mut a = vec!["reencrypt", "--batch-mode", "--key-file", s(&key)];
        a.extend(["--hotzone-size", HOTZONE, "--sector-size", to]);
        a.extend(FAST_PBKDF2);
        a.push(s(&img));
        let o = run(UCRYPT, &a);
        let what = format!("{from} → {to}");
        assert_eq!(o.status.code(), Some(0), "{what}: {}", text(&o));
        fio_outlasted(
            &mut c.procs[0],
            &format!("{what}: fio ended before the rotation did"),
        );
        let st = status(&n);
        assert!(st.contains(", finished"), "{what}: {st}");
        fio_ok(&mut c.procs[0], &out, &format!("during {what}"));
        c.procs.clear();
        assert!(st.contains("close and open the volume"), "{what}: {st}");
        assert!(
            st.contains(&format!("sector size:  {to}\n")),
            "{what}: status shows the sectors served: {st}"
        );
        let o = run(UCRYPT, &["suspend", &n]);
        assert_ne!(o.status.code(), Some(0), "{what}: suspended");
        assert!(text(&o).contains("changed online"), "{what}: {}", text(&o));
        // Another reencryption is refused before its init is written.
        let before = std::fs::read(&img).unwrap()[..1 << 20].to_vec();
        let mut a = vec!["reencrypt", "--batch-mode", "--key-file", s(&key)];
        a.extend(FAST_PBKDF2);
        a.push(s(&img));
        let o = run(UCRYPT, &a);
        assert_eq!(o.status.code(), Some(1), "{what}: {}", text(&o));
        assert!(
            text(&o).contains("close it and open it again"),
            "{}",
            text(&o)
        );
        assert!(
            std::fs::read(&img).unwrap()[..1 << 20] == before[..],
            "{what}: the refused reencryption wrote the header"
        );
        ok(UCRYPT, &["close", &n]);
        cryptsetup_accepts(&img, &key);
        let d = String::from_utf8_lossy(&ok(UCRYPT, &["luksDump", s(&img)]).stdout).to_string();
        assert!(d.contains(&format!("sector: {to} [bytes]")), "{what}: {d}");
        open(&img, &key, &n);
        let out2 = t.path("fio2.out");
        let mut v = fio(&dev, "32m", None, true, &out2);
        // Opened in 4096-byte sectors, the device takes no 512-byte direct I/O: the blocks
        // fio wrote are read back through the page cache.
        v.args([format!("--bs={bs}"), "--direct=0".to_string()]);
        let mut v = v.spawn().unwrap();
        fio_ok(&mut v, &out2, &format!("after reopening ({what})"));
        ok(UCRYPT, &["close", &n]);
        drop(c);
    }
}

/// An encryption that moves the data (the header put in front) served online, as cryptsetup
/// activates one: fio writes 16 MiB on the bare 96 MiB file; `ucrypt reencrypt --encrypt
/// --reduce-device-size 32M --init-only` starts it (the first 16 MiB moved to the end of the
/// file); `ucrypt open` serves the 64 MiB of data (the first 16 MiB read from where they
/// moved); `ucrypt reencrypt` hands the rest to the daemon while fio writes and verifies the
/// other 48 MiB. The daemon then serves the new layout until it is closed; opened again the
/// volume has grown by the shift and fio's data verifies; cryptsetup opens the header, with
/// the data at 16 MiB.
#[test]
fn an_encryption_moving_the_data_online() {
    skip_unless_rig!();
    let t = TempDir::new("shift");
    let (img, key) = (t.path("data.img"), t.path("key"));
    std::fs::write(&key, PASSPHRASE).unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(96 << 20))
        .unwrap();
    let before = t.path("before.out");
    let mut w = fio_at(&img, "0", "16m", None, false, &before)
        .spawn()
        .unwrap();
    fio_ok(&mut w, &before, "on the plaintext file");
    let mut a = vec!["reencrypt", "--encrypt", "--init-only", "--batch-mode"];
    a.extend(["--reduce-device-size", "32M", "--key-file", s(&key)]);
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    let n = name("shift");
    let dev = PathBuf::from(format!("{DEV_DIR}/{n}"));
    open(&img, &key, &n);
    let mut c = Cleanup {
        name: n.clone(),
        procs: vec![],
    };
    let st = status(&n);
    assert!(st.contains("reencryption: 0 of 67108864 bytes"), "{st}");
    let out = t.path("head.out");
    let mut v = fio_at(&dev, "0", "16m", None, true, &out).spawn().unwrap();
    fio_ok(&mut v, &out, "of the moved head, through the volume");
    let out = t.path("fio.out");
    let mut job = fio_at(&dev, "16m", "48m", Some("8m"), false, &out);
    c.procs.push(job.spawn().unwrap());
    fio_started(&mut c.procs[0]);
    let mut a = vec!["reencrypt", "--batch-mode", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(0), "online: {}", text(&o));
    fio_outlasted(&mut c.procs[0], "fio ended before the encryption did");
    let st = status(&n);
    assert!(st.contains(", finished"), "{st}");
    assert!(st.contains("close and open the volume"), "{st}");
    // 32 MiB reduced: the header in front takes half, the data starts at 16 MiB.
    assert!(
        st.contains("offset:  32768 sectors\n"),
        "status shows the data offset served: {st}"
    );
    fio_ok(&mut c.procs[0], &out, "during the encryption");
    c.procs.clear();
    let out = t.path("head2.out");
    let mut v = fio_at(&dev, "0", "16m", None, true, &out).spawn().unwrap();
    fio_ok(&mut v, &out, "of the head after the encryption");
    ok(UCRYPT, &["close", &n]);
    // The bare file no longer verifies where fio wrote, nor where the data moved.
    for at in ["0", "16m"] {
        let out = t.path("bare.out");
        let st = fio_at(&img, at, "16m", None, true, &out).status().unwrap();
        assert!(!st.success(), "the file holds plaintext at {at}");
    }
    cryptsetup_accepts(&img, &key);
    let d = String::from_utf8_lossy(&ok(UCRYPT, &["luksDump", s(&img)]).stdout).to_string();
    assert!(d.contains("offset: 16777216 [bytes]"), "{d}");
    open(&img, &key, &n);
    let size = std::fs::metadata(&dev).map(|m| m.len()).unwrap_or(0);
    let size = if size == 0 {
        let o = ok("blockdev", &["--getsize64", s(&dev)]);
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
    } else {
        size
    };
    assert_eq!(size, 80 << 20, "reopened: grown by the shift");
    for (at, len, what) in [("0", "16m", "head"), ("16m", "48m", "the rest")] {
        let out = t.path("after.out");
        let mut v = fio_at(&dev, at, len, None, true, &out).spawn().unwrap();
        fio_ok(&mut v, &out, &format!("{what} after reopening"));
    }
    ok(UCRYPT, &["close", &n]);
    drop(c);
}

/// A volume with two keyslots, served by `serve --control` under fio's verified NBD writes,
/// rotated online with one passphrase per keyslot read from a pipe (as cryptsetup asks them,
/// one line each): both keyslots are replaced under the new key, each passphrase opens the
/// result (and no other keyslot's), cryptsetup opens it, and fio's data verifies during the
/// rotation and after a new server. A wrong second passphrase is refused before anything is
/// written. Needs fio's nbd engine, no root.
#[test]
fn two_keyslots_rotate_online() {
    if !have("fio") || !fio_has_nbd() {
        println!("SKIPPED: fio with its nbd engine not installed (scripts/deps.sh test)");
        return;
    }
    let t = TempDir::new("two-slots");
    let (img, key) = volume(&t, 64);
    let key2 = t.path("key2");
    std::fs::write(&key2, b"the second keyslot's passphrase").unwrap();
    let mut a = vec!["luksAddKey", "-q", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.extend([s(&img), s(&key2)]);
    ok(UCRYPT, &a);
    let (sock, ctl) = (t.path("nbd.sock"), t.path("control.sock"));
    let serve = || serve_controlled(&img, &key, &sock, &ctl);
    let mut server = Reaped(serve());
    wait_for(&ctl, &mut server.0);
    wait_for(&sock, &mut server.0);
    let before = keyslots(&img);
    let rotate = |input: &[u8]| {
        use std::io::Write;
        let mut a = vec!["reencrypt", "--batch-mode", "--hotzone-size", HOTZONE];
        a.extend(["--control", s(&ctl)]);
        a.push(s(&img));
        let mut child = Command::new(UCRYPT)
            .args(&a)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        // A verb that refuses before reading closes the pipe: no error here.
        let _ = stdin.write_all(input);
        drop(stdin);
        child.wait_with_output().unwrap()
    };
    let first = std::fs::read(&key).unwrap();
    let second = std::fs::read(&key2).unwrap();
    let lines = |a: &[u8], b: &[u8]| [a, b"\n", b, b"\n"].concat();
    // A wrong passphrase for keyslot 1: refused (exit 2), nothing written.
    let o = rotate(&lines(&first, b"not the second one"));
    assert_eq!(
        o.status.code(),
        Some(2),
        "wrong second passphrase: {}",
        text(&o)
    );
    assert_eq!(keyslots(&img), before, "a refused rotation wrote");
    let out = t.path("fio.out");
    let mut fio = Reaped(
        fio_nbd(&sock, "32m", Some("6m"), false, &out)
            .spawn()
            .unwrap(),
    );
    fio_started(&mut fio.0);
    let o = rotate(&lines(&first, &second));
    assert_eq!(o.status.code(), Some(0), "online rotation: {}", text(&o));
    fio_outlasted(
        &mut fio.0,
        "fio ended before the rotation did: it did not run under I/O",
    );
    let st = fio.0.wait().unwrap();
    assert!(
        st.success(),
        "fio during the rotation: {}",
        std::fs::read_to_string(&out).unwrap_or_default()
    );
    let after = keyslots(&img);
    assert_ne!(before, after, "keyslots unchanged:\n{after}");
    assert!(!after.contains("reencrypt"), "{after}");
    assert_eq!(
        after.matches(": luks2").count(),
        2,
        "two keyslots:\n{after}"
    );
    // Each passphrase opens exactly one keyslot of the new key, each its own.
    let ids: Vec<&str> = after
        .lines()
        .filter_map(|l| l.trim().strip_suffix(": luks2"))
        .collect();
    let mut opened = Vec::new();
    for k in [&key, &key2] {
        let by: Vec<&str> = ids
            .iter()
            .copied()
            .filter(|slot| {
                let a = [
                    "open",
                    "--test-passphrase",
                    "--key-file",
                    s(k),
                    "--key-slot",
                ];
                run(UCRYPT, &[&a[..], &[*slot, s(&img)]].concat())
                    .status
                    .success()
            })
            .collect();
        assert_eq!(
            by.len(),
            1,
            "{} opens keyslots {by:?} of {ids:?}",
            k.display()
        );
        opened.push(by[0]);
    }
    assert_ne!(opened[0], opened[1], "both passphrases open one keyslot");
    if have("cryptsetup") {
        for k in [&key, &key2] {
            ok(
                "cryptsetup",
                &["open", "--test-passphrase", "--key-file", s(k), s(&img)],
            );
        }
    }
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
    assert!(server.0.wait().unwrap().success(), "serve exited badly");
    let _ = std::fs::remove_file(&sock);
    let mut server = Reaped(serve());
    wait_for(&sock, &mut server.0);
    let out2 = t.path("fio2.out");
    let st = fio_nbd(&sock, "32m", None, true, &out2).status().unwrap();
    assert!(
        st.success(),
        "fio's data after the rotation: {}",
        std::fs::read_to_string(&out2).unwrap_or_default()
    );
}

/// `ucrypt serve IMG` over NBD on the unix socket `sock` (a stale socket file removed
/// first), once the socket is there.
fn serve_nbd(img: &Path, key: &Path, sock: &Path) -> Reaped {
    let _ = std::fs::remove_file(sock);
    let mut server = Reaped(serve_cmd(img, key, sock).spawn().unwrap());
    wait_for(sock, &mut server.0);
    server
}

/// The command of `ucrypt serve IMG` over NBD on the unix socket `sock`, its standard streams
/// closed.
/// `serve` over NBD with the control socket `ctl`, started.
fn serve_controlled(img: &Path, key: &Path, sock: &Path, ctl: &Path) -> Child {
    serve_cmd(img, key, sock)
        .arg("--control")
        .arg(ctl)
        .spawn()
        .unwrap()
}

fn serve_cmd(img: &Path, key: &Path, sock: &Path) -> Command {
    let mut c = Command::new(UCRYPT);
    c.args(["serve", s(img), "--key-file", s(key), "--nbd"])
        .arg(format!("unix:{}", s(sock)))
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    c
}

/// A volume `ucrypt serve` serves without `--control` (no way to reencrypt it online): an
/// offline `reencrypt` (also with `--force-offline-reencrypt`, and `--encrypt` of the file),
/// `format`, `luksHeaderRestore`, `import`, and the `repair` of a reencryption are refused
/// with exit code 5 before anything is written; keyslot verbs work meanwhile (cryptsetup's
/// header lock is not held by the server); once the server is gone the refused verbs run.
/// Needs nothing but ucrypt (NBD on a unix socket).
#[test]
fn verbs_that_would_rewrite_a_served_volume_are_refused() {
    let t = TempDir::new("served");
    let (img, key) = volume(&t, 24);
    let sock = t.path("nbd.sock");
    let server = serve_nbd(&img, &key, &sock);
    let backup = t.path("hdr.backup");
    ok(
        UCRYPT,
        &[
            "luksHeaderBackup",
            s(&img),
            "--header-backup-file",
            s(&backup),
        ],
    );
    let plain = t.path("plain");
    std::fs::write(&plain, vec![7u8; 1 << 20]).unwrap();
    let before = std::fs::read(&img).unwrap();
    let reencrypt = |extra: &[&str]| {
        let mut a = vec!["reencrypt", "--batch-mode", "--key-file", s(&key)];
        a.extend(FAST_PBKDF2);
        a.extend(extra);
        a.push(s(&img));
        run(UCRYPT, &a)
    };
    for (what, o) in [
        ("reencrypt", reencrypt(&[])),
        (
            "reencrypt --force-offline-reencrypt",
            reencrypt(&["--force-offline-reencrypt"]),
        ),
        (
            "reencrypt --encrypt",
            reencrypt(&["--encrypt", "--reduce-device-size", "2M"]),
        ),
        (
            "format",
            run(UCRYPT, &["format", "-q", "--key-file", s(&key), s(&img)]),
        ),
        (
            "luksHeaderRestore",
            run(
                UCRYPT,
                &[
                    "luksHeaderRestore",
                    "-q",
                    s(&img),
                    "--header-backup-file",
                    s(&backup),
                ],
            ),
        ),
        (
            "import",
            run(
                UCRYPT,
                &["import", s(&plain), s(&img), "--key-file", s(&key)],
            ),
        ),
    ] {
        assert_eq!(o.status.code(), Some(5), "{what}: {}", text(&o));
        assert!(
            text(&o).contains("is in use by a ucrypt process"),
            "{what}: {}",
            text(&o)
        );
        assert!(std::fs::read(&img).unwrap() == before, "{what} wrote");
    }
    // A keyslot verb is not refused and does not wait for the server.
    let key2 = t.path("key2");
    std::fs::write(&key2, b"a second passphrase").unwrap();
    let mut a = vec!["luksAddKey", "--batch-mode", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.extend([s(&img), s(&key2)]);
    let start = Instant::now();
    ok(UCRYPT, &a);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "luksAddKey waited"
    );
    drop(server);
    let o = reencrypt(&["--key-slot", "0"]);
    assert_eq!(o.status.code(), Some(0), "after the server: {}", text(&o));
    // A reencryption's recovery (`repair`) belongs to the process serving it.
    ok(UCRYPT, &{
        let mut a = vec!["reencrypt", "--init-only", "-q", "--key-file", s(&key)];
        a.extend(FAST_PBKDF2);
        a.push(s(&img));
        a
    });
    let server = serve_nbd(&img, &key, &sock);
    let before = std::fs::read(&img).unwrap();
    let o = run(UCRYPT, &["repair", "-q", "--key-file", s(&key), s(&img)]);
    assert_eq!(o.status.code(), Some(5), "repair: {}", text(&o));
    assert!(
        text(&o).contains("is in use by a ucrypt process"),
        "{}",
        text(&o)
    );
    assert!(std::fs::read(&img).unwrap() == before, "repair wrote");
    drop(server);
    ok(UCRYPT, &["repair", "-q", "--key-file", s(&key), s(&img)]);
}

/// cryptsetup's `reencrypt --encrypt DEVICE NAME` in one command: `ucrypt reencrypt --encrypt
/// ... DEVICE --active-name NAME` writes the init, opens the volume as NAME (an `open`
/// daemon) and has it encrypt the volume while it serves; with the header put in front
/// (`--reduce-device-size`) and with a detached header. fio's data written on the bare file
/// before verifies through NAME after, and after close and open; cryptsetup opens the result.
/// A NAME in use is refused (exit 5) before anything is written.
#[test]
fn one_command_encrypts_online_under_a_name() {
    skip_unless_rig!();
    for detached in [false, true] {
        let t = TempDir::new(&format!("one-{detached}"));
        let (img, key, hdr) = (t.path("data.img"), t.path("key"), t.path("hdr.img"));
        std::fs::write(&key, PASSPHRASE).unwrap();
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(64 << 20))
            .unwrap();
        let before = t.path("before.out");
        let mut w = fio_at(&img, "0", "24m", None, false, &before)
            .spawn()
            .unwrap();
        fio_ok(&mut w, &before, "on the plaintext file");
        let n = name(&format!("one-{detached}"));
        let dev = PathBuf::from(format!("{DEV_DIR}/{n}"));
        let mut a = vec![
            "reencrypt",
            "--encrypt",
            "--batch-mode",
            "--key-file",
            s(&key),
        ];
        if detached {
            a.extend(["--header", s(&hdr)]);
        } else {
            a.extend(["--reduce-device-size", "8M"]);
        }
        a.extend(FAST_PBKDF2);
        a.extend([s(&img), "--active-name", &n]);
        let o = run(UCRYPT, &a);
        let c = Cleanup {
            name: n.clone(),
            procs: vec![],
        };
        assert_eq!(
            o.status.code(),
            Some(0),
            "detached {detached}: {}",
            text(&o)
        );
        let st = status(&n);
        assert!(st.contains(", finished"), "detached {detached}: {st}");
        let out = t.path("after.out");
        let mut v = fio_at(&dev, "0", "24m", None, true, &out).spawn().unwrap();
        fio_ok(&mut v, &out, "through the name after the encryption");
        // The name is taken: another encryption under it is refused, nothing written.
        let other = t.path("other.img");
        std::fs::write(&other, vec![7u8; 16 << 20]).unwrap();
        let mut a = vec![
            "reencrypt",
            "--encrypt",
            "--batch-mode",
            "--key-file",
            s(&key),
        ];
        a.extend(["--reduce-device-size", "8M"]);
        a.extend(FAST_PBKDF2);
        a.extend([s(&other), "--active-name", &n]);
        let o = run(UCRYPT, &a);
        assert_eq!(o.status.code(), Some(5), "a name in use: {}", text(&o));
        assert!(std::fs::read(&other).unwrap() == vec![7u8; 16 << 20]);
        ok(UCRYPT, &["close", &n]);
        if detached {
            cryptsetup_accepts_detached(&img, &hdr, &key);
            open_detached(&img, &hdr, &key, &n);
        } else {
            cryptsetup_accepts(&img, &key);
            open(&img, &key, &n);
        }
        let mut v = fio_at(&dev, "0", "24m", None, true, &out).spawn().unwrap();
        fio_ok(&mut v, &out, "after reopening");
        ok(UCRYPT, &["close", &n]);
        drop(c);
    }
}

/// A decryption that moves the data back (`--decrypt --header NEW` of a volume whose header
/// is in front) served online, as cryptsetup 2.6 runs one on an active device: `--init-only`
/// with the volume closed exports the header; `ucrypt open --header NEW` serves the three
/// ranges (the moved segment and the rest under the old key, the part done in plaintext at
/// offset 0); `ucrypt reencrypt --header NEW` hands the rest to the daemon while fio writes
/// and verifies 48 MiB; afterwards fio's data verifies on the bare file from offset 0. Then
/// the same in one command (`--active-name NAME`) on a second volume, and the refusal of a
/// new such decryption of a volume a daemon serves from its header in front (exit 1, nothing
/// written).
#[test]
fn a_decryption_moving_the_data_back_online() {
    skip_unless_rig!();
    let t = TempDir::new("unshift");
    let (img, key) = volume(&t, 64);
    let hdr = t.path("new.hdr");
    let unshift = |img: &Path, hdr: &Path, extra: &[&str]| {
        let mut a = vec![
            "reencrypt",
            "--decrypt",
            "--batch-mode",
            "--key-file",
            s(&key),
        ];
        a.extend(["--header", s(hdr)]);
        a.extend(extra);
        a.push(s(img));
        run(UCRYPT, &a)
    };
    // Refused while the volume is served from its header in front.
    let n = name("unshift");
    open(&img, &key, &n);
    let before = std::fs::read(&img).unwrap();
    let o = unshift(&img, &hdr, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("starts with the volume closed"),
        "{}",
        text(&o)
    );
    assert!(
        std::fs::read(&img).unwrap() == before,
        "the refused decryption wrote"
    );
    assert!(!hdr.exists(), "the refused decryption exported the header");
    ok(UCRYPT, &["close", &n]);
    let o = unshift(&img, &hdr, &["--init-only"]);
    assert_eq!(o.status.code(), Some(0), "init: {}", text(&o));
    let c = reencrypt_under_fio(&t, &n, (&img, &hdr, &key), "0", &[]);
    let st = status(&n);
    assert!(st.contains("close and open the volume"), "{st}");
    ok(UCRYPT, &["close", &n]);
    drop(c);
    let out = t.path("bare.out");
    let mut v = fio_at(&img, "0", "48m", None, true, &out).spawn().unwrap();
    fio_ok(&mut v, &out, "on the bare file, from offset 0");

    // In one command, under a name.
    let t2 = TempDir::new("unshift-one");
    let (img2, key2) = volume(&t2, 48);
    std::fs::copy(&key2, &key).unwrap();
    let hdr2 = t2.path("new.hdr");
    let n2 = name("unshift-one");
    let dev2 = PathBuf::from(format!("{DEV_DIR}/{n2}"));
    open(&img2, &key, &n2);
    let out = t2.path("w.out");
    let mut w = fio_at(&dev2, "0", "24m", None, false, &out)
        .spawn()
        .unwrap();
    fio_ok(&mut w, &out, "before the decryption");
    ok(UCRYPT, &["close", &n2]);
    let o = unshift(&img2, &hdr2, &["--active-name", &n2]);
    let c2 = Cleanup {
        name: n2.clone(),
        procs: vec![],
    };
    assert_eq!(o.status.code(), Some(0), "one command: {}", text(&o));
    let st = status(&n2);
    assert!(st.contains(", finished"), "{st}");
    let mut v = fio_at(&dev2, "0", "24m", None, true, &out).spawn().unwrap();
    fio_ok(&mut v, &out, "through the name after the decryption");
    ok(UCRYPT, &["close", &n2]);
    drop(c2);
    let mut v = fio_at(&img2, "0", "24m", None, true, &out).spawn().unwrap();
    fio_ok(&mut v, &out, "on the bare file after the one command");
}
