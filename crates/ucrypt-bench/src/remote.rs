//! `ucrypt bench remote`: encryption in front of a Ceph RBD image, side by side in one run on
//! one throw-away single-node cluster (scripts/ceph-cluster.sh; memstore, so the OSD keeps
//! objects in RAM), every target measured by the same client, fio over an NBD unix socket:
//! - `ucrypt rbd`: `ucrypt serve rbd:rbd/IMG` (LUKS2 made by `ucrypt format`, 4096-byte
//!   sectors, data offset aligned to the object size as librbd's is);
//! - `ucrypt rbd plain`: the same path with `serve --unencrypted` (what the crypto costs on it);
//! - `qsd librbd LUKS2`: qemu-storage-daemon exporting its rbd node with librbd's own
//!   client-side encryption (`encrypt.format=luks2`) on the same kind of image;
//! - `qsd luks on rbd`: qemu's own `luks` driver (LUKS1, 512-byte sectors) on a raw rbd node;
//! - `qsd raw` (the ceiling): the raw image exported without encryption;
//! - `fio rbd` (the floor of the path): fio's own rbd engine on the raw image, no NBD hop.
//!
//! And without Ceph, the NBD client backend in front of nbdkit's memory plugin:
//! - `ucrypt nbd`: `ucrypt serve nbd+unix:///?socket=KIT` (LUKS2 made by `ucrypt format` on
//!   the remote);
//! - `ucrypt nbd plain`: the same relay with `--unencrypted` (the cost of the second hop alone);
//! - `nbdkit direct`: fio straight to nbdkit (the ceiling of one hop);
//! - `nbdkit relay`: nbdkit's own `nbd` plugin relaying to nbdkit memory, no crypto (a peer's
//!   two-hop path: the ceiling of any relay on this machine);
//! - `nbdkit luks relay`: the same with nbdkit's `luks` filter (LUKS1, the peer's encrypting
//!   relay).
//!
//! Every image is written over in full before it is formatted, so that reads hit real objects,
//! and every volume is `VOLUME_BYTES` long. Round-robin over targets, `runs` times; medians.
//!
//! librbd's cache: every RBD path runs with librbd's cache off, as ucrypt's backend does by
//! default (`ucrypt_rbd::RBD_CACHE_DEFAULT`; librbd's write-around cache acknowledges writes
//! before the OSDs commit them): qemu-storage-daemon's nodes with `cache.direct=on`, which makes
//! qemu's rbd driver set `rbd_cache = false`, and fio's rbd engine through a copy of the
//! cluster's configuration that says so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::Serialize;

use super::cmd::{have, run_ok};
use super::fio::{self, FioResult, Job};
use super::limit::{self, LimitResult};
use super::server::Server;
use super::stats::{Machine, Summary};

/// The jobs of the issue: 4 KiB random at QD1 and QD32, 1 MiB sequential at QD8.
const JOBS: &[Job] = &[
    Job::new("4k randread QD1", "randread", 4096, "nbd", 1),
    Job::new("4k randwrite QD1", "randwrite", 4096, "nbd", 1),
    Job::new("4k randread QD32", "randread", 4096, "nbd", 32),
    Job::new("4k randwrite QD32", "randwrite", 4096, "nbd", 32),
    Job::new("1M read QD8", "read", 1 << 20, "nbd", 8),
    Job::new("1M write QD8", "write", 1 << 20, "nbd", 8),
];
/// What fio touches on every volume.
const VOLUME_BYTES: u64 = 128 << 20;
/// Room before the data: LUKS2's 16 MiB (LUKS1 on rbd: 4 MiB, the object size).
const HEADER_ROOM_BYTES: u64 = 16 << 20;
const PASSPHRASE: &str = "ucrypt-bench";
/// How long a server may take to accept connections.
const READY_WAIT: Duration = Duration::from_secs(60);
const EXPORT: &str = "disk";
/// RAM the test cluster's OSD may hold: every image once, with room.
const MEMSTORE_BYTES: u64 = 2 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    UcryptRbd,
    UcryptRbdPlain,
    QsdLibrbdLuks2,
    QsdLuksOnRbd,
    QsdRaw,
    FioRbd,
    UcryptNbd,
    UcryptNbdPlain,
    NbdkitDirect,
    NbdkitRelay,
    NbdkitLuksRelay,
}

