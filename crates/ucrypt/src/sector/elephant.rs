//! AES-CBC with the Elephant diffuser: BitLocker's cipher before Windows 8, as dm-crypt's
//! `elephant` IV generator computes it (`aes-cbc-elephant`).
//!
//! The key is two equal halves: the CBC key (whose eboiv IV `SectorCipher` computes) and the
//! sector key's AES key. Writing a sector: XOR a 32-byte sector key (the AES encryption of the
//! sector's byte offset, and of the same with its last byte 0x80) into every 32 bytes, run
//! diffuser A then diffuser B over the sector as little-endian 32-bit words, then CBC. Reading
//! undoes the three steps in the other order.

use zeroize::Zeroize;

use super::block::Ecb;
use super::evp::{Alg, EvpCtx};
use super::spec::BlockCipher;
use crate::{Error, Result};

/// Bytes of the sector key XORed, repeated, over each sector.
const SECTOR_KEY_BYTES: usize = 32;
/// Diffuser A's and B's rounds over a sector.
const DIFFUSER_A_ROUNDS: usize = 5;
const DIFFUSER_B_ROUNDS: usize = 3;

pub(crate) struct Elephant {
    cbc_enc: EvpCtx,
    cbc_dec: EvpCtx,
    sector_key: Ecb,
}

impl Elephant {
    /// `key`: the CBC key then the elephant key, equal halves (32 or 64 bytes in all; the spec
    /// checked the length).
    pub(crate) fn new(key: &[u8]) -> Result<Self> {
        let half = key.len() / 2;
        Ok(Elephant {
            cbc_enc: EvpCtx::new(Alg::AesCbc, &key[..half], true)?,
            cbc_dec: EvpCtx::new(Alg::AesCbc, &key[..half], false)?,
            sector_key: Ecb::new(BlockCipher::Aes, &key[half..])?,
        })
    }

    /// One sector in place. `iv` holds the eboiv IV in its first 16 bytes and the sector's
    /// byte offset, little-endian, in bytes 16..24 (`SectorCipher::iv` puts it there).
    pub(crate) fn crypt(&mut self, encrypt: bool, iv: &[u8; 32], data: &mut [u8]) -> Result<()> {
        if data.len() % SECTOR_KEY_BYTES != 0 || data.is_empty() {
            return Err(Error::Bug("elephant given a partial sector"));
        }
        let cbc_iv: &[u8; 16] = iv[..16].try_into().map_err(|_| Error::Bug("16-byte IV"))?;
        let mut ks = [0u8; SECTOR_KEY_BYTES];
        ks[..8].copy_from_slice(&iv[16..24]);
        ks[16..24].copy_from_slice(&iv[16..24]);
        ks[31] = 0x80;
        self.sector_key.encrypt(&mut ks)?;
        if encrypt {
            xor_sector_key(data, &ks);
            with_words(data, |w| {
                diffuser_a_encrypt(w);
                diffuser_b_encrypt(w);
            });
            self.cbc_enc.set_iv(cbc_iv)?;
            self.cbc_enc.update_in_place(data)?;
        } else {
            self.cbc_dec.set_iv(cbc_iv)?;
            self.cbc_dec.update_in_place(data)?;
            with_words(data, |w| {
                diffuser_b_decrypt(w);
                diffuser_a_decrypt(w);
            });
            xor_sector_key(data, &ks);
        }
        ks.zeroize();
        Ok(())
    }
}

fn xor_sector_key(data: &mut [u8], ks: &[u8; SECTOR_KEY_BYTES]) {
    for chunk in data.chunks_exact_mut(SECTOR_KEY_BYTES) {
        for (d, k) in chunk.iter_mut().zip(ks) {
            *d ^= k;
        }
    }
}

