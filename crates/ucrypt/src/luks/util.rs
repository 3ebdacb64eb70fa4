//! Small building blocks shared by LUKS1 and LUKS2: hash algorithms by name, PBKDF2, strict
//! base64, random bytes and UUIDs, NUL-terminated on-disk strings.

use blake2::{Blake2b512, Blake2s256};
use hmac::{Hmac, SimpleHmac};
use ripemd::Ripemd160;
use sha1::Sha1;
use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};
use sha3::{Sha3_224, Sha3_256, Sha3_384, Sha3_512};
use sm3::Sm3;
use whirlpool::Whirlpool;

use crate::{Error, Result, SecretBytes};

/// Hash algorithms LUKS headers may name (PBKDF2, AF diffusion, header checksums) and
/// reencryption checksums may use: the ones cryptsetup's crypto backend offers under these
/// names (cryptsetup 2.6.1's `luksFormat --hash NAME` accepts each; `ucrypt-cli`'s
/// `luks_interop` test opens volumes it formatted with them), except
/// stribog (cryptsetup refuses it here too) and the blake2 lengths other than the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    Sha1,
    Sha224,
    Sha256,
    Sha384,
    Sha512,
    Sha3_224,
    Sha3_256,
    Sha3_384,
    Sha3_512,
    Ripemd160,
    Whirlpool,
    Blake2b512,
    Blake2s256,
    Sm3,
}

impl HashAlg {
    /// Every algorithm, in the order error messages list them.
    pub const ALL: [HashAlg; 14] = [
        HashAlg::Sha1,
        HashAlg::Sha224,
        HashAlg::Sha256,
        HashAlg::Sha384,
        HashAlg::Sha512,
        HashAlg::Sha3_224,
        HashAlg::Sha3_256,
        HashAlg::Sha3_384,
        HashAlg::Sha3_512,
        HashAlg::Ripemd160,
        HashAlg::Whirlpool,
        HashAlg::Blake2b512,
        HashAlg::Blake2s256,
        HashAlg::Sm3,
    ];

    pub fn from_name(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        HashAlg::ALL
            .into_iter()
            .find(|h| h.name() == lower)
            .ok_or_else(|| {
                let names: Vec<&str> = HashAlg::ALL.iter().map(|h| h.name()).collect();
                Error::UnsupportedLuks(format!("hash '{lower}' (supported: {})", names.join(", ")))
            })
    }

