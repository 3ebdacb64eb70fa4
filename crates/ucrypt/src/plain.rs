//! cryptsetup's plain mode: a volume without a header whose key is made from a passphrase by
//! one unsalted hash (`man cryptsetup`, "Passphrase processing for PLAIN mode"). The data
//! path is the same as any raw mapping's ([`crate::volume::Volume`]); this module only turns
//! what the user typed into the key.
//!
//! The hash spec is cryptsetup's `--hash`: a hash name (`ripemd160`, cryptsetup 2.6's
//! default, [`DEFAULT_HASH`]), `plain` (the passphrase is the key: truncated, or zero-padded
//! when shorter), or `NAME:LEN`, where only the first LEN bytes of the key come from the
//! hash and the rest are zeros. A key longer than the digest is filled by hashing again with
//! one more `A` in front of the passphrase each round, as cryptsetup (after hashalot) does.

use zeroize::Zeroize;

use crate::luks::HashAlg;
use crate::{Error, Result, SecretBytes};

/// cryptsetup 2.6's plain-mode defaults (`cryptsetup --help`): later releases changed the
/// hash to sha256 and the cipher to aes-xts-plain64 with a 512-bit key; a volume made with
/// those is opened by naming them.
pub const DEFAULT_HASH: &str = "ripemd160";
/// See [`DEFAULT_HASH`].
pub const DEFAULT_CIPHER: &str = "aes-cbc-essiv:sha256";
/// See [`DEFAULT_HASH`].
pub const DEFAULT_KEY_BITS: u32 = 256;

/// The longest hash spec accepted (cryptsetup's limit too).
const HASH_SPEC_BYTES_MAX: usize = 255;

/// The key of `key_bytes` bytes that plain mode makes from `passphrase` with `hash_spec`.
pub fn key_from_passphrase(
    hash_spec: &str,
    key_bytes: usize,
    passphrase: &[u8],
) -> Result<SecretBytes> {
    if key_bytes == 0 {
        return Err(Error::InvalidArgument("plain mode needs a key size".into()));
    }
    if hash_spec.len() > HASH_SPEC_BYTES_MAX {
        return Err(Error::InvalidArgument(format!(
            "hash specification longer than {HASH_SPEC_BYTES_MAX} bytes"
        )));
    }
    let (name, hashed) = match hash_spec.split_once(':') {
        Some((name, len)) => {
            let n: usize = len.parse().map_err(|_| {
                Error::InvalidArgument(format!(
                    "Key processing error (using hash {hash_spec}): '{len}' is no length."
                ))
            })?;
            if n > key_bytes {
                return Err(Error::InvalidArgument(format!(
                    "Key processing error (using hash {hash_spec}): {n} bytes is longer than \
                     the {key_bytes}-byte key."
                )));
            }
            (name, n)
        }
        None => (hash_spec, key_bytes),
    };
    let mut key = SecretBytes::zeroed(key_bytes);
    if name == "plain" {
        let n = hashed.min(passphrase.len());
        key.as_mut()[..n].copy_from_slice(&passphrase[..n]);
        return Ok(key);
    }
    let alg = HashAlg::from_name(name)
        .map_err(|_| Error::InvalidArgument(format!("Hash algorithm {name} not supported.")))?;
    let mut filled = 0;
    let mut round = 0usize;
    let prefix = vec![b'A'; hashed.div_ceil(alg.output_bytes().max(1))];
    while filled < hashed {
        let mut d = alg.digest(&[&prefix[..round], passphrase]);
        let n = d.len().min(hashed - filled);
        key.as_mut()[filled..filled + n].copy_from_slice(&d[..n]);
        d.zeroize();
        filled += n;
        round += 1;
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_util::hex;

    #[test]
    fn one_round_is_the_digest_truncated() {
        // sha256("abc"), a published vector.
        let k = key_from_passphrase("sha256", 16, b"abc").unwrap();
        assert_eq!(hex(k.as_ref()), "ba7816bf8f01cfea414140de5dae2223");
    }

    #[test]
    fn longer_keys_hash_again_with_one_more_a() {
        let k = key_from_passphrase("sha256", 40, b"abc").unwrap();
        let first = HashAlg::from_name("sha256").unwrap().digest(&[b"abc"]);
        let second = HashAlg::from_name("sha256")
            .unwrap()
            .digest(&[b"A", b"abc"]);
        assert_eq!(&k.as_ref()[..32], &first[..]);
        assert_eq!(&k.as_ref()[32..], &second[..8]);
    }

    #[test]
    fn length_suffix_zero_pads_and_plain_copies() {
        let k = key_from_passphrase("sha256:8", 16, b"abc").unwrap();
        assert_eq!(hex(k.as_ref()), "ba7816bf8f01cfea0000000000000000");
        let k = key_from_passphrase("plain", 6, b"abc").unwrap();
        assert_eq!(k.as_ref(), b"abc\0\0\0");
        let k = key_from_passphrase("plain", 2, b"abc").unwrap();
        assert_eq!(k.as_ref(), b"ab");
        assert!(key_from_passphrase("sha256:40", 32, b"abc").is_err());
        assert!(key_from_passphrase("sha256:x", 32, b"abc").is_err());
        assert!(key_from_passphrase("nohash", 32, b"abc").is_err());
        assert!(key_from_passphrase("sha256", 0, b"abc").is_err());
    }
}
