//! Header-key derivation: PBKDF2 with the hashes and iteration counts TrueCrypt and VeraCrypt
//! use, the keyfile pool, and the search over the candidates spread across the cores.
//!
//! A header key is 192 bytes: several PBKDF2 output blocks (three for SHA-512, six for
//! SHA-256, ten for RIPEMD-160), each an independent chain of HMACs. The search runs every
//! (candidate, block) pair as one job on a small pool of threads, in table order, and stops
//! taking jobs of candidates after the first one whose key opens the header; the result is
//! the first candidate in table order that opens it, as a one-thread search would find.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use hmac::{Mac, SimpleHmac};
use zeroize::Zeroize;

use crate::sector::crc32;
use crate::{Error, Result, SecretBytes};

/// Bytes of the derived header key.
pub const HEADER_KEY_BYTES: usize = 192;
/// TrueCrypt's keyfile pool and passphrase limit.
pub const KEY_POOL_BYTES: usize = 64;
/// VeraCrypt's, when the passphrase is longer than TrueCrypt's limit.
pub const VERA_KEY_POOL_BYTES: usize = 128;
/// Bytes of a keyfile that count (TrueCrypt reads the first MiB).
pub const KEYFILE_BYTES_MAX: usize = 1 << 20;
/// Threads of the search at most.
const THREADS_MAX: usize = 16;

/// A PBKDF2 hash as TrueCrypt and VeraCrypt use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hash {
    Sha512,
    Sha256,
    Sha1,
    Ripemd160,
    Whirlpool,
    Blake2s256,
    Stribog512,
}

impl Hash {
    /// cryptsetup's name (what `-h` matches and the dump prints).
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha512 => "sha512",
            Hash::Sha256 => "sha256",
            Hash::Sha1 => "sha1",
            Hash::Ripemd160 => "ripemd160",
            Hash::Whirlpool => "whirlpool",
            Hash::Blake2s256 => "blake2s-256",
            Hash::Stribog512 => "stribog512",
        }
    }

    fn out_bytes(self) -> usize {
        match self {
            Hash::Sha512 | Hash::Whirlpool | Hash::Stribog512 => 64,
            Hash::Sha256 | Hash::Blake2s256 => 32,
            Hash::Sha1 | Hash::Ripemd160 => 20,
        }
    }

    /// PBKDF2 output block `index` (from 1) into `out` (at most one digest); gives up (the
    /// output then unspecified) when `stop` answers true, asked every [`STOP_POLL_ITERATIONS`].
    fn block(
        self,
        pwd: &[u8],
        salt: &[u8],
        iterations: u32,
        index: u32,
        out: &mut [u8],
        stop: &dyn Fn() -> bool,
    ) {
        match self {
            Hash::Sha512 => {
                f_block::<hmac::Hmac<sha2::Sha512>>(pwd, salt, iterations, index, out, stop)
            }
            Hash::Sha256 => {
                f_block::<hmac::Hmac<sha2::Sha256>>(pwd, salt, iterations, index, out, stop)
            }
            Hash::Sha1 => {
                f_block::<hmac::Hmac<sha1::Sha1>>(pwd, salt, iterations, index, out, stop)
            }
            Hash::Ripemd160 => {
                f_block::<hmac::Hmac<ripemd::Ripemd160>>(pwd, salt, iterations, index, out, stop)
            }
            Hash::Whirlpool => {
                f_block::<hmac::Hmac<whirlpool::Whirlpool>>(pwd, salt, iterations, index, out, stop)
            }
            Hash::Blake2s256 => {
                f_block::<SimpleHmac<blake2::Blake2s256>>(pwd, salt, iterations, index, out, stop)
            }
            Hash::Stribog512 => f_block::<SimpleHmac<streebog::Streebog512>>(
                pwd, salt, iterations, index, out, stop,
            ),
        }
    }
}

/// How often a running PBKDF2 block looks whether the search is over.
const STOP_POLL_ITERATIONS: u32 = 4096;

/// PBKDF2's F(P, S, c, i): one output block.
fn f_block<M: Mac + hmac::digest::KeyInit + Clone>(
    pwd: &[u8],
    salt: &[u8],
    iterations: u32,
    index: u32,
    out: &mut [u8],
    stop: &dyn Fn() -> bool,
) {
    // HMAC takes a key of any length: this never fails.
    let Ok(prf) = <M as hmac::digest::KeyInit>::new_from_slice(pwd) else {
        return;
    };
    let mut m = prf.clone();
    m.update(salt);
    m.update(&index.to_be_bytes());
    let mut u = m.finalize().into_bytes();
    let mut t = u.clone();
    for i in 1..iterations {
        if i % STOP_POLL_ITERATIONS == 0 && stop() {
            break;
        }
        let mut m = prf.clone();
        m.update(&u);
        u = m.finalize().into_bytes();
        for (a, b) in t.iter_mut().zip(u.iter()) {
            *a ^= b;
        }
    }
    let n = out.len().min(t.len());
    out[..n].copy_from_slice(&t[..n]);
    u.as_mut_slice().zeroize();
    t.as_mut_slice().zeroize();
}

