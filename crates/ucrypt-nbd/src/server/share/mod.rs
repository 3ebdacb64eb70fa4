//! One NBD socket shared by several processes, each serving its own export (`ucrypt open ...
//! --nbd unix:PATH` naming the same PATH): a crash of one takes only its own export down.
//!
//! Roles, for one PATH:
//! - The **owner** holds the listening socket, accepts every client and runs every handshake
//!   (newstyle fixed: `LIST`, `INFO`, `GO`, `EXPORT_NAME`) over its own export and every
//!   member's. A client that chooses a member's export is passed, its handshake over, to that
//!   member (`SCM_RIGHTS`, see `server/fdpass.rs`); the owner keeps nothing of it.
//! - A **member** registered its export with the owner and serves the transmission phase of the
//!   clients passed to it, on the server's ordinary connection threads.
//!
//! Registration goes through a socket in the abstract namespace named after PATH (and the
//! user): binding an abstract name is atomic and the name goes with its last holder, so it
//! doubles as the election of the owner with no file to go stale. Both ends check that the
//! other is the same user (`SO_PEERCRED`), since abstract sockets have no file permissions.
//! A second `attach` to PATH connects there and joins; when nobody answers it becomes the owner
//! (and binds PATH by [`super::bind_unix`]'s rule: a live server that is not a ucrypt owner is
//! refused, exit 5 in the CLI). A name already served on the socket is refused.
//!
//! The owner gives every member a copy of the listening socket when it joins. When the owner
//! leaves (closed or killed), its members see their registration connection end; the first to
//! bind the registration name becomes the owner and accepts on its copy of the listening
//! socket (clients that connect meanwhile wait in the kernel's backlog; PATH is never
//! removed while a member remains or a join is under way), and the others register with it.
//! The last process to leave removes PATH, even when an owner and its last member stop at
//! once (`leave`); only a killed last server leaves the file, and the next bind replaces it
//! as stale.
//! Established connections are untouched by any of this: each is served by the process that
//! owns its export.
//!
//! Bounds: [`SHARED_EXPORTS_MAX`] exports on one socket, and [`HANDSHAKES_PENDING_MAX`]
//! clients in their handshake at once (more wait in the backlog: the owner stops accepting).
//!
//! Nothing here wakes while idle: the owner's accept loop waits in one `poll` on the NBD
//! listener, the registration socket, every member's registration connection and the stop
//! (an eventfd, `server/stop_fd.rs`), with no timeout, so the owner needs no thread beside the
//! one that accepts; a member waits the same way on its registration connection and the stop.
//! [`serve_watching`] adds the caller's descriptors to each of these waits, so a daemon serves
//! its own events on the same thread.
//! [`ShareState`] says, live, which part an export plays ([`Standing`]), for `status`.

mod msg;
#[cfg(test)]
mod tests;

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ucrypt::sync::lock;
use ucrypt::{BlockDev, Stop};

use super::fdpass;
use super::stop_fd::{self, pollin};
use super::unix_socket::{bind_unix, BoundSocket};
use super::Entry;
use super::{wait_watching, Both, Conns, Export, Interest, Listener, ServerOptions, Sock, Watch};
use crate::proto::ExportInfo;
use crate::{Error, Result};
use msg::Msg;

/// Exports one shared socket serves at most (the owner's own included): each member costs the
/// owner one registration connection and a slot in every `LIST` reply.
pub const SHARED_EXPORTS_MAX: usize = 1024;
/// Clients in their handshake at the owner at once; further clients wait in the listening
/// socket's backlog until one finishes (each handshake is bounded by its own timeout).
pub const HANDSHAKES_PENDING_MAX: usize = 64;
/// How long `attach` retries while an owner is leaving (its registration name or PATH still
/// held for a moment) before it gives up.
const ATTACH_WAIT: Duration = Duration::from_secs(2);
/// How long a member whose owner left tries to take the listener over or join the new owner.
const TAKEOVER_WAIT: Duration = Duration::from_secs(10);
const RETRY_STEP: Duration = Duration::from_millis(20);
/// A registration message must arrive (or be sent) within this time.
const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections to the owner's registration whose `Join` has not arrived yet, at most (each
/// for [`MESSAGE_TIMEOUT`] at most); further joiners wait in the registration's backlog.
const JOINS_PENDING_MAX: usize = 16;
/// Connections an owner that leaves takes from its registration's backlog, to see whether a
/// join is under way (the backlog holds no more than the listen backlog anyway).
const JOINS_AT_CLOSE_MAX: usize = 1024;

