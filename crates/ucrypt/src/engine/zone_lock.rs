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
//!
//! The driver's calls come from outside the serving process's control: the online rotation's
//! hotzone loop runs in a worker process and its calls arrive over a socket, and a second
//! rotation may ask for a hotzone while the last one's is still held. So a call out of turn
//! (a second hotzone, a piece outside the hotzone, a release of nothing) is refused with a
//! [`HotzoneRefused`], never asserted. A driver that stopped inside its hotzone (its worker
//! died) leaves the hotzone held; [`ZoneLock::fence`] then holds it against every request
//! while the serving process recovers it from the resilience data, and
//! [`ZoneLock::release_hotzone`] or [`ZoneLock::break_hotzone`] ends that.

use std::sync::Mutex;

use crate::sync::{lock, WaitCell};
use crate::{Error, Result};

/// Why the hotzone lock refused a driver's call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HotzoneRefused {
    /// A hotzone is held already: another rotation's, or the one a rotation that stopped
    /// inside it left, not yet recovered.
    #[error(
        "the hotzone at bytes {}..{} of this volume is held by another reencryption",
        .0.start, .0.end
    )]
    Busy(ByteRange),
    /// The hotzone held is broken: a rotation failed inside it and it was not recovered.
    #[error(
        "the hotzone at bytes {}..{} of this volume is blocked: a reencryption stopped inside \
         it and it was not recovered (close the volume and open it again, which recovers it)",
        .0.start, .0.end
    )]
    Broken(ByteRange),
    /// No hotzone is held.
    #[error("no hotzone of this volume is held")]
    NotHeld,
    /// A piece (or hotzone) that is empty, or not inside the hotzone held.
    #[error(
        "bytes {}..{} are no piece of the hotzone held (bytes {}..{})",
        .piece.start, .piece.end, .hot.start, .hot.end
    )]
    Outside { piece: ByteRange, hot: ByteRange },
    /// A piece is being rewritten already.
    #[error("the piece at bytes {}..{} is being rewritten already", .0.start, .0.end)]
    PieceBusy(ByteRange),
    /// The piece said rewritten is not the one being rewritten.
    #[error("bytes {}..{} are not the piece being rewritten", .0.start, .0.end)]
    NotRewriting(ByteRange),
}