impl Target {
    const ALL: [Target; 11] = [
        Target::UcryptRbd,
        Target::UcryptRbdPlain,
        Target::QsdLibrbdLuks2,
        Target::QsdLuksOnRbd,
        Target::QsdRaw,
        Target::FioRbd,
        Target::UcryptNbd,
        Target::UcryptNbdPlain,
        Target::NbdkitDirect,
        Target::NbdkitRelay,
        Target::NbdkitLuksRelay,
    ];

    /// Needs the Ceph test cluster.
    fn on_ceph(self) -> bool {
        matches!(
            self,
            Target::UcryptRbd
                | Target::UcryptRbdPlain
                | Target::QsdLibrbdLuks2
                | Target::QsdLuksOnRbd
                | Target::QsdRaw
                | Target::FioRbd
        )
    }

    fn name(self) -> &'static str {
        match self {
            Target::UcryptRbd => "ucrypt rbd (LUKS2)",
            Target::UcryptRbdPlain => "ucrypt rbd, no crypto",
            Target::QsdLibrbdLuks2 => "qsd librbd LUKS2",
            Target::QsdLuksOnRbd => "qsd luks on rbd (LUKS1)",
            Target::QsdRaw => "qsd raw (ceiling)",
            Target::FioRbd => "fio rbd engine, raw (no NBD)",
            Target::UcryptNbd => "ucrypt nbd→nbdkit (LUKS2)",
            Target::UcryptNbdPlain => "ucrypt nbd→nbdkit, no crypto",
            Target::NbdkitDirect => "nbdkit direct (ceiling)",
            Target::NbdkitRelay => "nbdkit nbd→nbdkit, no crypto (relay ceiling)",
            Target::NbdkitLuksRelay => "nbdkit luks nbd→nbdkit (LUKS1)",
        }
    }

    fn image(self) -> &'static str {
        match self {
            Target::UcryptRbd => "bench-ucrypt",
            Target::UcryptRbdPlain => "bench-plain",
            Target::QsdLibrbdLuks2 => "bench-librbd",
            Target::QsdLuksOnRbd => "bench-luks1",
            Target::QsdRaw | Target::FioRbd => "bench-raw",
            Target::UcryptNbd => "kit-luks",
            Target::UcryptNbdPlain => "kit-plain",
            Target::NbdkitDirect => "kit-direct",
            Target::NbdkitRelay => "kit-relay",
            Target::NbdkitLuksRelay => "kit-luks-relay",
        }
    }
}

/// A speed goal of the issue: `ours` at least `min_ratio` × `peer` on the jobs named.
struct GoalSpec {
    ours: Target,
    jobs: &'static [&'static str],
    peer: Target,
    min_ratio: f64,
}

const ALL_JOBS: &[&str] = &[
    "4k randread QD1",
    "4k randwrite QD1",
    "4k randread QD32",
    "4k randwrite QD32",
    "1M read QD8",
    "1M write QD8",
];

const GOALS: &[GoalSpec] = &[
    GoalSpec {
        ours: Target::UcryptRbd,
        jobs: ALL_JOBS,
        peer: Target::QsdRaw,
        min_ratio: 0.9,
    },
    // The ceiling of ucrypt's own path: the same serve over the same image, without crypto.
    GoalSpec {
        ours: Target::UcryptRbd,
        jobs: ALL_JOBS,
        peer: Target::UcryptRbdPlain,
        min_ratio: 0.9,
    },
    GoalSpec {
        ours: Target::UcryptRbd,
        jobs: &["1M read QD8", "1M write QD8"],
        peer: Target::QsdLibrbdLuks2,
        min_ratio: 1.5,
    },
    GoalSpec {
        ours: Target::UcryptRbd,
        jobs: &[
            "4k randread QD1",
            "4k randwrite QD1",
            "4k randread QD32",
            "4k randwrite QD32",
        ],
        peer: Target::QsdLibrbdLuks2,
        min_ratio: 1.2,
    },
    GoalSpec {
        ours: Target::UcryptNbd,
        jobs: ALL_JOBS,
        peer: Target::NbdkitDirect,
        min_ratio: 0.9,
    },
    // The ceiling of a relay: a peer's second hop without crypto (nbdkit relaying to nbdkit).
    // Where the goal above is out of reach (a relay's request is two round trips on the same
    // cores), this is the limit the machine allows; ours without crypto says what crypto costs.
    GoalSpec {
        ours: Target::UcryptNbd,
        jobs: ALL_JOBS,
        peer: Target::NbdkitRelay,
        min_ratio: 0.9,
    },
    GoalSpec {
        ours: Target::UcryptNbd,
        jobs: ALL_JOBS,
        peer: Target::UcryptNbdPlain,
        min_ratio: 0.9,
    },
];

