//! The hotzone lock of a volume in reencryption: requests hold their byte range shared (any
//! number of them, overlapping or not), the reencryption driver holds one hotzone against
//! writes from before its read to its release, and against reads only the piece of it being
//! rewritten. While the driver reads the hotzone and stores its resilience data, the data
//! there is still the old ciphertext, so reads of it go on; during the rewrite, piece after
//! piece, a read waits only if it touches the piece being rewritten (the pieces before it are
//! under the new key, the ones after under the old, and the volume routes reads by that mark);
//! writes wait until the release, so that none lands in a hotzone whose resilience data could
//! still be replayed over it. A request that touches the hotzone at a stage that excludes it
//! waits for it alone; every other request passes. Once the driver has asked for a stage, new
//! requests it excludes wait, so the driver waits only for those already inside (no
//! starvation).

use std::sync::Mutex;

use crate::sync::{lock, WaitCell};
use crate::{Error, Result};

/// Requests holding a range at once; more wait (bounded, preallocated table). The engine's
/// own range lock has the same bound, and a request holds one entry in each.
pub const ZONE_HOLDERS_MAX: usize = 256;

/// A half-open byte range `[start, end)` of the plaintext.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    pub start: u64,
    pub end: u64,
}

impl ByteRange {
    pub fn overlaps(&self, o: &ByteRange) -> bool {
        self.start < o.end && o.start < self.end
    }
}

struct State {
    /// Ranges of the requests inside (shared holders), and whether each writes.
    held: Vec<(ByteRange, bool)>,
    /// The hotzone the driver holds or waits for.
    hot: Option<ByteRange>,
    /// The piece of the hotzone being rewritten: it excludes reads too.
    hot_reads: Option<ByteRange>,
    /// The driver failed inside the hotzone: its data is neither all old nor all new, so the
    /// requests touching it fail instead of waiting forever.
    broken: bool,
}

pub struct ZoneLock {
    state: Mutex<State>,
    cv: WaitCell,
}

pub struct SharedGuard<'a> {
    lock: &'a ZoneLock,
    range: ByteRange,
    write: bool,
}

impl Default for ZoneLock {
    fn default() -> Self {
        ZoneLock {
            state: Mutex::new(State {
                held: Vec::with_capacity(ZONE_HOLDERS_MAX),
                hot: None,
                hot_reads: None,
                broken: false,
            }),
            cv: WaitCell::new(),
        }
    }
}

impl ZoneLock {
    /// Holds `range` for a request (`write`: one that changes the data): waits while it
    /// touches the hotzone at a stage that excludes it (or the table is full). Fails if the
    /// driver left the hotzone broken.
    pub fn shared(&self, range: ByteRange, write: bool) -> Result<SharedGuard<'_>> {
        let mut s = lock(&self.state);
        loop {
            let touches = s.hot.is_some_and(|h| h.overlaps(&range));
            let rewriting = s.hot_reads.is_some_and(|p| p.overlaps(&range));
            let hot = touches && (write || rewriting || s.broken);
            if hot && s.broken {
                return Err(Error::Io {
                    context: "the reencryption failed inside this hotzone: close the volume \
                              and run repair"
                        .into(),
                    source: std::io::Error::from_raw_os_error(libc::EIO),
                });
            }
            if !hot && s.held.len() < ZONE_HOLDERS_MAX {
                break;
            }
            s = self.cv.wait(s);
        }
        s.held.push((range, write));
        Ok(SharedGuard {
            lock: self,
            range,
            write,
        })
    }

    /// Holds `range` as the hotzone against writes: new writes touching it wait from now on;
    /// returns once the writes already inside it have left. One hotzone at a time (the
    /// driver's), until [`ZoneLock::release_hotzone`] or [`ZoneLock::break_hotzone`].
    pub fn hold_hotzone(&self, range: ByteRange) {
        let mut s = lock(&self.state);
        assert!(s.hot.is_none(), "two hotzones held at once");
        s.hot = Some(range);
        s.hot_reads = None;
        while s.held.iter().any(|(r, w)| *w && r.overlaps(&range)) {
            s = self.cv.wait(s);
        }
    }

    /// The rewrite of `piece` (inside the held hotzone): it excludes reads too; returns once
    /// the reads already inside it have left. One piece at a time, until
    /// [`ZoneLock::allow_reads`].
    pub fn exclude_reads(&self, piece: ByteRange) {
        let mut s = lock(&self.state);
        let hot = s.hot.expect("no hotzone held");
        assert!(
            hot.start <= piece.start && piece.end <= hot.end,
            "rewritten piece outside the hotzone"
        );
        assert!(s.hot_reads.is_none(), "two pieces rewritten at once");
        s.hot_reads = Some(piece);
        while s.held.iter().any(|(r, _)| r.overlaps(&piece)) {
            s = self.cv.wait(s);
        }
    }

    /// The piece is rewritten (and the volume's mark moved past it): reads of it go on.
    pub fn allow_reads(&self) {
        let mut s = lock(&self.state);
        s.hot_reads = None;
        drop(s);
        self.cv.notify_all();
    }

    /// Lets the requests waiting for the hotzone in.
    pub fn release_hotzone(&self) {
        let mut s = lock(&self.state);
        assert!(s.hot.is_some() && !s.broken, "no hotzone held");
        s.hot = None;
        s.hot_reads = None;
        drop(s);
        self.cv.notify_all();
    }

    /// Leaves the hotzone blocked: requests touching it fail from now on (the driver failed
    /// inside it and the data there needs recovery).
    pub fn break_hotzone(&self) {
        let mut s = lock(&self.state);
        if s.hot.is_some() {
            s.broken = true;
        }
        drop(s);
        self.cv.notify_all();
    }
}