/// A member's export as the owner knows it.
pub(crate) struct Member {
    pub(crate) info: ExportInfo,
    pid: u32,
    fd: RawFd,
    /// The registration connection: client sockets go to the member through it, one message
    /// at a time.
    stream: Mutex<UnixStream>,
}

impl Member {
    /// Hands `sock` (its handshake done, the export chosen) to the member.
    pub(crate) fn pass(&self, sock: &Sock) -> io::Result<()> {
        let frame = msg::encode(&Msg::Conn {
            export: self.info.name.clone(),
        });
        let s = lock(&self.stream);
        fdpass::send(&s, &frame, Some(sock.as_fd()))
    }
}

/// The members of the socket this process owns (empty while it is a member itself).
#[derive(Default)]
pub(crate) struct Registry {
    members: Mutex<Vec<Arc<Member>>>,
}

impl Registry {
    pub(crate) fn snapshot(&self) -> Vec<Arc<Member>> {
        lock(&self.members).clone()
    }

    fn len(&self) -> usize {
        lock(&self.members).len()
    }
}

/// Where an attached export stands on its socket now ([`ShareState::standing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// This process listens and negotiates for `exports` exports, its own included.
    Owner { exports: usize },
    /// Joined the owner, process `owner_pid`, which passes this export's clients here.
    Member { owner_pid: u32 },
    /// The owner left: this process is taking the socket over or joining the next owner.
    TakingOver,
    /// Off the socket (serving ended, or no takeover succeeded): only the connections made
    /// before are served.
    Detached,
}

/// What [`Standing`] is made of, without the owner's member count (read live).
#[derive(Clone, Copy)]
enum Part {
    Owner,
    Member { owner_pid: u32 },
    TakingOver,
    Detached,
}

/// A live view of an attached export's [`Standing`], shared with whoever reports on it while
/// [`serve`] runs (a member may become the owner, an owner gain or lose members).
#[derive(Clone)]
pub struct ShareState(Arc<StateInner>);

struct StateInner {
    registry: Arc<Registry>,
    part: Mutex<Part>,
}

impl ShareState {
    fn new(part: Part) -> ShareState {
        ShareState(Arc::new(StateInner {
            registry: Arc::new(Registry::default()),
            part: Mutex::new(part),
        }))
    }

    fn set(&self, part: Part) {
        *lock(&self.0.part) = part;
    }

    /// Where the export stands now.
    pub fn standing(&self) -> Standing {
        match *lock(&self.0.part) {
            Part::Owner => Standing::Owner {
                exports: 1 + self.0.registry.len(),
            },
            Part::Member { owner_pid } => Standing::Member { owner_pid },
            Part::TakingOver => Standing::TakingOver,
            Part::Detached => Standing::Detached,
        }
    }
}

/// The owner's sockets: registration, NBD listener.
struct Owner {
    registration: UnixListener,
    listener: UnixListener,
    bound: BoundSocket,
}

/// A member's link to its owner and its copy of the listening socket (for a takeover).
struct Membership {
    stream: UnixStream,
    listener: OwnedFd,
    dev: u64,
    ino: u64,
    /// The owner's process (`SO_PEERCRED` of the registration connection).
    owner_pid: u32,
}

enum Role {
    Owner(Owner),
    Member(Membership),
}

/// An export attached to a shared socket ([`attach`]), to be served by [`serve`].
pub struct Attached {
    path: PathBuf,
    dev: Arc<dyn BlockDev>,
    info: ExportInfo,
    role: Role,
    state: ShareState,
}

impl Attached {
    /// Whether this process listens (else it joined another's listener).
    pub fn owner(&self) -> bool {
        matches!(self.role, Role::Owner(_))
    }

    /// Where the export stands, kept up to date by [`serve`].
    pub fn state(&self) -> ShareState {
        self.state.clone()
    }
}

