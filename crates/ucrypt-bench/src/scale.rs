//! `ucrypt bench scale`: what many open volumes cost one host, and whether reading several at
//! once adds up. As root, for each N of `--volumes` (default 1, 10, 100): N small LUKS2 volumes
//! (cheap PBKDF2, so opening measures ucrypt and not the KDF) opened with `ucrypt open ...
//! --front-end fuse`, one daemon each: the time to open them all, the daemons' total
//! `RssAnon`, `VmLck` and threads (`/proc/PID/status`, PIDs from the state directory),
//! `ucrypt list` and `ucrypt status NAME` wall times, and the time to close them all. Beside
//! them, where installed, qemu-storage-daemon with the same N exports in one process (FUSE
//! exports of its `luks` driver, on LUKS1 volumes: it reads no LUKS2) and that process's
//! memory.
//!
//! With the largest N open: fio 4 KiB random O_DIRECT reads at QD1 on 1, 10 and 100 of the
//! volumes at once (one fio thread per volume), per server: the aggregate IOPS ÷ (that run's
//! single-volume IOPS × min(active volumes, cores)), goal ≥ 0.9, and each volume's p99 beside
//! the single volume's. Round-robin over servers and active counts; medians over `--runs`.
//!
//! Host limits: the benchmark raises its soft RLIMIT_NOFILE (which the daemons, fio and
//! qemu-storage-daemon inherit) to what N volumes need, up to the hard limit, and reports the
//! result. Non-root users opening many FUSE volumes also meet fusermount's `mount_max`
//! (`/etc/fuse.conf`, default 1,000); this scenario runs as root, where it does not apply.
//!
//! Everything it opened is closed on the way out, on error too (the fleets close on drop), and
//! on SIGINT, SIGTERM or SIGHUP (caught; the run stops at the next step and cleans up).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::cmd::{have, run_ok};
use super::fio::{self, FioResult, Job};
use super::interrupt::{self, check};
use super::stats::{Machine, Summary};

const READ_QD1: Job = Job::new("4k randread psync QD1", "randread", 4096, "psync", 1);
/// Plaintext bytes fio reads of each volume (from offset 0).
const REGION_BYTES: u64 = 16 << 20;
/// The LUKS2 keyslots area, bytes: room for one 512-bit key's PBKDF2 keyslot (258,048 bytes
/// of anti-forensic stripes). The default (16 MiB less the metadata) is written whole at
/// format, so a thousand default headers would fill 16 GB of RAM; the area's size changes
/// nothing an open daemon holds.
const LUKS2_KEYSLOTS_BYTES: u64 = 512 << 10;
/// Each LUKS2 image: the header (two 16 KiB metadata copies and the keyslots area, data from
/// 1 MiB) and the region. Sparse, so N of them cost only what the headers wrote.
const LUKS2_IMAGE_BYTES: u64 = (1 << 20) + REGION_BYTES;
/// Each LUKS1 image: cryptsetup's 2 MiB payload offset and the region.
const LUKS1_IMAGE_BYTES: u64 = (2 << 20) + REGION_BYTES;
/// How many volumes are read at once (those up to the largest N).
const ACTIVE: &[usize] = &[1, 10, 100];
/// Aggregate IOPS ÷ (single-volume IOPS × min(active, cores)) the issue asks for.
pub const SCALING_GOAL: f64 = 0.9;
/// `ucrypt status NAME` calls timed per run (spread over the open volumes).
const STATUS_SAMPLES: usize = 5;
/// Descriptors per volume the processes of a run may hold: qemu-storage-daemon's image and
/// /dev/fuse per export, fio's file and slack.
const FDS_PER_VOLUME: u64 = 4;
/// Descriptors for everything else.
const FDS_OTHER: u64 = 256;
/// How long qemu-storage-daemon may take to show its exports: this plus a tenth of a second
/// per export.
const MOUNT_WAIT_BASE: Duration = Duration::from_secs(20);
/// How long a stopped qemu-storage-daemon may take to exit before it is killed.
const EXIT_WAIT: Duration = Duration::from_secs(30);
/// How long the daemons sit after opening before their memory is read.
const SETTLE: Duration = Duration::from_secs(2);
const PASSPHRASE: &str = "ucrypt-bench-scale";
/// Root's state directory of open volumes (crates/ucrypt-cli/src/daemon/state.rs).
const RUN_DIR: &str = "/run/ucrypt";
/// Root's stable names of open volumes.
const DEV_DIR: &str = "/dev/ucrypt";

