//! TrueCrypt's and VeraCrypt's cipher chains (the table cryptsetup tries, in its order), how
//! each decrypts the 448-byte encrypted header, and where each layer's key sits in the
//! header's 256-byte key area.
//!
//! Modes: XTS (TrueCrypt 5+, VeraCrypt), LRW (TrueCrypt 4.1 to 4.3) and the CBC variants of
//! TrueCrypt before 4.1: `cbc-tcw` (one cipher; its data is dm-crypt's `tcw` IV), `cbci-tcrypt`
//! (a chain applied block by block inside one CBC) and `cbc-tcrypt` (blowfish with its words
//! little-endian, alone or in a chain of CBCs). Both `-tcrypt` modes are read here but not
//! mapped: dm-crypt has no such mode (cryptsetup refuses them the same way).

use cipher::{BlockCipherDecrypt, KeyInit};

use crate::secret::SecretBox;
use crate::sector::block::Ecb;
use crate::sector::modes::BlockMode;
use crate::sector::BlockCipher;
use crate::{Error, Result};

/// Bytes of the encrypted part of a header.
pub const HDR_BYTES: usize = 448;
/// LRW's tweak key, the first 16 bytes of the key area.
const LRW_TWEAK_KEY_BYTES: usize = 16;

/// A cipher of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cipher {
    Wide(BlockCipher),
    /// GOST R 34.12-2015: no Debian kernel has it; refused by name.
    Kuznyechik,
    /// Blowfish with each 32-bit half read little-endian (TrueCrypt's).
    BlowfishLe,
    Cast5,
    Des3Ede,
}

impl Cipher {
    pub fn name(self) -> &'static str {
        match self {
            Cipher::Wide(c) => c.name(),
            Cipher::Kuznyechik => "kuznyechik",
            Cipher::BlowfishLe => "blowfish_le",
            Cipher::Cast5 => "cast5",
            Cipher::Des3Ede => "des3_ede",
        }
    }
}

/// One layer: its key length and where its key, IV (or XTS second key) and extra bytes are.
#[derive(Debug, Clone, Copy)]
pub struct Layer {
    pub cipher: Cipher,
    pub key_bytes: usize,
    pub iv_bytes: usize,
    pub key_offset: usize,
    /// XTS: the second key; CBC: the IV (followed by the whitening).
    pub iv_offset: usize,
    /// CBC: IV seed and whitening bytes after the key in the dm-crypt key.
    pub extra_bytes: usize,
}

/// The chaining of a whole chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chain {
    Xts,
    Lrw,
    CbcTcw,
    CbciTcrypt,
    CbcTcrypt,
}

impl Chain {
    /// cryptsetup's mode name.
    pub fn name(self) -> &'static str {
        match self {
            Chain::Xts => "xts-plain64",
            Chain::Lrw => "lrw-benbi",
            Chain::CbcTcw => "cbc-tcw",
            Chain::CbciTcrypt => "cbci-tcrypt",
            Chain::CbcTcrypt => "cbc-tcrypt",
        }
    }
}

/// A cipher chain: `layers[0]` is the outermost (applied first when encrypting).
#[derive(Debug, Clone, Copy)]
pub struct Algs {
    pub legacy: bool,
    pub chain_key_bytes: usize,
    pub long_name: &'static str,
    pub chain: Chain,
    pub layers: &'static [Layer],
}

const fn l(
    cipher: Cipher,
    key_bytes: usize,
    iv_bytes: usize,
    key_offset: usize,
    iv_offset: usize,
    extra_bytes: usize,
) -> Layer {
    Layer {
        cipher,
        key_bytes,
        iv_bytes,
        key_offset,
        iv_offset,
        extra_bytes,
    }
}

const AES: Cipher = Cipher::Wide(BlockCipher::Aes);
const SERPENT: Cipher = Cipher::Wide(BlockCipher::Serpent);
const TWOFISH: Cipher = Cipher::Wide(BlockCipher::Twofish);
const CAMELLIA: Cipher = Cipher::Wide(BlockCipher::Camellia);
const KUZ: Cipher = Cipher::Kuznyechik;
const BF: Cipher = Cipher::BlowfishLe;

const fn a(
    legacy: bool,
    chain_key_bytes: usize,
    long_name: &'static str,
    chain: Chain,
    layers: &'static [Layer],
) -> Algs {
    Algs {
        legacy,
        chain_key_bytes,
        long_name,
        chain,
        layers,
    }
}

use Chain::{CbcTcrypt, CbcTcw, CbciTcrypt, Lrw, Xts};

