//! NBD for ucrypt: any [`ucrypt::BlockDev`] (an encrypted `Volume`, a plain file) served to NBD
//! clients — qemu, the kernel's nbd-client, libnbd tools, fio.
//!
//! - [`proto`]: the protocol codec, sans I/O: the newstyle handshake as a state machine fed
//!   bytes ([`proto::Handshake`]: `feed` / `take_output` / `bytes_wanted`), request decoding
//!   and validation, replies.
//! - [`server`]: the driver around it: listeners, connections, TLS, request workers.

mod error;
pub mod proto;
pub mod server;

pub use error::{Error, Result};
