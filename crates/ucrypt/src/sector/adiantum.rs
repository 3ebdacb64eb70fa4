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
//!
//! Poly1305 is written here (44-bit limbs with 64×64→128-bit products, as poly1305-donna-64):
//! Adiantum hashes a few short inputs per sector (48 bytes, then 32 per KiB), where the
//! `poly1305` crate's AVX2 backend spends most of its time setting up and finishing.

use chacha20::cipher::{KeyIvInit, StreamCipher};
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

/// Poly1305's clamped key r in 44, 44 and 42-bit limbs.
#[derive(Clone, Copy)]
struct PolyKey([u64; 3]);

impl PolyKey {
    fn new(r: &[u8; 16]) -> Self {
        let t0 = u64::from_le_bytes([r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]]);
        let t1 = u64::from_le_bytes([r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]]);
        PolyKey([
            t0 & 0xffc_0fff_ffff,
            ((t0 >> 44) | (t1 << 20)) & 0xfff_ffc0_ffff,
            (t1 >> 24) & 0x00f_ffff_fc0f,
        ])
    }
}

const MASK44: u64 = (1 << 44) - 1;
const MASK42: u64 = (1 << 42) - 1;

/// A Poly1305 accumulator without the final key addition (Adiantum's "s" is zero): whole
/// 16-byte blocks in, h mod 2^128 out.
struct Poly {
    r: PolyKey,
    h: [u64; 3],
}

impl Poly {
    fn new(r: &PolyKey) -> Self {
        Poly { r: *r, h: [0; 3] }
    }

    /// Absorbs `data`, a whole number of 16-byte blocks (each with the 2^128 bit set).
    fn blocks(&mut self, data: &[u8]) {
        let [r0, r1, r2] = self.r.0;
        let (s1, s2) = (r1 * 20, r2 * 20);
        let [mut h0, mut h1, mut h2] = self.h;
        let m = |d: u64, r: u64| u128::from(d) * u128::from(r);
        for b in data.chunks_exact(16) {
            let t0 = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            let t1 = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
            h0 += t0 & MASK44;
            h1 += ((t0 >> 44) | (t1 << 20)) & MASK44;
            h2 += ((t1 >> 24) & MASK42) | (1 << 40);
            let d0 = m(h0, r0) + m(h1, s2) + m(h2, s1);
            let mut d1 = m(h0, r1) + m(h1, r0) + m(h2, s2);
            let mut d2 = m(h0, r2) + m(h1, r1) + m(h2, r0);
            d1 += d0 >> 44;
            h0 = d0 as u64 & MASK44;
            d2 += d1 >> 44;
            h1 = d1 as u64 & MASK44;
            let c = (d2 >> 42) as u64;
            h2 = d2 as u64 & MASK42;
            h0 += c * 5;
            h1 += h0 >> 44;
            h0 &= MASK44;
        }
        self.h = [h0, h1, h2];
    }

    /// h fully reduced mod 2^130 - 5, then mod 2^128.
    fn finish(self) -> u128 {
        let [mut h0, mut h1, mut h2] = self.h;
        let mut c;
        c = h1 >> 44;
        h1 &= MASK44;
        h2 += c;
        c = h2 >> 42;
        h2 &= MASK42;
        h0 += c * 5;
        c = h0 >> 44;
        h0 &= MASK44;
        h1 += c;
        c = h1 >> 44;
        h1 &= MASK44;
        h2 += c;
        c = h2 >> 42;
        h2 &= MASK42;
        h0 += c * 5;
        c = h0 >> 44;
        h0 &= MASK44;
        h1 += c;
        // g = h + 5 - 2^130; take it when it does not borrow (h >= p), in constant time.
        let mut g0 = h0 + 5;
        c = g0 >> 44;
        g0 &= MASK44;
        let mut g1 = h1 + c;
        c = g1 >> 44;
        g1 &= MASK44;
        let g2 = (h2 + c).wrapping_sub(1 << 42);
        let take_g = (g2 >> 63).wrapping_sub(1);
        h0 = (h0 & !take_g) | (g0 & take_g);
        h1 = (h1 & !take_g) | (g1 & take_g);
        h2 = (h2 & !take_g) | (g2 & take_g);
        let lo = h0 | (h1 << 44);
        let hi = (h1 >> 20) | (h2 << 24);
        (u128::from(hi) << 64) | u128::from(lo)
    }
}

