//! Authenticated sectors as dm-crypt makes them over dm-integrity, sans I/O: each encryption
//! sector gets a fresh random IV and an authentication tag, stored together in the sector's
//! dm-integrity tag ("tuple") as `[auth tag][IV]`.
//!
//! What is authenticated, for the sector whose first 512-byte unit is `s` (counted from the
//! start of the integrity device's data, whatever the sector size):
//! - AEAD (`aes-gcm-random`, integrity `aead`): GCM with the 12-byte IV as nonce, associated
//!   data `le64(s) || IV`, 16-byte tag. Tuple: 16 + 12 = 28 bytes.
//! - AEAD (`chacha20-random`, integrity `poly1305`): the kernel's `rfc7539(chacha20,poly1305)`
//!   (RFC 8439's ChaCha20-Poly1305, 256-bit key) with the same nonce, associated data and tuple
//!   as GCM: dm-crypt builds every AEAD request alike.
//! - `aes-xts-random` + `hmac(H)`: the sector is encrypted with AES-XTS using the 16-byte IV as
//!   the tweak, then the tag is `HMAC-H(mac key, le64(s) || IV || ciphertext)` (the kernel's
//!   `authenc(hmac(H),xts(aes))`). Tuple: |H| + 16 bytes. The volume key is the XTS key
//!   followed by the MAC key.
//!
//! IVs come from the operating system's CSPRNG (getrandom(2)), a fresh one for every sector
//! written: with 96-bit nonces (GCM, ChaCha20-Poly1305) the chance of a repeat stays negligible up to the usual
//! 2^32 writes per key bound NIST gives for random nonces.

use hmac::{Hmac, Mac};
use sha2::{Sha256, Sha512};

use crate::secret::SecretBox;
use crate::sector::evp::{AeadAlg, AeadCtx, Alg, EvpCtx, AEAD_NONCE_BYTES, AEAD_TAG_BYTES};
use crate::{Error, Result};

/// XTS IV (tweak) bytes kept in each tuple.
pub const XTS_IV_BYTES: usize = 16;
/// AES-256-XTS key bytes (the only XTS key size supported here: cryptsetup's default).
pub const XTS_KEY_BYTES: usize = 64;

/// The MAC of an XTS + HMAC volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HmacHash {
    Sha256,
    Sha512,
}

impl HmacHash {
    pub fn bytes(self) -> usize {
        match self {
            HmacHash::Sha256 => 32,
            HmacHash::Sha512 => 64,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            HmacHash::Sha256 => "hmac(sha256)",
            HmacHash::Sha512 => "hmac(sha512)",
        }
    }
}

/// An authenticated sector mode, parsed from a LUKS2 segment's `encryption` and
/// `integrity.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagMode {
    /// `aes-gcm-random` with integrity `aead`; key 16 or 32 bytes.
    AesGcmRandom { key_bytes: usize },
    /// `chacha20-random` with integrity `poly1305`; key 32 bytes.
    ChaCha20RandomPoly1305,
    /// `aes-xts-random` with integrity `hmac(sha256)` / `hmac(sha512)`; key = 64-byte XTS key
    /// + MAC key of the hash's size.
    AesXtsRandomHmac(HmacHash),
}

/// What this code supports, for error messages.
pub const SUPPORTED_MODES: &str = "aes-gcm-random + aead (128/256-bit key), \
     chacha20-random + poly1305 (256-bit key), \
     aes-xts-random + hmac(sha256)|hmac(sha512) (512-bit XTS key)";

/// ChaCha20's key bytes (the only size it has).
pub const CHACHA20_KEY_BYTES: usize = 32;

