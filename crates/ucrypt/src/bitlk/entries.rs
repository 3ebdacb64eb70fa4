//! FVE metadata entries: a list of (size, type, value, version) headers each followed by its
//! data; a VMK entry holds a nested list of properties. Both walks advance by the entry's own
//! size, which is at least the header (a zero size ends the list, as in cryptsetup), so each
//! loop runs at most `len / ENTRY_HEADER_BYTES` times.

use super::{guid_string, le16, le64, malformed, BitlkError, CcmKey, Protection, Vmk};

/// An AES-CCM protected key's nonce and tag, as its entry carries them before the ciphertext.
pub(crate) const NONCE_BYTES: usize = 12;
pub(crate) const TAG_BYTES: usize = 16;

pub(crate) const ENTRY_HEADER_BYTES: usize = 8;
/// A VMK entry's own header after the entry header: GUID, modification time, protection.
const VMK_HEADER_BYTES: usize = 28;
const SALT_BYTES: usize = 16;

const TYPE_PROPERTY: u16 = 0x0000;
const TYPE_VMK: u16 = 0x0002;
const TYPE_FVEK: u16 = 0x0003;
pub(crate) const TYPE_STARTUP_KEY: u16 = 0x0006;
const TYPE_DESCRIPTION: u16 = 0x0007;
const TYPE_VOLUME_HEADER: u16 = 0x000f;
pub(crate) const TYPE_VOLUME_GUID: u16 = 0x0019;

pub(crate) const VALUE_KEY: u16 = 0x0001;
pub(crate) const VALUE_STRING: u16 = 0x0002;
const VALUE_STRETCH_KEY: u16 = 0x0003;
const VALUE_USE_KEY: u16 = 0x0004;
const VALUE_ENCRYPTED_KEY: u16 = 0x0005;
pub(crate) const VALUE_EXTERNAL_KEY: u16 = 0x0009;
const VALUE_RECOVERY_TIME: u16 = 0x0015;
pub(crate) const VALUE_GUID: u16 = 0x0017;

/// One entry header and its whole bytes (header included).
pub(crate) struct Entry<'a> {
    pub(crate) kind: u16,
    pub(crate) value: u16,
    pub(crate) bytes: &'a [u8],
}

/// Walks the entries of `area`, in order, until a zero size or fewer than `min_left` bytes
/// remain (cryptsetup stops at 4 bytes in the top list and 6 in nested ones). An entry larger
/// than what is left is an error.
pub(crate) fn walk<'a>(
    area: &'a [u8],
    min_left: usize,
    mut f: impl FnMut(Entry<'a>) -> Result<(), BitlkError>,
) -> Result<(), BitlkError> {
    let mut at = 0usize;
    while area.len() - at >= min_left {
        let size = le16(area, at) as usize;
        if size == 0 {
            break;
        }
        if size > area.len() - at {
            return Err(malformed(
                "entry size",
                format!("entry at {at} of {size} bytes, {} left", area.len() - at),
            ));
        }
        let bytes = &area[at..at + size];
        let kind = le16(area, at + 2);
        // The value needs 6 bytes; a 4-byte tail in the top list has none.
        let value = if area.len() - at >= 6 {
            le16(area, at + 4)
        } else {
            0
        };
        f(Entry { kind, value, bytes })?;
        // size >= 1 here, so the walk ends after at most `area.len()` steps.
        at += size;
    }
    Ok(())
}

/// What the top-level entry list holds.
#[derive(Default)]
pub(crate) struct Entries {
    pub(crate) vmks: Vec<Vmk>,
    pub(crate) fvek: Option<CcmKey>,
    pub(crate) description: Option<String>,
    pub(crate) volume_header_offset: u64,
    pub(crate) volume_header_bytes: u64,
}

fn ccm_key(e: &[u8], what: &'static str) -> Result<CcmKey, BitlkError> {
    let d = ENTRY_HEADER_BYTES;
    if e.len() < d + NONCE_BYTES + TAG_BYTES {
        return Err(malformed(what, format!("{} bytes, too short", e.len())));
    }
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&e[d..d + NONCE_BYTES]);
    let mut tag = [0u8; TAG_BYTES];
    tag.copy_from_slice(&e[d + NONCE_BYTES..d + NONCE_BYTES + TAG_BYTES]);
    Ok(CcmKey {
        nonce,
        tag,
        ciphertext: e[d + NONCE_BYTES + TAG_BYTES..].to_vec(),
    })
}

