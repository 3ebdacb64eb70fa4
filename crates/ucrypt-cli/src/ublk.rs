//! `ucrypt ublk VOLUME`: the volume as `/dev/ublkbN`, served by `ucrypt-ublk` until SIGINT or
//! SIGTERM.

use clap::Args;
use ucrypt_ublk::UblkOptions;

use crate::error::CliResult;
use crate::open::VolumeArgs;

#[derive(Args)]
pub struct UblkArgs {
    #[command(flatten)]
    volume: VolumeArgs,
    /// Hardware queues (default: one per CPU).
    #[arg(long)]
    queues: Option<u16>,
}

pub fn run(a: UblkArgs) -> i32 {
    crate::error::report("ublk", serve(a))
}

fn serve(a: UblkArgs) -> CliResult<()> {
    // Before the volume's threads exist: see crate::signals.
    let stop = crate::signals::stop_on_signals()?;
    let dev = a.volume.open()?;
    let mut opts = UblkOptions::default();
    if let Some(q) = a.queues {
        opts.queues = q;
    }
    Ok(ucrypt_ublk::run(dev, opts, &stop)?)
}
