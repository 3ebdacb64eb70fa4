//! The foreign formats ucrypt reads (TrueCrypt/VeraCrypt for now): the `tcryptDump` verb, and
//! opening one as a raw dm-crypt mapping (`open --type tcrypt`, `export --type tcrypt`): the
//! library decrypts the header and says which cipher, key, offset and size the data has, and
//! the volume is built as `--type plain` builds its own.
//!
//! cryptsetup's rules kept: the passphrase is read from standard input or the terminal, and
//! every `--key-file` is a TrueCrypt keyfile (its first MiB mixed into the keyfile pool), not
//! the passphrase; VeraCrypt headers are tried unless `--disable-veracrypt`.

use std::io::Read;
use std::path::{Path, PathBuf};

use clap::Args;
use ucrypt::backend::Backend;
use ucrypt::tcrypt;
use ucrypt::SecretBytes;

use crate::error::{CliError, CliResult};
use crate::header_dev::open_header_file;
use crate::pass::{self, Source};

/// cryptsetup's TCRYPT options, shared by `tcryptDump` and `open`/`export --type tcrypt`.
#[derive(Args, Debug, Clone, Default)]
pub struct TcryptArgs {
    /// TCRYPT: VeraCrypt's PIM (personal iterations multiplier).
    #[arg(long, value_name = "PIM")]
    pub veracrypt_pim: Option<u32>,
    /// TCRYPT: ask for the VeraCrypt PIM after the passphrase.
    #[arg(long)]
    pub veracrypt_query_pim: bool,
    /// TCRYPT: try TrueCrypt headers only.
    #[arg(long)]
    pub disable_veracrypt: bool,
    /// TCRYPT: accepted for compatibility (VeraCrypt headers are tried by default).
    #[arg(long)]
    pub veracrypt: bool,
    /// TCRYPT: the hidden volume's header.
    #[arg(long)]
    pub tcrypt_hidden: bool,
    /// TCRYPT: the system volume's header (sector 62 of the drive image).
    #[arg(long)]
    pub tcrypt_system: bool,
    /// TCRYPT: the backup header (at the end of the volume).
    #[arg(long)]
    pub tcrypt_backup: bool,
    /// TCRYPT: one more keyfile, as another --key-file is (may repeat).
    #[arg(long = "tcrypt-keyfile", value_name = "FILE")]
    pub tcrypt_keyfiles: Vec<PathBuf>,
}

/// `ucrypt tcryptDump DEVICE` (cryptsetup's words and fields).
#[derive(Args, Debug, Clone)]
pub struct TcryptDumpArgs {
    pub device: PathBuf,
    /// Only KDFs whose hash name contains this (cryptsetup's -h).
    #[arg(long, short = 'h')]
    pub hash: Option<String>,
    #[command(flatten)]
    pub t: TcryptArgs,
    /// A TrueCrypt keyfile (repeat for more).
    #[arg(long = "key-file", short = 'd', value_name = "FILE")]
    pub key_files: Vec<PathBuf>,
    /// Only cipher chains whose name contains this (cryptsetup's -c).
    #[arg(long, short = 'c')]
    pub cipher: Option<String>,
    /// The header is in this file (the data in DEVICE).
    #[arg(long)]
    pub header: Option<PathBuf>,
    /// Print the volume key too.
    #[arg(long)]
    pub dump_volume_key: bool,
    #[arg(long, short = 'q')]
    pub batch_mode: bool,
    #[arg(long, short = 'v')]
    pub verbose: bool,
}

/// Reads each keyfile's first MiB (the part TrueCrypt's pool uses).
fn read_keyfiles<'a>(paths: impl Iterator<Item = &'a Path>) -> CliResult<Vec<SecretBytes>> {
    let mut out = Vec::new();
    for p in paths {
        let f = std::fs::File::open(p).map_err(|e| {
            ucrypt::Error::io(format!("Failed to open key file {}", p.display()), e)
        })?;
        let mut data = Vec::new();
        f.take(tcrypt::KEYFILE_BYTES_MAX as u64)
            .read_to_end(&mut data)
            .map_err(|e| ucrypt::Error::io(format!("Error reading keyfile {}", p.display()), e))?;
        out.push(SecretBytes::from_vec(data));
    }
    Ok(out)
}

