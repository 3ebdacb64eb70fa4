//! One memory budget for the bounce buffers of many pools, in one process or across processes.
//!
//! A pool charges a [`Budget`] for every chunk it makes resident beyond its reserve
//! ([`super::POOL_RESERVE_BYTES`]) and refunds it when it gives the chunk back. A refused
//! charge does not fail the request: the pool waits for its own grants to come back and serves
//! it from what it holds (see the pool's module documentation), so the budget caps growth,
//! never progress.
//!
//! Two implementations:
//! - [`LocalBudget`]: the pools of one process (a counter).
//! - [`FileBudget`]: the pools of every process that maps the same budget file: one slot per
//!   process (its pid and the bytes it has charged), written only by its owner with atomic
//!   stores; a charge takes the file's `flock`, sums the slots, reclaims those whose process
//!   is gone and adds its own bytes if the total stays within the limit. Charges are rare (one
//!   per chunk of [`super::LOCK_CHUNK_BYTES`] per busy period), so a walk over every slot at
//!   each is cheap; refunds need no lock (lowering a total never breaks the limit). A process
//!   killed with charges left behind leaks nothing for long: the next charge by anyone
//!   reclaims its slot. A pid reused by another process of the same user before that keeps the
//!   dead slot counted until that process exits (an over-count: the safe side).
//!
//! The limit is each charger's own: a process grows only while the total of all slots plus its
//! chunk stays within the limit it was given, so processes given different limits are each
//! bounded by theirs, and the total by the largest.
//!
//! Why a shared file and not one daemon owning every pool: each volume keeps its own daemon
//! process, so a crash of one cannot take others down; the accounting is all they share, and a
//! crashed process's share is reclaimed by the next charge.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// What a pool charges its growth to. Implementations must be cheap to call under the pool's
/// lock and must never block for long (a `flock` held for one walk over the slots at most).
pub trait Budget: Send + Sync {
    /// Adds `bytes` to this holder's charge if the total stays within the limit; false, and
    /// nothing charged, otherwise.
    fn try_charge(&self, bytes: u64) -> bool;
    /// Adds `bytes` whatever the total: for a pool that holds nothing else and must serve its
    /// oldest request (the reserve that keeps every volume going; see the pool's rules).
    fn charge_anyway(&self, bytes: u64);
    /// Takes back `bytes` charged before.
    fn refund(&self, bytes: u64);
    /// The limit, the total charged by everyone, this holder's charge.
    fn usage(&self) -> BudgetUsage;
    /// Charges refused so far to every holder together (it only grows): when it has moved, a
    /// pool gives back the charged chunks it holds and does not use, so that the pools that
    /// were refused can grow (the pool's module documentation says when).
    fn refusals(&self) -> u64;
}

/// A budget's numbers, for `status` and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BudgetUsage {
    pub limit_bytes: u64,
    /// Charged by every holder together.
    pub used_bytes: u64,
    /// Charged by this one (this process, for a [`FileBudget`]).
    pub charged_bytes: u64,
    /// Charges this holder asked for and was refused: each time, a pool's request waited for
    /// the pool's own buffers instead of growing it.
    pub refused_charges: u64,
    /// Charges this holder made beyond the limit ([`Budget::charge_anyway`]): a pool holding
    /// nothing served its oldest request.
    pub forced_charges: u64,
}

/// This holder's refused and forced charges (see [`BudgetUsage`]).
#[derive(Default)]
struct Tally {
    refused: AtomicU64,
    forced: AtomicU64,
}

