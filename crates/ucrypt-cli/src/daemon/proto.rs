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
//! Key material: only `resume` carries any, the passphrase (or key file contents) the user
//! gave, hex-encoded, to the daemon that re-derives the volume key from it (the volume key
//! itself never crosses the socket). A volume key file (`--volume-key-file`) is sent as its
//! path, for the daemon to read. The daemon reads request lines into wiped memory.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use ucrypt::engine::Policies;
use ucrypt::luks::reencrypt;
use ucrypt::luks::reencrypt::run::ResilienceAsked;
use ucrypt::luks::HashAlg;
use ucrypt::SecretBytes;

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;

/// Longest request line, bytes, newline included. Requests are a few dozen bytes; anything
/// longer is refused before it is parsed, so a client cannot make the daemon buffer much.
pub const REQUEST_LINE_BYTES_MAX: usize = 1024;

/// Longest passphrase or key file `resume` sends (cryptsetup takes key files of up to 8 MiB;
/// a resume through the control socket takes this much).
pub const RESUME_KEY_BYTES_MAX: usize = 64 << 10;

/// How a `resume` line starts (what `encode_request` writes): the only request that may be
/// longer than [`REQUEST_LINE_BYTES_MAX`].
const RESUME_PREFIX: &[u8] = b"{\"v\":1,\"cmd\":\"resume\"";

/// How a `reencrypt` line starts: it carries the passphrase too, so may be as long.
const REENCRYPT_PREFIX: &[u8] = b"{\"v\":1,\"cmd\":\"reencrypt\"";

/// Longest `resume` (or `reencrypt`) line: the key hex-encoded, and the rest.
pub const RESUME_LINE_BYTES_MAX: usize = 2 * RESUME_KEY_BYTES_MAX + REQUEST_LINE_BYTES_MAX;

/// Longest response line, bytes. A status report is well under 2 KiB (paths are at most
/// PATH_MAX = 4096 bytes each, and there are three); the client refuses longer lines.
pub const RESPONSE_LINE_BYTES_MAX: usize = 64 << 10;

/// A request to the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The volume's parameters, the front end and counters.
    Status,
    /// The status without its `in_use` (left `None`): that check reads every process's
    /// descriptors, which `list` cannot afford once per volume on a host with a thousand.
    Brief,
    /// Flush, detach the device and exit. Without `force`, refused while the device is in
    /// use (mounted, or held by another device).
    Close { force: bool },
    /// Close now if nothing uses the device, else once its last user goes (cryptsetup's
    /// `close --deferred`).
    CloseDeferred,
    /// Cancel a pending deferred close (cryptsetup's `close --cancel-deferred`).
    CancelDeferred,
    /// Change run-time settings without closing (cryptsetup's `refresh`); answered with the
    /// status after the change. A setting not given is kept.
    Refresh(RefreshSettings),
    /// Flush, hold new requests, wipe the key (cryptsetup's `luksSuspend`).
    Suspend,
    /// Re-derive the key and release the held requests (cryptsetup's `luksResume`).
    Resume {
        key: ResumeKey,
        key_slot: Option<u32>,
    },
    /// Set the plaintext size (512-byte sectors), or with None fit it to the backing file or
    /// device as it is now (cryptsetup's `resize`).
    Resize { size_sectors: Option<u64> },
    /// Rotate the volume key while serving (the header is already in reencryption: the verb
    /// started it); answered at once with the status, whose `reencryption` then reports the
    /// progress. Only a passphrase unlocks both keys.
    Reencrypt {
        key: ResumeKey,
        hotzone_bytes: Option<u64>,
        /// A resilience to switch to before the next hotzone (`--resilience` on resume).
        resilience: Option<ResilienceAsked>,
    },
}

/// What `refresh` changes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RefreshSettings {
    pub policy: Option<Policies>,
    pub allow_discards: Option<bool>,
    pub spin_us: Option<u64>,
}

