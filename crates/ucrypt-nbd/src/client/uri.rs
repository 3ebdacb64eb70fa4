//! NBD URIs as the NBD URI standard spells them (`doc/uri.md` of the NBD project):
//!
//! - `nbd://HOST[:PORT]/EXPORT` and `nbds://…` (TLS required) over TCP, port 10809 by default;
//! - `nbd+unix:///EXPORT?socket=PATH` and `nbds+unix://…` over a unix socket (a socket name
//!   starting with `%00` is in Linux's abstract namespace).
//!
//! The export name is the path without its leading `/`, percent-decoded (`nbd://h//x` names
//! `/x`, `nbd://h` the empty default export). Query parameters understood: `socket`,
//! `tls-type=x509`, `tls-hostname`, `tls-verify-peer=1`. Anything else is refused with a
//! message rather than ignored, as the standard asks: user names (TLS PSK) and `tls-type`
//! `anon`/`psk` need TLS modes rustls lacks, and `tls-verify-peer=0` would switch off the check
//! that makes `nbds` worth using.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::proto::EXPORT_NAME_MAX_BYTES;
use crate::{Error, Result};

/// The NBD port number assigned by IANA.
pub const NBD_DEFAULT_PORT: u16 = 10809;
/// Longest URI accepted: an export name and a socket path at their limits fit, with escapes.
pub const URI_MAX_BYTES: usize = 4 * EXPORT_NAME_MAX_BYTES;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    Tcp {
        host: String,
        port: u16,
    },
    Unix(PathBuf),
    /// A Linux abstract-namespace socket: the name without its leading NUL.
    UnixAbstract(Vec<u8>),
}

/// A parsed NBD URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    pub transport: Transport,
    /// `nbds` schemes: TLS is required and the connection fails without it.
    pub tls: bool,
    pub export: String,
    /// The name the server's certificate is checked against (`tls-hostname`; by default the
    /// URI's host, or `localhost` over a unix socket).
    pub tls_hostname: Option<String>,
    /// The URI as given, for messages.
    text: String,
}

fn bad(uri: &str, why: impl fmt::Display) -> Error {
    Error::Config(format!("NBD URI '{uri}': {why}"))
}

