//! `ucrypt bench reencrypt --online`: key rotation while the volume serves fio, against the
//! reencryption issue's goals: fio's throughput during the rotation ÷ before it ≥ 0.5 (4 KiB
//! random reads at QD1, 1 MiB sequential reads at QD4), while the rotation itself proceeds at ≥
//! 0.5 of its offline speed (offline seconds ÷ online seconds ≥ 0.5).
//!
//! A LUKS2 file volume on disk (`/var/tmp`, so the rotation's reads, writes and flushes meet
//! the foreground's on a real device) is opened by the `ucrypt` binary ([`crate::ucrypt_bin`])
//! with `ucrypt open --front-end loop` (FUSE file + loop device, direct I/O) and filled. Each
//! round, in turn: the volume closed and rotated offline (`ucrypt reencrypt` on the file, timed),
//! opened again; then per fio job: the job alone (before), then the job while `ucrypt
//! reencrypt` hands a rotation to the daemon (during; the rotation's wall time is the verb's,
//! as offline: unlocks, init, hotzones, finalisation). Every rotation gives the volume a new
//! key, so the same volume serves every round.
//!
//! Throughput is counted by the daemon, not by fio: the bytes read between two `status`
//! requests on its control socket over the window (before: [`BEFORE`] after fio's I/O has
//! started; during: from the verb's start to its exit), so the window is the rotation's
//! exactly. fio is only the load. Each cell is the median (min–max) of the rounds; the ratios
//! are taken per round (during ÷ before of that round's job, offline ÷ online of that round),
//! then summarised. The whole scenario runs idle and with [`BUSY_THREADS`] busy threads
//! beside it (a shared host).
//!
//! The ceiling, in the same round: the same job while the work any rotation at ucrypt's pace
//! must do runs beside it without ucrypt ([`Rig::ceiling`]): fio moves what the rotation
//! moved, in the time it took, on the same disk (a file of the volume's size read and
//! written, sequential 4 MiB requests as the rotation's pieces, an fsync every
//! [`COPY_FSYNC_EVERY`] writes, each direction capped at the volume's size ÷ that round's
//! online seconds), and one thread does its CPU work at the same pace (SHA-256 per 4 KiB
//! block for the checksums, AES-XTS decrypt and encrypt: [`paced_rekey`]). Its during ÷
//! before is what a rotation at that speed leaves the foreground on this machine; ucrypt's ÷
//! the ceiling's is the share of it ucrypt keeps (target ≥ [`CEILING_TARGET`]).
//!
//! Needs root, `/dev/fuse`, `/dev/loop-control` and fio; without them the report says
//! `SKIPPED: reason` (exit 0).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::cmd::{have, run_ok};
use super::reencrypt::{xts_cipher, Busy};
use super::stats::{Machine, Summary};

/// Data bytes of the volume (the file adds the LUKS2 header).
const DATA_BYTES: u64 = 1 << 30;
const DATA_BYTES_QUICK: u64 = 128 << 20;
/// ucrypt's LUKS2 data offset for a default format.
const HEADER_BYTES: u64 = 16 << 20;
/// Where the volume file lives: on disk.
const DIR: &str = "/var/tmp";
const PASSPHRASE: &[u8] = b"bench-online-rotate";
const PBKDF2: [&str; 4] = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
/// The window of a "before" measurement.
const BEFORE: Duration = Duration::from_secs(5);
const BEFORE_QUICK: Duration = Duration::from_secs(1);
/// After fio's first bytes, before a window opens: fio and the queues settle.
const SETTLE: Duration = Duration::from_millis(300);
/// How long fio may take to start reading.
const START_WAIT: Duration = Duration::from_secs(20);
/// Threads that spin during the shared-host rows.
const BUSY_THREADS: usize = 2;
/// The goals: during ÷ before and offline ÷ online, each at least this.
const GOAL: f64 = 0.5;
/// The target of ucrypt's during ÷ before against the ceiling's.
const CEILING_TARGET: f64 = 0.9;
/// The ceiling copy's request: the rotation's largest piece (`reencrypt_online::PIECE_BYTES_MAX`).
const COPY_BS: &str = "4M";
/// The ceiling copy syncs every this many writes: a default 64 MiB hotzone is 16 pieces, and
/// the rotation flushes about twice per hotzone (resilience data, then the new data).
const COPY_FSYNC_EVERY: u32 = 8;
/// The ceiling's CPU work goes a piece of the rotation's size at a time.
const REKEY_CHUNK: usize = 4 << 20;

