//! A queue's requests in flight. The queue's thread parses every chain the driver made
//! available and hands it here; a small bounded set of workers serves them at once, each
//! through its own bounce buffer, and the requests go back to the used ring in the order they
//! were taken from the available ring, in batches that cost one notification each.
//!
//! Why in order: it is what lets a restarted backend finish every request the killed one had
//! taken. A VMM that loses its backend (qemu's `reconnect=` on the chardev) cannot read the
//! ring state back, so it sets the available index it hands the next backend to the used
//! index in guest memory (qemu's `virtio_queue_restore_last_avail_idx`). With completions
//! published in ring order, the used index counts exactly the requests returned, and the
//! chains from there on are exactly those taken and not returned: the next backend serves
//! them again (a request the device had finished is served twice, which a read or a write of
//! the same data survives). Out of order, the restarted backend would return some requests a
//! second time (a virtio driver then declares the device broken) and never return others.
//! The cost: a request that finishes early waits in the queue's order for those taken before
//! it; the device still serves them all at once.
//!
//! Why threads: the volume's API is synchronous (a request returns once its backend I/O has),
//! so a queue that holds one request at a time waits for the disk on every request while the
//! guest has many queued. (Small reads and writes of a volume on a file are the exception: the
//! queue's thread keeps them in flight itself through its ring, `ring.rs`, and returns them
//! here in their turn with [`Inflight::finish`].) Workers start on demand (when a request is
//! handed over and no idle worker is there to take it) and end after [`WORKER_IDLE`] without
//! work, so an idle queue, or one with a single request at a time (served on the queue's own
//! thread, see [`Inflight::take`]), holds no worker.
//!
//! Limits: at most [`INFLIGHT_PER_QUEUE_MAX`] requests per queue taken from the ring and not
//! yet returned to it; beyond, the queue's thread waits for room and the guest's ring fills
//! (back-pressure). So a queue has at most that many workers and bounce buffers (of up to
//! `CHUNK_BYTES` each), and the write tickets and completion lists below never grow past it.
//!
//! Ordering: a flush completes only after every write, discard and write-zeroes taken from the
//! ring before it has returned from the device. (A write completed on another queue returned
//! from the device before its completion was published, so the device's flush covers it.)
//!
//! Invariant, as in the NBD server's job queue: whenever a job is queued, a live worker will
//! take it. A worker ends only under the lock after seeing no job, and [`Inflight::dispatch`]
//! counts idle workers under the same lock after queueing.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ucrypt::sync::{lock, WaitCell};
use ucrypt::BlockDev;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::request::{self, Bounce, Class, Mode, Request};

/// Requests in flight per queue: taken from the ring and not yet returned to it. Covers a
/// guest's queue depth of 32 over two queues; memory is at most this many bounce buffers per
/// queue.
pub const INFLIGHT_PER_QUEUE_MAX: usize = 16;
/// A worker with no request for this long ends.
pub const WORKER_IDLE: Duration = Duration::from_secs(2);

/// The guest memory map one request was parsed against.
pub type Memory = GuestMemoryMmap<()>;
/// The connection's guest memory, replaced when the VMM sends a new map.
pub type Mem = GuestMemoryAtomic<Memory>;

/// A parsed request with what serving and returning it takes.
pub struct Job {
    req: Request,
    /// The memory map the request was parsed against (kept alive while it is served).
    mem: Arc<Memory>,
    vring: VringRwLock<Mem>,
    mode: Mode,
    /// Its place in the order requests were taken from the ring.
    seq: u64,
    /// A write's ticket, tracked until it returns from the device.
    write: Option<u64>,
    /// A flush's: it waits until no write with a smaller ticket is in flight.
    flush_after: Option<u64>,
}

impl Job {
    /// The parsed request.
    pub fn req(&self) -> &Request {
        &self.req
    }

    /// The memory map it was parsed against.
    pub fn mem(&self) -> &Memory {
        &self.mem
    }
}

/// One queue's requests in flight and its workers.
pub struct Inflight {
    dev: Arc<dyn BlockDev>,
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    state: Mutex<State>,
    /// A job was queued, or the set closed.
    work: WaitCell,
    /// A write returned, requests went back to the ring, or a worker ended: for flushes, the
    /// queue's thread waiting for room, drains and the close.
    progress: WaitCell,
}

