//! Everything that talks to the kernel: mounting (mount(2), or `fusermount3` for non-root),
//! `/dev/fuse` file descriptors, the classic read/write loop, and the FUSE-over-io_uring queues.
//! All `unsafe` of this crate lives here. Request handling is [`VolumeFs::handle`], shared by
//! both transports.
//!
//! # Buffer ownership (io_uring)
//! Each ring entry owns a header buffer (`struct fuse_uring_req_header`) and a payload buffer,
//! registered with the kernel by FUSE_IO_URING_CMD_REGISTER. From registration (or from a
//! COMMIT_AND_FETCH) until that command's completion arrives, the kernel may write into both
//! buffers at any time: this code holds no reference into them then, only raw pointers. When the
//! completion arrives the entry belongs to this thread until it submits the next
//! COMMIT_AND_FETCH. The buffers are freed only after every entry's command has completed (the
//! kernel completes them all with -ENOTCONN at unmount) and the ring is closed; if the serving
//! loop ends early with commands still in the kernel, the buffers are leaked instead.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::fs::{VolumeFs, REQUEST_BYTES_MAX};
use crate::proto::{self, ring, InHeader};

/// Bytes of a classic read buffer: the largest request (a write of REQUEST_BYTES_MAX plus its
/// headers) with room to spare; the kernel refuses reads into buffers smaller than that.
pub const CLASSIC_BUF_BYTES: usize = REQUEST_BYTES_MAX as usize + (64 << 10);
/// Ring entries per FUSE queue: requests one CPU's queue can hand to this process at once
/// (more wait in the kernel). Each costs a REQUEST_BYTES_MAX payload buffer.
pub const URING_ENTRIES_PER_QUEUE: usize = 8;
/// Bytes of one ring entry's payload buffer; the kernel wants at least max_write and
/// max_pages pages (both REQUEST_BYTES_MAX here).
const URING_PAYLOAD_BYTES: usize = REQUEST_BYTES_MAX as usize;
use ucrypt::sync::PAGE_BYTES;
/// `_IOR(229, 0, uint32_t)`: attach a new /dev/fuse fd to an existing connection.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn open_dev_fuse() -> io::Result<OwnedFd> {
    // SAFETY: a valid NUL-terminated path; the returned fd is checked before use.
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// How to mount.
pub struct MountSpec<'a> {
    pub fs_name: &'a str,
    pub read_only: bool,
    pub allow_other: bool,
    /// The mount point is a directory (else a regular file, which becomes the file).
    pub is_dir: bool,
}

/// Mounts and returns the connection's /dev/fuse fd: mount(2) as root, else `fusermount3`.
pub fn mount(mountpoint: &Path, spec: &MountSpec<'_>) -> io::Result<OwnedFd> {
    let fd = open_dev_fuse()?;
    let target = cstr(mountpoint)?;
    let source = CString::new(spec.fs_name.replace('\0', "_"))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "bad fs name"))?;
    let rootmode = if spec.is_dir {
        libc::S_IFDIR
    } else {
        libc::S_IFREG
    };
    let (uid, gid) = ids();
    let mut data = format!(
        "fd={},rootmode={rootmode:o},user_id={uid},group_id={gid},default_permissions",
        fd.as_raw_fd()
    );
    if spec.allow_other {
        data.push_str(",allow_other");
    }
    let data = CString::new(data).map_err(|_| io::Error::other("mount options"))?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    if spec.read_only {
        flags |= libc::MS_RDONLY;
    }
    let mut last = io::Error::other("no mount attempted");
    for fstype in [c"fuse.ucrypt", c"fuse"] {
        // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                flags,
                data.as_ptr().cast(),
            )
        };
        if rc == 0 {
            return Ok(fd);
        }
        last = io::Error::last_os_error();
        if last.raw_os_error() != Some(libc::ENODEV) {
            break;
        }
    }
    if last.raw_os_error() == Some(libc::EPERM) {
        return fusermount(mountpoint, spec);
    }
    Err(last)
}

