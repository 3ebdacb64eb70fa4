//! A bounded multi-producer multi-consumer queue: a fixed ring under a mutex. Producers wait
//! when it is full (back-pressure), consumers when it is empty. Storage is allocated once.
//!
//! A consumer may spin for a bounded time before it sleeps ([`BoundedQueue::pop_or_retire`]): on a
//! virtual machine an idle vCPU halts, and waking it takes tens of microseconds, longer than the
//! chunk of work a caller hands off. A spinning consumer picks the next item up at once.
//!
//! Consumers on demand ([`BoundedQueue::with_consumers`]): the queue counts its consumers and
//! tells a producer when to start them ([`BoundedQueue::push_staffed`]: when an item waits for
//! more consumers than are idle, all that are missing, so that a busy period starts its
//! consumers once, not one at a time as the load happens to call for them); a consumer leaves
//! when nothing has been pushed for an idle period ([`BoundedQueue::pop_or_retire`]), so the
//! consumers of a busy queue stay however the items fall among them, and those of an idle one
//! all leave. Both decisions are made under the queue's mutex, so an item is never left behind
//! by a consumer that leaves as it is pushed.

use std::sync::atomic::{
    AtomicBool, AtomicI64, AtomicU32, AtomicUsize, Ordering::Acquire, Ordering::Relaxed,
    Ordering::Release,
};
use std::sync::{Mutex, MutexGuard};

use crate::sync::{lock, SpinGovernor, WaitCell};
use std::time::{Duration, Instant};

/// Spin iterations between two looks at the clock.
const SPIN_CHECK_EVERY: u32 = 64;

