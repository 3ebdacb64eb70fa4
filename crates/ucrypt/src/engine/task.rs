//! [`Task`]: one run of encryption sectors with the buffers its crypto and I/O use, as the
//! volume hands it to its own thread or to a worker.

use super::plan::SectorRange;

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
}

// SAFETY: a Task is a view of buffers owned by a caller that blocks until every task made from
// them has completed; disjoint chunks never overlap, so no two threads write the same bytes.
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
            ..*self
        }
    }

    /// Bytes the task's buffers cover.
    pub fn bytes(&self, shift: u32) -> usize {
        (self.sectors.len() << shift) as usize
    }
}
