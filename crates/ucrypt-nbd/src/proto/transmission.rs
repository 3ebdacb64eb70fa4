//! Transmission phase: request headers in, typed commands out; simple replies encoded (server)
//! and decoded (client).

use super::*;
use crate::{Error, Result};

/// Fixed size of a request header on the wire.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Fixed size of a simple reply header on the wire.
pub const SIMPLE_REPLY_BYTES: usize = 16;

/// A request header exactly as sent (after the magic was checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    /// Parses a header; a wrong magic means the stream is out of sync: hard disconnect.
    pub fn parse(b: &[u8; REQUEST_HEADER_BYTES]) -> Result<Self> {
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != REQUEST_MAGIC {
            return Err(Error::Protocol(format!("bad request magic {magic:#x}")));
        }
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&b[8..16]);
        let mut offset = [0u8; 8];
        offset.copy_from_slice(&b[16..24]);
        Ok(RequestHeader {
            flags: u16::from_be_bytes([b[4], b[5]]),
            kind: u16::from_be_bytes([b[6], b[7]]),
            cookie: u64::from_be_bytes(cookie),
            offset: u64::from_be_bytes(offset),
            length: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
        })
    }

    pub fn encode(&self) -> [u8; REQUEST_HEADER_BYTES] {
        let mut b = [0u8; REQUEST_HEADER_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// What the export looks like to the validator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransmissionLimits {
    pub size_bytes: u64,
    pub tx_flags: u16,
    pub min_block_bytes: u32,
    pub max_payload_bytes: u32,
}

/// A validated command: offsets and lengths lie inside the export and are aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        len: u32,
    },
    /// `len` payload bytes follow the header on the wire.
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        fua: bool,
        no_hole: bool,
    },
    Disconnect,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub cookie: u64,
    pub command: Command,
}

/// The decision on one request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded {
    Ok(Request),
    /// Answer with this error; first read and drop `skip_payload_bytes` (a refused write's
    /// payload), which is bounded by the maximum payload.
    Reject {
        cookie: u64,
        error: NbdError,
        skip_payload_bytes: u32,
    },
    /// Hard disconnect: the stream cannot be resynchronised (e.g. a write payload larger than
    /// the maximum payload, which we refuse to read through).
    Fatal(&'static str),
}

/// Validates a request header against the export.
pub fn decode_request(h: &RequestHeader, lim: &TransmissionLimits) -> Decoded {
    let cookie = h.cookie;
    let is_write = h.kind == CMD_WRITE;
    if is_write && h.length > lim.max_payload_bytes {
        return Decoded::Fatal("write payload larger than the maximum payload");
    }
    let skip = if is_write { h.length } else { 0 };
    let reject = |error| Decoded::Reject {
        cookie,
        error,
        skip_payload_bytes: skip,
    };

    let allowed_flags = match h.kind {
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        // FUA is valid on every command once SEND_FUA is advertised (clients set it on reads).
        _ => CMD_FLAG_FUA,
    };
    if h.flags & !allowed_flags != 0 {
        return reject(NbdError::Inval);
    }
    let fua = h.flags & CMD_FLAG_FUA != 0;
    let read_only = lim.tx_flags & TX_READ_ONLY != 0;
    let (offset, len) = (h.offset, h.length);

    // Range and alignment for the commands that address data.
    let check = |for_write: bool| -> Option<NbdError> {
        let end = offset.checked_add(u64::from(len));
        let inside = matches!(end, Some(e) if e <= lim.size_bytes);
        if !inside {
            // The spec asks for ENOSPC past the end on writes, EINVAL on reads and trims.
            return Some(if for_write {
                NbdError::NoSpc
            } else {
                NbdError::Inval
            });
        }
        let m = u64::from(lim.min_block_bytes.max(1));
        if offset % m != 0 || u64::from(len) % m != 0 {
            return Some(NbdError::Inval);
        }
        None
    };

    let command = match h.kind {
        CMD_READ => {
            if len > lim.max_payload_bytes {
                return reject(NbdError::Inval);
            }
            if let Some(e) = check(false) {
                return reject(e);
            }
            Command::Read { offset, len }
        }
        CMD_WRITE => {
            if read_only {
                return reject(NbdError::Perm);
            }
            if let Some(e) = check(true) {
                return reject(e);
            }
            Command::Write { offset, len, fua }
        }
        CMD_TRIM => {
            if read_only {
                return reject(NbdError::Perm);
            }
            if let Some(e) = check(false) {
                return reject(e);
            }
            Command::Trim { offset, len, fua }
        }
        CMD_WRITE_ZEROES => {
            if read_only {
                return reject(NbdError::Perm);
            }
            if let Some(e) = check(true) {
                return reject(e);
            }
            let no_hole = h.flags & CMD_FLAG_NO_HOLE != 0;
            Command::WriteZeroes {
                offset,
                len,
                fua,
                no_hole,
            }
        }
        CMD_FLUSH => {
            if offset != 0 || len != 0 {
                return reject(NbdError::Inval);
            }
            Command::Flush
        }
        CMD_DISC => Command::Disconnect,
        _ => return reject(NbdError::Inval),
    };
    Decoded::Ok(Request { cookie, command })
}

