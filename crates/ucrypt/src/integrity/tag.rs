//! Authenticated sectors as dm-crypt makes them over dm-integrity, sans I/O: each encryption
//! sector gets an authentication tag, and with a `random` IV generator also its IV, stored
//! together in the sector's dm-integrity tag ("tuple") as `[auth tag][IV]`.
//!
//! dm-crypt builds every request alike (`crypt_convert_block_aead`): for the sector whose first
//! 512-byte unit is `s` (counted from the start of the integrity device's data, whatever the
//! sector size; LUKS2 has no IV offset here), the associated data is `le64(s) || IV`, the IV
//! being the transform's IV for that sector: fresh random bytes (then kept in the tuple), or
//! the generator's IV for IV sector `s` (`plain64`: `le64(s)` zero-padded; `essiv:sha256`:
//! that block encrypted with AES, see below). The modes:
//! - `aes-gcm-random` + `aead`: the kernel's `gcm(aes)`, 12-byte IV, 16-byte tag. Tuple 28.
//! - `chacha20-random` / `chacha20-plain64` + `poly1305`: `rfc7539(chacha20,poly1305)` (RFC
//!   8439), 256-bit key, 12-byte IV, 16-byte tag. Tuple 28 (random) or 16 (plain64).
//! - `aes-ccm-random` + `aead`: `rfc4309(ccm(aes))`. The volume key is the AES key then a
//!   3-byte salt; the 8-byte IV follows the salt in CCM's 11-byte nonce, and rfc4309 takes the
//!   IV back out of the associated data, so CCM authenticates `le64(s)` alone. 16-byte tag.
//!   Tuple 24.
//! - `aegis128-random` + `aead`: the kernel's `aegis128` (AEGIS-128, [`super::aegis128`]),
//!   128-bit key, 16-byte IV, 16-byte tag; the associated data is `le64(s) || IV` (24 bytes),
//!   as for GCM. Tuple 32.
//! - `aes-xts|cbc-random|plain64|essiv:sha256` + `hmac(H)` (H = sha1, sha256, sha512): the
//!   kernel's `authenc(hmac(H),xts|cbc(aes))`; ESSIV goes through its `essiv(...)` template,
//!   which puts the encrypted IV into the associated data and keys its AES-256 with SHA-256 of
//!   the whole authenc key (encryption key, then MAC key: dm-crypt's volume key as it is), not
//!   of the encryption key alone as plain dm-crypt's ESSIV does. The sector is encrypted with
//!   the IV, then the tag is `HMAC-H(mac key, le64(s) || IV || ciphertext)`. The volume key is the
//!   encryption key followed by the MAC key: |H| bytes, or the segment's `integrity.key_size`
//!   when it has one (cryptsetup 2.8's `--integrity-key-size`, dm-crypt's `integrity_key_size`
//!   option). Tuple |H| + 16 (random) or |H|.
//!
//! Random IVs come from the operating system's CSPRNG (getrandom(2)), a fresh one for every
//! sector written: with 96-bit nonces (GCM, ChaCha20-Poly1305) the chance of a repeat stays
//! negligible up to the usual 2^32 writes per key bound NIST gives for random nonces (AEGIS's
//! 128-bit nonces allow far more; CCM's 64-bit IVs, as rfc4309 has them, far fewer). A generated IV repeats whenever a sector
//! is rewritten: cryptsetup offers `chacha20-plain64` with that property (its keystream is then
//! reused), and the authenc modes leak which sectors kept their contents, as plain dm-crypt
//! does.

use hmac::{Hmac, Mac};
use sha1::Sha1;
use sha2::{Sha256, Sha512};

use super::aegis128::{Aegis128, AEGIS128_IV_BYTES, AEGIS128_KEY_BYTES, AEGIS128_TAG_BYTES};
use crate::secret::SecretBox;
use crate::sector::block::Ecb;
use crate::sector::evp::{
    AeadAlg, AeadCtx, Alg, EvpCtx, AEAD_NONCE_BYTES, AEAD_TAG_BYTES, CCM_NONCE_BYTES, CCM_TAG_BYTES,
};
use crate::sector::{BlockCipher, CipherSpec, Geometry, SectorCipher, SectorSize};
use crate::{Error, Result};

