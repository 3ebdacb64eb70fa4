//! A bounded multi-producer multi-consumer queue: a fixed ring under a mutex. Producers wait
//! when it is full (back-pressure), consumers when it is empty. Storage is allocated once.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex, MutexGuard};

pub struct BoundedQueue<T> {
    state: Mutex<Ring<T>>,
    /// Idle consumers minus queued items, mirrored outside the lock so that the `auto` policy
    /// can look without contending with the queue's users.
    spare: AtomicI64,
    not_empty: Condvar,
    not_full: Condvar,
}

struct Ring<T> {
    slots: Vec<Option<T>>,
    head: usize,
    len: usize,
    closed: bool,
    /// Consumers blocked in `pop` right now (idle workers, for the `auto` policy).
    idle: u32,
}

impl<T> BoundedQueue<T> {
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        BoundedQueue {
            state: Mutex::new(Ring {
                slots: (0..capacity).map(|_| None).collect(),
                head: 0,
                len: 0,
                closed: false,
                idle: 0,
            }),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            spare: AtomicI64::new(0),
        }
    }

    fn mirror(&self, r: &Ring<T>) {
        self.spare.store(r.idle as i64 - r.len as i64, Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, Ring<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds an item, waiting while the queue is full. Gives the item back if the queue is closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut r = self.lock();
        while r.len == r.slots.len() && !r.closed {
            r = self.not_full.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        if r.closed {
            return Err(item);
        }
        let cap = r.slots.len();
        let tail = (r.head + r.len) % cap;
        r.slots[tail] = Some(item);
        r.len += 1;
        self.mirror(&r);
        let wake = r.idle > 0;
        drop(r);
        if wake {
            self.not_empty.notify_one();
        }
        Ok(())
    }

    /// Takes the oldest item, waiting while empty; None once closed and drained.
    pub fn pop(&self) -> Option<T> {
        let mut r = self.lock();
        loop {
            while r.len > 0 {
                let head = r.head;
                let item = r.slots[head].take();
                r.head = (head + 1) % r.slots.len();
                r.len -= 1;
                // An empty slot is a tombstone left by `steal`: skip it.
                if item.is_some() {
                    self.mirror(&r);
                    drop(r);
                    self.not_full.notify_one();
                    return item;
                }
            }
            self.mirror(&r);
            if r.closed {
                return None;
            }
            r.idle += 1;
            self.mirror(&r);
            r = self.not_empty.wait(r).unwrap_or_else(|e| e.into_inner());
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
                return r.slots[at].take();
            }
        }
        None
    }

    /// Takes up to `out.len()` items without waiting if at least one is there; waits for the
    /// first otherwise. Returns how many were taken (0 only once closed and drained).
    pub fn pop_batch(&self, out: &mut [Option<T>]) -> usize {
        let mut r = self.lock();
        loop {
            let mut n = 0;
            while r.len > 0 && n < out.len() {
                let head = r.head;
                let item = r.slots[head].take();
                r.head = (head + 1) % r.slots.len();
                r.len -= 1;
                if item.is_some() {
                    out[n] = item;
                    n += 1;
                }
            }
            self.mirror(&r);
            if n > 0 {
                drop(r);
                self.not_full.notify_all();
                return n;
            }
            if r.closed {
                return 0;
            }
            r.idle += 1;
            self.mirror(&r);
            r = self.not_empty.wait(r).unwrap_or_else(|e| e.into_inner());
            r.idle -= 1;
            self.mirror(&r);
        }
    }

    /// Consumers waiting for work right now, less the work already waiting for them (a
    /// lock-free, possibly slightly stale reading).
    pub fn idle(&self) -> u32 {
        self.spare.load(Relaxed).max(0) as u32
    }

    /// Refuses further pushes; consumers drain what is left, then get None.
    pub fn close(&self) {
        self.lock().closed = true;
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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
