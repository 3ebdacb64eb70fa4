//! `ucrypt bench fuse`: the decrypted volume as a file over FUSE, measured with fio, side by
//! side with qemu-storage-daemon's FUSE export of the same LUKS1 image and with the plain
//! storage (a tmpfs file, no encryption, no FUSE). ucrypt runs twice: over classic /dev/fuse
//! and over FUSE-over-io_uring (only when the kernel has it enabled: the benchmark does not
//! flip `enable_uring`; it lists the reason under "Skipped"). Round-robin over targets; medians.
//!
//! On disk (`/var/tmp`, or `UCRYPT_BENCH_DISK_DIR`; skipped with the reason if that is a RAM
//! file system): the same servers on copies of the image filled with data on the machine's
//! disk, where qemu-storage-daemon's page cache and ucrypt's O_DIRECT (`--cache none`, its
//! default) differ, beside ucrypt with `--cache writeback` and the plain disk file: 4 KiB
//! random reads and writes at QD1 and 1 MiB writes made durable one by one (fdatasync).
//!
//! The LUKS1 image is made by cryptsetup (aes-xts-plain64, 512-bit key, 512-byte sectors).
//! ucrypt serves it in raw mode with the volume key and payload offset that
//! `cryptsetup luksDump --dump-volume-key` reports: the same ciphertext layout and the same
//! cipher work as opening the LUKS header, without timing the KDF.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::cmd::{have, run_ok};
use super::cpu::CpuWatch;
use super::disk::{disk_dir, fs_type, write_noise};
use super::fio::{self, FioResult, Job};
use super::stats::{Machine, Summary};

const JOBS: &[Job] = &[
    Job::new("4k randread psync QD1", "randread", 4096, "psync", 1),
    Job::new("4k randwrite psync QD1", "randwrite", 4096, "psync", 1),
    Job::new(
        "4k randread io_uring QD32",
        "randread",
        4096,
        "io_uring",
        32,
    ),
    Job::new(
        "4k randwrite io_uring QD32",
        "randwrite",
        4096,
        "io_uring",
        32,
    ),
    Job::new("1M read psync", "read", 1 << 20, "psync", 1),
    Job::new("1M write psync", "write", 1 << 20, "psync", 1),
];
/// Jobs on the disk copies (see the module documentation).
const DISK_JOBS: &[Job] = &[
    Job::new(
        "4k randread psync QD1 on disk",
        "randread",
        4096,
        "psync",
        1,
    ),
    Job::new(
        "4k randwrite psync QD1 on disk",
        "randwrite",
        4096,
        "psync",
        1,
    ),
    Job::new("1M write psync", "write", 1 << 20, "psync", 1)
        .synced("1M write fdatasync on disk", 1),
];
/// The servers the disk jobs run on.
const DISK_TARGETS: &[Target] = &[
    Target::Plain,
    Target::Ucrypt,
    Target::UcryptWriteback,
    Target::QemuStorageDaemon,
];
/// Plaintext bytes of the benchmark volume (and of the region fio touches).
const VOLUME_BYTES: u64 = 256 << 20;
/// The same on disk: filled with data first, so reads are not of holes.
const DISK_VOLUME_BYTES: u64 = 64 << 20;
/// Room before the data in the LUKS1 image: cryptsetup's default payload offset.
const HEADER_ROOM_BYTES: u64 = 2 << 20;
const PASSPHRASE: &str = "ucrypt-bench";
/// How long a FUSE server may take to show its file.
const MOUNT_WAIT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Target {
    /// The storage itself: a tmpfs file, no encryption, no FUSE.
    Plain,
    /// `ucrypt mount` (FUSE over classic /dev/fuse), aes-xts-plain64.
    Ucrypt,
    /// `ucrypt mount` over FUSE-over-io_uring.
    UcryptIoUring,
    /// `ucrypt mount --cache writeback` (classic FUSE): the image through the page cache.
    UcryptWriteback,
    /// qemu-storage-daemon's luks driver exported over FUSE.
    QemuStorageDaemon,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Plain => "plain tmpfs file",
            Target::Ucrypt => "ucrypt (FUSE classic)",
            Target::UcryptIoUring => "ucrypt (FUSE io_uring)",
            Target::UcryptWriteback => "ucrypt (FUSE classic, cache=writeback)",
            Target::QemuStorageDaemon => "qemu-storage-daemon luks (FUSE)",
        }
    }
}

