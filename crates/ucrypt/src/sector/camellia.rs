//! Camellia (RFC 3713) with byte-indexed tables, as the kernel's `camellia_generic` and
//! OpenSSL's camellia compute it: the F function's S-boxes and its P function folded into four
//! 256-entry tables of 32-bit words, so a round is eight loads and a few XORs.
//! RustCrypto's `camellia` computes P with eight multiplications per round and runs several
//! times slower than OpenSSL; this one is proven equal to it, to the kernel's vectors and to
//! OpenSSL's camellia (tests), and to the kernel's dm-crypt in the VM.
//!
//! Like every table-driven cipher (the kernel's and OpenSSL's camellia included), table reads
//! are indexed by key-dependent bytes: a cache-timing side channel for a local attacker.

use zeroize::Zeroize;

/// RFC 3713's SBOX1; SBOX2, SBOX3 and SBOX4 are rotations of it (see [`sbox`]).
const SBOX1: [u8; 256] = [
    0x70, 0x82, 0x2c, 0xec, 0xb3, 0x27, 0xc0, 0xe5, 0xe4, 0x85, 0x57, 0x35, 0xea, 0x0c, 0xae, 0x41,
    0x23, 0xef, 0x6b, 0x93, 0x45, 0x19, 0xa5, 0x21, 0xed, 0x0e, 0x4f, 0x4e, 0x1d, 0x65, 0x92, 0xbd,
    0x86, 0xb8, 0xaf, 0x8f, 0x7c, 0xeb, 0x1f, 0xce, 0x3e, 0x30, 0xdc, 0x5f, 0x5e, 0xc5, 0x0b, 0x1a,
    0xa6, 0xe1, 0x39, 0xca, 0xd5, 0x47, 0x5d, 0x3d, 0xd9, 0x01, 0x5a, 0xd6, 0x51, 0x56, 0x6c, 0x4d,
    0x8b, 0x0d, 0x9a, 0x66, 0xfb, 0xcc, 0xb0, 0x2d, 0x74, 0x12, 0x2b, 0x20, 0xf0, 0xb1, 0x84, 0x99,
    0xdf, 0x4c, 0xcb, 0xc2, 0x34, 0x7e, 0x76, 0x05, 0x6d, 0xb7, 0xa9, 0x31, 0xd1, 0x17, 0x04, 0xd7,
    0x14, 0x58, 0x3a, 0x61, 0xde, 0x1b, 0x11, 0x1c, 0x32, 0x0f, 0x9c, 0x16, 0x53, 0x18, 0xf2, 0x22,
    0xfe, 0x44, 0xcf, 0xb2, 0xc3, 0xb5, 0x7a, 0x91, 0x24, 0x08, 0xe8, 0xa8, 0x60, 0xfc, 0x69, 0x50,
    0xaa, 0xd0, 0xa0, 0x7d, 0xa1, 0x89, 0x62, 0x97, 0x54, 0x5b, 0x1e, 0x95, 0xe0, 0xff, 0x64, 0xd2,
    0x10, 0xc4, 0x00, 0x48, 0xa3, 0xf7, 0x75, 0xdb, 0x8a, 0x03, 0xe6, 0xda, 0x09, 0x3f, 0xdd, 0x94,
    0x87, 0x5c, 0x83, 0x02, 0xcd, 0x4a, 0x90, 0x33, 0x73, 0x67, 0xf6, 0xf3, 0x9d, 0x7f, 0xbf, 0xe2,
    0x52, 0x9b, 0xd8, 0x26, 0xc8, 0x37, 0xc6, 0x3b, 0x81, 0x96, 0x6f, 0x4b, 0x13, 0xbe, 0x63, 0x2e,
    0xe9, 0x79, 0xa7, 0x8c, 0x9f, 0x6e, 0xbc, 0x8e, 0x29, 0xf5, 0xf9, 0xb6, 0x2f, 0xfd, 0xb4, 0x59,
    0x78, 0x98, 0x06, 0x6a, 0xe7, 0x46, 0x71, 0xba, 0xd4, 0x25, 0xab, 0x42, 0x88, 0xa2, 0x8d, 0xfa,
    0x72, 0x07, 0xb9, 0x55, 0xf8, 0xee, 0xac, 0x0a, 0x36, 0x49, 0x2a, 0x68, 0x3c, 0x38, 0xf1, 0xa4,
    0x40, 0x28, 0xd3, 0x7b, 0xbb, 0xc9, 0x43, 0xc1, 0x15, 0xe3, 0xad, 0xf4, 0x77, 0xc7, 0x80, 0x9e,
];

