//! Server side of the fixed newstyle handshake as a sans-I/O state machine.
//!
//! Driver loop: send [`Handshake::take_output`], read exactly [`Handshake::bytes_wanted`]
//! bytes, pass them to [`Handshake::feed`], act on the returned [`Step`]. Reading exactly what
//! is wanted matters: after `STARTTLS` the next bytes are TLS records, after `GO` they are
//! transmission requests, and neither may be swallowed by the handshake.

use super::*;
use crate::{Error, Result};

/// What the server tells clients about one export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    /// Shown by `nbdinfo`; empty means none.
    pub description: String,
    pub size_bytes: u64,
    pub tx_flags: u16,
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_payload_bytes: u32,
}

/// The TLS modes of the spec this server implements: NOTLS, or FORCEDTLS (every option other
/// than `STARTTLS` and `ABORT` refused until TLS is up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsPolicy {
    Disabled,
    Required,
}

/// The outcome of a successful negotiation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Index into the export list given to [`Handshake::new`].
    pub export: usize,
    pub tx_flags: u16,
}

/// What the driver must do after a [`Handshake::feed`] (always after sending the output).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read [`Handshake::bytes_wanted`] more bytes.
    Continue,
    /// Send the output (the `ACK`), then run a TLS server handshake on the connection and call
    /// [`Handshake::tls_established`]; all further bytes go through TLS.
    StartTls,
    /// Send the output, then enter the transmission phase.
    Transmission(Negotiated),
    /// The client asked to end the session (`NBD_OPT_ABORT`); send the output and close.
    Abort,
}

#[derive(Debug)]
enum State {
    ClientFlags,
    OptionHeader,
    OptionData { code: u32, len: usize },
    Done,
}

const CLIENT_FLAGS_BYTES: usize = 4;
const OPTION_HEADER_BYTES: usize = 16;
/// Greeting: NBDMAGIC, IHAVEOPT, 16-bit handshake flags.
pub const GREETING_BYTES: usize = 18;
/// Zero padding after an `EXPORT_NAME` reply unless the client asked for none.
const EXPORT_NAME_PADDING_BYTES: usize = 124;

pub struct Handshake {
    exports: Vec<ExportInfo>,
    tls: TlsPolicy,
    tls_active: bool,
    no_zeroes: bool,
    shutting_down: bool,
    options_seen: u32,
    state: State,
    buf: Vec<u8>,
    out: Vec<u8>,
}

fn violation(msg: impl Into<String>) -> Error {
    Error::Protocol(msg.into())
}

