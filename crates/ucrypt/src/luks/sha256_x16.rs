//! SHA-256 of sixteen messages of one length at once, one message per 32-bit lane of AVX-512
//! registers: the checksums of a reencryption hotzone (one digest per checksum block, 16384 per
//! 64 MiB hotzone) are its largest CPU cost. One message at a time is bound by the SHA
//! extensions' one execution port (OpenSSL's SHA-256 is bound the same way, and interleaving
//! two messages through the port gains little); sixteen independent messages use the vector
//! units instead (the checksum rows of `bench reencrypt`, BENCHMARKS.md). The digests are
//! SHA-256's (the tests compare them with the `sha2` crate's); `sha2`
//! hashes everything else, and everything on a CPU without AVX-512.
//!
//! Messages are whole 64-byte blocks (checksum blocks are 512 to 4096 bytes), so the padding
//! is one block of its own.

/// Messages hashed at once.
pub const LANES: usize = 16;
/// Bytes of one SHA-256 block.
pub const BLOCK_BYTES: usize = 64;

/// SHA-256's initial hash value (FIPS 180-4, 5.3.3).
const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// SHA-256's round constants (FIPS 180-4, 4.2.2).
const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

/// Whether this CPU has what [`digest16`] needs.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The SHA-256 digest of each of `msgs` into `out`, or `false` (nothing written) where the
/// CPU lacks AVX-512 ([`available`]) or the messages are not of one length of whole
/// [`BLOCK_BYTES`] blocks.
pub fn digest16(msgs: &[&[u8]; LANES], out: &mut [[u8; 32]; LANES]) -> bool {
    let len = msgs[0].len();
    if len % BLOCK_BYTES != 0 || msgs.iter().any(|m| m.len() != len) || !available() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `available` checked AVX-512F and AVX-512BW, the features `x86::digest16` is
        // compiled for; the lengths were checked above.
        unsafe { x86::digest16(msgs, out) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The padding block of a message of `len` bytes that ends on a block boundary: 0x80, zeros,
/// the length in bits, big-endian.
fn padding(len: usize) -> [u8; BLOCK_BYTES] {
    let mut p = [0u8; BLOCK_BYTES];
    p[0] = 0x80;
    p[56..].copy_from_slice(&((len as u64) * 8).to_be_bytes());
    p
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{padding, BLOCK_BYTES, H0, K, LANES};

    /// # Safety
    /// The CPU must have AVX-512F and AVX-512BW ([`super::available`]); every message has the
    /// same length,
    /// a multiple of [`BLOCK_BYTES`].
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn digest16(msgs: &[&[u8]; LANES], out: &mut [[u8; 32]; LANES]) {
        let len = msgs[0].len();
        assert!(
            len % BLOCK_BYTES == 0 && msgs.iter().all(|m| m.len() == len),
            "messages of whole blocks, one length"
        );
        let mut st = H0.map(|h| _mm512_set1_epi32(h as i32));
        for at in (0..len).step_by(BLOCK_BYTES) {
            compress(&mut st, &msgs.map(|m| &m[at..at + BLOCK_BYTES]));
        }
        let pad = padding(len);
        compress(&mut st, &[&pad[..]; LANES]);
        for (i, v) in st.iter().enumerate() {
            for (lane, word) in lanes(*v).into_iter().enumerate() {
                out[lane][4 * i..4 * i + 4].copy_from_slice(&word.to_be_bytes());
            }
        }
    }

    /// The sixteen 32-bit lanes of `v`, low to high.
    #[target_feature(enable = "avx512f")]
    fn lanes(v: __m512i) -> [u32; LANES] {
        let mut w = [0u32; LANES];
        // SAFETY: `w` is 64 writable bytes; the store is unaligned.
        unsafe { _mm512_storeu_si512(w.as_mut_ptr().cast(), v) };
        w
    }

    /// The sixteen message words of each lane's block, word `j` of lane `i` in lane `i` of
    /// vector `j`: each block loaded as one vector of big-endian words, then the 16 × 16
    /// matrix of words transposed (pairs of words, then of pairs, then of 128-bit quarters).
    #[target_feature(enable = "avx512f,avx512bw")]
    fn words(blocks: &[&[u8]; LANES]) -> [__m512i; 16] {
        let swap = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
        let r: [__m512i; 16] = std::array::from_fn(|i| {
            let b: &[u8; BLOCK_BYTES] = blocks[i][..BLOCK_BYTES].try_into().expect("one block");
            // SAFETY: `b` is 64 readable bytes; the load is unaligned.
            let v = unsafe { _mm512_loadu_si512(b.as_ptr().cast()) };
            _mm512_shuffle_epi8(v, swap)
        });
        // t: words 0,1 of rows 2p and 2p+1 interleaved (and 4,5, ...), then words 2,3.
        let t: [__m512i; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        // u[4g + k]: in each 128-bit quarter q, word 4q + k of rows 4g..4g+4.
        let u: [__m512i; 16] = std::array::from_fn(|i| {
            let (g, k) = (i / 4, i % 4);
            let (a, b) = (t[4 * g + k / 2], t[4 * g + 2 + k / 2]);
            if k % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        // Word 4q + k: quarter q of u[k], u[4 + k], u[8 + k], u[12 + k].
        let mut w = [_mm512_setzero_si512(); 16];
        for k in 0..4 {
            let lo01 = _mm512_shuffle_i32x4::<0x44>(u[k], u[4 + k]);
            let hi01 = _mm512_shuffle_i32x4::<0x44>(u[8 + k], u[12 + k]);
            let lo23 = _mm512_shuffle_i32x4::<0xee>(u[k], u[4 + k]);
            let hi23 = _mm512_shuffle_i32x4::<0xee>(u[8 + k], u[12 + k]);
            w[k] = _mm512_shuffle_i32x4::<0x88>(lo01, hi01);
            w[4 + k] = _mm512_shuffle_i32x4::<0xdd>(lo01, hi01);
            w[8 + k] = _mm512_shuffle_i32x4::<0x88>(lo23, hi23);
            w[12 + k] = _mm512_shuffle_i32x4::<0xdd>(lo23, hi23);
        }
        w
    }

    #[target_feature(enable = "avx512f")]
    fn add(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }

    /// a ^ b ^ c.
    #[target_feature(enable = "avx512f")]
    fn xor3(a: __m512i, b: __m512i, c: __m512i) -> __m512i {
        _mm512_ternarylogic_epi32::<0x96>(a, b, c)
    }

    /// One 64-byte block of each lane's message into the state (FIPS 180-4, 6.2.2), the
    /// message schedule kept as the last sixteen words.
    #[target_feature(enable = "avx512f,avx512bw")]
    fn compress(st: &mut [__m512i; 8], blocks: &[&[u8]; LANES]) {
        let mut w = words(blocks);
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = *st;
        for t in 0..64 {
            let wt = if t < 16 {
                w[t]
            } else {
                let (w15, w2) = (w[(t + 1) % 16], w[(t + 14) % 16]);
                let s0 = xor3(
                    _mm512_ror_epi32::<7>(w15),
                    _mm512_ror_epi32::<18>(w15),
                    _mm512_srli_epi32::<3>(w15),
                );
                let s1 = xor3(
                    _mm512_ror_epi32::<17>(w2),
                    _mm512_ror_epi32::<19>(w2),
                    _mm512_srli_epi32::<10>(w2),
                );
                w[t % 16] = add(add(w[t % 16], s0), add(w[(t + 9) % 16], s1));
                w[t % 16]
            };
            let big_s1 = xor3(
                _mm512_ror_epi32::<6>(e),
                _mm512_ror_epi32::<11>(e),
                _mm512_ror_epi32::<25>(e),
            );
            // Ch(e, f, g): e ? f : g.
            let ch = _mm512_ternarylogic_epi32::<0xca>(e, f, g);
            let t1 = add(
                add(h, big_s1),
                add(ch, add(_mm512_set1_epi32(K[t] as i32), wt)),
            );
            let big_s0 = xor3(
                _mm512_ror_epi32::<2>(a),
                _mm512_ror_epi32::<13>(a),
                _mm512_ror_epi32::<22>(a),
            );
            // Maj(a, b, c): at least two of three.
            let maj = _mm512_ternarylogic_epi32::<0xe8>(a, b, c);
            let t2 = add(big_s0, maj);
            h = g;
            g = f;
            f = e;
            e = add(d, t1);
            d = c;
            c = b;
            b = a;
            a = add(t1, t2);
        }
        for (s, v) in st.iter_mut().zip([a, b, c, d, e, f, g, h]) {
            *s = add(*s, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn digests_match_sha256() {
        if !available() {
            println!("SKIPPED: this CPU has no AVX-512");
            return;
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [0, 64, 128, 512, 960, 4096] {
            let msgs: Vec<Vec<u8>> = (0..LANES)
                .map(|_| {
                    (0..len)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            x as u8
                        })
                        .collect()
                })
                .collect();
            let refs: [&[u8]; LANES] = std::array::from_fn(|i| &msgs[i][..]);
            let mut out = [[0u8; 32]; LANES];
            assert!(digest16(&refs, &mut out), "len {len}");
            for (i, m) in msgs.iter().enumerate() {
                assert_eq!(out[i][..], Sha256::digest(m)[..], "len {len}, lane {i}");
            }
        }
        // The empty message: its padding block alone.
        let mut out = [[0u8; 32]; LANES];
        assert!(digest16(&[&[][..]; LANES], &mut out));
        assert_eq!(
            out[15]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn messages_that_do_not_fit_are_refused() {
        let mut out = [[0u8; 32]; LANES];
        let mut odd = [&[0u8; 64][..]; LANES];
        odd[3] = &[0u8; 128];
        assert!(!digest16(&odd, &mut out));
        assert!(!digest16(&[&[0u8; 65][..]; LANES], &mut out));
        assert_eq!(out, [[0u8; 32]; LANES], "nothing written");
    }
}