#[derive(Debug, Serialize)]
pub struct Row {
    pub job: Job,
    pub target: Target,
    pub mib_s: Summary,
    pub iops: Summary,
    pub lat_p99_us: Summary,
}

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
pub struct RemoteReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub runs: usize,
    pub runtime_s: f64,
    pub ramp_s: f64,
    pub volume_bytes: u64,
    pub skipped: Vec<String>,
    pub rows: Vec<Row>,
    pub goals: Vec<GoalResult>,
    /// AES-256-XTS on every core at once, MiB/s, measured once per round.
    pub cipher_x_cores_mib_s: Summary,
    /// Each encrypting ucrypt target against the limit of its job (see `limit.rs`).
    pub limits: Vec<LimitResult>,
    /// The seed of the targets' order, shuffled for every job of every run
    /// (`UCRYPT_BENCH_SEED` repeats it).
    pub order_seed: u64,
}

/// The encrypting ucrypt targets and the unencrypted NBD paths of the same kind whose best,
/// run by run, is their ceiling: the image exported without crypto (qemu-storage-daemon's, and
/// ucrypt's own), and a relay without crypto (nbdkit's, and ucrypt's own).
const LIMITS: &[(Target, &[Target])] = &[
    (Target::UcryptRbd, &[Target::QsdRaw, Target::UcryptRbdPlain]),
    (
        Target::UcryptNbd,
        &[Target::NbdkitRelay, Target::UcryptNbdPlain],
    ),
];

/// Limit rows from the per-run samples (`samples[job][target]`, in run order).
fn limit_rows(
    targets: &[Target],
    samples: &[Vec<Vec<FioResult>>],
    cipher: &[f64],
) -> Vec<LimitResult> {
    let per_run = |j: usize, t: Target| -> Option<Vec<f64>> {
        let i = targets.iter().position(|&x| x == t)?;
        Some(samples[j][i].iter().map(|r| r.mib_s).collect())
    };
    let mut out = Vec::new();
    for &(ours, ceilings) in LIMITS {
        for (j, job) in JOBS.iter().enumerate() {
            let Some(o) = per_run(j, ours) else { continue };
            let cs: Vec<(&str, Vec<f64>)> = ceilings
                .iter()
                .filter_map(|&c| Some((c.name(), per_run(j, c)?)))
                .collect();
            if cs.is_empty() {
                continue;
            }
            let cs: Vec<(&str, &[f64])> = cs.iter().map(|(n, v)| (*n, v.as_slice())).collect();
            out.push(LimitResult::of(job.name, (ours.name(), &o), &cs, cipher));
        }
    }
    out
}

fn repo_script() -> PathBuf {
    std::env::var_os("UCRYPT_CEPH_CLUSTER_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
        })
}

/// The throw-away cluster; stopped (and its directory removed) on drop.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    /// `conf` with librbd's cache off, for fio.
    nocache: PathBuf,
}

impl Cluster {
    fn start() -> Result<Cluster, String> {
        let script = repo_script();
        if !script.exists() {
            return Err(format!(
                "{} not found (set UCRYPT_CEPH_CLUSTER_SCRIPT to the repository's scripts/ceph-cluster.sh)",
                script.display()
            ));
        }
        let dir = std::env::temp_dir().join(format!("ucrypt-bench-ceph-{}", std::process::id()));
        run_ok(
            Command::new("bash")
                .arg(&script)
                .arg("start")
                .arg(&dir)
                .env("CEPH_MEMSTORE_BYTES", MEMSTORE_BYTES.to_string()),
        )?;
        let conf = dir.join("ceph.conf");
        // fio's rbd engine takes librbd's settings from the file alone: a copy with the cache
        // off, as every other RBD path here runs (see the module comment).
        let text =
            std::fs::read_to_string(&conf).map_err(|e| format!("{}: {e}", conf.display()))?;
        let nocache = dir.join("ceph-nocache.conf");
        std::fs::write(&nocache, format!("{text}\n[client]\nrbd cache = false\n"))
            .map_err(|e| format!("{}: {e}", nocache.display()))?;
        Ok(Cluster { conf, nocache, dir })
    }

