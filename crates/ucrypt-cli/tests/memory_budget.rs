//! `--memory-budget` under load: volumes written with many requests in flight share a budget
//! smaller than what their pools would grow to alone. Nothing fails, every acknowledged write
//! reads back, and while they write the bytes charged to the budget file (sampled from the file
//! itself: `/run/ucrypt/memory-budget` for root) stay within the budget, and the locked memory
//! of all the processes together (`VmLck`) within the budget plus what each volume may hold
//! uncharged (its 256 KiB reserve, its keys).
//!
//! - `volumes_under_one_budget_wait_and_never_fail`: N `open`ed volumes (each its own daemon,
//!   FUSE front end and an NBD socket beside it), each written by `nbdcopy` with 16 requests
//!   of 1 MiB in flight. `UCRYPT_BUDGET_VOLUMES` sets N (default 8; the long mode recorded in
//!   BENCHMARKS.md runs 100, with `UCRYPT_BUDGET_BYTES` 64 MiB). The budget is N × 128 KiB
//!   unless that says: far less than what 16 requests per volume would take beyond their
//!   reserves (a 256 KiB piece each), so the pools must wait for each other.
//! - `serve_mount_and_open_share_one_budget`: an `open`ed volume (written over its NBD socket), a
//!   `serve` (NBD) and a `mount` (FUSE file, written by parallel `dd`s with O_DIRECT) given the
//!   same budget charge the same file: each process's slot shows a charge while they write (one
//!   whose pool waited within its reserve while the others held the budget writes again alone
//!   once their charges are refunded, over 4 NBD connections, up to 3 times), and their total stays within the budget; `status` of the
//!   open volume and serve's metrics show the budget.
//! - `rootless_serve_mount_and_open_share_one_budget`: the same as user nobody (`setpriv`, FUSE
//!   through `fusermount3`), whose budget file is in its own `XDG_RUNTIME_DIR`.
//! - `ublk_takes_the_budget_as_open_does`: `ublk --memory-budget` refuses a size below one chunk
//!   with `open`'s words and exit code, and with a valid size joins the budget file (with
//!   ublk_drv loaded; SKIPPED without it, after checking that the option was taken and the driver
//!   is what is missing). No load runs through ublk here.
//!
//! The others need root (the rootless one to switch users), /dev/fuse and nbdcopy, and the
//! rootless one setpriv and fusermount3: SKIPPED otherwise. Names carry the test's pid. The
//! tests as root share the budget file of root's state directory, so they run one at a time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{have, is_root, run, s, text, TempDir, FAST_PBKDF2, UCRYPT};
use kit::{terminate, wait_timeout};

const PASSPHRASE: &[u8] = b"memory budget passphrase";
/// Writes of a volume alone until its process charged the budget, and the NBD connections
/// each takes (each served by its own workers).
const ALONE_TRIES: usize = 3;
const ALONE_CONNECTIONS: u32 = 4;
/// Each volume's data: written `PASSES` times over, read back.
const DATA_MIB: u64 = 8;
const PASSES: usize = 4;
/// What a volume may lock beyond its share of the budget: its pool's reserve (256 KiB), its
/// keys and the cipher contexts of the engine's workers (`--policy parallel`), with room for
/// the sampling's skew (each process's `VmLck` is read at a different instant, so the sum may
/// add peaks that were not at once).
const UNCHARGED_PER_VOLUME_BYTES: u64 = 1 << 20;
/// The budget per volume: half a 256 KiB piece.
const BUDGET_PER_VOLUME_BYTES: u64 = 128 << 10;
/// The budget of the three front ends' test: a 256 KiB piece each, less than what 16 requests
/// in flight per volume would take beyond their reserves.
const FRONT_ENDS_BUDGET_BYTES: u64 = 3 * (256 << 10);
/// How long an idle pool may take to refund its charges: its idle period
/// (`ucrypt::pool::POOL_IDLE_RELEASE`, 5 s) and the reaper's round, with room for a loaded
/// machine.
const REFUND_WAIT: Duration = Duration::from_secs(30);
/// How long a started server may take to be ready.
const READY_WAIT: Duration = Duration::from_secs(30);

/// The tests as root charge the same budget file: one at a time.
static BUDGET_FILE_USERS: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    BUDGET_FILE_USERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Who runs the volumes' processes and the commands that reach them.
#[derive(Clone)]
enum User {
    /// Root: its state directory is `/run/ucrypt`.
    Root,
    /// User nobody (rootless), with this `XDG_RUNTIME_DIR`: its state directory, and so its
    /// budget file, is its own.
    Nobody { xdg: PathBuf },
}

