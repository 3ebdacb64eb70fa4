//! Puts the git commit the binary is built from into `UCRYPT_COMMIT` for `ucrypt --version`.
//!
//! Outside a git checkout (a source package, a tarball) or without git, the variable is empty
//! and `--version` names no commit. `UCRYPT_COMMIT` set in the build's environment wins: a
//! source package built from a known commit can name it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=UCRYPT_COMMIT");
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let commit = match std::env::var("UCRYPT_COMMIT") {
        Ok(c) => c,
        Err(_) => git_commit(&manifest_dir).unwrap_or_default(),
    };
    println!("cargo:rustc-env=UCRYPT_COMMIT={commit}");
}

/// The short hash of HEAD, and the files whose change moves HEAD watched for a rebuild.
fn git_commit(dir: &Path) -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        Some(String::from_utf8(out.stdout).ok()?.trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    // HEAD itself (a checkout of another branch) and the branch it names (a commit on it); a
    // worktree's HEAD is in its own git dir, the branches in the common one.
    let git_dir = git(&["rev-parse", "--absolute-git-dir"])?;
    println!("cargo:rerun-if-changed={git_dir}/HEAD");
    if let (Some(branch), Some(common)) = (
        git(&["symbolic-ref", "-q", "HEAD"]),
        git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]),
    ) {
        for f in [
            format!("{common}/{branch}"),
            format!("{common}/packed-refs"),
        ] {
            if Path::new(&f).exists() {
                println!("cargo:rerun-if-changed={f}");
            }
        }
    }
    Some(commit)
}
