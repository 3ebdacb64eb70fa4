//! What a verb that opens a volume takes on its command line ([`VolumeArgs`], flattened into
//! each such verb) and cryptsetup's `--type` ([`DeviceType`]): parsed once here; `open.rs`
//! turns them into the library's open request, and the foreign formats' modules (`bitlk`,
//! `fvault2`, `loopaes`) read the options they use from them.

use std::path::PathBuf;

use clap::Args;
use ucrypt::backend::CacheMode;
use ucrypt::engine::Policies;
use ucrypt::luks;
use ucrypt::{Error, SecretBytes};

use crate::target::{RemoteArgs, Target};

/// cryptsetup's `--type` for `open`: what the volume is. Parsed once here; a type ucrypt does
/// not read is refused by name before anything is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceType {
    /// LUKS of either version, as the header says.
    Luks,
    Luks1,
    Luks2,
    /// No header: a raw dm-crypt mapping (`--cipher`, `--volume-key-file`).
    Plain,
    /// TrueCrypt/VeraCrypt (`crate::formats`).
    Tcrypt,
    /// BitLocker (`crate::bitlk`).
    Bitlk,
    /// FileVault2 (`crate::fvault2`).
    Fvault2,
    /// loop-AES (`crate::loopaes`).
    Loopaes,
}

impl std::str::FromStr for DeviceType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "luks" => Ok(DeviceType::Luks),
            "luks1" => Ok(DeviceType::Luks1),
            "luks2" => Ok(DeviceType::Luks2),
            "plain" => Ok(DeviceType::Plain),
            "tcrypt" => Ok(DeviceType::Tcrypt),
            "bitlk" => Ok(DeviceType::Bitlk),
            "fvault2" => Ok(DeviceType::Fvault2),
            "loopaes" => Ok(DeviceType::Loopaes),
            _ => Err(format!(
                "unknown device type '{s}' (cryptsetup's types: luks, luks1, luks2, plain, \
                 tcrypt, bitlk, fvault2, loopaes)"
            )),
        }
    }
}

impl DeviceType {
    /// cryptsetup's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::Luks => "luks",
            DeviceType::Luks1 => "luks1",
            DeviceType::Luks2 => "luks2",
            DeviceType::Plain => "plain",
            DeviceType::Tcrypt => "tcrypt",
            DeviceType::Bitlk => "bitlk",
            DeviceType::Fvault2 => "fvault2",
            DeviceType::Loopaes => "loopaes",
        }
    }

    /// Refuses a LUKS header of another version than the type names, as cryptsetup's
    /// `crypt_load` with that type does ("not a valid LUKS device", exit 1), saying which it
    /// is.
    pub fn check_header(self, hdr: &luks::Header, device: &str) -> ucrypt::Result<()> {
        let want = match self {
            DeviceType::Luks1 => 1,
            DeviceType::Luks2 => 2,
            _ => return Ok(()),
        };
        if hdr.version() == want {
            return Ok(());
        }
        Err(Error::NotLuks(format!(
            "{device} (it is LUKS{}, and --type {} was given)",
            hdr.version(),
            self.name()
        )))
    }
}

