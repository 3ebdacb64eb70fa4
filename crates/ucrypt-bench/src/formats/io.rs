//! The data rows of `ucrypt bench formats`: each volume as a file over FUSE, served by
//! `ucrypt mount` and, for BitLocker, by `dislocker-fuse` on the same image file, measured with
//! the same fio jobs.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Goal, RatioRow, Workdir, BITLK_PASSPHRASE, TCRYPT_PASSPHRASE};
use crate::cmd::run_ok;
use crate::cpu::CpuWatch;
use crate::fio::{self, FioResult, Job};
use crate::stats::Summary;

/// Bytes of each volume the jobs cover, from its start: below the first FVE metadata area of
/// every BitLocker image used (the lowest lies at 33 MiB), because `dislocker-fuse` fails a
/// write that touches one (EFAULT) where ucrypt drops it as cryptsetup's dm-zero does; and
/// within the VeraCrypt system image's 16 MiB of data.
pub const REGION_BYTES: u64 = 16 << 20;
/// The LUKS2 volume: cryptsetup's default 16 MiB header room before the data.
const LUKS2_IMAGE_BYTES: u64 = (16 << 20) + REGION_BYTES;
/// How long a FUSE server may take to show its file (the KDF of the secret included).
const MOUNT_WAIT: Duration = Duration::from_secs(60);

const JOBS: &[Job] = &[
    Job::new("4k randread psync QD1", "randread", 4096, "psync", 1),
    Job::new("4k randwrite psync QD1", "randwrite", 4096, "psync", 1),
    Job::new("1M read psync", "read", 1 << 20, "psync", 1),
    Job::new("1M write psync", "write", 1 << 20, "psync", 1),
];

/// A volume of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Volume {
    /// `bitlk-aes-xts-256.img`: AES-256-XTS (Windows 10+), 512-byte sectors.
    BitlkXts,
    /// `bitlk-aes-cbc-256.img`: AES-256-CBC with the `eboiv` IV, no diffuser.
    BitlkCbc,
    /// `bitlk-aes-cbc-elephant-256.img`: AES-256-CBC with the Elephant diffuser (Windows 7).
    BitlkElephant,
    /// `sys_vc_1_gpt_part-sha512-xts-aes`: a VeraCrypt system volume, AES-256-XTS (in the
    /// tarball of cryptsetup 2.7 and later; the row is skipped with older test material).
    TcryptXts,
    /// LUKS2 made by cryptsetup: aes-xts-plain64, 512-bit key, 512-byte sectors.
    Luks2Xts,
    /// A plain volume with `cipher_null-ecb`: ucrypt's FUSE path with no cipher, the
    /// ceiling of what any FUSE server reaches on this host (a ratio to dislocker-fuse above
    /// this one's is not possible here).
    Unencrypted,
}

impl Volume {
    const ALL: [Volume; 6] = [
        Volume::BitlkXts,
        Volume::BitlkCbc,
        Volume::BitlkElephant,
        Volume::TcryptXts,
        Volume::Luks2Xts,
        Volume::Unencrypted,
    ];

    /// (tarball, member) in cryptsetup's tests/; None: made here.
    fn source(self) -> Option<(&'static str, &'static str)> {
        match self {
            Volume::BitlkXts => Some(("bitlk-images.tar.xz", "bitlk-images/bitlk-aes-xts-256.img")),
            Volume::BitlkCbc => Some(("bitlk-images.tar.xz", "bitlk-images/bitlk-aes-cbc-256.img")),
            Volume::BitlkElephant => Some((
                "bitlk-images.tar.xz",
                "bitlk-images/bitlk-aes-cbc-elephant-256.img",
            )),
            Volume::TcryptXts => Some((
                "tcrypt-images.tar.xz",
                "tcrypt-images/sys_vc_1_gpt_part-sha512-xts-aes",
            )),
            Volume::Luks2Xts | Volume::Unencrypted => None,
        }
    }

    fn is_bitlk(self) -> bool {
        matches!(
            self,
            Volume::BitlkXts | Volume::BitlkCbc | Volume::BitlkElephant
        )
    }
}

