//! The online rotation's hotzones in a process of their own. The process that serves the
//! volume (the `ucrypt open` daemon, or `serve`/`mount`/`ublk` with `--control`) starts
//! `ucrypt` again as a worker (the hidden verb `reencrypt-worker`) in a session of its own,
//! hands it the passphrase over a socket pair, and answers the hotzone loop's calls
//! ([`Serving`]: start, hold, rewrite, rewritten, release, failed) over that socket, against
//! the volume it serves. The worker opens the device (and the detached header) itself and
//! runs the same loop an offline rotation runs.
//!
//! Why a process: Linux shares CPU time between sessions (autogroups) before it shares it
//! between their threads. With the rotation's hashing and crypto on a thread of the serving
//! process, they compete with the front end's threads for that session's share, and on a
//! busy host the clients lose (BENCHMARKS.md, `bench reencrypt --online`). In a session of
//! its own the rotation's CPU time is its own, as cryptsetup's reencryption runs in the
//! cryptsetup process beside the kernel's dm-crypt. The worker keeps the serving process's
//! nice value and cgroup, and dies with it (`PR_SET_PDEATHSIG`): a worker killed, or a
//! serving process killed, is a crash the reencryption's resilience recovers from, as in the
//! thread. A serving process that outlives its worker notices the death (the link closes;
//! the worker is waited for), recovers the hotzone the worker held from the resilience data
//! while it serves on (`reencrypt::online::recover_stopped`, in `online.rs`), and reports the
//! rotation stopped, to be resumed online.
//!
//! The link is a sans-I/O codec ([`Call`], [`Reply`], one length-prefixed frame each, at most
//! [`FRAME_BYTES_MAX`]) and two drivers: [`Link`] in the worker, [`serve_worker`] in the
//! serving process. Frames pass through [`SecretBytes`] buffers: the passphrase and the new
//! volume key cross the socket once each.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use clap::Args;
use ucrypt::backend::{Backend, CacheMode, DirectMode, FileBackend};
use ucrypt::luks::reencrypt::run::{Progress, ResilienceAsked, RunOptions};
use ucrypt::luks::reencrypt::Serving;
use ucrypt::luks::HashAlg;
use ucrypt::sector::{CipherSpec, SectorSize};
use ucrypt::volume::Volume;
use ucrypt::{Error, SecretBytes};

use super::proto::RESUME_KEY_BYTES_MAX;
use crate::error::CliError;
use ucrypt::luks::reencrypt;

/// The hidden verb the worker runs as.
pub const WORKER_VERB: &str = "reencrypt-worker";
/// The descriptor the worker finds its end of the socket pair on.
const LINK_FD: i32 = 3;
/// The largest frame either side sends: a passphrase of the most the control socket takes,
/// and a little framing.
pub const FRAME_BYTES_MAX: usize = RESUME_KEY_BYTES_MAX + 64;
/// The longest error message a frame carries (longer ones are cut at a character boundary).
const MESSAGE_BYTES_MAX: usize = 1024;

/// The worker's arguments (from the serving process, not typed by a user).
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The device or file whose data is rotated (and whose header it is, without --header).
    #[arg(long)]
    data: PathBuf,
    /// The detached header.
    #[arg(long)]
    header: Option<PathBuf>,
    #[arg(long)]
    hotzone_size: Option<u64>,
    #[arg(long)]
    resilience: Option<String>,
    #[arg(long)]
    resilience_hash: Option<String>,
}

/// The new side a rotation starts with: cipher, volume key, sector size.
#[derive(Debug, PartialEq, Eq)]
pub struct NewSide<'a> {
    spec: &'a str,
    key: &'a [u8],
    sector: u32,
}

