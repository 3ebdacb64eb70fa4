//! From what the user gives to the volume key (FVEK), as cryptsetup's BITLK does it: one
//! secret, tried against each VMK by its protection. A passphrase VMK stretches the UTF-16
//! passphrase; a recovery-passphrase VMK stretches the 16-byte key of the 48 digits; a
//! startup-key VMK takes the key inside a `.BEK` file whose GUID names it. The stretched (or
//! external) key decrypts the VMK with AES-CCM, the VMK decrypts the FVEK the same way.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use zeroize::Zeroize;

use super::entries::{
    walk, ENTRY_HEADER_BYTES, TAG_BYTES, TYPE_STARTUP_KEY, TYPE_VOLUME_GUID, VALUE_EXTERNAL_KEY,
    VALUE_GUID, VALUE_KEY, VALUE_STRING,
};
use super::{
    guid_string, le16, le32, malformed, BitlkError, CcmKey, Encryption, Metadata, Protection, Vmk,
};
use crate::sector::block::Ecb;
use crate::sector::BlockCipher;
use crate::SecretBytes;
/// SHA-256 rounds of the stretch key.
const KDF_ROUNDS: u64 = 0x10_0000;
/// The size and version fields before a decrypted key's bytes.
const KEY_DATA_HEADER_BYTES: usize = 12;
const RECOVERY_CHARS: usize = 55;
const RECOVERY_GROUPS: usize = 8;
const RECOVERY_GROUP_CHARS: usize = 6;
const BEK_HEADER_BYTES: usize = 48;
const STARTUP_KEY_HEADER_BYTES: usize = 24;

/// The 16-byte key of a recovery passphrase (8 groups of 6 digits, each a multiple of 11,
/// joined by '-'; one trailing newline allowed), or `None` when `pw` is not one.
pub fn recovery_key(pw: &[u8]) -> Option<SecretBytes> {
    let pw = match pw.len() {
        RECOVERY_CHARS => pw,
        n if n == RECOVERY_CHARS + 1 && pw[RECOVERY_CHARS] == b'\n' => &pw[..RECOVERY_CHARS],
        _ => return None,
    };
    let step = RECOVERY_GROUP_CHARS + 1;
    if (RECOVERY_GROUP_CHARS..RECOVERY_CHARS)
        .step_by(step)
        .any(|i| pw[i] != b'-')
    {
        return None;
    }
    let mut key = [0u8; 2 * RECOVERY_GROUPS];
    for (j, group) in pw.chunks(step).enumerate() {
        let v = strtol(&group[..RECOVERY_GROUP_CHARS]);
        if v % 11 != 0 {
            key.zeroize();
            return None;
        }
        // cryptsetup stores the quotient as a 16-bit value (it truncates).
        key[2 * j..2 * j + 2].copy_from_slice(&((v / 11) as u16).to_le_bytes());
    }
    let out = SecretBytes::from_slice(&key);
    key.zeroize();
    Some(out)
}

/// C's `strtol(s, NULL, 10)` on a 6-byte group: leading spaces, a sign, then digits up to the
/// first non-digit (none: 0).
fn strtol(s: &[u8]) -> i64 {
    let mut i = 0;
    while i < s.len() && matches!(s[i], b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c) {
        i += 1;
    }
    let neg = i < s.len() && s[i] == b'-';
    if i < s.len() && matches!(s[i], b'-' | b'+') {
        i += 1;
    }
    let mut v = 0i64;
    while i < s.len() && s[i].is_ascii_digit() {
        v = v * 10 + i64::from(s[i] - b'0');
        i += 1;
    }
    if neg {
        -v
    } else {
        v
    }
}

/// BitLocker's stretch: SHA-256 of the initial hash, salt and counter, chained
/// [`KDF_ROUNDS`] times.
fn stretch(initial: &[u8; 32], salt: &[u8; 16]) -> SecretBytes {
    let mut block = [0u8; 32 + 32 + 16 + 8];
    block[32..64].copy_from_slice(initial);
    block[64..80].copy_from_slice(salt);
    for count in 0..KDF_ROUNDS {
        block[80..88].copy_from_slice(&count.to_le_bytes());
        let d = Sha256::digest(block);
        block[..32].copy_from_slice(&d);
    }
    let out = SecretBytes::from_slice(&block[..32]);
    block.zeroize();
    out
}