/// Busy-waits until `done()` or `deadline`; true if `done()`.
pub fn spin_until(deadline: Instant, done: impl Fn() -> bool) -> bool {
    loop {
        for _ in 0..SPIN_CHECK_EVERY {
            if done() {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= deadline {
            return false;
        }
    }
}

pub struct BoundedQueue<T> {
    state: Mutex<Ring<T>>,
    /// Idle consumers minus queued items, mirrored outside the lock so that the `auto` policy
    /// can look without contending with the queue's users.
    spare: AtomicI64,
    /// Queued items (tombstones included) and whether the queue is closed, mirrored for
    /// spinning consumers.
    len_hint: AtomicUsize,
    closed_hint: AtomicBool,
    /// Consumers that may still be started on demand, mirrored like `spare`.
    startable_hint: AtomicU32,
    /// Consumers asleep for work: a push wakes one only if there are any.
    not_empty: WaitCell,
    /// Producers waiting for room.
    not_full: WaitCell,
}

struct Ring<T> {
    slots: Vec<Option<T>>,
    head: usize,
    len: usize,
    closed: bool,
    /// Consumers spinning or blocked in `pop` right now (idle workers, for the `auto` policy).
    idle: u32,
    /// Consumers spinning in `pop_spin` right now.
    spinning: u32,
    /// Consumers running (on-demand queues only): started at a producer's request, gone once
    /// retired or after the close.
    consumers: u32,
    /// The most consumers `push_staffed` asks for (0: the owner starts them itself).
    consumers_max: u32,
    /// Items pushed so far (on-demand queues): a consumer stays while this moves.
    pushes: u64,
}

impl<T> Ring<T> {
    /// Takes the oldest slot (`len > 0`): an item, or a tombstone left by `steal`.
    fn take_head(&mut self) -> Option<T> {
        debug_assert!(self.len > 0);
        let head = self.head;
        let item = self.slots[head].take();
        self.head = (head + 1) % self.slots.len();
        self.len -= 1;
        item
    }
}

impl<T> BoundedQueue<T> {
    #[cfg(test)]
    pub fn new(capacity: usize) -> Self {
        Self::with_consumers(capacity, 0)
    }

    /// A queue whose consumers, at most `consumers_max`, start on demand (see the module
    /// documentation).
    pub fn with_consumers(capacity: usize, consumers_max: u32) -> Self {
        let capacity = capacity.max(1);
        BoundedQueue {
            state: Mutex::new(Ring {
                slots: (0..capacity).map(|_| None).collect(),
                head: 0,
                len: 0,
                closed: false,
                idle: 0,
                spinning: 0,
                consumers: 0,
                consumers_max,
                pushes: 0,
            }),
            not_empty: WaitCell::new(),
            not_full: WaitCell::new(),
            spare: AtomicI64::new(0),
            len_hint: AtomicUsize::new(0),
            closed_hint: AtomicBool::new(false),
            startable_hint: AtomicU32::new(consumers_max),
        }
    }

    fn mirror(&self, r: &Ring<T>) {
        self.spare.store(r.idle as i64 - r.len as i64, Relaxed);
        self.len_hint.store(r.len, Release);
        self.startable_hint
            .store(r.consumers_max.saturating_sub(r.consumers), Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, Ring<T>> {
        lock(&self.state)
    }

    /// Adds an item, waiting while the queue is full. Gives the item back if the queue is closed.
    #[cfg(test)]
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut r = self.lock();
        while r.len == r.slots.len() && !r.closed {
            r = self.not_full.wait(r);
        }
        if r.closed {
            return Err(item);
        }
        let cap = r.slots.len();
        let tail = (r.head + r.len) % cap;
        r.slots[tail] = Some(item);
        r.len += 1;
        self.mirror(&r);
        drop(r);
        self.not_empty.notify_one();
        Ok(())
    }

    /// Like `push`, for a queue with consumers on demand: Ok(n) if the caller must start `n`
    /// consumers (already counted as running; for each that cannot start, the caller says so
    /// with [`Self::consumer_not_started`]).
    pub fn push_staffed(&self, item: T) -> Result<u32, T> {
        let mut r = self.lock();
        while r.len == r.slots.len() && !r.closed {
            r = self.not_full.wait(r);
        }
        if r.closed {
            return Err(item);
        }
        let cap = r.slots.len();
        let tail = (r.head + r.len) % cap;
        r.slots[tail] = Some(item);
        r.len += 1;
        r.pushes += 1;
        // Idle consumers each take one item; for an item beyond them, every missing consumer
        // is started.
        let start = if r.consumers < r.consumers_max && r.len > r.idle as usize {
            let n = r.consumers_max - r.consumers;
            r.consumers = r.consumers_max;
            n
        } else {
            0
        };
        self.mirror(&r);
        drop(r);
        self.not_empty.notify_one();
        Ok(start)
    }

    /// `n` consumers that `push_staffed` asked for did not start. True if then no consumer
    /// runs while items wait: the caller must take them itself (with `steal`).
    pub fn consumers_not_started(&self, n: u32) -> bool {
        let mut r = self.lock();
        r.consumers = r.consumers.saturating_sub(n);
        self.mirror(&r);
        r.consumers == 0 && r.len > 0
    }

    /// Consumers running now (on-demand queues).
    pub fn consumers(&self) -> u32 {
        self.lock().consumers
    }

    /// Consumers that could be started on demand now (a lock-free, possibly stale reading).
    pub fn startable(&self) -> u32 {
        self.startable_hint.load(Relaxed)
    }

    /// Takes the oldest item, waiting while empty; None once closed and drained.
    #[cfg(test)]
    pub fn pop(&self) -> Option<T> {
        self.pop_spin(Duration::ZERO, 0, &mut SpinGovernor::default())
    }

    /// Like `pop`, but while the queue is empty, spins for up to `spin` (counting as idle)
    /// before it sleeps, if fewer than `max_spinners` consumers are spinning already (spinners
    /// take CPUs from the threads that produce the work) and `governor` says spinning has
    /// been paying for this consumer (it is told whether each spin did).
    #[cfg(test)]
    pub fn pop_spin(
        &self,
        spin: Duration,
        max_spinners: u32,
        governor: &mut SpinGovernor,
    ) -> Option<T> {
        self.pop_or_retire(spin, max_spinners, governor, None)
    }

    /// Like `pop_spin`; with `retire_after`, a consumer of an on-demand queue leaves when it
    /// finds the queue empty and nothing has been pushed for that long: None, and it no
    /// longer counts as running.
    pub fn pop_or_retire(
        &self,
        spin: Duration,
        max_spinners: u32,
        governor: &mut SpinGovernor,
        retire_after: Option<Duration>,
    ) -> Option<T> {
        let mut deadline = (!spin.is_zero()).then(|| Instant::now() + spin);
        let mut idle_since: Option<(Instant, u64)> = None;
        let mut asked = false;
        let mut r = self.lock();
        loop {
            let mut freed = false;
            while r.len > 0 {
                let item = r.take_head();
                freed = true;
                // An empty slot is a tombstone left by `steal`: skip it.
                if item.is_some() {
                    self.mirror(&r);
                    drop(r);
                    self.not_full.notify_one();
                    return item;
                }
            }
            self.mirror(&r);
            if freed {
                // Skipped tombstones freed room: producers may be waiting for it.
                self.not_full.notify_all();
            }
            if r.closed {
                r.consumers = r.consumers.saturating_sub(1);
                self.mirror(&r);
                return None;
            }
            r.idle += 1;
            self.mirror(&r);
            if deadline.is_some() && !asked {
                // One question per wait: a paused governor counts waits, not spins.
                asked = true;
                if !governor.may_spin() {
                    deadline = None;
                }
            }
            if r.spinning < max_spinners && deadline.is_some_and(|d| Instant::now() < d) {
                r.spinning += 1;
                drop(r);
                if let Some(d) = deadline {
                    let paid = spin_until(d, || {
                        self.len_hint.load(Acquire) > 0 || self.closed_hint.load(Relaxed)
                    });
                    governor.record(paid);
                }
                r = self.lock();
                r.spinning -= 1;
            } else if let Some(after) = retire_after {
                match Self::idle_left(&mut idle_since, r.pushes, after) {
                    None => {
                        // Empty (checked above, under this lock), and nothing pushed for the
                        // whole idle period.
                        r.idle -= 1;
                        r.consumers = r.consumers.saturating_sub(1);
                        self.mirror(&r);
                        return None;
                    }
                    Some(left) => r = self.not_empty.wait_timeout(r, left),
                }
            } else {
                r = self.not_empty.wait(r);
            }
            r.idle -= 1;
            self.mirror(&r);
        }
    }

    /// Takes back the oldest queued item matching `pred` (a caller reclaiming work that no
    /// consumer has started), leaving a tombstone that consumers skip. Never waits.
    pub fn steal(&self, pred: impl Fn(&T) -> bool) -> Option<T> {
        let mut r = self.lock();
        let cap = r.slots.len();
        for i in 0..r.len {
            let at = (r.head + i) % cap;
            if r.slots[at].as_ref().is_some_and(&pred) {
                let item = r.slots[at].take();
                if i + 1 == r.len {
                    // The newest item (the usual case: a caller taking back what it just
                    // queued): shrink instead of leaving a tombstone.
                    r.len -= 1;
                    self.mirror(&r);
                    drop(r);
                    self.not_full.notify_one();
                }
                return item;
            }
        }
        None
    }

    /// Takes up to `out.len()` items without waiting if at least one is there; waits for the
    /// first otherwise. Returns how many were taken (0 only once closed and drained).
    /// With `retire_after`, a consumer of an on-demand queue that has found it empty for that
    /// long leaves (0), as in `pop_or_retire`.
    pub fn pop_batch_or_retire(
        &self,
        out: &mut [Option<T>],
        retire_after: Option<Duration>,
    ) -> usize {
        let mut idle_since: Option<(Instant, u64)> = None;
        let mut r = self.lock();
        loop {
            let mut n = 0;
            let mut freed = false;
            while r.len > 0 && n < out.len() {
                let item = r.take_head();
                freed = true;
                if item.is_some() {
                    out[n] = item;
                    n += 1;
                }
            }
            self.mirror(&r);
            if freed {
                // Room was freed (items or tombstones): wake waiting producers.
                self.not_full.notify_all();
            }
            if n > 0 {
                return n;
            }
            if r.closed {
                r.consumers = r.consumers.saturating_sub(1);
                self.mirror(&r);
                return 0;
            }
            if let Some(after) = retire_after {
                let Some(left) = Self::idle_left(&mut idle_since, r.pushes, after) else {
                    r.consumers = r.consumers.saturating_sub(1);
                    self.mirror(&r);
                    return 0;
                };
                r.idle += 1;
                self.mirror(&r);
                r = self.not_empty.wait_timeout(r, left);
                r.idle -= 1;
                self.mirror(&r);
                continue;
            }
            r.idle += 1;
            self.mirror(&r);
            r = self.not_empty.wait(r);
            r.idle -= 1;
            self.mirror(&r);
        }
    }

    /// Consumers waiting for work right now, less the work already waiting for them (a
    /// lock-free, possibly slightly stale reading).
    pub fn idle(&self) -> u32 {
        self.spare.load(Relaxed).max(0) as u32
    }

    /// How much longer a consumer waits before it leaves (None: leave now): `after` from the
    /// last push it saw (`since`, started at its first look; a push since restarts it).
    fn idle_left(
        since: &mut Option<(Instant, u64)>,
        pushes: u64,
        after: Duration,
    ) -> Option<Duration> {
        let now = Instant::now();
        let (t0, seen) = since.get_or_insert((now, pushes));
        if *seen != pushes {
            (*t0, *seen) = (now, pushes);
        }
        let left = after.saturating_sub(now.duration_since(*t0));
        (!left.is_zero()).then_some(left)
    }

    /// Refuses further pushes; consumers drain what is left, then get None.
    pub fn close(&self) {
        self.lock().closed = true;
        self.closed_hint.store(true, Relaxed);
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A consumer whose spins never see the next item arrive in time stops spinning: its
    /// governor pauses after a window of spins (a pop that finds its item already there, as
    /// on a loaded host, spins not and counts not: allow a few windows of pops).
    #[test]
    fn a_consumer_stops_spinning_when_items_come_later_than_its_spins() {
        const ITEMS: u32 = 4 * crate::sync::SPIN_WINDOW;
        let q = Arc::new(BoundedQueue::new(4));
        let p = {
            let q = q.clone();
            std::thread::spawn(move || {
                for i in 0..ITEMS {
                    std::thread::sleep(Duration::from_millis(2));
                    q.push(i).unwrap();
                }
                q.close();
            })
        };
        let mut g = SpinGovernor::default();
        let mut got = 0;
        let mut paused_after = None;
        while q.pop_spin(Duration::from_micros(20), 1, &mut g).is_some() {
            got += 1;
            if g.paused() && paused_after.is_none() {
                paused_after = Some(got);
            }
        }
        p.join().unwrap();
        assert_eq!(got, ITEMS);
        let n = paused_after.expect("spinning never paused");
        assert!(n < ITEMS, "paused after {n} waits");
    }

    #[test]
    fn bounded_fifo_with_back_pressure() {
        let q = Arc::new(BoundedQueue::new(2));
        let c = {
            let q = q.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                while let Some(x) = q.pop() {
                    got.push(x);
                }
                got
            })
        };
        for i in 0..100 {
            q.push(i).unwrap();
        }
        q.close();
        assert_eq!(q.push(7), Err(7));
        assert_eq!(c.join().unwrap(), (0..100).collect::<Vec<_>>());
    }

    /// Regression: a full queue of tombstones drained by a consumer must wake the producer
    /// waiting for room (it once did not, and the engine benchmark hung).
    #[test]
    fn draining_tombstones_wakes_producers() {
        let q = Arc::new(BoundedQueue::new(2));
        q.push(1).unwrap();
        q.push(2).unwrap();
        assert_eq!(q.steal(|_| true), Some(1));
        assert_eq!(q.steal(|_| true), Some(2));
        let (tx, rx) = std::sync::mpsc::channel();
        let p = {
            let q = q.clone();
            std::thread::spawn(move || {
                q.push(3).unwrap();
                q.push(4).unwrap();
                q.push(5).unwrap();
            })
        };
        let c = {
            let q = q.clone();
            std::thread::spawn(move || {
                let got: Vec<_> = (0..3).map(|_| q.pop().unwrap()).collect();
                let _ = tx.send(got);
            })
        };
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("producer and consumer deadlocked");
        assert_eq!(got, vec![3, 4, 5]);
        p.join().unwrap();
        c.join().unwrap();
    }

    #[test]
    fn steal_leaves_a_tombstone_consumers_skip() {
        let q = BoundedQueue::new(4);
        for i in 0..4 {
            q.push(i).unwrap();
        }
        assert_eq!(q.steal(|&x| x == 2), Some(2));
        assert_eq!(q.steal(|&x| x == 2), None);
        assert_eq!(q.pop(), Some(0));
        assert_eq!(q.pop(), Some(1));
        assert_eq!(q.pop(), Some(3));
        q.close();
        assert_eq!(q.pop(), None);
    }
}
