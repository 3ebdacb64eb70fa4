//! [`RbdBackend`]: a [`Backend`] over an RBD image.
//!
//! Every call submits one asynchronous librbd request (or several in turn, for a request
//! larger than [`REQUEST_BYTES_MAX`]) and waits for it on the calling thread. Depth comes from
//! the callers: the engine's workers and the front end's threads each keep a request in flight,
//! so the number in flight is bounded by the threads calling in; below us librados bounds its
//! own queue to the OSDs (`objecter_inflight_ops`, `objecter_inflight_op_bytes`).
//!
//! Every call fails after `RbdOptions::remote_timeout` at the latest (see `ffi` for how a
//! request is given up safely). A change given up may still reach the cluster later, after
//! writes the caller makes next to the same place; so once one was, the backend refuses all
//! further changes (fail-stop) until the image is reopened, while reads go on.

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use ucrypt::backend::Backend;
use ucrypt::blockdev::check_range;
use ucrypt::{Error, Result};

use crate::ffi::{self, CallError, Cluster, Image, Lib, LoadError};
use crate::spec::RbdSpec;

/// Bytes per librbd request at most; a larger write, discard or zeroing is cut into requests of
/// this size issued one after the other, and a larger read returns short. librbd splits each
/// request into per-object requests that run in parallel, so bigger requests gain nothing,
/// while this keeps every request's byte count far from librbd's 32-bit internal counters.
pub const REQUEST_BYTES_MAX: usize = 64 << 20;
/// Offsets and lengths of I/O are multiples of this: librbd takes any byte range, but the
/// volume only issues whole sectors, and 512 is the smallest.
pub const LOGICAL_BLOCK_BYTES: u32 = 512;

/// `rbd_cache` unless the caller's settings say otherwise: off. librbd's default cache policy
/// (write-around) acknowledges a write before the OSDs commit it and holds a failed write-back
/// for the next flush to report: one flush, image-wide. With several threads flushing (the
/// engine's workers do), another thread's flush can succeed although its write never landed:
/// `tests/rbd_osd_death.rs` saw exactly that with the OSD killed. With the cache off every write
/// returns the OSDs' own answer. Caching belongs above the volume (the page cache over the NBD,
/// FUSE or ublk device), where it also holds plaintext rather than ciphertext.
pub const RBD_CACHE_DEFAULT: &str = "false";

/// How a FUA write ([`Backend::write_at_fua`]) is made durable, decided at open from the
/// image's effective cache settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FuaPath {
    /// One write with librados' FUA op flag: with librbd's cache off (ucrypt's default),
    /// write-through or write-around the write completes once the OSDs committed it.
    Native,
    /// A write, then a flush of the image: librbd's write-back caches (`rbd_cache_policy =
    /// writeback`, the persistent write-log cache) may hold a FUA write back, so only a flush
    /// is sure. The string says which setting chose this.
    WriteThenFlush(String),
}

impl FuaPath {
    /// The choice for an image's effective settings (`Image::config`).
    pub fn for_settings(settings: &[(String, String)]) -> FuaPath {
        let get = |k: &str| {
            settings
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
        };
        if let Some(p) = get("rbd_plugins").filter(|p| p.contains("pwl_cache")) {
            return FuaPath::WriteThenFlush(format!("rbd_plugins = {p}"));
        }
        if get("rbd_cache") == Some("false") {
            return FuaPath::Native;
        }
        match get("rbd_cache_policy") {
            Some("writethrough") | Some("writearound") => FuaPath::Native,
            Some(p) => FuaPath::WriteThenFlush(format!("rbd_cache_policy = {p}")),
            None => FuaPath::WriteThenFlush("rbd_cache_policy not listed by librbd".into()),
        }
    }
}

/// The ciphertext in an RBD image. Thread-safe: many threads may have requests in flight.
pub struct RbdBackend {
    image: Image,
    /// `pool/image[@snap]`, for messages.
    name: String,
    /// The image's size as of opening or the last [`RbdBackend::resize`]; another client
    /// resizing the image is not seen until it is reopened.
    size: AtomicU64,
    object_bytes: u64,
    read_only: bool,
    /// How long a request may take (`RbdOptions::remote_timeout`).
    remote_timeout: Duration,
    /// Set once a write, discard, zeroing or flush was given up at its deadline: it may still
    /// reach the cluster, after writes made later to the same place, so from then on every
    /// change is refused until the image is reopened (fail-stop rather than silent reorder).
    fenced: AtomicBool,
    /// How FUA writes are made durable.
    fua: FuaPath,
}

