//! AEGIS-128, the authenticated cipher of dm-crypt's `aegis128-random` (the kernel's
//! `aegis128`, crypto/aegis128-core.c): the AEGIS-128 of the CAESAR submission (v1.1), not
//! AEGIS-128L. 128-bit key, 128-bit nonce, tags of up to 16 bytes (dm-crypt uses 16).
//!
//! The state is five 16-byte blocks `S0..S4`. One update with a message block `m` replaces
//! each `Si` by `AESRound(S(i-1), Si)` (indices mod 5; `AESRound(x, k)` is one AES encryption
//! round of `x` with round key `k`, Intel's `AESENC`), then XORs `m` into `S0`:
//! - init: `S = [K^N, C1, C0, K^C0, K^C1]`, then ten updates with `K`, `K^N`, `K`, ... ;
//! - associated data: one update per 16-byte block, the last zero-padded;
//! - message: each 16-byte block `P` gives `C = P ^ S1 ^ S4 ^ (S2 & S3)`, then an update with
//!   `P`; a short last block is zero-padded (the ciphertext truncated, the update with the
//!   padded plaintext);
//! - finalisation: `t = le64(ad bits) || le64(message bits)`, `S3` XORed in, seven updates with
//!   `t`; the tag is `S0 ^ S1 ^ S2 ^ S3 ^ S4`.
//!
//! The AES round is the `aes` crate's `hazmat::cipher_round` (AES-NI or ARMv8 AES where the
//! CPU has it, else its constant-time software round). The key and every state are zeroised
//! when dropped; the caller keeps an [`Aegis128`] in locked memory (a `SecretBox`).

use aes::hazmat::cipher_round;
use subtle::ConstantTimeEq;
use zeroize::Zeroize;

/// Key bytes (the only size AEGIS-128 has).
pub const AEGIS128_KEY_BYTES: usize = 16;
/// Nonce bytes (dm-crypt's IV for `aegis128-random`, kept in each tuple).
pub const AEGIS128_IV_BYTES: usize = 16;
/// Tag bytes as dm-crypt uses them (the kernel allows 8 to 16).
pub const AEGIS128_TAG_BYTES: usize = 16;

const BLOCK_BYTES: usize = 16;
type Blk = [u8; BLOCK_BYTES];

/// The Fibonacci constants of the specification (the kernel's `crypto_aegis_const`).
const C0: Blk = [
    0x00, 0x01, 0x01, 0x02, 0x03, 0x05, 0x08, 0x0d, 0x15, 0x22, 0x37, 0x59, 0x90, 0xe9, 0x79, 0x62,
];
const C1: Blk = [
    0xdb, 0x3d, 0x18, 0x55, 0x6d, 0xc2, 0x2f, 0xf1, 0x20, 0x11, 0x31, 0x42, 0x73, 0xb5, 0x28, 0xdd,
];

/// Updates of the initialisation and of the finalisation.
const INIT_UPDATES: usize = 10;
const FINAL_UPDATES: usize = 7;

fn xor(a: &Blk, b: &Blk) -> Blk {
    std::array::from_fn(|i| a[i] ^ b[i])
}

/// A zero-padded block from up to 16 bytes.
fn padded(bytes: &[u8]) -> Blk {
    let mut b = [0u8; BLOCK_BYTES];
    b[..bytes.len()].copy_from_slice(bytes);
    b
}

/// An AEGIS-128 key. Not `Clone`; zeroised on drop.
pub struct Aegis128 {
    key: Blk,
}

impl Drop for Aegis128 {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

/// One message's state; zeroised on drop (it is derived from the key).
struct State {
    s: [Blk; 5],
}

impl Drop for State {
    fn drop(&mut self) {
        self.s.zeroize();
    }
}

impl State {
    fn new(key: &Blk, iv: &Blk) -> State {
        let mut key_iv = xor(key, iv);
        let mut st = State {
            s: [key_iv, C1, C0, xor(key, &C0), xor(key, &C1)],
        };
        for i in 0..INIT_UPDATES {
            st.update(if i % 2 == 0 { key } else { &key_iv });
        }
        key_iv.zeroize();
        st
    }

