//! Helpers for the NBD interop tests: temp dirs, starting `ucrypt serve`, running clients,
//! and SKIPPED handling for missing Debian packages (a failure when `CI` is set).

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");

/// Returns false (after printing SKIPPED) when `prog` is missing; panics instead under CI,
/// which installs `package`.
pub fn need(prog: &str, package: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {prog}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !found {
        if std::env::var_os("CI").is_some() {
            panic!("{prog} (Debian package {package}) is required under CI");
        }
        println!("SKIPPED: {prog} not installed (Debian package {package})");
    }
    found
}

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "ucrypt-nbd-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    pub fn s(&self, name: &str) -> String {
        self.path(name).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes (xorshift), so failures replay.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.extend_from_slice(&s.to_le_bytes());
    }
    v.truncate(len);
    v
}

pub fn make_image(path: &Path, len: usize, seed: Option<u64>) {
    match seed {
        Some(s) => std::fs::write(path, pattern(len, s)).unwrap(),
        None => {
            let f = std::fs::File::create(path).unwrap();
            f.set_len(len as u64).unwrap();
        }
    }
}

pub struct Server {
    pub child: Child,
    /// The `ready:` URIs, one per export.
    pub uris: Vec<String>,
}

impl Server {
    /// Starts `ucrypt serve ARGS` and waits for its `ready:` lines (`exports` of them).
    pub fn start(args: &[&str], exports: usize) -> Server {
        Self::try_start(args, exports).unwrap_or_else(|e| panic!("server did not start: {e}"))
    }

    pub fn try_start(args: &[&str], exports: usize) -> Result<Server, String> {
        Self::try_start_logged(args, exports, Stdio::inherit())
    }

    /// Like [`Server::try_start`], with the server's log (stderr) going to `log`.
    pub fn try_start_logged(args: &[&str], exports: usize, log: Stdio) -> Result<Server, String> {
        let mut child = Command::new(UCRYPT)
            .arg("serve")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| e.to_string())?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(u) = line.strip_prefix("ready: ") {
                    let _ = tx.send(u.to_string());
                }
            }
        });
        let mut uris = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while uris.len() < exports {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(u) => uris.push(u),
                Err(_) => {
                    let status = wait_timeout(&mut child, Duration::from_millis(100));
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("no ready line (exit code {status:?})"));
                }
            }
        }
        Ok(Server { child, uris })
    }

    pub fn uri(&self) -> &str {
        &self.uris[0]
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGTERM, then wait; returns the exit code.
    pub fn stop(mut self) -> Option<i32> {
        terminate(self.pid());
        let code = wait_timeout(&mut self.child, Duration::from_secs(30));
        if code.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        std::mem::forget(self);
        code
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        terminate(self.pid());
        if wait_timeout(&mut self.child, Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn terminate(pid: i32) {
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
}

pub fn wait_timeout(child: &mut Child, t: Duration) -> Option<i32> {
    let deadline = Instant::now() + t;
    while Instant::now() < deadline {
        if let Ok(Some(s)) = child.try_wait() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Runs a command; returns (success, stdout+stderr).
pub fn run(prog: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {prog}: {e}"));
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), s)
}

/// Runs a command and panics with its output if it fails.
pub fn ok(prog: &str, args: &[&str]) -> String {
    let (good, out) = run(prog, args);
    assert!(good, "{prog} {args:?} failed:\n{out}");
    out
}

/// A self-signed CA `NAME-cert.pem`/`NAME-key.pem` in `dir`, made by the `openssl` CLI.
pub fn ca(dir: &TempDir, name: &str) {
    ok(
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &dir.s(&format!("{name}-key.pem")),
            "-out",
            &dir.s(&format!("{name}-cert.pem")),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A key and certificate `NAME-*.pem` signed by CA `ca_name`, with extensions `ext`.
pub fn leaf(dir: &TempDir, ca_name: &str, name: &str, ext: &str) {
    let key = dir.s(&format!("{name}-key.pem"));
    let csr = dir.s(&format!("{name}.csr"));
    let extf = dir.s(&format!("{name}.ext"));
    std::fs::write(&extf, ext).unwrap();
    ok(
        "openssl",
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    ok(
        "openssl",
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &dir.s(&format!("{ca_name}-cert.pem")),
            "-CAkey",
            &dir.s(&format!("{ca_name}-key.pem")),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &dir.s(&format!("{name}-cert.pem")),
            "-extfile",
            &extf,
        ],
    );
}

/// A TLS server's extensions, for 127.0.0.1 and localhost.
pub const SERVER_EXT: &str = "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n";
