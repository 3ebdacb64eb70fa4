//! FileVault2 volumes: the `fvault2Dump` verb, and the mapping `open --type fvault2` (and
//! `export`, `mount`, `serve`, `ublk` with the same type) serves: the library reads the Core
//! Storage metadata and unwraps the volume key, and the data is built as `--type plain`
//! builds its own (AES-XTS-plain64 over the logical volume). The metadata is never written.
//!
//! cryptsetup's rules kept: the passphrase from `--key-file` (with `--keyfile-offset` and
//! `--keyfile-size`), else standard input or the terminal; `--volume-key-file` instead of a
//! passphrase; "Device X is not a valid FVAULT2 device." (exit 1) when the metadata does not
//! parse.

use std::path::{Path, PathBuf};

use clap::Args;
use ucrypt::fvault2;
use ucrypt::tcrypt::Mapping;
use ucrypt::SecretBytes;

use crate::error::{CliError, CliResult};
use crate::header_dev::open_header_file;
use crate::pass::{self, KeyFileArgs, Source};

/// `ucrypt fvault2Dump DEVICE` (cryptsetup's words and fields).
#[derive(Args, Debug, Clone)]
pub struct Fvault2DumpArgs {
    pub device: PathBuf,
    /// Print the volume key too (the passphrase is asked or read from --key-file).
    #[arg(long)]
    pub dump_volume_key: bool,
    /// With --dump-volume-key, also write the volume key to this file.
    #[arg(long)]
    pub volume_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub key: KeyFileArgs,
    #[arg(long, short = 'q')]
    pub batch_mode: bool,
    #[arg(long, short = 'v')]
    pub verbose: bool,
}

/// The metadata of the FileVault2 volume at `path`, or cryptsetup's refusal.
pub fn read_params(path: &Path) -> CliResult<fvault2::Params> {
    let dev = open_header_file(path, false)?;
    fvault2::read_params(dev.as_ref()).map_err(|e| match e {
        ucrypt::Error::UnsupportedFormat(why) => CliError::Usage(format!(
            "Device {} is not a valid FVAULT2 device. ({why})",
            path.display()
        )),
        other => other.into(),
    })
}

/// The volume key: from `volume_key_file` (its 32 bytes), else from the passphrase.
pub fn volume_key(
    params: &fvault2::Params,
    src: &Source<'_>,
    device: &str,
    volume_key_file: Option<&Path>,
) -> CliResult<SecretBytes> {
    if let Some(p) = volume_key_file {
        return Ok(crate::volume_key::read(p, fvault2::VOLUME_KEY_BYTES)?);
    }
    let pass = pass::read_passphrase(src, &format!("Enter passphrase for {device}: "), false)?;
    Ok(params.volume_key(pass.as_ref())?)
}

/// `ucrypt fvault2Dump`.
pub fn dump(a: &Fvault2DumpArgs) -> CliResult<i32> {
    ucrypt::secret::disable_core_dumps();
    let params = read_params(&a.device)?;
    let name = a.device.display().to_string();
    if !a.dump_volume_key {
        print!("{}", params.dump(&name));
        return Ok(0);
    }
    pass::confirm(
        a.batch_mode,
        "The header dump with volume key is sensitive information\nthat allows access to \
         encrypted partition without a passphrase.\nThis dump should be stored encrypted in \
         a safe place.",
    )?;
    let key = volume_key(&params, &a.key.source(), &name, None)?;
    if let Some(p) = &a.volume_key_file {
        std::fs::write(p, key.as_ref())
            .map_err(|e| ucrypt::Error::io(format!("Cannot write {}", p.display()), e))?;
    }
    print!("{}", params.dump_volume_key(&name, &key));
    Ok(0)
}

/// `open`/`export --type fvault2`: the metadata of `path` read, the key unwrapped with the
/// passphrase of `src` (or taken from `volume_key_file`), and the data's mapping.
pub fn mapping(
    path: &Path,
    src: &Source<'_>,
    volume_key_file: Option<&Path>,
) -> CliResult<Mapping> {
    let params = read_params(path)?;
    let key = volume_key(&params, src, &path.display().to_string(), volume_key_file)?;
    Ok(params.mapping(key)?)
}

/// `open --type fvault2 --test-passphrase`: the key unwraps with the passphrase; nothing is
/// served.
pub fn test_passphrase(v: &crate::volume_args::VolumeArgs) -> i32 {
    ucrypt::secret::disable_core_dumps();
    let r = match &v.volume {
        crate::target::Target::Path(p) => {
            let src = Source {
                key_file: v.key_file(),
                offset: v.keyfile_offset.unwrap_or(0),
                size: v.keyfile_size,
            };
            mapping(p, &src, v.volume_key_file.as_deref()).map(|_| ())
        }
        other => Err(CliError::Usage(format!(
            "{other}: FVAULT2 volumes are opened from local files or devices"
        ))),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{}", e.message());
            e.exit_code()
        }
    }
}
