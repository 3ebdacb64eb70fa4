//! The few synchronisation pieces every part of ucrypt shares: a poison-tolerant lock, a
//! condition variable that wakes only when someone sleeps, the page size, and [`Stop`], the one
//! way a long-running front end (NBD, FUSE, ublk) is told to finish.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The memory page size ucrypt aligns buffers to (x86-64 and arm64 base pages); also the
/// granule of mlock and madvise.
pub const PAGE_BYTES: usize = 4096;

/// Locks `m`, taking the data even if another thread panicked while holding it. Every structure
/// ucrypt guards with a mutex is changed in single steps, so it stays consistent between
/// statements and a panic elsewhere must not take the whole volume down.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A condition variable that knows whether anyone sleeps on it, so that waking is free when
/// nobody does: a notify is a futex system call even with no waiter, and most releases of a
/// pool buffer, a range lock or a turn have none.
///
/// Use it with one mutex: a waiter calls [`WaitCell::wait`] holding the guard; a notifier
/// changes the guarded state under the same mutex, then notifies (holding the guard or not).
/// The waiter counts itself before the mutex is released, so a notifier that changed the state
/// under the mutex afterwards sees the count.
#[derive(Default)]
pub struct WaitCell {
    cv: Condvar,
    sleepers: AtomicU32,
}

impl WaitCell {
    pub const fn new() -> Self {
        WaitCell {
            cv: Condvar::new(),
            sleepers: AtomicU32::new(0),
        }
    }

    /// Sleeps until notified (or spuriously woken: callers loop on their condition).
    pub fn wait<'a, T>(&self, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        let g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        g
    }

    /// Like [`WaitCell::wait`], for at most `timeout`.
    pub fn wait_timeout<'a, T>(
        &self,
        g: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> MutexGuard<'a, T> {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        let (g, _) = self
            .cv
            .wait_timeout(g, timeout)
            .unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        g
    }

    /// True if a thread sleeps in [`WaitCell::wait`].
    pub fn has_sleepers(&self) -> bool {
        self.sleepers.load(Ordering::Relaxed) > 0
    }

    pub fn notify_one(&self) {
        if self.has_sleepers() {
            self.cv.notify_one();
        }
    }

    pub fn notify_all(&self) {
        if self.has_sleepers() {
            self.cv.notify_all();
        }
    }
}

/// A request to stop, shared between whoever decides (a signal, a control socket, a test) and
/// the front ends that serve until it comes. Cloning shares it. A front end polls
/// [`Stop::requested`], sleeps in [`Stop::wait_timeout`], or registers an action with
/// [`Stop::on_request`] (ublk kills its device so that its queues return).
///
/// Requests are counted, so a front end that failed to act on one (an unmount refused) can
/// act again on the next.
#[derive(Clone, Default)]
pub struct Stop(Arc<StopInner>);

#[derive(Default)]
struct StopInner {
    requests: AtomicU64,
    /// `requests > 0`, for the cheapest possible poll.
    flag: AtomicBool,
    state: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
    cv: WaitCell,
}

impl Stop {
    pub fn new() -> Self {
        Stop::default()
    }

    /// Asks every holder to stop; runs the actions registered with [`Stop::on_request`] once,
    /// on the first request.
    pub fn request(&self) {
        let actions = {
            let mut g = lock(&self.0.state);
            self.0.requests.fetch_add(1, Ordering::SeqCst);
            self.0.flag.store(true, Ordering::SeqCst);
            std::mem::take(&mut *g)
        };
        self.0.cv.notify_all();
        for a in actions {
            a();
        }
    }

    /// True once a stop was requested.
    pub fn requested(&self) -> bool {
        self.0.flag.load(Ordering::SeqCst)
    }

    /// How many stop requests there were so far.
    pub fn requests(&self) -> u64 {
        self.0.requests.load(Ordering::SeqCst)
    }

    /// Waits until more than `seen` requests were made or `timeout` passed; returns the count.
    pub fn wait_timeout(&self, seen: u64, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.0.state);
        loop {
            let n = self.requests();
            let now = Instant::now();
            if n > seen || now >= deadline {
                return n;
            }
            g = self.0.cv.wait_timeout(g, deadline - now);
        }
    }

    /// Runs `action` on the first stop request, or now if one was already made.
    pub fn on_request(&self, action: impl FnOnce() + Send + 'static) {
        let mut g = lock(&self.0.state);
        if self.requested() {
            drop(g);
            action();
        } else {
            g.push(Box::new(action));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn stop_wakes_a_waiter_and_runs_actions_once() {
        let stop = Stop::new();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        stop.on_request(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        let s = stop.clone();
        let waiter = std::thread::spawn(move || s.wait_timeout(0, Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!stop.requested());
        stop.request();
        stop.request();
        assert!(waiter.join().unwrap() >= 1);
        assert_eq!(stop.requests(), 2);
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        // Registered after the request: runs at once.
        let r = ran.clone();
        stop.on_request(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn stop_wait_times_out_without_a_request() {
        let stop = Stop::new();
        let t0 = Instant::now();
        assert_eq!(stop.wait_timeout(0, Duration::from_millis(30)), 0);
        assert!(t0.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn wait_cell_counts_sleepers() {
        let m = Arc::new(Mutex::new(false));
        let c = Arc::new(WaitCell::new());
        let (m2, c2) = (m.clone(), c.clone());
        let t = std::thread::spawn(move || {
            let mut g = lock(&m2);
            while !*g {
                g = c2.wait(g);
            }
        });
        while !c.has_sleepers() {
            std::thread::yield_now();
        }
        *lock(&m) = true;
        c.notify_all();
        t.join().unwrap();
        assert!(!c.has_sleepers());
    }
}
