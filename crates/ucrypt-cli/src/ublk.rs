//! `ucrypt ublk VOLUME`: the volume as `/dev/ublkbN`, served by `ucrypt-ublk` until SIGINT or
//! SIGTERM.

use clap::Args;
use ucrypt_ublk::UblkOptions;

use crate::daemon::budget::{self, MemoryBudgetArgs};
use crate::daemon::control::{self, ControlArgs, Serving};
use crate::error::CliResult;
use crate::metrics::{self, MetricsArgs, Volumes};
use crate::open::VolumeArgs;

#[derive(Args)]
pub struct UblkArgs {
    #[command(flatten)]
    volume: VolumeArgs,
    /// Hardware queues (default: one per CPU).
    #[arg(long)]
    queues: Option<u16>,
    #[command(flatten)]
    pub budget: MemoryBudgetArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    control: ControlArgs,
}

pub fn run(a: UblkArgs) -> i32 {
    crate::error::report("ublk", serve(a))
}

fn serve(a: UblkArgs) -> CliResult<()> {
    // Before the volume's threads exist: see crate::signals.
    let stop = crate::signals::stop_on_signals()?;
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
    let _control = control::start(&a.control, &a.volume, &dev, Serving::Ublk)?;
    let mut opts = UblkOptions::default();
    if let Some(q) = a.queues {
        opts.queues = q;
    }
    Ok(ucrypt_ublk::run(dev.dev(), opts, &stop)?)
}