/// Who serves a volume.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Server {
    /// `ucrypt mount` (FUSE over classic /dev/fuse, `--direct-io`).
    Ucrypt,
    /// `dislocker-fuse` (BitLocker only).
    Dislocker,
}

/// A row's target: a volume and its server.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Target {
    pub volume: Volume,
    pub server: Server,
}

impl Target {
    const fn new(volume: Volume, server: Server) -> Target {
        Target { volume, server }
    }

    fn name(self) -> String {
        let v = match self.volume {
            Volume::BitlkXts => "BitLocker AES-XTS",
            Volume::BitlkCbc => "BitLocker AES-CBC",
            Volume::BitlkElephant => "BitLocker AES-CBC + Elephant",
            Volume::TcryptXts => "VeraCrypt AES-XTS",
            Volume::Luks2Xts => "LUKS2 AES-XTS",
            Volume::Unencrypted => "unencrypted (cipher_null)",
        };
        match self.server {
            Server::Ucrypt => format!("ucrypt {v}"),
            Server::Dislocker => format!("dislocker-fuse {v}"),
        }
    }
}

const UCRYPT_XTS: Target = Target::new(Volume::BitlkXts, Server::Ucrypt);
const DISLOCKER_XTS: Target = Target::new(Volume::BitlkXts, Server::Dislocker);
const UCRYPT_CBC: Target = Target::new(Volume::BitlkCbc, Server::Ucrypt);
const UCRYPT_ELEPHANT: Target = Target::new(Volume::BitlkElephant, Server::Ucrypt);
const DISLOCKER_ELEPHANT: Target = Target::new(Volume::BitlkElephant, Server::Dislocker);
const UCRYPT_TCRYPT: Target = Target::new(Volume::TcryptXts, Server::Ucrypt);
const UCRYPT_LUKS2: Target = Target::new(Volume::Luks2Xts, Server::Ucrypt);
const UCRYPT_NULL: Target = Target::new(Volume::Unencrypted, Server::Ucrypt);

/// Every target, in the order they run within a round.
const TARGETS: [Target; 8] = [
    UCRYPT_XTS,
    DISLOCKER_XTS,
    UCRYPT_NULL,
    UCRYPT_LUKS2,
    UCRYPT_TCRYPT,
    UCRYPT_CBC,
    UCRYPT_ELEPHANT,
    DISLOCKER_ELEPHANT,
];

/// The ratios of the report: (numerator, denominator, goal per job name).
type RatioSpec = (Target, Target, fn(&str) -> Option<(f64, Goal)>);

/// Issue 43: ≥ 5× dislocker on 1 MiB reads, ≥ 2× on 4 KiB reads.
fn dislocker_goal(job: &str) -> Option<(f64, Goal)> {
    match job {
        "1M read psync" => Some((5.0, Goal::AtLeast)),
        "4k randread psync QD1" => Some((2.0, Goal::AtLeast)),
        _ => None,
    }
}

/// Issue 43: single-cipher XTS formats within 0.9 of LUKS2 with the same cipher and sector
/// size.
fn luks2_goal(_job: &str) -> Option<(f64, Goal)> {
    Some((0.9, Goal::AtLeast))
}

/// 4 KiB reads: the FUSE path without a cipher reaches less than twice dislocker-fuse's speed
/// on this host (the ceiling row), so BitLocker is judged within 0.9 of that ceiling. The
/// 1 MiB goal (5×) lies below its ceiling and stands as it is.
fn ceiling_goal(job: &str) -> Option<(f64, Goal)> {
    (job == "4k randread psync QD1").then_some((0.9, Goal::AtLeast))
}

fn no_goal(_job: &str) -> Option<(f64, Goal)> {
    None
}

