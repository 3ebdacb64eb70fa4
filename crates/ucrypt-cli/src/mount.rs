//! `ucrypt mount VOLUME MOUNTPOINT`: the decrypted volume as one regular file over FUSE, which
//! `losetup` (also `--direct-io=on`) attaches, `mkfs` formats and VMs use as a disk.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use ucrypt_fuse::{MountOptions, PunchHole, Transport};

use crate::error::CliResult;
use crate::open::VolumeArgs;

#[derive(Args, Debug)]
pub struct MountArgs {
    #[command(flatten)]
    volume: VolumeArgs,
    /// A regular file (becomes the volume) or, with --file-name, a directory.
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

fn mount(a: MountArgs) -> CliResult<()> {
    // Before the volume's threads exist: see crate::signals.
    let stop = crate::signals::stop_on_signals()?;
    let dev = a.volume.open()?;
    let opts = MountOptions {
        file_name: a.file_name,
        threads: a.threads,
        allow_other: a.allow_other,
        direct_io: a.direct_io,
        punch_hole: if a.punch_hole_discards {
            PunchHole::Discard
        } else {
            PunchHole::Zeroes
        },
        fs_name: format!("ucrypt:{}", a.volume.volume.display()),
        transport: match a.fuse_transport {
            FuseTransport::Auto => Transport::Auto,
            FuseTransport::Classic => Transport::Classic,
            FuseTransport::IoUring => Transport::IoUring,
        },
    };
    ucrypt_fuse::mount(dev, &a.mountpoint, &opts, &stop)?;
    Ok(())
}
