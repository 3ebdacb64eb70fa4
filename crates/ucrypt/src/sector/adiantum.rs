//! Adiantum (Crowley and Biggers, "Adiantum: length-preserving encryption for entry-level
//! processors", 2018), byte-compatible with the kernel's `adiantum(xchacha12,aes)` and
//! `adiantum(xchacha20,aes)` (crypto/adiantum.c, crypto/nhpoly1305.c): one wide-block
//! encryption per sector with a 32-byte tweak (dm-crypt's IV).
//!
//! For a message P = P_L || P_R (P_R its last 16 bytes) and tweak T:
//! - P_M = P_R + H(T, P_L) (mod 2^128, little-endian), C_M = AES-256(P_M);
//! - C_L = P_L ^ XChaCha(K, nonce C_M || 1);
//! - C_R = C_M - H(T, C_L).
//!
//! H(T, M) = Poly1305_{K_T}(le128(8·|M|) || T) + Poly1305_{K_M}(NH(M)), both without the final
//! key addition; NH hashes each 1024-byte chunk into 32 bytes. The subkeys (AES key, K_T, K_M,
//! the NH key) are the XChaCha keystream of K under the nonce 1 || 0…, in that order.
//!
//! The derived keys live in a [`SecretBox`]; the AES-256 key schedule in AWS-LC's locked
//! context ([`EvpCtx`]).

use chacha20::cipher::{KeyIvInit, StreamCipher};
use poly1305::universal_hash::{KeyInit as _, UniversalHash};
use poly1305::Poly1305;
use zeroize::Zeroize;

use super::evp::{Alg, EvpCtx};
use super::spec::XChaCha;
use crate::secret::SecretBox;
use crate::{Error, Result};

/// Adiantum's key: the XChaCha key.
pub(crate) const ADIANTUM_KEY_BYTES: usize = 32;
/// The tweak (dm-crypt's IV) length.
pub(crate) const ADIANTUM_TWEAK_BYTES: usize = 32;
/// The shortest message: one AES block.
const BLOCK_BYTES: usize = 16;
/// NH's chunk, and the bytes of key it takes beyond one chunk (three more passes' offsets).
const NH_MESSAGE_BYTES: usize = 1024;
const NH_KEY_WORDS: usize = (NH_MESSAGE_BYTES + 16 * 3) / 4;
const AES_KEY_BYTES: usize = 32;
const POLY_KEY_BYTES: usize = 16;
/// The XChaCha keystream the subkeys are cut from.
const DERIVED_BYTES: usize = AES_KEY_BYTES + 2 * POLY_KEY_BYTES + NH_KEY_WORDS * 4;

struct Keys {
    stream_key: [u8; ADIANTUM_KEY_BYTES],
    /// Poly1305 with r = K_T and s = 0 (Adiantum adds no s).
    header_poly: Poly1305,
    /// Poly1305 with r = K_M and s = 0.
    message_poly: Poly1305,
    nh_key: [u32; NH_KEY_WORDS],
}

impl Drop for Keys {
    fn drop(&mut self) {
        self.stream_key.zeroize();
        self.nh_key.zeroize();
        // The Poly1305 states wipe themselves (the crate's `zeroize` feature).
    }
}

pub(crate) struct Adiantum {
    rounds: XChaCha,
    keys: SecretBox<Keys>,
    aes_enc: EvpCtx,
    aes_dec: EvpCtx,
}

fn xchacha(rounds: XChaCha, key: &[u8; 32], nonce: &[u8; 24], data: &mut [u8]) {
    let (key, nonce) = (key.into(), nonce.into());
    match rounds {
        XChaCha::R12 => chacha20::XChaCha12::new(key, nonce).apply_keystream(data),
        XChaCha::R20 => chacha20::XChaCha20::new(key, nonce).apply_keystream(data),
    }
}

fn poly_with_r(r: &[u8]) -> Poly1305 {
    let mut k = [0u8; 32];
    k[..POLY_KEY_BYTES].copy_from_slice(r);
    let p = Poly1305::new((&k).into());
    k.zeroize();
    p
}

/// NH over one chunk (at most 1024 bytes, a multiple of 16): four passes, key offsets 0, 16,
/// 32, 48 bytes, 32-bit additions and 64-bit products, as the kernel's `nh_generic`.
#[inline]
fn nh(key: &[u32; NH_KEY_WORDS], chunk: &[u8]) -> [u8; 32] {
    let mut sums = [0u64; 4];
    for (unit, k) in chunk.chunks_exact(16).zip(key.windows(16).step_by(4)) {
        let m = |i: usize| u32::from_le_bytes([unit[i], unit[i + 1], unit[i + 2], unit[i + 3]]);
        let (m0, m1, m2, m3) = (m(0), m(4), m(8), m(12));
        for (p, sum) in sums.iter_mut().enumerate() {
            let k = &k[4 * p..4 * p + 4];
            *sum = sum
                .wrapping_add(u64::from(m0.wrapping_add(k[0])) * u64::from(m2.wrapping_add(k[2])))
                .wrapping_add(u64::from(m1.wrapping_add(k[1])) * u64::from(m3.wrapping_add(k[3])));
        }
    }
    let mut out = [0u8; 32];
    for (o, s) in out.chunks_exact_mut(8).zip(sums) {
        o.copy_from_slice(&s.to_le_bytes());
    }
    out
}

