//! Twofish (Schneier et al., "Twofish: A 128-Bit Block Cipher", 1998) with key-dependent
//! tables, as the kernel's `twofish_generic` (crypto/twofish_common.c) computes it: the
//! function g (the q permutations, the S-box key and the MDS matrix) is precomputed at keying
//! into four 256-entry tables of 32-bit words, so g is four loads and three XORs. RustCrypto's
//! `twofish` evaluates the q permutations and the GF(2^8) products for every byte of every
//! round and is two to three orders of magnitude slower, too slow for a disk; this one is
//! proven equal to it, to the kernel's vectors (tests) and to the kernel's dm-crypt (VM).
//!
//! Like every table-driven cipher, table reads are indexed by key-dependent bytes: a
//! cache-timing side channel for a local attacker (the kernel's twofish has the same).

use zeroize::Zeroize;

use crate::secret::SecretBox;

/// The 4-bit permutations t0..t3 that build q0 and q1 (the paper, section 4.3.5).
const QT: [[[u8; 16]; 4]; 2] = [
    [
        [8, 1, 7, 13, 6, 15, 3, 2, 0, 11, 5, 9, 14, 12, 10, 4],
        [14, 12, 11, 8, 1, 2, 3, 5, 15, 4, 10, 6, 7, 0, 9, 13],
        [11, 10, 5, 14, 6, 13, 9, 0, 12, 8, 15, 3, 2, 4, 7, 1],
        [13, 7, 15, 4, 1, 2, 6, 14, 9, 11, 3, 0, 8, 5, 12, 10],
    ],
    [
        [2, 8, 11, 13, 15, 7, 6, 14, 3, 1, 9, 4, 0, 10, 12, 5],
        [1, 14, 2, 11, 4, 12, 3, 7, 6, 13, 10, 5, 15, 9, 0, 8],
        [4, 12, 7, 5, 1, 6, 9, 10, 0, 14, 13, 8, 2, 11, 3, 15],
        [11, 9, 5, 1, 12, 3, 13, 14, 6, 4, 7, 15, 2, 0, 8, 10],
    ],
];

/// q0 and q1 of byte x.
const fn q_of(which: usize, x: u8) -> u8 {
    let t = &QT[which];
    let (a0, b0) = (x >> 4, x & 15);
    let a1 = a0 ^ b0;
    let b1 = (a0 ^ ((b0 >> 1) | (b0 << 3)) ^ (a0 << 3)) & 15;
    let (a2, b2) = (t[0][a1 as usize], t[1][b1 as usize]);
    let a3 = a2 ^ b2;
    let b3 = (a2 ^ ((b2 >> 1) | (b2 << 3)) ^ (a2 << 3)) & 15;
    let (a4, b4) = (t[2][a3 as usize], t[3][b3 as usize]);
    (b4 << 4) | a4
}

static Q: [[u8; 256]; 2] = {
    let mut q = [[0u8; 256]; 2];
    let mut x = 0;
    while x < 256 {
        q[0][x] = q_of(0, x as u8);
        q[1][x] = q_of(1, x as u8);
        x += 1;
    }
    q
};

/// For byte j of h's input: the q of each stage (the k = 4 stage, k >= 3, then the two every
/// key has) and the final one.
const QORD: [[usize; 5]; 4] = [
    [1, 1, 0, 0, 1],
    [0, 1, 1, 0, 0],
    [0, 0, 0, 1, 1],
    [1, 0, 1, 1, 0],
];

/// The MDS matrix's polynomial x^8 + x^6 + x^5 + x^3 + 1 and the RS code's x^8 + x^6 + x^3 +
/// x^2 + 1, without x^8.
const MDS_POLY: u8 = 0x69;
const RS_POLY: u8 = 0x4d;

const RS: [[u8; 8]; 4] = [
    [0x01, 0xa4, 0x55, 0x87, 0x5a, 0x58, 0xdb, 0x9e],
    [0xa4, 0x56, 0x82, 0xf3, 0x1e, 0xc6, 0x68, 0xe5],
    [0x02, 0xa1, 0xfc, 0xc1, 0x47, 0xae, 0x3d, 0x19],
    [0xa4, 0x55, 0x87, 0x5a, 0x58, 0xdb, 0x9e, 0x03],
];