/// What the worker's hotzone loop tells the serving process.
#[derive(Debug, PartialEq, Eq)]
pub enum Call<'a> {
    Start {
        new: Option<NewSide<'a>>,
        done: u64,
        backward: bool,
    },
    Hold {
        offset: u64,
        len: u64,
    },
    Rewrite {
        offset: u64,
        len: u64,
    },
    /// No reply.
    Rewritten {
        offset: u64,
        len: u64,
    },
    Release {
        done: u64,
    },
    Failed,
    /// No reply.
    Progress {
        done: u64,
        total: u64,
    },
    /// The loop's end (`code` 0: finished; else the exit code of its error); no reply.
    End {
        code: i32,
        message: &'a str,
    },
}

/// What the serving process sends the worker: the passphrase first, then one reply per call
/// (but `Progress` and `End`).
#[derive(Debug, PartialEq, Eq)]
pub enum Reply<'a> {
    Setup { passphrase: &'a [u8] },
    Ok,
    Err { code: i32, message: &'a str },
}

fn bad_frame(what: &str) -> Error {
    Error::io(
        "the rotation worker's link",
        std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string()),
    )
}

/// Appends to a frame being built; refuses to grow past [`FRAME_BYTES_MAX`].
struct Put<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Put<'_> {
    fn bytes(&mut self, b: &[u8]) -> ucrypt::Result<()> {
        let end = self.at + b.len();
        if end > self.buf.len() {
            return Err(bad_frame("a frame over its size limit"));
        }
        self.buf[self.at..end].copy_from_slice(b);
        self.at = end;
        Ok(())
    }
    fn u8(&mut self, v: u8) -> ucrypt::Result<()> {
        self.bytes(&[v])
    }
    fn u64(&mut self, v: u64) -> ucrypt::Result<()> {
        self.bytes(&v.to_le_bytes())
    }
    fn i32(&mut self, v: i32) -> ucrypt::Result<()> {
        self.bytes(&v.to_le_bytes())
    }
    /// A length-prefixed field (u32).
    fn field(&mut self, b: &[u8]) -> ucrypt::Result<()> {
        self.bytes(&(b.len() as u32).to_le_bytes())?;
        self.bytes(b)
    }
}

/// Reads a frame's fields in order.
struct Get<'a> {
    buf: &'a [u8],
}

impl<'a> Get<'a> {
    fn bytes(&mut self, n: usize) -> ucrypt::Result<&'a [u8]> {
        if n > self.buf.len() {
            return Err(bad_frame("a frame shorter than its fields"));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u8(&mut self) -> ucrypt::Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    fn u64(&mut self) -> ucrypt::Result<u64> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn u32(&mut self) -> ucrypt::Result<u32> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn i32(&mut self) -> ucrypt::Result<i32> {
        Ok(i32::from_le_bytes(
            self.bytes(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn field(&mut self) -> ucrypt::Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.bytes(n)
    }
    fn text(&mut self) -> ucrypt::Result<&'a str> {
        std::str::from_utf8(self.field()?).map_err(|_| bad_frame("a text field not UTF-8"))
    }
    fn end(&self) -> ucrypt::Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(bad_frame("bytes after a frame's last field"))
        }
    }
}

/// `message` cut to [`MESSAGE_BYTES_MAX`] at a character boundary.
fn cut(message: &str) -> &str {
    let mut n = message.len().min(MESSAGE_BYTES_MAX);
    while !message.is_char_boundary(n) {
        n -= 1;
    }
    &message[..n]
}

impl Call<'_> {
    /// Writes the frame (length first) into `out`; returns its length.
    pub fn encode(&self, out: &mut [u8]) -> ucrypt::Result<usize> {
        let mut p = Put { buf: out, at: 4 };
        match self {
            Call::Start {
                new,
                done,
                backward,
            } => {
                p.u8(1)?;
                p.u8(u8::from(*backward))?;
                p.u64(*done)?;
                match new {
                    None => p.u8(0)?,
                    Some(n) => {
                        p.u8(1)?;
                        p.bytes(&n.sector.to_le_bytes())?;
                        p.field(n.spec.as_bytes())?;
                        p.field(n.key)?;
                    }
                }
            }
            Call::Hold { offset, len } => {
                p.u8(2)?;
                p.u64(*offset)?;
                p.u64(*len)?;
            }
            Call::Rewrite { offset, len } => {
                p.u8(3)?;
                p.u64(*offset)?;
                p.u64(*len)?;
            }
            Call::Rewritten { offset, len } => {
                p.u8(4)?;
                p.u64(*offset)?;
                p.u64(*len)?;
            }
            Call::Release { done } => {
                p.u8(5)?;
                p.u64(*done)?;
            }
            Call::Failed => p.u8(6)?,
            Call::Progress { done, total } => {
                p.u8(7)?;
                p.u64(*done)?;
                p.u64(*total)?;
            }
            Call::End { code, message } => {
                p.u8(8)?;
                p.i32(*code)?;
                p.field(cut(message).as_bytes())?;
            }
        }
        Ok(seal(p))
    }