/// What `resume` unlocks with.
#[derive(Debug)]
pub enum ResumeKey {
    /// A passphrase or key file's contents (at most [`RESUME_KEY_BYTES_MAX`] bytes).
    Passphrase(SecretBytes),
    /// A file holding the volume key, read by the daemon.
    VolumeKeyFile(PathBuf),
}

impl Clone for ResumeKey {
    fn clone(&self) -> Self {
        match self {
            ResumeKey::Passphrase(p) => ResumeKey::Passphrase(SecretBytes::from_slice(p.as_ref())),
            ResumeKey::VolumeKeyFile(f) => ResumeKey::VolumeKeyFile(f.clone()),
        }
    }
}

impl PartialEq for ResumeKey {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ResumeKey::Passphrase(a), ResumeKey::Passphrase(b)) => a.ct_eq(b.as_ref()),
            (ResumeKey::VolumeKeyFile(a), ResumeKey::VolumeKeyFile(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for ResumeKey {}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Hex of a secret, into a secret.
fn hex_secret(b: &[u8]) -> SecretBytes {
    let mut out = SecretBytes::zeroed(b.len() * 2);
    for (o, x) in out.as_mut().chunks_exact_mut(2).zip(b) {
        o[0] = HEX[usize::from(x >> 4)];
        o[1] = HEX[usize::from(x & 15)];
    }
    out
}

/// A secret from its hex form.
fn unhex_secret(h: &[u8]) -> Result<SecretBytes, ProtoError> {
    if h.len() % 2 != 0 || h.len() / 2 > RESUME_KEY_BYTES_MAX {
        return Err(bad("\"passphrase_hex\" has a bad length"));
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(bad("\"passphrase_hex\" is not lower-case hex")),
    };
    let mut out = SecretBytes::zeroed(h.len() / 2);
    for (o, pair) in out.as_mut().iter_mut().zip(h.chunks_exact(2)) {
        *o = nib(pair[0])? << 4 | nib(pair[1])?;
    }
    Ok(out)
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

type Object = serde_json::Map<String, serde_json::Value>;

/// Parses one request line (with or without its newline). Fields a command does not know are
/// refused, not ignored: a request that means more than this daemon understands must fail.
pub fn parse_request(line: &[u8]) -> Result<Request, ProtoError> {
    use serde_json::Value;
    // Only a resume line may be longer than REQUEST_LINE_BYTES_MAX, and it says so first.
    if line.len() > RESUME_LINE_BYTES_MAX
        || (line.len() > REQUEST_LINE_BYTES_MAX
            && !line.starts_with(RESUME_PREFIX)
            && !line.starts_with(REENCRYPT_PREFIX))
    {
        return Err(ProtoError::TooLong);
    }
    let mut val: Value = serde_json::from_slice(line).map_err(|e| bad(e.to_string()))?;
    let pass_hex = take_passphrase(&mut val)?;
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
        "status" | "brief" | "suspend" => &["v", "cmd"],
        "close" => &["v", "cmd", "force", "deferred", "cancel_deferred"],
        "refresh" => &["v", "cmd", "policy", "allow_discards", "spin_us"],
        "resume" => &["v", "cmd", "volume_key_file", "key_slot"],
        "resize" => &["v", "cmd", "size_sectors"],
        "reencrypt" => &["v", "cmd", "hotzone_bytes", "resilience", "resilience_hash"],
        other => return Err(bad(format!("unknown command {other:?}"))),
    };
    if let Some(k) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(bad(format!("unknown field {k:?} for {cmd}")));
    }
    let with_pass = cmd == "resume" || cmd == "reencrypt";
    if pass_hex.is_some() && !with_pass {
        return Err(bad(format!("unknown field \"passphrase_hex\" for {cmd}")));
    }
    if line.len() > REQUEST_LINE_BYTES_MAX && !with_pass {
        return Err(ProtoError::TooLong);
    }
    Ok(match cmd {
        "suspend" => Request::Suspend,
        "brief" => Request::Brief,
        "reencrypt" => reencrypt_request(obj, pass_hex)?,
        "resize" => Request::Resize {
            size_sectors: num_field(obj, "size_sectors")?,
        },
        "resume" => resume_request(obj, pass_hex)?,
        "refresh" => refresh_request(obj)?,
        "close" => close_request(obj)?,
        _ => Request::Status,
    })
}

/// Takes `passphrase_hex` out of the request first, into wiped memory, and wipes its string:
/// whatever else the line holds, it leaves no copy behind.
fn take_passphrase(val: &mut serde_json::Value) -> Result<Option<SecretBytes>, ProtoError> {
    use serde_json::Value;
    match val.as_object_mut().and_then(|o| o.remove("passphrase_hex")) {
        Some(Value::String(h)) => {
            let mut h = h.into_bytes();
            let r = unhex_secret(&h);
            h.iter_mut().for_each(wipe_byte);
            Ok(Some(r?))
        }
        Some(_) => Err(bad("\"passphrase_hex\" must be a string")),
        None => Ok(None),
    }
}

/// An optional field, read by `get`; `kind` says what it must be when `get` finds otherwise.
fn field<'a, T>(
    obj: &'a Object,
    k: &str,
    get: fn(&'a serde_json::Value) -> Option<T>,
    kind: &str,
) -> Result<Option<T>, ProtoError> {
    obj.get(k)
        .map(|v| get(v).ok_or_else(|| bad(format!("\"{k}\" must be {kind}"))))
        .transpose()
}

fn num_field(obj: &Object, k: &str) -> Result<Option<u64>, ProtoError> {
    field(obj, k, serde_json::Value::as_u64, "a number")
}

fn text_field<'a>(obj: &'a Object, k: &str) -> Result<Option<&'a str>, ProtoError> {
    field(obj, k, serde_json::Value::as_str, "a string")
}

