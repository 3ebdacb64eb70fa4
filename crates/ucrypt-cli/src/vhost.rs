//! `ucrypt vhost VOLUME --socket PATH`: the volume as a VM's virtio-blk disk over
//! vhost-user-blk, served by `ucrypt-vhost` until SIGINT or SIGTERM; with `--control`, a
//! `resize` sends the VMM a config-change notice as the `ucrypt open` daemon does.

use std::path::PathBuf;

use clap::Args;
use ucrypt_vhost::VhostOptions;

use crate::daemon::budget::{self, MemoryBudgetArgs};
use crate::daemon::control::{self, ControlArgs, Serving};
use crate::error::CliResult;
use crate::metrics::{self, MetricsArgs, Volumes};
use crate::open::VolumeArgs;

#[derive(Args)]
pub struct VhostArgs {
    #[command(flatten)]
    volume: VolumeArgs,
    /// The vhost-user socket the VMM connects to (created mode 0600; an existing one is
    /// replaced).
    #[arg(long)]
    socket: PathBuf,
    /// Virtqueues offered, each served by its own thread (default: one per CPU).
    #[arg(long)]
    queues: Option<u16>,
    /// The disk's serial number as the guest sees it (first 20 bytes; default: the volume's
    /// file name).
    #[arg(long)]
    serial: Option<String>,
    #[command(flatten)]
    pub budget: MemoryBudgetArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    control: ControlArgs,
}

pub fn run(a: VhostArgs) -> i32 {
    crate::error::report("vhost", serve(a))
}

fn serve(a: VhostArgs) -> CliResult<()> {
    // The volume key lives in this process for its whole life: keep it out of core dumps.
    ucrypt::secret::disable_core_dumps();
    // Before the volume's threads exist: see crate::signals.
    let stop = crate::signals::stop_on_signals()?;
    // Before the volume's pools are made.
    budget::join_own(&a.budget)?;
    // Marked for as long as it is served: a second server, an offline reencrypt or a format
    // refuses it.
    let _served = a.volume.mark_served()?;
    let dev = a.volume.open()?;
    crate::signals::started();
    let _metrics = match &a.metrics.metrics {
        Some(at) => Some(metrics::start(at, Volumes::one(&a.volume, &dev))?),
        None => None,
    };
    let mut opts = VhostOptions::default();
    // The control socket's `resize` tells the VMM through the handle `run` serves with.
    let serving = Serving::Vhost(opts.handle.clone());
    let _control = control::start(&a.control, &a.volume, &dev, serving)?;
    if let Some(q) = a.queues {
        opts.queues = usize::from(q.max(1));
    }
    // Discards are offered where the volume passes them on (allow-discards), as dm-crypt does.
    opts.discard = dev.engine().is_some_and(|v| v.allow_discards());
    opts.id = ucrypt_vhost::id_of(&a.serial.unwrap_or_else(|| a.volume.volume.label()));
    Ok(ucrypt_vhost::run(dev.dev(), &a.socket, opts, &stop)?)
}