    /// The call in a frame's body (the bytes after its length).
    pub fn decode(body: &[u8]) -> ucrypt::Result<Call<'_>> {
        let mut g = Get { buf: body };
        let call = match g.u8()? {
            1 => {
                let backward = g.u8()? != 0;
                let done = g.u64()?;
                let new = match g.u8()? {
                    0 => None,
                    _ => Some(NewSide {
                        sector: g.u32()?,
                        spec: g.text()?,
                        key: g.field()?,
                    }),
                };
                Call::Start {
                    new,
                    done,
                    backward,
                }
            }
            2 => Call::Hold {
                offset: g.u64()?,
                len: g.u64()?,
            },
            3 => Call::Rewrite {
                offset: g.u64()?,
                len: g.u64()?,
            },
            4 => Call::Rewritten {
                offset: g.u64()?,
                len: g.u64()?,
            },
            5 => Call::Release { done: g.u64()? },
            6 => Call::Failed,
            7 => Call::Progress {
                done: g.u64()?,
                total: g.u64()?,
            },
            8 => Call::End {
                code: g.i32()?,
                message: g.text()?,
            },
            _ => return Err(bad_frame("an unknown call")),
        };
        g.end()?;
        Ok(call)
    }
}

impl Reply<'_> {
    /// Writes the frame (length first) into `out`; returns its length.
    pub fn encode(&self, out: &mut [u8]) -> ucrypt::Result<usize> {
        let mut p = Put { buf: out, at: 4 };
        match self {
            Reply::Setup { passphrase } => {
                p.u8(16)?;
                p.field(passphrase)?;
            }
            Reply::Ok => p.u8(17)?,
            Reply::Err { code, message } => {
                p.u8(18)?;
                p.i32(*code)?;
                p.field(cut(message).as_bytes())?;
            }
        }
        Ok(seal(p))
    }

    /// The reply in a frame's body.
    pub fn decode(body: &[u8]) -> ucrypt::Result<Reply<'_>> {
        let mut g = Get { buf: body };
        let reply = match g.u8()? {
            16 => Reply::Setup {
                passphrase: g.field()?,
            },
            17 => Reply::Ok,
            18 => Reply::Err {
                code: g.i32()?,
                message: g.text()?,
            },
            _ => return Err(bad_frame("an unknown reply")),
        };
        g.end()?;
        Ok(reply)
    }
}

/// Writes the body's length in front of it; the frame's length.
fn seal(p: Put<'_>) -> usize {
    let body = (p.at - 4) as u32;
    p.buf[..4].copy_from_slice(&body.to_le_bytes());
    p.at
}

/// One end of the socket pair, with a frame buffer that is zeroised on drop.
struct Wire {
    sock: UnixStream,
    buf: SecretBytes,
}

impl Wire {
    fn new(sock: UnixStream) -> Self {
        Wire {
            sock,
            buf: SecretBytes::zeroed(FRAME_BYTES_MAX),
        }
    }

