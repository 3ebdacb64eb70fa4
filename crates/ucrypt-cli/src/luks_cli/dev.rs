//! The only place LUKS verbs touch files: reading header bytes and keyslot areas, applying
//! write plans (pwrite, fsync at every `Sync`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ucrypt::luks::{self, Header, WriteOp};
use ucrypt::{Error, Result};

/// Zeroes are written in pieces of this size (format's metadata wipe).
const ZERO_CHUNK_BYTES: usize = 1 << 20;

pub struct HeaderDev {
    file: File,
    path: PathBuf,
}

fn open_err(path: &Path, e: std::io::Error) -> Error {
    Error::io(
        format!("Device {} does not exist or access denied", path.display()),
        e,
    )
}

/// Size of a regular file or block device.
pub fn size_of(file: &File, path: &Path) -> Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f = file;
    f.seek(SeekFrom::End(0))
        .map_err(|e| Error::io(format!("size of {}", path.display()), e))
}

/// Takes cryptsetup's lock on a header file: shared to read, exclusive to update, so a
/// concurrent cryptsetup (or ucrypt) never sees a half-written header. Held until the file is
/// closed.
fn lock(file: &File, path: &Path, exclusive: bool) -> Result<()> {
    use std::os::unix::io::AsRawFd;
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io(
                format!("Failed to acquire lock on {}", path.display()),
                e,
            ));
        }
    }
}

impl HeaderDev {
    pub fn open(path: &Path, writable: bool) -> Result<Self> {
        Self::open_with(
            path,
            writable,
            OpenOptions::new().read(true).write(writable),
        )
    }

    /// A detached header file may not exist yet at format time.
    pub fn open_or_create(path: &Path) -> Result<Self> {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(true).truncate(false);
        Self::open_with(path, true, &o)
    }

    /// Opens with `how` and takes the lock (exclusive to update).
    fn open_with(path: &Path, exclusive: bool, how: &OpenOptions) -> Result<Self> {
        let file = how.open(path).map_err(|e| open_err(path, e))?;
        lock(&file, path, exclusive)?;
        Ok(HeaderDev {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Reads `len` bytes at `offset`; fewer only at the end of the file (the parser reports
    /// a truncated header by name).
    pub fn read_upto(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len as usize];
        let mut done = 0usize;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("reading {} at {}", self.path.display(), offset),
                        e,
                    ))
                }
            }
        }
        buf.truncate(done);
        Ok(buf)
    }

    /// Exactly `len` bytes at `offset`.
    pub fn read_at(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let b = self.read_upto(offset, len)?;
        if (b.len() as u64) < len {
            return Err(Error::BadHeader {
                check: "truncated",
                detail: format!(
                    "{} ends before byte {} (keyslot or header area)",
                    self.path.display(),
                    offset + len
                ),
            });
        }
        Ok(b)
    }

    /// Reads as much as the header needs (bounded by `luks::HEADER_BYTES_MAX`) and parses it.
    pub fn read_header(&self) -> Result<Header> {
        let first = self.read_upto(0, luks::PROBE_BYTES)?;
        let need = luks::probe_len(&first)?;
        let bytes = self.read_upto(0, need.min(luks::HEADER_BYTES_MAX))?;
        luks::parse_any(&bytes)
    }

    /// Applies a write plan in order, making it durable at every `Sync`.
    pub fn apply(&self, ops: &[WriteOp]) -> Result<()> {
        let ctx = |e| Error::io(format!("writing {}", self.path.display()), e);
        for op in ops {
            match op {
                WriteOp::Write { offset, data } => {
                    self.file.write_all_at(data, *offset).map_err(ctx)?
                }
                WriteOp::Zero { offset, len } => {
                    let zero = vec![0u8; ZERO_CHUNK_BYTES];
                    let mut done = 0u64;
                    while done < *len {
                        let n = (*len - done).min(ZERO_CHUNK_BYTES as u64) as usize;
                        self.file
                            .write_all_at(&zero[..n], offset + done)
                            .map_err(ctx)?;
                        done += n as u64;
                    }
                }
                WriteOp::Sync => self.file.sync_data().map_err(ctx)?,
            }
        }
        Ok(())
    }
}

/// The data device (for format's size checks, export and import).
pub struct DataDev {
    pub file: File,
    pub path: PathBuf,
}

impl DataDev {
    pub fn open(path: &Path, writable: bool) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| open_err(path, e))?;
        Ok(DataDev {
            file,
            path: path.to_path_buf(),
        })
    }

    pub fn size(&self) -> Result<u64> {
        size_of(&self.file, &self.path)
    }
}

/// Creates a new file (never overwrites, like cryptsetup) readable only by the owner.
pub fn write_new_file(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                Error::InvalidArgument(format!("Requested file {} already exists.", path.display()))
            } else {
                Error::io(format!("Cannot create file {}", path.display()), e)
            }
        })?;
    f.write_all(data)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io(format!("Cannot write file {}", path.display()), e))
}
