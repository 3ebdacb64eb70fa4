//! A connection's bounded job queue, with workers started on demand and ended when idle.
//!
//! Why on demand: a client with one request at a time is served on its reader's thread and
//! never needs a worker, and an idle connection should hold no threads beyond its reader. A
//! worker starts when a job is queued and no idle worker is there to take it (up to the
//! connection's limit), and ends after [`WORKER_IDLE`] without a job.
//!
//! Invariant: whenever a job is queued, a live worker will take it. A worker ends only under
//! the queue's lock after seeing it empty, and [`Queue::push`] counts idle workers under the
//! same lock after queueing, so the two cannot miss each other.
//!
//! Waking a sleeping worker may preempt the thread that queues (the reader, which then waits
//! for a core while the worker runs one job and sleeps again). So a reader that has more
//! requests at hand queues them with [`Queue::push_deferred`] and wakes the workers once, with
//! [`Queue::wake`], before it could block (on the socket, the budget, or a full queue; the
//! last is done here). Until then a queued job may wait for the reader to finish its burst,
//! never longer: the invariant above holds from the next [`Queue::wake`].

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use ucrypt::sync::lock;

/// A worker with no job for this long ends.
pub const WORKER_IDLE: Duration = Duration::from_secs(2);

pub struct Queue<T> {
    state: Mutex<State<T>>,
    /// A job was queued, or the queue closed.
    ready: Condvar,
    /// A job was taken (room for the reader).
    room: Condvar,
    /// Jobs queued at most; beyond, [`Queue::push`] waits.
    jobs_max: usize,
    /// Workers at most.
    workers_max: usize,
}

struct State<T> {
    jobs: VecDeque<T>,
    /// Workers alive (started and not ended).
    alive: usize,
    /// Workers waiting for a job.
    idle: usize,
    /// Pushers waiting for room.
    full_waiters: usize,
    /// Jobs queued by [`Queue::push_deferred`] while workers slept, not yet woken for.
    unwoken: usize,
    closed: bool,
}

/// What [`Queue::push`] asks of its caller.
#[must_use]
pub enum Pushed {
    /// A worker will take the job.
    Taken,
    /// Start a worker ([`Queue::worker_started`] counted it already; call
    /// [`Queue::start_failed`] if it cannot start).
    StartWorker,
}

impl<T> Queue<T> {
    pub fn new(jobs_max: usize, workers_max: usize) -> Queue<T> {
        Queue {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                alive: 0,
                idle: 0,
                full_waiters: 0,
                unwoken: 0,
                closed: false,
            }),
            ready: Condvar::new(),
            room: Condvar::new(),
            jobs_max: jobs_max.max(1),
            workers_max: workers_max.max(1),
        }
    }

    /// Queues `job`, waiting while the queue is full.
    #[cfg(test)]
    pub fn push(&self, job: T) -> Pushed {
        let pushed = self.push_deferred(job);
        self.wake();
        pushed
    }

    /// Like [`Queue::push`], but a sleeping worker is woken only by the next [`Queue::wake`]
    /// (or when the queue is full): the caller must call it before it blocks.
    pub fn push_deferred(&self, job: T) -> Pushed {
        let mut s = lock(&self.state);
        while s.jobs.len() >= self.jobs_max && s.alive > 0 {
            // Workers must run for room to come.
            if std::mem::take(&mut s.unwoken) > 0 {
                self.ready.notify_all();
            }
            s.full_waiters += 1;
            s = self
                .room
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            s.full_waiters -= 1;
        }
        s.jobs.push_back(job);
        let start = s.alive == 0 || (s.jobs.len() > s.idle && s.alive < self.workers_max);
        if start {
            s.alive += 1;
        }
        // A notify is a system call whether anyone waits or not: only when a worker waits
        // (it counted itself idle under this lock before it slept).
        if s.idle > s.unwoken {
            s.unwoken += 1;
        }
        drop(s);
        if start {
            Pushed::StartWorker
        } else {
            Pushed::Taken
        }
    }

    /// Wakes a sleeping worker for each job queued by [`Queue::push_deferred`] since the last
    /// call (as many as sleep).
    pub fn wake(&self) {
        let mut s = lock(&self.state);
        let n = std::mem::take(&mut s.unwoken).min(s.idle);
        drop(s);
        for _ in 0..n {
            self.ready.notify_one();
        }
    }

    /// A worker asked for by [`Pushed::StartWorker`] could not start. Returns the jobs no
    /// worker will take if it was the only one (the caller drops or runs them).
    pub fn start_failed(&self) -> Vec<T> {
        let mut s = lock(&self.state);
        s.alive -= 1;
        if s.alive == 0 {
            s.jobs.drain(..).collect()
        } else {
            Vec::new()
        }
    }

    /// A worker's next job; `None` when the worker should end (the queue is closed and
    /// empty, or it stayed idle for [`WORKER_IDLE`]): it is no longer counted then.
    pub fn next(&self) -> Option<T> {
        let mut s = lock(&self.state);
        loop {
            if let Some(j) = s.jobs.pop_front() {
                let wake = s.full_waiters > 0;
                drop(s);
                if wake {
                    self.room.notify_one();
                }
                return Some(j);
            }
            if s.closed {
                s.alive -= 1;
                return None;
            }
            s.idle += 1;
            let (g, timeout) = self
                .ready
                .wait_timeout(s, WORKER_IDLE)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            s = g;
            s.idle -= 1;
            if timeout.timed_out() && s.jobs.is_empty() {
                s.alive -= 1;
                return None;
            }
        }
    }

    /// No more jobs: workers finish those queued, then end.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.ready.notify_all();
    }

    /// Workers alive now.
    #[cfg(test)]
    pub fn workers(&self) -> usize {
        lock(&self.state).alive
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn run(q: Arc<Queue<u32>>, done: Arc<AtomicUsize>) {
        while let Some(j) = q.next() {
            std::thread::sleep(Duration::from_millis(u64::from(j)));
            done.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn workers_start_on_demand_up_to_the_limit_and_end_when_idle() {
        let q = Arc::new(Queue::new(8, 3));
        let done = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for _ in 0..20 {
            if let Pushed::StartWorker = q.push(5) {
                let (q, d) = (q.clone(), done.clone());
                threads.push(std::thread::spawn(move || run(q, d)));
            }
        }
        assert!(threads.len() <= 3, "{} workers", threads.len());
        // Idle workers end by themselves.
        std::thread::sleep(WORKER_IDLE + Duration::from_millis(500));
        assert_eq!(done.load(Ordering::SeqCst), 20);
        assert_eq!(q.workers(), 0);
        for t in threads.drain(..) {
            t.join().unwrap();
        }
        // After that, a new job starts a worker again; close lets it finish the job.
        assert!(matches!(q.push(1), Pushed::StartWorker));
        let (q2, d) = (q.clone(), done.clone());
        let t = std::thread::spawn(move || run(q2, d));
        q.close();
        t.join().unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 21);
        // A worker that cannot start hands its jobs back.
        let q = Queue::new(8, 3);
        assert!(matches!(q.push(7), Pushed::StartWorker));
        assert_eq!(q.start_failed(), vec![7]);
    }
}
