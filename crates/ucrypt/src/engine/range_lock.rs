//! Exclusive locks on runs of sectors. A writer locks only the sectors it touches, so requests
//! to different places never wait for each other, and overlapping ones run one after the other
//! (no torn sector, no lost read-modify-write update).

use std::sync::{Condvar, Mutex, MutexGuard};

use super::plan::SectorRange;

/// Requests holding a range at once; more wait (bounded, preallocated table).
pub const RANGE_LOCK_HOLDERS_MAX: usize = 256;

pub struct RangeLock {
    held: Mutex<Held>,
    cv: Condvar,
}

struct Held {
    ranges: Vec<SectorRange>,
    /// Callers asleep on `cv`. Releasing a range wakes them only if there are any: a notify
    /// is a system call even when nobody waits, and most releases have no waiter.
    waiters: usize,
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
                waiters: 0,
            }),
            cv: Condvar::new(),
        }
    }
}

impl RangeLock {
    fn table(&self) -> MutexGuard<'_, Held> {
        // Entries are pushed and removed in single steps; a panic cannot leave a half entry.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until no held range overlaps `range` and a table slot is free, then holds it.
    pub fn lock(&self, range: SectorRange) -> RangeGuard<'_> {
        let mut held = self.table();
        while held.ranges.len() >= RANGE_LOCK_HOLDERS_MAX
            || held.ranges.iter().any(|r| r.overlaps(&range))
        {
            held.waiters += 1;
            held = self.cv.wait(held).unwrap_or_else(|e| e.into_inner());
            held.waiters -= 1;
        }
        held.ranges.push(range);
        RangeGuard { lock: self, range }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.lock.table();
        if let Some(i) = held.ranges.iter().position(|r| *r == self.range) {
            held.ranges.swap_remove(i);
        }
        // Read under the lock: a caller that found this range held counted itself in
        // `waiters` before it slept, and one that comes later sees the range gone.
        let wake = held.waiters > 0;
        drop(held);
        if wake {
            self.lock.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

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