/// A fio job of the scenario: what runs on the device before and during the rotation.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Job {
    pub name: &'static str,
    rw: &'static str,
    bs: &'static str,
    ioengine: &'static str,
    iodepth: u32,
}

const JOBS: [Job; 2] = [
    Job {
        name: "4 KiB random read QD1",
        rw: "randread",
        bs: "4k",
        ioengine: "psync",
        iodepth: 1,
    },
    Job {
        name: "1 MiB read QD4",
        rw: "read",
        bs: "1M",
        ioengine: "libaio",
        iodepth: 4,
    },
];

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub job: &'static str,
    pub busy_threads: usize,
    pub before_mib_s: Summary,
    pub during_mib_s: Summary,
    /// During ÷ before, per round (goal ≥ 0.5).
    pub during_of_before: Summary,
    /// Wall seconds of the rotation under this job.
    pub online_s: Summary,
    /// Wall seconds of the offline rotation of the same volume (same rounds).
    pub offline_s: Summary,
    /// Offline ÷ online seconds, per round: the online rotation's speed as a share of the
    /// offline one's (goal ≥ 0.5).
    pub speed_of_offline: Summary,
    /// The job's MiB/s beside the ceiling (the rotation's I/O and CPU work at its pace, without
    /// ucrypt).
    pub ceiling_during_mib_s: Summary,
    /// The ceiling's during ÷ before, per round: what the machine leaves the job.
    pub ceiling_of_before: Summary,
    /// ucrypt's during ÷ before ÷ the ceiling's, per round (target ≥ 0.9).
    pub of_ceiling: Summary,
}

/// The two goals for one load (idle or busy).
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub busy_threads: usize,
    /// Every job's median during ÷ before ≥ 0.5.
    pub foreground_met: bool,
    /// Every job's median offline ÷ online ≥ 0.5.
    pub rotation_met: bool,
    /// Every job's median ÷ the ceiling ≥ 0.9.
    pub ceiling_met: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    /// Why nothing was measured (no root, FUSE, loop or fio), if so.
    pub skipped: Option<String>,
    pub volume: String,
    pub data_bytes: u64,
    pub hotzone_bytes: Option<u64>,
    pub runs: usize,
    /// /proc/loadavg's first three fields before and after the runs.
    pub load_before: String,
    pub load_after: String,
    pub rows: Vec<Row>,
    pub verdicts: Vec<Verdict>,
    pub notes: Vec<String>,
}

/// What is missing to run the scenario, if anything.
fn missing_rig() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (ucrypt open with FUSE + loop needs root)".into());
    }
    for dev in ["/dev/fuse", "/dev/loop-control"] {
        if !Path::new(dev).exists() {
            return Some(format!("{dev} missing"));
        }
    }
    if !have("fio") {
        return Some("fio not installed (apt-get install fio)".into());
    }
    None
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The open volume: its daemon's name and files; closed (forced) and removed on drop.
struct Rig {
    ucrypt: PathBuf,
    dir: PathBuf,
    img: PathBuf,
    key: PathBuf,
    name: String,
    open: bool,
    hotzone: Option<String>,
}