/// The stretch key of a passphrase: SHA-256 twice over its UTF-16LE form, stretched. The
/// hashed length is twice the UTF-8 length, zero padded, as cryptsetup hashes it. `None` for
/// a passphrase that is not UTF-8.
fn passphrase_key(pw: &[u8], salt: &[u8; 16]) -> Option<SecretBytes> {
    let text = std::str::from_utf8(pw).ok()?;
    let mut buf = vec![0u8; pw.len() * 2];
    for (i, u) in text.encode_utf16().enumerate() {
        buf[2 * i..2 * i + 2].copy_from_slice(&u.to_le_bytes());
    }
    let mut h: [u8; 32] = Sha256::digest(&buf).into();
    buf.zeroize();
    let mut initial: [u8; 32] = Sha256::digest(h).into();
    h.zeroize();
    let out = stretch(&initial, salt);
    initial.zeroize();
    Some(out)
}

fn recovery_stretch(rk: &SecretBytes, salt: &[u8; 16]) -> SecretBytes {
    let mut initial: [u8; 32] = Sha256::digest(rk.as_ref()).into();
    let out = stretch(&initial, salt);
    initial.zeroize();
    out
}

/// AES-CCM decryption (12-byte nonce, 16-byte tag, no associated data) with the tag checked.
pub(crate) fn ccm_decrypt(key: &[u8], k: &CcmKey) -> Result<SecretBytes, BitlkError> {
    let bad = || BitlkError::WrongKey;
    if !matches!(key.len(), 16 | 24 | 32) || k.ciphertext.len() >= 1 << 24 {
        return Err(bad());
    }
    let mut aes = Ecb::new(BlockCipher::Aes, key).map_err(|_| bad())?;
    let n = k.ciphertext.len();
    // Counter block i: flags (q - 1 = 2), the nonce, i as 3 big-endian bytes.
    let counter = |i: u32| {
        let mut a = [0u8; 16];
        a[0] = 2;
        a[1..13].copy_from_slice(&k.nonce);
        a[13..].copy_from_slice(&i.to_be_bytes()[1..]);
        a
    };
    let mut plain = SecretBytes::from_slice(&k.ciphertext);
    for (i, chunk) in plain.as_mut().chunks_mut(16).enumerate() {
        let mut s = counter(i as u32 + 1);
        aes.encrypt_block(&mut s).map_err(|_| bad())?;
        for (p, s) in chunk.iter_mut().zip(&s) {
            *p ^= s;
        }
        s.zeroize();
    }
    // CBC-MAC over B0 (flags: 16-byte tag, q = 3) and the zero-padded plaintext.
    let mut mac = [0u8; 16];
    mac[0] = (((TAG_BYTES - 2) / 2) << 3) as u8 | 2;
    mac[1..13].copy_from_slice(&k.nonce);
    mac[13..].copy_from_slice(&(n as u32).to_be_bytes()[1..]);
    aes.encrypt_block(&mut mac).map_err(|_| bad())?;
    for chunk in plain.as_ref().chunks(16) {
        for (m, p) in mac.iter_mut().zip(chunk) {
            *m ^= p;
        }
        aes.encrypt_block(&mut mac).map_err(|_| bad())?;
    }
    let mut s0 = counter(0);
    aes.encrypt_block(&mut s0).map_err(|_| bad())?;
    for (m, s) in mac.iter_mut().zip(&s0) {
        *m ^= s;
    }
    let ok: bool = mac.ct_eq(&k.tag).into();
    mac.zeroize();
    if !ok {
        return Err(bad());
    }
    Ok(plain)
}

/// A decrypted key's bytes: the data starts with its own size, which must be the encrypted
/// size; the key follows the 12-byte header. An FVEK of AES-128 with the Elephant diffuser
/// keeps its two 16-byte keys 32 bytes apart.
fn key_data(key: &[u8], k: &CcmKey, elephant_128: bool) -> Result<SecretBytes, BitlkError> {
    let data = ccm_decrypt(key, k)?;
    let d = data.as_ref();
    if d.len() < KEY_DATA_HEADER_BYTES || usize::from(le16(d, 0)) != d.len() {
        return Err(BitlkError::Refused("Unexpected key data size.".into()));
    }
    let h = KEY_DATA_HEADER_BYTES;
    if elephant_128 {
        if d.len() < h + 48 {
            return Err(BitlkError::Refused("Unexpected key data size.".into()));
        }
        let mut v = Vec::with_capacity(32);
        v.extend_from_slice(&d[h..h + 16]);
        v.extend_from_slice(&d[h + 32..h + 48]);
        return Ok(SecretBytes::from_vec(v));
    }
    Ok(data.slice(h..d.len()))
}

