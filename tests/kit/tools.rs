//! Whether a test can run here. Two kinds of absence, two rules:
//! - what CI installs (a Debian package, `scripts/deps.sh test`): missing, the test prints
//!   `SKIPPED: reason` and returns, except under CI, where it fails ([`require`], [`can_run`]);
//! - what no package brings (root, a kernel feature, a device node): the test prints
//!   `SKIPPED: reason` and returns, also under CI ([`skip`]).
//!
//! `scripts/test.sh` counts the `SKIPPED` lines, so that a test that returned early is not
//! reported as passed.

use std::fmt::Display;
use std::path::{Path, PathBuf};

/// Whether this is a CI run (`CI` set and not empty), where every package the suite needs is
/// installed, so that a missing one is a failure, not a skip.
pub fn under_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Prints `SKIPPED: reason`; the caller then returns.
pub fn skip(reason: impl Display) {
    println!("SKIPPED: {reason}");
}

/// Whether the test can go on: `missing` names what CI installs and this machine lacks. None:
/// true. Some: under CI a panic, else [`skip`] and false.
pub fn can_run(missing: Option<String>) -> bool {
    match missing {
        None => true,
        Some(reason) if under_ci() => panic!("required under CI: {reason}"),
        Some(reason) => {
            skip(reason);
            false
        }
    }
}

/// Whether the program `cmd` is here: a path to a file, or a name found in a directory of
/// `PATH` as an executable file.
pub fn have(cmd: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if cmd.contains('/') {
        return runnable(Path::new(cmd));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| runnable(&d.join(cmd))))
}

/// The workspace binary `name` beside `exe` (a `CARGO_BIN_EXE_*` path: `cargo test
/// --workspace` builds every binary into one directory). When it is missing: None, after
/// SKIPPED for `test` (a failure under CI).
pub fn sibling_bin(test: &str, exe: &str, name: &str) -> Option<PathBuf> {
    let bin = Path::new(exe).with_file_name(name);
    if bin.is_file() {
        return Some(bin);
    }
    let why = format!("{} missing: run the tests with --workspace", bin.display());
    assert!(!under_ci(), "{why}");
    println!("SKIPPED {test}: {why}");
    None
}

/// Whether `tool` is here; without it, [`can_run`] with the Debian `package` that brings it.
pub fn require(tool: &str, package: &str) -> bool {
    can_run((!have(tool)).then(|| format!("{tool} not installed (Debian package {package})")))
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Why a volume cannot be opened with FUSE + loop here (root, /dev/fuse, /dev/loop-control,
/// and each of `cmds` installed), if it cannot. Root and the device nodes are no package, so
/// callers [`skip`] on the answer, also under CI.
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
