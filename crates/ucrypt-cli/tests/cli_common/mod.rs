//! What the CLI tests share: the binary under test, a fast KDF, a temporary directory, running a
//! program and showing what it said, and the checks that decide whether a test can run here
//! (a tool installed, root with FUSE + loop) or must print `SKIPPED: reason`.
//!
//! Each test file uses a part of it (`mod cli_common;`), hence the `dead_code` allowance.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");

/// KDF settings both ucrypt and cryptsetup accept, fast enough for a test suite.
pub const FAST_PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

/// A directory under the system's temp dir, removed on drop. Its name carries the tag, the
/// process id and the time, so that tests of one run and runs of other checkouts never share
/// one.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("ucrypt-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
    pub fn dir(&self) -> &Path {
        &self.0
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    /// A file with the given contents.
    pub fn file(&self, name: &str, data: &[u8]) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, data).expect("write temp file");
        p
    }
    /// A zero-filled (sparse) image of `mib` MiB.
    pub fn image(&self, name: &str, mib: u64) -> PathBuf {
        let p = self.path(name);
        let f = std::fs::File::create(&p).expect("create image");
        f.set_len(mib << 20).expect("size image");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `ucrypt open IMG NAME --key-file KEY --front-end loop EXTRA...` (a daemon serving the
/// volume on a loop device), asserted to succeed.
pub fn open_loop(img: &Path, key: &Path, name: &str, extra: &[&str]) -> Output {
    let mut a = vec![
        "open",
        s(img),
        name,
        "--key-file",
        s(key),
        "--front-end",
        "loop",
    ];
    a.extend(extra);
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
    o
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Runs `prog ARGS` with no stdin and collects its output.
pub fn run(prog: &str, args: &[&str]) -> Output {
    Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"))
}

/// Exit code, stdout and stderr, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `prog ARGS`, which must succeed; returns its stdout.
pub fn ok(prog: &str, args: &[&str]) -> String {
    let o = run(prog, args);
    assert!(o.status.success(), "{prog} {args:?} failed: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether `cmd` is on the PATH.
pub fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Whether `tool` runs here (`tool --version`); when it does not, prints SKIPPED naming the
/// Debian package, or panics under CI (which installs it).
pub fn require(tool: &str, package: &str) -> bool {
    let ok = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("{tool} missing under CI: install the Debian package {package}");
        }
        eprintln!("SKIPPED: {tool} not installed (Debian package {package})");
    }
    ok
}

/// Why a volume cannot be opened with FUSE + loop here (root, /dev/fuse, /dev/loop-control,
/// and each of `cmds` on the PATH), if it cannot.
pub fn missing_root_rig(cmds: &[&str]) -> Option<String> {
    if !is_root() {
        return Some("not root (open with FUSE + loop needs root)".into());
    }
    for dev in ["/dev/fuse", "/dev/loop-control"] {
        if !Path::new(dev).exists() {
            return Some(format!("{dev} missing"));
        }
    }
    cmds.iter()
        .find(|c| !have(c))
        .map(|c| format!("{c} not installed (scripts/deps.sh test)"))
}

/// cryptsetup's upstream `tests/` folder (images, generators, compat scripts), from Debian's
/// cryptsetup source package: `UCRYPT_CRYPTSETUP_TESTS` names an unpacked one; otherwise it is
/// fetched once (`scripts/fetch-cryptsetup-tests.sh`) into the temp dir, under a lock so that
/// tests running at once fetch it once. `Err` says why it cannot be had (the caller SKIPs).
pub fn cryptsetup_tests() -> Result<PathBuf, String> {
    if let Ok(d) = std::env::var("UCRYPT_CRYPTSETUP_TESTS") {
        return Ok(PathBuf::from(d));
    }
    let cache = std::env::temp_dir().join("ucrypt-cryptsetup-src");
    std::fs::create_dir_all(&cache).map_err(|e| format!("{}: {e}", cache.display()))?;
    let lock = std::fs::File::create(cache.join(".lock")).map_err(|e| e.to_string())?;
    // SAFETY: flock on a descriptor `lock` owns; no memory is passed. Released when `lock`
    // is dropped at the end of this function.
    let r = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
    if r != 0 {
        return Err(format!(
            "lock {}: {}",
            cache.display(),
            std::io::Error::last_os_error()
        ));
    }
    let find = |cache: &Path| -> Option<PathBuf> {
        std::fs::read_dir(cache)
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("tests"))
            .find(|t| t.join("luks2-validation-test").is_file())
    };
    if let Some(t) = find(&cache) {
        return Ok(t);
    }
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fetch-cryptsetup-tests.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(&cache)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "could not fetch cryptsetup's source package: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    find(&cache).ok_or_else(|| "the source package has no tests/luks2-validation-test".into())
}

/// Decompresses the `.xz` file `src` to `dst`.
pub fn unxz(src: &Path, dst: &Path) {
    let out = Command::new("xz")
        .arg("-dc")
        .arg(src)
        .output()
        .unwrap_or_else(|e| panic!("xz: {e}"));
    assert!(
        out.status.success(),
        "xz -dc {}: {}",
        src.display(),
        text(&out)
    );
    std::fs::write(dst, out.stdout).expect("write the unpacked image");
}

/// Unpacks the tarball `src` (xz) into `dir`.
pub fn untar(src: &Path, dir: &Path) {
    let out = Command::new("tar")
        .arg("-xJf")
        .arg(src)
        .arg("-C")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("tar: {e}"));
    assert!(
        out.status.success(),
        "tar -xJf {}: {}",
        src.display(),
        text(&out)
    );
}

/// Runs `prog ARGS` with `input` on stdin and collects its output.
pub fn run_in(prog: &str, args: &[&str], input: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"));
    let mut stdin = child.stdin.take().expect("stdin");
    // The program may exit without reading (a usage error): a broken pipe is its answer.
    let _ = stdin.write_all(input);
    drop(stdin);
    child.wait_with_output().expect("wait")
}
