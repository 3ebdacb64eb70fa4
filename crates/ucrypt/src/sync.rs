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

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("requests", &self.requests())
            .finish()
    }
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

/// Work that only one thread at a time does, handed to whichever thread is doing it: a thread
/// that brings an item while another works leaves it and goes on; the working thread does
/// every item left to it before it lets go (flat combining, without waiting).
///
/// Made for writes to a backend whose writes queue on one lock anyway
/// ([`crate::backend::Backend::serializes_writes`]: a buffered regular file, whose every
/// write takes the inode's lock): threads that split the crypto of a large piece of work
/// would otherwise each wait in the kernel for that lock, and when the holder is preempted
/// (a busy host) every other thread stops until it runs again. Taking turns here, they keep
/// on with their crypto instead.
///
/// The items left are held in a list sized when the turns are made (`capacity`: at most one
/// item per chunk of the work, so it never grows). Items are taken last in, first out: the
/// newest is the one most likely still in a cache.
pub struct TakeTurns<T> {
    /// Whether a thread is doing the work.
    busy: AtomicBool,
    left: Mutex<Vec<T>>,
}

impl<T> TakeTurns<T> {
    pub fn new(capacity: usize) -> Self {
        TakeTurns {
            busy: AtomicBool::new(false),
            left: Mutex::new(Vec::with_capacity(capacity)),
        }
    }

    /// Does `work(item)` now, or leaves `item` to the thread doing the work; a thread that
    /// starts working does every item left until none is. Returns the first error of the work
    /// this call did (the items it had not done yet stay left: see [`TakeTurns::left`]).
    pub fn take<E>(
        &self,
        item: T,
        work: &dyn Fn(T) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        /// Lets go of the turn when dropped, also when the work panics.
        struct Turn<'a>(&'a AtomicBool);
        impl Drop for Turn<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        lock(&self.left).push(item);
        loop {
            // SeqCst on both sides: an item pushed by a thread whose exchange fails is seen by
            // the working thread's check after it let go (below), or that thread's exchange
            // succeeds after the let-go. Either way someone does it.
            if self
                .busy
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                return Ok(());
            }
            let turn = Turn(&self.busy);
            let r = loop {
                let next = lock(&self.left).pop();
                match next {
                    Some(item) => {
                        if let Err(e) = work(item) {
                            break Err(e);
                        }
                    }
                    None => break Ok(()),
                }
            };
            drop(turn);
            r?;
            if lock(&self.left).is_empty() {
                return Ok(());
            }
        }
    }

    /// Items left and not done: 0 once every call of [`TakeTurns::take`] has returned `Ok`.
    pub fn left(&self) -> usize {
        lock(&self.left).len()
    }
}

/// Tells a sleeper that the next event came, with no polling: [`Tripwire::arm`] it, and the
/// first [`Tripwire::pass`] after that calls the function [`Tripwire::on_trip`] gave, once. A
/// pass while disarmed costs one relaxed load. A daemon's main loop arms its volume's wire
/// when it has nothing more to do until the volume is used again.
#[derive(Default)]
pub struct Tripwire {
    armed: AtomicBool,
    on_trip: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Tripwire {
    /// Sets what a trip calls (once: `false`, and `f` dropped, if one was set already). It runs
    /// on the thread that passes, so it must be quick and must not block (a write to a
    /// non-blocking socket or an eventfd).
    pub fn on_trip(&self, f: Box<dyn Fn() + Send + Sync>) -> bool {
        self.on_trip.set(f).is_ok()
    }

    /// The next [`Tripwire::pass`] trips the wire.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Marks an event: trips the wire if it is armed.
    #[inline(always)]
    pub fn pass(&self) {
        if self.armed.load(Ordering::Relaxed) {
            self.trip();
        }
    }

    #[cold]
    fn trip(&self) {
        // One of the passes that saw it armed trips it.
        if self.armed.swap(false, Ordering::SeqCst) {
            if let Some(f) = self.on_trip.get() {
                f();
            }
        }
    }
}

#[cfg(test)]
mod tripwire_tests {
    use super::*;

