//! The FUSE wire format as Linux speaks it (protocol 7.x): the request header, the argument
//! structs of the opcodes this export serves, reply encoders, and the headers of the
//! FUSE-over-io_uring transport. Written from the kernel's uapi `linux/fuse.h`; all integers
//! are in host byte order, as the kernel sends them.
//!
//! Pure code: bytes in, typed values or bytes out. Both transports (classic `/dev/fuse` and
//! io_uring) hand the same pieces to [`parse`]: the fixed per-opcode argument struct (`op_in`)
//! and the variable part after it (`payload`: a name, write data).

/// The protocol major version Linux speaks.
pub const MAJOR: u32 = 7;
/// The newest minor version this code knows (7.42 added the io_uring structs).
pub const MINOR: u32 = 42;

pub const IN_HEADER_BYTES: usize = 40;
pub const OUT_HEADER_BYTES: usize = 16;
/// Room for the largest fixed reply this export sends (fuse_entry_out, 128 bytes) and more.
pub const ATTR_BYTES: usize = 88;

pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

/// FUSE_INIT flags (bits 32.. travel in `flags2`).
pub mod init_flag {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// FOPEN_* flags of an open reply.
pub mod fopen {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
}

/// FATTR_* bits of a setattr request.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
}

pub const ROOT_ID: u64 = 1;

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_ne_bytes(x)
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_ne_bytes(x)
}

/// `struct fuse_in_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    /// Whole request length in bytes (header included), as the kernel counts it.
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl InHeader {
    /// None when fewer than [`IN_HEADER_BYTES`] bytes arrived.
    pub fn parse(b: &[u8]) -> Option<InHeader> {
        (b.len() >= IN_HEADER_BYTES).then(|| InHeader {
            len: u32_at(b, 0),
            opcode: u32_at(b, 4),
            unique: u64_at(b, 8),
            nodeid: u64_at(b, 16),
            uid: u32_at(b, 24),
            gid: u32_at(b, 28),
            pid: u32_at(b, 32),
        })
    }

    pub fn encode(&self) -> [u8; IN_HEADER_BYTES] {
        let mut b = [0u8; IN_HEADER_BYTES];
        b[0..4].copy_from_slice(&self.len.to_ne_bytes());
        b[4..8].copy_from_slice(&self.opcode.to_ne_bytes());
        b[8..16].copy_from_slice(&self.unique.to_ne_bytes());
        b[16..24].copy_from_slice(&self.nodeid.to_ne_bytes());
        b[24..28].copy_from_slice(&self.uid.to_ne_bytes());
        b[28..32].copy_from_slice(&self.gid.to_ne_bytes());
        b[32..36].copy_from_slice(&self.pid.to_ne_bytes());
        b
    }
}

/// `struct fuse_out_header`: `error` is 0 or a negative errno.
pub fn out_header(unique: u64, error: i32, body_len: usize) -> [u8; OUT_HEADER_BYTES] {
    let mut b = [0u8; OUT_HEADER_BYTES];
    let len = (OUT_HEADER_BYTES + body_len) as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b[4..8].copy_from_slice(&(-error).to_ne_bytes());
    b[8..16].copy_from_slice(&unique.to_ne_bytes());
    b
}

/// Size of the fixed argument struct that precedes the variable part of a request: what the
/// classic transport splits off, and what the io_uring transport finds in `op_in`.
/// Opcodes this export does not serve have none (their whole body is payload).
pub fn op_in_bytes(opcode: u32) -> usize {
    use opcode::*;
    match opcode {
        FORGET | INTERRUPT | OPEN | OPENDIR | BATCH_FORGET => 8,
        GETATTR | FSYNC | FSYNCDIR => 16,
        RELEASE | RELEASEDIR | FLUSH => 24,
        FALLOCATE => 32,
        READ | WRITE | READDIR => 40,
        INIT => 64,
        SETATTR => 88,
        _ => 0,
    }
}

