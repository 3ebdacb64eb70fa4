//! The threads of a volume: `workers` (one per core) run chunk tasks and the crypto of the
//! `queued` model; one `writer` thread submits the `queued` model's writes, sorted by sector.
//! Work reaches them only through bounded queues; a caller always waits for the completion of
//! everything it handed off before returning, so tasks may point into the caller's buffers.
//!
//! The threads start on demand and leave when idle: the queues count their consumers
//! (`BoundedQueue::push_staffed`), the volume starts one when an item waits for more
//! consumers than are idle, and a thread that found no work for [`THREAD_IDLE_EXIT`] ends. An
//! idle volume thus has no engine thread, and a busy one as many as before. Starting a thread
//! costs tens of microseconds and allocates; it happens once per busy period and thread, not
//! per request (the first requests after an idle period are served while it starts: a split's
//! caller runs the chunks no helper has taken).

use std::sync::atomic::{AtomicU32, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::queue::{spin_until, BoundedQueue};
use super::stats::{now, Times};
use super::task::Task;
use crate::sector::SectorCipher;
use crate::sync::{lock, SpinGovernor, WaitCell};
use crate::{Error, Result};

/// What the threads need from the volume they serve: its queues, and the
/// two steps of a task it knows how to perform. The volume implements it; this module never
/// names the volume, so the engine does not depend on it.
pub(crate) trait Executor: Sync {
    fn jobs(&self) -> &BoundedQueue<Job>;
    fn writes(&self) -> &BoundedQueue<WriteJob>;
    /// `VolumeConfig::spin`.
    fn spin(&self) -> Duration;
    /// Workers that may spin for work at once.
    fn max_spinners(&self) -> u32;
    /// Backend read + decrypt, or encrypt + backend write (I/O only if `task.io`).
    fn exec_task(&self, own: Option<&mut SectorCipher>, task: &Task, t: &mut Times) -> Result<()>;
    /// The backend write of an encrypted task.
    fn write_task_io(&self, task: &Task, t: &mut Times) -> Result<()>;
    /// Hands an encrypted write to the writer thread, starting it if none runs.
    fn push_write(&self, w: WriteJob) -> std::result::Result<(), WriteJob>;
    /// How long an idle thread waits for work before it ends (None: never).
    fn idle_exit(&self) -> Option<Duration>;
}

/// Jobs waiting for a worker: enough for every caller thread to hand off a few chunks.
pub const JOB_QUEUE_MAX: usize = 256;
/// Encrypted writes waiting for the `queued` model's writer thread.
pub const WRITE_QUEUE_MAX: usize = 256;
/// Writes the writer takes, sorts and submits in one go (dm-crypt sorts what has piled up).
pub const WRITE_BATCH_MAX: usize = 64;
/// The default of `VolumeConfig::spin`: how long an idle worker spins for the next job before
/// it sleeps, and how long a caller spins for its chunks' completion before it sleeps. Waking
/// a sleeping thread on another (v)CPU costs tens of microseconds here, as much as the crypto
/// of the chunk it would run; a request stream keeps the worker busy-waiting between chunks
/// instead. The price is up to this much CPU time after the last request.
pub const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);
/// The most `VolumeConfig::spin` may be: spinning longer than this only burns CPU.
pub const SPIN_MAX: Duration = Duration::from_millis(10);
/// How long a worker or writer thread waits for work before it ends: a request stream with
/// pauses shorter than this never pays for starting threads again; a volume left idle has no
/// engine thread after this.
pub const THREAD_IDLE_EXIT: Duration = Duration::from_secs(5);

/// Counts down the parts of a request handed to other threads. Lives on the caller's stack;
/// the caller does not return before `remaining` reaches zero.
pub(crate) struct Completion {
    st: Mutex<CompState>,
    cv: WaitCell,
    /// `remaining`, mirrored for a waiter that spins before it takes the lock.
    hint: AtomicU32,
}

struct CompState {
    remaining: u32,
    err: Option<Error>,
    times: Times,
}

impl Completion {
    pub fn new(parts: u32) -> Self {
        Completion {
            st: Mutex::new(CompState {
                remaining: parts,
                err: None,
                times: Times::default(),
            }),
            // The last part notifies only if the caller sleeps (it did not see the last part
            // finish while spinning): a notify is a system call otherwise wasted.
            cv: WaitCell::new(),
            hint: AtomicU32::new(parts),
        }
    }