/// The two servers, as rows name them.
pub const UCRYPT: &str = "ucrypt open --front-end fuse (a daemon per volume)";
pub const QSD: &str = "qemu-storage-daemon luks, FUSE exports (one process)";

/// One N: what opening N volumes cost with one server.
#[derive(Serialize)]
pub struct FleetRow {
    pub server: &'static str,
    pub volumes: usize,
    /// Server processes serving them.
    pub processes: usize,
    /// Wall time from the first open to the last volume served, seconds.
    pub open_all_s: f64,
    /// Sum over the server processes, idle after opening, kB (`RssAnon`, `VmLck`).
    pub rss_anon_kb: f64,
    pub rss_anon_kb_per_volume: f64,
    pub locked_kb: f64,
    pub threads: f64,
    /// `ucrypt list` wall time, ms (ucrypt only).
    pub list_ms: Summary,
    /// `ucrypt status NAME` wall time, ms (ucrypt only).
    pub status_ms: Summary,
    /// Wall time to close all N (ucrypt: `ucrypt close` each; qsd: SIGTERM until exit), s.
    pub close_all_s: f64,
}

/// Reading `active_volumes` of `open_volumes` at once.
#[derive(Serialize)]
pub struct ReadRow {
    pub job: Job,
    pub server: &'static str,
    pub open_volumes: usize,
    pub active_volumes: usize,
    /// Sum over the active volumes, per run.
    pub aggregate_iops: Summary,
    /// aggregate ÷ (the same run's single-volume IOPS × min(active, cores)).
    pub scaling: Summary,
    /// `scaling` median ≥ [`SCALING_GOAL`].
    pub met: bool,
    /// Per run: the median over the active volumes of each volume's p99 completion latency.
    pub lat_p99_us: Summary,
    /// Per run: the largest p99 of any active volume.
    pub lat_p99_us_worst: Summary,
    /// The single-volume p99 of the same runs.
    pub single_lat_p99_us: Summary,
}

#[derive(Serialize)]
pub struct ScaleReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub runs: usize,
    pub quick: bool,
    pub runtime_s: f64,
    /// The soft RLIMIT_NOFILE the run had after raising it, and what it wanted.
    pub nofile_soft: u64,
    pub nofile_wanted: u64,
    pub skipped: Vec<String>,
    pub notes: Vec<String>,
    pub fleets: Vec<FleetRow>,
    pub reads: Vec<ReadRow>,
}

/// The benchmark's files in /dev/shm (or `$TMPDIR`), removed on drop.
struct WorkDir {
    dir: PathBuf,
    pass: PathBuf,
}

impl WorkDir {
    fn new() -> Result<WorkDir, String> {
        let base = std::env::var_os("TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/dev/shm"));
        let dir = crate::disk::run_dir(&base, "scale")?;
        let pass = dir.join("pass");
        let w = WorkDir { dir, pass };
        std::fs::write(&w.pass, PASSPHRASE).map_err(|e| e.to_string())?;
        Ok(w)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Raises the soft RLIMIT_NOFILE towards `want`, up to the hard limit: the soft limit now.
fn raise_nofile(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 0;
    }
    if lim.rlim_cur >= want {
        return lim.rlim_cur;
    }
    let new = libc::rlimit {
        rlim_cur: want.min(lim.rlim_max),
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads one rlimit from `new`, which lives across the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0 {
        new.rlim_cur
    } else {
        lim.rlim_cur
    }
}

/// `count` LUKS2 images formatted by `ucrypt format` (each its own UUID and keys), on `cores`
/// threads.
fn luks2_images(
    ucrypt: &Path,
    w: &WorkDir,
    count: usize,
    cores: usize,
) -> Result<Vec<PathBuf>, String> {
    let imgs: Vec<PathBuf> = (0..count)
        .map(|i| w.dir.join(format!("v{i}.img")))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let format_one = |img: &Path| -> Result<(), String> {
        File::create(img)
            .and_then(|f| f.set_len(LUKS2_IMAGE_BYTES))
            .map_err(|e| format!("{}: {e}", img.display()))?;
        run_ok(
            Command::new(ucrypt)
                .args(["format", "-q", "--type", "luks2", "--pbkdf", "pbkdf2"])
                .args(["--pbkdf-force-iterations", "1000", "--luks2-keyslots-size"])
                .arg(LUKS2_KEYSLOTS_BYTES.to_string())
                .arg("--key-file")
                .arg(&w.pass)
                .arg(img),
        )
        .map(drop)
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..cores.max(1))
            .map(|_| {
                s.spawn(|| -> Result<(), String> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= imgs.len() {
                            return Ok(());
                        }
                        check()?;
                        format_one(&imgs[i])?;
                    }
                })
            })
            .collect();
        workers.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err("a format thread panicked".to_string()))
        })
    })?;
    Ok(imgs)
}

