//! dm-crypt cipher specifications (`cipher-chainmode-ivmode[:ivopts]`, or the kernel-API form
//! `capi:chainmode(cipher)-ivmode[:ivopts]`), parsed once into a [`CipherSpec`].

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// What `ucrypt` accepts, for error messages.
pub const SUPPORTED_SPECS: &str = "aes-xts-plain64, aes-xts-plain, aes-xts-plain64be, \
aes-xts-essiv:sha256, aes-cbc-essiv:sha256, aes-cbc-plain64, aes-cbc-plain, cipher_null-ecb \
(and their capi: forms, e.g. capi:xts(aes)-plain64)";

/// Block cipher and chaining mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// AES in XTS mode; the key is two AES keys (256, 384 or 512 bits in total).
    AesXts,
    /// AES in CBC mode, restarted every sector with that sector's IV (128, 192 or 256 bits).
    AesCbc,
    /// dm-crypt's null cipher: ciphertext = plaintext, key size 0. For benchmarks only.
    Null,
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
    /// ESSIV: plain64 encrypted with AES under SHA-256 of the whole volume key.
    EssivSha256,
    /// No IV (the null cipher).
    None,
}

/// A parsed, validated dm-crypt cipher specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CipherSpec {
    pub mode: Mode,
    pub iv: IvMode,
}

impl CipherSpec {
    pub const AES_XTS_PLAIN64: CipherSpec = CipherSpec {
        mode: Mode::AesXts,
        iv: IvMode::Plain64,
    };
    pub const NULL: CipherSpec = CipherSpec {
        mode: Mode::Null,
        iv: IvMode::None,
    };

    /// Key sizes this spec accepts, in bytes.
    pub fn key_bytes_allowed(&self) -> &'static [usize] {
        match self.mode {
            Mode::AesXts => &[32, 48, 64],
            Mode::AesCbc => &[16, 24, 32],
            Mode::Null => &[0],
        }
    }

    /// The key size cryptsetup picks by default for this spec, in bytes.
    pub fn default_key_bytes(&self) -> usize {
        match self.mode {
            Mode::AesXts => 64,
            Mode::AesCbc => 32,
            Mode::Null => 0,
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
                Mode::AesXts => "256, 384 or 512 bits",
                Mode::AesCbc => "128, 192 or 256 bits",
                Mode::Null => "0 bits (no key)",
            },
        })
    }

    /// LUKS stores cipher and mode separately (`cipher_name` "aes", `cipher_mode`
    /// "xts-plain64"); this is the pair for a LUKS1 header.
    pub fn luks1_name_mode(&self) -> (&'static str, String) {
        let s = self.to_string();
        match s.split_once('-') {
            Some((c, rest)) => (
                if c == "aes" { "aes" } else { "cipher_null" },
                rest.to_string(),
            ),
            None => ("cipher_null", "ecb".to_string()),
        }
    }
}

impl fmt::Display for CipherSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cm = match self.mode {
            Mode::AesXts => "aes-xts",
            Mode::AesCbc => "aes-cbc",
            Mode::Null => return f.write_str("cipher_null-ecb"),
        };
        let iv = match self.iv {
            IvMode::Plain64 => "plain64",
            IvMode::Plain => "plain",
            IvMode::Plain64Be => "plain64be",
            IvMode::EssivSha256 => "essiv:sha256",
            IvMode::None => "null",
        };
        write!(f, "{cm}-{iv}")
    }
}

fn unsupported(spec: &str, reason: impl Into<String>) -> Error {
    Error::UnsupportedCipher {
        spec: spec.to_string(),
        reason: reason.into(),
        supported: SUPPORTED_SPECS,
    }
}

impl FromStr for CipherSpec {
    type Err = Error;