/// One row of the KDF table: a hash, its iteration count, and VeraCrypt's PIM rule
/// (iterations = `pim_const` + `pim_mult` × PIM).
#[derive(Debug, Clone, Copy)]
pub struct Kdf {
    pub veracrypt: bool,
    pub hash: Hash,
    pub iterations: u32,
    pub pim_const: u32,
    pub pim_mult: u32,
}

const fn kdf(veracrypt: bool, hash: Hash, it: u32, pc: u32, pm: u32) -> Kdf {
    Kdf {
        veracrypt,
        hash,
        iterations: it,
        pim_const: pc,
        pim_mult: pm,
    }
}

/// The KDFs in the order cryptsetup tries them (TrueCrypt's first; the VeraCrypt rows with
/// PIM multiplier 2048 are those of system (boot) volumes). SHA-1 is TrueCrypt's legacy KDF,
/// which cryptsetup's command line always tries.
pub const KDFS: [Kdf; 14] = [
    kdf(false, Hash::Ripemd160, 2000, 0, 0),
    kdf(false, Hash::Ripemd160, 1000, 0, 0),
    kdf(false, Hash::Sha512, 1000, 0, 0),
    kdf(false, Hash::Whirlpool, 1000, 0, 0),
    kdf(false, Hash::Sha1, 2000, 0, 0),
    kdf(true, Hash::Sha512, 500_000, 15000, 1000),
    kdf(true, Hash::Whirlpool, 500_000, 15000, 1000),
    kdf(true, Hash::Sha256, 500_000, 15000, 1000),
    kdf(true, Hash::Sha256, 200_000, 0, 2048),
    kdf(true, Hash::Blake2s256, 500_000, 15000, 1000),
    kdf(true, Hash::Blake2s256, 200_000, 0, 2048),
    kdf(true, Hash::Ripemd160, 655_331, 15000, 1000),
    kdf(true, Hash::Ripemd160, 327_661, 0, 2048),
    kdf(true, Hash::Stribog512, 500_000, 15000, 1000),
];

/// The PBKDF2 password: the passphrase added byte-wise onto the keyfile pool, as TrueCrypt
/// does. With keyfiles the whole pool is the password; without, the passphrase alone.
pub fn password(
    passphrase: &[u8],
    keyfiles: &[SecretBytes],
    veracrypt: bool,
) -> Result<SecretBytes> {
    let (max, pool_len) = if veracrypt && passphrase.len() > KEY_POOL_BYTES {
        (VERA_KEY_POOL_BYTES, VERA_KEY_POOL_BYTES)
    } else {
        (KEY_POOL_BYTES, KEY_POOL_BYTES)
    };
    if passphrase.len() > max {
        return Err(Error::InvalidArgument(format!(
            "Maximum TCRYPT passphrase length ({max}) exceeded."
        )));
    }
    let mut pool = SecretBytes::from_vec(vec![0u8; VERA_KEY_POOL_BYTES]);
    {
        let pool = pool.as_mut();
        for kf in keyfiles {
            let data = kf.as_ref();
            let data = &data[..data.len().min(KEYFILE_BYTES_MAX)];
            let mut crc = !0u32;
            let mut j = 0;
            for &b in data {
                crc = crc32::update(crc, &[b]);
                for byte in crc.to_be_bytes() {
                    pool[j] = pool[j].wrapping_add(byte);
                    j += 1;
                }
                j %= pool_len;
            }
            crc.zeroize();
        }
        for (p, &c) in pool.iter_mut().zip(passphrase) {
            *p = p.wrapping_add(c);
        }
    }
    let len = if keyfiles.is_empty() {
        passphrase.len()
    } else {
        max
    };
    Ok(pool.slice(0..len))
}

/// The iterations of `k` with VeraCrypt's PIM, or its default count.
pub fn iterations(k: &Kdf, pim: Option<u32>) -> u32 {
    match pim {
        Some(pim) if k.veracrypt => k.pim_const.wrapping_add(k.pim_mult.wrapping_mul(pim)),
        _ => k.iterations,
    }
}

