//! vhost-user-blk front end: a ucrypt volume as a virtual machine's virtio-blk disk.
//!
//! A VMM (qemu's `vhost-user-blk-pci`, cloud-hypervisor, Firecracker) connects to a UNIX
//! socket, shares the guest's memory and hands each virtqueue's eventfds over; the guest's
//! requests then arrive in the virtqueues without a copy through the socket. The protocol, the
//! memory map and the event loops are the rust-vmm crates' (`vhost-user-backend`); this crate
//! is the virtio-blk device: the features and config space it offers ([`backend`]) and the
//! requests it serves ([`request`]).
//!
//! One thread per virtqueue (default: one queue per host CPU) takes the queue's kicks. A small
//! request alone in flight is served on that thread, the crypto included; when the guest has
//! more queued, the queue's thread keeps its small reads and writes in flight itself through
//! an io_uring ([`ring`]; the volume does their crypto on that thread), and a bounded set of
//! workers per queue serves the rest at once, big requests always (the volume's dispatch
//! policy may still split one across idle cores), so that the queue's thread is free for the
//! next; they complete out of order and return in order ([`inflight`]). Threads exist only while a VMM is connected; a VMM that disconnects leaves
//! a server that accepts the next one. A request on the caller's [`Stop`] ends the
//! connection, flushes the volume and removes the socket.

pub mod backend;
pub mod inflight;
pub mod request;
pub mod ring;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ucrypt::sync::lock;
use ucrypt::{BlockDev, Stop};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

pub use backend::BlkBackend;

/// What can go wrong serving a vhost-user-blk socket.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be created or waited on.
    #[error("{what} {}: {source}", path.display())]
    Socket {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The vhost-user machinery failed outside a connection (creating the device's threads).
    #[error("{what}: {detail}")]
    Vhost { what: &'static str, detail: String },
    /// The volume failed (flushing it at the end).
    #[error(transparent)]
    Device(#[from] ucrypt::Error),
    /// The VMM could not be told that the config space changed (the backend channel failed,
    /// or the VMM answered with an error).
    #[error("telling the VMM of the new size: {0}")]
    ConfigChange(std::io::Error),
}

impl Error {
    /// Who can act on this error (see [`ucrypt::ErrorKind`]).
    pub fn kind(&self) -> ucrypt::ErrorKind {
        match self {
            Error::Socket { .. } | Error::Vhost { .. } | Error::ConfigChange(_) => {
                ucrypt::ErrorKind::Device
            }
            Error::Device(e) => e.kind(),
        }
    }
}

/// How the device is offered to the VMM.
#[derive(Debug, Clone)]
pub struct VhostOptions {
    /// Virtqueues offered (the VMM's `num-queues` may use fewer); default one per host CPU.
    pub queues: usize,
    /// Offer `VIRTIO_BLK_F_DISCARD` (the volume decides what a discard does).
    pub discard: bool,
    /// What `VIRTIO_BLK_T_GET_ID` answers (the guest's `/sys/block/vdX/serial`).
    pub id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    /// The owner's view of the connection (see [`Handle`]).
    pub handle: Handle,
}

/// How long [`Handle::size_changed`] waits for the VMM's answer to its notice (qemu answers
/// from its main loop at once); past it the notice is reported unanswered.
pub const CONFIG_CHANGE_ANSWER_WAIT: Duration = Duration::from_secs(5);

/// The served device as its owner sees it while [`serve`] runs: whether a VMM is connected,
/// and the way to tell it of a resize ([`Handle::size_changed`]). The owner keeps a clone of
/// [`VhostOptions::handle`] before handing the options to [`run`] or [`serve`].
#[derive(Clone, Default)]
pub struct Handle(Arc<Mutex<Option<Arc<BlkBackend>>>>, Arc<AtomicBool>);

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("connected", &self.connected())
            .finish()
    }
}

impl Handle {
    /// A VMM is connected (its guest may be using the disk).
    pub fn connected(&self) -> bool {
        lock(&self.0).is_some()
    }

    /// Tells the connected VMM that the device's size changed; call once the volume has its
    /// new size. Returns whether a VMM was told: none is when no VMM is connected or the VMM
    /// negotiated no way to tell it (no `BACKEND_REQ` or `CONFIG` protocol feature); such a
    /// VMM shows the guest the new size only once it reads the config space again. See
    /// [`BlkBackend::config_changed`]. Waits at most [`CONFIG_CHANGE_ANSWER_WAIT`] for the
    /// VMM's answer; a VMM that has not answered by then is an error, and so is another
    /// notice while that one is still waiting (the thread waiting for it ends when the VMM
    /// answers or its connection ends: one at most).
    pub fn size_changed(&self) -> Result<bool, Error> {
        // A clone: the VMM's answer comes through the connection's own threads.
        let Some(backend) = lock(&self.0).clone() else {
            return Ok(false);
        };
        let unanswered = || {
            Error::ConfigChange(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the VMM has not answered the config-change notice within {} s",
                    CONFIG_CHANGE_ANSWER_WAIT.as_secs()
                ),
            ))
        };
        if self.1.swap(true, Ordering::AcqRel) {
            return Err(unanswered());
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let pending = self.1.clone();
        let spawned = std::thread::Builder::new()
            .name("vhost-config".into())
            .spawn(move || {
                let r = backend.config_changed();
                pending.store(false, Ordering::Release);
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            self.1.store(false, Ordering::Release);
            return Err(Error::ConfigChange(e));
        }
        match rx.recv_timeout(CONFIG_CHANGE_ANSWER_WAIT) {
            Ok(r) => r.map_err(Error::ConfigChange),
            Err(_) => Err(unanswered()),
        }
    }
}

impl Default for VhostOptions {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        VhostOptions {
            queues: cpus.min(64),
            discard: true,
            id: *b"ucrypt\0\0\0\0\0\0\0\0\0\0\0\0\0\0",
            handle: Handle::default(),
        }
    }
}