impl Drop for SharedGuard<'_> {
    fn drop(&mut self) {
        let mut s = lock(&self.lock.state);
        let me = (self.range, self.write);
        if let Some(i) = s.held.iter().position(|h| *h == me) {
            s.held.swap_remove(i);
        }
        let wake = s.hot.is_some() || s.held.len() + 1 == ZONE_HOLDERS_MAX;
        drop(s);
        if wake {
            self.lock.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    fn r(start: u64, end: u64) -> ByteRange {
        ByteRange { start, end }
    }

    #[test]
    fn requests_outside_the_hotzone_pass_inside_wait() {
        let z = Arc::new(ZoneLock::default());
        z.hold_hotzone(r(100, 200));
        // Outside: passes at once, while the hotzone is held; a read inside passes until the
        // rewrite stage.
        drop(z.shared(r(0, 100), true).unwrap());
        drop(z.shared(r(200, 300), true).unwrap());
        drop(z.shared(r(150, 160), false).unwrap());
        // The rewrite of the piece [140, 170): a read of it waits, reads of the rest of the
        // hotzone pass, writes anywhere in it still wait.
        z.exclude_reads(r(140, 170));
        drop(z.shared(r(100, 140), false).unwrap());
        drop(z.shared(r(170, 200), false).unwrap());
        let entered = Arc::new(AtomicBool::new(false));
        let t = {
            let (z, entered) = (z.clone(), entered.clone());
            std::thread::spawn(move || {
                let _g = z.shared(r(150, 160), false).unwrap();
                entered.store(true, Ordering::SeqCst);
            })
        };
        let w = {
            let z = z.clone();
            std::thread::spawn(move || drop(z.shared(r(180, 190), true).unwrap()))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!entered.load(Ordering::SeqCst), "entered the piece");
        z.allow_reads();
        t.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!w.is_finished(), "a write entered the hotzone");
        z.release_hotzone();
        w.join().unwrap();
    }

    #[test]
    fn the_rewrite_waits_for_reads_inside_its_piece_only() {
        let z = Arc::new(ZoneLock::default());
        z.hold_hotzone(r(0, 100));
        let outside_piece = z.shared(r(60, 70), false).unwrap();
        let inside_piece = z.shared(r(10, 20), false).unwrap();
        let got = Arc::new(AtomicBool::new(false));
        let t = {
            let (z, got) = (z.clone(), got.clone());
            std::thread::spawn(move || {
                z.exclude_reads(r(0, 50));
                got.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!got.load(Ordering::SeqCst), "piece rewritten under a read");
        drop(inside_piece);
        t.join().unwrap();
        drop(outside_piece);
    }

    #[test]
    fn the_driver_waits_for_requests_inside() {
        let z = Arc::new(ZoneLock::default());
        let inside = z.shared(r(0, 4096), true).unwrap();
        let got = Arc::new(AtomicBool::new(false));
        let t = {
            let (z, got) = (z.clone(), got.clone());
            std::thread::spawn(move || {
                z.hold_hotzone(r(0, 1 << 20));
                got.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!got.load(Ordering::SeqCst), "hotzone held over a request");
        drop(inside);
        t.join().unwrap();
    }

    #[test]
    fn a_broken_hotzone_fails_requests_touching_it() {
        let z = ZoneLock::default();
        z.hold_hotzone(r(0, 10));
        z.break_hotzone();
        assert!(z.shared(r(5, 6), false).is_err());
        assert!(z.shared(r(10, 20), true).is_ok());
    }
}
