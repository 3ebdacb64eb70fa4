//! File descriptors passed between processes over a connected unix stream socket
//! (`SCM_RIGHTS`), and the peer's user id (`SO_PEERCRED`): what a shared NBD listener
//! ([`super::share`]) needs to hand a connected client to the process that serves its export.
//!
//! Ownership: a descriptor sent stays owned by the sender (the kernel installs a duplicate in
//! the receiver); a descriptor received is returned as an [`OwnedFd`], close-on-exec, owned by
//! the caller from then on. Descriptors beyond [`FDS_PER_MESSAGE_MAX`] in one message are
//! refused by the kernel's truncation (`MSG_CTRUNC`) and closed there, never leaked here.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Descriptors one message may carry: the protocol sends at most one.
const FDS_PER_MESSAGE_MAX: usize = 1;

/// Room for the control message of [`FDS_PER_MESSAGE_MAX`] descriptors, aligned as `cmsghdr`.
#[repr(C)]
union CmsgBuf {
    _align: libc::cmsghdr,
    bytes: [u8; 64],
}

fn cmsg_space() -> usize {
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    unsafe { libc::CMSG_SPACE((FDS_PER_MESSAGE_MAX * size_of::<RawFd>()) as u32) as usize }
}

/// Sends all of `bytes`, the first of them together with `fd` if one is given.
pub(crate) fn send(
    stream: &UnixStream,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    use std::io::Write;
    let Some(fd) = fd else {
        return (&*stream).write_all(bytes);
    };
    if bytes.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a descriptor needs at least one byte to travel with",
        ));
    }
    let mut cbuf = CmsgBuf { bytes: [0; 64] };
    let space = cmsg_space();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: taking the address of the union's byte view, which covers the whole buffer.
    msg.msg_control = unsafe { cbuf.bytes.as_mut_ptr() }.cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `cbuf`, which has room for one cmsghdr with one descriptor
    // (`space` ≤ 64 bytes, checked by the assertion in the tests); CMSG_FIRSTHDR returns a
    // pointer inside it, and CMSG_DATA one inside that header's data.
    let sent = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd.as_raw_fd());
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    // The descriptor went with the first byte; the rest is plain data.
    (&*stream).write_all(&bytes[sent as usize..])
}

/// Receives up to `buf.len()` bytes and any descriptors that came with them. `Ok((0, _))` is
/// the end of the stream.
pub(crate) fn recv(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut cbuf = CmsgBuf { bytes: [0; 64] };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: taking the address of the union's byte view, which covers the whole buffer.
    msg.msg_control = unsafe { cbuf.bytes.as_mut_ptr() }.cast();
    msg.msg_controllen = cmsg_space() as _;
    let n = loop {
        // SAFETY: `msg` describes `buf` (writable, its length) and `cbuf` (writable, the
        // length given), both alive across the call.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `cbuf` up to `msg.msg_controllen`; CMSG_FIRSTHDR/NXTHDR walk
    // only within it, and each SCM_RIGHTS header's data holds (cmsg_len - CMSG_LEN(0)) / 4
    // descriptors the kernel installed in this process, which nobody else owns.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count =
                    ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more descriptors than one message may carry",
        ));
    }
    Ok((n, fds))
}

/// The user id of the process at the other end of `stream` (as it was when it connected).
pub(crate) fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    peer_cred(stream).map(|c| c.uid)
}

/// The process id of the process at the other end of `stream` (the one that connected it).
pub(crate) fn peer_pid(stream: &UnixStream) -> io::Result<u32> {
    peer_cred(stream).map(|c| c.pid as u32)
}

fn peer_cred(stream: &UnixStream) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which lives across the call.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// This process's effective user id.
pub(crate) fn my_uid() -> u32 {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_descriptor_travels_with_its_bytes() {
        assert!(cmsg_space() <= 64);
        let (a, b) = UnixStream::pair().unwrap();
        let (mut x, y) = UnixStream::pair().unwrap();
        let mut frame = vec![7u8; 100];
        frame[0] = 1;
        send(&a, &frame, Some(std::os::fd::AsFd::as_fd(&y))).unwrap();
        drop(y);
        let mut buf = [0u8; 100];
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!((n, fds.len()), (100, 1));
        assert_eq!(buf[..], frame[..]);
        // The descriptor received is the other end of `x`.
        let mut y2 = UnixStream::from(fds.into_iter().next().unwrap());
        x.write_all(b"hello").unwrap();
        let mut got = [0u8; 5];
        y2.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        assert_eq!(peer_uid(&a).unwrap(), my_uid());
        assert_eq!(peer_pid(&a).unwrap(), std::process::id());
        drop(a);
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!((n, fds.len()), (0, 0));
    }
}