impl Rig {
    fn new(ucrypt: PathBuf, data: u64, hotzone: Option<u64>) -> Result<Rig, String> {
        let dir = crate::disk::run_dir(Path::new(DIR), "online")?;
        let mut r = Rig {
            ucrypt,
            img: dir.join("vol.img"),
            key: dir.join("key"),
            name: format!("bench-online-{}", std::process::id()),
            open: false,
            hotzone: hotzone.map(|h| h.to_string()),
            dir,
        };
        std::fs::write(&r.key, PASSPHRASE).map_err(|e| e.to_string())?;
        std::fs::File::create(&r.img)
            .and_then(|f| f.set_len(data + HEADER_BYTES))
            .map_err(|e| format!("{}: {e}", r.img.display()))?;
        run_ok(
            Command::new(&r.ucrypt)
                .args(["format", "-q"])
                .args(PBKDF2)
                .arg("--key-file")
                .arg(&r.key)
                .arg(&r.img),
        )?;
        r.open()?;
        // Every byte written once, so reads meet data (not holes) on the disk.
        run_ok(
            Command::new("fio")
                .args(["--name=fill", "--rw=write", "--bs=1M", "--iodepth=4"])
                .args(["--ioengine=libaio", "--direct=1", "--output=/dev/null"])
                .arg(format!("--filename={}", r.device().display())),
        )?;
        Ok(r)
    }

    fn device(&self) -> PathBuf {
        Path::new("/dev/ucrypt").join(&self.name)
    }

    fn open(&mut self) -> Result<(), String> {
        run_ok(
            Command::new(&self.ucrypt)
                .arg("open")
                .arg(&self.img)
                .arg(&self.name)
                .arg("--key-file")
                .arg(&self.key)
                .args(["--front-end", "loop"]),
        )?;
        self.open = true;
        Ok(())
    }

    fn close(&mut self) -> Result<(), String> {
        run_ok(Command::new(&self.ucrypt).arg("close").arg(&self.name))?;
        self.open = false;
        Ok(())
    }

    /// `ucrypt reencrypt` of the volume file: online when the daemon serves it, offline
    /// otherwise. Returns once it has finished; its wall seconds.
    fn rotate(&self) -> Result<f64, String> {
        let t = Instant::now();
        run_ok(self.rotate_cmd().stdout(Stdio::null()))?;
        Ok(t.elapsed().as_secs_f64())
    }

    fn rotate_cmd(&self) -> Command {
        let mut c = Command::new(&self.ucrypt);
        c.args(["reencrypt", "-q"]).args(PBKDF2);
        if let Some(h) = &self.hotzone {
            c.args(["--hotzone-size", h]);
        }
        c.arg("--key-file").arg(&self.key).arg(&self.img);
        c
    }

