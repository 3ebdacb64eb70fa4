//! A [`Volume`]: the plaintext block device made of a backend (ciphertext), a key and a dispatch
//! policy. It implements [`BlockDev`], the contract every front end serves.
//!
//! The data path, for a read:
//! 1. `read_at` checks the range and asks the planner (`engine::plan`) for a plan: which
//!    encryption sectors, cut into pool-sized pieces, dispatched how (inline, parallel, ...).
//! 2. For each piece, `read_piece` picks where the ciphertext lands: straight in the caller's
//!    buffer when the piece is sector-aligned (no copy), else in a bounce buffer from the pool.
//! 3. A `Task` (sectors + buffers) is run by `exec_task`: backend read, then decrypt in place;
//!    either on the caller's thread (`inline`) or cut into chunks shared with the workers.
//! 4. A bounced piece is copied out to the caller.
//!
//! A write is the mirror image (`write_piece`): lock the sectors, take a bounce buffer, fill in
//! partial edge sectors (read-modify-write), encrypt into the bounce buffer, backend write.
//! The caller's buffer is never modified.
//!
//! The file reads top-down: configuration and the small types a request carries, then
//! **the data path** (`BlockDev` entry points, `read`/`read_piece`, `write`/`write_piece`,
//! `discard`), then construction (threads, calibration), then the **drivers** that run a task
//! inline, split among workers (`run_split`), in submission order, or through the `queued`
//! model's worker queue and writer thread.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::backend::Backend;
use crate::blockdev::SharedRun;
use crate::engine::ciphers::CipherSlots;
use crate::engine::gate::Gate;
use crate::engine::host;
use crate::engine::plan::{Dispatch, Op, Piece, Plan, Planner, SectorRange};
use crate::engine::queue::BoundedQueue;
use crate::engine::range_lock::RangeLock;
use crate::engine::stats::{now, ns_per_tick, Kind, Stats, Times};
use crate::engine::task::{Runs, Task};
use crate::engine::workers::{
    self, Completion, DoneRef, Executor, Job, WriteJob, JOB_QUEUE_MAX, WRITE_QUEUE_MAX,
};
pub use crate::engine::workers::{SPIN_BEFORE_SLEEP, SPIN_MAX, THREAD_IDLE_EXIT};
use crate::engine::{Policies, Policy, StatsSnapshot};
use crate::pool::{BufferPool, POOL_BYTES_DEFAULT};
use crate::sector::{CipherSpec, Geometry, Mode, Provider, SectorCipher, SectorSize};
use crate::sync::{lock, WaitCell};
use crate::{BlockDev, Error, Result, SecretBytes};

mod direct;
mod dispatch;
mod segments;
mod shared;
pub use segments::NewSideAt;
use segments::Segments;
use shared::Shared;
pub use shared::SHARED_COPY_BELOW_BYTES;

/// Largest piece of a request processed at once (also bounded by the pool): big enough for the
/// workers to share, small enough that many requests progress side by side.
pub const PIECE_BYTES_MAX: usize = 4 << 20;
/// `parallel`/`ordered` split requests of at least this size (Linux 6.11 dm-crypt splits at
/// 128 KiB for the same reason).
pub const PARALLEL_MIN_BYTES: u64 = 64 << 10;
/// No chunk smaller than this: below it the hand-off costs more than the crypto it moves.
pub const CHUNK_MIN_BYTES: u64 = 32 << 10;
/// The least an aligned write takes of the pool at once when many share it (see
/// `BufferPool::take_share`): the split policies cut it into chunks of at least
/// [`CHUNK_MIN_BYTES`] for two lanes.
pub const GRANT_SHARE_MIN_BYTES: usize = 2 * CHUNK_MIN_BYTES as usize;
/// Bounds for the calibrated `auto` threshold.
pub const AUTO_MIN_BYTES_FLOOR: u64 = 16 << 10;
pub const AUTO_MIN_BYTES_CEIL: u64 = 4 << 20;
/// Worker threads at most (one per core up to this).
pub const WORKERS_MAX: usize = 64;

/// Everything needed to build a volume. A LUKS header is turned into one of these elsewhere.
pub struct VolumeConfig {
    pub spec: CipherSpec,
    pub key: SecretBytes,
    pub geometry: Geometry,
    /// Where sector 0 of the data segment starts on the backend, in bytes.
    pub data_offset_bytes: u64,
    /// Plaintext size; None = from the data offset to the end of the backend (rounded down to
    /// whole sectors).
    pub size_bytes: Option<u64>,
    /// How reads and writes are dispatched (one policy for both converts with `.into()`).
    pub policy: Policies,
    /// Bounce buffer memory (see `pool`).
    pub pool_bytes: usize,
    pub read_only: bool,
    /// Pass discards down to the backend. Off, a discard succeeds and leaves the ciphertext in
    /// place, as dm-crypt does without `allow_discards`: discards reveal which blocks are unused.
    pub allow_discards: bool,
    /// How long idle workers and callers waiting for workers busy-wait before they sleep
    /// (default [`SPIN_BEFORE_SLEEP`], at most [`SPIN_MAX`]). Zero never spins: no CPU time
    /// after the last request, but every hand-off to a worker pays a wake-up.
    pub spin: Duration,
    /// How long the volume keeps its worker threads and its pool's memory after their last
    /// use (default [`THREAD_IDLE_EXIT`]): an idle volume then has neither.
    pub idle_release: Duration,
}

impl VolumeConfig {
    /// A read-write config over the whole backend with default policy and pool.
    pub fn new(spec: CipherSpec, key: SecretBytes, geometry: Geometry) -> Self {
        VolumeConfig {
            spec,
            key,
            geometry,
            data_offset_bytes: 0,
            size_bytes: None,
            policy: Policy::Inline.into(),
            pool_bytes: POOL_BYTES_DEFAULT,
            read_only: false,
            allow_discards: true,
            spin: SPIN_BEFORE_SLEEP,
            idle_release: THREAD_IDLE_EXIT,
        }
    }
}

/// Hands out turns in submission order for the `ordered` policy.
struct Turns {
    next_ticket: AtomicU64,
    /// The ticket being served; a turn is passed on with a notify only if someone sleeps on
    /// `cv`.
    serving: Mutex<u64>,
    cv: WaitCell,
}

/// Holding a ticket: dropping it waits for its turn (if not yet waited) and passes the turn on,
/// so an error never blocks later requests.
struct Turn<'a> {
    turns: &'a Turns,
    ticket: u64,
    waited: bool,
}

impl Turns {
    fn take(&self) -> Turn<'_> {
        Turn {
            turns: self,
            ticket: self.next_ticket.fetch_add(1, Relaxed),
            waited: false,
        }
    }
}

impl Turn<'_> {
    fn wait(&mut self) {
        let mut s = lock(&self.turns.serving);
        while *s != self.ticket {
            s = self.turns.cv.wait(s);
        }
        self.waited = true;
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if !self.waited {
            self.wait();
        }
        let mut s = lock(&self.turns.serving);
        *s = self.ticket + 1;
        drop(s);
        self.turns.cv.notify_all();
    }
}

/// Counts a big request of the `auto` policy while it runs.
struct BigGuard<'a>(&'a AtomicU32);

