//! `ucrypt serve`: volumes served to NBD clients by the `ucrypt-nbd` server, until SIGINT or
//! SIGTERM.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use ucrypt::{BlockDev, Stop};
use ucrypt_nbd::server::{self, dev, load_tls_config, Listen, ServerOptions, TlsFiles};

use crate::daemon::budget::{self, MemoryBudgetArgs};
use crate::daemon::control::{self, ControlArgs, Serving};
use crate::error::{CliError, CliResult};
use crate::in_use::InUse;
use crate::metrics::{self, MetricsArgs, Volumes};
use crate::open::VolumeArgs;
use crate::target::Target;

/// `ucrypt serve`: serve volumes to NBD clients.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// VOLUME and the options after it: the key and open options apply to every VOLUME, and
    /// to every --export that does not give its own.
    #[command(flatten)]
    volume: VolumeArgs,
    /// The format of every VOLUME, as `open --type` takes it: luks (the header decides),
    /// luks1, luks2, plain, tcrypt, bitlk, fvault2, loopaes.
    #[arg(long = "type", short = 'M', value_name = "TYPE")]
    dev_type: Option<crate::open::DeviceType>,
    /// More volumes served by the same process, each its own export named after its file
    /// (two exports of the same name are refused); opened as VOLUME is.
    #[arg(value_name = "VOLUME")]
    more_volumes: Vec<Target>,
    /// Where to listen: unix:PATH (socket mode 0600) or tcp:HOST:PORT (TLS required).
    #[arg(long)]
    nbd: Listen,
    /// Export name of the first VOLUME (default: its file name). It is also the default
    /// export.
    #[arg(long = "export-name")]
    export_name: Option<String>,
    /// One more export with options of its own: name=N,path=P[,key-file=K][,readonly]
    /// [,header=H]. key-file is this volume's passphrase file, read whole, in place of the
    /// shared --key-file, --keyfile-offset, --keyfile-size and --volume-key-file (with
    /// `--type tcrypt`: a TrueCrypt keyfile, repeated for more); header is
    /// its detached LUKS header; readonly serves it read-only. Other options are shared.
    #[arg(long = "export", value_name = "name=N,path=P[,...]")]
    exports: Vec<ExportSpec>,
    /// Short for --export name=NAME,path=PATH.
    #[arg(long = "add-export", value_name = "NAME=PATH", value_parser = ExportSpec::parse_short)]
    add_export: Vec<ExportSpec>,
    /// Most client connections served at once; a client beyond it takes the slot of one idle
    /// for --idle-timeout, else it is refused. An idle connection holds no request buffers
    /// (requests take them from one pool the whole server shares).
    #[arg(long, value_name = "N", default_value_t = server::CONNECTIONS_MAX_DEFAULT)]
    max_connections: usize,
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
    /// client may take its slot when all --max-connections are taken; idle connections stay
    /// while slots are free.
    #[arg(long, value_name = "SECS", default_value_t = server::IDLE_TIMEOUT_DEFAULT.as_secs_f64())]
    idle_timeout: f64,
    /// Poll for the next request after every request (--spin-us), even on a connection where
    /// polls rarely see one arrive; by default polling pauses there and tries again later.
    #[arg(long)]
    spin_always: bool,
    #[command(flatten)]
    pub budget: MemoryBudgetArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    // For the first VOLUME only.
    #[command(flatten)]
    control: ControlArgs,
}

/// One `--export` (or `--add-export`), parsed once at the command line.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportSpec {
    name: String,
    path: Target,
    /// This volume's passphrase file (TCRYPT: its keyfiles), in place of the shared key
    /// options.
    key_files: Vec<String>,
    read_only: bool,
    /// This volume's detached LUKS header.
    header: Option<PathBuf>,
}

impl ExportSpec {
    /// `--add-export NAME=PATH`.
    fn parse_short(s: &str) -> Result<ExportSpec, String> {
        let (name, path) = s
            .split_once('=')
            .ok_or_else(|| format!("'{s}': expected NAME=PATH"))?;
        ExportSpec::named(name, path)
    }

