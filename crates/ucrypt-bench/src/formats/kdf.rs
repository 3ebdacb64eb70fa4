//! The header-key derivation rows of `ucrypt bench formats`: `ucrypt tcryptDump` of a
//! VeraCrypt image with the default PIM and no `--hash` (the whole candidate search, which
//! ucrypt spreads over the cores: `crates/ucrypt/src/tcrypt/kdf.rs`), beside the same command
//! pinned to one CPU (`taskset`; the search then runs one thread), and beside `cryptsetup
//! tcryptDump` where cryptsetup can read TCRYPT on this host (it needs the kernel's AF_ALG
//! skcipher interface).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::Serialize;

use super::{Goal, RatioRow, Workdir, TCRYPT_PASSPHRASE};
use crate::stats::Summary;

/// The image searched: VeraCrypt, SHA-512, AES-XTS, the default PIM.
const IMAGE: &str = "tcrypt-images/vc_1-sha512-xts-aes";
/// Issue 43: the search on every core in at most 0.6 of its time on one thread.
const ONE_CPU_GOAL: f64 = 0.6;
/// The independent PBKDF2-SHA-512 chains of a VeraCrypt header key (three 64-byte output
/// blocks): with the right passphrase at the first hash, the search is these chains, so `n`
/// cores need `ceil(3 / n)` chain-times against one core's 3.
const SHA512_CHAINS: usize = 3;
/// Where the ceiling lies above the goal, the search is judged against the ceiling: within
/// this share of its speed counts as reaching it.
const CEILING_SHARE: f64 = 0.9;

/// A search the rows time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum KdfCase {
    /// `vc_1-sha512-xts-aes` with its passphrase: found at VeraCrypt's first hash.
    VeraSha512,
    /// `vc_1-sha512-xts-aes` with a wrong passphrase: every candidate tried, none opens.
    WrongPassphrase,
}

impl KdfCase {
    const ALL: [KdfCase; 2] = [KdfCase::VeraSha512, KdfCase::WrongPassphrase];

    fn passphrase(self) -> &'static str {
        match self {
            KdfCase::WrongPassphrase => "not-the-passphrase",
            _ => TCRYPT_PASSPHRASE,
        }
    }

    fn name(self) -> &'static str {
        match self {
            KdfCase::VeraSha512 => "VeraCrypt SHA-512 (found at VeraCrypt's first hash)",
            KdfCase::WrongPassphrase => "wrong passphrase (every candidate)",
        }
    }

    /// The most `cores` CPUs can take off one CPU's time (None: more than the goal asks).
    fn ceiling(self, cores: usize) -> Option<f64> {
        let c = match self {
            KdfCase::VeraSha512 => {
                SHA512_CHAINS.div_ceil(cores.max(1)) as f64 / SHA512_CHAINS as f64
            }
            // Dozens of candidates: they spread over the cores.
            KdfCase::WrongPassphrase => 1.0 / cores.max(1) as f64,
        };
        (c > ONE_CPU_GOAL).then_some(c)
    }
}

/// Who runs the search.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Runner {
    /// `ucrypt tcryptDump` on every CPU the bench may use.
    UcryptAllCpus,
    /// The same, pinned to one CPU with `taskset`.
    UcryptOneCpu,
    /// `cryptsetup tcryptDump`.
    Cryptsetup,
}

impl Runner {
    fn name(self, cores: usize) -> String {
        match self {
            Runner::UcryptAllCpus => format!("ucrypt, {cores} CPUs"),
            Runner::UcryptOneCpu => "ucrypt, one CPU".into(),
            Runner::Cryptsetup => "cryptsetup".into(),
        }
    }
}

#[derive(Serialize)]
pub struct KdfRow {
    pub case: KdfCase,
    pub case_name: &'static str,
    pub runner: Runner,
    pub runner_name: String,
    /// Wall-clock seconds of the whole command.
    pub seconds: Summary,
}

pub struct KdfResult {
    pub rows: Vec<KdfRow>,
    pub ratios: Vec<RatioRow>,
}

/// The first CPU this process may run on (the one-CPU runs are pinned there).
fn first_cpu() -> Result<usize, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .ok_or("/proc/self/status has no Cpus_allowed_list")?;
    list.trim()
        .split([',', '-'])
        .next()
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("cannot read Cpus_allowed_list {list:?}"))
}

