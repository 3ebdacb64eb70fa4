//! Where time goes, collected cheaply: per request, the time spent waiting (range lock, pool,
//! ordering turn), queued for a worker, in crypto and in backend I/O, each in a log2 histogram
//! of atomic counters. Callers record into one of several cache-line padded shards picked by
//! thread, so concurrent callers do not fight over one counter. The clock is the CPU's
//! time-stamp counter on x86_64, which is read without a system call and far more cheaply than
//! `Instant::now`.
//!
//! Every request is counted, but only one in [`SAMPLE_EVERY`] per thread is timed: the clock
//! reads and atomic adds of a fully timed request are a sizeable share of a 4 KiB read from
//! RAM, the request whose overhead `bench engine` scenario 1 holds to its target (inline ÷
//! raw, BENCHMARKS.md). Sampling keeps the distributions and takes that cost out of the data
//! path; one in 32 still times thousands of requests a second of a fast 4 KiB stream. The gaps
//! between timed requests are random (mean 32): a fixed one-in-32 aliases with a stream that
//! cycles through a few request sizes, and times only some of them.
//!
//! The counters every request bumps (requests, bytes, splits) live in per-thread slots: a thread
//! holds one of [`COUNTER_SLOTS`] slots exclusively while it lives ([`owned_slot`]), so it adds
//! with a plain load and store instead of a locked read-modify-write, which is a large part of
//! what ucrypt adds to a 4 KiB read served inline. Threads beyond that share one slot with
//! atomic adds. `reset` never writes an owned slot: it remembers a baseline instead.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::ErrorKind;

/// Time one request in this many (per thread), on average.
pub const SAMPLE_EVERY: u32 = 32;
/// Stats shards; a power of two.
const SHARDS: usize = 8;
/// Threads that get counters of their own ([`owned_slot`]); later threads share one more.
pub const COUNTER_SLOTS: usize = 64;
/// log2 buckets of clock ticks: 2^40 ticks is several minutes, longer than any request.
const BUCKETS: usize = 41;

/// Where a request's time goes. The implicit discriminants, 0 to `PHASES - 1` in this order,
/// index the per-phase arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Range lock, buffer pool, ordering turn.
    Wait,
    /// From hand-off to a worker until it starts.
    Queue,
    Crypto,
    Backend,
    Total,
}
const PHASES: usize = 5;
const _: () = assert!(Phase::Total as usize == PHASES - 1);
const PHASE_NAMES: [&str; PHASES] = ["wait", "queue", "crypto", "backend", "total"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Read = 0,
    /// Writes, write-zeroes and discards.
    Write = 1,
}

/// Clock ticks (TSC on x86_64, else ns since start-up).
#[inline]
pub fn now() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC has no preconditions on x86_64.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        epoch().elapsed().as_nanos() as u64
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

/// Nanoseconds per clock tick, calibrated once against `Instant` (the first call waits a few
/// milliseconds for it).
pub fn ns_per_tick() -> f64 {
    static NS: OnceLock<f64> = OnceLock::new();
    *NS.get_or_init(|| {
        let (t0, c0) = (Instant::now(), now());
        while t0.elapsed() < Duration::from_millis(2) {
            std::hint::spin_loop();
        }
        let (dt, dc) = (
            t0.elapsed().as_nanos() as f64,
            now().wrapping_sub(c0) as f64,
        );
        if dc > 0.0 {
            dt / dc
        } else {
            1.0
        }
    })
}

/// A small per-thread number, for picking shards and cipher slots.
pub fn thread_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! { static IDX: Cell<usize> = const { Cell::new(usize::MAX) }; }
    IDX.with(|c| {
        let v = c.get();
        if v != usize::MAX {
            return v;
        }
        let v = NEXT.fetch_add(1, Relaxed);
        c.set(v);
        v
    })
}

/// Which of the [`COUNTER_SLOTS`] slots are held by a live thread (bit i = slot i).
static SLOTS_TAKEN: AtomicU64 = AtomicU64::new(0);

/// A thread's claim on a slot, given back when the thread exits.
struct SlotClaim(Option<usize>);

impl SlotClaim {
    fn claim() -> SlotClaim {
        let mut cur = SLOTS_TAKEN.load(Acquire);
        loop {
            let free = (!cur).trailing_zeros() as usize;
            if free >= COUNTER_SLOTS {
                return SlotClaim(None);
            }
            // Acquire: this thread's plain adds come after the previous holder's (released when
            // it gave the slot back).
            match SLOTS_TAKEN.compare_exchange_weak(
                cur,
                cur | 1 << free,
                std::sync::atomic::Ordering::AcqRel,
                Acquire,
            ) {
                Ok(_) => return SlotClaim(Some(free)),
                Err(now) => cur = now,
            }
        }
    }
}

