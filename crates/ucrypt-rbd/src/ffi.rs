//! librados and librbd, loaded at run time, behind a safe interface. The only `unsafe` of the
//! crate.
//!
//! Declarations. Hand-written from Debian 12's `librbd-dev` 16.2.15 (`/usr/include/rbd/librbd.h`
//! and `/usr/include/rados/librados.h`), for the few functions used; every handle type there is
//! `typedef void *`. No bindgen: it would need libclang and the headers at build time, which is
//! what loading at run time avoids.
//!
//! Loading. [`Lib::system`] opens `librados.so.2` and `librbd.so.1` with `dlopen` once per
//! process and never closes them: librados starts threads and registers exit handlers that
//! must not outlive its code. The function pointers copied out of the libraries are valid for
//! as long as the [`Lib`] lives, which is forever for [`Lib::system`]; a [`Lib`] from
//! [`Lib::load`] (tests) keeps its libraries open while it lives, and every handle borrows it.
//!
//! Handles and their order. [`Cluster`] owns a `rados_t`, [`Pool`] a `rados_ioctx_t` and the
//! cluster, [`Image`] an `rbd_image_t` and the pool; dropping an image closes it, then destroys
//! its io context, then shuts its cluster connection down, the reverse of opening.
//!
//! Buffer ownership and deadlines. Every request owns its buffer: a [`Request`] holds the
//! bytes librbd reads from (a copy of the caller's data, for a write) or writes into (copied
//! out to the caller's buffer after completion, for a read), the return value, and a condvar.
//! One strong reference to it goes to the completion's callback ([`on_complete`]), which
//! records the result, releases the completion and drops that reference; the caller holds the
//! other while it waits. So the caller can stop waiting at its deadline (remote_timeout) and
//! return an error while librbd still has the request: nothing the caller owns is referenced,
//! and the request's memory lives until librbd is done with it. Without this, a write whose
//! object-map update and data write each wait for librados' op time-out takes two of them
//! with the OSD killed (`tests/rbd_osd_death.rs` holds every request to its deadline). A
//! given-up request may still reach the cluster later; the backend fences further writes
//! when that happened. The copy costs one
//! memcpy per request, which librbd makes anyway for writes when it copies (its default,
//! `rbd_disable_zero_copy_writes`, which the backend turns off since the buffer is ours).
//!
//! Threads. librbd's image handle is safe to use from many threads at once: asynchronous
//! requests go through its own locked queues (qemu and fio issue them from several threads on
//! one handle). So many callers can each have a request in flight on one [`Image`].

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use libloading::Library;

/// The libraries' names: their Debian sonames (packages librados2 and librbd1, which depends on
/// librados2).
pub const RADOS_LIBRARY: &str = "librados.so.2";
pub const RBD_LIBRARY: &str = "librbd.so.1";
/// The Debian package to install when the libraries are missing.
pub const RBD_PACKAGE: &str = "librbd1";

type RadosT = *mut c_void;
type IoctxT = *mut c_void;
type ImageT = *mut c_void;
type CompletionT = *mut c_void;
type CallbackT = Option<unsafe extern "C" fn(CompletionT, *mut c_void)>;

/// `RBD_MAX_BLOCK_NAME_SIZE` and `RBD_MAX_IMAGE_NAME_SIZE` in librbd.h.
const BLOCK_NAME_BYTES: usize = 24;
const IMAGE_NAME_BYTES: usize = 96;

/// `rbd_image_info_t`: what `rbd_stat` fills in (the last three fields are deprecated).
#[repr(C)]
struct ImageInfo {
    size: u64,
    obj_size: u64,
    num_objs: u64,
    order: c_int,
    block_name_prefix: [c_char; BLOCK_NAME_BYTES],
    parent_pool: i64,
    parent_name: [c_char; IMAGE_NAME_BYTES],
}

/// `rbd_config_option_t`: one of an image's settings, as `rbd_config_image_list` lists them.
#[repr(C)]
struct ConfigOption {
    name: *mut c_char,
    value: *mut c_char,
    /// `rbd_config_source_t` (config file, pool or image metadata): not used.
    source: c_int,
}