    /// One part finished. After this returns the completion may be gone: the caller of `done`
    /// must not touch it again.
    pub fn done(&self, r: Result<()>, t: &Times) {
        let mut s = lock(&self.st);
        s.times.add(t);
        if let Err(e) = r {
            s.err.get_or_insert(e);
        }
        assert!(s.remaining > 0, "more parts completed than were handed out");
        s.remaining -= 1;
        self.hint.store(s.remaining, Release);
        if s.remaining == 0 {
            // Notify while holding the lock: the waiter cannot return (and free this) before we
            // release it.
            self.cv.notify_all();
        }
    }

    /// Waits for every part, spinning for up to `spin` before sleeping (see
    /// [`SPIN_BEFORE_SLEEP`]); returns the first error and the parts' summed times.
    pub fn wait(&self, spin: Duration) -> (Result<()>, Times) {
        // The lock below is what makes returning safe; the spin only saves a sleep.
        if !spin.is_zero() && self.hint.load(Acquire) > 0 {
            spin_until(Instant::now() + spin, || self.hint.load(Acquire) == 0);
        }
        let mut s = lock(&self.st);
        while s.remaining > 0 {
            s = self.cv.wait(s);
        }
        let r = match s.err.take() {
            Some(e) => Err(e),
            None => Ok(()),
        };
        (r, s.times)
    }
}

impl Drop for Completion {
    /// Waits for every pending part even if the caller is unwinding from a panic: workers hold
    /// pointers to this completion (and to the caller's buffers) until they call `done`.
    fn drop(&mut self) {
        let mut s = lock(&self.st);
        while s.remaining > 0 {
            s = self.cv.wait(s);
        }
    }
}

/// A pointer to a caller's stack `Completion`, sendable to a worker.
#[derive(Clone, Copy)]
pub(crate) struct DoneRef(pub *const Completion);
// SAFETY: Completion is Sync (Mutex + WaitCell); the caller keeps it alive until every part
// referring to it has called `done` (it blocks in `wait`).
unsafe impl Send for DoneRef {}

impl DoneRef {
    pub fn done(self, r: Result<()>, t: &Times) {
        // SAFETY: see the Send impl: the completion outlives every pending part.
        unsafe { &*self.0 }.done(r, t)
    }
}

/// One piece of a request cut into `chunks` nearly equal runs of sectors, which the caller and
/// its helpers claim one at a time until none is left: whoever is faster (or started earlier)
/// takes more, so a request waits for at most one small chunk of a late helper, not half of it.
/// Lives on the caller's stack; `helpers` counts the helper jobs not yet finished.
pub(crate) struct Split {
    task: Task,
    chunks: u32,
    shift: u32,
    next: AtomicU32,
    pub helpers: Completion,
}

impl Split {
    pub fn new(task: Task, chunks: u32, shift: u32, helpers: u32) -> Self {
        let chunks = (chunks as u64).clamp(1, task.sectors.len().max(1)) as u32;
        Split {
            task,
            chunks,
            shift,
            next: AtomicU32::new(0),
            helpers: Completion::new(helpers),
        }
    }

    /// The next unclaimed chunk, if any.
    pub fn claim(&self) -> Option<Task> {
        let i = self.next.fetch_add(1, Relaxed);
        if i >= self.chunks {
            return None;
        }
        let sub = self
            .task
            .sectors
            .chunk(u64::from(i), u64::from(self.chunks));
        Some(self.task.sub(sub, self.shift))
    }

    /// Claims and runs chunks until none is left; returns the first error (later chunks still
    /// run, so that every chunk is finished when the request returns).
    pub fn run_chunks(
        &self,
        core: &impl Executor,
        mut own: Option<&mut SectorCipher>,
        t: &mut Times,
    ) -> Result<()> {
        let mut r = Ok(());
        while let Some(task) = self.claim() {
            let rc = core.exec_task(own.as_deref_mut(), &task, t);
            if r.is_ok() {
                r = rc;
            }
        }
        r
    }
}

