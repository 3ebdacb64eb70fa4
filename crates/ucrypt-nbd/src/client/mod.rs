//! The NBD client: a [`ucrypt::backend::Backend`] whose ciphertext lives on a remote NBD
//! export, so the server only ever sees encrypted sectors and the keys stay here.
//!
//! - [`NbdUri`] (`uri.rs`): the NBD URI standard's `nbd://`, `nbds://`, `nbd+unix://`,
//!   `nbds+unix://`.
//! - `dial.rs`: one connection — socket, TLS (rustls, then the server's relay thread), and the
//!   sans-I/O handshake [`crate::proto::ClientHandshake`] driven over it.
//! - `conn.rs`: one connection shared by all caller threads: pipelined requests matched to
//!   replies by handle, a reader thread per connection, reconnection with resend.
//! - [`NbdBackend`] (here): the `Backend` contract over one or more connections — requests
//!   cut to the server's block sizes, spread over the connections, flush on all of them.

mod conn;
mod dial;
mod uri;

#[cfg(test)]
mod tests;

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ucrypt::backend::Backend;
use ucrypt::sync::lock;
use ucrypt::Stop;

use crate::proto::{
    cmd_name, ExportGeometry, CMD_FLAG_FUA, CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE,
    CMD_WRITE_ZEROES, MAX_PAYLOAD_BYTES, TX_CAN_MULTI_CONN, TX_READ_ONLY, TX_SEND_FLUSH,
    TX_SEND_FUA, TX_SEND_TRIM, TX_SEND_WRITE_ZEROES,
};
use crate::{Error, Result};
use conn::{Conn, ReqError};
use dial::Target;

pub use conn::{BACKOFF_FIRST, BACKOFF_MAX, INFLIGHT_PER_CONNECTION_MAX};
pub use dial::SYSTEM_CA_BUNDLE;
pub use uri::{NbdUri, Transport, NBD_DEFAULT_PORT, URI_MAX_BYTES};

/// Most connections to one export (used only when the server advertises `CAN_MULTI_CONN`).
pub const CONNECTIONS_MAX: usize = 8;
/// Default remote timeout: how long a dropped connection may take to come back before the
/// requests waiting on it fail.
pub const REMOTE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Smallest block the client addresses, whatever smaller minimum the server advertises:
/// libnbd and the kernel assume 512, and so does every ucrypt sector size.
pub const BLOCK_BYTES_MIN: u32 = 512;
/// The zero buffer written when the server has no `WRITE_ZEROES`.
const ZERO_CHUNK_BYTES: usize = 1024 * 1024;

