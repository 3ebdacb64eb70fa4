//! A regular file or a block device, through `pread`/`pwrite`.
//!
//! Opened with `O_DIRECT` when the filesystem allows it, so that ciphertext does not fill the
//! page cache and reads measure the storage, not a copy. io_uring is deliberately not used:
//! on RAM-backed files (the benchmark's) a request is punted to a kernel worker, which makes it
//! several times slower than `pread` at queue depth 1; the engine gets its parallelism from
//! several threads doing `pread`/`pwrite` at once.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::{check_range, Backend};
use crate::{Error, Result};

/// `BLKDISCARD` = `_IO(0x12, 119)`; not in the libc crate.
const BLKDISCARD: libc::c_ulong = 0x1277;
/// `BLKZEROOUT` = `_IO(0x12, 127)`.
const BLKZEROOUT: libc::c_ulong = 0x127f;
/// Zeroes written per call when the kernel cannot zero a range for us.
const ZERO_CHUNK_BYTES: usize = 64 << 10;

#[repr(C, align(4096))]
struct AlignedZeroes([u8; ZERO_CHUNK_BYTES]);
static ZEROES: AlignedZeroes = AlignedZeroes([0; ZERO_CHUNK_BYTES]);

/// Whether to open with `O_DIRECT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectMode {
    /// `O_DIRECT` if the filesystem accepts it, else buffered (see [`FileBackend::note`]).
    Auto,
    /// Fail if `O_DIRECT` is refused.
    Always,
    /// Buffered I/O through the page cache.
    Never,
}

/// How a file volume uses the host's page cache and when its writes are durable, as qemu's
/// `cache=` modes are spelled (`--cache` of the CLI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// O_DIRECT (buffered only where the filesystem refuses it): no ciphertext in the page
    /// cache; writes durable at a flush. The default: the plaintext above a ucrypt volume is
    /// already cached by whoever reads it (the page cache over FUSE/loop/ublk, a guest's own
    /// cache over NBD), and a second copy of it as ciphertext is memory spent twice.
    #[default]
    None,
    /// Through the page cache; writes durable at a flush (fdatasync).
    Writeback,
    /// Through the page cache; every write durable when it completes (RWF_DSYNC).
    Writethrough,
    /// O_DIRECT and every write durable when it completes.
    Directsync,
    /// Through the page cache, and flushes do nothing: for scratch volumes only; a crash of the
    /// host loses acknowledged writes.
    Unsafe,
}

impl CacheMode {
    pub const NAMES: &'static str = "none, writeback, writethrough, directsync, unsafe";

    /// Whether the file is opened with O_DIRECT.
    pub fn direct_mode(self) -> DirectMode {
        match self {
            CacheMode::None | CacheMode::Directsync => DirectMode::Auto,
            _ => DirectMode::Never,
        }
    }

    fn write_through(self) -> bool {
        matches!(self, CacheMode::Writethrough | CacheMode::Directsync)
    }
}

impl std::str::FromStr for CacheMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "none" => CacheMode::None,
            "writeback" => CacheMode::Writeback,
            "writethrough" => CacheMode::Writethrough,
            "directsync" => CacheMode::Directsync,
            "unsafe" => CacheMode::Unsafe,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown cache mode '{s}' (one of {})",
                    CacheMode::NAMES
                )))
            }
        })
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheMode::None => "none",
            CacheMode::Writeback => "writeback",
            CacheMode::Writethrough => "writethrough",
            CacheMode::Directsync => "directsync",
            CacheMode::Unsafe => "unsafe",
        })
    }
}

/// The advisory lock [`FileBackend::lock`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileLock {
    /// Readers share it.
    Shared,
    /// One writer, no readers.
    Exclusive,
}

pub struct FileBackend {
    file: File,
    path: String,
    /// Changed only by `refresh_size`.
    size: AtomicU64,
    block_device: bool,
    direct: bool,
    logical_block_bytes: u32,
    mem_align_bytes: usize,
    note: Option<String>,
    cache: CacheMode,
}

