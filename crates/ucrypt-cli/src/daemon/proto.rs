//! The control protocol between the `ucrypt` verbs and an open volume's daemon, sans I/O: this
//! module only turns lines into types and types into lines; `server.rs` moves the bytes.
//!
//! One JSON object per line each way over the daemon's unix socket (`control.sock`, mode
//! 0600), one request per connection:
//!
//! ```text
//! -> {"v":1,"cmd":"status"}
//! <- {"ok":true,"status":{...}}
//! -> {"v":1,"cmd":"close","force":false}
//! <- {"ok":true,"closed":{"note":null}}
//! <- {"ok":false,"code":5,"error":"Cannot close data: /dev/loop3 is mounted on /mnt."}
//! ```
//!
//! `v` is the protocol version: a daemon answers a version it does not speak with an error
//! naming its own, so a newer `ucrypt` talking to an older daemon says so instead of
//! guessing. `code` is the exit code the client exits with (cryptsetup's). The same response
//! shape carries the daemon's readiness report to the `open` that forked it (`ready`).
//!
//! Nothing here carries key material: no request or response has a field for a passphrase or
//! key. (A later `resume` will carry a passphrase; it will be its own request type.)

use serde::{Deserialize, Serialize};
use ucrypt::engine::Policy;

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;

/// Longest request line, bytes, newline included. Requests are a few dozen bytes; anything
/// longer is refused before it is parsed, so a client cannot make the daemon buffer much.
pub const REQUEST_LINE_BYTES_MAX: usize = 1024;

/// Longest response line, bytes. A status report is well under 2 KiB (paths are at most
/// PATH_MAX = 4096 bytes each, and there are three); the client refuses longer lines.
pub const RESPONSE_LINE_BYTES_MAX: usize = 64 << 10;

/// A request to the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The volume's parameters, the front end and counters.
    Status,
    /// Flush, detach the device and exit. Without `force`, refused while the device is in
    /// use (mounted, or held by another device).
    Close { force: bool },
    /// Close now if nothing uses the device, else once its last user goes (cryptsetup's
    /// `close --deferred`).
    CloseDeferred,
    /// Change run-time settings without closing (cryptsetup's `refresh`); answered with the
    /// status after the change.
    Refresh { policy: Policy },
}

/// Why a request line was refused; becomes an error response (exit code 1: bad input).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("control request longer than {REQUEST_LINE_BYTES_MAX} bytes")]
    TooLong,
    #[error("unsupported control protocol version {0}; this daemon speaks version {VERSION}")]
    Version(u64),
    #[error("bad control request: {0}")]
    Bad(String),
}

fn bad(what: impl Into<String>) -> ProtoError {
    ProtoError::Bad(what.into())
}

/// Parses one request line (with or without its newline). Fields a command does not know are
/// refused, not ignored: a request that means more than this daemon understands must fail.
pub fn parse_request(line: &[u8]) -> Result<Request, ProtoError> {
    use serde_json::Value;
    if line.len() > REQUEST_LINE_BYTES_MAX {
        return Err(ProtoError::TooLong);
    }
    let val: Value = serde_json::from_slice(line).map_err(|e| bad(e.to_string()))?;
    let obj = val.as_object().ok_or_else(|| bad("not a JSON object"))?;
    // The version first, so that a newer command is reported as a version mismatch.
    let v = obj
        .get("v")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("no protocol version \"v\""))?;
    if v != u64::from(VERSION) {
        return Err(ProtoError::Version(v));
    }
    let cmd = obj
        .get("cmd")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("no \"cmd\""))?;
    let fields: &[&str] = match cmd {
        "status" => &["v", "cmd"],
        "close" => &["v", "cmd", "force", "deferred"],
        "refresh" => &["v", "cmd", "policy"],
        other => return Err(bad(format!("unknown command {other:?}"))),
    };
    if let Some(k) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(bad(format!("unknown field {k:?} for {cmd}")));
    }
    Ok(match cmd {
        "refresh" => Request::Refresh {
            policy: obj
                .get("policy")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("refresh needs a \"policy\""))?
                .parse()
                .map_err(|e: ucrypt::Error| bad(e.to_string()))?,
        },
        "close" => {
            let flag = |k: &str| match obj.get(k) {
                None => Ok(false),
                Some(f) => f
                    .as_bool()
                    .ok_or_else(|| bad(format!("\"{k}\" must be true or false"))),
            };
            match (flag("force")?, flag("deferred")?) {
                (true, true) => return Err(bad("close is either forced or deferred")),
                (false, true) => Request::CloseDeferred,
                (force, false) => Request::Close { force },
            }
        }
        _ => Request::Status,
    })
}