/// `auto`'s decision for one request (made once: it counts the request while it runs).
type Decided<'a> = (Dispatch, Option<BigGuard<'a>>);

/// How a write given its buffer (`write_at_mut`, `write_fua`) goes.
enum WriteRoute<'a> {
    /// Encrypted in the caller's buffer; holds the count of a big request while it runs.
    InPlace(Option<BigGuard<'a>>),
    /// Planned, with `auto`'s decision if it already made one.
    Planned(Option<Decided<'a>>),
}

impl Drop for BigGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// The state shared by the volume's callers and its threads.
pub(crate) struct Core {
    backend: Arc<dyn Backend>,
    data_offset: u64,
    /// Plaintext bytes; changed only by `Volume::resize`, with the gate closed.
    size: AtomicU64,
    shift: u32,
    /// The cipher is `cipher_null` (the data is plaintext): writes and reads skip the
    /// bounce buffers. Changed only by `Volume::end_segments` (a decryption or an encryption
    /// served online ends), with the gate closed, together with the cipher contexts.
    null_cipher: AtomicBool,
    /// The cipher decrypts from one buffer into another (`SectorCipher::crypts_out_of_place`):
    /// a big shared read is decrypted straight into the caller's memory. Changed with
    /// `null_cipher`, with the gate closed.
    out_of_place: AtomicBool,
    read_only: bool,
    /// `VolumeConfig::allow_discards`; changed by `Volume::set_allow_discards`.
    allow_discards: AtomicBool,
    mem_align: usize,
    planner: Planner,
    auto_min_bytes: AtomicU64,
    /// The cipher's cost in picoseconds per byte, measured at start-up (see `calibrate`).
    crypto_ps_per_byte: AtomicU64,
    /// `auto` requests at or above the threshold running now.
    big_inflight: AtomicU32,
    /// The dispatch policy of reads (0) and of writes (1).
    policy: [AtomicU8; 2],
    pool: BufferPool,
    locks: RangeLock,
    ciphers: CipherSlots,
    /// Shared with the new key's side while in reencryption (`volume/segments.rs`).
    stats: Arc<Stats>,
    /// Consumed by the worker threads, started on demand (see `engine::workers`).
    jobs: BoundedQueue<Job>,
    /// Consumed by the writer thread, started on demand.
    writes: BoundedQueue<WriteJob>,
    /// This core, for the threads it starts (each holds it while it runs).
    me: Weak<Core>,
    /// `VolumeConfig::idle_release`.
    idle_release: Duration,
    /// The worker threads started so far and not yet found finished (joined at the drop).
    worker_threads: Mutex<Vec<JoinHandle<()>>>,
    /// The writer thread, if started (joined at the drop).
    writer_thread: Mutex<Option<JoinHandle<()>>>,
    turns: Turns,
    /// Workers that may spin for work at once: one CPU less than there are, which is left to
    /// the callers that produce the work.
    max_spinners: u32,
    /// `VolumeConfig::spin` in nanoseconds; changed by `Volume::set_spin`.
    spin_ns: AtomicU64,
    /// Every request passes it; closed while the volume is suspended or resized.
    gate: Gate,
    /// Passed by every request as it enters ([`Volume::activity`]).
    activity: crate::sync::Tripwire,
    /// The cipher a new key is installed with on resume, and its key's length in bytes;
    /// changed when an online reencryption that changes the cipher ends.
    spec: Mutex<(CipherSpec, usize)>,
    geometry: Geometry,
    provider: Provider,
    /// Serialises suspend, resume and resize; true while suspended.
    suspended: Mutex<bool>,
    /// In reencryption: requests go through `Volume::segments` (changed with the gate closed).
    segmented: AtomicBool,
}

/// See the module documentation. Thread-safe: share it (`Arc<Volume>`) between callers.
pub struct Volume {
    core: Arc<Core>,
    /// In reencryption: the new key's side and the hotzone (see `segments`).
    segments: Mutex<Option<Arc<Segments>>>,
}

/// Where a write's plaintext comes from.
#[derive(Clone, Copy)]
enum Source<'a> {
    Buf(&'a [u8]),
    Zeroes,
}

// ================================================================ the data path

impl BlockDev for Volume {
    fn size(&self) -> u64 {
        self.core.size.load(Relaxed)
    }

    fn block_size(&self) -> u32 {
        1 << self.core.shift
    }

    fn read_only(&self) -> bool {
        self.core.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let _in = self.core.enter(Kind::Read)?;
        if self.core.segmented.load(Relaxed) {
            return counted(&self.core, Kind::Read, self.seg_read(buf, offset));
        }
        counted(&self.core, Kind::Read, self.core.read(buf, offset))
    }

    /// See `shared.rs`: without a copy where the volume can, else the default's way.
    fn read_shared(&self, dst: &mut [u8], offset: u64, scratch: &mut [u8]) -> Result<()> {
        match self.shared_io(Shared::Read(&mut *dst), offset, false, scratch) {
            Some(r) => r,
            None => crate::blockdev::read_through(self, dst, offset, scratch),
        }
    }

    /// See `shared.rs`: without a copy where the volume can, else the default's way.
    fn write_shared(&self, src: &[u8], offset: u64, fua: bool, scratch: &mut [u8]) -> Result<()> {
        match self.shared_io(Shared::Write(src), offset, fua, scratch) {
            Some(r) => r,
            None => crate::blockdev::write_through(self, src, offset, fua, scratch),
        }
    }

    /// See `shared.rs`: straight into the runs where the volume can, else through `scratch`.
    fn read_shared_runs(&self, dst: &[SharedRun], offset: u64, scratch: &mut [u8]) -> Result<()> {
        match self.shared_io(Shared::ReadRuns(dst), offset, false, scratch) {
            Some(r) => r,
            None => crate::blockdev::read_runs_through(self, dst, offset, scratch),
        }
    }

    /// See `shared.rs`: straight from the runs where the volume can, else through `scratch`.
    fn write_shared_runs(
        &self,
        src: &[SharedRun],
        offset: u64,
        fua: bool,
        scratch: &mut [u8],
    ) -> Result<()> {
        match self.shared_io(Shared::WriteRuns(src), offset, fua, scratch) {
            Some(r) => r,
            None => crate::blockdev::write_runs_through(self, src, offset, fua, scratch),
        }
    }

    /// See `volume/direct.rs`.
    fn read_direct(&self, offset: u64, len: usize) -> Option<crate::direct::DirectRead<'_>> {
        self.core.direct_read(offset, len)
    }

    /// See `volume/direct.rs`.
    fn write_direct(
        &self,
        offset: u64,
        len: usize,
        fua: bool,
    ) -> Option<crate::direct::DirectWrite<'_>> {
        self.core.direct_write(offset, len, fua)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let _in = self.core.enter(Kind::Write)?;
        if self.core.segmented.load(Relaxed) {
            let r = self.seg_write(Op::Write, Source::Buf(buf), offset, buf.len() as u64, false);
            return counted(&self.core, Kind::Write, r);
        }
        let r = self
            .core
            .write(Op::Write, Source::Buf(buf), offset, buf.len() as u64, false);
        counted(&self.core, Kind::Write, r)
    }

    fn write_at_mut(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.write_given(buf, offset, false)
    }

    /// Each backend write of the request is itself FUA (`Backend::write_at_fua`): no flush of
    /// the whole backend, and other writes in flight stay unordered.
    fn write_fua(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.write_given(buf, offset, true)
    }

    fn flush(&self) -> Result<()> {
        // Every acknowledged write has reached the backend (all policies acknowledge after the
        // backend write), so syncing the backend makes them durable.
        let _in = self.core.enter(Kind::Write)?;
        counted(&self.core, Kind::Write, self.core.backend.flush())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let _in = self.core.enter(Kind::Write)?;
        if self.core.segmented.load(Relaxed) {
            return counted(&self.core, Kind::Write, self.seg_discard(offset, len));
        }
        counted(&self.core, Kind::Write, self.core.discard(offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let _in = self.core.enter(Kind::Write)?;
        if self.core.segmented.load(Relaxed) {
            let r = self.seg_write(Op::WriteZeroes, Source::Zeroes, offset, len, false);
            return counted(&self.core, Kind::Write, r);
        }
        let r = self
            .core
            .write(Op::WriteZeroes, Source::Zeroes, offset, len, false);
        counted(&self.core, Kind::Write, r)
    }
}

/// Counts a failed request in the volume's statistics, by who can act on it.
#[inline]
fn counted(core: &Core, k: Kind, r: Result<()>) -> Result<()> {
    if let Err(e) = &r {
        core.stats.record_error(k, e.kind());
    }
    r
}

impl Core {
    /// Passes the gate for a request of kind `k`; the EIO of a failed gate
    /// ([`Volume::abort_suspended`]) counts as the request's error.
    #[inline(always)]
    fn enter(&self, k: Kind) -> Result<crate::engine::gate::Pass<'_>> {
        self.activity.pass();
        self.gate
            .enter()
            .inspect_err(|e| self.stats.record_error(k, e.kind()))
    }

    /// See [`Core::null_cipher`]'s field. Relaxed: it changes only with the gate closed,
    /// which orders it against every request.
    #[inline(always)]
    fn null_cipher(&self) -> bool {
        self.null_cipher.load(Relaxed)
    }

    // ---------------------------------------------------------------- reads

    fn read_piece(&self, plan: &Plan, piece: &Piece, out: &mut [u8], t: &mut Times) -> Result<()> {
        let bytes = (piece.sectors.len() << self.shift) as usize;
        let dst = &mut out[piece.buf_off..piece.buf_off + piece.buf_len];
        // Straight into the caller's buffer when it holds whole sectors at an address the
        // backend accepts: no bounce buffer, no copy.
        let in_place = piece.aligned() && (dst.as_ptr() as usize) % self.mem_align == 0;
        if in_place {
            let task = Task {
                write: false,
                sectors: piece.sectors,
                buf: dst.as_mut_ptr(),
                src: std::ptr::null(),
                out: std::ptr::null_mut(),
                io: true,
                fua: false,
                runs: Runs::NONE,
            };
            return self.run(plan, piece, task, t);
        }
        let t0 = t.clock();
        let mut g = self.pool.take(bytes)?;
        t.wait += t.clock().wrapping_sub(t0);
        let task = Task {
            write: false,
            sectors: piece.sectors,
            buf: g.as_mut_ptr(),
            src: std::ptr::null(),
            out: std::ptr::null_mut(),
            io: true,
            fua: false,
            runs: Runs::NONE,
        };
        self.run(plan, piece, task, t)?;
        dst.copy_from_slice(&g.as_mut_slice()[piece.head_skip..piece.head_skip + piece.buf_len]);
        Ok(())
    }

    /// True if a request can skip planning: it runs inline, covers whole sectors and its buffer
    /// sits at an address the backend accepts, so a read is one backend read and one decrypt
    /// in place, and a write given its buffer (`write_at_mut`) one encrypt in place and one
    /// backend write. This is the common 4 KiB case; the planner would produce the same single
    /// inline task (and, for a write, a bounce buffer and a copy).
    fn is_direct(&self, out: &[u8], offset: u64, write: bool) -> bool {
        self.runs_inline(write, out.len() as u64) && self.fits_direct(out, offset)
    }

    /// Whether the policy of the direction runs a request of `len` bytes on the caller's
    /// thread without planning: `inline`, or `auto` below its threshold.
    fn runs_inline(&self, write: bool, len: u64) -> bool {
        match Policy::from_u8(self.policy[usize::from(write)].load(Relaxed)) {
            Policy::Inline => true,
            Policy::Auto => len < self.auto_min_bytes.load(Relaxed),
            _ => false,
        }
    }

    /// Whole sectors, from a buffer at an address the backend accepts.
    fn fits_direct(&self, out: &[u8], offset: u64) -> bool {
        let len = out.len() as u64;
        let mask = (1u64 << self.shift) - 1;
        (offset | len) & mask == 0 && len > 0 && (out.as_ptr() as usize) % self.mem_align == 0
    }

    /// [`Core::is_direct`] for a write given its buffer, and also a big write that `auto`
    /// would not split now (every core busy with other big requests, or no worker idle):
    /// then it runs inline all the same, and is encrypted in the caller's buffer instead of a
    /// bounce buffer (one pass over memory fewer: on a relay to a remote at QD8 that was
    /// 1 MiB writes' difference between `auto` and `inline`). A big write `auto` splits is
    /// planned with the decision made here, so it is made (and counted) once.
    fn write_route(&self, buf: &[u8], offset: u64) -> WriteRoute<'_> {
        if self.is_direct(buf, offset, true) {
            return WriteRoute::InPlace(None);
        }
        let len = buf.len() as u64;
        let auto = Policy::from_u8(self.policy[1].load(Relaxed)) == Policy::Auto;
        if !auto || !self.fits_direct(buf, offset) {
            return WriteRoute::Planned(None);
        }
        match self.auto_dispatch(Op::Write, len) {
            (Dispatch::Inline, big) => WriteRoute::InPlace(big),
            decided => WriteRoute::Planned(Some(decided)),
        }
    }

    /// What `auto` makes of a request of `len` bytes now, and (for a big one) the count of
    /// it while it runs: split only if a worker is idle AND fewer big requests than the cores
    /// this process could use are running, i.e. another core is likely free. The cores are
    /// the engine's lanes, fewer when the host's other processes held some lately
    /// (`engine::host`). Small requests are not counted, to keep the shared counter off their
    /// path.
    fn auto_dispatch(&self, op: Op, len: u64) -> (Dispatch, Option<BigGuard<'_>>) {
        let planner = Planner {
            auto_min_bytes: self.auto_min_bytes.load(Relaxed),
            ..self.planner
        };
        let mut guard = None;
        let mut idle = 0;
        if len >= planner.auto_min_bytes {
            let others = self.big_inflight.fetch_add(1, Relaxed);
            guard = Some(BigGuard(&self.big_inflight));
            let cores = host::free_cores(planner.lanes as usize, others as usize);
            // A worker that can be started counts as idle: it starts at once, and the caller
            // runs the chunks it has not taken.
            idle = (self.jobs.idle() + self.jobs.startable()).min(cores as u32);
        }
        (planner.dispatch(Policy::Auto, op, len, idle), guard)
    }

    fn read(&self, out: &mut [u8], offset: u64) -> Result<()> {
        let mut t = Times::start();
        self.check(offset, out.len() as u64)?;
        if self.is_direct(out, offset, false) {
            // The backend read is called from here, not through planning and `exec_task`:
            // fewer frames and branches between the caller and the syscall, on the request
            // whose overhead `bench engine` scenario 1 measures (BENCHMARKS.md).
            let first = offset >> self.shift;
            let t0 = t.clock();
            let r = self.backend.read_exact_at(out, self.backend_offset(first));
            t.backend += t.clock().wrapping_sub(t0);
            let r = r.and_then(|()| {
                let t0 = t.clock();
                let r = self.crypt(None, false, first, out, None);
                t.crypto += t.clock().wrapping_sub(t0);
                r
            });
            self.stats
                .record(Kind::Read, out.len() as u64, &t, false, false);
            return r;
        }
        let (plan, _big) = self.plan(Op::Read, offset, out.len() as u64);
        let mut r = Ok(());
        for piece in plan.pieces() {
            r = self.read_piece(&plan, &piece, out, &mut t);
            if r.is_err() {
                break;
            }
        }
        let split = plan.dispatch.splits();
        self.stats
            .record(Kind::Read, out.len() as u64, &t, split, false);
        r
    }

    // ---------------------------------------------------------------- writes

    /// A write that passed [`Core::is_direct`], encrypted in the caller's buffer: lock its
    /// sectors, encrypt in place, one backend write (durable when it returns, with `fua`).
    fn write_direct(&self, buf: &mut [u8], offset: u64, fua: bool) -> Result<()> {
        let mut t = Times::start();
        let len = buf.len() as u64;
        self.check(offset, len)?;
        self.check_writable()?;
        let first = offset >> self.shift;
        let t0 = t.clock();
        let _lock = self.locks.lock(SectorRange {
            first,
            end: first + (len >> self.shift),
        });
        t.wait += t.clock().wrapping_sub(t0);
        let t0 = t.clock();
        let r = self.crypt(None, true, first, buf, None);
        t.crypto += t.clock().wrapping_sub(t0);
        let r = r.and_then(|()| {
            let t0 = t.clock();
            let at = self.backend_offset(first);
            let r = if fua {
                self.backend.write_at_fua(buf, at)
            } else {
                self.backend.write_at(buf, at)
            };
            t.backend += t.clock().wrapping_sub(t0);
            r
        });
        self.stats.record(Kind::Write, len, &t, false, false);
        r
    }

    /// Reads and decrypts one sector into `dst` (the edge of a read-modify-write).
    fn read_sector_plain(&self, sector: u64, dst: &mut [u8], t: &mut Times) -> Result<()> {
        let task = Task {
            write: false,
            sectors: SectorRange {
                first: sector,
                end: sector + 1,
            },
            buf: dst.as_mut_ptr(),
            src: std::ptr::null(),
            out: std::ptr::null_mut(),
            io: true,
            fua: false,
            runs: Runs::NONE,
        };
        self.exec_task(None, &task, t)
    }

    fn write_piece(
        &self,
        plan: &Plan,
        piece: &Piece,
        src: Source<'_>,
        fua: bool,
        t: &mut Times,
    ) -> Result<()> {
        let ss = 1usize << self.shift;
        let bytes = (piece.sectors.len() << self.shift) as usize;
        let unordered = matches!(plan.dispatch, Dispatch::Inline | Dispatch::Parallel { .. });
        if self.null_cipher() && unordered && piece.aligned() && matches!(src, Source::Zeroes) {
            // Ciphertext of zeroes is zeroes only for the null cipher: let the storage do it.
            let t0 = t.clock();
            let r = self
                .backend
                .write_zeroes(self.backend_offset(piece.sectors.first), bytes as u64);
            let r = if fua {
                r.and_then(|()| self.backend.flush())
            } else {
                r
            };
            t.backend += t.clock().wrapping_sub(t0);
            return r;
        }
        if piece.aligned() {
            return self.write_aligned(plan, piece, src, fua, t);
        }
        // Read-modify-write: the bounce buffer gets the old plaintext of partial edge sectors,
        // then the new data (or zeroes), then is encrypted in place (and wiped on release).
        let t0 = t.clock();
        let mut g = self.pool.take(bytes)?;
        t.wait += t.clock().wrapping_sub(t0);
        let b = g.as_mut_slice();
        if piece.partial_first {
            self.read_sector_plain(piece.sectors.first, &mut b[..ss], t)?;
        }
        if piece.partial_last {
            self.read_sector_plain(piece.sectors.end - 1, &mut b[bytes - ss..], t)?;
        }
        let dst = &mut b[piece.head_skip..piece.head_skip + piece.buf_len];
        match src {
            Source::Buf(s) => dst.copy_from_slice(&s[piece.buf_off..piece.buf_off + piece.buf_len]),
            Source::Zeroes => dst.fill(0),
        }
        let task = Task {
            write: true,
            sectors: piece.sectors,
            buf: g.as_mut_ptr(),
            src: std::ptr::null(),
            out: std::ptr::null_mut(),
            io: true,
            fua,
            runs: Runs::NONE,
        };
        self.run(plan, piece, task, t)
    }

    /// A piece of whole sectors, in parts of the pool's fair share (`BufferPool::take_share`):
    /// each part is encrypted from the caller's buffer (or zeroes) into a grant and written, so
    /// that many writers share the pool without taking turns. The parts of a piece are written
    /// one after the other; like a piece's, they are acknowledged together, with the request.
    fn write_aligned(
        &self,
        plan: &Plan,
        piece: &Piece,
        src: Source<'_>,
        fua: bool,
        t: &mut Times,
    ) -> Result<()> {
        let unordered = matches!(plan.dispatch, Dispatch::Inline | Dispatch::Parallel { .. });
        // The null cipher's ciphertext is the plaintext: write it from where it is, with no
        // copy into a grant and no wipe of one, if the backend takes the caller's buffer at
        // its address (O_DIRECT).
        let from_caller = match src {
            Source::Buf(b) if unordered && self.null_cipher() => {
                let data = &b[piece.buf_off..piece.buf_off + piece.buf_len];
                (data.as_ptr() as usize % self.mem_align == 0).then_some(data)
            }
            _ => None,
        };
        if let Some(data) = from_caller {
            let t0 = t.clock();
            let at = self.backend_offset(piece.sectors.first);
            let r = if fua {
                self.backend.write_at_fua(data, at)
            } else {
                self.backend.write_at(data, at)
            };
            t.backend += t.clock().wrapping_sub(t0);
            return r;
        }
        let ss = 1usize << self.shift;
        let bytes = piece.buf_len;
        // The `queued` model hands each part to a worker and then to the writer thread: there
        // parts would multiply the hand-offs, so it takes the piece whole.
        let whole = matches!(plan.dispatch, Dispatch::Queued);
        let mut done = 0usize;
        while done < bytes {
            let t0 = t.clock();
            let mut g = if whole {
                self.pool.take(bytes - done)?
            } else {
                self.pool
                    .take_share(bytes - done, ss, GRANT_SHARE_MIN_BYTES)?
            };
            t.wait += t.clock().wrapping_sub(t0);
            let len = g.len();
            let first = piece.sectors.first + (done >> self.shift) as u64;
            let part = Piece {
                buf_off: piece.buf_off + done,
                buf_len: len,
                sectors: SectorRange {
                    first,
                    end: first + (len >> self.shift) as u64,
                },
                ..*piece
            };
            let plain_src = match src {
                Source::Buf(b) => b[part.buf_off..part.buf_off + len].as_ptr(),
                Source::Zeroes => {
                    // A grant holds zeroes or old ciphertext: zeroes are encrypted in place.
                    g.as_mut_slice().fill(0);
                    std::ptr::null()
                }
            };
            let task = Task {
                write: true,
                sectors: part.sectors,
                buf: g.as_mut_ptr(),
                src: plain_src,
                out: std::ptr::null_mut(),
                io: true,
                fua,
                runs: Runs::NONE,
            };
            self.run(plan, &part, task, t)?;
            if !plain_src.is_null() && !self.null_cipher() {
                // Encrypted straight from the caller's buffer: only ciphertext ever landed here.
                g.held_only_ciphertext();
            }
            done += len;
        }
        Ok(())
    }

    /// A write of `len` bytes from `src`; with `fua`, durable when it returns.
    fn write(&self, op: Op, src: Source<'_>, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.write_decided(op, src, offset, len, fua, None)
    }

    /// [`Core::write`] with `auto`'s decision already made (`decided`), or not.
    fn write_decided(
        &self,
        op: Op,
        src: Source<'_>,
        offset: u64,
        len: u64,
        fua: bool,
        decided: Option<Decided<'_>>,
    ) -> Result<()> {
        let mut t = Times::start();
        self.check(offset, len)?;
        self.check_writable()?;
        let (plan, _big) = match decided {
            Some((dispatch, big)) => (self.planner.plan(op, offset, len, dispatch), big),
            None => self.plan(op, offset, len),
        };
        let t0 = t.clock();
        let _lock = plan.lock.map(|r| self.locks.lock(r));
        t.wait += t.clock().wrapping_sub(t0);
        let mut r = Ok(());
        let mut rmw = false;
        for piece in plan.pieces() {
            rmw |= !piece.aligned();
            r = self.write_piece(&plan, &piece, src, fua, &mut t);
            if r.is_err() {
                break;
            }
        }
        let split = plan.dispatch.splits();
        self.stats.record(Kind::Write, len, &t, split, rmw);
        r
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let mut t = Times::start();
        self.check(offset, len)?;
        self.check_writable()?;
        let (plan, _big) = self.plan(Op::Discard, offset, len);
        let r = match plan.discard {
            None => Ok(()),
            Some(_) if !self.allow_discards.load(Relaxed) => Ok(()),
            Some(range) => {
                let _lock = self.locks.lock(range);
                let t0 = t.clock();
                let r = self
                    .backend
                    .discard(self.backend_offset(range.first), range.len() << self.shift);
                t.backend += t.clock().wrapping_sub(t0);
                r
            }
        };
        self.stats.record(Kind::Write, len, &t, false, false);
        r
    }
}

