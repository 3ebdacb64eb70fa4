//! [`Crew`]: a small bounded executor for split work that is not a plain volume's sector task.
//! An authenticated volume (`integrity::device`) cuts a large request into chunks that its
//! caller and the crew's workers claim one at a time, as a plain volume's [`super::workers`]
//! do with `Split`; the work itself (fetch data and tags, verify, decrypt; or seal and write)
//! stays with the volume, behind the [`Chunks`] trait, so this module never names it.
//!
//! The rules are the engine's: threads (one per core, at most [`CREW_WORKERS_MAX`]) start on
//! demand, when a hand-off waits for more workers than are idle, and end after
//! [`super::workers::THREAD_IDLE_EXIT`] without work (an idle volume has none); they are
//! joined when the crew is dropped; every hand-off
//! goes through one bounded queue ([`CREW_QUEUE_MAX`]); a caller waits for every part it handed
//! off before it returns, so the work may point into its stack and buffers; a caller takes
//! back the parts no worker has started, so a request never waits for a worker to be scheduled
//! when it could finish the chunks itself; idle workers spin for work for a bounded time, with
//! the engine's spin governor, then sleep.
//!
//! Lanes: the caller runs its chunks as lane 0, each worker as a lane of its own among
//! `1..=workers` (taken as it starts, given back as it ends), so the work can keep one context
//! per worker (an authenticated volume keeps one keyed tag cipher per lane) without any lookup
//! on the data path.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::AcqRel, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::queue::BoundedQueue;
use super::stats::{now, Times};
use super::workers::{Completion, DoneRef, THREAD_IDLE_EXIT};
use crate::sync::{lock, SpinGovernor};
use crate::{Error, Result};

/// Workers at most, whatever the machine has: a crew serves one volume's large requests, and
/// beyond a few lanes their chunks are too small to pay for the hand-off.
pub const CREW_WORKERS_MAX: usize = 8;
/// Hand-offs waiting for a worker: a few per concurrent caller (each hands off at most one per
/// helper it asks for, at most `CREW_WORKERS_MAX`). A full queue makes callers wait (back
/// pressure), it never grows.
pub const CREW_QUEUE_MAX: usize = 64;

/// Work split into chunks that several threads claim one at a time. Lives on the caller's
/// stack for the duration of [`Crew::run`].
pub(crate) trait Chunks: Sync {
    /// Claims and runs chunks until none is left, on `lane` (0: the caller; `1..=workers`:
    /// the crew's workers). Errors are the work's to record: every chunk must have finished
    /// when this returns.
    fn run_chunks(&self, lane: usize);
}

/// A type-erased pointer to a caller's [`Chunks`] and the completion its helpers report to.
#[derive(Clone, Copy)]
struct WorkRef {
    work: *const (),
    run: unsafe fn(*const (), usize),
    done: DoneRef,
}

// SAFETY: `work` points at a `Chunks` (which is Sync) that the caller keeps alive, blocked in
// `Crew::run`, until every helper holding this reference has called `done` (see `Completion`).
unsafe impl Send for WorkRef {}

/// Runs `W::run_chunks` on a type-erased pointer.
///
/// # Safety
/// `work` must point at a live `W` (see [`WorkRef`]).
unsafe fn run_erased<W: Chunks>(work: *const (), lane: usize) {
    // SAFETY: the caller's contract: `work` was made from a `&W` that outlives this call.
    let w = unsafe { &*work.cast::<W>() };
    w.run_chunks(lane)
}

enum CrewJob {
    /// Help with a split request: claim and run its chunks, then complete one helper part.
    Help(WorkRef),
    /// Calibration: measures the hand-off round trip.
    Ping(DoneRef),
}

struct Shared {
    jobs: BoundedQueue<CrewJob>,
    /// How long idle workers and waiting callers spin (nanoseconds).
    spin_ns: AtomicU64,
    /// Workers that may spin for work at once: one CPU is left to the callers.
    max_spinners: u32,
    /// One bit per worker lane (bit `i` for lane `i`, `1..=workers`); set = free.
    lanes_free: AtomicU64,
    /// How long a worker waits for work before it ends.
    idle_exit: Duration,
}

const _: () = assert!(CREW_WORKERS_MAX < 64, "lanes are bits of a u64");

impl Shared {
    /// Takes a free lane. The queue starts no more workers than there are lanes, but a worker
    /// that has just left the queue may not have given its lane back yet: wait for it.
    fn take_lane(&self) -> usize {
        loop {
            let free = self.lanes_free.load(Relaxed);
            if free == 0 {
                std::thread::yield_now();
                continue;
            }
            let lane = free.trailing_zeros();
            let bit = 1u64 << lane;
            if self.lanes_free.fetch_and(!bit, AcqRel) & bit != 0 {
                return lane as usize;
            }
        }
    }