impl RbdBackend {
    /// Connects to the cluster and opens the image `spec` names: read-only for a snapshot or
    /// with `spec.options.read_only`. Loads librbd on first use; without it the error names the
    /// Debian package to install.
    pub fn open(spec: &RbdSpec) -> Result<RbdBackend> {
        Self::open_with(spec, Lib::system)
    }

    /// [`RbdBackend::open`] with the libraries from `load`: the seam through which tests name a
    /// library that does not exist.
    pub(crate) fn open_with(
        spec: &RbdSpec,
        load: impl FnOnce() -> std::result::Result<&'static Lib, LoadError>,
    ) -> Result<RbdBackend> {
        let name = spec.image_path();
        let o = &spec.options;
        let timeout_secs = o.remote_timeout.as_secs()
            + u64::from(o.remote_timeout.subsec_nanos() > 0 || o.remote_timeout.is_zero());
        let lib = load().map_err(|LoadError(why)| {
            Error::io(
                format!("{spec}"),
                std::io::Error::new(std::io::ErrorKind::NotFound, why),
            )
        })?;
        let bad = |e: String| Error::InvalidArgument(format!("{spec}: {e}"));
        let call_err = |e: CallError| Error::io(format!("{} for rbd {name}", e.call), e.io_error());

        let id =
            o.id.as_deref()
                .map(|id| ffi::c_string("client id", id))
                .transpose()
                .map_err(bad)?;
        let cluster = Cluster::create(lib, id.as_deref()).map_err(call_err)?;
        let conf = o
            .conf
            .as_deref()
            .map(|p| path_c_string("configuration file", p))
            .transpose()
            .map_err(bad)?;
        match cluster.read_conf(conf.as_deref()) {
            Ok(()) => {}
            // No file named and none in the default places: the settings may still name the
            // monitors (as qemu allows); if not, connecting says so.
            Err(e) if conf.is_none() && e.errno == libc::ENOENT => {}
            Err(e) => {
                return Err(Error::io(
                    format!(
                        "{} {} for rbd {name}",
                        e.call,
                        o.conf.as_deref().map_or_else(
                            || "($CEPH_CONF or the default places)".to_string(),
                            |p| p.display().to_string()
                        )
                    ),
                    e.io_error(),
                ))
            }
        }
        let mut settings: Vec<(String, String)> = Vec::new();
        if let Some(k) = &o.keyring {
            settings.push(("keyring".into(), k.display().to_string()));
        }
        // Each RADOS operation and connecting give up after remote_timeout too, so that a
        // request this backend gave up on ends inside librbd as well (see `ffi`).
        for key in [
            "rados_osd_op_timeout",
            "rados_mon_op_timeout",
            "client_mount_timeout",
        ] {
            settings.push((key.into(), timeout_secs.to_string()));
        }
        // librbd's own cache off (see `RBD_CACHE_DEFAULT`). Before the caller's settings, which
        // may turn it back on.
        settings.push(("rbd_cache".into(), RBD_CACHE_DEFAULT.into()));
        // Write buffers belong to the request (see `ffi`), so librbd need not copy them again.
        // Before the caller's settings, which may turn it back on.
        settings.push(("rbd_disable_zero_copy_writes".into(), "false".into()));
        settings.extend(o.settings.iter().cloned());
        for (k, v) in &settings {
            let (ck, cv) = (
                ffi::c_string("option", k).map_err(bad)?,
                ffi::c_string("option value", v).map_err(bad)?,
            );
            cluster.set(&ck, &cv).map_err(|e| {
                if e.errno == libc::ENOENT {
                    bad(format!("'{k}' is not a Ceph option"))
                } else {
                    Error::io(
                        format!("rados_conf_set {k}={v} for rbd {name}"),
                        e.io_error(),
                    )
                }
            })?;
        }
        cluster.connect().map_err(|e| {
            Error::io(
                format!(
                    "{} for rbd {name} (within {timeout_secs} s; is the cluster up, and are \
                     the configuration and keyring right?)",
                    e.call
                ),
                e.io_error(),
            )
        })?;
        let pool = ffi::c_string("pool", &spec.pool).map_err(bad)?;
        let ns = spec
            .namespace
            .as_deref()
            .map(|n| ffi::c_string("namespace", n))
            .transpose()
            .map_err(bad)?;
        let pool = cluster
            .open_pool(&pool, ns.as_deref())
            .map_err(|e| Error::io(format!("{} {}", e.call, spec.pool), e.io_error()))?;
        let image = ffi::c_string("image", &spec.image).map_err(bad)?;
        let snap = spec
            .snapshot
            .as_deref()
            .map(|s| ffi::c_string("snapshot", s))
            .transpose()
            .map_err(bad)?;
        let read_only = o.read_only || spec.snapshot.is_some();
        let image = pool
            .open_image(&image, snap.as_deref(), read_only, o.remote_timeout)
            .map_err(|e| Error::io(format!("{} {name}", e.call), e.io_error()))?;
        let stat = image.stat().map_err(call_err)?;
        let fua = FuaPath::for_settings(&image.config().map_err(call_err)?);
        Ok(RbdBackend {
            image,
            name,
            size: AtomicU64::new(stat.size),
            object_bytes: stat.object_bytes,
            read_only,
            remote_timeout: o.remote_timeout,
            fenced: AtomicBool::new(false),
            fua,
        })
    }

