//! [`Task`]: one run of encryption sectors with the buffers its crypto and I/O use, as the
//! volume hands it to its own thread or to a worker.

use super::plan::SectorRange;
use crate::blockdev::SharedRun;

/// What a task runs on: the encryption sectors, where their ciphertext is (or goes), and for
/// writes where the plaintext comes from. Raw pointers because chunks of one caller's buffers
/// go to worker threads; the caller waits for all of them before its buffers go away.
#[derive(Clone, Copy)]
pub(crate) struct Task {
    pub write: bool,
    pub sectors: SectorRange,
    /// Ciphertext for exactly `sectors` (`sectors.len() << shift` bytes); reads decrypt it in
    /// place, so for reads it ends up holding plaintext.
    pub buf: *mut u8,
    /// Writes: plaintext to encrypt into `buf`; null = `buf` already holds the plaintext.
    pub src: *const u8,
    /// Reads: where the plaintext goes, decrypted out of `buf` (which then holds only
    /// ciphertext); null = decrypted in place in `buf`.
    pub out: *mut u8,
    /// Also do the backend I/O (read before decrypting / write after encrypting).
    pub io: bool,
    /// Writes: the backend write must be durable when it completes (FUA).
    pub fua: bool,
    /// The caller's buffer as runs of shared memory ([`Runs`]), when it is not one range:
    /// writes encrypt from it, reads decrypt into it (`src` and `out` are then null).
    pub runs: Runs,
}

/// A task's view of a caller's buffer held as runs: the table, and how far into the
/// request's bytes the task starts. Every run is a whole number of encryption sectors, so a
/// sector never straddles two runs. Empty: the task has no runs. Counts are 32-bit, which
/// keeps a [`Task`] small on every job queue: a request of runs is at most
/// [`RUNS_BYTES_MAX`] long.
#[derive(Clone, Copy)]
pub(crate) struct Runs {
    table: *const SharedRun,
    count: u32,
    skip: u32,
}

/// Longest request whose buffer a task carries as runs, bytes (and most runs in one).
pub(crate) const RUNS_BYTES_MAX: usize = u32::MAX as usize;

impl Runs {
    /// No runs: the task's `src` / `out` say where the caller's buffer is.
    pub const NONE: Runs = Runs {
        table: std::ptr::null(),
        count: 0,
        skip: 0,
    };

    /// The runs of `table`, from `skip` bytes into them. The request is at most
    /// [`RUNS_BYTES_MAX`] long (its caller checks).
    pub fn of(table: &[SharedRun], skip: usize) -> Runs {
        let (Ok(count), Ok(skip)) = (u32::try_from(table.len()), u32::try_from(skip)) else {
            panic!("a request of runs longer than RUNS_BYTES_MAX");
        };
        Runs {
            table: table.as_ptr(),
            count,
            skip,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Pieces of the runs covering `len` bytes from the task's start, in order: (pointer,
    /// bytes). Stops early if the table is shorter.
    ///
    /// # Safety
    /// The table must still be alive (the caller waits for every task made from it).
    pub unsafe fn pieces(&self, len: usize) -> impl Iterator<Item = (*mut u8, usize)> + '_ {
        let table: &[SharedRun] = if self.count == 0 {
            &[]
        } else {
            // SAFETY: the caller's contract: the table, `count` runs long, outlives the task.
            unsafe { std::slice::from_raw_parts(self.table, self.count as usize) }
        };
        let (mut skip, mut left) = (self.skip as usize, len);
        table.iter().filter_map(move |r| {
            if skip >= r.len {
                skip -= r.len;
                return None;
            }
            if left == 0 {
                return None;
            }
            let n = (r.len - skip).min(left);
            // SAFETY: `skip < r.len`, so the pointer stays inside the run.
            let p = unsafe { r.ptr.add(skip) };
            skip = 0;
            left -= n;
            Some((p, n))
        })
    }
}

// SAFETY: a Task is a view of buffers owned by a caller that blocks until every task made from
// them has completed; disjoint chunks never overlap, so no two threads write the same bytes of
// memory the process owns. Runs of shared memory may overlap (a guest may name one page twice):
// two threads may then store plaintext into the same bytes, which `SharedRun::new` allows.
unsafe impl Send for Task {}

impl Task {
    /// The part of this task covering `sub`, which must lie inside `self.sectors`.
    pub fn sub(&self, sub: SectorRange, shift: u32) -> Task {
        // The pointer arithmetic below is in bounds only for a sub-range: checked always (once
        // per chunk, not per sector).
        assert!(
            self.sectors.first <= sub.first && sub.first <= sub.end && sub.end <= self.sectors.end,
            "chunk {sub:?} outside its task {:?}",
            self.sectors
        );
        let off = ((sub.first - self.sectors.first) << shift) as usize;
        Task {
            sectors: sub,
            // SAFETY: `sub` lies inside `self.sectors` (asserted above), so `off` is within the
            // buffer, which covers all of `self.sectors`.
            buf: unsafe { self.buf.add(off) },
            src: if self.src.is_null() {
                self.src
            } else {
                // SAFETY: as above; a non-null src covers the same sectors.
                unsafe { self.src.add(off) }
            },
            out: if self.out.is_null() {
                self.out
            } else {
                // SAFETY: as above; a non-null out covers the same sectors.
                unsafe { self.out.add(off) }
            },
            runs: Runs {
                // Within the request, which is at most `RUNS_BYTES_MAX` long.
                skip: self.runs.skip + off as u32,
                ..self.runs
            },
            ..*self
        }
    }

    /// Bytes the task's buffers cover.
    pub fn bytes(&self, shift: u32) -> usize {
        (self.sectors.len() << shift) as usize
    }
}