    fn from_str(spec: &str) -> Result<Self> {
        let s = spec.trim();
        // Split into (cipher, chainmode, ivpart) for either syntax.
        let (cipher, chain, ivpart): (&str, &str, &str) =
            if let Some(capi) = s.strip_prefix("capi:") {
                // capi:xts(aes)-plain64 / capi:ecb(cipher_null)
                let (alg, iv) = match capi.split_once(")-") {
                    Some((alg, iv)) => (format!("{alg})"), iv),
                    None => (capi.to_string(), ""),
                };
                let open = alg
                    .find('(')
                    .ok_or_else(|| unsupported(spec, "capi form needs mode(cipher)"))?;
                if !alg.ends_with(')') {
                    return Err(unsupported(spec, "capi form needs mode(cipher)"));
                }
                let chain = &alg[..open];
                let cipher = &alg[open + 1..alg.len() - 1];
                let chain: &'static str = match chain {
                    "xts" => "xts",
                    "cbc" => "cbc",
                    "ecb" => "ecb",
                    _ => return Err(unsupported(spec, format!("chaining mode '{chain}'"))),
                };
                let cipher: &'static str = match cipher {
                    "aes" => "aes",
                    "cipher_null" => "cipher_null",
                    _ => return Err(unsupported(spec, format!("cipher '{cipher}'"))),
                };
                (cipher, chain, iv)
            } else {
                let mut parts = s.splitn(3, '-');
                let cipher = parts.next().unwrap_or("");
                let chain = parts.next().unwrap_or("");
                let iv = parts.next().unwrap_or("");
                (cipher, chain, iv)
            };
        let (ivmode, ivopts) = match ivpart.split_once(':') {
            Some((m, o)) => (m, Some(o)),
            None => (ivpart, None),
        };
        match (cipher, chain) {
            ("cipher_null", "ecb") | ("cipher_null", "") => {
                if !matches!(ivmode, "" | "null" | "plain" | "plain64") || ivopts.is_some() {
                    return Err(unsupported(
                        spec,
                        format!("IV mode '{ivpart}' with the null cipher"),
                    ));
                }
                Ok(CipherSpec::NULL)
            }
            ("aes", "xts" | "cbc") => {
                let mode = if chain == "xts" {
                    Mode::AesXts
                } else {
                    Mode::AesCbc
                };
                let iv = match (ivmode, ivopts) {
                    ("plain64", None) => IvMode::Plain64,
                    ("plain", None) => IvMode::Plain,
                    ("plain64be", None) => IvMode::Plain64Be,
                    ("essiv", Some("sha256")) => IvMode::EssivSha256,
                    ("essiv", other) => {
                        return Err(unsupported(
                            spec,
                            format!("ESSIV hash '{}'", other.unwrap_or("(none)")),
                        ))
                    }
                    ("", _) => return Err(unsupported(spec, "missing IV mode (e.g. -plain64)")),
                    (m, _) => return Err(unsupported(spec, format!("IV mode '{m}'"))),
                };
                Ok(CipherSpec { mode, iv })
            }
            ("aes", m) => Err(unsupported(spec, format!("chaining mode '{m}'"))),
            (c, _) => Err(unsupported(spec, format!("cipher '{c}'"))),
        }
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
            ("cipher_null-ecb", Some("cipher_null-ecb")),
            ("capi:xts(aes)-plain64", Some("aes-xts-plain64")),
            ("capi:cbc(aes)-essiv:sha256", Some("aes-cbc-essiv:sha256")),
            ("capi:ecb(cipher_null)", Some("cipher_null-ecb")),
            ("capi:ecb(cipher_null)-plain64", Some("cipher_null-ecb")),
            ("aes-xts-benbi", None),
            ("aes-xts-essiv:sha1", None),
            ("aes-xts", None),
            ("aes-ctr-plain64", None),
            ("twofish-xts-plain64", None),
            ("serpent-cbc-essiv:sha256", None),
            ("capi:xts(twofish)-plain64", None),
            ("capi:xts-plain64", None),
            ("", None),
        ];
        for (input, want) in rows {
            let got = input.parse::<CipherSpec>();
            match (want, got) {
                (Some(w), Ok(spec)) => assert_eq!(spec.to_string(), *w, "input {input}"),
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
    }

    #[test]
    fn luks1_split() {
        assert_eq!(
            CipherSpec::AES_XTS_PLAIN64.luks1_name_mode(),
            ("aes", "xts-plain64".to_string())
        );
        let cbc: CipherSpec = "aes-cbc-essiv:sha256".parse().unwrap();
        assert_eq!(
            cbc.luks1_name_mode(),
            ("aes", "cbc-essiv:sha256".to_string())
        );
    }
}