impl Drop for SlotClaim {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            SLOTS_TAKEN.fetch_and(!(1 << i), std::sync::atomic::Ordering::Release);
        }
    }
}

/// The counter slot this thread holds exclusively, if it got one. No two live threads hold the
/// same slot, so the holder may update that slot's counters without a locked instruction.
pub fn owned_slot() -> Option<usize> {
    thread_local! { static CLAIM: SlotClaim = SlotClaim::claim(); }
    // During thread teardown the claim may be gone already: share the common slot then.
    CLAIM.try_with(|c| c.0).ok().flatten()
}

/// Counters every request updates, one set per slot.
#[repr(align(128))]
#[derive(Default)]
struct Counters {
    requests: [AtomicU64; 2],
    bytes: [AtomicU64; 2],
    split: AtomicU64,
    rmw: AtomicU64,
}

impl Counters {
    fn fields(&self) -> [&AtomicU64; 6] {
        [
            &self.requests[0],
            &self.requests[1],
            &self.bytes[0],
            &self.bytes[1],
            &self.split,
            &self.rmw,
        ]
    }
}

/// Adds to a counter only this thread writes: a plain load and store, no lock prefix.
#[inline]
fn bump_owned(c: &AtomicU64, n: u64) {
    c.store(c.load(Relaxed).wrapping_add(n), Relaxed);
}

struct Hist {
    buckets: [AtomicU64; BUCKETS],
    sum: AtomicU64,
}

impl Hist {
    fn record(&self, ticks: u64) {
        let b = (64 - ticks.leading_zeros() as usize).min(BUCKETS - 1);
        self.buckets[b].fetch_add(1, Relaxed);
        self.sum.fetch_add(ticks, Relaxed);
    }
}

#[repr(align(128))]
struct Shard {
    hist: [[Hist; PHASES]; 2],
}

/// The number of requests until the next timed one: uniform in 1..=2*SAMPLE_EVERY-1 (mean
/// SAMPLE_EVERY), from a per-thread xorshift generator seeded by the thread's address.
#[cold]
fn next_gap() -> u32 {
    thread_local! { static RNG: Cell<u32> = const { Cell::new(0) }; }
    RNG.with(|r| {
        let mut x = r.get();
        if x == 0 {
            // Any non-zero seed will do; the address of this thread's cell differs per thread.
            x = (r as *const Cell<u32> as usize as u32) | 1;
        }
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        r.set(x);
        1 + x % (2 * SAMPLE_EVERY - 1)
    })
}

/// Per-request phase times in clock ticks, filled in as the request runs (all zero for
/// requests not sampled).
#[derive(Debug, Default, Clone, Copy)]
pub struct Times {
    /// This request is timed.
    pub on: bool,
    /// When it started (clock ticks).
    pub start: u64,
    pub wait: u64,
    pub queue: u64,
    pub crypto: u64,
    pub backend: u64,
}

impl Times {
    /// Starts a request: decides whether to time it (one in SAMPLE_EVERY per thread, on
    /// average). The gap to the next timed request is drawn at random from
    /// 1..=2*SAMPLE_EVERY-1, so that a workload repeating a pattern (sizes cycling with a
    /// period that shares a factor with SAMPLE_EVERY) cannot hide parts of the pattern from the
    /// statistics; untimed requests pay one decrement.
    #[inline]
    pub fn start() -> Times {
        thread_local! { static LEFT: Cell<u32> = const { Cell::new(SAMPLE_EVERY) }; }
        let on = LEFT.with(|left| {
            let v = left.get() - 1;
            if v == 0 {
                left.set(next_gap());
                true
            } else {
                left.set(v);
                false
            }
        });
        Times {
            on,
            start: if on { now() } else { 0 },
            ..Times::default()
        }
    }

    /// The clock if this request is timed, else 0 (so that differences are 0).
    #[inline]
    pub fn clock(&self) -> u64 {
        if self.on {
            now()
        } else {
            0
        }
    }

    pub fn add(&mut self, o: &Times) {
        self.wait += o.wait;
        self.queue += o.queue;
        self.crypto += o.crypto;
        self.backend += o.backend;
    }
}