    fn io(e: std::io::Error) -> Error {
        Error::io("the rotation worker's link", e)
    }

    fn send(
        &mut self,
        encode: impl FnOnce(&mut [u8]) -> ucrypt::Result<usize>,
    ) -> ucrypt::Result<()> {
        let n = encode(self.buf.as_mut())?;
        let r = self
            .sock
            .write_all(&self.buf.as_ref()[..n])
            .map_err(Self::io);
        self.buf.as_mut()[..n].fill(0);
        r
    }

    /// Reads the next frame's body into the buffer; its length, or `None` at the end: the
    /// other side closed the link or died between frames. A process that dies with a frame
    /// of ours still unread resets the link (`ECONNRESET`) rather than closing it; that is
    /// the same end.
    fn receive(&mut self) -> ucrypt::Result<Option<usize>> {
        let mut len = [0u8; 4];
        match self.sock.read_exact(&mut len) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(Self::io(e)),
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > FRAME_BYTES_MAX {
            return Err(bad_frame("a frame over its size limit"));
        }
        self.sock
            .read_exact(&mut self.buf.as_mut()[..n])
            .map_err(Self::io)?;
        Ok(Some(n))
    }

    fn body(&self, n: usize) -> &[u8] {
        &self.buf.as_ref()[..n]
    }
}

/// The worker's side: the hotzone loop's calls, relayed to the serving process and answered.
struct Link {
    wire: Wire,
}

impl Link {
    /// Sends `call` and waits for its reply: `Ok`, or the serving process's refusal.
    fn call(&mut self, call: Call<'_>) -> ucrypt::Result<()> {
        self.wire.send(|b| call.encode(b))?;
        let n = self
            .wire
            .receive()?
            .ok_or_else(|| bad_frame("the serving process closed the link"))?;
        match Reply::decode(self.wire.body(n))? {
            Reply::Ok => Ok(()),
            Reply::Err { message, .. } => Err(Error::InvalidArgument(message.to_string())),
            Reply::Setup { .. } => Err(bad_frame("a second setup")),
        }
    }
}

impl Serving for Link {
    fn start(
        &mut self,
        new_key: Option<(CipherSpec, &[u8], SectorSize)>,
        done: u64,
        backward: bool,
    ) -> ucrypt::Result<()> {
        let spec = new_key.map(|(c, _, _)| c.to_string());
        let new = match (&spec, new_key) {
            (Some(spec), Some((_, key, ss))) => Some(NewSide {
                spec,
                key,
                sector: ss.bytes(),
            }),
            _ => None,
        };
        self.call(Call::Start {
            new,
            done,
            backward,
        })
    }
    fn hold(&mut self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.call(Call::Hold { offset, len })
    }
    fn rewrite(&mut self, offset: u64, len: u64) -> ucrypt::Result<()> {
        self.call(Call::Rewrite { offset, len })
    }
    fn rewritten(&mut self, offset: u64, len: u64) -> ucrypt::Result<()> {
        // No reply: the serving process takes calls in order, so the next call's reply (a
        // rewrite, a release) follows it; if it fails there, the link closes and that call
        // fails.
        self.wire
            .send(|b| Call::Rewritten { offset, len }.encode(b))
    }
    fn piece_bytes(&self, hotzone_bytes: u64) -> Option<u64> {
        Some(reencrypt::online::piece_bytes(hotzone_bytes))
    }
    fn rekey_lanes_max(&self) -> Option<usize> {
        Some(reencrypt::online::rekey_lanes_serving())
    }
    fn release(&mut self, done: u64) -> ucrypt::Result<()> {
        self.call(Call::Release { done })
    }
    fn failed(&mut self) {
        // The serving process breaks the hotzone on its own if the link is gone.
        let _ = self.call(Call::Failed);
    }
}

