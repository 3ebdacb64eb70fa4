//! loop-AES volumes (cryptsetup's LOOPAES), sans I/O: a loop-AES volume has no header; its
//! key file (already GPG-decrypted: cryptsetup reads it from a file or standard input and
//! refuses an armoured GPG message) holds one key line (v1), 64 (v2, multi-key) or 65 (v3:
//! 64 keys and an IV seed). Each line is hashed into one AES key ([`KeyFile::parse`],
//! [`KeyFile::volume_key`]) and [`KeyFile::mapping`] says how the data is encrypted.
//!
//! The facts (cryptsetup's lib/loopaes): lines end at `\n` or `\r` (runs of them separate
//! lines), all lines must have the same length, and the last must be terminated. A line is
//! hashed with SHA-256, SHA-384 or SHA-512 for 128-, 192- or 256-bit keys (or `--hash`),
//! truncated to the key size; the first byte of every key of a v2 file is XORed with 0x55,
//! of a v3 file with 0xF4. One key maps as `aes-cbc-plain64`; 64 or 65 as dm-crypt's
//! `aes:64-cbc-lmk` (a key per sector modulo 64, the LMK IV of `sector/lmk.rs`; v3's last
//! key is the LMK seed).

use sha2::Digest;

use crate::sector::{BlockCipher, CipherSpec, Geometry, IvMode, Mode, SectorSize};
use crate::tcrypt::Mapping;
use crate::{Error, Result, SecretBytes};

/// The most key lines a key file has (v3).
pub const KEYS_MAX: usize = 65;
/// The key sizes loop-AES uses, in bytes.
pub const KEY_BYTES: [usize; 3] = [16, 24, 32];
/// cryptsetup's default key size.
pub const DEFAULT_KEY_BITS: u32 = 128;
const SECTOR: u64 = 512;

/// The key file's layout, by its number of lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// One key: `aes-cbc-plain64`.
    Single,
    /// 64 keys: `aes:64-cbc-lmk`.
    Multi,
    /// 64 keys and the LMK seed: `aes:64-cbc-lmk` with a seed.
    MultiSeeded,
}

impl Version {
    pub fn keys(self) -> usize {
        match self {
            Version::Single => 1,
            Version::Multi => 64,
            Version::MultiSeeded => 65,
        }
    }

    /// The byte XORed into the first byte of every hashed key.
    fn tweak(self) -> u8 {
        match self {
            Version::Single => 0,
            Version::Multi => 0x55,
            Version::MultiSeeded => 0xF4,
        }
    }
}

/// Why a key file is refused (bad input: cryptsetup's words where it has them).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFileError {
    Empty,
    /// An armoured GPG message: decrypt it first (`gpg --decrypt KEYFILE | ucrypt ...
    /// --key-file=-`).
    Gpg,
    /// Not 1, 64 or 65 lines of one length, each terminated.
    Incompatible,
    /// A hash ucrypt does not offer for key lines.
    Hash(String),
    /// A key size other than 128, 192 or 256 bits (or one the hash cannot fill).
    KeySize(u32),
}

impl std::fmt::Display for KeyFileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyFileError::Empty => f.write_str("Incompatible loop-AES keyfile detected (empty)."),
            KeyFileError::Gpg => f.write_str(
                "Detected not yet supported GPG encrypted keyfile.\nPlease use gpg --decrypt \
                 <KEYFILE> | ucrypt --keyfile=- ...",
            ),
            KeyFileError::Incompatible => f.write_str("Incompatible loop-AES keyfile detected."),
            KeyFileError::Hash(h) => write!(f, "Key processing error (using hash {h})."),
            KeyFileError::KeySize(b) => write!(f, "loop-AES key size {b} bits is not supported"),
        }
    }
}

impl From<KeyFileError> for Error {
    fn from(e: KeyFileError) -> Self {
        Error::InvalidArgument(e.to_string())
    }
}

/// A parsed key file: its lines (secret), all of one length.
pub struct KeyFile {
    version: Version,
    lines: Vec<SecretBytes>,
}