impl Role {
    fn part(&self) -> Part {
        match self {
            Role::Owner(_) => Part::Owner,
            Role::Member(m) => Part::Member {
                owner_pid: m.owner_pid,
            },
        }
    }
}

/// 64-bit FNV-1a: names the registration socket after a path too long for an abstract name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// PATH as every process names it: its directory resolved, so that two spellings of one
/// socket meet at one registration name.
fn canonical(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(dir), Some(file)) => std::fs::canonicalize(dir)
            .map(|d| d.join(file))
            .unwrap_or(abs.clone()),
        _ => abs,
    }
}

fn registration_addr(path: &Path) -> io::Result<SocketAddr> {
    let name = format!(
        "ucrypt-nbd-share/{}/{:016x}",
        fdpass::my_uid(),
        fnv1a(canonical(path).as_os_str().as_bytes())
    );
    SocketAddr::from_abstract_name(name.as_bytes())
}

fn busy(what: String) -> Error {
    Error::io(what, io::Error::from_raw_os_error(libc::EBUSY))
}

/// Reads exactly `buf.len()` bytes, keeping the first descriptor that comes with them (others
/// are closed); `Ok(false)` at a clean end before the first byte.
fn read_exact_fds(s: &UnixStream, buf: &mut [u8], fd: &mut Option<OwnedFd>) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let (n, fds) = fdpass::recv(s, &mut buf[got..])?;
        for f in fds {
            if fd.is_none() {
                *fd = Some(f);
            }
        }
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// The next message and the descriptor that came with it; `None` at the end of the stream.
fn read_msg(s: &UnixStream) -> Result<Option<(Msg, Option<OwnedFd>)>> {
    let ctx = |e| Error::io("reading a shared-listener message", e);
    let mut fd = None;
    let mut hdr = [0u8; msg::HEADER_BYTES];
    if !read_exact_fds(s, &mut hdr, &mut fd).map_err(ctx)? {
        return Ok(None);
    }
    let (kind, len) = msg::decode_header(&hdr)?;
    let mut body = vec![0u8; len];
    if !read_exact_fds(s, &mut body, &mut fd).map_err(ctx)? && len > 0 {
        return Err(ctx(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Some((msg::decode(kind, &body)?, fd)))
}

/// How a join went.
enum Joined {
    Member(Membership),
    /// Nobody answers at the registration name.
    NoOwner,
}

/// Registers `info` with the owner of `path`, if there is one.
fn try_join(path: &Path, info: &ExportInfo) -> Result<Joined> {
    let addr = registration_addr(path).map_err(|e| Error::io("naming the registration", e))?;
    let s = match UnixStream::connect_addr(&addr) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(Joined::NoOwner),
        Err(e) => return Err(Error::io("joining the NBD listener", e)),
    };
    let io = |e| Error::io(format!("joining the NBD listener at {}", path.display()), e);
    if fdpass::peer_uid(&s).map_err(io)? != fdpass::my_uid() {
        return Err(busy(format!(
            "{}: its registration is held by another user; name another path",
            path.display()
        )));
    }
    let owner_pid = fdpass::peer_pid(&s).map_err(io)?;
    s.set_read_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    s.set_write_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    let join = msg::encode(&Msg::Join {
        pid: std::process::id(),
        info: info.clone(),
    });
    fdpass::send(&s, &join, None).map_err(io)?;
    match read_msg(&s)? {
        Some((Msg::Welcome { dev, ino }, Some(listener))) => Ok(Joined::Member(Membership {
            stream: s,
            listener,
            dev,
            ino,
            owner_pid,
        })),
        Some((Msg::Refused { why }, _)) => {
            Err(busy(format!("NBD socket {}: {why}", path.display())))
        }
        Some(_) => Err(Error::Protocol(
            "shared NBD listener: an unexpected answer to a join".into(),
        )),
        None => Err(io(io::ErrorKind::UnexpectedEof.into())),
    }
}

/// Binds the registration name: `Ok(None)` if another process holds it.
fn claim_registration(path: &Path) -> Result<Option<UnixListener>> {
    let addr = registration_addr(path).map_err(|e| Error::io("naming the registration", e))?;
    match UnixListener::bind_addr(&addr) {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Ok(None),
        Err(e) => Err(Error::io("binding the NBD listener's registration", e)),
    }
}

fn is_busy(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::EBUSY))
}