/// An authenc IV (the block cipher's, 16 bytes), kept in each tuple when random.
pub const XTS_IV_BYTES: usize = 16;
/// AES-256-XTS key bytes (cryptsetup's default XTS key).
pub const XTS_KEY_BYTES: usize = 64;
/// ChaCha20's key bytes (the only size it has).
pub const CHACHA20_KEY_BYTES: usize = 32;
/// The salt rfc4309 takes from the end of a CCM key.
pub const CCM_SALT_BYTES: usize = 3;
/// The IV rfc4309 takes per request (the rest of CCM's nonce), kept in each tuple.
pub const CCM_IV_BYTES: usize = CCM_NONCE_BYTES - CCM_SALT_BYTES;

/// The MAC of an authenc volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HmacHash {
    Sha1,
    Sha256,
    Sha512,
}

impl HmacHash {
    pub const fn bytes(self) -> usize {
        match self {
            HmacHash::Sha1 => 20,
            HmacHash::Sha256 => 32,
            HmacHash::Sha512 => 64,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            HmacHash::Sha1 => "hmac(sha1)",
            HmacHash::Sha256 => "hmac(sha256)",
            HmacHash::Sha512 => "hmac(sha512)",
        }
    }
    fn from_name(s: &str) -> Option<HmacHash> {
        match s {
            "hmac(sha1)" => Some(HmacHash::Sha1),
            "hmac(sha256)" => Some(HmacHash::Sha256),
            "hmac(sha512)" => Some(HmacHash::Sha512),
            _ => None,
        }
    }
}

/// The block cipher mode under `authenc(hmac(H), mode(aes))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthencMode {
    Xts,
    Cbc,
}

/// Where an authenc sector's IV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvSource {
    /// Fresh random bytes per write, kept in the tuple.
    Random,
    /// dm-crypt's `plain64`: the IV sector, little-endian, zero-padded.
    Plain64,
    /// dm-crypt's `essiv:sha256`.
    EssivSha256,
}

/// `authenc(hmac(hash), mode(aes))` with `iv`: an encryption key of `enc_key_bytes` followed by
/// the MAC key of `mac_key_bytes` (by default as many bytes as the hash's output) in the
/// volume key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Authenc {
    pub mode: AuthencMode,
    pub iv: IvSource,
    pub hash: HmacHash,
    pub enc_key_bytes: usize,
    pub mac_key_bytes: usize,
}

impl Authenc {
    /// The dm-crypt cipher spec whose sector encryption this mode uses; the IV is always
    /// given explicitly (see [`TagCipher`]'s IV rules).
    fn sector_spec(self) -> CipherSpec {
        let spec = match self.mode {
            AuthencMode::Xts => "aes-xts-plain64",
            AuthencMode::Cbc => "aes-cbc-plain64",
        };
        spec.parse().expect("a fixed, valid cipher spec")
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
    /// `chacha20-plain64` with integrity `poly1305`; key 32 bytes; no IV stored.
    ChaCha20Plain64Poly1305,
    /// `aes-ccm-random` with integrity `aead`; `key_bytes` is the whole volume key: an AES key
    /// of 16, 24 or 32 bytes and the 3-byte salt.
    AesCcmRandom { key_bytes: usize },
    /// `aegis128-random` with integrity `aead`; key 16 bytes.
    Aegis128Random,
    /// `aes-xts|cbc-random|plain64|essiv:sha256` with integrity `hmac(sha1|sha256|sha512)`.
    Authenc(Authenc),
}

/// What this code supports, for error messages.
pub const SUPPORTED_MODES: &str = "aes-gcm-random + aead (128/256-bit key), \
     aes-ccm-random + aead (128/192/256-bit key + 24-bit salt), \
     chacha20-random|chacha20-plain64 + poly1305 (256-bit key), \
     aegis128-random + aead (128-bit key), \
     aes-xts-random|plain64|essiv:sha256 and aes-cbc-random|plain64|essiv:sha256 + \
     hmac(sha1)|hmac(sha256)|hmac(sha512) (the cipher's key, then the MAC key)";

impl TagMode {
    /// `aes-xts-random` + `hmac(H)` with a 512-bit XTS key.
    pub const fn xts_random_hmac(hash: HmacHash) -> TagMode {
        TagMode::Authenc(Authenc {
            mode: AuthencMode::Xts,
            iv: IvSource::Random,
            hash,
            enc_key_bytes: XTS_KEY_BYTES,
            mac_key_bytes: hash.bytes(),
        })
    }