    /// Grows or shrinks the image to `new_size` bytes (`rbd_resize`; shrinking discards the
    /// data beyond). The caller keeps requests out of the range that goes away.
    /// Waits for librados' op time-outs rather than `remote_timeout` alone (a resize is
    /// synchronous in librbd).
    pub fn resize(&self, new_size: u64) -> Result<()> {
        self.writable("resize")?;
        self.image
            .resize(new_size)
            .map_err(|e| self.err(&e, format_args!("to {new_size} bytes")))?;
        let size = self
            .image
            .size()
            .map_err(|e| self.err(&e, format_args!("")))?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// The image's object size in bytes (4 MiB by default): where a layout wants alignment.
    pub fn object_bytes(&self) -> u64 {
        self.object_bytes
    }

    /// How this image's FUA writes are made durable.
    pub fn fua_path(&self) -> &FuaPath {
        &self.fua
    }

    /// Whether the image was opened read-only (a snapshot, or `RbdOptions::read_only`).
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    fn err(&self, e: &CallError, detail: std::fmt::Arguments<'_>) -> Error {
        let mut context = format!("{} on rbd {} {detail}", e.call, self.name)
            .trim_end()
            .to_string();
        if e.abandoned {
            context = format!(
                "{context}: no answer within {:?} (remote_timeout)",
                self.remote_timeout
            );
            if e.call != "rbd_aio_read" && !self.fenced.swap(true, Ordering::AcqRel) {
                context = format!("{context}; writes to it are refused from now on");
            }
        } else if e.errno == libc::EAGAIN {
            context = format!(
                "{context}: {} requests given up at their deadline are still in flight",
                crate::ffi::ABANDONED_MAX
            );
        }
        Error::io(context, e.io_error())
    }

    fn writable(&self, what: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly(format!(
                "rbd {} is open read-only: cannot {what}",
                self.name
            )));
        }
        if self.fenced.load(Ordering::Acquire) {
            return Err(Error::io(
                format!(
                    "rbd {}: cannot {what}: an earlier change got no answer within \
                     remote_timeout and may still land, so changes are refused until the \
                     image is reopened",
                    self.name
                ),
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        Ok(())
    }

    /// Runs `op` on `offset..offset+len` in pieces of at most [`REQUEST_BYTES_MAX`].
    fn in_pieces(
        &self,
        offset: u64,
        len: u64,
        mut op: impl FnMut(u64, usize, usize) -> std::result::Result<(), CallError>,
    ) -> Result<()> {
        let mut done = 0u64;
        while done < len {
            // Both fit in usize: n is at most REQUEST_BYTES_MAX.
            let n = (len - done).min(REQUEST_BYTES_MAX as u64) as usize;
            op(offset + done, done as usize, n).map_err(|e| {
                self.err(&e, format_args!("at offset {} ({n} bytes)", offset + done))
            })?;
            done += n as u64;
        }
        Ok(())
    }
}

impl Backend for RbdBackend {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let size = self.size.load(Ordering::Acquire);
        if offset >= size || buf.is_empty() {
            return Ok(0);
        }
        let n = (buf.len() as u64)
            .min(size - offset)
            .min(REQUEST_BYTES_MAX as u64) as usize;
        self.image
            .read(&mut buf[..n], offset)
            .map_err(|e| self.err(&e, format_args!("at offset {offset} ({n} bytes)")))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.writable("write")?;
        check_range(offset, buf.len() as u64, self.size.load(Ordering::Acquire))?;
        self.in_pieces(offset, buf.len() as u64, |off, at, n| {
            self.image.write(&buf[at..at + n], off, 0)
        })
    }

    fn write_at_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        if self.fua != FuaPath::Native {
            self.write_at(buf, offset)?;
            return self.flush();
        }
        self.writable("write")?;
        check_range(offset, buf.len() as u64, self.size.load(Ordering::Acquire))?;
        self.in_pieces(offset, buf.len() as u64, |off, at, n| {
            self.image.write(&buf[at..at + n], off, ffi::OP_FLAG_FUA)
        })
    }

    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.writable("flush")?;
        self.image
            .flush()
            .map_err(|e| self.err(&e, format_args!("")))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("discard")?;
        check_range(offset, len, self.size.load(Ordering::Acquire))?;
        self.in_pieces(offset, len, |off, _, n| self.image.discard(off, n as u64))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("write zeroes")?;
        check_range(offset, len, self.size.load(Ordering::Acquire))?;
        self.in_pieces(offset, len, |off, _, n| self.image.write_zeroes(off, n))
    }

    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn logical_block_bytes(&self) -> u32 {
        LOGICAL_BLOCK_BYTES
    }

    fn describe(&self) -> String {
        format!("rbd {}", self.name)
    }
}