// ================================================================ construction

/// Checks a configuration against its backend; returns the plaintext size in bytes.
fn checked_size(backend: &dyn Backend, cfg: &VolumeConfig) -> Result<u64> {
    if cfg.spin > SPIN_MAX {
        return Err(Error::InvalidArgument(format!(
            "spin of {} µs is longer than the limit of {} µs",
            cfg.spin.as_micros(),
            SPIN_MAX.as_micros()
        )));
    }
    let ss = cfg.geometry.sector_size.bytes() as u64;
    let lbs = backend.logical_block_bytes() as u64;
    if ss < lbs {
        return Err(Error::InvalidArgument(format!(
            "encryption sector size {ss} is smaller than the backend's logical block size {lbs}"
        )));
    }
    if cfg.data_offset_bytes % lbs.max(512) != 0 {
        return Err(Error::InvalidArgument(format!(
            "data offset {} is not a multiple of the backend's block size {}",
            cfg.data_offset_bytes,
            lbs.max(512)
        )));
    }
    fitted_size(backend.size(), cfg.data_offset_bytes, ss, cfg.size_bytes)
}

/// The plaintext size on a backend of `backend_bytes` with data from `data_offset`: `want`
/// if it is whole `ss`-byte sectors and fits, else (None) the room after the offset in whole
/// sectors.
fn fitted_size(backend_bytes: u64, data_offset: u64, ss: u64, want: Option<u64>) -> Result<u64> {
    let room = backend_bytes.checked_sub(data_offset).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "data offset {data_offset} is beyond the end of the backend ({backend_bytes} bytes)"
        ))
    })?;
    let size = match want {
        None => room / ss * ss,
        Some(s) if s % ss != 0 => {
            return Err(Error::InvalidArgument(format!(
                "volume size {s} is not a multiple of the sector size {ss}"
            )))
        }
        Some(s) if s > room => {
            return Err(Error::InvalidArgument(format!(
                "volume size {s} does not fit the backend ({room} bytes after the data offset)"
            )))
        }
        Some(s) => s,
    };
    Ok(size)
}