/// Attaches export `name` (the device `dev`) to the NBD socket at `path`: joins the ucrypt
/// process that listens there, or listens there itself. A name the socket serves already is
/// refused (an `Io` error with `EBUSY`), as is a live socket that no ucrypt owner holds.
pub fn attach(
    path: &Path,
    name: &str,
    dev: Arc<dyn BlockDev>,
    read_only: bool,
) -> Result<Attached> {
    let info = super::export_info(name, dev.as_ref(), read_only)?;
    if name.is_empty() {
        return Err(Error::Config(
            "a shared NBD socket needs a named export".into(),
        ));
    }
    let deadline = Instant::now() + ATTACH_WAIT;
    loop {
        let last = match try_join(path, &info) {
            Ok(Joined::Member(m)) => Some(Role::Member(m)),
            Err(e) if is_busy(&e) => return Err(e),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) | Ok(Joined::NoOwner) => match claim_registration(path)? {
                Some(registration) => match bind_unix(path) {
                    Ok((listener, bound)) => Some(Role::Owner(Owner {
                        registration,
                        listener,
                        bound,
                    })),
                    // An owner leaving still holds PATH for a moment.
                    Err(e) if is_busy(&e) && Instant::now() < deadline => None,
                    Err(e) => return Err(e),
                },
                None => None,
            },
        };
        if let Some(role) = last {
            return Ok(Attached {
                path: path.to_path_buf(),
                dev,
                info,
                state: ShareState::new(role.part()),
                role,
            });
        }
        if Instant::now() >= deadline {
            return Err(busy(format!(
                "{}: a shared NBD listener is changing owners; try again",
                path.display()
            )));
        }
        std::thread::sleep(RETRY_STEP);
    }
}

/// A connection to the owner's registration whose `Join` has not arrived yet.
struct PendingJoin {
    stream: UnixStream,
    since: Instant,
}

/// The owner's registration, watched by its accept loop ([`Watch`]): admits members, drops
/// those whose connection ends. A joiner's `Join` is read once it arrived, so that a slow
/// joiner holds up no client.
struct Registration<'a> {
    socket: UnixListener,
    /// A copy of the NBD listening socket, for every member (a takeover needs it).
    listener: OwnedFd,
    id: (u64, u64),
    registry: &'a Registry,
    local: &'a str,
    pending: Vec<PendingJoin>,
    /// The members whose connections the last [`Watch::fds`] gave, in order.
    polled: Vec<Arc<Member>>,
}

impl Watch for Registration<'_> {
    fn fds(&mut self, out: &mut Vec<(RawFd, Interest)>) {
        self.polled = self.registry.snapshot();
        // -1 (skipped by poll) while the pending joins are full: the rest wait in the backlog.
        let full = self.pending.len() >= JOINS_PENDING_MAX;
        let input = |fd| (fd, Interest::Input);
        out.push(input(if full { -1 } else { self.socket.as_raw_fd() }));
        out.extend(self.pending.iter().map(|p| input(p.stream.as_raw_fd())));
        out.extend(self.polled.iter().map(|m| input(m.fd)));
    }

    fn ready(&mut self, events: &[bool]) {
        let Some((&joining, rest)) = events.split_first() else {
            return;
        };
        let (joins, members) = rest.split_at(self.pending.len().min(rest.len()));
        // A member sends nothing after its join: readable means gone (or broken).
        for (m, _) in self.polled.iter().zip(members).filter(|(_, &e)| e) {
            eprintln!(
                "ucrypt: NBD export '{}' (pid {}) left the shared listener",
                m.info.name, m.pid
            );
            lock(&self.registry.members).retain(|x| !Arc::ptr_eq(x, m));
        }
        let mut flags = joins.iter().copied().chain(std::iter::repeat(false));
        for p in std::mem::take(&mut self.pending) {
            if flags.next() == Some(true) {
                admit(
                    p.stream,
                    self.listener.as_fd(),
                    self.id,
                    self.registry,
                    self.local,
                );
            } else if p.since.elapsed() >= MESSAGE_TIMEOUT {
                eprintln!("ucrypt: a join of the shared NBD listener sent nothing: dropped");
            } else {
                self.pending.push(p);
            }
        }
        if joining {
            if let Ok((s, _)) = self.socket.accept() {
                self.pending_join(s);
            }
        }
    }

    /// Until the oldest pending join's time is up.
    fn timeout_ms(&self) -> i32 {
        self.pending
            .iter()
            .map(|p| MESSAGE_TIMEOUT.saturating_sub(p.since.elapsed()))
            .min()
            .map_or(-1, |d| d.as_millis().min(i32::MAX as u128) as i32 + 1)
    }
}

