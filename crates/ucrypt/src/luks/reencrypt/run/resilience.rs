//! Switching a reencryption's resilience (checksum, journal, none) on resume, as cryptsetup
//! does, with the reencrypt keyslot and its digest rewritten in one header write.

use crate::backend::Backend;
use crate::luks::kdf::PBKDF2_ITERATIONS_MIN;
use crate::luks::luks2::digest::make_digest_with;
use crate::luks::reencrypt::{verification_data, ReencryptState};
use crate::luks::util::HashAlg;
use crate::luks::{apply, Luks2Header, VolumeKey, WriteOp};
use crate::{Error, Result};

use super::{bad, ResilienceAsked, ResilienceKind, CHECKSUM_BLOCK_BYTES};

/// Rewrites the reencrypt keyslot's area for the resilience `asked` (its offset and size
/// kept) and the reencryption digest over it with the volume `keys` (old, new), and commits
/// the header: what cryptsetup 2.6 does when a resume names another resilience. Returns
/// whether anything changed; nothing is written when `asked` is what the header has.
///
/// In place, `checksum`, `journal` and `none` replace each other. A decryption that moves the
/// data back switches between `datashift-checksum` and `datashift-journal` (asked as those
/// or as `checksum` and `journal`, as cryptsetup's command line maps them) when the area
/// holds the moved segment's checksums or copy. Refused with nothing written: a volume left
/// inside a hotzone (its recovery needs the resilience it was written with), any other
/// change (cryptsetup's words), and a moved segment the new type's area cannot hold.
/// Crash-safe as any header commit: both copies, the new one or the old one.
pub(super) fn switch_resilience(
    dev: &dyn Backend,
    h: &mut Luks2Header,
    st: &mut ReencryptState,
    asked: ResilienceAsked,
    keys: (Option<&VolumeKey>, Option<&VolumeKey>),
) -> Result<bool> {
    use crate::luks::reencrypt::Resilience as R;
    use ResilienceAsked as A;
    // cryptsetup 2.6.1's words (its command line's).
    let cannot = || {
        Error::InvalidArgument(
            "Requested --resilience option cannot be applied to current reencryption operation."
                .into(),
        )
    };
    let wanted = match (&st.keyslot.resilience, asked) {
        (R::Datashift { .. }, A::Datashift) => return Ok(false),
        // cryptsetup 2.6.1's words.
        (R::Datashift { .. }, _) => {
            return Err(Error::InvalidArgument(
                "Device is in reencryption using datashift resilience. Requested --resilience \
                 option cannot be applied."
                    .into(),
            ))
        }
        (
            R::DatashiftChecksum { shift_size, .. } | R::DatashiftJournal { shift_size },
            A::DatashiftChecksum(hash) | A::InPlace(ResilienceKind::Checksum, hash),
        ) => R::DatashiftChecksum {
            hash: hash.name().into(),
            sector_size: CHECKSUM_BLOCK_BYTES,
            shift_size: *shift_size,
        },
        (
            R::DatashiftChecksum { shift_size, .. } | R::DatashiftJournal { shift_size },
            A::DatashiftJournal | A::InPlace(ResilienceKind::Journal, _),
        ) => R::DatashiftJournal {
            shift_size: *shift_size,
        },
        (R::None | R::Checksum { .. } | R::Journal, A::InPlace(kind, hash)) => match kind {
            ResilienceKind::None => R::None,
            ResilienceKind::Journal => R::Journal,
            ResilienceKind::Checksum => R::Checksum {
                hash: hash.name().into(),
                sector_size: CHECKSUM_BLOCK_BYTES,
            },
        },
        _ => return Err(cannot()),
    };
    if wanted == st.keyslot.resilience {
        return Ok(false);
    }
    if st.needs_recovery() {
        return Err(Error::NeedsRecovery);
    }
    // The moved segment's hotzone must fit what the new type keeps in the area.
    if let Some(moved) = st.backup_moved {
        let moved_bytes = match h.meta.segments.get(&moved.to_string()).map(|s| s.size) {
            Some(crate::luks::json::SegmentSize::Bytes(n)) => n,
            _ => return Err(bad("the moved segment has no fixed size")),
        };
        let area = st.keyslot.area_bytes;
        let max = match &wanted {
            R::DatashiftChecksum { hash, .. } => {
                area / HashAlg::from_name(hash)?.output_bytes() as u64
                    * u64::from(CHECKSUM_BLOCK_BYTES)
            }
            _ => area,
        };
        if moved_bytes > max {
            // cryptsetup 2.6.1's words.
            return Err(Error::InvalidArgument(format!(
                "Can not update resilience type. New type only provides {max} bytes, required \
                 space is: {moved_bytes} bytes."
            )));
        }
    }
    let rk = st.keyslot.id.to_string();
    let area = h
        .meta
        .keyslots
        .get_mut(&rk)
        .and_then(|k| k.area.as_mut())
        .ok_or(Error::Bug("the reencrypt keyslot has no area"))?;
    for field in ["hash", "sector_size", "shift_size"] {
        area.extra.remove(field);
    }
    area.kind = wanted.name().into();
    let (sums, shift) = match &wanted {
        R::Checksum { hash, sector_size } => (Some((hash, sector_size)), None),
        R::DatashiftChecksum {
            hash,
            sector_size,
            shift_size,
        } => (Some((hash, sector_size)), Some(shift_size)),
        R::DatashiftJournal { shift_size } => (None, Some(shift_size)),
        _ => (None, None),
    };
    if let Some((hash, sector_size)) = sums {
        area.extra.insert("hash".into(), hash.as_str().into());
        area.extra
            .insert("sector_size".into(), (*sector_size).into());
    }
    if let Some(shift) = shift {
        // A string, as cryptsetup writes 64-bit numbers.
        area.extra
            .insert("shift_size".into(), shift.to_string().into());
    }
    *st = ReencryptState::from_metadata(&h.meta)?
        .ok_or(Error::Bug("reencryption state not recognised"))?;
    let data = verification_data(
        &h.meta,
        st,
        keys.0.map(VolumeKey::bytes),
        keys.1.map(VolumeKey::bytes),
    )?;
    let (id, old_digest) = h
        .meta
        .digest_for_keyslot(&rk)
        .ok_or(Error::Bug("the reencrypt keyslot has no digest"))?;
    let id = id.clone();
    // The digest's hash and cost kept (it was verified with them), with a new salt.
    let hash = old_digest
        .hash
        .as_deref()
        .map(HashAlg::from_name)
        .transpose()?
        .unwrap_or(HashAlg::Sha256);
    let iterations = old_digest
        .iterations
        .unwrap_or(PBKDF2_ITERATIONS_MIN)
        .max(PBKDF2_ITERATIONS_MIN);
    let digest = make_digest_with(hash, iterations, data.as_ref(), vec![rk], vec![])?;
    h.meta.digests.insert(id, digest);
    let mut ops = h.commit()?;
    ops.push(WriteOp::Sync);
    apply(dev, &ops)?;
    Ok(true)
}