    fn give_lane(&self, lane: usize) {
        self.lanes_free.fetch_or(1 << lane, AcqRel);
    }
}

/// See the module documentation.
pub(crate) struct Crew {
    shared: Arc<Shared>,
    workers: usize,
    name: String,
    /// Workers started and not yet found finished (joined at the drop; shared with the
    /// workers, which start one another).
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Crew {
    /// A crew of up to `workers` threads (at least 1, at most [`CREW_WORKERS_MAX`]) named
    /// `{name}`, started as work comes (see the module documentation).
    pub fn new(name: &str, workers: usize, spin: Duration) -> Result<Self> {
        Self::with_idle_exit(name, workers, spin, THREAD_IDLE_EXIT)
    }

    /// Like [`Self::new`]; its workers end after `idle_exit` without work.
    pub fn with_idle_exit(
        name: &str,
        workers: usize,
        spin: Duration,
        idle_exit: Duration,
    ) -> Result<Self> {
        let workers = workers.clamp(1, CREW_WORKERS_MAX);
        let shared = Arc::new(Shared {
            jobs: BoundedQueue::with_consumers(CREW_QUEUE_MAX, workers as u32),
            spin_ns: AtomicU64::new(spin.as_nanos() as u64),
            max_spinners: workers.saturating_sub(1).max(1) as u32,
            // Lanes 1..=workers.
            lanes_free: AtomicU64::new(((1u64 << workers) - 1) << 1),
            idle_exit,
        });
        Ok(Crew {
            shared,
            workers,
            name: name.to_string(),
            threads: Arc::new(Mutex::new(Vec::with_capacity(workers))),
        })
    }

    /// Queues a job, starting the workers if it waits for more than the idle ones; with no
    /// worker able to start and none running, runs what waits on this thread (lane 0).
    fn push(&self, job: CrewJob) -> std::result::Result<(), CrewJob> {
        let n = self.shared.jobs.push_staffed(job)?;
        if n > 0
            && start_workers(&self.shared, &self.threads, &self.name, n).is_err()
            && self.shared.jobs.consumers_not_started(n)
        {
            while let Some(job) = self.shared.jobs.steal(|_| true) {
                run_job(job, 0);
            }
        }
        Ok(())
    }

    /// Worker threads (lanes `1..=workers`).
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Workers waiting for work now or able to start, less the work already waiting for them
    /// (a lock-free, possibly slightly stale reading, for the `auto` policy).
    pub fn idle(&self) -> u32 {
        self.shared.jobs.idle() + self.shared.jobs.startable()
    }

    pub fn spin(&self) -> Duration {
        Duration::from_nanos(self.shared.spin_ns.load(Relaxed))
    }

    /// Runs `work` on `helpers` workers and, if `caller_helps`, on the caller (lane 0), and
    /// returns when every one of them has finished. With `caller_helps`, help no worker has
    /// started by the time the caller ran out of chunks is taken back. Errors are the work's
    /// own; the result only says whether the crew could run it.
    pub fn run<W: Chunks>(&self, work: &W, helpers: usize, caller_helps: bool) -> Result<()> {
        let helpers = helpers.min(self.workers());
        assert!(
            helpers > 0 || caller_helps,
            "split work must have someone to run it"
        );
        // Dropped (waiting for every helper) before `work`, also when unwinding.
        let done = Completion::new(helpers as u32);
        let me = WorkRef {
            work: (work as *const W).cast(),
            run: run_erased::<W>,
            done: DoneRef(&done),
        };
        for _ in 0..helpers {
            if self.push(CrewJob::Help(me)).is_err() {
                done.done(
                    Err(Error::Bug("crew queue closed while its volume is in use")),
                    &Times::default(),
                );
            }
        }
        if caller_helps {
            work.run_chunks(0);
            while let Some(CrewJob::Help(_)) = self
                .shared
                .jobs
                .steal(|j| matches!(j, CrewJob::Help(w) if std::ptr::eq(w.done.0, me.done.0)))
            {
                done.done(Ok(()), &Times::default());
            }
        }
        done.wait(self.spin()).0
    }

    /// The best round trip of `rounds` hand-offs to a worker, in clock ticks
    /// (`engine::stats::now`), for calibrating where splitting pays.
    pub fn ping_ticks(&self, rounds: usize) -> Result<u64> {
        let mut best = u64::MAX;
        for _ in 0..rounds.max(1) {
            let comp = Completion::new(1);
            let t0 = now();
            if self.push(CrewJob::Ping(DoneRef(&comp))).is_err() {
                return Err(Error::Bug("crew queue closed during calibration"));
            }
            comp.wait(self.spin()).0?;
            best = best.min(now().wrapping_sub(t0));
        }
        Ok(best)
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        // Workers drain what is queued (nothing: every caller has returned), then end.
        self.shared.jobs.close();
        // Joined until none is left: a worker may start another as it ends (it then finds the
        // queue closed and ends too).
        loop {
            let ts = std::mem::take(&mut *lock(&self.threads));
            if ts.is_empty() {
                break;
            }
            for t in ts {
                let _ = t.join();
            }
        }
    }
}

/// Starts `n` workers: this thread starts one, which starts the next before it takes work (see
/// `Core::start_workers` in the volume: the request that starts a busy period pays for one).
fn start_workers(
    s: &Arc<Shared>,
    threads: &Arc<Mutex<Vec<JoinHandle<()>>>>,
    name: &str,
    n: u32,
) -> Result<()> {
    let (s2, t2, name2) = (s.clone(), threads.clone(), name.to_string());
    let h = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            // The rest that could not start no longer count; this one runs.
            if n > 1 && start_workers(&s2, &t2, &name2, n - 1).is_err() {
                s2.jobs.consumers_not_started(n - 1);
            }
            let lane = s2.take_lane();
            worker_loop(&s2, lane);
            s2.give_lane(lane);
        })
        .map_err(|e| Error::io("starting a crew thread", e))?;
    let mut ts = lock(threads);
    ts.retain(|t| !t.is_finished());
    ts.push(h);
    Ok(())
}

