//! BitLocker (cryptsetup's BITLK): the `bitlkDump` verb, and opening a volume
//! (`open --type bitlk`, `bitlkOpen`, `export --type bitlk`) with a passphrase, a recovery
//! passphrase or a startup key (`--key-file X.BEK`: the file's bytes are the secret, as
//! cryptsetup takes them). The library reads the metadata, unlocks the volume key and serves
//! the segments cryptsetup maps; this file prints and asks.
//!
//! Writes: cryptsetup maps BitLocker read-write unless `--readonly`; so does ucrypt (the
//! metadata areas are dm-zero segments there and here: writes to them are dropped, the
//! metadata is never changed).

use std::path::PathBuf;

use clap::Args;
use ucrypt::backend::{Backend, DirectMode, FileBackend};
use ucrypt::bitlk::{self, Metadata};
use ucrypt::SecretBytes;

use crate::error::{CliError, CliResult};
use crate::pass::{self, Source};

/// `ucrypt bitlkDump DEVICE`.
#[derive(Args, Debug, Clone)]
pub struct BitlkDumpArgs {
    pub device: PathBuf,
    /// Print the volume key too (asks for the passphrase, recovery passphrase or startup key).
    #[arg(long)]
    pub dump_volume_key: bool,
    /// Write the volume key to this file instead of printing it (with --dump-volume-key).
    #[arg(long, value_name = "FILE")]
    pub volume_key_file: Option<PathBuf>,
    /// The passphrase, recovery passphrase or `.BEK` startup key is in this file.
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<String>,
    #[arg(long, short = 'q')]
    pub batch_mode: bool,
    #[arg(long, short = 'v')]
    pub verbose: bool,
}

/// The metadata of the BitLocker volume at `path`.
pub fn read_metadata(path: &std::path::Path) -> CliResult<Metadata> {
    let dev = FileBackend::open(path, false, DirectMode::Never)?;
    bitlk::read_metadata(&dev).map_err(|e| not_bitlk(e, path))
}

/// cryptsetup's message when the metadata does not read (exit 1), with the check that
/// failed; a refusal keeps cryptsetup's words.
fn not_bitlk(e: ucrypt::Error, path: &std::path::Path) -> CliError {
    match e {
        ucrypt::Error::BadHeader { check, detail } => CliError::Usage(format!(
            "Device {} is not a valid BITLK device. (check '{check}': {detail})",
            path.display()
        )),
        e => CliError::from(e),
    }
}

/// The secret from `--key-file` (its bytes, whole) or standard input / the terminal.
pub fn read_secret(key_file: Option<&str>) -> CliResult<SecretBytes> {
    Ok(pass::read_passphrase(
        &Source {
            key_file,
            offset: 0,
            size: None,
        },
        "Enter passphrase: ",
        false,
    )?)
}

/// The volume key of `meta` from the secret.
pub fn unlock(meta: &Metadata, key_file: Option<&str>) -> CliResult<SecretBytes> {
    meta.check_activation().map_err(ucrypt::Error::from)?;
    let secret = read_secret(key_file)?;
    Ok(bitlk::unlock(meta, secret.as_ref()).map_err(ucrypt::Error::from)?)
}

pub fn bitlk_dump(a: &BitlkDumpArgs) -> CliResult<i32> {
    ucrypt::secret::disable_core_dumps();
    let meta = read_metadata(&a.device)?;
    let name = a.device.display().to_string();
    if !a.dump_volume_key {
        print!("{}", dump(&meta, &name));
        return Ok(0);
    }
    pass::confirm(
        a.batch_mode,
        "The header dump with volume key is sensitive information\nthat allows access to \
         encrypted partition without a passphrase.\nThis dump should be stored encrypted in a \
         safe place.",
    )?;
    let secret = read_secret(a.key_file.as_deref())?;
    let vk = bitlk::unlock(&meta, secret.as_ref()).map_err(ucrypt::Error::from)?;
    if let Some(f) = &a.volume_key_file {
        std::fs::write(f, vk.as_ref()).map_err(|e| {
            ucrypt::Error::io(format!("Cannot write volume key file {}", f.display()), e)
        })?;
    }
    print!(
        "{}",
        dump_volume_key(&meta, &name, vk.as_ref(), a.volume_key_file.as_ref())
    );
    Ok(0)
}

/// `bitlkDump --dump-volume-key`, as cryptsetup prints it.
fn dump_volume_key(meta: &Metadata, name: &str, vk: &[u8], file: Option<&PathBuf>) -> String {
    let mut o = format!("BITLK header information for {name}\n");
    o += "Cipher name:   \taes\n";
    o += &format!("Cipher mode:   \t{}\n", meta.encryption.mode_name());
    o += &format!("UUID:          \t{}\n", meta.guid);
    o += &format!("MK bits:       \t{}\n", vk.len() * 8);
    if let Some(f) = file {
        o += &format!("Key stored to file {}.\n", f.display());
        return o;
    }
    o += "MK dump:\t";
    for (i, b) in vk.iter().enumerate() {
        if i > 0 && i % 16 == 0 {
            o += "\n\t\t";
        }
        o += &format!("{b:02x} ");
    }
    o += "\n";
    o
}

