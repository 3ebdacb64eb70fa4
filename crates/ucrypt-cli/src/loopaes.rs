//! loop-AES volumes: `open --type loopaes` (and `export`, `mount`, `serve`, `ublk` with the
//! same type). A loop-AES volume has no header: the key file (`--key-file`, required; `-`
//! for standard input, where a GPG-encrypted key file is piped after `gpg --decrypt`) gives
//! the keys, `--key-size` their size (default 128 bits), `--hash` how its lines are hashed,
//! `--offset` the data start and `--skip` the IV offset (by default the offset, as cryptsetup
//! sets it), both in 512-byte sectors. `--cipher` other than aes is refused.

use ucrypt::loopaes::{self, KeyFile};
use ucrypt::tcrypt::Mapping;

use crate::error::{CliError, CliResult};
use crate::pass;
use crate::volume_args::VolumeArgs;

/// The mapping of the loop-AES volume `v` names.
pub fn mapping(v: &VolumeArgs) -> CliResult<Mapping> {
    let Some(key_file) = v.key_file() else {
        return Err(CliError::Usage("Option --key-file is required.".into()));
    };
    if let Some(c) = v.cipher.as_deref().filter(|c| *c != "aes") {
        return Err(CliError::Usage(format!(
            "--type loopaes: cipher {c} is not supported by ucrypt (loop-AES volumes are aes)"
        )));
    }
    let bits = v.key_size.unwrap_or(loopaes::DEFAULT_KEY_BITS);
    if bits % 8 != 0 {
        return Err(CliError::Usage(format!(
            "key size {bits} bits is not a multiple of 8"
        )));
    }
    let buf = pass::read_key_file(key_file, v.keyfile_offset.unwrap_or(0), v.keyfile_size)?;
    let kf = KeyFile::parse(buf.as_ref()).map_err(|e| CliError::Usage(e.to_string()))?;
    let key = kf
        .volume_key(bits as usize / 8, v.hash.as_deref())
        .map_err(|e| CliError::Usage(e.to_string()))?;
    Ok(kf.mapping(key, v.offset, v.skip.unwrap_or(v.offset))?)
}

/// `open --type loopaes --test-passphrase`: refused as cryptsetup refuses it (a loop-AES
/// volume has nothing to check a key against), exit 1.
pub fn test_passphrase_refused() -> i32 {
    eprintln!(
        "Option --test-passphrase is allowed only for open of LUKS, TCRYPT, BITLK and FVAULT2 \
         devices."
    );
    1
}
