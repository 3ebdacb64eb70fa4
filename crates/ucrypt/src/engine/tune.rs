//! Whether `auto` splits a request, learnt from what splitting gave. Start-up calibration
//! guesses a threshold once (crypto per byte against one hand-off round trip); on a host whose
//! load changes by the minute the guess goes stale either way. So the tuner runs a running A/B
//! test per size class (powers of two from [`CLASS_MIN_BYTES`]): a class goes its current way
//! (split or inline), and about one request in [`EXPLORE_EVERY`] (drawn at random, so that a
//! workload cycling its sizes cannot hide a class) goes the other way. Both ways add their
//! wall time and bytes to the class's window; once the other way has [`WINDOW_EXPLORED`]
//! requests in it, the class takes whichever way cost less time per byte in that window (by
//! [`MARGIN_PERCENT`] at least) and starts a new window. Both ways are measured over the same
//! stretch of time, so a load that comes or goes favours neither.
//!
//! The measure is the outcome (the caller's wall time per byte), not a model of it: under CPU
//! contention a worker waits long to start, yet splitting may still win (more threads share
//! the CPUs, and the chunks overlap the I/O); the wait to start alone said otherwise (a first
//! version that raised the threshold from the queue wait stopped `auto` splitting at load 7 on
//! 2 cores, 0.58 of `parallel`).
//!
//! State is relaxed atomics without locks: a sample racing with the end of a window may land
//! in either window, which a comparison of sums does not notice.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

/// The smallest request `auto` may split (the first class); below it, always inline.
pub const CLASS_MIN_BYTES: u64 = 16 << 10;
const CLASS_MIN_SHIFT: u32 = CLASS_MIN_BYTES.trailing_zeros();
/// Size classes: 16 KiB, 32 KiB, ... 2 MiB, then 4 MiB and above.
const CLASSES: usize = 9;
/// About one request in this many (per thread, at random) goes the way its class does not.
pub const EXPLORE_EVERY: u32 = 32;
/// Requests that went the other way before a class compares the two ways.
pub const WINDOW_EXPLORED: u32 = 4;
/// A class changes its way only when the other cost this many percent less per byte.
const MARGIN_PERCENT: u64 = 5;

#[derive(Debug, Default)]
struct Way {
    ticks: AtomicU64,
    bytes: AtomicU64,
    requests: AtomicU32,
}

impl Way {
    fn add(&self, ticks: u64, bytes: u64) -> u32 {
        self.ticks.fetch_add(ticks, Relaxed);
        self.bytes.fetch_add(bytes, Relaxed);
        self.requests.fetch_add(1, Relaxed) + 1
    }
    /// (ticks, bytes), and starts over.
    fn take(&self) -> (u64, u64) {
        self.requests.store(0, Relaxed);
        (self.ticks.swap(0, Relaxed), self.bytes.swap(0, Relaxed))
    }
}

#[derive(Debug, Default)]
struct Class {
    split: AtomicBool,
    /// The window's split and inline requests.
    ways: [Way; 2],
}

#[derive(Debug, Default)]
pub struct AutoTuner {
    classes: [Class; CLASSES],
}

fn class(len: u64) -> usize {
    let log = 63 - len.max(1).leading_zeros();
    (log.saturating_sub(CLASS_MIN_SHIFT) as usize).min(CLASSES - 1)
}

/// The smallest request of class `c`.
fn class_bytes(c: usize) -> u64 {
    CLASS_MIN_BYTES << c
}

/// True about once in [`EXPLORE_EVERY`] calls on this thread (xorshift).
fn explore() -> bool {
    thread_local! { static X: Cell<u32> = const { Cell::new(0x9e37_79b9) }; }
    X.with(|c| {
        let mut x = c.get();
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        c.set(x);
        x % EXPLORE_EVERY == 0
    })
}

impl AutoTuner {
    /// Starts from the calibrated threshold: classes from it up split.
    pub fn seed(&self, threshold: u64) {
        for (c, k) in self.classes.iter().enumerate() {
            k.split.store(class_bytes(c) >= threshold, Relaxed);
            k.ways.iter().for_each(|w| {
                w.take();
            });
        }
    }