    /// From the LUKS2 segment's `encryption`, `integrity.type` and the volume key length, with
    /// an HMAC's key as long as its hash's output.
    pub fn from_luks2(encryption: &str, integrity: &str, key_bytes: usize) -> Result<Self> {
        Self::from_luks2_keyed(encryption, integrity, key_bytes, None)
    }

    /// As [`TagMode::from_luks2`], with the segment's `integrity.key_size` (bytes of the HMAC
    /// key at the end of the volume key) when it has one. As cryptsetup reads it, the size
    /// means something only for an HMAC, and 0 is the hash's output size.
    pub fn from_luks2_keyed(
        encryption: &str,
        integrity: &str,
        key_bytes: usize,
        mac_key_bytes: Option<usize>,
    ) -> Result<Self> {
        let unsupported = |reason: String| Error::UnsupportedCipher {
            spec: format!("{encryption} + {integrity}"),
            reason,
            supported: SUPPORTED_MODES,
        };
        let bits = |n: usize| n * 8;
        match (encryption, integrity) {
            ("aes-gcm-random", "aead") => match key_bytes {
                16 | 32 => Ok(TagMode::AesGcmRandom { key_bytes }),
                n => Err(unsupported(format!("{}-bit GCM key", bits(n)))),
            },
            ("aes-ccm-random", "aead") => match key_bytes.checked_sub(CCM_SALT_BYTES) {
                Some(16 | 24 | 32) => Ok(TagMode::AesCcmRandom { key_bytes }),
                _ => Err(unsupported(format!(
                    "a {}-bit CCM key (an AES key of 128, 192 or 256 bits, then a 24-bit salt)",
                    bits(key_bytes)
                ))),
            },
            ("chacha20-random" | "chacha20-plain64", "poly1305") => match key_bytes {
                CHACHA20_KEY_BYTES if encryption == "chacha20-random" => {
                    Ok(TagMode::ChaCha20RandomPoly1305)
                }
                CHACHA20_KEY_BYTES => Ok(TagMode::ChaCha20Plain64Poly1305),
                n => Err(unsupported(format!("a {}-bit ChaCha20 key", bits(n)))),
            },
            ("aegis128-random", "aead") => match key_bytes {
                AEGIS128_KEY_BYTES => Ok(TagMode::Aegis128Random),
                n => Err(unsupported(format!(
                    "a {}-bit AEGIS-128 key (it takes 128 bits)",
                    bits(n)
                ))),
            },
            (_, i) if HmacHash::from_name(i).is_some() => {
                let hash = HmacHash::from_name(i).expect("matched above");
                let (mode, iv) = match encryption {
                    "aes-xts-random" => (AuthencMode::Xts, IvSource::Random),
                    "aes-xts-plain64" => (AuthencMode::Xts, IvSource::Plain64),
                    "aes-xts-essiv:sha256" => (AuthencMode::Xts, IvSource::EssivSha256),
                    "aes-cbc-random" => (AuthencMode::Cbc, IvSource::Random),
                    "aes-cbc-plain64" => (AuthencMode::Cbc, IvSource::Plain64),
                    "aes-cbc-essiv:sha256" => (AuthencMode::Cbc, IvSource::EssivSha256),
                    _ => {
                        return Err(unsupported(
                            "not a cipher ucrypt authenticates with an HMAC".into(),
                        ))
                    }
                };
                let mac_key_bytes = mac_key_bytes.filter(|&n| n > 0).unwrap_or(hash.bytes());
                let enc_key_bytes = key_bytes.saturating_sub(mac_key_bytes);
                let a = Authenc {
                    mode,
                    iv,
                    hash,
                    enc_key_bytes,
                    mac_key_bytes,
                };
                let ok = match mode {
                    AuthencMode::Xts => matches!(enc_key_bytes, 32 | 64),
                    AuthencMode::Cbc => matches!(enc_key_bytes, 16 | 24 | 32),
                };
                if !ok || a.sector_spec().check_key_len(enc_key_bytes).is_err() {
                    return Err(unsupported(format!(
                        "a {}-bit volume key: the cipher's key (XTS: 256 or 512 bits, CBC: 128, \
                         192 or 256) followed by a {}-bit MAC key",
                        bits(key_bytes),
                        bits(mac_key_bytes)
                    )));
                }
                Ok(TagMode::Authenc(a))
            }
            _ => Err(unsupported(
                "not an authenticated mode ucrypt implements".into(),
            )),
        }
    }

