//! dm-crypt cipher specifications (`cipher-chainmode-ivmode[:ivopts]`, or the kernel-API form
//! `capi:chainmode(cipher)-ivmode[:ivopts]`), parsed once into a [`CipherSpec`].
//!
//! What is accepted follows what the kernel accepts for the same string: a block cipher in
//! XTS, CBC or LRW with an IV generator, or Adiantum; ESSIV with any hash whose digest is a key
//! size of the block cipher (the kernel's `essiv` template keys the same cipher with the
//! digest, so `aes-cbc-essiv:sha1` is refused there as here, while `serpent-cbc-essiv:sha1` is
//! fine).

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// What `ucrypt` accepts, for error messages.
pub const SUPPORTED_SPECS: &str = "CIPHER-MODE-IV with CIPHER aes, serpent, twofish or \
camellia, MODE xts, cbc or lrw, IV plain64, plain, plain64be, benbi or essiv:HASH (HASH sha1, \
sha224, sha256, sha384, sha512, rmd160, wp256, wp384, wp512 or sm3, its digest a key size of \
CIPHER), e.g. aes-xts-plain64, serpent-cbc-essiv:sha256, aes-lrw-benbi; \
xchacha12,aes-adiantum-plain64 and xchacha20,aes-adiantum-plain64 (IV plain64, plain or \
plain64be); cipher_null-ecb; TrueCrypt 3.x's CBC with IV tcw: aes-cbc-tcw (or serpent, \
twofish, camellia), cast5-cbc-tcw and des3_ede-cbc-tcw; and their capi: forms, e.g. \
capi:xts(serpent)-plain64, capi:adiantum(xchacha12,aes)-plain64";

/// A 128-bit block cipher as dm-crypt names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockCipher {
    /// AES (AWS-LC): 128, 192 or 256-bit keys.
    Aes,
    /// Serpent (RustCrypto `serpent`): 128 to 256-bit keys.
    Serpent,
    /// Twofish (table-driven, sector/twofish.rs): 128, 192 or 256-bit keys.
    Twofish,
    /// Camellia (table-driven, sector/camellia.rs): 128, 192 or 256-bit keys.
    Camellia,
}

impl BlockCipher {
    pub const ALL: [BlockCipher; 4] = [
        BlockCipher::Aes,
        BlockCipher::Serpent,
        BlockCipher::Twofish,
        BlockCipher::Camellia,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BlockCipher::Aes => "aes",
            BlockCipher::Serpent => "serpent",
            BlockCipher::Twofish => "twofish",
            BlockCipher::Camellia => "camellia",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        BlockCipher::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Whether `bytes` is a key length this cipher takes. The kernel's serpent also takes
    /// keys shorter than 128 bits (padded as the Serpent paper says); no dm-crypt key size
    /// and no ESSIV digest is that short, and the RustCrypto implementation refuses them.
    pub fn takes_key_bytes(self, bytes: usize) -> bool {
        match self {
            BlockCipher::Serpent => (16..=32).contains(&bytes),
            BlockCipher::Aes | BlockCipher::Twofish | BlockCipher::Camellia => {
                matches!(bytes, 16 | 24 | 32)
            }
        }
    }
}

/// A 64-bit block cipher as dm-crypt names it: TrueCrypt 3.x's CBC volumes (cryptsetup's
/// `cbc-tcw` chains `cast5` and `des3_ede`) are its only use here, so it runs only in CBC with
/// the `tcw` IV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockCipher64 {
    /// CAST-128 (RFC 2144; RustCrypto `cast5`) with a 128-bit key, TrueCrypt's size.
    Cast5,
    /// Triple DES, encrypt-decrypt-encrypt with three keys (RustCrypto `des::TdesEde3`).
    Des3Ede,
}

impl BlockCipher64 {
    pub const ALL: [BlockCipher64; 2] = [BlockCipher64::Cast5, BlockCipher64::Des3Ede];

    pub fn name(self) -> &'static str {
        match self {
            BlockCipher64::Cast5 => "cast5",
            BlockCipher64::Des3Ede => "des3_ede",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        BlockCipher64::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The cipher key's length: the one TrueCrypt's chains use.
    pub fn key_bytes(self) -> usize {
        match self {
            BlockCipher64::Cast5 => 16,
            BlockCipher64::Des3Ede => 24,
        }
    }
}

/// The stream cipher of Adiantum: XChaCha with 12 or 20 rounds (the kernel's two instances,
/// `adiantum(xchacha12,aes)` and `adiantum(xchacha20,aes)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XChaCha {
    R12,
    R20,
}

