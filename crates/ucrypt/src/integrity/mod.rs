//! Authenticated encryption: LUKS2 volumes whose data segment has an `integrity` object,
//! stored on dm-integrity's on-disk format exactly as cryptsetup and the kernel (dm-crypt over
//! dm-integrity) lay it out, served in userspace.
//!
//! - [`superblock`]: dm-integrity's superblock, parsed and serialised (sans I/O).
//! - [`layout`]: where each block's data and tag live, and the size the kernel provides.
//! - [`tag`]: the per-sector AEAD / XTS+HMAC with random IVs, as dm-crypt does it (sans I/O).
//! - [`device`]: [`IntegrityVolume`], the [`crate::BlockDev`] that reads, verifies, encrypts
//!   and writes through a [`crate::backend::Backend`]; [`open_luks2`] builds one from a header.
//!
//! Only dm-integrity's direct mode (no journal) is implemented; see docs/integrity.md.

pub mod device;
pub mod layout;
pub mod superblock;
pub mod tag;

pub use device::{open_luks2, IntegrityVolume};
pub use layout::Layout;
pub use superblock::Superblock;
pub use tag::{HmacHash, TagCipher, TagMode};