#[derive(Args, Debug, Clone)]
pub struct VolumeArgs {
    /// The volume: an image file, a block device, or an RBD image (rbd:POOL/IMAGE[@SNAP]).
    pub volume: Target,
    /// Raw (plain) mode: dm-crypt cipher spec of a volume without a header, e.g. aes-xts-plain64,
    /// serpent-xts-plain64, aes-lrw-benbi, xchacha12,aes-adiantum-plain64 (with `--type
    /// plain` and no --cipher: cryptsetup 2.6's aes-cbc-essiv:sha256). `--type tcrypt`: only
    /// cipher chains whose name contains this.
    #[arg(long, short = 'c')]
    pub cipher: Option<String>,
    /// The volume key (raw bytes) from this file, instead of a passphrase; exactly the key's
    /// size is read (the header's, or in raw mode --key-size), so /dev/urandom works.
    #[arg(long)]
    pub volume_key_file: Option<PathBuf>,
    /// Raw mode: the key's size in bits (default: 256 from a passphrase or key file, as
    /// cryptsetup's plain mode; the cipher's with --volume-key-file, 512 for aes-xts-plain64).
    #[arg(long, short = 's')]
    pub key_size: Option<u32>,
    /// Plain mode: how a passphrase becomes the key: a hash (default ripemd160), `plain`
    /// (the passphrase itself), or HASH:LEN (LEN bytes of hash, zeros after). A key file is
    /// the key itself and is never hashed. `--type tcrypt`: only KDFs whose hash name
    /// contains this.
    #[arg(long, short = 'h', value_name = "HASH")]
    pub hash: Option<String>,
    /// Raw mode: encryption sector size in bytes (512, 1024, 2048, 4096).
    #[arg(long, default_value_t = 512)]
    pub sector_size: u64,
    /// Raw mode: start of the encrypted data on the device, in 512-byte sectors.
    #[arg(long, short = 'o', default_value_t = 0)]
    pub offset: u64,
    /// Raw mode: IV offset, in 512-byte sectors (cryptsetup's --skip; default 0, for
    /// `--type loopaes` the --offset).
    #[arg(long, short = 'p')]
    pub skip: Option<u64>,
    /// Raw mode: map only this many 512-byte sectors from --offset (cryptsetup's --size);
    /// default: to the end of the device.
    #[arg(long, short = 'b', value_name = "SECTORS")]
    pub size: Option<u64>,
    /// Raw mode: --size in bytes, a multiple of 512 (cryptsetup's --device-size); read
    /// through [`VolumeArgs::size_sectors`].
    #[arg(
        long = "device-size",
        value_name = "BYTES",
        conflicts_with = "size",
        value_parser = device_size_sectors
    )]
    pub device_size_sectors: Option<u64>,
    /// Raw mode: the IV counts encryption sectors, not 512-byte units.
    #[arg(long)]
    pub iv_large_sectors: bool,
    /// Passphrase from this file ("-" = stdin); without it the passphrase is asked. Plain
    /// mode: the file holds the key itself (exactly the key's size is read). `--type
    /// tcrypt`: a TrueCrypt keyfile, repeated for more (each one's first MiB goes into the
    /// keyfile pool; the passphrase is still read from standard input or the terminal). Any
    /// other type takes one.
    #[arg(id = "key_file", long = "key-file", short = 'd')]
    pub key_files: Vec<String>,
    /// Skip this many bytes of the key file.
    #[arg(long)]
    pub keyfile_offset: Option<u64>,
    /// Read at most this many bytes of the key file (plain mode: of stdin).
    #[arg(long, short = 'l')]
    pub keyfile_size: Option<u64>,
    /// LUKS: try only this keyslot.
    #[arg(long, short = 'S', conflicts_with = "cipher")]
    pub key_slot: Option<u32>,
    /// LUKS: detached header file.
    #[arg(long, conflicts_with = "cipher")]
    pub header: Option<PathBuf>,
    /// LUKS: pass discards (TRIM) down to the backing store even if the header does not
    /// carry the allow-discards flag. Discards reveal which blocks are unused.
    #[arg(long)]
    pub allow_discards: bool,
    /// Open read-only (`--readonly` as cryptsetup spells it).
    #[arg(long, short = 'r', alias = "readonly")]
    pub read_only: bool,
    /// Dispatch policy: inline, parallel, ordered, queued, auto (inline for small requests,
    /// split across cores for large ones when a core is idle), or one per direction,
    /// `read=P,write=Q`. Default: auto, but a direction a LUKS2 header flags
    /// no-read-workqueue or no-write-workqueue (`config --persistent`) runs inline.
    #[arg(long, value_name = "POLICY")]
    pub policy: Option<Policies>,
    /// Reads run inline, whatever --policy says (dm-crypt's flag: no read workqueue).
    #[arg(long = "perf-no_read_workqueue")]
    pub perf_no_read_workqueue: bool,
    /// Writes run inline, whatever --policy says (dm-crypt's flag: no write workqueue).
    #[arg(long = "perf-no_write_workqueue")]
    pub perf_no_write_workqueue: bool,
    /// How long idle engine workers (and callers waiting for them, and for `serve` an NBD
    /// connection's reader) busy-wait for more work before they sleep, in µs; at most 10000.
    /// 0 never spins: no CPU time after the last request, but each hand-off pays a wake-up
    /// (tens of µs on a VM).
    #[arg(long, value_name = "US", default_value_t = 50)]
    pub spin_us: u64,
    /// A local volume's use of the host's page cache, as qemu spells it: none (O_DIRECT; the
    /// default: whoever reads the plaintext caches it already), writeback (page cache, durable
    /// at a flush), writethrough (page cache, every write durable), directsync (O_DIRECT,
    /// every write durable), unsafe (flushes ignored: scratch volumes only).
    #[arg(long, value_name = "MODE", default_value_t = CacheMode::None)]
    pub cache: CacheMode,
    /// Authenticated volumes: write in dm-integrity's direct mode (no journal: faster, but a
    /// crash mid-write may leave blocks that fail authentication), as cryptsetup's open does.
    /// Without it, writes go through the journal (unless the header's persistent flags say
    /// `no-journal`).
    #[arg(long)]
    pub integrity_no_journal: bool,
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// The passphrase, already read (`ucrypt open` of a remote volume reads it before it
    /// forks, and the daemon connects and unlocks with it): used instead of asking again.
    #[command(flatten)]
    pub token: crate::token::TokenOpts,
    #[arg(skip)]
    pub passphrase_read: Option<std::sync::Arc<SecretBytes>>,
    /// `ucrypt open --tries`: how many times a passphrase typed on a terminal is asked for.
    #[arg(skip)]
    pub tries: Option<u32>,
    /// `ucrypt open --type luks1|luks2`: the LUKS version the header must have.
    #[arg(skip)]
    pub device_type: Option<DeviceType>,
    /// `ucrypt open --type plain --shared`: a mapping beside others of the same volume.
    #[arg(skip)]
    pub shared: bool,
    #[command(flatten)]
    pub tcrypt: crate::formats::TcryptArgs,
}