    /// Whether a request of `len` bytes should split now: its class's way, or, about one
    /// time in [`EXPLORE_EVERY`], the other one.
    pub fn choose(&self, len: u64) -> bool {
        if len < CLASS_MIN_BYTES {
            return false;
        }
        self.classes[class(len)].split.load(Relaxed) != explore()
    }

    /// A request of `len` bytes took `ticks`, split or not.
    pub fn learn(&self, len: u64, split: bool, ticks: u64) {
        if len < CLASS_MIN_BYTES {
            return;
        }
        let k = &self.classes[class(len)];
        let n = k.ways[usize::from(split)].add(ticks, len);
        let current = k.split.load(Relaxed);
        if split == current || n < WINDOW_EXPLORED {
            return;
        }
        // The other way has its samples: compare the window's costs per byte.
        let (ot, ob) = k.ways[usize::from(split)].take();
        let (ct, cb) = k.ways[usize::from(current)].take();
        if ob == 0 || cb == 0 {
            return;
        }
        // other/ob * 100 + margin < current/cb * 100, in integers.
        let other = u128::from(ot) * u128::from(cb) * u128::from(100 + MARGIN_PERCENT);
        let cur = u128::from(ct) * u128::from(ob) * 100;
        if other < cur {
            k.split.store(split, Relaxed);
        }
    }

    /// The smallest request size whose class splits now (above every class when none does).
    pub fn threshold(&self) -> u64 {
        (0..CLASSES)
            .find(|&c| self.classes[c].split.load(Relaxed))
            .map_or(class_bytes(CLASSES), class_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_from_16_kib() {
        assert_eq!(class(16 << 10), 0);
        assert_eq!(class((32 << 10) - 1), 0);
        assert_eq!(class(64 << 10), 2);
        assert_eq!(class(1 << 20), 6);
        assert_eq!(class(64 << 20), CLASSES - 1);
    }

    #[test]
    fn seeded_from_the_calibrated_threshold() {
        let t = AutoTuner::default();
        t.seed(100 << 10);
        assert_eq!(t.threshold(), 128 << 10);
        assert!(!t.choose(4096));
    }

    /// Feeds `n` requests of `len` bytes whose time per byte depends on the way they took.
    fn run(t: &AutoTuner, len: u64, n: usize, split_cost: u64, inline_cost: u64) -> usize {
        let mut splits = 0;
        for _ in 0..n {
            let s = t.choose(len);
            splits += usize::from(s);
            let per_byte = if s { split_cost } else { inline_cost };
            t.learn(len, s, per_byte * len);
        }
        splits
    }

    #[test]
    fn a_class_follows_the_faster_way_and_explores_the_other() {
        let t = AutoTuner::default();
        t.seed(64 << 10);
        // 1 MiB: splitting is twice as fast: it splits, but for the explorations.
        let s = run(&t, 1 << 20, 3200, 1, 2);
        assert!(s > 3000 && s < 3200, "{s} of 3200 split");
        // The host gets busy: now inline is faster. The class turns.
        run(&t, 1 << 20, 3200, 3, 2);
        let s = run(&t, 1 << 20, 3200, 3, 2);
        assert!(s < 200, "{s} of 3200 split after inline became faster");
        assert!(!t.classes[class(1 << 20)].split.load(Relaxed));
        // Quiet again: it turns back.
        run(&t, 1 << 20, 3200, 1, 2);
        assert!(run(&t, 1 << 20, 3200, 1, 2) > 3000);
        // Other classes were not touched.
        assert_eq!(t.threshold(), 64 << 10);
    }

    #[test]
    fn within_the_margin_a_class_keeps_its_way() {
        let t = AutoTuner::default();
        t.seed(64 << 10);
        // Inline 3 % faster: not enough to turn.
        let s = run(&t, 256 << 10, 3200, 103, 100);
        assert!(s > 3000, "{s}");
    }
}