    fn named(name: &str, path: &str) -> Result<ExportSpec, String> {
        if name.is_empty() {
            return Err("an empty export name".into());
        }
        Ok(ExportSpec {
            name: name.to_string(),
            path: path.parse()?,
            key_files: Vec::new(),
            read_only: false,
            header: None,
        })
    }
}

impl FromStr for ExportSpec {
    type Err = String;
    /// `name=N,path=P[,key-file=K][,readonly][,header=H]`, in any order, each key once but
    /// key-file (TCRYPT's keyfiles; any other type refuses more than one when it opens).
    fn from_str(s: &str) -> Result<ExportSpec, String> {
        let (mut name, mut path, mut header, mut read_only) = (None, None, None, false);
        let mut key_files = Vec::new();
        for item in s.split(',') {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            let slot = match (key, value) {
                ("readonly", None) if !read_only => {
                    read_only = true;
                    continue;
                }
                ("readonly", None) => return Err("'readonly' given twice".into()),
                ("readonly", Some(_)) => return Err("'readonly' takes no value".into()),
                ("name", _) => &mut name,
                ("path", _) => &mut path,
                ("key-file", Some(v)) if !v.is_empty() => {
                    key_files.push(v.to_string());
                    continue;
                }
                ("key-file", _) => return Err("'key-file' needs a value".into()),
                ("header", _) => &mut header,
                _ => {
                    return Err(format!(
                        "unknown key '{key}' (expected name, path, key-file, readonly, header)"
                    ))
                }
            };
            let value = value
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("'{key}' needs a value"))?;
            if slot.replace(value).is_some() {
                return Err(format!("'{key}' given twice"));
            }
        }
        let (Some(name), Some(path)) = (name, path) else {
            return Err("name=N and path=P are both needed".into());
        };
        let mut spec = ExportSpec::named(name, path)?;
        spec.key_files = key_files;
        spec.header = header.map(PathBuf::from);
        spec.read_only = read_only;
        Ok(spec)
    }
}

/// NBD workers per connection when the volume is remote (see `ServerOptions::workers`).
const REMOTE_WORKERS_PER_CONNECTION: usize = 32;

/// What the server serves, and the volume behind it (none unencrypted).
type Opened = (Arc<dyn BlockDev>, Option<crate::open::Opened>);
/// One export: its name and what was opened for it.
type Export = (String, Arc<dyn BlockDev>, Option<crate::open::Opened>);

/// Opens one export from `v` (its volume and options). A remote volume's client gives an
/// unreachable server up within one remote timeout once `stop` is requested, so a stop waits
/// that long at most.
fn open_one(a: &ServeArgs, mut v: VolumeArgs, stop: &Stop) -> CliResult<(Opened, InUse)> {
    v.remote.stop = Some(stop.clone());
    // Marked for as long as it is served: a second server, an offline reencrypt or a format
    // refuses it.
    let marked = if a.unencrypted {
        v.mark_served_unencrypted()?
    } else {
        v.mark_served()?
    };
    if a.unencrypted {
        let ro = v.read_only;
        let backend = v.volume.open_plain(!ro, &v.remote)?;
        return Ok(((Arc::new(dev::PlainDev::new(backend, ro)), None), marked));
    }
    let vol = v.open()?;
    Ok(((vol.dev(), Some(vol)), marked))
}

/// Every export to open, named, with its options: the VOLUMEs with the shared options, then
/// each --export and --add-export with its own. Two of the same name are refused before any
/// is opened.
fn plan(a: &ServeArgs) -> CliResult<Vec<(String, VolumeArgs)>> {
    let first = a
        .export_name
        .clone()
        .unwrap_or_else(|| a.volume.volume.label());
    let mut out = vec![(first, a.volume.clone())];
    for t in &a.more_volumes {
        let mut v = a.volume.clone();
        v.volume = t.clone();
        out.push((t.label(), v));
    }
    if a.volume.header.is_some() && !a.more_volumes.is_empty() {
        return Err(CliError::Usage(
            "--header is one volume's header, and several VOLUMEs are given: give each its \
             own with --export name=N,path=P,header=H"
                .into(),
        ));
    }
    for e in a.exports.iter().chain(&a.add_export) {
        let mut v = a.volume.clone();
        v.volume = e.path.clone();
        v.header = e.header.clone();
        v.read_only |= e.read_only;
        if !e.key_files.is_empty() {
            v.key_files = e.key_files.clone();
            v.keyfile_offset = None;
            v.keyfile_size = None;
            v.volume_key_file = None;
            v.passphrase_read = None;
        }
        out.push((e.name.clone(), v));
    }
    for (i, (name, v)) in out.iter().enumerate() {
        if let Some((_, w)) = out[..i].iter().find(|(n, _)| n == name) {
            return Err(CliError::Usage(format!(
                "export name '{name}' is given twice ({} and {}): name one with --export \
                 name=N,path=P",
                w.volume, v.volume
            )));
        }
    }
    Ok(out)
}

