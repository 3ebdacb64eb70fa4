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
//! On x86-64 CPUs with AES-NI the state lives in five XMM registers and each round is one
//! inline `AESENC` (module `ni`); elsewhere the AES round is the `aes` crate's
//! `hazmat::cipher_round` (ARMv8 AES where the CPU has it, else its constant-time software
//! round), one call per round. The key and every state are zeroised when dropped; the caller
//! keeps an [`Aegis128`] in locked memory (a `SecretBox`).

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
    /// The CPU has AES-NI: [`ni`] runs the cipher (checked once, in [`Aegis128::new`]).
    ni: bool,
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
            ni: ni::available(),
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
        #[cfg(target_arch = "x86_64")]
        if self.ni {
            // SAFETY: `ni` is set only where `ni::available()` found AES-NI on this CPU.
            return unsafe { ni::seal(&self.key, iv, ad, src, data) };
        }
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
        #[cfg(target_arch = "x86_64")]
        let mut want = if self.ni {
            // SAFETY: `ni` is set only where `ni::available()` found AES-NI on this CPU.
            unsafe { ni::open(&self.key, iv, ad, data) }
        } else {
            self.open_soft(iv, ad, data)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let mut want = self.open_soft(iv, ad, data);
        let ok = (8..=AEGIS128_TAG_BYTES).contains(&tag.len())
            && bool::from(want[..tag.len()].ct_eq(tag));
        want.zeroize();
        if !ok {
            data.fill(0);
        }
        ok
    }

    /// Decrypts in place with the portable rounds; the tag the data should carry.
    fn open_soft(&self, iv: &[u8; AEGIS128_IV_BYTES], ad: &[u8], data: &mut [u8]) -> Blk {
        let mut st = State::new(&self.key, iv);
        st.absorb(ad);
        for c in data.chunks_mut(BLOCK_BYTES) {
            st.decrypt_block(c);
        }
        st.finish(ad.len(), data.len())
    }
}

/// AEGIS-128 on AES-NI: the same steps as [`State`], the five blocks in XMM registers and each
/// AES round one `AESENC` compiled inline.
#[cfg(target_arch = "x86_64")]
mod ni {
    use std::arch::x86_64::{
        __m128i, _mm_aesenc_si128, _mm_and_si128, _mm_loadu_si128, _mm_setzero_si128,
        _mm_storeu_si128, _mm_xor_si128,
    };

    use zeroize::Zeroize;

    use super::{padded, Blk, BLOCK_BYTES, C0, C1, FINAL_UPDATES, INIT_UPDATES};