/// Mounts through the setuid `fusermount3`, which passes the /dev/fuse fd back over the unix
/// socket named by `_FUSE_COMMFD` (one SCM_RIGHTS message).
fn fusermount(mountpoint: &Path, spec: &MountSpec<'_>) -> io::Result<OwnedFd> {
    let mut sv = [0 as RawFd; 2];
    // SAFETY: `sv` has room for the two fds socketpair writes.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    let mut opts = format!(
        "fsname={},subtype=ucrypt,default_permissions,nosuid,nodev,noatime",
        spec.fs_name.replace([',', '\\'], "_")
    );
    if spec.read_only {
        opts.push_str(",ro");
    }
    if spec.allow_other {
        opts.push_str(",allow_other");
    }
    let child_fd = theirs.as_raw_fd();
    let mut cmd = std::process::Command::new("fusermount3");
    cmd.arg("-o")
        .arg(opts)
        .arg("--")
        .arg(mountpoint)
        .env("_FUSE_COMMFD", child_fd.to_string());
    // SAFETY: the closure only calls fcntl, which is async-signal-safe, on an fd that the child
    // inherited (it is open in the parent until after spawn).
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(child_fd, libc::F_SETFD, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("run fusermount3: {e}")))?;
    drop(theirs);
    let fd = recv_fd(&ours);
    let status = child.wait()?;
    match fd {
        Ok(fd) => Ok(fd),
        Err(e) if status.success() => Err(e),
        Err(_) => Err(io::Error::other(format!("fusermount3 failed ({status})"))),
    }
}

fn recv_fd(sock: &OwnedFd) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for one cmsg carrying one int, aligned for cmsghdr.
    let mut space = [0u64; 8];
    // SAFETY: msghdr is plain data; every pointer set below is valid for the recvmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&space);
    // SAFETY: `msg` points at live buffers of the stated sizes.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR reads only within msg_control.
    let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if n == 0 || c.is_null() {
        return Err(io::Error::other("fusermount3 passed no file descriptor"));
    }
    // SAFETY: `c` points into `space`, checked non-null; the kernel wrote a whole cmsghdr.
    let (level, typ) = unsafe { ((*c).cmsg_level, (*c).cmsg_type) };
    if level != libc::SOL_SOCKET || typ != libc::SCM_RIGHTS {
        return Err(io::Error::other("fusermount3 sent an unexpected message"));
    }
    // SAFETY: an SCM_RIGHTS cmsg carries at least one int; read unaligned to be safe.
    let fd: RawFd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c).cast()) };
    // SAFETY: the kernel installed this fd in our table for us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A second fd on the same connection, so each worker thread reads its own.
pub fn clone_fd(main: &OwnedFd) -> io::Result<OwnedFd> {
    let fd = open_dev_fuse()?;
    let src: u32 = main.as_raw_fd() as u32;
    // SAFETY: `src` is a valid u32 the ioctl reads; `fd` is an open /dev/fuse fd.
    if unsafe { libc::ioctl(fd.as_raw_fd(), FUSE_DEV_IOC_CLONE, &src) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

pub fn umount(mountpoint: &Path, lazy: bool) -> io::Result<()> {
    let c = cstr(mountpoint)?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What one read of a classic fd gave.
pub enum Read {
    Got(usize),
    /// Nothing to read now (EAGAIN on a non-blocking fd): wait with [`wait_readable`].
    Empty,
    /// Try again (interrupted, or the request was aborted before we read it).
    Again,
    /// The connection is gone (unmounted).
    Gone,
}

/// Reads one request into `buf`.
pub fn read_request(fd: RawFd, buf: &mut [u8]) -> io::Result<Read> {
    // SAFETY: `buf` is a live, writable buffer of the given length.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n >= 0 {
        return Ok(Read::Got(n as usize));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) => Ok(Read::Empty),
        Some(libc::EINTR | libc::ENOENT) => Ok(Read::Again),
        // The connection is gone: unmounted (ENODEV), or ended by the kernel as it destroys
        // the file system once its last user (a loop device over a detached mount) leaves,
        // which reads as an aborted connection (ECONNABORTED), as the io_uring path sees too.
        Some(libc::ENODEV | libc::ECONNABORTED) => Ok(Read::Gone),
        _ => Err(e),
    }
}

/// Makes reads of `fd` return at once when no request is queued ([`Read::Empty`]), so that a
/// reader can wait with a timeout ([`wait_readable`]).
pub fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd we own; F_GETFL/F_SETFL touch no memory.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Waits until a request is queued on the connection of `fd` (or it ends: a read then says
/// so), for at most `timeout` (None: without a limit). False when the time passed.
pub fn wait_readable(fd: RawFd, timeout: Option<std::time::Duration>) -> io::Result<bool> {
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd, the count given.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            return Ok(true);
        }
        return Err(e);
    }
    Ok(n > 0)
}

/// Whether a request is queued on the connection of `fd` now (nobody has read it yet).
pub fn request_queued(fd: RawFd) -> bool {
    wait_readable(fd, Some(std::time::Duration::ZERO)).unwrap_or(false)
}