/// `ucrypt reencrypt-worker`: runs the hotzone loop on the device named, relaying the loop's
/// calls over the socket on [`LINK_FD`]. Its exit code is the loop's (also sent as `End`).
pub fn run_worker(a: WorkerArgs) -> i32 {
    ucrypt::secret::disable_core_dumps();
    use std::os::unix::fs::FileTypeExt;
    let linked = std::fs::metadata(format!("/proc/self/fd/{LINK_FD}"))
        .is_ok_and(|m| m.file_type().is_socket());
    if !linked {
        eprintln!(
            "ucrypt {WORKER_VERB}: no link on descriptor {LINK_FD}: the process that serves a \
             volume starts this verb for an online reencryption (use `ucrypt reencrypt`)"
        );
        return 1;
    }
    // SAFETY: LINK_FD was put there for this process by the serving one (`spawn`), which owns
    // nothing else on it; nothing else in this process uses or closes it.
    let sock = unsafe { <UnixStream as std::os::fd::FromRawFd>::from_raw_fd(LINK_FD) };
    let mut link = Link {
        wire: Wire::new(sock),
    };
    let r = work(&a, &mut link);
    let (code, message) = match &r {
        Ok(()) => (0, String::new()),
        Err(e) => (e.exit_code(), e.to_string()),
    };
    let _ = link.wire.send(|b| {
        Call::End {
            code,
            message: &message,
        }
        .encode(b)
    });
    code
}

fn work(a: &WorkerArgs, link: &mut Link) -> Result<(), CliError> {
    let n = link
        .wire
        .receive()?
        .ok_or_else(|| bad_frame("the serving process closed the link before the setup"))?;
    let pass = match Reply::decode(link.wire.body(n))? {
        Reply::Setup { passphrase } => SecretBytes::from_slice(passphrase),
        _ => return Err(bad_frame("no setup first").into()),
    };
    link.wire.buf.as_mut()[..n].fill(0);
    let hash = match &a.resilience_hash {
        Some(h) => HashAlg::from_name(h)?,
        None => reencrypt::run::CHECKSUM_HASH,
    };
    let opts = RunOptions {
        hotzone_bytes: a.hotzone_size,
        resilience: a
            .resilience
            .as_deref()
            .map(|n| ResilienceAsked::from_name(n, hash))
            .transpose()?,
        device_size: None,
    };
    // As the offline verb opens it: O_DIRECT where the filesystem takes it, durable at a flush.
    let data = FileBackend::open_cached(&a.data, true, CacheMode::None)?;
    let header = a
        .header
        .as_ref()
        .map(|h| FileBackend::open(h, true, DirectMode::Never))
        .transpose()?;
    let devs = reencrypt::run::Devices {
        header: header.as_ref().map_or(&data as &dyn Backend, |h| h),
        data: &data,
    };
    // Progress goes through a second handle of the same socket (the loop holds `link`); the
    // loop calls it between its calls, on this thread, so frames never interleave. A lost
    // progress frame shows up as the next call's failure.
    let mut pwire = Wire {
        sock: link.wire.sock.try_clone().map_err(Wire::io)?,
        buf: SecretBytes::zeroed(64),
    };
    let mut report = |p: Progress| {
        let _ = pwire.send(|b| {
            Call::Progress {
                done: p.done,
                total: p.total,
            }
            .encode(b)
        });
    };
    reencrypt::run::resume_serving(devs, pass.as_ref(), opts, &mut report, link)?;
    Ok(())
}