struct State {
    /// Handed over and not yet taken by a worker (at most `INFLIGHT_PER_QUEUE_MAX`).
    jobs: VecDeque<Job>,
    /// Taken from the ring and not yet returned to it: queued, being served, or done and not
    /// yet published.
    taken: usize,
    /// Workers alive, and those waiting for a job.
    workers: usize,
    idle: usize,
    /// Tickets of writes taken and not yet returned from the device.
    writes: Vec<u64>,
    next_ticket: u64,
    /// One place per request taken and not yet handed to the used ring, in the order taken
    /// (the front's sequence number is `first_seq`, the next request's `next_seq`): its head
    /// and used length once done. Only a done prefix is published.
    order: VecDeque<Option<(u16, u32)>>,
    first_seq: u64,
    next_seq: u64,
    /// Whether a thread is publishing now, and the list it publishes from (kept to reuse its
    /// allocation).
    publishing: bool,
    batch: Vec<(u16, u32)>,
    /// Parsed requests' storage, reused (at most one per request in flight, plus one).
    spare: Vec<Request>,
    closed: bool,
}

impl Inflight {
    pub fn new(dev: Arc<dyn BlockDev>, id: [u8; VIRTIO_BLK_ID_BYTES as usize]) -> Arc<Self> {
        Arc::new(Inflight {
            dev,
            id,
            state: Mutex::new(State {
                jobs: VecDeque::with_capacity(INFLIGHT_PER_QUEUE_MAX),
                taken: 0,
                workers: 0,
                idle: 0,
                writes: Vec::with_capacity(INFLIGHT_PER_QUEUE_MAX),
                next_ticket: 0,
                order: VecDeque::with_capacity(INFLIGHT_PER_QUEUE_MAX),
                first_seq: 0,
                next_seq: 0,
                publishing: false,
                batch: Vec::with_capacity(INFLIGHT_PER_QUEUE_MAX),
                spare: Vec::new(),
                closed: false,
            }),
            work: WaitCell::new(),
            progress: WaitCell::new(),
        })
    }

    /// Storage for the next request to parse.
    pub fn request(&self) -> Request {
        lock(&self.state).spare.pop().unwrap_or_default()
    }

    /// Takes a parsed request in, waiting for room: the job, and whether nothing else of this
    /// queue is in flight (then the caller may serve it on its own thread).
    pub fn take(
        &self,
        req: Request,
        mem: Arc<Memory>,
        vring: &VringRwLock<Mem>,
        mode: Mode,
    ) -> (Job, bool) {
        let (mut st, seq) = self.admit();
        let alone = st.taken == 1;
        let (mut write, mut flush_after) = (None, None);
        match req.class() {
            Class::Write => {
                let ticket = st.next_ticket;
                write = Some(ticket);
                st.writes.push(ticket);
                st.next_ticket += 1;
            }
            Class::Flush => flush_after = Some(st.next_ticket),
            Class::Other => {}
        }
        let job = Job {
            req,
            mem,
            vring: vring.clone(),
            mode,
            seq,
            write,
            flush_after,
        };
        (job, alone)
    }

    /// Waits for room, then gives the next request its place in the order: the state, still
    /// locked, and that place's sequence number.
    fn admit(&self) -> (MutexGuard<'_, State>, u64) {
        let mut st = lock(&self.state);
        while st.taken >= INFLIGHT_PER_QUEUE_MAX {
            st = self.progress.wait(st);
        }
        st.taken += 1;
        let seq = st.next_seq;
        st.next_seq += 1;
        st.order.push_back(None);
        (st, seq)
    }

    /// Hands `job` to a worker, starting one if none is idle; gives it back when no worker can
    /// take it (the set is closed, or no thread could be started): the caller [`run`]s it.
    ///
    /// [`run`]: Inflight::run
    #[must_use]
    pub fn dispatch(self: &Arc<Self>, job: Job) -> Option<Job> {
        let start = {
            let mut st = lock(&self.state);
            if st.closed {
                return Some(job);
            }
            st.jobs.push_back(job);
            let start = st.jobs.len() > st.idle && st.workers < INFLIGHT_PER_QUEUE_MAX;
            if start {
                st.workers += 1;
            }
            start
        };
        self.work.notify_one();
        if start {
            let me = self.clone();
            let started = std::thread::Builder::new()
                .name("ucrypt-vhost-io".into())
                .spawn(move || me.work_loop());
            if started.is_err() {
                let mut st = lock(&self.state);
                st.workers -= 1;
                // No worker at all: nobody else would take the job just queued (the only one,
                // as every earlier one had a worker).
                if st.workers == 0 {
                    return st.jobs.pop_back();
                }
            }
        }
        None
    }