impl TagMode {
    /// From the LUKS2 segment's `encryption`, `integrity.type` and the volume key length.
    pub fn from_luks2(encryption: &str, integrity: &str, key_bytes: usize) -> Result<Self> {
        let unsupported = |reason: String| Error::UnsupportedCipher {
            spec: format!("{encryption} + {integrity}"),
            reason,
            supported: SUPPORTED_MODES,
        };
        match (encryption, integrity) {
            ("aes-gcm-random", "aead") => match key_bytes {
                16 | 32 => Ok(TagMode::AesGcmRandom { key_bytes }),
                n => Err(unsupported(format!("{}-bit GCM key", n * 8))),
            },
            ("chacha20-random", "poly1305") => match key_bytes {
                CHACHA20_KEY_BYTES => Ok(TagMode::ChaCha20RandomPoly1305),
                n => Err(unsupported(format!("a {}-bit ChaCha20 key", n * 8))),
            },
            ("aes-xts-random", "hmac(sha256)" | "hmac(sha512)") => {
                let h = if integrity == "hmac(sha256)" {
                    HmacHash::Sha256
                } else {
                    HmacHash::Sha512
                };
                if key_bytes != XTS_KEY_BYTES + h.bytes() {
                    return Err(unsupported(format!(
                        "a {}-bit volume key (expected {} bits: a 512-bit XTS key and a {}-bit MAC key)",
                        key_bytes * 8,
                        (XTS_KEY_BYTES + h.bytes()) * 8,
                        h.bytes() * 8
                    )));
                }
                Ok(TagMode::AesXtsRandomHmac(h))
            }
            _ => Err(unsupported(
                "not an authenticated mode ucrypt implements".into(),
            )),
        }
    }

    /// Bytes of the authentication tag.
    pub fn auth_bytes(self) -> usize {
        match self {
            TagMode::AesGcmRandom { .. } | TagMode::ChaCha20RandomPoly1305 => AEAD_TAG_BYTES,
            TagMode::AesXtsRandomHmac(h) => h.bytes(),
        }
    }

    /// Bytes of the IV kept in the tuple.
    pub fn iv_bytes(self) -> usize {
        match self {
            TagMode::AesGcmRandom { .. } | TagMode::ChaCha20RandomPoly1305 => AEAD_NONCE_BYTES,
            TagMode::AesXtsRandomHmac(_) => XTS_IV_BYTES,
        }
    }

    /// Bytes dm-integrity must keep per sector (cryptsetup's tag size for the mode).
    pub fn tuple_bytes(self) -> usize {
        self.auth_bytes() + self.iv_bytes()
    }

    pub fn key_bytes(self) -> usize {
        match self {
            TagMode::AesGcmRandom { key_bytes } => key_bytes,
            TagMode::ChaCha20RandomPoly1305 => CHACHA20_KEY_BYTES,
            TagMode::AesXtsRandomHmac(h) => XTS_KEY_BYTES + h.bytes(),
        }
    }
}

enum Imp {
    /// GCM or ChaCha20-Poly1305: the context lives in a secret box inside `AeadCtx`.
    Aead(AeadCtx),
    /// In a secret box: the keyed HMAC states (the key's inner and outer pads, hashed) are
    /// key material, and several hundred bytes.
    XtsHmac(SecretBox<XtsHmac>),
}

struct XtsHmac {
    enc: EvpCtx,
    dec: EvpCtx,
    mac: MacKey,
}

enum MacKey {
    Sha256(Hmac<Sha256>),
    Sha512(Hmac<Sha512>),
}

/// A keyed authenticated-sector cipher: one per thread (not `Sync`).
pub struct TagCipher {
    mode: TagMode,
    imp: Imp,
}

/// The sector that failed verification, in 512-byte units from the start of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagMismatch {
    pub sector: u64,
}

impl TagCipher {
    pub fn new(mode: TagMode, key: &[u8]) -> Result<Self> {
        if key.len() != mode.key_bytes() {
            return Err(Error::Bug(
                "TagCipher::new: key length does not match the mode",
            ));
        }
        let imp = match mode {
            TagMode::AesGcmRandom { .. } => Imp::Aead(AeadCtx::new(AeadAlg::AesGcm, key)?),
            TagMode::ChaCha20RandomPoly1305 => {
                Imp::Aead(AeadCtx::new(AeadAlg::ChaCha20Poly1305, key)?)
            }
            TagMode::AesXtsRandomHmac(h) => {
                let (xk, mk) = key.split_at(XTS_KEY_BYTES);
                let mac = match h {
                    HmacHash::Sha256 => MacKey::Sha256(
                        Hmac::new_from_slice(mk).map_err(|_| Error::Bug("HMAC key"))?,
                    ),
                    HmacHash::Sha512 => MacKey::Sha512(
                        Hmac::new_from_slice(mk).map_err(|_| Error::Bug("HMAC key"))?,
                    ),
                };
                Imp::XtsHmac(SecretBox::new(XtsHmac {
                    enc: EvpCtx::new(Alg::Aes256Xts, xk, true)?,
                    dec: EvpCtx::new(Alg::Aes256Xts, xk, false)?,
                    mac,
                }))
            }
        };
        Ok(TagCipher { mode, imp })
    }