fn gf_mul(mut a: u8, mut b: u8, poly: u8) -> u8 {
    let mut r = 0;
    while a != 0 {
        if a & 1 != 0 {
            r ^= b;
        }
        a >>= 1;
        b = (b << 1) ^ if b & 0x80 != 0 { poly } else { 0 };
    }
    r
}

/// Column j of the MDS matrix times y, as a little-endian word.
fn mds_column(y: u8, j: usize) -> u32 {
    let (y5b, yef) = (gf_mul(y, 0x5b, MDS_POLY), gf_mul(y, 0xef, MDS_POLY));
    u32::from_le_bytes(match j {
        0 => [y, y5b, yef, yef],
        1 => [yef, yef, y5b, y],
        2 => [y5b, yef, y, yef],
        _ => [y5b, y, yef, y5b],
    })
}

/// Byte j of h's S-box part for input byte x and key words `l` (L_0..L_{k-1}, k = l.len()):
/// the q stages, each followed by an XOR with byte j of a key word, then the final q.
fn h_byte(j: usize, x: u8, l: &[[u8; 4]]) -> u8 {
    let k = l.len();
    let mut y = x;
    for z in 4 - k..4 {
        y = Q[QORD[j][z]][y as usize] ^ l[3 - z][j];
    }
    Q[QORD[j][4]][y as usize]
}

/// The function h of the key schedule.
fn h(x: u32, l: &[[u8; 4]]) -> u32 {
    let b = x.to_le_bytes();
    (0..4).fold(0, |acc, j| acc ^ mds_column(h_byte(j, b[j], l), j))
}

/// A keyed Twofish.
pub(crate) struct Twofish {
    /// The round subkeys K_0..K_39.
    k: [u32; 40],
    /// g folded into tables: g(X) = t[0][X0] ^ t[1][X1] ^ t[2][X2] ^ t[3][X3].
    t: [[u32; 256]; 4],
}

impl Drop for Twofish {
    fn drop(&mut self) {
        self.k.zeroize();
        for t in &mut self.t {
            t.zeroize();
        }
    }
}

impl Twofish {
    /// `key`: 16, 24 or 32 bytes (checked by the caller: `BlockCipher::takes_key_bytes`).
    /// Keyed in place in locked memory: the tables are never copied through the stack.
    pub(crate) fn new(key: &[u8]) -> Option<SecretBox<Self>> {
        if !matches!(key.len(), 16 | 24 | 32) {
            return None;
        }
        let k = key.len() / 8;
        let word =
            |i: usize| -> [u8; 4] { [key[4 * i], key[4 * i + 1], key[4 * i + 2], key[4 * i + 3]] };
        let mut me = [[0u8; 4]; 4];
        let mut mo = [[0u8; 4]; 4];
        let mut s = [[0u8; 4]; 4];
        for i in 0..k {
            me[i] = word(2 * i);
            mo[i] = word(2 * i + 1);
            // S_{k-1-i} = RS · key[8i..8i+8]; g takes S in the order S_{k-1}, …, S_0.
            for (r, row) in RS.iter().enumerate() {
                s[k - 1 - i][r] =
                    (0..8).fold(0, |acc, c| acc ^ gf_mul(key[8 * i + c], row[c], RS_POLY));
            }
        }
        // SAFETY: Twofish is two arrays of integers, for which all-zero bytes are a valid value.
        let mut tf = unsafe { SecretBox::<Twofish>::zeroed() };
        const RHO: u32 = 0x0101_0101;
        for i in 0..20u32 {
            let a = h(RHO.wrapping_mul(2 * i), &me[..k]);
            let b = h(RHO.wrapping_mul(2 * i + 1), &mo[..k]).rotate_left(8);
            tf.k[2 * i as usize] = a.wrapping_add(b);
            tf.k[2 * i as usize + 1] = a.wrapping_add(b.wrapping_mul(2)).rotate_left(9);
        }
        for j in 0..4 {
            for x in 0..256 {
                tf.t[j][x] = mds_column(h_byte(j, x as u8, &s[..k]), j);
            }
        }
        me.zeroize();
        mo.zeroize();
        s.zeroize();
        Some(tf)
    }

    #[inline(always)]
    fn g(&self, x: u32) -> u32 {
        let b = x.to_le_bytes();
        self.t[0][b[0] as usize]
            ^ self.t[1][b[1] as usize]
            ^ self.t[2][b[2] as usize]
            ^ self.t[3][b[3] as usize]
    }

