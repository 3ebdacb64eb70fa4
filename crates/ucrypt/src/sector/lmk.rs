//! dm-crypt's `lmk` IV over CBC with 64 keys: loop-AES's multi-key mode, as the kernel's
//! `aes:64-cbc-lmk` mapping does it (crypt_iv_lmk_* in dm-crypt.c).
//!
//! Sector `n` (512-byte units, IV offset added) is encrypted with key `n mod 64`. Its IV is
//! the raw MD5 state (no padding, no length: every input is whole 64-byte blocks) after the
//! optional 64-byte seed block, plaintext bytes 16..512 of the sector, and 16 bytes of the
//! sector number (56 bits, a marker bit and the constant 4024). Encryption computes it from
//! the plaintext; decryption decrypts with a zero IV, computes it from the plaintext's bytes
//! 16..512 (which CBC recovers without the IV) and XORs it into the first block.
//!
//! The key is 64 equal subkeys, or 65 equal parts whose last (loop-AES v3's seed line) gives
//! the seed: its first 16 bytes, zero padded to 64.

use super::modes::BlockMode;
use super::spec::BlockCipher;
use crate::{Error, Result};

/// The number of keys of loop-AES's multi-key mode (dm-crypt's `:64`).
pub const LMK_KEYS: usize = 64;
const SEED_BYTES: usize = 64;
const SEED_USED_BYTES: usize = 16;
const SECTOR_BYTES: usize = 512;

pub(crate) struct Lmk {
    keys: Vec<BlockMode>,
    /// The seed block, zero padded (the kernel's LMK_SEED_SIZE).
    seed: Option<[u8; SEED_BYTES]>,
}

impl Drop for Lmk {
    fn drop(&mut self) {
        if let Some(s) = self.seed.as_mut() {
            zeroize::Zeroize::zeroize(s);
        }
    }
}

impl Lmk {
    pub(crate) fn new(cipher: BlockCipher, key: &[u8]) -> Result<Self> {
        let (parts, seeded) = if key.len() % LMK_KEYS == 0 {
            (LMK_KEYS, false)
        } else {
            (LMK_KEYS + 1, true)
        };
        let sub = key.len() / parts;
        if sub * parts != key.len() || sub < SEED_USED_BYTES {
            return Err(Error::Bug("lmk key not 64 or 65 equal parts"));
        }
        let keys = key[..sub * LMK_KEYS]
            .chunks_exact(sub)
            .map(|k| BlockMode::cbc(cipher, k))
            .collect::<Result<Vec<_>>>()?;
        let seed = seeded.then(|| {
            let mut s = [0u8; SEED_BYTES];
            let at = sub * LMK_KEYS;
            s[..SEED_USED_BYTES].copy_from_slice(&key[at..at + SEED_USED_BYTES]);
            s
        });
        Ok(Lmk { keys, seed })
    }

    /// The IV of a 512-byte sector whose plaintext is `plain`.
    fn iv(&self, sector: u64, plain: &[u8]) -> [u8; 16] {
        let mut state = MD5_INIT;
        if let Some(seed) = &self.seed {
            md5_compress(&mut state, seed);
        }
        for block in plain[16..SECTOR_BYTES - 16].chunks_exact(64) {
            md5_compress(&mut state, block);
        }
        // The last block: plaintext bytes 464..512, then the sector number's 16 bytes.
        let mut last = [0u8; 64];
        last[..48].copy_from_slice(&plain[SECTOR_BYTES - 48..]);
        last[48..52].copy_from_slice(&(sector as u32).to_le_bytes());
        let high = ((sector >> 32) as u32 & 0x00FF_FFFF) | 0x8000_0000;
        last[52..56].copy_from_slice(&high.to_le_bytes());
        last[56..60].copy_from_slice(&4024u32.to_le_bytes());
        md5_compress(&mut state, &last);
        zeroize::Zeroize::zeroize(&mut last);
        let mut iv = [0u8; 16];
        for (w, out) in state.iter().zip(iv.chunks_exact_mut(4)) {
            out.copy_from_slice(&w.to_le_bytes());
        }
        iv
    }