    /// The name cryptsetup writes in headers and accepts on its command line.
    pub fn name(self) -> &'static str {
        match self {
            HashAlg::Sha1 => "sha1",
            HashAlg::Sha224 => "sha224",
            HashAlg::Sha256 => "sha256",
            HashAlg::Sha384 => "sha384",
            HashAlg::Sha512 => "sha512",
            HashAlg::Sha3_224 => "sha3-224",
            HashAlg::Sha3_256 => "sha3-256",
            HashAlg::Sha3_384 => "sha3-384",
            HashAlg::Sha3_512 => "sha3-512",
            HashAlg::Ripemd160 => "ripemd160",
            HashAlg::Whirlpool => "whirlpool",
            HashAlg::Blake2b512 => "blake2b-512",
            HashAlg::Blake2s256 => "blake2s-256",
            HashAlg::Sm3 => "sm3",
        }
    }

    /// Output length in bytes.
    pub fn output_bytes(self) -> usize {
        match self {
            HashAlg::Sha1 | HashAlg::Ripemd160 => 20,
            HashAlg::Sha224 | HashAlg::Sha3_224 => 28,
            HashAlg::Sha256 | HashAlg::Sha3_256 | HashAlg::Blake2s256 | HashAlg::Sm3 => 32,
            HashAlg::Sha384 | HashAlg::Sha3_384 => 48,
            HashAlg::Sha512 | HashAlg::Sha3_512 | HashAlg::Whirlpool | HashAlg::Blake2b512 => 64,
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
            HashAlg::Sha3_224 => run::<Sha3_224>(parts),
            HashAlg::Sha3_256 => run::<Sha3_256>(parts),
            HashAlg::Sha3_384 => run::<Sha3_384>(parts),
            HashAlg::Sha3_512 => run::<Sha3_512>(parts),
            HashAlg::Ripemd160 => run::<Ripemd160>(parts),
            HashAlg::Whirlpool => run::<Whirlpool>(parts),
            HashAlg::Blake2b512 => run::<Blake2b512>(parts),
            HashAlg::Blake2s256 => run::<Blake2s256>(parts),
            HashAlg::Sm3 => run::<Sm3>(parts),
        }
    }

    /// PBKDF2-HMAC with this hash into `out`. The SHA-1 and SHA-2 family use `Hmac`, which
    /// keeps the padded key's state between iterations; the others `SimpleHmac`, which any
    /// hash with a block size supports (blake2's buffering rules out `Hmac`).
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
        use pbkdf2::pbkdf2 as run;
        match self {
            HashAlg::Sha1 => run::<Hmac<Sha1>>(password, salt, iterations, out),
            HashAlg::Sha224 => run::<Hmac<Sha224>>(password, salt, iterations, out),
            HashAlg::Sha256 => run::<Hmac<Sha256>>(password, salt, iterations, out),
            HashAlg::Sha384 => run::<Hmac<Sha384>>(password, salt, iterations, out),
            HashAlg::Sha512 => run::<Hmac<Sha512>>(password, salt, iterations, out),
            HashAlg::Sha3_224 => run::<SimpleHmac<Sha3_224>>(password, salt, iterations, out),
            HashAlg::Sha3_256 => run::<SimpleHmac<Sha3_256>>(password, salt, iterations, out),
            HashAlg::Sha3_384 => run::<SimpleHmac<Sha3_384>>(password, salt, iterations, out),
            HashAlg::Sha3_512 => run::<SimpleHmac<Sha3_512>>(password, salt, iterations, out),
            HashAlg::Ripemd160 => run::<SimpleHmac<Ripemd160>>(password, salt, iterations, out),
            HashAlg::Whirlpool => run::<SimpleHmac<Whirlpool>>(password, salt, iterations, out),
            HashAlg::Blake2b512 => run::<SimpleHmac<Blake2b512>>(password, salt, iterations, out),
            HashAlg::Blake2s256 => run::<SimpleHmac<Blake2s256>>(password, salt, iterations, out),
            HashAlg::Sm3 => run::<SimpleHmac<Sm3>>(password, salt, iterations, out),
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

/// Random bytes for wiping, where the kernel's generator is the slow part (it is several
/// times slower than AES with AES-NI): zeros encrypted with
/// aes-xts-plain64 under a fresh random 512-bit key, each 4 KiB sector under its own sector
/// number, none repeated in one stream. This is cryptsetup's "encrypted zero" wipe pattern.
/// For overwriting areas only: keys, salts and UUIDs come from [`random_fill`].
pub struct Noise {
    cipher: crate::sector::SectorCipher,
    /// The next sector number of the stream.
    sector: u64,
}

impl Noise {
    /// The bytes of one sector of the stream.
    const SECTOR_BYTES: usize = 4096;

    /// A stream under a fresh random key (zeroised when the stream is dropped).
    pub fn new() -> Result<Self> {
        use crate::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
        let spec: CipherSpec = "aes-xts-plain64".parse()?;
        let key = random_secret(64)?;
        let geometry = Geometry::new(SectorSize::new(Self::SECTOR_BYTES as u64)?);
        Ok(Noise {
            cipher: SectorCipher::new(spec, key.as_ref(), geometry)?,
            sector: 0,
        })
    }

    /// Fills `buf` with the stream's next bytes (a tail shorter than a sector takes the start
    /// of a whole one).
    pub fn fill(&mut self, buf: &mut [u8]) -> Result<()> {
        let whole = buf.len() / Self::SECTOR_BYTES * Self::SECTOR_BYTES;
        let (head, tail) = buf.split_at_mut(whole);
        head.fill(0);
        self.cipher.encrypt(self.sector, head)?;
        self.sector += (whole / Self::SECTOR_BYTES) as u64;
        if !tail.is_empty() {
            let mut last = [0u8; Self::SECTOR_BYTES];
            self.cipher.encrypt(self.sector, &mut last)?;
            self.sector += 1;
            tail.copy_from_slice(&last[..tail.len()]);
        }
        Ok(())
    }
}

impl std::fmt::Debug for Noise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Noise")
            .field("sector", &self.sector)
            .finish()
    }
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
    Ok(uuid_text(&b))
}