/// A parsed request. Variable parts are given as lengths into the payload, so the caller
/// keeps one mutable buffer for payload in and reply out (the io_uring payload buffer is both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Init {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u64,
    },
    /// The name is `payload[..name_len]` (NUL not included).
    Lookup {
        name_len: usize,
    },
    Forget,
    Interrupt,
    Getattr,
    Setattr {
        valid: u32,
        size: u64,
    },
    Open {
        flags: u32,
    },
    Opendir,
    Read {
        offset: u64,
        size: u32,
    },
    /// The data is `payload[..size]`.
    Write {
        offset: u64,
        size: u32,
        flags: u32,
    },
    Statfs,
    Release,
    Releasedir,
    Flush,
    Fsync,
    Fsyncdir,
    Fallocate {
        offset: u64,
        length: u64,
        mode: i32,
    },
    Readdir {
        offset: u64,
        size: u32,
    },
    Destroy,
    /// An opcode this export does not serve: ENOSYS.
    Other(u32),
}

/// Parses the arguments of `opcode`. Truncated or inconsistent requests are EINVAL.
pub fn parse(opcode: u32, op_in: &[u8], payload: &[u8]) -> Result<Op, i32> {
    use opcode::*;
    let need = op_in_bytes(opcode);
    // INIT from old kernels carries only major, minor, max_readahead, flags (16 bytes).
    let min = if opcode == INIT { 16 } else { need };
    if op_in.len() < min {
        return Err(libc::EINVAL);
    }
    Ok(match opcode {
        INIT => Op::Init {
            major: u32_at(op_in, 0),
            minor: u32_at(op_in, 4),
            max_readahead: u32_at(op_in, 8),
            flags: u64::from(u32_at(op_in, 12))
                | if op_in.len() >= 20 {
                    u64::from(u32_at(op_in, 16)) << 32
                } else {
                    0
                },
        },
        LOOKUP => {
            let name_len = payload.iter().position(|&c| c == 0).ok_or(libc::EINVAL)?;
            Op::Lookup { name_len }
        }
        FORGET | BATCH_FORGET => Op::Forget,
        INTERRUPT => Op::Interrupt,
        GETATTR => Op::Getattr,
        SETATTR => Op::Setattr {
            valid: u32_at(op_in, 0),
            size: u64_at(op_in, 16),
        },
        OPEN => Op::Open {
            flags: u32_at(op_in, 0),
        },
        OPENDIR => Op::Opendir,
        READ => Op::Read {
            offset: u64_at(op_in, 8),
            size: u32_at(op_in, 16),
        },
        WRITE => {
            let size = u32_at(op_in, 16);
            if payload.len() < size as usize {
                return Err(libc::EINVAL);
            }
            Op::Write {
                offset: u64_at(op_in, 8),
                size,
                flags: u32_at(op_in, 32),
            }
        }
        STATFS => Op::Statfs,
        RELEASE => Op::Release,
        RELEASEDIR => Op::Releasedir,
        FLUSH => Op::Flush,
        FSYNC => Op::Fsync,
        FSYNCDIR => Op::Fsyncdir,
        FALLOCATE => Op::Fallocate {
            offset: u64_at(op_in, 8),
            length: u64_at(op_in, 16),
            mode: u32_at(op_in, 24) as i32,
        },
        READDIR => Op::Readdir {
            offset: u64_at(op_in, 8),
            size: u32_at(op_in, 16),
        },
        DESTROY => Op::Destroy,
        other => Op::Other(other),
    })
}

/// Splits a classic `/dev/fuse` request (header included) into header, `op_in` and payload
/// offsets. The header's length must equal the bytes read.
pub fn split_classic(req: &[u8]) -> Result<(InHeader, usize, usize), (Option<u64>, i32)> {
    let h = InHeader::parse(req).ok_or((None, libc::EIO))?;
    if h.len as usize != req.len() {
        return Err((Some(h.unique), libc::EIO));
    }
    let body = req.len() - IN_HEADER_BYTES;
    let op = op_in_bytes(h.opcode).min(body);
    Ok((h, IN_HEADER_BYTES, IN_HEADER_BYTES + op))
}

/// `struct fuse_attr` fields this export uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub time_s: u64,
    pub time_ns: u32,
    /// File type and permission bits (S_IFREG | 0600 ...).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub blksize: u32,
}

