//! The gate every request of a volume passes (`Volume::suspend`, `resume`, `resize`).
//!
//! Open, a request enters by counting itself in its thread's shard and reading one flag that
//! stays in every core's cache while nobody closes the gate: one uncontended locked add on the
//! way in, one on the way out, no shared cache line written. Closed, a new request waits at the
//! gate (it does not fail) and the closer waits for the requests inside to leave, so that once
//! [`Gate::close`] returns nothing runs in the volume: its key can be wiped, its size changed.
//!
//! Why it is sound: entering is "add to my shard, then read `closed`"; closing is "set
//! `closed`, then read every shard". Both are sequentially consistent, so of a request and a
//! closer racing, at least one sees the other: the request sees `closed` (and backs out), or
//! the closer sees the request's count (and waits for it to leave).
//!
//! A closed gate can also be failed ([`Gate::fail`], a suspended volume closed by force): the
//! requests waiting at it, and every later one, then fail with EIO instead of entering. It
//! never opens again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Release, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::Duration;

use super::stats::thread_index;
use crate::sync::{lock, WaitCell};
use crate::{Error, Result};

/// Shards of the count of requests inside (a power of two): threads beyond this share.
pub const GATE_SHARDS: usize = 64;

/// How often a closer looks whether the requests inside have left. Closing is rare (suspend,
/// resize) and waits for requests that take microseconds to seconds: polling keeps the
/// requests' way out to one atomic subtraction.
pub const GATE_DRAIN_POLL: Duration = Duration::from_micros(200);

/// One shard, on a cache line of its own.
#[repr(align(128))]
#[derive(Default)]
struct Shard(AtomicU64);

pub(crate) struct Gate {
    /// Read by every request; written only by `close` and `open`.
    closed: AtomicBool,
    shards: Box<[Shard]>,
    /// The state under a mutex, for requests that sleep until the gate opens (or fails).
    waiting: Mutex<Held>,
    cv: WaitCell,
}

/// What a request that found the gate closed waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Open,
    Closed,
    /// Failed for good: waiting requests leave with EIO.
    Failed,
}

/// A request inside the gate; leaving is dropping it.
pub(crate) struct Pass<'a>(&'a AtomicU64);

impl Drop for Pass<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.fetch_sub(1, Release);
    }
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            closed: AtomicBool::new(false),
            shards: (0..GATE_SHARDS).map(|_| Shard::default()).collect(),
            waiting: Mutex::new(Held::Open),
            cv: WaitCell::new(),
        }
    }
}

