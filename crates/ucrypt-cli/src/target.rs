//! Where a volume lives, as the command line names it, parsed once: a file or block device
//! path, an export of any NBD server (`nbd://HOST[:PORT]/EXPORT`, `nbds://...` with TLS,
//! `nbd+unix:///EXPORT?socket=PATH`, `nbds+unix://...`, as the NBD URI standard spells them),
//! or a Ceph RBD image (`rbd:POOL/IMAGE[@SNAP]`, as qemu spells it). Every verb that
//! names a volume (format, dump, the keyslot verbs, export/import, serve, mount, ublk, open)
//! takes a [`Target`] and opens its ciphertext through [`Target::open_data`] and its header
//! through [`Target::open_header`].

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use ucrypt::backend::{Backend, CacheMode, DirectMode, FileBackend};
use ucrypt::Result;
use ucrypt_nbd::{ClientOptions, NbdBackend, NbdUri};
use ucrypt_rbd::{RbdBackend, RbdSpec, RBD_PREFIX};

/// The URI schemes that name an NBD export.
const NBD_SCHEMES: [&str; 4] = ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://"];

/// An NBD client error as the core's error type, which every verb reports: I/O keeps its OS
/// error (and so its exit code); a server that misbehaves or refuses is an I/O failure of
/// the remote storage, named.
fn core_error(e: ucrypt_nbd::Error) -> ucrypt::Error {
    use ucrypt_nbd::Error as E;
    match e {
        E::Io { context, source } => ucrypt::Error::io(context, source),
        E::Device(d) => d,
        E::Config(m) => ucrypt::Error::InvalidArgument(m),
        other => ucrypt::Error::io(
            "NBD server",
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, other.to_string()),
        ),
    }
}

use crate::header_dev::open_header;

/// How to reach remote storage; ignored for a local path.
#[derive(Args, Debug, Clone, Default)]
pub struct RemoteArgs {
    /// rbd: a Ceph configuration file (default: $CEPH_CONF, then librados' own places).
    #[arg(long, value_name = "FILE")]
    pub rbd_conf: Option<PathBuf>,
    /// rbd: the Ceph client name without `client.` (default: admin).
    #[arg(long, value_name = "NAME")]
    pub rbd_id: Option<String>,
    /// rbd: a keyring file (default: what the configuration says).
    #[arg(long, value_name = "FILE")]
    pub rbd_keyring: Option<PathBuf>,
    /// How long a remote request (or connecting) may wait before it fails with an I/O error,
    /// in seconds (default 30). NBD: also how long a dropped connection may take to come back
    /// (requests in flight are resent).
    #[arg(long, value_name = "SECONDS")]
    pub remote_timeout: Option<u64>,
    /// nbds: CA certificates (PEM) the server's certificate must chain to (default: the
    /// system's).
    #[arg(long, value_name = "FILE")]
    pub remote_tls_ca: Option<PathBuf>,
    /// nbds: client certificate (PEM) for servers that ask for one.
    #[arg(long, value_name = "FILE", requires = "remote_tls_key")]
    pub remote_tls_cert: Option<PathBuf>,
    /// nbds: the client certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "remote_tls_cert")]
    pub remote_tls_key: Option<PathBuf>,
    /// nbd: connections to a server that advertises multi-conn (default: one per core, at
    /// most 8).
    #[arg(long, value_name = "N")]
    pub remote_connections: Option<usize>,
    /// Not an option: the stop of a verb that serves until stopped (`serve`). Once it is
    /// requested, an unreachable NBD server is given up on within one remote timeout, so
    /// that the stop does not wait a remote timeout per flush it still makes.
    #[arg(skip)]
    pub stop: Option<ucrypt::Stop>,
}

/// A volume's location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Path(PathBuf),
    Nbd(Box<NbdUri>),
    Rbd(Box<RbdSpec>),
}

impl FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.is_empty() {
            return Err("an empty volume name".into());
        }
        if NBD_SCHEMES.iter().any(|p| s.starts_with(p)) {
            return NbdUri::parse(s)
                .map(|u| Target::Nbd(Box::new(u)))
                .map_err(|e| e.to_string());
        }
        if s.starts_with(RBD_PREFIX) {
            return RbdSpec::parse(s)
                .map(|r| Target::Rbd(Box::new(r)))
                .map_err(|e| e.to_string());
        }
        Ok(Target::Path(PathBuf::from(s)))
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Path(p) => write!(f, "{}", p.display()),
            Target::Nbd(u) => write!(f, "{u}"),
            Target::Rbd(r) => write!(f, "{r}"),
        }
    }
}

impl From<PathBuf> for Target {
    fn from(p: PathBuf) -> Self {
        Target::Path(p)
    }
}

impl Target {
    /// True for a volume on remote storage (NBD, RBD): requests wait on the network.
    pub fn is_remote(&self) -> bool {
        !matches!(self, Target::Path(_))
    }

