//! The reencryption digest's input, sans I/O (cryptsetup's `luks2_reencrypt_digest.c`): a
//! pbkdf2 digest bound to the reencrypt keyslot covers the volume keys and the fields that
//! say what the reencryption does (its keyslot, the backup segments), so that metadata edited
//! without the keys is refused.

use super::keyslot::{bad, Resilience, REQUIREMENT_VERSION_MAX};
use super::state::ReencryptState;
use crate::luks::json::{Metadata, Segment, SegmentKind, SegmentSize};
use crate::{Result, SecretBytes};

/// First byte of the digest input.
const VERIFICATION_MAGIC: u8 = 0x76;
/// Longest string field the digest input takes (cryptsetup refuses longer ones).
pub const DIGEST_STRING_MAX: usize = 64;

/// Appends a string field as its bytes, refusing the lengths cryptsetup refuses.
fn put_str(out: &mut Vec<u8>, s: &str) -> Result<()> {
    if s.is_empty() || s.len() > DIGEST_STRING_MAX {
        return Err(bad(format!(
            "field '{s}' is empty or longer than {DIGEST_STRING_MAX} bytes"
        )));
    }
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// One segment as the digest sees it: type, offset (u64 BE), size (u64 BE or the text
/// "dynamic"), and for crypt segments iv_tweak (u64 BE), encryption and sector_size (u32 BE).
fn put_segment(out: &mut Vec<u8>, s: &Segment) -> Result<()> {
    put_str(out, s.kind.as_str())?;
    out.extend_from_slice(&s.offset.0.to_be_bytes());
    match s.size {
        SegmentSize::Dynamic => out.extend_from_slice(b"dynamic"),
        SegmentSize::Bytes(n) => out.extend_from_slice(&n.to_be_bytes()),
    }
    match &s.kind {
        SegmentKind::Linear => Ok(()),
        SegmentKind::Crypt => {
            let iv = s
                .iv_tweak
                .ok_or_else(|| bad("crypt segment lacks iv_tweak"))?;
            out.extend_from_slice(&iv.0.to_be_bytes());
            put_str(
                out,
                s.encryption
                    .as_deref()
                    .ok_or_else(|| bad("crypt segment lacks encryption"))?,
            )?;
            let ss = s
                .sector_size
                .ok_or_else(|| bad("crypt segment lacks sector_size"))?;
            out.extend_from_slice(&ss.to_be_bytes());
            Ok(())
        }
        SegmentKind::Other(k) => Err(bad(format!("segment type '{k}' in reencryption"))),
    }
}

/// The metadata half of the digest input: the reencrypt keyslot's fields, then the backup
/// segments (previous, final, and the moved one if present).
pub fn metadata_bytes(meta: &Metadata, st: &ReencryptState) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let k = &st.keyslot;
    put_str(&mut out, k.mode.name())?;
    put_str(&mut out, k.direction.name())?;
    put_str(&mut out, k.resilience.name())?;
    out.extend_from_slice(&k.area_offset.to_be_bytes());
    out.extend_from_slice(&k.area_bytes.to_be_bytes());
    match &k.resilience {
        Resilience::None | Resilience::Journal => {}
        Resilience::Checksum { hash, sector_size } => {
            put_str(&mut out, hash)?;
            out.extend_from_slice(&sector_size.to_be_bytes());
        }
        Resilience::Datashift { shift_size } | Resilience::DatashiftJournal { shift_size } => {
            out.extend_from_slice(&shift_size.to_be_bytes());
        }
        Resilience::DatashiftChecksum {
            hash,
            sector_size,
            shift_size,
        } => {
            put_str(&mut out, hash)?;
            out.extend_from_slice(&sector_size.to_be_bytes());
            out.extend_from_slice(&shift_size.to_be_bytes());
        }
    }
    let seg = |id: u32| {
        meta.segments
            .get(&id.to_string())
            .ok_or_else(|| bad(format!("segment {id} missing")))
    };
    put_segment(&mut out, seg(st.backup_previous)?)?;
    put_segment(&mut out, seg(st.backup_final)?)?;
    if let Some(m) = st.backup_moved {
        put_segment(&mut out, seg(m)?)?;
    }
    Ok(out)
}

/// The id of the digest that verifies the key of segment `seg`.
pub fn digest_of_segment(meta: &Metadata, seg: u32) -> Option<u32> {
    let s = seg.to_string();
    meta.digests
        .iter()
        .find(|(_, d)| d.segments.contains(&s))
        .and_then(|(k, _)| k.parse().ok())
}

/// The bytes the reencryption digest is computed over: `0x76`, `0x30 + version`, the old
/// volume key (digest of the backup-previous segment), the new one (backup-final's digest, if
/// it differs), then [`metadata_bytes`]. A missing key the layout needs is an error.
pub fn verification_data(
    meta: &Metadata,
    st: &ReencryptState,
    old_key: Option<&[u8]>,
    new_key: Option<&[u8]>,
) -> Result<SecretBytes> {
    if st.version > REQUIREMENT_VERSION_MAX {
        return Err(bad(format!("requirement version {}", st.version)));
    }
    let d_old = digest_of_segment(meta, st.backup_previous);
    let d_new = digest_of_segment(meta, st.backup_final);
    let old = match d_old {
        Some(_) => Some(old_key.ok_or_else(|| bad("the old volume key is needed"))?),
        None => None,
    };
    let new = match d_new {
        Some(_) if d_new != d_old => {
            Some(new_key.ok_or_else(|| bad("the new volume key is needed"))?)
        }
        _ => None,
    };
    if old.is_none() && new.is_none() {
        return Err(bad("neither backup segment has a key digest"));
    }
    let m = metadata_bytes(meta, st)?;
    let len = 2 + old.map_or(0, <[u8]>::len) + new.map_or(0, <[u8]>::len) + m.len();
    let mut out = SecretBytes::zeroed(len);
    let buf = out.as_mut();
    buf[0] = VERIFICATION_MAGIC;
    buf[1] = 0x30 + st.version;
    let mut at = 2;
    for part in [old.unwrap_or(&[]), new.unwrap_or(&[]), &m] {
        buf[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    debug_assert_eq!(at, len);
    Ok(out)
}
