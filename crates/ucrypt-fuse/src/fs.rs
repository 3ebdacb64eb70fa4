//! The FUSE filesystem: one regular file whose bytes are the plaintext of a [`BlockDev`].
//!
//! The request-to-device mapping is a set of pure functions ([`plan_read`], [`plan_write`],
//! [`plan_fallocate`]) tested as tables; [`VolumeFs`] only performs what they decide.

use std::cell::RefCell;
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, WriteFlags,
};
use ucrypt::BlockDev;

/// Largest single read or write the kernel sends us (FUSE allows up to 16 MiB; 1 MiB is what
/// the kernel's max_pages default of 256 pages allows and what loop and mkfs issue at most).
pub const REQUEST_BYTES_MAX: u32 = 1 << 20;

/// How long the kernel may cache attributes and lookups. The file never changes size.
const ATTR_TTL: Duration = Duration::from_secs(3600);

const FILE_INO: INodeNo = INodeNo(2);

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
}

pub struct VolumeFs {
    dev: Arc<dyn BlockDev>,
    cfg: FsConfig,
    mounted_at: SystemTime,
}

thread_local! {
    /// One read buffer per FUSE worker thread, grown to the largest read seen (bounded by
    /// REQUEST_BYTES_MAX, which the kernel never exceeds because we told it so in init).
    static READ_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn errno(e: &ucrypt::Error) -> Errno {
    Errno::from_i32(e.errno())
}

impl VolumeFs {
    pub fn new(dev: Arc<dyn BlockDev>, cfg: FsConfig) -> Self {
        VolumeFs {
            dev,
            cfg,
            mounted_at: SystemTime::now(),
        }
    }

    fn file_ino(&self) -> INodeNo {
        if self.cfg.file_name.is_some() {
            FILE_INO
        } else {
            INodeNo::ROOT
        }
    }

    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let t = self.mounted_at;
        let mut a = FileAttr {
            ino,
            size: 0,
            blocks: 0,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind: FileType::Directory,
            perm: 0o755,
            nlink: 2,
            uid: self.cfg.uid,
            gid: self.cfg.gid,
            rdev: 0,
            blksize: self.dev.block_size(),
            flags: 0,
        };
        if ino == self.file_ino() {
            a.kind = FileType::RegularFile;
            a.size = self.dev.size();
            a.blocks = a.size.div_ceil(512);
            a.nlink = 1;
            a.perm = if self.dev.read_only() { 0o400 } else { 0o600 };
            Some(a)
        } else if ino == INodeNo::ROOT {
            Some(a)
        } else {
            None
        }
    }
}

impl Filesystem for VolumeFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Requests of up to 1 MiB; async direct I/O so loop --direct-io=on keeps many requests
        // in flight. Capabilities the kernel lacks are simply not enabled.
        let _ = config.set_max_write(REQUEST_BYTES_MAX);
        let _ = config.set_max_readahead(REQUEST_BYTES_MAX);
        let _ =
            config.add_capabilities(InitFlags::FUSE_ASYNC_DIO | InitFlags::FUSE_PARALLEL_DIROPS);
        Ok(())
    }

    fn destroy(&mut self) {
        // Everything acknowledged becomes durable before the session ends.
        if let Err(e) = self.dev.flush() {
            eprintln!("ucrypt mount: flush at unmount failed: {e}");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (&self.cfg.file_name, self.attr(FILE_INO)) {
            (Some(n), Some(a)) if parent == INodeNo::ROOT && name == OsStr::new(n) => {
                reply.entry(&ATTR_TTL, &a, Generation(0))
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&ATTR_TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(a) = self.attr(ino) else {
            return reply.error(Errno::ENOENT);
        };
        // The file is the volume: its size is fixed; ownership and mode are set at mount time.
        // Time updates (touch, O_TRUNC of an empty range) are accepted and ignored.
        if size.is_some_and(|s| s != a.size) {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        if mode.is_some() || uid.is_some() || gid.is_some() {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        reply.attr(&ATTR_TTL, &a)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != self.file_ino() {
            return reply.error(Errno::from_i32(libc::EISDIR));
        }
        let writes = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
        if writes && self.dev.read_only() {
            return reply.error(Errno::from_i32(libc::EROFS));
        }
        let mut f = FopenFlags::empty();
        if self.cfg.direct_io {
            f |= FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES;
        }
        reply.opened(FileHandle(0), f)
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != self.file_ino() {
            return reply.error(Errno::from_i32(libc::EISDIR));
        }
        let n = plan_read(self.dev.size(), offset, size.min(REQUEST_BYTES_MAX)) as usize;
        READ_BUF.with(|b| {
            let mut buf = b.borrow_mut();
            if buf.len() < n {
                buf.resize(n, 0);
            }
            match self.dev.read_at(&mut buf[..n], offset) {
                Ok(()) => reply.data(&buf[..n]),
                Err(e) => reply.error(errno(&e)),
            }
        })
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != self.file_ino() {
            return reply.error(Errno::from_i32(libc::EISDIR));
        }
        let n = match plan_write(self.dev.size(), offset, data.len()) {
            Ok(n) => n,
            Err(e) => return reply.error(Errno::from_i32(e)),
        };
        if let Err(e) = self.dev.write_at(&data[..n], offset) {
            return reply.error(errno(&e));
        }
        // O_SYNC / O_DSYNC handles: acknowledged means durable.
        if flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0 {
            if let Err(e) = self.dev.flush() {
                return reply.error(errno(&e));
            }
        }
        reply.written(n as u32)
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2): make what this handle wrote durable, so a closed file is a safe file.
        match self.dev.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.dev.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if ino != self.file_ino() {
            return reply.error(Errno::from_i32(libc::EISDIR));
        }
        let r = match plan_fallocate(self.dev.size(), offset, length, mode, self.cfg.punch_hole) {
            FallocPlan::Nothing => Ok(()),
            FallocPlan::Zeroes { offset, len } => self.dev.write_zeroes(offset, len),
            FallocPlan::Discard { offset, len } => self.dev.discard(offset, len),
            FallocPlan::Refuse(e) => return reply.error(Errno::from_i32(e)),
        };
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino == INodeNo::ROOT && self.cfg.file_name.is_some() {
            reply.opened(FileHandle(0), FopenFlags::empty())
        } else {
            reply.error(Errno::from_i32(libc::ENOTDIR))
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(name) = self
            .cfg
            .file_name
            .as_deref()
            .filter(|_| ino == INodeNo::ROOT)
        else {
            return reply.error(Errno::from_i32(libc::ENOTDIR));
        };
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (FILE_INO, FileType::RegularFile, name),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bs = self.dev.block_size();
        let blocks = self.dev.size() / u64::from(bs);
        reply.statfs(blocks, 0, 0, 2, 0, bs, 255, bs)
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