/// The key schedule constants Sigma1..Sigma6.
const SIGMA: [u64; 6] = [
    0xa09e_667f_3bcc_908b,
    0xb67a_e858_4caa_73b2,
    0xc6ef_372f_e94f_82be,
    0x54ff_53a5_f1d3_6f1c,
    0x10e5_27fa_de68_2d1d,
    0xb056_88c2_b3e6_c1fd,
];

/// SBOX1..SBOX4 of byte `x` (RFC 3713, 2.4.4: SBOX2 = SBOX1 <<< 1, SBOX3 = SBOX1 <<< 7,
/// SBOX4 = SBOX1(x <<< 1)).
const fn sbox(which: usize, x: u8) -> u8 {
    match which {
        1 => SBOX1[x as usize],
        2 => SBOX1[x as usize].rotate_left(1),
        3 => SBOX1[x as usize].rotate_left(7),
        _ => SBOX1[x.rotate_left(1) as usize],
    }
}

/// The S-boxes spread over 32-bit words in the patterns of the P function (OpenSSL's and the
/// kernel's tables): `SP[0]` = SBOX1 in bytes 1110 (most significant first), `SP[1]` = SBOX2
/// in 0222, `SP[2]` = SBOX3 in 3033, `SP[3]` = SBOX4 in 4404.
static SP: [[u32; 256]; 4] = {
    let mut t = [[0u32; 256]; 4];
    let mut x = 0;
    while x < 256 {
        let (s1, s2, s3, s4) = (
            sbox(1, x as u8) as u32,
            sbox(2, x as u8) as u32,
            sbox(3, x as u8) as u32,
            sbox(4, x as u8) as u32,
        );
        t[0][x] = (s1 << 24) | (s1 << 16) | (s1 << 8);
        t[1][x] = (s2 << 16) | (s2 << 8) | s2;
        t[2][x] = (s3 << 24) | (s3 << 8) | s3;
        t[3][x] = (s4 << 24) | (s4 << 16) | s4;
        x += 1;
    }
    t
};

/// F's S-box and P layers on an input already XORed with its round key: the two words
/// (t2, t3) from which F's output is (t2, ror(t3, 8) ^ t2). The eight lookups run as two
/// independent chains of four (OpenSSL's `Camellia_Feistel`), so a round's latency is one
/// chain, not eight dependent XORs.
#[inline(always)]
fn sp(t0: u32, t1: u32) -> (u32, u32) {
    let (a, b) = sp_halves(t0, t1);
    (a ^ b, b)
}

/// The two chains of F's lookups, uncombined: F's output is (a ^ b, ror(b, 8) ^ a ^ b).
#[inline(always)]
fn sp_halves(t0: u32, t1: u32) -> (u32, u32) {
    let b = |x: u32, n: u32| ((x >> n) & 0xff) as usize;
    let t3 = (SP[3][b(t0, 0)] ^ SP[2][b(t0, 8)]) ^ (SP[1][b(t0, 16)] ^ SP[0][b(t0, 24)]);
    let t2 = (SP[0][b(t1, 0)] ^ SP[3][b(t1, 8)]) ^ (SP[2][b(t1, 16)] ^ SP[1][b(t1, 24)]);
    (t2, t3)
}

/// One round on halves of two 32-bit big-endian words: `y ^= F(xk)` where `xk` is the other
/// half already XORed with this round's key, and returns `y ^ k_next`, the next round's keyed
/// input. `y ^ k_next` is computed while F's lookups are in flight, so the next round starts
/// without a key XOR on its critical path; each chain's result joins it with one XOR.
#[inline(always)]
fn round(xk: (u32, u32), y: &mut (u32, u32), k_next: u64) -> (u32, u32) {
    let pre = (y.0 ^ (k_next >> 32) as u32, y.1 ^ k_next as u32);
    let (a, b) = sp_halves(xk.0, xk.1);
    let b2 = b ^ b.rotate_right(8);
    y.0 ^= a ^ b;
    y.1 ^= a ^ b2;
    ((pre.0 ^ b) ^ a, (pre.1 ^ b2) ^ a)
}

/// F on a 64-bit half, for the key schedule.
fn f(x: u64, k: u64) -> u64 {
    let x = x ^ k;
    let (t2, t3) = sp((x >> 32) as u32, x as u32);
    (u64::from(t2) << 32) | u64::from(t3.rotate_right(8) ^ t2)
}

#[inline(always)]
fn fl(x: u64, k: u64) -> u64 {
    let (mut x1, mut x2) = ((x >> 32) as u32, x as u32);
    let (k1, k2) = ((k >> 32) as u32, k as u32);
    x2 ^= (x1 & k1).rotate_left(1);
    x1 ^= x2 | k2;
    (u64::from(x1) << 32) | u64::from(x2)
}