    pub fn mode(&self) -> TagMode {
        self.mode
    }

    /// Encrypts the sectors of `data` (each `sector_bytes`) in place, the first at 512-byte
    /// unit `first_sector`, and fills one tuple per sector into `tuples` (back to back, each
    /// [`TagMode::tuple_bytes`]). Draws fresh IVs from the OS CSPRNG for the whole run at once.
    pub fn seal(
        &mut self,
        first_sector: u64,
        sector_bytes: usize,
        data: &mut [u8],
        tuples: &mut [u8],
    ) -> Result<()> {
        self.seal_to(first_sector, sector_bytes, None, data, tuples)
    }

    /// As [`TagCipher::seal`], reading the plaintext from `src` (same length as `data`) when
    /// given, so that a caller's buffer is encrypted into `data` without a copy first.
    pub fn seal_to(
        &mut self,
        first_sector: u64,
        sector_bytes: usize,
        src: Option<&[u8]>,
        data: &mut [u8],
        tuples: &mut [u8],
    ) -> Result<()> {
        let (auth, ivb, tb) = (
            self.mode.auth_bytes(),
            self.mode.iv_bytes(),
            self.mode.tuple_bytes(),
        );
        let n = data.len() / sector_bytes;
        assert!(
            data.len() == n * sector_bytes
                && tuples.len() == n * tb
                && src.is_none_or(|s| s.len() == data.len()),
            "seal: buffer sizes"
        );
        // Fresh IVs straight into their places in the tuples.
        for t in tuples.chunks_exact_mut(tb) {
            t[..auth].fill(0);
        }
        fill_random_ivs(tuples, auth, ivb)?;
        let step = (sector_bytes / 512) as u64;
        for (i, (sec, t)) in data
            .chunks_exact_mut(sector_bytes)
            .zip(tuples.chunks_exact_mut(tb))
            .enumerate()
        {
            let s = first_sector + i as u64 * step;
            let plain = src.map(|p| &p[i * sector_bytes..(i + 1) * sector_bytes]);
            let (tag, iv) = t.split_at_mut(auth);
            match &mut self.imp {
                Imp::Aead(g) => {
                    let nonce: &[u8; AEAD_NONCE_BYTES] = (&*iv).try_into().expect("12-byte IV");
                    let ad = aead_ad(s, nonce);
                    let tag: &mut [u8; AEAD_TAG_BYTES] = tag.try_into().expect("16-byte tag");
                    match plain {
                        Some(p) => g.seal_to(nonce, &ad, p, sec, tag)?,
                        None => g.seal_in_place(nonce, &ad, sec, tag)?,
                    }
                }
                Imp::XtsHmac(x) => {
                    let XtsHmac { enc, mac, .. } = &mut **x;
                    let iv: &[u8; XTS_IV_BYTES] = (&*iv).try_into().expect("16-byte IV");
                    enc.set_iv(iv)?;
                    match plain {
                        Some(p) => enc.update(p, sec)?,
                        None => enc.update_in_place(sec)?,
                    }
                    mac.tag(s, iv, sec, tag);
                }
            }
        }
        Ok(())
    }