const RATIOS: [RatioSpec; 8] = [
    (UCRYPT_XTS, DISLOCKER_XTS, dislocker_goal),
    (UCRYPT_NULL, DISLOCKER_XTS, no_goal),
    (UCRYPT_XTS, UCRYPT_NULL, ceiling_goal),
    (UCRYPT_ELEPHANT, DISLOCKER_ELEPHANT, no_goal),
    (UCRYPT_XTS, UCRYPT_LUKS2, luks2_goal),
    (UCRYPT_TCRYPT, UCRYPT_LUKS2, luks2_goal),
    (UCRYPT_ELEPHANT, UCRYPT_XTS, no_goal),
    (UCRYPT_CBC, UCRYPT_XTS, no_goal),
];

#[derive(Serialize)]
pub struct IoRow {
    pub job: Job,
    pub target: Target,
    pub name: String,
    pub mib_s: Summary,
    pub lat_p99_us: Summary,
    /// The FUSE server's CPU time per request, µs (all its threads).
    pub server_cpu_us_per_req: Summary,
}

pub struct IoResult {
    pub rows: Vec<IoRow>,
    pub ratios: Vec<RatioRow>,
}

/// The volumes' files and what opens them.
struct Images {
    files: Vec<(Volume, PathBuf)>,
    luks2_key_file: PathBuf,
    /// 32 bytes: the plain volume's key (`cipher_null` ignores it, plain mode reads it).
    null_key_file: PathBuf,
}

impl Images {
    /// Every volume's file; a volume whose image the test material lacks is left out, and
    /// why is pushed to `skipped`.
    fn new(work: &Workdir, tests: &Path, skipped: &mut Vec<String>) -> Result<Images, String> {
        let luks2_key_file = work.path("luks2.pass");
        std::fs::write(&luks2_key_file, BITLK_PASSPHRASE).map_err(|e| e.to_string())?;
        let null_key_file = work.path("null.key");
        std::fs::write(&null_key_file, [0u8; 32]).map_err(|e| e.to_string())?;
        let mut files = Vec::new();
        let mut listings: Vec<(&str, String)> = Vec::new();
        for v in Volume::ALL {
            let path = match v.source() {
                Some((tar, member)) => {
                    if !listings.iter().any(|(t, _)| *t == tar) {
                        let list = run_ok(Command::new("tar").arg("-tJf").arg(tests.join(tar)))?;
                        listings.push((tar, list));
                    }
                    let has = listings
                        .iter()
                        .any(|(t, list)| *t == tar && list.lines().any(|l| l == member));
                    if !has {
                        skipped.push(format!(
                            "{v:?}: {tar} in {} has no {member} (cryptsetup 2.7 and later \
                             ship it: set UCRYPT_CRYPTSETUP_TESTS to their tests/)",
                            tests.display()
                        ));
                        continue;
                    }
                    work.untar(&tests.join(tar), member)?
                }
                None if v == Volume::Unencrypted => {
                    let p = work.path("null.img");
                    std::fs::File::create(&p)
                        .and_then(|f| f.set_len(REGION_BYTES))
                        .map_err(|e| format!("{}: {e}", p.display()))?;
                    p
                }
                None => {
                    let p = work.path("luks2.img");
                    std::fs::File::create(&p)
                        .and_then(|f| f.set_len(LUKS2_IMAGE_BYTES))
                        .map_err(|e| format!("{}: {e}", p.display()))?;
                    run_ok(
                        Command::new("cryptsetup")
                            .args(["luksFormat", "--type", "luks2", "-q"])
                            .args(["--cipher", "aes-xts-plain64", "--key-size", "512"])
                            .args(["--sector-size", "512", "--pbkdf", "pbkdf2"])
                            .args(["--pbkdf-force-iterations", "1000", "--key-file"])
                            .arg(&luks2_key_file)
                            .arg(&p),
                    )?;
                    p
                }
            };
            files.push((v, path));
        }
        Ok(Images {
            files,
            luks2_key_file,
            null_key_file,
        })
    }

    fn file(&self, v: Volume) -> Option<&Path> {
        self.files
            .iter()
            .find(|(x, _)| *x == v)
            .map(|(_, p)| p.as_path())
    }
}

/// A FUSE server process; unmounted and reaped on drop.
struct Mounted {
    child: Child,
    /// What fusermount3 unmounts.
    mountpoint: PathBuf,
    /// The plaintext file.
    file: PathBuf,
}

