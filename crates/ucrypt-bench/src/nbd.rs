//! `ucrypt bench nbd`: ucrypt's NBD server beside qemu-storage-daemon's luks export and
//! nbdkit's luks filter, all measured by the same client (fio's nbd engine over unix sockets),
//! each on its own copy of the same image in RAM (/dev/shm, or `$TMPDIR` if set).
//!
//! Images (all files of [`IMAGE_BYTES`], AES-256-XTS with a 512-bit key, fast PBKDF2 so that
//! opening is not what is measured):
//! - LUKS2 by cryptsetup, 4096-byte encryption sectors (what cryptsetup picks on 4K-capable
//!   storage, given explicitly here): served by `ucrypt serve` with the inline policy (named
//!   explicitly) and with `--policy auto`, each from its own copy.
//! - LUKS1 by cryptsetup (512-byte sectors, the only kind LUKS1 has): one copy each for ucrypt,
//!   qemu-storage-daemon (`--blockdev driver=luks`) and nbdkit (`--filter=luks`), the two
//!   peers that read LUKS1 only.
//! - A plain file served by `ucrypt serve --unencrypted`, and another copy by nbdkit's file
//!   plugin without a filter: each server's NBD path without any crypto. The nbdkit one bounds
//!   what any server can reach with this client at QD1, where the round trip dominates.
//! - The 4 KiB QD1 jobs run twice: with fio and the servers where the scheduler puts them, and
//!   with fio and the server under test pinned to one CPU (every thread of the server, for
//!   that job only), which takes the wake-up of a sleeping CPU out of each round trip.
//! - On disk (`/var/tmp`, or `UCRYPT_BENCH_DISK_DIR`; skipped with the reason if that is a RAM
//!   file system): smaller copies of the LUKS images for ucrypt, qemu-storage-daemon and
//!   nbdkit, for the durable-write job ([`DISK_JOBS`]), where the cost of flushing is real.
//!
//! Every file is filled with pseudo-random bytes before it is formatted, so reads hit written
//! (allocated, non-zero) ciphertext rather than holes. ucrypt opens the LUKS images through its
//! normal LUKS path (`--key-file`), not raw mode. The servers run for the whole benchmark;
//! each fio job runs on every target in turn (round-robin), `runs` times; medians.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Serialize;

use super::cmd::{have, run_ok};
use super::cpu::CpuWatch;
use super::disk::{disk_dir, fs_type, settle, write_noise};
use super::fio::{self, FioResult, Job, QEMU_IMG};
use super::limit::{self, LimitResult};
use super::server::Server;
use super::stats::{Machine, Summary};

const RANDREAD_QD1: Job = Job::new("4k randread QD1", "randread", 4096, "nbd", 1);
const RANDWRITE_QD1: Job = Job::new("4k randwrite QD1", "randwrite", 4096, "nbd", 1);
/// The think time of the job where polling for the next request does not pay, µs.
const THINK_US: u32 = 200;
const THINK_JOB: &str = "4k randread QD1, 200 µs think time";
const JOBS: &[Job] = &[
    RANDREAD_QD1,
    RANDWRITE_QD1,
    // The same with fio and the server pinned to one CPU: at QD1 a request is one round trip,
    // and on virtual machines waking a sleeping CPU costs more than the rest of it. These rows
    // show what each server's own path costs without that wake-up.
    RANDREAD_QD1.on_one_cpu("4k randread QD1, one CPU"),
    RANDWRITE_QD1.on_one_cpu("4k randwrite QD1, one CPU"),
    // A client that pauses 200 µs after each request, longer than the server's poll for the
    // next one (`--spin-us`, 50 µs): polling does not pay here, and the server's CPU per
    // request shows whether it backs off (beside `ucrypt LUKS2 spin-always`).
    RANDREAD_QD1.thinking(THINK_JOB, THINK_US),
    Job::new("4k randread QD32", "randread", 4096, "nbd", 32),
    Job::new("4k randwrite QD32", "randwrite", 4096, "nbd", 32),
    // Four 1 MiB requests in flight: a sequential stream as a file system or qemu sends it.
    Job::new("1M read QD4", "read", 1 << 20, "nbd", 4),
    Job::new("1M write QD4", "write", 1 << 20, "nbd", 4),
    // The same kinds of request from QEMU's own NBD client (what a virtual machine's disk
    // uses), sequential: its round trip differs from fio's, and its writethrough cache mode
    // sends every write with FUA, which each server must make durable before replying.
    Job::new("4k read QD1, qemu-img", "read", 4096, QEMU_IMG, 1),
    Job::new("4k write QD1, qemu-img", "write", 4096, QEMU_IMG, 1),
    Job::new(
        "1M write FUA QD4, qemu-img",
        "write-fua",
        1 << 20,
        QEMU_IMG,
        4,
    ),
];
/// Jobs on images on the machine's disk instead of RAM, where making a write durable costs
/// what it costs on real storage: a server that splits a 1 MiB FUA write into many backend
/// writes, each made durable on its own (nbdkit's luks filter calls its plugin once per
/// 512-byte sector), pays for every one of them.
/// And 4 KiB random reads and writes at QD1 on a disk file, where the servers that use the
/// page cache (qemu-storage-daemon, nbdkit, ucrypt with `--cache writeback`) differ from
/// O_DIRECT (ucrypt's default `--cache none`).
const DISK_JOBS: &[Job] = &[
    Job::new(
        "1M write FUA QD4 on disk, qemu-img",
        "write-fua",
        1 << 20,
        QEMU_IMG,
        4,
    ),
    Job::new("4k randread QD1 on disk", "randread", 4096, "nbd", 1),
    Job::new("4k randwrite QD1 on disk", "randwrite", 4096, "nbd", 1),
];
/// The servers the disk jobs run on: LUKS ones only (the no-crypto rows bound round trips,
/// which the disk jobs are not about).
const DISK_TARGETS: [Target; 6] = [
    Target::UcryptLuks2,
    Target::UcryptLuks2Writeback,
    Target::UcryptLuks2Auto,
    Target::UcryptLuks1,
    Target::QsdLuks1,
    Target::NbdkitLuks1,
];
/// Requests per `qemu-img bench` run (it counts requests, not time): about as long as a fio
/// run for ucrypt; (full, --quick) for 4 KiB and for 1 MiB jobs, and for the disk jobs (where
/// nbdkit takes ~0.1 s per durable 1 MiB write; at most the disk volume's MiBs).
const QEMU_IMG_COUNT_4K: (u64, u64) = (20_000, 4_000);
const QEMU_IMG_COUNT_1M: (u64, u64) = (600, 120);
const QEMU_IMG_COUNT_DISK: (u64, u64) = (48, 16);
/// The volume size of the disk images: the disk jobs write the first MiBs only.
const DISK_VOLUME_BYTES: u64 = 64 << 20;
const _: () = assert!(QEMU_IMG_COUNT_DISK.0 << 20 <= DISK_VOLUME_BYTES);
/// The region fio touches: the first bytes of every volume.
const VOLUME_BYTES: u64 = 256 << 20;
/// Size of every image file in RAM: the volume plus the header room.
const IMAGE_BYTES: u64 = VOLUME_BYTES + HEADER_ROOM_BYTES;
/// Room before the data in every image: LUKS2's default 16 MiB data offset (LUKS1's payload
/// starts at 2 MiB).
const HEADER_ROOM_BYTES: u64 = 16 << 20;
const PASSPHRASE: &str = "ucrypt-bench";
/// PBKDF2 iterations for every keyslot: opening is not what is measured.
const PBKDF2_ITERATIONS: &str = "1000";
/// How long a server may take to accept connections.
const READY_WAIT: Duration = Duration::from_secs(20);
/// Export name every server uses.
const EXPORT: &str = "disk";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// `ucrypt serve --unencrypted` on a plain file: the NBD path without crypto.
    Plain,
    /// `ucrypt serve` on the LUKS2 image, inline policy.
    UcryptLuks2,
    /// `ucrypt serve --policy auto` on the LUKS2 image.
    UcryptLuks2Auto,
    /// `ucrypt serve --spin-always` on the LUKS2 image, inline policy: polls for the next
    /// request after every request, even where that does not pay (no back-off).
    UcryptLuks2SpinAlways,
    /// `ucrypt serve --cache writeback` on the LUKS2 image (disk jobs only).
    UcryptLuks2Writeback,
    /// `ucrypt serve` on the LUKS1 image.
    UcryptLuks1,
    /// qemu-storage-daemon's luks driver on the LUKS1 image, NBD export.
    QsdLuks1,
    /// nbdkit's luks filter over its file plugin on the LUKS1 image.
    NbdkitLuks1,
    /// nbdkit's file plugin on a plain file: nbdkit's NBD path without crypto.
    NbdkitPlain,
}

