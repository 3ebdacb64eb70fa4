//! LUKS verbs: lowercase names with cryptsetup's spellings as aliases, so a cryptsetup script
//! runs with `s/cryptsetup/ucrypt/`. All header logic is in `ucrypt::luks` (sans I/O); this
//! module reads and writes the files and talks to the user.
//!
//! Exit codes follow cryptsetup(8): 1 wrong parameters, 2 no permission / bad passphrase,
//! 3 out of memory, 4 wrong device, 5 device busy.

mod convert;
mod data;
mod keyslot_area;
mod progress_json;
pub(crate) mod reencrypt;

use std::path::PathBuf;

use clap::{Args, Subcommand};
use ucrypt::format::{
    FormatPlan, FormatRequest, Integrity, IntegrityKind, IntegrityWipe, LuksVersion,
};
use ucrypt::luks::{
    self, HashAlg, Header, KdfRequest, KeyUse, NewKeyslot, Unlock, VolumeKey, WriteOp,
};
use ucrypt::sector::SectorSize;
use ucrypt::{Error, Result};

use crate::error::{CliError, CliResult};
use crate::open::VolumeArgs;
use crate::target::{RemoteArgs, Target};
use crate::token::TokenOutcome;

use crate::header_dev::{self as dev, HeaderDev};
use crate::pass::{self, Source};

/// Options every LUKS verb accepts (cryptsetup accepts any option with any action).
#[derive(Args, Debug, Clone, Default)]
pub struct LuksOpts {
    /// LUKS version: luks2 (default) or luks1 (also accepts "luks").
    #[arg(long = "type", short = 'M')]
    pub luks_type: Option<String>,
    /// Cipher spec, e.g. aes-xts-plain64, serpent-xts-plain64, twofish-cbc-essiv:sha256,
    /// xchacha12,aes-adiantum-plain64.
    #[arg(long, short = 'c')]
    pub cipher: Option<String>,
    /// Volume key size in bits.
    #[arg(long, short = 's')]
    pub key_size: Option<u32>,
    /// Encryption sector size in bytes (LUKS2).
    #[arg(long)]
    pub sector_size: Option<u64>,
    /// Hash for PBKDF2, AF diffusion and the volume key digest: sha256 (the default), sha1,
    /// sha224, sha384, sha512, sha3-224/256/384/512, ripemd160, whirlpool, blake2b-512,
    /// blake2s-256 or sm3.
    #[arg(long, short = 'h')]
    pub hash: Option<String>,
    /// pbkdf2, argon2i or argon2id.
    #[arg(long)]
    pub pbkdf: Option<String>,
    /// PBKDF target time in milliseconds.
    #[arg(long, short = 'i')]
    pub iter_time: Option<u32>,
    /// Argon2 memory cost in KiB.
    #[arg(long)]
    pub pbkdf_memory: Option<u32>,
    /// Argon2 threads.
    #[arg(long)]
    pub pbkdf_parallel: Option<u32>,
    /// Fixed PBKDF2 iterations / Argon2 time cost instead of calibration.
    #[arg(long)]
    pub pbkdf_force_iterations: Option<u32>,
    #[arg(long)]
    pub label: Option<String>,
    #[arg(long)]
    pub subsystem: Option<String>,
    #[arg(long)]
    pub uuid: Option<String>,
    /// Detached header file.
    #[arg(long)]
    pub header: Option<PathBuf>,
    /// Data offset in 512-byte sectors.
    #[arg(long, short = 'o', conflicts_with = "align_payload")]
    pub offset: Option<u64>,
    /// format: align the data offset to this many 512-byte sectors (with a detached
    /// --header: the data offset itself), as cryptsetup's option does.
    #[arg(long, value_name = "SECTORS")]
    pub align_payload: Option<u64>,
    #[command(flatten)]
    pub key: pass::KeyFileArgs,
    #[arg(long)]
    pub new_keyfile_offset: Option<u64>,
    #[arg(long)]
    pub new_keyfile_size: Option<u64>,
    #[arg(long, short = 'S')]
    pub key_slot: Option<u32>,
    /// LUKS2 format, add-key, change-key, convert-key, reencrypt --encrypt: encrypt the new
    /// keyslot's area with this cipher (with --keyslot-key-size) instead of the data
    /// segment's. A reencryption's new keyslots take the old keyslots' encryption, as in
    /// cryptsetup, which ignores the option there.
    #[arg(long, value_name = "CIPHER", requires = "keyslot_key_size")]
    pub keyslot_cipher: Option<String>,
    /// The --keyslot-cipher's key size in bits.
    #[arg(
        long,
        value_name = "BITS",
        requires = "keyslot_cipher",
        value_parser = keyslot_area::keyslot_key_bits
    )]
    pub keyslot_key_size: Option<u32>,
    #[arg(long)]
    pub new_key_slot: Option<u32>,
    /// Do not ask for confirmation.
    #[arg(long, short = 'q')]
    pub batch_mode: bool,
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// luksDump: print the volume key (asks for confirmation unless --batch-mode).
    #[arg(long, alias = "dump-master-key")]
    pub dump_volume_key: bool,
    /// luksDump: print the LUKS2 metadata as JSON.
    #[arg(long)]
    pub dump_json_metadata: bool,
    /// Read (format, add-key) or write (dump) the volume key from/to this file.
    #[arg(long, alias = "master-key-file")]
    pub volume_key_file: Option<PathBuf>,
    #[arg(long)]
    pub header_backup_file: Option<PathBuf>,
    /// open: only check the passphrase.
    #[arg(long)]
    pub test_passphrase: bool,
    /// A key no data segment uses (LUKS2): add-key --unbound (with --key-size) adds one;
    /// open --test-passphrase --unbound tries the unbound keyslots too; dump --unbound
    /// --key-slot N prints (or, with --volume-key-file, saves) keyslot N's unbound key.
    #[arg(long)]
    pub unbound: bool,
    /// Store the given activation flags in the header.
    #[arg(long)]
    pub persistent: bool,
    #[arg(long)]
    pub allow_discards: bool,
    #[arg(long = "perf-same_cpu_crypt")]
    pub perf_same_cpu_crypt: bool,
    #[arg(long = "perf-submit_from_crypt_cpus")]
    pub perf_submit_from_crypt_cpus: bool,
    #[arg(long = "perf-no_read_workqueue")]
    pub perf_no_read_workqueue: bool,
    #[arg(long = "perf-no_write_workqueue")]
    pub perf_no_write_workqueue: bool,
    #[arg(long = "perf-high_priority")]
    pub perf_high_priority: bool,
    /// Keyslot priority: prefer, normal or ignore (config).
    #[arg(long)]
    pub priority: Option<String>,
    /// LUKS2 header copy size in bytes.
    #[arg(long)]
    pub luks2_metadata_size: Option<u64>,
    /// LUKS2 keyslots area size in bytes.
    #[arg(long)]
    pub luks2_keyslots_size: Option<u64>,
    /// format: authenticated encryption (LUKS2): aead (with --cipher aes-gcm-random,
    /// aes-ccm-random or aegis128-random), poly1305 (with --cipher chacha20-random or chacha20-plain64),
    /// hmac-sha1, hmac-sha256 or hmac-sha512 (with --cipher aes-xts-* or aes-cbc-*, IV random,
    /// plain64 or essiv:sha256; aes-xts-plain64 when --cipher is not given). --key-size is the
    /// cipher's key; the MAC key is added to the volume key, as cryptsetup does.
    #[arg(long, short = 'I', value_name = "TYPE")]
    pub integrity: Option<String>,
    /// format --integrity hmac-*: the HMAC key's size in bits (a multiple of 8, at least 128;
    /// default: the hash's output size), as cryptsetup 2.8's option: the volume key is the
    /// cipher's key then this many bits, and the segment records the size. Ignored without
    /// --integrity, as cryptsetup ignores it.
    #[arg(long, value_name = "BITS", value_parser = keyslot_area::keyslot_key_bits)]
    pub integrity_key_size: Option<u32>,
    /// format --integrity: accepted, as cryptsetup's format takes it (the wipe is written
    /// without the journal either way, as cryptsetup wipes; nothing is recorded in the header).
    #[arg(long)]
    pub integrity_no_journal: bool,
    /// format --integrity: do not write the data area (its blocks fail authentication until
    /// written). Without it every block is written with zeroes so that every tag verifies.
    #[arg(long)]
    pub integrity_no_wipe: bool,
    /// format --integrity: format dm-integrity as kernels before 5.7 did (each area's tags
    /// padded to 128 KiB instead of 4 KiB), as cryptsetup's option does; such volumes open
    /// without the option.
    #[arg(long)]
    pub integrity_legacy_padding: bool,
    /// format --integrity and reencrypt: print progress every this many seconds.
    #[arg(long)]
    pub progress_frequency: Option<u64>,
    /// format --integrity and reencrypt: progress as cryptsetup's JSON lines on standard
    /// output (every --progress-frequency seconds, or every half second).
    #[arg(long)]
    pub progress_json: bool,
    /// Accepted for compatibility; ucrypt reads files without device-mapper.
    #[arg(long)]
    pub disable_locks: bool,
    /// Accepted for compatibility (cryptsetup's passphrase quality check is not applied).
    #[arg(long)]
    pub force_password: bool,
    /// How many times a passphrase typed on a terminal is asked for (default 3), as
    /// cryptsetup does for `open` and `luksResume`; other verbs, key files and pipes ask once.
    #[arg(long, short = 'T')]
    pub tries: Option<u32>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Subcommand, Debug)]