impl XChaCha {
    pub fn name(self) -> &'static str {
        match self {
            XChaCha::R12 => "xchacha12",
            XChaCha::R20 => "xchacha20",
        }
    }
}

/// The chaining mode of every layer of a [`Cascade`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CascadeChain {
    Xts,
    Lrw,
}

/// Two or three block ciphers stacked, each in the same chaining mode with the same IV, as
/// cryptsetup maps a TrueCrypt/VeraCrypt cascade (one dm-crypt device per cipher over the
/// next). `ciphers[0]` is the outermost layer: encryption runs `ciphers[0]` first and the last
/// cipher last (it is the one that meets the disk); decryption the other way round. The key
/// is each layer's dm-crypt key in the order of `ciphers` (64 bytes each for XTS, 48 for LRW).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cascade {
    pub chain: CascadeChain,
    ciphers: [BlockCipher; CASCADE_LAYERS_MAX],
    len: u8,
}

/// The most layers a cascade has (TrueCrypt's and VeraCrypt's longest chains have three).
pub const CASCADE_LAYERS_MAX: usize = 3;

impl Cascade {
    /// A cascade of 1 to [`CASCADE_LAYERS_MAX`] ciphers, outermost first.
    pub fn new(chain: CascadeChain, ciphers: &[BlockCipher]) -> Result<Self> {
        if ciphers.is_empty() || ciphers.len() > CASCADE_LAYERS_MAX {
            return Err(Error::InvalidArgument(format!(
                "a cascade has 1 to {CASCADE_LAYERS_MAX} ciphers, not {}",
                ciphers.len()
            )));
        }
        let mut c = [ciphers[0]; CASCADE_LAYERS_MAX];
        c[..ciphers.len()].copy_from_slice(ciphers);
        Ok(Cascade {
            chain,
            ciphers: c,
            len: ciphers.len() as u8,
        })
    }

    /// The ciphers, outermost first.
    pub fn ciphers(&self) -> &[BlockCipher] {
        &self.ciphers[..self.len as usize]
    }

    /// Key bytes of one layer: two 256-bit keys for XTS, a 256-bit key and the 128-bit tweak
    /// key for LRW.
    pub fn layer_key_bytes(&self) -> usize {
        match self.chain {
            CascadeChain::Xts => 64,
            CascadeChain::Lrw => 48,
        }
    }

    /// The chain's name as TrueCrypt and cryptsetup spell it: `serpent-twofish-aes`.
    pub fn name(&self) -> String {
        let names: Vec<&str> = self.ciphers().iter().map(|c| c.name()).collect();
        names.join("-")
    }
}

/// Cipher and chaining mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// XTS (IEEE 1619); the key is two cipher keys of equal size (256, 384 or 512 bits).
    Xts(BlockCipher),
    /// CBC restarted every sector with that sector's IV (128, 192 or 256 bits; serpent also
    /// the sizes between).
    Cbc(BlockCipher),
    /// CBC over a 64-bit block cipher, restarted every sector; with the `tcw` IV only (an
    /// 8-byte IV, TrueCrypt 3.x's volumes).
    Cbc64(BlockCipher64),
    /// LRW (the kernel's `lrw` template): the cipher key followed by the 128-bit tweak key;
    /// the IV is the big-endian index of the sector's first 16-byte block.
    Lrw(BlockCipher),
    /// Adiantum (the kernel's `adiantum(xchachaN,aes)`): a 256-bit key, one wide block per
    /// sector, a 32-byte tweak.
    Adiantum(XChaCha),
    /// dm-crypt's null cipher: ciphertext = plaintext, key size 0. For benchmarks only.
    Null,
    /// Block ciphers stacked (TrueCrypt/VeraCrypt cascades); no dm-crypt spec string names
    /// one, so it is built, never parsed.
    Cascade(Cascade),
}