fn bool_field(obj: &Object, k: &str) -> Result<Option<bool>, ProtoError> {
    field(obj, k, serde_json::Value::as_bool, "true or false")
}

fn reencrypt_request(obj: &Object, pass_hex: Option<SecretBytes>) -> Result<Request, ProtoError> {
    let hash = text_field(obj, "resilience_hash")?
        .map(HashAlg::from_name)
        .transpose()
        .map_err(|e| bad(format!("\"resilience_hash\": {e}")))?
        .unwrap_or(reencrypt::run::CHECKSUM_HASH);
    let resilience = text_field(obj, "resilience")?
        .map(|n| ResilienceAsked::from_name(n, hash))
        .transpose()
        .map_err(|e| bad(format!("\"resilience\": {e}")))?;
    Ok(Request::Reencrypt {
        key: ResumeKey::Passphrase(
            pass_hex.ok_or_else(|| bad("reencrypt needs \"passphrase_hex\""))?,
        ),
        hotzone_bytes: num_field(obj, "hotzone_bytes")?,
        resilience,
    })
}

fn resume_request(obj: &Object, pass_hex: Option<SecretBytes>) -> Result<Request, ProtoError> {
    let key_slot = num_field(obj, "key_slot")?
        .map(|n| u32::try_from(n).map_err(|_| bad("\"key_slot\" out of range")))
        .transpose()?;
    let file = obj.get("volume_key_file").map(|f| {
        f.as_str()
            .map(PathBuf::from)
            .ok_or_else(|| bad("\"volume_key_file\" must be a string"))
    });
    let key = match (pass_hex, file) {
        (Some(p), None) => ResumeKey::Passphrase(p),
        (None, Some(f)) => ResumeKey::VolumeKeyFile(f?),
        _ => {
            return Err(bad(
                "resume needs exactly one of \"passphrase_hex\", \"volume_key_file\"",
            ))
        }
    };
    Ok(Request::Resume { key, key_slot })
}