impl Volume {
    /// A write given its buffer (`write_at_mut`, and `write_fua` with `fua`): encrypted in
    /// place when it runs inline ([`Core::write_route`]), else planned; by the segments while
    /// the volume is in reencryption.
    fn write_given(&self, buf: &mut [u8], offset: u64, fua: bool) -> Result<()> {
        let _in = self.core.enter(Kind::Write)?;
        let len = buf.len() as u64;
        let r = if self.core.segmented.load(Relaxed) {
            self.seg_write(Op::Write, Source::Buf(buf), offset, len, fua)
        } else {
            match self.core.write_route(buf, offset) {
                WriteRoute::InPlace(_big) => self.core.write_direct(buf, offset, fua),
                WriteRoute::Planned(decided) => {
                    let src = Source::Buf(buf);
                    self.core
                        .write_decided(Op::Write, src, offset, len, fua, decided)
                }
            }
        };
        counted(&self.core, Kind::Write, r)
    }

    pub fn new(backend: Arc<dyn Backend>, cfg: VolumeConfig) -> Result<Self> {
        Self::with_stats(backend, cfg, Arc::new(Stats::default()))
    }

    /// [`Volume::new`] counting into `stats` (the new key's side of a volume in reencryption
    /// counts into the volume's own).
    fn with_stats(backend: Arc<dyn Backend>, cfg: VolumeConfig, stats: Arc<Stats>) -> Result<Self> {
        let size = checked_size(backend.as_ref(), &cfg)?;
        let ss = cfg.geometry.sector_size.bytes() as u64;
        let shift = cfg.geometry.sector_size.shift();
        let cipher = SectorCipher::new(cfg.spec, cfg.key.as_ref(), cfg.geometry)?;
        let pool = BufferPool::with_idle_release(cfg.pool_bytes, cfg.idle_release)?;
        let piece = (pool.piece_bytes_max().min(PIECE_BYTES_MAX) as u64) / ss * ss;
        let workers = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, WORKERS_MAX);
        let planner = Planner {
            sector_shift: shift,
            piece_bytes_max: piece.max(ss),
            parallel_min_bytes: PARALLEL_MIN_BYTES,
            auto_min_bytes: AUTO_MIN_BYTES_CEIL,
            chunk_min_bytes: CHUNK_MIN_BYTES,
            lanes: workers as u32,
        };
        let provider = cipher.provider();
        let core = Arc::new_cyclic(|me| Core {
            mem_align: backend.mem_align_bytes(),
            backend,
            data_offset: cfg.data_offset_bytes,
            size: AtomicU64::new(size),
            shift,
            null_cipher: AtomicBool::new(cfg.spec.mode == Mode::Null),
            out_of_place: AtomicBool::new(cipher.crypts_out_of_place()),
            read_only: cfg.read_only,
            allow_discards: AtomicBool::new(cfg.allow_discards),
            planner,
            auto_min_bytes: AtomicU64::new(AUTO_MIN_BYTES_CEIL),
            crypto_ps_per_byte: AtomicU64::new(0),
            big_inflight: AtomicU32::new(0),
            policy: [
                AtomicU8::new(cfg.policy.read.to_u8()),
                AtomicU8::new(cfg.policy.write.to_u8()),
            ],
            pool,
            locks: RangeLock::default(),
            ciphers: CipherSlots::new(cipher),
            stats,
            jobs: BoundedQueue::with_consumers(JOB_QUEUE_MAX, workers as u32),
            writes: BoundedQueue::with_consumers(WRITE_QUEUE_MAX, 1),
            me: me.clone(),
            idle_release: cfg.idle_release,
            worker_threads: Mutex::new(Vec::with_capacity(workers)),
            writer_thread: Mutex::new(None),
            turns: Turns {
                next_ticket: AtomicU64::new(0),
                serving: Mutex::new(0),
                cv: WaitCell::new(),
            },
            max_spinners: workers.saturating_sub(1) as u32,
            spin_ns: AtomicU64::new(cfg.spin.as_nanos() as u64),
            gate: Gate::default(),
            activity: Default::default(),
            spec: Mutex::new((cfg.spec, cfg.key.len())),
            geometry: cfg.geometry,
            provider,
            suspended: Mutex::new(false),
            segmented: AtomicBool::new(false),
        });
        let mut vol = Volume {
            core,
            segments: Mutex::new(None),
        };
        vol.calibrate()?;
        Ok(vol)
    }

    /// Current dispatch policies.
    pub fn policy(&self) -> Policies {
        let get = |i: usize| Policy::from_u8(self.core.policy[i].load(Relaxed));
        Policies {
            read: get(0),
            write: get(1),
        }
    }

    /// Switches the dispatch policies (`Policy` for both directions, or `Policies`); requests
    /// already running finish under the old ones.
    pub fn set_policy(&self, p: impl Into<Policies>) {
        let p = p.into();
        self.core.policy[0].store(p.read.to_u8(), Relaxed);
        self.core.policy[1].store(p.write.to_u8(), Relaxed);
    }

    /// Suspends the volume (cryptsetup's `luksSuspend`): new requests wait (they do not fail),
    /// the requests running finish, the backend is flushed, then every cipher context, each
    /// holding a copy of the key, is dropped (wiped). Until [`Volume::resume`], nothing in this
    /// volume holds the key. Must not be called from inside a request (it waits for them).
    pub fn suspend(&self) -> Result<()> {
        let mut suspended = lock(&self.core.suspended);
        if *suspended {
            return Err(Error::InvalidArgument(
                "the volume is already suspended".into(),
            ));
        }
        self.check_not_segmented()?;
        self.core.gate.close();
        if let Err(e) = self.core.backend.flush() {
            self.core.gate.open();
            return Err(e);
        }
        self.core.ciphers.clear();
        *suspended = true;
        Ok(())
    }

    /// Resumes a suspended volume with `key`, which must be its volume key: the volume cannot
    /// tell a wrong key of the right length (the caller checks it, e.g. against the LUKS
    /// digest: [`crate::luks::unlock_key`]). Releases the waiting requests.
    pub fn resume(&self, key: SecretBytes) -> Result<()> {
        let mut suspended = lock(&self.core.suspended);
        if !*suspended {
            return Err(Error::InvalidArgument("the volume is not suspended".into()));
        }
        let c = &*self.core;
        let spec = lock(&c.spec).0;
        let cipher = SectorCipher::with_provider(spec, key.as_ref(), c.geometry, c.provider)?;
        drop(key);
        c.ciphers.install(cipher);
        *suspended = false;
        c.gate.open();
        Ok(())
    }

    /// Ends a suspended volume for good (`close --force` of a suspended device): the requests
    /// waiting for the resume, and every later one, fail with EIO. The volume never holds its
    /// key again; only dropping it is left. Refused when not suspended.
    pub fn abort_suspended(&self) -> Result<()> {
        let suspended = lock(&self.core.suspended);
        if !*suspended {
            return Err(Error::InvalidArgument("the volume is not suspended".into()));
        }
        self.core.gate.fail();
        Ok(())
    }

    /// Refuses while two segments are served: in reencryption, or after a reencryption
    /// that changed the sector size or the data offset (until the volume is closed).
    fn check_not_segmented(&self) -> Result<()> {
        if !self.core.segmented.load(Relaxed) {
            Ok(())
        } else if self.reopen_needed() {
            Err(Error::InvalidArgument(segments::REOPEN_NEEDED.into()))
        } else {
            Err(Error::InReencryption)
        }
    }

    /// The volume's own encryption sector size (in reencryption, the old side's).
    pub fn sector_size(&self) -> SectorSize {
        self.core.geometry.sector_size
    }

    /// The cipher the volume serves with, and its key's length in bytes (in reencryption: the
    /// old side's, until [`Volume::end_segments`]).
    pub fn cipher(&self) -> (CipherSpec, usize) {
        *lock(&self.core.spec)
    }

    /// True between [`Volume::suspend`] and [`Volume::resume`].
    pub fn is_suspended(&self) -> bool {
        *lock(&self.core.suspended)
    }

    /// Changes the plaintext size after the backend grew or shrank (cryptsetup's `resize`):
    /// `size_bytes`, or with None everything from the data offset to the backend's end, as
    /// measured now. Requests wait while the size changes. Refused while suspended, and for a
    /// size that is not whole sectors or does not fit the backend. Returns the new size.
    pub fn resize(&self, size_bytes: Option<u64>) -> Result<u64> {
        let suspended = lock(&self.core.suspended);
        if *suspended {
            return Err(Error::InvalidArgument(
                "the volume is suspended: resume it first".into(),
            ));
        }
        self.check_not_segmented()?;
        let c = &*self.core;
        let backend_bytes = c.backend.refresh_size()?;
        let size = fitted_size(backend_bytes, c.data_offset, 1u64 << c.shift, size_bytes)?;
        c.gate.close();
        c.size.store(size, Relaxed);
        c.gate.open();
        drop(suspended);
        Ok(size)
    }

    /// Whether discards reach the backend (`VolumeConfig::allow_discards`).
    pub fn allow_discards(&self) -> bool {
        self.core.allow_discards.load(Relaxed)
    }

    /// Lets discards through to the backend, or not, from the next request on.
    pub fn set_allow_discards(&self, on: bool) {
        self.core.allow_discards.store(on, Relaxed)
    }

    /// `VolumeConfig::spin`, as now.
    pub fn spin(&self) -> Duration {
        self.core.spin()
    }

    /// Changes `VolumeConfig::spin` (at most [`SPIN_MAX`]) for the next waits.
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        if spin > SPIN_MAX {
            return Err(Error::InvalidArgument(format!(
                "spin of {} µs is longer than the limit of {} µs",
                spin.as_micros(),
                SPIN_MAX.as_micros()
            )));
        }
        self.core.spin_ns.store(spin.as_nanos() as u64, Relaxed);
        Ok(())
    }

    /// Passed by every request as it enters: armed, it says when the volume is used again.
    pub fn activity(&self) -> &crate::sync::Tripwire {
        &self.core.activity
    }

    /// A snapshot of where time went so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.core.stats.snapshot()
    }

    /// Zeroes the counters behind [`Volume::stats`].
    pub fn reset_stats(&self) {
        self.core.stats.reset()
    }

    /// The request size from which `auto` splits (calibrated at start-up).
    pub fn auto_threshold_bytes(&self) -> u64 {
        self.core.auto_min_bytes.load(Relaxed)
    }

    /// Worker threads at most (one per core).
    pub fn workers(&self) -> usize {
        self.core.planner.lanes as usize
    }

    /// Engine threads running now (workers and the writer): none once the volume has been
    /// idle for `VolumeConfig::idle_release`.
    pub fn threads_running(&self) -> usize {
        (self.core.jobs.consumers() + self.core.writes.consumers()) as usize
    }

    /// Bounce buffer bytes resident (and locked, where the limit allows) now: none once the
    /// volume has been idle for `VolumeConfig::idle_release`.
    pub fn pool_resident_bytes(&self) -> usize {
        self.core.pool.resident_bytes()
    }

    /// Chunks of the bounce buffers whose `mlock` failed (RLIMIT_MEMLOCK): plaintext in them
    /// may be swapped out.
    pub fn pool_lock_failures(&self) -> u64 {
        self.core.pool.lock_failures()
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.core.backend
    }

    /// Measures the cipher's cost per byte and the worker hand-off round trip, and sets the
    /// `auto` threshold where splitting a request in two saves more than the hand-off costs.
    fn calibrate(&mut self) -> Result<()> {
        let core = &*self.core;
        const PROBE_BYTES: usize = 64 << 10;
        const ROUNDS: usize = 8;
        let probe = (PROBE_BYTES.min(core.pool.capacity()) as u64 >> core.shift) << core.shift;
        let mut g = core.pool.take(probe as usize)?;
        let buf = g.as_mut_slice();
        let mut best_crypto = u64::MAX;
        for _ in 0..ROUNDS {
            let t0 = now();
            core.ciphers.with(|c| c.encrypt(0, buf))?;
            // Backend I/O on RAM costs about a copy; it is split along with the crypto.
            buf.copy_within(0..buf.len() / 2, buf.len() / 2);
            buf.copy_within(buf.len() / 2.., 0);
            best_crypto = best_crypto.min(now().wrapping_sub(t0));
        }
        drop(g);
        let mut best_ping = u64::MAX;
        for _ in 0..ROUNDS * 4 {
            let comp = Completion::new(1);
            let t0 = now();
            if core
                .push_job(Job::Ping {
                    done: DoneRef(&comp),
                })
                .is_err()
            {
                return Err(Error::Bug("job queue closed during calibration"));
            }
            let _ = comp.wait(core.spin());
            best_ping = best_ping.min(now().wrapping_sub(t0));
        }
        let ns = ns_per_tick();
        let per_byte_ns = (best_crypto as f64 * ns / probe.max(1) as f64).max(1e-3);
        core.crypto_ps_per_byte
            .store((per_byte_ns * 1e3) as u64, Relaxed);
        let handoff_ns = best_ping as f64 * ns;
        // Splitting L bytes in two saves L*c/2 and costs one hand-off; ask for a 2x margin.
        let t = (4.0 * handoff_ns / per_byte_ns) as u64;
        let ss = 1u64 << core.shift;
        let t = t
            .clamp(AUTO_MIN_BYTES_FLOOR, AUTO_MIN_BYTES_CEIL)
            .div_ceil(ss)
            * ss;
        core.auto_min_bytes.store(t, Relaxed);
        Ok(())
    }
}

