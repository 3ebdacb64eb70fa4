//! Sector encryption, byte-compatible with dm-crypt.
//!
//! A [`SectorCipher`] is keyed once and then encrypts or decrypts runs of consecutive sectors
//! per call, so the fixed per-call cost is paid once per run. The IV of each sector follows
//! dm-crypt exactly ([`Geometry::iv_sector`]): it counts 512-byte units from the start of the
//! data segment, plus the IV offset, unless `iv_large_sectors` is set.
//!
//! AES-XTS and AES-CBC run on AWS-LC's EVP modes (`evp.rs`); the other block ciphers and LRW
//! run the modes of `modes.rs` over one block cipher (`block.rs`); Adiantum is `adiantum.rs`;
//! the 64-bit ciphers of TrueCrypt 3.x (CBC with the `tcw` IV only) are `block64.rs`.

mod adiantum;
pub(crate) mod block;
mod block64;
mod camellia;
pub(crate) mod crc32;
mod elephant;
pub(crate) mod evp;
mod lmk;
pub(crate) mod modes;
mod spec;
mod twofish;

pub use evp::backend;
pub use spec::{
    BlockCipher, BlockCipher64, Cascade, CascadeChain, CipherSpec, EssivHash, IvMode, Mode,
    XChaCha, CASCADE_LAYERS_MAX, SUPPORTED_SPECS,
};

use crate::{Error, Result, SecretBytes};
use adiantum::{Adiantum, ADIANTUM_TWEAK_BYTES};
use block::Ecb;
use block64::{Cbc64, BLOCK64_BYTES};
use elephant::Elephant;
use evp::{Alg, EvpCtx};
use modes::BlockMode;

/// Largest encryption sector dm-crypt supports; also the size of the XTS tweak scratch buffer.
pub const SECTOR_BYTES_MAX: u32 = 4096;

/// dm-crypt's benbi shift, 9 - log2(16): every cipher here has 16-byte blocks.
const BENBI_SHIFT: u32 = 9 - 4;

/// An encryption sector size: 512, 1024, 2048 or 4096 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SectorSize(u32);

impl SectorSize {
    pub const S512: SectorSize = SectorSize(512);
    pub const S4096: SectorSize = SectorSize(4096);

    pub fn new(bytes: u64) -> Result<Self> {
        match bytes {
            512 | 1024 | 2048 | 4096 => Ok(SectorSize(bytes as u32)),
            _ => Err(Error::SectorSize(bytes)),
        }
    }

    pub fn bytes(self) -> u32 {
        self.0
    }

    /// log2 of the size in bytes (9..=12).
    pub fn shift(self) -> u32 {
        self.0.trailing_zeros()
    }
}

/// Where sector numbers and IVs come from, as in a dm-crypt table line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub sector_size: SectorSize,
    /// dm-crypt's `iv_offset`: added to the IV sector, in 512-byte units.
    pub iv_offset: u64,
    /// dm-crypt's `iv_large_sectors`: the IV counts encryption sectors instead of 512-byte units.
    /// LUKS2 never sets it.
    pub iv_large_sectors: bool,
}

impl Geometry {
    pub fn new(sector_size: SectorSize) -> Self {
        Geometry {
            sector_size,
            iv_offset: 0,
            iv_large_sectors: false,
        }
    }

    /// The IV sector number dm-crypt uses for encryption sector `sector` (counted in
    /// `sector_size` units from the data segment start). Arithmetic wraps like the kernel's u64.
    #[inline]
    pub fn iv_sector(&self, sector: u64) -> u64 {
        let units_512 = self.sector_size.shift() - 9;
        let cc_sector = (sector << units_512).wrapping_add(self.iv_offset);
        if self.iv_large_sectors {
            cc_sector >> units_512
        } else {
            cc_sector
        }
    }
}