/// RFC 3986 percent-decoding (`+` stays a `+`: it means a space only in HTML forms).
fn percent_decode(uri: &str, s: &str) -> Result<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad(uri, format!("bad percent escape at byte {i}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn decode_utf8(uri: &str, what: &str, s: &str) -> Result<String> {
    let v = percent_decode(uri, s)?;
    if v.contains(&0) {
        return Err(bad(uri, format!("{what} contains a NUL byte")));
    }
    String::from_utf8(v).map_err(|_| bad(uri, format!("{what} is not UTF-8")))
}

impl NbdUri {
    pub fn parse(s: &str) -> Result<Self> {
        if s.len() > URI_MAX_BYTES {
            return Err(Error::Config(format!(
                "NBD URI of {} bytes is longer than {URI_MAX_BYTES}",
                s.len()
            )));
        }
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| bad(s, "expected nbd://, nbds://, nbd+unix:// or nbds+unix://"))?;
        let (tls, unix) = match scheme.to_ascii_lowercase().as_str() {
            "nbd" => (false, false),
            "nbds" => (true, false),
            "nbd+unix" => (false, true),
            "nbds+unix" => (true, true),
            // nbd+vsock exists in the standard's family but vsock is a VM transport this
            // client does not speak.
            other => return Err(bad(s, format!("unsupported scheme '{other}'"))),
        };
        if rest.contains('#') {
            return Err(bad(s, "a fragment (#…) has no meaning in an NBD URI"));
        }
        let (before_query, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match before_query.find('/') {
            Some(i) => (&before_query[..i], &before_query[i..]),
            None => (before_query, ""),
        };
        let export = decode_utf8(s, "export name", path.strip_prefix('/').unwrap_or(path))?;
        if export.len() > EXPORT_NAME_MAX_BYTES {
            return Err(bad(s, "export name longer than NBD allows"));
        }

        let mut socket: Option<Vec<u8>> = None;
        let mut tls_hostname = None;
        let mut seen: Vec<String> = Vec::new();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let key = decode_utf8(s, "query parameter name", k)?;
            if seen.contains(&key) {
                return Err(bad(s, format!("query parameter '{key}' given twice")));
            }
            seen.push(key.clone());
            match key.as_str() {
                "socket" => socket = Some(percent_decode(s, v)?),
                "tls-type" => {
                    let t = decode_utf8(s, "tls-type", v)?;
                    if t != "x509" {
                        return Err(bad(
                            s,
                            format!("tls-type '{t}' is not supported (only x509)"),
                        ));
                    }
                }
                "tls-hostname" => tls_hostname = Some(decode_utf8(s, "tls-hostname", v)?),
                "tls-verify-peer" => match v {
                    "1" => {}
                    "0" => {
                        return Err(bad(
                            s,
                            "tls-verify-peer=0 is not supported: the server's certificate is \
                             always verified (give its CA with the TLS CA option)",
                        ))
                    }
                    _ => return Err(bad(s, format!("tls-verify-peer must be 0 or 1, not '{v}'"))),
                },
                other => {
                    return Err(bad(s, format!("unknown query parameter '{other}'")));
                }
            }
        }
        if (tls_hostname.is_some() || seen.iter().any(|k| k == "tls-type")) && !tls {
            return Err(bad(s, "TLS parameters need an nbds scheme"));
        }

        let transport = if unix {
            if !authority.is_empty() {
                return Err(bad(
                    s,
                    "a unix-socket URI has no host (write nbd+unix:///EXPORT?socket=PATH)",
                ));
            }
            let sock = socket.ok_or_else(|| bad(s, "the socket=PATH parameter is required"))?;
            match sock.split_first() {
                None => return Err(bad(s, "empty socket path")),
                Some((0, name)) => Transport::UnixAbstract(name.to_vec()),
                Some(_) => {
                    use std::os::unix::ffi::OsStringExt;
                    Transport::Unix(PathBuf::from(std::ffi::OsString::from_vec(sock)))
                }
            }
        } else {
            if socket.is_some() {
                return Err(bad(
                    s,
                    "socket= is only for the nbd+unix and nbds+unix schemes",
                ));
            }
            let (host, port) = parse_authority(s, authority)?;
            Transport::Tcp { host, port }
        };
        Ok(NbdUri {
            transport,
            tls,
            export,
            tls_hostname,
            text: s.to_string(),
        })
    }

    /// The name the server certificate must carry.
    pub fn server_name(&self) -> &str {
        if let Some(h) = &self.tls_hostname {
            return h;
        }
        match &self.transport {
            Transport::Tcp { host, .. } => host,
            Transport::Unix(_) | Transport::UnixAbstract(_) => "localhost",
        }
    }
}

/// `[userinfo@]host[:port]`, host a name, an IPv4 address or `[IPv6]`.
fn parse_authority(uri: &str, a: &str) -> Result<(String, u16)> {
    if a.contains('@') {
        return Err(bad(
            uri,
            "a user name (for TLS PSK) is not supported: rustls has no PSK mode",
        ));
    }
    let (host, port) = if let Some(rest) = a.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| bad(uri, "unterminated [IPv6] address"))?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| bad(uri, "junk after ]"))?,
            ),
        };
        (h.to_string(), port)
    } else {
        match a.rsplit_once(':') {
            Some((h, p)) => (decode_utf8(uri, "host", h)?, Some(p)),
            None => (decode_utf8(uri, "host", a)?, None),
        }
    };
    if host.is_empty() {
        return Err(bad(
            uri,
            "a TCP URI needs a host (nbd://HOST[:PORT]/EXPORT)",
        ));
    }
    let port = match port {
        None | Some("") => NBD_DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| bad(uri, format!("bad port '{p}'")))?,
    };
    Ok((host, port))
}

impl FromStr for NbdUri {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        NbdUri::parse(s)
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