fn open_file(path: &Path, writable: bool, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(writable);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// `statx(STATX_DIOALIGN)`: (memory alignment, offset alignment) for O_DIRECT, or None when the
/// kernel or filesystem does not say.
fn dio_align(file: &File) -> Option<(u32, u32)> {
    // SAFETY: statx is plain data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, empty path with AT_EMPTY_PATH, and a valid out pointer.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align))
}

impl FileBackend {
    /// Opens a regular file or block device. `writable = false` opens read-only.
    pub fn open(path: impl AsRef<Path>, writable: bool, mode: DirectMode) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let ctx = |what: &str| format!("{what} {name}");
        let mut note = None;
        // Before opening: opening a FIFO waits for a writer, a directory is no device. Both
        // (and character devices) are "not compatible", as cryptsetup says, with its exit
        // code 4 (ENODEV).
        let kind = std::fs::metadata(path)
            .map_err(|e| Error::io(ctx("stat"), e))?
            .file_type();
        if !kind.is_file() && !kind.is_block_device() {
            return Err(Error::io(
                format!(
                    "Device {name} is not compatible (neither a regular file nor a block device)"
                ),
                io::Error::from_raw_os_error(libc::ENODEV),
            ));
        }
        let (file, direct) = match mode {
            DirectMode::Never => (
                open_file(path, writable, false).map_err(|e| Error::io(ctx("open"), e))?,
                false,
            ),
            DirectMode::Always => (
                open_file(path, writable, true)
                    .map_err(|e| Error::io(ctx("open with O_DIRECT"), e))?,
                true,
            ),
            DirectMode::Auto => match open_file(path, writable, true) {
                Ok(f) => (f, true),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    note = Some(format!(
                        "the filesystem of {name} refused O_DIRECT; using buffered I/O"
                    ));
                    (
                        open_file(path, writable, false).map_err(|e| Error::io(ctx("open"), e))?,
                        false,
                    )
                }
                Err(e) => return Err(Error::io(ctx("open"), e)),
            },
        };
        let meta = file.metadata().map_err(|e| Error::io(ctx("stat"), e))?;
        let block_device = meta.file_type().is_block_device();
        let size = if block_device || meta.file_type().is_file() {
            measure_size(&file, block_device).map_err(|e| Error::io(ctx("size of"), e))?
        } else {
            return Err(Error::InvalidArgument(format!(
                "{name} is neither a regular file nor a block device"
            )));
        };
        let (mut lbs, mut mem_align) = (512u32, 1usize);
        if block_device {
            let mut ssz: libc::c_int = 0;
            // SAFETY: BLKSSZGET writes one int through the pointer.
            if unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut ssz) } == 0 && ssz > 0 {
                lbs = ssz as u32;
            }
            if direct {
                mem_align = lbs as usize;
            }
        } else if direct {
            match dio_align(&file) {
                Some((m, o)) if m > 0 && o > 0 => {
                    lbs = o.max(512);
                    mem_align = m as usize;
                }
                Some(_) if mode == DirectMode::Always => {
                    return Err(Error::InvalidArgument(format!(
                        "the filesystem of {name} does not support O_DIRECT"
                    )))
                }
                Some(_) => {
                    note = Some(format!(
                        "the filesystem of {name} reports no O_DIRECT support; using buffered I/O"
                    ));
                    let f =
                        open_file(path, writable, false).map_err(|e| Error::io(ctx("open"), e))?;
                    return Ok(FileBackend {
                        file: f,
                        path: name,
                        size: AtomicU64::new(size),
                        block_device,
                        direct: false,
                        logical_block_bytes: 512,
                        mem_align_bytes: 1,
                        note,
                        cache: CacheMode::None,
                    });
                }
                // Kernel too old to say: assume the strictest common rule.
                None => mem_align = 4096,
            }
        }
        Ok(FileBackend {
            file,
            path: name,
            size: AtomicU64::new(size),
            block_device,
            direct,
            logical_block_bytes: lbs,
            mem_align_bytes: mem_align,
            note,
            cache: CacheMode::None,
        })
    }

    /// Opens a volume's data device in a cache mode (see [`CacheMode`]).
    pub fn open_cached(path: impl AsRef<Path>, writable: bool, cache: CacheMode) -> Result<Self> {
        let mut b = Self::open(path, writable, cache.direct_mode())?;
        b.cache = cache;
        Ok(b)
    }

    /// The cache mode it was opened in ([`CacheMode::None`] unless [`FileBackend::open_cached`]
    /// said otherwise; see [`FileBackend::is_direct`] for whether O_DIRECT was granted).
    pub fn cache_mode(&self) -> CacheMode {
        self.cache
    }

    /// Like [`FileBackend::open`], for a volume with `sector_bytes` encryption sectors: if
    /// O_DIRECT would need bigger blocks than that (a 512-byte-sector volume on a 4096-byte
    /// device or filesystem), a regular file is reopened buffered (with a note) instead of
    /// failing; a block device is returned as is (the volume will refuse it, as dm-crypt does).
    pub fn open_for_sector(
        path: impl AsRef<Path>,
        writable: bool,
        mode: DirectMode,
        sector_bytes: u32,
    ) -> Result<Self> {
        let b = Self::open(path.as_ref(), writable, mode)?;
        if b.direct
            && !b.block_device
            && b.logical_block_bytes > sector_bytes
            && mode == DirectMode::Auto
        {
            let mut again = Self::open(path.as_ref(), writable, DirectMode::Never)?;
            again.note = Some(format!(
                "O_DIRECT on {} needs {}-byte blocks, more than the {sector_bytes}-byte sectors; using buffered I/O",
                b.path, b.logical_block_bytes
            ));
            return Ok(again);
        }
        Ok(b)
    }

    /// Takes cryptsetup's advisory lock on the file (`flock`): shared to read a header,
    /// exclusive to update one, so a concurrent cryptsetup (or ucrypt) never reads a
    /// half-written header. Waits for a conflicting holder; held until the backend is dropped.
    pub fn lock(&self, how: FileLock) -> Result<()> {
        let op = match how {
            FileLock::Shared => libc::LOCK_SH,
            FileLock::Exclusive => libc::LOCK_EX,
        };
        loop {
            // SAFETY: flock on a descriptor this backend owns; no memory is passed.
            if unsafe { libc::flock(self.file.as_raw_fd(), op) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(Error::io(
                    format!("Failed to acquire lock on {}", self.path),
                    e,
                ));
            }
        }
    }

    /// Releases the lock [`FileBackend::lock`] took (on this open file description, so for
    /// every handle that shares it): a process that keeps a header open for its life holds
    /// the lock only around its reads and writes, as cryptsetup does.
    pub fn unlock(&self) -> Result<()> {
        // SAFETY: flock on a descriptor this backend owns; no memory is passed.
        if unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) } == 0 {
            return Ok(());
        }
        Err(Error::io(
            format!("Failed to release lock on {}", self.path),
            io::Error::last_os_error(),
        ))
    }

    /// True if opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Why the backend is not what was asked for (e.g. O_DIRECT refused), if anything.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::io(format!("fdatasync {}", self.path), e))
    }

    fn err(&self, what: &str, offset: u64, len: u64, e: io::Error) -> Error {
        Error::io(
            format!("{what} of {len} bytes at offset {offset} on {}", self.path),
            e,
        )
    }

    fn write_zero_buffers(&self, offset: u64, len: u64) -> Result<()> {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(ZERO_CHUNK_BYTES as u64) as usize;
            self.write_at(&ZEROES.0[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }

    fn range_ioctl(&self, req: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD/BLKZEROOUT read two u64 through the pointer.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), req, range.as_ptr()) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: fallocate on our own fd with a mode that keeps the file size.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// The size of a regular file or block device now.
fn measure_size(file: &File, block_device: bool) -> io::Result<u64> {
    if !block_device {
        return Ok(file.metadata()?.len());
    }
    // SAFETY: lseek on our own fd; only moves the (unused) file position.
    let end = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(end as u64)
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EINVAL)
    )
}