impl Mounted {
    fn start(t: Target, images: &Images, work: &Workdir) -> Result<Mounted, String> {
        let image = images
            .file(t.volume)
            .ok_or_else(|| format!("{}: no image", t.name()))?;
        let (mut cmd, mountpoint, file, secret) = match t.server {
            Server::Ucrypt => {
                let m = work.path("ucrypt.mnt");
                std::fs::write(&m, b"").map_err(|e| e.to_string())?;
                let mut c = Command::new(crate::ucrypt_bin()?);
                c.arg("mount").arg(image).arg(&m);
                // Direct I/O (FOPEN_DIRECT_IO): fio opens O_DIRECT, and without it the kernel
                // serialises writes to a FUSE file.
                c.args(["--fuse-transport", "classic", "--direct-io"]);
                let secret = match t.volume {
                    Volume::Luks2Xts => {
                        c.arg("--key-file").arg(&images.luks2_key_file);
                        None
                    }
                    Volume::Unencrypted => {
                        c.args(["--type", "plain", "--cipher", "cipher_null-ecb"]);
                        c.arg("--key-file").arg(&images.null_key_file);
                        None
                    }
                    Volume::TcryptXts => {
                        c.args(["--type", "tcrypt", "--tcrypt-system", "-h", "sha512"]);
                        c.args(["-c", "aes"]);
                        Some(TCRYPT_PASSPHRASE)
                    }
                    _ => {
                        c.args(["--type", "bitlk"]);
                        Some(BITLK_PASSPHRASE)
                    }
                };
                (c, m.clone(), m, secret)
            }
            Server::Dislocker => {
                let m = work.path("dislocker.mnt");
                std::fs::create_dir_all(&m).map_err(|e| e.to_string())?;
                let mut c = Command::new("dislocker-fuse");
                c.arg("-V").arg(image);
                c.arg(format!("-u{BITLK_PASSPHRASE}"));
                // -f: in the foreground, so that the child is the server whose CPU is counted.
                c.arg("--").arg("-f").arg(&m);
                (c, m.clone(), m.join("dislocker-file"), None)
            }
        };
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{}: {e}", t.name()))?;
        if let (Some(s), Some(mut stdin)) = (secret, child.stdin.take()) {
            stdin
                .write_all(format!("{s}\n").as_bytes())
                .map_err(|e| format!("{}: writing the passphrase: {e}", t.name()))?;
        }
        let m = Mounted {
            child,
            mountpoint,
            file,
        };
        let t0 = Instant::now();
        while t0.elapsed() < MOUNT_WAIT {
            if std::fs::metadata(&m.file).is_ok_and(|x| x.len() >= REGION_BYTES) {
                return Ok(m);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!("{} did not mount within {MOUNT_WAIT:?}", t.name()))
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        crate::fuse::unmount_and_reap(&self.mountpoint, &mut self.child);
    }
}

/// One fio run: its result (None: fio failed) and the server's CPU µs per request.
type Sample = (Option<FioResult>, f64);

pub fn measure(
    work: &Workdir,
    tests: &Path,
    runs: usize,
    runtime_s: f64,
    progress: bool,
    skipped: &mut Vec<String>,
) -> Result<IoResult, String> {
    let images = Images::new(work, tests, skipped)?;
    let dislocker = which("dislocker-fuse");
    if !dislocker {
        skipped.push("dislocker-fuse: not installed (apt-get install dislocker)".into());
    }
    let targets: Vec<Target> = TARGETS
        .into_iter()
        .filter(|t| dislocker || t.server != Server::Dislocker)
        .filter(|t| images.file(t.volume).is_some())
        .collect();
    debug_assert!(targets
        .iter()
        .all(|t| t.server == Server::Ucrypt || t.volume.is_bitlk()));
    // samples[target][job][round]
    let mut samples: Vec<Vec<Vec<Sample>>> = vec![vec![Vec::new(); JOBS.len()]; targets.len()];
    for round in 0..runs {
        for (ti, &t) in targets.iter().enumerate() {
            if progress {
                eprintln!("bench formats: run {}/{runs}: {}", round + 1, t.name());
            }
            let m = Mounted::start(t, &images, work)?;
            for (ji, job) in JOBS.iter().enumerate() {
                let watch = CpuWatch::start(m.child.id() as libc::pid_t);
                let r = fio::run_for(
                    job,
                    &m.file,
                    REGION_BYTES,
                    Duration::from_secs_f64(runtime_s),
                    Duration::ZERO,
                    true,
                    None,
                );
                let sample = match r {
                    Ok(r) => (Some(r), watch.stop(r.iops).1),
                    Err(e) => {
                        let why = format!("{} {}: {e}", t.name(), job.name);
                        if !skipped.contains(&why) {
                            skipped.push(why);
                        }
                        (None, f64::NAN)
                    }
                };
                samples[ti][ji].push(sample);
            }
        }
    }
    let mib_s = |ti: usize, ji: usize| -> Vec<f64> {
        samples[ti][ji]
            .iter()
            .map(|s| s.0.map_or(f64::NAN, |r| r.mib_s))
            .collect()
    };
    let mut rows = Vec::new();
    for (ji, job) in JOBS.iter().enumerate() {
        for (ti, &t) in targets.iter().enumerate() {
            let s = &samples[ti][ji];
            rows.push(IoRow {
                job: *job,
                target: t,
                name: t.name(),
                mib_s: Summary::of(&mib_s(ti, ji)),
                lat_p99_us: Summary::of(
                    &s.iter()
                        .map(|x| x.0.map_or(f64::NAN, |r| r.lat_p99_us))
                        .collect::<Vec<_>>(),
                ),
                server_cpu_us_per_req: Summary::of(&s.iter().map(|x| x.1).collect::<Vec<_>>()),
            });
        }
    }
    let mut ratios = Vec::new();
    for (num, den, goal) in RATIOS {
        let (Some(n), Some(d)) = (
            targets.iter().position(|&t| t == num),
            targets.iter().position(|&t| t == den),
        ) else {
            continue;
        };
        for (ji, job) in JOBS.iter().enumerate() {
            let per_round: Vec<f64> = mib_s(n, ji)
                .iter()
                .zip(mib_s(d, ji))
                .map(|(a, b)| a / b)
                .collect();
            ratios.push(RatioRow::new(
                format!("{} ÷ {}", num.name(), den.name()),
                job.name,
                &per_round,
                goal(job.name),
            ));
        }
    }
    Ok(IoResult { rows, ratios })
}

/// True if `program` is an executable file on PATH (`dislocker-fuse --version` would not
/// only print its version).
fn which(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            std::fs::metadata(d.join(program)).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.is_file() && m.permissions().mode() & 0o111 != 0
            })
        })
    })
}

