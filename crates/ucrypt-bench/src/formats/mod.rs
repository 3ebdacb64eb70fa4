//! `ucrypt bench formats`: the foreign formats (issue 43's "Speed"), side by side in one run.
//!
//! - Data ([`io`]): BitLocker images of cryptsetup's `tests/bitlk-images.tar.xz` (AES-256:
//!   XTS, CBC, CBC with the Elephant diffuser) through `ucrypt mount` beside `dislocker-fuse`
//!   on the same file, a VeraCrypt AES-XTS volume (`tcrypt-images.tar.xz`'s system image) and
//!   a LUKS2 volume with the same cipher and sector size made by cryptsetup: fio with O_DIRECT
//!   on the FUSE file, 4 KiB random and 1 MiB sequential reads and writes.
//! - Header-key derivation ([`kdf`]): `ucrypt tcryptDump` with the hash not given (the
//!   candidate search, spread over the cores) beside the same search on one CPU, and beside
//!   `cryptsetup tcryptDump` where cryptsetup can read TCRYPT on this host.
//!
//! Targets run round-robin, one at a time; ratios are taken run by run (both sides measured
//! within the same round) and then summarised, so they carry less of the host's drift than
//! the absolute numbers do.

mod io;
mod kdf;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use super::cmd::{have, run_ok};
use super::stats::{Machine, Summary};

use io::IoRow;
use kdf::KdfRow;

/// The passphrase of every image of `bitlk-images.tar.xz` (its `images.conf`, `PW`).
const BITLK_PASSPHRASE: &str = "anaconda";
/// The passphrase of the TCRYPT images (`tcrypt-compat-test`'s `PASSWORD`).
const TCRYPT_PASSPHRASE: &str = "aaaaaaaaaaaa";

#[derive(Serialize)]
pub struct FormatsReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub runs: usize,
    /// Seconds of each fio job.
    pub runtime_s: f64,
    /// Bytes of each volume the fio jobs cover (from its start).
    pub region_bytes: u64,
    /// The cryptsetup test material the images came from.
    pub images_from: String,
    pub skipped: Vec<String>,
    pub rows: Vec<IoRow>,
    pub kdf: Vec<KdfRow>,
    /// Quotients measured within one round each, summarised over the rounds.
    pub ratios: Vec<RatioRow>,
}

/// `num ÷ den` of one metric, taken in each round, with the goal issue 43 sets where it sets one.
#[derive(Serialize)]
pub struct RatioRow {
    pub what: String,
    /// The fio job, or the KDF case.
    pub of: String,
    pub ratio: Summary,
    /// The goal; `goal_is` says whether the ratio must be at least (`min`) or at most (`max`)
    /// this.
    pub goal: Option<f64>,
    pub goal_is: &'static str,
    /// The median meets the goal (true where there is none).
    pub met: bool,
}

impl RatioRow {
    fn new(what: String, of: &str, per_round: &[f64], goal: Option<(f64, Goal)>) -> RatioRow {
        let ratio = Summary::of(per_round);
        let met = goal.is_none_or(|(g, kind)| match kind {
            Goal::AtLeast => ratio.median >= g,
            Goal::AtMost => ratio.median <= g,
        });
        RatioRow {
            what,
            of: of.to_owned(),
            ratio,
            goal: goal.map(|g| g.0),
            goal_is: match goal {
                Some((_, Goal::AtLeast)) => "min",
                Some((_, Goal::AtMost)) => "max",
                None => "none",
            },
            met,
        }
    }
}

#[derive(Clone, Copy)]
enum Goal {
    AtLeast,
    AtMost,
}

/// The benchmark's files in /dev/shm (so that storage is not what is measured), removed on
/// drop.
struct Workdir {
    dir: PathBuf,
}

