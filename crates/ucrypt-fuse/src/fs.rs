//! The FUSE filesystem: one regular file whose bytes are the plaintext of a [`BlockDev`].
//!
//! Sans-I/O as far as FUSE goes: [`VolumeFs::handle`] takes the bytes of one request (header,
//! per-opcode struct, payload) and leaves the reply in the caller's buffer; both transports
//! (classic `/dev/fuse` and io_uring) call it. The request-to-device mapping is a set of pure
//! functions ([`plan_read`], [`plan_write`], [`plan_fallocate`]) tested as tables; `handle` only
//! performs what they decide on the [`BlockDev`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ucrypt::BlockDev;

use crate::proto::{self, fattr, fopen, init_flag, Attr, InHeader, InitOut, Op, Out};

/// Largest single read or write the kernel sends us (FUSE allows up to 16 MiB; 1 MiB is what
/// the kernel's max_pages default of 256 pages allows and what loop and mkfs issue at most).
pub const REQUEST_BYTES_MAX: u32 = 1 << 20;

/// What a read of `len` bytes at `offset` must return from a file of `size` bytes: how many
/// bytes to read from the device (0 at or past the end, as for any file).
pub fn plan_read(size: u64, offset: u64, len: u32) -> u32 {
    if offset >= size {
        0
    } else {
        (size - offset).min(u64::from(len)) as u32
    }
}

/// How many bytes of a write to store, or the errno: the file cannot grow, so a write starting
/// at or past the end fails with ENOSPC and one crossing the end is cut short (as on a full
/// disk), which the caller sees as a short write.
pub fn plan_write(size: u64, offset: u64, len: usize) -> Result<usize, i32> {
    if len == 0 {
        return Ok(0);
    }
    if offset >= size {
        return Err(libc::ENOSPC);
    }
    Ok((size - offset).min(len as u64) as usize)
}

/// What a `fallocate(2)` call does to the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallocPlan {
    /// Space is always allocated: plain preallocation inside the file has nothing to do.
    Nothing,
    /// `BlockDev::write_zeroes` on the range (clamped to the file).
    Zeroes {
        offset: u64,
        len: u64,
    },
    /// `BlockDev::discard` on the range (clamped to the file).
    Discard {
        offset: u64,
        len: u64,
    },
    Refuse(i32),
}

/// How `FALLOC_FL_PUNCH_HOLE` is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PunchHole {
    /// As `write_zeroes`: the range reads back as zeroes, as fallocate(2) promises. Required for
    /// loop devices, which turn block-layer WRITE_ZEROES (mkfs, ext4) into PUNCH_HOLE.
    #[default]
    Zeroes,
    /// As `discard`: frees the ciphertext on the backing store, but the range then reads back as
    /// garbage; only for users who never rely on zeroes after a punch (no loop device).
    Discard,
}

/// Maps a fallocate request on a file of `size` bytes. The file cannot grow: a mode that would
/// extend it fails with ENOSPC; modes that shift data (collapse, insert) are EOPNOTSUPP.
pub fn plan_fallocate(size: u64, offset: u64, len: u64, mode: i32, punch: PunchHole) -> FallocPlan {
    const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
    const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;
    let Some(end) = offset.checked_add(len) else {
        return FallocPlan::Refuse(libc::EFBIG);
    };
    if len == 0 {
        return FallocPlan::Refuse(libc::EINVAL);
    }
    let keep = mode & KEEP != 0;
    let clamped_len = size.saturating_sub(offset).min(len);
    match mode & !KEEP {
        0 if keep || end <= size => FallocPlan::Nothing,
        0 => FallocPlan::Refuse(libc::ENOSPC),
        PUNCH if !keep => FallocPlan::Refuse(libc::EINVAL),
        PUNCH if clamped_len == 0 => FallocPlan::Nothing,
        PUNCH => match punch {
            PunchHole::Zeroes => FallocPlan::Zeroes {
                offset,
                len: clamped_len,
            },
            PunchHole::Discard => FallocPlan::Discard {
                offset,
                len: clamped_len,
            },
        },
        ZERO if !keep && end > size => FallocPlan::Refuse(libc::ENOSPC),
        ZERO if clamped_len == 0 => FallocPlan::Nothing,
        ZERO => FallocPlan::Zeroes {
            offset,
            len: clamped_len,
        },
        _ => FallocPlan::Refuse(libc::EOPNOTSUPP),
    }
}