fn refresh_request(obj: &Object) -> Result<Request, ProtoError> {
    let policy = text_field(obj, "policy")?
        .map(|p| p.parse().map_err(|e: ucrypt::Error| bad(e.to_string())))
        .transpose()?;
    let allow_discards = bool_field(obj, "allow_discards")?;
    let r = RefreshSettings {
        policy,
        allow_discards,
        spin_us: num_field(obj, "spin_us")?,
    };
    if r == RefreshSettings::default() {
        return Err(bad("refresh needs a setting to change"));
    }
    Ok(Request::Refresh(r))
}

fn close_request(obj: &Object) -> Result<Request, ProtoError> {
    let flag = |k: &str| bool_field(obj, k).map(|f| f.unwrap_or(false));
    match (flag("force")?, flag("deferred")?, flag("cancel_deferred")?) {
        (_, _, true) if obj.len() > 3 => Err(bad("cancel_deferred goes alone")),
        (_, _, true) => Ok(Request::CancelDeferred),
        (true, true, _) => Err(bad("close is either forced or deferred")),
        (false, true, _) => Ok(Request::CloseDeferred),
        (force, false, _) => Ok(Request::Close { force }),
    }
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
        cancel_deferred: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        policy: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        allow_discards: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        spin_us: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        size_sectors: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        key_slot: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        volume_key_file: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        hotzone_bytes: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        resilience: Option<&'static str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        resilience_hash: Option<&'static str>,
    }
    let mut w = Wire {
        v: VERSION,
        cmd: "status",
        force: None,
        deferred: None,
        cancel_deferred: None,
        policy: None,
        allow_discards: None,
        spin_us: None,
        size_sectors: None,
        key_slot: None,
        volume_key_file: None,
        hotzone_bytes: None,
        resilience: None,
        resilience_hash: None,
    };
    let mut passphrase = None;
    match req {
        Request::Status => {}
        Request::Brief => w.cmd = "brief",
        Request::Suspend => w.cmd = "suspend",
        Request::Close { force } => (w.cmd, w.force) = ("close", Some(*force)),
        Request::CloseDeferred => (w.cmd, w.deferred) = ("close", Some(true)),
        Request::CancelDeferred => (w.cmd, w.cancel_deferred) = ("close", Some(true)),
        Request::Refresh(r) => {
            w.cmd = "refresh";
            w.policy = r.policy.map(|p| p.to_string());
            w.allow_discards = r.allow_discards;
            w.spin_us = r.spin_us;
        }
        Request::Resize { size_sectors } => (w.cmd, w.size_sectors) = ("resize", *size_sectors),
        Request::Reencrypt {
            key,
            hotzone_bytes,
            resilience,
        } => {
            w.cmd = "reencrypt";
            w.hotzone_bytes = *hotzone_bytes;
            w.resilience = resilience.map(ResilienceAsked::name);
            w.resilience_hash = resilience
                .and_then(ResilienceAsked::hash)
                .map(HashAlg::name);
            // A volume key file cannot rotate (both keys come from keyslots).
            if let ResumeKey::Passphrase(p) = key {
                passphrase = Some(p);
            }
        }
        Request::Resume { key, key_slot } => {
            w.cmd = "resume";
            w.key_slot = *key_slot;
            match key {
                ResumeKey::Passphrase(p) => passphrase = Some(p),
                ResumeKey::VolumeKeyFile(f) => {
                    w.volume_key_file = Some(f.to_string_lossy().into_owned())
                }
            }
        }
    }
    let out = line(&w);
    match passphrase {
        None => out,
        Some(p) => {
            // Spliced in by hand, into a vector sized once (no reallocation leaves a copy):
            // the object's closing brace is replaced by the field.
            let hex = hex_secret(p.as_ref());
            let head = &out[..out.len() - 2];
            let mut v = Vec::with_capacity(head.len() + hex.len() + 24);
            v.extend_from_slice(head);
            v.extend_from_slice(b",\"passphrase_hex\":\"");
            v.extend_from_slice(hex.as_ref());
            v.extend_from_slice(b"\"}\n");
            v
        }
    }
}