    fn rbd(&self, args: &[&str]) -> Result<String, String> {
        run_ok(Command::new("rbd").args(args).env("CEPH_CONF", &self.conf))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo_script())
            .arg("stop")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

struct Setup {
    dir: PathBuf,
    /// None: Ceph is not installed; its targets are skipped.
    cluster: Option<Cluster>,
}

impl Setup {
    fn p(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
    fn sock(&self, t: Target) -> PathBuf {
        self.p(&format!("{}.sock", t.image()))
    }
    /// The socket of the nbdkit behind an NBD target.
    fn kit_sock(&self, t: Target) -> PathBuf {
        self.p(&format!("{}.kit", t.image()))
    }
    fn kit_uri(&self, t: Target) -> String {
        format!("nbd+unix:///?socket={}", self.kit_sock(t).display())
    }
    fn uri(&self, t: Target) -> PathBuf {
        if t == Target::NbdkitDirect {
            return PathBuf::from(self.kit_uri(t));
        }
        PathBuf::from(format!(
            "nbd+unix:///{EXPORT}?socket={}",
            self.sock(t).display()
        ))
    }
    fn cluster(&self) -> Result<&Cluster, String> {
        self.cluster
            .as_ref()
            .ok_or_else(|| "no Ceph cluster".to_string())
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Creates, fills and formats the images.
fn images(s: &Setup, progress: bool) -> Result<(), String> {
    let ucrypt = crate::ucrypt_bin()?;
    let cluster = s.cluster()?;
    let conf = cluster.conf.display().to_string();
    let size = format!("{}M", (VOLUME_BYTES + HEADER_ROOM_BYTES) >> 20);
    for img in [
        "bench-ucrypt",
        "bench-plain",
        "bench-librbd",
        "bench-luks1",
        "bench-raw",
    ] {
        if progress {
            eprintln!("bench remote: image {img}");
        }
        cluster.rbd(&["create", "--size", &size, &format!("rbd/{img}")])?;
        // Written over in full: reads then fetch real objects, not holes.
        cluster.rbd(&[
            "bench",
            "--io-type",
            "write",
            "--io-pattern",
            "seq",
            "--io-size",
            "4M",
            "--io-total",
            &size,
            &format!("rbd/{img}"),
        ])?;
    }
    let pass = s.p("pass").display().to_string();
    for (img, kind) in [
        ("bench-ucrypt", "luks2"),
        ("bench-librbd", "luks2"),
        ("bench-luks1", "luks1"),
    ] {
        run_ok(
            Command::new(&ucrypt)
                .args(["format", "-q", "--type", kind])
                .arg(format!("rbd:rbd/{img}"))
                .arg(&pass)
                .args(["--rbd-conf", &conf])
                .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]),
        )?;
    }
    Ok(())
}

fn server_command(t: Target, s: &Setup) -> Result<Option<Command>, String> {
    let sock = s.sock(t).display().to_string();
    let conf = s
        .cluster
        .as_ref()
        .map(|c| c.conf.display().to_string())
        .unwrap_or_default();
    let pass = s.p("pass").display().to_string();
    let qsd = |blockdevs: &[String], node: &str| {
        let mut c = Command::new("qemu-storage-daemon");
        c.arg("--object").arg(format!("secret,id=s0,file={pass}"));
        for b in blockdevs {
            c.arg("--blockdev").arg(b);
        }
        c.arg("--nbd-server")
            .arg(format!("addr.type=unix,addr.path={sock}"))
            .arg("--export")
            .arg(format!(
                "type=nbd,id=e0,node-name={node},name={EXPORT},writable=on"
            ));
        c
    };
    // cache.direct=on: qemu's rbd driver then turns librbd's cache off (see the module comment).
    let rbd_node = |img: &str, extra: &str| {
        format!("driver=rbd,node-name=r0,pool=rbd,image={img},conf={conf},cache.direct=on{extra}")
    };
    Ok(Some(match t {
        Target::UcryptRbd | Target::UcryptRbdPlain => {
            let mut c = Command::new(crate::ucrypt_bin()?);
            c.arg("serve")
                .arg(format!("rbd:rbd/{}", t.image()))
                .args(["--nbd", &format!("unix:{sock}")])
                .args(["--export-name", EXPORT])
                .args(["--rbd-conf", &conf]);
            if t == Target::UcryptRbd {
                c.args(["--key-file", &pass]);
            } else {
                c.arg("--unencrypted");
            }
            c
        }
        Target::QsdLibrbdLuks2 => qsd(
            &[rbd_node(
                t.image(),
                ",encrypt.format=luks2,encrypt.key-secret=s0",
            )],
            "r0",
        ),
        Target::QsdLuksOnRbd => qsd(
            &[
                rbd_node(t.image(), ""),
                "driver=luks,node-name=l0,file=r0,key-secret=s0".into(),
            ],
            "l0",
        ),
        Target::QsdRaw => qsd(&[rbd_node(t.image(), "")], "r0"),
        Target::FioRbd | Target::NbdkitDirect => return Ok(None),
        Target::NbdkitRelay | Target::NbdkitLuksRelay => {
            let mut c = Command::new("nbdkit");
            c.args(["-f", "--exit-with-parent", "-U", &sock]);
            if t == Target::NbdkitLuksRelay {
                c.arg("--filter=luks");
            }
            c.arg("nbd")
                .arg(format!("socket={}", s.kit_sock(t).display()));
            if t == Target::NbdkitLuksRelay {
                c.arg(format!("passphrase=+{pass}"));
            }
            c
        }
        Target::UcryptNbd | Target::UcryptNbdPlain => {
            let mut c = Command::new(crate::ucrypt_bin()?);
            c.arg("serve")
                .arg(s.kit_uri(t))
                .args(["--nbd", &format!("unix:{sock}")])
                .args(["--export-name", EXPORT]);
            if t == Target::UcryptNbd {
                c.args(["--key-file", &pass]);
            } else {
                c.arg("--unencrypted");
            }
            c
        }
    }))
}

/// fio's own rbd engine on the raw image: librbd straight from fio, no NBD hop.
fn fio_rbd(job: &Job, s: &Setup, runtime: Duration, ramp: Duration) -> Result<FioResult, String> {
    let out = Command::new("fio")
        .args([
            "--name=ucrypt-bench",
            "--output-format=json",
            "--time_based",
            "--group_reporting",
            "--ioengine=rbd",
            "--clientname=admin",
            "--pool=rbd",
            "--randrepeat=0",
            "--norandommap",
        ])
        .arg(format!("--rbdname={}", Target::FioRbd.image()))
        .arg(format!("--rw={}", job.rw))
        .arg(format!("--bs={}", job.block_bytes))
        .arg(format!("--iodepth={}", job.iodepth))
        .arg(format!("--runtime={}ms", runtime.as_millis().max(1)))
        .arg(format!("--ramp_time={}ms", ramp.as_millis()))
        .arg(format!("--size={VOLUME_BYTES}"))
        .env("CEPH_CONF", &s.cluster()?.nocache)
        .output()
        .map_err(|e| format!("running fio: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "fio rbd {}: {}",
            job.name,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    fio::parse(
        &String::from_utf8_lossy(&out.stdout),
        job.rw.contains("write"),
    )
}

fn find<'a>(rows: &'a [Row], job: &str, t: Target) -> Option<&'a Row> {
    rows.iter().find(|r| r.job.name == job && r.target == t)
}

/// One nbdkit memory instance per NBD target, written over in full (so reads hit real pages),
/// and the encrypted one formatted by `ucrypt format` on the remote.
fn kits(s: &Setup, servers: &mut Vec<Server>) -> Result<(), String> {
    let size = format!("{}M", (VOLUME_BYTES + HEADER_ROOM_BYTES) >> 20);
    for t in [
        Target::UcryptNbd,
        Target::UcryptNbdPlain,
        Target::NbdkitDirect,
        Target::NbdkitRelay,
        Target::NbdkitLuksRelay,
    ] {
        let sock = s.kit_sock(t);
        let mut c = Command::new("nbdkit");
        c.args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(["memory", &size]);
        let log = s.p(&format!("{}.kitlog", t.image()));
        servers.push(Server::start(c, &sock, &log, "nbdkit memory", READY_WAIT)?);
        run_ok(
            Command::new("fio")
                .args(["--name=fill", "--ioengine=nbd", "--rw=write", "--bs=1M"])
                .arg(format!("--uri={}", s.kit_uri(t)))
                .arg(format!("--size={size}")),
        )?;
    }
    run_ok(
        Command::new(crate::ucrypt_bin()?)
            .args(["format", "-q", "--type", "luks2"])
            .arg(s.kit_uri(Target::UcryptNbd))
            .arg(s.p("pass"))
            .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]),
    )?;
    // nbdkit's luks filter reads LUKS1 only.
    run_ok(
        Command::new(crate::ucrypt_bin()?)
            .args(["format", "-q", "--type", "luks1"])
            .arg(s.kit_uri(Target::NbdkitLuksRelay))
            .arg(s.p("pass"))
            .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]),
    )?;
    Ok(())
}