/// How long the kernel may cache attributes and lookups, in seconds. The file never changes.
const ATTR_TTL_S: u64 = 3600;
/// Inode of the file in directory mode (the root directory is inode 1).
const FILE_INO: u64 = 2;
/// Background requests (readahead, async direct I/O) the kernel may have in flight at once.
const MAX_BACKGROUND: u16 = 64;
/// Above this many background requests the kernel marks the mount congested (3/4 of the above).
const CONGESTION_THRESHOLD: u16 = 48;
const PAGE_BYTES: u32 = 4096;
const DT_DIR: u32 = 4;
const DT_REG: u32 = 8;

/// Settings of one mounted file.
#[derive(Debug, Clone)]
pub struct FsConfig {
    /// `Some(name)`: the mount point is a directory holding one file of that name;
    /// `None`: the mount point itself is the file.
    pub file_name: Option<String>,
    /// Open every handle with FOPEN_DIRECT_IO (no page cache, parallel writes).
    pub direct_io: bool,
    pub punch_hole: PunchHole,
    pub uid: u32,
    pub gid: u32,
    /// Offer FUSE_OVER_IO_URING in the INIT reply when the kernel offers it.
    pub want_io_uring: bool,
}

/// What one request asks of the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Send a reply: `error` 0 with the first `len` bytes of the buffer as body, or a positive
    /// errno with no body.
    Reply { error: i32, len: usize },
    /// Send nothing (FORGET, INTERRUPT).
    NoReply,
}

impl Outcome {
    fn ok(len: usize) -> Outcome {
        Outcome::Reply { error: 0, len }
    }
    fn err(errno: i32) -> Outcome {
        Outcome::Reply {
            error: errno,
            len: 0,
        }
    }
}

pub struct VolumeFs {
    dev: Arc<dyn BlockDev>,
    cfg: FsConfig,
    mounted_at: SystemTime,
    /// Set once our INIT reply advertised FUSE_OVER_IO_URING.
    io_uring: AtomicBool,
    /// Set once INIT was answered.
    initialised: AtomicBool,
    /// Requests served per transport (classic, io_uring), for tests and diagnostics.
    served: [AtomicU64; 2],
}

/// Which transport carried a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Classic = 0,
    IoUring = 1,
}

fn errno(e: &ucrypt::Error) -> i32 {
    e.errno()
}

