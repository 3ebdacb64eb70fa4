//! Temporary directories and files, removed on drop (also when the test fails).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Set (to anything) to keep the temporary directories of a run, to look at after a failure.
pub const KEEP_VAR: &str = "UCRYPT_KEEP_TMP";

/// A name no other temporary of this run or of another process shares: the tag, the pid and a
/// counter (several tests of one binary run at once and may share a tag).
fn unique(tag: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("ucrypt-{tag}-{}-{n}", std::process::id())
}

/// A directory under the system's temp dir (`TMPDIR`), removed on drop unless
/// [`KEEP_VAR`] is set. The field is public because ucrypt-bench's `integrity --vm` reads it;
/// tests use [`TempDir::dir`] and [`TempDir::path`].
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(unique(tag));
        // A directory of that name is a leftover of a killed run whose pid came round again.
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)
            .unwrap_or_else(|e| panic!("creating the temp dir {}: {e}", p.display()));
        TempDir(p)
    }

    pub fn dir(&self) -> &Path {
        &self.0
    }

    /// `name` inside the directory (not created).
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// [`TempDir::path`] as the `String` a command line takes.
    pub fn s(&self, name: &str) -> String {
        self.path(name).to_string_lossy().into_owned()
    }

    /// A file `name` holding `data`.
    pub fn file(&self, name: &str, data: impl AsRef<[u8]>) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, data).unwrap_or_else(|e| panic!("writing {}: {e}", p.display()));
        p
    }

    /// A zero-filled (sparse) file `name` of `bytes` bytes.
    pub fn sparse(&self, name: &str, bytes: u64) -> PathBuf {
        let p = self.path(name);
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(bytes))
            .unwrap_or_else(|e| panic!("creating {}: {e}", p.display()));
        p
    }

    /// A zero-filled (sparse) image `name` of `mib` MiB.
    pub fn image(&self, name: &str, mib: u64) -> PathBuf {
        self.sparse(name, mib << 20)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os(KEEP_VAR).is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A zero-filled (sparse) file of a given size, in RAM (`/dev/shm`) where there is one so that
/// tests do not wait for a disk; removed on drop.
pub struct TempFile(pub PathBuf);

impl TempFile {
    pub fn new(bytes: u64) -> TempFile {
        let dir = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let p = dir.join(unique("file"));
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(bytes))
            .unwrap_or_else(|e| panic!("creating {}: {e}", p.display()));
        TempFile(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