impl User {
    fn command(&self, prog: &str) -> Command {
        match self {
            User::Root => Command::new(prog),
            User::Nobody { xdg } => {
                let mut c = Command::new("setpriv");
                c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "env"])
                    .arg(format!("XDG_RUNTIME_DIR={}", s(xdg)))
                    .arg(prog);
                c
            }
        }
    }

    /// Runs `prog ARGS` as this user with no stdin and collects its output.
    fn run(&self, prog: &str, args: &[&str]) -> Output {
        self.command(prog)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"))
    }

    fn ok(&self, prog: &str, args: &[&str]) -> Output {
        let o = self.run(prog, args);
        assert!(o.status.success(), "{prog} {args:?}: {}", text(&o));
        o
    }

    fn state_dir(&self) -> PathBuf {
        match self {
            User::Root => PathBuf::from("/run/ucrypt"),
            User::Nobody { xdg } => xdg.join("ucrypt"),
        }
    }

    /// The budget file (`daemon::budget::MEMORY_BUDGET_FILE` in the state directory).
    fn budget_file(&self) -> PathBuf {
        self.state_dir().join("memory-budget")
    }

    /// Hands `dir` and what is in it over to this user.
    fn own(&self, dir: &Path) {
        if let User::Nobody { .. } = self {
            ok("chown", &["-R", "nobody:nogroup", s(dir)]);
        }
    }
}

fn skip_reason() -> Option<&'static str> {
    (!is_root() || !Path::new("/dev/fuse").exists() || !have("nbdcopy"))
        .then_some("needs root, /dev/fuse and nbdcopy (libnbd-bin)")
}

fn ok(prog: &str, args: &[&str]) -> Output {
    let o = run(prog, args);
    assert!(o.status.success(), "{prog} {args:?}: {}", text(&o));
    o
}