/// Runs `f` over the sector as little-endian 32-bit words (at most a 4096-byte sector).
fn with_words(data: &mut [u8], f: impl FnOnce(&mut [u32])) {
    let mut words = [0u32; super::SECTOR_BYTES_MAX as usize / 4];
    let n = (data.len() / 4).min(words.len());
    for (w, b) in words.iter_mut().zip(data.chunks_exact(4)) {
        *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    f(&mut words[..n]);
    for (w, b) in words.iter().zip(data.chunks_exact_mut(4)) {
        b.copy_from_slice(&w.to_le_bytes());
    }
    words.zeroize();
}

/// Diffuser A's rotation of the third word, by the position of the word changed (mod 4).
fn rot_a(i: usize, x: u32) -> u32 {
    match i % 4 {
        0 => x.rotate_left(9),
        2 => x.rotate_left(13),
        _ => x,
    }
}

fn rot_b(i: usize, x: u32) -> u32 {
    match i % 4 {
        1 => x.rotate_left(10),
        3 => x.rotate_left(25),
        _ => x,
    }
}

// Each diffuser step changes word i from words i-2 and i-5 (A) or i+2 and i+5 (B), indices mod
// the word count; decryption walks up and adds, encryption walks down and subtracts.
fn diffuser_a_decrypt(d: &mut [u32]) {
    let n = d.len();
    for _ in 0..DIFFUSER_A_ROUNDS {
        for i in 0..n {
            let v = d[(i + n - 2) % n] ^ rot_a(i, d[(i + n - 5) % n]);
            d[i] = d[i].wrapping_add(v);
        }
    }
}

fn diffuser_a_encrypt(d: &mut [u32]) {
    let n = d.len();
    for _ in 0..DIFFUSER_A_ROUNDS {
        for i in (0..n).rev() {
            let v = d[(i + n - 2) % n] ^ rot_a(i, d[(i + n - 5) % n]);
            d[i] = d[i].wrapping_sub(v);
        }
    }
}

fn diffuser_b_decrypt(d: &mut [u32]) {
    let n = d.len();
    for _ in 0..DIFFUSER_B_ROUNDS {
        for i in 0..n {
            let v = d[(i + 2) % n] ^ rot_b(i, d[(i + 5) % n]);
            d[i] = d[i].wrapping_add(v);
        }
    }
}

fn diffuser_b_encrypt(d: &mut [u32]) {
    let n = d.len();
    for _ in 0..DIFFUSER_B_ROUNDS {
        for i in (0..n).rev() {
            let v = d[(i + 2) % n] ^ rot_b(i, d[(i + 5) % n]);
            d[i] = d[i].wrapping_sub(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diffusers_invert() {
        for n in [128usize, 1024] {
            let orig: Vec<u32> = (0..n as u32)
                .map(|i| i.wrapping_mul(0x9e37_79b9) ^ 0x1234_5678)
                .collect();
            let mut d = orig.clone();
            diffuser_a_encrypt(&mut d);
            diffuser_b_encrypt(&mut d);
            assert_ne!(d, orig);
            diffuser_b_decrypt(&mut d);
            diffuser_a_decrypt(&mut d);
            assert_eq!(d, orig);
        }
    }

    #[test]
    fn sector_round_trip_depends_on_offset() {
        let key: Vec<u8> = (0..64u8).collect();
        let mut e = Elephant::new(&key).unwrap();
        let plain: Vec<u8> = (0..512u32).map(|i| (i * 7) as u8).collect();
        let mut iv = [0u8; 32];
        iv[16..24].copy_from_slice(&4096u64.to_le_bytes());
        let mut a = plain.clone();
        e.crypt(true, &iv, &mut a).unwrap();
        let mut iv2 = iv;
        iv2[16..24].copy_from_slice(&4608u64.to_le_bytes());
        let mut b = plain.clone();
        e.crypt(true, &iv2, &mut b).unwrap();
        assert_ne!(a, b);
        e.crypt(false, &iv, &mut a).unwrap();
        assert_eq!(a, plain);
    }
}