impl Mode {
    /// The `cipher` part of a dm-crypt spec (`serpent`, `xchacha12,aes`, `cipher_null`), which
    /// LUKS1 stores as `cipher_name`.
    pub fn cipher_name(self) -> &'static str {
        match self {
            Mode::Xts(c) | Mode::Cbc(c) | Mode::Lrw(c) => c.name(),
            Mode::Cbc64(c) => c.name(),
            Mode::Adiantum(XChaCha::R12) => "xchacha12,aes",
            Mode::Adiantum(XChaCha::R20) => "xchacha20,aes",
            Mode::Null => "cipher_null",
            Mode::Cascade(_) => "cascade",
        }
    }

    /// The chaining-mode part (`xts`, `adiantum`, `ecb` for the null cipher).
    pub fn chain_name(self) -> &'static str {
        match self {
            Mode::Xts(_) => "xts",
            Mode::Cbc(_) | Mode::Cbc64(_) => "cbc",
            Mode::Lrw(_) => "lrw",
            Mode::Adiantum(_) => "adiantum",
            Mode::Null => "ecb",
            Mode::Cascade(c) => match c.chain {
                CascadeChain::Xts => "xts",
                CascadeChain::Lrw => "lrw",
            },
        }
    }

    /// The 128-bit block cipher a block mode runs (also ESSIV's cipher); `None` for Adiantum,
    /// null, cascades and the 64-bit ciphers.
    pub fn block_cipher(self) -> Option<BlockCipher> {
        match self {
            Mode::Xts(c) | Mode::Cbc(c) | Mode::Lrw(c) => Some(c),
            Mode::Cbc64(_) | Mode::Adiantum(_) | Mode::Null | Mode::Cascade(_) => None,
        }
    }
}

/// The hash of an ESSIV IV generator, by its kernel name (`essiv:sha256`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EssivHash {
    Sha1,
    Sha224,
    Sha256,
    Sha384,
    Sha512,
    Rmd160,
    /// Whirlpool truncated to 256 bits (the kernel's `wp256`).
    Wp256,
    /// Whirlpool truncated to 384 bits.
    Wp384,
    Wp512,
    Sm3,
}

impl EssivHash {
    const ALL: [EssivHash; 10] = [
        EssivHash::Sha1,
        EssivHash::Sha224,
        EssivHash::Sha256,
        EssivHash::Sha384,
        EssivHash::Sha512,
        EssivHash::Rmd160,
        EssivHash::Wp256,
        EssivHash::Wp384,
        EssivHash::Wp512,
        EssivHash::Sm3,
    ];

    pub fn name(self) -> &'static str {
        match self {
            EssivHash::Sha1 => "sha1",
            EssivHash::Sha224 => "sha224",
            EssivHash::Sha256 => "sha256",
            EssivHash::Sha384 => "sha384",
            EssivHash::Sha512 => "sha512",
            EssivHash::Rmd160 => "rmd160",
            EssivHash::Wp256 => "wp256",
            EssivHash::Wp384 => "wp384",
            EssivHash::Wp512 => "wp512",
            EssivHash::Sm3 => "sm3",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        // cryptsetup also writes `ripemd160` and `whirlpool` for these two.
        match name {
            "ripemd160" => Some(EssivHash::Rmd160),
            "whirlpool" => Some(EssivHash::Wp512),
            _ => EssivHash::ALL.into_iter().find(|h| h.name() == name),
        }
    }

    /// Digest length in bytes: the ESSIV cipher's key length.
    pub fn digest_bytes(self) -> usize {
        match self {
            EssivHash::Sha1 | EssivHash::Rmd160 => 20,
            EssivHash::Sha224 => 28,
            EssivHash::Sha256 | EssivHash::Wp256 | EssivHash::Sm3 => 32,
            EssivHash::Sha384 | EssivHash::Wp384 => 48,
            EssivHash::Sha512 | EssivHash::Wp512 => 64,
        }
    }
}

/// How the per-sector IV is derived from the sector number (dm-crypt's IV generators).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IvMode {
    /// Little-endian 64-bit sector number, zero padded.
    Plain64,
    /// Little-endian 32-bit sector number (wraps at 2 TiB of 512-byte sectors), zero padded.
    Plain,
    /// Big-endian 64-bit sector number in the last 8 bytes of the IV.
    Plain64Be,
    /// dm-crypt's `benbi`: the big-endian 64-bit count of 16-byte blocks before the sector,
    /// plus one, in the last 8 bytes (LRW's block index, counted from 1).
    Benbi,
    /// ESSIV: plain64 encrypted with the mode's block cipher keyed with the hash of the whole
    /// volume key.
    Essiv(EssivHash),
    /// dm-crypt's `tcw` (TrueCrypt before 4.1, CBC only): the IV is a seed XORed with the
    /// little-endian sector number in each half, and each ciphertext sector is whitened with 8
    /// bytes derived from a whitening key and the sector number. Seed and whitening key are
    /// the last 32 bytes of the key.
    Tcw,
    /// dm-crypt's `eboiv` (BitLocker's CBC): the IV is the sector's byte offset
    /// (little-endian 64-bit, zero padded) encrypted with the data key.
    Eboiv,
    /// dm-crypt's `elephant` (BitLocker's CBC with the Elephant diffuser, Windows 7): the
    /// eboiv IV with the first half of the key as the CBC key; the second half keys the sector
    /// key that each sector is XORed with before diffusers A and B run over it.
    Elephant,
    /// dm-crypt's `lmk` with 64 keys (loop-AES multi-key, `aes:64-cbc-lmk`; CBC only): the
    /// key of sector n is key n mod 64, the IV an MD5 state over the sector's plaintext and
    /// number (`lmk.rs`). The key is 64 subkeys, or 65 parts whose last is the IV seed.
    Lmk64,
    /// No IV (the null cipher).
    None,
}