/// `bitlkDump`, field for field as cryptsetup 2.6 prints it (the creation time in UTC).
pub fn dump(m: &Metadata, name: &str) -> String {
    let mut o = format!(
        "Info for BITLK{} device {name}.\n",
        if m.togo { " To Go" } else { "" }
    );
    o += &format!("Version:      \t{}\n", m.version);
    o += &format!("GUID:         \t{}\n", m.guid);
    o += &format!("Sector size:  \t{} [bytes]\n", m.sector_size.bytes());
    o += &format!("Volume size:  \t{} [bytes]\n", m.volume_size_bytes);
    o += &format!("Created:      \t{}\n", ctime_utc(m.creation_time));
    o += &format!(
        "Description:  \t{}\n",
        m.description.as_deref().unwrap_or("(null)")
    );
    o += "Cipher name:  \taes\n";
    o += &format!("Cipher mode:  \t{}\n", m.encryption.mode_name());
    o += &format!("Cipher key:   \t{} bits\n", m.encryption.key_bits());
    o += "\nKeyslots:\n";
    for (i, v) in m.vmks.iter().enumerate() {
        o += &format!(" {i}: VMK\n");
        if let Some(n) = &v.name {
            o += &format!("\tName:       \t{n}\n");
        }
        o += &format!("\tGUID:       \t{}\n", v.guid);
        o += &format!("\tProtection: \t{}\n", v.protection.describe());
        o += "\tSalt:       \t";
        for b in v.salt {
            o += &format!("{b:02x}");
        }
        o += "\n";
        for k in &v.keys {
            o += &format!("\tKey data size:\t{} [bytes]\n", k.ciphertext.len());
        }
    }
    o += &format!(" {}: FVEK\n", m.vmks.len());
    o += &format!("\tKey data size:\t{} [bytes]\n", m.fvek.ciphertext.len());
    o += "\nMetadata segments:\n";
    for (i, off) in m.metadata_offsets.iter().enumerate() {
        o += &format!(" {i}: FVE metadata area\n");
        o += &format!("\tOffset: \t{off} [bytes]\n");
        o += &format!("\tSize:   \t{} [bytes]\n", bitlk::FVE_METADATA_AREA_BYTES);
    }
    o += " 3: Volume header\n";
    o += &format!("\tOffset: \t{} [bytes]\n", m.volume_header_offset);
    o += &format!("\tSize:   \t{} [bytes]\n", m.volume_header_bytes);
    o += &format!("\tCipher: \taes-{}\n", m.encryption.mode_name());
    o
}

/// C's `ctime` in UTC, without its newline: "Thu Jan  1 00:00:00 1970".
fn ctime_utc(t: i64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let days = t.div_euclid(86_400);
    let secs = t.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{} {} {:2} {:02}:{:02}:{:02} {}",
        DAYS[days.rem_euclid(7) as usize],
        MONTHS[(month - 1) as usize],
        day,
        secs / 3600,
        secs % 3600 / 60,
        secs % 60,
        year
    )
}

/// `open --type bitlk` (and `bitlkOpen`): the library request for the volume at `path`.
pub fn open_request(
    path: &std::path::Path,
    backend: std::sync::Arc<dyn Backend>,
    key_file: Option<&str>,
    volume_key: Option<SecretBytes>,
) -> CliResult<ucrypt::open::OpenRequest> {
    let meta = read_metadata(path)?;
    let unlock = match volume_key {
        Some(k) => ucrypt::luks::Unlock::VolumeKey(k),
        None => {
            meta.check_activation().map_err(ucrypt::Error::from)?;
            ucrypt::luks::Unlock::Passphrase(read_secret(key_file)?)
        }
    };
    let mut b = ucrypt::open::Bitlk::new(unlock);
    b.metadata = Some(Box::new(meta));
    Ok(ucrypt::open::OpenRequest::new(
        backend,
        ucrypt::open::Format::Bitlk(b),
    ))
}

/// `open --type bitlk --test-passphrase`: the volume could be activated and the secret gives
/// its volume key; nothing is served.
pub fn test_passphrase(v: &crate::volume_args::VolumeArgs) -> CliResult<()> {
    ucrypt::secret::disable_core_dumps();
    let crate::target::Target::Path(path) = &v.volume else {
        return Err(CliError::Usage(format!(
            "{}: BITLK volumes are opened from local files or devices",
            v.volume
        )));
    };
    let meta = read_metadata(path)?;
    unlock(&meta, v.key_file()).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::ctime_utc;

    #[test]
    fn ctime_rows() {
        for (t, s) in [
            (0, "Thu Jan  1 00:00:00 1970"),
            (951_782_400, "Tue Feb 29 00:00:00 2000"),
            (1_574_412_360, "Fri Nov 22 08:46:00 2019"),
        ] {
            assert_eq!(ctime_utc(t), s);
        }
    }
}
