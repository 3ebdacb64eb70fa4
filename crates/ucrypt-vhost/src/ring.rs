//! A queue's small reads and writes in flight on the queue's own thread, through an io_uring
//! of its own.
//!
//! The volume's calls are synchronous, so without this a queue with many requests waiting
//! hands each to a worker thread ([`crate::inflight`]), and every request costs two thread
//! wake-ups beside its I/O. Here the queue's thread asks the volume where each request's
//! ciphertext lies (`BlockDev::read_direct`, `write_direct`), queues the file I/O on the ring
//! (a write's data sealed first, from guest memory into the slot's buffer), and, as each
//! completes, finishes it (a read decrypted from the slot's buffer into guest memory) and
//! returns it to the used ring, in its place in the queue's order like any other request. The
//! slots' buffers are private to the backend and hold ciphertext only.
//!
//! Limits: at most [`INFLIGHT_PER_QUEUE_MAX`] requests in flight (one buffer each, of up to
//! [`RING_IO_BYTES_MAX`]); the ring's submission queue holds as many. Where io_uring cannot
//! be set up (a kernel without it, or a sandbox that forbids it), [`Ring::new`] says so and the
//! queue hands its requests to workers.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use io_uring::{opcode, types, IoUring};

use crate::inflight::INFLIGHT_PER_QUEUE_MAX;
use crate::request::Bounce;

/// Reads and writes of at most this many bytes go through the ring; larger ones go to the
/// workers, where the volume can split their crypto across idle cores.
pub const RING_IO_BYTES_MAX: usize = 64 << 10;
/// Submission queue entries: one per request in flight.
const RING_ENTRIES: u32 = INFLIGHT_PER_QUEUE_MAX as u32;

/// A queue's ring and the buffers of its reads in flight.
pub struct Ring {
    ring: IoUring,
    bufs: Vec<Bounce>,
    /// Each slot's read length.
    lens: Vec<usize>,
    /// Slots free for a read (indices into `bufs`).
    free: Vec<usize>,
}

impl Ring {
    /// A ring, or `None` where the kernel refuses one.
    pub fn new() -> Option<Ring> {
        let ring = IoUring::new(RING_ENTRIES).ok()?;
        Some(Ring {
            ring,
            bufs: (0..INFLIGHT_PER_QUEUE_MAX)
                .map(|_| Bounce::default())
                .collect(),
            lens: vec![0; INFLIGHT_PER_QUEUE_MAX],
            free: (0..INFLIGHT_PER_QUEUE_MAX).rev().collect(),
        })
    }

    /// Slots taken and not yet reaped or given back.
    pub fn in_flight(&self) -> usize {
        INFLIGHT_PER_QUEUE_MAX - self.free.len()
    }

    /// Takes a free slot for a request of `len` bytes: the slot and its buffer (page-aligned),
    /// or `None` when every slot is taken. The slot is the caller's until it is reaped after
    /// [`Ring::read`] or [`Ring::write`] queued its I/O, or given back with [`Ring::give_back`].
    pub fn take(&mut self, len: usize) -> Option<(usize, &mut [u8])> {
        assert!(len <= RING_IO_BYTES_MAX, "a ring request of {len} bytes");
        let slot = self.free.pop()?;
        self.lens[slot] = len;
        Some((slot, self.bufs[slot].get(len)))
    }

    /// Gives back a slot taken and not used.
    pub fn give_back(&mut self, slot: usize) {
        debug_assert!(!self.free.contains(&slot), "slot {slot} given back twice");
        self.free.push(slot);
    }

    /// Queues a read of `fd` at `offset` into `slot`'s buffer (submitted at the next
    /// [`Ring::wait`]); false if the submission queue refused it (the slot is still taken).
    pub fn read(&mut self, slot: usize, fd: BorrowedFd<'_>, offset: u64) -> bool {
        let len = self.lens[slot];
        let buf = self.bufs[slot].get(len);
        let entry = opcode::Read::new(types::Fd(fd.as_raw_fd()), buf.as_mut_ptr(), len as u32)
            .offset(offset)
            .build()
            .user_data(slot as u64);
        self.push(&entry)
    }

    /// Queues a write of `slot`'s buffer to `fd` at `offset`, with `RWF_DSYNC` if `dsync`; as
    /// [`Ring::read`].
    pub fn write(&mut self, slot: usize, fd: BorrowedFd<'_>, offset: u64, dsync: bool) -> bool {
        let len = self.lens[slot];
        let buf = self.bufs[slot].get(len);
        let flags = if dsync { libc::RWF_DSYNC } else { 0 };
        let entry = opcode::Write::new(types::Fd(fd.as_raw_fd()), buf.as_ptr(), len as u32)
            .offset(offset)
            .rw_flags(flags)
            .build()
            .user_data(slot as u64);
        self.push(&entry)
    }

    fn push(&mut self, entry: &io_uring::squeue::Entry) -> bool {
        // SAFETY: the entry's buffer is its slot's, grown to the slot's length by `take`, and
        // is neither touched nor regrown until the slot's completion is reaped (the slot is
        // off the free list till then), nor freed before it: `Drop` waits for every request in
        // flight. The descriptor is the volume's backing file, held open by the volume's
        // `DirectRead` or `DirectWrite`, which the caller keeps until it reaps the slot.
        unsafe { self.ring.submission().push(entry) }.is_ok()
    }

    /// Submits what was queued and waits until at least one read completed.
    pub fn wait(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(1) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r.map(drop),
            }
        }
    }

    /// Calls `done` with each completed request's slot, its result (bytes read or written, or
    /// the error) and its buffer, and frees the slot.
    pub fn reap(&mut self, mut done: impl FnMut(usize, io::Result<usize>, &mut [u8])) {
        loop {
            let Some(cqe) = self.ring.completion().next() else {
                return;
            };
            let slot = cqe.user_data() as usize;
            if slot >= self.bufs.len() || self.free.contains(&slot) {
                continue;
            }
            let res = cqe.result();
            let res = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else {
                Ok(res as usize)
            };
            done(slot, res, self.bufs[slot].get(self.lens[slot]));
            self.free.push(slot);
        }
    }
}

impl Drop for Ring {
    /// The kernel may still use a buffer whose I/O was queued: wait for every one.
    fn drop(&mut self) {
        while self.in_flight() > 0 {
            if self.wait().is_err() {
                // The ring is unusable; keep the buffers rather than free memory the kernel
                // may still write.
                std::mem::forget(std::mem::take(&mut self.bufs));
                return;
            }
            self.reap(|_, _, _| {});
        }
    }
}
