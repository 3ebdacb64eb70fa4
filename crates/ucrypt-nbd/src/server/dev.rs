//! [`PlainDev`]: a backend served as it is, without encryption (`ucrypt serve --unencrypted`):
//! the baseline that separates the NBD server's cost from the encryption engine's in tests and
//! benchmarks, on a local file or on remote storage alike. Encrypted volumes are opened by the
//! caller (`ucrypt::open::open`, or a `Volume` built by hand).

use std::sync::Arc;

use ucrypt::backend::Backend;
use ucrypt::blockdev::check_range;
use ucrypt::{BlockDev, Error, Result};

/// Any [`Backend`] as a [`BlockDev`], bytes in and out unchanged.
pub struct PlainDev {
    backend: Arc<dyn Backend>,
    read_only: bool,
}

impl PlainDev {
    /// `backend` must accept the requests NBD clients send: offsets and lengths in whole
    /// [`Backend::logical_block_bytes`] from any memory (a buffered file, not O_DIRECT).
    pub fn new(backend: Arc<dyn Backend>, read_only: bool) -> Self {
        PlainDev { backend, read_only }
    }

    fn writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly("the export is read-only".into()));
        }
        Ok(())
    }
}

impl BlockDev for PlainDev {
    fn size(&self) -> u64 {
        self.backend.size()
    }
    fn block_size(&self) -> u32 {
        self.backend.logical_block_bytes()
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size())?;
        self.backend.read_exact_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.writable()?;
        check_range(offset, buf.len() as u64, self.size())?;
        self.backend.write_at(buf, offset)
    }
    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.backend.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.writable()?;
        check_range(offset, len, self.size())?;
        self.backend.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.writable()?;
        check_range(offset, len, self.size())?;
        self.backend.write_zeroes(offset, len)
    }
}