    /// Encrypts `N` independent blocks round by round, so their lookups interleave.
    #[inline(always)]
    fn enc<const N: usize>(&self, blocks: [&mut [u8; 16]; N]) {
        let w = |b: &[u8; 16], i: usize| {
            u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]) ^ self.k[i]
        };
        let mut p: [[u32; 4]; N] =
            std::array::from_fn(|n| std::array::from_fn(|i| w(blocks[n], i)));
        for r in 0..8 {
            let k = 4 * r + 8;
            for p in p.iter_mut() {
                let t1 = self.g(p[1].rotate_left(8));
                let t0 = self.g(p[0]).wrapping_add(t1);
                p[2] = (p[2] ^ t0.wrapping_add(self.k[k])).rotate_right(1);
                p[3] = p[3].rotate_left(1) ^ t1.wrapping_add(t0).wrapping_add(self.k[k + 1]);
            }
            for p in p.iter_mut() {
                let t1 = self.g(p[3].rotate_left(8));
                let t0 = self.g(p[2]).wrapping_add(t1);
                p[0] = (p[0] ^ t0.wrapping_add(self.k[k + 2])).rotate_right(1);
                p[1] = p[1].rotate_left(1) ^ t1.wrapping_add(t0).wrapping_add(self.k[k + 3]);
            }
        }
        for (p, block) in p.iter().zip(blocks) {
            // Undo the last swap; output whitening.
            let out = [
                p[2] ^ self.k[4],
                p[3] ^ self.k[5],
                p[0] ^ self.k[6],
                p[1] ^ self.k[7],
            ];
            for (i, v) in out.iter().enumerate() {
                block[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// Decrypts `N` independent blocks round by round.
    #[inline(always)]
    fn dec<const N: usize>(&self, blocks: [&mut [u8; 16]; N]) {
        let w = |b: &[u8; 16], i: usize| {
            u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
        };
        let mut c: [[u32; 4]; N] = std::array::from_fn(|n| {
            let b = &*blocks[n];
            [
                w(b, 2) ^ self.k[6],
                w(b, 3) ^ self.k[7],
                w(b, 0) ^ self.k[4],
                w(b, 1) ^ self.k[5],
            ]
        });
        for r in (0..8).rev() {
            let k = 4 * r + 8;
            for c in c.iter_mut() {
                let t1 = self.g(c[3].rotate_left(8));
                let t0 = self.g(c[2]).wrapping_add(t1);
                c[0] = c[0].rotate_left(1) ^ t0.wrapping_add(self.k[k + 2]);
                c[1] = (c[1] ^ t1.wrapping_add(t0).wrapping_add(self.k[k + 3])).rotate_right(1);
            }
            for c in c.iter_mut() {
                let t1 = self.g(c[1].rotate_left(8));
                let t0 = self.g(c[0]).wrapping_add(t1);
                c[2] = c[2].rotate_left(1) ^ t0.wrapping_add(self.k[k]);
                c[3] = (c[3] ^ t1.wrapping_add(t0).wrapping_add(self.k[k + 1])).rotate_right(1);
            }
        }
        for (c, block) in c.iter().zip(blocks) {
            for (i, v) in c.iter().enumerate() {
                block[4 * i..4 * i + 4].copy_from_slice(&(v ^ self.k[i]).to_le_bytes());
            }
        }
    }

    /// Encrypts whole blocks, two at a time (independent blocks: ECB within XTS and LRW; one
    /// block at a time is CBC encryption).
    pub(crate) fn encrypt_blocks(&self, data: &mut [u8]) {
        let mut pairs = data.chunks_exact_mut(32);
        for pair in pairs.by_ref() {
            let (x, y) = pair.split_at_mut(16);
            if let (Ok(x), Ok(y)) = (x.try_into(), y.try_into()) {
                self.enc([x, y]);
            }
        }
        if let Ok(last) = pairs.into_remainder().try_into() {
            self.enc([last]);
        }
    }

    /// Decrypts whole blocks, two at a time.
    pub(crate) fn decrypt_blocks(&self, data: &mut [u8]) {
        let mut pairs = data.chunks_exact_mut(32);
        for pair in pairs.by_ref() {
            let (x, y) = pair.split_at_mut(16);
            if let (Ok(x), Ok(y)) = (x.try_into(), y.try_into()) {
                self.dec([x, y]);
            }
        }
        if let Ok(last) = pairs.into_remainder().try_into() {
            self.dec([last]);
        }
    }
}