pub fn markdown(rows: &[IoRow]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        if !names.contains(&r.name.as_str()) {
            names.push(&r.name);
        }
    }
    let mut s = table(rows, &names, |r| Some(r.mib_s.show(0)));
    s.push_str("\nServer CPU per request, µs (median; all the FUSE server's threads):\n\n");
    s.push_str(&table(rows, &names, |r| {
        let m = r.server_cpu_us_per_req.median;
        m.is_finite().then(|| format!("{m:.1}"))
    }));
    s
}

/// A job per line, a target (`names`) per column, each cell `cell` of the row measured there
/// ("–" where none is, or `cell` gives none).
fn table(rows: &[IoRow], names: &[&str], cell: impl Fn(&IoRow) -> Option<String>) -> String {
    let mut s = format!(
        "| job | {} |\n|---|{}\n",
        names.join(" | "),
        "---|".repeat(names.len())
    );
    for job in JOBS {
        let cells: Vec<String> = names
            .iter()
            .map(|n| {
                rows.iter()
                    .find(|r| r.job.name == job.name && r.name == *n)
                    .and_then(&cell)
                    .unwrap_or_else(|| "–".into())
            })
            .collect();
        s.push_str(&format!("| {} | {} |\n", job.name, cells.join(" | ")));
    }
    s
}