impl Tally {
    /// `charged`, counting it when refused.
    fn charge(&self, charged: bool) -> bool {
        if !charged {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        charged
    }

    fn forced(&self) {
        self.forced.fetch_add(1, Ordering::Relaxed);
    }

    fn usage(&self, limit_bytes: u64, used_bytes: u64, charged_bytes: u64) -> BudgetUsage {
        BudgetUsage {
            limit_bytes,
            used_bytes,
            charged_bytes,
            refused_charges: self.refused.load(Ordering::Relaxed),
            forced_charges: self.forced.load(Ordering::Relaxed),
        }
    }
}

/// A budget for the pools of one process.
pub struct LocalBudget {
    limit_bytes: u64,
    used_bytes: AtomicU64,
    tally: Tally,
}

impl LocalBudget {
    pub fn new(limit_bytes: u64) -> Self {
        LocalBudget {
            limit_bytes,
            used_bytes: AtomicU64::new(0),
            tally: Tally::default(),
        }
    }
}

impl Budget for LocalBudget {
    fn try_charge(&self, bytes: u64) -> bool {
        let charged = self
            .used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(bytes).filter(|&t| t <= self.limit_bytes)
            })
            .is_ok();
        self.tally.charge(charged)
    }

    fn charge_anyway(&self, bytes: u64) {
        self.tally.forced();
        self.used_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    fn refund(&self, bytes: u64) {
        sub_saturating(&self.used_bytes, bytes);
    }

    fn usage(&self) -> BudgetUsage {
        let used = self.used_bytes.load(Ordering::Acquire);
        self.tally.usage(self.limit_bytes, used, used)
    }

    fn refusals(&self) -> u64 {
        self.tally.refused.load(Ordering::Relaxed)
    }
}

fn sub_saturating(a: &AtomicU64, bytes: u64) {
    // Never below zero, even for a refund that a bug or another writer of the file made
    // larger than the charge.
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
        Some(u.saturating_sub(bytes))
    });
}

/// Processes that can share one budget file at once: a slot each. A process that finds no
/// free slot opens without a budget share and is refused every charge beyond its reserve
/// (it still makes progress). 4096 slots of 16 bytes: a 64 KiB file.
pub const BUDGET_SLOTS_MAX: usize = 4096;
/// The file: a header of one slot's size (the magic, and the charges refused to every
/// process: [`Budget::refusals`]), then the slots.
const SLOT_BYTES: usize = 16;
const FILE_BYTES: usize = SLOT_BYTES * (BUDGET_SLOTS_MAX + 1);
const MAGIC: u64 = u64::from_le_bytes(*b"ucbudg01");
/// The header's word that counts the charges refused to every process.
const REFUSALS_WORD: usize = 1;

/// A budget shared by every process that opens the same file (see the module documentation).
pub struct FileBudget {
    file: File,
    /// Held with the `flock`: a `flock` belongs to the open file, which every thread of this
    /// process shares, so it excludes other processes but not this one's other threads.
    local: std::sync::Mutex<()>,
    base: NonNull<AtomicU64>,
    /// This process's slot, if it got one.
    slot: Option<usize>,
    pid: u32,
    limit_bytes: u64,
    tally: Tally,
}

// SAFETY: the mapping is shared memory accessed only through atomics; the file and the
// pointer are owned by this value for its life.
unsafe impl Send for FileBudget {}
// SAFETY: as above: every access to the mapping is an atomic operation.
unsafe impl Sync for FileBudget {}

impl FileBudget {
    /// [`Budget::try_charge`] in the file: under its lock, if the total of every live slot
    /// stays within the limit.
    fn charge_in_file(&self, bytes: u64) -> bool {
        let Some(s) = self.slot else {
            return false;
        };
        let _local = crate::sync::lock(&self.local);
        let Ok(_g) = Flock::take(&self.file) else {
            return false;
        };
        let total = self.total_reclaiming();
        if total.saturating_add(bytes) > self.limit_bytes {
            self.word(REFUSALS_WORD).fetch_add(1, Ordering::AcqRel);
            return false;
        }
        self.bytes_of(s).fetch_add(bytes, Ordering::AcqRel);
        true
    }