/// Wipes one byte so that the compiler keeps the write (the buffer is freed next).
fn wipe_byte(b: &mut u8) {
    // SAFETY: a volatile write to a byte we hold a unique reference to.
    unsafe { std::ptr::write_volatile(b, 0) };
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
    /// Authenticated encryption: the integrity type (`aead`, `hmac(sha256)`), as cryptsetup's
    /// status prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<String>,
    /// The integrity type's own key (an HMAC's), bits; 0: none (an AEAD, or no integrity).
    /// Part of `key_bits`, as in cryptsetup's status.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub integrity_key_bits: u32,
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
    /// Suspended (`ucrypt suspend`): requests wait, the key is wiped.
    #[serde(default)]
    pub suspended: bool,
    /// Authenticated volumes: blocks whose tag did not verify since opening (dm-integrity's
    /// "number of integrity mismatches"); absent for a plain volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity_mismatches: Option<u64>,
    /// A volume in reencryption, or one whose online rotation ran in this daemon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reencryption: Option<ReencryptionReport>,
    /// The detached header the volume was opened with (`--header`), as given; absent when
    /// the header is in front of the data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Chunks of the volume's buffers (those that may hold plaintext) whose `mlock` failed
    /// since opening: RLIMIT_MEMLOCK was reached, and they may be swapped out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub buffer_lock_failures: u64,
    /// `--memory-budget`: the budget and what is charged to it; absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_budget: Option<MemoryBudgetReport>,
    /// `open --nbd unix:PATH`: the NBD socket (shared by every daemon that names PATH) and
    /// this volume's part on it now; absent without `--nbd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_socket: Option<NbdSocketReport>,
}

/// A volume's NBD socket (`open --nbd`): several daemons' exports share one socket; one
/// daemon, the owner, listens and negotiates for all, the members serve the clients it passes
/// them (`ucrypt_nbd::server::share`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NbdSocketReport {
    /// `unix:PATH`, as `open --nbd` named it.
    pub listen: String,
    /// "owner", "member", "taking over" (its owner left) or "detached" (off the socket: only
    /// the connections made before are served).
    pub role: String,
    /// An owner's: the exports it negotiates for, its own included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exports: Option<u64>,
    /// A member's: its owner's process id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_pid: Option<u32>,
}

/// The memory budget shared by the volumes served with `--memory-budget` (`pool::budget`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBudgetReport {
    pub limit_bytes: u64,
    /// Charged by every volume sharing the budget.
    pub used_bytes: u64,
    /// Charged by this volume's process: its daemon, or the `serve`, `mount` or `ublk` that
    /// serves it.
    pub charged_bytes: u64,
    /// Charges that process was refused (each time, a request waited for its volume's own
    /// buffers) and made beyond the budget (a volume holding none served its oldest request).
    #[serde(default)]
    pub refused_charges: u64,
    #[serde(default)]
    pub forced_charges: u64,
}

fn is_zero<N: Default + PartialEq>(n: &N) -> bool {
    *n == N::default()
}

/// Where an online key rotation stands (`status` while `reencrypt` runs in the daemon).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReencryptionReport {
    /// Bytes under the new key, of `total_bytes`.
    pub done_bytes: u64,
    pub total_bytes: u64,
    /// The rotation runs in the daemon now.
    pub running: bool,
    /// Set when it ended: success, or the failure with its exit code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// It ended before its end (`finished` false) with the volume and its header consistent
    /// (a hotzone its worker held recovered): `reencrypt --resume-only` continues it online;
    /// `error` says why it stopped and how.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped: bool,
    /// It changed the sector size or the data offset: the volume serves the new layout
    /// through its reencryption view until it is closed, and refuses suspend, resize and
    /// another reencryption until it is opened again.
    #[serde(default)]
    pub reopen_needed: bool,
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

