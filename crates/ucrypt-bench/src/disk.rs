//! Where the benchmarks put images on the machine's disk (rather than in RAM), and how they
//! fill them: shared by `bench nbd` and `bench fuse`, whose "on disk" rows measure what the
//! page cache and durable writes cost on real storage.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Where the disk images go unless `UCRYPT_BENCH_DISK_DIR` says otherwise: a directory that
/// is on disk on Debian (/tmp may be a tmpfs).
pub const DISK_DIR_DEFAULT: &str = "/var/tmp";

/// The file system type of the mount holding `path` (from /proc/self/mounts).
pub fn fs_type(path: &Path) -> Option<String> {
    let path = path.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
            // Mount points with spaces are escaped as \040.
            let at = PathBuf::from(at.replace("\\040", " "));
            path.starts_with(&at).then(|| (at, kind.to_string()))
        })
        .max_by_key(|(at, _)| at.as_os_str().len())
        .map(|(_, kind)| kind)
}

/// The directory for the disk jobs' images, or why there is none.
pub fn disk_dir() -> Result<PathBuf, String> {
    let dir = std::env::var_os("UCRYPT_BENCH_DISK_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DISK_DIR_DEFAULT));
    match fs_type(&dir) {
        None => Err(format!(
            "the disk jobs: {} does not exist (set UCRYPT_BENCH_DISK_DIR to a directory on disk)",
            dir.display()
        )),
        Some(k) if ["tmpfs", "ramfs"].contains(&k.as_str()) => Err(format!(
            "the disk jobs: {} is on {k}, not on disk (set UCRYPT_BENCH_DISK_DIR to a directory \
             on disk)",
            dir.display()
        )),
        Some(_) => Ok(dir),
    }
}

/// Every run directory's name: `ucrypt-bench-SCENARIO-PID`.
const RUN_DIR_PREFIX: &str = "ucrypt-bench-";
/// The file in a run directory that its run holds locked (flock) until it exits.
const RUN_LOCK: &str = ".running";

/// A new directory `base/ucrypt-bench-SCENARIO-PID` for this run's images, locked as this
/// run's for as long as the process lives; first removes what killed runs left under `base`
/// ([`sweep_killed_runs`]). A run that ends any other way removes its own directory on the way
/// out; one killed with SIGKILL cannot, and the next run removes it here.
pub fn run_dir(base: &Path, scenario: &str) -> Result<PathBuf, String> {
    sweep_killed_runs(base);
    let dir = base.join(format!("{RUN_DIR_PREFIX}{scenario}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let lock = dir.join(RUN_LOCK);
    let f = File::create(&lock).map_err(|e| format!("{}: {e}", lock.display()))?;
    if !try_lock(&f) {
        return Err(format!("{}: locked by another run", lock.display()));
    }
    // Held until the process exits, however it exits: the kernel drops the lock then. One
    // descriptor per run directory, a handful per process.
    std::mem::forget(f);
    Ok(dir)
}

/// Whether this process got `f`'s exclusive lock without waiting.
fn try_lock(f: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor `f` owns and keeps open for the call's duration.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Removes the run directories under `base` that no running benchmark holds: its lock file
/// free (or missing) and its process gone. A directory of a live run (in any PID namespace:
/// the lock says so), of another user, or of another name pattern is kept. Each removal is
/// said on stderr.
pub fn sweep_killed_runs(base: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(RUN_DIR_PREFIX)) else {
            continue;
        };
        let Some((scenario, pid)) = rest.rsplit_once('-') else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if scenario.is_empty() || !scenario.bytes().all(|b| b.is_ascii_lowercase()) {
            continue;
        }
        let path = e.path();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() && m.uid() == me => {}
            _ => continue,
        }
        // Both must say so: a run between making its directory and locking it is alive in
        // /proc, and a live run in another PID namespace holds its lock.
        let unlocked = File::open(path.join(RUN_LOCK)).map_or(true, |f| try_lock(&f));
        let killed = unlocked && !Path::new(&format!("/proc/{pid}")).exists();
        if killed && std::fs::remove_dir_all(&path).is_ok() {
            eprintln!(
                "ucrypt bench: removed {} (left by a run that was killed)",
                path.display()
            );
        }
    }
}

/// Writes `bytes` of pseudo-random data (xorshift64*, fixed seed: every run the same) to `path`,
/// makes it durable and drops it from the page cache.
pub fn write_noise(path: &Path, bytes: u64) -> Result<(), String> {
    const CHUNK_BYTES: usize = 1 << 20;
    let f = File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut w = BufWriter::with_capacity(CHUNK_BYTES, f);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut chunk = vec![0u8; CHUNK_BYTES];
    let mut left = bytes;
    while left > 0 {
        for word in chunk.chunks_exact_mut(8) {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            word.copy_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
        }
        let n = left.min(CHUNK_BYTES as u64) as usize;
        w.write_all(&chunk[..n])
            .map_err(|e| format!("{}: {e}", path.display()))?;
        left -= n as u64;
    }
    let f = w
        .into_inner()
        .map_err(|e| format!("{}: {}", path.display(), e.error()))?;
    drop(f);
    settle(path)
}

/// Makes the file at `path` durable and drops it from the page cache: a benchmark then starts
/// from the disk, and an O_DIRECT read need not first write back dirty pages of its range
/// (which made whichever target ran first pay for the set-up's writes).
/// Files in RAM (tmpfs, ramfs) are left alone: their pages are the data.
pub fn settle(path: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    if fs_type(path).is_some_and(|k| ["tmpfs", "ramfs"].contains(&k.as_str())) {
        return Ok(());
    }
    let f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.sync_all()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: an open descriptor; the call only advises the kernel about its cached pages.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid no process has now: a child's, once it has been reaped.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true")
            .spawn()
            .expect("run true");
        let pid = c.id();
        c.wait().expect("wait");
        pid
    }

    #[test]
    fn a_killed_runs_directory_goes_and_a_live_ones_stays() {
        let base = std::env::temp_dir().join(format!("ucrypt-disk-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let dead = dead_pid();
        // Killed: its lock file free, its process gone; and one from before lock files.
        let killed = base.join(format!("ucrypt-bench-vhost-{dead}"));
        std::fs::create_dir_all(&killed).unwrap();
        std::fs::write(killed.join(RUN_LOCK), b"").unwrap();
        std::fs::write(killed.join("luks1.img"), b"x").unwrap();
        let old = base.join(format!("ucrypt-bench-nbd-{dead}"));
        std::fs::create_dir_all(&old).unwrap();
        // Kept: a live process's without a lock, another name, a file.
        let init = base.join("ucrypt-bench-scale-1");
        std::fs::create_dir_all(&init).unwrap();
        let other = base.join(format!("ucrypt-bench-Vhost-{dead}"));
        std::fs::create_dir_all(&other).unwrap();
        let file = base.join(format!("ucrypt-bench-fuse-{dead}"));
        std::fs::write(&file, b"").unwrap();
        // This run's own, locked: kept by the next scenario's sweep.
        let mine = run_dir(&base, "fuse").unwrap();
        let second = run_dir(&base, "nbd").unwrap();
        assert!(
            !killed.exists() && !old.exists(),
            "killed runs' directories stay"
        );
        for kept in [&init, &other, &file, &mine, &second] {
            assert!(kept.exists(), "{} removed", kept.display());
        }
        std::fs::remove_dir_all(&base).unwrap();
    }
}