#[inline(always)]
fn fl_inv(y: u64, k: u64) -> u64 {
    let (mut y1, mut y2) = ((y >> 32) as u32, y as u32);
    let (k1, k2) = ((k >> 32) as u32, k as u32);
    y1 ^= y2 | k2;
    y2 ^= (y1 & k1).rotate_left(1);
    (u64::from(y1) << 32) | u64::from(y2)
}

/// The 64-bit halves of a 128-bit value rotated left by `n`.
fn rot(v: u128, n: u32) -> (u64, u64) {
    let r = v.rotate_left(n);
    ((r >> 64) as u64, r as u64)
}

/// One direction's subkeys in the order they are used: whitening in, one per round, a pair
/// per FL layer (after every sixth round), whitening out.
#[derive(Clone)]
struct Schedule {
    kw_in: [u64; 2],
    k: [u64; 24],
    ke: [u64; 6],
    kw_out: [u64; 2],
}

impl Zeroize for Schedule {
    fn zeroize(&mut self) {
        self.kw_in.zeroize();
        self.k.zeroize();
        self.ke.zeroize();
        self.kw_out.zeroize();
    }
}

/// A keyed Camellia: 18 rounds for 128-bit keys, 24 for 192 and 256.
pub(crate) struct Camellia {
    rounds: usize,
    enc: Schedule,
    dec: Schedule,
}

impl Drop for Camellia {
    fn drop(&mut self) {
        self.enc.zeroize();
        self.dec.zeroize();
    }
}

impl Camellia {
    /// `key`: 16, 24 or 32 bytes (checked by the caller: `BlockCipher::takes_key_bytes`).
    pub(crate) fn new(key: &[u8]) -> Option<Self> {
        let (kl, kr) = match key.len() {
            16 => (u128::from_be_bytes(key.try_into().ok()?), 0u128),
            24 => {
                let right = u64::from_be_bytes(key[16..24].try_into().ok()?);
                (
                    u128::from_be_bytes(key[..16].try_into().ok()?),
                    (u128::from(right) << 64) | u128::from(!right),
                )
            }
            32 => (
                u128::from_be_bytes(key[..16].try_into().ok()?),
                u128::from_be_bytes(key[16..].try_into().ok()?),
            ),
            _ => return None,
        };
        // KA and KB (RFC 3713, 2.2).
        let x = kl ^ kr;
        let (mut d1, mut d2) = ((x >> 64) as u64, x as u64);
        d2 ^= f(d1, SIGMA[0]);
        d1 ^= f(d2, SIGMA[1]);
        d1 ^= (kl >> 64) as u64;
        d2 ^= kl as u64;
        d2 ^= f(d1, SIGMA[2]);
        d1 ^= f(d2, SIGMA[3]);
        let ka = (u128::from(d1) << 64) | u128::from(d2);
        let x = ka ^ kr;
        let (mut d1, mut d2) = ((x >> 64) as u64, x as u64);
        d2 ^= f(d1, SIGMA[4]);
        d1 ^= f(d2, SIGMA[5]);
        let kb = (u128::from(d1) << 64) | u128::from(d2);

        let mut enc = Schedule {
            kw_in: [0; 2],
            k: [0; 24],
            ke: [0; 6],
            kw_out: [0; 2],
        };
        let pair = |v: u128, n: u32| -> [u64; 2] {
            let (h, l) = rot(v, n);
            [h, l]
        };
        enc.kw_in = pair(kl, 0);
        let rounds = if key.len() == 16 {
            // (source, rotation) of k1..k18 in pairs; k10 alone comes from another source
            // than its pair's first half (KL <<< 60, with k9 from KA <<< 45), set after.
            let ks: [(u128, u32); 9] = [
                (ka, 0),
                (kl, 15),
                (ka, 15),
                (kl, 45),
                (ka, 45),
                (ka, 60),
                (kl, 94),
                (ka, 94),
                (kl, 111),
            ];
            for (i, &(v, n)) in ks.iter().enumerate() {
                let [h, l] = pair(v, n);
                enc.k[2 * i] = h;
                enc.k[2 * i + 1] = l;
            }
            enc.k[9] = rot(kl, 60).1;
            let [a, b] = pair(ka, 30);
            let [c, d] = pair(kl, 77);
            enc.ke[..4].copy_from_slice(&[a, b, c, d]);
            enc.kw_out = pair(ka, 111);
            18
        } else {
            let ks: [(u128, u32); 12] = [
                (kb, 0),
                (kr, 15),
                (ka, 15),
                (kb, 30),
                (kl, 45),
                (ka, 45),
                (kr, 60),
                (kb, 60),
                (kl, 77),
                (kr, 94),
                (ka, 94),
                (kl, 111),
            ];
            for (i, &(v, n)) in ks.iter().enumerate() {
                let [h, l] = pair(v, n);
                enc.k[2 * i] = h;
                enc.k[2 * i + 1] = l;
            }
            let fls: [(u128, u32); 3] = [(kr, 30), (kl, 60), (ka, 77)];
            for (i, &(v, n)) in fls.iter().enumerate() {
                let [h, l] = pair(v, n);
                enc.ke[2 * i] = h;
                enc.ke[2 * i + 1] = l;
            }
            enc.kw_out = pair(kb, 111);
            24
        };
        // Decryption runs the same network with the subkeys reversed (RFC 3713, 2.3.3).
        let layers = rounds / 6 - 1;
        let mut dec = enc.clone();
        dec.kw_in = enc.kw_out;
        dec.kw_out = enc.kw_in;
        for i in 0..rounds {
            dec.k[i] = enc.k[rounds - 1 - i];
        }
        for l in 0..layers {
            let m = layers - 1 - l;
            dec.ke[2 * l] = enc.ke[2 * m + 1];
            dec.ke[2 * l + 1] = enc.ke[2 * m];
        }
        Some(Camellia { rounds, enc, dec })
    }