    /// `Si = AESRound(S(i-1), Si)` for all five at once (from the old values), then `S0 ^= m`.
    fn update(&mut self, m: &Blk) {
        let s = &mut self.s;
        let mut last = s[4];
        for i in (1..5).rev() {
            let mut x = s[i - 1];
            cipher_round((&mut x).into(), (&s[i]).into());
            s[i] = x;
        }
        cipher_round((&mut last).into(), (&s[0]).into());
        s[0] = xor(&last, m);
        last.zeroize();
    }

    /// The keystream block of the current state: `S1 ^ S4 ^ (S2 & S3)`.
    fn keystream(&self) -> Blk {
        let s = &self.s;
        std::array::from_fn(|i| s[1][i] ^ s[4][i] ^ (s[2][i] & s[3][i]))
    }

    fn absorb(&mut self, ad: &[u8]) {
        let mut chunks = ad.chunks_exact(BLOCK_BYTES);
        for c in &mut chunks {
            self.update(c.try_into().expect("16-byte chunk"));
        }
        if !chunks.remainder().is_empty() {
            self.update(&padded(chunks.remainder()));
        }
    }

    /// Encrypts one block of up to 16 bytes from `p` into `c` (same length).
    fn encrypt_block(&mut self, p: &[u8], c: &mut [u8]) {
        let mut pb = padded(p);
        let mut cb = xor(&pb, &self.keystream());
        self.update(&pb);
        c.copy_from_slice(&cb[..c.len()]);
        pb.zeroize();
        cb.zeroize();
    }

    /// Decrypts one block of up to 16 bytes in place; the update takes the plaintext
    /// zero-padded, as encryption did.
    fn decrypt_block(&mut self, c: &mut [u8]) {
        let n = c.len();
        let mut pb = xor(&padded(c), &self.keystream());
        pb[n..].fill(0);
        self.update(&pb);
        c.copy_from_slice(&pb[..n]);
        pb.zeroize();
    }

    fn finish(mut self, ad_bytes: usize, msg_bytes: usize) -> Blk {
        let mut t = [0u8; BLOCK_BYTES];
        t[..8].copy_from_slice(&(ad_bytes as u64 * 8).to_le_bytes());
        t[8..].copy_from_slice(&(msg_bytes as u64 * 8).to_le_bytes());
        let mut t = xor(&t, &self.s[3]);
        for _ in 0..FINAL_UPDATES {
            self.update(&t);
        }
        t.zeroize();
        let s = &self.s;
        std::array::from_fn(|i| s[0][i] ^ s[1][i] ^ s[2][i] ^ s[3][i] ^ s[4][i])
    }
}

impl Aegis128 {
    /// `None` unless `key` is [`AEGIS128_KEY_BYTES`] long.
    pub fn new(key: &[u8]) -> Option<Aegis128> {
        Some(Aegis128 {
            key: key.try_into().ok()?,
        })
    }

    /// Encrypts `src` (or, without one, `data` in place) into `data` under nonce `iv` with
    /// associated data `ad`, and returns the 16-byte tag.
    pub fn seal(
        &self,
        iv: &[u8; AEGIS128_IV_BYTES],
        ad: &[u8],
        src: Option<&[u8]>,
        data: &mut [u8],
    ) -> [u8; AEGIS128_TAG_BYTES] {
        assert!(
            src.is_none_or(|s| s.len() == data.len()),
            "seal: src length"
        );
        let mut st = State::new(&self.key, iv);
        st.absorb(ad);
        let mut p = [0u8; BLOCK_BYTES];
        for (i, c) in data.chunks_mut(BLOCK_BYTES).enumerate() {
            let n = c.len();
            match src {
                Some(s) => p[..n].copy_from_slice(&s[i * BLOCK_BYTES..i * BLOCK_BYTES + n]),
                None => p[..n].copy_from_slice(c),
            }
            st.encrypt_block(&p[..n], c);
        }
        p.zeroize();
        st.finish(ad.len(), data.len())
    }