    /// This CPU has AES-NI (SSE2, the other instructions used, is in every x86-64 CPU).
    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("aes")
    }

    fn load(b: &Blk) -> __m128i {
        // SAFETY: `b` is 16 readable bytes, and `loadu` has no alignment requirement.
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }

    fn store(x: __m128i) -> Blk {
        let mut b = [0u8; BLOCK_BYTES];
        // SAFETY: `b` is 16 writable bytes, and `storeu` has no alignment requirement.
        unsafe { _mm_storeu_si128(b.as_mut_ptr().cast(), x) };
        b
    }

    /// The five state blocks; their registers' last copies are overwritten on drop.
    struct State([__m128i; 5]);

    impl Drop for State {
        fn drop(&mut self) {
            for r in &mut self.0 {
                // SAFETY: `r` is a valid, aligned, exclusive reference; the volatile write
                // keeps the compiler from dropping the wipe of a value it never reads again.
                unsafe { std::ptr::write_volatile(r, _mm_setzero_si128()) };
            }
        }
    }

    impl State {
        #[target_feature(enable = "aes")]
        fn new(key: &Blk, iv: &Blk) -> State {
            let k = load(key);
            let kn = _mm_xor_si128(k, load(iv));
            let (c0, c1) = (load(&C0), load(&C1));
            let mut st = State([kn, c1, c0, _mm_xor_si128(k, c0), _mm_xor_si128(k, c1)]);
            for i in 0..INIT_UPDATES {
                st.update(if i % 2 == 0 { k } else { kn });
            }
            st
        }

        #[target_feature(enable = "aes")]
        fn update(&mut self, m: __m128i) {
            let s = &mut self.0;
            let s4 = s[4];
            s[4] = _mm_aesenc_si128(s[3], s[4]);
            s[3] = _mm_aesenc_si128(s[2], s[3]);
            s[2] = _mm_aesenc_si128(s[1], s[2]);
            s[1] = _mm_aesenc_si128(s[0], s[1]);
            s[0] = _mm_xor_si128(_mm_aesenc_si128(s4, s[0]), m);
        }

        #[target_feature(enable = "aes")]
        fn keystream(&self) -> __m128i {
            let s = &self.0;
            _mm_xor_si128(_mm_xor_si128(s[1], s[4]), _mm_and_si128(s[2], s[3]))
        }

        #[target_feature(enable = "aes")]
        fn absorb(&mut self, ad: &[u8]) {
            let mut chunks = ad.chunks_exact(BLOCK_BYTES);
            for c in &mut chunks {
                self.update(load(c.try_into().expect("16-byte chunk")));
            }
            if !chunks.remainder().is_empty() {
                self.update(load(&padded(chunks.remainder())));
            }
        }

        #[target_feature(enable = "aes")]
        fn finish(mut self, ad_bytes: usize, msg_bytes: usize) -> Blk {
            let mut t = [0u8; BLOCK_BYTES];
            t[..8].copy_from_slice(&(ad_bytes as u64 * 8).to_le_bytes());
            t[8..].copy_from_slice(&(msg_bytes as u64 * 8).to_le_bytes());
            let t = _mm_xor_si128(load(&t), self.0[3]);
            for _ in 0..FINAL_UPDATES {
                self.update(t);
            }
            let s = &self.0;
            store(_mm_xor_si128(
                _mm_xor_si128(_mm_xor_si128(s[0], s[1]), _mm_xor_si128(s[2], s[3])),
                s[4],
            ))
        }
    }

    /// [`super::Aegis128::seal`] on AES-NI.
    #[target_feature(enable = "aes")]
    pub fn seal(key: &Blk, iv: &Blk, ad: &[u8], src: Option<&[u8]>, data: &mut [u8]) -> Blk {
        let mut st = State::new(key, iv);
        st.absorb(ad);
        let mut p = [0u8; BLOCK_BYTES];
        for (i, c) in data.chunks_mut(BLOCK_BYTES).enumerate() {
            let n = c.len();
            p[n..].fill(0);
            match src {
                Some(s) => p[..n].copy_from_slice(&s[i * BLOCK_BYTES..i * BLOCK_BYTES + n]),
                None => p[..n].copy_from_slice(c),
            }
            let pv = load(&p);
            let cb = store(_mm_xor_si128(pv, st.keystream()));
            st.update(pv);
            c.copy_from_slice(&cb[..n]);
        }
        p.zeroize();
        st.finish(ad.len(), data.len())
    }

    /// Decrypts `data` in place on AES-NI; the tag it should carry (the caller compares).
    #[target_feature(enable = "aes")]
    pub fn open(key: &Blk, iv: &Blk, ad: &[u8], data: &mut [u8]) -> Blk {
        let mut st = State::new(key, iv);
        st.absorb(ad);
        for c in data.chunks_mut(BLOCK_BYTES) {
            let n = c.len();
            let mut p = store(_mm_xor_si128(load(&padded(c)), st.keystream()));
            p[n..].fill(0);
            st.update(load(&p));
            c.copy_from_slice(&p[..n]);
            p.zeroize();
        }
        st.finish(ad.len(), data.len())
    }
}

/// Where the CPU has no AES-NI the portable rounds run.
#[cfg(not(target_arch = "x86_64"))]
mod ni {
    pub fn available() -> bool {
        false
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

    /// The AES-NI path and the portable rounds agree on every length of data and associated
    /// data around the block size and on whole sectors, and each opens the other's output.
    #[test]
    fn aes_ni_and_portable_rounds_agree() {
        let Some(fast) = Aegis128::new(&[7u8; 16]) else {
            panic!("16-byte key")
        };
        if !fast.ni {
            println!("SKIPPED: this CPU has no AES-NI; only the portable rounds run here");
            return;
        }
        let soft = Aegis128 {
            key: fast.key,
            ni: false,
        };
        let mut x = 0x9e37_79b9_u32;
        let mut byte = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        };
        for (ad_len, len) in [
            (0, 0),
            (8, 1),
            (16, 15),
            (17, 16),
            (31, 33),
            (24, 512),
            (40, 4096),
        ] {
            let iv: [u8; 16] = std::array::from_fn(|_| byte());
            let ad: Vec<u8> = (0..ad_len).map(|_| byte()).collect();
            let pt: Vec<u8> = (0..len).map(|_| byte()).collect();
            let (mut a, mut b) = (vec![0u8; len], pt.clone());
            let tag = fast.seal(&iv, &ad, Some(&pt), &mut a);
            assert_eq!(soft.seal(&iv, &ad, None, &mut b), tag, "tag {ad_len}/{len}");
            assert_eq!(a, b, "ciphertext {ad_len}/{len}");
            assert!(
                soft.open(&iv, &ad, &mut a, &tag),
                "portable opens {ad_len}/{len}"
            );
            assert!(
                fast.open(&iv, &ad, &mut b, &tag),
                "AES-NI opens {ad_len}/{len}"
            );
            assert_eq!((&a, &b), (&pt, &pt), "plaintext {ad_len}/{len}");
        }
    }

    #[test]
    fn wrong_key_length_is_refused() {
        assert!(Aegis128::new(&[0u8; 15]).is_none());
        assert!(Aegis128::new(&[0u8; 32]).is_none());
    }
}
