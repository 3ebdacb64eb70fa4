//! `ucrypt bench vhost`: a VM's encrypted disk over vhost-user-blk, side by side in one boot of
//! the test VM (tests/vm/, through the test kit, tests/kit/vm.rs; qemu TCG, 2 vCPUs). Four
//! disks of 2 queues each, every backend bypassing the host's page cache, three of them
//! vhost-user-blk:
//!
//! - `ucrypt vhost` on a LUKS1 image (aes-xts-plain64, made by cryptsetup; `--cache none`, its
//!   default);
//! - qemu-storage-daemon's vhost-user-blk export over its `luks` driver on a copy of that image
//!   (`cache.direct=on`);
//! - qemu-storage-daemon's export of a plain file: the unencrypted ceiling;
//!
//! and the way a VM reaches ucrypt without vhost-user: `ucrypt serve` of another copy of the
//! LUKS1 image over a unix socket, attached with qemu's NBD client as a virtio-blk disk (a
//! socket round trip and a copy per request; two servers may not write one image).
//!
//! The images are sparse files on the machine's disk ([`disk_dir`]). fio runs in the guest
//! (libaio, O_DIRECT, the same arguments as the host-side scenarios, [`fio::args`]): 4 KiB
//! random reads and writes at QD1 and at QD32 (2 jobs × 16), 1 MiB sequential writes and reads
//! at QD4. Each round runs every job on the four disks in turn, the order rotating by round;
//! cells are medians over rounds, ratios are taken within a round.
//!
//! Under TCG the emulated guest limits every disk, so the report also gives each backend's own
//! CPU time per request: the guest writes a line to a file in the share (9p) before and after
//! each fio run, and a host thread reads the backend's utime + stime ([`process_cpu_s`]) at
//! each new line ([`sample_phases`]). CPU per request is the difference ÷ the requests fio
//! completed (its IOPS × the runtime). For the NBD disk that is `ucrypt serve`'s CPU alone: the
//! NBD client's runs in qemu, as the virtqueue work of the other three runs in their backends.
//!
//! The goals (issue 45), checked as targets beside a ceiling measured in the same run
//! ([`crate::engine::targets_table`]): per job, ucrypt's throughput ÷ qemu-storage-daemon
//! luks's ≥ 1.0 (ceiling: the unencrypted export's ÷ qemu-storage-daemon luks's); per 1 MiB
//! job, ucrypt ÷ the unencrypted export ≥ 0.9 (ceiling: the limit of [`crate::limit`], the
//! unencrypted export's throughput with the cipher's cost on every core added, ÷ the
//! unencrypted export's; the cipher, AES-XTS with the volume's 512-byte sectors, is measured on
//! the host before and after the VM); backend CPU per 4 KiB request (over the four
//! 4 KiB jobs), qemu-storage-daemon luks's ÷ ucrypt's ≥ 2, that is ucrypt ≤ 0.5× (no
//! ceiling: the unencrypted export's CPU does not bound an encrypting backend's). The NBD disk
//! has no goal: its rows and its ratio to qemu-storage-daemon luks show what vhost-user saves.
//!
//! A SIGINT, SIGTERM or SIGHUP stops the VM and the servers and removes the images
//! ([`crate::interrupt`]); so does an error on the way (the servers and images close on drop).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cmd::{have, run_ok};
use crate::cpu::process_cpu_s;
use crate::disk::disk_dir;
use crate::engine::{target, targets_table, TargetCheck};
use crate::fio::{self, Job};
use crate::fuse::Setup;
use crate::interrupt;
use crate::kit;
use crate::limit;
use crate::server::Server;
use crate::stats::{loadavg, Machine, Summary};