/// The 16-byte IV of IV sector `n` for the IV modes that are the sector number alone
/// (`plain64`, `plain`, `plain64be`), made as one 16-byte value; `None` for the others. The
/// cipher reads the IV back whole: an IV written in pieces into a larger array and read back
/// at other widths stalls the load, on every sector (BENCHMARKS.md, `bench cipher`, measures
/// what that costs AES-XTS on 512-byte sectors).
#[inline]
fn counter_iv(mode: IvMode, n: u64) -> Option<[u8; 16]> {
    match mode {
        IvMode::Plain64 => Some(u128::from(n).to_le_bytes()),
        IvMode::Plain => Some(u128::from(n as u32).to_le_bytes()),
        IvMode::Plain64Be => Some((u128::from(n.swap_bytes()) << 64).to_le_bytes()),
        _ => None,
    }
}

/// Which AES-XTS implementation a [`SectorCipher`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provider {
    /// The fastest available for the key: AWS-LC's AES-256-XTS for 512-bit keys, the ECB-based
    /// XTS for other key sizes (AWS-LC has no AES-128/192-XTS).
    Auto,
    /// AWS-LC `EVP_aes_256_xts` (512-bit XTS keys only).
    AwsLcXts,
    /// XTS built here from AWS-LC's AES-ECB: one ECB call per sector between two tweak passes.
    /// Any AES key size; proven equal to AWS-LC's XTS and to python-cryptography by tests.
    EcbXts,
}

impl Provider {
    pub const ALL: [Provider; 2] = [Provider::AwsLcXts, Provider::EcbXts];

    pub fn name(self) -> &'static str {
        match self {
            Provider::Auto => "auto",
            Provider::AwsLcXts => "aws-lc-xts",
            Provider::EcbXts => "ecb-xts",
        }
    }
}

enum Imp {
    Null,
    Xts {
        enc: EvpCtx,
        dec: EvpCtx,
    },
    EcbXts(Box<EcbXts>),
    Cbc {
        enc: EvpCtx,
        dec: EvpCtx,
    },
    /// Serpent, twofish, camellia in XTS or CBC; LRW over any of the four.
    Modes(Box<BlockMode>),
    Adiantum(Box<Adiantum>),
    /// TrueCrypt/VeraCrypt cascades: one block mode per layer, outermost first.
    Cascade(Vec<BlockMode>),
    /// CBC with dm-crypt's `tcw` IV and whitening.
    Tcw(Box<Tcw>),
    /// AES-CBC with BitLocker's Elephant diffuser (dm-crypt's `elephant` IV).
    Elephant(Box<Elephant>),
    /// CBC over 64 keys with dm-crypt's `lmk` IV (loop-AES multi-key).
    Lmk(Box<lmk::Lmk>),
}

/// Bytes of `tcw`'s whitening key, whatever the cipher's block size.
const TCW_WHITENING_BYTES: usize = 16;

/// The CBC under `tcw`: a 128-bit cipher's (16-byte IV seed) or a 64-bit one's (8 bytes).
enum TcwCbc {
    Wide(BlockMode),
    Narrow(Cbc64),
}

/// CBC with dm-crypt's `tcw` IV generator (crypt_iv_tcw_* in the kernel's dm-crypt.c): the
/// key is the cipher key, an IV seed of one cipher block, and the 16-byte whitening key.
struct Tcw {
    cbc: TcwCbc,
    /// The IV seed in its first `iv_bytes` bytes (the cipher's block size).
    seed: [u8; 16],
    iv_bytes: usize,
    whitening: [u8; TCW_WHITENING_BYTES],
}

impl Drop for Tcw {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.seed);
        zeroize::Zeroize::zeroize(&mut self.whitening);
    }
}

impl Tcw {
    /// `key` is the whole dm-crypt key; `iv_bytes` the cipher's block size; `cbc` keys the
    /// CBC with the cipher key (the part before the seed).
    fn new(key: &[u8], iv_bytes: usize, cbc: impl FnOnce(&[u8]) -> Result<TcwCbc>) -> Result<Self> {
        let k = key
            .len()
            .checked_sub(iv_bytes + TCW_WHITENING_BYTES)
            .ok_or(Error::Bug("tcw key shorter than its seed and whitening"))?;
        let mut seed = [0u8; 16];
        seed[..iv_bytes].copy_from_slice(&key[k..k + iv_bytes]);
        let mut whitening = [0u8; TCW_WHITENING_BYTES];
        whitening.copy_from_slice(&key[k + iv_bytes..]);
        Ok(Tcw {
            cbc: cbc(&key[..k])?,
            seed,
            iv_bytes,
            whitening,
        })
    }

