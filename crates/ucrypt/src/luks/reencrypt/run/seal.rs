//! The steps every start of a reencryption ends with, whatever it changes: the volume keys'
//! digests assigned to the segments they decrypt, the mandatory requirement that keeps tools
//! unaware of the protocol away, and the reencryption digest that binds the keys to the
//! metadata (cryptsetup's `luks2_reencrypt_digest.c` concept).

use crate::luks::json::{Metadata, Requirements};
use crate::luks::kdf::KdfRequest;
use crate::luks::luks2::digest::{free_id, make_digest};
use crate::luks::reencrypt::{verification_data, ReencryptState};
use crate::{Error, Result};

/// Points digest `digest_id` at `segments` (`what` names the key in the error when the digest
/// is missing, which only a bug causes).
pub(super) fn assign_segments(
    meta: &mut Metadata,
    digest_id: u32,
    segments: Vec<String>,
    what: &'static str,
) -> Result<()> {
    meta.digests
        .get_mut(&digest_id.to_string())
        .ok_or(Error::Bug(what))?
        .segments = segments;
    Ok(())
}

/// Adds `requirement` (`online-reencrypt-v2`, `-v3`) to the header's mandatory requirements.
pub(super) fn require(meta: &mut Metadata, requirement: &str) {
    meta.config
        .requirements
        .get_or_insert_with(Requirements::default)
        .mandatory
        .get_or_insert_with(Vec::new)
        .push(requirement.into());
}

/// Adds the reencryption digest of the metadata as it now stands with `old_key` and `new_key`,
/// tied to the reencrypt keyslot `rk`; returns the reencryption state it was computed over.
pub(super) fn add_reencryption_digest(
    meta: &mut Metadata,
    kdf: &KdfRequest,
    rk: u32,
    old_key: Option<&[u8]>,
    new_key: Option<&[u8]>,
) -> Result<ReencryptState> {
    let st = ReencryptState::from_metadata(meta)?
        .ok_or(Error::Bug("reencryption state not recognised"))?;
    let data = verification_data(meta, &st, old_key, new_key)?;
    let rdid = free_id(meta.digests.keys())?;
    meta.digests.insert(
        rdid.to_string(),
        make_digest(kdf, data.as_ref(), vec![rk.to_string()], vec![])?,
    );
    Ok(st)
}