/// Runs one search; its wall-clock seconds. The right passphrase must open the header and a
/// wrong one must not: either surprise is an error.
fn time_one(runner: Runner, case: KdfCase, image: &Path, cpu: usize) -> Result<f64, String> {
    let mut c = match runner {
        Runner::UcryptAllCpus => Command::new(crate::ucrypt_bin()?),
        Runner::UcryptOneCpu => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string()]).arg(crate::ucrypt_bin()?);
            c
        }
        Runner::Cryptsetup => Command::new("cryptsetup"),
    };
    c.arg("tcryptDump").arg(image);
    c.stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = c.spawn().map_err(|e| format!("{c:?}: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(format!("{}\n", case.passphrase()).as_bytes())
            .map_err(|e| format!("{c:?}: writing the passphrase: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{c:?}: {e}"))?;
    let secs = t0.elapsed().as_secs_f64();
    let opened = out.status.success();
    if opened != (case != KdfCase::WrongPassphrase) {
        return Err(format!(
            "{c:?} ({}): exit {:?}, expected {}: {}",
            case.name(),
            out.status.code(),
            if opened { "a failure" } else { "success" },
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(secs)
}

pub fn measure(
    work: &Workdir,
    tests: &Path,
    runs: usize,
    quick: bool,
    progress: bool,
    skipped: &mut Vec<String>,
) -> Result<KdfResult, String> {
    let image = work.untar(&tests.join("tcrypt-images.tar.xz"), IMAGE)?;
    let cpu = first_cpu()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut runners = vec![Runner::UcryptAllCpus, Runner::UcryptOneCpu];
    // cryptsetup reads TCRYPT through the kernel's crypto API; where that is missing its
    // search fails whatever the passphrase.
    match time_one(Runner::Cryptsetup, KdfCase::VeraSha512, &image, cpu) {
        Ok(_) => runners.push(Runner::Cryptsetup),
        Err(e) => skipped.push(format!(
            "cryptsetup tcryptDump: cannot read TCRYPT on this host ({e}); in the test VM its \
             time runs on an emulated CPU and is not measured here"
        )),
    }
    // --quick: the shortest search only.
    let cases: Vec<KdfCase> = KdfCase::ALL
        .into_iter()
        .filter(|&c| !quick || c == KdfCase::VeraSha512)
        .collect();
    // samples[case][runner][round]
    let mut samples = vec![vec![Vec::new(); runners.len()]; cases.len()];
    for round in 0..runs {
        for (ci, case) in cases.iter().enumerate() {
            for (ri, &runner) in runners.iter().enumerate() {
                if progress {
                    eprintln!(
                        "bench formats: run {}/{runs}: {}: {}",
                        round + 1,
                        case.name(),
                        runner.name(cores)
                    );
                }
                samples[ci][ri].push(time_one(runner, *case, &image, cpu)?);
            }
        }
    }
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for (ci, case) in cases.iter().enumerate() {
        for (ri, &runner) in runners.iter().enumerate() {
            rows.push(KdfRow {
                case: *case,
                case_name: case.name(),
                runner,
                runner_name: runner.name(cores),
                seconds: Summary::of(&samples[ci][ri]),
            });
        }
        let per_round: Vec<f64> = samples[ci][0]
            .iter()
            .zip(&samples[ci][1])
            .map(|(all, one)| all / one)
            .collect();
        let what = format!(
            "tcryptDump seconds: {} ÷ {}",
            Runner::UcryptAllCpus.name(cores),
            Runner::UcryptOneCpu.name(cores)
        );
        let (what, goal) = match case.ceiling(cores) {
            Some(c) => (
                format!(
                    "{what} (the goal {ONE_CPU_GOAL} is below this host's ceiling of {c:.2}: \
                     {SHA512_CHAINS} SHA-512 chains on {cores} CPUs; within {CEILING_SHARE} \
                     of it)"
                ),
                c / CEILING_SHARE,
            ),
            None => (what, ONE_CPU_GOAL),
        };
        ratios.push(RatioRow::new(
            what,
            case.name(),
            &per_round,
            Some((goal, Goal::AtMost)),
        ));
    }
    Ok(KdfResult { rows, ratios })
}

pub fn markdown(rows: &[KdfRow]) -> String {
    let mut runners: Vec<&str> = Vec::new();
    let mut cases: Vec<&str> = Vec::new();
    for r in rows {
        if !runners.contains(&r.runner_name.as_str()) {
            runners.push(&r.runner_name);
        }
        if !cases.contains(&r.case_name) {
            cases.push(r.case_name);
        }
    }
    let mut s = format!(
        "| search | {} |\n|---|{}\n",
        runners.join(" | "),
        "---|".repeat(runners.len())
    );
    for case in cases {
        let cells: Vec<String> = runners
            .iter()
            .map(|n| {
                rows.iter()
                    .find(|r| r.case_name == case && r.runner_name == *n)
                    .map_or_else(|| "–".into(), |r| r.seconds.show(2))
            })
            .collect();
        s.push_str(&format!("| {case} | {} |\n", cells.join(" | ")));
    }
    s
}