/// `LIBRADOS_OP_FLAG_FADVISE_FUA` in librados.h: librbd's write-around cache lets such a write
/// through, and the request completes once the OSDs committed it.
pub const OP_FLAG_FUA: c_int = 0x80;

/// The functions used, copied out of the loaded libraries.
struct Fns {
    rados_create: unsafe extern "C" fn(*mut RadosT, *const c_char) -> c_int,
    rados_conf_read_file: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    rados_conf_set: unsafe extern "C" fn(RadosT, *const c_char, *const c_char) -> c_int,
    rados_connect: unsafe extern "C" fn(RadosT) -> c_int,
    rados_shutdown: unsafe extern "C" fn(RadosT),
    rados_ioctx_create: unsafe extern "C" fn(RadosT, *const c_char, *mut IoctxT) -> c_int,
    rados_ioctx_set_namespace: unsafe extern "C" fn(IoctxT, *const c_char),
    rados_ioctx_destroy: unsafe extern "C" fn(IoctxT),
    rbd_open: unsafe extern "C" fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    rbd_open_read_only:
        unsafe extern "C" fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    rbd_close: unsafe extern "C" fn(ImageT) -> c_int,
    rbd_get_size: unsafe extern "C" fn(ImageT, *mut u64) -> c_int,
    rbd_stat: unsafe extern "C" fn(ImageT, *mut ImageInfo, usize) -> c_int,
    rbd_resize: unsafe extern "C" fn(ImageT, u64) -> c_int,
    rbd_aio_create_completion:
        unsafe extern "C" fn(*mut c_void, CallbackT, *mut CompletionT) -> c_int,
    rbd_aio_get_return_value: unsafe extern "C" fn(CompletionT) -> isize,
    rbd_aio_release: unsafe extern "C" fn(CompletionT),
    rbd_aio_read: unsafe extern "C" fn(ImageT, u64, usize, *mut c_char, CompletionT) -> c_int,
    rbd_aio_write2:
        unsafe extern "C" fn(ImageT, u64, usize, *const c_char, CompletionT, c_int) -> c_int,
    rbd_config_image_list: unsafe extern "C" fn(ImageT, *mut ConfigOption, *mut c_int) -> c_int,
    rbd_config_image_list_cleanup: unsafe extern "C" fn(*mut ConfigOption, c_int),
    rbd_aio_discard: unsafe extern "C" fn(ImageT, u64, u64, CompletionT) -> c_int,
    rbd_aio_write_zeroes:
        unsafe extern "C" fn(ImageT, u64, usize, CompletionT, c_int, c_int) -> c_int,
    rbd_aio_flush: unsafe extern "C" fn(ImageT, CompletionT) -> c_int,
}

/// The loaded libraries and their functions.
pub struct Lib {
    fns: Fns,
    // Kept open while `fns` is used; dropped after it (fields drop in declaration order).
    _rbd: Library,
    _rados: Library,
}

/// Why the libraries could not be loaded: the text names the library, the package and the
/// loader's own reason.
#[derive(Debug)]
pub struct LoadError(pub String);