impl Drop for Poly {
    fn drop(&mut self) {
        self.r.0.zeroize();
        self.h.zeroize();
    }
}

struct Keys {
    stream_key: [u8; ADIANTUM_KEY_BYTES],
    /// Poly1305's r for the header (K_T) and for the NH values (K_M).
    header_r: PolyKey,
    message_r: PolyKey,
    nh_key: [u32; NH_KEY_WORDS],
}

impl Drop for Keys {
    fn drop(&mut self) {
        self.stream_key.zeroize();
        self.header_r.0.zeroize();
        self.message_r.0.zeroize();
        self.nh_key.zeroize();
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

fn poly_key(r: &[u8]) -> Result<PolyKey> {
    let r: &[u8; POLY_KEY_BYTES] = r
        .try_into()
        .map_err(|_| Error::Bug("Poly1305 key of 16 bytes"))?;
    Ok(PolyKey::new(r))
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
            header_r: poly_key(header_r)?,
            message_r: poly_key(message_r)?,
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
        let mut poly = Poly::new(&self.keys.message_r);
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
            // 32 bytes: two whole Poly1305 blocks.
            poly.blocks(&nh_out);
        }
        last.zeroize();
        header.wrapping_add(poly.finish())
    }

    fn header_hash(&self, bulk_bytes: usize, tweak: &[u8; ADIANTUM_TWEAK_BYTES]) -> u128 {
        let mut h = [0u8; 16 + ADIANTUM_TWEAK_BYTES];
        h[..8].copy_from_slice(&(bulk_bytes as u64 * 8).to_le_bytes());
        h[16..].copy_from_slice(tweak);
        let mut poly = Poly::new(&self.keys.header_r);
        poly.blocks(&h);
        poly.finish()
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
        header_r: poly_key(r).expect("16-byte r"),
        message_r: poly_key(r).expect("16-byte r"),
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

/// The Poly1305 here against RustCrypto's `poly1305` (a test reference), random r and blocks,
/// with s = 0.
#[cfg(test)]
#[test]
fn poly1305_matches_rustcrypto() {
    use poly1305::universal_hash::{KeyInit as _, UniversalHash as _};
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed as u8
    };
    for blocks in [0usize, 1, 2, 3, 4, 5, 8, 17, 64] {
        for _ in 0..20 {
            let r: [u8; 16] = std::array::from_fn(|_| next());
            let data: Vec<u8> = (0..16 * blocks).map(|_| next()).collect();
            let mut key = [0u8; 32];
            key[..16].copy_from_slice(&r);
            let mut reference = poly1305::Poly1305::new((&key).into());
            reference.update_padded(&data);
            let want = u128::from_le_bytes(reference.finalize().into());
            let mut p = Poly::new(&PolyKey::new(&r));
            p.blocks(&data);
            assert_eq!(p.finish(), want, "{blocks} blocks");
        }
    }
    // All-ones blocks with an all-ones r: h lands at or above 2^130 - 5 in the final reduction.
    let mut key = [0u8; 32];
    key[..16].copy_from_slice(&[0xff; 16]);
    let data = [0xffu8; 16 * 9];
    let mut reference = poly1305::Poly1305::new((&key).into());
    reference.update_padded(&data);
    let mut p = Poly::new(&PolyKey::new(&[0xff; 16]));
    p.blocks(&data);
    assert_eq!(p.finish(), u128::from_le_bytes(reference.finalize().into()));
}
