//! The control socket's I/O: the daemon's accept loop and the client's one request. What the
//! lines mean is `proto.rs`; what a request does is the daemon's [`Handler`].

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::proto::{self, Request, Response};
use crate::error::{CliError, CliResult};
use ucrypt::SecretBytes;
use ucrypt_nbd::server::{bind_unix, BoundSocket};

/// Control connections served at once, at most; one more is answered "busy" and closed. A
/// status or close takes milliseconds, so this only bounds threads against a misbehaving
/// client that opens connections and sends nothing.
pub const CONNECTIONS_MAX: usize = 8;

/// How long a client may take to send its request line, and the daemon to accept a reply.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a client waits for the daemon's answer: a close flushes the volume and detaches
/// the device, which may wait for the kernel to let go of it.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// What the daemon does with a request: it calls `respond` exactly once. (A callback, not a
/// return value, so that `close` can answer and only then let the daemon exit.)
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, req: Request, respond: &mut dyn FnMut(&Response));
}

/// Binds a control socket, mode 0600, by the rule every ucrypt socket follows
/// (`ucrypt_nbd::server::unix_socket`: a file or a live socket at `path` is refused, a stale
/// socket replaced); the path goes when the returned [`BoundSocket`] is dropped.
pub fn bind(path: &Path) -> CliResult<(UnixListener, BoundSocket)> {
    Ok(bind_unix(path)?)
}

/// A control socket's listener and its handler: each connection accepted is served on a
/// thread of its own that ends with it, at most [`CONNECTIONS_MAX`] at once.
pub struct Acceptor {
    listener: UnixListener,
    handler: Arc<dyn Handler>,
    active: Arc<AtomicUsize>,
}