impl Lib {
    /// The system's librados and librbd, loaded on first use and kept for the life of the
    /// process. A failure is not cached: installing the package and trying again works.
    pub fn system() -> Result<&'static Lib, LoadError> {
        static SYSTEM: OnceLock<Lib> = OnceLock::new();
        if let Some(lib) = SYSTEM.get() {
            return Ok(lib);
        }
        let lib = Lib::load(RADOS_LIBRARY, RBD_LIBRARY)?;
        // Two threads may both load; the loser's copy is dropped, which only lowers dlopen's
        // reference count on libraries the winner keeps open.
        Ok(SYSTEM.get_or_init(|| lib))
    }

    /// Loads the libraries by these names (the seam tests use to name a missing library).
    pub fn load(rados_name: &str, rbd_name: &str) -> Result<Lib, LoadError> {
        let open = |name: &str| {
            // SAFETY: dlopen runs the library's initialisers. librados and librbd are Ceph's
            // client libraries, whose initialisers only set up their own global state; a
            // library of another kind under these sonames is outside what we can check.
            unsafe { Library::new(name) }.map_err(|e| {
                LoadError(format!(
                    "cannot load {name}, Ceph's RBD client library (install the Debian package \
                     {RBD_PACKAGE}): {e}"
                ))
            })
        };
        let rados = open(rados_name)?;
        let rbd = open(rbd_name)?;
        macro_rules! sym {
            ($lib:expr, $libname:expr, $name:ident) => {{
                let name = concat!(stringify!($name), "\0").as_bytes();
                // SAFETY: the symbol's type is the one declared in `Fns`, copied from
                // librbd.h / librados.h 16.2.15; the pointer is copied out of the `Symbol`
                // and used only while `Lib` keeps the library open.
                match unsafe { $lib.get(name) } {
                    Ok(s) => *s,
                    Err(e) => {
                        return Err(LoadError(format!(
                            "{} has no {} (too old? Debian 12's {RBD_PACKAGE} 16.2 has it): {e}",
                            $libname,
                            stringify!($name)
                        )))
                    }
                }
            }};
        }
        let fns = Fns {
            rados_create: sym!(rados, rados_name, rados_create),
            rados_conf_read_file: sym!(rados, rados_name, rados_conf_read_file),
            rados_conf_set: sym!(rados, rados_name, rados_conf_set),
            rados_connect: sym!(rados, rados_name, rados_connect),
            rados_shutdown: sym!(rados, rados_name, rados_shutdown),
            rados_ioctx_create: sym!(rados, rados_name, rados_ioctx_create),
            rados_ioctx_set_namespace: sym!(rados, rados_name, rados_ioctx_set_namespace),
            rados_ioctx_destroy: sym!(rados, rados_name, rados_ioctx_destroy),
            rbd_open: sym!(rbd, rbd_name, rbd_open),
            rbd_open_read_only: sym!(rbd, rbd_name, rbd_open_read_only),
            rbd_close: sym!(rbd, rbd_name, rbd_close),
            rbd_get_size: sym!(rbd, rbd_name, rbd_get_size),
            rbd_stat: sym!(rbd, rbd_name, rbd_stat),
            rbd_resize: sym!(rbd, rbd_name, rbd_resize),
            rbd_aio_create_completion: sym!(rbd, rbd_name, rbd_aio_create_completion),
            rbd_aio_get_return_value: sym!(rbd, rbd_name, rbd_aio_get_return_value),
            rbd_aio_release: sym!(rbd, rbd_name, rbd_aio_release),
            rbd_aio_read: sym!(rbd, rbd_name, rbd_aio_read),
            rbd_aio_write2: sym!(rbd, rbd_name, rbd_aio_write2),
            rbd_config_image_list: sym!(rbd, rbd_name, rbd_config_image_list),
            rbd_config_image_list_cleanup: sym!(rbd, rbd_name, rbd_config_image_list_cleanup),
            rbd_aio_discard: sym!(rbd, rbd_name, rbd_aio_discard),
            rbd_aio_write_zeroes: sym!(rbd, rbd_name, rbd_aio_write_zeroes),
            rbd_aio_flush: sym!(rbd, rbd_name, rbd_aio_flush),
        };
        Ok(Lib {
            fns,
            _rbd: rbd,
            _rados: rados,
        })
    }
}

/// A failed call: its name and the positive errno librados or librbd returned negated.
#[derive(Debug)]
pub struct CallError {
    pub call: &'static str,
    pub errno: i32,
    /// The request was given up at its deadline and may still reach the cluster later.
    pub abandoned: bool,
}

impl CallError {
    pub fn io_error(&self) -> io::Error {
        io::Error::from_raw_os_error(self.errno)
    }
}

/// 0 or more is success; a negative value is `-errno`.
fn check(call: &'static str, rc: c_int) -> Result<(), CallError> {
    if rc < 0 {
        Err(CallError {
            call,
            errno: rc.saturating_neg(),
            abandoned: false,
        })
    } else {
        Ok(())
    }
}

/// A string for C, or the caller's `InvalidInput` (a NUL inside).
pub fn c_string(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} '{}' holds a NUL byte", s.escape_debug()))
}