impl Handshake {
    /// Starts a handshake; the greeting is the first output.
    pub fn new(exports: Vec<ExportInfo>, tls: TlsPolicy) -> Self {
        let mut out = Vec::with_capacity(GREETING_BYTES);
        out.extend_from_slice(&NBD_MAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        Handshake {
            exports,
            tls,
            tls_active: false,
            no_zeroes: false,
            shutting_down: false,
            options_seen: 0,
            state: State::ClientFlags,
            buf: Vec::new(),
            out,
        }
    }

    /// Bytes to send to the client now.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// How many bytes to read before the next [`Handshake::feed`] can make progress; 0 once the
    /// handshake is over.
    pub fn bytes_wanted(&self) -> usize {
        let need = match self.state {
            State::ClientFlags => CLIENT_FLAGS_BYTES,
            State::OptionHeader => OPTION_HEADER_BYTES,
            State::OptionData { len, .. } => len,
            State::Done => return 0,
        };
        need - self.buf.len()
    }

    /// From now on, options other than `ABORT` are refused with `NBD_REP_ERR_SHUTDOWN`.
    pub fn set_shutting_down(&mut self) {
        self.shutting_down = true;
    }

    /// Called by the driver once the TLS handshake after a [`Step::StartTls`] succeeded. Per the
    /// spec no negotiation state survives the upgrade (we keep none besides the flags).
    pub fn tls_established(&mut self) {
        self.tls_active = true;
    }

    /// Consumes bytes the client sent. `data` must not be longer than `bytes_wanted()`.
    /// An `Err` means: hard disconnect (a protocol violation a reply cannot express).
    pub fn feed(&mut self, data: &[u8]) -> Result<Step> {
        if data.len() > self.bytes_wanted() {
            return Err(Error::Bug("nbd handshake fed more bytes than it asked for"));
        }
        self.buf.extend_from_slice(data);
        if self.bytes_wanted() > 0 {
            return Ok(Step::Continue);
        }
        let buf = std::mem::take(&mut self.buf);
        match self.state {
            State::ClientFlags => {
                let flags = u32::from_be_bytes(take4(&buf, 0));
                let known = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
                if flags & !known != 0 {
                    return Err(violation(format!("unknown client flags {flags:#x}")));
                }
                if flags & CLIENT_FLAG_FIXED_NEWSTYLE == 0 && self.tls == TlsPolicy::Required {
                    // TLS needs fixed newstyle; such a client could only reach an export by
                    // EXPORT_NAME without TLS, which policy forbids.
                    return Err(violation("client without fixed newstyle cannot use TLS"));
                }
                self.no_zeroes = flags & CLIENT_FLAG_NO_ZEROES != 0;
                self.state = State::OptionHeader;
                Ok(Step::Continue)
            }
            State::OptionHeader => {
                let magic = u64::from_be_bytes(take8(&buf, 0));
                let code = u32::from_be_bytes(take4(&buf, 8));
                let len = u32::from_be_bytes(take4(&buf, 12)) as usize;
                if magic != IHAVEOPT {
                    return Err(violation(format!("bad option magic {magic:#x}")));
                }
                self.options_seen += 1;
                if self.options_seen > OPTIONS_PER_CONNECTION_MAX {
                    return Err(violation("too many options before choosing an export"));
                }
                if len > OPTION_DATA_MAX_BYTES {
                    return Err(violation(format!(
                        "option {code} data of {len} bytes too long"
                    )));
                }
                self.state = State::OptionData { code, len };
                if len == 0 {
                    return self.option(code, &[]);
                }
                Ok(Step::Continue)
            }
            State::OptionData { code, .. } => self.option(code, &buf),
            State::Done => Err(Error::Bug("nbd handshake fed after it ended")),
        }
    }

    fn reply(&mut self, option: u32, reply_type: u32, data: &[u8]) {
        self.out
            .extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        self.out.extend_from_slice(&option.to_be_bytes());
        self.out.extend_from_slice(&reply_type.to_be_bytes());
        // Replies are built from bounded export data; a length that does not fit is our bug.
        let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        self.out.extend_from_slice(&len.to_be_bytes());
        self.out.extend_from_slice(data);
    }

    fn error(&mut self, option: u32, reply_type: u32, message: &str) -> Result<Step> {
        self.reply(option, reply_type, message.as_bytes());
        self.state = State::OptionHeader;
        Ok(Step::Continue)
    }

    fn find_export(&self, name: &[u8]) -> Option<usize> {
        if name.is_empty() {
            // The empty name is the default export: the first one.
            return if self.exports.is_empty() {
                None
            } else {
                Some(0)
            };
        }
        self.exports.iter().position(|e| e.name.as_bytes() == name)
    }

    fn option(&mut self, code: u32, data: &[u8]) -> Result<Step> {
        self.state = State::OptionHeader;
        if code == OPT_ABORT {
            self.reply(code, REP_ACK, &[]);
            self.state = State::Done;
            return Ok(Step::Abort);
        }
        if self.shutting_down {
            if code == OPT_EXPORT_NAME {
                return Err(violation("server is shutting down"));
            }
            return self.error(code, REP_ERR_SHUTDOWN, "server is shutting down");
        }
        if self.tls == TlsPolicy::Required && !self.tls_active {
            return match code {
                OPT_STARTTLS if data.is_empty() => {
                    self.reply(code, REP_ACK, &[]);
                    Ok(Step::StartTls)
                }
                OPT_STARTTLS => self.error(code, REP_ERR_INVALID, "STARTTLS takes no data"),
                OPT_EXPORT_NAME => Err(violation("EXPORT_NAME before TLS on a TLS-only server")),
                _ => self.error(code, REP_ERR_TLS_REQD, "this server requires TLS"),
            };
        }
        match code {
            OPT_STARTTLS => {
                if self.tls_active {
                    self.error(code, REP_ERR_INVALID, "TLS is already active")
                } else {
                    self.error(code, REP_ERR_POLICY, "TLS is not configured on this server")
                }
            }
            OPT_LIST => {
                if !data.is_empty() {
                    return self.error(code, REP_ERR_INVALID, "LIST takes no data");
                }
                let names: Vec<Vec<u8>> = self
                    .exports
                    .iter()
                    .map(|e| e.name.as_bytes().to_vec())
                    .collect();
                for name in names {
                    let mut d = Vec::with_capacity(4 + name.len());
                    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    d.extend_from_slice(&name);
                    self.reply(code, REP_SERVER, &d);
                }
                self.reply(code, REP_ACK, &[]);
                Ok(Step::Continue)
            }
            OPT_INFO | OPT_GO => {
                let (name, info_requests) = match parse_info_request(data) {
                    Ok(v) => v,
                    Err(msg) => return self.error(code, REP_ERR_INVALID, msg),
                };
                let Some(index) = self.find_export(name) else {
                    return self.error(code, REP_ERR_UNKNOWN, "no such export");
                };
                let e = self.exports[index].clone();
                let mut d = Vec::with_capacity(14);
                d.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                d.extend_from_slice(&e.size_bytes.to_be_bytes());
                d.extend_from_slice(&e.tx_flags.to_be_bytes());
                self.reply(code, REP_INFO, &d);
                // Block sizes are always sent: clients that did not ask ignore them, and the
                // spec lets a server send information that was not requested.
                let mut d = Vec::with_capacity(14);
                d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                d.extend_from_slice(&e.min_block_bytes.to_be_bytes());
                d.extend_from_slice(&e.preferred_block_bytes.to_be_bytes());
                d.extend_from_slice(&e.max_payload_bytes.to_be_bytes());
                self.reply(code, REP_INFO, &d);
                if info_requests.contains(&INFO_NAME) {
                    let mut d = INFO_NAME.to_be_bytes().to_vec();
                    d.extend_from_slice(e.name.as_bytes());
                    self.reply(code, REP_INFO, &d);
                }
                if info_requests.contains(&INFO_DESCRIPTION) && !e.description.is_empty() {
                    let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
                    d.extend_from_slice(e.description.as_bytes());
                    self.reply(code, REP_INFO, &d);
                }
                self.reply(code, REP_ACK, &[]);
                if code == OPT_GO {
                    self.state = State::Done;
                    return Ok(Step::Transmission(Negotiated {
                        export: index,
                        tx_flags: e.tx_flags,
                    }));
                }
                Ok(Step::Continue)
            }
            OPT_EXPORT_NAME => {
                if data.len() > EXPORT_NAME_MAX_BYTES {
                    return Err(violation("export name too long"));
                }
                let Some(index) = self.find_export(data) else {
                    // EXPORT_NAME cannot be answered with an error: the spec says disconnect.
                    return Err(violation(format!(
                        "unknown export '{}'",
                        String::from_utf8_lossy(data)
                    )));
                };
                let e = &self.exports[index];
                let tx_flags = e.tx_flags;
                self.out.extend_from_slice(&e.size_bytes.to_be_bytes());
                self.out.extend_from_slice(&tx_flags.to_be_bytes());
                if !self.no_zeroes {
                    self.out
                        .extend_from_slice(&[0u8; EXPORT_NAME_PADDING_BYTES]);
                }
                self.state = State::Done;
                Ok(Step::Transmission(Negotiated {
                    export: index,
                    tx_flags,
                }))
            }
            // Structured replies are not implemented: simple replies carry everything this
            // server sends (reads fail before their header is sent, so no mid-payload errors).
            OPT_STRUCTURED_REPLY => {
                self.error(code, REP_ERR_UNSUP, "structured replies not supported")
            }
            _ => self.error(code, REP_ERR_UNSUP, "unsupported option"),
        }
    }
}

/// Parses the data of `INFO`/`GO`: u32 name length, name, u16 count, count × u16 requests.
fn parse_info_request(data: &[u8]) -> std::result::Result<(&[u8], Vec<u16>), &'static str> {
    if data.len() < 6 {
        return Err("option data shorter than 6 bytes");
    }
    let name_len = u32::from_be_bytes(take4(data, 0)) as usize;
    if name_len > EXPORT_NAME_MAX_BYTES {
        return Err("export name too long");
    }
    if name_len > data.len() - 6 {
        return Err("export name length exceeds option data");
    }
    let name = &data[4..4 + name_len];
    let rest = &data[4 + name_len..];
    let count = u16::from_be_bytes([rest[0], rest[1]]) as usize;
    let list = &rest[2..];
    if list.len() != count * 2 {
        return Err("information request count does not match option length");
    }
    let requests = list
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Ok((name, requests))
}

pub(super) fn take4(b: &[u8], at: usize) -> [u8; 4] {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    a
}

pub(super) fn take8(b: &[u8], at: usize) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    a
}