impl std::fmt::Debug for KeyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("loopaes::KeyFile")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl KeyFile {
    /// Splits the key file's bytes into key lines, as cryptsetup does.
    pub fn parse(buf: &[u8]) -> std::result::Result<Self, KeyFileError> {
        if buf.is_empty() {
            return Err(KeyFileError::Empty);
        }
        let head = &buf[..buf.len().min(100)];
        if head.windows(17).any(|w| w == b"BEGIN PGP MESSAGE") {
            return Err(KeyFileError::Gpg);
        }
        let eol = |c: &u8| *c == b'\n' || *c == b'\r';
        // Every line must end in an EOL: the bytes after the last one form no key.
        // A key line must start the file (an empty first key is refused as cryptsetup does).
        if !buf.last().is_some_and(eol) || buf.first().is_some_and(eol) {
            return Err(KeyFileError::Incompatible);
        }
        let mut lines = Vec::new();
        for line in buf.split(eol).filter(|l| !l.is_empty()) {
            if lines.len() == KEYS_MAX {
                return Err(KeyFileError::Incompatible);
            }
            lines.push(SecretBytes::from_slice(line));
        }
        let len = lines.first().map_or(0, SecretBytes::len);
        if len == 0 || lines.iter().any(|l| l.len() != len) {
            return Err(KeyFileError::Incompatible);
        }
        let version = match lines.len() {
            1 => Version::Single,
            64 => Version::Multi,
            65 => Version::MultiSeeded,
            _ => return Err(KeyFileError::Incompatible),
        };
        Ok(KeyFile { version, lines })
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// The keys, each line hashed (`hash`, else by key size) and truncated to `key_bytes`,
    /// with the version's tweak in its first byte; concatenated as dm-crypt takes them.
    pub fn volume_key(
        &self,
        key_bytes: usize,
        hash: Option<&str>,
    ) -> std::result::Result<SecretBytes, KeyFileError> {
        if !KEY_BYTES.contains(&key_bytes) {
            return Err(KeyFileError::KeySize(key_bytes as u32 * 8));
        }
        let hash = hash.unwrap_or(match key_bytes {
            16 => "sha256",
            24 => "sha384",
            _ => "sha512",
        });
        let mut out = SecretBytes::zeroed(key_bytes * self.lines.len());
        for (line, k) in self
            .lines
            .iter()
            .zip(out.as_mut().chunks_exact_mut(key_bytes))
        {
            let mut d = digest(hash, line.as_ref())?;
            if d.len() < key_bytes {
                zeroize::Zeroize::zeroize(&mut d);
                return Err(KeyFileError::KeySize(key_bytes as u32 * 8));
            }
            k.copy_from_slice(&d[..key_bytes]);
            k[0] ^= self.version.tweak();
            zeroize::Zeroize::zeroize(&mut d);
        }
        Ok(out)
    }

    /// The data: `aes-cbc-plain64` with one key, `aes:64-cbc-lmk` with 64 or 65, from
    /// `offset_sectors`, the IV (and LMK's key choice) counted from `skip_sectors`
    /// (cryptsetup's `--offset` and `--skip`, 512-byte sectors).
    pub fn mapping(
        &self,
        key: SecretBytes,
        offset_sectors: u64,
        skip_sectors: u64,
    ) -> Result<Mapping> {
        let spec = CipherSpec {
            mode: Mode::Cbc(BlockCipher::Aes),
            iv: match self.version {
                Version::Single => IvMode::Plain64,
                Version::Multi | Version::MultiSeeded => IvMode::Lmk64,
            },
        };
        spec.check_key_len(key.len())?;
        let data_offset_bytes = offset_sectors
            .checked_mul(SECTOR)
            .ok_or_else(|| Error::InvalidArgument("--offset too large".into()))?;
        let mut geometry = Geometry::new(SectorSize::S512);
        geometry.iv_offset = skip_sectors;
        Ok(Mapping {
            spec,
            key,
            geometry,
            data_offset_bytes,
            size_bytes: None,
        })
    }
}

fn digest(hash: &str, data: &[u8]) -> std::result::Result<Vec<u8>, KeyFileError> {
    Ok(match hash {
        "sha1" => sha1::Sha1::digest(data).to_vec(),
        "sha224" => sha2::Sha224::digest(data).to_vec(),
        "sha256" => sha2::Sha256::digest(data).to_vec(),
        "sha384" => sha2::Sha384::digest(data).to_vec(),
        "sha512" => sha2::Sha512::digest(data).to_vec(),
        "ripemd160" => ripemd::Ripemd160::digest(data).to_vec(),
        "whirlpool" => whirlpool::Whirlpool::digest(data).to_vec(),
        "sha3-256" => sha3::Sha3_256::digest(data).to_vec(),
        "sha3-512" => sha3::Sha3_512::digest(data).to_vec(),
        other => return Err(KeyFileError::Hash(other.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(n: usize, len: usize) -> Vec<u8> {
        let mut v = Vec::new();
        for i in 0..n {
            v.extend(std::iter::repeat_n(b'A' + (i % 26) as u8, len));
            v.push(b'\n');
        }
        v
    }

    #[test]
    fn key_files_of_each_version_and_refusals() {
        assert_eq!(
            KeyFile::parse(&lines(1, 8)).unwrap().version(),
            Version::Single
        );
        assert_eq!(
            KeyFile::parse(&lines(64, 8)).unwrap().version(),
            Version::Multi
        );
        let v3 = KeyFile::parse(&lines(65, 8)).unwrap();
        assert_eq!(v3.version(), Version::MultiSeeded);
        // CRLF and blank lines separate lines too.
        assert_eq!(
            KeyFile::parse(b"abc\r\n\r\n").unwrap().version(),
            Version::Single
        );
        let cases: [(&[u8], KeyFileError); 7] = [
            (b"", KeyFileError::Empty),
            (b"abc", KeyFileError::Incompatible),
            (b"abc\nabcd\n", KeyFileError::Incompatible),
            (b"\n\n", KeyFileError::Incompatible),
            (b"\nabc\n", KeyFileError::Incompatible),
            (b"-----BEGIN PGP MESSAGE-----\nxx\n", KeyFileError::Gpg),
            (&lines(2, 8), KeyFileError::Incompatible),
        ];
        for (buf, want) in cases {
            assert_eq!(KeyFile::parse(buf).err(), Some(want), "{buf:?}");
        }
        assert_eq!(
            KeyFile::parse(&lines(66, 8)).err(),
            Some(KeyFileError::Incompatible)
        );
    }

    #[test]
    fn keys_are_hashed_truncated_and_tweaked() {
        let kf = KeyFile::parse(b"secret\n").unwrap();
        let k = kf.volume_key(16, None).unwrap();
        assert_eq!(k.as_ref(), &sha2::Sha256::digest(b"secret")[..16]);
        let k = kf.volume_key(32, None).unwrap();
        assert_eq!(k.as_ref(), &sha2::Sha512::digest(b"secret")[..32]);
        let k = kf.volume_key(24, Some("sha256")).unwrap();
        assert_eq!(k.as_ref(), &sha2::Sha256::digest(b"secret")[..24]);
        assert!(matches!(
            kf.volume_key(32, Some("sha1")),
            Err(KeyFileError::KeySize(256))
        ));
        assert!(matches!(
            kf.volume_key(20, None),
            Err(KeyFileError::KeySize(160))
        ));
        assert!(matches!(
            kf.volume_key(16, Some("md4")),
            Err(KeyFileError::Hash(_))
        ));
        let v2 = KeyFile::parse(&lines(64, 8)).unwrap();
        let k = v2.volume_key(16, None).unwrap();
        assert_eq!(k.len(), 64 * 16);
        let mut want = sha2::Sha256::digest(b"AAAAAAAA")[..16].to_vec();
        want[0] ^= 0x55;
        assert_eq!(&k.as_ref()[..16], &want[..]);
        let v3 = KeyFile::parse(&lines(65, 8)).unwrap();
        let k = v3.volume_key(16, None).unwrap();
        assert_eq!(k.as_ref()[0], sha2::Sha256::digest(b"AAAAAAAA")[0] ^ 0xF4);
    }

    #[test]
    fn single_key_maps_as_cbc_plain64_and_multi_key_as_lmk() {
        let kf = KeyFile::parse(b"secret\n").unwrap();
        let m = kf.mapping(kf.volume_key(16, None).unwrap(), 16, 0).unwrap();
        assert_eq!(m.data_offset_bytes, 8192);
        assert_eq!(m.geometry.iv_offset, 0);
        assert_eq!(m.spec.mode, Mode::Cbc(BlockCipher::Aes));
        let v2 = KeyFile::parse(&lines(64, 8)).unwrap();
        let m = v2.mapping(v2.volume_key(16, None).unwrap(), 0, 0).unwrap();
        assert_eq!(m.spec.iv, IvMode::Lmk64);
        let v3 = KeyFile::parse(&lines(65, 8)).unwrap();
        assert!(v3.mapping(v3.volume_key(32, None).unwrap(), 0, 0).is_ok());
    }
}