impl Core {
    /// Queues a job, starting the workers if it waits for more than the idle ones. Workers
    /// that cannot start (the system's thread limit) leave the job to the running ones; with
    /// none running, this thread runs what waits itself.
    fn push_job(&self, job: Job) -> std::result::Result<(), Job> {
        let n = self.jobs.push_staffed(job)?;
        if n > 0 && self.start_workers(n).is_err() && self.jobs.consumers_not_started(n) {
            while let Some(job) = self.jobs.steal(|_| true) {
                workers::run_job(self, job);
            }
        }
        Ok(())
    }

    /// Starts `n` worker threads: this thread starts one, which starts the next before it
    /// takes work, and so on, so that the request that starts a busy period pays for one
    /// thread's start, not all. Each fills its cipher slot as it starts: a thread's start-up
    /// allocates (its name, its thread-locals, its cipher context), and that belongs to the
    /// start of a busy period, not to each request; with every worker's slot filled, no thread
    /// has to skip a busy slot and fill another, so steady-state I/O never makes a context.
    fn start_workers(&self, n: u32) -> Result<()> {
        let c = self.me.upgrade().ok_or(Error::Bug("volume core gone"))?;
        let h = std::thread::Builder::new()
            .name("ucrypt-worker".into())
            .spawn(move || {
                // The rest that could not start no longer count; this one runs, so no job is
                // left without a worker.
                if n > 1 && c.start_workers(n - 1).is_err() {
                    c.jobs.consumers_not_started(n - 1);
                }
                // A failure here (the volume suspended) only leaves the slot to fill later.
                let _ = c.ciphers.with(|_| Ok(()));
                workers::worker_loop(&*c)
            })
            .map_err(|e| Error::io("starting a worker thread", e))?;
        let mut ts = lock(&self.worker_threads);
        // Handles of threads that ended are dropped (their threads are gone): the list holds
        // at most the running workers and the ones ending now.
        ts.retain(|t| !t.is_finished());
        ts.push(h);
        Ok(())
    }