/// A UUID's 16 bytes in canonical lowercase text form (8-4-4-4-12 hex digits, bytes in order).
pub(crate) fn uuid_text(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
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
    fn noise_never_repeats_a_block_and_streams_differ() {
        // 1 MiB + 100 bytes in uneven fills: every 16-byte block distinct, none all zero, and
        // each byte value near its share (a stream that repeated or stuck would fail).
        let mut n = Noise::new().unwrap();
        let mut out = vec![0u8; (1 << 20) + 100];
        let mut at = 0;
        for len in [4096, 100, 12288, 1, 4095].iter().cycle() {
            let end = (at + len).min(out.len());
            n.fill(&mut out[at..end]).unwrap();
            at = end;
            if at == out.len() {
                break;
            }
        }
        let mut seen = std::collections::HashSet::new();
        for b in out.chunks_exact(16) {
            assert!(b.iter().any(|&x| x != 0), "an all-zero block");
            assert!(seen.insert(b.to_vec()), "a repeated block");
        }
        let mut count = [0usize; 256];
        out.iter().for_each(|&b| count[b as usize] += 1);
        let share = out.len() / 256;
        assert!(
            count
                .iter()
                .all(|&c| c > share * 9 / 10 && c < share * 11 / 10),
            "byte counts far from uniform: {count:?}"
        );
        let mut other = vec![0u8; 4096];
        Noise::new().unwrap().fill(&mut other).unwrap();
        assert_ne!(other, out[..4096], "two streams under two keys");
    }

    use crate::test_util::hex;

    /// The hashes beyond SHA-1/SHA-2, against another implementation: OpenSSL 3's (its
    /// `dgst` and PBKDF2, the legacy provider for whirlpool), for "abc" and for PBKDF2 of
    /// "passphrase" with the salt "salt-of-16-bytes", 1000 iterations, 32 bytes. Names
    /// round-trip, upper case is read, output lengths are what the digests give.
    #[test]
    fn other_hashes_match_openssl() {
        let rows: [(&str, &str, &str); 9] = [
            (
                "sha3-224",
                "e642824c3f8cf24ad09234ee7d3c766fc9a3a5168d0c94ad73b46fdf",
                "07e464937866071a4f0bb7df0c8d996fa74f3e6e5d4e18149e20383cd3f504af",
            ),
            (
                "sha3-256",
                "3a985da74fe225b2045c172d6bd390bd855f086e3e9d525b46bfe24511431532",
                "b9d7e689658529353585370bf0e4fd3ccae42b695756b74301ec3be2a72133c3",
            ),
            (
                "sha3-384",
                "ec01498288516fc926459f58e2c6ad8df9b473cb0fc08c2596da7cf0e49be4b298d88cea927ac7f5\
                 39f1edf228376d25",
                "ed6c86159e20e498b75ec1f63d908c39569ef11ed83d1b6cea513f57843c5cfe",
            ),
            (
                "sha3-512",
                "b751850b1a57168a5693cd924b6b096e08f621827444f70d884f5d0240d2712e10e116e9192af3c9\
                 1a7ec57647e3934057340b4cf408d5a56592f8274eec53f0",
                "9568a49b6609e52cc0237ada2b789a2217c898de1e2656b085f79d9061e07433",
            ),
            (
                "ripemd160",
                "8eb208f7e05d987a9b044a8e98c6b087f15a0bfc",
                "99cf998d66576efddd4eaa7000bc2fb1b314015373f0dfa55b64018fa790a772",
            ),
            (
                "whirlpool",
                "4e2448a4c6f486bb16b6562c73b4020bf3043e3a731bce721ae1b303d97e6d4c7181eebdb6c57e27\
                 7d0e34957114cbd6c797fc9d95d8b582d225292076d4eef5",
                "ea636e871017debd383c980207ffb25db9b93ceea2968ec7263cc93927ac7b89",
            ),
            (
                "blake2b-512",
                "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d17d87c5392aab792d\
                 c252d5de4533cc9518d38aa8dbf1925ab92386edd4009923",
                "e176c15aeac5e419a87d7d1193d4b067b6de94c9937e1fbd52db4ccc68245cea",
            ),
            (
                "blake2s-256",
                "508c5e8c327c14e2e1a72ba34eeb452f37458b209ed63a294d999b4c86675982",
                "e124e742a2491194f91fb95dad96e58832d078b07ca28fb8bf7333e94c7548a8",
            ),
            (
                "sm3",
                "66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0",
                "a9b5d3103e7543035a2c6b8b3302948d925b5cb7568aa31c86919710ba4a2a54",
            ),
        ];
        for (name, abc, kdf) in rows {
            let h = HashAlg::from_name(name).expect(name);
            assert_eq!(h.name(), name);
            assert_eq!(HashAlg::from_name(&name.to_ascii_uppercase()).ok(), Some(h));
            let d = h.digest(&[b"a", b"bc"]);
            assert_eq!(hex(&d), abc, "{name}");
            assert_eq!(d.len(), h.output_bytes(), "{name}");
            let mut out = [0u8; 32];
            h.pbkdf2(b"passphrase", b"salt-of-16-bytes", 1000, &mut out);
            assert_eq!(hex(&out), kdf, "{name} PBKDF2");
        }
        for h in HashAlg::ALL {
            assert_eq!(HashAlg::from_name(h.name()).ok(), Some(h));
            assert_eq!(h.digest(&[]).len(), h.output_bytes(), "{}", h.name());
        }
        for other in ["stribog512", "blake2b-256", "md5", ""] {
            let e = HashAlg::from_name(other).unwrap_err().to_string();
            assert!(e.contains("whirlpool") && e.contains(other), "{e}");
        }
    }

    #[test]
    fn uuid_shape() {
        let u = random_uuid().expect("rng");
        check_uuid(&u).expect("valid");
        assert!(check_uuid("not-a-uuid").is_err());
    }
}