/// Every chain, in the order cryptsetup tries them.
pub static ALGS: [Algs; 36] = [
    a(false, 64, "aes", Xts, &[l(AES, 64, 16, 0, 32, 0)]),
    a(false, 64, "serpent", Xts, &[l(SERPENT, 64, 16, 0, 32, 0)]),
    a(false, 64, "twofish", Xts, &[l(TWOFISH, 64, 16, 0, 32, 0)]),
    a(
        false,
        128,
        "twofish-aes",
        Xts,
        &[l(TWOFISH, 64, 16, 0, 64, 0), l(AES, 64, 16, 32, 96, 0)],
    ),
    a(
        false,
        192,
        "serpent-twofish-aes",
        Xts,
        &[
            l(SERPENT, 64, 16, 0, 96, 0),
            l(TWOFISH, 64, 16, 32, 128, 0),
            l(AES, 64, 16, 64, 160, 0),
        ],
    ),
    a(
        false,
        128,
        "aes-serpent",
        Xts,
        &[l(AES, 64, 16, 0, 64, 0), l(SERPENT, 64, 16, 32, 96, 0)],
    ),
    a(
        false,
        192,
        "aes-twofish-serpent",
        Xts,
        &[
            l(AES, 64, 16, 0, 96, 0),
            l(TWOFISH, 64, 16, 32, 128, 0),
            l(SERPENT, 64, 16, 64, 160, 0),
        ],
    ),
    a(
        false,
        128,
        "serpent-twofish",
        Xts,
        &[l(SERPENT, 64, 16, 0, 64, 0), l(TWOFISH, 64, 16, 32, 96, 0)],
    ),
    a(false, 64, "camellia", Xts, &[l(CAMELLIA, 64, 16, 0, 32, 0)]),
    a(false, 64, "kuznyechik", Xts, &[l(KUZ, 64, 16, 0, 32, 0)]),
    a(
        false,
        128,
        "kuznyechik-camellia",
        Xts,
        &[l(KUZ, 64, 16, 0, 64, 0), l(CAMELLIA, 64, 16, 32, 96, 0)],
    ),
    a(
        false,
        128,
        "twofish-kuznyechik",
        Xts,
        &[l(TWOFISH, 64, 16, 0, 64, 0), l(KUZ, 64, 16, 32, 96, 0)],
    ),
    a(
        false,
        128,
        "serpent-camellia",
        Xts,
        &[l(SERPENT, 64, 16, 0, 64, 0), l(CAMELLIA, 64, 16, 32, 96, 0)],
    ),
    a(
        false,
        128,
        "aes-kuznyechik",
        Xts,
        &[l(AES, 64, 16, 0, 64, 0), l(KUZ, 64, 16, 32, 96, 0)],
    ),
    a(
        false,
        192,
        "camellia-serpent-kuznyechik",
        Xts,
        &[
            l(CAMELLIA, 64, 16, 0, 96, 0),
            l(SERPENT, 64, 16, 32, 128, 0),
            l(KUZ, 64, 16, 64, 160, 0),
        ],
    ),
    a(false, 48, "aes", Lrw, &[l(AES, 48, 16, 32, 0, 0)]),
    a(false, 48, "serpent", Lrw, &[l(SERPENT, 48, 16, 32, 0, 0)]),
    a(false, 48, "twofish", Lrw, &[l(TWOFISH, 48, 16, 32, 0, 0)]),
    a(
        false,
        96,
        "twofish-aes",
        Lrw,
        &[l(TWOFISH, 48, 16, 32, 0, 0), l(AES, 48, 16, 64, 0, 0)],
    ),
    a(
        false,
        144,
        "serpent-twofish-aes",
        Lrw,
        &[
            l(SERPENT, 48, 16, 32, 0, 0),
            l(TWOFISH, 48, 16, 64, 0, 0),
            l(AES, 48, 16, 96, 0, 0),
        ],
    ),
    a(
        false,
        96,
        "aes-serpent",
        Lrw,
        &[l(AES, 48, 16, 32, 0, 0), l(SERPENT, 48, 16, 64, 0, 0)],
    ),
    a(
        false,
        144,
        "aes-twofish-serpent",
        Lrw,
        &[
            l(AES, 48, 16, 32, 0, 0),
            l(TWOFISH, 48, 16, 64, 0, 0),
            l(SERPENT, 48, 16, 96, 0, 0),
        ],
    ),
    a(
        false,
        96,
        "serpent-twofish",
        Lrw,
        &[l(SERPENT, 48, 16, 32, 0, 0), l(TWOFISH, 48, 16, 64, 0, 0)],
    ),
    a(true, 64, "aes", CbcTcw, &[l(AES, 32, 16, 32, 0, 32)]),
    a(
        true,
        64,
        "serpent",
        CbcTcw,
        &[l(SERPENT, 32, 16, 32, 0, 32)],
    ),
    a(
        true,
        64,
        "twofish",
        CbcTcw,
        &[l(TWOFISH, 32, 16, 32, 0, 32)],
    ),
    a(
        true,
        96,
        "twofish-aes",
        CbciTcrypt,
        &[l(TWOFISH, 32, 16, 32, 0, 0), l(AES, 32, 16, 64, 0, 32)],
    ),
    a(
        true,
        128,
        "serpent-twofish-aes",
        CbciTcrypt,
        &[
            l(SERPENT, 32, 16, 32, 0, 0),
            l(TWOFISH, 32, 16, 64, 0, 0),
            l(AES, 32, 16, 96, 0, 32),
        ],
    ),
    a(
        true,
        96,
        "aes-serpent",
        CbciTcrypt,
        &[l(AES, 32, 16, 32, 0, 0), l(SERPENT, 32, 16, 64, 0, 32)],
    ),
    a(
        true,
        128,
        "aes-twofish-serpent",
        CbciTcrypt,
        &[
            l(AES, 32, 16, 32, 0, 0),
            l(TWOFISH, 32, 16, 64, 0, 0),
            l(SERPENT, 32, 16, 96, 0, 32),
        ],
    ),
    a(
        true,
        96,
        "serpent-twofish",
        CbciTcrypt,
        &[l(SERPENT, 32, 16, 32, 0, 0), l(TWOFISH, 32, 16, 64, 0, 32)],
    ),
    a(
        true,
        40,
        "cast5",
        CbcTcw,
        &[l(Cipher::Cast5, 16, 8, 32, 0, 24)],
    ),
    a(
        true,
        48,
        "des3_ede",
        CbcTcw,
        &[l(Cipher::Des3Ede, 24, 8, 32, 0, 24)],
    ),
    a(
        true,
        80,
        "blowfish_le",
        CbcTcrypt,
        &[l(BF, 56, 8, 32, 0, 24)],
    ),
    a(
        true,
        120,
        "blowfish_le-aes",
        CbcTcrypt,
        &[l(BF, 56, 8, 32, 0, 0), l(AES, 32, 16, 88, 0, 32)],
    ),
    a(
        true,
        152,
        "serpent-blowfish_le-aes",
        CbcTcrypt,
        &[
            l(SERPENT, 32, 16, 32, 0, 0),
            l(BF, 56, 8, 64, 0, 0),
            l(AES, 32, 16, 120, 0, 32),
        ],
    ),
];