    /// One 512-byte sector in place; `sector` is its IV sector (512-byte units).
    pub(crate) fn crypt(&mut self, encrypt: bool, sector: u64, data: &mut [u8]) -> Result<()> {
        if data.len() != SECTOR_BYTES {
            return Err(Error::Bug("lmk given a unit other than 512 bytes"));
        }
        let k = (sector % LMK_KEYS as u64) as usize;
        if encrypt {
            let mut iv = self.iv(sector, data);
            self.keys[k].crypt(true, &iv, data)?;
            zeroize::Zeroize::zeroize(&mut iv);
        } else {
            self.keys[k].crypt(false, &[0u8; 16], data)?;
            let mut iv = self.iv(sector, data);
            for (d, x) in data[..16].iter_mut().zip(&iv) {
                *d ^= x;
            }
            zeroize::Zeroize::zeroize(&mut iv);
        }
        Ok(())
    }
}

const MD5_INIT: [u32; 4] = [0x6745_2301, 0xefcd_ab89, 0x98ba_dcfe, 0x1032_5476];

const MD5_SHIFTS: [u32; 16] = [7, 12, 17, 22, 5, 9, 14, 20, 4, 11, 16, 23, 6, 10, 15, 21];

/// MD5's constants: floor(|sin(i + 1)| * 2^32) (RFC 1321 section 3.4).
const MD5_K: [u32; 64] = [
    0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
    0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
    0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
    0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
    0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
    0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
    0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
    0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391,
];

/// One MD5 compression of a 64-byte block into `state`.
pub(crate) fn md5_compress(state: &mut [u32; 4], block: &[u8]) {
    let mut m = [0u32; 16];
    for (w, c) in m.iter_mut().zip(block.chunks_exact(4)) {
        *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    let [mut a, mut b, mut c, mut d] = *state;
    for i in 0..64 {
        let (f, g) = match i / 16 {
            0 => ((b & c) | (!b & d), i),
            1 => ((d & b) | (!d & c), (5 * i + 1) % 16),
            2 => (b ^ c ^ d, (3 * i + 5) % 16),
            _ => (c ^ (b | !d), (7 * i) % 16),
        };
        let s = MD5_SHIFTS[(i / 16) * 4 + i % 4];
        let t = a
            .wrapping_add(f)
            .wrapping_add(MD5_K[i])
            .wrapping_add(m[g])
            .rotate_left(s);
        a = d;
        d = c;
        c = b;
        b = b.wrapping_add(t);
    }
    state[0] = state[0].wrapping_add(a);
    state[1] = state[1].wrapping_add(b);
    state[2] = state[2].wrapping_add(c);
    state[3] = state[3].wrapping_add(d);
    zeroize::Zeroize::zeroize(&mut m);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Full MD5 (with padding) from the compression function, for the known answers.
    fn md5(msg: &[u8]) -> [u8; 16] {
        let mut data = msg.to_vec();
        data.push(0x80);
        while data.len() % 64 != 56 {
            data.push(0);
        }
        data.extend_from_slice(&((msg.len() as u64) * 8).to_le_bytes());
        let mut s = MD5_INIT;
        for b in data.chunks_exact(64) {
            md5_compress(&mut s, b);
        }
        let mut out = [0u8; 16];
        for (w, o) in s.iter().zip(out.chunks_exact_mut(4)) {
            o.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    use crate::test_util::hex;

    #[test]
    fn md5_known_answers() {
        // RFC 1321 appendix A.5.
        assert_eq!(hex(&md5(b"")), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hex(&md5(b"abc")), "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(
            hex(&md5(
                b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"
            )),
            "57edf4a22be3c955ac49da2e2107b67a"
        );
    }

    #[test]
    fn round_trip_and_key_choice() {
        for (len, seeded) in [(1024, false), (1040, true), (2048, false), (2080, true)] {
            let key: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let mut lmk = Lmk::new(BlockCipher::Aes, &key).unwrap();
            assert_eq!(lmk.seed.is_some(), seeded);
            let plain: Vec<u8> = (0..512).map(|i| (i * 13) as u8).collect();
            let mut a = plain.clone();
            lmk.crypt(true, 5, &mut a).unwrap();
            assert_ne!(a, plain);
            // Another sector, same key index (5 + 64): another IV, so other ciphertext.
            let mut b = plain.clone();
            lmk.crypt(true, 69, &mut b).unwrap();
            assert_ne!(a, b);
            lmk.crypt(false, 5, &mut a).unwrap();
            assert_eq!(a, plain);
            lmk.crypt(false, 69, &mut b).unwrap();
            assert_eq!(b, plain);
        }
        assert!(Lmk::new(BlockCipher::Aes, &[0; 1000]).is_err());
    }
}