/// One request line, newline included.
pub fn encode_request(req: &Request) -> Vec<u8> {
    // A struct, so that the version comes first on the wire whatever serde_json's map order.
    #[derive(Serialize)]
    struct Wire {
        v: u32,
        cmd: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        force: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        deferred: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        policy: Option<String>,
    }
    let mut w = Wire {
        v: VERSION,
        cmd: "status",
        force: None,
        deferred: None,
        policy: None,
    };
    match req {
        Request::Status => {}
        Request::Close { force } => (w.cmd, w.force) = ("close", Some(*force)),
        Request::CloseDeferred => (w.cmd, w.deferred) = ("close", Some(true)),
        Request::Refresh { policy } => (w.cmd, w.policy) = ("refresh", Some(policy.to_string())),
    }
    line(&w)
}

/// The volume as cryptsetup's `status` describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeInfo {
    /// LUKS2, LUKS1 or PLAIN.
    #[serde(rename = "type")]
    pub kind: String,
    pub cipher: String,
    pub key_bits: u32,
    /// The volume as given (canonical path).
    pub device: String,
    pub sector_size: u32,
    /// Data offset on the device, 512-byte sectors.
    pub offset_sectors: u64,
    /// Plaintext size, 512-byte sectors.
    pub size_sectors: u64,
    /// IV offset, 512-byte sectors (cryptsetup's "skipped"); 0 is not printed.
    pub skipped_sectors: u64,
    pub read_only: bool,
    /// cryptsetup's flag names: "discards".
    pub flags: Vec<String>,
}

/// Counters from `Volume::stats` (reads; writes with write-zeroes and discards).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub read_requests: u64,
    pub read_bytes: u64,
    pub write_requests: u64,
    pub write_bytes: u64,
}

/// A live daemon's answer to `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    pub volume: VolumeInfo,
    /// "ublk", "fuse+loop" or "fuse".
    pub front_end: String,
    /// What serves the plaintext: /dev/ublkbN, /dev/loopN, or the FUSE file.
    pub device: String,
    /// The stable name: /dev/ucrypt/NAME (root) or $XDG_RUNTIME_DIR/ucrypt/NAME/device.
    pub stable_path: String,
    /// How the front end runs, when worth saying (loop direct I/O refused, FUSE transport).
    pub note: Option<String>,
    pub policy: String,
    /// Why the device cannot be closed without --force right now, if it cannot.
    pub in_use: Option<String>,
    pub counters: Counters,
    pub pid: u32,
    pub started_unix_s: u64,
}

/// The daemon's report to the `open` that forked it: the device is there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    pub front_end: String,
    pub device: String,
    pub stable_path: String,
    pub note: Option<String>,
}

/// The answer to `close`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Closed {
    /// Set when something still held the device after it was detached (only with --force):
    /// the daemon then stopped serving it anyway.
    pub note: Option<String>,
}

/// A response (or a readiness report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Status(Box<StatusReport>),
    Closed(Closed),
    Ready(Ready),
    /// A failure, with the exit code the client should exit with.
    Error {
        code: i32,
        error: String,
    },
}

#[derive(Serialize, Deserialize, Default)]
struct ResponseWire {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<Box<StatusReport>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    closed: Option<Closed>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ready: Option<Ready>,
}

/// One response line, newline included.
pub fn encode_response(r: &Response) -> Vec<u8> {
    let mut w = ResponseWire {
        ok: true,
        ..Default::default()
    };
    match r {
        Response::Status(s) => w.status = Some(s.clone()),
        Response::Closed(c) => w.closed = Some(c.clone()),
        Response::Ready(r) => w.ready = Some(r.clone()),
        Response::Error { code, error } => {
            w.ok = false;
            w.code = Some(*code);
            w.error = Some(error.clone());
        }
    }
    line(&w)
}

/// Parses one response line. A malformed line is a `ProtoError` (the daemon is not one this
/// build understands).
pub fn parse_response(line: &[u8]) -> Result<Response, ProtoError> {
    if line.len() > RESPONSE_LINE_BYTES_MAX {
        return Err(ProtoError::Bad("response line too long".into()));
    }
    let w: ResponseWire =
        serde_json::from_slice(line).map_err(|e| ProtoError::Bad(e.to_string()))?;
    if !w.ok {
        return Ok(Response::Error {
            code: w.code.unwrap_or(1),
            error: w.error.unwrap_or_else(|| "unspecified error".into()),
        });
    }
    match (w.status, w.closed, w.ready) {
        (Some(s), None, None) => Ok(Response::Status(s)),
        (None, Some(c), None) => Ok(Response::Closed(c)),
        (None, None, Some(r)) => Ok(Response::Ready(r)),
        _ => Err(ProtoError::Bad(
            "a successful response carries exactly one of status, closed, ready".into(),
        )),
    }
}