impl VolumeFs {
    pub fn new(dev: Arc<dyn BlockDev>, cfg: FsConfig) -> Self {
        VolumeFs {
            dev,
            cfg,
            mounted_at: SystemTime::now(),
            io_uring: AtomicBool::new(false),
            initialised: AtomicBool::new(false),
            served: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// True once INIT was answered with FUSE_OVER_IO_URING (the kernel offered it and we want it).
    pub fn io_uring_negotiated(&self) -> bool {
        self.io_uring.load(Ordering::Acquire)
    }

    /// Counts one request carried by `via`.
    pub fn count(&self, via: Via) {
        self.served[via as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests served so far: (classic /dev/fuse, io_uring).
    pub fn served(&self) -> (u64, u64) {
        (
            self.served[0].load(Ordering::Relaxed),
            self.served[1].load(Ordering::Relaxed),
        )
    }

    pub fn initialised(&self) -> bool {
        self.initialised.load(Ordering::Acquire)
    }

    fn file_ino(&self) -> u64 {
        if self.cfg.file_name.is_some() {
            FILE_INO
        } else {
            proto::ROOT_ID
        }
    }

    fn attr(&self, ino: u64) -> Option<Attr> {
        let t = self
            .mounted_at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let mut a = Attr {
            ino,
            size: 0,
            blocks: 0,
            time_s: t.as_secs(),
            time_ns: t.subsec_nanos(),
            mode: libc::S_IFDIR | 0o755,
            nlink: 2,
            uid: self.cfg.uid,
            gid: self.cfg.gid,
            blksize: self.dev.block_size(),
        };
        if ino == self.file_ino() {
            a.size = self.dev.size();
            a.blocks = a.size.div_ceil(512);
            a.nlink = 1;
            a.mode = libc::S_IFREG | if self.dev.read_only() { 0o400 } else { 0o600 };
            Some(a)
        } else if ino == proto::ROOT_ID {
            Some(a)
        } else {
            None
        }
    }

    fn init(
        &self,
        kernel_major: u32,
        kernel_minor: u32,
        readahead: u32,
        kflags: u64,
        out: &mut [u8],
    ) -> Outcome {
        if kernel_major < proto::MAJOR {
            return Outcome::err(libc::EPROTO);
        }
        let mut o = Out::new(out);
        if kernel_major > proto::MAJOR {
            // The kernel retries INIT with the major we name; only major and minor count.
            proto::init_out(
                &mut o,
                &InitOut {
                    minor: proto::MINOR,
                    max_readahead: 0,
                    flags: 0,
                    max_background: 0,
                    congestion_threshold: 0,
                    max_write: 0,
                    max_pages: 0,
                },
            );
            return Outcome::ok(o.len());
        }
        // Requests of up to 1 MiB; async direct I/O so loop --direct-io=on keeps many requests
        // in flight. Flags the kernel did not offer are not enabled.
        let mut want = init_flag::ASYNC_READ
            | init_flag::BIG_WRITES
            | init_flag::ASYNC_DIO
            | init_flag::PARALLEL_DIROPS
            | init_flag::MAX_PAGES
            | init_flag::INIT_EXT;
        if self.cfg.want_io_uring {
            want |= init_flag::OVER_IO_URING;
        }
        let flags = want & kflags;
        let i = InitOut {
            minor: kernel_minor.min(proto::MINOR),
            max_readahead: readahead.min(REQUEST_BYTES_MAX),
            flags,
            max_background: MAX_BACKGROUND,
            congestion_threshold: CONGESTION_THRESHOLD,
            max_write: REQUEST_BYTES_MAX,
            max_pages: (REQUEST_BYTES_MAX / PAGE_BYTES) as u16,
        };
        proto::init_out(&mut o, &i);
        self.io_uring
            .store(flags & init_flag::OVER_IO_URING != 0, Ordering::Release);
        self.initialised.store(true, Ordering::Release);
        Outcome::ok(o.len())
    }

    /// Serves one request. `op_in` is the per-opcode struct; `buf[..payload_len]` the variable
    /// part (a name, write data). The reply body is left in `buf[..len]`: `buf` must hold at
    /// least [`proto::REPLY_BUF_BYTES_MIN`] bytes, and read replies need room for the data
    /// (a read larger than `buf` is refused with EINVAL; the kernel never sends one larger than
    /// [`REQUEST_BYTES_MAX`], as told in INIT).
    pub fn handle(
        &self,
        h: &InHeader,
        op_in: &[u8],
        buf: &mut [u8],
        payload_len: usize,
    ) -> Outcome {
        if payload_len > buf.len() || buf.len() < proto::REPLY_BUF_BYTES_MIN {
            return Outcome::err(libc::EIO);
        }
        let op = match proto::parse(h.opcode, op_in, &buf[..payload_len]) {
            Ok(op) => op,
            Err(e) => return Outcome::err(e),
        };
        if !self.initialised() && !matches!(op, Op::Init { .. }) {
            return Outcome::err(libc::EIO);
        }
        let file = self.file_ino();
        let ino = h.nodeid;
        let r: Result<Outcome, i32> = match op {
            Op::Init {
                major,
                minor,
                max_readahead,
                flags,
            } => Ok(self.init(major, minor, max_readahead, flags, buf)),
            Op::Forget | Op::Interrupt => Ok(Outcome::NoReply),
            Op::Destroy => {
                // Everything acknowledged becomes durable before the session ends.
                self.dev
                    .flush()
                    .map(|_| Outcome::ok(0))
                    .map_err(|e| errno(&e))
            }
            Op::Lookup { name_len } => {
                let hit = ino == proto::ROOT_ID
                    && self
                        .cfg
                        .file_name
                        .as_deref()
                        .is_some_and(|n| n.as_bytes() == &buf[..name_len]);
                match self.attr(FILE_INO).filter(|_| hit) {
                    Some(a) => {
                        let mut o = Out::new(buf);
                        proto::entry_out(&mut o, ATTR_TTL_S, &a);
                        Ok(Outcome::ok(o.len()))
                    }
                    None => Err(libc::ENOENT),
                }
            }
            Op::Getattr => match self.attr(ino) {
                Some(a) => {
                    let mut o = Out::new(buf);
                    proto::attr_out(&mut o, ATTR_TTL_S, &a);
                    Ok(Outcome::ok(o.len()))
                }
                None => Err(libc::ENOENT),
            },
            Op::Setattr { valid, size } => match self.attr(ino) {
                None => Err(libc::ENOENT),
                // The file is the volume: its size is fixed; ownership and mode are set at
                // mount time. Time updates (touch) are accepted and ignored.
                Some(a) if valid & fattr::SIZE != 0 && size != a.size => Err(libc::EPERM),
                Some(_) if valid & (fattr::MODE | fattr::UID | fattr::GID) != 0 => Err(libc::EPERM),
                Some(a) => {
                    let mut o = Out::new(buf);
                    proto::attr_out(&mut o, ATTR_TTL_S, &a);
                    Ok(Outcome::ok(o.len()))
                }
            },
            Op::Open { flags } => {
                if ino != file {
                    Err(libc::EISDIR)
                } else if (flags as i32) & libc::O_ACCMODE != libc::O_RDONLY && self.dev.read_only()
                {
                    Err(libc::EROFS)
                } else {
                    let f = if self.cfg.direct_io {
                        fopen::DIRECT_IO | fopen::PARALLEL_DIRECT_WRITES
                    } else {
                        0
                    };
                    let mut o = Out::new(buf);
                    proto::open_out(&mut o, 0, f);
                    Ok(Outcome::ok(o.len()))
                }
            }
            Op::Read { offset, size } => {
                if ino != file {
                    Err(libc::EISDIR)
                } else if size as usize > buf.len() {
                    Err(libc::EINVAL)
                } else {
                    let n = plan_read(self.dev.size(), offset, size) as usize;
                    self.dev
                        .read_at(&mut buf[..n], offset)
                        .map(|_| Outcome::ok(n))
                        .map_err(|e| errno(&e))
                }
            }
            Op::Write {
                offset,
                size,
                flags,
            } => {
                if ino != file {
                    Err(libc::EISDIR)
                } else {
                    self.write(offset, size as usize, flags as i32, buf)
                }
            }
            Op::Flush | Op::Fsync | Op::Fsyncdir => {
                // close(2) and fsync(2): make what was written durable, so a closed file is a
                // safe file.
                self.dev
                    .flush()
                    .map(|_| Outcome::ok(0))
                    .map_err(|e| errno(&e))
            }
            Op::Release | Op::Releasedir => Ok(Outcome::ok(0)),
            Op::Fallocate {
                offset,
                length,
                mode,
            } => {
                if ino != file {
                    Err(libc::EISDIR)
                } else {
                    let plan =
                        plan_fallocate(self.dev.size(), offset, length, mode, self.cfg.punch_hole);
                    let r = match plan {
                        FallocPlan::Nothing => Ok(()),
                        FallocPlan::Zeroes { offset, len } => self.dev.write_zeroes(offset, len),
                        FallocPlan::Discard { offset, len } => self.dev.discard(offset, len),
                        FallocPlan::Refuse(e) => return Outcome::err(e),
                    };
                    r.map(|_| Outcome::ok(0)).map_err(|e| errno(&e))
                }
            }
            Op::Opendir => {
                if ino == proto::ROOT_ID && self.cfg.file_name.is_some() {
                    let mut o = Out::new(buf);
                    proto::open_out(&mut o, 0, 0);
                    Ok(Outcome::ok(o.len()))
                } else {
                    Err(libc::ENOTDIR)
                }
            }
            Op::Readdir { offset, size } => match self.cfg.file_name.as_deref() {
                Some(name) if ino == proto::ROOT_ID => {
                    let entries = [
                        (proto::ROOT_ID, DT_DIR, "."),
                        (proto::ROOT_ID, DT_DIR, ".."),
                        (FILE_INO, DT_REG, name),
                    ];
                    let limit = (size as usize).min(buf.len());
                    let mut o = Out::new(buf);
                    for (i, (ino, typ, name)) in entries.iter().enumerate() {
                        if (i as u64) < offset {
                            continue;
                        }
                        if !proto::dirent(&mut o, limit, *ino, i as u64 + 1, *typ, name) {
                            break;
                        }
                    }
                    Ok(Outcome::ok(o.len()))
                }
                _ => Err(libc::ENOTDIR),
            },
            Op::Statfs => {
                let bs = self.dev.block_size();
                let mut o = Out::new(buf);
                proto::statfs_out(&mut o, self.dev.size() / u64::from(bs), 2, bs, 255);
                Ok(Outcome::ok(o.len()))
            }
            Op::Other(_) => Err(libc::ENOSYS),
        };
        r.unwrap_or_else(Outcome::err)
    }

    fn write(&self, offset: u64, size: usize, flags: i32, buf: &mut [u8]) -> Result<Outcome, i32> {
        let n = plan_write(self.dev.size(), offset, size)?;
        self.dev
            .write_at(&buf[..n], offset)
            .map_err(|e| errno(&e))?;
        // O_SYNC / O_DSYNC handles: acknowledged means durable.
        if flags & (libc::O_SYNC | libc::O_DSYNC) != 0 {
            self.dev.flush().map_err(|e| errno(&e))?;
        }
        let mut o = Out::new(buf);
        proto::write_out(&mut o, n as u32);
        Ok(Outcome::ok(o.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;

    #[test]
    fn read_plan_table() {
        // (size, offset, len, expected bytes)
        let rows: &[(u64, u64, u32, u32)] = &[
            (8192, 0, 4096, 4096),
            (8192, 4096, 8192, 4096),
            (8192, 8192, 4096, 0),
            (8192, 9000, 4096, 0),
            (8192, 100, 50, 50),
            (0, 0, 4096, 0),
            (u64::MAX, u64::MAX - 1, 4096, 1),
        ];
        for &(size, off, len, want) in rows {
            assert_eq!(plan_read(size, off, len), want, "row {size} {off} {len}");
        }
    }

    #[test]
    fn write_plan_table() {
        let rows: &[(u64, u64, usize, Result<usize, i32>)] = &[
            (8192, 0, 4096, Ok(4096)),
            (8192, 4096, 8192, Ok(4096)),
            (8192, 8192, 1, Err(libc::ENOSPC)),
            (8192, 8192, 0, Ok(0)),
            (8192, 8191, 10, Ok(1)),
        ];
        for &(size, off, len, want) in rows {
            assert_eq!(plan_write(size, off, len), want, "row {size} {off} {len}");
        }
    }

    #[test]
    fn fallocate_plan_table() {
        use FallocPlan::*;
        use PunchHole as P;
        let rows: &[(u64, u64, i32, P, FallocPlan)] = &[
            // (offset, len, mode, punch policy, expected) on a 1 MiB file
            (0, 4096, 0, P::Zeroes, Nothing),
            (0, 2 << 20, 0, P::Zeroes, Refuse(libc::ENOSPC)),
            (0, 2 << 20, KEEP, P::Zeroes, Nothing),
            (
                4096,
                8192,
                PUNCH,
                P::Zeroes,
                Zeroes {
                    offset: 4096,
                    len: 8192,
                },
            ),
            (
                4096,
                8192,
                PUNCH,
                P::Discard,
                Discard {
                    offset: 4096,
                    len: 8192,
                },
            ),
            (
                4096,
                8192,
                libc::FALLOC_FL_PUNCH_HOLE,
                P::Zeroes,
                Refuse(libc::EINVAL),
            ),
            (
                (1 << 20) - 4096,
                1 << 20,
                PUNCH,
                P::Zeroes,
                Zeroes {
                    offset: (1 << 20) - 4096,
                    len: 4096,
                },
            ),
            (2 << 20, 4096, PUNCH, P::Discard, Nothing),
            (
                0,
                4096,
                ZERO,
                P::Zeroes,
                Zeroes {
                    offset: 0,
                    len: 4096,
                },
            ),
            (
                0,
                4096,
                ZERO | KEEP,
                P::Discard,
                Zeroes {
                    offset: 0,
                    len: 4096,
                },
            ),
            (0, 2 << 20, ZERO, P::Zeroes, Refuse(libc::ENOSPC)),
            (
                0,
                2 << 20,
                ZERO | KEEP,
                P::Zeroes,
                Zeroes {
                    offset: 0,
                    len: 1 << 20,
                },
            ),
            (
                0,
                4096,
                libc::FALLOC_FL_COLLAPSE_RANGE,
                P::Zeroes,
                Refuse(libc::EOPNOTSUPP),
            ),
            (
                0,
                4096,
                libc::FALLOC_FL_INSERT_RANGE,
                P::Zeroes,
                Refuse(libc::EOPNOTSUPP),
            ),
            (0, 0, ZERO, P::Zeroes, Refuse(libc::EINVAL)),
            (u64::MAX, 2, ZERO, P::Zeroes, Refuse(libc::EFBIG)),
        ];
        for (i, &(off, len, mode, punch, want)) in rows.iter().enumerate() {
            assert_eq!(
                plan_fallocate(1 << 20, off, len, mode, punch),
                want,
                "row {i}"
            );
        }
    }
}