impl Target {
    /// The targets of the jobs on RAM.
    const RAM: [Target; 8] = [
        Target::Plain,
        Target::UcryptLuks2,
        Target::UcryptLuks2Auto,
        Target::UcryptLuks2SpinAlways,
        Target::UcryptLuks1,
        Target::QsdLuks1,
        Target::NbdkitLuks1,
        Target::NbdkitPlain,
    ];
    const ALL: [Target; 9] = [
        Target::Plain,
        Target::UcryptLuks2,
        Target::UcryptLuks2Writeback,
        Target::UcryptLuks2Auto,
        Target::UcryptLuks2SpinAlways,
        Target::UcryptLuks1,
        Target::QsdLuks1,
        Target::NbdkitLuks1,
        Target::NbdkitPlain,
    ];

    fn name(self) -> &'static str {
        match self {
            Target::Plain => "plain (no crypto)",
            Target::UcryptLuks2 => "ucrypt LUKS2",
            Target::UcryptLuks2Auto => "ucrypt LUKS2 auto",
            Target::UcryptLuks2SpinAlways => "ucrypt LUKS2 spin-always",
            Target::UcryptLuks2Writeback => "ucrypt LUKS2 cache=writeback",
            Target::UcryptLuks1 => "ucrypt LUKS1",
            Target::QsdLuks1 => "qsd LUKS1",
            Target::NbdkitLuks1 => "nbdkit LUKS1",
            Target::NbdkitPlain => "nbdkit plain (no crypto)",
        }
    }

    /// A short name for files and sockets.
    fn slug(self) -> &'static str {
        match self {
            Target::Plain => "plain",
            Target::UcryptLuks2 => "ucrypt-luks2",
            Target::UcryptLuks2Auto => "ucrypt-luks2-auto",
            Target::UcryptLuks2SpinAlways => "ucrypt-luks2-spin-always",
            Target::UcryptLuks2Writeback => "ucrypt-luks2-writeback",
            Target::UcryptLuks1 => "ucrypt-luks1",
            Target::QsdLuks1 => "qsd-luks1",
            Target::NbdkitLuks1 => "nbdkit-luks1",
            Target::NbdkitPlain => "nbdkit-plain",
        }
    }

    /// The peer program this target needs and the Debian package that has it.
    fn peer_program(self) -> Option<(&'static str, &'static str)> {
        match self {
            Target::QsdLuks1 => Some(("qemu-storage-daemon", "qemu-system-common")),
            Target::NbdkitLuks1 | Target::NbdkitPlain => Some(("nbdkit", "nbdkit")),
            _ => None,
        }
    }
}

/// A speed goal of the issue: `ours` at least `min_ratio` × `peer` on `job`.
struct GoalSpec {
    job: &'static str,
    peer: Target,
    min_ratio: f64,
}

