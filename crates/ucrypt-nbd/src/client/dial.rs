//! Opening one connection: the socket, the handshake state machine driven over it, and TLS.
//! Blocking, bounded by a deadline: every socket operation carries a timeout no later than it.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore};
use ucrypt::sync::lock;

use super::uri::{NbdUri, Transport};
use super::ClientOptions;
use crate::proto::{ClientHandshake, ClientStep, ExportGeometry};
use crate::server::tls::spawn_relay;
use crate::server::Sock;
use crate::{Error, Result};

/// Where the CA bundle is looked for when no CA file is given (Debian's `ca-certificates`).
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// How long a closing TLS connection waits for the server's own close before it drops the
/// socket (the relay thread lingers, never the caller).
const CLOSE_LINGER: Duration = Duration::from_secs(2);
/// Shortest timeout given to a socket operation: a zero timeout means "none" to the socket
/// API, and an operation must get a chance to run even with the deadline almost gone.
const SOCKET_TIMEOUT_MIN: Duration = Duration::from_millis(10);

/// What every connection (and every reconnection) needs to reach the export.
pub(crate) struct Target {
    pub uri: NbdUri,
    pub tls: Option<(Arc<ClientConfig>, ServerName<'static>)>,
}

fn cfg_err(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Config(format!("{}: {what}: {e}", path.display()))
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| cfg_err(path, "reading certificates", e))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| cfg_err(path, "parsing certificates", e))?;
    if certs.is_empty() {
        return Err(cfg_err(path, "certificates", "no PEM certificate found"));
    }
    Ok(certs)
}

impl Target {
    pub fn new(uri: &NbdUri, opts: &ClientOptions) -> Result<Target> {
        if !uri.tls {
            if opts.tls_ca_file.is_some()
                || opts.tls_cert_file.is_some()
                || opts.tls_key_file.is_some()
            {
                return Err(Error::Config(format!(
                    "{uri}: TLS files given for a URI without TLS (use nbds:// or nbds+unix://)"
                )));
            }
            return Ok(Target {
                uri: uri.clone(),
                tls: None,
            });
        }
        let ca = opts
            .tls_ca_file
            .clone()
            .unwrap_or_else(|| SYSTEM_CA_BUNDLE.into());
        let mut roots = RootCertStore::empty();
        for c in load_certs(&ca)? {
            roots.add(c).map_err(|e| cfg_err(&ca, "adding CA", e))?;
        }
        let builder = ClientConfig::builder().with_root_certificates(roots);
        let cfg = match (&opts.tls_cert_file, &opts.tls_key_file) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let certs = load_certs(cert)?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| cfg_err(key, "reading private key", e))?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| cfg_err(cert, "client certificate and key", e))?
            }
            _ => {
                return Err(Error::Config(
                    "a TLS client certificate needs its key, and a key its certificate".into(),
                ))
            }
        };
        let name = ServerName::try_from(uri.server_name().to_string()).map_err(|e| {
            Error::Config(format!(
                "{uri}: '{}' is not a usable TLS server name: {e}",
                uri.server_name()
            ))
        })?;
        Ok(Target {
            uri: uri.clone(),
            tls: Some((Arc::new(cfg), name)),
        })
    }
}

/// A connection in the transmission phase.
pub(crate) struct Dialed {
    pub reader: Sock,
    pub writer: Sock,
    pub geometry: ExportGeometry,
}

fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(SOCKET_TIMEOUT_MIN)
}

fn io_err(uri: &NbdUri, what: &str, e: io::Error) -> Error {
    Error::io(format!("{uri}: {what}"), e)
}

