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
//! Buffer ownership. A request is submitted with `rbd_aio_*` and a completion without callback,
//! then waited for with `rbd_aio_wait_for_complete` on the calling thread before the call
//! returns, so the caller's buffer (borrowed by [`Image::read`] or [`Image::write`] for the
//! whole call) outlives every use librbd makes of it, and the completion is released exactly
//! once, after the wait. librbd may not return from the wait only if the cluster never answers;
//! `rados_osd_op_timeout` (set by the caller before connecting) bounds that: the request then
//! completes with `-ETIMEDOUT`.
//!
//! Threads. librbd's image handle is safe to use from many threads at once: asynchronous
//! requests go through its own locked queues (qemu and fio issue them from several threads on
//! one handle). So many callers can each have a request in flight on one [`Image`].

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::sync::OnceLock;

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
    rbd_aio_wait_for_complete: unsafe extern "C" fn(CompletionT) -> c_int,
    rbd_aio_get_return_value: unsafe extern "C" fn(CompletionT) -> isize,
    rbd_aio_release: unsafe extern "C" fn(CompletionT),
    rbd_aio_read: unsafe extern "C" fn(ImageT, u64, usize, *mut c_char, CompletionT) -> c_int,
    rbd_aio_write: unsafe extern "C" fn(ImageT, u64, usize, *const c_char, CompletionT) -> c_int,
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
            rbd_aio_wait_for_complete: sym!(rbd, rbd_name, rbd_aio_wait_for_complete),
            rbd_aio_get_return_value: sym!(rbd, rbd_name, rbd_aio_get_return_value),
            rbd_aio_release: sym!(rbd, rbd_name, rbd_aio_release),
            rbd_aio_read: sym!(rbd, rbd_name, rbd_aio_read),
            rbd_aio_write: sym!(rbd, rbd_name, rbd_aio_write),
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

impl Pool {
    /// `rbd_open` (or `rbd_open_read_only`) of `image` at `snapshot` (`None`: the head).
    pub fn open_image(
        self,
        image: &CStr,
        snapshot: Option<&CStr>,
        read_only: bool,
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
        Ok(Image { h, pool: self })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: `h` came from rados_ioctx_create and is destroyed once, here, after every
        // image opened on it was closed (an `Image` owns its `Pool`); the cluster is shut down
        // after this, when the field drops.
        unsafe { (self.cluster.lib.fns.rados_ioctx_destroy)(self.h) };
    }
}

/// An open RBD image (`rbd_image_t`).
pub struct Image {
    h: ImageT,
    pool: Pool,
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

impl Image {
    fn lib(&self) -> &'static Lib {
        self.pool.cluster.lib
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

    pub fn resize(&self, size: u64) -> Result<(), CallError> {
        // SAFETY: an open image; librbd locks the image against concurrent I/O itself.
        check("rbd_resize", unsafe {
            (self.lib().fns.rbd_resize)(self.h, size)
        })
    }

    /// Reads into `buf` at `offset`; returns the bytes read (fewer at the end of the image).
    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize, CallError> {
        let (ptr, len) = (buf.as_mut_ptr().cast::<c_char>(), buf.len());
        // SAFETY: `ptr..ptr+len` is `buf`, exclusively borrowed for this whole call, and `aio`
        // returns only after the request completed, so librbd writes into live memory no one
        // else touches.
        let n = self.aio("rbd_aio_read", |c| unsafe {
            (self.lib().fns.rbd_aio_read)(self.h, offset, len, ptr, c)
        })?;
        // librbd returns the bytes read, never more than asked.
        Ok(n.min(len))
    }

    pub fn write(&self, buf: &[u8], offset: u64) -> Result<(), CallError> {
        let (ptr, len) = (buf.as_ptr().cast::<c_char>(), buf.len());
        // SAFETY: `ptr..ptr+len` is `buf`, borrowed for this whole call, and `aio` returns only
        // after the request completed: librbd reads live memory.
        self.aio("rbd_aio_write", |c| unsafe {
            (self.lib().fns.rbd_aio_write)(self.h, offset, len, ptr, c)
        })
        .map(drop)
    }

    pub fn discard(&self, offset: u64, len: u64) -> Result<(), CallError> {
        // SAFETY: an open image; no buffer.
        self.aio("rbd_aio_discard", |c| unsafe {
            (self.lib().fns.rbd_aio_discard)(self.h, offset, len, c)
        })
        .map(drop)
    }

    pub fn write_zeroes(&self, offset: u64, len: usize) -> Result<(), CallError> {
        // SAFETY: an open image; no buffer; flags 0 (no thick provisioning, no op flags).
        self.aio("rbd_aio_write_zeroes", |c| unsafe {
            (self.lib().fns.rbd_aio_write_zeroes)(self.h, offset, len, c, 0, 0)
        })
        .map(drop)
    }

    pub fn flush(&self) -> Result<(), CallError> {
        // SAFETY: an open image; no buffer.
        self.aio("rbd_aio_flush", |c| unsafe {
            (self.lib().fns.rbd_aio_flush)(self.h, c)
        })
        .map(drop)
    }

    /// Makes a completion, submits with it, waits, and returns the request's non-negative
    /// return value. `submit` must hand the completion to one `rbd_aio_*` call and return its
    /// return code.
    fn aio(
        &self,
        call: &'static str,
        submit: impl FnOnce(CompletionT) -> c_int,
    ) -> Result<usize, CallError> {
        let fns = &self.lib().fns;
        let mut c: CompletionT = std::ptr::null_mut();
        // SAFETY: no callback and no argument (the completion is waited for instead), and a
        // valid out pointer.
        check("rbd_aio_create_completion", unsafe {
            (fns.rbd_aio_create_completion)(std::ptr::null_mut(), None, &mut c)
        })?;
        let submitted = check(call, submit(c));
        let rv = match submitted {
            // SAFETY: `c` is a live completion that librbd accepted; the wait returns once the
            // request finished, and the return value is read before the release below.
            Ok(()) => unsafe {
                (fns.rbd_aio_wait_for_complete)(c);
                (fns.rbd_aio_get_return_value)(c)
            },
            Err(_) => 0,
        };
        // SAFETY: `c` is live and released once, here: either its request completed (waited
        // for above) or it was refused and librbd holds no reference to it.
        unsafe { (fns.rbd_aio_release)(c) };
        submitted?;
        if rv < 0 {
            return Err(CallError {
                call,
                errno: i32::try_from(-rv).unwrap_or(libc::EIO),
            });
        }
        // A non-negative `isize` always fits in `usize`.
        Ok(rv as usize)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: `h` came from rbd_open and is closed once, here; no request is in flight,
        // since every request is waited for inside the call that made it and those calls
        // borrow the image. The pool and then the cluster are released after this.
        unsafe { (self.lib().fns.rbd_close)(self.h) };
    }
}