impl TcryptArgs {
    fn options(&self, hash: Option<&str>, cipher: Option<&str>) -> CliResult<tcrypt::Options> {
        if self.veracrypt_pim == Some(0) {
            return Err(CliError::Usage("Invalid PIM value: 0.".into()));
        }
        Ok(tcrypt::Options {
            veracrypt: !self.disable_veracrypt,
            pim: self.veracrypt_pim,
            hidden: self.tcrypt_hidden,
            system: self.tcrypt_system,
            backup: self.tcrypt_backup,
            hash: hash.map(str::to_string),
            cipher: cipher.map(str::to_string),
        })
    }

    /// The passphrase (a line of standard input, or asked on the terminal), then the PIM if
    /// `--veracrypt-query-pim`.
    fn read_secrets(&self, device: &str) -> CliResult<(SecretBytes, Option<u32>)> {
        let src = Source {
            key_file: None,
            offset: 0,
            size: None,
        };
        let p = pass::read_passphrase(&src, &format!("Enter passphrase for {device}: "), false)?;
        if !self.veracrypt_query_pim {
            return Ok((p, self.veracrypt_pim));
        }
        let pim = pass::read_passphrase(&src, "Enter VeraCrypt PIM: ", false)?;
        let text = std::str::from_utf8(pim.as_ref()).unwrap_or("");
        match text.parse::<u64>() {
            Ok(0) => Err(CliError::Usage("Invalid PIM value: 0.".into())),
            Ok(n) => u32::try_from(n)
                .map(|n| (p, Some(n)))
                .map_err(|_| CliError::Usage("Invalid PIM value: outside of range.".into())),
            Err(_) => Err(CliError::Usage("Invalid PIM value: parse error.".into())),
        }
    }
}

/// Reads and decrypts the header of `hdr_path` with the passphrase and keyfiles.
fn unlock_tcrypt(
    hdr_path: &Path,
    t: &TcryptArgs,
    keyfiles: &[SecretBytes],
    hash: Option<&str>,
    cipher: Option<&str>,
) -> CliResult<(tcrypt::Header, u64)> {
    let dev = open_header_file(hdr_path, false)?;
    let (pass, pim) = t.read_secrets(&hdr_path.display().to_string())?;
    let mut opts = t.options(hash, cipher)?;
    opts.pim = pim;
    let hdr = tcrypt::unlock(dev.as_ref(), pass.as_ref(), keyfiles, &opts)?;
    Ok((hdr, dev.size()))
}

/// `ucrypt tcryptDump`.
pub fn tcrypt_dump(a: &TcryptDumpArgs) -> CliResult<i32> {
    ucrypt::secret::disable_core_dumps();
    let keyfiles = read_keyfiles(a.key_files.iter().map(PathBuf::as_path))?;
    let hdr_path = a.header.as_deref().unwrap_or(&a.device);
    let (hdr, size) = unlock_tcrypt(
        hdr_path,
        &a.t,
        &keyfiles,
        a.hash.as_deref(),
        a.cipher.as_deref(),
    )?;
    let name = a.device.display().to_string();
    if a.dump_volume_key {
        pass::confirm(
            a.batch_mode,
            "Header dump with volume key is sensitive information\nwhich allows access to \
             encrypted partition without passphrase.\nThis dump should be always stored \
             encrypted on safe place.",
        )?;
        print!("{}", hdr.dump_volume_key(&name, size));
    } else {
        print!("{}", hdr.dump(&name));
    }
    Ok(0)
}

/// `open`/`export`/`mount`/`serve --type tcrypt`: the header of `hdr_path` (the volume, or its
/// `--header`) decrypted with the passphrase and the keyfiles (every `--key-file`, then
/// `--tcrypt-keyfile`), and the raw mapping of the volume it gives.
pub fn tcrypt_mapping(
    hdr_path: &Path,
    t: &TcryptArgs,
    key_files: &[String],
    hash: Option<&str>,
    cipher: Option<&str>,
) -> CliResult<tcrypt::Mapping> {
    let files = key_files
        .iter()
        .map(Path::new)
        .chain(t.tcrypt_keyfiles.iter().map(PathBuf::as_path));
    let keyfiles = read_keyfiles(files)?;
    let (hdr, hdr_size) = unlock_tcrypt(hdr_path, t, &keyfiles, hash, cipher)?;
    Ok(hdr.mapping(hdr_size)?)
}