/// A status field's value (`key: value` lines).
fn status_field(user: &User, name: &str, key: &str) -> Option<String> {
    let o = user.run(UCRYPT, &["status", name]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    out.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// `VmLck` of a process, in bytes.
fn vm_lck_bytes(pid: u32) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    st.lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

fn alive(pid: u64) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    p > 0 && unsafe { libc::kill(p, 0) } == 0
}

/// The charges in the budget file, by pid, of the processes alive (as `status` counts them).
/// The file (`ucrypt::pool::budget`): a 16-byte header, then 16-byte slots of two
/// little-endian u64s, the pid and the bytes it has charged.
fn budget_charges(file: &Path) -> HashMap<u32, u64> {
    let bytes = std::fs::read(file).unwrap_or_default();
    let word = |c: &[u8]| u64::from_le_bytes(c.try_into().expect("8 bytes"));
    bytes
        .chunks_exact(16)
        .skip(1)
        .map(|slot| (word(&slot[..8]), word(&slot[8..])))
        .filter(|&(pid, _)| pid != 0 && alive(pid))
        .map(|(pid, charged)| (pid as u32, charged))
        .collect()
}

/// The most seen while the writers ran.
#[derive(Debug, Default, Clone)]
struct Peaks {
    /// `VmLck` of the watched processes, summed at one sampling.
    locked: u64,
    /// Charged to the budget file by all.
    charged: u64,
    /// Charged by each watched process.
    charged_by: HashMap<u32, u64>,
}

/// Samples the watched processes and the budget file every 20 ms until finished.
struct Sampler {
    peaks: Arc<Mutex<Peaks>>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Sampler {
    /// Watches `pids` and the budget `file`.
    fn start(pids: Vec<u32>, file: PathBuf) -> Sampler {
        let peaks = Arc::new(Mutex::new(Peaks::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peaks, stop) = (Arc::clone(&peaks), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let locked = pids.iter().map(|&pid| vm_lck_bytes(pid)).sum();
                    let charges = budget_charges(&file);
                    let mut p = peaks.lock().unwrap();
                    p.locked = p.locked.max(locked);
                    p.charged = p.charged.max(charges.values().sum());
                    for pid in &pids {
                        let c = charges.get(pid).copied().unwrap_or(0);
                        let seen = p.charged_by.entry(*pid).or_default();
                        *seen = (*seen).max(c);
                    }
                    drop(p);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        Sampler {
            peaks,
            stop,
            thread,
        }
    }

    /// The most `pid` has charged so far.
    fn charged_by(&self, pid: u32) -> u64 {
        let p = self.peaks.lock().unwrap();
        p.charged_by.get(&pid).copied().unwrap_or(0)
    }

    fn finish(self) -> Peaks {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
        let p = self.peaks.lock().unwrap();
        p.clone()
    }
}

/// A LUKS2 volume of `DATA_MIB` MiB of data, with the test's passphrase.
fn volume(t: &TempDir, key: &Path, file: &str) -> PathBuf {
    let img = t.path(file);
    std::fs::File::create(&img)
        .and_then(|f| f.set_len((DATA_MIB + 16) << 20))
        .unwrap();
    let mut a = vec!["format", "-q", "--key-file", s(key)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    img
}

/// The data written to volume `i`: different for each.
fn pattern(t: &TempDir, i: usize) -> PathBuf {
    let p = t.path(&format!("p{i}"));
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1);
    let data: Vec<u8> = (0..(DATA_MIB << 20) / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(&p, data).unwrap();
    p
}

/// How a test writes a volume: through an NBD export or a file that is the volume.
#[derive(Clone)]
enum Writer {
    /// `nbdcopy` to this URI, 16 requests of 1 MiB in flight.
    Nbd(String),
    /// One `dd` per MiB at once, with O_DIRECT.
    File(PathBuf),
}

impl Writer {
    /// Writes `pattern` `PASSES` times over, in a thread: what the first failed command said,
    /// if one failed.
    fn start(&self, user: &User, pattern: &Path) -> JoinHandle<Result<(), String>> {
        self.start_on(user, pattern, 1)
    }

    /// As `start`, an NBD writer over `connections` connections (16 requests in flight on each).
    fn start_on(
        &self,
        user: &User,
        pattern: &Path,
        connections: u32,
    ) -> JoinHandle<Result<(), String>> {
        let (w, user, pattern) = (self.clone(), user.clone(), pattern.to_path_buf());
        std::thread::spawn(move || {
            for _ in 0..PASSES {
                match &w {
                    Writer::Nbd(uri) => nbd_pass(&user, uri, &pattern, connections)?,
                    Writer::File(file) => file_pass(&user, file, &pattern)?,
                }
            }
            Ok(())
        })
    }
}

fn nbd_pass(user: &User, uri: &str, pattern: &Path, connections: u32) -> Result<(), String> {
    let connections = format!("--connections={connections}");
    let args = [
        "--request-size=1048576",
        &connections,
        "--requests=16",
        "--flush",
        s(pattern),
        uri,
    ];
    let o = user.run("nbdcopy", &args);
    o.status.success().then_some(()).ok_or_else(|| text(&o))
}

fn file_pass(user: &User, file: &Path, pattern: &Path) -> Result<(), String> {
    let dds: Vec<_> = (0..DATA_MIB)
        .map(|mib| {
            let args = [
                format!("if={}", s(pattern)),
                format!("of={}", s(file)),
                "bs=1M".into(),
                format!("skip={mib}"),
                format!("seek={mib}"),
                "count=1".into(),
                "oflag=direct".into(),
                "conv=notrunc".into(),
                "status=none".into(),
            ];
            let user = user.clone();
            std::thread::spawn(move || {
                let a: Vec<&str> = args.iter().map(String::as_str).collect();
                user.run("dd", &a)
            })
        })
        .collect();
    // Every dd is joined before an error is returned: none outlives the pass.
    let outputs: Vec<Output> = dds.into_iter().map(|d| d.join().unwrap()).collect();
    match outputs.iter().find(|o| !o.status.success()) {
        Some(o) => Err(text(o)),
        None => Ok(()),
    }
}

/// Waits until none of `pids` holds a charge in the budget file: their pools went idle and
/// gave their memory back (`ucrypt::pool::POOL_IDLE_RELEASE` after their last request).
fn wait_refunded(pids: &[u32], file: &Path) {
    let t0 = Instant::now();
    while pids
        .iter()
        .any(|p| budget_charges(file).get(p).is_some_and(|&c| c > 0))
    {
        assert!(
            t0.elapsed() < REFUND_WAIT,
            "charges not refunded in time: {:?}",
            budget_charges(file)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The first `DATA_MIB` MiB of `path`, read with O_DIRECT (from the volume, not a cache).
fn read_direct(user: &User, path: &Path) -> Vec<u8> {
    let args = [
        format!("if={}", s(path)),
        "bs=1M".into(),
        format!("count={DATA_MIB}"),
        "iflag=direct".into(),
        "status=none".into(),
    ];
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    user.ok("dd", &a).stdout
}

/// `ucrypt open IMG NAME --front-end fuse --nbd unix:SOCK --memory-budget B`: its NBD URI.
fn open_budgeted(
    user: &User,
    img: &Path,
    key: &Path,
    name: &str,
    sock: &Path,
    budget: u64,
) -> String {
    let budget_arg = budget.to_string();
    let o = user.run(
        UCRYPT,
        &[
            "open",
            s(img),
            name,
            "--key-file",
            s(key),
            "--front-end",
            "fuse",
            "--memory-budget",
            &budget_arg,
            // Planned writes take pool grants (an inline write is encrypted in the
            // caller's buffer and takes none).
            "--policy",
            "parallel",
            "--nbd",
            &format!("unix:{}", s(sock)),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "open {name}: {}", text(&o));
    format!("nbd+unix:///{name}?socket={}", s(sock))
}

/// The pid of the daemon of the open volume `name`.
fn daemon_pid(user: &User, name: &str) -> u32 {
    status_field(user, name, "pid")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in the status of {name}"))
}

struct Open {
    user: User,
    names: Vec<String>,
}

impl Drop for Open {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = self.user.run(UCRYPT, &["close", n]);
        }
    }
}

/// A server in the foreground (`serve`, `mount`): asked to stop with SIGTERM when dropped,
/// killed if it has not stopped within `READY_WAIT`.
struct Foreground(Child);

impl Foreground {
    /// Starts `ucrypt ARGS` as `user` and waits until `ready` holds.
    fn start(user: &User, args: &[&str], ready: impl Fn() -> bool) -> Foreground {
        let child = user
            .command(UCRYPT)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn ucrypt");
        let mut f = Foreground(child);
        let t0 = Instant::now();
        while !ready() {
            if let Ok(Some(st)) = f.0.try_wait() {
                panic!("ucrypt {args:?} ended before it was ready: {st}");
            }
            assert!(
                t0.elapsed() < READY_WAIT,
                "ucrypt {args:?} not ready in time"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        f
    }

    /// Stops it and returns its exit code.
    fn stop(mut self) -> Option<i32> {
        terminate(self.0.id());
        wait_timeout(&mut self.0, READY_WAIT)
    }
}

impl Drop for Foreground {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            terminate(self.0.id());
            if wait_timeout(&mut self.0, READY_WAIT).is_none() {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
    }
}

#[test]
fn volumes_under_one_budget_wait_and_never_fail() {
    if let Some(why) = skip_reason() {
        println!("SKIPPED: {why}");
        return;
    }
    let _one = one_at_a_time();
    let n: usize = std::env::var("UCRYPT_BUDGET_VOLUMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let budget = std::env::var("UCRYPT_BUDGET_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n as u64 * BUDGET_PER_VOLUME_BYTES);
    let t = TempDir::new("budget");
    let key = t.path("key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    let t0 = Instant::now();
    let user = User::Root;
    let mut open = Open {
        user: User::Root,
        names: Vec::new(),
    };
    let mut uris = Vec::new();
    for i in 0..n {
        let img = volume(&t, &key, &format!("v{i}.img"));
        let name = format!("budget-{i}-{}", std::process::id());
        let sock = t.path(&format!("nbd{i}.sock"));
        uris.push(open_budgeted(&user, &img, &key, &name, &sock, budget));
        open.names.push(name);
    }
    let opened_s = t0.elapsed().as_secs_f64();
    let pids: Vec<u32> = open.names.iter().map(|n| daemon_pid(&user, n)).collect();
    let patterns: Vec<PathBuf> = (0..n).map(|i| pattern(&t, i)).collect();
    let sampler = Sampler::start(pids, user.budget_file());
    let t1 = Instant::now();
    let writers: Vec<_> = (0..n)
        .map(|i| Writer::Nbd(uris[i].clone()).start(&user, &patterns[i]))
        .collect();
    for (i, w) in writers.into_iter().enumerate() {
        if let Err(e) = w.join().unwrap() {
            panic!("writer of volume {i}: {e}");
        }
    }
    let write_s = t1.elapsed().as_secs_f64();
    let peaks = sampler.finish();
    assert!(
        status_field(&user, &open.names[0], "budget").is_some(),
        "no budget line in the status of {}",
        open.names[0]
    );
    // Every acknowledged write reads back.
    for (i, name) in open.names.iter().enumerate() {
        let got = read_direct(&user, &user.state_dir().join(name).join("volume"));
        assert!(
            std::fs::read(&patterns[i]).unwrap() == got,
            "volume {i} ({name}) does not read back what was written"
        );
    }
    let bound = budget + n as u64 * UNCHARGED_PER_VOLUME_BYTES;
    println!(
        "{n} volumes, budget {budget} bytes: opened in {opened_s:.1} s, {} MiB written in \
         {write_s:.1} s; peak VmLck of all daemons {} bytes (bound {bound}), peak charged \
         {} bytes",
        n as u64 * DATA_MIB * PASSES as u64,
        peaks.locked,
        peaks.charged
    );
    assert!(
        peaks.charged <= budget,
        "charged {} > budget {budget}",
        peaks.charged
    );
    assert!(peaks.locked <= bound, "locked {} > {bound}", peaks.locked);
}

/// An `open`ed volume, a `serve` and a `mount`, run by one user with one budget.
struct Fronts {
    open: Open,
    served: Foreground,
    mounted: Foreground,
    /// The open daemon's, serve's and mount's.
    pids: [u32; 3],
    /// How each volume is written and read back: the open daemon's and serve's NBD exports,
    /// mount's file.
    writers: [Writer; 3],
    /// serve's `--metrics` socket.
    metrics: PathBuf,
}

const FRONTS: [&str; 3] = ["open", "serve", "mount"];

/// Starts the three with the volumes `imgs`, each with `--memory-budget budget`.
fn start_fronts(user: &User, t: &TempDir, key: &Path, imgs: &[PathBuf], budget: u64) -> Fronts {
    let budget_arg = budget.to_string();
    let common = [
        "--key-file",
        s(key),
        "--memory-budget",
        &budget_arg,
        "--policy",
        "parallel",
    ];
    let name = format!("budget-open-{}", std::process::id());
    let open = Open {
        user: user.clone(),
        names: vec![name.clone()],
    };
    let open_uri = open_budgeted(user, &imgs[0], key, &name, &t.path("open.sock"), budget);
    let (sock, pid_file) = (t.path("serve.sock"), t.path("serve.pid"));
    let listen = format!("unix:{}", s(&sock));
    let metrics = t.path("serve.metrics");
    let metrics_at = format!("unix:{}", s(&metrics));
    let mut a = vec!["serve", s(&imgs[1]), "--nbd", &listen];
    a.extend(["--pid-file", s(&pid_file), "--metrics", &metrics_at]);
    a.extend(common);
    let served = Foreground::start(user, &a, || pid_file.exists());
    // A missing mount point becomes the volume's file; it has the volume's size once mounted
    // (stat as root: a rootless FUSE mount answers its own user only, so it fails until then).
    let file = t.path("mounted");
    let mut a = vec!["mount", s(&imgs[2]), s(&file), "--direct-io"];
    a.extend(common);
    let mounted = Foreground::start(user, &a, || {
        let size = user.run("stat", &["-c", "%s", s(&file)]);
        String::from_utf8_lossy(&size.stdout).trim() == (DATA_MIB << 20).to_string()
    });
    let pids = [daemon_pid(user, &name), served.0.id(), mounted.0.id()];
    let writers = [
        Writer::Nbd(open_uri),
        Writer::Nbd(format!("nbd+unix:///?socket={}", s(&sock))),
        Writer::File(file),
    ];
    Fronts {
        open,
        served,
        mounted,
        pids,
        writers,
        metrics,
    }
}

/// Writes the three volumes at once, then alone each one whose process the sampler saw
/// charge nothing: the peaks, and which wrote alone.
fn write_fronts(f: &Fronts, user: &User, patterns: &[PathBuf]) -> (Peaks, Vec<&'static str>) {
    let sampler = Sampler::start(f.pids.to_vec(), user.budget_file());
    // All at once: the budget is less than what they would take, so they wait for it.
    let running: Vec<_> = (0..3)
        .map(|i| f.writers[i].start(user, &patterns[i]))
        .collect();
    for (w, what) in running.into_iter().zip(FRONTS) {
        if let Err(e) = w.join().unwrap() {
            panic!("writer of the {what} volume: {e}");
        }
    }
    // A pool keeps what it charged until it goes idle, so the first to grow may have held the
    // whole budget while the others waited within their reserves: once every charge is
    // refunded, each of those writes alone, and charges the same file.
    // How many grants a pool holds at once depends on how its requests overlap, which a loaded
    // host changes: alone, a volume is written with more requests at once (NBD over
    // ALONE_CONNECTIONS), up to ALONE_TRIES times until its process charged.
    let mut alone = Vec::new();
    for i in 0..3 {
        for _ in 0..ALONE_TRIES {
            if sampler.charged_by(f.pids[i]) > 0 {
                break;
            }
            wait_refunded(&f.pids, &user.budget_file());
            let w = f.writers[i].start_on(user, &patterns[i], ALONE_CONNECTIONS);
            if let Err(e) = w.join().unwrap() {
                panic!("writer of the {} volume, alone: {e}", FRONTS[i]);
            }
            alone.push(FRONTS[i]);
        }
    }
    (sampler.finish(), alone)
}

/// What `--memory-budget` promises `open`, `serve` and `mount` run by `user` together (see
/// the module documentation).
fn fronts_share_one_budget(user: &User, t: &TempDir) {
    let budget = std::env::var("UCRYPT_BUDGET_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FRONT_ENDS_BUDGET_BYTES);
    let key = t.path("key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    let imgs: Vec<PathBuf> = (0..3)
        .map(|i| volume(t, &key, &format!("v{i}.img")))
        .collect();
    let patterns: Vec<PathBuf> = (0..3).map(|i| pattern(t, i)).collect();
    user.own(t.dir());
    let f = start_fronts(user, t, &key, &imgs, budget);
    let (peaks, alone) = write_fronts(&f, user, &patterns);
    // Every acknowledged write reads back, each through the front end that wrote it.
    let name = &f.open.names[0];
    let (Writer::Nbd(serve_uri), Writer::File(file)) = (&f.writers[1], &f.writers[2]) else {
        unreachable!("serve is written over NBD, mount through its file")
    };
    let back = [
        read_direct(user, &user.state_dir().join(name).join("volume")),
        user.ok("nbdcopy", &[serve_uri, "-"]).stdout,
        read_direct(user, file),
    ];
    for (i, (got, what)) in back.iter().zip(FRONTS).enumerate() {
        assert!(
            std::fs::read(&patterns[i]).unwrap() == *got,
            "the {what} volume does not read back what was written"
        );
    }
    // The budget is in serve's metrics as in an open daemon's status.
    let scraped = scrape_unix(&f.metrics);
    assert!(
        scraped
            .lines()
            .any(|l| l == format!("ucrypt_memory_budget_bytes {budget}")),
        "serve's metrics lack the budget:\n{scraped}"
    );
    for counter in ["refused_charges", "forced_charges"] {
        assert!(
            (scraped.lines()).any(|l| l.starts_with(&format!("ucrypt_memory_budget_{counter}"))),
            "serve's metrics lack {counter}:\n{scraped}"
        );
    }
    assert!(
        status_field(user, name, "budget")
            .is_some_and(|b| b.starts_with(&format!("{budget} bytes"))),
        "no budget line in the status of {name}"
    );
    let bound = budget + 3 * UNCHARGED_PER_VOLUME_BYTES;
    println!(
        "open, serve and mount under a budget of {budget} bytes in {}: peak charged {} bytes, \
         by each (pid: bytes) {:?}, written again alone after the others' charges were \
         refunded: {alone:?}; peak VmLck of the three {} bytes (bound {bound})",
        user.budget_file().display(),
        peaks.charged,
        peaks.charged_by,
        peaks.locked
    );
    for (pid, what) in f.pids.iter().zip(FRONTS) {
        let c = peaks.charged_by.get(pid).copied().unwrap_or(0);
        assert!(
            c > 0,
            "the {what} process ({pid}) charged nothing: {peaks:?}"
        );
    }
    assert!(
        peaks.charged <= budget,
        "charged {} > budget {budget}",
        peaks.charged
    );
    assert!(peaks.locked <= bound, "locked {} > {bound}", peaks.locked);
    assert_eq!(f.served.stop(), Some(0), "serve did not stop cleanly");
    assert_eq!(f.mounted.stop(), Some(0), "mount did not stop cleanly");
}

#[test]
fn serve_mount_and_open_share_one_budget() {
    if let Some(why) = skip_reason() {
        println!("SKIPPED: {why}");
        return;
    }
    let _one = one_at_a_time();
    fronts_share_one_budget(&User::Root, &TempDir::new("budget-fronts"));
}

/// The same as user nobody: rootless `open` (FUSE file), `serve` and `mount` share the
/// budget file of the user's own state directory.
#[test]
fn rootless_serve_mount_and_open_share_one_budget() {
    if let Some(why) = skip_reason() {
        println!("SKIPPED: {why} (to switch to user nobody)");
        return;
    }
    if !have("setpriv") || !have("fusermount3") {
        println!("SKIPPED: needs setpriv and fusermount3 (fuse3)");
        return;
    }
    let t = TempDir::new("budget-rootless");
    // The user reaches the files through the temp dir (root's, 0700 or 0755).
    std::fs::set_permissions(t.dir(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let xdg = t.path("xdg");
    std::fs::create_dir(&xdg).unwrap();
    std::fs::set_permissions(&xdg, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let user = User::Nobody { xdg };
    if !user.run(UCRYPT, &["--version"]).status.success() {
        println!("SKIPPED: user nobody cannot run {UCRYPT}");
        return;
    }
    fronts_share_one_budget(&user, &t);
}

/// `ublk --memory-budget`: a size below one buffer chunk is refused as `open` refuses it (same
/// exit code, same words), and a valid one is taken: the process opens the volume and reaches
/// the device (with ublk_drv it takes a slot in the budget file while it serves; without, it
/// fails for want of the driver, not of the option).
#[test]
fn ublk_takes_the_budget_as_open_does() {
    let t = TempDir::new("budget-ublk");
    let key = t.path("key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    let img = volume(&t, &key, "v.img");
    let refused = |verb: &[&str]| {
        let mut a = verb.to_vec();
        a.extend(["--key-file", s(&key), "--memory-budget", "1k"]);
        let o = run(UCRYPT, &a);
        (o.status.code(), stderr_line(&o, "memory budget"))
    };
    let by_open = refused(&["open", s(&img), "budget-ublk-never"]);
    assert_eq!(by_open.0, Some(1), "open --memory-budget 1k: {by_open:?}");
    assert!(by_open.1.is_some(), "open --memory-budget 1k: {by_open:?}");
    assert_eq!(
        refused(&["ublk", s(&img)]),
        by_open,
        "ublk --memory-budget 1k"
    );
    if !is_root() {
        println!("SKIPPED: ublk with a valid budget: needs root (root's state directory)");
        return;
    }
    let _one = one_at_a_time();
    let args = [
        "ublk",
        s(&img),
        "--key-file",
        s(&key),
        "--memory-budget",
        "1M",
    ];
    if !Path::new("/dev/ublk-control").exists() {
        let o = run(UCRYPT, &args);
        assert!(
            o.status.code() == Some(1) && text(&o).contains("/dev/ublk-control"),
            "ublk --memory-budget 1M without ublk_drv: {}",
            text(&o)
        );
        println!("SKIPPED: serving under the budget with ublk: no /dev/ublk-control (ublk_drv)");
        return;
    }
    let mut child = Command::new(UCRYPT)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn ucrypt ublk");
    let pid = child.id();
    let t0 = Instant::now();
    let file = User::Root.budget_file();
    while !budget_charges(&file).contains_key(&pid) && t0.elapsed() < READY_WAIT {
        std::thread::sleep(Duration::from_millis(20));
    }
    let joined = budget_charges(&file).contains_key(&pid);
    terminate(pid);
    let code = wait_timeout(&mut child, READY_WAIT);
    if code.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(joined, "ublk ({pid}) took no slot in {}", file.display());
    assert_eq!(code, Some(0), "ublk did not stop cleanly");
}

/// The Prometheus text of a `--metrics unix:PATH` endpoint.
fn scrape_unix(path: &Path) -> String {
    use std::io::{Read, Write};
    let mut c = std::os::unix::net::UnixStream::connect(path).expect("connect to metrics");
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("request");
    let mut out = String::new();
    c.read_to_string(&mut out).expect("response");
    let (head, body) = out.split_once("\r\n\r\n").expect("HTTP head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The first line of `o`'s stderr that contains `word`.
fn stderr_line(o: &Output, word: &str) -> Option<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .find(|l| l.contains(word))
        .map(str::to_string)
}