#[derive(Serialize)]
pub struct Row {
    pub job: Job,
    pub target: Target,
    pub mib_s: Summary,
    pub lat_p99_us: Summary,
    /// The FUSE server's CPU time per request, µs (all its threads; the plain file: NaN).
    pub server_cpu_us_per_req: Summary,
    /// The server's CPU seconds per wall second (cores it kept busy).
    pub server_cpu_cores: Summary,
}

#[derive(Serialize)]
pub struct FuseReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub runs: usize,
    pub runtime_s: f64,
    pub skipped: Vec<String>,
    /// Where the images of the disk jobs were (None: the disk jobs did not run, see skipped).
    pub disk_image_dir: Option<String>,
    pub rows: Vec<Row>,
}

/// The benchmark's files (in /dev/shm, or on disk), removed on drop: a LUKS1 image made by
/// cryptsetup (aes-xts-plain64), its passphrase and volume key in files, and a plain file of
/// the same size (`bench vhost` serves them too).
pub(crate) struct Setup {
    pub(crate) dir: PathBuf,
    pub(crate) image: PathBuf,
    key_file: PathBuf,
    pub(crate) pass_file: PathBuf,
    pub(crate) payload_sectors: u64,
    pub(crate) plain: PathBuf,
    pub(crate) volume_bytes: u64,
}

