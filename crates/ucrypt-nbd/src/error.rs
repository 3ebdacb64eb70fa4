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
            Error::Protocol(_) => ucrypt::ErrorKind::Peer,
            Error::Io { .. } => ucrypt::ErrorKind::Device,
            Error::Config(_) => ucrypt::ErrorKind::BadInput,
            Error::Device(e) => e.kind(),
            Error::Bug(_) => ucrypt::ErrorKind::Internal,
        }
    }
}
