//! The NBD crate's error type: protocol violations by the peer, socket and set-up failures,
//! and errors of the device being served, each kept with its own type.

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The peer broke the NBD protocol; the connection is closed.
    #[error("NBD protocol violation by the client: {0}")]
    Protocol(String),

    /// The server broke the NBD protocol (seen by the client); the connection is closed.
    #[error("NBD protocol violation by the server: {0}")]
    ServerProtocol(String),

    /// The server refused what the client asked during the handshake (an option's error
    /// reply, named as the spec names it, with the server's own message).
    #[error("NBD server refused {option}: {reply}{}", fmt_message(.message))]
    Refused {
        option: &'static str,
        reply: &'static str,
        message: String,
    },

    /// A socket, TLS or file operation failed.
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },

    /// A server option or export is unusable (the caller's input).
    #[error("{0}")]
    Config(String),

    /// The device being served failed (its own error, kept whole).
    #[error(transparent)]
    Device(#[from] ucrypt::Error),

    /// Our own bug.
    #[error("internal error (a ucrypt bug, please report): {0}")]
    Bug(&'static str),
}

fn fmt_message(m: &str) -> String {
    if m.is_empty() {
        String::new()
    } else {
        format!(" ({m})")
    }
}

impl Error {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Who can act on this error (see [`ucrypt::ErrorKind`]).
    pub fn kind(&self) -> ucrypt::ErrorKind {
        match self {
            Error::Protocol(_) | Error::ServerProtocol(_) | Error::Refused { .. } => {
                ucrypt::ErrorKind::Peer
            }
            Error::Io { .. } => ucrypt::ErrorKind::Device,
            Error::Config(_) => ucrypt::ErrorKind::BadInput,
            Error::Device(e) => e.kind(),
            Error::Bug(_) => ucrypt::ErrorKind::Internal,
        }
    }
}