/// `count` LUKS1 images for qemu-storage-daemon: one formatted by cryptsetup, copied (its
/// header's non-zero 4 KiB blocks only, so the copies stay sparse). The copies share a UUID
/// and a key, which qemu-storage-daemon does not look at.
fn luks1_images(w: &WorkDir, count: usize) -> Result<Vec<PathBuf>, String> {
    let template = w.dir.join("luks1-template.img");
    File::create(&template)
        .and_then(|f| f.set_len(LUKS1_IMAGE_BYTES))
        .map_err(|e| format!("{}: {e}", template.display()))?;
    run_ok(
        Command::new("cryptsetup")
            .args([
                "luksFormat",
                "--type",
                "luks1",
                "-q",
                "--cipher",
                "aes-xts-plain64",
            ])
            .args([
                "--key-size",
                "512",
                "--pbkdf-force-iterations",
                "1000",
                "--key-file",
            ])
            .arg(&w.pass)
            .arg(&template),
    )?;
    let mut header = vec![0u8; (LUKS1_IMAGE_BYTES - REGION_BYTES) as usize];
    File::open(&template)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(|e| format!("{}: {e}", template.display()))?;
    let mut imgs = Vec::with_capacity(count);
    for i in 0..count {
        check()?;
        let img = w.dir.join(format!("l{i}.img"));
        let f = File::create(&img).map_err(|e| format!("{}: {e}", img.display()))?;
        f.set_len(LUKS1_IMAGE_BYTES)
            .map_err(|e| format!("{}: {e}", img.display()))?;
        for (b, block) in header.chunks(4096).enumerate() {
            if block.iter().any(|&x| x != 0) {
                f.write_all_at(block, b as u64 * 4096)
                    .map_err(|e| format!("{}: {e}", img.display()))?;
            }
        }
        imgs.push(img);
    }
    Ok(imgs)
}

/// Memory and threads of a set of processes, from `/proc/PID/status`.
#[derive(Default)]
struct ProcTotals {
    rss_anon_kb: u64,
    locked_kb: u64,
    threads: u64,
}

fn proc_totals(pids: &[libc::pid_t]) -> Result<ProcTotals, String> {
    let mut t = ProcTotals::default();
    for &pid in pids {
        let path = format!("/proc/{pid}/status");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        let field = |name: &str| -> Result<u64, String> {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{path} has no {name}"))
        };
        t.rss_anon_kb += field("RssAnon:")?;
        t.locked_kb += field("VmLck:")?;
        t.threads += field("Threads:")?;
    }
    Ok(t)
}

/// Runs `cmd`, which must succeed: its wall time (s) and stdout.
fn timed(cmd: &mut Command) -> Result<(f64, String), String> {
    let t = Instant::now();
    let out = run_ok(cmd)?;
    Ok((t.elapsed().as_secs_f64(), out))
}

/// N volumes opened by `ucrypt open`, a daemon each; those still open are closed on drop.
struct UcryptFleet {
    ucrypt: PathBuf,
    prefix: String,
    names: Vec<String>,
}