/// How to reach the export.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// CA certificates (PEM) the server's certificate must chain to; default
    /// [`SYSTEM_CA_BUNDLE`]. Only for `nbds` URIs.
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate (PEM), for servers that ask for one; needs `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// Connections to open when the server advertises `CAN_MULTI_CONN` (1 ..=
    /// [`CONNECTIONS_MAX`]); otherwise one is used whatever this says.
    pub connections: usize,
    /// How long a dropped connection may take to come back (see `conn.rs`); also how long a
    /// request may wait for its reply with nothing arriving before the connection is deemed
    /// dead, and the budget of the first connection.
    pub remote_timeout: Duration,
}

impl Default for ClientOptions {
    /// One connection per core (at most [`CONNECTIONS_MAX`]), [`REMOTE_TIMEOUT_DEFAULT`].
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        ClientOptions {
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            connections: cores.clamp(1, CONNECTIONS_MAX),
            remote_timeout: REMOTE_TIMEOUT_DEFAULT,
        }
    }
}

/// A remote NBD export as ciphertext storage.
pub struct NbdBackend {
    uri: NbdUri,
    conns: Vec<Arc<Conn>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    geometry: ExportGeometry,
    block_bytes: u32,
    /// Largest read or write sent in one request: the server's maximum payload (at most
    /// [`MAX_PAYLOAD_BYTES`]), in whole blocks.
    request_bytes_max: u32,
    size: u64,
    next: AtomicUsize,
}

impl NbdBackend {
    /// Connects to `uri` and negotiates the export; opens more connections if the server
    /// allows it. Fails at once (no retry) if the server cannot be reached now.
    pub fn connect(uri: &NbdUri, opts: &ClientOptions) -> Result<NbdBackend> {
        if opts.connections == 0 || opts.connections > CONNECTIONS_MAX {
            return Err(Error::Config(format!(
                "NBD connections must be 1 to {CONNECTIONS_MAX}, not {}",
                opts.connections
            )));
        }
        if opts.remote_timeout.is_zero() {
            return Err(Error::Config(
                "the remote timeout must be above zero".into(),
            ));
        }
        let target = Arc::new(Target::new(uri, opts)?);
        let deadline = Instant::now() + opts.remote_timeout;
        let first = dial::dial(&target, deadline)?;
        let g = first.geometry;
        let block_bytes = g.min_block_bytes.max(BLOCK_BYTES_MIN);
        let request_bytes_max =
            g.max_payload_bytes.min(MAX_PAYLOAD_BYTES) / block_bytes * block_bytes;
        if request_bytes_max == 0 {
            return Err(Error::ServerProtocol(format!(
                "{uri}: maximum payload {} is smaller than a {block_bytes}-byte block",
                g.max_payload_bytes
            )));
        }
        let wanted = if g.has(TX_CAN_MULTI_CONN) {
            opts.connections
        } else {
            1
        };
        let mut dialed = vec![first];
        while dialed.len() < wanted {
            let d = dial::dial(&target, deadline)?;
            if d.geometry != g {
                return Err(Error::ServerProtocol(format!(
                    "{uri}: a second connection saw a different export ({} vs {g})",
                    d.geometry
                )));
            }
            dialed.push(d);
        }
        let mut conns = Vec::with_capacity(dialed.len());
        let mut readers = Vec::with_capacity(dialed.len());
        for (i, d) in dialed.into_iter().enumerate() {
            let (c, reader) = Conn::new(target.clone(), d, opts.remote_timeout)
                .map_err(|e| Error::io(format!("{uri}: socket set-up"), e))?;
            let rc = c.clone();
            let h = std::thread::Builder::new()
                .name(format!("nbd-client-{i}"))
                .spawn(move || rc.run_reader(reader))
                .map_err(|e| Error::io("starting an NBD reader thread", e))?;
            conns.push(c);
            readers.push(h);
        }
        Ok(NbdBackend {
            uri: uri.clone(),
            conns,
            readers: Mutex::new(readers),
            geometry: g,
            block_bytes,
            request_bytes_max,
            size: g.size_bytes / u64::from(block_bytes) * u64::from(block_bytes),
            next: AtomicUsize::new(0),
        })
    }

    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    /// What the server said about the export.
    pub fn geometry(&self) -> ExportGeometry {
        self.geometry
    }

    /// Once `stop` is requested (the process is stopping), an unreachable server is given up
    /// on within one remote timeout of the request and not tried again: requests unanswered
    /// by then, and any made after, fail. Without it each of a stopping process's last
    /// requests (a flush per connection and per export) would wait a remote timeout of its
    /// own. See `conn.rs`.
    pub fn give_up_on(&self, stop: &Stop) {
        let conns: Vec<Weak<Conn>> = self.conns.iter().map(Arc::downgrade).collect();
        stop.on_request(move || {
            for c in conns.iter().filter_map(Weak::upgrade) {
                c.stopping();
            }
        });
    }

    /// How many times a dropped connection was restored (over all connections).
    pub fn reconnections(&self) -> u64 {
        self.conns.iter().map(|c| c.reconnections()).sum()
    }

    /// Connections in use.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// The connection for the next request: the least loaded, starting the scan at a
    /// rotating index so equal loads spread.
    fn pick(&self) -> &Arc<Conn> {
        let n = self.conns.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        if n == 1 {
            return &self.conns[0];
        }
        (0..n)
            .map(|k| &self.conns[(start + k) % n])
            .min_by_key(|c| c.load())
            .unwrap_or(&self.conns[start])
    }

    fn err(&self, kind: u16, offset: u64, len: u64, e: ReqError) -> ucrypt::Error {
        let what = format!(
            "NBD {} of {len} bytes at offset {offset} on {}",
            cmd_name(kind),
            self.uri
        );
        match e {
            ReqError::Server(n) => ucrypt::Error::io(
                format!("{what}: the server answered {}", n.name()),
                io::Error::from_raw_os_error(n.errno()),
            ),
            ReqError::Unavailable(msg) => ucrypt::Error::io(
                format!("{what}: {msg}"),
                io::Error::from_raw_os_error(libc::ETIMEDOUT),
            ),
            ReqError::Bug(what) => ucrypt::Error::Bug(what),
            ReqError::Closed => ucrypt::Error::io(
                format!("{what}: the backend is closing"),
                io::Error::from_raw_os_error(libc::ESHUTDOWN),
            ),
        }
    }

    /// One request other than a read on one connection, start to answer (reads:
    /// `Conn::read_into`).
    fn call(
        &self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Option<&[u8]>,
    ) -> ucrypt::Result<()> {
        let c = self.pick();
        let cookie = c
            .start(kind, flags, offset, len, payload)
            .map_err(|e| self.err(kind, offset, len.into(), e))?;
        c.finish(cookie, payload)
            .map_err(|e| self.err(kind, offset, len.into(), e))
    }

    fn check(&self, offset: u64, len: u64, writes: bool) -> ucrypt::Result<()> {
        let b = u64::from(self.block_bytes);
        if offset % b != 0 || len % b != 0 {
            return Err(ucrypt::Error::InvalidArgument(format!(
                "NBD request at offset {offset} of {len} bytes is not aligned to the export's \
                 {b}-byte blocks"
            )));
        }
        if writes && self.geometry.has(TX_READ_ONLY) {
            return Err(ucrypt::Error::ReadOnly(format!(
                "the NBD export {} is read-only",
                self.uri
            )));
        }
        ucrypt::blockdev::check_range(offset, len, self.size)
    }

    /// Cuts `[offset, offset + len)` into requests of at most `request_bytes_max`.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u32)> {
        let max = u64::from(self.request_bytes_max);
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            // Bounded by `max`, a u32.
            let n = (end - at).min(max) as u32;
            let piece = (at, n);
            at += u64::from(n);
            Some(piece)
        })
    }

    /// `NBD_CMD_WRITE` with `flags`, cut into requests the server accepts.
    fn write(&self, buf: &[u8], offset: u64, flags: u16) -> ucrypt::Result<()> {
        self.check(offset, buf.len() as u64, true)?;
        for (at, n) in self.pieces(offset, buf.len() as u64) {
            let from = (at - offset) as usize;
            let piece = Some(&buf[from..from + n as usize]);
            self.call(CMD_WRITE, flags, at, n, piece)?;
        }
        Ok(())
    }
}

impl Backend for NbdBackend {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ucrypt::Result<usize> {
        if offset >= self.size || buf.is_empty() {
            return Ok(0);
        }
        let len = (buf.len() as u64).min(self.size - offset);
        self.check(offset, len, false)?;
        for (at, n) in self.pieces(offset, len) {
            let from = (at - offset) as usize;
            let dest = &mut buf[from..from + n as usize];
            self.pick()
                .read_into(at, dest)
                .map_err(|e| self.err(CMD_READ, at, n.into(), e))?;
        }
        Ok(len as usize)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        self.write(buf, offset, 0)
    }

    /// `NBD_CMD_WRITE` with `NBD_CMD_FLAG_FUA` when the server advertises `SEND_FUA` (the
    /// server makes that write durable before answering); otherwise a write and a flush.
    fn write_at_fua(&self, buf: &[u8], offset: u64) -> ucrypt::Result<()> {
        if !self.geometry.has(TX_SEND_FUA) {
            self.write_at(buf, offset)?;
            return self.flush();
        }
        self.write(buf, offset, CMD_FLAG_FUA)
    }

    /// `NBD_CMD_FLUSH` on every connection at once; returns when all have answered (the
    /// spec makes a flush cover only the writes its own connection had acknowledged, unless
    /// `CAN_MULTI_CONN`, and even then only the flushing connection's answer is ordered).
    /// A server that does not advertise `SEND_FLUSH` has nothing to flush.
    fn flush(&self) -> ucrypt::Result<()> {
        if !self.geometry.has(TX_SEND_FLUSH) {
            return Ok(());
        }
        // Slots are taken in connection order, so two flushes waiting for room can never
        // hold what the other waits for.
        let mut started = Vec::with_capacity(self.conns.len());
        let mut first_err = None;
        for c in &self.conns {
            match c.start(CMD_FLUSH, 0, 0, 0, None) {
                Ok(cookie) => started.push((c, cookie)),
                Err(e) => {
                    first_err.get_or_insert(self.err(CMD_FLUSH, 0, 0, e));
                }
            }
        }
        for (c, cookie) in started {
            if let Err(e) = c.finish(cookie, None) {
                first_err.get_or_insert(self.err(CMD_FLUSH, 0, 0, e));
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// `NBD_CMD_TRIM` when the server advertises it. Discard is advisory (the range "may read
    /// back as anything"), so without `SEND_TRIM` it succeeds and sends nothing.
    fn discard(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.check(offset, len, true)?;
        if !self.geometry.has(TX_SEND_TRIM) {
            return Ok(());
        }
        for (at, n) in self.pieces(offset, len) {
            self.call(CMD_TRIM, 0, at, n, None)?;
        }
        Ok(())
    }

    /// `NBD_CMD_WRITE_ZEROES` when advertised (cut like a write, which no server refuses as
    /// too long); otherwise zero buffers written.
    fn write_zeroes(&self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.check(offset, len, true)?;
        if self.geometry.has(TX_SEND_WRITE_ZEROES) {
            for (at, n) in self.pieces(offset, len) {
                self.call(CMD_WRITE_ZEROES, 0, at, n, None)?;
            }
            return Ok(());
        }
        let zero_len = (ZERO_CHUNK_BYTES as u64).min(len) as usize;
        let zeroes = vec![0u8; zero_len];
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(zero_len as u64) as usize;
            self.write_at(&zeroes[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_bytes(&self) -> u32 {
        self.block_bytes
    }

    fn describe(&self) -> String {
        format!(
            "nbd {} ({} connection{}, {}-byte blocks)",
            self.uri,
            self.conns.len(),
            if self.conns.len() == 1 { "" } else { "s" },
            self.block_bytes
        )
    }
}

impl Drop for NbdBackend {
    fn drop(&mut self) {
        for c in &self.conns {
            c.close();
        }
        for h in lock(&self.readers).drain(..) {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for NbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}
