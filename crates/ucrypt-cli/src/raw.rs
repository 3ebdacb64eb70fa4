//! Raw (plain dm-crypt) volumes for the front-end verbs until LUKS opening and the engine's
//! `Volume` are on main: [`RawArgs`] parses `--cipher SPEC --volume-key-file F [--sector-size N]
//! [--offset BYTES] [--iv-offset N] [--read-only]`, and [`RawVolume`] is a small synchronous
//! stand-in `BlockDev` over a file or block device.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use clap::Args;
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use ucrypt::{BlockDev, Error, Result, SecretBytes};

#[derive(Args, Debug)]
pub struct RawArgs {
    /// Raw dm-crypt mode: cipher spec, e.g. aes-xts-plain64.
    #[arg(long)]
    pub cipher: Option<String>,
    /// Raw mode: file holding the binary volume key.
    #[arg(long)]
    pub volume_key_file: Option<PathBuf>,
    /// Raw mode: encryption sector size in bytes.
    #[arg(long, default_value_t = 512)]
    pub sector_size: u64,
    /// Raw mode: where the encrypted data starts on VOLUME, in bytes.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// Raw mode: dm-crypt iv_offset (cryptsetup --skip), in 512-byte units.
    #[arg(long, default_value_t = 0)]
    pub iv_offset: u64,
    /// Serve read-only.
    #[arg(long)]
    pub read_only: bool,
}

impl RawArgs {
    /// Opens `volume` as described, or says what is missing.
    pub fn open(&self, volume: &Path) -> Result<RawVolume> {
        let (Some(cipher), Some(key_file)) = (&self.cipher, &self.volume_key_file) else {
            return Err(Error::InvalidArgument(
                "LUKS volumes are not served yet by this build; give raw dm-crypt parameters: \
                 --cipher SPEC --volume-key-file FILE [--sector-size N] [--offset BYTES]"
                    .into(),
            ));
        };
        let spec: CipherSpec = cipher.parse()?;
        let key = SecretBytes::from_vec(
            std::fs::read(key_file)
                .map_err(|e| Error::io(format!("read {}", key_file.display()), e))?,
        );
        let geometry = Geometry {
            sector_size: SectorSize::new(self.sector_size)?,
            iv_offset: self.iv_offset,
            iv_large_sectors: false,
        };
        let cipher = SectorCipher::new(spec, key.as_ref(), geometry)?;
        drop(key);
        RawVolume::open(volume, self.offset, cipher, self.read_only)
    }
}

/// Largest chunk [`RawVolume`] encrypts at once for write_zeroes.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// A plain dm-crypt mapping of a file or block device, served synchronously with pread/pwrite
/// and one cipher per concurrent caller (a stand-in until the engine's Volume is on main).
///
/// Concurrency: aligned writes share `rmw` (read lock); a request needing read-modify-write of
/// a partial sector takes it exclusively, so no aligned write can land between its read and
/// its write.
pub struct RawVolume {
    file: File,
    data_offset: u64,
    size: u64,
    sector: u64,
    read_only: bool,
    /// Idle keyed ciphers; at most one per thread that ever ran a request at once.
    ciphers: Mutex<Vec<SectorCipher>>,
    template: Mutex<SectorCipher>,
    rmw: RwLock<()>,
}