/// A chain that could not be tried: a cipher ucrypt does not have (kuznyechik), or one that
/// refused its key. The search goes on with the next chain, as cryptsetup's does when its
/// crypto backend lacks a cipher.
#[derive(Debug)]
pub struct Skip;

/// The key of `layer` as dm-crypt takes it, cut out of `key` (the header key or the key area):
/// XTS the two halves, LRW the cipher key then the tweak key, CBC the key then IV seed and
/// whitening.
pub fn layer_key(layer: &Layer, chain: Chain, key: &[u8]) -> Vec<u8> {
    match chain {
        Chain::Xts => {
            let half = layer.key_bytes / 2;
            let mut k = key[layer.key_offset..layer.key_offset + half].to_vec();
            k.extend_from_slice(&key[layer.iv_offset..layer.iv_offset + half]);
            k
        }
        Chain::Lrw => {
            let n = layer.key_bytes - LRW_TWEAK_KEY_BYTES;
            let mut k = key[layer.key_offset..layer.key_offset + n].to_vec();
            k.extend_from_slice(&key[..LRW_TWEAK_KEY_BYTES]);
            k
        }
        Chain::CbcTcw | Chain::CbciTcrypt | Chain::CbcTcrypt => {
            let mut k = key[layer.key_offset..layer.key_offset + layer.key_bytes].to_vec();
            k.extend_from_slice(&key[layer.iv_offset..layer.iv_offset + layer.extra_bytes]);
            k
        }
    }
}

/// A keyed ECB cipher of 8 or 16-byte blocks, for the header; the 64-bit ciphers' schedules
/// in locked, wiped-on-drop memory, as sector/block.rs keeps the others'.
enum HdrEcb {
    Wide(Ecb),
    BlowfishLe(SecretBox<blowfish::Blowfish>),
    Cast5(SecretBox<cast5::Cast5>),
    Des3(SecretBox<des::TdesEde3>),
}

fn refused() -> Error {
    Error::Bug("a TCRYPT header cipher refused its key length")
}

