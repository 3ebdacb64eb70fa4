//! One keyed 128-bit block cipher that encrypts or decrypts whole blocks in place: AES through
//! AWS-LC's ECB (many blocks per call, pipelined in hardware), serpent, twofish and camellia
//! through RustCrypto. The modes built on it (XTS, CBC, LRW: [`super::modes`]) and ESSIV see
//! only this type.
//!
//! Key hygiene: AWS-LC's schedules live in locked pages ([`EvpCtx`]); RustCrypto's cipher
//! states are moved into a [`SecretBox`] (locked, non-dumpable, wiped when dropped) right after
//! the key schedule is built, and the crates' `zeroize` feature wipes them on drop too.

use cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};

use super::evp::{Alg, EvpCtx};
use super::spec::BlockCipher;
use crate::secret::SecretBox;
use crate::{Error, Result};

/// The block size of every cipher here.
pub(crate) const BLOCK_BYTES: usize = 16;

pub(crate) enum Ecb {
    Aes { enc: EvpCtx, dec: EvpCtx },
    Serpent(SecretBox<serpent::Serpent>),
    Twofish(SecretBox<twofish::Twofish>),
    Camellia128(SecretBox<camellia::Camellia128>),
    Camellia192(SecretBox<camellia::Camellia192>),
    Camellia256(SecretBox<camellia::Camellia256>),
}

fn rust_cipher<C: KeyInit>(key: &[u8]) -> Result<SecretBox<C>> {
    // Key sizes were checked against the spec (and an ESSIV digest against its cipher) before
    // any cipher is keyed, and `Ecb::new` checks them once more.
    let c = C::new_from_slice(key)
        .map_err(|_| Error::Bug("a block cipher refused a key length its spec accepts"))?;
    Ok(SecretBox::new(c))
}

/// Runs `$body` with `$c` bound to the RustCrypto cipher of any non-AES variant.
macro_rules! with_rust_cipher {
    ($self:expr, $c:ident => $body:expr, aes => $aes:expr) => {
        match $self {
            Ecb::Aes { enc, dec } => $aes(enc, dec),
            Ecb::Serpent($c) => $body,
            Ecb::Twofish($c) => $body,
            Ecb::Camellia128($c) => $body,
            Ecb::Camellia192($c) => $body,
            Ecb::Camellia256($c) => $body,
        }
    };
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
            BlockCipher::Twofish => Ecb::Twofish(rust_cipher(key)?),
            BlockCipher::Camellia => match key.len() {
                16 => Ecb::Camellia128(rust_cipher(key)?),
                24 => Ecb::Camellia192(rust_cipher(key)?),
                _ => Ecb::Camellia256(rust_cipher(key)?),
            },
        })
    }

    /// Encrypts `data` (whole blocks) in place, each block on its own.
    #[inline]
    pub(crate) fn encrypt(&mut self, data: &mut [u8]) -> Result<()> {
        debug_assert!(data.len() % BLOCK_BYTES == 0);
        with_rust_cipher!(self, c => {
            for b in data.chunks_exact_mut(BLOCK_BYTES) {
                c.encrypt_block(b.try_into().map_err(|_| Error::Bug("16-byte chunk"))?);
            }
            Ok(())
        }, aes => |enc: &mut EvpCtx, _| enc.update_in_place(data))
    }

    /// Decrypts `data` (whole blocks) in place, each block on its own.
    #[inline]
    pub(crate) fn decrypt(&mut self, data: &mut [u8]) -> Result<()> {
        debug_assert!(data.len() % BLOCK_BYTES == 0);
        with_rust_cipher!(self, c => {
            for b in data.chunks_exact_mut(BLOCK_BYTES) {
                c.decrypt_block(b.try_into().map_err(|_| Error::Bug("16-byte chunk"))?);
            }
            Ok(())
        }, aes => |_, dec: &mut EvpCtx| dec.update_in_place(data))
    }

    /// Encrypts one block in place.
    #[inline]
    pub(crate) fn encrypt_block(&mut self, block: &mut [u8; BLOCK_BYTES]) -> Result<()> {
        self.encrypt(block)
    }
}
