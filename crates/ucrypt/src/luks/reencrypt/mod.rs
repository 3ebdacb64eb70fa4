//! LUKS2 reencryption as cryptsetup 2.x runs it, split by on-disk concept as cryptsetup's
//! `lib/luks2` splits it (docs/reencryption.md has the whole protocol):
//!
//! - `keyslot` (sans I/O): the `online-reencrypt` requirement and the `reencrypt` keyslot's
//!   mode, direction and resilience; their checks as a header loads ([`validate`]);
//! - `state` (sans I/O): the segment flags and the typed [`ReencryptState`] read from them
//!   and the keyslot;
//! - `digest` (sans I/O): the reencryption digest's input ([`verification_data`]): the
//!   volume keys and the fields above, so that metadata edited without the keys is refused;
//! - [`plan`] (sans I/O): where the reencryption is ([`plan::Position`]), the next hotzone's
//!   steps, and the segments each step commits, for the three movements of the data (in
//!   place, shifted up by an encryption, shifted back by a decryption);
//! - [`run`]: the driver: starting a reencryption (init), unlocking its keys, switching its
//!   resilience, running hotzones through lanes of rekeyed chunks, and recovering a hotzone a
//!   crash interrupted; all I/O through [`crate::backend::Backend`];
//! - `serving`: the contract between the hotzone loop and whoever serves the volume meanwhile
//!   (nobody offline; a volume online);
//! - `pieces`: a hotzone's data read, hashed and rewritten in pieces by a crew of threads;
//! - [`online`]: a volume served in two segments while its rotation runs.
//!
//! Read in that order: the state says what is on disk, the plan what the next step writes, the
//! run performs it.

mod digest;
mod keyslot;
pub mod online;
mod pieces;
pub mod plan;
pub mod run;
mod serving;
mod state;

pub use digest::{digest_of_segment, metadata_bytes, verification_data, DIGEST_STRING_MAX};
pub use keyslot::{
    is_reencrypt_requirement, is_requirement_candidate, parse_keyslot, requirement_version,
    validate, Direction, Mode, ReencryptKeyslot, Resilience, OFFLINE_REENCRYPT,
    REQUIREMENT_VERSIONS, REQUIREMENT_VERSION_MAX,
};
pub use serving::Serving;
pub use state::{segment_with_flag, ReencryptState, SegmentFlag};