/// A classic reader's request buffer: an anonymous mapping of [`CLASSIC_BUF_BYTES`], whose
/// pages are faulted in as requests fill them (a 4 KiB read touches two) and given back with
/// [`ReqBuf::release`]. Not the allocator's: a freed 1 MiB allocation raises glibc's mmap
/// threshold, and the next one then stays in a thread's arena for good.
pub struct ReqBuf {
    ptr: std::ptr::NonNull<u8>,
}

// SAFETY: the mapping is owned by this value alone; it is only reached through `&mut self`.
unsafe impl Send for ReqBuf {}

impl ReqBuf {
    pub fn new() -> io::Result<ReqBuf> {
        // SAFETY: a new private anonymous mapping (no file, no fixed address) aliases nothing.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                CLASSIC_BUF_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: our own mapping; advisory (written requests hold plaintext: keep it out of
        // core dumps where the kernel allows).
        unsafe { libc::madvise(raw, CLASSIC_BUF_BYTES, libc::MADV_DONTDUMP) };
        let ptr = std::ptr::NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(ReqBuf { ptr })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the whole mapping, readable and writable, borrowed mutably from its owner.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), CLASSIC_BUF_BYTES) }
    }

    /// Gives the pages back to the kernel (the next request gets zeroed ones): what the last
    /// requests left there, plaintext of writes included, is gone.
    pub fn release(&mut self) {
        // SAFETY: our own mapping, not borrowed (`&mut self`): dropping its pages loses
        // nothing anyone may read.
        unsafe {
            libc::madvise(
                self.ptr.as_ptr().cast(),
                CLASSIC_BUF_BYTES,
                libc::MADV_DONTNEED,
            )
        };
    }
}

impl Drop for ReqBuf {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; no borrow outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), CLASSIC_BUF_BYTES) };
    }
}

/// FUSE_NOTIFY_INVAL_INODE (linux/fuse.h): the kernel drops the inode's cached attributes.
const FUSE_NOTIFY_INVAL_INODE: i32 = 2;

/// Tells the kernel to drop inode `ino`'s cached attributes (offset -1: not its pages).
pub fn notify_inval_inode(fd: RawFd, ino: u64) -> io::Result<()> {
    // struct fuse_notify_inval_inode_out { u64 ino; s64 off; s64 len; }
    let mut body = [0u8; 24];
    body[0..8].copy_from_slice(&ino.to_ne_bytes());
    body[8..16].copy_from_slice(&(-1i64).to_ne_bytes());
    // A notification is a reply with unique 0 and the notify code in the error field (which
    // `write_reply` negates).
    match write_reply(fd, 0, -FUSE_NOTIFY_INVAL_INODE, &body)? {
        true => Ok(()),
        false => Err(io::Error::from_raw_os_error(libc::ENODEV)),
    }
}

