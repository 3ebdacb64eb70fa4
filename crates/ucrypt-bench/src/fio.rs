//! Running fio and reading its JSON: the load generator of the front-end benchmarks (FUSE,
//! NBD), so ucrypt and its peers are measured by the same client with the same job. NBD jobs
//! can also run through `qemu-img bench` ([`QEMU_IMG`]): QEMU's own NBD client, the one a
//! virtual machine's disk uses.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Serialize;

/// One fio job: what a row of a front-end benchmark measures.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Job {
    pub name: &'static str,
    /// fio's --rw: read, write, randread, randwrite. With [`QEMU_IMG`] as the engine: read,
    /// write, or write-fua (writethrough cache: every write carries FUA).
    pub rw: &'static str,
    pub block_bytes: u32,
    pub ioengine: &'static str,
    pub iodepth: u32,
    /// Where the client and the server run: [`ANY_CPU`] (where the scheduler puts them) or
    /// [`ONE_CPU`] (both pinned to the same CPU, so no wake-up crosses CPUs).
    pub cpus: &'static str,
    /// fio's --fdatasync: a data sync after every this many writes (0: none), so that the
    /// job measures durable writes.
    pub fdatasync: u32,
    /// fio's --thinktime in µs: the client's pause after each request (0: none).
    pub think_us: u32,
    /// fio's --numjobs: clients running the job at once, each at `iodepth` (reported as one,
    /// `--group_reporting`). Left out of the JSON when 1.
    #[serde(skip_serializing_if = "is_one")]
    pub numjobs: u32,
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// [`Job::cpus`]: the scheduler places client and server.
pub const ANY_CPU: &str = "any";
/// [`Job::cpus`]: client and server pinned to one CPU (see [`Job::on_one_cpu`]).
pub const ONE_CPU: &str = "one";

impl Job {
    pub const fn new(
        name: &'static str,
        rw: &'static str,
        block_bytes: u32,
        ioengine: &'static str,
        iodepth: u32,
    ) -> Job {
        Job {
            name,
            rw,
            block_bytes,
            ioengine,
            iodepth,
            cpus: ANY_CPU,
            fdatasync: 0,
            think_us: 0,
            numjobs: 1,
        }
    }

    /// The same job run by `numjobs` clients at once.
    pub const fn jobs(self, name: &'static str, numjobs: u32) -> Job {
        Job {
            name,
            numjobs,
            ..self
        }
    }

    /// The same job with a data sync after every `writes` writes.
    pub const fn synced(self, name: &'static str, writes: u32) -> Job {
        Job {
            name,
            fdatasync: writes,
            ..self
        }
    }

    /// The same job with the client pausing `think_us` after each request: a client whose
    /// requests come further apart than a server's poll for the next one lasts.
    pub const fn thinking(self, name: &'static str, think_us: u32) -> Job {
        Job {
            name,
            think_us,
            ..self
        }
    }

    /// The same job with client and server pinned to one CPU: at QD1 a request then costs
    /// the work of both ends and two context switches, without the wake-up of a sleeping CPU.
    pub const fn on_one_cpu(self, name: &'static str) -> Job {
        Job {
            name,
            cpus: ONE_CPU,
            ..self
        }
    }

    pub fn is_write(&self) -> bool {
        self.rw.contains("write")
    }
}

/// The `ioengine` of jobs run by `qemu-img bench` instead of fio (sequential requests).
pub const QEMU_IMG: &str = "qemu-img";