fn worker_loop(s: &Shared, lane: usize) {
    let mut governor = SpinGovernor::default();
    let spin = || Duration::from_nanos(s.spin_ns.load(Relaxed));
    while let Some(job) =
        s.jobs
            .pop_or_retire(spin(), s.max_spinners, &mut governor, Some(s.idle_exit))
    {
        run_job(job, lane);
    }
}

fn run_job(job: CrewJob, lane: usize) {
    match job {
        CrewJob::Help(w) => {
            // A panic in the work must still complete the part, or its caller would wait
            // forever (and its stack frame, which the work points into, never be freed).
            // SAFETY: see WorkRef: the work outlives this help.
            let r = catch_unwind(AssertUnwindSafe(|| unsafe { (w.run)(w.work, lane) }));
            let r = r.map_err(|_| Error::Bug("a chunk of split work panicked"));
            w.done.done(r, &Times::default());
        }
        CrewJob::Ping(done) => done.done(Ok(()), &Times::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, AtomicUsize};
    use std::sync::Mutex;

    /// Sums `0..n` in chunks of one, recording which lanes took part.
    struct Sum {
        next: AtomicU32,
        n: u32,
        total: AtomicU64,
        lanes: Mutex<Vec<usize>>,
    }

    impl Chunks for Sum {
        fn run_chunks(&self, lane: usize) {
            loop {
                let i = self.next.fetch_add(1, Relaxed);
                if i >= self.n {
                    return;
                }
                std::thread::sleep(Duration::from_micros(50));
                self.total.fetch_add(u64::from(i), Relaxed);
                self.lanes.lock().unwrap().push(lane);
            }
        }
    }

    #[test]
    fn every_chunk_runs_once_on_the_caller_and_its_helpers() {
        let crew = Crew::new("crew-test", 2, Duration::from_micros(50)).unwrap();
        for (helpers, caller) in [(0, true), (1, true), (2, true), (1, false), (2, false)] {
            let w = Sum {
                next: AtomicU32::new(0),
                n: 64,
                total: AtomicU64::new(0),
                lanes: Mutex::new(Vec::new()),
            };
            crew.run(&w, helpers, caller).unwrap();
            assert_eq!(w.total.load(Relaxed), 63 * 64 / 2, "{helpers} {caller}");
            let lanes = w.lanes.lock().unwrap();
            assert_eq!(lanes.len(), 64);
            assert!(lanes.iter().all(|&l| l <= 2));
            if !caller {
                assert!(lanes.iter().all(|&l| l > 0), "the caller ran no chunk");
            }
        }
        assert!(crew.ping_ticks(4).unwrap() > 0);
    }

    /// A chunk that panics on a worker completes its part with an error: the caller returns.
    #[test]
    fn a_panicking_helper_does_not_hang_its_caller() {
        struct Boom(AtomicUsize);
        impl Chunks for Boom {
            fn run_chunks(&self, lane: usize) {
                if lane > 0 {
                    self.0.fetch_add(1, Relaxed);
                    panic!("chunk panics on purpose");
                }
            }
        }
        let crew = Crew::new("crew-test", 1, Duration::ZERO).unwrap();
        let w = Boom(AtomicUsize::new(0));
        let r = crew.run(&w, 1, false);
        assert!(matches!(r, Err(Error::Bug(_))), "{r:?}");
        assert_eq!(w.0.load(Relaxed), 1);
        // The worker survived and serves the next request.
        let s = Sum {
            next: AtomicU32::new(0),
            n: 4,
            total: AtomicU64::new(0),
            lanes: Mutex::new(Vec::new()),
        };
        crew.run(&s, 1, false).unwrap();
        assert_eq!(s.total.load(Relaxed), 6);
    }
}