/// Writes little helpers into a reply buffer; panics only on our own bug (a reply larger
/// than the buffer the transport guarantees, see `REPLY_FIXED_BYTES_MAX`).
pub struct Out<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl<'a> Out<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Out { buf, at: 0 }
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_ne_bytes())
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_ne_bytes())
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_ne_bytes())
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
        self
    }
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.buf[self.at..self.at + n].fill(0);
        self.at += n;
        self
    }
    pub fn written(&self) -> usize {
        self.at
    }
    pub fn attr(&mut self, a: &Attr) -> &mut Self {
        self.u64(a.ino).u64(a.size).u64(a.blocks);
        self.u64(a.time_s).u64(a.time_s).u64(a.time_s);
        self.u32(a.time_ns).u32(a.time_ns).u32(a.time_ns);
        self.u32(a.mode).u32(a.nlink).u32(a.uid).u32(a.gid);
        self.u32(0).u32(a.blksize).u32(0)
    }
}

/// The largest fixed-size reply this export writes (fuse_entry_out).
pub const REPLY_FIXED_BYTES_MAX: usize = 128;
/// Bytes a reply buffer must hold besides read data (a readdir of three names fits in 4 KiB).
pub const REPLY_BUF_BYTES_MIN: usize = 4096;

/// `struct fuse_entry_out` (128 bytes).
pub fn entry_out(o: &mut Out<'_>, ttl_s: u64, a: &Attr) {
    o.u64(a.ino)
        .u64(0)
        .u64(ttl_s)
        .u64(ttl_s)
        .u32(0)
        .u32(0)
        .attr(a);
}

/// `struct fuse_attr_out` (104 bytes).
pub fn attr_out(o: &mut Out<'_>, ttl_s: u64, a: &Attr) {
    o.u64(ttl_s).u32(0).u32(0).attr(a);
}

/// `struct fuse_open_out` (16 bytes).
pub fn open_out(o: &mut Out<'_>, fh: u64, open_flags: u32) {
    o.u64(fh).u32(open_flags).u32(0);
}

/// `struct fuse_write_out` (8 bytes).
pub fn write_out(o: &mut Out<'_>, size: u32) {
    o.u32(size).u32(0);
}

/// `struct fuse_statfs_out` (80 bytes).
pub fn statfs_out(o: &mut Out<'_>, blocks: u64, files: u64, bsize: u32, namelen: u32) {
    o.u64(blocks).u64(0).u64(0).u64(files).u64(0);
    o.u32(bsize).u32(namelen).u32(bsize).u32(0).zeros(24);
}

/// What this side answers to FUSE_INIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitOut {
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u64,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub max_pages: u16,
}

impl InitOut {
    /// A reply that names only the protocol minor: what the kernel needs to retry INIT with
    /// our major (every other field is ignored then).
    pub fn minor_only(minor: u32) -> InitOut {
        InitOut {
            minor,
            max_readahead: 0,
            flags: 0,
            max_background: 0,
            congestion_threshold: 0,
            max_write: 0,
            max_pages: 0,
        }
    }
}

/// `struct fuse_init_out` (64 bytes).
pub fn init_out(o: &mut Out<'_>, i: &InitOut) {
    o.u32(MAJOR).u32(i.minor).u32(i.max_readahead);
    o.u32(i.flags as u32);
    o.u16(i.max_background).u16(i.congestion_threshold);
    o.u32(i.max_write).u32(1); // time_gran: 1 ns
    o.u16(i.max_pages).u16(0); // map_alignment
    o.u32((i.flags >> 32) as u32);
    o.zeros(28); // max_stack_depth, request_timeout, unused
}

/// `struct fuse_dirent` followed by the name, padded to 8 bytes; None if it does not fit.
pub fn dirent(o: &mut Out<'_>, limit: usize, ino: u64, off: u64, typ: u32, name: &str) -> bool {
    let n = name.len();
    let rec = (24 + n).next_multiple_of(8);
    if o.written() + rec > limit {
        return false;
    }
    o.u64(ino)
        .u64(off)
        .u32(n as u32)
        .u32(typ)
        .bytes(name.as_bytes());
    o.zeros(rec - 24 - n);
    true
}