/// Runs `job` through `qemu-img bench` on the NBD URI `target`: `count` requests at
/// `job.iodepth`, sequential from offset 0. qemu-img reports only the elapsed time, so the
/// result has throughput and IOPS; its latency fields are NaN (not measured).
pub fn run_qemu_img(job: &Job, target: &Path, count: u64) -> Result<FioResult, String> {
    let mut cmd = Command::new("qemu-img");
    cmd.arg("bench")
        .args(["-f", "raw"])
        .args(["-c", &count.to_string()])
        .args(["-d", &job.iodepth.to_string()])
        .args(["-s", &job.block_bytes.to_string()]);
    match job.rw {
        "read" => {}
        "write" => {
            cmd.arg("-w");
        }
        "write-fua" => {
            cmd.args(["-w", "-t", "writethrough"]);
        }
        other => return Err(format!("qemu-img bench cannot run --rw {other}")),
    }
    cmd.arg(target);
    let out = cmd
        .output()
        .map_err(|e| format!("running qemu-img: {e} (apt-get install qemu-utils)"))?;
    if !out.status.success() {
        return Err(format!(
            "qemu-img bench {} on {} failed: {}",
            job.name,
            target.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // qemu-img's own timer starts after the image is open; ours would also count starting
    // the process and the NBD handshake.
    let secs = parse_qemu_img(&String::from_utf8_lossy(&out.stdout)).ok_or_else(|| {
        format!(
            "qemu-img bench {} printed no \"Run completed\" line: {}",
            job.name,
            String::from_utf8_lossy(&out.stdout).trim()
        )
    })?;
    Ok(qemu_img_result(job, count, secs))
}

/// The elapsed seconds in qemu-img bench's "Run completed in X seconds." line.
fn parse_qemu_img(out: &str) -> Option<f64> {
    let rest = out.split("Run completed in ").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

fn qemu_img_result(job: &Job, count: u64, secs: f64) -> FioResult {
    let secs = secs.max(1e-9);
    FioResult {
        mib_s: (count * u64::from(job.block_bytes)) as f64 / secs / (1024.0 * 1024.0),
        iops: count as f64 / secs,
        lat_p50_us: f64::NAN,
        lat_p99_us: f64::NAN,
        lat_p999_us: f64::NAN,
    }
}

/// What one fio run measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct FioResult {
    pub mib_s: f64,
    pub iops: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
}

/// fio's arguments for `job` (JSON output, one report for all its clients) over the first
/// `size_bytes` of a target given after them (`--filename` or `--uri`), for `runtime` after
/// `ramp` of unmeasured warm-up.
pub fn args(
    job: &Job,
    size_bytes: u64,
    runtime: Duration,
    ramp: Duration,
    direct: bool,
) -> Vec<String> {
    let mut a: Vec<String> = [
        "--name=ucrypt-bench",
        "--output-format=json",
        "--time_based",
        "--group_reporting",
    ]
    .map(String::from)
    .into();
    a.push(format!("--rw={}", job.rw));
    a.push(format!("--bs={}", job.block_bytes));
    a.push(format!("--ioengine={}", job.ioengine));
    a.push(format!("--iodepth={}", job.iodepth));
    a.push(format!("--runtime={}ms", runtime.as_millis().max(1)));
    a.push(format!("--ramp_time={}ms", ramp.as_millis()));
    a.push(format!("--size={size_bytes}"));
    a.push(format!("--direct={}", direct as u8));
    a.push("--randrepeat=0".into());
    a.push("--norandommap".into());
    if job.numjobs > 1 {
        a.push(format!("--numjobs={}", job.numjobs));
    }
    if job.think_us > 0 {
        a.push(format!("--thinktime={}", job.think_us));
    }
    if job.fdatasync > 0 {
        a.push(format!("--fdatasync={}", job.fdatasync));
    }
    a
}

/// Runs `job` for `runtime` (fio takes milliseconds) against `target` (a file path, or with
/// `ioengine` "nbd" an NBD URI), over the first `size_bytes`, after `ramp` of unmeasured
/// warm-up (the scheduler settles where client and server threads run). `cpu`: the CPU fio is
/// pinned to (a [`ONE_CPU`] job), None to let the scheduler place it.
pub fn run_for(
    job: &Job,
    target: &Path,
    size_bytes: u64,
    runtime: Duration,
    ramp: Duration,
    direct: bool,
    cpu: Option<usize>,
) -> Result<FioResult, String> {
    let mut cmd = Command::new("fio");
    cmd.args(args(job, size_bytes, runtime, ramp, direct));
    if let Some(c) = cpu {
        cmd.arg(format!("--cpus_allowed={c}"));
    }
    if job.ioengine == "nbd" {
        cmd.arg(format!("--uri={}", target.display()));
    } else {
        cmd.arg(format!("--filename={}", target.display()));
    }
    let out = cmd
        .output()
        .map_err(|e| format!("running fio: {e} (apt-get install fio)"))?;
    if !out.status.success() {
        return Err(format!(
            "fio {} on {} failed: {}",
            job.name,
            target.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    parse(&String::from_utf8_lossy(&out.stdout), job.is_write())
}

/// Runs `job` on every file of `targets` at once, one fio job (a thread) per file, for
/// `runtime` after `ramp` of unmeasured warm-up, O_DIRECT, each over its file's first
/// `size_bytes`: the result of each file's job, in the order of `targets`.
pub fn run_each(
    job: &Job,
    targets: &[PathBuf],
    size_bytes: u64,
    runtime: Duration,
    ramp: Duration,
) -> Result<Vec<FioResult>, String> {
    let mut cmd = Command::new("fio");
    // Options before the first --name apply to every job.
    cmd.args(["--output-format=json", "--time_based", "--thread"])
        .arg(format!("--rw={}", job.rw))
        .arg(format!("--bs={}", job.block_bytes))
        .arg(format!("--ioengine={}", job.ioengine))
        .arg(format!("--iodepth={}", job.iodepth))
        .arg(format!("--runtime={}ms", runtime.as_millis().max(1)))
        .arg(format!("--ramp_time={}ms", ramp.as_millis()))
        .arg(format!("--size={size_bytes}"))
        .args(["--direct=1", "--randrepeat=0", "--norandommap"]);
    for (i, t) in targets.iter().enumerate() {
        cmd.arg(format!("--name=v{i}"))
            .arg(format!("--filename={}", t.display()));
    }
    let out = cmd
        .output()
        .map_err(|e| format!("running fio: {e} (apt-get install fio)"))?;
    if !out.status.success() {
        return Err(format!(
            "fio {} on {} files failed: {}",
            job.name,
            targets.len(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let all = parse_jobs(&String::from_utf8_lossy(&out.stdout), job.is_write())?;
    if all.len() != targets.len() {
        return Err(format!(
            "fio reported {} jobs for {} files",
            all.len(),
            targets.len()
        ));
    }
    Ok(all)
}

/// Reads bandwidth, IOPS and completion-latency percentiles of the read or write side.
pub fn parse(json: &str, write: bool) -> Result<FioResult, String> {
    parse_jobs(json, write)?
        .into_iter()
        .next()
        .ok_or_else(|| "fio JSON has no job".to_string())
}

/// [`parse`] for every job of fio's JSON (runs without `--group_reporting`), in its order.
pub fn parse_jobs(json: &str, write: bool) -> Result<Vec<FioResult>, String> {
    // fio may print warnings before the JSON document.
    let start = json.find('{').ok_or("fio printed no JSON")?;
    let v: serde_json::Value =
        serde_json::from_str(&json[start..]).map_err(|e| format!("fio JSON: {e}"))?;
    let jobs = v["jobs"].as_array().ok_or("fio JSON has no jobs")?;
    jobs.iter()
        .map(|j| job_result(&j[if write { "write" } else { "read" }]))
        .collect()
}

fn job_result(side: &serde_json::Value) -> Result<FioResult, String> {
    let num = |x: &serde_json::Value| {
        x.as_f64()
            .ok_or_else(|| format!("fio JSON lacks a number at {x}"))
    };
    let pct = |p: &str| {
        side["clat_ns"]["percentile"][p]
            .as_f64()
            .map(|ns| ns / 1000.0)
            .unwrap_or(f64::NAN)
    };
    Ok(FioResult {
        mib_s: num(&side["bw_bytes"])? / (1024.0 * 1024.0),
        iops: num(&side["iops"])?,
        lat_p50_us: pct("50.000000"),
        lat_p99_us: pct("99.000000"),
        lat_p999_us: pct("99.900000"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_qemu_img_bench() {
        let job = Job::new("4k read", "read", 4096, QEMU_IMG, 1);
        // (qemu-img's stdout, requests, seconds used, MiB/s)
        let rows: &[(&str, u64, f64, f64)] = &[
            ("Sending 256 read requests, 4096 bytes each, 1 in parallel (starting at offset 0, step size 4096)\nRun completed in 0.500 seconds.\n", 256, 0.5, 2.0),
            ("Run completed in 2 seconds.", 1024, 2.0, 2.0),
        ];
        for &(out, count, secs, mib_s) in rows {
            let got = parse_qemu_img(out).expect(out);
            assert_eq!(got, secs, "{out}");
            let r = qemu_img_result(&job, count, got);
            assert!((r.mib_s - mib_s).abs() < 1e-9, "{out}: {}", r.mib_s);
            assert!(r.lat_p99_us.is_nan());
        }
        assert_eq!(parse_qemu_img("qemu-img: Could not open"), None);
    }

    #[test]
    fn parses_fio_json() {
        let json = r#"note: a warning line
        {"jobs":[{"read":{"bw_bytes":104857600,"iops":25600.0,
          "clat_ns":{"percentile":{"50.000000":30000,"99.000000":90000,"99.900000":150000}}},
          "write":{"bw_bytes":0,"iops":0.0,"clat_ns":{}}}]}"#;
        let r = parse(json, false).unwrap();
        assert_eq!(
            (r.mib_s, r.iops, r.lat_p50_us, r.lat_p99_us, r.lat_p999_us),
            (100.0, 25600.0, 30.0, 90.0, 150.0)
        );
        let w = parse(json, true).unwrap();
        assert_eq!(w.mib_s, 0.0);
        assert!(w.lat_p99_us.is_nan());
        assert!(parse("no json", false).is_err());
    }

    #[test]
    fn parses_every_job() {
        let json = r#"{"jobs":[
          {"read":{"bw_bytes":1048576,"iops":256.0,"clat_ns":{"percentile":{"99.000000":5000}}}},
          {"read":{"bw_bytes":2097152,"iops":512.0,"clat_ns":{"percentile":{"99.000000":7000}}}}]}"#;
        let r = parse_jobs(json, false).unwrap();
        let got: Vec<(f64, f64)> = r.iter().map(|x| (x.iops, x.lat_p99_us)).collect();
        assert_eq!(got, [(256.0, 5.0), (512.0, 7.0)]);
        assert!(parse_jobs(r#"{"jobs":[]}"#, false).unwrap().is_empty());
        assert!(parse(r#"{"jobs":[]}"#, false).is_err());
        assert!(parse_jobs(r#"{"x":1}"#, false).is_err());
    }
}