impl Backend for FileBackend {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        loop {
            match self.file.read_at(buf, offset) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.err("read", offset, buf.len() as u64, e)),
            }
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        if self.cache.write_through() {
            return self.write_at_fua(buf, offset);
        }
        check_range(offset, buf.len() as u64, self.size.load(Relaxed))?;
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| self.err("write", offset, buf.len() as u64, e))
    }

    /// `pwritev2` with `RWF_DSYNC`: only this write is made durable, as a disk's FUA write
    /// (the kernel turns it into a FUA write or a cache flush on the device beneath).
    fn write_at_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size.load(Relaxed))?;
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &buf[done..];
            let iov = libc::iovec {
                iov_base: rest.as_ptr() as *mut libc::c_void,
                iov_len: rest.len(),
            };
            let at = offset + done as u64;
            // SAFETY: `iov` points at `rest`, which lives and is not written during the call;
            // the kernel only reads it. The fd belongs to `self.file`, open for writing.
            let n = unsafe {
                libc::pwritev2(
                    self.file.as_raw_fd(),
                    &iov,
                    1,
                    at as libc::off_t,
                    libc::RWF_DSYNC,
                )
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => {
                    let e = io::Error::from(io::ErrorKind::WriteZero);
                    return Err(self.err("write (FUA)", at, rest.len() as u64, e));
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EINTR) => continue,
                        // An old kernel without pwritev2 flags: write, then fdatasync.
                        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {
                            self.file
                                .write_all_at(rest, at)
                                .map_err(|e| self.err("write", at, rest.len() as u64, e))?;
                            return self.sync();
                        }
                        _ => return Err(self.err("write (FUA)", at, rest.len() as u64, e)),
                    }
                }
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if self.cache == CacheMode::Unsafe {
            return Ok(());
        }
        self.sync()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(offset, len, self.size.load(Relaxed))?;
        let r = if self.block_device {
            self.range_ioctl(BLKDISCARD, offset, len)
        } else {
            self.fallocate(libc::FALLOC_FL_PUNCH_HOLE, offset, len)
        };
        match r {
            Ok(()) => Ok(()),
            // Discard is advisory: storage that cannot free space keeps the old ciphertext.
            Err(e) if unsupported(&e) => Ok(()),
            Err(e) => Err(self.err("discard", offset, len, e)),
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_range(offset, len, self.size.load(Relaxed))?;
        let r = if self.block_device {
            self.range_ioctl(BLKZEROOUT, offset, len)
        } else {
            self.fallocate(libc::FALLOC_FL_ZERO_RANGE, offset, len)
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) if unsupported(&e) => self.write_zero_buffers(offset, len),
            Err(e) => Err(self.err("write-zeroes", offset, len, e)),
        }
    }

    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }

    fn refresh_size(&self) -> Result<u64> {
        let n = measure_size(&self.file, self.block_device)
            .map_err(|e| Error::io(format!("size of {}", self.path), e))?;
        self.size.store(n, Relaxed);
        Ok(n)
    }

    fn logical_block_bytes(&self) -> u32 {
        self.logical_block_bytes
    }

    fn mem_align_bytes(&self) -> usize {
        self.mem_align_bytes
    }

    fn file_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(std::os::fd::AsFd::as_fd(&self.file))
    }

    fn writes_through(&self) -> bool {
        self.cache.write_through()
    }

    fn describe(&self) -> String {
        format!(
            "{} {}{}",
            if self.block_device {
                "block device"
            } else {
                "file"
            },
            self.path,
            match (self.direct, self.cache) {
                (true, CacheMode::None) => " (O_DIRECT)".to_string(),
                (true, c) => format!(" (O_DIRECT, cache={c})"),
                (false, CacheMode::None) => " (buffered)".to_string(),
                (false, c) => format!(" (buffered, cache={c})"),
            }
        )
    }

    fn serializes_writes(&self) -> bool {
        // A buffered write to a regular file takes the inode's lock (`generic_file_write_iter`
        // and each filesystem's own); a block device's does not, and an O_DIRECT overwrite of
        // a file takes it shared where the filesystem allows (ext4, xfs).
        !self.block_device && !self.direct
    }
}
