//! TLS for NBD (`NBD_OPT_STARTTLS`) with rustls, x509 certificates only.
//!
//! After the server acknowledges STARTTLS, the socket is handed to a relay thread that runs
//! rustls and exchanges plaintext with the rest of the server over a unix socket pair. The
//! connection code therefore sees a plain byte stream it can split between a reader and a
//! writer, exactly as without TLS. The NBD client (`crate::client`) uses the same relay once
//! its own TLS handshake is done ([`spawn_relay`]). The relay half-closes in both directions so that stopping
//! the server (shutdown of the socket's read side) still lets in-flight replies go out.
//!
//! PSK: rustls (0.23) has no external pre-shared-key support (only resumption PSKs), so the
//! `tls-creds-psk` mode of qemu is not offered.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{Connection, RootCertStore, ServerConfig, ServerConnection};

use super::sock::Sock;
use crate::{Error, Result};

/// Plaintext that rustls may buffer for sending before the relay stops reading from the app.
const TLS_SEND_BUFFER_BYTES: usize = 1024 * 1024;
/// Relay copy buffer.
const RELAY_CHUNK_BYTES: usize = 64 * 1024;
/// Decrypted bytes held while the app side is not reading, before the relay stops reading the
/// network (back-pressure).
const TO_APP_MAX_BYTES: usize = 1024 * 1024;

pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When given, clients must present a certificate signed by this CA.
    pub client_ca: Option<PathBuf>,
}

fn bad(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Config(format!("{}: {what}: {e}", path.display()))
}

/// Builds the rustls server configuration from PEM files.
pub fn load_tls_config(f: &TlsFiles) -> Result<Arc<ServerConfig>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&f.cert)
        .map_err(|e| bad(&f.cert, "reading certificates", e))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad(&f.cert, "parsing certificates", e))?;
    if certs.is_empty() {
        return Err(bad(&f.cert, "certificate", "no PEM certificate found"));
    }
    let key =
        PrivateKeyDer::from_pem_file(&f.key).map_err(|e| bad(&f.key, "reading private key", e))?;
    let builder = ServerConfig::builder();
    let builder = match &f.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).map_err(|e| bad(ca, "reading CA", e))? {
                let c = c.map_err(|e| bad(ca, "parsing CA", e))?;
                roots.add(c).map_err(|e| bad(ca, "adding CA", e))?;
            }
            let v = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .map_err(|e| bad(ca, "client verifier", e))?;
            builder.with_client_cert_verifier(v)
        }
    };
    let cfg = builder
        .with_single_cert(certs, key)
        .map_err(|e| bad(&f.cert, "certificate and key", e))?;
    Ok(Arc::new(cfg))
}

/// Starts TLS on `net` (the client speaks first: its ClientHello); returns the plaintext side.
pub fn upgrade(net: Sock, cfg: Arc<ServerConfig>) -> io::Result<Sock> {
    let conn = ServerConnection::new(cfg).map_err(io::Error::other)?;
    // Handshake failures (wrong CA, no client cert) end up in the relay's error: the client is
    // refused by closing the connection, and the server's operator sees why.
    spawn_relay(
        net,
        Connection::Server(conn),
        None,
        Box::new(|e| eprintln!("ucrypt: tls: {e}")),
    )
}