/// Makes a serial number of `s`: its first 20 bytes, zero padded.
pub fn id_of(s: &str) -> [u8; VIRTIO_BLK_ID_BYTES as usize] {
    let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let n = s.len().min(id.len());
    id[..n].copy_from_slice(&s.as_bytes()[..n]);
    id
}

/// Serves `dev` at `socket` until `stop` is requested, printing `ready: SOCKET` once a VMM may
/// connect.
pub fn run(
    dev: Arc<dyn BlockDev>,
    socket: &Path,
    opts: VhostOptions,
    stop: &Stop,
) -> Result<(), Error> {
    serve(dev, socket, opts, stop, |p: &Path| {
        println!("ready: {}", p.display());
        let _ = std::io::stdout().flush();
    })
}

/// [`run`] that tells `on_ready` instead of printing.
pub fn serve(
    dev: Arc<dyn BlockDev>,
    socket: &Path,
    opts: VhostOptions,
    stop: &Stop,
    on_ready: impl FnOnce(&Path),
) -> Result<(), Error> {
    let sock_err = |what: &'static str| {
        let path = socket.to_path_buf();
        move |source| Error::Socket { what, path, source }
    };
    let mut listener = Listener::new(socket, true).map_err(|e| Error::Socket {
        what: "listening on",
        path: socket.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    // Guest memory and the plaintext volume: the socket is its owner's only.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(sock_err("restricting"))?;

    // A stop request wakes the accept wait through this pair and ends the connection.
    let (wake_rx, wake_tx) = UnixStream::pair().map_err(sock_err("waiting on"))?;
    let current: Arc<Mutex<Option<ShutdownHandle>>> = Arc::default();
    {
        let current = current.clone();
        let mut wake_tx = wake_tx;
        stop.on_request(move || {
            let _ = wake_tx.write_all(&[1]);
            if let Some(h) = lock(&current).as_ref() {
                h.shutdown();
            }
        });
    }
    on_ready(socket);

    let served = serve_connections(&dev, &mut listener, &opts, stop, &current, &wake_rx);
    let _ = std::fs::remove_file(socket);
    let flushed = dev.flush().map_err(Error::from);
    served.and(flushed)
}

/// One connection after another until `stop` is requested.
fn serve_connections(
    dev: &Arc<dyn BlockDev>,
    listener: &mut Listener,
    opts: &VhostOptions,
    stop: &Stop,
    current: &Mutex<Option<ShutdownHandle>>,
    wake: &UnixStream,
) -> Result<(), Error> {
    loop {
        if !wait_readable(listener, wake).map_err(|source| Error::Socket {
            what: "accepting on",
            path: PathBuf::new(),
            source,
        })? || stop.requested()
        {
            return Ok(());
        }
        // The device's queue threads start here, with a VMM at the door, and end with it.
        let backend = Arc::new(BlkBackend::new(
            dev.clone(),
            opts.queues,
            opts.discard,
            opts.id,
        ));
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let mut daemon = VhostUserDaemon::new("ucrypt-vhost".into(), backend.clone(), mem)
            .map_err(|e| Error::Vhost {
                what: "starting the device",
                detail: e.to_string(),
            })?;
        if let Err(e) = daemon.start(listener) {
            eprintln!("ucrypt vhost: accepting a connection: {e}");
            continue;
        }
        *lock(current) = daemon.shutdown_handle();
        *lock(&opts.handle.0) = Some(backend.clone());
        if stop.requested() {
            daemon.request_shutdown();
        }
        eprintln!("ucrypt vhost: VMM connected");
        match daemon.wait() {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => eprintln!("ucrypt vhost: VMM disconnected"),
            Err(e) => eprintln!("ucrypt vhost: connection ended: {e}"),
        }
        *lock(current) = None;
        *lock(&opts.handle.0) = None;
        // Joins the queue threads, then waits for the requests they handed to workers: no
        // request is in progress once this returns.
        drop(daemon);
        backend.close();
        if let Err(e) = dev.flush() {
            eprintln!("ucrypt vhost: flushing after the connection: {e}");
        }
    }
}

/// Sleeps until the listener has a connection (true) or `wake` was written to (false).
fn wait_readable(listener: &Listener, wake: &UnixStream) -> std::io::Result<bool> {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            let mut b = [0u8; 1];
            let _ = (&*wake).read(&mut b);
            return Ok(false);
        }
        if fds[0].revents != 0 {
            return Ok(true);
        }
    }
}

#[cfg(test)]
mod tests;
