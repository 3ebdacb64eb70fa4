//! A test cluster per test binary (scripts/ceph-cluster.sh), the `rbd` command, and a runner
//! that runs a binary's cases one after the other against that cluster and tears it down at the
//! end, even when cases fail.
//!
//! Each binary has a single `#[test]` that calls [`run_cases`]: the test harness has no hook
//! that runs after the last test, so a cluster shared by several `#[test]`s could only be
//! stopped from an exit handler. Cases are rows of a table; each runs under `catch_unwind`,
//! every case runs, and the test fails naming the cases that failed. `UCRYPT_RBD_CASE=NAME`
//! runs only the cases whose name contains NAME.
//!
//! Without Ceph's packages the test prints `SKIPPED: <reason>` and passes, unless `CI` is set
//! (CI installs them: `scripts/deps.sh test`), where it fails.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ucrypt_rbd::{RbdOptions, RbdSpec};

/// How long one `rbd` command may take; a command sent to a dead cluster retries for ever.
pub const RBD_COMMAND_SECONDS: u32 = 60;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A running cluster; dropping it stops the cluster and removes its directory.
pub struct Cluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
    pub keyring: PathBuf,
    pub osd_pid_file: PathBuf,
}

/// What is missing for the cluster, or None.
fn missing() -> Option<String> {
    for (prog, package) in [
        ("ceph-mon", "ceph-mon"),
        ("ceph-osd", "ceph-osd"),
        ("ceph", "ceph-common"),
        ("rbd", "ceph-common"),
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {prog}")])
            .stdout(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !found {
            return Some(format!(
                "{prog} not installed (Debian package {package}; bash scripts/deps.sh test)"
            ));
        }
    }
    None
}

/// Prints SKIPPED (or panics under CI) when `what` is missing; true when the test can go on.
pub fn present(what: Option<String>) -> bool {
    match what {
        None => true,
        Some(reason) => {
            if std::env::var_os("CI").is_some() {
                panic!("required under CI: {reason}");
            }
            println!("SKIPPED: {reason}");
            false
        }
    }
}

impl Cluster {
    /// Starts a cluster for this test binary in `$TMPDIR/ucrypt-rbd-TAG-PID`, after stopping the
    /// clusters of earlier runs whose process is gone (a run killed before its clean-up).
    /// None (after printing SKIPPED) when Ceph is not installed.
    pub fn start(tag: &str) -> Option<Cluster> {
        if !present(missing()) {
            return None;
        }
        sweep_stale();
        let dir = std::env::temp_dir().join(format!("ucrypt-rbd-{tag}-{}", std::process::id()));
        let t0 = Instant::now();
        let o = Command::new("bash")
            .arg(repo_root().join("scripts/ceph-cluster.sh"))
            .arg("start")
            .arg(&dir)
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/ceph-cluster.sh");
        // Whatever happened, stop it when this guard goes.
        let mut c = Cluster {
            conf: dir.join("ceph.conf"),
            keyring: dir.join("client.admin.keyring"),
            osd_pid_file: dir.join("run/osd.0.pid"),
            dir,
        };
        assert!(
            o.status.success(),
            "ceph-cluster.sh start failed:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let env = std::fs::read_to_string(c.dir.join("env")).expect("read the cluster's env");
        for line in env.lines() {
            match line.split_once('=') {
                Some(("CEPH_CONF", v)) => c.conf = v.into(),
                Some(("CEPH_KEYRING", v)) => c.keyring = v.into(),
                Some(("CEPH_OSD_PID_FILE", v)) => c.osd_pid_file = v.into(),
                _ => {}
            }
        }
        println!(
            "cluster {} started in {:.1} s",
            c.dir.display(),
            t0.elapsed().as_secs_f64()
        );
        Some(c)
    }

    /// `rbd:rbd/IMAGE` reaching this cluster through its configuration file.
    pub fn spec(&self, image: &str) -> RbdSpec {
        let mut s = RbdSpec::new("rbd", image);
        s.options = self.options();
        s
    }

    pub fn options(&self) -> RbdOptions {
        let mut o = RbdOptions::default();
        o.conf = Some(self.conf.clone());
        o
    }

    /// Runs `rbd ARGS` against this cluster; panics with its output when it fails.
    pub fn rbd(&self, args: &[&str]) -> Output {
        let o = self.rbd_try(args);
        assert!(
            o.status.success(),
            "rbd {args:?} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        o
    }

    pub fn rbd_try(&self, args: &[&str]) -> Output {
        Command::new("timeout")
            .arg(RBD_COMMAND_SECONDS.to_string())
            .arg("rbd")
            .args(args)
            .env("CEPH_CONF", &self.conf)
            .stdin(Stdio::null())
            .output()
            .expect("run rbd")
    }

    /// Creates image `name` of `size` (an `rbd create --size` value, such as `64M`).
    pub fn create_image(&self, name: &str, size: &str) {
        self.rbd(&["create", "--size", size, &format!("rbd/{name}")]);
    }

    /// The whole image, as `rbd export` reads it.
    pub fn export(&self, image: &str) -> Vec<u8> {
        let out = self.dir.join(format!("export-{image}"));
        let _ = std::fs::remove_file(&out);
        self.rbd(&[
            "export",
            "--no-progress",
            &format!("rbd/{image}"),
            out.to_str().unwrap(),
        ]);
        let bytes = std::fs::read(&out).expect("read the export");
        let _ = std::fs::remove_file(&out);
        bytes
    }

    /// The OSD's pid.
    pub fn osd_pid(&self) -> u32 {
        std::fs::read_to_string(&self.osd_pid_file)
            .expect("read the OSD's pid file")
            .trim()
            .parse()
            .expect("a pid")
    }

    fn stop(&self) {
        let t0 = Instant::now();
        let o = Command::new("bash")
            .arg(repo_root().join("scripts/ceph-cluster.sh"))
            .arg("stop")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .output();
        match o {
            Ok(o) if o.status.success() => println!(
                "cluster {} stopped in {:.1} s",
                self.dir.display(),
                t0.elapsed().as_secs_f64()
            ),
            Ok(o) => eprintln!(
                "ceph-cluster.sh stop {}: {}",
                self.dir.display(),
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("ceph-cluster.sh stop {}: {e}", self.dir.display()),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Stops clusters left in the temp dir by test processes that no longer exist.
fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("ucrypt-rbd-") else {
            continue;
        };
        let Some(pid) = rest.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let _ = Command::new("bash")
            .arg(repo_root().join("scripts/ceph-cluster.sh"))
            .arg("stop")
            .arg(e.path())
            .stdin(Stdio::null())
            .output();
    }
}

/// A case: a name and what it does with the cluster.
pub type Case = (&'static str, fn(&Cluster));

/// Runs each case (those matching `UCRYPT_RBD_CASE` if set) against one cluster started for
/// `tag`, then stops the cluster and fails if any case did.
pub fn run_cases(tag: &str, cases: &[Case]) {
    let Some(cluster) = Cluster::start(tag) else {
        return;
    };
    let filter = std::env::var("UCRYPT_RBD_CASE").ok();
    let mut failed = Vec::new();
    for &(name, case) in cases {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        let t0 = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&cluster)));
        let secs = t0.elapsed().as_secs_f64();
        match r {
            Ok(()) => println!("case {name}: ok ({secs:.1} s)"),
            Err(_) => {
                println!("case {name}: FAILED ({secs:.1} s)");
                failed.push(name);
            }
        }
    }
    drop(cluster);
    assert!(failed.is_empty(), "failed cases: {failed:?}");
}

/// Runs `f` on a thread and waits at most `limit` for it: a hang becomes a failure naming
/// `what` instead of a test that never ends. The thread is left behind on a hang.
pub fn within<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {limit:?} (hung)"),
    }
}

/// A fresh image name per case (cases share a cluster).
pub fn image_name(case: &str) -> String {
    format!("{case}-{}", std::process::id())
}
