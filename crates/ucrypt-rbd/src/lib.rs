//! Ceph RBD as a ucrypt backend: the ciphertext lives in a RADOS block device image, the keys
//! stay with the client, and the cluster sees only encrypted sectors.
//!
//! ```no_run
//! use std::sync::Arc;
//! use ucrypt::backend::Backend;
//! use ucrypt::luks::Unlock;
//! use ucrypt::open::{open, Format, Luks, OpenRequest};
//! use ucrypt_rbd::{RbdBackend, RbdSpec};
//!
//! let spec = RbdSpec::parse("rbd:rbd/vm1:conf=/etc/ceph/ceph.conf")?;
//! let backend: Arc<dyn Backend> = Arc::new(RbdBackend::open(&spec)?);
//! let passphrase = ucrypt::SecretBytes::from_slice(b"secret");
//! let luks = Luks::new(Unlock::Passphrase(passphrase));
//! let volume = open(OpenRequest::new(backend, Format::Luks(luks)))?;
//! # Ok::<(), ucrypt::Error>(())
//! ```
//!
//! librbd and librados are loaded at run time, when an image is first opened (see `ffi.rs`
//! and this crate's `Cargo.toml`): without them ucrypt still builds and runs, and opening an
//! `rbd:` volume fails with an error naming the Debian package `librbd1`.
//!
//! Modules: `spec` parses `rbd:` names (no I/O), `ffi` holds the loaded libraries and every
//! `unsafe` block, `backend` is the [`ucrypt::backend::Backend`] over them.

#![deny(unsafe_code)]

mod backend;
#[allow(unsafe_code)]
mod ffi;
mod spec;

pub use backend::{FuaPath, RbdBackend, LOGICAL_BLOCK_BYTES, RBD_CACHE_DEFAULT, REQUEST_BYTES_MAX};
pub use ffi::{ABANDONED_MAX, CLOSE_WAIT_DEADLINES, RADOS_LIBRARY, RBD_LIBRARY, RBD_PACKAGE};
pub use spec::{RbdOptions, RbdSpec, RBD_PREFIX, REMOTE_TIMEOUT_DEFAULT, SETTINGS_MAX};