/// Derives the header key of each candidate `(hash, iterations)` in turn (spread over the
/// cores) and returns the first, in order, for which `try_key` answers `Some`, with its index.
pub fn search<T: Send>(
    candidates: &[(Hash, u32)],
    pwd: &[u8],
    salt: &[u8],
    try_key: &(dyn Fn(usize, &[u8]) -> Option<T> + Sync),
) -> Option<(usize, T)> {
    // Jobs in order: (candidate, block index from 1).
    let mut jobs = Vec::new();
    for (c, (hash, _)) in candidates.iter().enumerate() {
        let blocks = HEADER_KEY_BYTES.div_ceil(hash.out_bytes());
        for b in 0..blocks {
            jobs.push((c, b));
        }
    }
    struct Slot<T> {
        key: SecretBytes,
        done_blocks: usize,
        result: Option<T>,
    }
    let slots: Vec<Mutex<Slot<T>>> = candidates
        .iter()
        .map(|_| {
            Mutex::new(Slot {
                key: SecretBytes::from_vec(vec![0; HEADER_KEY_BYTES]),
                done_blocks: 0,
                result: None,
            })
        })
        .collect();
    let next = AtomicUsize::new(0);
    // The lowest candidate known to open the header: later candidates are not started.
    let found = AtomicUsize::new(usize::MAX);
    let worker = || loop {
        let j = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(c, b)) = jobs.get(j) else { return };
        if c > found.load(Ordering::Relaxed) {
            return;
        }
        let (hash, iters) = candidates[c];
        let out_bytes = hash.out_bytes();
        let start = b * out_bytes;
        let end = (start + out_bytes).min(HEADER_KEY_BYTES);
        let mut block = SecretBytes::from_vec(vec![0; end - start]);
        let stop = || c > found.load(Ordering::Relaxed);
        hash.block(pwd, salt, iters, (b + 1) as u32, block.as_mut(), &stop);
        if stop() {
            continue;
        }
        let mut slot = crate::sync::lock(&slots[c]);
        slot.key.as_mut()[start..end].copy_from_slice(block.as_ref());
        slot.done_blocks += 1;
        if slot.done_blocks == HEADER_KEY_BYTES.div_ceil(out_bytes) {
            slot.result = try_key(c, slot.key.as_ref());
            if slot.result.is_some() {
                found.fetch_min(c, Ordering::Relaxed);
            }
        }
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, THREADS_MAX)
        .min(jobs.len().max(1));
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(worker);
        }
        worker();
    });
    slots.into_iter().enumerate().find_map(|(c, s)| {
        let s = s.into_inner().unwrap_or_else(|p| p.into_inner());
        s.result.map(|r| (c, r))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_blocks_match_the_pbkdf2_crate() {
        let mut ours = [0u8; HEADER_KEY_BYTES];
        for (b, chunk) in ours.chunks_mut(64).enumerate() {
            Hash::Sha512.block(b"pass", b"salt", 3, b as u32 + 1, chunk, &|| false);
        }
        let mut want = [0u8; HEADER_KEY_BYTES];
        pbkdf2::pbkdf2_hmac::<sha2::Sha512>(b"pass", b"salt", 3, &mut want);
        assert_eq!(ours, want);
        let mut ours = [0u8; 40];
        for (b, chunk) in ours.chunks_mut(20).enumerate() {
            Hash::Ripemd160.block(b"pass", b"salt", 5, b as u32 + 1, chunk, &|| false);
        }
        let mut want = [0u8; 40];
        pbkdf2::pbkdf2_hmac::<ripemd::Ripemd160>(b"pass", b"salt", 5, &mut want);
        assert_eq!(ours, want);
    }

    #[test]
    fn search_finds_the_first_candidate_in_order() {
        let cands = [(Hash::Sha256, 2), (Hash::Sha1, 2), (Hash::Sha256, 3)];
        let r = search(&cands, b"p", b"s", &|c, _k| (c >= 1).then_some(c));
        assert_eq!(r, Some((1, 1)));
        let r = search(&cands, b"p", b"s", &|_, _| None::<()>);
        assert!(r.is_none());
    }

    #[test]
    fn passphrase_limits() {
        assert!(password(&[b'a'; 64], &[], false).is_ok());
        assert!(password(&[b'a'; 65], &[], false).is_err());
        assert_eq!(password(&[b'a'; 72], &[], true).unwrap().len(), 72);
        let kf = [SecretBytes::from_slice(b"x")];
        assert_eq!(password(b"", &kf, false).unwrap().len(), 64);
    }
}