    fn start_writer(&self) -> Result<()> {
        let c = self.me.upgrade().ok_or(Error::Bug("volume core gone"))?;
        let h = std::thread::Builder::new()
            .name("ucrypt-writer".into())
            .spawn(move || workers::writer_loop(&*c))
            .map_err(|e| Error::io("starting the writer thread", e))?;
        // The writer before it, if any, has retired (the queue counts one at most).
        let old = lock(&self.writer_thread).replace(h);
        drop(old);
        Ok(())
    }

    /// Joins every worker, including ones started while this runs (the queue is closed, so
    /// those only drain what is left).
    fn join_workers(&self) {
        loop {
            let ts = std::mem::take(&mut *lock(&self.worker_threads));
            if ts.is_empty() {
                return;
            }
            for t in ts {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.core.jobs.close();
        // Workers drain their queue (pushing to the writer) before the writer's queue closes.
        self.core.join_workers();
        self.core.writes.close();
        let writer = lock(&self.core.writer_thread).take();
        if let Some(w) = writer {
            let _ = w.join();
        }
    }
}

// ================================================================ drivers: how tasks run

impl Core {
    /// The range check every request passes first: the pointer arithmetic of tasks and the
    /// pool relies on requests lying inside the volume.
    fn check(&self, offset: u64, len: u64) -> Result<()> {
        crate::blockdev::check_range(offset, len, self.size.load(Relaxed))
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly("the volume was opened read-only".into()));
        }
        Ok(())
    }