const JOBS: &[Job] = &[
    Job::new("4k randread QD1", "randread", 4096, "libaio", 1),
    Job::new("4k randwrite QD1", "randwrite", 4096, "libaio", 1),
    Job::new("4k randread", "randread", 4096, "libaio", 16).jobs("4k randread QD32 (2×16)", 2),
    Job::new("4k randwrite", "randwrite", 4096, "libaio", 16).jobs("4k randwrite QD32 (2×16)", 2),
    Job::new("1M write QD4", "write", 1 << 20, "libaio", 4),
    Job::new("1M read QD4", "read", 1 << 20, "libaio", 4),
];
/// Plaintext bytes of each disk fio covers (and of ucrypt's volume).
const VOLUME_BYTES: u64 = 256 << 20;
/// What each disk after ucrypt's vhost-user one adds to the size of the one before: the guest
/// tells the disks apart by size (virtio's probe order is not the command line's).
const SIZE_STEP_BYTES: u64 = 4 << 20;
const QUEUES: u32 = 2;
/// The LUKS1 volume's encryption sectors (LUKS1 has no other), for the cipher of the limit.
const VOLUME_SECTOR: ucrypt::sector::SectorSize = ucrypt::sector::SectorSize::S512;
const GUEST_CPUS: u32 = 2;
const GUEST_MEM_MB: u32 = 1024;
/// How long a backend may take to listen.
const READY_WAIT: Duration = Duration::from_secs(30);
/// How often the host looks at the guest's phase file.
const PHASE_POLL: Duration = Duration::from_millis(10);
/// The guest's boot, and each fio run's start and end under TCG, beside its runtime (seconds).
const VM_BOOT_S: u32 = 180;
const FIO_OVERHEAD_S: u32 = 15;
/// The time limit's allowance for a host shared with other work.
const VM_BUSY_HOST_SLOWDOWN: u32 = 2;
/// The guest prints a line per fio run: this much silence is a hang.
const VM_SILENCE_MAX_S: u32 = 300;
/// The goals of issue 45 (see the module documentation).
const GOAL_VS_QSD: f64 = 1.0;
const GOAL_VS_CEILING_1M: f64 = 0.9;
const GOAL_CPU_QSD_OVER_UCRYPT: f64 = 2.0;

/// The four disks, in the order of the guest's `d0` … `d3`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    Ucrypt,
    QsdLuks,
    QsdRaw,
    /// `ucrypt serve` behind qemu's NBD client.
    UcryptNbd,
}

/// How many disks the VM has.
const DISKS: usize = 4;

const BACKENDS: [Backend; DISKS] = [
    Backend::Ucrypt,
    Backend::QsdLuks,
    Backend::QsdRaw,
    Backend::UcryptNbd,
];

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Ucrypt => "ucrypt vhost",
            Backend::QsdLuks => "qemu-storage-daemon luks",
            Backend::QsdRaw => "qemu-storage-daemon raw (unencrypted ceiling)",
            Backend::UcryptNbd => "ucrypt serve over NBD (qemu's NBD client)",
        }
    }

    /// The size step of its disk (see [`SIZE_STEP_BYTES`]) and the prefix of its files.
    fn tag(self) -> (u64, &'static str) {
        match self {
            Backend::Ucrypt => (0, "u"),
            Backend::QsdLuks => (1, "q"),
            Backend::QsdRaw => (2, "r"),
            Backend::UcryptNbd => (3, "n"),
        }
    }
}

#[derive(Serialize)]
pub struct Row {
    pub job: Job,
    pub backend: Backend,
    pub mib_s: Summary,
    pub iops: Summary,
    pub lat_p99_us: Summary,
    /// The backend's CPU time (all its threads) per request, µs.
    pub cpu_us_per_req: Summary,
}

/// A quotient of two backends' throughput on one job, taken round by round.
#[derive(Serialize)]
pub struct Ratio {
    pub job: &'static str,
    /// "ucrypt ÷ qsd luks", "qsd raw ÷ qsd luks", "ucrypt nbd ÷ qsd luks", "ucrypt ÷ ucrypt
    /// nbd", "ucrypt ÷ qsd raw".
    pub what: &'static str,
    pub ratio: Summary,
}

#[derive(Serialize)]
pub struct Cpu4k {
    pub backend: Backend,
    /// CPU time over the four 4 KiB jobs of a round ÷ their requests, µs.
    pub cpu_us_per_req: Summary,
}

#[derive(Serialize)]
pub struct VhostReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub quick: bool,
    pub runs: usize,
    pub runtime_s: f64,
    /// Why nothing was measured (None: it ran).
    pub skipped: Option<String>,
    pub guest_cpus: u32,
    pub queues: u32,
    /// The host's /proc/loadavg before and after the VM.
    pub host_load_before: String,
    pub host_load_after: String,
    pub vm_seconds: f64,
    pub rows: Vec<Row>,
    pub ratios: Vec<Ratio>,
    pub cpu_4k: Vec<Cpu4k>,
    /// AES-XTS with the volume's sectors on every core at once, MiB/s, measured on the host
    /// just before and just after the VM: the cipher of the 1 MiB jobs' limit.
    pub cipher_x_cores_mib_s: Summary,
    pub targets: Vec<TargetCheck>,
}