impl IvMode {
    fn name(self) -> String {
        match self {
            IvMode::Plain64 => "plain64".into(),
            IvMode::Plain => "plain".into(),
            IvMode::Plain64Be => "plain64be".into(),
            IvMode::Benbi => "benbi".into(),
            IvMode::Essiv(h) => format!("essiv:{}", h.name()),
            IvMode::Tcw => "tcw".into(),
            IvMode::Eboiv => "eboiv".into(),
            IvMode::Elephant => "elephant".into(),
            IvMode::Lmk64 => "lmk".into(),
            IvMode::None => "null".into(),
        }
    }
}

/// A parsed, validated dm-crypt cipher specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CipherSpec {
    pub mode: Mode,
    pub iv: IvMode,
}

impl CipherSpec {
    pub const AES_XTS_PLAIN64: CipherSpec = CipherSpec {
        mode: Mode::Xts(BlockCipher::Aes),
        iv: IvMode::Plain64,
    };
    pub const NULL: CipherSpec = CipherSpec {
        mode: Mode::Null,
        iv: IvMode::None,
    };

    /// Key sizes this spec accepts, in bytes.
    pub fn key_bytes_allowed(&self) -> &'static [usize] {
        if self.iv == IvMode::Lmk64 {
            return match self.mode {
                Mode::Cbc(c) => lmk_key_bytes_allowed(c),
                _ => &[],
            };
        }
        if self.iv == IvMode::Tcw {
            // The cipher key, then an IV seed of one block and the 16-byte whitening key.
            return match self.mode {
                Mode::Cbc(_) => &[48, 56, 64],
                Mode::Cbc64(BlockCipher64::Cast5) => &[40],
                Mode::Cbc64(BlockCipher64::Des3Ede) => &[48],
                _ => &[],
            };
        }
        if self.iv == IvMode::Elephant {
            // The CBC key, then an elephant key of the same size (AES-128 or AES-256).
            return &[32, 64];
        }
        match self.mode {
            Mode::Cascade(c) => match (c.chain, c.len) {
                (CascadeChain::Xts, 1) => &[64],
                (CascadeChain::Xts, 2) => &[128],
                (CascadeChain::Xts, _) => &[192],
                (CascadeChain::Lrw, 1) => &[48],
                (CascadeChain::Lrw, 2) => &[96],
                (CascadeChain::Lrw, _) => &[144],
            },
            Mode::Xts(BlockCipher::Serpent) => &[
                32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62, 64,
            ],
            Mode::Xts(_) => &[32, 48, 64],
            Mode::Cbc(BlockCipher::Serpent) => &[
                16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32,
            ],
            Mode::Cbc(_) => &[16, 24, 32],
            Mode::Lrw(BlockCipher::Serpent) => &[
                32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48,
            ],
            Mode::Lrw(_) => &[32, 40, 48],
            // Only with the tcw IV (above).
            Mode::Cbc64(_) => &[],
            Mode::Adiantum(_) => &[32],
            Mode::Null => &[0],
        }
    }

    /// The key size cryptsetup picks by default for this spec, in bytes (512 bits for XTS,
    /// 256 otherwise: for LRW that is a 128-bit cipher key and the tweak key); for the `tcw`
    /// CBCs, the size of TrueCrypt's keys (cipher key, IV seed, whitening key).
    pub fn default_key_bytes(&self) -> usize {
        match self.mode {
            Mode::Xts(_) => 64,
            // TrueCrypt's: a 256-bit cipher key, the 16-byte IV seed and whitening key.
            Mode::Cbc(_) if self.iv == IvMode::Tcw => 64,
            Mode::Cbc(_) | Mode::Lrw(_) | Mode::Adiantum(_) => 32,
            // The cipher key, the 8-byte IV seed and the 16-byte whitening key.
            Mode::Cbc64(c) => c.key_bytes() + 8 + 16,
            Mode::Null => 0,
            Mode::Cascade(c) => c.layer_key_bytes() * c.ciphers().len(),
        }
    }

    /// Checks a key length against the spec. The null cipher takes a key of any length and
    /// ignores it, as dm-crypt's does (cryptsetup's LUKS1 `cipher_null-ecb` headers carry
    /// 32-byte keys).
    pub fn check_key_len(&self, len: usize) -> Result<()> {
        if self.key_bytes_allowed().contains(&len) || self.mode == Mode::Null {
            return Ok(());
        }
        Err(Error::KeySize {
            spec: self.to_string(),
            bits: len * 8,
            expected: match self.mode {
                Mode::Cbc(_) if self.iv == IvMode::Elephant => {
                    "256 or 512 bits (the CBC key, then an elephant key of the same size)"
                }
                Mode::Cbc(_) if self.iv == IvMode::Lmk64 => {
                    "64 keys of 128, 192 or 256 bits, and optionally a 65th part (the IV seed)"
                }
                Mode::Cbc(_) if self.iv == IvMode::Tcw => {
                    "the cipher key (128, 192 or 256 bits) and 256 bits of IV seed and whitening"
                }
                Mode::Cbc64(BlockCipher64::Cast5) if self.iv == IvMode::Tcw => {
                    "320 bits: the 128-bit cipher key, 64 bits of IV seed, 128 of whitening"
                }
                Mode::Cbc64(BlockCipher64::Des3Ede) if self.iv == IvMode::Tcw => {
                    "384 bits: the 192-bit cipher key, 64 bits of IV seed, 128 of whitening"
                }
                Mode::Cbc64(_) => "none: a 64-bit block cipher runs with the tcw IV only",
                Mode::Xts(BlockCipher::Serpent) => "256 to 512 bits, two equal halves",
                Mode::Xts(_) => "256, 384 or 512 bits",
                Mode::Cbc(BlockCipher::Serpent) => "128 to 256 bits",
                Mode::Cbc(_) => "128, 192 or 256 bits",
                Mode::Lrw(BlockCipher::Serpent) => {
                    "256 to 384 bits (the cipher key, then a 128-bit tweak key)"
                }
                Mode::Lrw(_) => "256, 320 or 384 bits (the cipher key, then a 128-bit tweak key)",
                Mode::Adiantum(_) => "256 bits",
                Mode::Null => "0 bits (no key)",
                Mode::Cascade(_) => "one layer key (512 bits for XTS, 384 for LRW) per cipher",
            },
        })
    }

    /// Bytes of the IV the kernel's transform takes: 32 for Adiantum's tweak, else one block.
    pub fn iv_bytes(&self) -> usize {
        match self.mode {
            Mode::Adiantum(_) => 32,
            Mode::Cbc64(_) => 8,
            _ => 16,
        }
    }

    /// LUKS stores cipher and mode separately (`cipher_name` "serpent", `cipher_mode`
    /// "xts-plain64"); this is the pair for a LUKS1 header.
    pub fn luks1_name_mode(&self) -> (&'static str, String) {
        match self.mode {
            Mode::Null => ("cipher_null", "ecb".to_string()),
            Mode::Cascade(_) => (
                "cascade",
                format!("{}-{}", self.mode.chain_name(), self.iv.name()),
            ),
            m => (
                m.cipher_name(),
                format!("{}-{}", m.chain_name(), self.iv.name()),
            ),
        }
    }
}