    /// The 8 whitening bytes of a sector: the whitening key XOR the sector number (in each
    /// half), each 32-bit word replaced by the kernel's crc32(0, word), then folded.
    fn sector_whitening(&self, sector: [u8; 8]) -> [u8; 8] {
        let mut buf = [0u8; TCW_WHITENING_BYTES];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.whitening[i] ^ sector[i % 8];
        }
        for word in buf.chunks_exact_mut(4) {
            let c = crc32::update(0, word);
            word.copy_from_slice(&c.to_le_bytes());
        }
        let mut w = [0u8; 8];
        for i in 0..4 {
            w[i] = buf[i] ^ buf[12 + i];
            w[4 + i] = buf[4 + i] ^ buf[8 + i];
        }
        zeroize::Zeroize::zeroize(&mut buf);
        w
    }

    /// The CBC IV of a sector: the seed XOR the sector number, in each 8-byte half of it.
    fn sector_iv(&self, sector: [u8; 8]) -> [u8; 16] {
        let mut iv = [0u8; 16];
        for (i, b) in iv.iter_mut().enumerate().take(self.iv_bytes) {
            *b = self.seed[i] ^ sector[i % 8];
        }
        iv
    }

    /// One 512-byte sector; `iv` carries the IV sector number, little-endian, in its first
    /// 8 bytes.
    fn crypt(&mut self, encrypt: bool, iv: &[u8; 16], data: &mut [u8]) -> Result<()> {
        let mut sector = [0u8; 8];
        sector.copy_from_slice(&iv[..8]);
        let mut real_iv = self.sector_iv(sector);
        let mut w = self.sector_whitening(sector);
        let whiten = |data: &mut [u8]| {
            for chunk in data.chunks_exact_mut(8) {
                for (d, k) in chunk.iter_mut().zip(&w) {
                    *d ^= k;
                }
            }
        };
        if !encrypt {
            whiten(data);
        }
        let r = match &mut self.cbc {
            TcwCbc::Wide(m) => m.crypt(encrypt, &real_iv, data),
            TcwCbc::Narrow(m) => {
                let mut narrow = [0u8; BLOCK64_BYTES];
                narrow.copy_from_slice(&real_iv[..BLOCK64_BYTES]);
                let r = m.crypt(encrypt, &narrow, data);
                zeroize::Zeroize::zeroize(&mut narrow);
                r
            }
        };
        if encrypt && r.is_ok() {
            whiten(data);
        }
        zeroize::Zeroize::zeroize(&mut w);
        zeroize::Zeroize::zeroize(&mut real_iv);
        r
    }
}

/// The largest IV of any spec (Adiantum's 32-byte tweak); block modes use the first 16 bytes.
const IV_BYTES_MAX: usize = ADIANTUM_TWEAK_BYTES;

/// ESSIV's salt: the hash of the whole volume key, truncated as the kernel's `wp256`/`wp384`
/// truncate Whirlpool.
fn essiv_salt(hash: EssivHash, key: &[u8]) -> SecretBytes {
    use sha2::Digest;
    let d: Vec<u8> = match hash {
        EssivHash::Sha1 => sha1::Sha1::digest(key).to_vec(),
        EssivHash::Sha224 => sha2::Sha224::digest(key).to_vec(),
        EssivHash::Sha256 => sha2::Sha256::digest(key).to_vec(),
        EssivHash::Sha384 => sha2::Sha384::digest(key).to_vec(),
        EssivHash::Sha512 => sha2::Sha512::digest(key).to_vec(),
        EssivHash::Rmd160 => ripemd::Ripemd160::digest(key).to_vec(),
        EssivHash::Wp256 | EssivHash::Wp384 | EssivHash::Wp512 => {
            whirlpool::Whirlpool::digest(key).to_vec()
        }
        EssivHash::Sm3 => sm3::Sm3::digest(key).to_vec(),
    };
    SecretBytes::from_vec(d).slice(0..hash.digest_bytes())
}

