//! The ciphertext side: where encrypted sectors are stored.
//!
//! Only backends make storage syscalls. A [`Backend`] is addressed in bytes; the volume only
//! ever issues whole encryption sectors at `data_offset + k * sector_bytes`, so every request
//! it makes is aligned to the backend's [`Backend::logical_block_bytes`] and, when the backend
//! says so, comes from memory aligned to [`Backend::mem_align_bytes`] (the buffer pool's
//! buffers always are).

mod crash;
mod fault;
mod file;
mod mem;

pub use crash::{CrashBackend, CRASH_BACKEND_BYTES_MAX};
pub use fault::{Fault, FaultBackend, FaultOp, FaultRule};
pub use file::{CacheMode, DirectMode, FileBackend, FileLock};
pub use mem::MemBackend;

use crate::{Error, Result};

/// Where ciphertext lives. Thread-safe: the volume calls it from many threads at once.
pub trait Backend: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset`, like `pread`: may return fewer (a short read);
    /// 0 means the end of the backend. Use [`Backend::read_exact_at`] to read all.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize>;
    /// Writes all of `buf` at `offset` (short writes are retried inside).
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// Makes completed writes durable (`fdatasync`).
    fn flush(&self) -> Result<()>;
    /// Writes all of `buf` at `offset` and returns once that write is durable (Force Unit
    /// Access); says nothing of other writes. The default is a write and then a flush; backends
    /// with a cheaper way (RWF_DSYNC, NBD's FUA flag) override it.
    fn write_at_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_at(buf, offset)?;
        self.flush()
    }
    /// Frees the range where the storage can; it may read back as anything afterwards.
    fn discard(&self, offset: u64, len: u64) -> Result<()>;
    /// The range reads back as zeroes afterwards.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()>;
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Measures the size again, after the file or device grew or shrank underneath, and
    /// returns it; [`Backend::size`] answers the new size from then on. A backend whose size
    /// cannot change returns its size.
    fn refresh_size(&self) -> Result<u64> {
        Ok(self.size())
    }
    /// Offsets and lengths of I/O must be multiples of this.
    fn logical_block_bytes(&self) -> u32;
    /// I/O buffers must start at a multiple of this (1: any address). O_DIRECT needs > 1.
    fn mem_align_bytes(&self) -> usize {
        1
    }
    /// The open file behind the backend, for a caller that reads it with I/O of its own
    /// (`BlockDev::read_direct`), under the same rules as [`Backend::read_at`] and the
    /// alignments above; `None` for a backend that is not one file (memory, a remote
    /// server, a test's wrapper).
    fn file_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
    /// Whether every write must be made durable as it is written (a write-through cache
    /// mode): a caller writing [`Backend::file_fd`] itself then writes with `RWF_DSYNC`.
    fn writes_through(&self) -> bool {
        false
    }
    /// A short human description ("file /dev/shm/x (O_DIRECT)"), for benchmarks and logs.
    fn describe(&self) -> String;
    /// Whether every write queues on one lock, whichever thread makes it: a buffered regular
    /// file, whose every write takes the inode's lock (tmpfs, ext4 and xfs alike). Threads
    /// writing such a backend at once gain nothing, and one preempted while holding the lock
    /// stops the rest, so work split over threads writes it one thread at a time
    /// ([`crate::sync::TakeTurns`]). False where writes may run side by side (a block device,
    /// a file opened with O_DIRECT, a remote volume).
    fn serializes_writes(&self) -> bool {
        false
    }

    /// Reads exactly `buf.len()` bytes, retrying short reads; reaching the end first is an error
    /// naming the offset.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let n = self.read_at(&mut buf[done..], offset + done as u64)?;
            if n == 0 {
                return Err(Error::io(
                    format!(
                        "backend read of {} bytes at offset {offset} ended early after {done} bytes",
                        buf.len()
                    ),
                    std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                ));
            }
            done += n;
        }
        Ok(())
    }
}

pub(crate) use crate::blockdev::check_range;