impl UcryptFleet {
    /// Opens every image in turn (as a user would type it): the fleet and the wall time.
    fn open(
        ucrypt: &Path,
        prefix: &str,
        imgs: &[PathBuf],
        pass: &Path,
    ) -> Result<(UcryptFleet, f64), String> {
        let mut f = UcryptFleet {
            ucrypt: ucrypt.to_path_buf(),
            prefix: prefix.to_owned(),
            names: Vec::with_capacity(imgs.len()),
        };
        let t = Instant::now();
        for (i, img) in imgs.iter().enumerate() {
            check()?;
            let name = format!("{prefix}{i}");
            // Named before it opens: a half-done open is closed too.
            f.names.push(name.clone());
            run_ok(
                Command::new(ucrypt)
                    .arg("open")
                    .arg(img)
                    .arg(&name)
                    .arg("--key-file")
                    .arg(pass)
                    .args(["--front-end", "fuse"]),
            )?;
        }
        Ok((f, t.elapsed().as_secs_f64()))
    }

    /// The volumes' decrypted files (their stable names).
    fn files(&self) -> Vec<PathBuf> {
        self.names
            .iter()
            .map(|n| Path::new(DEV_DIR).join(n))
            .collect()
    }

    fn pids(&self) -> Result<Vec<libc::pid_t>, String> {
        self.names
            .iter()
            .map(|n| {
                let p = Path::new(RUN_DIR).join(n).join("pid");
                std::fs::read_to_string(&p)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .ok_or_else(|| format!("no daemon pid in {}", p.display()))
            })
            .collect()
    }

    /// `ucrypt list`: its wall time (s), after checking it lists every volume as active.
    fn time_list(&self) -> Result<f64, String> {
        let (s, out) = timed(Command::new(&self.ucrypt).arg("list"))?;
        let ours: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with(&self.prefix))
            .collect();
        if ours.len() != self.names.len() || !ours.iter().all(|l| l.ends_with(" active")) {
            return Err(format!(
                "ucrypt list shows {} of {} volumes active: {}",
                ours.iter().filter(|l| l.ends_with(" active")).count(),
                self.names.len(),
                ours.first().unwrap_or(&"")
            ));
        }
        Ok(s)
    }

    /// `ucrypt status NAME` of volume `i`: its wall time (s).
    fn time_status(&self, i: usize) -> Result<f64, String> {
        let (s, out) = timed(Command::new(&self.ucrypt).arg("status").arg(&self.names[i]))?;
        if !out.contains("is active") {
            return Err(format!("ucrypt status {}: {out}", self.names[i]));
        }
        Ok(s)
    }

    /// Closes every volume (`ucrypt close`), last opened first: the wall time (s). Then checks
    /// that nothing is left: no state directory, no stable name, no FUSE mount.
    fn close_all(&mut self) -> Result<f64, String> {
        let t = Instant::now();
        let mut first_err = None;
        while let Some(n) = self.names.pop() {
            if let Err(e) = run_ok(Command::new(&self.ucrypt).arg("close").arg(&n)) {
                first_err.get_or_insert(e);
            }
        }
        let s = t.elapsed().as_secs_f64();
        if let Some(e) = first_err {
            return Err(e);
        }
        let left = leftovers(&self.prefix);
        if !left.is_empty() {
            return Err(format!("left after closing: {}", left.join(", ")));
        }
        Ok(s)
    }
}