    /// Verifies and decrypts the sectors of `data` in place against their tuples. On the first
    /// sector that does not verify, returns it; the sectors of the run are then wiped rather
    /// than left half decrypted.
    pub fn open(
        &mut self,
        first_sector: u64,
        sector_bytes: usize,
        data: &mut [u8],
        tuples: &[u8],
    ) -> Result<std::result::Result<(), TagMismatch>> {
        let (auth, tb) = (self.mode.auth_bytes(), self.mode.tuple_bytes());
        let n = data.len() / sector_bytes;
        assert!(
            data.len() == n * sector_bytes && tuples.len() == n * tb,
            "open: buffer sizes"
        );
        let step = (sector_bytes / 512) as u64;
        for i in 0..n {
            let s = first_sector + i as u64 * step;
            let sec = &mut data[i * sector_bytes..(i + 1) * sector_bytes];
            let (tag, iv) = tuples[i * tb..(i + 1) * tb].split_at(auth);
            let ok = match &mut self.imp {
                Imp::Aead(g) => {
                    let nonce: &[u8; AEAD_NONCE_BYTES] = iv.try_into().expect("12-byte IV");
                    let tag: &[u8; AEAD_TAG_BYTES] = tag.try_into().expect("16-byte tag");
                    g.open_in_place(nonce, &aead_ad(s, nonce), sec, tag)
                }
                Imp::XtsHmac(x) => {
                    let XtsHmac { dec, mac, .. } = &mut **x;
                    let iv: &[u8; XTS_IV_BYTES] = iv.try_into().expect("16-byte IV");
                    if mac.verify(s, iv, sec, tag) {
                        dec.set_iv(iv)?;
                        dec.update_in_place(sec)?;
                        true
                    } else {
                        false
                    }
                }
            };
            if !ok {
                data.fill(0);
                return Ok(Err(TagMismatch { sector: s }));
            }
        }
        Ok(Ok(()))
    }
}

fn fill_random_ivs(tuples: &mut [u8], auth: usize, ivb: usize) -> Result<()> {
    let tb = auth + ivb;
    // One getrandom call per run of up to RANDOM_BATCH_BYTES of IVs.
    const RANDOM_BATCH_BYTES: usize = 4096;
    let mut batch = [0u8; RANDOM_BATCH_BYTES];
    let per_batch = RANDOM_BATCH_BYTES / ivb;
    for group in tuples.chunks_mut(per_batch * tb) {
        let k = group.len() / tb;
        let ivs = &mut batch[..k * ivb];
        getrandom::fill(ivs).map_err(|e| {
            Error::io(
                "getrandom for sector IVs",
                std::io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(libc::EIO)),
            )
        })?;
        for (t, iv) in group.chunks_exact_mut(tb).zip(ivs.chunks_exact(ivb)) {
            t[auth..].copy_from_slice(iv);
        }
    }
    batch.fill(0);
    Ok(())
}

/// An AEAD's associated data, as dm-crypt passes it: the sector number then the IV (20 bytes).
fn aead_ad(sector: u64, nonce: &[u8; AEAD_NONCE_BYTES]) -> [u8; 8 + AEAD_NONCE_BYTES] {
    let mut ad = [0u8; 8 + AEAD_NONCE_BYTES];
    ad[..8].copy_from_slice(&sector.to_le_bytes());
    ad[8..].copy_from_slice(nonce);
    ad
}

impl MacKey {
    fn tag(&self, sector: u64, iv: &[u8; XTS_IV_BYTES], ct: &[u8], out: &mut [u8]) {
        match self {
            MacKey::Sha256(k) => {
                out.copy_from_slice(&mac_over(k.clone(), sector, iv, ct).finalize().into_bytes())
            }
            MacKey::Sha512(k) => {
                out.copy_from_slice(&mac_over(k.clone(), sector, iv, ct).finalize().into_bytes())
            }
        }
    }

    /// Constant-time comparison (the `hmac` crate's `verify_slice`).
    fn verify(&self, sector: u64, iv: &[u8; XTS_IV_BYTES], ct: &[u8], tag: &[u8]) -> bool {
        match self {
            MacKey::Sha256(k) => mac_over(k.clone(), sector, iv, ct)
                .verify_slice(tag)
                .is_ok(),
            MacKey::Sha512(k) => mac_over(k.clone(), sector, iv, ct)
                .verify_slice(tag)
                .is_ok(),
        }
    }
}