fn check_goals(rows: &[Row]) -> Vec<GoalResult> {
    let mut out = Vec::new();
    for g in GOALS {
        for &job in g.jobs {
            let ratio = match (find(rows, job, g.ours), find(rows, job, g.peer)) {
                (Some(o), Some(p)) if o.mib_s.median > 0.0 && p.mib_s.median > 0.0 => {
                    Some(o.mib_s.median / p.mib_s.median)
                }
                _ => None,
            };
            out.push(GoalResult {
                job,
                ours: g.ours,
                peer: g.peer,
                min_ratio: g.min_ratio,
                ratio,
                met: ratio.map(|r| r >= g.min_ratio),
            });
        }
    }
    out
}

/// Which targets a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    All,
    /// The NBD targets: no Ceph cluster.
    NbdOnly,
    /// The Ceph RBD targets: no nbdkit.
    RbdOnly,
}

impl Part {
    /// From the command line's `--nbd-only` and `--rbd-only` (which exclude each other).
    pub fn of(nbd_only: bool, rbd_only: bool) -> Part {
        match (nbd_only, rbd_only) {
            (true, _) => Part::NbdOnly,
            (false, true) => Part::RbdOnly,
            (false, false) => Part::All,
        }
    }
}

pub fn measure(
    runs: usize,
    quick: bool,
    progress: bool,
    part: Part,
) -> Result<RemoteReport, String> {
    let nbd_only = part == Part::NbdOnly;
    for (p, pkg) in [("fio", "fio"), ("nbdkit", "nbdkit")] {
        if !have(p) {
            return Err(format!("{p} not found (apt-get install {pkg})"));
        }
    }
    let mut skipped = Vec::new();
    let ceph_missing = [
        ("rbd", "ceph-common"),
        ("ceph-mon", "ceph-mon"),
        ("ceph-osd", "ceph-osd"),
    ]
    .into_iter()
    .find(|(p, _)| !have(p))
    .filter(|_| !nbd_only);
    let (runtime, ramp) = if quick {
        (Duration::from_millis(1000), Duration::from_millis(300))
    } else {
        (Duration::from_millis(3000), Duration::from_millis(500))
    };
    let dir = crate::disk::run_dir(&std::env::temp_dir(), "remote")?;
    let cluster = match ceph_missing {
        None if nbd_only => {
            skipped.push("the Ceph RBD targets: --nbd-only".to_string());
            None
        }
        Some((p, pkg)) => {
            skipped.push(format!(
                "the Ceph RBD targets: {p} not installed (apt-get install {pkg}; bash scripts/deps.sh test)"
            ));
            None
        }
        None => {
            if progress {
                eprintln!("bench remote: starting the test cluster");
            }
            Some(Cluster::start()?)
        }
    };
    let setup = Setup { dir, cluster };
    std::fs::write(setup.p("pass"), PASSPHRASE).map_err(|e| e.to_string())?;
    if setup.cluster.is_some() {
        images(&setup, progress)?;
    }
    let mut servers = Vec::new();
    if part == Part::RbdOnly {
        skipped.push("the NBD targets: --rbd-only".to_string());
    } else {
        kits(&setup, &mut servers)?;
    }
    let mut targets = Vec::new();
    for t in Target::ALL {
        if t.on_ceph() && setup.cluster.is_none() || !t.on_ceph() && part == Part::RbdOnly {
            continue;
        }
        let needs_qsd = matches!(
            t,
            Target::QsdLibrbdLuks2 | Target::QsdLuksOnRbd | Target::QsdRaw
        );
        if needs_qsd && !have("qemu-storage-daemon") {
            skipped.push(format!(
                "{}: qemu-storage-daemon not installed (qemu-system-common, qemu-block-extra)",
                t.name()
            ));
            continue;
        }
        match server_command(t, &setup)? {
            None => targets.push(t),
            Some(cmd) => {
                let log = setup.p(&format!("{}.log", t.image()));
                match Server::start(cmd, &setup.sock(t), &log, t.name(), READY_WAIT) {
                    Ok(s) => {
                        servers.push(s);
                        targets.push(t);
                    }
                    Err(e) if matches!(t, Target::UcryptRbd | Target::UcryptNbd) => return Err(e),
                    Err(e) => skipped.push(e),
                }
            }
        }
    }
    let mut samples: Vec<Vec<Vec<FioResult>>> = vec![vec![Vec::new(); targets.len()]; JOBS.len()];
    let mut cipher = Vec::new();
    let order_seed = order_seed();
    let mut order = Order::new(order_seed, targets.len());
    for run in 0..runs {
        for (j, job) in JOBS.iter().enumerate() {
            if progress {
                eprintln!("bench remote: run {}/{runs}: {}", run + 1, job.name);
            }
            for i in order.next_round() {
                let t = targets[i];
                let r = match t {
                    Target::FioRbd => fio_rbd(job, &setup, runtime, ramp)?,
                    _ => {
                        fio::run_for(job, &setup.uri(t), VOLUME_BYTES, runtime, ramp, false, None)?
                    }
                };
                samples[j][i].push(r);
            }
        }
        // Once a round, beside the jobs: the cipher on every core, under the same load.
        cipher.push(limit::cipher_x_cores_mib_s(limit::CIPHER_MEASURE));
    }
    drop(servers);
    let limits = limit_rows(&targets, &samples, &cipher);
    let mut rows = Vec::new();
    for (j, job) in JOBS.iter().enumerate() {
        for (i, &t) in targets.iter().enumerate() {
            let s = &samples[j][i];
            let of = |f: fn(&FioResult) -> f64| Summary::of(&s.iter().map(f).collect::<Vec<_>>());
            rows.push(Row {
                job: *job,
                target: t,
                mib_s: of(|r| r.mib_s),
                iops: of(|r| r.iops),
                lat_p99_us: of(|r| r.lat_p99_us),
            });
        }
    }
    let goals = check_goals(&rows);
    Ok(RemoteReport {
        schema: 1,
        machine: Machine::detect(),
        runs,
        runtime_s: runtime.as_secs_f64(),
        ramp_s: ramp.as_secs_f64(),
        volume_bytes: VOLUME_BYTES,
        skipped,
        rows,
        goals,
        cipher_x_cores_mib_s: Summary::of(&cipher),
        limits,
        order_seed,
    })
}

