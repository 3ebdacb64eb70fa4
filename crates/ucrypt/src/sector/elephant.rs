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
        if data.len() % SECTOR_KEY_BYTES != 0
            || data.is_empty()
            || data.len() > super::SECTOR_BYTES_MAX as usize
        {
            return Err(Error::Bug("elephant given a partial or oversized sector"));
        }
        let cbc_iv: &[u8; 16] = iv[..16].try_into().map_err(|_| Error::Bug("16-byte IV"))?;
        let mut ks = [0u8; SECTOR_KEY_BYTES];
        ks[..8].copy_from_slice(&iv[16..24]);
        ks[16..24].copy_from_slice(&iv[16..24]);
        ks[31] = 0x80;
        self.sector_key.encrypt(&mut ks)?;
        if encrypt {
            with_words(data, &ks, true, |w| {
                diffuser_a_encrypt(w);
                diffuser_b_encrypt(w);
            });
            self.cbc_enc.set_iv(cbc_iv)?;
            self.cbc_enc.update_in_place(data)?;
        } else {
            self.cbc_dec.set_iv(cbc_iv)?;
            self.cbc_dec.update_in_place(data)?;
            with_words(data, &ks, false, |w| {
                diffuser_b_decrypt(w);
                diffuser_a_decrypt(w);
            });
        }
        ks.zeroize();
        Ok(())
    }
}

/// 32-bit words per sector key.
const SECTOR_KEY_WORDS: usize = SECTOR_KEY_BYTES / 4;
/// 32-bit words of the largest sector.
const SECTOR_WORDS_MAX: usize = super::SECTOR_BYTES_MAX as usize / 4;

/// Diffuser A's and B's left rotations of the word read five positions away, by the position
/// (mod 4) of the word changed.
const ROT_A: [u32; 4] = [9, 0, 13, 0];
const ROT_B: [u32; 4] = [0, 10, 0, 25];

/// Runs `f` over the sector as little-endian 32-bit words, the sector key XORed in on the way
/// in (`key_in`) or on the way out (otherwise). The caller checked the sector's length: a
/// multiple of [`SECTOR_KEY_BYTES`], at most a 4096-byte sector.
fn with_words(
    data: &mut [u8],
    ks: &[u8; SECTOR_KEY_BYTES],
    key_in: bool,
    f: impl FnOnce(&mut [u32]),
) {
    let mut kw = [0u32; SECTOR_KEY_WORDS];
    for (w, b) in kw.iter_mut().zip(ks.chunks_exact(4)) {
        *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    let (mut key_a, mut key_b) = if key_in {
        (kw, [0; SECTOR_KEY_WORDS])
    } else {
        ([0; SECTOR_KEY_WORDS], kw)
    };
    let mut words = [0u32; SECTOR_WORDS_MAX];
    let n = (data.len() / 4).min(SECTOR_WORDS_MAX);
    let words = &mut words[..n];
    for (w8, b32) in words
        .chunks_exact_mut(SECTOR_KEY_WORDS)
        .zip(data.chunks_exact(SECTOR_KEY_BYTES))
    {
        for ((w, b), k) in w8.iter_mut().zip(b32.chunks_exact(4)).zip(&key_a) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) ^ k;
        }
    }
    f(words);
    for (w8, b32) in words
        .chunks_exact(SECTOR_KEY_WORDS)
        .zip(data.chunks_exact_mut(SECTOR_KEY_BYTES))
    {
        for ((w, b), k) in w8.iter().zip(b32.chunks_exact_mut(4)).zip(&key_b) {
            b.copy_from_slice(&(w ^ k).to_le_bytes());
        }
    }
    words.zeroize();
    kw.zeroize();
    key_a.zeroize();
    key_b.zeroize();
}

// Each diffuser step changes word i from words i-2 and i-5 (A) or i+2 and i+5 (B), indices mod
// the word count n (a multiple of 8, at least 8); decryption walks up and adds, encryption
// walks down and subtracts. Where a step reads words its own round has already changed, the
// steps form one chain: those loops carry the last five words changed in registers, seeded
// with the words the first steps read across the wrap (which the round has not reached yet).
// Where a step reads only words its round has not reached, the steps are independent; the
// few steps at the wrap then read words the round has changed and run on their own.

/// A decrypt: d[i] += d[i-2] ^ rot(d[i-5]), i upwards; every step reads changed words.
fn diffuser_a_decrypt(d: &mut [u32]) {
    let n = d.len();
    if n < 8 || n % 4 != 0 {
        return;
    }
    for _ in 0..DIFFUSER_A_ROUNDS {
        // The five words before word 0, cyclically: d[n-5] .. d[n-1].
        let (mut m5, mut m4, mut m3, mut m2, mut m1) =
            (d[n - 5], d[n - 4], d[n - 3], d[n - 2], d[n - 1]);
        for q in d.chunks_exact_mut(4) {
            let w0 = q[0].wrapping_add(m2 ^ m5.rotate_left(ROT_A[0]));
            let w1 = q[1].wrapping_add(m1 ^ m4.rotate_left(ROT_A[1]));
            let w2 = q[2].wrapping_add(w0 ^ m3.rotate_left(ROT_A[2]));
            let w3 = q[3].wrapping_add(w1 ^ m2.rotate_left(ROT_A[3]));
            q.copy_from_slice(&[w0, w1, w2, w3]);
            (m5, m4, m3, m2, m1) = (m1, w0, w1, w2, w3);
        }
    }
}