/// A cluster handle (`rados_t`), configured but maybe not yet connected.
pub struct Cluster {
    lib: &'static Lib,
    h: RadosT,
}

impl Cluster {
    /// `rados_create` as client `id` (`None`: librados' default, `admin`).
    pub fn create(lib: &'static Lib, id: Option<&CStr>) -> Result<Cluster, CallError> {
        let mut h: RadosT = std::ptr::null_mut();
        let id_ptr = id.map_or(std::ptr::null(), CStr::as_ptr);
        // SAFETY: `h` is a valid out pointer; `id_ptr` is NULL or a NUL-terminated string that
        // outlives the call (librados copies it).
        check("rados_create", unsafe {
            (lib.fns.rados_create)(&mut h, id_ptr)
        })?;
        Ok(Cluster { lib, h })
    }

    /// `rados_conf_read_file`: `None` searches `$CEPH_CONF`, then the default places.
    pub fn read_conf(&self, path: Option<&CStr>) -> Result<(), CallError> {
        let p = path.map_or(std::ptr::null(), CStr::as_ptr);
        // SAFETY: `self.h` is a live, not yet connected handle; `p` is NULL or a string that
        // outlives the call.
        check("rados_conf_read_file", unsafe {
            (self.lib.fns.rados_conf_read_file)(self.h, p)
        })
    }

    /// `rados_conf_set` (`-ENOENT`: no such option).
    pub fn set(&self, option: &CStr, value: &CStr) -> Result<(), CallError> {
        // SAFETY: a live handle and two strings that outlive the call (librados copies them).
        check("rados_conf_set", unsafe {
            (self.lib.fns.rados_conf_set)(self.h, option.as_ptr(), value.as_ptr())
        })
    }

    /// `rados_connect`: talks to the monitors and authenticates. Blocks up to the handle's
    /// `client_mount_timeout`.
    pub fn connect(&self) -> Result<(), CallError> {
        // SAFETY: a live handle, configured by the calls above.
        check("rados_connect", unsafe {
            (self.lib.fns.rados_connect)(self.h)
        })
    }

    /// `rados_ioctx_create` for `pool`, then `rados_ioctx_set_namespace` when one is named.
    /// The cluster must be connected.
    pub fn open_pool(self, pool: &CStr, namespace: Option<&CStr>) -> Result<Pool, CallError> {
        let mut h: IoctxT = std::ptr::null_mut();
        // SAFETY: a live, connected handle (the caller connected it), a string that outlives
        // the call and a valid out pointer.
        check("rados_ioctx_create", unsafe {
            (self.lib.fns.rados_ioctx_create)(self.h, pool.as_ptr(), &mut h)
        })?;
        let p = Pool { h, cluster: self };
        if let Some(ns) = namespace {
            // SAFETY: a live io context and a string that outlives the call (copied).
            unsafe { (p.cluster.lib.fns.rados_ioctx_set_namespace)(p.h, ns.as_ptr()) };
        }
        Ok(p)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: `h` came from rados_create and is shut down once, here; every io context
        // made from it was destroyed before (a `Pool` owns its `Cluster`).
        unsafe { (self.lib.fns.rados_shutdown)(self.h) };
    }
}

/// An io context on one pool (`rados_ioctx_t`).
pub struct Pool {
    h: IoctxT,
    cluster: Cluster,
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: `h` came from rados_ioctx_create and is destroyed once, here, after every
        // image opened on it was closed (an `Image` owns its `Pool`); the cluster is shut down
        // after this, when the field drops.
        unsafe { (self.cluster.lib.fns.rados_ioctx_destroy)(self.h) };
    }
}

/// Requests given up at their deadline and not yet completed by librbd, at most. Each holds
/// its buffer (up to `REQUEST_BYTES_MAX`) until librados' own time-outs end it; past this bound
/// new requests fail at once instead of piling up memory behind a dead cluster.
pub const ABANDONED_MAX: usize = 64;