pub enum LuksCmd {
    /// Create a LUKS volume (cryptsetup luksFormat).
    #[command(name = "format", visible_alias = "luksFormat")]
    Format {
        device: Target,
        /// Key file for the first keyslot (as cryptsetup's positional argument).
        #[arg(value_name = "KEY_FILE")]
        pos_key_file: Option<String>,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Print the header (cryptsetup luksDump).
    #[command(name = "dump", visible_alias = "luksDump")]
    Dump {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Add a passphrase (cryptsetup luksAddKey).
    #[command(name = "add-key", visible_alias = "luksAddKey")]
    AddKey {
        device: Target,
        new_key_file: Option<String>,
        /// The new passphrase's key file, as an option (cryptsetup 2.6's spelling of the
        /// second argument).
        #[arg(
            long = "new-keyfile",
            value_name = "FILE",
            conflicts_with = "new_key_file"
        )]
        new_keyfile: Option<String>,
        /// LUKS2, without a new key file: the new passphrase is the one token ID gives (a
        /// luks2-keyring token's, from the kernel keyring), and the new keyslot is assigned to
        /// that token.
        #[arg(long = "new-token-id", value_name = "ID")]
        new_token_id: Option<u32>,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Remove the keyslot a passphrase opens (cryptsetup luksRemoveKey).
    #[command(name = "remove-key", visible_alias = "luksRemoveKey")]
    RemoveKey {
        device: Target,
        #[arg(value_name = "KEY_FILE")]
        pos_key_file: Option<String>,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Change a passphrase (cryptsetup luksChangeKey).
    #[command(name = "change-key", visible_alias = "luksChangeKey")]
    ChangeKey {
        device: Target,
        new_key_file: Option<String>,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Wipe a keyslot by number (cryptsetup luksKillSlot).
    #[command(name = "kill-slot", visible_alias = "luksKillSlot")]
    KillSlot {
        device: Target,
        slot: u32,
        #[arg(value_name = "KEY_FILE")]
        pos_key_file: Option<String>,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Save the header and keyslot areas to --header-backup-file (cryptsetup luksHeaderBackup).
    #[command(name = "header-backup", visible_alias = "luksHeaderBackup")]
    HeaderBackup {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Restore them (cryptsetup luksHeaderRestore).
    #[command(name = "header-restore", visible_alias = "luksHeaderRestore")]
    HeaderRestore {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Print or (with --uuid) set the UUID (cryptsetup luksUUID).
    #[command(name = "uuid", visible_alias = "luksUUID")]
    Uuid {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Exit 0 if the device is LUKS (cryptsetup isLuks).
    #[command(name = "is-luks", visible_alias = "isLuks")]
    IsLuks {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Set label, subsystem, keyslot priority, and (with --persistent) activation flags.
    #[command(name = "config", alias = "luksConfig")]
    Config {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Convert the header in place to --type luks1 or luks2 (cryptsetup convert).
    #[command(name = "convert")]
    Convert {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Give a keyslot new PBKDF parameters, same passphrase (cryptsetup luksConvertKey).
    #[command(name = "convert-key", visible_alias = "luksConvertKey")]
    ConvertKey {
        device: Target,
        #[arg(value_name = "KEY_FILE")]
        pos_key_file: Option<String>,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Destroy every keyslot: the volume can no longer be opened (cryptsetup erase).
    #[command(name = "erase", visible_alias = "luksErase")]
    Erase {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Rewrite both LUKS2 header copies from the valid one (cryptsetup repair).
    #[command(name = "repair")]
    Repair {
        device: Target,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Rotate the volume key in place (cryptsetup reencrypt): offline, or online through the
    /// `ucrypt open` daemon serving the volume; resumable by either tool, crash-safe with
    /// --resilience checksum or journal. Asks a passphrase per active keyslot (one a line
    /// from a pipe), or for --key-slot's alone. DEVICE may be left out with --active-name.
    #[command(name = "reencrypt")]
    Reencrypt {
        device: Option<Target>,
        #[command(flatten)]
        r: reencrypt::ReencryptOpts,
        #[command(flatten)]
        o: LuksOpts,
    },
    /// Decrypt the whole data area of VOLUME into FILE.
    #[command(name = "export")]
    Export {
        #[command(flatten)]
        v: VolumeArgs,
        file: PathBuf,
        /// The volume's format: luks (default; the header decides), plain (with --cipher),
        /// tcrypt, fvault2 or loopaes.
        #[arg(long = "type", short = 'M')]
        dev_type: Option<crate::open::DeviceType>,
        /// Print progress every this many seconds, a line each (also when stderr is not a
        /// terminal), as cryptsetup's option does.
        #[arg(long, value_name = "SECONDS")]
        progress_frequency: Option<u64>,
        /// Export although a ucrypt process serves the volume read-write (the copy may mix
        /// data from before and after its writes).
        #[arg(long)]
        force: bool,
    },
    /// Encrypt FILE into the data area of VOLUME.
    #[command(name = "import")]
    Import {
        file: PathBuf,
        #[command(flatten)]
        v: VolumeArgs,
        /// The volume's format, as for export.
        #[arg(long = "type", short = 'M')]
        dev_type: Option<crate::open::DeviceType>,
        /// Print progress every this many seconds, a line each.
        #[arg(long, value_name = "SECONDS")]
        progress_frequency: Option<u64>,
    },
}

/// Verbs and aliases, for argument reordering (`cryptsetup -q luksFormat ...`).
const VERBS: &[&str] = &[
    "format",
    "luksFormat",
    "dump",
    "luksDump",
    "add-key",
    "luksAddKey",
    "remove-key",
    "luksRemoveKey",
    "change-key",
    "luksChangeKey",
    "kill-slot",
    "luksKillSlot",
    "header-backup",
    "luksHeaderBackup",
    "header-restore",
    "luksHeaderRestore",
    "uuid",
    "luksUUID",
    "is-luks",
    "isLuks",
    "open",
    "luksOpen",
    "config",
    "luksConfig",
    "convert",
    "convert-key",
    "luksConvertKey",
    "erase",
    "luksErase",
    "repair",
    "reencrypt",
    "export",
    "import",
];

/// cryptsetup accepts options before the action (`cryptsetup -q --type luks2 luksFormat X`);
/// clap wants them after the subcommand. Moves everything between the program name and a
/// LUKS verb to just after the verb; other commands are left untouched.
pub fn reorder_args(args: Vec<String>) -> Vec<String> {
    let Some(pos) = args
        .iter()
        .skip(1)
        .position(|a| VERBS.contains(&a.as_str()))
    else {
        return args;
    };
    let pos = pos + 1;
    if pos == 1 || !args[1].starts_with('-') {
        return args;
    }
    let mut out = vec![args[0].clone(), args[pos].clone()];
    out.extend_from_slice(&args[1..pos]);
    out.extend_from_slice(&args[pos + 1..]);
    out
}

pub fn run(cmd: LuksCmd) -> i32 {
    ucrypt::secret::disable_core_dumps();
    report(dispatch(cmd))
}

/// A LUKS verb's result as its exit code, its error on stderr in cryptsetup's words.
fn report(r: CliResult<i32>) -> i32 {
    match r {
        Ok(code) => code,
        Err(CliError::Core(Error::NotLuks(dev))) => {
            eprintln!("Device {dev} is not a valid LUKS device.");
            1
        }
        // cryptsetup's own messages, unprefixed: scripts match them.
        Err(e) => {
            eprintln!("{}", e.message());
            e.exit_code()
        }
    }
}

fn dispatch(cmd: LuksCmd) -> CliResult<i32> {
    let r = match cmd {
        LuksCmd::Format {
            device,
            pos_key_file,
            o,
        } => format(&device, pos_key_file.as_deref(), &o),
        LuksCmd::Dump { device, o } => dump(&device, &o),
        LuksCmd::AddKey {
            device,
            new_key_file,
            new_keyfile,
            new_token_id,
            o,
        } => add_key(
            &device,
            new_key_file.or(new_keyfile).as_deref(),
            new_token_id,
            &o,
        ),
        LuksCmd::RemoveKey {
            device,
            pos_key_file,
            o,
        } => remove_key(&device, pos_key_file.as_deref(), &o),
        LuksCmd::ChangeKey {
            device,
            new_key_file,
            o,
        } => change_key(&device, new_key_file.as_deref(), &o),
        LuksCmd::KillSlot {
            device,
            slot,
            pos_key_file,
            o,
        } => kill_slot(&device, slot, pos_key_file.as_deref(), &o),
        LuksCmd::HeaderBackup { device, o } => header_backup(&device, &o),
        LuksCmd::HeaderRestore { device, o } => header_restore(&device, &o),
        LuksCmd::Uuid { device, o } => uuid(&device, &o),
        LuksCmd::IsLuks { device, o } => is_luks(&device, &o),
        LuksCmd::Config { device, o } => config(&device, &o),
        LuksCmd::Convert { device, o } => convert::convert(&device, &o),
        LuksCmd::ConvertKey {
            device,
            pos_key_file,
            o,
        } => convert::convert_key(&device, pos_key_file.as_deref(), &o),
        LuksCmd::Erase { device, o } => convert::erase(&device, &o),
        LuksCmd::Repair { device, o } => repair(&device, &o),
        LuksCmd::Reencrypt { device, r, o } => reencrypt::reencrypt_cmd(device, &r, &o),
        LuksCmd::Export {
            mut v,
            file,
            dev_type,
            progress_frequency,
            force,
        } => {
            v.device_type = dev_type;
            return data::export(&v, &file, progress_frequency, force);
        }
        LuksCmd::Import {
            file,
            mut v,
            dev_type,
            progress_frequency,
        } => {
            v.device_type = dev_type;
            return data::import(&file, &v, progress_frequency);
        }
    };
    Ok(r?)
}

/// The header device: --header if given (a local file), else the volume itself; a local one
/// under cryptsetup's lock (exclusive to update).
fn header_dev(device: &Target, o: &LuksOpts, update: bool) -> Result<HeaderDev> {
    match &o.header {
        Some(h) => dev::open_header(h, update),
        None => device.open_header(update, &o.remote),
    }
}

/// The header device's name, for messages.
fn header_name(device: &Target, o: &LuksOpts) -> String {
    match &o.header {
        Some(h) => h.display().to_string(),
        None => device.to_string(),
    }
}

fn print_warnings(h: &Header) {
    for w in h.warnings() {
        eprintln!("WARNING: {w}");
    }
}

/// Opens the header device and parses its header (printing recovery warnings).
fn load(device: &Target, o: &LuksOpts, writable: bool) -> Result<(HeaderDev, Header)> {
    let dev = header_dev(device, o, writable)?;
    let hdr = luks::read_header(dev.as_ref()).map_err(|e| match e {
        Error::NotLuks(_) => Error::NotLuks(header_name(device, o)),
        other => other,
    })?;
    print_warnings(&hdr);
    Ok((dev, hdr))
}

fn kdf_request(o: &LuksOpts, version: u32) -> Result<KdfRequest> {
    let mut k = if version == 1 {
        KdfRequest::luks1_default()
    } else {
        KdfRequest::luks2_default()
    };
    if let Some(h) = &o.hash {
        k.hash = HashAlg::from_name(h)?;
    }
    if let Some(p) = &o.pbkdf {
        if version == 1 && p != "pbkdf2" {
            return Err(Error::InvalidArgument(
                "LUKS1 supports only --pbkdf pbkdf2".into(),
            ));
        }
        k.kind = p.clone();
    }
    if let Some(t) = o.iter_time {
        k.iter_time_ms = t.max(1);
    }
    if let Some(m) = o.pbkdf_memory {
        k.memory_kib = m;
    }
    if let Some(p) = o.pbkdf_parallel {
        k.parallel = p;
    }
    k.force_iterations = o.pbkdf_force_iterations;
    // Calibration runs the KDF for about iter_time: say so on a terminal, since the command
    // otherwise sits silent for seconds (scripts, with stderr redirected, see nothing).
    if k.force_iterations.is_none() && pass::stderr_is_tty() {
        eprintln!(
            "Calibrating {} to take about {} ms per unlock...",
            k.kind, k.iter_time_ms
        );
    }
    Ok(k)
}

fn existing_source<'a>(o: &'a LuksOpts, positional: Option<&'a str>) -> Source<'a> {
    Source {
        key_file: o.key.key_file.as_deref().or(positional),
        ..o.key.source()
    }
}

fn new_source<'a>(o: &'a LuksOpts, positional: Option<&'a str>) -> Source<'a> {
    Source {
        key_file: positional,
        offset: o.new_keyfile_offset.unwrap_or(0),
        size: o.new_keyfile_size,
    }
}

/// Unlocks with a passphrase from `src`, reading keyslot areas from the header device.
/// `key_use` says which keyslots may answer: [`KeyUse::Data`] for everything that uses the
/// key on the data or gives it to a new keyslot, [`KeyUse::AnySegment`] where cryptsetup
/// allows an unbound key (a passphrase test, a passphrase change, a dump of the unbound key).
fn unlock_with(
    dev: &HeaderDev,
    hdr: &Header,
    src: &Source<'_>,
    slot: Option<u32>,
    key_use: KeyUse,
    prompt: &str,
) -> Result<(u32, VolumeKey)> {
    let p = pass::read_passphrase(src, prompt, false)?;
    match luks::unlock_key_for(dev.as_ref(), hdr, Unlock::Passphrase(p), slot, key_use)? {
        (Some(slot), vk) => Ok((slot, vk)),
        (None, _) => Err(Error::Bug("a passphrase unlock named no keyslot")),
    }
}

// ---------------------------------------------------------------- format

/// Refuses (exit 5) a verb that would rewrite data or header under a ucrypt process serving
/// the volume or its detached header (`crate::in_use`); `what` says what was refused and how
/// to go on.
pub(crate) fn refuse_if_served(device: &Target, o: &LuksOpts, what: &str) -> Result<()> {
    let mut paths: Vec<&std::path::Path> = o.header.iter().map(|h| h.as_path()).collect();
    if let Target::Path(p) = device {
        paths.push(p);
    }
    crate::in_use::refuse_if_served(&paths, what)
}

fn format(device: &Target, pos_key_file: Option<&str>, o: &LuksOpts) -> Result<i32> {
    // cryptsetup refuses to format an active device ("Cannot format device ... in use.").
    refuse_if_served(device, o, "cannot format it; stop that process first")?;
    let version = match o.luks_type.as_deref().unwrap_or("luks2") {
        "luks2" => LuksVersion::Luks2,
        "luks1" | "luks" => LuksVersion::Luks1,
        t => {
            return Err(Error::InvalidArgument(format!(
                "unsupported --type '{t}' (luks1, luks2)"
            )))
        }
    };
    let mut req = FormatRequest::new(version, device.to_string());
    req.integrity = match &o.integrity {
        Some(t) if version == LuksVersion::Luks2 => Some(integrity_choice(o, t)?),
        Some(_) => {
            return Err(Error::InvalidArgument(
                "--integrity needs LUKS2 (--type luks2)".into(),
            ))
        }
        None => None,
    };
    // With --integrity the segment's cipher is the integrity choice's.
    if req.integrity.is_none() {
        req.cipher = o.cipher.as_deref().unwrap_or("aes-xts-plain64").parse()?;
    }
    req.key_bits = o.key_size;
    req.sector_size = o.sector_size.map(SectorSize::new).transpose()?;
    req.offset_sectors = o.offset;
    req.align_payload_sectors = o.align_payload;
    req.detached = o.header.is_some();
    req.label = o.label.clone();
    req.subsystem = o.subsystem.clone();
    req.uuid = o.uuid.clone();
    req.key_slot = o.key_slot;
    req.luks2_metadata_bytes = o.luks2_metadata_size;
    req.luks2_keyslots_bytes = o.luks2_keyslots_size;
    req.keyslot_area = keyslot_area::request(o)?;
    let key_bytes = req.check()?;
    req.object_bytes = device.object_bytes(&o.remote)?;
    let align = req.alignment()?;
    if align.by_object {
        eprintln!(
            "{device}: data offset aligned to the image's object size ({} KiB), as librbd does",
            align.bytes >> 10
        );
    }
    req.data_bytes = match device {
        Target::Path(p) => dev::size_of(p)?,
        remote => remote.size(&o.remote)?,
    };
    pass::confirm(
        o.batch_mode,
        &format!(
            "This will overwrite data on {} irrevocably.",
            header_name(device, o)
        ),
    )?;
    let passphrase = pass::read_passphrase(
        &existing_source(o, pos_key_file),
        &format!("Enter passphrase for {}: ", device),
        true,
    )?;
    let vk_secret = match &o.volume_key_file {
        Some(p) => crate::volume_key::read(p, key_bytes)?,
        None => luks::random_secret(key_bytes)?,
    };
    req.kdf = kdf_request(o, version.number())?;
    let plan = ucrypt::format::plan(&req, passphrase.as_ref(), vk_secret)?;
    let hdev = match &o.header {
        Some(h) => dev::create_header(h, plan.header_end_bytes())?,
        None => device.open_header(true, &o.remote)?,
    };
    ucrypt::format::write_header(hdev.as_ref(), &plan)?;
    drop(hdev);
    if o.verbose {
        eprintln!("Key slot {} created.", plan.keyslot);
    }
    if plan.integrity.is_some() {
        format_integrity(device, o, &plan)?;
    }
    Ok(0)
}

/// `format --integrity`: the integrity type and the segment's cipher, as the user named them
/// (cryptsetup's default cipher when none is given).
fn integrity_choice(o: &LuksOpts, t: &str) -> Result<Integrity> {
    let kind = IntegrityKind::from_name(t).ok_or_else(|| {
        // cryptsetup's messages, then what ucrypt takes.
        let size = if o.integrity_key_size.is_some() {
            "\nCannot use specified integrity key size."
        } else {
            ""
        };
        Error::InvalidArgument(format!(
            "No known integrity specification pattern detected.{size}\n--integrity {t}: ucrypt \
             supports aead, poly1305, hmac-sha1, hmac-sha256 and hmac-sha512"
        ))
    })?;
    let encryption = o
        .cipher
        .clone()
        .unwrap_or_else(|| ucrypt::format::INTEGRITY_DEFAULT_CIPHER.into());
    Ok(Integrity {
        kind,
        encryption,
        legacy_padding: o.integrity_legacy_padding,
        mac_key_bits: o.integrity_key_size,
    })
}

/// After the LUKS2 header of an authenticated volume: its dm-integrity area, then, unless
/// --integrity-no-wipe, zeroes over the whole data area with a progress line.
fn format_integrity(device: &Target, o: &LuksOpts, plan: &FormatPlan) -> Result<()> {
    let data = device.open_data(true, &o.remote, ucrypt::backend::CacheMode::Writeback)?;
    let wipe = if o.integrity_no_wipe {
        IntegrityWipe::Skip
    } else {
        IntegrityWipe::Zeroes
    };
    let mut p: Option<data::Progress> = None;
    let total =
        ucrypt::format::write_integrity(data, plan, wipe, &mut |done, total| match &mut p {
            None => {
                let mut n = data::Progress::new(total, o.progress_frequency);
                if o.progress_json {
                    n = n.json(device.to_string());
                }
                p = Some(n)
            }
            Some(p) => p.tick(done),
        })?;
    match p {
        Some(mut p) => p.finish("Wiped", total),
        None => eprintln!(
            "{device}: integrity data area not wiped ({total} bytes): blocks fail \
             authentication until written."
        ),
    }
    Ok(())
}

// ---------------------------------------------------------------- dump

fn dump(device: &Target, o: &LuksOpts) -> Result<i32> {
    let (dev, hdr) = load(device, o, false)?;
    let name = device.to_string();
    if o.unbound && !o.dump_volume_key {
        return dump_unbound(&dev, &hdr, &name, o);
    }
    if o.dump_json_metadata {
        let Header::Luks2(h) = &hdr else {
            return Err(Error::InvalidArgument(
                "--dump-json-metadata needs a LUKS2 header".into(),
            ));
        };
        print!("{}", luks::dump_json(h));
        return Ok(0);
    }
    if !o.dump_volume_key {
        print!("{}", luks::dump(&hdr, &name, None));
        dump_integrity(device, o, &dev, &hdr);
        return Ok(0);
    }
    pass::confirm(
        o.batch_mode,
        "Header dump with volume key is sensitive information\nthat allows access to encrypted partition without a passphrase.\nThis dump should be stored encrypted in a safe place.",
    )?;
    let (_, vk) = unlock_with(
        &dev,
        &hdr,
        &existing_source(o, None),
        o.key_slot,
        KeyUse::Data,
        &format!("Enter passphrase for {name}: "),
    )?;
    if let Some(p) = &o.volume_key_file {
        dev::write_new_file(p, vk.bytes())?;
        println!("Key stored to file {}.", p.display());
    } else {
        print!("{}", luks::dump(&hdr, &name, Some(&vk)));
    }
    Ok(0)
}

/// `luksDump --unbound --key-slot N`: keyslot N's unbound key, printed or (with
/// `--volume-key-file`) written to a new file, as cryptsetup does; the slot must be named and
/// must hold an unbound key.
fn dump_unbound(dev: &HeaderDev, hdr: &Header, name: &str, o: &LuksOpts) -> Result<i32> {
    let slot = o
        .key_slot
        .ok_or_else(|| Error::InvalidArgument("Keyslot specification is required.".into()))?;
    let unbound = match hdr {
        Header::Luks2(h) => h
            .meta()
            .digest_for_keyslot(&slot.to_string())
            .is_some_and(|(_, d)| d.segments.is_empty()),
        Header::Luks1(_) => false,
    };
    if !unbound {
        return Err(Error::InvalidArgument(format!(
            "Keyslot {slot} does not contain unbound key."
        )));
    }
    pass::confirm(
        o.batch_mode,
        "The header dump with unbound key is sensitive information.\nThis dump should be stored encrypted in a safe place.",
    )?;
    let (_, key) = unlock_with(
        dev,
        hdr,
        &existing_source(o, None),
        Some(slot),
        KeyUse::AnySegment,
        &format!("Enter passphrase for {name}: "),
    )?;
    match &o.volume_key_file {
        Some(p) => {
            dev::write_new_file(p, key.bytes())?;
            print!("{}", luks::dump_unbound(hdr, name, slot, &key, false));
            println!("Key stored to file {}.", p.display());
        }
        None => print!("{}", luks::dump_unbound(hdr, name, slot, &key, true)),
    }
    Ok(0)
}

/// The dm-integrity superblock of an authenticated volume, read from the data device (which
/// is the header device unless `--header` names another). A damaged or unreadable superblock
/// is reported on stderr; the header dump stands on its own.
fn dump_integrity(device: &Target, o: &LuksOpts, dev: &HeaderDev, hdr: &Header) {
    if ucrypt::integrity::superblock_offset(hdr).is_none() {
        return;
    }
    let data = match &o.header {
        None => Ok(dev.clone()),
        Some(_) => device.open_data(false, &o.remote, ucrypt::backend::CacheMode::None),
    };
    let r = data.and_then(|d| ucrypt::integrity::read_superblock(d.as_ref(), hdr));
    match r {
        Ok(Some(layout)) => print!("{}", ucrypt::integrity::dump(&layout)),
        Ok(None) => {}
        Err(e) => eprintln!("Cannot read the integrity superblock: {e}"),
    }
}

// ---------------------------------------------------------------- keys

fn add_key(
    device: &Target,
    new_key_file: Option<&str>,
    new_token_id: Option<u32>,
    o: &LuksOpts,
) -> Result<i32> {
    if o.unbound {
        return add_unbound_key(device, new_key_file, o);
    }
    let (dev, mut hdr) = load(device, o, true)?;
    hdr.check_requirements()?;
    let area = keyslot_area::for_header(o, &hdr)?;
    let vk = match &o.volume_key_file {
        Some(p) => crate::volume_key::read_verified(&hdr, p, o.key_size)?,
        None => {
            unlock_with(
                &dev,
                &hdr,
                &existing_source(o, None),
                None,
                KeyUse::Data,
                "Enter any existing passphrase: ",
            )?
            .1
        }
    };
    // As cryptsetup: a new key file wins over --new-token-id.
    let by_token = new_token_id.filter(|_| new_key_file.is_none());
    let newp = match by_token {
        Some(token) => token_passphrase(&hdr, token)?,
        None => pass::read_passphrase(
            &new_source(o, new_key_file),
            "Enter new passphrase for key slot: ",
            true,
        )?,
    };
    let kdf = kdf_request(o, hdr.version())?;
    let slot = o.new_key_slot.or(o.key_slot);
    let new = NewKeyslot {
        vk: &vk,
        passphrase: newp.as_ref(),
        kdf: &kdf,
        slot,
    };
    let (id, ops) = match &mut hdr {
        Header::Luks2(h) if area.is_some() => h.add_keyslot_with_area(new, None, area)?,
        _ => hdr.add_keyslot(new)?,
    };
    luks::apply(dev.as_ref(), &ops)?;
    if o.verbose {
        eprintln!("Key slot {id} created.");
    }
    if let Some(token) = by_token {
        // The new keyslot is the token's too (cryptsetup assigns it after adding it).
        if let Header::Luks2(mut h) = luks::read_header(dev.as_ref())? {
            h.assign_token(token, Some(id))?;
            luks::apply(dev.as_ref(), &h.commit()?)?;
        }
    }
    Ok(0)
}

/// The passphrase token `id` gives: a luks2-keyring token's, read from the kernel keyring.
/// As cryptsetup: no such token exits 1; its key missing from the keyring exits 2, as a
/// passphrase that opens nothing.
fn token_passphrase(hdr: &Header, id: u32) -> Result<ucrypt::SecretBytes> {
    let no_token = || Error::InvalidArgument(format!("Token {id} is not a usable token."));
    let Header::Luks2(h) = hdr else {
        return Err(no_token());
    };
    let filter = ucrypt::luks::luks2::TokenFilter {
        id: Some(id),
        kind: None,
    };
    let t = h
        .keyring_tokens(&filter)
        .into_iter()
        .next()
        .ok_or_else(no_token)?;
    pass::keyring_passphrase(&t.key_description).ok_or(Error::WrongPassphrase)
}

/// `luksAddKey --unbound --key-size BITS`: a keyslot for a key no segment uses, random or
/// from `--volume-key-file`; the new passphrase only is asked (an unbound key is no volume
/// key, so no existing passphrase proves anything). LUKS2 only, into a free keyslot.
fn add_unbound_key(device: &Target, new_key_file: Option<&str>, o: &LuksOpts) -> Result<i32> {
    let bits = o.key_size.filter(|&b| b > 0).ok_or_else(|| {
        Error::InvalidArgument("Key size is required with --unbound option.".into())
    })?;
    if bits % 8 != 0 {
        return Err(Error::InvalidArgument(
            "Key size must be a multiple of 8 bits".into(),
        ));
    }
    let key_bytes = (bits / 8) as usize;
    let (dev, mut hdr) = load(device, o, true)?;
    hdr.check_requirements()?;
    let area = keyslot_area::for_header(o, &hdr)?;
    let Header::Luks2(h) = &mut hdr else {
        return Err(Error::InvalidArgument(format!(
            "Device {} is not a valid LUKS2 device.",
            header_name(device, o)
        )));
    };
    let key = match &o.volume_key_file {
        Some(p) => crate::volume_key::read(p, key_bytes)?,
        None => luks::random_secret(key_bytes)?,
    };
    let newp = pass::read_passphrase(
        &new_source(o, new_key_file),
        "Enter new passphrase for key slot: ",
        true,
    )?;
    let kdf = kdf_request(o, 2)?;
    let (id, ops) = h.add_unbound_keyslot(key, newp.as_ref(), &kdf, o.key_slot, area)?;
    luks::apply(dev.as_ref(), &ops)?;
    if o.verbose {
        eprintln!("Key slot {id} created.");
    }
    Ok(0)
}

fn remove_key(device: &Target, key_file: Option<&str>, o: &LuksOpts) -> Result<i32> {
    let (dev, mut hdr) = load(device, o, true)?;
    let (slot, _) = unlock_with(
        &dev,
        &hdr,
        &existing_source(o, key_file),
        o.key_slot,
        KeyUse::Data,
        "Enter passphrase to be deleted: ",
    )?;
    if hdr.active_keyslots().len() == 1 {
        pass::confirm(
            o.batch_mode,
            "This is the last keyslot. Device will become unusable after purging this key.",
        )?;
    }
    let ops = hdr.remove_keyslot(slot)?;
    luks::apply(dev.as_ref(), &ops)?;
    if o.verbose {
        eprintln!("Key slot {slot} removed.");
    }
    Ok(0)
}

fn change_key(device: &Target, new_key_file: Option<&str>, o: &LuksOpts) -> Result<i32> {
    let (dev, mut hdr) = load(device, o, true)?;
    hdr.check_requirements()?;
    let area = keyslot_area::for_header(o, &hdr)?;
    // An unbound keyslot's passphrase may be changed too (cryptsetup allows it); the new
    // keyslot keeps the old one's digest, so it stays unbound.
    let (old, vk) = unlock_with(
        &dev,
        &hdr,
        &existing_source(o, None),
        o.key_slot,
        KeyUse::AnySegment,
        "Enter passphrase to be changed: ",
    )?;
    let newp = pass::read_passphrase(&new_source(o, new_key_file), "Enter new passphrase: ", true)?;
    let kdf = kdf_request(o, hdr.version())?;
    // Write the new keyslot first, then remove the old one: a crash in between leaves both
    // passphrases working, never neither.
    let (new, ops) = match &mut hdr {
        Header::Luks2(h) => h.change_keyslot(old, &vk, newp.as_ref(), &kdf, area)?,
        Header::Luks1(_) => {
            let (new, mut ops) = hdr.add_keyslot(NewKeyslot {
                vk: &vk,
                passphrase: newp.as_ref(),
                kdf: &kdf,
                slot: None,
            })?;
            ops.extend(hdr.remove_keyslot(old)?);
            (new, ops)
        }
    };
    luks::apply(dev.as_ref(), &ops)?;
    if o.verbose {
        eprintln!("Key slot {old} changed (now {new}).");
    }
    Ok(0)
}

fn kill_slot(device: &Target, slot: u32, key_file: Option<&str>, o: &LuksOpts) -> Result<i32> {
    let (dev, mut hdr) = load(device, o, true)?;
    if !hdr.active_keyslots().contains(&slot) {
        return Err(Error::Keyslot {
            slot,
            reason: "Keyslot is not active.".into(),
        });
    }
    // Like cryptsetup: without --batch-mode, prove knowledge of a remaining passphrase.
    if !o.batch_mode || key_file.is_some() || o.key.key_file.is_some() {
        unlock_with(
            &dev,
            &hdr,
            &existing_source(o, key_file),
            None,
            KeyUse::Data,
            "Enter any remaining passphrase: ",
        )?;
    }
    if hdr.active_keyslots().len() == 1 {
        pass::confirm(
            o.batch_mode,
            "This is the last keyslot. Device will become unusable after purging this key.",
        )?;
    }
    luks::apply(dev.as_ref(), &hdr.remove_keyslot(slot)?)?;
    Ok(0)
}

// ---------------------------------------------------------------- header files

fn header_backup(device: &Target, o: &LuksOpts) -> Result<i32> {
    let file = o
        .header_backup_file
        .as_deref()
        .ok_or_else(|| Error::InvalidArgument("--header-backup-file is required".into()))?;
    let (dev, hdr) = load(device, o, false)?;
    let len = hdr.metadata_area_bytes();
    let bytes = luks::read_area(dev.as_ref(), 0, len)?;
    dev::write_new_file(file, &bytes)?;
    Ok(0)
}

fn header_restore(device: &Target, o: &LuksOpts) -> Result<i32> {
    // A serving process keeps the volume key and the reencryption's progress of the header it
    // opened, and writes that header back as it goes: a restored header under it would be
    // overwritten, or would describe data the process has already rewritten.
    refuse_if_served(
        device,
        o,
        "cannot restore its header while it is served; stop that process first",
    )?;
    let file = o
        .header_backup_file
        .as_deref()
        .ok_or_else(|| Error::InvalidArgument("--header-backup-file is required".into()))?;
    let backup = dev::open_header(file, false)?;
    let bhdr = luks::read_header(backup.as_ref()).map_err(|e| {
        Error::InvalidArgument(format!(
            "Backup file doesn't contain valid LUKS header ({e})."
        ))
    })?;
    // A backup in reencryption may be restored (its reencryption then resumes); one with
    // requirements ucrypt does not know may not (cryptsetup's rule and words).
    if bhdr.check_known_requirements().is_err() {
        return Err(Error::InvalidArgument(format!(
            "Forbidden LUKS2 requirements detected in backup {}.",
            file.display()
        )));
    }
    let len = bhdr.metadata_area_bytes();
    let bytes = luks::read_area(backup.as_ref(), 0, len)?;
    let target = header_name(device, o);
    let dev = header_dev(device, o, true)?;
    let existing = luks::read_header(dev.as_ref()).ok();
    if let Some(cur) = &existing {
        // LUKS1 also compares the key size (cryptsetup's LUKS_hdr_restore).
        let key_size_differs = matches!((cur, &bhdr), (Header::Luks1(c), Header::Luks1(b))
            if c.key_bytes != b.key_bytes);
        if cur.metadata_area_bytes() != len
            || key_size_differs
            || cur.data_layout().ok().map(|l| l.offset_bytes)
                != bhdr.data_layout().ok().map(|l| l.offset_bytes)
        {
            return Err(Error::InvalidArgument(
                "Data offset, key size or header size differ on device and backup, restore \
                 failed."
                    .into(),
            ));
        }
    }
    let msg = match &existing {
        Some(cur) if cur.uuid() != bhdr.uuid() => format!(
            "Device {} already contains LUKS header. Replacing header will destroy existing keyslots.\nWARNING: real device header has different UUID than backup!",
            target
        ),
        Some(_) => format!(
            "Device {} already contains LUKS header. Replacing header will destroy existing keyslots.",
            target
        ),
        None => format!(
            "Device {} does not contain LUKS header. Replacing header can destroy data on that device.",
            target
        ),
    };
    pass::confirm(o.batch_mode, &msg)?;
    luks::apply(
        dev.as_ref(),
        &[
            WriteOp::Write {
                offset: 0,
                data: bytes,
            },
            WriteOp::Sync,
        ],
    )?;
    Ok(0)
}

fn uuid(device: &Target, o: &LuksOpts) -> Result<i32> {
    let writable = o.uuid.is_some();
    let (dev, mut hdr) = load(device, o, writable)?;
    let Some(new) = &o.uuid else {
        println!("{}", hdr.uuid());
        return Ok(0);
    };
    hdr.check_requirements()?;
    let ops = match &mut hdr {
        Header::Luks1(h) => {
            luks::check_uuid(new)?;
            h.uuid = new.to_lowercase();
            vec![
                WriteOp::Write {
                    offset: 0,
                    data: h.encode()?,
                },
                WriteOp::Sync,
            ]
        }
        Header::Luks2(h) => {
            h.set_uuid(new)?;
            h.commit()?
        }
    };
    luks::apply(dev.as_ref(), &ops)?;
    Ok(0)
}

fn is_luks(device: &Target, o: &LuksOpts) -> Result<i32> {
    let dev = match header_dev(device, o, false) {
        Ok(d) => d,
        Err(e) => {
            if o.verbose {
                eprintln!("{e}");
            }
            return Ok(4);
        }
    };
    let res = luks::read_header(dev.as_ref());
    let ok = match (&res, o.luks_type.as_deref()) {
        (Ok(h), Some("luks1")) => h.version() == 1,
        (Ok(h), Some("luks2")) => h.version() == 2,
        (Ok(_), _) => true,
        (Err(_), _) => false,
    };
    if o.verbose {
        match &res {
            Ok(_) if ok => eprintln!("Command successful."),
            _ => eprintln!("Device {} is not a valid LUKS device.", device),
        }
    }
    Ok(if ok { 0 } else { 1 })
}

/// `open --test-passphrase` as `ucrypt open` parses it: the options of the LUKS verb that
/// checks the passphrase, then that verb, its exit code.
pub fn test_passphrase_of(a: &crate::daemon::OpenArgs) -> i32 {
    let v = &a.v;
    let o = LuksOpts {
        luks_type: a.dev_type.map(|t| t.name().to_string()),
        header: v.header.clone(),
        key: pass::KeyFileArgs {
            key_file: v.key_file().map(str::to_string),
            keyfile_offset: v.keyfile_offset,
            keyfile_size: v.keyfile_size,
        },
        key_slot: v.key_slot,
        batch_mode: a.batch_mode,
        verbose: a.verbose,
        volume_key_file: v.volume_key_file.clone(),
        test_passphrase: true,
        unbound: a.unbound,
        tries: a.tries,
        ..LuksOpts::default()
    };
    ucrypt::secret::disable_core_dumps();
    report(test_passphrase(&v.volume, &o, &v.token))
}

/// `open --test-passphrase`: unlocks a keyslot and serves nothing. As cryptsetup does, a
/// named keyslot (`--key-slot`) or `--unbound` lets an unbound keyslot answer too; without
/// either only the keyslots of the data segment's key are tried.
fn test_passphrase(
    device: &Target,
    o: &LuksOpts,
    token: &crate::token::TokenOpts,
) -> CliResult<i32> {
    use crate::open::DeviceType;
    let dev_type: Option<DeviceType> = match &o.luks_type {
        Some(t) => Some(t.parse().map_err(CliError::Usage)?),
        None => None,
    };
    if let Some(t) = dev_type {
        if t == DeviceType::Plain {
            return Err(CliError::Usage(
                "Option --test-passphrase is allowed only for open of LUKS, TCRYPT, BITLK and \
                 FVAULT2 devices."
                    .into(),
            ));
        }
    }
    // Unmet requirements do not stop a passphrase test (cryptsetup's rule): the keyslots
    // answer, the volume is not activated.
    let (dev, hdr) = load(device, o, false)?;
    if let Some(t) = dev_type {
        t.check_header(&hdr, &device.to_string())?;
    }
    if let Some(p) = &o.volume_key_file {
        // A volume key is checked against the data segment's digest.
        crate::volume_key::read_verified(&hdr, p, o.key_size)?;
        return Ok(0);
    }
    if hdr.in_reencryption() && o.key_slot.is_some() {
        // cryptsetup 2.6 refuses a passphrase test on one named keyslot of a header in
        // reencryption ("wrong or missing parameters", exit 1; `luks_interop`'s
        // `reencryption_in_progress_is_recognised` pins it).
        return Err(Error::InvalidArgument(
            "wrong or missing parameters: --key-slot cannot be used on a device in reencryption"
                .into(),
        )
        .into());
    }
    if o.key.key_file.is_none() {
        let key_use = if o.unbound {
            KeyUse::AnySegment
        } else {
            KeyUse::Data
        };
        match crate::token::unlock_by_token(dev.as_ref(), &hdr, token, o.key_slot, key_use)? {
            TokenOutcome::Unlocked(t) => {
                if o.verbose {
                    eprintln!("Key slot {} unlocked.", t.slot);
                }
                return Ok(0);
            }
            other if token.only() => return Err(token.failure(&other)),
            _ => {}
        }
    }
    // A wrong passphrase typed on a terminal is asked again (`--tries`); cryptsetup does not
    // on a header in reencryption, where the answer is "no usable keyslot" (below).
    let src = existing_source(o, None);
    let key_use = if o.key_slot.is_some() || o.unbound {
        KeyUse::AnySegment
    } else {
        KeyUse::Data
    };
    let tries = if hdr.in_reencryption() {
        1
    } else {
        pass::tries(o.tries, src.key_file)
    };
    let (slot, _vk) = pass::retry_wrong(
        tries,
        |e| matches!(e, Error::WrongPassphrase),
        || {
            unlock_with(
                &dev,
                &hdr,
                &src,
                o.key_slot,
                key_use,
                &format!("Enter passphrase for {}: ", device),
            )
        },
    )
    .map_err(|e| match e {
        // cryptsetup 2.6 answers a wrong passphrase on a header in reencryption with "No
        // usable keyslot is available." and exit code 1, not its usual exit 2 (pinned by
        // `luks_interop`'s `reencryption_in_progress_is_recognised`).
        Error::WrongPassphrase if hdr.in_reencryption() => Error::NoUsableKeyslot,
        e => e,
    })?;
    if o.verbose {
        eprintln!("Key slot {slot} unlocked.");
    }
    Ok(0)
}

/// The flags named on the command line, in cryptsetup's on-disk spelling.
fn requested_flags(o: &LuksOpts) -> Vec<String> {
    let mut f = Vec::new();
    let pairs = [
        (o.allow_discards, "allow-discards"),
        (o.perf_same_cpu_crypt, "same-cpu-crypt"),
        (o.perf_submit_from_crypt_cpus, "submit-from-crypt-cpus"),
        (o.perf_no_read_workqueue, "no-read-workqueue"),
        (o.perf_no_write_workqueue, "no-write-workqueue"),
        (o.perf_high_priority, "high_priority"),
    ];
    for (on, name) in pairs {
        if on {
            f.push(name.to_string());
        }
    }
    f
}

fn config(device: &Target, o: &LuksOpts) -> Result<i32> {
    let (dev, mut hdr) = load(device, o, true)?;
    hdr.check_requirements()?;
    let Header::Luks2(h) = &mut hdr else {
        return Err(Error::InvalidArgument(
            "config needs a LUKS2 header (LUKS1 has no labels, priorities or flags)".into(),
        ));
    };
    let mut changed = false;
    if let Some(l) = &o.label {
        h.set_label(l)?;
        changed = true;
    }
    if let Some(s) = &o.subsystem {
        h.set_subsystem(s)?;
        changed = true;
    }
    if let Some(p) = &o.priority {
        let slot = o
            .key_slot
            .ok_or_else(|| Error::InvalidArgument("--priority needs --key-slot".into()))?;
        h.set_keyslot_priority(slot, p.parse()?)?;
        changed = true;
    }
    if o.persistent {
        let flags = requested_flags(o);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        h.set_persistent_flags(&flags)?;
        changed = true;
    }
    if !changed {
        println!("Flags: {}", h.flags().join(" "));
        return Ok(0);
    }
    luks::apply(dev.as_ref(), &h.commit()?)?;
    Ok(0)
}

fn repair(device: &Target, o: &LuksOpts) -> Result<i32> {
    // Another format's signature does not stop a repair (the user asked for it).
    let dev = header_dev(device, o, true)?;
    let mut hdr = luks::read_header_to_repair(dev.as_ref()).map_err(|e| match e {
        Error::NotLuks(_) => Error::NotLuks(header_name(device, o)),
        other => other,
    })?;
    print_warnings(&hdr);
    // cryptsetup's repair refuses a header with requirements it does not know, repaired or
    // not.
    hdr.check_known_requirements()?;
    let in_reencryption = matches!(&hdr, Header::Luks2(h)
        if luks::reencrypt::ReencryptState::from_metadata(h.meta()).ok().flatten().is_some());
    if in_reencryption {
        drop(dev);
        return reencrypt::repair_reencryption(device, o);
    }
    match &mut hdr {
        Header::Luks2(h) => {
            if h.repair.is_none() {
                if o.verbose {
                    eprintln!("No known problems detected for LUKS header.");
                }
                return Ok(0);
            }
            hdr.check_requirements()?;
            let Header::Luks2(h) = &mut hdr else {
                return Err(Error::Bug("header changed type"));
            };
            luks::apply(dev.as_ref(), &h.repair_plan()?)?;
            eprintln!("LUKS2 header repaired.");
        }
        Header::Luks1(_) => {
            if o.verbose {
                eprintln!("No known problems detected for LUKS header.");
            }
        }
    }
    Ok(0)
}