/// B encrypt: d[i] -= d[i+2] ^ rot(d[i+5]), i downwards; every step reads changed words.
fn diffuser_b_encrypt(d: &mut [u32]) {
    let n = d.len();
    if n < 8 || n % 4 != 0 {
        return;
    }
    for _ in 0..DIFFUSER_B_ROUNDS {
        // The five words after word n-1, cyclically: d[0] .. d[4].
        let (mut p1, mut p2, mut p3, mut p4, mut p5) = (d[0], d[1], d[2], d[3], d[4]);
        for q in d.chunks_exact_mut(4).rev() {
            let w3 = q[3].wrapping_sub(p2 ^ p5.rotate_left(ROT_B[3]));
            let w2 = q[2].wrapping_sub(p1 ^ p4.rotate_left(ROT_B[2]));
            let w1 = q[1].wrapping_sub(w3 ^ p3.rotate_left(ROT_B[1]));
            let w0 = q[0].wrapping_sub(w2 ^ p2.rotate_left(ROT_B[0]));
            q.copy_from_slice(&[w0, w1, w2, w3]);
            (p1, p2, p3, p4, p5) = (w0, w1, w2, w3, p1);
        }
    }
}

/// A encrypt: d[i] -= d[i-2] ^ rot(d[i-5]), i downwards. Steps 5..n read only words below
/// them, which the round has not reached; steps 4..0 read the changed top of the sector.
fn diffuser_a_encrypt(d: &mut [u32]) {
    let n = d.len();
    if n < 8 || n % 4 != 0 {
        return;
    }
    for _ in 0..DIFFUSER_A_ROUNDS {
        // Words 8..n in blocks of 4 from the top: block j reads d[j-5 .. j+2], below or
        // inside itself, all read before the block is written.
        for j in (8..n).step_by(4).rev() {
            let (lo, hi) = d.split_at_mut(j);
            let lo: &[u32; 8] = match lo[j - 8..].try_into() {
                Ok(a) => a,
                Err(_) => return,
            };
            let q = &mut hi[..4];
            // lo[k] is d[j-8+k]: d[i-2] is lo[i-j+6], d[i-5] is lo[i-j+3].
            let w0 = q[0].wrapping_sub(lo[6] ^ lo[3].rotate_left(ROT_A[0]));
            let w1 = q[1].wrapping_sub(lo[7] ^ lo[4].rotate_left(ROT_A[1]));
            let w2 = q[2].wrapping_sub(q[0] ^ lo[5].rotate_left(ROT_A[2]));
            let w3 = q[3].wrapping_sub(q[1] ^ lo[6].rotate_left(ROT_A[3]));
            q.copy_from_slice(&[w0, w1, w2, w3]);
        }
        for i in (0..8).rev() {
            let v = d[(i + n - 2) % n] ^ d[(i + n - 5) % n].rotate_left(ROT_A[i % 4]);
            d[i] = d[i].wrapping_sub(v);
        }
    }
}