    /// Bytes the daemon has served to readers so far (its `status` over the control socket).
    fn read_bytes(&self) -> Result<u64, String> {
        let sock = Path::new("/run/ucrypt")
            .join(&self.name)
            .join("control.sock");
        let mut c = UnixStream::connect(&sock).map_err(|e| format!("{}: {e}", sock.display()))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        c.write_all(b"{\"v\":1,\"cmd\":\"status\"}\n")
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(c)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("status reply: {e}"))?;
        v["status"]["counters"]["read_bytes"]
            .as_u64()
            .ok_or_else(|| format!("status reply without read_bytes: {line}"))
    }

    /// Starts `job` on the device for as long as it takes (stopped by [`Fio::stop`]) and
    /// returns once its reads reach the daemon and have run for [`SETTLE`].
    fn fio(&self, job: &Job) -> Result<Fio, String> {
        let child = Command::new("fio")
            // --thread: the job runs in this process, so killing it stops the job (fio's job
            // processes would outlive their parent and keep reading).
            .args([
                "--name=job",
                "--thread",
                "--direct=1",
                "--time_based",
                "--runtime=3600",
            ])
            .args(["--randrepeat=0", "--norandommap", "--output=/dev/null"])
            .arg(format!("--rw={}", job.rw))
            .arg(format!("--bs={}", job.bs))
            .arg(format!("--ioengine={}", job.ioengine))
            .arg(format!("--iodepth={}", job.iodepth))
            .arg(format!("--filename={}", self.device().display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("fio: {e}"))?;
        let fio = Fio(child);
        let first = self.read_bytes()?;
        let t = Instant::now();
        while self.read_bytes()? == first {
            if t.elapsed() > START_WAIT {
                return Err(format!("fio {} read nothing in {START_WAIT:?}", job.name));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(SETTLE);
        Ok(fio)
    }

    /// MiB/s the daemon served to `job` over `window`, with nothing else going on.
    fn before(&self, job: &Job, window: Duration) -> Result<f64, String> {
        let fio = self.fio(job)?;
        let (b0, t) = (self.read_bytes()?, Instant::now());
        std::thread::sleep(window);
        let (b1, secs) = (self.read_bytes()?, t.elapsed().as_secs_f64());
        drop(fio);
        Ok((b1 - b0) as f64 / secs / (1024.0 * 1024.0))
    }

    /// MiB/s the daemon served to `job` while a copy with no crypto moved what a rotation of
    /// `online_s` seconds moves (the volume's size read and written) on the same disk: the
    /// device's ceiling for the job during a rotation at that speed.
    fn ceiling(&self, job: &Job, online_s: f64) -> Result<f64, String> {
        let data = std::fs::metadata(&self.img)
            .map_err(|e| e.to_string())?
            .len()
            .saturating_sub(HEADER_BYTES);
        let rate = (data as f64 / online_s.max(0.1)) as u64;
        let ballast = self.dir.join("ceiling.img");
        if std::fs::metadata(&ballast).map_or(true, |m| m.len() != data) {
            run_ok(
                Command::new("fio")
                    .args(["--name=ballast", "--rw=write", "--bs=4M", "--direct=1"])
                    .args(["--ioengine=libaio", "--iodepth=4", "--output=/dev/null"])
                    .arg(format!("--size={data}"))
                    .arg(format!("--filename={}", ballast.display())),
            )?;
        }
        let fio = self.fio(job)?;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let served = std::thread::scope(|sc| -> Result<f64, String> {
            let work = sc.spawn(|| paced_rekey(rate, &stop));
            let served = self.ceiling_copy(&ballast, data, rate, online_s);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            work.join()
                .map_err(|_| "the ceiling's rekey thread panicked".to_string())??;
            served
        });
        drop(fio);
        served
    }

    /// The I/O half of [`Rig::ceiling`], the job already running: MiB/s served to it while
    /// the copy ran.
    fn ceiling_copy(
        &self,
        ballast: &Path,
        data: u64,
        rate: u64,
        online_s: f64,
    ) -> Result<f64, String> {
        let copy = Command::new("fio")
            .args([
                "--name=copy",
                "--thread",
                "--rw=rw",
                "--rwmixread=50",
                "--direct=1",
            ])
            .args(["--ioengine=psync", "--time_based", "--output=/dev/null"])
            .arg(format!("--bs={COPY_BS}"))
            .arg(format!("--fsync={COPY_FSYNC_EVERY}"))
            .arg(format!("--rate={rate},{rate}"))
            .arg(format!("--size={data}"))
            .arg(format!("--runtime={}ms", (online_s * 1000.0) as u64))
            .arg(format!("--filename={}", ballast.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("fio copy: {e}"))?;
        let mut copy = Fio(copy);
        let (b0, t) = (self.read_bytes()?, Instant::now());
        let st = copy.0.wait().map_err(|e| e.to_string())?;
        let (b1, secs) = (self.read_bytes()?, t.elapsed().as_secs_f64());
        if !st.success() {
            return Err(format!("the ceiling copy (fio) exited with {st}"));
        }
        Ok((b1 - b0) as f64 / secs / (1024.0 * 1024.0))
    }

    /// MiB/s the daemon served to `job` while it rotated the key, and the rotation's wall
    /// seconds.
    fn during(&self, job: &Job) -> Result<(f64, f64), String> {
        let fio = self.fio(job)?;
        let b0 = self.read_bytes()?;
        let secs = self.rotate()?;
        let b1 = self.read_bytes()?;
        drop(fio);
        Ok(((b1 - b0) as f64 / secs / (1024.0 * 1024.0), secs))
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if self.open {
            let _ = Command::new(&self.ucrypt)
                .args(["close", "--force"])
                .arg(&self.name)
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The CPU work of a rotation with checksum resilience at `rate` bytes/s, on one thread (the
/// online rotation's one lane), until `stop`: each [`REKEY_CHUNK`] of a buffer hashed per
/// 4096-byte block (SHA-256, the resilience data), decrypted with one AES-256-XTS key and
/// encrypted with another, then a pause until the pace allows the next.
fn paced_rekey(rate: u64, stop: &std::sync::atomic::AtomicBool) -> Result<(), String> {
    use ucrypt::luks::HashAlg;
    let (mut old, mut new) = (xts_cipher(0xa5)?, xts_cipher(0x5a)?);
    let mut buf = vec![0x3cu8; REKEY_CHUNK];
    let t = Instant::now();
    let mut done = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        for block in buf.chunks(4096) {
            std::hint::black_box(HashAlg::Sha256.digest(&[block]));
        }
        let sector = done / 4096;
        old.decrypt(sector, &mut buf).map_err(|e| e.to_string())?;
        new.encrypt(sector, &mut buf).map_err(|e| e.to_string())?;
        done += REKEY_CHUNK as u64;
        let due = Duration::from_secs_f64(done as f64 / rate.max(1) as f64);
        if let Some(wait) = due.checked_sub(t.elapsed()) {
            std::thread::sleep(wait.min(Duration::from_millis(100)));
        }
    }
    Ok(())
}

/// A running fio (`--thread`: one process); stopped (SIGKILL: its report is not used) and
/// reaped on drop.
struct Fio(Child);

impl Drop for Fio {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The samples of one job under one load.
#[derive(Default)]
struct Samples {
    before: Vec<f64>,
    during: Vec<f64>,
    online: Vec<f64>,
    ratio: Vec<f64>,
    speed: Vec<f64>,
    ceiling: Vec<f64>,
    ceiling_ratio: Vec<f64>,
    of_ceiling: Vec<f64>,
}

pub fn measure(runs: usize, quick: bool, progress: bool) -> Result<Report, String> {
    let data = if quick { DATA_BYTES_QUICK } else { DATA_BYTES };
    // Quick: hotzones of 16 MiB, so a small volume still has several.
    let hotzone = quick.then_some(16 << 20);
    let mut report = Report {
        machine: Machine::detect(),
        skipped: None,
        volume: format!(
            "LUKS2 file in {DIR}, aes-xts-plain64, served by ucrypt open --front-end loop"
        ),
        data_bytes: data,
        hotzone_bytes: hotzone,
        runs,
        load_before: load(),
        load_after: String::new(),
        rows: Vec::new(),
        verdicts: Vec::new(),
        notes: vec![
            "throughput is what the daemon served (its read counter) over the window; fio is \
             the load"
                .into(),
            "rotation seconds are the `ucrypt reencrypt` verb's wall time, online and offline \
             alike (unlocks at 1000 pbkdf2 iterations, init, hotzones, finalisation)"
                .into(),
            "resilience checksum (the default)".into(),
            "ceiling: the same job beside the work of a rotation at that round's pace without \
             ucrypt: fio reading and writing a file of the volume's size on the same disk \
             (sequential 4 MiB requests, an fsync every 8 writes, each direction capped at the \
             volume's size ÷ the online seconds, for as long) and one thread hashing (SHA-256 \
             per 4 KiB), decrypting and encrypting (AES-256-XTS) the same bytes at that pace: \
             what the machine leaves the job while a rotation at that speed runs"
                .into(),
        ],
    };
    if let Some(why) = missing_rig() {
        report.skipped = Some(why);
        report.load_after = load();
        return Ok(report);
    }
    let ucrypt = crate::ucrypt_bin()?;
    let window = if quick { BEFORE_QUICK } else { BEFORE };
    for busy in [0, BUSY_THREADS] {
        let _load = Busy::start(busy);
        let mut rig = Rig::new(ucrypt.clone(), data, hotzone)?;
        let mut offline = Vec::new();
        let mut s: Vec<Samples> = JOBS.iter().map(|_| Samples::default()).collect();
        for round in 0..runs {
            rig.close()?;
            let off = rig.rotate()?;
            offline.push(off);
            rig.open()?;
            for (j, job) in JOBS.iter().enumerate() {
                let before = rig.before(job, window)?;
                let (during, online) = rig.during(job)?;
                let ceiling = rig.ceiling(job, online)?;
                let sj = &mut s[j];
                sj.ceiling.push(ceiling);
                sj.ceiling_ratio.push(ceiling / before);
                sj.of_ceiling.push(during / ceiling);
                sj.before.push(before);
                sj.during.push(during);
                sj.online.push(online);
                sj.ratio.push(during / before);
                sj.speed.push(off / online);
                if progress {
                    eprintln!(
                        "reencrypt --online: busy {busy}, round {}/{runs}, {}: before {before:.1} \
                         MiB/s, during {during:.1} MiB/s ({:.2}); rotation online {online:.2} s, \
                         offline {off:.2} s ({:.2}); ceiling {ceiling:.1} MiB/s ({:.2} of \
                         before; ucrypt {:.2} of it); load {}",
                        round + 1,
                        job.name,
                        during / before,
                        off / online,
                        ceiling / before,
                        during / ceiling,
                        load()
                    );
                }
            }
        }
        drop(rig);
        let off = Summary::of(&offline);
        let mut verdict = Verdict {
            busy_threads: busy,
            foreground_met: true,
            rotation_met: true,
            ceiling_met: true,
        };
        for (job, sj) in JOBS.iter().zip(&s) {
            let row = Row {
                job: job.name,
                busy_threads: busy,
                before_mib_s: Summary::of(&sj.before),
                during_mib_s: Summary::of(&sj.during),
                during_of_before: Summary::of(&sj.ratio),
                online_s: Summary::of(&sj.online),
                offline_s: off,
                speed_of_offline: Summary::of(&sj.speed),
                ceiling_during_mib_s: Summary::of(&sj.ceiling),
                ceiling_of_before: Summary::of(&sj.ceiling_ratio),
                of_ceiling: Summary::of(&sj.of_ceiling),
            };
            verdict.foreground_met &= row.during_of_before.median >= GOAL;
            verdict.rotation_met &= row.speed_of_offline.median >= GOAL;
            verdict.ceiling_met &= row.of_ceiling.median >= CEILING_TARGET;
            report.rows.push(row);
        }
        report.verdicts.push(verdict);
    }
    report.load_after = load();
    Ok(report)
}

fn met(b: bool) -> &'static str {
    if b {
        "met"
    } else {
        "missed"
    }
}

pub fn markdown(r: &Report) -> String {
    let mut o = String::from("## ucrypt bench reencrypt --online\n\n");
    if let Some(why) = &r.skipped {
        o += &format!("SKIPPED: {why}\n");
        return o;
    }
    o += &format!(
        "Machine: {}. Volume: {} MiB of data, {}; hotzones {}. {} round-robin runs, median \
         (min–max). Load average before {}, after {}.\n\n",
        r.machine.describe(),
        r.data_bytes >> 20,
        r.volume,
        r.hotzone_bytes
            .map_or_else(|| "ucrypt's default".into(), |h| format!("{} MiB", h >> 20)),
        r.runs,
        r.load_before,
        r.load_after,
    );
    o += "| job | busy threads | before MiB/s | during MiB/s | during ÷ before (goal ≥ 0.5) | online s | offline s | offline ÷ online (goal ≥ 0.5) | ceiling: during MiB/s | ceiling: during ÷ before | ucrypt ÷ ceiling (≥ 0.9) |\n";
    o += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for row in &r.rows {
        o += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            row.job,
            row.busy_threads,
            row.before_mib_s.show(1),
            row.during_mib_s.show(1),
            row.during_of_before.show(2),
            row.online_s.show(2),
            row.offline_s.show(2),
            row.speed_of_offline.show(2),
            row.ceiling_during_mib_s.show(1),
            row.ceiling_of_before.show(2),
            row.of_ceiling.show(2),
        );
    }
    o += "\n";
    for v in &r.verdicts {
        o += &format!(
            "Busy threads {}: foreground during ÷ before ≥ {GOAL}: {}; rotation ≥ {GOAL} of its \
             offline speed: {}; foreground ≥ {CEILING_TARGET} of the ceiling's: {}.\n",
            v.busy_threads,
            met(v.foreground_met),
            met(v.rotation_met),
            met(v.ceiling_met)
        );
    }
    for n in &r.notes {
        o += &format!("\nNote: {n}.\n");
    }
    o
}