    /// Bytes of the authentication tag.
    pub fn auth_bytes(self) -> usize {
        match self {
            TagMode::AesGcmRandom { .. }
            | TagMode::ChaCha20RandomPoly1305
            | TagMode::ChaCha20Plain64Poly1305 => AEAD_TAG_BYTES,
            TagMode::AesCcmRandom { .. } => CCM_TAG_BYTES,
            TagMode::Aegis128Random => AEGIS128_TAG_BYTES,
            TagMode::Authenc(a) => a.hash.bytes(),
        }
    }

    /// Bytes of the IV kept in the tuple (0 when the IV is generated from the sector).
    pub fn iv_bytes(self) -> usize {
        match self {
            TagMode::AesGcmRandom { .. } | TagMode::ChaCha20RandomPoly1305 => AEAD_NONCE_BYTES,
            TagMode::ChaCha20Plain64Poly1305 => 0,
            TagMode::AesCcmRandom { .. } => CCM_IV_BYTES,
            TagMode::Aegis128Random => AEGIS128_IV_BYTES,
            TagMode::Authenc(a) if a.iv == IvSource::Random => XTS_IV_BYTES,
            TagMode::Authenc(_) => 0,
        }
    }

    /// Bytes dm-integrity must keep per sector (cryptsetup's tag size for the mode).
    pub fn tuple_bytes(self) -> usize {
        self.auth_bytes() + self.iv_bytes()
    }