impl Drop for UcryptFleet {
    fn drop(&mut self) {
        while let Some(n) = self.names.pop() {
            let _ = Command::new(&self.ucrypt)
                .arg("close")
                .arg(&n)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// What of volumes named `prefix...` is still there: state directories, stable names, mounts.
fn leftovers(prefix: &str) -> Vec<String> {
    let mut left = Vec::new();
    for dir in [RUN_DIR, DEV_DIR] {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with(prefix) {
                    left.push(e.path().display().to_string());
                }
            }
        }
    }
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    left.extend(
        mounts
            .lines()
            .filter(|l| l.starts_with(&format!("ucrypt:{prefix}")))
            .map(|l| format!("mount {}", l.split(' ').nth(1).unwrap_or("?"))),
    );
    left
}

/// One qemu-storage-daemon serving N LUKS1 images as FUSE exports; stopped on drop.
struct QsdFleet {
    child: Child,
    mounts: Vec<PathBuf>,
}

impl QsdFleet {
    /// Starts it and waits until every export is mounted: the fleet and the wall time (s).
    fn start(imgs: &[PathBuf], w: &WorkDir) -> Result<(QsdFleet, f64), String> {
        let mut cmd = Command::new("qemu-storage-daemon");
        cmd.arg("--object")
            .arg(format!("secret,id=s0,file={}", w.pass.display()));
        let mut mounts = Vec::with_capacity(imgs.len());
        for (i, img) in imgs.iter().enumerate() {
            let m = w.dir.join(format!("qsd{i}"));
            File::create(&m).map_err(|e| format!("{}: {e}", m.display()))?;
            cmd.arg("--blockdev").arg(format!(
                "driver=file,node-name=f{i},filename={}",
                img.display()
            ));
            cmd.arg("--blockdev").arg(format!(
                "driver=luks,node-name=l{i},file=f{i},key-secret=s0"
            ));
            cmd.arg("--export").arg(format!(
                "type=fuse,id=e{i},node-name=l{i},mountpoint={},writable=on",
                m.display()
            ));
            mounts.push(m);
        }
        let log = w.dir.join("qsd.log");
        let t = Instant::now();
        let child = crate::server::spawn_logged(&mut cmd, &log, "qemu-storage-daemon")?;
        let mut f = QsdFleet { child, mounts };
        let wait = MOUNT_WAIT_BASE + Duration::from_millis(100) * imgs.len() as u32;
        let mut ready = 0;
        while ready < f.mounts.len() {
            check()?;
            if let Ok(Some(st)) = f.child.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("qemu-storage-daemon exited ({st}): {}", log.trim()));
            }
            if t.elapsed() > wait {
                return Err(format!(
                    "qemu-storage-daemon showed {ready} of {} exports within {wait:?}",
                    f.mounts.len()
                ));
            }
            // A mounted export has the volume's size; the empty mount point before has none.
            if std::fs::metadata(&f.mounts[ready]).is_ok_and(|m| m.len() > 0) {
                ready += 1;
            } else {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok((f, t.elapsed().as_secs_f64()))
    }

    fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    /// SIGTERM, then waits (SIGKILL after [`EXIT_WAIT`]): the wall time to exit (s).
    fn stop(&mut self) -> f64 {
        let t = Instant::now();
        if let Ok(Some(_)) = self.child.try_wait() {
            return 0.0;
        }
        // SAFETY: kill(2) on our own child's pid, reserved until it is reaped below.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        while t.elapsed() < EXIT_WAIT {
            if let Ok(Some(_)) = self.child.try_wait() {
                return t.elapsed().as_secs_f64();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Its FUSE mounts go with it; unmount any the kernel kept (a killed server's).
        for m in &self.mounts {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(m)
                .stderr(Stdio::null())
                .status();
        }
        t.elapsed().as_secs_f64()
    }
}

impl Drop for QsdFleet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// ms of a list of seconds.
fn ms(s: &[f64]) -> Summary {
    Summary::of(&s.iter().map(|x| x * 1000.0).collect::<Vec<_>>())
}

/// One N with ucrypt: the row, and the fleet still open when `keep`.
fn ucrypt_fleet(
    ucrypt: &Path,
    imgs: &[PathBuf],
    w: &WorkDir,
    runs: usize,
    keep: bool,
    progress: bool,
) -> Result<(FleetRow, Option<UcryptFleet>), String> {
    let n = imgs.len();
    if progress {
        eprintln!("bench scale: ucrypt: opening {n} volumes");
    }
    let prefix = format!("scale{}-", std::process::id());
    let (mut fleet, open_all_s) = UcryptFleet::open(ucrypt, &prefix, imgs, &w.pass)?;
    std::thread::sleep(SETTLE);
    let p = proc_totals(&fleet.pids()?)?;
    let (mut list, mut status) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        check()?;
        list.push(fleet.time_list()?);
        for k in 0..STATUS_SAMPLES.min(n) {
            status.push(fleet.time_status(k * n / STATUS_SAMPLES.min(n))?);
        }
    }
    let close_all_s = if keep {
        f64::NAN
    } else {
        if progress {
            eprintln!("bench scale: ucrypt: closing {n} volumes");
        }
        fleet.close_all()?
    };
    let row = FleetRow {
        server: UCRYPT,
        volumes: n,
        processes: n,
        open_all_s,
        rss_anon_kb: p.rss_anon_kb as f64,
        rss_anon_kb_per_volume: p.rss_anon_kb as f64 / n as f64,
        locked_kb: p.locked_kb as f64,
        threads: p.threads as f64,
        list_ms: ms(&list),
        status_ms: ms(&status),
        close_all_s,
    };
    Ok((row, keep.then_some(fleet)))
}

/// One N with qemu-storage-daemon: the row, and the server still running when `keep`.
fn qsd_fleet(
    imgs: &[PathBuf],
    w: &WorkDir,
    keep: bool,
    progress: bool,
) -> Result<(FleetRow, Option<QsdFleet>), String> {
    let n = imgs.len();
    if progress {
        eprintln!("bench scale: qemu-storage-daemon: {n} exports");
    }
    let (mut fleet, open_all_s) = QsdFleet::start(imgs, w)?;
    std::thread::sleep(SETTLE);
    let p = proc_totals(&[fleet.pid()])?;
    let close_all_s = if keep { f64::NAN } else { fleet.stop() };
    let row = FleetRow {
        server: QSD,
        volumes: n,
        processes: 1,
        open_all_s,
        rss_anon_kb: p.rss_anon_kb as f64,
        rss_anon_kb_per_volume: p.rss_anon_kb as f64 / n as f64,
        locked_kb: p.locked_kb as f64,
        threads: p.threads as f64,
        list_ms: Summary::of(&[]),
        status_ms: Summary::of(&[]),
        close_all_s,
    };
    Ok((row, keep.then_some(fleet)))
}

/// The fio part: `files[s]` are server `s`'s open volumes. Round-robin over servers and
/// active counts, `runs` times.
fn reads(
    servers: &[(&'static str, Vec<PathBuf>)],
    runs: usize,
    runtime: Duration,
    cores: usize,
    progress: bool,
) -> Result<Vec<ReadRow>, String> {
    let open = servers.first().map_or(0, |s| s.1.len());
    let active: Vec<usize> = ACTIVE.iter().copied().filter(|&a| a <= open).collect();
    let ramp = runtime / 4;
    // samples[server][active][run]: each volume's result.
    let mut samples = vec![vec![Vec::<Vec<FioResult>>::new(); active.len()]; servers.len()];
    for run in 0..runs {
        for (si, (name, files)) in servers.iter().enumerate() {
            for (ai, &a) in active.iter().enumerate() {
                check()?;
                if progress {
                    eprintln!("bench scale: run {}/{runs}: {name}: {a} at once", run + 1);
                }
                let r = fio::run_each(&READ_QD1, &files[..a], REGION_BYTES, runtime, ramp)?;
                samples[si][ai].push(r);
            }
        }
    }
    let mut rows = Vec::new();
    for (si, (name, _)) in servers.iter().enumerate() {
        let single = &samples[si][0];
        for (ai, &a) in active.iter().enumerate() {
            let per_run = &samples[si][ai];
            let agg: Vec<f64> = per_run
                .iter()
                .map(|r| r.iter().map(|x| x.iops).sum())
                .collect();
            let scaling: Vec<f64> = agg
                .iter()
                .zip(single)
                .map(|(g, s1)| g / (s1[0].iops * a.min(cores) as f64))
                .collect();
            let p99 = |pick: fn(&[f64]) -> f64| -> Summary {
                Summary::of(
                    &per_run
                        .iter()
                        .map(|r| pick(&r.iter().map(|x| x.lat_p99_us).collect::<Vec<_>>()))
                        .collect::<Vec<_>>(),
                )
            };
            let scaling = Summary::of(&scaling);
            rows.push(ReadRow {
                job: READ_QD1,
                server: name,
                open_volumes: open,
                active_volumes: a,
                aggregate_iops: Summary::of(&agg),
                met: scaling.median >= SCALING_GOAL,
                scaling,
                lat_p99_us: p99(|v| Summary::of(v).median),
                lat_p99_us_worst: p99(|v| v.iter().copied().fold(f64::NAN, f64::max)),
                single_lat_p99_us: Summary::of(
                    &single.iter().map(|r| r[0].lat_p99_us).collect::<Vec<_>>(),
                ),
            });
        }
    }
    Ok(rows)
}

pub fn measure(
    runs: usize,
    quick: bool,
    progress: bool,
    volumes: &[u32],
) -> Result<ScaleReport, String> {
    // SAFETY: geteuid only reads the process's credentials.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (FUSE volumes at /dev/ucrypt/NAME, one daemon each)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Err("no /dev/fuse (modprobe fuse)".into());
    }
    interrupt::catch_signals();
    let ucrypt = crate::ucrypt_bin()?;
    let machine = Machine::detect();
    let cores = machine.cores;
    let mut ns: Vec<usize> = volumes.iter().map(|&n| n as usize).collect();
    ns.sort_unstable();
    ns.dedup();
    let max_n = *ns.last().ok_or("no --volumes given")?;
    let nofile_wanted = max_n as u64 * FDS_PER_VOLUME + FDS_OTHER;
    let nofile_soft = raise_nofile(nofile_wanted);
    let mut skipped = Vec::new();
    let mut notes = vec![format!(
        "RLIMIT_NOFILE: soft limit {nofile_soft} for {max_n} volumes (wanted {nofile_wanted})"
    )];
    if nofile_soft < nofile_wanted {
        notes.push(format!(
            "the hard RLIMIT_NOFILE is below {nofile_wanted}: raise it (ulimit -Hn, \
             LimitNOFILE= in systemd) if opening fails"
        ));
    }
    let has_qsd = have("qemu-storage-daemon");
    let has_cryptsetup = have("cryptsetup");
    if !has_qsd {
        skipped.push(format!(
            "{QSD}: SKIPPED: qemu-storage-daemon not installed (apt-get install \
             qemu-system-common)"
        ));
    } else if !has_cryptsetup {
        skipped.push(format!(
            "{QSD}: SKIPPED: cryptsetup (to format its LUKS1 volumes) not installed \
             (apt-get install cryptsetup-bin)"
        ));
    }
    let with_qsd = has_qsd && has_cryptsetup;
    let with_fio = have("fio");
    if !with_fio {
        skipped.push("reads: SKIPPED: fio not installed (apt-get install fio)".into());
    }
    let runtime = Duration::from_millis(if quick { 1000 } else { 3000 });

    let w = WorkDir::new()?;
    if progress {
        eprintln!("bench scale: formatting {max_n} LUKS2 volumes");
    }
    let luks2 = luks2_images(&ucrypt, &w, max_n, cores)?;
    let luks1 = if with_qsd {
        luks1_images(&w, max_n)?
    } else {
        Vec::new()
    };

    let mut fleets = Vec::new();
    let mut kept_ucrypt = None;
    let mut kept_qsd = None;
    for &n in &ns {
        let last = n == max_n;
        let (row, kept) = ucrypt_fleet(&ucrypt, &luks2[..n], &w, runs, last, progress)?;
        fleets.push(row);
        kept_ucrypt = kept;
        if with_qsd {
            let (row, kept) = qsd_fleet(&luks1[..n], &w, last, progress)?;
            fleets.push(row);
            kept_qsd = kept;
        }
    }

    let mut servers = Vec::new();
    if let Some(f) = &kept_ucrypt {
        servers.push((UCRYPT, f.files()));
    }
    if let Some(f) = &kept_qsd {
        servers.push((QSD, f.mounts.clone()));
    }
    let reads = if with_fio {
        reads(&servers, runs, runtime, cores, progress)?
    } else {
        Vec::new()
    };

    // Close the largest fleets, timed, into their rows.
    if let Some(mut f) = kept_ucrypt {
        if progress {
            eprintln!("bench scale: ucrypt: closing {max_n} volumes");
        }
        let s = f.close_all()?;
        if let Some(r) = fleets
            .iter_mut()
            .find(|r| r.server == UCRYPT && r.volumes == max_n)
        {
            r.close_all_s = s;
        }
    }
    if let Some(mut f) = kept_qsd {
        let s = f.stop();
        if let Some(r) = fleets
            .iter_mut()
            .find(|r| r.server == QSD && r.volumes == max_n)
        {
            r.close_all_s = s;
        }
    }
    notes.push(format!(
        "volumes: LUKS2 (ucrypt; a {} KiB keyslots area) and LUKS1 (qemu-storage-daemon), \
         aes-xts-plain64, PBKDF2 1000 iterations, {} MiB of data each, sparse images in {}",
        LUKS2_KEYSLOTS_BYTES >> 10,
        REGION_BYTES >> 20,
        w.dir
            .parent()
            .map_or("?".into(), |p| p.display().to_string())
    ));
    Ok(ScaleReport {
        schema: 1,
        machine,
        runs,
        quick,
        runtime_s: runtime.as_secs_f64(),
        nofile_soft,
        nofile_wanted,
        skipped,
        notes,
        fleets,
        reads,
    })
}

/// "1,234"
fn thousands(x: f64) -> String {
    if !x.is_finite() {
        return "–".into();
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::from(if x <= -0.5 { "-" } else { "" });
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn opt(s: &Summary, decimals: usize) -> String {
    if s.runs == 0 {
        "–".into()
    } else {
        s.show(decimals)
    }
}

pub fn markdown(r: &ScaleReport) -> String {
    let mut s = format!(
        "## ucrypt bench scale\n\nMachine: {}. {} runs.\n\n\
         Opening N volumes, idle after opening (sums over the server processes; list and \
         status in ms, median (min–max)):\n\n\
         | server | N | processes | open all, s | RssAnon kB | per volume kB | VmLck kB | \
         threads | `ucrypt list` ms | `ucrypt status` ms | close all, s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        r.machine.describe(),
        r.runs
    );
    for f in &r.fleets {
        s.push_str(&format!(
            "| {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {:.2} |\n",
            f.server,
            f.volumes,
            f.processes,
            f.open_all_s,
            thousands(f.rss_anon_kb),
            thousands(f.rss_anon_kb_per_volume),
            thousands(f.locked_kb),
            thousands(f.threads),
            opt(&f.list_ms, 1),
            opt(&f.status_ms, 1),
            f.close_all_s
        ));
    }
    if !r.reads.is_empty() {
        s.push_str(&format!(
            "\n{} on A of the open volumes at once ({} s each, fio thread per volume), \
             median (min–max); scaling = aggregate ÷ (single-volume IOPS × min(A, {} cores)), \
             goal ≥ {SCALING_GOAL}:\n\n\
             | server | open | A | aggregate IOPS | scaling | met | p99 µs, median volume | \
             p99 µs, worst volume | p99 µs, single volume |\n|---|---|---|---|---|---|---|---|---|\n",
            READ_QD1.name, r.runtime_s, r.machine.cores
        ));
        for x in &r.reads {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                x.server,
                x.open_volumes,
                x.active_volumes,
                x.aggregate_iops.show(0),
                x.scaling.show(2),
                if x.met { "yes" } else { "no" },
                x.lat_p99_us.show(0),
                x.lat_p99_us_worst.show(0),
                x.single_lat_p99_us.show(0)
            ));
        }
    }
    for n in &r.notes {
        s.push_str(&format!("\nNote: {n}\n"));
    }
    for sk in &r.skipped {
        s.push_str(&format!("\nSkipped: {sk}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_rows() {
        for (x, want) in [
            (0.0, "0"),
            (999.4, "999"),
            (1000.0, "1,000"),
            (1234567.0, "1,234,567"),
            (-1234.0, "-1,234"),
            (f64::NAN, "–"),
        ] {
            assert_eq!(thousands(x), want, "{x}");
        }
    }
}