/// The seed of the targets' order: `UCRYPT_BENCH_SEED` (to repeat a run's order), or the clock.
fn order_seed() -> u64 {
    std::env::var("UCRYPT_BENCH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// The order the targets run in, shuffled afresh for every job of every run, so that no target
/// always follows the same one. In a fixed order, the relay's encrypting target always came
/// right after the Ceph targets, whose after-effects (the cluster's threads still busy) then
/// counted against that one column every time; shuffled, a neighbour's after-effects spread
/// over every column.
struct Order {
    state: u64,
    idx: Vec<usize>,
}

impl Order {
    fn new(seed: u64, n: usize) -> Self {
        Order {
            state: seed | 1,
            idx: (0..n).collect(),
        }
    }

    /// A fresh permutation of the targets' indices (Fisher–Yates over xorshift64).
    fn next_round(&mut self) -> Vec<usize> {
        for i in (1..self.idx.len()).rev() {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            let j = (self.state % (i as u64 + 1)) as usize;
            self.idx.swap(i, j);
        }
        self.idx.clone()
    }
}

/// Where a goal over librbd's LUKS2 asks more than the limit allows: `min_ratio` × librbd's
/// median above ucrypt's limit for that job (both medians of this run).
fn librbd_goal_note(r: &RemoteReport) -> String {
    let mut s = String::new();
    for g in GOALS.iter().filter(|g| g.peer == Target::QsdLibrbdLuks2) {
        for &job in g.jobs {
            let peer = find(&r.rows, job, g.peer).map(|x| x.mib_s.median);
            let lim = r
                .limits
                .iter()
                .find(|l| l.job == job && l.ours == g.ours.name())
                .map(|l| l.limit_mib_s.median);
            if let (Some(p), Some(l)) = (peer, lim) {
                if p * g.min_ratio > l {
                    s.push_str(&format!(
                        "- {job}: {}× {} would be {:.0} MiB/s, above the limit of {:.0} MiB/s \
                         this machine allowed {} in this run ({:.2} of it).\n",
                        g.min_ratio,
                        g.peer.name(),
                        p * g.min_ratio,
                        l,
                        g.ours.name(),
                        p * g.min_ratio / l
                    ));
                }
            }
        }
    }
    if s.is_empty() {
        s
    } else {
        format!("\nGoals above the limit:\n\n{s}")
    }
}

pub fn markdown(r: &RemoteReport) -> String {
    let mut s = format!(
        "Machine: {}. A single-node Ceph 16 cluster (memstore OSD, objects in RAM) on this \
         machine; fio --ioengine=nbd over unix sockets ({} MiB of each volume), except the last \
         column (fio's rbd engine); {} s per job after {} s of warm-up, {} round-robin runs, \
         the targets in a new random order for every job of every run (seed {}: \
         UCRYPT_BENCH_SEED={} repeats it); MiB/s median (min–max). AES-256-XTS everywhere.\n\n",
        r.machine.describe(),
        r.volume_bytes >> 20,
        r.runtime_s,
        r.ramp_s,
        r.runs,
        r.order_seed,
        r.order_seed
    );
    // Only the targets this run measured (--nbd-only or a missing peer leaves some out).
    let shown: Vec<Target> = Target::ALL
        .into_iter()
        .filter(|&t| r.rows.iter().any(|x| x.target == t))
        .collect();
    s.push_str("| job |");
    for t in &shown {
        s.push_str(&format!(" {} |", t.name()));
    }
    s.push_str(&format!("\n|---|{}\n", "---|".repeat(shown.len())));
    for job in JOBS {
        s.push_str(&format!("| {} |", job.name));
        for &t in &shown {
            let cell = find(&r.rows, job.name, t)
                .map(|x| x.mib_s.show(1))
                .unwrap_or_else(|| "–".into());
            s.push_str(&format!(" {cell} |"));
        }
        s.push('\n');
    }
    s.push_str("\n## Goals (ours ÷ peer, medians)\n\n| job | ours | peer | ratio | goal | |\n|---|---|---|---|---|---|\n");
    for g in r.goals.iter().filter(|g| g.ratio.is_some()) {
        let (ratio, verdict) = match (g.ratio, g.met) {
            (Some(x), Some(true)) => (format!("{x:.2}"), "met"),
            (Some(x), Some(false)) => (format!("{x:.2}"), "MISSED"),
            _ => ("–".into(), "not measured"),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {ratio} | ≥ {} | {verdict} |\n",
            g.job,
            g.ours.name(),
            g.peer.name(),
            g.min_ratio
        ));
    }
    if !r.limits.is_empty() {
        s.push_str(&limit::markdown(
            "## Against the limit of this machine",
            &r.limits,
            &r.cipher_x_cores_mib_s,
        ));
        s.push_str(&librbd_goal_note(r));
    }
    if !r.skipped.is_empty() {
        s.push_str("\nSkipped:\n");
        for k in &r.skipped {
            s.push_str(&format!("- {k}\n"));
        }
    }
    s
}

#[cfg(test)]
mod order_tests {
    use super::Order;

    #[test]
    fn every_round_is_a_permutation_and_rounds_differ() {
        let mut o = Order::new(0x5eed, 11);
        let rounds: Vec<Vec<usize>> = (0..30).map(|_| o.next_round()).collect();
        for r in &rounds {
            let mut sorted = r.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..11).collect::<Vec<_>>());
        }
        // No target always sits right after the same one.
        let follows = |a: usize, b: usize| {
            rounds
                .iter()
                .all(|r| r.windows(2).any(|w| w[0] == a && w[1] == b))
        };
        assert!(!(0..11).any(|a| (0..11).any(|b| a != b && follows(a, b))));
        // The same seed repeats the order.
        let mut again = Order::new(0x5eed, 11);
        assert_eq!(again.next_round(), rounds[0]);
    }
}