/// The error values NBD allows on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum NbdError {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

impl NbdError {
    /// Reads the error field of a reply; 0 is success. The spec asks clients to treat an
    /// unexpected value as `NBD_EINVAL` rather than disconnect.
    pub fn from_wire(v: u32) -> Option<Self> {
        Some(match v {
            0 => return None,
            1 => NbdError::Perm,
            5 => NbdError::Io,
            12 => NbdError::NoMem,
            28 => NbdError::NoSpc,
            75 => NbdError::Overflow,
            95 => NbdError::NotSup,
            108 => NbdError::Shutdown,
            _ => NbdError::Inval,
        })
    }

    /// The spec's name of the error, for messages.
    pub fn name(self) -> &'static str {
        match self {
            NbdError::Perm => "NBD_EPERM",
            NbdError::Io => "NBD_EIO",
            NbdError::NoMem => "NBD_ENOMEM",
            NbdError::Inval => "NBD_EINVAL",
            NbdError::NoSpc => "NBD_ENOSPC",
            NbdError::Overflow => "NBD_EOVERFLOW",
            NbdError::NotSup => "NBD_ENOTSUP",
            NbdError::Shutdown => "NBD_ESHUTDOWN",
        }
    }

    /// The local errno for the error (the wire values were chosen as Linux errnos, but the
    /// mapping is spelled out rather than assumed).
    pub fn errno(self) -> i32 {
        match self {
            NbdError::Perm => libc::EPERM,
            NbdError::Io => libc::EIO,
            NbdError::NoMem => libc::ENOMEM,
            NbdError::Inval => libc::EINVAL,
            NbdError::NoSpc => libc::ENOSPC,
            NbdError::Overflow => libc::EOVERFLOW,
            NbdError::NotSup => libc::ENOTSUP,
            NbdError::Shutdown => libc::ESHUTDOWN,
        }
    }

    /// Maps an errno to the closest NBD error; unknown ones become EIO.
    pub fn from_errno(errno: i32) -> Self {
        match errno {
            libc::EPERM | libc::EROFS | libc::EACCES => NbdError::Perm,
            libc::ENOMEM => NbdError::NoMem,
            libc::EINVAL => NbdError::Inval,
            // The spec asks to map EDQUOT and EFBIG to ENOSPC.
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NbdError::NoSpc,
            libc::EOVERFLOW => NbdError::Overflow,
            libc::ENOTSUP => NbdError::NotSup,
            libc::ESHUTDOWN => NbdError::Shutdown,
            _ => NbdError::Io,
        }
    }

    /// The NBD error a client gets when the device fails a request.
    pub fn from_error(e: &ucrypt::Error) -> Self {
        Self::from_errno(e.errno())
    }
}

/// Encodes a simple reply header; a successful read's data follows it.
pub fn encode_simple_reply(cookie: u64, error: Option<NbdError>) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut b = [0u8; SIMPLE_REPLY_BYTES];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.map_or(0, |e| e as u32).to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A simple reply header as a client reads it; a successful read's `length` bytes follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimpleReply {
    pub cookie: u64,
    pub error: Option<NbdError>,
}

impl SimpleReply {
    /// Parses a reply header. A wrong magic (including the structured reply magic, which this
    /// client never negotiates) means the stream is out of sync: hard disconnect.
    pub fn parse(b: &[u8; SIMPLE_REPLY_BYTES]) -> Result<Self> {
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(Error::ServerProtocol(format!(
                "bad reply magic {magic:#x} (expected a simple reply)"
            )));
        }
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&b[8..16]);
        Ok(SimpleReply {
            cookie: u64::from_be_bytes(cookie),
            error: NbdError::from_wire(u32::from_be_bytes([b[4], b[5], b[6], b[7]])),
        })
    }
}
