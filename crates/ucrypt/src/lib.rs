//! ucrypt: a userspace, dm-crypt and LUKS2 compatible disk encryption engine.
//!
//! The data path, top to bottom:
//! - [`sector`]: cipher specs in dm-crypt syntax, IV generators, and multi-sector AES-XTS/CBC
//!   calls byte-compatible with dm-crypt.

pub mod blockdev;
pub mod error;
pub mod luks;
pub mod secret;
pub mod sector;

pub use blockdev::BlockDev;
pub use error::{Error, Result};
pub use secret::SecretBytes;