pub struct Stats {
    /// Sampled timings, shared by thread number (atomic adds).
    shards: Box<[Shard]>,
    /// [`COUNTER_SLOTS`] owned slots, then the shared one.
    counters: Box<[Counters]>,
    /// Counter values at the last `reset`, subtracted by `snapshot` (in `Counters::fields`
    /// order).
    baseline: Mutex<[u64; 6]>,
    /// Failed requests, by [`Kind`] and by [`ErrorKind`] (rare: plain atomic adds).
    errors: [[AtomicU64; ERROR_KINDS]; 2],
}

/// The kinds of error counted ([`ErrorKind::ALL`]).
const ERROR_KINDS: usize = ErrorKind::ALL.len();

impl Default for Stats {
    fn default() -> Self {
        let _ = ns_per_tick();
        Stats {
            // SAFETY-free zero init: all-atomic structs built field by field.
            shards: (0..SHARDS)
                .map(|_| Shard {
                    hist: std::array::from_fn(|_| {
                        std::array::from_fn(|_| Hist {
                            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
                            sum: AtomicU64::new(0),
                        })
                    }),
                })
                .collect(),
            counters: (0..=COUNTER_SLOTS).map(|_| Counters::default()).collect(),
            baseline: Mutex::new([0; 6]),
            errors: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
        }
    }
}

impl Stats {
    /// Records one finished request.
    pub fn record(&self, kind: Kind, bytes: u64, t: &Times, split: bool, rmw: bool) {
        let k = kind as usize;
        match owned_slot() {
            Some(i) => {
                let c = &self.counters[i];
                bump_owned(&c.requests[k], 1);
                bump_owned(&c.bytes[k], bytes);
                if split {
                    bump_owned(&c.split, 1);
                }
                if rmw {
                    bump_owned(&c.rmw, 1);
                }
            }
            None => {
                let c = &self.counters[COUNTER_SLOTS];
                c.requests[k].fetch_add(1, Relaxed);
                c.bytes[k].fetch_add(bytes, Relaxed);
                if split {
                    c.split.fetch_add(1, Relaxed);
                }
                if rmw {
                    c.rmw.fetch_add(1, Relaxed);
                }
            }
        }
        if !t.on {
            return;
        }
        let s = &self.shards[thread_index() & (SHARDS - 1)];
        let total = now().wrapping_sub(t.start);
        let h = &s.hist[k];
        h[Phase::Total as usize].record(total);
        h[Phase::Crypto as usize].record(t.crypto);
        h[Phase::Backend as usize].record(t.backend);
        if t.wait > 0 {
            h[Phase::Wait as usize].record(t.wait);
        }
        if t.queue > 0 {
            h[Phase::Queue as usize].record(t.queue);
        }
    }

    /// The counters summed over all slots, in `Counters::fields` order.
    fn counter_sums(&self) -> [u64; 6] {
        let mut sum = [0u64; 6];
        for c in self.counters.iter() {
            for (s, f) in sum.iter_mut().zip(c.fields()) {
                *s = s.wrapping_add(f.load(Relaxed));
            }
        }
        sum
    }

    /// Counts a failed request of kind `k`.
    #[cold]
    pub fn record_error(&self, k: Kind, e: ErrorKind) {
        self.errors[k as usize][e as usize].fetch_add(1, Relaxed);
    }