/// Writes one reply; false when the connection is gone.
fn write_reply(fd: RawFd, unique: u64, error: i32, body: &[u8]) -> io::Result<bool> {
    let hdr = proto::out_header(unique, error, body.len());
    let iov = [
        libc::iovec {
            iov_base: hdr.as_ptr() as *mut _,
            iov_len: hdr.len(),
        },
        libc::iovec {
            iov_base: body.as_ptr() as *mut _,
            iov_len: body.len(),
        },
    ];
    loop {
        // SAFETY: both iovecs point at live buffers the kernel only reads.
        let n = unsafe { libc::writev(fd, iov.as_ptr(), 2) };
        if n >= 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            // The request was interrupted and is gone: nothing to answer.
            Some(libc::ENOENT) => return Ok(true),
            Some(libc::ENODEV | libc::ECONNABORTED) => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// Serves one classic request from `buf[..n]`; false when the connection is gone.
pub fn serve_classic(fd: RawFd, fs: &VolumeFs, buf: &mut [u8], n: usize) -> io::Result<bool> {
    match fs.handle_classic(buf, n) {
        None => Ok(true),
        Some(r) => write_reply(fd, r.unique, r.error, &buf[r.body]),
    }
}

/// Answers the first request, which must be FUSE_INIT, on the main fd (still blocking).
pub fn serve_init(fd: &OwnedFd, fs: &VolumeFs) -> io::Result<()> {
    let mut buf = ReqBuf::new()?;
    let buf = buf.as_mut_slice();
    loop {
        match read_request(fd.as_raw_fd(), buf)? {
            Read::Again => continue,
            Read::Empty => {
                wait_readable(fd.as_raw_fd(), None)?;
            }
            Read::Gone => return Err(io::Error::other("FUSE connection closed before INIT")),
            Read::Got(n) => {
                let op = InHeader::parse(&buf[..n]).map(|h| h.opcode);
                if op != Some(proto::opcode::INIT) {
                    return Err(io::Error::other(format!(
                        "first FUSE request is opcode {op:?}, not INIT"
                    )));
                }
                serve_classic(fd.as_raw_fd(), fs, buf, n)?;
                if !fs.initialised() {
                    return Err(io::Error::other("FUSE INIT refused (protocol version)"));
                }
                return Ok(());
            }
        }
    }
}

/// The FUSE queues the kernel keeps: one per possible CPU (the queue of a request is the CPU
/// its task runs on).
pub fn possible_cpus() -> usize {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let n: usize = s
        .trim()
        .split(',')
        .filter_map(|r| match r.split_once('-') {
            Some((a, b)) => Some(b.parse::<usize>().ok()? + 1 - a.parse::<usize>().ok()?),
            None => r.parse::<usize>().ok().map(|_| 1),
        })
        .sum();
    n.max(1)
}

/// Can this process create a ring with 128-byte SQEs (not forbidden by
/// `kernel.io_uring_disabled`, not too old)?
pub fn probe_io_uring() -> io::Result<()> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .build(2)
        .map(drop)
}

/// Page-aligned, zeroed memory the kernel writes into; freed on drop.
struct RawBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl RawBuf {
    fn new(len: usize) -> io::Result<RawBuf> {
        let layout = std::alloc::Layout::from_size_align(len, PAGE_BYTES)
            .map_err(|_| io::Error::other("bad buffer layout"))?;
        // SAFETY: `len` is non-zero (header and payload sizes are constants > 0).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        Ok(RawBuf { ptr, layout })
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the owner guarantees the kernel no longer
        // holds it (see the module's ownership rules).
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

struct Entry {
    qid: u16,
    header: RawBuf,
    payload: RawBuf,
    /// iov[0] = header, iov[1] = payload, read by the kernel at REGISTER.
    iov: Box<[libc::iovec; 2]>,
    /// A command of this entry is in the kernel.
    in_kernel: bool,
}

/// One thread's io_uring serving one or more FUSE queues.
pub struct UringQueues {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    entries: Vec<Entry>,
    fd: RawFd,
}

/// Sets the `len` field of a 128-byte SQE (the io-uring crate's UringCmd80 leaves it 0, and
/// FUSE's REGISTER wants the iovec count there).
fn with_len(e: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is a repr(C) 128-byte SQE of plain integers: any bit pattern is valid,
    // and `len` sits at byte offset 24 of `struct io_uring_sqe`.
    let mut b: [u8; 128] = unsafe { std::mem::transmute(e) };
    b[24..28].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(b) }
}

impl UringQueues {
    /// A ring and [`URING_ENTRIES_PER_QUEUE`] entries for each of `qids`, on connection `fd`.
    /// `fd` must stay open as long as this value lives.
    pub fn new(fd: RawFd, qids: &[u16]) -> io::Result<UringQueues> {
        let n = qids.len() * URING_ENTRIES_PER_QUEUE;
        let depth = (n as u32).next_power_of_two();
        // One thread submits and reaps, so the kernel may run the work that hands us requests
        // only when we wait for completions (no interrupting task work; Linux >= 6.1), else a
        // plain ring.
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(depth)
            .or_else(|_| IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(depth))?;
        let mut entries = Vec::with_capacity(n);
        for &qid in qids {
            for _ in 0..URING_ENTRIES_PER_QUEUE {
                let header = RawBuf::new(ring::HEADER_BYTES)?;
                let payload = RawBuf::new(URING_PAYLOAD_BYTES)?;
                let iov = Box::new([
                    libc::iovec {
                        iov_base: header.ptr.cast(),
                        iov_len: ring::HEADER_BYTES,
                    },
                    libc::iovec {
                        iov_base: payload.ptr.cast(),
                        iov_len: URING_PAYLOAD_BYTES,
                    },
                ]);
                entries.push(Entry {
                    qid,
                    header,
                    payload,
                    iov,
                    in_kernel: false,
                });
            }
        }
        Ok(UringQueues { ring, entries, fd })
    }

    fn push(&mut self, sqe: squeue::Entry128) -> io::Result<()> {
        // SAFETY: every buffer the SQE names (iovecs, header, payload) lives in `self.entries`
        // and is freed only after its command completed (see module docs).
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        if pushed.is_err() {
            // The SQ holds one slot per entry and each entry has at most one command queued.
            return Err(io::Error::other("io_uring submission queue full (bug)"));
        }
        Ok(())
    }

    /// Registers every entry (FUSE_IO_URING_CMD_REGISTER). Registration is asynchronous: a
    /// command that the kernel refuses completes at once with an error, which this returns;
    /// accepted ones complete only when a request arrives.
    pub fn register(&mut self, fs: &VolumeFs) -> io::Result<()> {
        for i in 0..self.entries.len() {
            let e = &self.entries[i];
            let sqe = opcode::UringCmd80::new(types::Fd(self.fd), ring::CMD_REGISTER)
                .cmd(ring::cmd_req(0, e.qid))
                .addr(Some(e.iov.as_ptr() as u64))
                .build()
                .user_data(i as u64);
            self.push(with_len(sqe, 2))?;
            self.entries[i].in_kernel = true;
        }
        self.ring.submit()?;
        // Refusals complete during submit; peek without taking successes (requests) away.
        let mut first_err = None;
        let mut cq = self.ring.completion();
        cq.sync();
        let results: Vec<(u64, i32)> = cq.map(|c| (c.user_data(), c.result())).collect();
        for (ud, res) in results {
            if res < 0 {
                if let Some(e) = self.entries.get_mut(ud as usize) {
                    e.in_kernel = false;
                }
                first_err.get_or_insert(io::Error::from_raw_os_error(-res));
            } else {
                // A request already arrived: serve it now.
                self.complete_with(ud as usize, fs)?;
            }
        }
        self.ring.submit()?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Serves the request in entry `i` (its command completed with 0) and queues
    /// COMMIT_AND_FETCH with the reply.
    fn complete_with(&mut self, i: usize, fs: &VolumeFs) -> io::Result<()> {
        let e = &mut self.entries[i];
        e.in_kernel = false;
        // SAFETY: the entry's command completed, so until we submit the next one the kernel
        // does not touch these buffers (module docs); they are distinct allocations.
        let header = unsafe { std::slice::from_raw_parts_mut(e.header.ptr, ring::HEADER_BYTES) };
        // SAFETY: as above.
        let payload = unsafe { std::slice::from_raw_parts_mut(e.payload.ptr, URING_PAYLOAD_BYTES) };
        let commit_id = fs.handle_ring(header, payload);
        let sqe = opcode::UringCmd80::new(types::Fd(self.fd), ring::CMD_COMMIT_AND_FETCH)
            .cmd(ring::cmd_req(commit_id, e.qid))
            .build()
            .user_data(i as u64);
        self.push(sqe)?;
        self.entries[i].in_kernel = true;
        Ok(())
    }

    /// Serves requests until every entry's command has come back with an error (at unmount
    /// the kernel ends them all with -ENOTCONN).
    pub fn run(&mut self, fs: &VolumeFs) -> io::Result<()> {
        let mut first_err: Option<io::Error> = None;
        while self.entries.iter().any(|e| e.in_kernel) {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                    ) => {}
                Err(e) => return Err(e),
            }
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in done {
                let i = ud as usize;
                if i >= self.entries.len() {
                    continue;
                }
                if res == 0 {
                    self.complete_with(i, fs)?;
                    continue;
                }
                self.entries[i].in_kernel = false;
                let err = -res;
                if !matches!(
                    err,
                    libc::ENOTCONN | libc::ECANCELED | libc::ENODEV | libc::ECONNABORTED
                ) {
                    first_err.get_or_insert(io::Error::from_raw_os_error(err));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for UringQueues {
    fn drop(&mut self) {
        // Fields drop after this: the ring first (closing it cancels what is still queued),
        // then the buffers. If an entry is still in the kernel (run() ended early on an error),
        // the kernel may yet write into its buffers: leak them rather than free memory it holds.
        if self.entries.iter().any(|e| e.in_kernel) {
            std::mem::forget(std::mem::take(&mut self.entries));
        }
    }
}

/// Pins the calling thread to `cpu` (best effort): the kernel queues a request on the queue of
/// the CPU that issued it, so the thread serving that queue runs where its requests come from.
pub fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data, initialised by CPU_ZERO before use.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t; CPU_SET ignores out-of-range CPUs.
    unsafe {
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
    }
}

/// The real user and group id of this process.
pub fn ids() -> (u32, u32) {
    // SAFETY: getuid/getgid cannot fail and touch no memory.
    unsafe { (libc::getuid(), libc::getgid()) }
}