/// Why the scenario cannot run here, or None.
fn missing() -> Option<String> {
    for (p, pkg) in [
        ("qemu-storage-daemon", "qemu-system-common"),
        ("fio", "fio"),
        ("cryptsetup", "cryptsetup-bin"),
    ] {
        if !have(p) {
            return Some(format!("{p} not found (apt-get install {pkg})"));
        }
    }
    if on_path("fio").is_none() {
        return Some("fio is not a file on PATH (the VM copies it in)".into());
    }
    kit::vm::vm_missing()
}

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// The images and the backends serving them, stopped on drop (servers before files).
struct Rig {
    servers: Vec<Server>,
    /// Each disk's size in 512-byte sectors as the guest sees it, in [`BACKENDS`] order.
    sectors: [u64; DISKS],
    socks: Vec<PathBuf>,
    /// The LUKS1 image each encrypted backend serves (its own copy but ucrypt vhost's).
    images: Vec<PathBuf>,
    setup: Setup,
}

impl Rig {
    fn start(base: &Path) -> Result<Rig, String> {
        let setup = Setup::new(base, "vhost", VOLUME_BYTES, false)?;
        let image_bytes = std::fs::metadata(&setup.image)
            .map_err(|e| format!("{}: {e}", setup.image.display()))?
            .len();
        let luks_sectors = image_bytes / 512 - setup.payload_sectors;
        let grow = |p: &Path, bytes: u64| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .and_then(|f| f.set_len(bytes))
                .map_err(|e| format!("{}: {e}", p.display()))
        };
        // Each disk is larger than ucrypt vhost's by its steps: the sizes the guest tells them
        // apart by. The other encrypted backends serve copies (a LUKS1 image's payload grows
        // with its file); the plain file is the payload alone.
        let mut images = Vec::new();
        let mut sectors = [0; DISKS];
        for (i, b) in BACKENDS.into_iter().enumerate() {
            let (steps, tag) = b.tag();
            let step_bytes = steps * SIZE_STEP_BYTES;
            sectors[i] = luks_sectors + step_bytes / 512;
            let image = match b {
                Backend::Ucrypt => setup.image.clone(),
                Backend::QsdRaw => {
                    grow(&setup.plain, luks_sectors * 512 + step_bytes)?;
                    setup.plain.clone()
                }
                Backend::QsdLuks | Backend::UcryptNbd => {
                    let copy = setup.dir.join(format!("{tag}-luks1.img"));
                    run_ok(
                        Command::new("cp")
                            .arg("--sparse=always")
                            .arg(&setup.image)
                            .arg(&copy),
                    )?;
                    grow(&copy, image_bytes + step_bytes)?;
                    copy
                }
            };
            images.push(image);
        }
        let socks = BACKENDS
            .iter()
            .map(|b| setup.dir.join(format!("{}.sock", b.tag().1)))
            .collect();
        let mut rig = Rig {
            servers: Vec::new(),
            sectors,
            socks,
            images,
            setup,
        };
        for b in BACKENDS {
            interrupt::check()?;
            let cmd = rig.command(b)?;
            let i = b as usize;
            let log = rig.setup.dir.join(format!("backend{i}.log"));
            let s = Server::start(cmd, &rig.socks[i], &log, b.name(), READY_WAIT)?;
            rig.servers.push(s);
        }
        Ok(rig)
    }

    fn command(&self, b: Backend) -> Result<Command, String> {
        let s = &self.setup;
        let (sock, image) = (&self.socks[b as usize], &self.images[b as usize]);
        let export = |node: &str| {
            format!(
                "type=vhost-user-blk,id=e0,node-name={node},addr.type=unix,addr.path={},\
                 writable=on,num-queues={QUEUES}",
                sock.display()
            )
        };
        let file = format!(
            "driver=file,node-name=f0,filename={},cache.direct=on",
            image.display()
        );
        let mut c;
        match b {
            Backend::Ucrypt | Backend::UcryptNbd => {
                c = Command::new(crate::ucrypt_bin()?);
                if b == Backend::Ucrypt {
                    c.arg("vhost").arg(image).arg("--socket").arg(sock);
                    c.args(["--queues", &QUEUES.to_string()]);
                } else {
                    c.arg("serve").arg(image);
                    c.arg("--nbd").arg(format!("unix:{}", sock.display()));
                }
                c.arg("--key-file").arg(&s.pass_file);
            }
            Backend::QsdLuks => {
                c = Command::new("qemu-storage-daemon");
                c.arg("--object")
                    .arg(format!("secret,id=s0,file={}", s.pass_file.display()));
                c.arg("--blockdev").arg(file);
                c.arg("--blockdev")
                    .arg("driver=luks,node-name=l0,file=f0,key-secret=s0");
                c.arg("--export").arg(export("l0"));
            }
            Backend::QsdRaw => {
                c = Command::new("qemu-storage-daemon");
                c.arg("--blockdev").arg(file);
                c.arg("--export").arg(export("f0"));
            }
        }
        Ok(c)
    }

    fn pids(&self) -> [libc::pid_t; DISKS] {
        std::array::from_fn(|i| self.servers[i].pid())
    }
}