impl fmt::Display for CipherSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.mode == Mode::Null {
            return f.write_str("cipher_null-ecb");
        }
        if let Mode::Cascade(c) = self.mode {
            return write!(
                f,
                "{}-{}-{}",
                c.name(),
                self.mode.chain_name(),
                self.iv.name()
            );
        }
        let (name, mode) = self.luks1_name_mode();
        write!(f, "{name}-{mode}")
    }
}

fn unsupported(spec: &str, reason: impl Into<String>) -> Error {
    Error::UnsupportedCipher {
        spec: spec.to_string(),
        reason: reason.into(),
        supported: SUPPORTED_SPECS,
    }
}

/// Splits either syntax into (cipher, chain mode, IV mode, IV options), as dm-crypt's
/// `crypt_ctr_cipher_old` / `crypt_ctr_cipher_new` do.
fn split_spec(spec: &str) -> Result<(&str, &str, &str, Option<&str>)> {
    let s = spec.trim();
    if let Some(capi) = s.strip_prefix("capi:") {
        // capi:chain(cipher)-ivmode:ivopts; the IV part follows the last ')'.
        let close = capi
            .rfind(')')
            .ok_or_else(|| unsupported(spec, "capi form needs mode(cipher)"))?;
        let (alg, iv) = (&capi[..close], &capi[close + 1..]);
        let (chain, cipher) = alg
            .split_once('(')
            .ok_or_else(|| unsupported(spec, "capi form needs mode(cipher)"))?;
        let iv = match iv {
            "" => "",
            _ => iv
                .strip_prefix('-')
                .ok_or_else(|| unsupported(spec, "capi form: '-' must follow the ')'"))?,
        };
        let (ivmode, ivopts) = match iv.split_once(':') {
            Some((m, o)) => (m, Some(o)),
            None => (iv, None),
        };
        return Ok((cipher, chain, ivmode, ivopts));
    }
    let mut parts = s.splitn(3, '-');
    let cipher = parts.next().unwrap_or("");
    let chain = parts.next().unwrap_or("");
    let iv = parts.next().unwrap_or("");
    let (ivmode, ivopts) = match iv.split_once(':') {
        Some((m, o)) => (m, Some(o)),
        None => (iv, None),
    };
    Ok((cipher, chain, ivmode, ivopts))
}

