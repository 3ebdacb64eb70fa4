//! Sans-I/O codec for both sides of the NBD protocol (fixed newstyle handshake, simple
//! replies). Bytes in, typed requests and encoded replies out; this module never touches a
//! socket, a thread or a [`ucrypt::BlockDev`]. The server that drives it is [`crate::server`],
//! the client [`crate::client`].
//!
//! - [`handshake`]: the server's greeting, client flags, option haggling (`GO`, `INFO`,
//!   `EXPORT_NAME`, `LIST`, `ABORT`, `STARTTLS`), as a state machine that tells its driver
//!   exactly how many bytes to read next, so it never consumes bytes that belong to TLS or to
//!   the transmission phase.
//! - [`client`]: the client's side of the same handshake (`STARTTLS` when asked, `GO` with
//!   block sizes requested, `EXPORT_NAME` only as the spec's fallback), in the same shape.
//! - [`transmission`]: request header encoding, decoding and validation against the export
//!   (bounds, alignment, flags, read-only), simple reply encoding and decoding, and the errno ↔
//!   NBD error mapping.
//!
//! Limits on everything a client controls are named constants below; a client that exceeds
//! one is disconnected, never allowed to make the server allocate or loop without bound.

pub mod client;
pub mod handshake;
pub mod transmission;

#[cfg(test)]
mod client_tests;
#[cfg(test)]
mod tests;

pub use client::{ClientHandshake, ClientStep, ExportGeometry};
pub use handshake::{ExportInfo, Handshake, Negotiated, Step, TlsPolicy};
pub use transmission::{
    decode_request, encode_simple_reply, Command, Decoded, NbdError, Request, RequestHeader,
    SimpleReply, TransmissionLimits,
};

// ---- magic numbers (protocol constants) ----
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

// ---- handshake flags (server) and client flags ----
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;

// ---- options ----
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;

// ---- option replies ----
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR + 1;
pub const REP_ERR_POLICY: u32 = REP_ERR + 2;
pub const REP_ERR_INVALID: u32 = REP_ERR + 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR + 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR + 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR + 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR + 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR + 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR + 9;

/// True for the option reply types that report an error (bit 31 set).
pub const fn is_rep_err(reply_type: u32) -> bool {
    reply_type & REP_ERR != 0
}

/// The spec's name of an option reply type, for error messages.
pub fn rep_name(reply_type: u32) -> &'static str {
    match reply_type {
        REP_ACK => "NBD_REP_ACK",
        REP_SERVER => "NBD_REP_SERVER",
        REP_INFO => "NBD_REP_INFO",
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD",
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        t if is_rep_err(t) => "an unknown NBD_REP_ERR",
        _ => "an unknown option reply",
    }
}

/// The spec's name of a command, for error messages.
pub fn cmd_name(kind: u16) -> &'static str {
    match kind {
        CMD_READ => "NBD_CMD_READ",
        CMD_WRITE => "NBD_CMD_WRITE",
        CMD_DISC => "NBD_CMD_DISC",
        CMD_FLUSH => "NBD_CMD_FLUSH",
        CMD_TRIM => "NBD_CMD_TRIM",
        CMD_WRITE_ZEROES => "NBD_CMD_WRITE_ZEROES",
        _ => "an unknown command",
    }
}

// ---- information types in NBD_REP_INFO ----
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---- transmission flags ----
pub const TX_HAS_FLAGS: u16 = 1 << 0;
pub const TX_READ_ONLY: u16 = 1 << 1;
pub const TX_SEND_FLUSH: u16 = 1 << 2;
pub const TX_SEND_FUA: u16 = 1 << 3;
pub const TX_SEND_TRIM: u16 = 1 << 5;
pub const TX_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TX_CAN_MULTI_CONN: u16 = 1 << 8;

// ---- command flags and types ----
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

// ---- limits ----
/// Longest export name accepted (the spec bounds NBD strings at 4096 bytes).
pub const EXPORT_NAME_MAX_BYTES: usize = 4096;
/// Largest option payload read from a client: a `GO` with a maximal name plus a generous list
/// of information requests fits; anything longer is a hostile client and is disconnected
/// rather than buffered.
pub const OPTION_DATA_MAX_BYTES: usize = 16 * 1024;
/// Options one connection may send before it must pick an export; bounds a client that
/// haggles forever.
pub const OPTIONS_PER_CONNECTION_MAX: u32 = 1024;
/// Largest READ/WRITE payload: 32 MiB, the size the spec says every server should accept and
/// the most a simple reply or write request may carry here. Bounds per-request buffers.
pub const MAX_PAYLOAD_BYTES: u32 = 32 * 1024 * 1024;
/// Minimum block size advertised. 512 rather than the encryption sector size (often 4096):
/// libnbd, qemu and the kernel all address in 512-byte units, the `BlockDev` contract serves
/// sub-sector requests with a read-modify-write, and a 4096 minimum would make clients that
/// assume 512-byte sectors (e.g. a kernel nbd device used with 512-byte filesystems) fail.
/// The encryption sector size is advertised as the preferred size instead.
pub const MIN_BLOCK_BYTES: u32 = 512;
/// Preferred block size floor: 4096, the common page and LUKS2 sector size.
pub const PREFERRED_BLOCK_BYTES: u32 = 4096;
/// Largest minimum block size a server may advertise (the spec's bound, 2^16).
pub const MIN_BLOCK_BYTES_MAX: u32 = 64 * 1024;
/// Largest option reply a client reads from a server: an `NBD_REP_INFO` is at most a few
/// bytes plus a 4096-byte NBD string, an error reply carries a short message. A longer reply
/// is a hostile or broken server and ends the connection rather than being buffered.
pub const OPTION_REPLY_MAX_BYTES: usize = 16 * 1024;
/// Option replies a client accepts to one option before giving up on the server (a `GO` gets
/// a handful of `NBD_REP_INFO`s and one `ACK`); bounds a server that replies forever.
pub const REPLIES_PER_OPTION_MAX: u32 = 64;
