//! XTS, CBC and LRW over any [`Ecb`] block cipher, one data unit (sector) per call, as the
//! kernel's `xts`, `cbc` and `lrw` templates compute them. AES-XTS and AES-CBC keep their
//! AWS-LC paths in `mod.rs`; these serve serpent, twofish, camellia and LRW.
//!
//! XTS and LRW are "tweak, ECB, tweak": the per-block tweaks of a sector are computed first
//! into a scratch buffer, so the cipher sees the whole sector in one call.

use zeroize::Zeroize;

use super::block::{Ecb, BLOCK_BYTES};
use super::spec::BlockCipher;
use super::SECTOR_BYTES_MAX;
use crate::secret::SecretBox;
use crate::{Error, Result};

/// Multiplication by x in GF(2^128) on a 128-bit integer whose bit i is the coefficient of x^i,
/// reduced by x^128 + x^7 + x^2 + x + 1 (`0x87`). XTS applies it to the tweak read as a
/// little-endian integer, LRW (the kernel's "bbe" convention) to one read big-endian.
#[inline(always)]
pub(crate) fn gf128_mul_x(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

/// LRW's tweak key K2 as multiples: `powers[j]` = K2·x^j, and `ones[k]` = K2·(x^0 + … + x^k),
/// the step from the tweak of block index I to that of I + 1 when I ends in k one-bits (the
/// kernel's `mulinc` table).
struct LrwKey {
    powers: [u128; 128],
    ones: [u128; 128],
}

impl Drop for LrwKey {
    fn drop(&mut self) {
        self.powers.zeroize();
        self.ones.zeroize();
    }
}

impl LrwKey {
    fn new(tweak_key: &[u8; 16]) -> Self {
        let mut k = LrwKey {
            powers: [0; 128],
            ones: [0; 128],
        };
        let mut p = u128::from_be_bytes(*tweak_key);
        let mut acc = 0u128;
        for j in 0..128 {
            k.powers[j] = p;
            acc ^= p;
            k.ones[j] = acc;
            p = gf128_mul_x(p);
        }
        p.zeroize();
        acc.zeroize();
        k
    }

    /// K2·i. The bits of `i` (a block index, from the sector number) are public; the table
    /// entries are read by index, never branched on.
    fn mul(&self, i: u128) -> u128 {
        let mut r = 0u128;
        let mut bits = i;
        while bits != 0 {
            let j = bits.trailing_zeros() as usize;
            r ^= self.powers[j];
            bits &= bits - 1;
        }
        r
    }
}

enum Chain {
    /// The second key half's cipher, which encrypts the IV into the first tweak.
    Xts(Ecb),
    Cbc,
    Lrw(SecretBox<LrwKey>),
}

/// A block mode keyed for one volume.
pub(crate) struct BlockMode {
    chain: Chain,
    data: Ecb,
    /// XTS/LRW: the tweak of every block of the current sector. CBC decryption: the
    /// ciphertext of the current sector (each block's chaining value).
    scratch: Box<[u8; SECTOR_BYTES_MAX as usize]>,
}

impl BlockMode {
    pub(crate) fn xts(cipher: BlockCipher, key: &[u8]) -> Result<Self> {
        let half = key.len() / 2;
        Ok(BlockMode {
            chain: Chain::Xts(Ecb::new(cipher, &key[half..])?),
            data: Ecb::new(cipher, &key[..half])?,
            scratch: Box::new([0; SECTOR_BYTES_MAX as usize]),
        })
    }

    pub(crate) fn cbc(cipher: BlockCipher, key: &[u8]) -> Result<Self> {
        Ok(BlockMode {
            chain: Chain::Cbc,
            data: Ecb::new(cipher, key)?,
            scratch: Box::new([0; SECTOR_BYTES_MAX as usize]),
        })
    }

    /// `key` is the cipher key followed by the 16-byte tweak key, as the kernel's lrw takes it.
    pub(crate) fn lrw(cipher: BlockCipher, key: &[u8]) -> Result<Self> {
        let split = key
            .len()
            .checked_sub(BLOCK_BYTES)
            .ok_or(Error::Bug("LRW key shorter than its tweak key"))?;
        let tweak_key: &[u8; 16] = key[split..]
            .try_into()
            .map_err(|_| Error::Bug("16-byte LRW tweak key"))?;
        Ok(BlockMode {
            chain: Chain::Lrw(SecretBox::new(LrwKey::new(tweak_key))),
            data: Ecb::new(cipher, &key[..split])?,
            scratch: Box::new([0; SECTOR_BYTES_MAX as usize]),
        })
    }

    /// One data unit in place with its IV. `data` is whole blocks, at most `SECTOR_BYTES_MAX`.
    pub(crate) fn crypt(&mut self, encrypt: bool, iv: &[u8; 16], data: &mut [u8]) -> Result<()> {
        if data.len() % BLOCK_BYTES != 0 || data.len() > self.scratch.len() {
            return Err(Error::Bug(
                "block mode given a partial block or an oversized unit",
            ));
        }
        let scratch = &mut self.scratch[..data.len()];
        match &mut self.chain {
            Chain::Xts(k2) => {
                let mut t0 = *iv;
                k2.encrypt_block(&mut t0)?;
                let mut t = u128::from_le_bytes(t0);
                for tw in scratch.chunks_exact_mut(BLOCK_BYTES) {
                    tw.copy_from_slice(&t.to_le_bytes());
                    t = gf128_mul_x(t);
                }
                tweak_ecb_tweak(&mut self.data, encrypt, scratch, data)
            }
            Chain::Lrw(k) => {
                let mut i = u128::from_be_bytes(*iv);
                let mut t = k.mul(i);
                for tw in scratch.chunks_exact_mut(BLOCK_BYTES) {
                    tw.copy_from_slice(&t.to_be_bytes());
                    // I ^ (I + 1) has trailing_ones(I) + 1 low bits set (all 128 when I wraps).
                    t ^= k.ones[(i.trailing_ones() as usize).min(127)];
                    i = i.wrapping_add(1);
                }
                tweak_ecb_tweak(&mut self.data, encrypt, scratch, data)
            }
            Chain::Cbc if encrypt => {
                let mut prev = *iv;
                for b in data.chunks_exact_mut(BLOCK_BYTES) {
                    let block: &mut [u8; 16] =
                        b.try_into().map_err(|_| Error::Bug("16-byte chunk"))?;
                    xor_into(block, &prev);
                    self.data.encrypt_block(block)?;
                    prev = *block;
                }
                Ok(())
            }
            Chain::Cbc => {
                // Every block decrypts on its own; the chaining values are the ciphertext.
                scratch.copy_from_slice(data);
                self.data.decrypt(data)?;
                let (first, rest) = data.split_at_mut(BLOCK_BYTES);
                xor_into(first, iv);
                for (b, c) in rest
                    .chunks_exact_mut(BLOCK_BYTES)
                    .zip(scratch.chunks_exact(BLOCK_BYTES))
                {
                    xor_into(b, c);
                }
                Ok(())
            }
        }
    }
}

#[inline(always)]
fn xor_into(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d ^= s;
    }
}

/// `data ^= tweaks; data = E/D(data); data ^= tweaks`, the ECB call over the whole unit.
#[inline]
fn tweak_ecb_tweak(ecb: &mut Ecb, encrypt: bool, tweaks: &[u8], data: &mut [u8]) -> Result<()> {
    xor_into(data, tweaks);
    if encrypt {
        ecb.encrypt(data)?;
    } else {
        ecb.decrypt(data)?;
    }
    xor_into(data, tweaks);
    Ok(())
}