/// How long dropping an open image waits for librbd's close, in request deadlines. Closing
/// waits for what librbd still has in flight and releases the image's lock; against a cluster
/// that answers, each step ends within librados' op time-outs. With an OSD gone, librbd 16's
/// close was seen never to return (the cache off, writes given up at their deadline): past
/// this wait the close is left to finish, or not, on its own thread, holding the image, the
/// pool and the cluster handle, so that the caller (a daemon shutting down) does not hang.
pub const CLOSE_WAIT_DEADLINES: u32 = 3;

/// An open RBD image (`rbd_image_t`).
pub struct Image {
    h: ImageT,
    /// How long a request may take before [`Image`] gives up waiting for it.
    deadline: Duration,
    /// Requests given up and still in librbd's hands (see [`ABANDONED_MAX`]).
    abandoned: Arc<AtomicUsize>,
    lib: &'static Lib,
    /// `Some` while the image is open; taken by `drop`, which hands it to the closing thread.
    pool: Option<Pool>,
}

// SAFETY: the handle is a pointer to librbd's ImageCtx, which does not depend on the thread
// that opened it; moving it to another thread and closing it there is what qemu does.
unsafe impl Send for Image {}
// SAFETY: librbd serialises concurrent calls on one image internally (its ImageCtx locks and
// request queues), so `&Image` may be used by many threads at once; see the module comment.
// The other fields (`Pool`, `Cluster`) are only touched when the image is dropped.
unsafe impl Sync for Image {}

/// The object size and size of an image.
pub struct Stat {
    pub size: u64,
    pub object_bytes: u64,
}

impl Pool {
    /// `rbd_open` (or `rbd_open_read_only`) of `image` at `snapshot` (`None`: the head); every
    /// request on it is given up after `deadline`.
    pub fn open_image(
        self,
        image: &CStr,
        snapshot: Option<&CStr>,
        read_only: bool,
        deadline: Duration,
    ) -> Result<Image, CallError> {
        let (call, f) = if read_only {
            (
                "rbd_open_read_only",
                self.cluster.lib.fns.rbd_open_read_only,
            )
        } else {
            ("rbd_open", self.cluster.lib.fns.rbd_open)
        };
        let snap = snapshot.map_or(std::ptr::null(), CStr::as_ptr);
        let mut h: ImageT = std::ptr::null_mut();
        // SAFETY: a live io context, strings (or NULL for the snapshot) that outlive the call,
        // and a valid out pointer.
        check(call, unsafe { f(self.h, image.as_ptr(), &mut h, snap) })?;
        Ok(Image {
            h,
            deadline,
            abandoned: Arc::new(AtomicUsize::new(0)),
            lib: self.cluster.lib,
            pool: Some(self),
        })
    }
}