    /// Serves `job` on this thread through `bounce` and returns it to the ring.
    pub fn run(&self, job: Job, bounce: &mut Bounce) {
        if let Some(ticket) = job.flush_after {
            let mut st = lock(&self.state);
            while st.writes.iter().any(|&w| w < ticket) {
                st = self.progress.wait(st);
            }
        }
        let done = request::serve(&*self.dev, &self.id, job.mode, bounce, &*job.mem, &job.req);
        self.complete(&job.vring, job.req, done.used_len, job.seq, job.write);
    }

    /// Whether [`take`](Inflight::take) would take a request without waiting for room.
    pub fn has_room(&self) -> bool {
        lock(&self.state).taken < INFLIGHT_PER_QUEUE_MAX
    }

    /// Returns `job`, served elsewhere (through the queue's ring) with `done`, to the used
    /// ring in its turn.
    pub fn finish(&self, job: Job, done: request::Done) {
        self.complete(&job.vring, job.req, done.used_len, job.seq, job.write);
    }

    /// Returns a request that ended at parsing (malformed) to the ring, in its turn; waits for
    /// room like [`take`](Inflight::take), so a ring full of malformed chains cannot grow the
    /// order past the limit.
    pub fn refuse(&self, vring: &VringRwLock<Mem>, req: Request, used_len: u32) {
        let (st, seq) = self.admit();
        drop(st);
        self.complete(vring, req, used_len, seq, None);
    }

    /// Records `req` (taken as `seq`) as done; the first thread to find nobody publishing
    /// publishes the done prefix of the order (its own completion and those that arrive
    /// meanwhile, as far as no earlier request is still being served), one notification per
    /// batch when the driver asked for one.
    fn complete(
        &self,
        vring: &VringRwLock<Mem>,
        req: Request,
        used_len: u32,
        seq: u64,
        write: Option<u64>,
    ) {
        let mut st = lock(&self.state);
        if let Some(w) = write {
            if let Some(i) = st.writes.iter().position(|&x| x == w) {
                st.writes.swap_remove(i);
            }
        }
        let place = usize::try_from(seq - st.first_seq).expect("a place in the order");
        assert!(st.order[place].is_none(), "request {seq} completed twice");
        st.order[place] = Some((req.head(), used_len));
        if st.spare.len() <= INFLIGHT_PER_QUEUE_MAX {
            st.spare.push(req);
        }
        if st.publishing {
            drop(st);
            self.progress.notify_all();
            return;
        }
        st.publishing = true;
        let mut batch = std::mem::take(&mut st.batch);
        loop {
            while let Some(Some(done)) = st.order.front().copied() {
                st.order.pop_front();
                st.first_seq += 1;
                batch.push(done);
            }
            if batch.is_empty() {
                break;
            }
            drop(st);
            for &(head, len) in &batch {
                // A head outside the queue (a hostile avail ring) has nothing to return to.
                let _ = vring.add_used(head, len);
            }
            if vring.needs_notification().unwrap_or(true) {
                // A VMM that closed the call eventfd hears nothing; the request is done anyway.
                let _ = vring.signal_used_queue();
            }
            st = lock(&self.state);
            st.taken -= batch.len();
            batch.clear();
        }
        st.publishing = false;
        st.batch = batch;
        drop(st);
        self.progress.notify_all();
    }

    /// Waits until every request taken is back in the ring.
    pub fn drain(&self) {
        let mut st = lock(&self.state);
        while st.taken > 0 {
            st = self.progress.wait(st);
        }
    }

    /// Drains, then ends the workers (they finish what is queued first) and waits for them.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.work.notify_all();
        let mut st = lock(&self.state);
        while st.taken > 0 || st.workers > 0 {
            st = self.progress.wait(st);
        }
    }

    /// Workers alive now.
    pub fn workers(&self) -> usize {
        lock(&self.state).workers
    }

    fn work_loop(self: Arc<Self>) {
        let mut bounce = Bounce::default();
        while let Some(job) = self.next_job() {
            self.run(job, &mut bounce);
        }
    }

    /// The next job, or `None` when this worker ends (closed, or idle for [`WORKER_IDLE`]).
    fn next_job(&self) -> Option<Job> {
        let mut st = lock(&self.state);
        let idle_since = Instant::now();
        loop {
            if let Some(job) = st.jobs.pop_front() {
                return Some(job);
            }
            if st.closed || idle_since.elapsed() >= WORKER_IDLE {
                break;
            }
            st.idle += 1;
            st = self.work.wait_timeout(st, WORKER_IDLE);
            st.idle -= 1;
        }
        st.workers -= 1;
        drop(st);
        self.progress.notify_all();
        None
    }
}
