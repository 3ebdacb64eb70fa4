//! `ucrypt serve`: volumes served to NBD clients by the `ucrypt-nbd` server, until SIGINT or
//! SIGTERM.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ucrypt::{BlockDev, Stop};
use ucrypt_nbd::server::{self, dev, load_tls_config, Listen, ServerOptions, TlsFiles};

use crate::daemon::control::{self, ControlArgs};
use crate::error::{CliError, CliResult};
use crate::in_use::InUse;
use crate::metrics::{self, MetricsArgs, Volumes};
use crate::open::VolumeArgs;
use crate::target::Target;

/// `ucrypt serve`: serve volumes to NBD clients.
#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    volume: VolumeArgs,
    /// Where to listen: unix:PATH (socket mode 0600) or tcp:HOST:PORT (TLS required).
    #[arg(long)]
    nbd: Listen,
    /// Export name of VOLUME (default: its file name). It is also the default export.
    #[arg(long = "export-name")]
    export_name: Option<String>,
    /// More exports from the same process, NAME=PATH, opened with the same options.
    #[arg(long = "add-export", value_name = "NAME=PATH")]
    add_export: Vec<String>,
    /// Write the server's process id here once listening (removed on exit).
    #[arg(long)]
    pid_file: Option<PathBuf>,
    /// Server certificate (PEM) for NBD_OPT_STARTTLS.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// Serve TCP without TLS (anyone on the network path sees the plaintext volume).
    #[arg(long)]
    insecure_plaintext: bool,
    /// Serve the files as they are, without encryption (tests and benchmark baseline).
    #[arg(long, conflicts_with = "cipher")]
    unencrypted: bool,
    /// Seconds a connection may sit idle (nothing received, nothing in flight) before a new
    /// client may take its slot when all are taken; idle connections stay while slots are
    /// free.
    #[arg(long, value_name = "SECS", default_value_t = server::IDLE_TIMEOUT_DEFAULT.as_secs_f64())]
    idle_timeout: f64,
    /// Poll for the next request after every request (--spin-us), even on a connection where
    /// polls rarely see one arrive; by default polling pauses there and tries again later.
    #[arg(long)]
    spin_always: bool,
    #[command(flatten)]
    metrics: MetricsArgs,
    // For VOLUME, not the --add-export ones.
    #[command(flatten)]
    control: ControlArgs,
}

/// NBD workers per connection when the volume is remote (see `ServerOptions::workers`).
const REMOTE_WORKERS_PER_CONNECTION: usize = 32;

/// What the server serves, and the volume behind it (none unencrypted).
type Opened = (Arc<dyn BlockDev>, Option<crate::open::Opened>);
/// One export: its name and what was opened for it.
type Export = (String, Arc<dyn BlockDev>, Option<crate::open::Opened>);

/// Opens one export. A remote volume's client gives an unreachable server up within one
/// remote timeout once `stop` is requested, so a stop waits that long at most.
fn open_one(a: &ServeArgs, target: &Target, stop: &Stop) -> CliResult<(Opened, InUse)> {
    let mut v = a.volume.clone();
    v.volume = target.clone();
    v.remote.stop = Some(stop.clone());
    // Marked for as long as it is served: a second server, an offline reencrypt or a format
    // refuses it.
    let marked = if a.unencrypted {
        v.mark_served_unencrypted()?
    } else {
        v.mark_served()?
    };
    if a.unencrypted {
        let ro = a.volume.read_only;
        let backend = target.open_plain(!ro, &v.remote)?;
        return Ok(((Arc::new(dev::PlainDev::new(backend, ro)), None), marked));
    }
    let vol = v.open()?;
    Ok(((vol.dev(), Some(vol)), marked))
}

/// The exports, and the marks that say their volumes are served (held until the end).
fn open_volumes(a: &ServeArgs, stop: &Stop) -> CliResult<(Vec<Export>, Vec<InUse>)> {
    let first = a
        .export_name
        .clone()
        .unwrap_or_else(|| a.volume.volume.label());
    let ((dev, vol), marked) = open_one(a, &a.volume.volume, stop)?;
    let mut out = vec![(first, dev, vol)];
    let mut marks = vec![marked];
    for spec in &a.add_export {
        let (name, target) = spec
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("--add-export '{spec}': expected NAME=PATH")))?;
        let target: Target = target
            .parse()
            .map_err(|e| CliError::Usage(format!("--add-export '{spec}': {e}")))?;
        let ((dev, vol), marked) = open_one(a, &target, stop)?;
        out.push((name.to_string(), dev, vol));
        marks.push(marked);
    }
    Ok((out, marks))
}

pub fn run(a: ServeArgs) -> i32 {
    crate::error::report("serve", serve(a))
}

fn serve(a: ServeArgs) -> CliResult<()> {
    if !a.unencrypted {
        // The volume key lives in this process for its whole life: keep it out of core dumps.
        ucrypt::secret::disable_core_dumps();
    }
    // Before the volumes' threads exist: see crate::signals.
    let stop = crate::signals::stop_on_signals()?;
    let (opened, _served) = open_volumes(&a, &stop)?;
    crate::signals::started();
    let _metrics = match &a.metrics.metrics {
        Some(at) => {
            let vols = opened
                .iter()
                .filter_map(|(n, _, v)| v.clone().map(|v| (n.clone(), v)))
                .collect();
            Some(metrics::start(at, Volumes(vols))?)
        }
        None => None,
    };
    let _control = match opened.first() {
        Some((_, _, Some(v))) => control::start(&a.control, &a.volume, v, "nbd")?,
        _ if a.control.control.is_some() => {
            return Err(CliError::Usage(
                "--control needs an encrypted volume (not --unencrypted)".into(),
            ))
        }
        _ => None,
    };
    let exports = opened.into_iter().map(|(n, d, _)| (n, d)).collect();
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(load_tls_config(&TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: a.tls_ca.clone(),
        })?),
        _ => None,
    };
    let opts = ServerOptions {
        read_only: a.volume.read_only,
        tls,
        insecure_plaintext: a.insecure_plaintext,
        pid_file: a.pid_file.clone(),
        announce: true,
        poll: Duration::from_micros(a.volume.spin_us),
        poll_backoff: !a.spin_always,
        // On remote storage a request waits on the network, not a core: give every request a
        // QD32 client keeps in flight its worker, so that they reach the remote at once.
        workers: if a.volume.volume.is_remote() {
            REMOTE_WORKERS_PER_CONNECTION
        } else {
            server::WORKERS_PER_CONNECTION
        },
        idle_timeout: Duration::try_from_secs_f64(a.idle_timeout).map_err(|_| {
            CliError::Usage(format!("--idle-timeout {}: not a duration", a.idle_timeout))
        })?,
    };
    Ok(server::serve(exports, &a.nbd, opts, stop)?)
}