impl FromStr for CipherSpec {
    type Err = Error;

    fn from_str(spec: &str) -> Result<Self> {
        let (cipher, chain, ivmode, ivopts) = split_spec(spec)?;
        if cipher == "cipher_null" {
            if !matches!(chain, "ecb" | "") {
                return Err(unsupported(spec, format!("chaining mode '{chain}'")));
            }
            if !matches!(ivmode, "" | "null" | "plain" | "plain64") || ivopts.is_some() {
                return Err(unsupported(
                    spec,
                    format!("IV mode '{ivmode}' with the null cipher"),
                ));
            }
            return Ok(CipherSpec::NULL);
        }
        let mode = match (chain, cipher) {
            ("adiantum", "xchacha12,aes") => Mode::Adiantum(XChaCha::R12),
            ("adiantum", "xchacha20,aes") => Mode::Adiantum(XChaCha::R20),
            ("adiantum", c) => {
                return Err(unsupported(
                    spec,
                    format!("Adiantum over '{c}' (xchacha12,aes or xchacha20,aes)"),
                ))
            }
            (chain, c) if BlockCipher64::from_name(c).is_some() => match chain {
                "cbc" => Mode::Cbc64(
                    BlockCipher64::from_name(c).ok_or(Error::Bug("a 64-bit cipher's name"))?,
                ),
                m => {
                    return Err(unsupported(
                        spec,
                        format!("chaining mode '{m}' of the 64-bit cipher {c} (only cbc)"),
                    ))
                }
            },
            (chain, c) => {
                let block = BlockCipher::from_name(c)
                    .ok_or_else(|| unsupported(spec, format!("cipher '{c}'")))?;
                match chain {
                    "xts" => Mode::Xts(block),
                    "cbc" => Mode::Cbc(block),
                    "lrw" => Mode::Lrw(block),
                    m => return Err(unsupported(spec, format!("chaining mode '{m}'"))),
                }
            }
        };
        let iv = match (ivmode, ivopts) {
            ("plain64", None) => IvMode::Plain64,
            ("plain", None) => IvMode::Plain,
            ("plain64be", None) => IvMode::Plain64Be,
            ("benbi", None) => IvMode::Benbi,
            ("tcw", None) if matches!(mode, Mode::Cbc(_) | Mode::Cbc64(_)) => IvMode::Tcw,
            ("eboiv", None) if matches!(mode, Mode::Cbc(_)) => IvMode::Eboiv,
            // The kernel's elephant keys AES for the sector key and diffuses AES-CBC sectors.
            ("elephant", None) if mode == Mode::Cbc(BlockCipher::Aes) => IvMode::Elephant,
            ("essiv", Some(h)) => {
                let hash = EssivHash::from_name(h)
                    .ok_or_else(|| unsupported(spec, format!("ESSIV hash '{h}'")))?;
                IvMode::Essiv(hash)
            }
            ("essiv", None) => return Err(unsupported(spec, "ESSIV needs a hash (essiv:sha256)")),
            ("", _) => return Err(unsupported(spec, "missing IV mode (e.g. -plain64)")),
            (m, Some(o)) if m != "essiv" => {
                return Err(unsupported(spec, format!("IV mode '{m}:{o}'")))
            }
            (m, _) => return Err(unsupported(spec, format!("IV mode '{m}'"))),
        };
        match (mode, iv) {
            (Mode::Cbc64(c), iv) if iv != IvMode::Tcw => {
                return Err(unsupported(
                    spec,
                    format!(
                        "IV mode '{}' with the 64-bit cipher {} (only TrueCrypt's tcw)",
                        iv.name(),
                        c.name()
                    ),
                ))
            }
            (Mode::Adiantum(_), IvMode::Benbi | IvMode::Essiv(_)) => {
                return Err(unsupported(
                    spec,
                    format!(
                        "IV mode '{}' with Adiantum (plain64, plain or plain64be)",
                        iv.name()
                    ),
                ))
            }
            (_, IvMode::Essiv(h)) => {
                let block = mode
                    .block_cipher()
                    .ok_or(Error::Bug("ESSIV without a cipher"))?;
                if !block.takes_key_bytes(h.digest_bytes()) {
                    // The kernel's essiv template keys the cipher with the digest: it refuses
                    // the table line the same way.
                    return Err(unsupported(
                        spec,
                        format!(
                            "ESSIV with {}: its {}-bit digest is not a {} key size",
                            h.name(),
                            h.digest_bytes() * 8,
                            block.name()
                        ),
                    ));
                }
            }
            _ => {}
        }
        Ok(CipherSpec { mode, iv })
    }
}