impl Registration<'_> {
    /// A new connection to the registration: kept until its `Join` arrives, if it is this
    /// user's.
    fn pending_join(&mut self, s: UnixStream) {
        if fdpass::peer_uid(&s).ok() != Some(fdpass::my_uid()) {
            eprintln!("ucrypt: refusing another user's join of the shared NBD listener");
            return;
        }
        if s.set_read_timeout(Some(MESSAGE_TIMEOUT)).is_err()
            || s.set_write_timeout(Some(MESSAGE_TIMEOUT)).is_err()
        {
            return;
        }
        self.pending.push(PendingJoin {
            stream: s,
            since: Instant::now(),
        });
    }

    /// Stops registering; returns whether members remained (then they take the listener
    /// over: their connections end as these go, once no handshake holds one). A join under
    /// way counts as a member, whether its `Join` is pending or its connection still waits in
    /// the backlog (at most [`JOINS_AT_CLOSE_MAX`] are taken from it): it may be a member
    /// that is taking over after an earlier owner left, which needs PATH to stay; its
    /// connection ends here and it retries.
    fn close(self) -> bool {
        let mut joining = !self.pending.is_empty();
        if self.socket.set_nonblocking(true).is_ok() {
            for _ in 0..JOINS_AT_CLOSE_MAX {
                if self.socket.accept().is_err() {
                    break;
                }
                joining = true;
            }
        }
        drop(self.socket);
        drop(self.pending);
        let mut members = lock(&self.registry.members);
        // Looked at only now that the registration name is free: a member that leaves after
        // this look finds the name free and removes PATH itself ([`leave`]).
        let remained = members.iter().any(|m| still_joined(m.fd)) || joining;
        members.clear();
        remained
    }
}

/// Whether a member's registration connection is still open: a member sends nothing after its
/// join, so a readable (or hung-up) connection is one whose member left.
fn still_joined(fd: RawFd) -> bool {
    let mut fds = [pollin(fd)];
    stop_fd::wait(&mut fds, 0) == 0
}

/// Takes or refuses one member's join.
fn admit(
    s: UnixStream,
    listener: BorrowedFd<'_>,
    (dev, ino): (u64, u64),
    registry: &Registry,
    local: &str,
) {
    let (pid, info) = match read_msg(&s) {
        Ok(Some((Msg::Join { pid, info }, _))) => (pid, info),
        Ok(_) => return,
        Err(e) => {
            eprintln!("ucrypt: a join of the shared NBD listener: {e}");
            return;
        }
    };
    let mut members = lock(&registry.members);
    let refusal = if info.name.is_empty() {
        Some("an export needs a name".to_string())
    } else if info.name == local {
        Some(format!(
            "export name '{}' is served there already (by pid {})",
            info.name,
            std::process::id()
        ))
    } else if let Some(m) = members.iter().find(|m| m.info.name == info.name) {
        Some(format!(
            "export name '{}' is served there already (by pid {})",
            info.name, m.pid
        ))
    } else if members.len() + 1 >= SHARED_EXPORTS_MAX {
        Some(format!(
            "it serves {SHARED_EXPORTS_MAX} exports, the most one socket may"
        ))
    } else {
        None
    };
    if let Some(why) = refusal {
        let _ = fdpass::send(&s, &msg::encode(&Msg::Refused { why }), None);
        return;
    }
    if let Err(e) = fdpass::send(&s, &msg::encode(&Msg::Welcome { dev, ino }), Some(listener)) {
        eprintln!("ucrypt: welcoming NBD export '{}': {e}", info.name);
        return;
    }
    eprintln!(
        "ucrypt: NBD export '{}' (pid {pid}) joined the shared listener",
        info.name
    );
    members.push(Arc::new(Member {
        info,
        pid,
        fd: s.as_raw_fd(),
        stream: Mutex::new(s),
    }));
}

