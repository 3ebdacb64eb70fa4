//! Small building blocks shared by LUKS1 and LUKS2: hash algorithms by name, PBKDF2, strict
//! base64, random bytes and UUIDs, NUL-terminated on-disk strings.

use hmac::Hmac;
use sha1::Sha1;
use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};

use crate::{Error, Result, SecretBytes};

/// Hash algorithms LUKS headers may name (PBKDF2, AF diffusion, header checksums).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    Sha1,
    Sha224,
    Sha256,
    Sha384,
    Sha512,
}

impl HashAlg {
    pub fn from_name(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "sha1" => Ok(HashAlg::Sha1),
            "sha224" => Ok(HashAlg::Sha224),
            "sha256" => Ok(HashAlg::Sha256),
            "sha384" => Ok(HashAlg::Sha384),
            "sha512" => Ok(HashAlg::Sha512),
            other => Err(Error::UnsupportedLuks(format!(
                "hash '{other}' (supported: sha1, sha224, sha256, sha384, sha512)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlg::Sha1 => "sha1",
            HashAlg::Sha224 => "sha224",
            HashAlg::Sha256 => "sha256",
            HashAlg::Sha384 => "sha384",
            HashAlg::Sha512 => "sha512",
        }
    }

    /// Output length in bytes.
    pub fn output_bytes(self) -> usize {
        match self {
            HashAlg::Sha1 => 20,
            HashAlg::Sha224 => 28,
            HashAlg::Sha256 => 32,
            HashAlg::Sha384 => 48,
            HashAlg::Sha512 => 64,
        }
    }

    /// Hash of the concatenation of `parts`.
    pub fn digest(self, parts: &[&[u8]]) -> Vec<u8> {
        fn run<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut h = D::new();
            for p in parts {
                h.update(p);
            }
            h.finalize().to_vec()
        }
        match self {
            HashAlg::Sha1 => run::<Sha1>(parts),
            HashAlg::Sha224 => run::<Sha224>(parts),
            HashAlg::Sha256 => run::<Sha256>(parts),
            HashAlg::Sha384 => run::<Sha384>(parts),
            HashAlg::Sha512 => run::<Sha512>(parts),
        }
    }

    /// PBKDF2-HMAC with this hash into `out`.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
        match self {
            HashAlg::Sha1 => pbkdf2::pbkdf2::<Hmac<Sha1>>(password, salt, iterations, out),
            HashAlg::Sha224 => pbkdf2::pbkdf2::<Hmac<Sha224>>(password, salt, iterations, out),
            HashAlg::Sha256 => pbkdf2::pbkdf2::<Hmac<Sha256>>(password, salt, iterations, out),
            HashAlg::Sha384 => pbkdf2::pbkdf2::<Hmac<Sha384>>(password, salt, iterations, out),
            HashAlg::Sha512 => pbkdf2::pbkdf2::<Hmac<Sha512>>(password, salt, iterations, out),
        }
        // The only error is an invalid HMAC key length, which HMAC never reports.
        .unwrap_or(());
    }
}

/// Fills `buf` from the OS random number generator.
pub fn random_fill(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| {
        Error::io(
            "reading the OS random number generator",
            std::io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(libc::EIO)),
        )
    })
}

/// A fresh random secret of `len` bytes.
pub fn random_secret(len: usize) -> Result<SecretBytes> {
    let mut s = SecretBytes::zeroed(len);
    random_fill(s.as_mut())?;
    Ok(s)
}

/// A random (version 4) UUID in its canonical lowercase text form.
pub fn random_uuid() -> Result<String> {
    let mut b = [0u8; 16];
    random_fill(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

/// Checks a UUID's canonical text form (8-4-4-4-12 hex digits).
pub fn check_uuid(s: &str) -> Result<()> {
    let ok = s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        });
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "wrong LUKS UUID format '{s}': expected xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
        )))
    }
}

/// The string in a fixed-size, NUL-padded on-disk field. `check` names the field for errors;
/// the field must contain a NUL (cryptsetup writes at most len-1 characters) and valid UTF-8.
pub fn c_string(field: &[u8], check: &'static str) -> Result<String> {
    let end = field.iter().position(|&b| b == 0).ok_or(Error::BadHeader {
        check,
        detail: "string field is not NUL-terminated".into(),
    })?;
    String::from_utf8(field[..end].to_vec()).map_err(|_| Error::BadHeader {
        check,
        detail: "string field is not valid UTF-8".into(),
    })
}

/// Writes `s` into a NUL-padded field, refusing strings that leave no room for the NUL.
pub fn put_c_string(field: &mut [u8], s: &str, what: &str) -> Result<()> {
    if s.len() >= field.len() || s.as_bytes().contains(&0) {
        return Err(Error::InvalidArgument(format!(
            "{what} '{s}' is too long (at most {} bytes) or contains NUL",
            field.len() - 1
        )));
    }
    field.fill(0);
    field[..s.len()].copy_from_slice(s.as_bytes());
    Ok(())
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn b64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(B64[(n >> 18) as usize & 63] as char);
        out.push(B64[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            B64[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            B64[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// Strict standard base64 (padding required, no whitespace), as cryptsetup writes it.
pub fn b64_decode(s: &str) -> Option<Vec<u8>> {
    let bytes = s.as_bytes();
    if bytes.len() % 4 != 0 {
        return None;
    }
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    let quads = bytes.len() / 4;
    for (i, q) in bytes.chunks(4).enumerate() {
        let last = i + 1 == quads;
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            n = (n << 6) | val(c)?;
        }
        n <<= 6 * pad as u32;
        let b = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&b[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trip_and_rejects() {
        for len in 0..70 {
            let data: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let e = b64_encode(&data);
            assert_eq!(b64_decode(&e).as_deref(), Some(&data[..]), "len {len}");
        }
        for bad in ["A", "AB=C", "A===", "AB\nC", "AB!C", "AA==AAAA"] {
            assert!(b64_decode(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn uuid_shape() {
        let u = random_uuid().expect("rng");
        check_uuid(&u).expect("valid");
        assert!(check_uuid("not-a-uuid").is_err());
    }
}