    /// Decrypts `data` in place and checks `tag` (in constant time). On a mismatch returns
    /// false and wipes `data`: a failed verification gives out no plaintext.
    pub fn open(
        &self,
        iv: &[u8; AEGIS128_IV_BYTES],
        ad: &[u8],
        data: &mut [u8],
        tag: &[u8],
    ) -> bool {
        let mut st = State::new(&self.key, iv);
        st.absorb(ad);
        for c in data.chunks_mut(BLOCK_BYTES) {
            st.decrypt_block(c);
        }
        let mut want = st.finish(ad.len(), data.len());
        let ok = (8..=AEGIS128_TAG_BYTES).contains(&tag.len())
            && bool::from(want[..tag.len()].ct_eq(tag));
        want.zeroize();
        if !ok {
            data.fill(0);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_util::unhex as hex;

    /// The kernel's own known-answer vectors (`aegis128_tv_template` of crypto/testmgr.h, see
    /// the data file's header): encryption gives the kernel's ciphertext and tag; decryption
    /// gives the plaintext back; a flipped bit of ciphertext, tag or associated data fails and
    /// wipes the output.
    #[test]
    fn kernel_testmgr_vectors() {
        let text = include_str!("testdata/kernel-testmgr-aegis128.txt");
        let mut n = 0;
        for (line_no, line) in text.lines().enumerate() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            assert_eq!(words.next(), Some("aegis128"));
            let f: std::collections::BTreeMap<&str, Vec<u8>> = words
                .map(|w| {
                    let (k, v) = w.split_once('=').expect("key=value");
                    (k, hex(v))
                })
                .collect();
            let at = format!("line {}", line_no + 1);
            let (pt, ct, ad) = (&f["pt"], &f["ct"], &f["ad"]);
            let iv: [u8; 16] = f["iv"].as_slice().try_into().expect("16-byte IV");
            let a = Aegis128::new(&f["key"]).expect("16-byte key");
            // The last vectors truncate the tag (the kernel's authsize, 8 to 16 bytes).
            let (want_ct, want_tag) = ct.split_at(pt.len());
            let tag_len = want_tag.len();
            let mut data = pt.clone();
            let full_tag = a.seal(&iv, ad, None, &mut data);
            let tag = &full_tag[..tag_len];
            assert_eq!((&data[..], tag), (want_ct, want_tag), "{at}: seal");
            let mut out = vec![0u8; pt.len()];
            assert_eq!(
                a.seal(&iv, ad, Some(pt), &mut out),
                full_tag,
                "{at}: seal_to"
            );
            assert_eq!(out, data, "{at}: seal_to");
            assert!(a.open(&iv, ad, &mut data, tag), "{at}: open");
            assert_eq!(&data, pt, "{at}: open");
            let mut bad_tag = tag.to_vec();
            bad_tag[tag_len - 1] ^= 0x80;
            let mut d = want_ct.to_vec();
            assert!(!a.open(&iv, ad, &mut d, &bad_tag), "{at}: bad tag");
            assert!(d.iter().all(|&b| b == 0), "{at}: wiped");
            if !pt.is_empty() {
                let mut d = want_ct.to_vec();
                d[pt.len() / 2] ^= 1;
                assert!(!a.open(&iv, ad, &mut d, tag), "{at}: bad ciphertext");
            }
            if !ad.is_empty() {
                let mut bad_ad = ad.clone();
                bad_ad[0] ^= 1;
                let mut d = want_ct.to_vec();
                assert!(!a.open(&iv, &bad_ad, &mut d, tag), "{at}: bad ad");
            }
            n += 1;
        }
        assert_eq!(n, 24, "vectors");
    }

    #[test]
    fn wrong_key_length_is_refused() {
        assert!(Aegis128::new(&[0u8; 15]).is_none());
        assert!(Aegis128::new(&[0u8; 32]).is_none());
    }
}