    /// Opens (creating, mode 0600) the budget file at `path` and takes a slot for this process
    /// (one slot per process: open it once and share it).
    pub fn open(path: &Path, limit_bytes: u64) -> Result<Self> {
        let io = |what: &str, e: std::io::Error| Error::Io {
            context: format!("{what} the memory budget file {}", path.display()),
            source: e,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| io("opening", e))?;
        let b = {
            let _g = Flock::take(&file).map_err(|e| io("locking", e))?;
            let len = file.metadata().map_err(|e| io("reading", e))?.len();
            if len < FILE_BYTES as u64 {
                // New (or cut short by someone): zeroes are empty slots.
                file.set_len(FILE_BYTES as u64)
                    .map_err(|e| io("sizing", e))?;
            }
            // SAFETY: a shared mapping of a file we hold open, at least FILE_BYTES long.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    FILE_BYTES,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if raw == libc::MAP_FAILED {
                return Err(io("mapping", std::io::Error::last_os_error()));
            }
            let base =
                NonNull::new(raw.cast::<AtomicU64>()).ok_or(Error::Bug("mmap returned null"))?;
            let mut b = FileBudget {
                file: file.try_clone().map_err(|e| io("opening", e))?,
                local: std::sync::Mutex::new(()),
                base,
                slot: None,
                pid: std::process::id(),
                limit_bytes,
                tally: Tally::default(),
            };
            b.word(0).store(MAGIC, Ordering::Release);
            b.slot = b.claim_slot();
            b
        };
        drop(file);
        Ok(b)
    }

    /// Word `i` of the mapping (word 0 is the magic, word 1 the refusals, slot `s` is words
    /// 2s+2 and 2s+3).
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < FILE_BYTES / 8, "budget word beyond the file");
        // SAFETY: inside the mapping (checked above), 8-byte aligned (page-aligned base);
        // AtomicU64 has u64's layout, and every access to the shared words is atomic.
        unsafe { &*self.base.as_ptr().add(i) }
    }

    fn pid_of(&self, s: usize) -> &AtomicU64 {
        self.word(2 * s + 2)
    }

    fn bytes_of(&self, s: usize) -> &AtomicU64 {
        self.word(2 * s + 3)
    }

    /// Under the flock: the first slot that is free or whose process is gone, now ours.
    fn claim_slot(&self) -> Option<usize> {
        for s in 0..BUDGET_SLOTS_MAX {
            let pid = self.pid_of(s).load(Ordering::Acquire);
            if pid == 0 || !alive(pid) {
                self.bytes_of(s).store(0, Ordering::Release);
                self.pid_of(s).store(u64::from(self.pid), Ordering::Release);
                return Some(s);
            }
        }
        None
    }

    /// Under the flock: the total of every live slot, reclaiming the dead ones.
    fn total_reclaiming(&self) -> u64 {
        let mut total = 0u64;
        for s in 0..BUDGET_SLOTS_MAX {
            let pid = self.pid_of(s).load(Ordering::Acquire);
            if pid == 0 {
                continue;
            }
            if Some(s) != self.slot && !alive(pid) {
                self.bytes_of(s).store(0, Ordering::Release);
                self.pid_of(s).store(0, Ordering::Release);
                continue;
            }
            total = total.saturating_add(self.bytes_of(s).load(Ordering::Acquire));
        }
        total
    }
}

/// Whether process `pid` exists (a pid that does not fit is taken as gone: no process has it).
fn alive(pid: u64) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

impl Budget for FileBudget {
    fn try_charge(&self, bytes: u64) -> bool {
        let charged = self.charge_in_file(bytes);
        self.tally.charge(charged)
    }

    fn charge_anyway(&self, bytes: u64) {
        self.tally.forced();
        if let Some(s) = self.slot {
            self.bytes_of(s).fetch_add(bytes, Ordering::AcqRel);
        }
    }

    fn refund(&self, bytes: u64) {
        if let Some(s) = self.slot {
            sub_saturating(self.bytes_of(s), bytes);
        }
    }

    fn usage(&self) -> BudgetUsage {
        // Without the lock: a look, not a charge. Slots of processes that are gone (a daemon
        // ends without clearing its slot when it exits) are left for the next charge to
        // reclaim, and not counted.
        let used = (0..BUDGET_SLOTS_MAX)
            .filter(|&s| {
                let pid = self.pid_of(s).load(Ordering::Acquire);
                pid != 0 && (Some(s) == self.slot || alive(pid))
            })
            .fold(0u64, |t, s| {
                t.saturating_add(self.bytes_of(s).load(Ordering::Acquire))
            });
        let charged = (self.slot).map_or(0, |s| self.bytes_of(s).load(Ordering::Acquire));
        self.tally.usage(self.limit_bytes, used, charged)
    }