fn mac_over<M: Mac>(mut m: M, sector: u64, iv: &[u8; XTS_IV_BYTES], ct: &[u8]) -> M {
    m.update(&sector.to_le_bytes());
    m.update(iv);
    m.update(ct);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn modes() -> Vec<TagMode> {
        vec![
            TagMode::AesGcmRandom { key_bytes: 32 },
            TagMode::AesGcmRandom { key_bytes: 16 },
            TagMode::ChaCha20RandomPoly1305,
            TagMode::AesXtsRandomHmac(HmacHash::Sha256),
            TagMode::AesXtsRandomHmac(HmacHash::Sha512),
        ]
    }

    #[test]
    fn tuple_sizes_are_cryptsetups() {
        assert_eq!(
            TagMode::from_luks2("aes-gcm-random", "aead", 32)
                .unwrap()
                .tuple_bytes(),
            28
        );
        assert_eq!(
            TagMode::from_luks2("aes-xts-random", "hmac(sha256)", 96)
                .unwrap()
                .tuple_bytes(),
            48
        );
        assert_eq!(
            TagMode::from_luks2("aes-xts-random", "hmac(sha512)", 128)
                .unwrap()
                .tuple_bytes(),
            80
        );
        assert!(TagMode::from_luks2("aes-xts-random", "hmac(sha256)", 64).is_err());
        assert!(TagMode::from_luks2("aes-xts-plain64", "hmac(sha256)", 96).is_err());
        assert_eq!(
            TagMode::from_luks2("chacha20-random", "poly1305", 32)
                .unwrap()
                .tuple_bytes(),
            28
        );
        assert!(TagMode::from_luks2("chacha20-random", "poly1305", 16).is_err());
        assert!(TagMode::from_luks2("chacha20-random", "aead", 32).is_err());
    }

    /// Every mode: round trip; a flipped bit of ciphertext, auth tag or IV, or the right data
    /// at another sector, fails to verify; IVs differ between two writes of the same data.
    #[test]
    fn round_trip_and_every_tamper_fails() {
        for mode in modes() {
            for ss in [512usize, 4096] {
                let key: Vec<u8> = (0..mode.key_bytes()).map(|i| i as u8 ^ 0x5a).collect();
                let mut c = TagCipher::new(mode, &key).unwrap();
                let plain: Vec<u8> = (0..3 * ss).map(|i| (i * 7 % 251) as u8).collect();
                let tb = mode.tuple_bytes();
                let mut data = plain.clone();
                let mut tuples = vec![0u8; 3 * tb];
                c.seal(80, ss, &mut data, &mut tuples).unwrap();
                assert_ne!(data, plain, "{mode:?}: encrypted");
                let mut again = plain.clone();
                let mut tuples2 = vec![0u8; 3 * tb];
                c.seal(80, ss, &mut again, &mut tuples2).unwrap();
                assert_ne!(tuples[..tb], tuples2[..tb], "{mode:?}: fresh IVs");
                let mut d = data.clone();
                assert_eq!(c.open(80, ss, &mut d, &tuples).unwrap(), Ok(()));
                assert_eq!(d, plain, "{mode:?}/{ss}: round trip");
                // Sealed from a separate plaintext buffer (left as it is): the same round trip.
                let mut out = vec![0u8; 3 * ss];
                let mut tuples3 = vec![0u8; 3 * tb];
                c.seal_to(80, ss, Some(&plain), &mut out, &mut tuples3)
                    .unwrap();
                assert_ne!(out, plain, "{mode:?}/{ss}: seal_to encrypted");
                assert_eq!(c.open(80, ss, &mut out, &tuples3).unwrap(), Ok(()));
                assert_eq!(out, plain, "{mode:?}/{ss}: seal_to round trip");
                let step = (ss / 512) as u64;
                let tampers: Vec<(&str, usize, usize)> = vec![
                    ("ciphertext", 1, ss + 17),
                    ("auth tag", 1, 3 * ss + tb + 1),
                    ("iv", 1, 3 * ss + tb + mode.auth_bytes()),
                ];
                for (what, bad_idx, at) in tampers {
                    let mut all = [data.clone(), tuples.clone()].concat();
                    all[at] ^= 0x01;
                    let (mut d, t) = (all[..3 * ss].to_vec(), all[3 * ss..].to_vec());
                    assert_eq!(
                        c.open(80, ss, &mut d, &t).unwrap(),
                        Err(TagMismatch {
                            sector: 80 + bad_idx as u64 * step
                        }),
                        "{mode:?}/{ss}: {what}"
                    );
                    assert!(d.iter().all(|&b| b == 0), "{what}: wiped");
                }
                // Right ciphertext and tuple, wrong place: the sector number is authenticated.
                let mut d = data.clone();
                assert_eq!(
                    c.open(80 + step, ss, &mut d, &tuples).unwrap(),
                    Err(TagMismatch { sector: 80 + step }),
                    "{mode:?}/{ss}: moved"
                );
            }
        }
    }
}