/// UTF-16LE text as cryptsetup converts it (an odd trailing byte is dropped, a trailing NUL
/// ends the string); invalid UTF-16 is an error.
pub(crate) fn utf16(b: &[u8]) -> Option<String> {
    let units: Vec<u16> = b
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .take_while(|&u| u != 0)
        .collect();
    String::from_utf16(&units).ok()
}

pub(crate) fn parse_entries(area: &[u8]) -> Result<Entries, BitlkError> {
    let mut out = Entries::default();
    walk(area, 4, |e| {
        match e.kind {
            TYPE_VMK => out.vmks.push(parse_vmk(e.bytes)?),
            TYPE_FVEK if out.fvek.is_none() => out.fvek = Some(ccm_key(e.bytes, "FVEK entry")?),
            TYPE_VOLUME_HEADER => {
                // cryptsetup checks the bytes left in the list, not the entry's own size.
                let d = e.bytes.as_ptr() as usize - area.as_ptr() as usize + ENTRY_HEADER_BYTES;
                if area.len() < d + 16 {
                    return Err(malformed("volume header entry", "too short"));
                }
                out.volume_header_offset = le64(area, d);
                out.volume_header_bytes = le64(area, d + 8);
            }
            TYPE_DESCRIPTION if out.description.is_none() => {
                if e.bytes.len() < ENTRY_HEADER_BYTES {
                    return Err(malformed("description entry", "too short"));
                }
                out.description = Some(utf16(&e.bytes[ENTRY_HEADER_BYTES..]).ok_or_else(|| {
                    BitlkError::Refused("Failed to convert BITLK volume description".into())
                })?);
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok(out)
}

fn parse_vmk(e: &[u8]) -> Result<Vmk, BitlkError> {
    let d = ENTRY_HEADER_BYTES;
    if e.len() < d + VMK_HEADER_BYTES {
        return Err(malformed(
            "VMK entry",
            format!("{} bytes, too short", e.len()),
        ));
    }
    let protection = Protection::from_raw(le16(e, d + 26));
    let mut vmk = Vmk {
        guid: guid_string(&e[d..d + 16]),
        name: None,
        protection,
        salt: [0; SALT_BYTES],
        keys: Vec::new(),
    };
    let supported = protection.supported();
    let props = &e[d + VMK_HEADER_BYTES..];
    walk(props, 6, |p| {
        if p.kind != TYPE_PROPERTY && supported {
            return Err(BitlkError::Refused(format!(
                "Unexpected metadata entry type '{}' found when parsing supported Volume Master Key.",
                p.kind
            )));
        }
        match p.value {
            VALUE_STRETCH_KEY => {
                // cryptsetup checks what is left of the list, not the property's size.
                let at = p.bytes.as_ptr() as usize - props.as_ptr() as usize;
                let s = at + ENTRY_HEADER_BYTES + 4;
                let salt = props
                    .get(s..s + SALT_BYTES)
                    .ok_or_else(|| malformed("stretch key", "too short"))?;
                vmk.salt.copy_from_slice(salt);
            }
            VALUE_ENCRYPTED_KEY => vmk.keys.push(ccm_key(p.bytes, "encrypted VMK")?),
            VALUE_KEY | VALUE_RECOVERY_TIME => {}
            VALUE_USE_KEY if protection == Protection::StartupKey => {}
            VALUE_STRING => {
                let s = utf16(&p.bytes[ENTRY_HEADER_BYTES.min(p.bytes.len())..]).ok_or_else(
                    || BitlkError::Refused("Invalid string found when parsing Volume Master Key.".into()),
                )?;
                if vmk.name.is_none() {
                    vmk.name = Some(s);
                } else if supported {
                    return Err(BitlkError::Refused(format!(
                        "Unexpected string ('{s}') found when parsing supported Volume Master Key."
                    )));
                }
            }
            v if supported => {
                return Err(BitlkError::Refused(format!(
                    "Unexpected metadata entry value '{v}' found when parsing supported Volume Master Key."
                )))
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok(vmk)
}