impl Image {
    fn lib(&self) -> &'static Lib {
        self.lib
    }

    pub fn size(&self) -> Result<u64, CallError> {
        let mut size = 0u64;
        // SAFETY: an open image and a valid out pointer.
        check("rbd_get_size", unsafe {
            (self.lib().fns.rbd_get_size)(self.h, &mut size)
        })?;
        Ok(size)
    }

    pub fn stat(&self) -> Result<Stat, CallError> {
        let mut info = ImageInfo {
            size: 0,
            obj_size: 0,
            num_objs: 0,
            order: 0,
            block_name_prefix: [0; BLOCK_NAME_BYTES],
            parent_pool: 0,
            parent_name: [0; IMAGE_NAME_BYTES],
        };
        // SAFETY: an open image and a pointer to an `rbd_image_info_t` of the size passed.
        check("rbd_stat", unsafe {
            (self.lib().fns.rbd_stat)(self.h, &mut info, std::mem::size_of::<ImageInfo>())
        })?;
        Ok(Stat {
            size: info.size,
            object_bytes: info.obj_size,
        })
    }

    /// `rbd_resize`, synchronous: librbd has no deadline for it but librados' op time-outs.
    pub fn resize(&self, size: u64) -> Result<(), CallError> {
        // SAFETY: an open image; librbd locks the image against concurrent I/O itself.
        check("rbd_resize", unsafe {
            (self.lib().fns.rbd_resize)(self.h, size)
        })
    }

    /// Reads into `buf` at `offset`; returns the bytes read (fewer at the end of the image).
    /// librbd reads into a buffer of the request's own, copied into `buf` once it completed,
    /// so that a request given up at its deadline never writes into `buf` afterwards.
    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize, CallError> {
        let len = buf.len();
        let req = Request::new(self, vec![0u8; len].into_boxed_slice());
        let ptr = req.buf.cast::<c_char>();
        let (n, req) = self.aio("rbd_aio_read", req, |c| {
            // SAFETY: `ptr..ptr+len` is the request's own buffer, which lives until the
            // request's last reference goes, after librbd completed it (`aio`).
            unsafe { (self.lib().fns.rbd_aio_read)(self.h, offset, len, ptr, c) }
        })?;
        // librbd returns the bytes read, never more than asked.
        let n = n.min(len);
        buf[..n].copy_from_slice(&req.bytes()[..n]);
        Ok(n)
    }

    /// Writes `buf` at `offset`, from a copy the request owns (see [`Image::read`]), with
    /// librados op flags (`0`, or [`OP_FLAG_FUA`]).
    pub fn write(&self, buf: &[u8], offset: u64, op_flags: c_int) -> Result<(), CallError> {
        let len = buf.len();
        let req = Request::new(self, Box::from(buf));
        let ptr = req.buf.cast::<c_char>().cast_const();
        self.aio("rbd_aio_write2", req, |c| {
            // SAFETY: as in `read`: the request's own buffer, alive until librbd is done.
            unsafe { (self.lib().fns.rbd_aio_write2)(self.h, offset, len, ptr, c, op_flags) }
        })
        .map(drop)
    }

    /// The image's effective settings (from the configuration, the pool and the image's own
    /// metadata, as librbd resolved them at open), as (name, value) pairs.
    pub fn config(&self) -> Result<Vec<(String, String)>, CallError> {
        // librbd fills at most `max` entries and says how many it has; a first call with none
        // returns -ERANGE and the count. Settings can only be added between the calls by an
        // upgrade of librbd, so two rounds suffice; a third -ERANGE is returned as the error.
        let mut max: c_int = 0;
        for _ in 0..2 {
            let mut opts: Vec<ConfigOption> = (0..max)
                .map(|_| ConfigOption {
                    name: std::ptr::null_mut(),
                    value: std::ptr::null_mut(),
                    source: 0,
                })
                .collect();
            let mut n = max;
            // SAFETY: an open image, and `opts` has room for `n` entries (`n` = its length).
            let r = unsafe {
                (self.lib().fns.rbd_config_image_list)(self.h, opts.as_mut_ptr(), &mut n)
            };
            if r == -libc::ERANGE {
                max = n;
                continue;
            }
            check("rbd_config_image_list", r)?;
            assert!(n <= max, "librbd listed more settings than it had room for");
            let list = opts[..n as usize]
                .iter()
                .map(|o| {
                    let text = |p: *mut c_char| {
                        // SAFETY: librbd filled the first `n` entries with NUL-terminated
                        // strings it allocated, alive until the clean-up call below.
                        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                    };
                    (text(o.name), text(o.value))
                })
                .collect();
            // SAFETY: the `n` entries librbd filled, freed once; `opts` itself is ours.
            unsafe { (self.lib().fns.rbd_config_image_list_cleanup)(opts.as_mut_ptr(), n) };
            return Ok(list);
        }
        check("rbd_config_image_list", -libc::ERANGE).map(|()| Vec::new())
    }

    pub fn discard(&self, offset: u64, len: u64) -> Result<(), CallError> {
        let req = Request::new(self, Box::default());
        self.aio("rbd_aio_discard", req, |c| {
            // SAFETY: an open image; no buffer.
            unsafe { (self.lib().fns.rbd_aio_discard)(self.h, offset, len, c) }
        })
        .map(drop)
    }

    pub fn write_zeroes(&self, offset: u64, len: usize) -> Result<(), CallError> {
        let req = Request::new(self, Box::default());
        self.aio("rbd_aio_write_zeroes", req, |c| {
            // SAFETY: an open image; no buffer; flags 0 (no thick provisioning, no op flags).
            unsafe { (self.lib().fns.rbd_aio_write_zeroes)(self.h, offset, len, c, 0, 0) }
        })
        .map(drop)
    }

    pub fn flush(&self) -> Result<(), CallError> {
        let req = Request::new(self, Box::default());
        self.aio("rbd_aio_flush", req, |c| {
            // SAFETY: an open image; no buffer.
            unsafe { (self.lib().fns.rbd_aio_flush)(self.h, c) }
        })
        .map(drop)
    }

    /// Makes a completion whose callback finishes `req`, submits with it, and waits for the
    /// request until the image's deadline. Returns the request's non-negative return value
    /// and the request (for its buffer). `submit` must hand the completion to one `rbd_aio_*`
    /// call, with no buffer but the request's own, and return that call's return code.
    ///
    /// At the deadline the request is given up: the call fails with `ETIMEDOUT` and
    /// `abandoned` set, while the request, its buffer and the completion stay alive until
    /// librbd completes it (librados' op time-outs see to that) and the callback frees them.
    fn aio(
        &self,
        call: &'static str,
        req: Arc<Request>,
        submit: impl FnOnce(CompletionT) -> c_int,
    ) -> Result<(usize, Arc<Request>), CallError> {
        let fail = |errno, abandoned| CallError {
            call,
            errno,
            abandoned,
        };
        if self.abandoned.load(Ordering::Acquire) >= ABANDONED_MAX {
            return Err(fail(libc::EAGAIN, false));
        }
        let fns = &self.lib().fns;
        let mut c: CompletionT = std::ptr::null_mut();
        let arg = Arc::into_raw(Arc::clone(&req)).cast_mut().cast::<c_void>();
        // SAFETY: `arg` is one strong reference to `req`, handed to the callback, which takes
        // it back exactly once when the request completes; `c` is a valid out pointer.
        let rc = unsafe { (fns.rbd_aio_create_completion)(arg, Some(on_complete), &mut c) };
        if rc < 0 {
            // SAFETY: the completion was not made, so no callback will run: take the reference
            // handed out above back.
            drop(unsafe { Arc::from_raw(arg.cast_const().cast::<Request>()) });
            return Err(fail(rc.saturating_neg(), false));
        }
        let rc = submit(c);
        if rc < 0 {
            // librbd refused the request. Whether it will still complete the completion (and
            // so run the callback) is not promised by librbd.h, so the completion and the
            // request are left to the callback: a leak if it never runs, never a use after
            // free. (librbd 16 reports errors through the completion and returns 0 here.)
            return Err(fail(rc.saturating_neg(), false));
        }
        let deadline = Instant::now() + self.deadline;
        let mut st = lock(&req.state);
        loop {
            if let Some(rv) = st.rv {
                drop(st);
                if rv < 0 {
                    return Err(fail(i32::try_from(-rv).unwrap_or(libc::EIO), false));
                }
                // A non-negative `isize` always fits in `usize`.
                return Ok((rv as usize, req));
            }
            let now = Instant::now();
            if now >= deadline {
                st.abandoned = true;
                self.abandoned.fetch_add(1, Ordering::AcqRel);
                return Err(fail(libc::ETIMEDOUT, true));
            }
            st = req
                .done
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for Image {
    /// Closes the image on a thread of its own and waits for it at most
    /// [`CLOSE_WAIT_DEADLINES`] request deadlines.
    fn drop(&mut self) {
        let Some(pool) = self.pool.take() else {
            return;
        };
        let closing = Closing { h: self.h, pool };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        // If the thread cannot be made, the closure (and `closing` in it) is dropped here,
        // which closes the image on this thread.
        let spawned = std::thread::Builder::new()
            .name("rbd-close".into())
            .spawn(move || {
                drop(closing);
                let _ = tx.send(());
            });
        let wait = self.deadline.saturating_mul(CLOSE_WAIT_DEADLINES);
        if spawned.is_ok() && rx.recv_timeout(wait).is_err() {
            eprintln!(
                "ucrypt: closing an rbd image took longer than {wait:?}; left to finish in the \
                 background"
            );
        }
    }
}

/// An image being closed: `rbd_close`, then the pool and the cluster, in that order.
struct Closing {
    h: ImageT,
    pool: Pool,
}

// SAFETY: see `Image`'s Send: librbd's image handle may be closed on any thread, and the pool
// and cluster handles are released after it on the same thread.
unsafe impl Send for Closing {}

impl Drop for Closing {
    fn drop(&mut self) {
        // SAFETY: `h` came from rbd_open and is closed once, here (the `Image` it came from
        // gave it up). Requests still in flight (given up at their deadline) own their buffers
        // and completions; librbd completes them before its close returns, and their callbacks
        // touch only what they own and the libraries, which outlive this. The pool and then the
        // cluster are released after, when the field drops.
        unsafe { (self.pool.cluster.lib.fns.rbd_close)(self.h) };
    }
}

/// One request in flight: its result, and the buffer librbd reads from or writes into. Shared
/// by the waiting caller and the completion callback; whichever lets go last frees it.
struct Request {
    state: Mutex<RequestState>,
    done: Condvar,
    /// From `Box::<[u8]>::into_raw`, freed when the request is dropped. Only librbd touches the
    /// bytes between submission and completion; only the caller after it saw `rv` set.
    buf: *mut u8,
    len: usize,
    lib: &'static Lib,
    /// The image's count of abandoned requests, lowered when an abandoned one completes.
    abandoned_count: Arc<AtomicUsize>,
}

#[derive(Default)]
struct RequestState {
    /// The request's return value, once librbd completed it.
    rv: Option<isize>,
    /// The caller gave up waiting at its deadline.
    abandoned: bool,
}

// SAFETY: `buf` is the only field that is not Send and Sync by itself. Its bytes are touched
// by librbd (any thread) only between submission and completion, and by the caller only after
// it observed completion through `state`'s mutex, which orders the two; the allocation is
// freed once, by whoever drops the last `Arc`.
unsafe impl Send for Request {}
// SAFETY: as for Send: all shared access goes through `state`.
unsafe impl Sync for Request {}

impl Request {
    fn new(image: &Image, buf: Box<[u8]>) -> Arc<Request> {
        let len = buf.len();
        Arc::new(Request {
            state: Mutex::new(RequestState::default()),
            done: Condvar::new(),
            buf: Box::into_raw(buf).cast::<u8>(),
            len,
            lib: image.lib(),
            abandoned_count: Arc::clone(&image.abandoned),
        })
    }

    /// The buffer, for the caller that saw the request complete.
    fn bytes(&self) -> &[u8] {
        debug_assert!(lock(&self.state).rv.is_some());
        // SAFETY: `buf..buf+len` is the live allocation made in `new`; librbd no longer writes
        // to it once the request completed, which the caller observed under `state`'s mutex.
        unsafe { std::slice::from_raw_parts(self.buf, self.len) }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: `buf` and `len` are the parts of the `Box<[u8]>` made in `new`, freed only
        // here; the last reference is gone, so librbd is done with it (the callback held one).
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.buf, self.len)) });
    }
}

/// The completion callback: records the return value, wakes the caller and lets go of the
/// request. Runs on one of librbd's threads; must not unwind into C (it cannot panic: the lock
/// is poison-tolerant and nothing here allocates beyond the condvar's wake-up).
unsafe extern "C" fn on_complete(c: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the strong reference handed out in `Image::aio` for this completion,
    // which librbd passes back exactly once.
    let req = unsafe { Arc::from_raw(arg.cast_const().cast::<Request>()) };
    // SAFETY: `c` is this request's live completion; its return value is read before the
    // completion is released, once, here (the caller never releases it).
    let rv = unsafe {
        let rv = (req.lib.fns.rbd_aio_get_return_value)(c);
        (req.lib.fns.rbd_aio_release)(c);
        rv
    };
    let mut st = lock(&req.state);
    st.rv = Some(rv);
    if st.abandoned {
        req.abandoned_count.fetch_sub(1, Ordering::AcqRel);
    }
    drop(st);
    req.done.notify_all();
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