/// Starts the worker for the volume at `data` (and the detached `header`) in a session of its
/// own, dying with the calling thread; hands it the passphrase. Its end of the link.
fn spawn(
    data: &Path,
    header: Option<&Path>,
    opts: RunOptions,
    pass: &[u8],
) -> ucrypt::Result<(std::process::Child, Wire)> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
    // /proc/self/exe: this very binary, even if the file was replaced since.
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg0("ucrypt").arg(WORKER_VERB).arg("--data").arg(data);
    if let Some(h) = header {
        cmd.arg("--header").arg(h);
    }
    if let Some(n) = opts.hotzone_bytes {
        cmd.arg("--hotzone-size").arg(n.to_string());
    }
    if let Some(r) = opts.resilience {
        cmd.arg("--resilience").arg(r.name());
        if let Some(h) = r.hash() {
            cmd.arg("--resilience-hash").arg(h.name());
        }
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    let fd = theirs.as_raw_fd();
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only async-signal-safe
    // functions (dup2, fcntl, setsid, prctl, getppid, _exit) on plain integers; `fd` is open
    // in the child (inherited from `theirs`, which lives until after spawn returns).
    unsafe {
        cmd.pre_exec(move || {
            if fd == LINK_FD {
                // dup2 onto itself would keep close-on-exec.
                let flags = libc::fcntl(fd, libc::F_GETFD);
                libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            } else if libc::dup2(fd, LINK_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::setsid();
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            // The parent may have gone before the death signal was asked for.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| Error::io("starting the rotation worker", e))?;
    drop(theirs);
    let mut wire = Wire::new(ours);
    wire.send(|b| Reply::Setup { passphrase: pass }.encode(b))?;
    Ok((child, wire))
}

/// An error as the verb reports it: its exit code and message.
pub fn reported(e: Error) -> (i32, String) {
    let e = CliError::from(e);
    (e.exit_code(), e.to_string())
}

/// How a rotation run in a worker ended before its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// The worker ended without its last word (killed, or crashed): its exit status, as
    /// "signal 9" or "exit code 3".
    Died(String),
    /// The worker's loop, or the volume's side of it, failed: the exit code and message the
    /// verb reports.
    Failed(i32, String),
}

/// `status` of a worker that ended without its last word, in few words.
fn died_how(status: std::io::Result<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => match (s.signal(), s.code()) {
            (Some(sig), _) => format!("signal {sig}"),
            (None, Some(code)) => format!("exit code {code}"),
            (None, None) => s.to_string(),
        },
        Err(e) => format!("its end unknown: {e}"),
    }
}

/// Rotates the key of `vol` (served by this process; its header in reencryption) in a worker
/// process: starts it ([`spawn`]), answers its calls against the volume, and switches the
/// volume to the new side when it finished. `progress` gets the worker's reports. A worker
/// that ends before its end (killed, or its loop failed) is waited for (killed first if the
/// link broke under it, so that nothing writes the hotzone any more), and the hotzone it
/// held stays held: the caller recovers it (`reencrypt::online::recover_stopped`).
pub fn serve_worker(
    vol: &Volume,
    (data, header): (&Path, Option<&Path>),
    pass: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<(), Ended> {
    let failed = |e| {
        let (code, message) = reported(e);
        Ended::Failed(code, message)
    };
    let (mut child, mut wire) = spawn(data, header, opts, pass).map_err(failed)?;
    let mut serving = reencrypt::online::serving(vol);
    // The volume's own first refusal of a call (its code and words: a busy hotzone is
    // cryptsetup's 5), which says more than the worker's report of it.
    let mut refusal: Option<(i32, String)> = None;
    // Whether the worker sent its last word (`End`); `ended` is `None` when the link ended
    // without it.
    let mut last_word = false;
    let ended: Option<Result<(), (i32, String)>> = loop {
        let n = match wire.receive() {
            Ok(Some(n)) => n,
            Ok(None) => break None,
            Err(e) => break Some(Err(reported(e))),
        };
        let call = match Call::decode(wire.body(n)) {
            Ok(c) => c,
            Err(e) => break Some(Err(reported(e))),
        };
        let answer = match call {
            Call::Start {
                new,
                done,
                backward,
            } => {
                let new = new
                    .map(|n| -> ucrypt::Result<_> {
                        let spec: CipherSpec = n.spec.parse()?;
                        let ss = SectorSize::new(u64::from(n.sector))?;
                        Ok((spec, SecretBytes::from_slice(n.key), ss))
                    })
                    .transpose();
                let r = new.and_then(|new| {
                    let new = new.as_ref().map(|(c, k, ss)| (*c, k.as_ref(), *ss));
                    serving.start(new, done, backward)
                });
                r.map_err(reported)
            }
            Call::Hold { offset, len } => serving.hold(offset, len).map_err(reported),
            Call::Rewrite { offset, len } => serving.rewrite(offset, len).map_err(reported),
            Call::Rewritten { offset, len } => match serving.rewritten(offset, len) {
                Ok(()) => continue,
                Err(e) => break Some(Err(reported(e))),
            },
            Call::Release { done } => serving.release(done).map_err(reported),
            Call::Failed => {
                serving.failed();
                Ok(())
            }
            Call::Progress { done, total } => {
                progress(Progress { done, total });
                continue;
            }
            Call::End { code, message } => {
                last_word = true;
                break Some(if code == 0 {
                    Ok(())
                } else {
                    Err((code, message.to_string()))
                });
            }
        };
        if let Err(e) = &answer {
            refusal.get_or_insert_with(|| e.clone());
        }
        // Wipe the frame (a start carries the new key) before answering.
        wire.buf.as_mut()[..n].fill(0);
        let sent = match &answer {
            Ok(()) => wire.send(|b| Reply::Ok.encode(b)),
            Err((code, message)) => wire.send(|b| {
                Reply::Err {
                    code: *code,
                    message,
                }
                .encode(b)
            }),
        };
        if sent.is_err() {
            break None;
        }
    };
    drop(wire);
    // A worker that sent its last word exits by itself; one whose link broke may still run
    // (a frame this side refused) and is stopped before anyone recovers its hotzone. A kill
    // of one that is gone already changes nothing.
    if !last_word {
        let _ = child.kill();
    }
    let status = child.wait();
    match ended {
        Some(Ok(())) => reencrypt::online::finish_rotation(vol).map_err(failed),
        Some(Err(e)) => {
            let (code, message) = refusal.unwrap_or(e);
            Err(Ended::Failed(code, message))
        }
        None => Err(Ended::Died(died_how(status))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_of(encode: impl FnOnce(&mut [u8]) -> ucrypt::Result<usize>) -> Vec<u8> {
        let mut buf = vec![0u8; FRAME_BYTES_MAX];
        let n = encode(&mut buf).unwrap();
        let body = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        assert_eq!(body + 4, n, "the length in front counts the body");
        buf[4..n].to_vec()
    }

    #[test]
    fn every_call_and_reply_comes_back_as_it_was_sent() {
        let key = [0x5au8; 64];
        let calls = [
            Call::Start {
                new: Some(NewSide {
                    spec: "aes-xts-plain64",
                    key: &key,
                    sector: 4096,
                }),
                done: 1 << 30,
                backward: false,
            },
            Call::Start {
                new: None,
                done: 0,
                backward: true,
            },
            Call::Hold {
                offset: 7 << 20,
                len: 64 << 20,
            },
            Call::Rewrite {
                offset: u64::MAX,
                len: 1,
            },
            Call::Rewritten { offset: 0, len: 0 },
            Call::Release { done: 42 },
            Call::Failed,
            Call::Progress { done: 1, total: 2 },
            Call::End {
                code: 0,
                message: "",
            },
            Call::End {
                code: -5,
                message: "I/O error: é",
            },
        ];
        for c in &calls {
            let body = frame_of(|b| c.encode(b));
            assert_eq!(&Call::decode(&body).unwrap(), c);
        }
        let pass = vec![0x33u8; RESUME_KEY_BYTES_MAX];
        let replies = [
            Reply::Setup { passphrase: &pass },
            Reply::Setup { passphrase: b"" },
            Reply::Ok,
            Reply::Err {
                code: 5,
                message: "Device x is suspended",
            },
        ];
        for r in &replies {
            let body = frame_of(|b| r.encode(b));
            assert_eq!(&Reply::decode(&body).unwrap(), r);
        }
    }

    #[test]
    fn a_bad_frame_is_refused_by_name() {
        let body = frame_of(|b| Call::Hold { offset: 1, len: 2 }.encode(b));
        let short = Call::decode(&body[..body.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(short.contains("shorter than its fields"), "{short}");
        let mut long = body.clone();
        long.push(0);
        let long = Call::decode(&long).unwrap_err().to_string();
        assert!(long.contains("after a frame's last field"), "{long}");
        let unknown = Call::decode(&[99]).unwrap_err().to_string();
        assert!(unknown.contains("unknown call"), "{unknown}");
        // A reply is no call, and the other way round.
        assert!(Call::decode(&frame_of(|b| Reply::Ok.encode(b))).is_err());
        assert!(Reply::decode(&body).is_err());
        // A field's length past the frame.
        let mut lying = frame_of(|b| {
            Call::End {
                code: 1,
                message: "x",
            }
            .encode(b)
        });
        lying[5..9].copy_from_slice(&1000u32.to_le_bytes());
        assert!(Call::decode(&lying).is_err());
        // Text that is not UTF-8.
        let mut latin = frame_of(|b| {
            Call::End {
                code: 1,
                message: "x",
            }
            .encode(b)
        });
        *latin.last_mut().unwrap() = 0xff;
        let e = Call::decode(&latin).unwrap_err().to_string();
        assert!(e.contains("not UTF-8"), "{e}");
    }

    #[test]
    fn frames_stay_within_their_limit() {
        // A passphrase over the limit does not fit; a long message is cut.
        let pass = vec![0u8; FRAME_BYTES_MAX];
        let mut buf = vec![0u8; FRAME_BYTES_MAX];
        let e = Reply::Setup { passphrase: &pass }
            .encode(&mut buf)
            .unwrap_err()
            .to_string();
        assert!(e.contains("over its size limit"), "{e}");
        let long = "é".repeat(MESSAGE_BYTES_MAX);
        let body = frame_of(|b| {
            Call::End {
                code: 1,
                message: &long,
            }
            .encode(b)
        });
        let Call::End { message, .. } = Call::decode(&body).unwrap() else {
            panic!("not an end");
        };
        assert!(message.len() <= MESSAGE_BYTES_MAX && message.len() >= MESSAGE_BYTES_MAX - 1);
        assert!(long.starts_with(message));
    }

    #[test]
    fn a_peer_that_dies_with_our_reply_unread_ends_the_link() {
        // The serving process's reply sits unread in the worker's socket when the worker is
        // killed: the serving side's next read fails with ECONNRESET, not EOF. Both are the
        // link's end, so the verb reports the worker's death rather than a link error.
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut serving = Wire::new(ours);
        serving.send(|b| Reply::Ok.encode(b)).unwrap();
        drop(theirs);
        let raw = (&serving.sock).read(&mut [0u8; 4]);
        assert_eq!(
            raw.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::ConnectionReset),
            "this kernel closes a socket with unread data by a reset"
        );
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut serving = Wire::new(ours);
        serving.send(|b| Reply::Ok.encode(b)).unwrap();
        drop(theirs);
        assert_eq!(serving.receive().unwrap(), None);
        // A plain close ends it too; a frame cut short does not pass for an end.
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut serving = Wire::new(ours);
        drop(theirs);
        assert_eq!(serving.receive().unwrap(), None);
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let mut serving = Wire::new(ours);
        theirs.write_all(&8u32.to_le_bytes()).unwrap();
        theirs.write_all(&[1, 2]).unwrap();
        drop(theirs);
        assert!(serving.receive().is_err());
    }
}