    /// Runs the network on `N` independent blocks, round by round: their lookups interleave,
    /// so N chains of latency overlap where one block alone leaves the core waiting.
    #[inline(always)]
    fn run<const N: usize>(s: &Schedule, rounds: usize, blocks: [&mut [u8; 16]; N]) {
        let split = |v: u64| ((v >> 32) as u32, v as u32);
        let join = |h: (u32, u32)| (u64::from(h.0) << 32) | u64::from(h.1);
        // The block's two big-endian 64-bit halves.
        let half = |b: &[u8; 16], high: bool| {
            let v = u128::from_be_bytes(*b);
            if high {
                (v >> 64) as u64
            } else {
                v as u64
            }
        };
        let mut a: [(u32, u32); N] =
            std::array::from_fn(|i| split(half(blocks[i], true) ^ s.kw_in[0]));
        let mut b: [(u32, u32); N] =
            std::array::from_fn(|i| split(half(blocks[i], false) ^ s.kw_in[1]));
        for r in (0..rounds).step_by(6) {
            let k = &s.k[r..r + 6];
            let mut ak = [(0, 0); N];
            let mut bk = [(0, 0); N];
            for i in 0..N {
                if r > 0 {
                    a[i] = split(fl(join(a[i]), s.ke[r / 3 - 2]));
                    b[i] = split(fl_inv(join(b[i]), s.ke[r / 3 - 1]));
                }
                ak[i] = split(join(a[i]) ^ k[0]);
            }
            for j in (1..6).step_by(2) {
                for i in 0..N {
                    bk[i] = round(ak[i], &mut b[i], k[j]);
                }
                for i in 0..N {
                    // After the sixth round there is no next round in this group.
                    ak[i] = round(bk[i], &mut a[i], if j < 5 { k[j + 1] } else { 0 });
                }
            }
        }
        for (i, block) in blocks.into_iter().enumerate() {
            block[..8].copy_from_slice(&(join(b[i]) ^ s.kw_out[0]).to_be_bytes());
            block[8..].copy_from_slice(&(join(a[i]) ^ s.kw_out[1]).to_be_bytes());
        }
    }

    /// Encrypts whole blocks, two at a time (independent blocks: ECB within XTS and LRW).
    pub(crate) fn encrypt_blocks(&self, data: &mut [u8]) {
        Self::each_pair(&self.enc, self.rounds, data)
    }

    /// Decrypts whole blocks, two at a time (ECB within XTS and LRW, and CBC decryption).
    pub(crate) fn decrypt_blocks(&self, data: &mut [u8]) {
        Self::each_pair(&self.dec, self.rounds, data)
    }

    fn each_pair(s: &Schedule, rounds: usize, data: &mut [u8]) {
        let mut pairs = data.chunks_exact_mut(32);
        for pair in pairs.by_ref() {
            let (x, y) = pair.split_at_mut(16);
            if let (Ok(x), Ok(y)) = (x.try_into(), y.try_into()) {
                Self::run(s, rounds, [x, y]);
            }
        }
        if let Ok(last) = pairs.into_remainder().try_into() {
            Self::run(s, rounds, [last]);
        }
    }
}