/// B decrypt: d[i] += d[i+2] ^ rot(d[i+5]), i upwards. Steps 0..n-5 read only words above
/// them, which the round has not reached; steps n-5..n read the changed bottom of the sector.
fn diffuser_b_decrypt(d: &mut [u32]) {
    let n = d.len();
    if n < 8 || n % 4 != 0 {
        return;
    }
    for _ in 0..DIFFUSER_B_ROUNDS {
        // Words 0..n-8 in blocks of 4 from the bottom: block j reads d[j+2 .. j+9], inside or
        // above itself, all read before the block is written.
        for j in (0..n - 8).step_by(4) {
            let (lo, hi) = d.split_at_mut(j + 4);
            let q = &mut lo[j..];
            let hi: &[u32; 5] = match hi[..5].try_into() {
                Ok(a) => a,
                Err(_) => return,
            };
            // hi[k] is d[j+4+k]: d[i+2] is hi[i-j-2] (or q), d[i+5] is hi[i-j+1].
            let w0 = q[0].wrapping_add(q[2] ^ hi[1].rotate_left(ROT_B[0]));
            let w1 = q[1].wrapping_add(q[3] ^ hi[2].rotate_left(ROT_B[1]));
            let w2 = q[2].wrapping_add(hi[0] ^ hi[3].rotate_left(ROT_B[2]));
            let w3 = q[3].wrapping_add(hi[1] ^ hi[4].rotate_left(ROT_B[3]));
            q.copy_from_slice(&[w0, w1, w2, w3]);
        }
        for i in n - 8..n {
            let v = d[(i + 2) % n] ^ d[(i + 5) % n].rotate_left(ROT_B[i % 4]);
            d[i] = d[i].wrapping_add(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};

    /// The diffusers as the formulas state them (Ferguson, "AES-CBC + Elephant diffuser",
    /// section 4; dm-crypt's `crypt_iv_elephant`): one step per word, indices mod n.
    mod reference {
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

        pub(super) fn a_decrypt(d: &mut [u32]) {
            let n = d.len();
            for _ in 0..5 {
                for i in 0..n {
                    let v = d[(i + n - 2) % n] ^ rot_a(i, d[(i + n - 5) % n]);
                    d[i] = d[i].wrapping_add(v);
                }
            }
        }

        pub(super) fn a_encrypt(d: &mut [u32]) {
            let n = d.len();
            for _ in 0..5 {
                for i in (0..n).rev() {
                    let v = d[(i + n - 2) % n] ^ rot_a(i, d[(i + n - 5) % n]);
                    d[i] = d[i].wrapping_sub(v);
                }
            }
        }

        pub(super) fn b_decrypt(d: &mut [u32]) {
            let n = d.len();
            for _ in 0..3 {
                for i in 0..n {
                    let v = d[(i + 2) % n] ^ rot_b(i, d[(i + 5) % n]);
                    d[i] = d[i].wrapping_add(v);
                }
            }
        }

        pub(super) fn b_encrypt(d: &mut [u32]) {
            let n = d.len();
            for _ in 0..3 {
                for i in (0..n).rev() {
                    let v = d[(i + 2) % n] ^ rot_b(i, d[(i + 5) % n]);
                    d[i] = d[i].wrapping_sub(v);
                }
            }
        }

        /// A sector before CBC: the sector key XORed into every 32 bytes, then A, then B.
        pub(super) fn encrypt_sector(data: &mut [u8], ks: &[u8; 32]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b ^= ks[i % 32];
            }
            let mut w: Vec<u32> = data
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            a_encrypt(&mut w);
            b_encrypt(&mut w);
            for (b, w) in data.chunks_exact_mut(4).zip(&w) {
                b.copy_from_slice(&w.to_le_bytes());
            }
        }
    }

    /// A seeded generator; the seed is printed, and `UCRYPT_TEST_SEED` replays one.
    fn rng() -> rand::rngs::StdRng {
        let seed = std::env::var("UCRYPT_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(rand::random::<u64>);
        eprintln!("UCRYPT_TEST_SEED={seed}");
        rand::rngs::StdRng::seed_from_u64(seed)
    }

    /// Each optimised diffuser equals the reference on random sectors of 512 and 4096 bytes
    /// (and of the smallest sizes, where the wrap-around steps overlap).
    #[test]
    fn diffusers_match_reference() {
        let mut rng = rng();
        type Pair = (fn(&mut [u32]), fn(&mut [u32]), &'static str);
        let pairs: [Pair; 4] = [
            (diffuser_a_encrypt, reference::a_encrypt, "A encrypt"),
            (diffuser_a_decrypt, reference::a_decrypt, "A decrypt"),
            (diffuser_b_encrypt, reference::b_encrypt, "B encrypt"),
            (diffuser_b_decrypt, reference::b_decrypt, "B decrypt"),
        ];
        for bytes in [512usize, 4096, 32, 64, 96] {
            for _ in 0..20 {
                let orig: Vec<u32> = (0..bytes / 4).map(|_| rng.random()).collect();
                for (fast, slow, name) in pairs {
                    let (mut a, mut b) = (orig.clone(), orig.clone());
                    fast(&mut a);
                    slow(&mut b);
                    assert_eq!(a, b, "{name}, {bytes}-byte sector");
                }
            }
        }
    }

    /// The whole pre-CBC transform (sector key, A, B, as bytes) equals the reference, and
    /// the way back restores the sector.
    #[test]
    fn sector_transform_matches_reference() {
        let mut rng = rng();
        for bytes in [512usize, 4096] {
            for _ in 0..20 {
                let mut ks = [0u8; 32];
                rng.fill_bytes(&mut ks);
                let mut plain = vec![0u8; bytes];
                rng.fill_bytes(&mut plain);
                let mut want = plain.clone();
                reference::encrypt_sector(&mut want, &ks);
                let mut got = plain.clone();
                with_words(&mut got, &ks, true, |w| {
                    diffuser_a_encrypt(w);
                    diffuser_b_encrypt(w);
                });
                assert_eq!(got, want, "{bytes}-byte sector");
                with_words(&mut got, &ks, false, |w| {
                    diffuser_b_decrypt(w);
                    diffuser_a_decrypt(w);
                });
                assert_eq!(got, plain, "{bytes}-byte sector back");
            }
        }
    }

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
