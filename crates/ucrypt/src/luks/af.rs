//! Anti-forensic information splitter (LUKS1 spec section 2.4, used unchanged by LUKS2).
//!
//! A key of `n` bytes becomes `stripes` blocks of `n` bytes: all but the last are random, and
//! the last is the key XORed with a hash diffusion of the XOR-chain of the others. Destroying
//! any one stripe destroys the key. Diffusion hashes the buffer in hash-sized pieces, each
//! prefixed with its big-endian 32-bit index; a short tail piece keeps only its length.

use super::util::{random_fill, HashAlg};
use crate::{Result, SecretBytes};

/// The stripe count every LUKS implementation writes; we refuse others (cryptsetup does too).
pub const AF_STRIPES: u32 = 4000;

fn diffuse(hash: HashAlg, buf: &mut [u8]) {
    let ds = hash.output_bytes();
    for (i, piece) in buf.chunks_mut(ds).enumerate() {
        let iv = (i as u32).to_be_bytes();
        let mut d = hash.digest(&[&iv, piece]);
        let n = piece.len();
        piece.copy_from_slice(&d[..n]);
        // The digest is derived from key material: wipe it.
        zeroize::Zeroize::zeroize(&mut d);
    }
}

fn xor_into(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d ^= s;
    }
}

/// Bytes of split material for a key, before rounding to 512-byte sectors.
pub fn split_bytes(key_bytes: usize, stripes: u32) -> usize {
    key_bytes * stripes as usize
}

/// Splits `key` into `stripes` stripes (`key.len() * stripes` bytes).
pub fn split(key: &[u8], stripes: u32, hash: HashAlg) -> Result<SecretBytes> {
    let n = key.len();
    let mut out = SecretBytes::zeroed(split_bytes(n, stripes));
    let mut acc = SecretBytes::zeroed(n);
    let stripes = stripes as usize;
    {
        let dst = out.as_mut();
        random_fill(&mut dst[..n * (stripes - 1)])?;
        for i in 0..stripes - 1 {
            xor_into(acc.as_mut(), &dst[i * n..(i + 1) * n]);
            diffuse(hash, acc.as_mut());
        }
        let last = &mut dst[(stripes - 1) * n..];
        last.copy_from_slice(key);
        xor_into(last, acc.as_ref());
    }
    Ok(out)
}

/// Recovers a `key_bytes` key from `material` (at least `key_bytes * stripes` bytes).
pub fn merge(material: &[u8], key_bytes: usize, stripes: u32, hash: HashAlg) -> SecretBytes {
    let n = key_bytes;
    let stripes = stripes as usize;
    let mut acc = SecretBytes::zeroed(n);
    for i in 0..stripes - 1 {
        xor_into(acc.as_mut(), &material[i * n..(i + 1) * n]);
        diffuse(hash, acc.as_mut());
    }
    xor_into(acc.as_mut(), &material[(stripes - 1) * n..stripes * n]);
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_merge_round_trip_every_hash_and_size() {
        for hash in [HashAlg::Sha1, HashAlg::Sha256, HashAlg::Sha512] {
            for n in [16usize, 32, 33, 64] {
                let key: Vec<u8> = (0..n as u8).collect();
                let m = split(&key, 40, hash).expect("split");
                assert_eq!(merge(m.as_ref(), n, 40, hash).as_ref(), &key[..]);
                // Any damaged stripe destroys the key.
                let mut bad = m.as_ref().to_vec();
                bad[0] ^= 1;
                assert_ne!(merge(&bad, n, 40, hash).as_ref(), &key[..]);
            }
        }
    }
}