    fn refusals(&self) -> u64 {
        self.word(REFUSALS_WORD).load(Ordering::Acquire)
    }
}

impl Drop for FileBudget {
    fn drop(&mut self) {
        if let Some(s) = self.slot {
            if let Ok(_g) = Flock::take(&self.file) {
                self.bytes_of(s).store(0, Ordering::Release);
                self.pid_of(s).store(0, Ordering::Release);
            }
        }
        // SAFETY: mapped in `open` with this length; no reference into it outlives `self`.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), FILE_BYTES);
        }
    }
}

/// The file's exclusive `flock`, released at drop.
struct Flock<'a>(&'a File);

impl<'a> Flock<'a> {
    fn take(f: &'a File) -> std::io::Result<Self> {
        loop {
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Flock(f));
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: unlocking a descriptor we own.
        unsafe {
            libc::flock(self.0.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_path(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("ucrypt-budget-{tag}-{}", std::process::id()))
    }

    #[test]
    fn local_budget_refuses_beyond_its_limit() {
        let b = LocalBudget::new(100);
        assert!(b.try_charge(60));
        assert!(!b.try_charge(41), "60 + 41 > 100");
        assert!(b.try_charge(40));
        b.refund(50);
        assert_eq!(b.usage().used_bytes, 50);
        b.charge_anyway(80);
        assert_eq!(b.usage().used_bytes, 130);
        b.refund(1000);
        assert_eq!(b.usage().used_bytes, 0, "refunds never go below zero");
        let u = b.usage();
        assert_eq!((u.refused_charges, u.forced_charges), (1, 1));
    }

    /// Two budgets on one file see each other's charges; a slot whose process is gone is
    /// reclaimed by the next charge.
    #[test]
    fn file_budgets_share_one_total_and_reclaim_dead_slots() {
        let path = temp_path("share");
        let _ = std::fs::remove_file(&path);
        // Two openers in one process get a slot each, as two processes would.
        let a = FileBudget::open(&path, 1000).unwrap();
        let b = FileBudget::open(&path, 1000).unwrap();
        assert_ne!(a.slot, b.slot);
        assert!(a.try_charge(600));
        assert!(!b.try_charge(500), "600 + 500 > 1000");
        assert!(b.try_charge(400));
        assert_eq!(a.usage().used_bytes, 1000);
        assert_eq!(a.usage().charged_bytes, 600);
        assert_eq!(b.usage().charged_bytes, 400);
        a.refund(600);
        assert!(b.try_charge(500));
        b.refund(900);
        // Each holder counts its own refusals; the file counts everyone's, for every holder to
        // see.
        assert_eq!(
            (a.usage().refused_charges, b.usage().refused_charges),
            (0, 1)
        );
        assert_eq!((a.refusals(), b.refusals()), (1, 1));
        b.charge_anyway(1);
        b.refund(1);
        assert_eq!(b.usage().forced_charges, 1);
        // A dead process's slot: a pid that no process has (beyond pid_max's ceiling).
        let dead = 3usize;
        a.pid_of(dead).store(1 << 23, Ordering::Release);
        a.bytes_of(dead).store(900, Ordering::Release);
        assert_eq!(a.usage().used_bytes, 0, "a dead slot is not counted");
        assert!(a.try_charge(500), "the dead slot's 900 was reclaimed");
        assert_eq!(a.pid_of(dead).load(Ordering::Acquire), 0);
        assert_eq!(a.usage().used_bytes, 500);
        drop(b);
        drop(a);
        // A new opener finds the slots free again.
        let c = FileBudget::open(&path, 10).unwrap();
        assert_eq!(c.usage().used_bytes, 0);
        assert!(!c.try_charge(11));
        assert_eq!(c.refusals(), 2, "kept in the file");
        drop(c);
        let _ = std::fs::remove_file(&path);
    }
}