/// Runs `tls` over `net` on a relay thread; returns the plaintext side. `on_error` gets the
/// relay's error if it ends with one (a closed or broken connection, a TLS alert). With
/// `linger`, once the app side has closed, the relay waits up to that long for the peer to
/// close before it does (a client's courtesy to the server).
pub(crate) fn spawn_relay(
    net: Sock,
    tls: Connection,
    linger: Option<Duration>,
    on_error: Box<dyn FnOnce(io::Error) + Send>,
) -> io::Result<Sock> {
    let (app, relay_end) = UnixStream::pair()?;
    std::thread::Builder::new()
        .name("nbd-tls".into())
        .spawn(move || {
            let mut relay_end = relay_end;
            if let Err(e) = relay(net, tls, &mut relay_end, linger) {
                // Reported before the app side closes, so the app, seeing the close, can
                // already find out why.
                on_error(e);
            }
            drop(relay_end);
        })?;
    Ok(Sock::Unix(app))
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

fn relay(
    mut net: Sock,
    mut tls: Connection,
    app: &mut UnixStream,
    linger: Option<Duration>,
) -> io::Result<()> {
    net.set_nonblocking(true)?;
    app.set_nonblocking(true)?;
    tls.set_buffer_limit(Some(TLS_SEND_BUFFER_BYTES));
    let mut buf = vec![0u8; RELAY_CHUNK_BYTES];
    let mut to_app: Vec<u8> = Vec::new();
    let (mut net_eof, mut app_eof, mut app_write_closed) = (false, false, false);
    let mut app_eof_at: Option<Instant> = None;
    loop {
        // 1. TLS records out to the network.
        while tls.wants_write() {
            match tls.write_tls(&mut net) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        if app_eof && !tls.wants_write() {
            // Everything the app wrote, and close_notify, has been sent. A client waits for
            // the server to close too (its last replies and close_notify), so the server's
            // final writes do not meet a closed socket; for at most `linger`.
            match (linger, app_eof_at) {
                (None, _) => return Ok(()),
                (Some(_), _) if net_eof => return Ok(()),
                (Some(l), Some(t)) if t.elapsed() >= l => return Ok(()),
                _ => {}
            }
        }
        // 2. Decrypted bytes to the app.
        if !to_app.is_empty() {
            match app.write(&to_app) {
                Ok(n) => {
                    to_app.drain(..n);
                }
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(e),
            }
        }
        // 3. Network into rustls, while the app keeps up.
        if !net_eof && to_app.len() < TO_APP_MAX_BYTES {
            match tls.read_tls(&mut net) {
                Ok(0) => net_eof = true,
                Ok(_) => {
                    if let Err(e) = tls.process_new_packets() {
                        // Send the alert (e.g. bad certificate) before giving up.
                        let _ = tls.write_tls(&mut net);
                        return Err(io::Error::other(format!(
                            "TLS handshake or record error: {e}"
                        )));
                    }
                    loop {
                        match tls.reader().read(&mut buf) {
                            Ok(0) => {
                                net_eof = true; // close_notify
                                break;
                            }
                            Ok(n) => to_app.extend_from_slice(&buf[..n]),
                            Err(e) if would_block(&e) => break,
                            Err(_) => {
                                net_eof = true;
                                break;
                            }
                        }
                    }
                }
                Err(e) if would_block(&e) => {}
                Err(_) => net_eof = true,
            }
        }
        if net_eof && to_app.is_empty() && !app_write_closed {
            if tls.is_handshaking() {
                return Err(io::Error::other("peer closed during the TLS handshake"));
            }
            // No more requests will come: the app's reader sees EOF, in-flight replies still
            // flow the other way.
            let _ = app.shutdown(std::net::Shutdown::Write);
            app_write_closed = true;
        }
        // 4. App replies into rustls once the handshake is done and its buffer has room.
        let can_take = !app_eof && !tls.is_handshaking() && !tls.wants_write();
        if can_take {
            match app.read(&mut buf) {
                Ok(0) => {
                    app_eof = true;
                    app_eof_at = Some(Instant::now());
                    tls.send_close_notify();
                    continue;
                }
                Ok(n) => tls.writer().write_all(&buf[..n])?,
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(e),
            }
            if tls.wants_write() {
                continue;
            }
        }
        // 5. Wait for something to do.
        let mut fds = [
            libc::pollfd {
                fd: net.as_raw_fd(),
                events: 0,
                revents: 0,
            },
            libc::pollfd {
                fd: app.as_raw_fd(),
                events: 0,
                revents: 0,
            },
        ];
        if !net_eof && to_app.len() < TO_APP_MAX_BYTES {
            fds[0].events |= libc::POLLIN;
        }
        if tls.wants_write() {
            fds[0].events |= libc::POLLOUT;
        }
        if !to_app.is_empty() {
            fds[1].events |= libc::POLLOUT;
        }
        if !app_eof && !tls.is_handshaking() && !tls.wants_write() {
            fds[1].events |= libc::POLLIN;
        }
        // SAFETY: `fds` is a valid array of two initialised pollfd structs for the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        if fds
            .iter()
            .any(|f| f.revents & (libc::POLLERR | libc::POLLNVAL) != 0)
            && fds[0].revents & libc::POLLIN == 0
        {
            // A dead socket with nothing left to read; reads/writes above will report it.
            if fds[0].revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
                return Err(io::Error::other("network socket error"));
            }
        }
    }
}