impl Workdir {
    fn new() -> Result<Workdir, String> {
        let dir = crate::disk::run_dir(Path::new("/dev/shm"), "formats")?;
        Ok(Workdir { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Unpacks `member` of the tarball `tar` (a path inside it) into this directory; its path.
    fn untar(&self, tar: &Path, member: &str) -> Result<PathBuf, String> {
        run_ok(
            Command::new("tar")
                .arg("-xJf")
                .arg(tar)
                .arg("-C")
                .arg(&self.dir)
                .arg(member),
        )?;
        Ok(self.dir.join(member))
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `tests/` folder of cryptsetup's source: `UCRYPT_CRYPTSETUP_TESTS`, else the copy the
/// test suite unpacks (`$TMPDIR/ucrypt-cryptsetup-src/*/tests`), else fetched there by
/// `scripts/fetch-cryptsetup-tests.sh` of the checkout this bench was built from.
fn cryptsetup_tests() -> Result<PathBuf, String> {
    let has_images = |t: &Path| {
        t.join("bitlk-images.tar.xz").is_file() && t.join("tcrypt-images.tar.xz").is_file()
    };
    if let Some(d) = std::env::var_os("UCRYPT_CRYPTSETUP_TESTS") {
        let d = PathBuf::from(d);
        return if has_images(&d) {
            Ok(d)
        } else {
            Err(format!(
                "UCRYPT_CRYPTSETUP_TESTS={} holds no bitlk-images.tar.xz and \
                 tcrypt-images.tar.xz",
                d.display()
            ))
        };
    }
    let cache = std::env::temp_dir().join("ucrypt-cryptsetup-src");
    let find = || {
        std::fs::read_dir(&cache)
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("tests"))
            .find(|t| has_images(t))
    };
    if let Some(t) = find() {
        return Ok(t);
    }
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fetch-cryptsetup-tests.sh");
    if !script.is_file() {
        return Err(format!(
            "cryptsetup's test images not found: set UCRYPT_CRYPTSETUP_TESTS to the tests/ \
             folder of cryptsetup's source (no {} to fetch it)",
            script.display()
        ));
    }
    run_ok(Command::new("bash").arg(&script).arg(&cache))?;
    find().ok_or_else(|| format!("{} fetched no test images", script.display()))
}

pub fn measure(runs: usize, quick: bool, progress: bool) -> Result<FormatsReport, String> {
    for (p, pkg) in [
        ("fio", "fio"),
        ("cryptsetup", "cryptsetup-bin"),
        ("fusermount3", "fuse3"),
        ("xz", "xz-utils"),
        ("taskset", "util-linux"),
    ] {
        if !have(p) {
            return Err(format!("{p} not found (apt-get install {pkg})"));
        }
    }
    let tests = cryptsetup_tests()?;
    let work = Workdir::new()?;
    let mut skipped = Vec::new();
    let runtime_s = if quick { 0.5 } else { 3.0 };
    let io = io::measure(&work, &tests, runs, runtime_s, progress, &mut skipped)?;
    let kdf = kdf::measure(&work, &tests, runs, quick, progress, &mut skipped)?;
    let mut ratios = io.ratios;
    ratios.extend(kdf.ratios);
    Ok(FormatsReport {
        schema: 1,
        machine: Machine::detect(),
        runs,
        runtime_s,
        region_bytes: io::REGION_BYTES,
        images_from: tests.display().to_string(),
        skipped,
        rows: io.rows,
        kdf: kdf.rows,
        ratios,
    })
}

pub fn markdown(r: &FormatsReport) -> String {
    let mut s = format!(
        "Machine: {}. {} round-robin runs; fio --direct=1 on the FUSE file, {} s per job, over \
         the first {} MiB of each volume; images from {}. MiB/s median (min–max):\n\n",
        r.machine.describe(),
        r.runs,
        r.runtime_s,
        r.region_bytes >> 20,
        r.images_from
    );
    s.push_str(&io::markdown(&r.rows));
    s.push_str(
        "\nHeader-key derivation (`tcryptDump`, hash not given: the candidate search), \
         seconds median (min–max):\n\n",
    );
    s.push_str(&kdf::markdown(&r.kdf));
    s.push_str(
        "\nRatios, taken within each round, median (min–max) over the rounds:\n\n\
         | ratio | of | median (min–max) | goal | met |\n|---|---|---|---|---|\n",
    );
    for x in &r.ratios {
        let goal = match (x.goal, x.goal_is) {
            (Some(g), "min") => format!("≥ {}", (g * 100.0).round() / 100.0),
            (Some(g), _) => format!("≤ {}", (g * 100.0).round() / 100.0),
            (None, _) => "–".into(),
        };
        let met = if x.goal.is_some() {
            if x.met {
                "yes"
            } else {
                "no"
            }
        } else {
            "–"
        };
        s.push_str(&format!(
            "| {} | {} | {} | {goal} | {met} |\n",
            x.what,
            x.of,
            x.ratio.show(2)
        ));
    }
    for sk in &r.skipped {
        s.push_str(&format!("\nSkipped: {sk}\n"));
    }
    s
}
