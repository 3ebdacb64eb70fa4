//! CBC over the 64-bit block ciphers of TrueCrypt 3.x's data (CAST5, triple DES), one data
//! unit per call, as the kernel's `cbc(cast5)` and `cbc(des3_ede)` compute it: an 8-byte IV
//! and 8-byte blocks. The only IV generator dm-crypt gives these volumes is `tcw`, whose
//! seed and whitening are applied around this in `mod.rs`.
//!
//! Key hygiene: the RustCrypto key schedules live in a [`SecretBox`] (locked, non-dumpable,
//! wiped when dropped), as `block.rs` keeps the 128-bit ciphers'.

use cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};

use super::spec::BlockCipher64;
use crate::secret::SecretBox;
use crate::{Error, Result};

/// The block (and IV) size of every cipher here.
pub(crate) const BLOCK64_BYTES: usize = 8;

const CHUNK: Error = Error::Bug("8-byte chunk");

enum Schedule {
    Cast5(SecretBox<cast5::Cast5>),
    Des3Ede(SecretBox<des::TdesEde3>),
}

/// CBC over one keyed 64-bit block cipher.
pub(crate) struct Cbc64 {
    schedule: Schedule,
}

fn keyed<C: KeyInit>(key: &[u8]) -> Result<SecretBox<C>> {
    // The spec checked the key length before any cipher is keyed.
    let c = C::new_from_slice(key)
        .map_err(|_| Error::Bug("a 64-bit block cipher refused a key length its spec accepts"))?;
    Ok(SecretBox::new(c))
}

impl Cbc64 {
    /// Keys `cipher` with `key` (the cipher key alone: [`BlockCipher64::key_bytes`]).
    pub(crate) fn new(cipher: BlockCipher64, key: &[u8]) -> Result<Self> {
        if key.len() != cipher.key_bytes() {
            return Err(Error::Bug(
                "Cbc64::new called with a key length the cipher does not take",
            ));
        }
        let schedule = match cipher {
            BlockCipher64::Cast5 => Schedule::Cast5(keyed(key)?),
            BlockCipher64::Des3Ede => Schedule::Des3Ede(keyed(key)?),
        };
        Ok(Cbc64 { schedule })
    }

    fn encrypt_block(&self, b: &mut [u8]) -> Result<()> {
        match &self.schedule {
            Schedule::Cast5(c) => c.encrypt_block(b.try_into().map_err(|_| CHUNK)?),
            Schedule::Des3Ede(c) => c.encrypt_block(b.try_into().map_err(|_| CHUNK)?),
        }
        Ok(())
    }

    fn decrypt_block(&self, b: &mut [u8]) -> Result<()> {
        match &self.schedule {
            Schedule::Cast5(c) => c.decrypt_block(b.try_into().map_err(|_| CHUNK)?),
            Schedule::Des3Ede(c) => c.decrypt_block(b.try_into().map_err(|_| CHUNK)?),
        }
        Ok(())
    }

    /// One data unit in place, CBC from `iv`. `data` is whole 8-byte blocks.
    pub(crate) fn crypt(
        &mut self,
        encrypt: bool,
        iv: &[u8; BLOCK64_BYTES],
        data: &mut [u8],
    ) -> Result<()> {
        if data.len() % BLOCK64_BYTES != 0 {
            return Err(Error::Bug("64-bit CBC given a partial block"));
        }
        let mut prev = *iv;
        for b in data.chunks_exact_mut(BLOCK64_BYTES) {
            if encrypt {
                for (d, p) in b.iter_mut().zip(&prev) {
                    *d ^= p;
                }
                self.encrypt_block(b)?;
                prev.copy_from_slice(b);
            } else {
                // The chaining value of the next block is this block's ciphertext.
                let mut ct = [0u8; BLOCK64_BYTES];
                ct.copy_from_slice(b);
                self.decrypt_block(b)?;
                for (d, p) in b.iter_mut().zip(&prev) {
                    *d ^= p;
                }
                prev = ct;
            }
        }
        Ok(())
    }
}