/// The guest's part: finds the disks by size, then runs every job on each disk per round,
/// appending `B SIDE JOB ROUND` and `E SIDE JOB ROUND` lines to the share's `phase` file around
/// each fio run and writing fio's JSON into `out/`.
fn script(sectors: [u64; DISKS], runs: usize, runtime: Duration) -> String {
    let mut s = String::from("set -e\nfor b in /sys/block/vd*; do\n  case $(cat $b/size) in\n");
    for (i, n) in sectors.iter().enumerate() {
        s += &format!("    {n}) d{i}=/dev/${{b##*/}};;\n");
    }
    s += "  esac\ndone\n\
          echo \"disks: ucrypt=$d0 qsd-luks=$d1 qsd-raw=$d2 ucrypt-nbd=$d3\"\n\
          [ -n \"$d0\" ] && [ -n \"$d1\" ] && [ -n \"$d2\" ] && [ -n \"$d3\" ]\n\
          mkdir -p /mnt/host/out\n\
          run() {\n  \
            s=$1; j=$2; r=$3; d=$4; shift 4\n  \
            o=/mnt/host/out/s$s-j$j-r$r\n  \
            echo \"B $s $j $r\" >> /mnt/host/phase\n  \
            /usr/local/sbin/fio \"$@\" --filename=$d --output=$o.json 2>$o.err || echo \"@@FAIL s$s j$j r$r\"\n  \
            echo \"E $s $j $r\" >> /mnt/host/phase\n  \
            echo \"@@DONE s$s j$j r$r\"\n\
          }\n";
    for r in 0..runs {
        for (j, job) in JOBS.iter().enumerate() {
            let args = fio::args(job, VOLUME_BYTES, runtime, Duration::ZERO, true).join(" ");
            for k in 0..BACKENDS.len() {
                let side = (k + r) % BACKENDS.len();
                s += &format!("run {side} {j} {r} $d{side} {args}\n");
            }
        }
    }
    s + "echo VHOST-BENCH-DONE\n"
}

/// A line of the guest's phase file and each backend's CPU seconds when the host saw it.
struct Mark {
    text: String,
    cpu: [Option<f64>; DISKS],
}

/// Reads the lines the guest appends to the phase file, every [`PHASE_POLL`] until `done`:
/// each new line, with the backends' CPU times then. A backend is idle between fio runs, and
/// fio takes far longer than a poll to start in the guest, so a late look costs nothing.
fn sample_phases(file: &Path, pids: [libc::pid_t; DISKS], done: &AtomicBool) -> Vec<Mark> {
    let mut marks: Vec<Mark> = Vec::new();
    let mut seen = 0;
    while !done.load(Ordering::Relaxed) {
        let text = std::fs::read(file).unwrap_or_default();
        let new = text.get(seen..).unwrap_or_default();
        if let Some(end) = new.iter().rposition(|&b| b == b'\n') {
            let cpu = pids.map(process_cpu_s);
            for line in String::from_utf8_lossy(&new[..end]).lines() {
                marks.push(Mark {
                    text: line.trim().to_string(),
                    cpu,
                });
            }
            seen += end + 1;
        }
        std::thread::sleep(PHASE_POLL);
    }
    marks
}