    /// Plans a request. For `auto`, a request big enough to split is counted while it runs
    /// (the guard; [`Core::auto_dispatch`]).
    fn plan(&self, op: Op, offset: u64, len: u64) -> (Plan, Option<BigGuard<'_>>) {
        let write = !matches!(op, Op::Read);
        let policy = Policy::from_u8(self.policy[usize::from(write)].load(Relaxed));
        let (dispatch, guard) = if policy == Policy::Auto {
            self.auto_dispatch(op, len)
        } else {
            (self.planner.dispatch(policy, op, len, 0), None)
        };
        (self.planner.plan(op, offset, len, dispatch), guard)
    }

    fn backend_offset(&self, sector: u64) -> u64 {
        self.data_offset + (sector << self.shift)
    }

    /// Crypto for whole sectors: decrypt `buf` in place, or encrypt `src` (or `buf` itself)
    /// into `buf`. Uses `own` if given (a worker's context), else borrows one.
    // Inlined into its four callers: the 4 KiB direct path's null-cipher case is then two
    // instructions, not a call. The workers reach the volume through a trait, so the compiler
    // keeps it out of line unless told, and a call on every 4 KiB read is a visible share of
    // a read from memory (`read4k` under callgrind: BENCHMARKS.md, "CPU per 4 KiB read").
    #[inline(always)]
    fn crypt(
        &self,
        own: Option<&mut SectorCipher>,
        write: bool,
        sector: u64,
        buf: &mut [u8],
        src: Option<&[u8]>,
    ) -> Result<()> {
        if self.null_cipher() {
            if let Some(s) = src {
                buf.copy_from_slice(s);
            }
            return Ok(());
        }
        let mut run = |c: &mut SectorCipher| match (write, src) {
            (false, _) => c.decrypt(sector, buf),
            (true, Some(s)) => c.encrypt_to(sector, s, buf),
            (true, None) => c.encrypt(sector, buf),
        };
        match own {
            Some(c) => run(c),
            None => self.ciphers.with(run),
        }
    }

