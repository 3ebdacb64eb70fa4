//! Client side of the fixed newstyle handshake as a sans-I/O state machine, the mirror of
//! [`super::handshake`].
//!
//! Driver loop: send [`ClientHandshake::take_output`], read exactly
//! [`ClientHandshake::bytes_wanted`] bytes, pass them to [`ClientHandshake::feed`], act on the
//! returned [`ClientStep`]. As on the server side, reading exactly what is wanted keeps TLS
//! records and transmission replies out of the handshake's hands.
//!
//! What it asks for, in order:
//! 1. with TLS wanted, `NBD_OPT_STARTTLS` first (the spec's advice against a man in the middle
//!    rewriting earlier options); any refusal ends the session, never a fall-back to plaintext;
//! 2. `NBD_OPT_GO` for the export, requesting `NBD_INFO_BLOCK_SIZE`, which commits the client
//!    to the server's block sizes;
//! 3. only if the server does not know `GO` (`NBD_REP_ERR_UNSUP`), the spec's fall-back
//!    `NBD_OPT_EXPORT_NAME`, with default block sizes.
//!
//! Structured replies are not requested: simple replies carry everything this client needs.

use super::handshake::{take4, take8};
use super::*;
use crate::{Error, Result};

/// What the client learnt about the export it entered transmission with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportGeometry {
    pub size_bytes: u64,
    /// Transmission flags as sent (`TX_*`); 0 if the server did not set `TX_HAS_FLAGS`.
    pub tx_flags: u16,
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_payload_bytes: u32,
    /// The server sent `NBD_INFO_BLOCK_SIZE`; otherwise the sizes are the spec's defaults
    /// (1, 4096, 32 MiB).
    pub block_sizes_advertised: bool,
}

impl std::fmt::Display for ExportGeometry {
    /// As a message names it: size, flags, block sizes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes, flags {:#06x}, blocks of {} (minimum), {} (preferred), {} (maximum payload) \
             bytes",
            self.size_bytes,
            self.tx_flags,
            self.min_block_bytes,
            self.preferred_block_bytes,
            self.max_payload_bytes
        )
    }
}

impl ExportGeometry {
    pub fn has(&self, tx_flag: u16) -> bool {
        self.tx_flags & tx_flag != 0
    }
}

/// The spec's defaults when a server sends no block sizes.
const DEFAULT_MIN_BLOCK_BYTES: u32 = 1;
const DEFAULT_PREFERRED_BLOCK_BYTES: u32 = 4096;
const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 * 1024 * 1024;

/// What the driver must do after a [`ClientHandshake::feed`] (always after sending the output).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientStep {
    /// Read [`ClientHandshake::bytes_wanted`] more bytes.
    Continue,
    /// The server accepted `STARTTLS`: run a TLS client handshake on the connection, then call
    /// [`ClientHandshake::tls_established`]; all further bytes go through TLS.
    StartTls,
    /// Enter the transmission phase with this export.
    Ready(ExportGeometry),
}

#[derive(Debug)]
enum State {
    Greeting,
    ReplyHeader {
        option: u32,
    },
    ReplyData {
        option: u32,
        reply_type: u32,
        len: usize,
    },
    /// Waiting for the driver to run TLS.
    TlsPending,
    /// The reply to `EXPORT_NAME`: size, flags and (unless both sides agreed on no zeroes)
    /// 124 bytes of padding.
    ExportNameReply,
    Done,
}

/// Old-style servers send this instead of `IHAVEOPT`.
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
const OPTION_REPLY_HEADER_BYTES: usize = 20;
const EXPORT_NAME_REPLY_BYTES: usize = 10;
const EXPORT_NAME_PADDING_BYTES: usize = 124;
/// Longest server message quoted in an error.
const MESSAGE_QUOTE_MAX_BYTES: usize = 512;

pub struct ClientHandshake {
    export_name: Vec<u8>,
    tls_wanted: bool,
    no_zeroes: bool,
    state: State,
    replies_to_option: u32,
    export: Option<(u64, u16)>,
    block_sizes: Option<(u32, u32, u32)>,
    buf: Vec<u8>,
    out: Vec<u8>,
}

