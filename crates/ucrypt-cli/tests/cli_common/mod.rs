//! What the CLI tests share beyond the test kit (`tests/kit`, which each test file includes
//! before `mod cli_common;` and whose general helpers this module re-exports): the binary under
//! test, opening a volume on a loop device, and cryptsetup's upstream test material.
//!
//! Each test file uses a part of it, hence the `dead_code` and `unused_imports` allowances.
#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub use crate::kit::cryptsetup::FAST_PBKDF2;
pub use crate::kit::{have, is_root, missing_root_rig, ok, require, run, run_in, s, text, TempDir};

pub const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");

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

/// cryptsetup's upstream `tests/` folder (images, generators, compat scripts; beside it
/// `../src/` with the option tables of its command line), from Debian's cryptsetup source
/// package: `UCRYPT_CRYPTSETUP_TESTS` names an unpacked one; otherwise it is
/// fetched once (`scripts/fetch-cryptsetup-tests.sh`) into the temp dir, under a lock so that
/// tests running at once fetch it once. `Err` says why it cannot be had (the caller SKIPs).
pub fn cryptsetup_tests() -> Result<PathBuf, String> {
    cryptsetup_tests_of("bookworm")
}

/// As [`cryptsetup_tests`], from Debian `suite`'s source package ("bookworm": 2.6.1, "sid":
/// 2.8.x); `UCRYPT_CRYPTSETUP_TESTS` names bookworm's, `UCRYPT_CRYPTSETUP_TESTS_SID` sid's.
pub fn cryptsetup_tests_of(suite: &str) -> Result<PathBuf, String> {
    let var = match suite {
        "bookworm" => "UCRYPT_CRYPTSETUP_TESTS".to_string(),
        s => format!("UCRYPT_CRYPTSETUP_TESTS_{}", s.to_uppercase()),
    };
    if let Ok(d) = std::env::var(&var) {
        return Ok(PathBuf::from(d));
    }
    let cache = match suite {
        "bookworm" => std::env::temp_dir().join("ucrypt-cryptsetup-src"),
        s => std::env::temp_dir().join(format!("ucrypt-cryptsetup-src-{s}")),
    };
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
            .find(|t| {
                // A copy unpacked before the option and verb tables were part of it is
                // fetched again.
                t.join("luks2-validation-test").is_file()
                    && t.join("../src/cryptsetup_arg_list.h").is_file()
                    && t.join("../src/cryptsetup.c").is_file()
            })
    };
    if let Some(t) = find(&cache) {
        return Ok(t);
    }
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fetch-cryptsetup-tests.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(&cache)
        .arg(suite)
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

/// cryptsetup's image tarball `tests/NAME.tar.xz`, unpacked into a new temporary directory:
/// that directory (removed when dropped) and the `NAME` folder the tarball holds; `None` after
/// printing why the calling test is SKIPPED.
pub fn unpacked_images(name: &str) -> Option<(TempDir, PathBuf)> {
    let tests = image_suite()?;
    let tmp = TempDir::new(name);
    untar(&tests.join(format!("{name}.tar.xz")), tmp.dir());
    let dir = tmp.dir().join(name);
    Some((tmp, dir))
}

/// cryptsetup's test folder with xz to unpack its images, or `None` after printing why the
/// calling test is SKIPPED.
pub fn image_suite() -> Option<PathBuf> {
    if !have("xz") {
        println!("SKIPPED: xz not installed (cryptsetup's images are xz-compressed)");
        return None;
    }
    match cryptsetup_tests() {
        Ok(d) => Some(d),
        Err(why) => {
            println!("SKIPPED: {why}");
            None
        }
    }
}