/// Opens every export, or none: the first that fails names its volume in the error, and
/// those opened before it are closed again.
fn open_volumes(a: &ServeArgs, stop: &Stop) -> CliResult<(Vec<Export>, Vec<InUse>)> {
    let mut plan = plan(a)?;
    // A passphrase on stdin can be read once: read it once for every volume that shares it.
    let shared_stdin = plan
        .iter()
        .filter(|(_, v)| v.key_file() == Some("-") && v.passphrase_read.is_none())
        .count();
    if shared_stdin > 1
        && a.volume.key_file() == Some("-")
        && a.volume.cipher.is_none()
        && !a.unencrypted
    {
        let p = Arc::new(a.volume.read_passphrase()?);
        for (_, v) in plan.iter_mut() {
            if v.key_file() == Some("-") {
                v.passphrase_read = Some(p.clone());
            }
        }
    }
    let (mut out, mut marks) = (Vec::new(), Vec::new());
    for (name, v) in plan {
        let what = v.volume.to_string();
        let ((dev, vol), marked) = open_one(a, v, stop).map_err(|e| named(e, &what))?;
        out.push((name, dev, vol));
        marks.push(marked);
    }
    Ok((out, marks))
}

/// `e` named as being about `volume`, unless it already names it.
fn named(e: CliError, volume: &str) -> CliError {
    if e.to_string().contains(volume) {
        e
    } else {
        e.at(volume)
    }
}

pub fn run(a: ServeArgs) -> i32 {
    crate::error::report("serve", serve(a))
}

fn serve(mut a: ServeArgs) -> CliResult<()> {
    crate::daemon::check_type(a.dev_type, a.volume.cipher.is_some())?;
    a.volume.device_type = a.dev_type;
    if !a.unencrypted {
        // The volume key lives in this process for its whole life: keep it out of core dumps.
        ucrypt::secret::disable_core_dumps();
    }
    // Before the volumes' threads exist: see crate::signals.
    let stop = crate::signals::stop_on_signals()?;
    // Before the volumes' pools are made: every volume served here charges this share.
    budget::join_own(&a.budget)?;
    let (opened, _served) = open_volumes(&a, &stop)?;
    crate::signals::started();
    let _metrics = match &a.metrics.metrics {
        Some(at) => {
            let vols = opened
                .iter()
                .filter_map(|(n, _, v)| v.clone().map(|v| (n.clone(), v)))
                .collect();
            Some(metrics::start(at, Volumes::new(vols))?)
        }
        None => None,
    };
    let _control = match opened.first() {
        Some((_, _, Some(v))) => control::start(&a.control, &a.volume, v, Serving::Nbd)?,
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
        workers: if std::iter::once(&a.volume.volume)
            .chain(&a.more_volumes)
            .chain(a.exports.iter().chain(&a.add_export).map(|e| &e.path))
            .any(Target::is_remote)
        {
            REMOTE_WORKERS_PER_CONNECTION
        } else {
            server::WORKERS_PER_CONNECTION
        },
        idle_timeout: Duration::try_from_secs_f64(a.idle_timeout).map_err(|_| {
            CliError::Usage(format!("--idle-timeout {}: not a duration", a.idle_timeout))
        })?,
        connections_max: a.max_connections,
    };
    Ok(server::serve(exports, &a.nbd, opts, stop)?)
}