impl Response {
    /// A failure the client exits with `code` for.
    pub fn error(code: i32, error: impl Into<String>) -> Response {
        Response::Error {
            code,
            error: error.into(),
        }
    }

    /// An error from the library or the CLI, with cryptsetup's exit code for it.
    pub fn failed(e: impl Into<crate::error::CliError>) -> Response {
        let e = e.into();
        Response::error(e.exit_code(), e.message())
    }
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
            r#"{"v":1,"cmd":"resize","size_sectors":"x"}"#,
            r#"{"v":1,"cmd":"refresh"}"#,
            r#"{"v":1,"cmd":"resume"}"#,
            r#"{"v":1,"cmd":"resume","passphrase_hex":"0g"}"#,
            r#"{"v":1,"cmd":"resume","passphrase_hex":"abc"}"#,
            r#"{"v":1,"cmd":"status","passphrase_hex":"00"}"#,
            r#"{"v":1,"cmd":"resume","passphrase_hex":"00","volume_key_file":"/k"}"#,
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
            Request::Brief,
            Request::Close { force: false },
            Request::Close { force: true },
            Request::CloseDeferred,
            Request::CancelDeferred,
            Request::Suspend,
            Request::Resize { size_sectors: None },
            Request::Resize {
                size_sectors: Some(2048),
            },
            Request::Refresh(RefreshSettings {
                policy: Some("read=inline,write=auto".parse().unwrap()),
                allow_discards: Some(true),
                spin_us: Some(0),
            }),
            Request::Refresh(RefreshSettings {
                allow_discards: Some(false),
                ..RefreshSettings::default()
            }),
            Request::Resume {
                key: ResumeKey::Passphrase(SecretBytes::from_slice(b"p\n\"\x00\xff")),
                key_slot: Some(3),
            },
            Request::Resume {
                key: ResumeKey::VolumeKeyFile("/run/k".into()),
                key_slot: None,
            },
            Request::Reencrypt {
                key: ResumeKey::Passphrase(SecretBytes::from_slice(b"rot\x00")),
                hotzone_bytes: Some(1 << 20),
                resilience: None,
            },
            Request::Reencrypt {
                key: ResumeKey::Passphrase(SecretBytes::from_slice(&[7u8; 8 << 10])),
                hotzone_bytes: None,
                resilience: Some(ResilienceAsked::InPlace(
                    reencrypt::run::ResilienceKind::Checksum,
                    HashAlg::Sha512,
                )),
            },
            Request::Reencrypt {
                key: ResumeKey::Passphrase(SecretBytes::from_slice(b"j")),
                hotzone_bytes: None,
                resilience: Some(ResilienceAsked::DatashiftJournal),
            },
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
        // reencrypt needs the passphrase; other commands refuse one.
        assert!(parse_request(br#"{"v":1,"cmd":"reencrypt"}"#).is_err());
        assert!(parse_request(br#"{"v":1,"cmd":"status","passphrase_hex":"00"}"#).is_err());
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
                integrity: Some("hmac(sha256)".into()),
                integrity_key_bits: 256,
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
            suspended: true,
            integrity_mismatches: Some(3),
            reencryption: None,
            header: None,
            buffer_lock_failures: 5,
            memory_budget: Some(MemoryBudgetReport {
                limit_bytes: 64 << 20,
                used_bytes: 3 << 20,
                charged_bytes: 1 << 20,
                refused_charges: 7,
                forced_charges: 1,
            }),
            nbd_socket: Some(NbdSocketReport {
                listen: "unix:/run/nbd.sock".into(),
                role: "member".into(),
                exports: None,
                owner_pid: Some(41),
            }),
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