impl RawVolume {
    pub fn open(
        path: &Path,
        data_offset: u64,
        cipher: SectorCipher,
        read_only: bool,
    ) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
        let total =
            device_size(&file).map_err(|e| Error::io(format!("size of {}", path.display()), e))?;
        let sector = cipher.sector_bytes() as u64;
        let size = total.saturating_sub(data_offset) / sector * sector;
        if size == 0 {
            return Err(Error::InvalidArgument(format!(
                "{} has no whole {sector}-byte sector after offset {data_offset}",
                path.display()
            )));
        }
        if data_offset % 512 != 0 {
            return Err(Error::InvalidArgument(
                "--offset must be a multiple of 512".into(),
            ));
        }
        Ok(RawVolume {
            file,
            data_offset,
            size,
            sector,
            read_only,
            ciphers: Mutex::new(Vec::new()),
            template: Mutex::new(cipher),
            rmw: RwLock::new(()),
        })
    }

    fn with_cipher<T>(&self, f: impl FnOnce(&mut SectorCipher) -> Result<T>) -> Result<T> {
        let idle = self
            .ciphers
            .lock()
            .map_err(|_| Error::Bug("cipher pool poisoned"))?
            .pop();
        let mut c = match idle {
            Some(c) => c,
            None => self
                .template
                .lock()
                .map_err(|_| Error::Bug("cipher template poisoned"))?
                .try_clone()?,
        };
        let r = f(&mut c);
        if let Ok(mut pool) = self.ciphers.lock() {
            pool.push(c);
        }
        r
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    fn check_write(&self, offset: u64, len: u64) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly("mounted with --read-only".into()));
        }
        self.check(offset, len)
    }

    /// Reads and decrypts whole sectors `[first, first + buf.len()/sector)`.
    fn read_sectors(&self, buf: &mut [u8], first: u64) -> Result<()> {
        self.file
            .read_exact_at(buf, self.data_offset + first * self.sector)
            .map_err(|e| Error::io("read volume", e))?;
        self.with_cipher(|c| c.decrypt(first, buf))
    }

    fn write_sectors(&self, plain: &[u8], first: u64) -> Result<()> {
        let mut ct = vec![0u8; plain.len()];
        self.with_cipher(|c| c.encrypt_to(first, plain, &mut ct))?;
        self.file
            .write_all_at(&ct, self.data_offset + first * self.sector)
            .map_err(|e| Error::io("write volume", e))
    }

    /// The sector-aligned span covering `[offset, offset + len)`.
    fn span(&self, offset: u64, len: u64) -> (u64, u64) {
        let start = offset / self.sector * self.sector;
        let end = (offset + len).div_ceil(self.sector) * self.sector;
        (start, end)
    }
}

fn device_size(f: &File) -> std::io::Result<u64> {
    let meta = f.metadata()?;
    if meta.file_type().is_file() {
        return Ok(meta.len());
    }
    let mut bytes: u64 = 0;
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    // SAFETY: the fd is open for the call; the ioctl writes one u64 into `bytes`.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut bytes) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(bytes)
}

impl BlockDev for RawVolume {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_size(&self) -> u32 {
        self.sector as u32
    }
    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (start, end) = self.span(offset, buf.len() as u64);
        if start == offset && end == offset + buf.len() as u64 {
            return self.read_sectors(buf, start / self.sector);
        }
        let mut tmp = vec![0u8; (end - start) as usize];
        self.read_sectors(&mut tmp, start / self.sector)?;
        let skip = (offset - start) as usize;
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.check_write(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (start, end) = self.span(offset, buf.len() as u64);
        if start == offset && end == offset + buf.len() as u64 {
            let _shared = self
                .rmw
                .read()
                .map_err(|_| Error::Bug("rmw lock poisoned"))?;
            return self.write_sectors(buf, start / self.sector);
        }
        let _excl = self
            .rmw
            .write()
            .map_err(|_| Error::Bug("rmw lock poisoned"))?;
        let mut tmp = vec![0u8; (end - start) as usize];
        self.read_sectors(&mut tmp, start / self.sector)?;
        let skip = (offset - start) as usize;
        tmp[skip..skip + buf.len()].copy_from_slice(buf);
        self.write_sectors(&tmp, start / self.sector)
    }

    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file
            .sync_data()
            .map_err(|e| Error::io("fdatasync volume", e))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_write(offset, len)?;
        // Only whole sectors inside the range may be freed; partial ones keep their data.
        let start = offset.div_ceil(self.sector) * self.sector;
        let end = (offset + len) / self.sector * self.sector;
        if end <= start {
            return Ok(());
        }
        // SAFETY: the fd is open; fallocate only changes the file's allocation.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                (self.data_offset + start) as libc::off_t,
                (end - start) as libc::off_t,
            )
        };
        // A backing store that cannot punch holes simply keeps the data: discard is advisory.
        let _ = rc;
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check_write(offset, len)?;
        let zeroes = vec![0u8; ZERO_CHUNK_BYTES.min(len as usize)];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            self.write_at(&zeroes[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }
}