impl Acceptor {
    /// Takes the listener, made non-blocking for [`Self::accept_pending`].
    pub fn new(listener: UnixListener, handler: Arc<dyn Handler>) -> CliResult<Acceptor> {
        listener
            .set_nonblocking(true)
            .map_err(|e| CliError::Core(ucrypt::Error::io("control socket O_NONBLOCK", e)))?;
        Ok(Acceptor {
            listener,
            handler,
            active: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Serves every connection waiting to be accepted now, each from a thread of its own;
    /// returns without waiting (for a caller that polls the listener).
    pub fn accept_pending(&self) {
        loop {
            match self.listener.accept() {
                Ok((conn, _)) => self.serve(conn),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // WouldBlock: none left; others (a client that went away, no fds): the next
                // poll tries again.
                Err(_) => return,
            }
        }
    }

    /// Serves `conn` from a new thread, or answers "busy" when [`CONNECTIONS_MAX`] are.
    fn serve(&self, mut conn: UnixStream) {
        // Blocking, with the timeouts `serve_one` sets, whatever the listener is.
        let _ = conn.set_nonblocking(false);
        if self.active.fetch_add(1, Ordering::SeqCst) >= CONNECTIONS_MAX {
            self.active.fetch_sub(1, Ordering::SeqCst);
            let _ = conn.set_write_timeout(Some(REQUEST_TIMEOUT));
            let _ = conn.write_all(&proto::encode_response(&Response::Error {
                code: 5,
                error: format!(
                    "the daemon is busy ({CONNECTIONS_MAX} control connections); try again"
                ),
            }));
            return;
        }
        let (h, a) = (self.handler.clone(), self.active.clone());
        let spawned = std::thread::Builder::new()
            .name("ucrypt-control-conn".into())
            .spawn(move || {
                serve_one(conn, &*h);
                a.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            self.active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl AsRawFd for Acceptor {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.listener.as_raw_fd()
    }
}

/// Serves the listener from a background thread (blocking accepts), one thread per
/// connection, at most [`CONNECTIONS_MAX`] at once. Runs until the process exits.
pub fn spawn(listener: UnixListener, handler: Arc<dyn Handler>) -> CliResult<()> {
    let acceptor = Acceptor {
        listener,
        handler,
        active: Arc::new(AtomicUsize::new(0)),
    };
    std::thread::Builder::new()
        .name("ucrypt-control".into())
        .spawn(move || {
            for conn in acceptor.listener.incoming() {
                let Ok(conn) = conn else { continue };
                acceptor.serve(conn);
            }
        })
        .map_err(|e| CliError::Core(ucrypt::Error::io("starting the control thread", e)))?;
    Ok(())
}

/// Reads one line of at most `max` bytes (newline included); None if longer or cut.
fn read_line(r: impl Read, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    BufReader::new(r.take(max as u64 + 1)).read_until(b'\n', &mut line)?;
    if line.len() > max || line.last() != Some(&b'\n') {
        return Ok(None);
    }
    Ok(Some(line))
}

/// Reads one request line of at most `max` bytes into wiped memory (a `resume` line holds a
/// passphrase): no buffer that grows, no reader's buffer left behind. None if longer or cut.
fn read_request_line(r: &mut impl Read, max: usize) -> std::io::Result<Option<SecretBytes>> {
    let mut buf = SecretBytes::zeroed(max + 1);
    let mut len = 0;
    loop {
        let n = match r.read(&mut buf.as_mut()[len..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Ok(None);
        }
        let nl = buf.as_ref()[len..len + n].contains(&b'\n');
        len += n;
        if nl {
            // One request per connection: nothing may follow its newline.
            if buf.as_ref()[len - 1] != b'\n' {
                return Ok(None);
            }
            return Ok(Some(buf.slice(0..len)));
        }
        if len > max {
            return Ok(None);
        }
    }
}

fn serve_one(mut conn: UnixStream, h: &dyn Handler) {
    let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
    let _ = conn.set_write_timeout(Some(REQUEST_TIMEOUT));
    let err = match read_request_line(&mut conn, proto::RESUME_LINE_BYTES_MAX) {
        Ok(Some(line)) => match proto::parse_request(line.as_ref()) {
            Ok(req) => {
                h.handle(req, &mut |resp: &Response| {
                    let _ = conn.write_all(&proto::encode_response(resp));
                });
                return;
            }
            Err(e) => e,
        },
        Ok(None) => proto::ProtoError::TooLong,
        Err(_) => return,
    };
    let resp = Response::Error {
        code: 1,
        error: err.to_string(),
    };
    let _ = conn.write_all(&proto::encode_response(&resp));
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nobody listens: the daemon is dead, or not ready yet.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("control socket: {0}")]
    Proto(#[from] proto::ProtoError),
    #[error("control socket: the daemon closed the connection without answering")]
    NoAnswer,
}

/// Sends one request and reads the answer.
pub fn request(sock: &Path, req: &Request) -> Result<Response, ClientError> {
    let mut conn = UnixStream::connect(sock).map_err(|source| ClientError::Connect {
        path: sock.display().to_string(),
        source,
    })?;
    conn.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    conn.set_read_timeout(Some(REPLY_TIMEOUT))?;
    let mut line = proto::encode_request(req);
    let sent = conn.write_all(&line);
    // A resume line holds the passphrase: wipe it before anything else can fail.
    line.iter_mut().for_each(|b| {
        // SAFETY: a volatile write to a byte of our own vector.
        unsafe { std::ptr::write_volatile(b, 0) }
    });
    sent?;
    match read_line(&mut conn, proto::RESPONSE_LINE_BYTES_MAX)? {
        Some(line) => Ok(proto::parse_response(&line)?),
        None => Err(ClientError::NoAnswer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    struct Echo;
    impl Handler for Echo {
        fn handle(&self, req: Request, respond: &mut dyn FnMut(&Response)) {
            respond(&Response::Error {
                code: 7,
                error: format!("{req:?}"),
            })
        }
    }

    #[test]
    fn round_trip_and_bounds() {
        let dir = std::env::temp_dir().join(format!("ucrypt-ctl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("control.sock");
        let (l, _bound) = bind(&sock).unwrap();
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        spawn(l, Arc::new(Echo)).unwrap();
        match request(&sock, &Request::Close { force: true }).unwrap() {
            Response::Error { code: 7, error } => assert_eq!(error, "Close { force: true }"),
            r => panic!("{r:?}"),
        }
        // An over-long line is refused without being parsed.
        let mut c = UnixStream::connect(&sock).unwrap();
        let mut big = vec![b'x'; proto::REQUEST_LINE_BYTES_MAX + 10];
        big.push(b'\n');
        c.write_all(&big).unwrap();
        let line = read_line(&mut c, proto::RESPONSE_LINE_BYTES_MAX)
            .unwrap()
            .unwrap();
        match proto::parse_response(&line).unwrap() {
            Response::Error { code: 1, error } => assert!(error.contains("longer"), "{error}"),
            r => panic!("{r:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