impl From<HotzoneRefused> for Error {
    fn from(r: HotzoneRefused) -> Self {
        match r {
            // The device is busy (cryptsetup's exit code 5): wait, or recover it.
            HotzoneRefused::Busy(_) | HotzoneRefused::Broken(_) => Error::Io {
                context: r.to_string(),
                source: std::io::Error::from_raw_os_error(libc::EBUSY),
            },
            // A driver's calls out of order.
            _ => Error::InvalidArgument(r.to_string()),
        }
    }
}

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
    /// The part of the hotzone that excludes reads too: the piece being rewritten, or all of
    /// it while it is recovered ([`ZoneLock::fence`]).
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
                    context: "the reencryption stopped inside this hotzone and it was not \
                              recovered: close the volume and open it again, which recovers it"
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
    /// driver's), until [`ZoneLock::release_hotzone`] or [`ZoneLock::break_hotzone`]: while
    /// one is held (or broken) another is refused at once.
    pub fn hold_hotzone(&self, range: ByteRange) -> Result<(), HotzoneRefused> {
        let mut s = lock(&self.state);
        match s.hot {
            Some(h) if s.broken => return Err(HotzoneRefused::Broken(h)),
            Some(h) => return Err(HotzoneRefused::Busy(h)),
            None if range.start >= range.end => {
                return Err(HotzoneRefused::Outside {
                    piece: range,
                    hot: range,
                })
            }
            None => {}
        }
        s.hot = Some(range);
        s.hot_reads = None;
        while s.held.iter().any(|(r, w)| *w && r.overlaps(&range)) {
            s = self.cv.wait(s);
        }
        Ok(())
    }

    /// The rewrite of `piece` (inside the held hotzone): it excludes reads too; returns once
    /// the reads already inside it have left. One piece at a time, until
    /// [`ZoneLock::allow_reads`].
    pub fn exclude_reads(&self, piece: ByteRange) -> Result<(), HotzoneRefused> {
        let mut s = lock(&self.state);
        let hot = s.hot.ok_or(HotzoneRefused::NotHeld)?;
        if s.broken {
            return Err(HotzoneRefused::Broken(hot));
        }
        if piece.start >= piece.end || piece.start < hot.start || hot.end < piece.end {
            return Err(HotzoneRefused::Outside { piece, hot });
        }
        if let Some(p) = s.hot_reads {
            return Err(HotzoneRefused::PieceBusy(p));
        }
        s.hot_reads = Some(piece);
        while s.held.iter().any(|(r, _)| r.overlaps(&piece)) {
            s = self.cv.wait(s);
        }
        Ok(())
    }

    /// `piece`, the one being rewritten, is rewritten: `moved` moves the volume's mark past
    /// it (while reads of it are still excluded), then reads of it go on.
    pub fn allow_reads(
        &self,
        piece: ByteRange,
        moved: impl FnOnce(),
    ) -> Result<(), HotzoneRefused> {
        let mut s = lock(&self.state);
        if s.hot_reads != Some(piece) || s.broken {
            return Err(HotzoneRefused::NotRewriting(piece));
        }
        moved();
        s.hot_reads = None;
        drop(s);
        self.cv.notify_all();
        Ok(())
    }

    /// `moved` moves the volume's mark past the hotzone (while every request it excludes
    /// still waits), then lets the requests waiting for the hotzone in.
    pub fn release_hotzone(&self, moved: impl FnOnce()) -> Result<(), HotzoneRefused> {
        let mut s = lock(&self.state);
        match s.hot {
            None => return Err(HotzoneRefused::NotHeld),
            Some(h) if s.broken => return Err(HotzoneRefused::Broken(h)),
            Some(_) => {}
        }
        moved();
        s.hot = None;
        s.hot_reads = None;
        drop(s);
        self.cv.notify_all();
        Ok(())
    }

    /// The hotzone held now, if any (broken or not).
    pub fn held_hotzone(&self) -> Option<ByteRange> {
        lock(&self.state).hot
    }

    /// Holds `range` against every request, reads too, for the recovery of a hotzone whose
    /// driver stopped: together with the hotzone held now, if any, as one range (a driver may
    /// die before it holds the hotzone it committed, or after it held one), and no longer
    /// broken, so that requests touching it wait for the recovery instead of failing.
    /// Returns the range held, once the requests inside it have left. Then
    /// [`ZoneLock::release_hotzone`] (recovered) or [`ZoneLock::break_hotzone`] (not).
    pub fn fence(&self, range: ByteRange) -> ByteRange {
        let mut s = lock(&self.state);
        let all = match s.hot {
            Some(h) => ByteRange {
                start: h.start.min(range.start),
                end: h.end.max(range.end),
            },
            None => range,
        };
        s.hot = Some(all);
        s.hot_reads = Some(all);
        s.broken = false;
        while s.held.iter().any(|(r, _)| r.overlaps(&all)) {
            s = self.cv.wait(s);
        }
        all
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
        z.hold_hotzone(r(100, 200)).unwrap();
        // Outside: passes at once, while the hotzone is held; a read inside passes until the
        // rewrite stage.
        drop(z.shared(r(0, 100), true).unwrap());
        drop(z.shared(r(200, 300), true).unwrap());
        drop(z.shared(r(150, 160), false).unwrap());
        // The rewrite of the piece [140, 170): a read of it waits, reads of the rest of the
        // hotzone pass, writes anywhere in it still wait.
        z.exclude_reads(r(140, 170)).unwrap();
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
        z.allow_reads(r(140, 170), || {}).unwrap();
        t.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!w.is_finished(), "a write entered the hotzone");
        z.release_hotzone(|| {}).unwrap();
        w.join().unwrap();
    }

    #[test]
    fn the_rewrite_waits_for_reads_inside_its_piece_only() {
        let z = Arc::new(ZoneLock::default());
        z.hold_hotzone(r(0, 100)).unwrap();
        let outside_piece = z.shared(r(60, 70), false).unwrap();
        let inside_piece = z.shared(r(10, 20), false).unwrap();
        let got = Arc::new(AtomicBool::new(false));
        let t = {
            let (z, got) = (z.clone(), got.clone());
            std::thread::spawn(move || {
                z.exclude_reads(r(0, 50)).unwrap();
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
                z.hold_hotzone(r(0, 1 << 20)).unwrap();
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
        z.hold_hotzone(r(0, 10)).unwrap();
        z.break_hotzone();
        assert!(z.shared(r(5, 6), false).is_err());
        assert!(z.shared(r(10, 20), true).is_ok());
    }

    #[test]
    fn calls_out_of_turn_are_refused_not_asserted() {
        let z = ZoneLock::default();
        // Nothing held: no piece, no release.
        assert_eq!(z.exclude_reads(r(0, 10)), Err(HotzoneRefused::NotHeld));
        assert_eq!(z.release_hotzone(|| {}), Err(HotzoneRefused::NotHeld));
        assert!(matches!(
            z.hold_hotzone(r(5, 5)),
            Err(HotzoneRefused::Outside { .. })
        ));
        z.hold_hotzone(r(100, 200)).unwrap();
        // A second hotzone, while one is held: busy, at once.
        assert_eq!(
            z.hold_hotzone(r(0, 10)),
            Err(HotzoneRefused::Busy(r(100, 200)))
        );
        // Pieces outside the hotzone, empty, or two at once.
        for bad in [r(90, 110), r(190, 210), r(150, 150)] {
            assert!(matches!(
                z.exclude_reads(bad),
                Err(HotzoneRefused::Outside { .. })
            ));
        }
        z.exclude_reads(r(100, 120)).unwrap();
        assert_eq!(
            z.exclude_reads(r(120, 140)),
            Err(HotzoneRefused::PieceBusy(r(100, 120)))
        );
        // Only the piece being rewritten is said rewritten; the mark moves only then.
        let mut moved = false;
        assert_eq!(
            z.allow_reads(r(120, 140), || moved = true),
            Err(HotzoneRefused::NotRewriting(r(120, 140)))
        );
        assert!(!moved);
        z.allow_reads(r(100, 120), || moved = true).unwrap();
        assert!(moved);
        // Broken: refused as such until fenced.
        z.break_hotzone();
        assert_eq!(
            z.hold_hotzone(r(0, 10)),
            Err(HotzoneRefused::Broken(r(100, 200)))
        );
        assert_eq!(
            z.release_hotzone(|| moved = false),
            Err(HotzoneRefused::Broken(r(100, 200)))
        );
        assert!(moved, "the mark moved on a refused release");
        // Busy maps to EBUSY (cryptsetup's exit code 5), misuse to an invalid argument.
        let busy: Error = HotzoneRefused::Busy(r(0, 1)).into();
        assert_eq!(busy.errno(), libc::EBUSY);
        let misuse: Error = HotzoneRefused::NotHeld.into();
        assert!(matches!(misuse, Error::InvalidArgument(_)));
    }

    #[test]
    fn a_fence_holds_every_request_until_the_recovery_ends() {
        let z = Arc::new(ZoneLock::default());
        // A driver died holding [100, 200), broken, while a read of [150, 160) is inside.
        z.hold_hotzone(r(100, 200)).unwrap();
        let inside = z.shared(r(150, 160), false).unwrap();
        z.break_hotzone();
        assert!(z.shared(r(150, 160), false).is_err());
        // The fence takes in the hotzone the header names ([200, 300)) too, and waits for
        // the read inside.
        let fenced = Arc::new(AtomicBool::new(false));
        let f = {
            let (z, fenced) = (z.clone(), fenced.clone());
            std::thread::spawn(move || {
                let all = z.fence(r(200, 300));
                fenced.store(true, Ordering::SeqCst);
                all
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!fenced.load(Ordering::SeqCst), "fenced over a read inside");
        drop(inside);
        assert_eq!(f.join().unwrap(), r(100, 300));
        // Requests touching it wait (not fail) while it is recovered; others pass.
        drop(z.shared(r(0, 100), true).unwrap());
        drop(z.shared(r(300, 400), false).unwrap());
        let read = {
            let z = z.clone();
            std::thread::spawn(move || z.shared(r(250, 260), false).map(drop))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!read.is_finished(), "a read entered the fence");
        z.release_hotzone(|| {}).unwrap();
        read.join().unwrap().unwrap();
        // Nothing held: a fence holds the range given; broken after a failed recovery.
        assert_eq!(z.fence(r(10, 20)), r(10, 20));
        z.break_hotzone();
        assert!(z.shared(r(15, 16), true).is_err());
    }
}
