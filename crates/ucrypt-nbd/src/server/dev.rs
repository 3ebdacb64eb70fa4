//! [`FileDev`]: a file served as it is, without encryption (`ucrypt serve --unencrypted`):
//! the baseline that separates the NBD server's cost from the encryption engine's in tests
//! and benchmarks. Encrypted volumes are opened by the caller (`ucrypt::luks::open`, or a `Volume` built by hand).

use std::fs::File;
use std::os::unix::fs::FileExt;

use ucrypt::blockdev::check_range;
use ucrypt::{BlockDev, Error, Result};

/// Zero buffer size for `write_zeroes` (bounded, reused per call).
const ZERO_CHUNK_BYTES: usize = 1024 * 1024;

fn io_err(what: &str, e: std::io::Error) -> Error {
    Error::io(what.to_string(), e)
}

fn ro_err() -> Error {
    Error::ReadOnly("opened read-only".into())
}

pub struct FileDev {
    file: File,
    size: u64,
    read_only: bool,
}

impl FileDev {
    pub fn open(path: &std::path::Path, read_only: bool) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|e| io_err(&format!("opening {}", path.display()), e))?;
        let size = file.metadata().map_err(|e| io_err("stat", e))?.len();
        Ok(FileDev {
            file,
            size,
            read_only,
        })
    }
}

impl BlockDev for FileDev {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size)?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| io_err("read", e))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        if self.read_only {
            return Err(ro_err());
        }
        check_range(offset, buf.len() as u64, self.size)?;
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| io_err("write", e))
    }
    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data().map_err(|e| io_err("fdatasync", e))
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        if self.read_only {
            return Err(ro_err());
        }
        check_range(offset, len, self.size)?;
        Ok(()) // allowed: discarded ranges may read back as anything
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        if self.read_only {
            return Err(ro_err());
        }
        check_range(offset, len, self.size)?;
        let zero = vec![0u8; ZERO_CHUNK_BYTES.min(len as usize)];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(zero.len() as u64) as usize;
            self.write_at(&zero[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }
}