const GOALS: &[GoalSpec] = &[
    GoalSpec {
        job: "4k randread QD1",
        peer: Target::QsdLuks1,
        min_ratio: 3.0,
    },
    GoalSpec {
        job: "4k randread QD1",
        peer: Target::NbdkitLuks1,
        min_ratio: 3.0,
    },
    GoalSpec {
        job: "4k randwrite QD1",
        peer: Target::QsdLuks1,
        min_ratio: 3.0,
    },
    GoalSpec {
        job: "4k randwrite QD1",
        peer: Target::NbdkitLuks1,
        min_ratio: 3.0,
    },
    GoalSpec {
        job: "1M write QD4",
        peer: Target::NbdkitLuks1,
        min_ratio: 20.0,
    },
    // Encrypting 1 MiB writes at depth costs little beside moving them: ucrypt LUKS2 at
    // least 0.9 of its own server without crypto.
    GoalSpec {
        job: "1M write QD4",
        peer: Target::Plain,
        min_ratio: 0.9,
    },
    GoalSpec {
        job: "1M write FUA QD4 on disk, qemu-img",
        peer: Target::NbdkitLuks1,
        min_ratio: 20.0,
    },
];
/// One fio run: its result, the server's busy cores and its CPU µs per request.
type Sample = (FioResult, f64, f64);

/// The ucrypt configurations the goals are checked for.
const OURS: [Target; 2] = [Target::UcryptLuks2, Target::UcryptLuks2Auto];

#[derive(Debug, Serialize)]
pub struct Row {
    pub job: Job,
    pub target: Target,
    pub mib_s: Summary,
    pub iops: Summary,
    pub lat_p99_us: Summary,
    /// The server's CPU time per request, µs (all its threads; qemu-img jobs: NaN).
    pub server_cpu_us_per_req: Summary,
    /// The server's CPU seconds per wall second (cores it kept busy).
    pub server_cpu_cores: Summary,
}

/// One goal checked for one ucrypt configuration. `ratio` is ours ÷ peer (medians); `met` is
/// None when either side was not measured.
#[derive(Debug, Serialize, PartialEq)]
pub struct GoalResult {
    pub job: &'static str,
    pub ours: Target,
    pub peer: Target,
    pub min_ratio: f64,
    pub ratio: Option<f64>,
    pub met: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct NbdReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub runs: usize,
    pub runtime_s: f64,
    /// Unmeasured warm-up before each fio run.
    pub ramp_s: f64,
    /// Where the images were (a RAM file system unless `$TMPDIR` says otherwise).
    pub image_dir: String,
    /// Where the images of the disk jobs were (None: the disk jobs did not run, see skipped).
    pub disk_image_dir: Option<String>,
    pub volume_bytes: u64,
    pub skipped: Vec<String>,
    pub rows: Vec<Row>,
    pub goals: Vec<GoalResult>,
    /// AES-256-XTS on every core at once, MiB/s, measured once per round.
    pub cipher_x_cores_mib_s: Summary,
    /// The large jobs of each ucrypt configuration against their limit (see `limit.rs`):
    /// the ceiling is ucrypt's own server without crypto in the same run.
    pub limits: Vec<LimitResult>,
}

/// The jobs checked against the limit: large requests in RAM, where the cipher's share of the
/// CPU shows (at 4 KiB the limit is the ceiling).
const LIMIT_JOBS: &[&str] = &["1M read QD4", "1M write QD4"];

fn find<'a>(rows: &'a [Row], job: &str, t: Target) -> Option<&'a Row> {
    rows.iter().find(|r| r.job.name == job && r.target == t)
}

/// Ratio of two medians; None unless both are positive numbers.
fn ratio(ours: Option<&Row>, peer: Option<&Row>) -> Option<f64> {
    let (o, p) = (ours?.mib_s.median, peer?.mib_s.median);
    (o.is_finite() && p.is_finite() && o > 0.0 && p > 0.0).then(|| o / p)
}

/// Checks every goal for every ucrypt configuration in [`OURS`].
fn check_goals(rows: &[Row]) -> Vec<GoalResult> {
    let mut out = Vec::new();
    for g in GOALS {
        for ours in OURS {
            let r = ratio(find(rows, g.job, ours), find(rows, g.job, g.peer));
            out.push(GoalResult {
                job: g.job,
                ours,
                peer: g.peer,
                min_ratio: g.min_ratio,
                ratio: r,
                met: r.map(|r| r >= g.min_ratio),
            });
        }
    }
    out
}

/// Where the images go: `$TMPDIR` if set, else /dev/shm (RAM, so the storage is not measured).
fn base_dir() -> PathBuf {
    std::env::var_os("TMPDIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm"))
}

/// The benchmark's directory and files; removed on drop.
struct Setup {
    dir: PathBuf,
    pass_file: PathBuf,
}

impl Setup {
    /// Images for `targets` in a new directory under `base`, each `image_bytes` long.
    fn new(base: &Path, image_bytes: u64, targets: &[Target]) -> Result<Setup, String> {
        let dir = crate::disk::run_dir(base, "nbd")?;
        let s = Setup {
            pass_file: dir.join("pass"),
            dir,
        };
        std::fs::write(&s.pass_file, PASSPHRASE).map_err(|e| e.to_string())?;
        let noise = s.dir.join("noise.img");
        write_noise(&noise, image_bytes)?;
        let copy = |to: &Path| {
            std::fs::copy(&noise, to)
                .map(|_| ())
                .map_err(|e| format!("{}: {e}", to.display()))
        };
        for (kind, sector) in [("luks2", "4096"), ("luks1", "512")] {
            let img = s.dir.join(format!("{kind}.img"));
            copy(&img)?;
            let mut c = Command::new("cryptsetup");
            c.args(["luksFormat", "-q", "--type", kind])
                .args(["--cipher", "aes-xts-plain64", "--key-size", "512"])
                .args(["--hash", "sha256", "--pbkdf", "pbkdf2"])
                .args(["--pbkdf-force-iterations", PBKDF2_ITERATIONS]);
            if kind == "luks2" {
                c.args(["--sector-size", sector]);
            }
            run_ok(c.arg("--key-file").arg(&s.pass_file).arg(&img))?;
        }
        for &t in targets {
            let source = match t {
                Target::Plain | Target::NbdkitPlain => noise.clone(),
                Target::UcryptLuks2
                | Target::UcryptLuks2Auto
                | Target::UcryptLuks2Writeback
                | Target::UcryptLuks2SpinAlways => s.dir.join("luks2.img"),
                _ => s.dir.join("luks1.img"),
            };
            std::fs::copy(source, s.image(t)).map_err(|e| format!("{}: {e}", t.name()))?;
            settle(&s.image(t))?;
        }
        // Only the copies are served; the masters would just hold RAM.
        for f in ["noise.img", "luks2.img", "luks1.img"] {
            let _ = std::fs::remove_file(s.dir.join(f));
        }
        Ok(s)
    }