fn line<T: Serialize>(v: &T) -> Vec<u8> {
    // Serialising these plain structs cannot fail (no maps with non-string keys, no custom
    // serialisers); an empty object would be refused by the peer, never misread.
    let mut out = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_table() {
        let rows: &[(&str, Result<Request, ProtoError>)] = &[
            (r#"{"v":1,"cmd":"status"}"#, Ok(Request::Status)),
            (
                r#"{"v":1,"cmd":"close"}"#,
                Ok(Request::Close { force: false }),
            ),
            (
                r#"{"v":1,"cmd":"close","force":true}"#,
                Ok(Request::Close { force: true }),
            ),
            (
                r#"{"v":1,"cmd":"close","deferred":true}"#,
                Ok(Request::CloseDeferred),
            ),
            (
                r#"{"v":1,"cmd":"close","deferred":true,"force":true}"#,
                Err(bad("close is either forced or deferred")),
            ),
            (r#"{"v":2,"cmd":"suspend"}"#, Err(ProtoError::Version(2))),
            (r#"{"v":2,"cmd":"status"}"#, Err(ProtoError::Version(2))),
        ];
        for (line, want) in rows {
            assert_eq!(&parse_request(line.as_bytes()), want, "{line}");
        }
        for bad in [
            "",
            "{}",
            r#"{"cmd":"status"}"#,
            r#"{"v":1}"#,
            r#"{"v":1,"cmd":"resize"}"#,
            r#"{"v":1,"cmd":"status","passphrase":"x"}"#,
            r#"{"v":"1","cmd":"status"}"#,
            "not json",
        ] {
            assert!(
                matches!(parse_request(bad.as_bytes()), Err(ProtoError::Bad(_))),
                "accepted {bad:?}"
            );
        }
        let long = format!(
            r#"{{"v":1,"cmd":"status","pad":"{}"}}"#,
            "x".repeat(REQUEST_LINE_BYTES_MAX)
        );
        assert_eq!(parse_request(long.as_bytes()), Err(ProtoError::TooLong));
    }

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Status,
            Request::Close { force: false },
            Request::Close { force: true },
            Request::CloseDeferred,
        ] {
            let l = encode_request(&r);
            assert_eq!(l.last(), Some(&b'\n'));
            assert_eq!(l.iter().filter(|&&b| b == b'\n').count(), 1);
            assert_eq!(parse_request(&l).unwrap(), r);
        }
        assert_eq!(
            encode_request(&Request::Status),
            b"{\"v\":1,\"cmd\":\"status\"}\n"
        );
    }

    fn sample_status() -> StatusReport {
        StatusReport {
            volume: VolumeInfo {
                kind: "LUKS2".into(),
                cipher: "aes-xts-plain64".into(),
                key_bits: 512,
                device: "/srv/vol\nimg".into(),
                sector_size: 4096,
                offset_sectors: 32768,
                size_sectors: 1000,
                skipped_sectors: 0,
                read_only: false,
                flags: vec!["discards".into()],
            },
            front_end: "fuse+loop".into(),
            device: "/dev/loop3".into(),
            stable_path: "/dev/ucrypt/data".into(),
            note: None,
            policy: "auto".into(),
            in_use: Some("mounted on /mnt".into()),
            counters: Counters {
                read_requests: 1,
                read_bytes: 2,
                write_requests: 3,
                write_bytes: 4,
            },
            pid: 42,
            started_unix_s: 1_700_000_000,
        }
    }

    #[test]
    fn responses_round_trip_on_one_line() {
        for r in [
            Response::Status(Box::new(sample_status())),
            Response::Closed(Closed { note: None }),
            Response::Ready(Ready {
                front_end: "ublk".into(),
                device: "/dev/ublkb0".into(),
                stable_path: "/dev/ucrypt/x".into(),
                note: Some("n".into()),
            }),
            Response::Error {
                code: 5,
                error: "Device data already exists.".into(),
            },
        ] {
            let l = encode_response(&r);
            // A newline inside a path is escaped: one response, one line.
            assert_eq!(l.iter().filter(|&&b| b == b'\n').count(), 1);
            assert_eq!(parse_response(&l).unwrap(), r);
        }
        assert_eq!(
            encode_response(&Response::Error {
                code: 4,
                error: "e".into()
            }),
            b"{\"ok\":false,\"code\":4,\"error\":\"e\"}\n"
        );
    }

    #[test]
    fn malformed_responses_are_refused() {
        for bad in [
            r#"{"ok":true}"#,
            r#"{"ok":true,"closed":{"note":null},"ready":{"front_end":"a","device":"b","stable_path":"c","note":null}}"#,
            "[]",
            "",
        ] {
            assert!(parse_response(bad.as_bytes()).is_err(), "accepted {bad:?}");
        }
        // An error without a code is still an error (exit 1).
        assert_eq!(
            parse_response(br#"{"ok":false}"#).unwrap(),
            Response::Error {
                code: 1,
                error: "unspecified error".into()
            }
        );
    }
}
