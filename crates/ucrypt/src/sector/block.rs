//! One keyed 128-bit block cipher that encrypts or decrypts whole blocks in place: AES through
//! AWS-LC's ECB (many blocks per call, pipelined in hardware), serpent through RustCrypto,
//! twofish and camellia through the table-driven implementations beside this file (RustCrypto's
//! are several times to hundreds of times slower: see twofish.rs and camellia.rs). The modes
//! built on it (XTS, CBC, LRW: [`super::modes`]) and ESSIV see only this type.
//!
//! Key hygiene: AWS-LC's schedules live in locked pages ([`EvpCtx`]); the other cipher states
//! live in a [`SecretBox`] (locked, non-dumpable, wiped when dropped): twofish's tables are
//! built there in place, serpent's and camellia's round keys are moved there right after the
//! key schedule is built, and both wipe themselves on drop too.

use cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};

use super::camellia::Camellia;
use super::evp::{Alg, EvpCtx};
use super::spec::BlockCipher;
use super::twofish::Twofish;
use crate::secret::SecretBox;
use crate::{Error, Result};

/// The block size of every cipher here.
pub(crate) const BLOCK_BYTES: usize = 16;

const CHUNK: Error = Error::Bug("16-byte chunk");
const PARTIAL: Error = Error::Bug("a block cipher given a partial block");
// Key sizes were checked against the spec (and an ESSIV digest against its cipher) before any
// cipher is keyed, and `Ecb::new` checks them once more.
const REFUSED: Error = Error::Bug("a block cipher refused a key length its spec accepts");

pub(crate) enum Ecb {
    Aes { enc: EvpCtx, dec: EvpCtx },
    Serpent(SecretBox<serpent::Serpent>),
    Twofish(SecretBox<Twofish>),
    Camellia(SecretBox<Camellia>),
}

fn rust_cipher<C: KeyInit>(key: &[u8]) -> Result<SecretBox<C>> {
    Ok(SecretBox::new(C::new_from_slice(key).map_err(|_| REFUSED)?))
}

impl Ecb {
    /// Keys `cipher` with `key` (a length the cipher takes).
    pub(crate) fn new(cipher: BlockCipher, key: &[u8]) -> Result<Self> {
        if !cipher.takes_key_bytes(key.len()) {
            return Err(Error::Bug(
                "Ecb::new called with a key length the cipher does not take",
            ));
        }
        Ok(match cipher {
            BlockCipher::Aes => Ecb::Aes {
                enc: EvpCtx::new(Alg::AesEcb, key, true)?,
                dec: EvpCtx::new(Alg::AesEcb, key, false)?,
            },
            BlockCipher::Serpent => Ecb::Serpent(rust_cipher(key)?),
            BlockCipher::Twofish => Ecb::Twofish(Twofish::new(key).ok_or(REFUSED)?),
            BlockCipher::Camellia => {
                Ecb::Camellia(SecretBox::new(Camellia::new(key).ok_or(REFUSED)?))
            }
        })
    }

    /// Encrypts `data` (whole blocks) in place, each block on its own.
    #[inline]
    pub(crate) fn encrypt(&mut self, data: &mut [u8]) -> Result<()> {
        if data.len() % BLOCK_BYTES != 0 {
            return Err(PARTIAL);
        }
        match self {
            Ecb::Aes { enc, .. } => return enc.update_in_place(data),
            Ecb::Serpent(c) => {
                for b in data.chunks_exact_mut(BLOCK_BYTES) {
                    c.encrypt_block(b.try_into().map_err(|_| CHUNK)?);
                }
            }
            Ecb::Twofish(c) => c.encrypt_blocks(data),
            Ecb::Camellia(c) => c.encrypt_blocks(data),
        }
        Ok(())
    }

    /// Decrypts `data` (whole blocks) in place, each block on its own.
    #[inline]
    pub(crate) fn decrypt(&mut self, data: &mut [u8]) -> Result<()> {
        if data.len() % BLOCK_BYTES != 0 {
            return Err(PARTIAL);
        }
        match self {
            Ecb::Aes { dec, .. } => return dec.update_in_place(data),
            Ecb::Serpent(c) => {
                for b in data.chunks_exact_mut(BLOCK_BYTES) {
                    c.decrypt_block(b.try_into().map_err(|_| CHUNK)?);
                }
            }
            Ecb::Twofish(c) => c.decrypt_blocks(data),
            Ecb::Camellia(c) => c.decrypt_blocks(data),
        }
        Ok(())
    }

    /// Encrypts one block in place.
    #[inline]
    pub(crate) fn encrypt_block(&mut self, block: &mut [u8; BLOCK_BYTES]) -> Result<()> {
        self.encrypt(block)
    }
}
