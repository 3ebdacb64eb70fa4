//! Keyslot material: anti-forensic split, then encryption with the area cipher in 512-byte
//! sectors whose IVs count from 0 — the same for LUKS1 and LUKS2.

use super::af;
use super::kdf::Kdf;
use super::util::HashAlg;
use crate::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use crate::{Result, SecretBytes};

/// Everything needed to open or write one keyslot's material.
#[derive(Debug, Clone)]
pub struct SlotCrypto {
    pub key_bytes: usize,
    pub area_cipher: CipherSpec,
    pub area_key_bytes: usize,
    pub kdf: Kdf,
    pub af_hash: HashAlg,
    pub stripes: u32,
}

fn area_cipher(spec: CipherSpec, key: &SecretBytes) -> Result<SectorCipher> {
    SectorCipher::new(spec, key.as_ref(), Geometry::new(SectorSize::S512))
}

impl SlotCrypto {
    /// Bytes of material on disk (split key rounded up to 512-byte sectors).
    pub fn material_bytes(&self) -> usize {
        super::json::af_area_bytes(self.key_bytes, self.stripes) as usize
    }

    /// Recovers the candidate key from `material` (at least `material_bytes()` long) with the
    /// passphrase. The caller checks it against a digest.
    pub fn open(&self, passphrase: &[u8], material: &[u8]) -> Result<SecretBytes> {
        let n = self.material_bytes();
        if material.len() < n {
            return Err(crate::Error::Bug("keyslot material shorter than its area"));
        }
        let derived = self.kdf.derive(passphrase, self.area_key_bytes)?;
        let mut plain = SecretBytes::from_slice(&material[..n]);
        area_cipher(self.area_cipher, &derived)?.decrypt(0, plain.as_mut())?;
        Ok(af::merge(
            plain.as_ref(),
            self.key_bytes,
            self.stripes,
            self.af_hash,
        ))
    }

    /// Produces the encrypted material storing `key` under `passphrase`.
    pub fn seal(&self, passphrase: &[u8], key: &[u8]) -> Result<Vec<u8>> {
        let derived = self.kdf.derive(passphrase, self.area_key_bytes)?;
        let split = af::split(key, self.stripes, self.af_hash)?;
        let mut buf = SecretBytes::zeroed(self.material_bytes());
        buf.as_mut()[..split.len()].copy_from_slice(split.as_ref());
        area_cipher(self.area_cipher, &derived)?.encrypt(0, buf.as_mut())?;
        // Encrypted, the material is no longer secret.
        Ok(buf.as_ref().to_vec())
    }
}