    /// The backend read of a task's ciphertext into `buf` (its buffer).
    fn read_task_io(&self, task: &Task, buf: &mut [u8], t: &mut Times) -> Result<()> {
        let t0 = t.clock();
        let r = self
            .backend
            .read_exact_at(buf, self.backend_offset(task.sectors.first));
        t.backend += t.clock().wrapping_sub(t0);
        r
    }

    /// The ciphertext buffer of `task`, after checking (in debug builds; this is every
    /// request's path) that its sectors lie inside the volume, which is what sizes the buffers
    /// callers and the pool hand in.
    ///
    /// # Safety
    /// `task.buf` must cover `task.sectors` and belong to this task alone (see [`Task`]) for
    /// as long as the returned slice is used.
    unsafe fn task_buf<'a>(&self, task: &Task) -> &'a mut [u8] {
        debug_assert!(
            task.sectors.end << self.shift <= self.size.load(Relaxed),
            "task beyond the volume"
        );
        debug_assert!(!task.buf.is_null());
        // SAFETY: the caller's contract above.
        unsafe { std::slice::from_raw_parts_mut(task.buf, task.bytes(self.shift)) }
    }
}

impl Executor for Core {
    fn jobs(&self) -> &BoundedQueue<Job> {
        &self.jobs
    }

    fn writes(&self) -> &BoundedQueue<WriteJob> {
        &self.writes
    }

    fn spin(&self) -> Duration {
        Duration::from_nanos(self.spin_ns.load(Relaxed))
    }

    fn max_spinners(&self) -> u32 {
        self.max_spinners
    }

    fn push_write(&self, w: WriteJob) -> std::result::Result<(), WriteJob> {
        // The queue has one consumer at most: n is 0 or 1.
        let n = self.writes.push_staffed(w)?;
        if n > 0 && self.start_writer().is_err() && self.writes.consumers_not_started(n) {
            while let Some(w) = self.writes.steal(|_| true) {
                workers::run_write(self, w);
            }
        }
        Ok(())
    }

    fn idle_exit(&self) -> Option<Duration> {
        Some(self.idle_release)
    }

    /// Runs a task: backend read + decrypt, or encrypt + backend write (I/O only if `task.io`).
    fn exec_task(&self, own: Option<&mut SectorCipher>, task: &Task, t: &mut Times) -> Result<()> {
        let len = task.bytes(self.shift);
        // SAFETY: every task the volume builds covers its sectors with a buffer of its own
        // (see Task); chunks of a split are disjoint sub-tasks.
        let buf = unsafe { self.task_buf(task) };
        if !task.write {
            if task.io {
                self.read_task_io(task, buf, t)?;
            }
            let t0 = t.clock();
            let r = if !task.runs.is_empty() {
                self.crypt_runs(own, task, buf)
            } else if task.out.is_null() {
                self.crypt(own, false, task.sectors.first, buf, None)
            } else {
                // SAFETY: a non-null out covers the same sectors in the caller's buffer, apart
                // from `buf` (see Task).
                let out = unsafe { std::slice::from_raw_parts_mut(task.out, len) };
                self.decrypt_out(own, task.sectors.first, buf, out)
            };
            t.crypto += t.clock().wrapping_sub(t0);
            return r;
        }
        // SAFETY: a non-null src covers the same sectors in the caller's (read-only) buffer.
        let src =
            (!task.src.is_null()).then(|| unsafe { std::slice::from_raw_parts(task.src, len) });
        let t0 = t.clock();
        let r = if task.runs.is_empty() {
            self.crypt(own, true, task.sectors.first, buf, src)
        } else {
            self.crypt_runs(own, task, buf)
        };
        t.crypto += t.clock().wrapping_sub(t0);
        r?;
        if task.io {
            self.write_task_io(task, t)?;
        }
        Ok(())
    }

    /// The backend write of an encrypted task.
    fn write_task_io(&self, task: &Task, t: &mut Times) -> Result<()> {
        // SAFETY: as in exec_task; the buffer now holds ciphertext.
        let buf: &[u8] = unsafe { self.task_buf(task) };
        let t0 = t.clock();
        let at = self.backend_offset(task.sectors.first);
        let r = if task.fua {
            self.backend.write_at_fua(buf, at)
        } else {
            self.backend.write_at(buf, at)
        };
        t.backend += t.clock().wrapping_sub(t0);
        r
    }
}