    fn image(&self, t: Target) -> PathBuf {
        self.dir.join(format!("{}.img", t.slug()))
    }

    fn socket(&self, t: Target) -> PathBuf {
        self.dir.join(format!("{}.sock", t.slug()))
    }

    fn log(&self, t: Target) -> PathBuf {
        self.dir.join(format!("{}.log", t.slug()))
    }

    fn uri(&self, t: Target) -> PathBuf {
        PathBuf::from(format!(
            "nbd+unix:///{EXPORT}?socket={}",
            self.socket(t).display()
        ))
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How ucrypt or a peer is run to serve target `t`.
fn server_command(t: Target, s: &Setup) -> Result<Command, String> {
    let img = s.image(t);
    let sock = s.socket(t);
    let ucrypt = || -> Result<Command, String> {
        let mut c = Command::new(crate::ucrypt_bin()?);
        c.arg("serve")
            .arg(&img)
            .arg("--nbd")
            .arg(format!("unix:{}", sock.display()))
            .args(["--export-name", EXPORT]);
        Ok(c)
    };
    Ok(match t {
        Target::Plain => {
            let mut c = ucrypt()?;
            c.arg("--unencrypted");
            c
        }
        Target::UcryptLuks2
        | Target::UcryptLuks1
        | Target::UcryptLuks2Auto
        | Target::UcryptLuks2Writeback
        | Target::UcryptLuks2SpinAlways => {
            let mut c = ucrypt()?;
            if t == Target::UcryptLuks2Writeback {
                c.args(["--cache", "writeback"]);
            }
            if t == Target::UcryptLuks2SpinAlways {
                c.arg("--spin-always");
            }
            c.arg("--key-file").arg(&s.pass_file);
            // Named explicitly, so the rows mean the same whatever `serve`'s default is.
            let policy = if t == Target::UcryptLuks2Auto {
                "auto"
            } else {
                "inline"
            };
            c.args(["--policy", policy]);
            c
        }
        Target::QsdLuks1 => {
            let mut c = Command::new("qemu-storage-daemon");
            c.arg("--object")
                .arg(format!("secret,id=s0,file={}", s.pass_file.display()))
                .arg("--blockdev")
                .arg(format!(
                    "driver=file,node-name=f0,filename={}",
                    img.display()
                ))
                .arg("--blockdev")
                .arg("driver=luks,node-name=l0,file=f0,key-secret=s0")
                .arg("--nbd-server")
                .arg(format!("addr.type=unix,addr.path={}", sock.display()))
                .arg("--export")
                .arg(format!(
                    "type=nbd,id=e0,node-name=l0,name={EXPORT},writable=on"
                ));
            c
        }
        Target::NbdkitLuks1 => {
            let mut c = Command::new("nbdkit");
            c.args(["-f", "--exit-with-parent", "-U"])
                .arg(&sock)
                .args(["-e", EXPORT, "--filter=luks", "file"])
                .arg(&img)
                .arg(format!("passphrase=+{}", s.pass_file.display()));
            c
        }
        Target::NbdkitPlain => {
            let mut c = Command::new("nbdkit");
            c.args(["-f", "--exit-with-parent", "-U"])
                .arg(&sock)
                .args(["-e", EXPORT, "file"])
                .arg(&img);
            c
        }
    })
}

/// Starts the server for `t` and waits until its socket accepts connections.
fn start_server(t: Target, s: &Setup) -> Result<Server, String> {
    Server::start(
        server_command(t, s)?,
        &s.socket(t),
        &s.log(t),
        t.name(),
        READY_WAIT,
    )
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Result<libc::cpu_set_t, String> {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity writes at most the given size into `set`, which we own.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if r != 0 {
        return Err(format!(
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(set)
}

fn first_cpu(set: &libc::cpu_set_t) -> Option<usize> {
    // SAFETY: CPU_ISSET only reads the set, for CPU numbers below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize).find(|&c| unsafe { libc::CPU_ISSET(c, set) })
}

/// Sets the affinity of every thread of process `pid` (threads it starts later inherit it from
/// the thread that starts them).
fn set_process_affinity(pid: libc::pid_t, set: &libc::cpu_set_t) -> Result<(), String> {
    let dir = format!("/proc/{pid}/task");
    let tasks = std::fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))?;
    for tid in tasks.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<libc::pid_t>().ok()) {
        // SAFETY: sched_setaffinity reads the set, which outlives the call.
        let r = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(set), set) };
        let e = std::io::Error::last_os_error();
        // A thread that ended since the directory was read is no error.
        if r != 0 && e.raw_os_error() != Some(libc::ESRCH) {
            return Err(format!("pinning thread {tid} of process {pid}: {e}"));
        }
    }
    Ok(())
}

/// A server pinned to one CPU for a job; on drop it may use `restore` again.
struct Pinned {
    pid: libc::pid_t,
    restore: libc::cpu_set_t,
}

impl Pinned {
    fn new(pid: libc::pid_t, cpu: usize, restore: libc::cpu_set_t) -> Result<Pinned, String> {
        // SAFETY: as in allowed_cpus.
        let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: CPU_SET writes one bit of `one`; `cpu` came from first_cpu (< CPU_SETSIZE).
        unsafe { libc::CPU_SET(cpu, &mut one) };
        // The guard exists first: if pinning fails part way, its drop restores every thread.
        let pinned = Pinned { pid, restore };
        set_process_affinity(pid, &one)?;
        Ok(pinned)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = set_process_affinity(self.pid, &self.restore);
    }
}

/// Servers on one set of images, and the jobs they run.
struct Part {
    /// Declared before `setup`: the servers stop before their files go.
    servers: Vec<Server>,
    setup: Setup,
    /// The targets that serve (a peer that is not installed or fails is left out).
    targets: Vec<Target>,
    jobs: Vec<&'static Job>,
    volume_bytes: u64,
}

impl Part {
    fn start(
        setup: Setup,
        want: &[Target],
        jobs: Vec<&'static Job>,
        volume_bytes: u64,
        skipped: &mut Vec<String>,
    ) -> Result<Part, String> {
        let mut part = Part {
            servers: Vec::new(),
            setup,
            targets: Vec::new(),
            jobs,
            volume_bytes,
        };
        for &t in want {
            if let Some((prog, pkg)) = t.peer_program() {
                if !have(prog) {
                    let why = format!("{}: {prog} not installed (apt-get install {pkg})", t.name());
                    if !skipped.contains(&why) {
                        skipped.push(why);
                    }
                    continue;
                }
            }
            match start_server(t, &part.setup) {
                Ok(s) => {
                    part.servers.push(s);
                    part.targets.push(t);
                }
                // A peer that cannot serve is reported and left out; ucrypt must serve.
                Err(e) if t.peer_program().is_some() => skipped.push(e),
                Err(e) => return Err(e),
            }
        }
        Ok(part)
    }
}

pub fn measure(runs: usize, quick: bool, progress: bool) -> Result<NbdReport, String> {
    for (p, pkg) in [("fio", "fio"), ("cryptsetup", "cryptsetup-bin")] {
        if !have(p) {
            return Err(format!("{p} not found (apt-get install {pkg})"));
        }
    }
    // fio itself takes about 0.35 s to start and stop around each run: --quick (3 runs of
    // 36 job × target pairs) stays near a minute, the full run (7 runs) under six. The ramp
    // lets the scheduler settle where fio and the server run before measuring (at QD1 that
    // placement, same CPU or not, matters more than anything the server does).
    let (runtime, ramp) = if quick {
        (Duration::from_millis(250), Duration::from_millis(150))
    } else {
        (Duration::from_millis(800), Duration::from_millis(200))
    };
    let mut skipped = Vec::new();
    if progress {
        eprintln!("bench nbd: preparing images");
    }
    let has_qemu_img = have("qemu-img");
    if !has_qemu_img {
        skipped
            .push("the qemu-img jobs: qemu-img not installed (apt-get install qemu-utils)".into());
    }
    let with_client = |jobs: &'static [Job]| -> Vec<&'static Job> {
        jobs.iter()
            .filter(|j| has_qemu_img || j.ioengine != QEMU_IMG)
            .collect()
    };
    let mut parts = vec![Part::start(
        Setup::new(&base_dir(), IMAGE_BYTES, &Target::RAM)?,
        &Target::RAM,
        with_client(JOBS),
        VOLUME_BYTES,
        &mut skipped,
    )?];
    let mut disk_image_dir = None;
    match disk_dir() {
        Ok(dir) if has_qemu_img => {
            if progress {
                eprintln!("bench nbd: preparing images on disk ({})", dir.display());
            }
            let setup = Setup::new(&dir, DISK_VOLUME_BYTES + HEADER_ROOM_BYTES, &DISK_TARGETS)?;
            disk_image_dir = Some(dir.display().to_string());
            parts.push(Part::start(
                setup,
                &DISK_TARGETS,
                with_client(DISK_JOBS),
                DISK_VOLUME_BYTES,
                &mut skipped,
            )?);
        }
        Ok(_) => {}
        Err(e) => skipped.push(e),
    }
    let count = |job: &Job| {
        let (full, short) = if DISK_JOBS.iter().any(|d| d.name == job.name) {
            QEMU_IMG_COUNT_DISK
        } else if job.block_bytes >= 1 << 20 {
            QEMU_IMG_COUNT_1M
        } else {
            QEMU_IMG_COUNT_4K
        };
        if quick {
            short
        } else {
            full
        }
    };
    // The CPU that one-CPU jobs pin fio and the server to; afterwards the server gets back
    // the CPUs this process (and so every server, which inherited them) may use.
    let own_cpus = allowed_cpus()?;
    let one_cpu = first_cpu(&own_cpus).ok_or("this process may run on no CPU")?;
    // samples[part][target][job]
    let mut samples: Vec<Vec<Vec<Vec<Sample>>>> = parts
        .iter()
        .map(|p| vec![vec![Vec::new(); p.jobs.len()]; p.targets.len()])
        .collect();
    let mut cipher = Vec::new();
    for run in 0..runs {
        if progress {
            eprintln!("bench nbd: run {}/{runs}", run + 1);
        }
        for (part, samples) in parts.iter().zip(samples.iter_mut()) {
            for (ji, &job) in part.jobs.iter().enumerate() {
                for (ti, &t) in part.targets.iter().enumerate() {
                    let uri = part.setup.uri(t);
                    let cpu = (job.cpus == fio::ONE_CPU).then_some(one_cpu);
                    let _pinned = match cpu {
                        Some(c) => Some(Pinned::new(part.servers[ti].pid(), c, own_cpus)?),
                        None => None,
                    };
                    let watch = CpuWatch::start(part.servers[ti].pid());
                    let r = if job.ioengine == QEMU_IMG {
                        fio::run_qemu_img(job, &uri, count(job))
                    } else {
                        fio::run_for(job, &uri, part.volume_bytes, runtime, ramp, false, cpu)
                    }
                    .map_err(|e| format!("{}: {e}", t.name()))?;
                    let (cores, per_req) = watch.stop(r.iops);
                    samples[ti][ji].push((r, cores, per_req));
                }
            }
        }
        // Once a round, beside the jobs: the cipher on every core, under the same load.
        cipher.push(limit::cipher_x_cores_mib_s(limit::CIPHER_MEASURE));
    }
    let limits = limit_rows(&parts[0], &samples[0], &cipher);
    let mut rows = Vec::new();
    for (part, samples) in parts.iter().zip(&samples) {
        for (ji, &job) in part.jobs.iter().enumerate() {
            for (ti, &target) in part.targets.iter().enumerate() {
                let s = &samples[ti][ji];
                let of = |f: fn(&Sample) -> f64| Summary::of(&s.iter().map(f).collect::<Vec<_>>());
                rows.push(Row {
                    job: *job,
                    target,
                    mib_s: of(|r| r.0.mib_s),
                    iops: of(|r| r.0.iops),
                    lat_p99_us: of(|r| r.0.lat_p99_us),
                    server_cpu_us_per_req: of(|r| {
                        if r.0.lat_p99_us.is_finite() {
                            r.2
                        } else {
                            f64::NAN
                        }
                    }),
                    server_cpu_cores: of(|r| r.1),
                });
            }
        }
    }
    drop(parts);
    let goals = check_goals(&rows);
    Ok(NbdReport {
        schema: 1,
        machine: Machine::detect(),
        runs,
        runtime_s: runtime.as_secs_f64(),
        ramp_s: ramp.as_secs_f64(),
        image_dir: base_dir().display().to_string(),
        disk_image_dir,
        volume_bytes: VOLUME_BYTES,
        skipped,
        rows,
        goals,
        cipher_x_cores_mib_s: Summary::of(&cipher),
        limits,
    })
}

/// Limit rows of the RAM part (`samples[target][job]`, in run order).
fn limit_rows(part: &Part, samples: &[Vec<Vec<Sample>>], cipher: &[f64]) -> Vec<LimitResult> {
    let per_run = |t: Target, job: &str| -> Option<Vec<f64>> {
        let ti = part.targets.iter().position(|&x| x == t)?;
        let ji = part.jobs.iter().position(|j| j.name == job)?;
        Some(samples[ti][ji].iter().map(|s| s.0.mib_s).collect())
    };
    let mut out = Vec::new();
    for &job in LIMIT_JOBS {
        let Some(ceiling) = per_run(Target::Plain, job) else {
            continue;
        };
        for ours in OURS {
            let Some(o) = per_run(ours, job) else {
                continue;
            };
            out.push(LimitResult::of(
                job,
                (ours.name(), &o),
                &[(Target::Plain.name(), &ceiling)],
                cipher,
            ));
        }
    }
    out
}

fn show_ratio(r: Option<f64>) -> String {
    match r {
        Some(r) if r >= 10.0 => format!("{r:.0}×"),
        Some(r) => format!("{r:.2}×"),
        None => "–".into(),
    }
}

pub fn markdown(r: &NbdReport) -> String {
    let mut s = format!(
        "Machine: {}. fio --ioengine=nbd over unix sockets, {} MiB volumes in {}, {} s per job \
         after {} s of warm-up, {} round-robin runs; MiB/s median (min–max). AES-256-XTS \
         everywhere; LUKS2: 4096-byte sectors; LUKS1: 512-byte sectors. Jobs marked qemu-img \
         run through `qemu-img bench` instead (QEMU's NBD client, sequential offsets, a fixed \
         number of requests; throughput only).\n\n",
        r.machine.describe(),
        r.volume_bytes >> 20,
        r.image_dir,
        r.runtime_s,
        r.ramp_s,
        r.runs
    );
    if let Some(dir) = &r.disk_image_dir {
        s.push_str(&format!(
            "Jobs marked \"on disk\" run on other copies of the LUKS images in {dir} ({}), \
             where a FUA write costs what making data durable costs on that storage.\n\n",
            fs_type(Path::new(dir)).unwrap_or_else(|| "file system unknown".into())
        ));
    }
    let peers = [Target::QsdLuks1, Target::NbdkitLuks1];
    s.push_str("| job |");
    for t in Target::ALL {
        s.push_str(&format!(" {} |", t.name()));
    }
    for p in peers {
        s.push_str(&format!(" LUKS2 ÷ {} |", p.name()));
    }
    s.push_str(&format!(
        "\n|---|{}\n",
        "---|".repeat(Target::ALL.len() + 2)
    ));
    for job in JOBS.iter().chain(DISK_JOBS) {
        s.push_str(&format!("| {} |", job.name));
        for t in Target::ALL {
            let cell = find(&r.rows, job.name, t)
                .map(|x| x.mib_s.show(0))
                .unwrap_or_else(|| "–".into());
            s.push_str(&format!(" {cell} |"));
        }
        for p in peers {
            let q = ratio(
                find(&r.rows, job.name, Target::UcryptLuks2),
                find(&r.rows, job.name, p),
            );
            s.push_str(&format!(" {} |", show_ratio(q)));
        }
        s.push('\n');
    }
    s.push_str(&fio_jobs_table(
        r,
        "p99 completion latency, µs (median over runs)",
        |x| {
            let v = x.lat_p99_us.median;
            v.is_finite().then(|| format!("{v:.0}"))
        },
    ));
    s.push_str(&fio_jobs_table(
        r,
        "Server CPU per request, µs (median; all the server's threads, the warm-up counted at \
         the measured rate), and in parentheses the cores it kept busy",
        |x| {
            let (us, cores) = (x.server_cpu_us_per_req.median, x.server_cpu_cores.median);
            us.is_finite().then(|| format!("{us:.1} ({cores:.2})"))
        },
    ));
    s.push_str("\nGoals (ucrypt ÷ peer, medians):\n\n| goal |");
    for o in OURS {
        s.push_str(&format!(" {} |", o.name()));
    }
    s.push_str(&format!("\n|---|{}\n", "---|".repeat(OURS.len())));
    for g in GOALS {
        s.push_str(&format!(
            "| {} ≥ {}× {} |",
            g.job,
            g.min_ratio,
            g.peer.name()
        ));
        for o in OURS {
            let cell = r
                .goals
                .iter()
                .find(|x| x.job == g.job && x.peer == g.peer && x.ours == o)
                .map(|x| match x.met {
                    Some(true) => format!("{} met", show_ratio(x.ratio)),
                    Some(false) => format!("{} missed", show_ratio(x.ratio)),
                    None => "not measured".into(),
                })
                .unwrap_or_else(|| "–".into());
            s.push_str(&format!(" {cell} |"));
        }
        s.push('\n');
    }
    if !r.limits.is_empty() {
        s.push_str(&limit::markdown(
            "Against the limit of this machine",
            &r.limits,
            &r.cipher_x_cores_mib_s,
        ));
    }
    s.push_str(&round_trip_note(r));
    for sk in &r.skipped {
        s.push_str(&format!("\nSkipped: {sk}\n"));
    }
    s.push_str(&spin_backoff_note(&r.rows));
    s
}

/// A table of one figure per fio job (qemu-img jobs report no latencies or CPU per request)
/// and target, "–" where `cell` has nothing.
fn fio_jobs_table(r: &NbdReport, title: &str, cell: impl Fn(&Row) -> Option<String>) -> String {
    let mut s = format!("\n{title}:\n\n| job |");
    for t in Target::ALL {
        s.push_str(&format!(" {} |", t.name()));
    }
    s.push_str(&format!("\n|---|{}\n", "---|".repeat(Target::ALL.len())));
    for job in JOBS
        .iter()
        .chain(DISK_JOBS)
        .filter(|j| j.ioengine != QEMU_IMG)
    {
        s.push_str(&format!("| {} |", job.name));
        for t in Target::ALL {
            let c = find(&r.rows, job.name, t).and_then(&cell);
            s.push_str(&format!(" {} |", c.as_deref().unwrap_or("–")));
        }
        s.push('\n');
    }
    s
}

/// At QD1 every request is one NBD round trip: what the two servers reach without any crypto
/// bounds what a "3× nbdkit LUKS1" goal can ask for.
fn round_trip_note(r: &NbdReport) -> String {
    let mut s = String::new();
    for job in ["4k randread QD1", "4k randwrite QD1"] {
        let mib = |t| find(&r.rows, job, t).map(|x| x.mib_s.median);
        if let (Some(luks), Some(bare), Some(ours), Some(plain)) = (
            mib(Target::NbdkitLuks1),
            mib(Target::NbdkitPlain),
            mib(Target::UcryptLuks2),
            mib(Target::Plain),
        ) {
            s.push_str(&format!(
                "\n{job}: 3× nbdkit LUKS1 would be {:.0} MiB/s. Without any crypto, nbdkit \
                 reaches {bare:.0} and ucrypt {plain:.0}; ucrypt LUKS2 reaches {ours:.0} \
                 ({:.0} % of its own no-crypto path).\n",
                3.0 * luks,
                100.0 * ours / plain.max(1e-9)
            ));
        }
        let pinned = format!("{job}, one CPU");
        let mib = |t| find(&r.rows, &pinned, t).map(|x| x.mib_s.median);
        if let Some(ours) = mib(Target::UcryptLuks2) {
            s.push_str(&format!(
                "With fio and the server pinned to one CPU (no wake-up of a sleeping CPU per \
                 request): ucrypt LUKS2 {ours:.0} MiB/s"
            ));
            for p in [Target::NbdkitLuks1, Target::QsdLuks1] {
                if let Some(peer) = mib(p) {
                    s.push_str(&format!(
                        ", {} {peer:.0} ({})",
                        p.name(),
                        show_ratio(Some(ours / peer.max(1e-9)))
                    ));
                }
            }
            s.push_str(".\n");
        }
    }
    s
}

/// Polling back-off at a glance: ucrypt LUKS2 (polling backs off where it does not pay) ÷
/// the same server with `--spin-always`, measured in the same round-robin: server CPU per
/// request where the client thinks between requests (polling does not pay: lower is the
/// point), and IOPS at QD1 without think time (polling pays: should stay ~1).
fn spin_backoff_note(rows: &[Row]) -> String {
    let pair = |job: &str| {
        Some((
            find(rows, job, Target::UcryptLuks2)?,
            find(rows, job, Target::UcryptLuks2SpinAlways)?,
        ))
    };
    let mut s = String::new();
    if let Some((a, b)) = pair(THINK_JOB) {
        s.push_str(&format!(
            "\nPolling back-off, {THINK_JOB}: server CPU per request {:.1} µs with back-off, \
             {:.1} µs with --spin-always (÷ {:.2}); IOPS ÷ {:.2}.\n",
            a.server_cpu_us_per_req.median,
            b.server_cpu_us_per_req.median,
            a.server_cpu_us_per_req.median / b.server_cpu_us_per_req.median,
            a.iops.median / b.iops.median,
        ));
    }
    for job in [RANDREAD_QD1.name, RANDWRITE_QD1.name] {
        if let Some((a, b)) = pair(job) {
            s.push_str(&format!(
                "\nPolling back-off, {job} (polling pays): IOPS with back-off ÷ --spin-always \
                 {:.2}, p99 latency ÷ {:.2}, CPU per request ÷ {:.2}.\n",
                a.iops.median / b.iops.median,
                a.lat_p99_us.median / b.lat_p99_us.median,
                a.server_cpu_us_per_req.median / b.server_cpu_us_per_req.median,
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(job: &'static str, target: Target, mib_s: f64) -> Row {
        let one = |v| Summary::of(&[v]);
        Row {
            job: *JOBS.iter().find(|j| j.name == job).expect("known job"),
            target,
            mib_s: one(mib_s),
            iops: one(mib_s * 256.0),
            lat_p99_us: one(50.0),
            server_cpu_us_per_req: one(10.0),
            server_cpu_cores: one(0.5),
        }
    }

    #[test]
    fn goal_rows() {
        use Target::*;
        // (ucrypt LUKS2 MiB/s, peer, peer MiB/s, job, expected ratio, expected met)
        type Case = (f64, Target, f64, &'static str, Option<f64>, Option<bool>);
        let cases: &[Case] = &[
            (
                330.0,
                QsdLuks1,
                110.0,
                "4k randread QD1",
                Some(3.0),
                Some(true),
            ),
            (
                300.0,
                NbdkitLuks1,
                110.0,
                "4k randread QD1",
                Some(300.0 / 110.0),
                Some(false),
            ),
            (
                2000.0,
                NbdkitLuks1,
                100.0,
                "1M write QD4",
                Some(20.0),
                Some(true),
            ),
            (
                1900.0,
                NbdkitLuks1,
                100.0,
                "1M write QD4",
                Some(19.0),
                Some(false),
            ),
            (300.0, QsdLuks1, 0.0, "4k randwrite QD1", None, None),
            (f64::NAN, QsdLuks1, 100.0, "4k randwrite QD1", None, None),
        ];
        for &(ours, peer, theirs, job, want_ratio, want_met) in cases {
            let rows = vec![row(job, UcryptLuks2, ours), row(job, peer, theirs)];
            let goals = check_goals(&rows);
            let g = goals
                .iter()
                .find(|g| g.job == job && g.peer == peer && g.ours == UcryptLuks2)
                .expect("goal listed");
            assert_eq!(
                (g.ratio, g.met),
                (want_ratio, want_met),
                "{job} vs {peer:?}"
            );
            // The auto policy was not measured in this row set.
            let auto = goals
                .iter()
                .find(|g| g.job == job && g.peer == peer && g.ours == UcryptLuks2Auto)
                .expect("goal listed");
            assert_eq!(auto.met, None);
        }
        // Every goal is checked for every ucrypt configuration, even with no rows at all.
        assert_eq!(check_goals(&[]).len(), GOALS.len() * OURS.len());
    }

    #[test]
    fn markdown_cells() {
        use Target::*;
        let rows = vec![
            row("4k randread QD1", UcryptLuks2, 330.0),
            row("4k randread QD1", QsdLuks1, 110.0),
            row("1M write QD4", UcryptLuks2, 2500.0),
            row("1M write QD4", NbdkitLuks1, 100.0),
            row("4k randwrite QD1", UcryptLuks2, 165.0),
            row("4k randwrite QD1", Plain, 170.0),
            row("4k randwrite QD1", NbdkitLuks1, 80.0),
            row("4k randwrite QD1", NbdkitPlain, 100.0),
            row("4k randread QD1, one CPU", UcryptLuks2, 600.0),
            row("4k randread QD1, one CPU", NbdkitLuks1, 240.0),
        ];
        let goals = check_goals(&rows);
        let report = NbdReport {
            schema: 1,
            machine: Machine {
                cpu_model: "cpu".into(),
                cores: 2,
                aes_flags: vec![],
                kernel: "k".into(),
            },
            runs: 1,
            runtime_s: 1.0,
            ramp_s: 0.2,
            image_dir: "/dev/shm".into(),
            disk_image_dir: None,
            volume_bytes: VOLUME_BYTES,
            skipped: vec!["nbdkit LUKS1: nbdkit not installed (apt-get install nbdkit)".into()],
            rows,
            goals,
            cipher_x_cores_mib_s: Summary::of(&[10000.0]),
            limits: vec![LimitResult::of(
                "1M write QD4",
                ("ucrypt LUKS2", &[2000.0]),
                &[("plain (no crypto)", &[2500.0])],
                &[10000.0],
            )],
        };
        let md = markdown(&report);
        // (a line that must appear in the table)
        let lines = [
            "| 4k randread QD1 | – | 330 (330–330) | – | – | – | – | 110 (110–110) | – | – | 3.00× | – |",
            "| 1M write QD4 | – | 2500 (2500–2500) | – | – | – | – | – | 100 (100–100) | – | – | 25× |",
            "4k randwrite QD1: 3× nbdkit LUKS1 would be 240 MiB/s. Without any crypto, nbdkit \
             reaches 100 and ucrypt 170; ucrypt LUKS2 reaches 165 (97 % of its own no-crypto \
             path).",
            "| 4k randread QD1 ≥ 3× qsd LUKS1 | 3.00× met | not measured |",
            "| 4k randread QD1 ≥ 3× nbdkit LUKS1 | not measured | not measured |",
            "| 1M write QD4 ≥ 20× nbdkit LUKS1 | 25× met | not measured |",
            "Skipped: nbdkit LUKS1: nbdkit not installed (apt-get install nbdkit)",
            // Server CPU per request and busy cores.
            "| 4k randread QD1 | – | 10.0 (0.50) | – | – | – | – | 10.0 (0.50) | – | – |",
            "With fio and the server pinned to one CPU (no wake-up of a sleeping CPU per \
             request): ucrypt LUKS2 600 MiB/s, nbdkit LUKS1 240 (2.50×).",
            // 1 / (1/2500 + 1/10000) = 2000: ours at 1.00 of it.
            "| 1M write QD4 | ucrypt LUKS2 | plain (no crypto) | 2000 (2000–2000) | 1.00 (1.00–1.00) | ≥ 0.9 | met |",
        ];
        for l in lines {
            assert!(md.lines().any(|x| x == l), "missing {l:?} in\n{md}");
        }
        let json = serde_json::to_value(&report).expect("serialises");
        assert_eq!(json["rows"][0]["target"], "ucrypt-luks2");
        assert_eq!(json["rows"][0]["job"]["name"], "4k randread QD1");
        assert_eq!(json["rows"][0]["job"]["cpus"], "any");
        assert_eq!(json["rows"][8]["job"]["cpus"], "one");
        assert_eq!(json["goals"][0]["met"], true);
    }
}