    /// Starts counting from zero (benchmarks measure one phase at a time). Requests running
    /// meanwhile may be half counted.
    pub fn reset(&self) {
        self.errors
            .iter()
            .flatten()
            .for_each(|e| e.store(0, Relaxed));
        for s in self.shards.iter() {
            for h in s.hist.iter().flatten() {
                h.buckets.iter().for_each(|b| b.store(0, Relaxed));
                h.sum.store(0, Relaxed);
            }
        }
        let now = self.counter_sums();
        *self.baseline.lock().unwrap_or_else(|e| e.into_inner()) = now;
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let ns = ns_per_tick();
        let base = *self.baseline.lock().unwrap_or_else(|e| e.into_inner());
        let sums = self.counter_sums();
        let c: [u64; 6] = std::array::from_fn(|i| sums[i].wrapping_sub(base[i]));
        let op = |k: usize| {
            let mut o = OpStats {
                requests: c[k],
                bytes: c[2 + k],
                errors: std::array::from_fn(|e| self.errors[k][e].load(Relaxed)),
                ..OpStats::default()
            };
            for (p, ps) in o.phases.iter_mut().enumerate() {
                let mut buckets = [0u64; BUCKETS];
                let mut sum = 0u64;
                for s in self.shards.iter() {
                    for (b, v) in buckets.iter_mut().enumerate() {
                        *v += s.hist[k][p].buckets[b].load(Relaxed);
                    }
                    sum += s.hist[k][p].sum.load(Relaxed);
                }
                let count: u64 = buckets.iter().sum();
                let pct = |q: f64| -> f64 {
                    let target = (count as f64 * q).ceil().max(1.0) as u64;
                    let mut acc = 0;
                    for (b, v) in buckets.iter().enumerate() {
                        acc += v;
                        if acc >= target {
                            // Upper edge of the bucket: a conservative estimate.
                            return (1u64 << b) as f64 * ns;
                        }
                    }
                    0.0
                };
                *ps = PhaseStats {
                    count,
                    sum_ns: sum as f64 * ns,
                    tick_ns: ns,
                    buckets,
                    mean_ns: if count > 0 {
                        sum as f64 * ns / count as f64
                    } else {
                        0.0
                    },
                    p50_ns: pct(0.5),
                    p99_ns: pct(0.99),
                };
            }
            o
        };
        StatsSnapshot {
            read: op(0),
            write: op(1),
            split: c[4],
            rmw: c[5],
        }
    }
}

/// Buckets of a phase's histogram: bucket `b` counts times below `2^b` clock ticks (and at
/// least `2^(b-1)`); the last one also holds everything longer.
pub const HIST_BUCKETS: usize = BUCKETS;

/// One phase's timings over the sampled requests (one in [`SAMPLE_EVERY`]).
#[derive(Debug, Clone, Copy)]
pub struct PhaseStats {
    /// Sampled requests that spent time in this phase.
    pub count: u64,
    pub mean_ns: f64,
    /// Percentiles are bucket upper edges (log2 histogram): within 2x, never under.
    pub p50_ns: f64,
    pub p99_ns: f64,
    /// Total time of the sampled requests in this phase.
    pub sum_ns: f64,
    /// Nanoseconds per clock tick (the buckets' unit).
    pub tick_ns: f64,
    /// The log2 histogram (see [`HIST_BUCKETS`]).
    pub buckets: [u64; HIST_BUCKETS],
}

impl Default for PhaseStats {
    fn default() -> Self {
        PhaseStats {
            count: 0,
            mean_ns: 0.0,
            p50_ns: 0.0,
            p99_ns: 0.0,
            sum_ns: 0.0,
            tick_ns: 0.0,
            buckets: [0; HIST_BUCKETS],
        }
    }
}

