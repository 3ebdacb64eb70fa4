//! `--keyslot-cipher` and `--keyslot-key-size`: a new keyslot's area encryption, parsed from
//! the command line and checked against the header it goes into
//! (`ucrypt::luks::luks2::Luks2Header::keyslot_area`).

use ucrypt::luks::luks2::KeyslotArea;
use ucrypt::luks::Header;
use ucrypt::sector::CipherSpec;
use ucrypt::{Error, Result};

use super::LuksOpts;

/// `--keyslot-key-size`: bits, a multiple of 8 and not 0 (cryptsetup's checks, made before
/// anything runs).
pub(super) fn keyslot_key_bits(v: &str) -> std::result::Result<u32, String> {
    match v.parse::<u32>() {
        Ok(0) | Err(_) => Err(format!("Bad number: {v}")),
        Ok(b) if b % 8 != 0 => Err("Key size must be a multiple of 8 bits".into()),
        Ok(b) => Ok(b),
    }
}

/// `--keyslot-cipher` and `--keyslot-key-size`: the cipher and its key size in bytes (clap
/// requires both or neither).
pub(super) fn request(o: &LuksOpts) -> Result<Option<(CipherSpec, usize)>> {
    match (&o.keyslot_cipher, o.keyslot_key_size) {
        (Some(c), Some(bits)) => Ok(Some((c.parse()?, bits as usize / 8))),
        _ => Ok(None),
    }
}

/// The new keyslot's area encryption the options ask for on `hdr`, checked against it: only
/// LUKS2 takes one, as in cryptsetup (asked before any passphrase).
pub(super) fn for_header(o: &LuksOpts, hdr: &Header) -> Result<Option<KeyslotArea>> {
    let Some((cipher, bytes)) = request(o)? else {
        return Ok(None);
    };
    match hdr {
        Header::Luks2(h) => Ok(Some(h.keyslot_area(cipher, bytes)?)),
        Header::Luks1(_) => Err(Error::InvalidArgument(
            "Keyslot encryption parameters can be set only for LUKS2 device.".into(),
        )),
    }
}
