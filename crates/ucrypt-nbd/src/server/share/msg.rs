//! The messages between the processes of a shared NBD listener, sans I/O: a frame is an
//! 11-byte header (magic "UCSH", version, kind, body length, all big-endian) and a body of at
//! most [`FRAME_BODY_MAX_BYTES`]. Descriptors travel beside the frame (see `fdpass`), never in
//! it.
//!
//! - `Join` (member → owner): the export a member serves, as the handshake describes it.
//! - `Welcome` (owner → member, with the listening socket): joined; the socket's path is the
//!   file (`dev`, `ino`) the member may adopt if it takes the listener over.
//! - `Refused` (owner → member): why not (a name taken, too many exports).
//! - `Conn` (owner → member, with a client's socket): the client chose this export and its
//!   handshake is over; serve its transmission phase.

use crate::proto::{ExportInfo, EXPORT_NAME_MAX_BYTES};
use crate::{Error, Result};

const MAGIC: u32 = 0x5543_5348;
const VERSION: u16 = 1;
pub(crate) const HEADER_BYTES: usize = 11;
/// An export description, at most (the owner repeats it to clients in `NBD_INFO_DESCRIPTION`).
const DESCRIPTION_MAX_BYTES: usize = 1024;
/// The longest body: a `Join` with the longest name and description.
pub(crate) const FRAME_BODY_MAX_BYTES: usize = 64 + EXPORT_NAME_MAX_BYTES + DESCRIPTION_MAX_BYTES;

const KIND_JOIN: u8 = 1;
const KIND_WELCOME: u8 = 2;
const KIND_REFUSED: u8 = 3;
const KIND_CONN: u8 = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    Join { pid: u32, info: ExportInfo },
    Welcome { dev: u64, ino: u64 },
    Refused { why: String },
    Conn { export: String },
}

fn bad(what: &str) -> Error {
    Error::Protocol(format!("shared NBD listener: {what}"))
}

/// The whole frame of `m`.
pub(crate) fn encode(m: &Msg) -> Vec<u8> {
    let mut body = Vec::new();
    let kind = match m {
        Msg::Join { pid, info } => {
            body.extend_from_slice(&pid.to_be_bytes());
            body.extend_from_slice(&info.size_bytes.to_be_bytes());
            body.extend_from_slice(&info.tx_flags.to_be_bytes());
            body.extend_from_slice(&info.min_block_bytes.to_be_bytes());
            body.extend_from_slice(&info.preferred_block_bytes.to_be_bytes());
            body.extend_from_slice(&info.max_payload_bytes.to_be_bytes());
            let desc = truncated(&info.description, DESCRIPTION_MAX_BYTES);
            for s in [info.name.as_str(), desc] {
                body.extend_from_slice(&(s.len() as u32).to_be_bytes());
                body.extend_from_slice(s.as_bytes());
            }
            KIND_JOIN
        }
        Msg::Welcome { dev, ino } => {
            body.extend_from_slice(&dev.to_be_bytes());
            body.extend_from_slice(&ino.to_be_bytes());
            KIND_WELCOME
        }
        Msg::Refused { why } => {
            body.extend_from_slice(truncated(why, DESCRIPTION_MAX_BYTES).as_bytes());
            KIND_REFUSED
        }
        Msg::Conn { export } => {
            body.extend_from_slice(export.as_bytes());
            KIND_CONN
        }
    };
    let mut f = Vec::with_capacity(HEADER_BYTES + body.len());
    f.extend_from_slice(&MAGIC.to_be_bytes());
    f.extend_from_slice(&VERSION.to_be_bytes());
    f.push(kind);
    f.extend_from_slice(&(body.len() as u32).to_be_bytes());
    f.extend_from_slice(&body);
    f
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn truncated(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The kind and body length a header announces.
pub(crate) fn decode_header(h: &[u8; HEADER_BYTES]) -> Result<(u8, usize)> {
    let magic = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let version = u16::from_be_bytes([h[4], h[5]]);
    let len = u32::from_be_bytes([h[7], h[8], h[9], h[10]]) as usize;
    if magic != MAGIC {
        return Err(bad("bad magic"));
    }
    if version != VERSION {
        return Err(bad(&format!(
            "version {version}, this ucrypt speaks {VERSION}"
        )));
    }
    if len > FRAME_BODY_MAX_BYTES {
        return Err(bad(&format!("a message of {len} bytes")));
    }
    Ok((h[6], len))
}

/// Reads a body field by field; every read is bounds-checked.
struct Body<'a>(&'a [u8]);

impl<'a> Body<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(bad("a message shorter than its fields"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
    fn string(&mut self, max: usize) -> Result<String> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(bad("a name too long"));
        }
        utf8(self.take(n)?)
    }
    fn end(&self) -> Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(bad("trailing bytes in a message"))
        }
    }
}