fn violation(msg: impl Into<String>) -> Error {
    Error::ServerProtocol(msg.into())
}

fn opt_name(option: u32) -> &'static str {
    match option {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_STARTTLS => "NBD_OPT_STARTTLS",
        OPT_GO => "NBD_OPT_GO",
        _ => "an option",
    }
}

impl ClientHandshake {
    /// Starts a handshake for `export_name`; the client speaks second (after the greeting),
    /// so there is no output until the first [`ClientHandshake::feed`].
    pub fn new(export_name: &str, tls: bool) -> Result<Self> {
        if export_name.len() > EXPORT_NAME_MAX_BYTES {
            return Err(Error::Config(format!(
                "export name of {} bytes is longer than NBD allows ({EXPORT_NAME_MAX_BYTES})",
                export_name.len()
            )));
        }
        Ok(ClientHandshake {
            export_name: export_name.as_bytes().to_vec(),
            tls_wanted: tls,
            no_zeroes: false,
            state: State::Greeting,
            replies_to_option: 0,
            export: None,
            block_sizes: None,
            buf: Vec::new(),
            out: Vec::new(),
        })
    }

    /// Bytes to send to the server now.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// How many bytes to read before the next [`ClientHandshake::feed`] can make progress; 0
    /// while TLS is pending and once the handshake is over.
    pub fn bytes_wanted(&self) -> usize {
        let need = match self.state {
            State::Greeting => handshake::GREETING_BYTES,
            State::ReplyHeader { .. } => OPTION_REPLY_HEADER_BYTES,
            State::ReplyData { len, .. } => len,
            State::ExportNameReply if self.no_zeroes => EXPORT_NAME_REPLY_BYTES,
            State::ExportNameReply => EXPORT_NAME_REPLY_BYTES + EXPORT_NAME_PADDING_BYTES,
            State::TlsPending | State::Done => return 0,
        };
        need - self.buf.len()
    }

    /// Called by the driver once the TLS handshake after [`ClientStep::StartTls`] succeeded;
    /// queues `GO`, which now travels encrypted.
    pub fn tls_established(&mut self) -> Result<()> {
        if !matches!(self.state, State::TlsPending) {
            return Err(Error::Bug("tls_established without a pending STARTTLS"));
        }
        self.send_go();
        Ok(())
    }

    /// Consumes bytes the server sent. `data` must not be longer than `bytes_wanted()`.
    /// An `Err` ends the session: the server broke the protocol or refused what we need.
    pub fn feed(&mut self, data: &[u8]) -> Result<ClientStep> {
        if data.len() > self.bytes_wanted() {
            return Err(Error::Bug(
                "nbd client handshake fed more bytes than it asked for",
            ));
        }
        self.buf.extend_from_slice(data);
        if self.bytes_wanted() > 0 {
            return Ok(ClientStep::Continue);
        }
        let buf = std::mem::take(&mut self.buf);
        match self.state {
            State::Greeting => self.greeting(&buf),
            State::ReplyHeader { option } => {
                let magic = u64::from_be_bytes(take8(&buf, 0));
                let echoed = u32::from_be_bytes(take4(&buf, 8));
                let reply_type = u32::from_be_bytes(take4(&buf, 12));
                let len = u32::from_be_bytes(take4(&buf, 16)) as usize;
                if magic != OPTION_REPLY_MAGIC {
                    return Err(violation(format!("bad option reply magic {magic:#x}")));
                }
                if echoed != option {
                    return Err(violation(format!(
                        "reply to option {echoed} while {} was asked",
                        opt_name(option)
                    )));
                }
                if len > OPTION_REPLY_MAX_BYTES {
                    return Err(violation(format!(
                        "option reply of {len} bytes is longer than {OPTION_REPLY_MAX_BYTES}"
                    )));
                }
                self.replies_to_option += 1;
                if self.replies_to_option > REPLIES_PER_OPTION_MAX {
                    return Err(violation(format!(
                        "more than {REPLIES_PER_OPTION_MAX} replies to {}",
                        opt_name(option)
                    )));
                }
                self.state = State::ReplyData {
                    option,
                    reply_type,
                    len,
                };
                if len == 0 {
                    return self.reply(option, reply_type, &[]);
                }
                Ok(ClientStep::Continue)
            }
            State::ReplyData {
                option, reply_type, ..
            } => self.reply(option, reply_type, &buf),
            State::ExportNameReply => {
                let size_bytes = u64::from_be_bytes(take8(&buf, 0));
                let flags = u16::from_be_bytes([buf[8], buf[9]]);
                self.state = State::Done;
                Ok(ClientStep::Ready(ExportGeometry {
                    size_bytes,
                    tx_flags: effective_flags(flags),
                    min_block_bytes: DEFAULT_MIN_BLOCK_BYTES,
                    preferred_block_bytes: DEFAULT_PREFERRED_BLOCK_BYTES,
                    max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
                    block_sizes_advertised: false,
                }))
            }
            State::TlsPending => Err(Error::Bug("nbd client handshake fed during TLS")),
            State::Done => Err(Error::Bug("nbd client handshake fed after it ended")),
        }
    }

