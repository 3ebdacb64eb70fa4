//! `auto`'s split threshold, kept current while the volume serves. Splitting a request of L
//! bytes in two saves about L × (crypto per byte) / 2 and costs one hand-off to a worker, so
//! `auto` splits from 4 × hand-off ÷ crypto-per-byte (a 2× margin). Start-up calibration
//! measures both once; on a host whose load changes by the minute, both change: a woken worker
//! waits for a CPU (the hand-off grows), the caller's crypto is preempted (its per-byte cost
//! grows). The tuner follows them from the requests the engine times anyway
//! ([`super::stats::SAMPLE_EVERY`]): every timed request gives its crypto ticks per byte, every
//! timed split request its hand-off ticks per chunk a worker took, each folded into a moving
//! average. A request that could have split but did not pulls the hand-off back toward its
//! calibrated value, so that a threshold raised by a passing load comes down again without
//! splits to measure it.
//!
//! All state is relaxed atomics updated without locks: two racing updates lose one sample,
//! which a moving average does not notice.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Moving averages weigh a new sample 1 / 2^this.
const EWMA_SHIFT: u32 = 3;
/// A request that could have split but ran inline moves the hand-off average 1 / 2^this of
/// the way back to its calibrated value.
const REVERT_SHIFT: u32 = 6;
/// Crypto cost is kept per this many bytes (ticks per MiB keep precision for 4 KiB samples).
const COST_UNIT_SHIFT: u32 = 20;
/// The threshold is this many hand-offs' worth of crypto (a 2x margin on splitting in two).
const HANDOFFS_PER_SPLIT: u64 = 4;

#[derive(Debug, Default)]
pub struct AutoTuner {
    /// Ticks from a chunk's hand-off until a worker starts it (moving average).
    handoff: AtomicU64,
    /// The calibrated hand-off, where [`AutoTuner::revert`] pulls back to.
    handoff_base: AtomicU64,
    /// Crypto ticks per 2^[`COST_UNIT_SHIFT`] bytes (moving average).
    cost: AtomicU64,
}

fn fold(a: &AtomicU64, sample: u64, shift: u32) {
    let old = a.load(Relaxed);
    a.store(old - (old >> shift) + (sample >> shift), Relaxed);
}

impl AutoTuner {
    /// Starts from a calibration: `handoff` ticks per hand-off, `crypto` ticks for `bytes`.
    pub fn seed(&self, handoff: u64, crypto: u64, bytes: u64) {
        self.handoff.store(handoff, Relaxed);
        self.handoff_base.store(handoff, Relaxed);
        self.cost.store(per_unit(crypto, bytes).max(1), Relaxed);
    }

    /// A timed request spent `crypto` ticks on `bytes` bytes.
    pub fn crypto(&self, crypto: u64, bytes: u64) {
        if crypto > 0 && bytes > 0 {
            fold(&self.cost, per_unit(crypto, bytes), EWMA_SHIFT);
        }
    }

    /// A timed split request waited `queued` ticks in all for `handoffs` chunks to start.
    pub fn handoff(&self, queued: u64, handoffs: u64) {
        if let Some(each) = queued.checked_div(handoffs) {
            fold(&self.handoff, each, EWMA_SHIFT);
        }
    }

    /// A timed request that could have split ran inline: no hand-off measured, so the
    /// average drifts back toward the calibrated hand-off.
    pub fn revert(&self) {
        let base = self.handoff_base.load(Relaxed);
        let h = self.handoff.load(Relaxed);
        let step = (h.abs_diff(base) >> REVERT_SHIFT).max(1);
        let next = if h > base {
            h - step.min(h - base)
        } else {
            h + step.min(base - h)
        };
        self.handoff.store(next, Relaxed);
    }

    /// The request size from which splitting pays now, in bytes, within `floor..=ceil` and a
    /// whole number of `sector` bytes.
    pub fn threshold(&self, floor: u64, ceil: u64, sector: u64) -> u64 {
        let cost = self.cost.load(Relaxed).max(1);
        let work = u128::from(HANDOFFS_PER_SPLIT) * u128::from(self.handoff.load(Relaxed));
        let t = (work << COST_UNIT_SHIFT) / u128::from(cost);
        let t = u64::try_from(t).unwrap_or(u64::MAX).clamp(floor, ceil);
        t.div_ceil(sector) * sector
    }
}

/// Ticks per 2^[`COST_UNIT_SHIFT`] bytes.
fn per_unit(ticks: u64, bytes: u64) -> u64 {
    let v = (u128::from(ticks) << COST_UNIT_SHIFT) / u128::from(bytes.max(1));
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOOR: u64 = 16 << 10;
    const CEIL: u64 = 4 << 20;

    /// Calibrated: hand-off 20,000 ticks, crypto 1 tick per byte -> 80,000 bytes (4 x).
    fn tuner() -> AutoTuner {
        let t = AutoTuner::default();
        t.seed(20_000, 1 << 20, 1 << 20);
        t
    }

    #[test]
    fn threshold_is_four_handoffs_of_crypto() {
        let t = tuner();
        assert_eq!(
            t.threshold(FLOOR, CEIL, 4096),
            80_000u64.div_ceil(4096) * 4096
        );
    }

    #[test]
    fn a_slower_handoff_raises_the_threshold_and_it_comes_back_down() {
        let t = tuner();
        let calm = t.threshold(FLOOR, CEIL, 4096);
        // A loaded host: workers start 10x later.
        for _ in 0..200 {
            t.handoff(2 * 200_000, 2);
        }
        let loaded = t.threshold(FLOOR, CEIL, 4096);
        assert!(loaded > 8 * calm, "loaded {loaded} calm {calm}");
        // The load goes; requests run inline (no splits to measure): the threshold returns.
        for _ in 0..2000 {
            t.revert();
        }
        let after = t.threshold(FLOOR, CEIL, 4096);
        assert!(after <= calm + 4096, "after {after} calm {calm}");
    }

    #[test]
    fn slower_crypto_lowers_the_threshold_within_bounds() {
        let t = tuner();
        for _ in 0..200 {
            t.crypto(4 << 20, 1 << 20);
        }
        let slow = t.threshold(FLOOR, CEIL, 4096);
        assert!(slow < 80_000 / 3, "{slow}");
        assert!(slow >= FLOOR);
        for _ in 0..200 {
            t.handoff(u64::MAX / 4, 1);
        }
        assert_eq!(t.threshold(FLOOR, CEIL, 4096), CEIL);
    }
}