/// The io_uring transport's per-entry header buffer (`struct fuse_uring_req_header`):
/// 128 bytes of in/out header, 128 bytes of per-opcode struct, 32 bytes of entry info.
pub mod ring {
    pub const IN_OUT_BYTES: usize = 128;
    pub const OP_IN_BYTES: usize = 128;
    pub const OP_IN_AT: usize = IN_OUT_BYTES;
    pub const ENT_AT: usize = IN_OUT_BYTES + OP_IN_BYTES;
    /// sizeof(struct fuse_uring_req_header).
    pub const HEADER_BYTES: usize = ENT_AT + 32;
    pub const CMD_REGISTER: u32 = 1;
    pub const CMD_COMMIT_AND_FETCH: u32 = 2;

    /// `struct fuse_uring_ent_in_out` inside the header buffer.
    pub fn ent_commit_id(h: &[u8]) -> u64 {
        super::u64_at(h, ENT_AT + 8)
    }
    pub fn ent_payload_bytes(h: &[u8]) -> u32 {
        super::u32_at(h, ENT_AT + 16)
    }
    pub fn set_ent_payload_bytes(h: &mut [u8], n: u32) {
        h[ENT_AT + 16..ENT_AT + 20].copy_from_slice(&n.to_ne_bytes());
    }

    /// `struct fuse_uring_cmd_req` in the SQE's 80-byte command area.
    pub fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
        let mut c = [0u8; 80];
        c[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        c[16..18].copy_from_slice(&qid.to_ne_bytes());
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = InHeader {
            len: 80,
            opcode: opcode::READ,
            unique: 77,
            nodeid: 1,
            uid: 5,
            gid: 6,
            pid: 7,
        };
        assert_eq!(InHeader::parse(&h.encode()), Some(h));
        assert_eq!(InHeader::parse(&h.encode()[..39]), None);
        let o = out_header(77, libc::ENOENT, 8);
        assert_eq!(u32_at(&o, 0), 24);
        assert_eq!(u32_at(&o, 4) as i32, -libc::ENOENT);
        assert_eq!(u64_at(&o, 8), 77);
    }

    #[test]
    fn fixed_reply_sizes_match_the_kernel_structs() {
        let a = Attr {
            ino: 1,
            size: 2,
            blocks: 3,
            time_s: 4,
            time_ns: 5,
            mode: 6,
            nlink: 7,
            uid: 8,
            gid: 9,
            blksize: 10,
        };
        let mut b = [0u8; 256];
        // (encoder, kernel struct size)
        type Enc = fn(&mut Out<'_>, &Attr);
        let rows: &[(Enc, usize)] = &[
            (|o, a| entry_out(o, 1, a), 128),
            (|o, a| attr_out(o, 1, a), 104),
            (|o, _| open_out(o, 0, 0), 16),
            (|o, _| write_out(o, 0), 8),
            (|o, _| statfs_out(o, 1, 1, 1, 1), 80),
            (|o, _| init_out(o, &InitOut::minor_only(42)), 64),
            (
                |o, a| {
                    o.attr(a);
                },
                ATTR_BYTES,
            ),
        ];
        for (i, (enc, want)) in rows.iter().enumerate() {
            let mut o = Out::new(&mut b);
            enc(&mut o, &a);
            assert_eq!(o.written(), *want, "row {i}");
            assert!(*want <= REPLY_FIXED_BYTES_MAX);
        }
        assert_eq!(ring::HEADER_BYTES, 288);
    }

    #[test]
    fn dirent_pads_and_refuses_overflow() {
        let mut b = [0u8; 64];
        let mut o = Out::new(&mut b);
        assert!(dirent(&mut o, 64, 1, 1, 4, "."));
        assert_eq!(o.written(), 32);
        assert!(!dirent(&mut o, 64, 2, 2, 8, "0123456789"));
        assert!(dirent(&mut o, 64, 2, 2, 8, "01234567"));
        assert_eq!(o.written(), 64);
    }
}