    #[test]
    fn an_armed_wire_trips_once_on_the_next_pass() {
        let w = Tripwire::default();
        let trips = Arc::new(AtomicU32::new(0));
        let t = trips.clone();
        assert!(w.on_trip(Box::new(move || {
            t.fetch_add(1, Ordering::SeqCst);
        })));
        assert!(!w.on_trip(Box::new(|| {})), "a second function was taken");
        w.pass();
        assert_eq!(trips.load(Ordering::SeqCst), 0, "tripped while disarmed");
        w.arm();
        // Passes from several threads at once trip it once.
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| w.pass());
            }
        });
        w.pass();
        assert_eq!(trips.load(Ordering::SeqCst), 1, "one trip per arming");
        w.arm();
        w.arm();
        w.pass();
        w.pass();
        assert_eq!(trips.load(Ordering::SeqCst), 2);
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

/// Spins judged together by [`SpinGovernor`].
pub const SPIN_WINDOW: u32 = 16;
/// A window in which fewer than this many spins in 100 saw the awaited thing arrive pauses
/// spinning: it comes further apart than a spin lasts.
pub const SPIN_PAY_MIN_PERCENT: u32 = 50;
/// Waits without spinning after the first window that did not pay; each further such window
/// doubles it, up to [`SPIN_PAUSE_MAX`], and a window that pays resets it. So a waiter whose
/// spins never pay spins for one window of 16 waits in every 4,112 at worst.
pub const SPIN_PAUSE_MIN: u32 = 64;
pub const SPIN_PAUSE_MAX: u32 = 4096;

/// Whether spinning (busy-waiting) for the next piece of work pays for one waiter: it counts
/// the spins that saw the work arrive before the spin ran out, and stops spinning for a while
/// (then tries again) when too few did. A wait that finds the work already there says nothing
/// and is not counted: a sleeping wait would have returned as fast. Used by the NBD server's
/// request reads and by the engine's idle workers: on a busy host, a spin that does not pay
/// takes a CPU from the thread that would produce the work.
#[derive(Debug, Default)]
pub struct SpinGovernor {
    tries: u32,
    paid: u32,
    /// Waits left before spinning resumes.
    paused: u32,
    /// The pause the next window that does not pay starts (0 until one did not).
    next_pause: u32,
}

impl SpinGovernor {
    /// Whether the next wait may spin (counts a paused wait).
    pub fn may_spin(&mut self) -> bool {
        if self.paused > 0 {
            self.paused -= 1;
            return false;
        }
        true
    }

    /// Whether spinning is paused now.
    pub fn paused(&self) -> bool {
        self.paused > 0
    }

    /// Records a spin: `paid` if the work arrived before the spin gave up.
    pub fn record(&mut self, paid: bool) {
        self.tries += 1;
        self.paid += u32::from(paid);
        if self.tries < SPIN_WINDOW {
            return;
        }
        if self.paid * 100 < self.tries * SPIN_PAY_MIN_PERCENT {
            self.next_pause = (self.next_pause * 2).clamp(SPIN_PAUSE_MIN, SPIN_PAUSE_MAX);
            self.paused = self.next_pause;
        } else {
            self.next_pause = 0;
        }
        self.tries = 0;
        self.paid = 0;
    }
}

#[cfg(test)]
mod spin_tests {
    use super::*;

    /// Waits that spin out of `waits`, with every spin ending as `paid` says.
    fn spins(g: &mut SpinGovernor, waits: u32, paid: impl Fn(u32) -> bool) -> u32 {
        let mut n = 0;
        for i in 0..waits {
            if g.may_spin() {
                g.record(paid(i));
                n += 1;
            }
        }
        n
    }

    #[test]
    fn spinning_backs_off_when_it_does_not_pay_and_resumes_when_it_does() {
        let mut g = SpinGovernor::default();
        // Always paying: every wait spins.
        assert_eq!(spins(&mut g, 1000, |_| true), 1000);
        // Never paying: one window, then pauses of 64, 128, ... 4096 waits between windows.
        let n = spins(&mut g, 100_000, |_| false);
        assert!(n < 100_000 / 50, "{n} spins of 100000 waits that never pay");
        // Paying again: spinning comes back within one pause and stays.
        let first = spins(&mut g, SPIN_PAUSE_MAX + 1000, |_| true);
        assert!(first >= 1000, "{first}");
        assert_eq!(spins(&mut g, 1000, |_| true), 1000);
        // Half paying is enough to keep spinning.
        assert_eq!(spins(&mut g, 1000, |i| i % 2 == 0), 1000);
    }
}