impl Setup {
    /// The images in a new directory under `base` named after `scenario`: `volume_bytes` of
    /// plaintext each, filled with data first when `fill` (on disk, where reading a hole costs
    /// nothing).
    pub(crate) fn new(
        base: &Path,
        scenario: &str,
        volume_bytes: u64,
        fill: bool,
    ) -> Result<Setup, String> {
        let dir = crate::disk::run_dir(base, scenario)?;
        let mut s = Setup {
            image: dir.join("luks1.img"),
            key_file: dir.join("volume.key"),
            pass_file: dir.join("pass"),
            plain: dir.join("plain.img"),
            payload_sectors: 0,
            volume_bytes,
            dir,
        };
        std::fs::write(&s.pass_file, PASSPHRASE).map_err(|e| e.to_string())?;
        // LUKS1 header + key material fit in 2 MiB (cryptsetup's default payload offset).
        let image_bytes = volume_bytes + HEADER_ROOM_BYTES;
        if fill {
            write_noise(&s.image, image_bytes)?;
            write_noise(&s.plain, volume_bytes)?;
        } else {
            let f = std::fs::File::create(&s.image).map_err(|e| e.to_string())?;
            f.set_len(image_bytes).map_err(|e| e.to_string())?;
            std::fs::File::create(&s.plain)
                .and_then(|f| f.set_len(volume_bytes))
                .map_err(|e| e.to_string())?;
        }
        run_ok(
            Command::new("cryptsetup")
                .args([
                    "luksFormat",
                    "--type",
                    "luks1",
                    "-q",
                    "--pbkdf-force-iterations",
                    "1000",
                    "--key-file",
                ])
                .arg(&s.pass_file)
                .arg(&s.image),
        )?;
        let dump = run_ok(
            Command::new("cryptsetup")
                .args(["luksDump", "--dump-volume-key", "-q", "--key-file"])
                .arg(&s.pass_file)
                .arg(&s.image),
        )?;
        let payload = dump
            .lines()
            .find_map(|l| l.strip_prefix("Payload offset:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or("luksDump printed no payload offset")?;
        let key = mk_dump(&dump)?;
        std::fs::write(&s.key_file, key).map_err(|e| e.to_string())?;
        s.payload_sectors = payload;
        Ok(s)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The volume key in `luksDump --dump-volume-key` output ("MK dump:" and hex byte pairs).
fn mk_dump(text: &str) -> Result<Vec<u8>, String> {
    let start = text.find("MK dump:").ok_or("luksDump printed no MK dump")? + "MK dump:".len();
    let mut bytes = Vec::new();
    for (i, line) in text[start..].lines().enumerate() {
        if i > 0 && !line.starts_with(char::is_whitespace) {
            break;
        }
        for tok in line.split_whitespace() {
            bytes.push(u8::from_str_radix(tok, 16).map_err(|_| format!("bad key byte {tok:?}"))?);
        }
    }
    Ok(bytes)
}

/// A FUSE server process; unmounted and reaped on drop.
struct Server {
    child: Child,
    mountpoint: PathBuf,
}

impl Server {
    fn start(target: Target, s: &Setup, mountpoint: &Path) -> Result<Server, String> {
        std::fs::write(mountpoint, b"").map_err(|e| e.to_string())?;
        let mut cmd = match target {
            Target::Ucrypt | Target::UcryptIoUring | Target::UcryptWriteback => {
                let mut c = Command::new(crate::ucrypt_bin()?);
                c.arg("mount").arg(&s.image).arg(mountpoint);
                c.arg("--fuse-transport")
                    .arg(if target == Target::UcryptIoUring {
                        "io-uring"
                    } else {
                        "classic"
                    });
                if target == Target::UcryptWriteback {
                    c.args(["--cache", "writeback"]);
                }
                // Direct I/O (FOPEN_DIRECT_IO with parallel direct writes): fio opens O_DIRECT, and
                // without it the kernel serialises writes to a FUSE file.
                c.args([
                    "--cipher",
                    "aes-xts-plain64",
                    "--sector-size",
                    "512",
                    "--direct-io",
                ]);
                c.arg("--volume-key-file").arg(&s.key_file);
                c.arg("--offset").arg(s.payload_sectors.to_string());
                c
            }
            Target::QemuStorageDaemon => {
                let mut c = Command::new("qemu-storage-daemon");
                c.arg("--object")
                    .arg(format!("secret,id=s0,file={}", s.pass_file.display()));
                c.arg("--blockdev").arg(format!(
                    "driver=file,node-name=f0,filename={}",
                    s.image.display()
                ));
                c.arg("--blockdev")
                    .arg("driver=luks,node-name=l0,file=f0,key-secret=s0");
                c.arg("--export").arg(format!(
                    "type=fuse,id=e0,node-name=l0,mountpoint={},writable=on",
                    mountpoint.display()
                ));
                c
            }
            Target::Plain => return Err("the plain target has no server".into()),
        };
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{}: {e}", target.name()))?;
        let server = Server {
            child,
            mountpoint: mountpoint.to_path_buf(),
        };
        let t = Instant::now();
        while t.elapsed() < MOUNT_WAIT {
            if std::fs::metadata(mountpoint)
                .map(|m| m.len() >= s.volume_bytes)
                .unwrap_or(false)
            {
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "{} did not mount within {MOUNT_WAIT:?}",
            target.name()
        ))
    }
}

/// Unmounts a FUSE server's mount and waits up to 10 s for the server to exit, then kills it.
pub(crate) fn unmount_and_reap(mountpoint: &std::path::Path, child: &mut std::process::Child) {
    let _ = Command::new("fusermount3")
        .arg("-u")
        .arg(mountpoint)
        .stderr(Stdio::null())
        .status();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Server {
    fn drop(&mut self) {
        unmount_and_reap(&self.mountpoint, &mut self.child);
    }
}

/// One fio run: its result, the server's busy cores, its CPU µs per request.
type Sample = (FioResult, f64, f64);

/// One set of images with the servers and jobs that run on it.
struct Part {
    setup: Setup,
    targets: Vec<Target>,
    jobs: &'static [Job],
}

pub fn measure(runs: usize, quick: bool, progress: bool) -> Result<FuseReport, String> {
    for (p, pkg) in [
        ("fio", "fio"),
        ("cryptsetup", "cryptsetup-bin"),
        ("fusermount3", "fuse3"),
    ] {
        if !have(p) {
            return Err(format!("{p} not found (apt-get install {pkg})"));
        }
    }
    // fio itself takes a good part of a second to start and stop: --quick keeps the timed
    // part short too.
    let runtime_s = if quick { 0.5 } else { 3.0 };
    let mut skipped = Vec::new();
    let mut targets = vec![Target::Plain, Target::Ucrypt];
    match ucrypt_fuse::io_uring_availability() {
        Ok(()) => targets.push(Target::UcryptIoUring),
        Err(r) => skipped.push(format!("ucrypt (FUSE io_uring): {r}")),
    }
    let has_qsd = have("qemu-storage-daemon");
    if has_qsd {
        targets.push(Target::QemuStorageDaemon);
    } else {
        skipped.push(
            "qemu-storage-daemon luks (FUSE): not installed (apt-get install qemu-system-common)"
                .into(),
        );
    }
    let mut parts = vec![Part {
        setup: Setup::new(Path::new("/dev/shm"), "fuse", VOLUME_BYTES, false)?,
        targets,
        jobs: JOBS,
    }];
    let mut disk_image_dir = None;
    match disk_dir() {
        Ok(dir) => {
            if progress {
                eprintln!("bench fuse: preparing images on disk ({})", dir.display());
            }
            disk_image_dir = Some(dir.display().to_string());
            parts.push(Part {
                setup: Setup::new(&dir, "fuse", DISK_VOLUME_BYTES, true)?,
                targets: DISK_TARGETS
                    .iter()
                    .copied()
                    .filter(|&t| has_qsd || t != Target::QemuStorageDaemon)
                    .collect(),
                jobs: DISK_JOBS,
            });
        }
        Err(e) => skipped.push(e),
    }
    // samples[part][target][job]
    let mut samples: Vec<Vec<Vec<Vec<Sample>>>> = parts
        .iter()
        .map(|p| vec![vec![Vec::new(); p.jobs.len()]; p.targets.len()])
        .collect();
    for run in 0..runs {
        for (part, samples) in parts.iter().zip(samples.iter_mut()) {
            let mountpoint = part.setup.dir.join("export");
            for (ti, &target) in part.targets.iter().enumerate() {
                if progress {
                    eprintln!("bench fuse: run {}/{runs}: {}", run + 1, target.name());
                }
                let (server, file) = match target {
                    Target::Plain => (None, part.setup.plain.clone()),
                    _ => (
                        Some(Server::start(target, &part.setup, &mountpoint)?),
                        mountpoint.clone(),
                    ),
                };
                for (ji, job) in part.jobs.iter().enumerate() {
                    let watch = server
                        .as_ref()
                        .map(|s| CpuWatch::start(s.child.id() as libc::pid_t));
                    let r = fio::run_for(
                        job,
                        &file,
                        part.setup.volume_bytes,
                        Duration::from_secs_f64(runtime_s),
                        Duration::ZERO,
                        true,
                        None,
                    )?;
                    let (cores, per_req) = watch.map_or((f64::NAN, f64::NAN), |w| w.stop(r.iops));
                    samples[ti][ji].push((r, cores, per_req));
                }
            }
        }
    }
    let mut rows = Vec::new();
    for (part, samples) in parts.iter().zip(samples.iter()) {
        for (ji, job) in part.jobs.iter().enumerate() {
            for (ti, &target) in part.targets.iter().enumerate() {
                let s = &samples[ti][ji];
                rows.push(Row {
                    job: *job,
                    target,
                    mib_s: Summary::of(&s.iter().map(|r| r.0.mib_s).collect::<Vec<_>>()),
                    lat_p99_us: Summary::of(&s.iter().map(|r| r.0.lat_p99_us).collect::<Vec<_>>()),
                    server_cpu_us_per_req: Summary::of(&s.iter().map(|r| r.2).collect::<Vec<_>>()),
                    server_cpu_cores: Summary::of(&s.iter().map(|r| r.1).collect::<Vec<_>>()),
                });
            }
        }
    }
    Ok(FuseReport {
        schema: 1,
        machine: Machine::detect(),
        runs,
        runtime_s,
        skipped,
        disk_image_dir,
        rows,
    })
}

pub fn markdown(r: &FuseReport) -> String {
    let mut s = format!(
        "Machine: {}. fio --direct=1 on the exported file, {} s per job, {} round-robin runs; MiB/s median (min–max).\n\n",
        r.machine.describe(),
        r.runtime_s,
        r.runs
    );
    let find = |job: &str, t: Target| r.rows.iter().find(|x| x.job.name == job && x.target == t);
    s.push_str("| job | plain tmpfs | ucrypt classic | ucrypt io_uring | qemu-storage-daemon luks | classic ÷ qsd | io_uring ÷ qsd | p99 µs classic / io_uring / qsd |\n");
    s.push_str("|---|---|---|---|---|---|---|---|\n");
    for job in JOBS {
        let cell = |t| {
            find(job.name, t)
                .map(|x| x.mib_s.show(0))
                .unwrap_or_else(|| "–".into())
        };
        let p99 = |t| {
            find(job.name, t)
                .map(|x| format!("{:.0}", x.lat_p99_us.median))
                .unwrap_or_else(|| "–".into())
        };
        let ratio = |t| match (find(job.name, t), find(job.name, Target::QemuStorageDaemon)) {
            (Some(u), Some(q)) => format!("{:.2}", u.mib_s.median / q.mib_s.median),
            _ => "–".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} / {} |\n",
            job.name,
            cell(Target::Plain),
            cell(Target::Ucrypt),
            cell(Target::UcryptIoUring),
            cell(Target::QemuStorageDaemon),
            ratio(Target::Ucrypt),
            ratio(Target::UcryptIoUring),
            p99(Target::Ucrypt),
            p99(Target::UcryptIoUring),
            p99(Target::QemuStorageDaemon)
        ));
    }
    s.push_str(
        "\nServer CPU per request, µs (median; all the FUSE server's threads), and in \
         parentheses the cores it kept busy:\n\n| job | ucrypt classic | ucrypt io_uring | \
         qemu-storage-daemon luks |\n|---|---|---|---|\n",
    );
    for job in JOBS {
        let cpu = |t| {
            find(job.name, t)
                .filter(|x| x.server_cpu_us_per_req.median.is_finite())
                .map(|x| {
                    format!(
                        "{:.1} ({:.2})",
                        x.server_cpu_us_per_req.median, x.server_cpu_cores.median
                    )
                })
                .unwrap_or_else(|| "–".into())
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            job.name,
            cpu(Target::Ucrypt),
            cpu(Target::UcryptIoUring),
            cpu(Target::QemuStorageDaemon)
        ));
    }
    if let Some(dir) = &r.disk_image_dir {
        s.push_str(&format!(
            "\nOn disk: copies of the images in {dir} ({}), {} MiB of each filled with data \
             first; fio --direct=1 on the exported file (on the plain file: O_DIRECT to the \
             disk), the 1 MiB writes each followed by fdatasync. MiB/s median (min–max):\n\n\
             | job | plain disk file | ucrypt cache=none | ucrypt cache=writeback | \
             qemu-storage-daemon luks | none ÷ qsd | writeback ÷ qsd | server CPU µs/request \
             none / writeback / qsd |\n|---|---|---|---|---|---|---|---|\n",
            fs_type(Path::new(dir)).unwrap_or_else(|| "file system unknown".into()),
            DISK_VOLUME_BYTES >> 20
        ));
        for job in DISK_JOBS {
            let cell = |t| {
                find(job.name, t)
                    .map(|x| x.mib_s.show(0))
                    .unwrap_or_else(|| "–".into())
            };
            let ratio = |t| match (find(job.name, t), find(job.name, Target::QemuStorageDaemon)) {
                (Some(u), Some(q)) => format!("{:.2}", u.mib_s.median / q.mib_s.median),
                _ => "–".into(),
            };
            let cpu = |t| {
                find(job.name, t)
                    .filter(|x| x.server_cpu_us_per_req.median.is_finite())
                    .map(|x| format!("{:.1}", x.server_cpu_us_per_req.median))
                    .unwrap_or_else(|| "–".into())
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} / {} / {} |\n",
                job.name,
                cell(Target::Plain),
                cell(Target::Ucrypt),
                cell(Target::UcryptWriteback),
                cell(Target::QemuStorageDaemon),
                ratio(Target::Ucrypt),
                ratio(Target::UcryptWriteback),
                cpu(Target::Ucrypt),
                cpu(Target::UcryptWriteback),
                cpu(Target::QemuStorageDaemon)
            ));
        }
    }
    for sk in &r.skipped {
        s.push_str(&format!("\nSkipped: {sk}\n"));
    }
    s
}