/// The external key of a `.BEK` file for `vmk`: `Ok(None)` when the file is for another VMK.
fn startup_key(
    bek: &[u8],
    vmk: &Vmk,
    volume_guid: &str,
) -> Result<Option<SecretBytes>, BitlkError> {
    if bek.len() < BEK_HEADER_BYTES + 6 {
        return Ok(None);
    }
    if guid_string(&bek[16..32]) != vmk.guid {
        return Ok(None);
    }
    let version = le32(bek, 4);
    if version != 1 {
        return Err(BitlkError::Refused(format!(
            "Unsupported BEK metadata version {version}"
        )));
    }
    let size = le32(bek, 0);
    if size as usize != bek.len() {
        return Err(BitlkError::Refused(format!(
            "Unexpected BEK metadata size {size} does not match BEK file length"
        )));
    }
    let h = BEK_HEADER_BYTES;
    if usize::from(le16(bek, h)) < ENTRY_HEADER_BYTES {
        return Err(malformed("BEK entry", "shorter than its header"));
    }
    if le16(bek, h + 2) != TYPE_STARTUP_KEY || le16(bek, h + 4) != VALUE_EXTERNAL_KEY {
        return Err(BitlkError::Refused(
            "Unexpected metadata entry found when parsing startup key.".into(),
        ));
    }
    let props_at = h + ENTRY_HEADER_BYTES + STARTUP_KEY_HEADER_BYTES;
    let props = bek.get(props_at..).unwrap_or(&[]);
    let mut key = None;
    walk(props, 6, |e| {
        if key.is_some() {
            return Ok(());
        }
        if e.kind != 0 && e.kind != TYPE_VOLUME_GUID {
            return Err(BitlkError::Refused(format!(
                "Unexpected metadata entry type '{}' found when parsing external key.",
                e.kind
            )));
        }
        match e.value {
            VALUE_KEY => {
                let k = e
                    .bytes
                    .get(ENTRY_HEADER_BYTES + 4..)
                    .ok_or_else(|| malformed("external key", "too short"))?;
                key = Some(SecretBytes::from_slice(k));
            }
            VALUE_STRING => {}
            VALUE_GUID => {
                let at = e.bytes.as_ptr() as usize - props.as_ptr() as usize;
                let g = props
                    .get(at + ENTRY_HEADER_BYTES..at + ENTRY_HEADER_BYTES + 16)
                    .ok_or_else(|| malformed("external key GUID", "too short"))?;
                let g = guid_string(g);
                if g != volume_guid {
                    return Err(BitlkError::Refused(format!(
                        "BEK file GUID '{g}' does not match GUID of the volume."
                    )));
                }
            }
            v => {
                return Err(BitlkError::Refused(format!(
                    "Unexpected metadata entry value '{v}' found when parsing external key."
                )))
            }
        }
        Ok(())
    })?;
    key.map(Some)
        .ok_or_else(|| malformed("external key", "no key in the BEK file"))
}

/// The key that opens `vmk` from `secret`, by its protection; `Err` when this VMK is not for
/// this secret (the caller goes on to the next VMK).
fn vmk_opening_key(meta: &Metadata, vmk: &Vmk, secret: &[u8]) -> Result<SecretBytes, BitlkError> {
    match vmk.protection {
        Protection::Passphrase => passphrase_key(secret, &vmk.salt).ok_or(BitlkError::WrongKey),
        Protection::RecoveryPassphrase => recovery_key(secret)
            .map(|rk| recovery_stretch(&rk, &vmk.salt))
            .ok_or(BitlkError::WrongKey),
        Protection::StartupKey => startup_key(secret, vmk, &meta.guid)?.ok_or(BitlkError::WrongKey),
        _ => Err(BitlkError::Refused(
            "This operation is not supported.".into(),
        )),
    }
}

/// The volume key (FVEK) from `secret`: a passphrase, a recovery passphrase or the bytes of a
/// `.BEK` file, tried against every VMK in metadata order. Fails with the last VMK's reason
/// ([`BitlkError::WrongKey`] when the secret opened nothing).
pub fn unlock(meta: &Metadata, secret: &[u8]) -> Result<SecretBytes, BitlkError> {
    let elephant_128 = meta.encryption == Encryption::CbcElephant { aes_bits: 128 };
    let mut last = BitlkError::WrongKey;
    let mut tried_supported = false;
    for vmk in &meta.vmks {
        if !vmk.protection.supported() {
            continue;
        }
        tried_supported = true;
        let key = match vmk_opening_key(meta, vmk, secret) {
            Ok(k) => k,
            Err(e) => {
                last = e;
                continue;
            }
        };
        let Some(enc) = vmk.keys.first() else {
            last = malformed("VMK", "no encrypted key");
            continue;
        };
        let vmk_key = match key_data(key.as_ref(), enc, false) {
            Ok(k) => k,
            Err(e) => {
                last = e;
                continue;
            }
        };
        match key_data(vmk_key.as_ref(), &meta.fvek, elephant_128) {
            Ok(fvek) => return Ok(fvek),
            Err(e) => last = e,
        }
    }
    if !tried_supported {
        return Err(BitlkError::Refused(
            "No supported VMK (passphrase, recovery passphrase or startup key) found.".into(),
        ));
    }
    Err(last)
}