impl Gate {
    /// Enters, waiting while the gate is closed; EIO once it failed ([`Gate::fail`]).
    #[inline(always)]
    pub fn enter(&self) -> Result<Pass<'_>> {
        let s = &self.shards[thread_index() & (GATE_SHARDS - 1)].0;
        s.fetch_add(1, SeqCst);
        if self.closed.load(SeqCst) {
            self.wait_open(s)?;
        }
        Ok(Pass(s))
    }

    /// Enters if the gate is open; `None` (without waiting) if it is closed. For a caller that
    /// holds passes while it waits for something else (I/O it submitted): waiting at the gate
    /// then could wait for itself, as the closer waits for those passes.
    pub fn try_enter(&self) -> Option<Pass<'_>> {
        let s = &self.shards[thread_index() & (GATE_SHARDS - 1)].0;
        s.fetch_add(1, SeqCst);
        if self.closed.load(SeqCst) {
            s.fetch_sub(1, SeqCst);
            return None;
        }
        Some(Pass(s))
    }

    /// The slow way in: back out, sleep until the gate opens, try again.
    #[cold]
    #[inline(never)]
    fn wait_open(&self, s: &AtomicU64) -> Result<()> {
        loop {
            s.fetch_sub(1, SeqCst);
            let mut g = lock(&self.waiting);
            while *g == Held::Closed {
                g = self.cv.wait(g);
            }
            if *g == Held::Failed {
                return Err(Error::io(
                    "the volume was closed while suspended",
                    std::io::Error::from_raw_os_error(libc::EIO),
                ));
            }
            drop(g);
            s.fetch_add(1, SeqCst);
            if !self.closed.load(SeqCst) {
                return Ok(());
            }
        }
    }

    /// Closes the gate and returns once no request is inside. Must not be called by a request
    /// (it would wait for itself), nor by two closers at once (the volume serialises them).
    pub fn close(&self) {
        *lock(&self.waiting) = Held::Closed;
        self.closed.store(true, SeqCst);
        while self.inside() != 0 {
            std::thread::sleep(GATE_DRAIN_POLL);
        }
    }

    /// Opens the gate and wakes the requests waiting at it.
    pub fn open(&self) {
        let mut g = lock(&self.waiting);
        *g = Held::Open;
        self.closed.store(false, SeqCst);
        drop(g);
        self.cv.notify_all();
    }

    /// Fails a closed gate for good: the requests waiting at it and every later one get EIO.
    pub fn fail(&self) {
        let mut g = lock(&self.waiting);
        *g = Held::Failed;
        self.closed.store(true, SeqCst);
        drop(g);
        self.cv.notify_all();
    }

    #[cfg(test)]
    pub fn is_closed(&self) -> bool {
        self.closed.load(SeqCst)
    }

    /// Requests inside now (or backing out).
    fn inside(&self) -> u64 {
        self.shards
            .iter()
            .fold(0u64, |n, s| n.wrapping_add(s.0.load(SeqCst)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
    use std::sync::Arc;

    #[test]
    fn close_waits_for_requests_inside_and_holds_new_ones() {
        let gate = Arc::new(Gate::default());
        let done = Arc::new(AtomicU32::new(0));
        let p = gate.enter().unwrap();
        let (g2, d2) = (gate.clone(), done.clone());
        let closer = std::thread::spawn(move || {
            g2.close();
            d2.load(Relaxed)
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !closer.is_finished(),
            "close returned with a request inside"
        );
        drop(p);
        assert_eq!(closer.join().unwrap(), 0);
        assert!(gate.is_closed());
        let (g3, d3) = (gate.clone(), done.clone());
        let req = std::thread::spawn(move || {
            let _p = g3.enter().unwrap();
            d3.fetch_add(1, Relaxed);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(done.load(Relaxed), 0, "a request passed a closed gate");
        gate.open();
        req.join().unwrap();
        assert_eq!(done.load(Relaxed), 1);
        assert_eq!(gate.inside(), 0);
    }

    #[test]
    fn a_failed_gate_fails_the_waiting_requests_and_every_later_one() {
        let gate = Arc::new(Gate::default());
        gate.close();
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let g = gate.clone();
                std::thread::spawn(move || g.enter().map(|_| ()).map_err(|e| e.errno()))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            waiting.iter().all(|t| !t.is_finished()),
            "passed a closed gate"
        );
        gate.fail();
        for t in waiting {
            assert_eq!(t.join().unwrap(), Err(libc::EIO));
        }
        assert_eq!(gate.enter().err().map(|e| e.errno()), Some(libc::EIO));
        assert_eq!(gate.inside(), 0);
    }

    #[test]
    fn racing_requests_never_run_while_closed() {
        let gate = Arc::new(Gate::default());
        // Set by the closer while `close` has returned and the gate is not yet open again.
        let drained = Arc::new(AtomicBool::new(false));
        let bad = Arc::new(AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for _ in 0..4 {
            let (g, drained, bad, stop) =
                (gate.clone(), drained.clone(), bad.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Relaxed) {
                    let _p = g.enter().unwrap();
                    if drained.load(SeqCst) {
                        bad.fetch_add(1, Relaxed);
                    }
                }
            }));
        }
        for _ in 0..200 {
            gate.close();
            drained.store(true, SeqCst);
            std::thread::sleep(Duration::from_micros(100));
            drained.store(false, SeqCst);
            gate.open();
        }
        stop.store(true, Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            bad.load(Relaxed),
            0,
            "a request ran while the gate was closed"
        );
    }
}