struct EcbXts {
    k1_enc: EvpCtx,
    k1_dec: EvpCtx,
    k2_enc: EvpCtx,
    /// The tweak of every 16-byte block of the current sector.
    tweaks: [u8; SECTOR_BYTES_MAX as usize],
}

/// Multiplication by the primitive element α in GF(2^128), XTS's little-endian convention.
#[inline(always)]
fn xts_mul_alpha(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

impl EcbXts {
    fn crypt(&mut self, encrypt: bool, iv: &[u8; 16], data: &mut [u8]) -> Result<()> {
        let mut t0 = [0u8; 16];
        self.k2_enc.update(iv, &mut t0)?;
        let mut t = u128::from_le_bytes(t0);
        let tweaks = &mut self.tweaks[..data.len()];
        for (block, tw) in data.chunks_exact_mut(16).zip(tweaks.chunks_exact_mut(16)) {
            tw.copy_from_slice(&t.to_le_bytes());
            let x = u128::from_le_bytes(block.try_into().expect("16-byte chunk")) ^ t;
            block.copy_from_slice(&x.to_le_bytes());
            t = xts_mul_alpha(t);
        }
        if encrypt {
            self.k1_enc.update_in_place(data)?;
        } else {
            self.k1_dec.update_in_place(data)?;
        }
        for (block, tw) in data.chunks_exact_mut(16).zip(tweaks.chunks_exact(16)) {
            let x = u128::from_le_bytes(block.try_into().expect("16-byte chunk"))
                ^ u128::from_le_bytes(tw.try_into().expect("16-byte chunk"));
            block.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    }
}

/// A keyed sector cipher for one volume: one set of cipher contexts, used by one thread at a
/// time. Make one per worker thread with [`SectorCipher::try_clone`].
pub struct SectorCipher {
    spec: CipherSpec,
    geometry: Geometry,
    provider: Provider,
    key: SecretBytes,
    imp: Imp,
    /// ESSIV's cipher: the mode's block cipher keyed with the hash of the volume key; eboiv's
    /// and elephant's: the block cipher keyed with the CBC key.
    essiv: Option<Ecb>,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SectorCipher")
            .field("spec", &self.spec.to_string())
            .field("key_bits", &(self.key.len() * 8))
            .field("geometry", &self.geometry)
            .field("provider", &self.provider)
            .finish()
    }
}

impl SectorCipher {
    /// Keys a cipher with the fastest provider for this key.
    pub fn new(spec: CipherSpec, key: &[u8], geometry: Geometry) -> Result<Self> {
        Self::with_provider(spec, key, geometry, Provider::Auto)
    }

    pub fn with_provider(
        spec: CipherSpec,
        key: &[u8],
        geometry: Geometry,
        provider: Provider,
    ) -> Result<Self> {
        spec.check_key_len(key.len())?;
        let (imp, provider) = match spec.mode {
            Mode::Null => (Imp::Null, provider),
            Mode::Cbc(c) if spec.iv == IvMode::Lmk64 => {
                if geometry.sector_size != SectorSize::S512 {
                    return Err(Error::InvalidArgument(
                        "the lmk IV works on 512-byte sectors only".into(),
                    ));
                }
                (Imp::Lmk(Box::new(lmk::Lmk::new(c, key)?)), provider)
            }
            Mode::Cbc(c) if spec.iv == IvMode::Tcw => {
                if geometry.sector_size != SectorSize::S512 {
                    return Err(Error::InvalidArgument(
                        "the tcw IV works on 512-byte sectors only".into(),
                    ));
                }
                let tcw = Tcw::new(key, 16, |k| Ok(TcwCbc::Wide(BlockMode::cbc(c, k)?)))?;
                (Imp::Tcw(Box::new(tcw)), provider)
            }
            Mode::Cbc64(c) if spec.iv == IvMode::Tcw => {
                if geometry.sector_size != SectorSize::S512 {
                    return Err(Error::InvalidArgument(
                        "the tcw IV works on 512-byte sectors only".into(),
                    ));
                }
                let tcw = Tcw::new(key, BLOCK64_BYTES, |k| {
                    Ok(TcwCbc::Narrow(Cbc64::new(c, k)?))
                })?;
                (Imp::Tcw(Box::new(tcw)), provider)
            }
            Mode::Cbc64(c) => {
                return Err(Error::InvalidArgument(format!(
                    "the 64-bit cipher {} runs with the tcw IV only",
                    c.name()
                )))
            }
            Mode::Cbc(BlockCipher::Aes) if spec.iv == IvMode::Elephant => {
                (Imp::Elephant(Box::new(Elephant::new(key)?)), provider)
            }
            Mode::Cbc(BlockCipher::Aes) => (
                Imp::Cbc {
                    enc: EvpCtx::new(Alg::AesCbc, key, true)?,
                    dec: EvpCtx::new(Alg::AesCbc, key, false)?,
                },
                provider,
            ),
            Mode::Xts(BlockCipher::Aes) => {
                let aws_lc = || -> Result<Imp> {
                    Ok(Imp::Xts {
                        enc: EvpCtx::new(Alg::Aes256Xts, key, true)?,
                        dec: EvpCtx::new(Alg::Aes256Xts, key, false)?,
                    })
                };
                let half = key.len() / 2;
                let ecb = || -> Result<Imp> {
                    Ok(Imp::EcbXts(Box::new(EcbXts {
                        k1_enc: EvpCtx::new(Alg::AesEcb, &key[..half], true)?,
                        k1_dec: EvpCtx::new(Alg::AesEcb, &key[..half], false)?,
                        k2_enc: EvpCtx::new(Alg::AesEcb, &key[half..], true)?,
                        tweaks: [0; SECTOR_BYTES_MAX as usize],
                    })))
                };
                match provider {
                    Provider::EcbXts => (ecb()?, Provider::EcbXts),
                    Provider::AwsLcXts if key.len() != 64 => {
                        return Err(Error::InvalidArgument(format!(
                            "provider aws-lc-xts needs a 512-bit key, not {} bits",
                            key.len() * 8
                        )))
                    }
                    Provider::AwsLcXts => (aws_lc()?, Provider::AwsLcXts),
                    // AWS-LC refuses XTS keys whose halves are equal (a FIPS rule the kernel does
                    // not apply outside FIPS mode); the ECB path accepts them like dm-crypt.
                    Provider::Auto if key.len() == 64 => match aws_lc() {
                        Ok(imp) => (imp, Provider::AwsLcXts),
                        Err(_) => (ecb()?, Provider::EcbXts),
                    },
                    Provider::Auto => (ecb()?, Provider::EcbXts),
                }
            }
            Mode::Xts(c) => (Imp::Modes(Box::new(BlockMode::xts(c, key)?)), provider),
            Mode::Cbc(c) => (Imp::Modes(Box::new(BlockMode::cbc(c, key)?)), provider),
            Mode::Lrw(c) => (Imp::Modes(Box::new(BlockMode::lrw(c, key)?)), provider),
            Mode::Adiantum(r) => (Imp::Adiantum(Box::new(Adiantum::new(r, key)?)), provider),
            Mode::Cascade(c) => {
                let layers = c
                    .ciphers()
                    .iter()
                    .zip(key.chunks_exact(c.layer_key_bytes()))
                    .map(|(&cipher, k)| match c.chain {
                        CascadeChain::Xts => BlockMode::xts(cipher, k),
                        CascadeChain::Lrw => BlockMode::lrw(cipher, k),
                    })
                    .collect::<Result<Vec<_>>>()?;
                (Imp::Cascade(layers), provider)
            }
        };
        let essiv = match (spec.iv, spec.mode.block_cipher()) {
            (IvMode::Essiv(hash), Some(cipher)) => {
                Some(Ecb::new(cipher, essiv_salt(hash, key).as_ref())?)
            }
            (IvMode::Essiv(_), None) => return Err(Error::Bug("ESSIV without a block cipher")),
            // eboiv encrypts the IV with the data key; elephant's CBC key is the first half.
            (IvMode::Eboiv, Some(cipher)) => Some(Ecb::new(cipher, key)?),
            (IvMode::Elephant, Some(cipher)) => Some(Ecb::new(cipher, &key[..key.len() / 2])?),
            (IvMode::Eboiv | IvMode::Elephant, None) => {
                return Err(Error::Bug("eboiv without a block cipher"))
            }
            _ => None,
        };
        Ok(SectorCipher {
            spec,
            geometry,
            provider,
            key: SecretBytes::from_slice(key),
            imp,
            essiv,
        })
    }

    /// Another cipher with the same key and settings, for another thread.
    pub fn try_clone(&self) -> Result<Self> {
        Self::with_provider(self.spec, self.key.as_ref(), self.geometry, self.provider)
    }

    pub fn spec(&self) -> CipherSpec {
        self.spec
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    pub fn provider(&self) -> Provider {
        self.provider
    }

    pub fn sector_bytes(&self) -> usize {
        self.geometry.sector_size.bytes() as usize
    }

    /// The IV of `sector`, as dm-crypt's generator writes it into an IV of the transform's
    /// size (16 bytes, 32 for Adiantum; the rest of the array stays zero).
    #[inline]
    fn iv(&mut self, sector: u64) -> Result<[u8; IV_BYTES_MAX]> {
        let n = self.geometry.iv_sector(sector);
        let mut iv = [0u8; IV_BYTES_MAX];
        let end = self.spec.iv_bytes();
        match self.spec.iv {
            IvMode::Plain64 | IvMode::Tcw | IvMode::Lmk64 => {
                iv[..8].copy_from_slice(&n.to_le_bytes())
            }
            IvMode::Plain => iv[..4].copy_from_slice(&(n as u32).to_le_bytes()),
            IvMode::Plain64Be => iv[end - 8..end].copy_from_slice(&n.to_be_bytes()),
            // The kernel shifts by 9 - log2(cipher block size): 512-byte units to 16-byte
            // blocks, whatever the sector size.
            IvMode::Benbi => iv[end - 8..end]
                .copy_from_slice(&((n << BENBI_SHIFT).wrapping_add(1)).to_be_bytes()),
            IvMode::Essiv(_) => {
                let block: &mut [u8; 16] = (&mut iv[..16])
                    .try_into()
                    .map_err(|_| Error::Bug("16-byte ESSIV block"))?;
                block[..8].copy_from_slice(&n.to_le_bytes());
                self.essiv
                    .as_mut()
                    .ok_or(Error::Bug("ESSIV context missing"))?
                    .encrypt_block(block)?;
            }
            IvMode::Eboiv | IvMode::Elephant => {
                // The kernel's eboiv: the byte offset of the IV sector, in the units its
                // sector size gives it, encrypted with the CBC key.
                let offset_bytes = n.wrapping_mul(u64::from(self.geometry.sector_size.bytes()));
                let block: &mut [u8; 16] = (&mut iv[..16])
                    .try_into()
                    .map_err(|_| Error::Bug("16-byte eboiv block"))?;
                block[..8].copy_from_slice(&offset_bytes.to_le_bytes());
                self.essiv
                    .as_mut()
                    .ok_or(Error::Bug("eboiv context missing"))?
                    .encrypt_block(block)?;
                // Elephant's sector key derives from the byte offset too: it rides in the
                // IV bytes past the CBC block, which the CBC transform never reads.
                iv[16..24].copy_from_slice(&offset_bytes.to_le_bytes());
            }
            IvMode::None => {}
        }
        Ok(iv)
    }

    /// Encrypts or decrypts one sector of any supported size (a multiple of 16 bytes, at most
    /// [`SECTOR_BYTES_MAX`]) with an explicit 16-byte IV: `src` into `data` when given (same
    /// length), else `data` in place.
    pub(crate) fn crypt_sector_with_iv(
        &mut self,
        encrypt: bool,
        iv: &[u8; 16],
        src: Option<&[u8]>,
        data: &mut [u8],
    ) -> Result<()> {
        if data.len() % 16 != 0
            || data.len() > SECTOR_BYTES_MAX as usize
            || src.is_some_and(|s| s.len() != data.len())
        {
            return Err(Error::Bug("crypt_sector_with_iv: buffer sizes"));
        }
        if let (Some(s), Imp::Xts { enc, dec } | Imp::Cbc { enc, dec }) = (src, &mut self.imp) {
            let ctx = if encrypt { enc } else { dec };
            ctx.set_iv(iv)?;
            return ctx.update(s, data);
        }
        if let Some(s) = src {
            data.copy_from_slice(s);
        }
        let mut full = [0u8; IV_BYTES_MAX];
        full[..16].copy_from_slice(iv);
        self.crypt_unit(encrypt, &full, data)
    }

    fn check_len(&self, len: usize) -> Result<()> {
        if len % self.sector_bytes() != 0 {
            return Err(Error::NotSectorMultiple {
                len,
                sector_bytes: self.sector_bytes() as u32,
            });
        }
        Ok(())
    }

    fn crypt_in_place(&mut self, encrypt: bool, first_sector: u64, data: &mut [u8]) -> Result<()> {
        self.check_len(data.len())?;
        if matches!(self.imp, Imp::Null) {
            return Ok(());
        }
        let ss = self.sector_bytes();
        let counter = counter_iv(self.spec.iv, 0).is_some();
        if let (true, Imp::Xts { enc, dec } | Imp::Cbc { enc, dec }) = (counter, &mut self.imp) {
            let ctx = if encrypt { enc } else { dec };
            for (i, chunk) in data.chunks_exact_mut(ss).enumerate() {
                let n = self.geometry.iv_sector(first_sector.wrapping_add(i as u64));
                let iv = counter_iv(self.spec.iv, n).ok_or(Error::Bug("counter IV"))?;
                ctx.set_iv(&iv)?;
                ctx.update_in_place(chunk)?;
            }
            return Ok(());
        }
        for (i, chunk) in data.chunks_exact_mut(ss).enumerate() {
            let iv = self.iv(first_sector.wrapping_add(i as u64))?;
            self.crypt_unit(encrypt, &iv, chunk)?;
        }
        Ok(())
    }

    /// One data unit (sector) with an explicit IV, in place. `data` is a multiple of 16 bytes
    /// and at most `SECTOR_BYTES_MAX`.
    #[inline]
    fn crypt_unit(
        &mut self,
        encrypt: bool,
        iv: &[u8; IV_BYTES_MAX],
        data: &mut [u8],
    ) -> Result<()> {
        let block_iv: &[u8; 16] = iv[..16].try_into().map_err(|_| Error::Bug("16-byte IV"))?;
        match &mut self.imp {
            Imp::Null => Ok(()),
            Imp::Xts { enc, dec } | Imp::Cbc { enc, dec } => {
                let ctx = if encrypt { enc } else { dec };
                ctx.set_iv(block_iv)?;
                ctx.update_in_place(data)
            }
            Imp::EcbXts(x) => x.crypt(encrypt, block_iv, data),
            Imp::Modes(m) => m.crypt(encrypt, block_iv, data),
            Imp::Adiantum(a) => a.crypt(encrypt, iv, data),
            // Encryption meets the outermost layer first; decryption peels the disk's first.
            Imp::Cascade(layers) if encrypt => {
                for m in layers.iter_mut() {
                    m.crypt(true, block_iv, data)?;
                }
                Ok(())
            }
            Imp::Cascade(layers) => {
                for m in layers.iter_mut().rev() {
                    m.crypt(false, block_iv, data)?;
                }
                Ok(())
            }
            Imp::Tcw(t) => t.crypt(encrypt, block_iv, data),
            Imp::Elephant(e) => e.crypt(encrypt, iv, data),
            Imp::Lmk(l) => {
                let mut n = [0u8; 8];
                n.copy_from_slice(&block_iv[..8]);
                l.crypt(encrypt, u64::from_le_bytes(n), data)
            }
        }
    }

    fn crypt_to(
        &mut self,
        encrypt: bool,
        first_sector: u64,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "source ({} bytes) and destination ({} bytes) differ in length",
                src.len(),
                dst.len()
            )));
        }
        self.check_len(src.len())?;
        let ss = self.sector_bytes();
        match self.imp {
            Imp::Xts { .. } | Imp::Cbc { .. } if counter_iv(self.spec.iv, 0).is_some() => {
                let (Imp::Xts { enc, dec } | Imp::Cbc { enc, dec }) = &mut self.imp else {
                    return Err(Error::Bug("cipher implementation changed mid-call"));
                };
                let ctx = if encrypt { enc } else { dec };
                let sectors = src.chunks_exact(ss).zip(dst.chunks_exact_mut(ss));
                for (i, (s, d)) in sectors.enumerate() {
                    let n = self.geometry.iv_sector(first_sector.wrapping_add(i as u64));
                    let iv = counter_iv(self.spec.iv, n).ok_or(Error::Bug("counter IV"))?;
                    ctx.set_iv(&iv)?;
                    ctx.update(s, d)?;
                }
                Ok(())
            }
            Imp::Xts { .. } | Imp::Cbc { .. } => {
                for (i, (s, d)) in src
                    .chunks_exact(ss)
                    .zip(dst.chunks_exact_mut(ss))
                    .enumerate()
                {
                    let iv = self.iv(first_sector.wrapping_add(i as u64))?;
                    let (Imp::Xts { enc, dec } | Imp::Cbc { enc, dec }) = &mut self.imp else {
                        return Err(Error::Bug("cipher implementation changed mid-call"));
                    };
                    let ctx = if encrypt { enc } else { dec };
                    let iv: &[u8; 16] =
                        iv[..16].try_into().map_err(|_| Error::Bug("16-byte IV"))?;
                    ctx.set_iv(iv)?;
                    ctx.update(s, d)?;
                }
                Ok(())
            }
            Imp::Null
            | Imp::EcbXts(_)
            | Imp::Modes(_)
            | Imp::Adiantum(_)
            | Imp::Cascade(_)
            | Imp::Tcw(_)
            | Imp::Elephant(_)
            | Imp::Lmk(_) => {
                dst.copy_from_slice(src);
                self.crypt_in_place(encrypt, first_sector, dst)
            }
        }
    }

    /// Whether [`SectorCipher::decrypt_to`] and [`SectorCipher::encrypt_to`] write `dst` only
    /// with their output, reading each byte of `src` once: the modes a cipher library runs
    /// from one buffer into another. The others copy `src` into `dst` and work there.
    pub fn crypts_out_of_place(&self) -> bool {
        matches!(self.imp, Imp::Xts { .. } | Imp::Cbc { .. })
    }

    /// Encrypts whole sectors in place; `first_sector` counts encryption sectors from the start
    /// of the data segment.
    pub fn encrypt(&mut self, first_sector: u64, data: &mut [u8]) -> Result<()> {
        self.crypt_in_place(true, first_sector, data)
    }

    /// Decrypts whole sectors in place.
    pub fn decrypt(&mut self, first_sector: u64, data: &mut [u8]) -> Result<()> {
        self.crypt_in_place(false, first_sector, data)
    }

    /// Encrypts `src` into `dst` (same length, whole sectors).
    pub fn encrypt_to(&mut self, first_sector: u64, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.crypt_to(true, first_sector, src, dst)
    }

    /// Decrypts `src` into `dst` (same length, whole sectors).
    pub fn decrypt_to(&mut self, first_sector: u64, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.crypt_to(false, first_sector, src, dst)
    }
}

#[cfg(test)]
mod tests;
