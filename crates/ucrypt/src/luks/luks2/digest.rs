//! LUKS2 digests: the pbkdf2 check that proves a candidate key (or the reencryption
//! metadata) right, and new digests for new keys.

use super::bad;
use crate::luks::json::DigestJson;
use crate::luks::json::DigestKind;
use crate::luks::kdf::{
    calibrate_pbkdf2, KdfRequest, PBKDF2_ITERATIONS_MIN, SALT_BYTES, SALT_BYTES_MAX,
};
use crate::luks::util::{b64_decode, b64_encode, random_fill, HashAlg};
use crate::luks::{DIGEST_BYTES_MAX, DIGEST_TIME_MS, KEYSLOTS_MAX};
use crate::{Error, Result, SecretBytes};

/// Whether `candidate` hashes to the pbkdf2 digest `d` (LUKS2's only digest type).
pub(crate) fn digest_matches(id: &str, d: &DigestJson, candidate: &[u8]) -> Result<bool> {
    if d.kind != DigestKind::Pbkdf2 {
        return Err(Error::UnsupportedLuks(format!("digest type '{}'", d.kind)));
    }
    let hash = HashAlg::from_name(d.hash.as_deref().unwrap_or(""))?;
    let salt = b64_decode(d.salt.as_deref().unwrap_or(""))
        .ok_or_else(|| bad("digests", format!("digest {id} salt is not base64")))?;
    let want = b64_decode(d.digest.as_deref().unwrap_or(""))
        .ok_or_else(|| bad("digests", format!("digest {id} value is not base64")))?;
    let iterations = d
        .iterations
        .filter(|&n| n > 0)
        .ok_or_else(|| bad("digests", format!("digest {id} has no iterations")))?;
    if want.is_empty() || want.len() > DIGEST_BYTES_MAX || salt.len() > SALT_BYTES_MAX {
        return Err(bad("digests", format!("digest {id} value or salt length")));
    }
    let mut got = SecretBytes::zeroed(want.len());
    hash.pbkdf2(candidate, &salt, iterations, got.as_mut());
    Ok(got.ct_eq(&want))
}

pub(crate) fn free_id<'a>(used: impl Iterator<Item = &'a String>) -> Result<u32> {
    let used: Vec<u32> = used.filter_map(|k| k.parse().ok()).collect();
    (0..KEYSLOTS_MAX)
        .find(|i| !used.contains(i))
        .ok_or_else(|| Error::InvalidArgument("no free id left in the LUKS2 header".into()))
}

/// A pbkdf2 digest of `secret` (the volume key digest LUKS2 uses), calibrated as format does.
pub(crate) fn make_digest(
    kdf: &KdfRequest,
    secret: &[u8],
    keyslots: Vec<String>,
    segments: Vec<String>,
) -> Result<DigestJson> {
    let hash = kdf.hash;
    let iterations = if kdf.force_iterations.is_some() {
        PBKDF2_ITERATIONS_MIN
    } else {
        calibrate_pbkdf2(hash, DIGEST_TIME_MS, secret.len())
    };
    make_digest_with(hash, iterations, secret, keyslots, segments)
}

/// [`make_digest`] with a given hash and iteration count (and a new salt).
pub(crate) fn make_digest_with(
    hash: HashAlg,
    iterations: u32,
    secret: &[u8],
    keyslots: Vec<String>,
    segments: Vec<String>,
) -> Result<DigestJson> {
    let mut salt = vec![0u8; SALT_BYTES];
    random_fill(&mut salt)?;
    let mut out = vec![0u8; hash.output_bytes()];
    hash.pbkdf2(secret, &salt, iterations, &mut out);
    Ok(DigestJson {
        kind: "pbkdf2".into(),
        keyslots,
        segments,
        hash: Some(hash.name().into()),
        iterations: Some(iterations),
        salt: Some(b64_encode(&salt)),
        digest: Some(b64_encode(&out)),
        extra: Default::default(),
    })
}
