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

use crate::proto::{self, fattr, fopen, init_flag, ring, Attr, InHeader, InitOut, Op, Out};

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

/// A reply on the classic transport: the out header's fields, and where the body lies in the
/// request buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassicReply {
    pub unique: u64,
    /// 0 or a positive errno.
    pub error: i32,
    pub body: std::ops::Range<usize>,
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

/// An attribute reply (GETATTR, SETATTR) for `a` in `buf`.
fn attr_reply(a: &Attr, buf: &mut [u8]) -> Outcome {
    let mut o = Out::new(buf);
    proto::attr_out(&mut o, ATTR_TTL_S, a);
    Outcome::ok(o.written())
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

    pub(crate) fn file_ino(&self) -> u64 {
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
            proto::init_out(&mut o, &InitOut::minor_only(proto::MINOR));
            return Outcome::ok(o.written());
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
            max_pages: (REQUEST_BYTES_MAX / ucrypt::sync::PAGE_BYTES as u32) as u16,
        };
        proto::init_out(&mut o, &i);
        self.io_uring
            .store(flags & init_flag::OVER_IO_URING != 0, Ordering::Release);
        self.initialised.store(true, Ordering::Release);
        Outcome::ok(o.written())
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
        let ino = h.nodeid;
        let r: Result<Outcome, i32> = match op {
            Op::Init {
                major,
                minor,
                max_readahead,
                flags,
            } => Ok(self.init(major, minor, max_readahead, flags, buf)),
            Op::Forget | Op::Interrupt => Ok(Outcome::NoReply),
            // DESTROY: everything acknowledged becomes durable before the session ends.
            // FLUSH and FSYNC (close(2), fsync(2)): a closed file is a safe file.
            Op::Destroy | Op::Flush | Op::Fsync | Op::Fsyncdir => self.flush(),
            Op::Lookup { name_len } => self.lookup(ino, name_len, buf),
            Op::Getattr => match self.attr(ino) {
                Some(a) => Ok(attr_reply(&a, buf)),
                None => Err(libc::ENOENT),
            },
            Op::Setattr { valid, size } => self.setattr(ino, valid, size, buf),
            Op::Open { flags } => self.open(ino, flags, buf),
            Op::Read { offset, size } => self.read(ino, offset, size, buf),
            Op::Write {
                offset,
                size,
                flags,
            } => {
                if ino != self.file_ino() {
                    Err(libc::EISDIR)
                } else {
                    self.write(offset, size as usize, flags as i32, buf)
                }
            }
            Op::Release | Op::Releasedir => Ok(Outcome::ok(0)),
            Op::Fallocate {
                offset,
                length,
                mode,
            } => self.fallocate(ino, offset, length, mode),
            Op::Opendir => {
                if ino == proto::ROOT_ID && self.cfg.file_name.is_some() {
                    let mut o = Out::new(buf);
                    proto::open_out(&mut o, 0, 0);
                    Ok(Outcome::ok(o.written()))
                } else {
                    Err(libc::ENOTDIR)
                }
            }
            Op::Readdir { offset, size } => self.readdir(ino, offset, size, buf),
            Op::Statfs => {
                let bs = self.dev.block_size();
                let mut o = Out::new(buf);
                proto::statfs_out(&mut o, self.dev.size() / u64::from(bs), 2, bs, 255);
                Ok(Outcome::ok(o.written()))
            }
            Op::Other(_) => Err(libc::ENOSYS),
        };
        r.unwrap_or_else(Outcome::err)
    }

    /// Classic transport: serves the request read from /dev/fuse into `buf[..n]`; the reply
    /// body is left in `buf`. None: send nothing (FORGET, INTERRUPT, or too short to answer).
    pub fn handle_classic(&self, buf: &mut [u8], n: usize) -> Option<ClassicReply> {
        let n = n.min(buf.len());
        let (h, op_at, payload_at) = match proto::split_classic(&buf[..n]) {
            Ok(x) => x,
            Err((Some(unique), error)) => {
                return Some(ClassicReply {
                    unique,
                    error,
                    body: 0..0,
                })
            }
            Err((None, _)) => return None,
        };
        let (head, rest) = buf.split_at_mut(payload_at);
        self.count(Via::Classic);
        match self.handle(&h, &head[op_at..], rest, n - payload_at) {
            Outcome::NoReply => None,
            Outcome::Reply { error, len } => Some(ClassicReply {
                unique: h.unique,
                error,
                body: if error == 0 {
                    payload_at..payload_at + len
                } else {
                    0..0
                },
            }),
        }
    }

    /// io_uring transport: serves the request in a ring entry's header buffer
    /// (`struct fuse_uring_req_header`) and payload buffer, leaving the out header and payload
    /// size in `header` and the reply body in `payload`. Returns the commit id to send back.
    pub fn handle_ring(&self, header: &mut [u8], payload: &mut [u8]) -> u64 {
        assert!(
            header.len() >= ring::HEADER_BYTES,
            "ring header buffer too small (bug)"
        );
        let commit_id = ring::ent_commit_id(header);
        let (unique, error, len) = match InHeader::parse(&header[..ring::IN_OUT_BYTES]) {
            None => (commit_id, libc::EIO, 0),
            Some(h) => {
                let op_in = &header[ring::OP_IN_AT..ring::OP_IN_AT + proto::op_in_bytes(h.opcode)];
                let payload_len = ring::ent_payload_bytes(header) as usize;
                self.count(Via::IoUring);
                match self.handle(&h, op_in, payload, payload_len) {
                    Outcome::Reply { error: 0, len } => (h.unique, 0, len),
                    Outcome::Reply { error, .. } => (h.unique, error, 0),
                    // FORGET and INTERRUPT travel over /dev/fuse, never the ring; should one
                    // come here, the kernel still needs the entry back.
                    Outcome::NoReply => (h.unique, libc::ENOSYS, 0),
                }
            }
        };
        header[..proto::OUT_HEADER_BYTES].copy_from_slice(&proto::out_header(unique, error, len));
        ring::set_ent_payload_bytes(header, len as u32);
        commit_id
    }

    /// Makes everything acknowledged so far durable.
    fn flush(&self) -> Result<Outcome, i32> {
        self.dev
            .flush()
            .map(|_| Outcome::ok(0))
            .map_err(|e| errno(&e))
    }

    /// LOOKUP of `buf[..name_len]` in directory `ino`: only the file, in the root directory.
    fn lookup(&self, ino: u64, name_len: usize, buf: &mut [u8]) -> Result<Outcome, i32> {
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
                Ok(Outcome::ok(o.written()))
            }
            None => Err(libc::ENOENT),
        }
    }

    fn setattr(&self, ino: u64, valid: u32, size: u64, buf: &mut [u8]) -> Result<Outcome, i32> {
        match self.attr(ino) {
            None => Err(libc::ENOENT),
            // The file is the volume: its size is fixed; ownership and mode are set at
            // mount time. Time updates (touch) are accepted and ignored.
            Some(a) if valid & fattr::SIZE != 0 && size != a.size => Err(libc::EPERM),
            Some(_) if valid & (fattr::MODE | fattr::UID | fattr::GID) != 0 => Err(libc::EPERM),
            Some(a) => Ok(attr_reply(&a, buf)),
        }
    }

    fn open(&self, ino: u64, flags: u32, buf: &mut [u8]) -> Result<Outcome, i32> {
        if ino != self.file_ino() {
            return Err(libc::EISDIR);
        }
        if (flags as i32) & libc::O_ACCMODE != libc::O_RDONLY && self.dev.read_only() {
            return Err(libc::EROFS);
        }
        let f = if self.cfg.direct_io {
            fopen::DIRECT_IO | fopen::PARALLEL_DIRECT_WRITES
        } else {
            0
        };
        let mut o = Out::new(buf);
        proto::open_out(&mut o, 0, f);
        Ok(Outcome::ok(o.written()))
    }

    fn read(&self, ino: u64, offset: u64, size: u32, buf: &mut [u8]) -> Result<Outcome, i32> {
        if ino != self.file_ino() {
            return Err(libc::EISDIR);
        }
        if size as usize > buf.len() {
            return Err(libc::EINVAL);
        }
        let n = plan_read(self.dev.size(), offset, size) as usize;
        if n == 0 {
            return Ok(Outcome::ok(0));
        }
        self.dev
            .read_at(&mut buf[..n], offset)
            .map(|_| Outcome::ok(n))
            .map_err(|e| errno(&e))
    }

    fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<Outcome, i32> {
        if ino != self.file_ino() {
            return Err(libc::EISDIR);
        }
        let plan = plan_fallocate(self.dev.size(), offset, length, mode, self.cfg.punch_hole);
        let r = match plan {
            FallocPlan::Nothing => Ok(()),
            FallocPlan::Zeroes { offset, len } => self.dev.write_zeroes(offset, len),
            FallocPlan::Discard { offset, len } => self.dev.discard(offset, len),
            FallocPlan::Refuse(e) => return Err(e),
        };
        r.map(|_| Outcome::ok(0)).map_err(|e| errno(&e))
    }

    /// READDIR of the root directory in directory mode: ".", ".." and the file, from entry
    /// `offset` on, as many as fit in `size` bytes.
    fn readdir(&self, ino: u64, offset: u64, size: u32, buf: &mut [u8]) -> Result<Outcome, i32> {
        let name = match self.cfg.file_name.as_deref() {
            Some(name) if ino == proto::ROOT_ID => name,
            _ => return Err(libc::ENOTDIR),
        };
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
        Ok(Outcome::ok(o.written()))
    }

    fn write(&self, offset: u64, size: usize, flags: i32, buf: &mut [u8]) -> Result<Outcome, i32> {
        let n = plan_write(self.dev.size(), offset, size)?;
        if n > 0 {
            // The request buffer is read no more: the volume may encrypt in it.
            self.dev
                .write_at_mut(&mut buf[..n], offset)
                .map_err(|e| errno(&e))?;
        }
        // O_SYNC / O_DSYNC handles: acknowledged means durable.
        if flags & (libc::O_SYNC | libc::O_DSYNC) != 0 {
            self.dev.flush().map_err(|e| errno(&e))?;
        }
        let mut o = Out::new(buf);
        proto::write_out(&mut o, n as u32);
        Ok(Outcome::ok(o.written()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::opcode as opc;
    use std::sync::Mutex;

    /// Plaintext in memory.
    struct Mem {
        data: Mutex<Vec<u8>>,
        ro: bool,
    }

    impl Mem {
        fn range(&self, offset: u64, len: usize) -> ucrypt::Result<std::ops::Range<usize>> {
            let size = self.size();
            match offset.checked_add(len as u64) {
                Some(end) if end <= size => Ok(offset as usize..end as usize),
                _ => Err(ucrypt::Error::OutOfRange {
                    offset,
                    len: len as u64,
                    size,
                }),
            }
        }
    }

    impl BlockDev for Mem {
        fn size(&self) -> u64 {
            self.data.lock().expect("lock").len() as u64
        }
        fn block_size(&self) -> u32 {
            4096
        }
        fn read_only(&self) -> bool {
            self.ro
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<()> {
            let r = self.range(offset, buf.len())?;
            buf.copy_from_slice(&self.data.lock().expect("lock")[r]);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
            let r = self.range(offset, buf.len())?;
            self.data.lock().expect("lock")[r].copy_from_slice(buf);
            Ok(())
        }
        fn flush(&self) -> ucrypt::Result<()> {
            Ok(())
        }
        fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
            let r = self.range(offset, len as usize)?;
            self.data.lock().expect("lock")[r].fill(0xdb);
            Ok(())
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
            let r = self.range(offset, len as usize)?;
            self.data.lock().expect("lock")[r].fill(0);
            Ok(())
        }
    }

    const DEV_BYTES: usize = 64 << 10;
    /// Reply room of the test transports (the real ones have REQUEST_BYTES_MAX).
    const BUF_BYTES: usize = 16 << 10;

    fn volume(file_name: Option<&str>, ro: bool, want_io_uring: bool) -> (Arc<Mem>, VolumeFs) {
        let data: Vec<u8> = (0..DEV_BYTES).map(|i| (i % 251) as u8).collect();
        let dev = Arc::new(Mem {
            data: Mutex::new(data),
            ro,
        });
        let fs = VolumeFs::new(
            dev.clone(),
            FsConfig {
                file_name: file_name.map(String::from),
                direct_io: true,
                punch_hole: PunchHole::Zeroes,
                uid: 7,
                gid: 8,
                want_io_uring,
            },
        );
        (dev, fs)
    }

    fn le(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }
    fn u32b(v: u32) -> Vec<u8> {
        v.to_ne_bytes().to_vec()
    }
    fn u64b(v: u64) -> Vec<u8> {
        v.to_ne_bytes().to_vec()
    }
    /// fuse_init_in (64 bytes) with the given flags (flags2 in the high half).
    fn init_in(major: u32, minor: u32, flags: u64) -> Vec<u8> {
        let mut v = le(&[
            &u32b(major),
            &u32b(minor),
            &u32b(1 << 20),
            &u32b(flags as u32),
            &u32b((flags >> 32) as u32),
        ]);
        v.resize(64, 0);
        v
    }
    /// fuse_read_in / fuse_write_in (40 bytes).
    fn rw_in(offset: u64, size: u32, flags: u32) -> Vec<u8> {
        le(&[
            &u64b(0),
            &u64b(offset),
            &u32b(size),
            &u32b(0),
            &u64b(0),
            &u32b(flags),
            &u32b(0),
        ])
    }
    fn setattr_in(valid: u32, size: u64) -> Vec<u8> {
        let mut v = le(&[&u32b(valid), &u32b(0), &u64b(0), &u64b(size)]);
        v.resize(88, 0);
        v
    }
    fn falloc_in(offset: u64, len: u64, mode: i32) -> Vec<u8> {
        le(&[
            &u64b(0),
            &u64b(offset),
            &u64b(len),
            &u32b(mode as u32),
            &u32b(0),
        ])
    }

    /// What a transport sent back: (errno, body), or None for no reply.
    type Sent = Option<(i32, Vec<u8>)>;

    fn classic(fs: &VolumeFs, opcode: u32, nodeid: u64, op_in: &[u8], payload: &[u8]) -> Sent {
        let len = proto::IN_HEADER_BYTES + op_in.len() + payload.len();
        let h = InHeader {
            len: len as u32,
            opcode,
            unique: 42,
            nodeid,
            uid: 0,
            gid: 0,
            pid: 1,
        };
        let mut buf = vec![0u8; len + BUF_BYTES];
        buf[..proto::IN_HEADER_BYTES].copy_from_slice(&h.encode());
        buf[proto::IN_HEADER_BYTES..len].copy_from_slice(&[op_in, payload].concat());
        let r = fs.handle_classic(&mut buf, len)?;
        assert_eq!(r.unique, 42);
        Some((r.error, buf[r.body].to_vec()))
    }

    fn ring_req(fs: &VolumeFs, opcode: u32, nodeid: u64, op_in: &[u8], payload: &[u8]) -> Sent {
        let h = InHeader {
            len: (proto::IN_HEADER_BYTES + op_in.len() + payload.len()) as u32,
            opcode,
            unique: 42,
            nodeid,
            uid: 0,
            gid: 0,
            pid: 1,
        };
        let mut header = vec![0u8; ring::HEADER_BYTES];
        header[..proto::IN_HEADER_BYTES].copy_from_slice(&h.encode());
        header[ring::OP_IN_AT..ring::OP_IN_AT + op_in.len()].copy_from_slice(op_in);
        header[ring::ENT_AT + 8..ring::ENT_AT + 16].copy_from_slice(&42u64.to_ne_bytes());
        ring::set_ent_payload_bytes(&mut header, payload.len() as u32);
        let mut pl = vec![0u8; BUF_BYTES.max(payload.len())];
        pl[..payload.len()].copy_from_slice(payload);
        let commit = fs.handle_ring(&mut header, &mut pl);
        assert_eq!(commit, 42);
        let o = InHeader::parse(&header).expect("header");
        let len = ring::ent_payload_bytes(&header) as usize;
        // out header: len, error (negative errno), unique.
        assert_eq!(o.len as usize, proto::OUT_HEADER_BYTES + len);
        assert_eq!(o.unique, 42);
        Some((-(o.opcode as i32), pl[..len].to_vec()))
    }

    fn init(fs: &VolumeFs) {
        let r = classic(fs, opc::INIT, 0, &init_in(7, 44, u64::MAX), &[]);
        assert_eq!(r.map(|x| (x.0, x.1.len())), Some((0, 64)));
    }

    /// Expected outcome: errno (0 = ok) and body length, or no reply.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Want {
        Ok(usize),
        Err(i32),
        Silent,
    }

    /// (row name, opcode, nodeid, op_in, payload, expected)
    type Row = (&'static str, u32, u64, Vec<u8>, Vec<u8>, Want);

    fn want_of(s: &Sent) -> Want {
        match s {
            None => Want::Silent,
            Some((0, b)) => Want::Ok(b.len()),
            Some((e, _)) => Want::Err(*e),
        }
    }

    #[test]
    fn every_opcode_answers_the_same_on_both_transports() {
        use libc::*;
        let name = b"disk.img\0".to_vec();
        // (row name, opcode, nodeid, op_in, payload, expected). File mode: the root (1) is the
        // file; directory rows run on a volume with a file name (file = inode 2).
        let rows: Vec<Row> = vec![
            (
                "getattr file",
                opc::GETATTR,
                1,
                vec![0; 16],
                vec![],
                Want::Ok(104),
            ),
            (
                "getattr unknown ino",
                opc::GETATTR,
                9,
                vec![0; 16],
                vec![],
                Want::Err(ENOENT),
            ),
            (
                "getattr truncated",
                opc::GETATTR,
                1,
                vec![0; 8],
                vec![],
                Want::Err(EINVAL),
            ),
            (
                "setattr same size",
                opc::SETATTR,
                1,
                setattr_in(fattr::SIZE, DEV_BYTES as u64),
                vec![],
                Want::Ok(104),
            ),
            (
                "setattr resize",
                opc::SETATTR,
                1,
                setattr_in(fattr::SIZE, 1),
                vec![],
                Want::Err(EPERM),
            ),
            (
                "setattr chmod",
                opc::SETATTR,
                1,
                setattr_in(fattr::MODE, 0),
                vec![],
                Want::Err(EPERM),
            ),
            (
                "setattr touch",
                opc::SETATTR,
                1,
                setattr_in(1 << 4, 0),
                vec![],
                Want::Ok(104),
            ),
            (
                "open rw",
                opc::OPEN,
                1,
                u32b(O_RDWR as u32).into_iter().chain([0; 4]).collect(),
                vec![],
                Want::Ok(16),
            ),
            (
                "read 4k",
                opc::READ,
                1,
                rw_in(4096, 4096, 0),
                vec![],
                Want::Ok(4096),
            ),
            (
                "read across end",
                opc::READ,
                1,
                rw_in(DEV_BYTES as u64 - 100, 4096, 0),
                vec![],
                Want::Ok(100),
            ),
            (
                "read past end",
                opc::READ,
                1,
                rw_in(DEV_BYTES as u64, 4096, 0),
                vec![],
                Want::Ok(0),
            ),
            (
                "read larger than buffer",
                opc::READ,
                1,
                rw_in(0, BUF_BYTES as u32 + 1, 0),
                vec![],
                Want::Err(EINVAL),
            ),
            (
                "read truncated",
                opc::READ,
                1,
                rw_in(0, 4096, 0)[..30].to_vec(),
                vec![],
                Want::Err(EINVAL),
            ),
            (
                "write 512",
                opc::WRITE,
                1,
                rw_in(512, 512, 0),
                vec![0xab; 512],
                Want::Ok(8),
            ),
            (
                "write O_DSYNC",
                opc::WRITE,
                1,
                rw_in(0, 16, O_DSYNC as u32),
                vec![0xcd; 16],
                Want::Ok(8),
            ),
            (
                "write past end",
                opc::WRITE,
                1,
                rw_in(DEV_BYTES as u64, 16, 0),
                vec![1; 16],
                Want::Err(ENOSPC),
            ),
            (
                "write short payload",
                opc::WRITE,
                1,
                rw_in(0, 4096, 0),
                vec![1; 100],
                Want::Err(EINVAL),
            ),
            ("flush", opc::FLUSH, 1, vec![0; 24], vec![], Want::Ok(0)),
            ("fsync", opc::FSYNC, 1, vec![0; 16], vec![], Want::Ok(0)),
            (
                "punch hole",
                opc::FALLOCATE,
                1,
                falloc_in(8192, 4096, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE),
                vec![],
                Want::Ok(0),
            ),
            (
                "zero range",
                opc::FALLOCATE,
                1,
                falloc_in(0, 100, FALLOC_FL_ZERO_RANGE),
                vec![],
                Want::Ok(0),
            ),
            (
                "fallocate grow",
                opc::FALLOCATE,
                1,
                falloc_in(0, 1 << 20, 0),
                vec![],
                Want::Err(ENOSPC),
            ),
            ("release", opc::RELEASE, 1, vec![0; 24], vec![], Want::Ok(0)),
            ("statfs", opc::STATFS, 1, vec![], vec![], Want::Ok(80)),
            (
                "opendir on file",
                opc::OPENDIR,
                1,
                vec![0; 8],
                vec![],
                Want::Err(ENOTDIR),
            ),
            (
                "lookup in file mode",
                opc::LOOKUP,
                1,
                vec![],
                name.clone(),
                Want::Err(ENOENT),
            ),
            (
                "lookup without NUL",
                opc::LOOKUP,
                1,
                vec![],
                b"disk".to_vec(),
                Want::Err(EINVAL),
            ),
            ("unknown opcode", 4242, 1, vec![], vec![], Want::Err(ENOSYS)),
            (
                "mkdir unsupported",
                9,
                1,
                vec![0; 16],
                b"x\0".to_vec(),
                Want::Err(ENOSYS),
            ),
            ("destroy", opc::DESTROY, 1, vec![], vec![], Want::Ok(0)),
        ];
        let dir_rows: Vec<Row> = vec![
            (
                "lookup file",
                opc::LOOKUP,
                1,
                vec![],
                name.clone(),
                Want::Ok(128),
            ),
            (
                "lookup other",
                opc::LOOKUP,
                1,
                vec![],
                b"nope\0".to_vec(),
                Want::Err(ENOENT),
            ),
            (
                "getattr dir",
                opc::GETATTR,
                1,
                vec![0; 16],
                vec![],
                Want::Ok(104),
            ),
            (
                "getattr file",
                opc::GETATTR,
                2,
                vec![0; 16],
                vec![],
                Want::Ok(104),
            ),
            ("opendir", opc::OPENDIR, 1, vec![0; 8], vec![], Want::Ok(16)),
            // ".", "..", "disk.img": 32 + 32 + 32 bytes of dirents.
            (
                "readdir",
                opc::READDIR,
                1,
                rw_in(0, 4096, 0),
                vec![],
                Want::Ok(96),
            ),
            (
                "readdir from 2",
                opc::READDIR,
                1,
                rw_in(2, 4096, 0),
                vec![],
                Want::Ok(32),
            ),
            (
                "readdir small",
                opc::READDIR,
                1,
                rw_in(0, 40, 0),
                vec![],
                Want::Ok(32),
            ),
            (
                "readdir on file",
                opc::READDIR,
                2,
                rw_in(0, 4096, 0),
                vec![],
                Want::Err(ENOTDIR),
            ),
            (
                "open dir",
                opc::OPEN,
                1,
                vec![0; 8],
                vec![],
                Want::Err(EISDIR),
            ),
            (
                "read dir",
                opc::READ,
                1,
                rw_in(0, 16, 0),
                vec![],
                Want::Err(EISDIR),
            ),
            (
                "releasedir",
                opc::RELEASEDIR,
                1,
                vec![0; 24],
                vec![],
                Want::Ok(0),
            ),
            (
                "read file",
                opc::READ,
                2,
                rw_in(0, 16, 0),
                vec![],
                Want::Ok(16),
            ),
        ];
        for (file_name, rows) in [(None, &rows), (Some("disk.img"), &dir_rows)] {
            // One volume for both transports (same timestamps); every row is idempotent.
            let (_, fs) = volume(file_name, false, false);
            init(&fs);
            for (name, op, ino, op_in, payload, want) in rows.iter() {
                let c = classic(&fs, *op, *ino, op_in, payload);
                let r = ring_req(&fs, *op, *ino, op_in, payload);
                assert_eq!(want_of(&c), *want, "{name} (classic)");
                // The ring's op_in area is always 128 bytes: truncation is classic-only.
                if op_in.len() >= proto::op_in_bytes(*op) {
                    assert_eq!(c, r, "{name}: the transports answered differently");
                }
            }
        }
    }

    #[test]
    fn replies_carry_the_right_bytes() {
        let (dev, fs) = volume(Some("vol"), false, false);
        init(&fs);
        // READ returns device bytes; WRITE lands at its offset; GETATTR gives size and mode.
        let (_, b) = classic(&fs, opc::READ, 2, &rw_in(1000, 8, 0), &[]).expect("reply");
        let want: Vec<u8> = (1000..1008).map(|i| (i % 251) as u8).collect();
        assert_eq!(b, want);
        let r = ring_req(&fs, opc::WRITE, 2, &rw_in(3, 4, 0), b"abcd").expect("reply");
        assert_eq!(r, (0, le(&[&u32b(4), &u32b(0)])));
        assert_eq!(&dev.data.lock().expect("lock")[3..7], b"abcd");
        let (_, a) = classic(&fs, opc::GETATTR, 2, &[0; 16], &[]).expect("reply");
        let attr = &a[16..];
        assert_eq!(attr[0..8], 2u64.to_ne_bytes()); // ino
        assert_eq!(attr[8..16], (DEV_BYTES as u64).to_ne_bytes()); // size
        assert_eq!(attr[60..64], (libc::S_IFREG | 0o600).to_ne_bytes()); // mode
        assert_eq!(attr[68..72], 7u32.to_ne_bytes()); // uid
        let (_, d) = classic(&fs, opc::READDIR, 1, &rw_in(0, 4096, 0), &[]).expect("reply");
        assert_eq!(&d[64 + 24..64 + 27], b"vol");
        assert_eq!(d[64 + 16..64 + 20], 3u32.to_ne_bytes());
        // ZERO_RANGE zeroes exactly its range.
        let r = classic(
            &fs,
            opc::FALLOCATE,
            2,
            &falloc_in(10, 5, libc::FALLOC_FL_ZERO_RANGE),
            &[],
        );
        assert_eq!(r, Some((0, vec![])));
        let d = dev.data.lock().expect("lock");
        assert!(d[10..15].iter().all(|&x| x == 0));
        assert_eq!(d[15], 15);
    }

    #[test]
    fn init_negotiation_table() {
        use init_flag::*;
        // (kernel major, minor, kernel flags, we want io_uring, errno, io_uring negotiated)
        let rows: &[(u32, u32, u64, bool, i32, bool)] = &[
            (7, 44, u64::MAX, true, 0, true),
            (7, 44, u64::MAX, false, 0, false),
            (7, 44, ASYNC_READ | INIT_EXT, true, 0, false),
            (7, 31, ASYNC_READ, false, 0, false),
            (6, 0, 0, false, libc::EPROTO, false),
        ];
        for (i, &(major, minor, kflags, want, err, uring)) in rows.iter().enumerate() {
            let (_, fs) = volume(None, false, want);
            let r = classic(&fs, opc::INIT, 0, &init_in(major, minor, kflags), &[]).expect("reply");
            assert_eq!(r.0, err, "row {i}");
            assert_eq!(fs.io_uring_negotiated(), uring, "row {i}");
            assert_eq!(fs.initialised(), err == 0, "row {i}");
            if err == 0 {
                let b = &r.1;
                assert_eq!(b[0..4], 7u32.to_ne_bytes(), "row {i}: major");
                assert_eq!(
                    b[4..8],
                    minor.min(proto::MINOR).to_ne_bytes(),
                    "row {i}: minor"
                );
                let flags = u64::from(u32::from_ne_bytes(b[12..16].try_into().expect("4")))
                    | u64::from(u32::from_ne_bytes(b[32..36].try_into().expect("4"))) << 32;
                assert_eq!(
                    flags & !kflags,
                    0,
                    "row {i}: a flag the kernel did not offer"
                );
                assert_eq!(flags & OVER_IO_URING != 0, uring, "row {i}");
                assert_eq!(
                    b[20..24],
                    REQUEST_BYTES_MAX.to_ne_bytes(),
                    "row {i}: max_write"
                );
            }
        }
        // A newer major: answer with ours so the kernel can retry.
        let (_, fs) = volume(None, false, false);
        let r = classic(&fs, opc::INIT, 0, &init_in(8, 0, 0), &[]).expect("reply");
        assert_eq!((r.0, &r.1[0..4]), (0, &7u32.to_ne_bytes()[..]));
        assert!(!fs.initialised());
    }

    #[test]
    fn malformed_requests_get_errors_not_panics() {
        let (_, fs) = volume(None, true, false);
        // Before INIT every request is EIO.
        assert_eq!(
            classic(&fs, opc::GETATTR, 1, &[0; 16], &[]),
            Some((libc::EIO, vec![]))
        );
        init(&fs);
        // Read-only volume: opening for writing is EROFS.
        assert_eq!(
            want_of(&classic(
                &fs,
                opc::OPEN,
                1,
                &u32b(libc::O_WRONLY as u32),
                &[0; 4]
            )),
            Want::Err(libc::EROFS)
        );
        // FORGET and INTERRUPT get no reply on the classic transport.
        assert_eq!(classic(&fs, opc::FORGET, 1, &[0; 8], &[]), None);
        assert_eq!(classic(&fs, opc::INTERRUPT, 1, &[0; 8], &[]), None);
        // On the ring the entry must go back anyway: ENOSYS.
        assert_eq!(
            want_of(&ring_req(&fs, opc::FORGET, 1, &[0; 8], &[])),
            Want::Err(libc::ENOSYS)
        );
        // Classic framing: shorter than a header -> nothing to answer; header length not what
        // was read -> EIO to that unique.
        let mut buf = vec![0u8; 8192];
        assert_eq!(fs.handle_classic(&mut buf, 39), None);
        let h = InHeader {
            len: 4000,
            opcode: opc::GETATTR,
            unique: 9,
            nodeid: 1,
            uid: 0,
            gid: 0,
            pid: 0,
        };
        buf[..40].copy_from_slice(&h.encode());
        let r = fs.handle_classic(&mut buf, 56).expect("reply");
        assert_eq!((r.unique, r.error, r.body), (9, libc::EIO, 0..0));
        // n larger than the buffer is clamped, not a panic.
        assert!(fs.handle_classic(&mut buf[..100], 4000).is_some());
        // Ring: a payload size beyond the buffer is EIO.
        let mut header = vec![0u8; ring::HEADER_BYTES];
        let h = InHeader { len: 0, ..h };
        header[..40].copy_from_slice(&h.encode());
        ring::set_ent_payload_bytes(&mut header, u32::MAX);
        let mut pl = vec![0u8; BUF_BYTES];
        fs.handle_ring(&mut header, &mut pl);
        let o = InHeader::parse(&header).expect("out");
        assert_eq!(-(o.opcode as i32), libc::EIO);
        // Every opcode with empty, short and garbage arguments: an answer, never a panic.
        for op in 0..64u32 {
            for len in [0usize, 1, 7, 15, 39, 87] {
                let junk = vec![0xffu8; len];
                let _ = classic(&fs, op, 1, &junk, &junk);
                let _ = ring_req(&fs, op, 1, &junk, &junk);
            }
        }
    }

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