/// A pointer to a caller's stack `Split`, sendable to a worker.
#[derive(Clone, Copy)]
pub(crate) struct SplitRef(pub *const Split);
// SAFETY: Split is Sync (atomics, a Completion, and a Task that is Send and only read); the
// caller keeps it alive until every helper has called `done` on `helpers` (it blocks in `wait`).
unsafe impl Send for SplitRef {}

pub(crate) enum Job {
    /// Help with a split request: claim and run its chunks, then complete one helper part.
    Help { split: SplitRef, queued_at: u64 },
    /// Run a task (crypto, and backend I/O if the task says so), then complete.
    Chunk {
        task: Task,
        done: DoneRef,
        queued_at: u64,
    },
    /// `queued` model write: encrypt, then hand the ciphertext to the writer thread.
    QueuedWrite {
        task: Task,
        done: DoneRef,
        queued_at: u64,
    },
    /// Calibration: measures the hand-off round trip.
    Ping { done: DoneRef },
}

/// A write for the `queued` model's writer.
pub(crate) struct WriteJob {
    pub task: Task,
    pub done: DoneRef,
    pub times: Times,
}

pub(crate) fn worker_loop(core: &impl Executor) {
    // A worker borrows a cipher context per job from the volume's table (its thread starts at
    // a slot of its own, so the borrow is uncontended), rather than owning one: a suspended
    // volume must be able to wipe every context, and an idle worker would keep its own.
    // Spinning for the next job stops for a while when it stops paying (jobs come further
    // apart than the spin lasts): on a busy host a spin that does not pay takes a CPU from
    // the thread that would produce the job.
    let mut governor = SpinGovernor::default();
    while let Some(job) = core.jobs().pop_or_retire(
        core.spin(),
        core.max_spinners(),
        &mut governor,
        core.idle_exit(),
    ) {
        run_job(core, job);
    }
}

/// Runs one job to its completion (on a worker, or on a caller that could not start one).
pub(crate) fn run_job(core: &impl Executor, job: Job) {
    // Timed only if the request is sampled (see stats): it then sent a non-zero time.
    let times_for = |queued_at: u64| Times {
        on: queued_at != 0,
        queue: if queued_at != 0 {
            now().wrapping_sub(queued_at)
        } else {
            0
        },
        ..Times::default()
    };
    match job {
        Job::Help { split, queued_at } => {
            // SAFETY: see SplitRef: the split outlives its helpers.
            let split = unsafe { &*split.0 };
            let mut t = times_for(queued_at);
            let r = split.run_chunks(core, None, &mut t);
            split.helpers.done(r, &t);
        }
        Job::Chunk {
            task,
            done,
            queued_at,
        } => {
            let mut t = times_for(queued_at);
            let r = core.exec_task(None, &task, &mut t);
            done.done(r, &t);
        }
        Job::QueuedWrite {
            task,
            done,
            queued_at,
        } => {
            let mut t = times_for(queued_at);
            match core.exec_task(None, &task, &mut t) {
                Err(e) => done.done(Err(e), &t),
                Ok(()) => {
                    let w = WriteJob {
                        task,
                        done,
                        times: t,
                    };
                    if let Err(w) = core.push_write(w) {
                        w.done.done(
                            Err(Error::Bug("write queue closed with writes pending")),
                            &w.times,
                        );
                    }
                }
            }
        }
        Job::Ping { done } => done.done(Ok(()), &Times::default()),
    }
}

pub(crate) fn writer_loop(core: &impl Executor) {
    let mut batch: [Option<WriteJob>; WRITE_BATCH_MAX] = [const { None }; WRITE_BATCH_MAX];
    loop {
        let n = core
            .writes()
            .pop_batch_or_retire(&mut batch, core.idle_exit());
        if n == 0 {
            return;
        }
        batch[..n].sort_unstable_by_key(|w| w.as_ref().map_or(u64::MAX, |w| w.task.sectors.first));
        for slot in batch[..n].iter_mut() {
            if let Some(w) = slot.take() {
                run_write(core, w);
            }
        }
    }
}

/// Performs one queued write and completes it (on the writer, or on a thread that could not
/// start it).
pub(crate) fn run_write(core: &impl Executor, mut w: WriteJob) {
    let r = core.write_task_io(&w.task, &mut w.times);
    w.done.done(r, &w.times);
}
