//! `ucrypt mount VOLUME MOUNTPOINT`: the decrypted volume as one regular file over FUSE, which
//! `losetup` (also `--direct-io=on`) attaches, `mkfs` formats and VMs use as a disk.

use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use clap::{Args, ValueEnum};
use ucrypt_fuse::{MountOptions, PunchHole, Transport};

use crate::daemon::budget::{self, MemoryBudgetArgs};
use crate::daemon::control::{self, ControlArgs, Serving};
use crate::error::CliResult;
use crate::metrics::{self, MetricsArgs, Volumes};
use crate::open::VolumeArgs;

#[derive(Args, Debug)]
pub struct MountArgs {
    #[command(flatten)]
    volume: VolumeArgs,
    /// The volume's format, as `open --type` takes it: luks (the header decides), luks1,
    /// luks2, plain, tcrypt, bitlk, fvault2, loopaes.
    #[arg(long = "type", short = 'M', value_name = "TYPE")]
    dev_type: Option<crate::open::DeviceType>,
    /// A regular file (becomes the volume; created if missing, and then removed on unmount) or
    /// a directory (the volume appears in it as --file-name, by default its own file name).
    mountpoint: PathBuf,
    /// Serve the volume as MOUNTPOINT/NAME instead of on MOUNTPOINT itself.
    #[arg(long)]
    file_name: Option<String>,
    /// Classic FUSE worker threads (0 = one per CPU); io_uring runs one per CPU queue.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Allow users other than the mounting one.
    #[arg(long)]
    allow_other: bool,
    /// Bypass the kernel page cache for every open of the file.
    #[arg(long)]
    direct_io: bool,
    /// Serve PUNCH_HOLE as a discard of the ciphertext (the range then reads as garbage, which
    /// breaks loop devices' write-zeroes). Default: PUNCH_HOLE writes zeroes.
    #[arg(long)]
    punch_hole_discards: bool,
    /// How requests travel between the kernel and ucrypt: auto = FUSE-over-io_uring when the
    /// kernel has it enabled (/sys/module/fuse/parameters/enable_uring = Y), else classic
    /// /dev/fuse; io-uring fails, saying why, when it is unavailable.
    #[arg(long, value_enum, default_value_t = FuseTransport::Auto)]
    fuse_transport: FuseTransport,
    #[command(flatten)]
    pub budget: MemoryBudgetArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    control: ControlArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum FuseTransport {
    Auto,
    Classic,
    IoUring,
}

pub fn run(a: MountArgs) -> i32 {
    crate::error::report("mount", mount(a))
}

/// What the mount point is when the command starts.
enum MountPoint {
    /// Missing: created as an empty file for the mount, removed after it.
    Created,
    /// A directory without --file-name: the volume appears in it under its own file name.
    Directory(String),
    /// As given (a regular file, or a directory with --file-name).
    AsGiven,
}

/// Makes `ucrypt mount vol.img ./plain` work as typed: a missing mount point becomes a new
/// empty file (removed again on unmount), and a directory serves a file named after the volume.
fn prepare_mount_point(a: &MountArgs) -> CliResult<MountPoint> {
    let at = &a.mountpoint;
    match std::fs::symlink_metadata(at) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(at)
                .map_err(|e| {
                    ucrypt::Error::io(format!("creating mount point {}", at.display()), e)
                })?;
            Ok(MountPoint::Created)
        }
        Err(e) => Err(ucrypt::Error::io(format!("mount point {}", at.display()), e).into()),
        Ok(m) if m.is_dir() && a.file_name.is_none() => {
            Ok(MountPoint::Directory(a.volume.volume.label()))
        }
        Ok(_) => Ok(MountPoint::AsGiven),
    }
}

fn mount(mut a: MountArgs) -> CliResult<()> {
    crate::daemon::check_type(a.dev_type, a.volume.cipher.is_some())?;
    a.volume.device_type = a.dev_type;
    // Before the volume's threads exist: see crate::signals.
    let stop = crate::signals::stop_on_signals()?;
    let point = prepare_mount_point(&a)?;
    if let MountPoint::Created = point {
        crate::signals::remove_if_interrupted(a.mountpoint.clone());
    }
    let r = serve(&a, &point, &stop);
    if let MountPoint::Created = point {
        // Unmounted (or never mounted): the empty file we made goes again.
        let _ = std::fs::remove_file(&a.mountpoint);
    }
    r
}

fn serve(a: &MountArgs, point: &MountPoint, stop: &ucrypt::Stop) -> CliResult<()> {
    // Before the volume's pools are made.
    budget::join_own(&a.budget)?;
    // Marked for as long as it is served: an offline reencrypt or a format refuses it.
    let _served = a.volume.mark_served()?;
    let dev = a.volume.open()?;
    crate::signals::started();
    let _metrics = match &a.metrics.metrics {
        Some(at) => Some(metrics::start(at, Volumes::one(&a.volume, &dev))?),
        None => None,
    };
    // The control socket's `resize` tells the kernel through the mount's notifier, set once
    // the file is mounted.
    let notifier = Arc::new(OnceLock::new());
    let serving = Serving::Fuse(notifier.clone());
    let _control = control::start(&a.control, &a.volume, &dev, serving)?;
    let file_name = match point {
        MountPoint::Directory(n) => Some(n.clone()),
        _ => a.file_name.clone(),
    };
    let opts = MountOptions {
        file_name,
        threads: a.threads,
        allow_other: a.allow_other,
        direct_io: a.direct_io,
        punch_hole: if a.punch_hole_discards {
            PunchHole::Discard
        } else {
            PunchHole::Zeroes
        },
        fs_name: format!("ucrypt:{}", a.volume.volume),
        transport: match a.fuse_transport {
            FuseTransport::Auto => Transport::Auto,
            FuseTransport::Classic => Transport::Classic,
            FuseTransport::IoUring => Transport::IoUring,
        },
    };
    ucrypt_fuse::serve(dev.dev(), &a.mountpoint, &opts, stop, |m| {
        let _ = notifier.set(m.size_notifier());
    })?;
    Ok(())
}