    /// Bytes of the volume key.
    pub fn key_bytes(self) -> usize {
        match self {
            TagMode::AesGcmRandom { key_bytes } | TagMode::AesCcmRandom { key_bytes } => key_bytes,
            TagMode::ChaCha20RandomPoly1305 | TagMode::ChaCha20Plain64Poly1305 => {
                CHACHA20_KEY_BYTES
            }
            TagMode::Aegis128Random => AEGIS128_KEY_BYTES,
            TagMode::Authenc(a) => a.enc_key_bytes + a.mac_key_bytes,
        }
    }
}

enum Imp {
    /// GCM or ChaCha20-Poly1305: the context lives in a secret box inside `AeadCtx`.
    Aead(AeadCtx),
    /// In a secret box: the salt is key material.
    Ccm(SecretBox<Ccm>),
    /// In a secret box: the AEGIS-128 key.
    Aegis(SecretBox<Aegis128>),
    /// In a secret box: the keyed HMAC states (the key's inner and outer pads, hashed) are
    /// key material, and several hundred bytes.
    Authenc(SecretBox<AuthencImp>),
}

struct Ccm {
    enc: EvpCtx,
    dec: EvpCtx,
    salt: [u8; CCM_SALT_BYTES],
}

struct AuthencImp {
    /// Encrypts sectors of any size with an explicit IV.
    cipher: SectorCipher,
    /// `essiv:sha256`: AES-256 keyed with SHA-256 of the whole volume key.
    essiv: Option<Ecb>,
    mac: MacKey,
}

enum MacKey {
    Sha1(Hmac<Sha1>),
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
            TagMode::ChaCha20RandomPoly1305 | TagMode::ChaCha20Plain64Poly1305 => {
                Imp::Aead(AeadCtx::new(AeadAlg::ChaCha20Poly1305, key)?)
            }
            TagMode::AesCcmRandom { .. } => {
                let (aes, salt) = key.split_at(key.len() - CCM_SALT_BYTES);
                let mut s = [0u8; CCM_SALT_BYTES];
                s.copy_from_slice(salt);
                Imp::Ccm(SecretBox::new(Ccm {
                    enc: EvpCtx::new(Alg::AesCcm, aes, true)?,
                    dec: EvpCtx::new(Alg::AesCcm, aes, false)?,
                    salt: s,
                }))
            }
            TagMode::Aegis128Random => Imp::Aegis(SecretBox::new(
                Aegis128::new(key).ok_or(Error::Bug("AEGIS-128 key length"))?,
            )),
            TagMode::Authenc(a) => {
                let (ek, mk) = key.split_at(a.enc_key_bytes);
                let bad = |_| Error::Bug("HMAC key");
                let mac = match a.hash {
                    HmacHash::Sha1 => MacKey::Sha1(Hmac::new_from_slice(mk).map_err(bad)?),
                    HmacHash::Sha256 => MacKey::Sha256(Hmac::new_from_slice(mk).map_err(bad)?),
                    HmacHash::Sha512 => MacKey::Sha512(Hmac::new_from_slice(mk).map_err(bad)?),
                };
                let cipher =
                    SectorCipher::new(a.sector_spec(), ek, Geometry::new(SectorSize::S512))?;
                let essiv = match a.iv {
                    IvSource::EssivSha256 => {
                        use sha2::Digest;
                        let mut salt: [u8; 32] = Sha256::digest(key).into();
                        let e = Ecb::new(BlockCipher::Aes, &salt);
                        zeroize::Zeroize::zeroize(&mut salt);
                        Some(e?)
                    }
                    IvSource::Random | IvSource::Plain64 => None,
                };
                Imp::Authenc(SecretBox::new(AuthencImp { cipher, essiv, mac }))
            }
        };
        Ok(TagCipher { mode, imp })
    }

    pub fn mode(&self) -> TagMode {
        self.mode
    }

    /// Encrypts the sectors of `data` (each `sector_bytes`) in place, the first at 512-byte
    /// unit `first_sector`, and fills one tuple per sector into `tuples` (back to back, each
    /// [`TagMode::tuple_bytes`]). Draws fresh IVs from the OS CSPRNG for the whole run at once
    /// (random-IV modes).
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
        if ivb > 0 {
            fill_random_ivs(tuples, auth, ivb)?;
        }
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
                    let nonce = aead_nonce(s, iv)?;
                    let ad = aead_ad(s, &nonce);
                    let tag: &mut [u8; AEAD_TAG_BYTES] = tag.try_into().expect("16-byte tag");
                    match plain {
                        Some(p) => g.seal_to(&nonce, &ad, p, sec, tag)?,
                        None => g.seal_in_place(&nonce, &ad, sec, tag)?,
                    }
                }
                Imp::Ccm(c) => {
                    let nonce = c.nonce(iv);
                    let tag: &mut [u8; CCM_TAG_BYTES] = tag.try_into().expect("16-byte tag");
                    c.enc.ccm_seal(&nonce, &s.to_le_bytes(), plain, sec, tag)?;
                }
                Imp::Aegis(a) => {
                    let iv: &[u8; AEGIS128_IV_BYTES] = (&*iv).try_into().expect("16-byte IV");
                    tag.copy_from_slice(&a.seal(iv, &aegis_ad(s, iv), plain, sec));
                }
                Imp::Authenc(x) => {
                    let AuthencImp { cipher, essiv, mac } = &mut **x;
                    let iv = authenc_iv(essiv.as_mut(), s, iv)?;
                    cipher.crypt_sector_with_iv(true, &iv, plain, sec)?;
                    mac.tag(s, &iv, sec, tag);
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
                    let nonce = aead_nonce(s, iv)?;
                    let tag: &[u8; AEAD_TAG_BYTES] = tag.try_into().expect("16-byte tag");
                    g.open_in_place(&nonce, &aead_ad(s, &nonce), sec, tag)
                }
                Imp::Ccm(c) => {
                    let nonce = c.nonce(iv);
                    let tag: &[u8; CCM_TAG_BYTES] = tag.try_into().expect("16-byte tag");
                    c.dec.ccm_open(&nonce, &s.to_le_bytes(), sec, tag)?
                }
                Imp::Aegis(a) => {
                    let iv: &[u8; AEGIS128_IV_BYTES] = iv.try_into().expect("16-byte IV");
                    a.open(iv, &aegis_ad(s, iv), sec, tag)
                }
                Imp::Authenc(x) => {
                    let AuthencImp { cipher, essiv, mac } = &mut **x;
                    let iv = authenc_iv(essiv.as_mut(), s, iv)?;
                    if mac.verify(s, &iv, sec, tag) {
                        cipher.crypt_sector_with_iv(false, &iv, None, sec)?;
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

impl Ccm {
    /// rfc4309's nonce: the key's salt, then the request's 8-byte IV.
    fn nonce(&self, iv: &[u8]) -> [u8; CCM_NONCE_BYTES] {
        let mut n = [0u8; CCM_NONCE_BYTES];
        n[..CCM_SALT_BYTES].copy_from_slice(&self.salt);
        n[CCM_SALT_BYTES..].copy_from_slice(iv);
        n
    }
}

/// The 12-byte AEAD nonce of sector `s`: the stored IV, or with none stored (`plain64`),
/// `le64(s)` zero-padded.
fn aead_nonce(s: u64, stored: &[u8]) -> Result<[u8; AEAD_NONCE_BYTES]> {
    let mut n = [0u8; AEAD_NONCE_BYTES];
    match stored.len() {
        0 => n[..8].copy_from_slice(&s.to_le_bytes()),
        AEAD_NONCE_BYTES => n.copy_from_slice(stored),
        _ => return Err(Error::Bug("AEAD IV length")),
    }
    Ok(n)
}

/// The 16-byte IV of an authenc sector: the stored one (random), or the generator's for IV
/// sector `s`: `le64(s)` zero-padded (plain64), encrypted with the ESSIV cipher when given.
fn authenc_iv(essiv: Option<&mut Ecb>, s: u64, stored: &[u8]) -> Result<[u8; XTS_IV_BYTES]> {
    match stored.len() {
        0 => {
            let mut iv = [0u8; XTS_IV_BYTES];
            iv[..8].copy_from_slice(&s.to_le_bytes());
            if let Some(e) = essiv {
                e.encrypt_block(&mut iv)?;
            }
            Ok(iv)
        }
        XTS_IV_BYTES => Ok(stored.try_into().expect("16 bytes")),
        _ => Err(Error::Bug("authenc IV length")),
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

/// AEGIS-128's associated data, as dm-crypt passes it: the sector number then the IV (24 bytes).
fn aegis_ad(sector: u64, iv: &[u8; AEGIS128_IV_BYTES]) -> [u8; 8 + AEGIS128_IV_BYTES] {
    let mut ad = [0u8; 8 + AEGIS128_IV_BYTES];
    ad[..8].copy_from_slice(&sector.to_le_bytes());
    ad[8..].copy_from_slice(iv);
    ad
}

impl MacKey {
    fn tag(&self, sector: u64, iv: &[u8; XTS_IV_BYTES], ct: &[u8], out: &mut [u8]) {
        match self {
            MacKey::Sha1(k) => {
                out.copy_from_slice(&mac_over(k.clone(), sector, iv, ct).finalize().into_bytes())
            }
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
            MacKey::Sha1(k) => mac_over(k.clone(), sector, iv, ct)
                .verify_slice(tag)
                .is_ok(),
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
            TagMode::xts_random_hmac(HmacHash::Sha256),
            TagMode::xts_random_hmac(HmacHash::Sha512),
            TagMode::ChaCha20Plain64Poly1305,
            TagMode::AesCcmRandom { key_bytes: 19 },
            TagMode::AesCcmRandom { key_bytes: 35 },
            TagMode::Aegis128Random,
        ]
        .into_iter()
        .chain(
            [
                ("aes-xts-random", "hmac(sha1)", 32 + 20),
                ("aes-xts-plain64", "hmac(sha1)", 64 + 20),
                ("aes-xts-plain64", "hmac(sha256)", 32 + 32),
                ("aes-xts-essiv:sha256", "hmac(sha512)", 64 + 64),
                ("aes-cbc-essiv:sha256", "hmac(sha256)", 16 + 32),
                ("aes-cbc-plain64", "hmac(sha256)", 32 + 32),
                ("aes-cbc-random", "hmac(sha512)", 24 + 64),
            ]
            .map(|(e, i, k)| TagMode::from_luks2(e, i, k).expect("a supported mode")),
        )
        .chain(
            // cryptsetup 2.8's --integrity-key-size lines: MAC keys of 33 and 99 bytes.
            [
                ("aes-xts-plain64", "hmac(sha256)", 64 + 33, 33),
                ("aes-xts-random", "hmac(sha512)", 64 + 99, 99),
            ]
            .map(|(e, i, k, m)| {
                TagMode::from_luks2_keyed(e, i, k, Some(m)).expect("a supported mode")
            }),
        )
        .collect()
    }

    /// The segment's `integrity.key_size`: the MAC key's length at the end of the volume key;
    /// 0 or none is the hash's output size; an AEAD has no separate key and ignores it, as
    /// cryptsetup's `INTEGRITY_key_size` does.
    #[test]
    fn integrity_key_size_splits_the_volume_key() {
        let m = TagMode::from_luks2_keyed("aes-xts-plain64", "hmac(sha256)", 97, Some(33)).unwrap();
        let TagMode::Authenc(a) = m else {
            panic!("not authenc: {m:?}")
        };
        assert_eq!(
            (a.enc_key_bytes, a.mac_key_bytes, m.key_bytes()),
            (64, 33, 97)
        );
        assert_eq!(m.tuple_bytes(), 32, "the tag stays the hash's size");
        for size in [None, Some(0)] {
            assert_eq!(
                TagMode::from_luks2_keyed("aes-xts-plain64", "hmac(sha256)", 96, size).unwrap(),
                TagMode::from_luks2("aes-xts-plain64", "hmac(sha256)", 96).unwrap()
            );
        }
        // 97 bytes with a 32-byte MAC key leave 65 for XTS: refused.
        assert!(TagMode::from_luks2("aes-xts-plain64", "hmac(sha256)", 97).is_err());
        assert!(
            TagMode::from_luks2_keyed("aes-xts-plain64", "hmac(sha256)", 96, Some(33)).is_err()
        );
        assert!(
            TagMode::from_luks2_keyed("aes-xts-plain64", "hmac(sha256)", 20, Some(33)).is_err()
        );
        assert_eq!(
            TagMode::from_luks2_keyed("aes-gcm-random", "aead", 32, Some(16)).unwrap(),
            TagMode::AesGcmRandom { key_bytes: 32 }
        );
    }

    /// A sector of `aes-xts-plain64` + `hmac(sha256)` with a 33-byte MAC key, against the
    /// construction computed here from its parts: the data encrypted as plain dm-crypt's
    /// aes-xts-plain64 does with the first 64 bytes of the key, the tag HMAC-SHA256 under the
    /// last 33 bytes of `le64(sector) || IV || ciphertext`.
    #[test]
    fn a_separate_mac_key_is_the_end_of_the_volume_key() {
        let key: Vec<u8> = (0..97u8)
            .map(|i| i.wrapping_mul(7).wrapping_add(1))
            .collect();
        let mode =
            TagMode::from_luks2_keyed("aes-xts-plain64", "hmac(sha256)", 97, Some(33)).unwrap();
        let mut c = TagCipher::new(mode, &key).unwrap();
        let sector = 9u64;
        let plain: Vec<u8> = (0..512u32).map(|i| (i * 3) as u8).collect();
        let mut data = plain.clone();
        let mut tuple = vec![0u8; mode.tuple_bytes()];
        c.seal(sector, 512, &mut data, &mut tuple).unwrap();
        let mut want = plain.clone();
        let mut xts = SectorCipher::new(
            CipherSpec::AES_XTS_PLAIN64,
            &key[..64],
            Geometry::new(SectorSize::S512),
        )
        .unwrap();
        xts.encrypt(sector, &mut want).unwrap();
        assert_eq!(data, want, "the ciphertext: XTS under the first 64 bytes");
        let mut iv = [0u8; 16];
        iv[..8].copy_from_slice(&sector.to_le_bytes());
        let mut mac = Hmac::<Sha256>::new_from_slice(&key[64..]).unwrap();
        mac.update(&sector.to_le_bytes());
        mac.update(&iv);
        mac.update(&want);
        assert_eq!(tuple, mac.finalize().into_bytes().to_vec(), "the tag");
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
        assert!(TagMode::from_luks2("aes-xts-random", "hmac(sha256)", 60).is_err());
        assert!(TagMode::from_luks2("aes-xts-plain64", "hmac(sha256)", 80).is_err());
        assert!(TagMode::from_luks2("aes-xts-plain64", "aead", 64).is_err());
        assert_eq!(
            TagMode::from_luks2("aegis128-random", "aead", 16).unwrap(),
            TagMode::Aegis128Random
        );
        assert!(TagMode::from_luks2("aegis128-random", "aead", 32).is_err());
        assert!(TagMode::from_luks2("aegis128-random", "poly1305", 16).is_err());
        // The matrix of cryptsetup's luks2-integrity-test: tag sizes as cryptsetup computes them.
        for (enc, integ, key_bytes, tuple) in [
            ("aes-cbc-essiv:sha256", "hmac(sha256)", 16 + 32, 32),
            ("aes-xts-plain64", "hmac(sha256)", 32 + 32, 32),
            ("aes-xts-random", "hmac(sha256)", 32 + 32, 48),
            ("aes-cbc-essiv:sha256", "hmac(sha512)", 32 + 64, 64),
            ("aes-xts-essiv:sha256", "hmac(sha512)", 64 + 64, 64),
            ("aes-xts-plain64", "hmac(sha1)", 64 + 20, 20),
            ("aes-xts-random", "hmac(sha1)", 64 + 20, 36),
            ("aes-ccm-random", "aead", 19, 24),
            ("aes-ccm-random", "aead", 35, 24),
            ("chacha20-plain64", "poly1305", 32, 16),
            ("aegis128-random", "aead", 16, 32),
        ] {
            let m = TagMode::from_luks2(enc, integ, key_bytes).unwrap();
            assert_eq!(
                (m.tuple_bytes(), m.key_bytes()),
                (tuple, key_bytes),
                "{enc}"
            );
        }
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
                if mode.iv_bytes() > 0 {
                    assert_ne!(tuples[..tb], tuples2[..tb], "{mode:?}: fresh IVs");
                } else {
                    assert_eq!(
                        (&data, &tuples),
                        (&again, &tuples2),
                        "{mode:?}: generated IVs"
                    );
                }
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
                let mut tampers: Vec<(&str, usize, usize)> =
                    vec![("ciphertext", 1, ss + 17), ("auth tag", 1, 3 * ss + tb + 1)];
                if mode.iv_bytes() > 0 {
                    tampers.push(("iv", 1, 3 * ss + tb + mode.auth_bytes()));
                }
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