/// Owns the socket until `stop`: accepts and negotiates for every export and runs the
/// registration, all on this thread ([`Registration`] is its accept loop's [`Watch`], beside
/// `outside`). On stop, members left keep PATH (they take the listener over).
fn run_owner(
    o: Owner,
    shared: &Arc<super::Shared>,
    registry: &Registry,
    conns: &mut Conns,
    outside: &mut dyn Watch,
) {
    let Owner {
        registration,
        listener,
        bound,
    } = o;
    let id = bound.file_id();
    let copy = listener.as_fd().try_clone_to_owned();
    let l = Listener::Unix(listener, bound);
    let remained = match copy {
        Ok(copy) => {
            let local = shared.exports[0].info.name.clone();
            let mut watch = Registration {
                socket: registration,
                listener: copy,
                id,
                registry,
                local: &local,
                pending: Vec::new(),
                polled: Vec::new(),
            };
            super::accept_loop(&l, shared, conns, &mut Both::new(&mut watch, outside));
            watch.close()
        }
        Err(e) => {
            eprintln!("ucrypt: NBD listener: {e}: serving without members");
            drop(registration);
            super::accept_loop(&l, shared, conns, outside);
            false
        }
    };
    if let (true, Listener::Unix(_, bound)) = (remained, &l) {
        bound.keep();
    }
    super::listener_close(l);
}

/// Why a member stopped serving through its owner.
enum MemberEnd {
    /// The server's stop was requested.
    Stopped(Membership),
    /// The owner is gone: take over or join the next.
    OwnerLeft(Membership),
}

/// Serves the clients the owner passes until `stop` or until the owner is gone. Waits on the
/// registration connection, the stop and `outside`, with no timeout of its own.
fn run_member(
    m: Membership,
    shared: &Arc<super::Shared>,
    conns: &mut Conns,
    outside: &mut dyn Watch,
) -> MemberEnd {
    let own = &shared.exports[0].info.name;
    let mut fds = [
        pollin(shared.stop_fd.as_raw_fd()),
        pollin(m.stream.as_raw_fd()),
    ];
    while !shared.stop.requested() {
        if wait_watching(&mut fds, outside, -1) == 0 || fds[1].revents == 0 {
            continue;
        }
        match read_msg(&m.stream) {
            Ok(Some((Msg::Conn { export }, Some(fd)))) if &export == own => {
                conns.admit(shared, Sock::Unix(UnixStream::from(fd)), Entry::Transmit(0));
            }
            Ok(Some(_)) => eprintln!("ucrypt: shared NBD listener: an unexpected message"),
            Ok(None) | Err(_) => return MemberEnd::OwnerLeft(m),
        }
    }
    MemberEnd::Stopped(m)
}

/// A member that stops: leaves its owner, and removes PATH if the owner went at the same time
/// and nobody else is left on the socket. The owner, closing, keeps PATH for the members it
/// still counts ([`Registration::close`]); it frees the registration name before it counts,
/// so a member it counted finds the name free here once it has left.
fn leave(path: &Path, m: Membership) {
    let Membership {
        stream,
        listener,
        dev,
        ino,
        ..
    } = m;
    drop(stream);
    drop(listener);
    // Held: a live owner, or a member that took over.
    let Ok(Some(registration)) = claim_registration(path) else {
        return;
    };
    // A member taking over would join here: PATH stays for it (it retries and claims).
    if registration.set_nonblocking(true).is_ok() && registration.accept().is_ok() {
        return;
    }
    // Removed on drop if PATH is still the socket this member was given.
    drop(BoundSocket::adopt(path.to_path_buf(), dev, ino));
}