/// The backend's CPU seconds over each fio run, by (side, job, round), from the marks.
fn cpu_per_run(marks: &[Mark]) -> HashMap<(usize, usize, usize), f64> {
    let mut begun = HashMap::new();
    let mut out = HashMap::new();
    for m in marks {
        let f: Vec<&str> = m.text.split_whitespace().collect();
        let [kind, s, j, r] = f[..] else { continue };
        let (Ok(s), Ok(j), Ok(r)) = (s.parse::<usize>(), j.parse(), r.parse()) else {
            continue;
        };
        let Some(cpu) = m.cpu.get(s).copied().flatten() else {
            continue;
        };
        match kind {
            "B" => {
                begun.insert((s, j, r), cpu);
            }
            "E" => {
                if let Some(b) = begun.get(&(s, j, r)) {
                    out.insert((s, j, r), cpu - b);
                }
            }
            _ => {}
        }
    }
    out
}

/// One fio run in the guest: its result and the backend's CPU seconds over it.
type Sample = (fio::FioResult, f64);

/// samples[job][side][round], from the share's `out/` and the CPU marks; an error naming
/// every run that failed.
fn collect(
    out: &Path,
    cpu: &HashMap<(usize, usize, usize), f64>,
    runs: usize,
) -> Result<Vec<Vec<Vec<Sample>>>, String> {
    let mut failures = Vec::new();
    let mut samples = vec![vec![Vec::new(); BACKENDS.len()]; JOBS.len()];
    for (j, job) in JOBS.iter().enumerate() {
        for s in 0..BACKENDS.len() {
            for r in 0..runs {
                let base = out.join(format!("s{s}-j{j}-r{r}"));
                let json = std::fs::read_to_string(base.with_extension("json")).unwrap_or_default();
                match fio::parse(&json, job.is_write()) {
                    Ok(res) => {
                        let c = cpu.get(&(s, j, r)).copied().unwrap_or(f64::NAN);
                        samples[j][s].push((res, c));
                    }
                    Err(e) => {
                        let err =
                            std::fs::read_to_string(base.with_extension("err")).unwrap_or_default();
                        failures.push(format!(
                            "{} on {} round {}: {e} {}",
                            job.name,
                            BACKENDS[s].name(),
                            r + 1,
                            err.trim()
                        ));
                    }
                }
            }
        }
    }
    if failures.is_empty() {
        Ok(samples)
    } else {
        Err(failures.join("\n"))
    }
}