impl HdrEcb {
    fn new(cipher: Cipher, key: &[u8]) -> std::result::Result<Self, Skip> {
        Ok(match cipher {
            Cipher::Wide(c) => HdrEcb::Wide(Ecb::new(c, key).map_err(|_| Skip)?),
            Cipher::Kuznyechik => return Err(Skip),
            Cipher::BlowfishLe => HdrEcb::BlowfishLe(SecretBox::new(
                blowfish::Blowfish::new_from_slice(key).map_err(|_| Skip)?,
            )),
            Cipher::Cast5 => HdrEcb::Cast5(SecretBox::new(
                cast5::Cast5::new_from_slice(key).map_err(|_| Skip)?,
            )),
            Cipher::Des3Ede => HdrEcb::Des3(SecretBox::new(
                des::TdesEde3::new_from_slice(key).map_err(|_| Skip)?,
            )),
        })
    }

    fn block_bytes(&self) -> usize {
        match self {
            HdrEcb::Wide(_) => 16,
            _ => 8,
        }
    }

    /// Decrypts one block in place.
    fn decrypt(&mut self, b: &mut [u8]) -> Result<()> {
        match self {
            HdrEcb::Wide(e) => e.decrypt(b)?,
            HdrEcb::BlowfishLe(c) => {
                // The kernel's (and RustCrypto's) blowfish reads its two words big-endian.
                b[..4].reverse();
                b[4..8].reverse();
                c.decrypt_block(b.try_into().map_err(|_| refused())?);
                b[..4].reverse();
                b[4..8].reverse();
            }
            HdrEcb::Cast5(c) => c.decrypt_block(b.try_into().map_err(|_| refused())?),
            HdrEcb::Des3(c) => c.decrypt_block(b.try_into().map_err(|_| refused())?),
        }
        Ok(())
    }
}

/// TrueCrypt's CBC whitening: the 8 bytes at offset 8 of the key, over the whole header.
fn remove_whitening(buf: &mut [u8], key: &[u8]) {
    for (j, b) in buf.iter_mut().enumerate() {
        *b ^= key[8 + j % 8];
    }
}

/// CBC decryption of the header with one block cipher per block (a chain for `cbci`).
fn cbc_decrypt(ciphers: &mut [HdrEcb], iv: &[u8], buf: &mut [u8]) -> Result<()> {
    let bs = ciphers[0].block_bytes();
    let mut prev = iv[..bs].to_vec();
    for block in buf.chunks_exact_mut(bs) {
        let ct = block.to_vec();
        for c in ciphers.iter_mut().rev() {
            c.decrypt(block)?;
        }
        for (b, p) in block.iter_mut().zip(&prev) {
            *b ^= p;
        }
        prev = ct;
    }
    Ok(())
}

fn wide(cipher: Cipher) -> std::result::Result<BlockCipher, Skip> {
    match cipher {
        Cipher::Wide(c) => Ok(c),
        Cipher::Kuznyechik => Err(Skip),
        _ => Err(Skip),
    }
}

/// Decrypts `buf` (the 448 encrypted header bytes, in place) with chain `algs` under the
/// header key `key`.
pub fn decrypt_header(
    algs: &Algs,
    key: &[u8],
    buf: &mut [u8; HDR_BYTES],
) -> std::result::Result<(), Skip> {
    let bug = |_| Skip;
    if algs.chain == Chain::CbciTcrypt {
        remove_whitening(buf, key);
        let mut ciphers = algs
            .layers
            .iter()
            .map(|layer| {
                HdrEcb::new(
                    layer.cipher,
                    &key[layer.key_offset..layer.key_offset + layer.key_bytes],
                )
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let iv0 = algs.layers[0].iv_offset;
        return cbc_decrypt(&mut ciphers, &key[iv0..iv0 + 16], buf).map_err(bug);
    }
    for layer in algs.layers.iter().rev() {
        match algs.chain {
            Chain::Xts => {
                let k = layer_key(layer, algs.chain, key);
                let mut m = BlockMode::xts(wide(layer.cipher)?, &k).map_err(bug)?;
                m.crypt(false, &[0; 16], buf).map_err(bug)?;
            }
            Chain::Lrw => {
                let k = layer_key(layer, algs.chain, key);
                let mut iv = [0u8; 16];
                iv[15] = 1;
                let mut m = BlockMode::lrw(wide(layer.cipher)?, &k).map_err(bug)?;
                m.crypt(false, &iv, buf).map_err(bug)?;
            }
            Chain::CbcTcw | Chain::CbcTcrypt | Chain::CbciTcrypt => {
                remove_whitening(buf, key);
                let k = &key[layer.key_offset..layer.key_offset + layer.key_bytes];
                let mut c = [HdrEcb::new(layer.cipher, k)?];
                let iv = &key[layer.iv_offset..layer.iv_offset + layer.iv_bytes];
                cbc_decrypt(&mut c, iv, buf).map_err(bug)?;
            }
        }
    }
    Ok(())
}