    fn greeting(&mut self, buf: &[u8]) -> Result<ClientStep> {
        let magic = u64::from_be_bytes(take8(buf, 0));
        let second = u64::from_be_bytes(take8(buf, 8));
        if magic != NBD_MAGIC {
            return Err(violation(format!(
                "not an NBD server (greeting magic {magic:#x})"
            )));
        }
        if second == OLDSTYLE_MAGIC {
            return Err(violation(
                "the server speaks the old-style handshake, which this client does not",
            ));
        }
        if second != IHAVEOPT {
            return Err(violation(format!("bad greeting magic {second:#x}")));
        }
        let flags = u16::from_be_bytes([buf[16], buf[17]]);
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            // Without fixed newstyle the server cannot answer unknown options (GO, STARTTLS)
            // with an error, so neither TLS nor block sizes could be negotiated.
            return Err(violation(
                "the server does not offer fixed newstyle negotiation",
            ));
        }
        self.no_zeroes = flags & FLAG_NO_ZEROES != 0;
        let mut client_flags = CLIENT_FLAG_FIXED_NEWSTYLE;
        if self.no_zeroes {
            client_flags |= CLIENT_FLAG_NO_ZEROES;
        }
        self.out.extend_from_slice(&client_flags.to_be_bytes());
        if self.tls_wanted {
            self.option(OPT_STARTTLS, &[]);
        } else {
            self.send_go();
        }
        Ok(ClientStep::Continue)
    }

    fn option(&mut self, code: u32, data: &[u8]) {
        self.out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        self.out.extend_from_slice(&code.to_be_bytes());
        // Option data is an export name (bounded in `new`) plus a few bytes.
        self.out
            .extend_from_slice(&(data.len() as u32).to_be_bytes());
        self.out.extend_from_slice(data);
        self.replies_to_option = 0;
        self.state = if code == OPT_EXPORT_NAME {
            State::ExportNameReply
        } else {
            State::ReplyHeader { option: code }
        };
    }

    fn send_go(&mut self) {
        let name = std::mem::take(&mut self.export_name);
        let mut d = Vec::with_capacity(8 + name.len());
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(&name);
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        self.option(OPT_GO, &d);
        self.export_name = name;
    }

    fn refused(&self, option: u32, reply_type: u32, data: &[u8]) -> Error {
        let quoted = &data[..data.len().min(MESSAGE_QUOTE_MAX_BYTES)];
        Error::Refused {
            option: opt_name(option),
            reply: rep_name(reply_type),
            message: String::from_utf8_lossy(quoted).into_owned(),
        }
    }

    fn reply(&mut self, option: u32, reply_type: u32, data: &[u8]) -> Result<ClientStep> {
        self.state = State::ReplyHeader { option };
        match (option, reply_type) {
            (OPT_STARTTLS, REP_ACK) => {
                self.state = State::TlsPending;
                Ok(ClientStep::StartTls)
            }
            // Any refusal of STARTTLS ends the session: TLS was asked for, and continuing in
            // plaintext is exactly the downgrade the spec warns about.
            (OPT_STARTTLS, t) if is_rep_err(t) => Err(self.refused(option, t, data)),
            (OPT_GO, REP_INFO) => {
                self.info(data)?;
                Ok(ClientStep::Continue)
            }
            (OPT_GO, REP_ACK) => {
                let Some((size_bytes, flags)) = self.export else {
                    return Err(violation("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT"));
                };
                self.state = State::Done;
                let (min, preferred, max, advertised) = match self.block_sizes {
                    Some((a, b, c)) => (a, b, c, true),
                    None => (
                        DEFAULT_MIN_BLOCK_BYTES,
                        DEFAULT_PREFERRED_BLOCK_BYTES,
                        DEFAULT_MAX_PAYLOAD_BYTES,
                        false,
                    ),
                };
                Ok(ClientStep::Ready(ExportGeometry {
                    size_bytes,
                    tx_flags: effective_flags(flags),
                    min_block_bytes: min,
                    preferred_block_bytes: preferred,
                    max_payload_bytes: max,
                    block_sizes_advertised: advertised,
                }))
            }
            // The spec's fall-back for servers that predate GO.
            (OPT_GO, REP_ERR_UNSUP) => {
                let name = std::mem::take(&mut self.export_name);
                self.option(OPT_EXPORT_NAME, &name);
                self.export_name = name;
                Ok(ClientStep::Continue)
            }
            (_, t) if is_rep_err(t) => Err(self.refused(option, t, data)),
            (_, t) => Err(violation(format!(
                "unexpected reply {} ({t:#x}) to {}",
                rep_name(t),
                opt_name(option)
            ))),
        }
    }

    fn info(&mut self, data: &[u8]) -> Result<()> {
        if data.len() < 2 {
            return Err(violation("NBD_REP_INFO shorter than its type"));
        }
        let kind = u16::from_be_bytes([data[0], data[1]]);
        let body = &data[2..];
        match kind {
            INFO_EXPORT => {
                if body.len() != 10 {
                    return Err(violation(format!(
                        "NBD_INFO_EXPORT of {} bytes (expected 10)",
                        body.len()
                    )));
                }
                let size = u64::from_be_bytes(take8(body, 0));
                let flags = u16::from_be_bytes([body[8], body[9]]);
                self.export = Some((size, flags));
            }
            INFO_BLOCK_SIZE => {
                if body.len() != 12 {
                    return Err(violation(format!(
                        "NBD_INFO_BLOCK_SIZE of {} bytes (expected 12)",
                        body.len()
                    )));
                }
                let min = u32::from_be_bytes(take4(body, 0));
                let preferred = u32::from_be_bytes(take4(body, 4));
                let max = u32::from_be_bytes(take4(body, 8));
                check_block_sizes(min, preferred, max)?;
                self.block_sizes = Some((min, preferred, max));
            }
            // Names, descriptions and future information are not needed; the spec tells
            // clients to ignore what they do not know.
            _ => {}
        }
        Ok(())
    }
}

/// The spec's rules for advertised block sizes, as far as this client relies on them.
fn check_block_sizes(min: u32, preferred: u32, max: u32) -> Result<()> {
    if !min.is_power_of_two() || min > MIN_BLOCK_BYTES_MAX {
        return Err(violation(format!(
            "minimum block size {min} is not a power of two up to {MIN_BLOCK_BYTES_MAX}"
        )));
    }
    if !preferred.is_power_of_two() || preferred < min {
        return Err(violation(format!(
            "preferred block size {preferred} is not a power of two at least the minimum {min}"
        )));
    }
    if max < min {
        return Err(violation(format!(
            "maximum payload {max} is smaller than the minimum block size {min}"
        )));
    }
    Ok(())
}

/// Transmission flags count only when the server says it sent them (bit 0 must be set).
fn effective_flags(flags: u16) -> u16 {
    if flags & TX_HAS_FLAGS == 0 {
        0
    } else {
        flags
    }
}
