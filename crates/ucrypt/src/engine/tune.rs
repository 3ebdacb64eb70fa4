//! Whether `auto` splits a request, learnt from what splitting gave. Start-up calibration
//! guesses a threshold once (crypto per byte against one hand-off round trip); on a host whose
//! load changes by the minute the guess goes stale either way. So for each size class (powers
//! of two from [`CLASS_MIN_BYTES`]) the tuner keeps two moving averages of the whole request's
//! time per byte: requests that were split and requests that ran inline. A class splits while
//! its split average is the lower one (with a margin against flapping). To keep both averages
//! current, one request in [`EXPLORE_EVERY`] of a class takes the other way.
//!
//! The measure is the outcome (the caller's wall time per byte), not a model of it: under CPU
//! contention a worker waits long to start, yet splitting may still win (more threads share
//! the CPUs, and the chunks overlap the I/O); the wait to start alone said otherwise (a first
//! version that raised the threshold from the queue wait stopped `auto` splitting at load 7 on
//! 2 cores, 0.58 of `parallel`).
//!
//! State is relaxed atomics without locks: racing updates may lose a sample, which a moving
//! average does not notice.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// The smallest request `auto` may split (the first class); below it, always inline.
pub const CLASS_MIN_BYTES: u64 = 16 << 10;
const CLASS_MIN_SHIFT: u32 = CLASS_MIN_BYTES.trailing_zeros();
/// Size classes: 16 KiB, 32 KiB, ... 2 MiB, then 4 MiB and above.
const CLASSES: usize = 9;
/// One request in this many (per thread) of a class takes the way its class does not.
pub const EXPLORE_EVERY: u32 = 32;
/// Moving averages weigh a new sample 1 / 2^this.
const EWMA_SHIFT: u32 = 3;
/// A class changes its way only when the other is faster by this many percent.
const MARGIN_PERCENT: u64 = 5;
/// Costs are kept per this many bytes (ticks per MiB keep precision for 16 KiB requests).
const COST_UNIT_SHIFT: u32 = 20;

#[derive(Debug, Default)]
struct Class {
    /// Ticks per 2^COST_UNIT_SHIFT bytes of split and of inline requests (0: none seen yet).
    split_cost: AtomicU64,
    inline_cost: AtomicU64,
    split: AtomicBool,
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

fn fold(a: &AtomicU64, sample: u64) {
    let old = a.load(Relaxed);
    let new = if old == 0 {
        sample
    } else {
        old - (old >> EWMA_SHIFT) + (sample >> EWMA_SHIFT)
    };
    a.store(new.max(1), Relaxed);
}

impl AutoTuner {
    /// Starts from the calibrated threshold: classes from it up split.
    pub fn seed(&self, threshold: u64) {
        for (c, k) in self.classes.iter().enumerate() {
            k.split.store(class_bytes(c) >= threshold, Relaxed);
            k.split_cost.store(0, Relaxed);
            k.inline_cost.store(0, Relaxed);
        }
    }

    /// Whether a request of `len` bytes should split now: its class's way, or, one time in
    /// [`EXPLORE_EVERY`] on this thread, the other one.
    pub fn choose(&self, len: u64) -> bool {
        if len < CLASS_MIN_BYTES {
            return false;
        }
        thread_local! { static TURN: Cell<u32> = const { Cell::new(0) }; }
        let explore = TURN.with(|t| {
            let v = t.get().wrapping_add(1);
            t.set(v);
            v % EXPLORE_EVERY == 0
        });
        self.classes[class(len)].split.load(Relaxed) != explore
    }

    /// A request of `len` bytes took `ticks`, split or not.
    pub fn learn(&self, len: u64, split: bool, ticks: u64) {
        if len < CLASS_MIN_BYTES || ticks == 0 {
            return;
        }
        let k = &self.classes[class(len)];
        let cost = u64::try_from((u128::from(ticks) << COST_UNIT_SHIFT) / u128::from(len))
            .unwrap_or(u64::MAX);
        fold(if split { &k.split_cost } else { &k.inline_cost }, cost);
        let (s, i) = (k.split_cost.load(Relaxed), k.inline_cost.load(Relaxed));
        if s == 0 || i == 0 {
            return;
        }
        let margin = |c: u64| u128::from(c) * u128::from(100 + MARGIN_PERCENT);
        if k.split.load(Relaxed) {
            if u128::from(s) * 100 > margin(i) {
                k.split.store(false, Relaxed);
            }
        } else if u128::from(i) * 100 > margin(s) {
            k.split.store(true, Relaxed);
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