fn utf8(b: &[u8]) -> Result<String> {
    String::from_utf8(b.to_vec()).map_err(|_| bad("a name that is not UTF-8"))
}

/// The message of a header's `kind` with this `body`.
pub(crate) fn decode(kind: u8, body: &[u8]) -> Result<Msg> {
    let mut b = Body(body);
    let m = match kind {
        KIND_JOIN => {
            let pid = b.u32()?;
            let size_bytes = b.u64()?;
            let tx_flags = b.u16()?;
            let min_block_bytes = b.u32()?;
            let preferred_block_bytes = b.u32()?;
            let max_payload_bytes = b.u32()?;
            let name = b.string(EXPORT_NAME_MAX_BYTES)?;
            let description = b.string(DESCRIPTION_MAX_BYTES)?;
            Msg::Join {
                pid,
                info: ExportInfo {
                    name,
                    description,
                    size_bytes,
                    tx_flags,
                    min_block_bytes,
                    preferred_block_bytes,
                    max_payload_bytes,
                },
            }
        }
        KIND_WELCOME => Msg::Welcome {
            dev: b.u64()?,
            ino: b.u64()?,
        },
        KIND_REFUSED => return Ok(Msg::Refused { why: utf8(body)? }),
        KIND_CONN => {
            if body.len() > EXPORT_NAME_MAX_BYTES {
                return Err(bad("a name too long"));
            }
            return Ok(Msg::Conn {
                export: utf8(body)?,
            });
        }
        k => return Err(bad(&format!("unknown message kind {k}"))),
    };
    b.end()?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str) -> ExportInfo {
        ExportInfo {
            name: name.into(),
            description: "ucrypt volume, 512 byte sectors".into(),
            size_bytes: 20 << 20,
            tx_flags: 0x4d,
            min_block_bytes: 512,
            preferred_block_bytes: 4096,
            max_payload_bytes: 32 << 20,
        }
    }

    fn round(m: &Msg) -> Result<Msg> {
        let f = encode(m);
        let h: [u8; HEADER_BYTES] = f[..HEADER_BYTES].try_into().unwrap();
        let (kind, len) = decode_header(&h)?;
        assert_eq!(len, f.len() - HEADER_BYTES);
        decode(kind, &f[HEADER_BYTES..])
    }

    #[test]
    fn every_message_round_trips() {
        for m in [
            Msg::Join {
                pid: 42,
                info: info("vol-ä"),
            },
            Msg::Welcome { dev: 7, ino: 9 },
            Msg::Refused {
                why: "export name 'a' is taken".into(),
            },
            Msg::Conn { export: "a".into() },
            Msg::Conn { export: "".into() },
        ] {
            assert_eq!(round(&m).unwrap(), m);
        }
    }

    #[test]
    fn bad_frames_are_refused() {
        let good = encode(&Msg::Join {
            pid: 1,
            info: info("x"),
        });
        let h = |f: &[u8]| -> [u8; HEADER_BYTES] { f[..HEADER_BYTES].try_into().unwrap() };
        let mut f = good.clone();
        f[0] ^= 1;
        assert!(decode_header(&h(&f)).is_err(), "magic");
        let mut f = good.clone();
        f[5] = 2;
        assert!(decode_header(&h(&f)).is_err(), "version");
        let mut f = good.clone();
        f[7..11].copy_from_slice(&((FRAME_BODY_MAX_BYTES + 1) as u32).to_be_bytes());
        assert!(decode_header(&h(&f)).is_err(), "length");
        let body = &good[HEADER_BYTES..];
        assert!(decode(KIND_JOIN, &body[..body.len() - 1]).is_err(), "short");
        let mut long = body.to_vec();
        long.push(0);
        assert!(decode(KIND_JOIN, &long).is_err(), "trailing");
        assert!(decode(99, body).is_err(), "kind");
        assert!(decode(KIND_CONN, &[0xff, 0xfe]).is_err(), "utf-8");
        assert!(decode(KIND_WELCOME, &[0; 15]).is_err(), "welcome short");
    }
}
