//! Interim devices for `ucrypt serve` until the engine's `Volume` lands on main:
//! - [`FileDev`]: a file served as is (no encryption), the baseline for tests and benchmarks;
//! - [`PlainCryptDev`]: a `cryptsetup open --type plain` style mapping (cipher, volume key,
//!   sector size, offset) on a file, with one cipher context per worker and a simple
//!   read-modify-write for sub-sector writes.
//!
//! Both are deliberately simple (pread/pwrite, no io_uring, no pool); the real data path is
//! the engine's.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Mutex, RwLock};

use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use ucrypt::{BlockDev, Error, Result};

use super::lock;

/// Zero buffer size for `write_zeroes` (bounded, reused per call).
const ZERO_CHUNK_BYTES: usize = 1024 * 1024;

fn check_range(offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfRange { offset, len, size }),
    }
}

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

/// A plain dm-crypt mapping on a file (like `cryptsetup open --type plain`).
pub struct PlainCryptDev {
    file: File,
    /// Byte offset of the data area in the file.
    offset: u64,
    size: u64,
    sector: u32,
    read_only: bool,
    /// Idle cipher contexts; a caller takes one, uses it, puts it back (one per thread at most).
    ciphers: Mutex<Vec<SectorCipher>>,
    template: Mutex<SectorCipher>,
    /// Whole-sector writes share it; sub-sector read-modify-writes take it exclusively so no
    /// other write can land between their read and their write.
    rmw: RwLock<()>,
}

impl PlainCryptDev {
    pub fn open(
        path: &std::path::Path,
        spec: &str,
        key: &[u8],
        sector_size: u64,
        offset: u64,
        read_only: bool,
    ) -> Result<Self> {
        let spec: CipherSpec = spec.parse()?;
        let geometry = Geometry::new(SectorSize::new(sector_size)?);
        let cipher = SectorCipher::new(spec, key, geometry)?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|e| io_err(&format!("opening {}", path.display()), e))?;
        let file_len = file.metadata().map_err(|e| io_err("stat", e))?.len();
        let data = file_len.checked_sub(offset).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "offset {offset} is past the end of the file ({file_len})"
            ))
        })?;
        let size = data - data % sector_size;
        Ok(PlainCryptDev {
            file,
            offset,
            size,
            sector: sector_size as u32,
            read_only,
            ciphers: Mutex::new(Vec::new()),
            template: Mutex::new(cipher),
            rmw: RwLock::new(()),
        })
    }

    fn with_cipher<T>(&self, f: impl FnOnce(&mut SectorCipher) -> Result<T>) -> Result<T> {
        let popped = lock(&self.ciphers).pop();
        let mut c = match popped {
            Some(c) => c,
            None => lock(&self.template).try_clone()?,
        };
        let r = f(&mut c);
        lock(&self.ciphers).push(c);
        r
    }

    /// Reads and decrypts whole sectors starting at byte `pos` (sector aligned).
    fn read_sectors(&self, buf: &mut [u8], pos: u64) -> Result<()> {
        self.file
            .read_exact_at(buf, self.offset + pos)
            .map_err(|e| io_err("read", e))?;
        let first = pos / u64::from(self.sector);
        self.with_cipher(|c| c.decrypt(first, buf))
    }

    fn write_sectors(&self, plain: &[u8], pos: u64) -> Result<()> {
        let mut ct = vec![0u8; plain.len()];
        let first = pos / u64::from(self.sector);
        self.with_cipher(|c| c.encrypt_to(first, plain, &mut ct))?;
        self.file
            .write_all_at(&ct, self.offset + pos)
            .map_err(|e| io_err("write", e))
    }

    fn span(&self, offset: u64, len: u64) -> (u64, u64) {
        let s = u64::from(self.sector);
        let start = offset / s * s;
        let end = (offset + len).div_ceil(s) * s;
        (start, end)
    }
}

impl BlockDev for PlainCryptDev {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_size(&self) -> u32 {
        self.sector
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size)?;
        let (start, end) = self.span(offset, buf.len() as u64);
        if start == offset && end == offset + buf.len() as u64 {
            return self.read_sectors(buf, offset);
        }
        let mut tmp = vec![0u8; (end - start) as usize];
        self.read_sectors(&mut tmp, start)?;
        let at = (offset - start) as usize;
        buf.copy_from_slice(&tmp[at..at + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        if self.read_only {
            return Err(ro_err());
        }
        check_range(offset, buf.len() as u64, self.size)?;
        let (start, end) = self.span(offset, buf.len() as u64);
        if start == offset && end == offset + buf.len() as u64 {
            let _shared = self.rmw.read().unwrap_or_else(|e| e.into_inner());
            return self.write_sectors(buf, offset);
        }
        let _excl = self.rmw.write().unwrap_or_else(|e| e.into_inner());
        let mut tmp = vec![0u8; (end - start) as usize];
        self.read_sectors(&mut tmp, start)?;
        let at = (offset - start) as usize;
        tmp[at..at + buf.len()].copy_from_slice(buf);
        self.write_sectors(&tmp, start)
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
        check_range(offset, len, self.size)
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