impl PhaseStats {
    /// The histogram as cumulative counts below upper edges in nanoseconds, as Prometheus
    /// histograms have it: `(le_ns, count of samples at most le_ns)`, one pair per bucket up to
    /// the last non-empty one (the count of everything is [`PhaseStats::count`]).
    pub fn cumulative_ns(&self) -> Vec<(f64, u64)> {
        let last = self
            .buckets
            .iter()
            .rposition(|&c| c > 0)
            .map_or(0, |i| i + 1);
        let mut acc = 0;
        (0..last)
            .map(|b| {
                acc += self.buckets[b];
                ((1u64 << b) as f64 * self.tick_ns, acc)
            })
            .collect()
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct OpStats {
    pub requests: u64,
    pub bytes: u64,
    /// Failed requests, indexed by [`ErrorKind`] (see [`OpStats::errors_of`]).
    pub errors: [u64; ERROR_KINDS],
    /// Indexed by [`Phase`].
    pub phases: [PhaseStats; PHASES],
}

impl OpStats {
    /// Failed requests of one kind.
    pub fn errors_of(&self, e: ErrorKind) -> u64 {
        self.errors[e as usize]
    }

    pub fn phase(&self, p: Phase) -> PhaseStats {
        self.phases[p as usize]
    }
}

/// A copy of a volume's counters; see [`crate::volume::Volume::stats`].
#[derive(Debug, Default, Clone, Copy)]
pub struct StatsSnapshot {
    pub read: OpStats,
    /// Writes, write-zeroes and discards.
    pub write: OpStats,
    /// Requests cut into chunks for the workers.
    pub split: u64,
    /// Write requests that needed a read-modify-write of a partial sector.
    pub rmw: u64,
}

impl fmt::Display for StatsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, o) in [("read", &self.read), ("write", &self.write)] {
            if o.requests == 0 {
                continue;
            }
            write!(
                f,
                "{name}: {} requests, {} bytes; timed 1 in {SAMPLE_EVERY}:",
                o.requests, o.bytes
            )?;
            for (i, p) in o.phases.iter().enumerate() {
                if p.count > 0 {
                    write!(
                        f,
                        " {} mean {:.0} ns (p50<={:.0}, p99<={:.0})",
                        PHASE_NAMES[i], p.mean_ns, p.p50_ns, p.p99_ns
                    )?;
                    if i + 1 < PHASES {
                        write!(f, ";")?;
                    }
                }
            }
            writeln!(f)?;
        }
        write!(
            f,
            "split {} requests, read-modify-write {}",
            self.split, self.rmw
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// More threads than owned slots, each recording a known number of requests, some at the
    /// same time: every request is counted exactly once (owned slots and the shared one), and
    /// a reset starts from zero without touching the owned slots.
    #[test]
    fn counts_are_exact_across_owned_and_shared_slots() {
        let stats = Stats::default();
        let threads = COUNTER_SLOTS + 8;
        let per_thread = 1000u64;
        let barrier = std::sync::Barrier::new(threads);
        std::thread::scope(|s| {
            for th in 0..threads {
                let (stats, barrier) = (&stats, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    for i in 0..per_thread {
                        let kind = if i % 2 == 0 { Kind::Read } else { Kind::Write };
                        stats.record(kind, 4096, &Times::default(), th % 3 == 0, false);
                    }
                });
            }
        });
        let snap = stats.snapshot();
        let total = threads as u64 * per_thread;
        assert_eq!(snap.read.requests + snap.write.requests, total);
        assert_eq!(snap.read.bytes + snap.write.bytes, total * 4096);
        let split_threads = (0..threads).filter(|t| t % 3 == 0).count() as u64;
        assert_eq!(snap.split, split_threads * per_thread);

        stats.reset();
        assert_eq!(stats.snapshot().read.requests, 0);
        stats.record(Kind::Read, 512, &Times::default(), false, true);
        let snap = stats.snapshot();
        assert_eq!((snap.read.requests, snap.read.bytes, snap.rmw), (1, 512, 1));
    }

    /// A thread that exits gives its slot back; the next thread continues its counts. Without
    /// give-back, no more than COUNTER_SLOTS threads could ever own one (other tests in this
    /// process hold slots only briefly).
    #[test]
    fn slots_are_given_back_when_threads_exit() {
        let stats = Stats::default();
        let mut owned = 0;
        for _ in 0..3 * COUNTER_SLOTS {
            owned += std::thread::scope(|s| {
                s.spawn(|| {
                    stats.record(Kind::Write, 1, &Times::default(), false, false);
                    owned_slot().is_some() as usize
                })
                .join()
                .expect("thread")
            });
        }
        assert!(owned > COUNTER_SLOTS, "only {owned} threads owned a slot");
        assert_eq!(stats.snapshot().write.requests, 3 * COUNTER_SLOTS as u64);
    }

    /// Timed requests are one in SAMPLE_EVERY on average, and a workload whose pattern repeats
    /// with a period sharing a factor with SAMPLE_EVERY (here 2, 4, 8 and 6) still has every
    /// position of its pattern timed, in nearly equal shares (a fixed one-in-N counter would
    /// time one position only, or a few of six).
    #[test]
    fn sampling_covers_every_position_of_a_periodic_workload() {
        std::thread::spawn(|| {
            let n = 200 * 1024usize;
            let periods = [2usize, 4, 8, 6];
            let mut hits: Vec<Vec<usize>> = periods.iter().map(|&p| vec![0; p]).collect();
            let mut timed = 0;
            for i in 0..n {
                if Times::start().on {
                    timed += 1;
                    for (h, &p) in hits.iter_mut().zip(&periods) {
                        h[i % p] += 1;
                    }
                }
            }
            let expect = n / SAMPLE_EVERY as usize;
            assert!(
                timed > expect * 9 / 10 && timed < expect * 11 / 10,
                "{timed} of {n} timed, expected about {expect}"
            );
            for (h, p) in hits.iter().zip(periods) {
                let share = timed / p;
                for (pos, &c) in h.iter().enumerate() {
                    assert!(
                        c > share * 8 / 10 && c < share * 12 / 10,
                        "period {p}: position {pos} timed {c} times, expected about {share}: {h:?}"
                    );
                }
            }
        })
        .join()
        .expect("sampling thread");
    }
}