fn connect(uri: &NbdUri, deadline: Instant) -> Result<Sock> {
    match &uri.transport {
        Transport::Unix(p) => UnixStream::connect(p)
            .map(Sock::Unix)
            .map_err(|e| io_err(uri, &format!("connecting to {}", p.display()), e)),
        Transport::UnixAbstract(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)
                .map_err(|e| io_err(uri, "abstract socket name", e))?;
            UnixStream::connect_addr(&addr)
                .map(Sock::Unix)
                .map_err(|e| io_err(uri, "connecting to the abstract socket", e))
        }
        Transport::Tcp { host, port } => {
            let addrs = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(|e| io_err(uri, &format!("resolving {host}"), e))?;
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
            for a in addrs {
                match TcpStream::connect_timeout(&a, left(deadline)) {
                    Ok(s) => {
                        // Request headers are small and latency-bound: never hold them back.
                        s.set_nodelay(true)
                            .map_err(|e| io_err(uri, "TCP_NODELAY", e))?;
                        return Ok(Sock::Tcp(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(io_err(uri, &format!("connecting to {host}:{port}"), last))
        }
    }
}

fn set_timeouts(s: &Sock, deadline: Instant) -> io::Result<()> {
    s.set_read_timeout(Some(left(deadline)))?;
    s.set_write_timeout(Some(left(deadline)))
}

/// Opens a connection and negotiates the export, all before `deadline`.
pub(crate) fn dial(t: &Target, deadline: Instant) -> Result<Dialed> {
    let uri = &t.uri;
    let mut sock = connect(uri, deadline)?;
    let mut hs = ClientHandshake::new(&uri.export, t.tls.is_some())?;
    // The TLS relay's own error (an alert, a certificate refused by the server), kept so a
    // handshake that then sees only a closed socket can say why.
    let relay_error: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let closed = |e: io::Error| -> Error {
        let why = lock(&relay_error).clone();
        match why {
            Some(w) => io_err(uri, &format!("NBD handshake (TLS: {w})"), e),
            None => io_err(uri, "NBD handshake", e),
        }
    };
    let mut buf = Vec::new();
    loop {
        set_timeouts(&sock, deadline).map_err(|e| io_err(uri, "socket timeouts", e))?;
        let out = hs.take_output();
        if !out.is_empty() {
            sock.write_all(&out).map_err(closed)?;
        }
        let want = hs.bytes_wanted();
        buf.resize(want, 0);
        sock.read_exact(&mut buf).map_err(closed)?;
        match hs.feed(&buf)? {
            ClientStep::Continue => {}
            ClientStep::StartTls => {
                let Some((cfg, name)) = &t.tls else {
                    return Err(Error::Bug("STARTTLS accepted but never asked for"));
                };
                sock = tls_upgrade(uri, sock, cfg.clone(), name.clone(), &relay_error)?;
                hs.tls_established()?;
            }
            ClientStep::Ready(geometry) => {
                let writer = sock
                    .try_clone()
                    .map_err(|e| io_err(uri, "cloning the socket", e))?;
                return Ok(Dialed {
                    reader: sock,
                    writer,
                    geometry,
                });
            }
        }
    }
}

/// Runs the TLS client handshake on `net` (blocking, under the socket timeouts already set),
/// so a refused certificate is reported here with rustls's reason; then hands the session to
/// the relay thread and returns the plaintext side.
fn tls_upgrade(
    uri: &NbdUri,
    mut net: Sock,
    cfg: Arc<ClientConfig>,
    name: ServerName<'static>,
    relay_error: &Arc<Mutex<Option<String>>>,
) -> Result<Sock> {
    let mut tls = ClientConnection::new(cfg, name)
        .map_err(|e| io_err(uri, "TLS set-up", io::Error::other(e)))?;
    while tls.is_handshaking() {
        tls.complete_io(&mut net)
            .map_err(|e| io_err(uri, "TLS handshake", e))?;
    }
    let keep = relay_error.clone();
    spawn_relay(
        net,
        Connection::Client(tls),
        Some(CLOSE_LINGER),
        Box::new(move |e| *lock(&keep) = Some(e.to_string())),
    )
    .map_err(|e| io_err(uri, "starting the TLS relay", e))
}