/// The key sizes of `lmk` with 64 subkeys of `cipher`'s sizes (128, 192 or 256 bits), and
/// optionally a 65th part of the same size (the IV seed): 64 or 65 parts.
pub(crate) fn lmk_key_bytes_allowed(cipher: BlockCipher) -> &'static [usize] {
    match cipher {
        BlockCipher::Aes | BlockCipher::Twofish | BlockCipher::Camellia => {
            &[1024, 1040, 1536, 1560, 2048, 2080]
        }
        BlockCipher::Serpent => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        // (input, Some(canonical) | None for rejection)
        let rows: &[(&str, Option<&str>)] = &[
            ("aes-xts-plain64", Some("aes-xts-plain64")),
            ("aes-xts-plain", Some("aes-xts-plain")),
            ("aes-xts-plain64be", Some("aes-xts-plain64be")),
            ("aes-xts-essiv:sha256", Some("aes-xts-essiv:sha256")),
            ("aes-cbc-essiv:sha256", Some("aes-cbc-essiv:sha256")),
            ("aes-cbc-plain64", Some("aes-cbc-plain64")),
            ("aes-cbc-plain", Some("aes-cbc-plain")),
            ("aes-cbc-eboiv", Some("aes-cbc-eboiv")),
            ("aes-cbc-elephant", Some("aes-cbc-elephant")),
            ("aes-xts-eboiv", None),
            ("serpent-cbc-elephant", None),
            ("cipher_null-ecb", Some("cipher_null-ecb")),
            ("capi:xts(aes)-plain64", Some("aes-xts-plain64")),
            ("capi:cbc(aes)-essiv:sha256", Some("aes-cbc-essiv:sha256")),
            ("capi:ecb(cipher_null)", Some("cipher_null-ecb")),
            ("capi:ecb(cipher_null)-plain64", Some("cipher_null-ecb")),
            ("aes-xts-benbi", Some("aes-xts-benbi")),
            ("aes-lrw-benbi", Some("aes-lrw-benbi")),
            ("aes-lrw-plain64", Some("aes-lrw-plain64")),
            ("capi:lrw(aes)-benbi", Some("aes-lrw-benbi")),
            ("twofish-xts-plain64", Some("twofish-xts-plain64")),
            ("serpent-xts-plain64", Some("serpent-xts-plain64")),
            ("camellia-xts-plain64", Some("camellia-xts-plain64")),
            ("serpent-cbc-essiv:sha256", Some("serpent-cbc-essiv:sha256")),
            ("serpent-cbc-essiv:sha1", Some("serpent-cbc-essiv:sha1")),
            ("twofish-cbc-plain64", Some("twofish-cbc-plain64")),
            ("camellia-cbc-essiv:wp256", Some("camellia-cbc-essiv:wp256")),
            ("aes-xts-essiv:wp256", Some("aes-xts-essiv:wp256")),
            ("aes-cbc-essiv:whirlpool", None),
            (
                "serpent-cbc-essiv:ripemd160",
                Some("serpent-cbc-essiv:rmd160"),
            ),
            ("capi:xts(twofish)-plain64", Some("twofish-xts-plain64")),
            (
                "capi:cbc(camellia)-essiv:sha256",
                Some("camellia-cbc-essiv:sha256"),
            ),
            (
                "xchacha12,aes-adiantum-plain64",
                Some("xchacha12,aes-adiantum-plain64"),
            ),
            (
                "xchacha20,aes-adiantum-plain64",
                Some("xchacha20,aes-adiantum-plain64"),
            ),
            (
                "capi:adiantum(xchacha12,aes)-plain64",
                Some("xchacha12,aes-adiantum-plain64"),
            ),
            (
                "capi:adiantum(xchacha20,aes)-plain64be",
                Some("xchacha20,aes-adiantum-plain64be"),
            ),
            ("xchacha12,aes-adiantum-essiv:sha256", None),
            ("xchacha12,aes-adiantum-benbi", None),
            ("xchacha8,aes-adiantum-plain64", None),
            ("aes-xts-essiv:sha1", None),
            ("aes-cbc-essiv:sha512", None),
            ("twofish-cbc-essiv:sha1", None),
            ("aes-cbc-essiv", None),
            ("aes-cbc-essiv:md5", None),
            ("aes-xts", None),
            ("aes-ctr-plain64", None),
            ("blowfish-cbc-plain64", None),
            ("cast5-cbc-tcw", Some("cast5-cbc-tcw")),
            ("des3_ede-cbc-tcw", Some("des3_ede-cbc-tcw")),
            ("capi:cbc(cast5)-tcw", Some("cast5-cbc-tcw")),
            ("cast5-cbc-plain64", None),
            ("des3_ede-cbc-essiv:sha256", None),
            ("cast5-xts-tcw", None),
            ("blowfish-cbc-tcw", None),
            ("aes-xts-lmk", None),
            ("aes-xts-plain64:x", None),
            ("capi:xts-plain64", None),
            ("capi:xts(aes)plain64", None),
            ("", None),
        ];
        for (input, want) in rows {
            let got = input.parse::<CipherSpec>();
            match (want, got) {
                (Some(w), Ok(spec)) => {
                    assert_eq!(spec.to_string(), *w, "input {input}");
                    assert_eq!(w.parse::<CipherSpec>().unwrap(), spec, "{w} round trip");
                }
                (None, Err(e)) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains(input),
                        "error for {input:?} should name it: {msg}"
                    );
                    assert!(
                        msg.contains("aes-xts-plain64"),
                        "error should list supported: {msg}"
                    );
                }
                (w, g) => panic!("input {input:?}: want {w:?}, got {g:?}"),
            }
        }
    }

    #[test]
    fn key_sizes() {
        let xts = CipherSpec::AES_XTS_PLAIN64;
        assert!(xts.check_key_len(64).is_ok());
        assert!(xts.check_key_len(32).is_ok());
        let e = xts.check_key_len(16).unwrap_err().to_string();
        assert!(e.contains("128 bits") && e.contains("512"), "{e}");
        assert!(CipherSpec::NULL.check_key_len(0).is_ok());
        // (spec, accepted, refused), in bytes.
        let rows: &[(&str, &[usize], &[usize])] = &[
            ("serpent-xts-plain64", &[32, 48, 64], &[16, 24, 33, 66]),
            ("twofish-xts-plain64", &[32, 48, 64], &[40, 16]),
            ("camellia-cbc-plain64", &[16, 24, 32], &[20, 64]),
            ("serpent-cbc-plain64", &[16, 20, 32], &[8, 33]),
            ("aes-lrw-benbi", &[32, 40, 48], &[16, 64]),
            ("xchacha12,aes-adiantum-plain64", &[32], &[16, 64]),
            ("aes-cbc-tcw", &[48, 56, 64], &[32, 40]),
            ("cast5-cbc-tcw", &[40], &[16, 32, 48]),
            ("des3_ede-cbc-tcw", &[48], &[24, 40, 64]),
        ];
        for (spec, ok, bad) in rows {
            let s: CipherSpec = spec.parse().unwrap();
            for &n in *ok {
                assert!(s.check_key_len(n).is_ok(), "{spec} {n}");
            }
            for &n in *bad {
                assert!(s.check_key_len(n).is_err(), "{spec} {n}");
            }
            assert!(s.check_key_len(s.default_key_bytes()).is_ok(), "{spec}");
        }
    }

    #[test]
    fn luks1_split() {
        let rows = [
            ("aes-xts-plain64", "aes", "xts-plain64"),
            ("aes-cbc-essiv:sha256", "aes", "cbc-essiv:sha256"),
            ("serpent-xts-plain64", "serpent", "xts-plain64"),
            ("aes-lrw-benbi", "aes", "lrw-benbi"),
            ("aes-xts-essiv:wp256", "aes", "xts-essiv:wp256"),
            (
                "xchacha20,aes-adiantum-plain64",
                "xchacha20,aes",
                "adiantum-plain64",
            ),
            ("cipher_null-ecb", "cipher_null", "ecb"),
        ];
        for (spec, name, mode) in rows {
            let s: CipherSpec = spec.parse().unwrap();
            assert_eq!(s.luks1_name_mode(), (name, mode.to_string()), "{spec}");
            // A LUKS1 header's pair parses back into the same spec.
            assert_eq!(format!("{name}-{mode}").parse::<CipherSpec>().unwrap(), s);
        }
    }
}