impl VolumeArgs {
    /// `--size`, or `--device-size` in sectors (clap lets one of them through).
    pub fn size_sectors(&self) -> Option<u64> {
        self.size.or(self.device_size_sectors)
    }

    /// The `--key-file` of a format that takes one: every path that reads it runs after
    /// [`key_files_refusal`] has refused more than one for such a format.
    pub fn key_file(&self) -> Option<&str> {
        self.key_files.first().map(String::as_str)
    }
}

/// cryptsetup's rule for `--key-file`: only TCRYPT takes more than one (its keyfile pool).
pub fn key_files_refusal(
    key_files: &[String],
    dev_type: Option<DeviceType>,
) -> Option<&'static str> {
    (key_files.len() > 1 && dev_type != Some(DeviceType::Tcrypt))
        .then_some("Only one --key-file argument is allowed.")
}

/// `--device-size SIZE` in 512-byte sectors: not 0, a multiple of 512 (cryptsetup's checks,
/// made before anything runs). SIZE in bytes, or with cryptsetup's units ([`cryptsetup_size`]).
pub fn device_size_sectors(v: &str) -> Result<u64, String> {
    match cryptsetup_size(v) {
        Ok(0) | Err(_) => Err(format!("Bad number: {v}")),
        Ok(b) if b % 512 != 0 => Err("Device size must be multiple of 512 bytes sector.".into()),
        Ok(b) => Ok(b / 512),
    }
}

/// A size as cryptsetup 2.6.1 reads its size options (`tools_string_to_size`): decimal
/// digits, then optionally a unit: `S` (512-byte sectors), `K`, `M`, `G`, `T` (or `KiB` ...:
/// powers of 1024), `KB`, `MB`, `GB`, `TB` (powers of 1000), either case of the letter.
pub fn cryptsetup_size(v: &str) -> Result<u64, String> {
    let bad = || format!("Bad number: {v}");
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    if digits == 0 {
        return Err(bad());
    }
    let n: u64 = v[..digits].parse().map_err(|_| bad())?;
    let unit = &v[digits..];
    let mut chars = unit.chars();
    let Some(letter) = chars.next() else {
        return Ok(n);
    };
    let base: u64 = match chars.as_str() {
        "" | "iB" => 1024,
        "B" => 1000,
        _ => return Err(bad()),
    };
    let mult = match letter.to_ascii_uppercase() {
        'S' => 512,
        'K' => base,
        'M' => base.pow(2),
        'G' => base.pow(3),
        'T' => base.pow(4),
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_cryptsetup_reads_them() {
        for (v, want) in [
            ("4096", Some(4096)),
            ("8S", Some(4096)),
            ("8s", Some(4096)),
            ("8M", Some(8 << 20)),
            ("8MiB", Some(8 << 20)),
            ("8MB", Some(8_000_000)),
            ("1k", Some(1024)),
            ("2T", Some(2 << 40)),
            ("8B", None),
            ("8Mi", None),
            ("M", None),
            ("-1", None),
            ("8 M", None),
            ("99999999999T", None),
        ] {
            assert_eq!(cryptsetup_size(v).ok(), want, "{v}");
        }
        assert_eq!(device_size_sectors("8M"), Ok(16384));
        assert!(device_size_sectors("1000").is_err());
        assert!(device_size_sectors("0").is_err());
    }
}