    /// A short name: a file's name, or an RBD image's name (export names, metric labels).
    pub fn label(&self) -> String {
        match self {
            Target::Path(p) => p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string()),
            Target::Nbd(u) if !u.export.is_empty() => u.export.clone(),
            Target::Nbd(_) => "nbd".into(),
            Target::Rbd(r) => r.image.clone(),
        }
    }

    fn nbd_options(remote: &RemoteArgs) -> ClientOptions {
        let mut o = ClientOptions {
            tls_ca_file: remote.remote_tls_ca.clone(),
            tls_cert_file: remote.remote_tls_cert.clone(),
            tls_key_file: remote.remote_tls_key.clone(),
            ..ClientOptions::default()
        };
        if let Some(n) = remote.remote_connections {
            o.connections = n;
        }
        if let Some(s) = remote.remote_timeout {
            o.remote_timeout = Duration::from_secs(s.max(1));
        }
        o
    }

    fn nbd(u: &NbdUri, remote: &RemoteArgs) -> Result<Arc<dyn Backend>> {
        let b = NbdBackend::connect(u, &Self::nbd_options(remote)).map_err(core_error)?;
        if let Some(stop) = &remote.stop {
            b.give_up_on(stop);
        }
        Ok(Arc::new(b))
    }

    fn rbd_spec(r: &RbdSpec, writable: bool, remote: &RemoteArgs) -> RbdSpec {
        let mut spec = r.clone();
        let o = &mut spec.options;
        // The command line wins over the spec's `:conf=` suffix, as qemu's options do.
        if remote.rbd_conf.is_some() {
            o.conf = remote.rbd_conf.clone();
        }
        if remote.rbd_id.is_some() {
            o.id = remote.rbd_id.clone();
        }
        if remote.rbd_keyring.is_some() {
            o.keyring = remote.rbd_keyring.clone();
        }
        if let Some(s) = remote.remote_timeout {
            o.remote_timeout = Duration::from_secs(s.max(1));
        }
        o.read_only = o.read_only || !writable;
        spec
    }

    /// The ciphertext, for the data path: a local file or device in the cache mode asked for
    /// (default: O_DIRECT when the filesystem allows it), or the remote image (which has its
    /// own cache settings: librbd's `rbd_cache`, the NBD server's).
    pub fn open_data(
        &self,
        writable: bool,
        remote: &RemoteArgs,
        cache: CacheMode,
    ) -> Result<Arc<dyn Backend>> {
        Ok(match self {
            Target::Path(p) => Arc::new(FileBackend::open_cached(p, writable, cache)?),
            Target::Nbd(u) => Self::nbd(u, remote)?,
            Target::Rbd(r) => Arc::new(RbdBackend::open(&Self::rbd_spec(r, writable, remote))?),
        })
    }

    /// The bytes as they are, for `serve --unencrypted`: a local file buffered (NBD clients
    /// send 512-byte units from any memory), or the remote image.
    pub fn open_plain(&self, writable: bool, remote: &RemoteArgs) -> Result<Arc<dyn Backend>> {
        Ok(match self {
            Target::Path(p) => Arc::new(FileBackend::open(p, writable, DirectMode::Never)?),
            other => other.open_data(writable, remote, CacheMode::None)?,
        })
    }

    /// The device a LUKS header is read from and written to: a local one under cryptsetup's
    /// lock (shared to read, exclusive to update), or the remote image (which librbd's own
    /// exclusive-lock feature guards, when the image has it).
    pub fn open_header(&self, update: bool, remote: &RemoteArgs) -> Result<Arc<dyn Backend>> {
        match self {
            Target::Path(p) => open_header(p, update),
            Target::Nbd(u) => Self::nbd(u, remote),
            Target::Rbd(r) => Ok(Arc::new(RbdBackend::open(&Self::rbd_spec(
                r, update, remote,
            ))?)),
        }
    }

    /// The object size of an RBD image, whose data offset librbd aligns to it; `None` for a
    /// local path.
    pub fn object_bytes(&self, remote: &RemoteArgs) -> Result<Option<u64>> {
        match self {
            Target::Path(_) | Target::Nbd(_) => Ok(None),
            Target::Rbd(r) => {
                let b = RbdBackend::open(&Self::rbd_spec(r, false, remote))?;
                Ok(Some(b.object_bytes()))
            }
        }
    }

    /// Size in bytes.
    pub fn size(&self, remote: &RemoteArgs) -> Result<u64> {
        Ok(self.open_data(false, remote, CacheMode::None)?.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_once() {
        assert_eq!(
            "vol.img".parse::<Target>().unwrap(),
            Target::Path("vol.img".into())
        );
        let t: Target = "rbd:pool/img@snap".parse().unwrap();
        match &t {
            Target::Rbd(r) => {
                assert_eq!((r.pool.as_str(), r.image.as_str()), ("pool", "img"));
                assert_eq!(r.snapshot.as_deref(), Some("snap"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(t.label(), "img");
        assert!("rbd:".parse::<Target>().is_err());
        assert!("".parse::<Target>().is_err());
        let n: Target = "nbd+unix:///disk?socket=/run/s.sock".parse().unwrap();
        assert!(matches!(&n, Target::Nbd(u) if u.export == "disk"));
        assert!(n.is_remote() && !Target::Path("x".into()).is_remote());
        assert_eq!(n.label(), "disk");
        assert!("nbd://".parse::<Target>().is_err());
        assert_eq!(
            "/srv/a/vol.img".parse::<Target>().unwrap().label(),
            "vol.img"
        );
    }
}
