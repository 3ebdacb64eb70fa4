//! NBD for ucrypt: any [`ucrypt::BlockDev`] (an encrypted `Volume`, a plain file) served to NBD
//! clients — qemu, the kernel's nbd-client, libnbd tools, fio — and a client that keeps a
//! volume's ciphertext on a remote NBD export.
//!
//! - [`proto`]: the protocol codec, sans I/O: the newstyle handshake as state machines fed
//!   bytes, server side ([`proto::Handshake`]) and client side ([`proto::ClientHandshake`]),
//!   both `feed` / `take_output` / `bytes_wanted`; requests and simple replies.
//! - [`server`]: the driver around it: listeners, connections, TLS, request workers, and a
//!   unix socket shared by several processes' exports ([`server::share`]).
//! - [`client`]: [`NbdBackend`], a [`ucrypt::backend::Backend`] over NBD connections
//!   ([`NbdUri`], [`ClientOptions`]): pipelining, several connections, reconnection.

pub mod client;
mod error;
pub mod proto;
pub mod server;

pub use client::{ClientOptions, NbdBackend, NbdUri};
pub use error::{Error, Result};
