//! Opening a volume from command-line arguments: the one place the CLI turns a path and
//! options into an `Arc<dyn BlockDev>` for a front end (NBD, FUSE, ublk) or a data verb.
//!
//! Raw mode (`--cipher` with `--volume-key-file`) mirrors `cryptsetup open --type plain`:
//! `--offset` is the data start and `--skip` the IV offset, both in 512-byte sectors.
//! Without `--cipher` the volume is LUKS1/LUKS2, unlocked like `cryptsetup open`: passphrase
//! from `--key-file` (or asked), or `--volume-key-file`; `--header` for a detached header.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use ucrypt::backend::{DirectMode, FileBackend};
use ucrypt::engine::Policy;
use ucrypt::sector::{CipherSpec, Geometry, SectorSize};
use ucrypt::volume::{Volume, VolumeConfig};
use ucrypt::{BlockDev, SecretBytes};

/// Largest volume key file accepted (a 512-bit key is 64 bytes; leave room for hex forms).
const VOLUME_KEY_FILE_BYTES_MAX: u64 = 4096;

#[derive(Args, Debug, Clone)]
pub struct VolumeArgs {
    /// The volume: an image file or a block device.
    pub volume: PathBuf,
    /// Raw (plain) mode: dm-crypt cipher spec of a volume without a header, e.g. aes-xts-plain64.
    #[arg(long, requires = "volume_key_file")]
    pub cipher: Option<String>,
    /// Raw mode: file holding the volume key (raw bytes).
    #[arg(long)]
    pub volume_key_file: Option<PathBuf>,
    /// Raw mode: encryption sector size in bytes (512, 1024, 2048, 4096).
    #[arg(long, default_value_t = 512)]
    pub sector_size: u64,
    /// Raw mode: start of the encrypted data on the device, in 512-byte sectors.
    #[arg(long, short = 'o', default_value_t = 0)]
    pub offset: u64,
    /// Raw mode: IV offset, in 512-byte sectors (cryptsetup's --skip).
    #[arg(long, short = 'p', default_value_t = 0)]
    pub skip: u64,
    /// Raw mode: the IV counts encryption sectors, not 512-byte units.
    #[arg(long)]
    pub iv_large_sectors: bool,
    /// LUKS: passphrase from this file ("-" = stdin); without it the passphrase is asked.
    #[arg(long, short = 'd', conflicts_with = "cipher")]
    pub key_file: Option<String>,
    /// LUKS: skip this many bytes of the key file.
    #[arg(long, conflicts_with = "cipher")]
    pub keyfile_offset: Option<u64>,
    /// LUKS: read at most this many bytes of the key file.
    #[arg(long, conflicts_with = "cipher")]
    pub keyfile_size: Option<u64>,
    /// LUKS: try only this keyslot.
    #[arg(long, conflicts_with = "cipher")]
    pub key_slot: Option<u32>,
    /// LUKS: detached header file.
    #[arg(long, conflicts_with = "cipher")]
    pub header: Option<PathBuf>,
    /// LUKS: pass discards (TRIM) down to the backing store even if the header does not
    /// carry the allow-discards flag. Discards reveal which blocks are unused.
    #[arg(long)]
    pub allow_discards: bool,
    /// Open read-only.
    #[arg(long)]
    pub read_only: bool,
    /// Dispatch policy: inline, parallel, ordered, queued, auto.
    #[arg(long, default_value = "inline")]
    pub policy: String,
    /// How long idle engine workers (and callers waiting for them, and for `serve` an NBD
    /// connection's reader) busy-wait for more work before they sleep, in µs; at most 10000.
    /// 0 never spins: no CPU time after the last request, but each hand-off pays a wake-up
    /// (tens of µs on a VM).
    #[arg(long, value_name = "US", default_value_t = 50)]
    pub spin_us: u64,
}

fn read_volume_key(path: &PathBuf) -> Result<SecretBytes, String> {
    let meta =
        std::fs::metadata(path).map_err(|e| format!("volume key file {}: {e}", path.display()))?;
    if meta.len() > VOLUME_KEY_FILE_BYTES_MAX {
        return Err(format!(
            "volume key file {} is {} bytes; expected a raw key of at most 64",
            path.display(),
            meta.len()
        ));
    }
    let v = std::fs::read(path).map_err(|e| format!("volume key file {}: {e}", path.display()))?;
    Ok(SecretBytes::from_vec(v))
}

impl VolumeArgs {
    pub fn policy(&self) -> Result<Policy, String> {
        self.policy.parse::<Policy>().map_err(|e| e.to_string())
    }

    /// Opens the volume as a block device for a front end.
    pub fn open(&self) -> Result<Arc<dyn BlockDev>, String> {
        // This process is about to hold key material: keep it out of core dumps.
        ucrypt::secret::disable_core_dumps();
        let policy = self.policy()?;
        let Some(cipher) = &self.cipher else {
            // LUKS1/LUKS2: unlock with the passphrase (or --volume-key-file) like cryptsetup open.
            let o = crate::luks_cli::LuksOpts {
                key_file: self.key_file.clone(),
                keyfile_offset: self.keyfile_offset,
                keyfile_size: self.keyfile_size,
                key_slot: self.key_slot,
                header: self.header.clone(),
                volume_key_file: self.volume_key_file.clone(),
                allow_discards: self.allow_discards,
                spin_us: Some(self.spin_us),
                ..Default::default()
            };
            return crate::luks_cli::open_luks_blockdev(&self.volume, &o, !self.read_only, policy)
                .map_err(|e| format!("{}: {e}", self.volume.display()));
        };
        let spec: CipherSpec = cipher.parse().map_err(|e: ucrypt::Error| e.to_string())?;
        let key = read_volume_key(
            self.volume_key_file
                .as_ref()
                .ok_or("--cipher needs --volume-key-file")?,
        )?;
        let geometry = Geometry {
            sector_size: SectorSize::new(self.sector_size).map_err(|e| e.to_string())?,
            iv_offset: self.skip,
            iv_large_sectors: self.iv_large_sectors,
        };
        let backend = FileBackend::open(&self.volume, !self.read_only, DirectMode::Auto)
            .map_err(|e| format!("{}: {e}", self.volume.display()))?;
        let mut cfg = VolumeConfig::new(spec, key, geometry);
        cfg.data_offset_bytes = self.offset.checked_mul(512).ok_or("--offset too large")?;
        cfg.policy = policy;
        cfg.spin = std::time::Duration::from_micros(self.spin_us);
        cfg.read_only = self.read_only;
        let vol = Volume::new(Arc::new(backend), cfg)
            .map_err(|e| format!("{}: {e}", self.volume.display()))?;
        Ok(Arc::new(vol))
    }
}
