//! Exclusive locks on runs of sectors. A writer locks only the sectors it touches, so requests
//! to different places never wait for each other, and overlapping ones run one after the other
//! (no torn sector, no lost read-modify-write update).

use std::sync::{Mutex, MutexGuard};

use super::plan::SectorRange;
use crate::sync::{lock, WaitCell};

/// Requests holding a range at once; more wait (bounded, preallocated table).
pub const RANGE_LOCK_HOLDERS_MAX: usize = 256;

pub struct RangeLock {
    held: Mutex<Held>,
    /// Callers waiting for a range; releasing one wakes them only if there are any.
    cv: WaitCell,
}

struct Held {
    ranges: Vec<SectorRange>,
}

pub struct RangeGuard<'a> {
    lock: &'a RangeLock,
    range: SectorRange,
}

impl Default for RangeLock {
    fn default() -> Self {
        RangeLock {
            held: Mutex::new(Held {
                ranges: Vec::with_capacity(RANGE_LOCK_HOLDERS_MAX),
            }),
            cv: WaitCell::new(),
        }
    }
}

impl RangeLock {
    fn table(&self) -> MutexGuard<'_, Held> {
        // Entries are pushed and removed in single steps; a panic cannot leave a half entry.
        lock(&self.held)
    }

    /// Waits until no held range overlaps `range` and a table slot is free, then holds it.
    pub fn lock(&self, range: SectorRange) -> RangeGuard<'_> {
        let mut held = self.table();
        while held.ranges.len() >= RANGE_LOCK_HOLDERS_MAX
            || held.ranges.iter().any(|r| r.overlaps(&range))
        {
            held = self.cv.wait(held);
        }
        held.ranges.push(range);
        RangeGuard { lock: self, range }
    }

    /// Holds `range` if no held range overlaps it and a table slot is free; `None` (without
    /// waiting) otherwise.
    pub fn try_lock(&self, range: SectorRange) -> Option<RangeGuard<'_>> {
        let mut held = self.table();
        if held.ranges.len() >= RANGE_LOCK_HOLDERS_MAX
            || held.ranges.iter().any(|r| r.overlaps(&range))
        {
            return None;
        }
        held.ranges.push(range);
        Some(RangeGuard { lock: self, range })
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.lock.table();
        if let Some(i) = held.ranges.iter().position(|r| *r == self.range) {
            held.ranges.swap_remove(i);
        }
        // A caller that found this range held counted itself as a sleeper before the lock was
        // released; one that comes later sees the range gone.
        drop(held);
        self.lock.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn try_lock_refuses_an_overlap_without_waiting() {
        let lock = RangeLock::default();
        let r = |first, end| SectorRange { first, end };
        let a = lock.try_lock(r(4, 8)).expect("a free range");
        assert!(lock.try_lock(r(7, 9)).is_none(), "overlaps the held range");
        let b = lock.try_lock(r(8, 9)).expect("adjacent, not overlapping");
        drop(a);
        assert!(lock.try_lock(r(0, 8)).is_some(), "free again once released");
        drop(b);
    }

    #[test]
    fn overlapping_ranges_exclude_each_other() {
        let lock = Arc::new(RangeLock::default());
        let inside = Arc::new([const { AtomicU32::new(0) }; 16]);
        let threads: Vec<_> = (0..6u64)
            .map(|t| {
                let (lock, inside) = (lock.clone(), inside.clone());
                std::thread::spawn(move || {
                    for i in 0..300u64 {
                        let first = (t * 5 + i * 3) % 12;
                        let r = SectorRange {
                            first,
                            end: first + 1 + (i % 4),
                        };
                        let _g = lock.lock(r);
                        for s in r.first..r.end {
                            assert_eq!(inside[s as usize].fetch_add(1, Ordering::SeqCst), 0);
                        }
                        std::hint::spin_loop();
                        for s in r.first..r.end {
                            inside[s as usize].fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
