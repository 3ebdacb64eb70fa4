//! ucrypt: a userspace, dm-crypt and LUKS2 compatible disk encryption engine.
//!
//! The data path, top to bottom:
//! - [`sector`]: cipher specs in dm-crypt syntax, IV generators, and multi-sector AES-XTS/CBC
//!   calls byte-compatible with dm-crypt.
//! - [`volume`]: a [`volume::Volume`] = backend + key + dispatch policy, serving [`BlockDev`];
//!   read it first: it shows read -> plan -> crypto -> backend.
//! - [`engine`]: the pure request planner, dispatch policies, workers, range locks, stats.
//! - [`pool`]: bounded, aligned, preallocated bounce buffers.
//! - [`backend`]: where ciphertext lives (file / block device, memory, fault injection).

pub mod backend;
pub mod blockdev;
pub mod engine;
pub mod error;
pub mod luks;
pub mod nbd;
pub mod pool;
pub mod secret;
pub mod sector;
pub mod volume;

pub use blockdev::BlockDev;
pub use error::{Error, Result};
pub use secret::SecretBytes;