#[cfg(test)]
mod take_turns_tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;

    /// From several threads at once: every item done once, never two at a time.
    #[test]
    fn every_item_is_done_once_by_one_thread_at_a_time() {
        const THREADS: usize = 4;
        const EACH: usize = 500;
        let turns = TakeTurns::new(THREADS);
        let done: Vec<AtomicUsize> = (0..THREADS * EACH).map(|_| AtomicUsize::new(0)).collect();
        let inside = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        let work = |i: usize| -> std::result::Result<(), ()> {
            let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(n, Ordering::SeqCst);
            done[i].fetch_add(1, Ordering::SeqCst);
            std::hint::spin_loop();
            inside.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        };
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (turns, work) = (&turns, &work);
                s.spawn(move || {
                    for k in 0..EACH {
                        turns.take(t * EACH + k, work).unwrap();
                    }
                });
            }
        });
        assert_eq!(turns.left(), 0);
        assert!(done.iter().all(|d| d.load(Ordering::SeqCst) == 1));
        assert_eq!(most.load(Ordering::SeqCst), 1, "two threads worked at once");
    }

    /// A thread that brings an item while another works returns at once; the working thread
    /// does that item before it lets go.
    #[test]
    fn an_item_brought_during_a_turn_is_left_to_the_working_thread() {
        let turns = TakeTurns::new(2);
        let (entered_tx, entered) = mpsc::channel::<()>();
        let (go, go_rx) = mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        let by: Mutex<Vec<(u32, std::thread::ThreadId)>> = Mutex::new(Vec::new());
        let work = |i: u32| -> std::result::Result<(), ()> {
            if i == 1 {
                entered_tx.send(()).unwrap();
                lock(&go_rx).recv().unwrap();
            }
            lock(&by).push((i, std::thread::current().id()));
            Ok(())
        };
        std::thread::scope(|s| {
            let first = s.spawn(|| {
                turns.take(1, &work).unwrap();
                std::thread::current().id()
            });
            entered.recv().unwrap();
            // The first thread is inside its turn: this returns without doing item 2.
            turns.take(2, &work).unwrap();
            assert!(lock(&by).is_empty(), "item 2 was done outside the turn");
            assert_eq!(turns.left(), 1);
            go.send(()).unwrap();
            let first = first.join().unwrap();
            let by = lock(&by);
            assert_eq!(*by, vec![(1, first), (2, first)]);
        });
        assert_eq!(turns.left(), 0);
    }

    /// A failing item ends the turn with its error, and the items not done stay left; a
    /// panic lets go of the turn, so the next thread works.
    #[test]
    fn an_error_or_a_panic_ends_the_turn() {
        let turns = TakeTurns::new(4);
        let (entered_tx, entered) = mpsc::channel::<()>();
        let (go, go_rx) = mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        let fail = |i: u32| match i {
            1 => {
                entered_tx.send(()).unwrap();
                lock(&go_rx).recv().unwrap();
                Ok(())
            }
            7 => Err(i),
            _ => Ok(()),
        };
        std::thread::scope(|s| {
            let first = s.spawn(|| turns.take(1, &fail));
            entered.recv().unwrap();
            // Left in this order, taken last in first out: 7 fails before 8 is done.
            turns.take(8, &fail).unwrap();
            turns.take(7, &fail).unwrap();
            go.send(()).unwrap();
            assert_eq!(first.join().unwrap(), Err(7));
        });
        assert_eq!(turns.left(), 1, "item 8 is left");
        let boom = |_: u32| -> std::result::Result<(), u32> { panic!("work panics on purpose") };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| turns.take(1, &boom)));
        assert!(r.is_err());
        let done = AtomicUsize::new(0);
        let count = |_: u32| -> std::result::Result<(), u32> {
            done.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        turns.take(2, &count).unwrap();
        // Item 2, and item 8 left from before.
        assert_eq!(
            done.load(Ordering::SeqCst),
            2,
            "the turn was let go after the panic"
        );
        assert_eq!(turns.left(), 0);
    }
}