fn path_c_string(what: &str, p: &std::path::Path) -> std::result::Result<CString, String> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| format!("{what} path '{}' holds a NUL byte", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_names_the_package() {
        let spec = RbdSpec::parse("rbd:rbd/img").unwrap();
        let err = RbdBackend::open_with(&spec, || {
            Lib::load("libucrypt-no-such-rados.so.9", "libucrypt-no-such-rbd.so.9")
                .map(|l| &*Box::leak(Box::new(l)))
        })
        .err()
        .expect("opened with a library that does not exist");
        let text = err.to_string();
        assert_eq!(err.kind(), ucrypt::ErrorKind::Device, "{text}");
        for needle in [
            "rbd:rbd/img",
            "libucrypt-no-such-rados.so.9",
            "Debian package librbd1",
        ] {
            assert!(text.contains(needle), "missing '{needle}' in: {text}");
        }
    }

    fn settings(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn fua_path_follows_the_cache_settings() {
        let native = [
            &[("rbd_cache", "true"), ("rbd_cache_policy", "writearound")][..],
            &[("rbd_cache", "true"), ("rbd_cache_policy", "writethrough")],
            &[("rbd_cache", "false"), ("rbd_cache_policy", "writeback")],
        ];
        for s in native {
            assert_eq!(
                FuaPath::for_settings(&settings(s)),
                FuaPath::Native,
                "{s:?}"
            );
        }
        let flush = [
            &[("rbd_cache", "true"), ("rbd_cache_policy", "writeback")][..],
            &[
                ("rbd_cache_policy", "writearound"),
                ("rbd_plugins", "pwl_cache"),
            ],
            &[("rbd_cache", "true")],
        ];
        for s in flush {
            assert!(
                matches!(
                    FuaPath::for_settings(&settings(s)),
                    FuaPath::WriteThenFlush(_)
                ),
                "{s:?}"
            );
        }
    }
}
