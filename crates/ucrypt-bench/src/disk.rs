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
