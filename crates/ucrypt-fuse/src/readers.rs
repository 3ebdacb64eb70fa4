//! Classic `/dev/fuse` readers, as many as the load needs: one always runs; more (up to the
//! mount's thread count) start when a reader takes a request while none waits and another
//! request is already queued, and end after [`READER_IDLE`] without a request. The one that
//! stays gives its request buffer's pages back after the same period, so an idle mount costs
//! one thread and a few pages.
//!
//! Readers wait with `poll` on a non-blocking fd (a blocking read has no timeout). Each has its
//! own clone of the connection's fd where the kernel allows (a reply goes on the fd its request
//! was read from); the clones are made at the mount and kept while readers come and go.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ucrypt::sync::lock;
use ucrypt::{Error, Result};

use crate::fs::VolumeFs;
use crate::transport::{self, Read, ReqBuf};

/// How long a reader waits for a request before it ends (one started on demand) or gives its
/// buffer's pages back (the one that stays): as long as the engine's pools keep their memory
/// (`ucrypt::pool::POOL_IDLE_RELEASE`), so a volume goes idle as a whole.
pub const READER_IDLE: Duration = ucrypt::pool::POOL_IDLE_RELEASE;

/// The first error a FUSE thread ended with, kept for `Mounted::join`.
pub type WorkerError = Arc<Mutex<Option<String>>>;

/// Runs `f` on a named thread; its error, if any, is kept in `err`.
pub fn worker(
    name: String,
    err: &WorkerError,
    f: impl FnOnce() -> std::io::Result<()> + Send + 'static,
) -> Result<JoinHandle<()>> {
    let err = err.clone();
    let n2 = name.clone();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            if let Err(e) = f() {
                if let Ok(mut g) = err.lock() {
                    g.get_or_insert(format!("{n2}: {e}"));
                }
            }
        })
        .map_err(|e| Error::io("start FUSE worker thread", e))
}

/// The classic readers of one connection.
pub struct Readers {
    fs: Arc<VolumeFs>,
    /// Fds for readers started on demand, not in use now.
    spare: Mutex<Vec<Arc<OwnedFd>>>,
    /// Readers running, the first one included; at most `max`.
    running: AtomicUsize,
    max: usize,
    /// Readers waiting for a request now.
    waiting: AtomicUsize,
    /// Readers started on demand (finished ones are dropped at the next start).
    started: Mutex<Vec<JoinHandle<()>>>,
    err: WorkerError,
    idle: Duration,
}

impl Readers {
    /// Starts the first reader on `fd` (named `name`), with up to `max` readers in all; `max`
    /// above 1 makes `fd` and its clones non-blocking (readers then wait with a timeout).
    /// Returns the readers and the first one's thread.
    pub fn start(
        fd: Arc<OwnedFd>,
        fs: &Arc<VolumeFs>,
        max: usize,
        name: &str,
        err: &WorkerError,
    ) -> Result<(Arc<Readers>, JoinHandle<()>)> {
        let max = max.max(1);
        let mut spare = Vec::with_capacity(max - 1);
        for _ in 1..max {
            // Where the kernel cannot clone, readers share the connection's fd.
            spare.push(transport::clone_fd(&fd).map_or_else(|_| fd.clone(), Arc::new));
        }
        if max > 1 {
            for f in spare.iter().chain(std::iter::once(&fd)) {
                transport::set_nonblocking(f).map_err(|e| Error::io("FUSE fd O_NONBLOCK", e))?;
            }
        }
        let r = Arc::new(Readers {
            fs: fs.clone(),
            spare: Mutex::new(spare),
            running: AtomicUsize::new(1),
            max,
            waiting: AtomicUsize::new(0),
            started: Mutex::new(Vec::new()),
            err: err.clone(),
            idle: READER_IDLE,
        });
        let r2 = r.clone();
        let first = worker(name.into(), err, move || r2.serve(&fd, true))?;
        Ok((r, first))
    }

    /// True once every reader started on demand has ended.
    pub fn finished(&self) -> bool {
        lock(&self.started).iter().all(|h| h.is_finished())
    }

    /// Waits for the readers started on demand (after the connection ended: they end too).
    pub fn join(&self) -> Result<()> {
        loop {
            let handles = std::mem::take(&mut *lock(&self.started));
            if handles.is_empty() {
                return Ok(());
            }
            for h in handles {
                h.join()
                    .map_err(|_| Error::Bug("a FUSE worker thread panicked"))?;
            }
        }
    }

    /// One reader's loop: reads and answers requests on `fd` until the connection goes away;
    /// a reader started on demand (`stays` false) also ends after [`READER_IDLE`] without one.
    fn serve(self: &Arc<Self>, fd: &OwnedFd, stays: bool) -> std::io::Result<()> {
        let mut buf = ReqBuf::new()?;
        let raw = fd.as_raw_fd();
        loop {
            match transport::read_request(raw, buf.as_mut_slice())? {
                Read::Again => continue,
                Read::Gone => return Ok(()),
                Read::Got(n) => {
                    self.grow();
                    if !transport::serve_classic(raw, &self.fs, buf.as_mut_slice(), n)? {
                        return Ok(());
                    }
                }
                Read::Empty => {
                    self.waiting.fetch_add(1, Ordering::SeqCst);
                    let mut ready = transport::wait_readable(raw, Some(self.idle));
                    if let Ok(false) = ready {
                        if !stays {
                            self.waiting.fetch_sub(1, Ordering::SeqCst);
                            return Ok(());
                        }
                        buf.release();
                        ready = transport::wait_readable(raw, None);
                    }
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    ready?;
                }
            }
        }
    }

    /// Starts one more reader if none waits, another request is queued, and the bound allows.
    /// Called by a reader that has just taken a request, before it serves it.
    fn grow(self: &Arc<Self>) {
        if self.max == 1 || self.waiting.load(Ordering::SeqCst) > 0 {
            return;
        }
        let n = self.running.load(Ordering::SeqCst);
        if n >= self.max {
            return;
        }
        let Some(fd) = lock(&self.spare).last().cloned() else {
            return;
        };
        if !transport::request_queued(fd.as_raw_fd()) {
            return;
        }
        if self
            .running
            .compare_exchange(n, n + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return;
        }
        let Some(fd) = lock(&self.spare).pop() else {
            self.running.fetch_sub(1, Ordering::SeqCst);
            return;
        };
        let r = self.clone();
        let f2 = fd.clone();
        let spawned = worker(format!("fuse-{n}"), &self.err, move || {
            let res = r.serve(&f2, false);
            lock(&r.spare).push(f2);
            r.running.fetch_sub(1, Ordering::SeqCst);
            res
        });
        match spawned {
            Ok(h) => {
                let mut started = lock(&self.started);
                started.retain(|h| !h.is_finished());
                started.push(h);
            }
            Err(_) => {
                lock(&self.spare).push(fd);
                self.running.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}
