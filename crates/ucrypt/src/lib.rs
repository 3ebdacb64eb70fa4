//! ucrypt: a userspace, dm-crypt and LUKS2 compatible disk encryption engine.
//!
//! Open any volume ucrypt reads in one call with [`open::open`]: a raw dm-crypt mapping, LUKS1,
//! LUKS2, LUKS2 in reencryption or with authenticated encryption, all managed by one type,
//! [`open::Opened`], whose [`open::Opened::dev`] is a [`BlockDev`], the plaintext device every
//! front end (NBD, FUSE, ublk: the `ucrypt-*` crates) serves. Make one with [`format::plan`]
//! (sans I/O) and [`format::write_header`]. The lower-level pieces stay public:
//! [`luks::open`], [`integrity::open_luks2`], [`volume::Volume::new`].
//!
//! The data path, top to bottom:
//! - [`volume`]: a [`volume::Volume`] = backend + key + dispatch policy, serving [`BlockDev`];
//!   read it first: it shows read -> plan -> crypto -> backend.
//! - [`engine`]: the dispatch [`engine::Policy`] and its statistics; the planner, workers,
//!   queues and range locks behind them are private to this crate.
//! - [`sector`]: cipher specs in dm-crypt syntax, IV generators, and multi-sector AES-XTS/CBC
//!   calls byte-compatible with dm-crypt.
//! - [`pool`]: bounded, aligned bounce buffers, locked as used and given back when idle.
//! - [`backend`]: where ciphertext lives (file / block device, memory, fault injection).
//! - [`luks`]: LUKS2 and LUKS1 headers, sans I/O, and the small driver that performs their
//!   reads and writes against a backend.
//! - [`plain`]: cryptsetup's plain mode, the key of a headerless volume from a passphrase.
//! - [`bitlk`]: BitLocker metadata and keys, sans I/O, and the segments cryptsetup maps.
//! - [`open`] and [`format`](mod@format): a volume of any kind opened or made in one call, on
//!   top of the above.
//!
//! Engine internals are not reachable from outside the crate:
//!
//! ```compile_fail
//! use ucrypt::engine::workers::DoneRef;
//! ```
//!
//! ```compile_fail
//! use ucrypt::engine::plan::Planner;
//! ```
//!
//! ```compile_fail
//! use ucrypt::volume::Task;
//! ```

pub mod backend;
pub mod bitlk;
pub mod blockdev;
pub mod direct;
pub mod engine;
pub mod error;
pub mod format;
pub mod fvault2;
pub mod integrity;
pub mod loopaes;
pub mod luks;
pub mod open;
pub mod plain;
pub mod pool;
pub mod secret;
pub mod sector;
pub mod sync;
pub mod tcrypt;
pub mod volume;

pub use blockdev::BlockDev;
pub use error::{Error, ErrorKind, Refusal, Result};
pub use secret::SecretBytes;
pub use sync::Stop;

/// Helpers the unit tests share.
#[cfg(test)]
#[path = "../../../tests/kit/hex.rs"]
pub(crate) mod test_util;