/// Waits, with no timeout of its own, until the server's stop is requested (`outside` is
/// served meanwhile).
fn wait_for_stop(shared: &super::Shared, outside: &mut dyn Watch) {
    let mut fds = [pollin(shared.stop_fd.as_raw_fd())];
    while !shared.stop.requested() {
        wait_watching(&mut fds, outside, -1);
    }
}

/// After the owner left: become the owner (on the listening socket this member holds, while
/// PATH still names it) or join whoever did. `outside` is served between tries.
fn takeover(
    path: &Path,
    info: &ExportInfo,
    m: Membership,
    shared: &super::Shared,
    outside: &mut dyn Watch,
) -> Result<Role> {
    let stop = &shared.stop;
    eprintln!(
        "ucrypt: the owner of the NBD socket {} left: taking over or joining the next",
        path.display()
    );
    let deadline = Instant::now() + TAKEOVER_WAIT;
    let mut m = Some(m);
    loop {
        match try_join(path, info) {
            Ok(Joined::Member(new)) => return Ok(Role::Member(new)),
            Err(e) if is_busy(&e) => return Err(e),
            Ok(Joined::NoOwner) | Err(_) => {}
        }
        if let Some(registration) = claim_registration(path)? {
            let Some(old) = m.take() else {
                return Err(Error::Bug("shared NBD takeover without its membership"));
            };
            let same = std::fs::symlink_metadata(path).is_ok_and(|s| {
                s.file_type().is_socket() && s.dev() == old.dev && s.ino() == old.ino
            });
            let (listener, bound) = if same {
                let bound = BoundSocket::adopt(path.to_path_buf(), old.dev, old.ino);
                (UnixListener::from(old.listener), bound)
            } else {
                bind_unix(path)?
            };
            eprintln!("ucrypt: now listening at {}", path.display());
            return Ok(Role::Owner(Owner {
                registration,
                listener,
                bound,
            }));
        }
        if stop.requested() || Instant::now() >= deadline {
            return Err(busy(format!(
                "{}: no process took the shared NBD listener over",
                path.display()
            )));
        }
        let mut fds = [pollin(shared.stop_fd.as_raw_fd())];
        wait_watching(&mut fds, outside, RETRY_STEP.as_millis() as i32);
    }
}

/// Serves the attached export until `stop`, as owner or member (a member may become the
/// owner); then lets every connection finish and flushes the device. Keeps the export's
/// [`ShareState`] up to date.
pub fn serve(a: Attached, opts: ServerOptions, stop: Stop) -> Result<()> {
    serve_watching(a, opts, stop, &mut ())
}

/// [`serve`], with `outside`'s descriptors in every wait of this thread: the caller's own
/// events are served on the thread that serves the socket, which then needs none of its own.
/// The watch ends the serving by requesting `stop`.
pub fn serve_watching(
    a: Attached,
    opts: ServerOptions,
    stop: Stop,
    outside: &mut dyn Watch,
) -> Result<()> {
    super::raise_open_files_limit(opts.connections_max);
    let Attached {
        path,
        dev,
        info,
        role,
        state,
    } = a;
    let registry = state.0.registry.clone();
    let export = Export {
        dev,
        info: info.clone(),
    };
    let shared = match super::new_shared(vec![export], &opts, &stop, Some(registry.clone())) {
        Ok(s) => s,
        Err(e) => {
            state.set(Part::Detached);
            return Err(e);
        }
    };
    let mut conns = Conns::new();
    let mut next = Some(role);
    while let Some(r) = next.take() {
        state.set(r.part());
        match r {
            Role::Owner(o) => run_owner(o, &shared, &registry, &mut conns, outside),
            Role::Member(m) => {
                let m = match run_member(m, &shared, &mut conns, outside) {
                    MemberEnd::Stopped(m) => {
                        leave(&path, m);
                        break;
                    }
                    MemberEnd::OwnerLeft(m) => m,
                };
                state.set(Part::TakingOver);
                match takeover(&path, &info, m, &shared, outside) {
                    Ok(r) => next = Some(r),
                    Err(e) => {
                        eprintln!("ucrypt: {e}: serving the connections established");
                        state.set(Part::Detached);
                        wait_for_stop(&shared, outside);
                    }
                }
            }
        }
    }
    state.set(Part::Detached);
    super::finish_conns(&shared, conns.into_threads())
}