/// Boots the VM with the four backends and measures; a report with `skipped` set where a tool
/// or the VM is missing here.
pub fn measure(runs: usize, quick: bool, progress: bool) -> Result<VhostReport, String> {
    let runtime = Duration::from_secs(if quick { 4 } else { 8 });
    let mut report = VhostReport {
        schema: 1,
        machine: Machine::detect(),
        quick,
        runs,
        runtime_s: runtime.as_secs_f64(),
        skipped: None,
        guest_cpus: GUEST_CPUS,
        queues: QUEUES,
        host_load_before: loadavg(),
        host_load_after: String::new(),
        vm_seconds: f64::NAN,
        rows: Vec::new(),
        ratios: Vec::new(),
        cpu_4k: Vec::new(),
        cipher_x_cores_mib_s: Summary::of(&[]),
        targets: Vec::new(),
    };
    let base = match missing().map_or_else(disk_dir, Err) {
        Ok(b) => b,
        Err(reason) => {
            report.skipped = Some(reason);
            return Ok(report);
        }
    };
    interrupt::catch_signals();
    let rig = Rig::start(&base)?;
    let share = rig.setup.dir.join("share");
    std::fs::create_dir_all(share.join("out")).map_err(|e| format!("{}: {e}", share.display()))?;
    let mut vm = kit::vm::VmRun::new(script(rig.sectors, runs, runtime));
    let nbd = Backend::UcryptNbd as usize;
    vm.vhosts = rig.socks[..nbd].to_vec();
    vm.nbds = vec![rig.socks[nbd].clone()];
    vm.vhost_queues = Some(QUEUES);
    vm.cpus = Some(GUEST_CPUS);
    vm.mem_mb = GUEST_MEM_MB;
    vm.share = Some(share.clone());
    vm.extra_bins = on_path("fio").into_iter().collect();
    vm.echo = false;
    let fio_runs = (runs * JOBS.len() * BACKENDS.len()) as u32;
    vm.timeout_s = VM_BUSY_HOST_SLOWDOWN
        * (VM_BOOT_S + fio_runs * (runtime.as_secs() as u32 + FIO_OVERHEAD_S));
    vm.silence_max_s = Some(VM_SILENCE_MAX_S);
    if progress {
        eprintln!(
            "ucrypt bench vhost: booting the VM ({fio_runs} fio runs of {} s; time limit {} s)",
            runtime.as_secs(),
            vm.timeout_s
        );
    }
    interrupt::check()?;
    let cipher_before = limit::cipher_x_cores_mib_s_at(limit::CIPHER_MEASURE, VOLUME_SECTOR);
    let done = AtomicBool::new(false);
    let t0 = Instant::now();
    let (out, marks) = std::thread::scope(|sc| {
        let (pids, phase, done) = (rig.pids(), share.join("phase"), &done);
        let sampler = sc.spawn(move || sample_phases(&phase, pids, done));
        let out = vm.run(&rig.setup.dir);
        done.store(true, Ordering::Relaxed);
        (out, sampler.join().unwrap_or_default())
    });
    report.vm_seconds = t0.elapsed().as_secs_f64();
    report.host_load_after = loadavg();
    let cipher_after = limit::cipher_x_cores_mib_s_at(limit::CIPHER_MEASURE, VOLUME_SECTOR);
    report.cipher_x_cores_mib_s = Summary::of(&[cipher_before, cipher_after]);
    interrupt::check()?;
    if progress {
        eprintln!("ucrypt bench vhost: VM done in {:.0} s", report.vm_seconds);
    }
    let samples = collect(&share.join("out"), &cpu_per_run(&marks), runs);
    if out.status != 0 || samples.is_err() {
        let tail: Vec<&str> = out.output.lines().rev().take(30).collect();
        return Err(format!(
            "the VM run failed (status {}): {}\nlast lines of its output:\n{}",
            out.status,
            samples.err().unwrap_or_default(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    fill(&mut report, &samples?);
    Ok(report)
}

/// The rows, ratios, CPU per 4 KiB request and targets from samples[job][side][round].
fn fill(report: &mut VhostReport, samples: &[Vec<Vec<Sample>>]) {
    let runtime_s = report.runtime_s;
    let per_req_us = |(r, cpu): &Sample| *cpu / (r.iops * runtime_s) * 1e6;
    let (u, q, w, n) = (
        Backend::Ucrypt as usize,
        Backend::QsdLuks as usize,
        Backend::QsdRaw as usize,
        Backend::UcryptNbd as usize,
    );
    for (job, per_side) in JOBS.iter().zip(samples) {
        for (&backend, s) in BACKENDS.iter().zip(per_side) {
            let of = |f: &dyn Fn(&Sample) -> f64| Summary::of(&s.iter().map(f).collect::<Vec<_>>());
            report.rows.push(Row {
                job: *job,
                backend,
                mib_s: of(&|x| x.0.mib_s),
                iops: of(&|x| x.0.iops),
                lat_p99_us: of(&|x| x.0.lat_p99_us),
                cpu_us_per_req: of(&per_req_us),
            });
        }
        let ratio = |a: usize, b: usize| {
            let v: Vec<f64> = per_side[a]
                .iter()
                .zip(&per_side[b])
                .map(|(x, y)| x.0.mib_s / y.0.mib_s)
                .collect();
            Summary::of(&v)
        };
        let (vs_qsd, ceiling) = (ratio(u, q), ratio(w, q));
        target(
            &mut report.targets,
            format!(
                "{}: ucrypt ÷ qsd luks throughput (allowed: qsd raw ÷ qsd luks)",
                job.name
            ),
            vs_qsd.median,
            GOAL_VS_QSD,
            Some(ceiling.median),
        );
        let mut ratios = vec![
            ("ucrypt ÷ qsd luks", vs_qsd),
            ("qsd raw ÷ qsd luks", ceiling),
            ("ucrypt nbd ÷ qsd luks", ratio(n, q)),
            ("ucrypt ÷ ucrypt nbd", ratio(u, n)),
        ];
        if job.block_bytes >= 1 << 20 {
            let vs_raw = ratio(u, w);
            // What the machine allows: each round's limit ÷ that round's unencrypted export.
            let cipher = report.cipher_x_cores_mib_s.median;
            let allowed: Vec<f64> = per_side[w]
                .iter()
                .map(|x| limit::limit(x.0.mib_s, cipher) / x.0.mib_s)
                .collect();
            target(
                &mut report.targets,
                format!(
                    "{}: ucrypt ÷ unencrypted (qsd raw) throughput (allowed: limit ÷ qsd raw)",
                    job.name
                ),
                vs_raw.median,
                GOAL_VS_CEILING_1M,
                Some(Summary::of(&allowed).median).filter(|a| a.is_finite()),
            );
            ratios.push(("ucrypt ÷ qsd raw", vs_raw));
        }
        for (what, ratio) in ratios {
            report.ratios.push(Ratio {
                job: job.name,
                what,
                ratio,
            });
        }
    }
    // Per round: CPU over the 4 KiB jobs ÷ their requests, per backend.
    let small: Vec<&Vec<Vec<Sample>>> = JOBS
        .iter()
        .zip(samples)
        .filter(|(j, _)| j.block_bytes == 4096)
        .map(|(_, s)| s)
        .collect();
    let rounds = samples.first().map_or(0, |s| s[0].len());
    let cpu_4k: Vec<Vec<f64>> = (0..BACKENDS.len())
        .map(|b| {
            (0..rounds)
                .map(|r| {
                    let (cpu, reqs) = small.iter().fold((0.0, 0.0), |(c, n), s| {
                        let (res, cpu) = &s[b][r];
                        (c + cpu, n + res.iops * runtime_s)
                    });
                    cpu / reqs * 1e6
                })
                .collect()
        })
        .collect();
    let quotient = |a: usize, b: usize| {
        let v: Vec<f64> = cpu_4k[a]
            .iter()
            .zip(&cpu_4k[b])
            .map(|(x, y)| x / y)
            .collect();
        Summary::of(&v).median
    };
    // No ceiling: the unencrypted export's CPU bounds nothing of an encrypting backend's
    // (ucrypt's per request is below it).
    target(
        &mut report.targets,
        "CPU per 4 KiB request: qsd luks ÷ ucrypt, i.e. ucrypt ≤ 0.5×".into(),
        quotient(q, u),
        GOAL_CPU_QSD_OVER_UCRYPT,
        None,
    );
    for (&backend, v) in BACKENDS.iter().zip(&cpu_4k) {
        report.cpu_4k.push(Cpu4k {
            backend,
            cpu_us_per_req: Summary::of(v),
        });
    }
}

pub fn markdown(r: &VhostReport) -> String {
    if let Some(why) = &r.skipped {
        return format!("SKIPPED: {why}\n");
    }
    let mut s = format!(
        "Machine: {}; load {} before, {} after. One qemu guest (TCG, {} vCPUs), disks of {} \
         queues: three vhost-user-blk (ucrypt vhost, qemu-storage-daemon luks and raw) and \
         ucrypt serve through qemu's NBD client (virtio-blk), every backend O_DIRECT on the \
         host; fio in the guest (libaio, direct), {} s per job, {} rounds ({:.0} s in the VM). \
         4 KiB rows: IOPS, 1 MiB rows: MiB/s; median (min–max); backend CPU µs per request, \
         median.\n\n\
         | job | ucrypt | qsd luks | qsd raw (ceiling) | ucrypt NBD | ucrypt ÷ qsd luks | \
         ucrypt ÷ raw | ucrypt NBD ÷ qsd luks | CPU µs/req ucrypt / qsd luks / raw / ucrypt NBD \
         |\n|---|---|---|---|---|---|---|---|---|\n",
        r.machine.describe(),
        r.host_load_before,
        r.host_load_after,
        r.guest_cpus,
        r.queues,
        r.runtime_s,
        r.runs,
        r.vm_seconds
    );
    for job in JOBS {
        let row = |b| {
            r.rows
                .iter()
                .find(|x| x.job.name == job.name && x.backend == b)
        };
        let cell = |b| match row(b) {
            Some(x) if job.block_bytes == 4096 => x.iops.show(0),
            Some(x) => x.mib_s.show(0),
            None => "–".into(),
        };
        let cpu = |b| row(b).map_or("–".into(), |x| format!("{:.1}", x.cpu_us_per_req.median));
        let ratio = |what| {
            r.ratios
                .iter()
                .find(|x| x.job == job.name && x.what == what)
                .map_or("–".into(), |x| x.ratio.show(2))
        };
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} / {} |\n",
            job.name,
            cell(Backend::Ucrypt),
            cell(Backend::QsdLuks),
            cell(Backend::QsdRaw),
            cell(Backend::UcryptNbd),
            ratio("ucrypt ÷ qsd luks"),
            ratio("ucrypt ÷ qsd raw"),
            ratio("ucrypt nbd ÷ qsd luks"),
            cpu(Backend::Ucrypt),
            cpu(Backend::QsdLuks),
            cpu(Backend::QsdRaw),
            cpu(Backend::UcryptNbd)
        );
    }
    s += "\nBackend CPU per 4 KiB request over the four 4 KiB jobs, µs: ";
    let cpu: Vec<String> = r
        .cpu_4k
        .iter()
        .map(|c| format!("{} {}", c.backend.name(), c.cpu_us_per_req.show(1)))
        .collect();
    s += &cpu.join("; ");
    s += &format!(
        ".\n\nThe 1 MiB jobs' limit: 1 / (1/qsd raw + 1/(cores × cipher)) per round, the cipher \
         AES-XTS with the volume's {}-byte sectors on every core at once, on the host before and \
         after the VM: {} MiB/s.\n",
        VOLUME_SECTOR.bytes(),
        r.cipher_x_cores_mib_s.show(0)
    );
    s + &targets_table(&r.targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host pairs each run's begin and end marks, per backend, and ignores what is not a
    /// mark (a torn read of the file).
    #[test]
    fn cpu_between_marks() {
        let mark = |text: &str, cpu: [f64; DISKS]| Mark {
            text: text.into(),
            cpu: cpu.map(Some),
        };
        let marks = [
            mark("B 1 0 0", [1.0, 2.0, 3.0, 4.0]),
            mark("E 1", [9.0, 9.0, 9.0, 9.0]),
            mark("E 1 0 0", [1.5, 2.75, 3.0, 4.0]),
            mark("B 0 2 1", [1.5, 2.75, 3.0, 4.0]),
            mark("E 0 2 1", [4.0, 2.75, 3.0, 4.0]),
            mark("B 3 1 0", [4.0, 2.75, 3.0, 4.0]),
            mark("E 3 1 0", [4.0, 2.75, 3.0, 4.25]),
            mark("E 2 0 0", [4.0, 2.75, 3.0, 4.25]),
        ];
        let c = cpu_per_run(&marks);
        assert_eq!(c.get(&(1, 0, 0)), Some(&0.75));
        assert_eq!(c.get(&(0, 2, 1)), Some(&2.5));
        assert_eq!(c.get(&(3, 1, 0)), Some(&0.25));
        assert_eq!(c.len(), 3, "{c:?}");
    }

    /// Every round runs every job on all four disks, each side first in turn.
    #[test]
    fn script_runs_each_job_on_each_disk() {
        let s = script([1, 2, 3, 4], 4, Duration::from_secs(1));
        let runs: Vec<&str> = s.lines().filter(|l| l.starts_with("run ")).collect();
        assert_eq!(runs.len(), 4 * JOBS.len() * DISKS);
        for r in 0..4 {
            assert!(runs[r * JOBS.len() * DISKS].starts_with(&format!("run {r} 0 {r} $d{r} ")));
        }
        assert!(s.contains("    3) d2=/dev/${b##*/};;"), "{s}");
        assert!(s.contains("    4) d3=/dev/${b##*/};;"), "{s}");
        // Job 2 (4 KiB random reads, 2 jobs × 16) on the first disk of round 0.
        assert!(
            runs[2 * DISKS].contains("--numjobs=2") && runs[2 * DISKS].contains("--iodepth=16")
        );
    }

    /// The disks' sizes differ (the guest finds each by its size) and grow by backend order.
    #[test]
    fn disk_size_steps_differ() {
        let steps: Vec<u64> = BACKENDS.iter().map(|b| b.tag().0).collect();
        assert_eq!(steps, [0, 1, 2, 3]);
        let tags: Vec<&str> = BACKENDS.iter().map(|b| b.tag().1).collect();
        assert_eq!(tags, ["u", "q", "r", "n"]);
        for (i, b) in BACKENDS.iter().enumerate() {
            assert_eq!(*b as usize, i);
        }
    }
}