impl Adiantum {
    pub(crate) fn new(rounds: XChaCha, key: &[u8]) -> Result<Self> {
        let key: &[u8; ADIANTUM_KEY_BYTES] = key
            .try_into()
            .map_err(|_| Error::Bug("Adiantum keyed with a key that is not 256 bits"))?;
        let mut derived = crate::SecretBytes::zeroed(DERIVED_BYTES);
        let mut nonce = [0u8; 24];
        nonce[0] = 1;
        xchacha(rounds, key, &nonce, derived.as_mut());
        let d = derived.as_ref();
        let (aes_key, rest) = d.split_at(AES_KEY_BYTES);
        let (header_r, rest) = rest.split_at(POLY_KEY_BYTES);
        let (message_r, nh_bytes) = rest.split_at(POLY_KEY_BYTES);
        let mut keys = SecretBox::new(Keys {
            stream_key: *key,
            header_poly: poly_with_r(header_r),
            message_poly: poly_with_r(message_r),
            nh_key: [0; NH_KEY_WORDS],
        });
        for (w, b) in keys.nh_key.iter_mut().zip(nh_bytes.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(Adiantum {
            rounds,
            aes_enc: EvpCtx::new(Alg::AesEcb, aes_key, true)?,
            aes_dec: EvpCtx::new(Alg::AesEcb, aes_key, false)?,
            keys,
        })
    }

    /// Poly1305_{K_T}(le128(8·bulk) || T) + Poly1305_{K_M}(NH(bulk)), mod 2^128.
    fn hash(&self, header: u128, bulk: &[u8]) -> u128 {
        let mut poly = self.keys.message_poly.clone();
        let mut chunks = bulk.chunks(NH_MESSAGE_BYTES);
        let mut last = [0u8; NH_MESSAGE_BYTES];
        for chunk in chunks.by_ref() {
            let nh_out = if chunk.len() % 16 == 0 {
                nh(&self.keys.nh_key, chunk)
            } else {
                // Only a message's last chunk can end in a partial unit: zero padded.
                last[..chunk.len()].copy_from_slice(chunk);
                let padded = chunk.len().next_multiple_of(16);
                nh(&self.keys.nh_key, &last[..padded])
            };
            // 32 bytes: two whole Poly1305 blocks, no padding.
            poly.update_padded(&nh_out);
        }
        last.zeroize();
        let m = u128::from_le_bytes(poly.finalize().into());
        header.wrapping_add(m)
    }

    fn header_hash(&self, bulk_bytes: usize, tweak: &[u8; ADIANTUM_TWEAK_BYTES]) -> u128 {
        let mut h = [0u8; 16 + ADIANTUM_TWEAK_BYTES];
        h[..8].copy_from_slice(&(bulk_bytes as u64 * 8).to_le_bytes());
        h[16..].copy_from_slice(tweak);
        let t = self.keys.header_poly.clone().compute_unpadded(&h);
        u128::from_le_bytes(t.into())
    }

    fn stream(&self, c_m: &[u8; 16], data: &mut [u8]) {
        let mut nonce = [0u8; 24];
        nonce[..16].copy_from_slice(c_m);
        nonce[16] = 1;
        xchacha(self.rounds, &self.keys.stream_key, &nonce, data);
    }

    /// Encrypts or decrypts `data` (at least 16 bytes, any length) in place under `tweak`.
    pub(crate) fn crypt(
        &mut self,
        encrypt: bool,
        tweak: &[u8; ADIANTUM_TWEAK_BYTES],
        data: &mut [u8],
    ) -> Result<()> {
        let bulk_bytes = data
            .len()
            .checked_sub(BLOCK_BYTES)
            .ok_or(Error::Bug("Adiantum given less than one block"))?;
        let header = self.header_hash(bulk_bytes, tweak);
        let (bulk, last) = data.split_at_mut(bulk_bytes);
        let last: &mut [u8; 16] = last
            .try_into()
            .map_err(|_| Error::Bug("Adiantum's last block"))?;
        // enc: P_M = P_R + H(P_L); dec: C_M = C_R + H(C_L).
        let mut block = u128::from_le_bytes(*last)
            .wrapping_add(self.hash(header, bulk))
            .to_le_bytes();
        if encrypt {
            self.aes_enc.update_in_place(&mut block)?;
            self.stream(&block, bulk);
        } else {
            self.stream(&block, bulk);
            self.aes_dec.update_in_place(&mut block)?;
        }
        // enc: C_R = C_M - H(C_L); dec: P_R = P_M - H(P_L).
        *last = u128::from_le_bytes(block)
            .wrapping_sub(self.hash(header, bulk))
            .to_le_bytes();
        block.zeroize();
        Ok(())
    }
}

/// NHPoly1305 alone (the kernel's `nhpoly1305` hash, no header): `key` is the Poly1305 r
/// followed by the NH key, as the kernel's setkey takes it.
#[cfg(test)]
pub(crate) fn nhpoly1305(key: &[u8], msg: &[u8]) -> [u8; 16] {
    let (r, nh_bytes) = key.split_at(POLY_KEY_BYTES);
    let mut keys = SecretBox::new(Keys {
        stream_key: [0; 32],
        header_poly: poly_with_r(r),
        message_poly: poly_with_r(r),
        nh_key: [0; NH_KEY_WORDS],
    });
    for (w, b) in keys.nh_key.iter_mut().zip(nh_bytes.chunks_exact(4)) {
        *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    let a = Adiantum {
        rounds: XChaCha::R12,
        aes_enc: EvpCtx::new(Alg::AesEcb, &[0; 32], true).expect("aes"),
        aes_dec: EvpCtx::new(Alg::AesEcb, &[0; 32], false).expect("aes"),
        keys,
    };
    if msg.is_empty() {
        // No NH value at all: Poly1305 of nothing is 0.
        return [0; 16];
    }
    a.hash(0, msg).to_le_bytes()
}
