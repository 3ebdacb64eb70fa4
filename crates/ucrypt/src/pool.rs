//! Bounce buffers: one aligned arena, allocated once, handed out in page-granular grants.
//!
//! Rules that keep it bounded and deadlock-free:
//! - The arena is allocated once (`pool_bytes`, rounded up to whole pages) and never grows.
//! - A request takes everything it needs for one piece in ONE call ([`BufferPool::take`]) and
//!   never asks for more while holding a grant, so two requests can never each hold half of
//!   what the other needs.
//! - A request bigger than the pool is cut into pieces of at most [`BufferPool::capacity`]
//!   bytes by the planner; `take` refuses anything bigger (that would wait forever).
//! - Waiters are served first come, first served (a ticket queue): a big request is not starved
//!   by a stream of small ones, and since every holder releases without waiting for anything
//!   else, the head of the queue is always eventually served.
//! - A release wakes only the head of the queue, and only if its request fits; the head, once
//!   served, wakes the next in the same way. Waking every waiter on each release (a condition
//!   variable's `notify_all`) made 64 writers of 1 MiB against a 16 MiB pool switch context
//!   ~48 times per release for one thread's progress, which on 2 cores halved throughput.
//! - Grants are zeroised on release, unless their holder declared that they only ever held
//!   ciphertext ([`Grant::held_only_ciphertext`]: it is on the disk anyway, and wiping 1 MiB
//!   costs a third of encrypting it). So a fresh grant holds zeroes or old ciphertext, never
//!   plaintext; nobody may assume it is zero.
//!
//! The arena is page-aligned (O_DIRECT), locked in memory and excluded from core dumps where the
//! kernel allows (best effort, like secrets).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};
use std::thread::Thread;

use crate::sync::{lock, PAGE_BYTES};
use crate::{Error, Result};

/// Buffers are handed out in pages: the alignment O_DIRECT needs on every device seen so far.
pub const POOL_PAGE_BYTES: usize = PAGE_BYTES;
/// Default bounce memory per volume: 16 concurrent 1 MiB requests, or 4096 4 KiB ones.
pub const POOL_BYTES_DEFAULT: usize = 16 << 20;
/// Refuse silly configurations (a typo adding zeroes) rather than pin gigabytes.
pub const POOL_BYTES_MAX: usize = 1 << 30;
/// Waiter slots reserved up front (the queue grows past it, once, if more threads wait).
const WAITERS_RESERVED: usize = 64;

pub struct BufferPool {
    base: NonNull<u8>,
    pages: usize,
    state: Mutex<State>,
}

struct State {
    /// One bit per page; set = in use.
    used: Vec<u64>,
    free_pages: usize,
    next_ticket: u64,
    serving: u64,
    /// Callers waiting in line, in ticket order (each queues itself in the same critical
    /// section that gave it its ticket, so the front is always the ticket being served).
    waiters: VecDeque<Waiter>,
}

struct Waiter {
    ticket: u64,
    pages: usize,
    thread: Thread,
}

impl State {
    /// The head of the line if its request fits in the free pages now: the one thread worth
    /// waking (it may still find the free pages fragmented and wait again).
    fn head_that_fits(&self) -> Option<Thread> {
        self.waiters
            .front()
            .filter(|w| w.ticket == self.serving && w.pages <= self.free_pages)
            .map(|w| w.thread.clone())
    }
}

// SAFETY: the arena is owned by the pool; disjoint page ranges are handed to one grant each
// under the mutex, so no two threads ever get the same bytes.
unsafe impl Send for BufferPool {}
// SAFETY: as above; shared access only hands out disjoint grants.
unsafe impl Sync for BufferPool {}

/// A run of pool pages owned by one request; zeroised and returned on drop.
pub struct Grant<'a> {
    pool: &'a BufferPool,
    first_page: usize,
    pages: usize,
    len: usize,
    wipe: bool,
}

impl BufferPool {
    /// Allocates the arena: `bytes` rounded up to whole pages (at least one).
    pub fn new(bytes: usize) -> Result<Self> {
        if bytes > POOL_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "buffer pool of {bytes} bytes exceeds the limit of {POOL_BYTES_MAX}"
            )));
        }
        let pages = bytes.div_ceil(POOL_PAGE_BYTES).max(1);
        let layout = Layout::from_size_align(pages * POOL_PAGE_BYTES, POOL_PAGE_BYTES)
            .map_err(|_| Error::Bug("pool layout"))?;
        // SAFETY: non-zero size layout.
        let raw = unsafe { alloc_zeroed(layout) };
        let base = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: our own page-aligned allocation; both calls are advisory and may fail
        // (RLIMIT_MEMLOCK) without harm.
        unsafe {
            libc::madvise(raw.cast(), layout.size(), libc::MADV_DONTDUMP);
            libc::mlock(raw.cast(), layout.size());
        }
        Ok(BufferPool {
            base,
            pages,
            state: Mutex::new(State {
                used: vec![0; pages.div_ceil(64)],
                free_pages: pages,
                next_ticket: 0,
                serving: 0,
                waiters: VecDeque::with_capacity(WAITERS_RESERVED),
            }),
        })
    }

    /// The largest grant ever possible, in bytes.
    pub fn capacity(&self) -> usize {
        self.pages * POOL_PAGE_BYTES
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a bitmap updated in single steps; a panic elsewhere cannot corrupt it.
        lock(&self.state)
    }

    /// Takes `len` bytes (rounded up to pages) as one contiguous buffer (holding zeroes or old
    /// ciphertext, never old plaintext), waiting
    /// in line while the pool is short. `len` must be at most [`Self::capacity`].
    pub fn take(&self, len: usize) -> Result<Grant<'_>> {
        let pages = len.div_ceil(POOL_PAGE_BYTES).max(1);
        if pages > self.pages {
            return Err(Error::Bug(
                "buffer request larger than the pool (planner must split)",
            ));
        }
        let mut st = self.lock();
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        let mut queued = false;
        loop {
            if st.serving == ticket && st.free_pages >= pages {
                if let Some(first) = find_run(&st.used, self.pages, pages) {
                    // Grants turn `first_page` into pointer offsets: the run must lie inside
                    // the arena (checked once per grant).
                    assert!(first + pages <= self.pages, "pool run beyond the arena");
                    for p in first..first + pages {
                        st.used[p / 64] |= 1 << (p % 64);
                    }
                    st.free_pages -= pages;
                    st.serving += 1;
                    if queued {
                        let me = st.waiters.pop_front();
                        debug_assert_eq!(me.map(|w| w.ticket), Some(ticket));
                    }
                    let next = st.head_that_fits();
                    drop(st);
                    // The next in line may fit too.
                    if let Some(t) = next {
                        t.unpark();
                    }
                    return Ok(Grant {
                        pool: self,
                        first_page: first,
                        pages,
                        len,
                        wipe: true,
                    });
                }
            }
            if !queued {
                st.waiters.push_back(Waiter {
                    ticket,
                    pages,
                    thread: std::thread::current(),
                });
                queued = true;
            }
            drop(st);
            // Returns when a release or the previous head unparks this thread (or spuriously,
            // or at once for a token left by an earlier wake-up): the loop checks again.
            std::thread::park();
            st = self.lock();
        }
    }

    /// Pages currently free (for tests and stats).
    pub fn free_bytes(&self) -> usize {
        self.lock().free_pages * POOL_PAGE_BYTES
    }
}

/// First run of `n` clear bits among the first `total` bits.
fn find_run(used: &[u64], total: usize, n: usize) -> Option<usize> {
    let mut start = 0usize;
    let mut run = 0usize;
    let mut p = 0usize;
    while p < total {
        let word = used[p / 64];
        if p % 64 == 0 && word == u64::MAX {
            p += 64;
            run = 0;
            start = p;
            continue;
        }
        if word & (1 << (p % 64)) == 0 {
            if run == 0 {
                start = p;
            }
            run += 1;
            if run == n {
                return Some(start);
            }
        } else {
            run = 0;
        }
        p += 1;
    }
    None
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        let size = self.pages * POOL_PAGE_BYTES;
        // SAFETY: allocated in `new` with this exact layout; no grant outlives the pool (grants
        // borrow it).
        unsafe {
            std::ptr::write_bytes(self.base.as_ptr(), 0, size);
            libc::munlock(self.base.as_ptr().cast(), size);
            dealloc(
                self.base.as_ptr(),
                Layout::from_size_align_unchecked(size, POOL_PAGE_BYTES),
            );
        }
    }
}

impl Grant<'_> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: first_page < pool.pages, so the offset stays inside the arena.
        unsafe {
            self.pool
                .base
                .as_ptr()
                .add(self.first_page * POOL_PAGE_BYTES)
        }
    }

    /// The holder promises this buffer never held plaintext (e.g. it only received the output
    /// of a successful `encrypt_to`): it need not be wiped on release.
    pub fn held_only_ciphertext(&mut self) {
        self.wipe = false;
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: these pages belong to this grant alone until it is dropped.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }
}

impl Drop for Grant<'_> {
    fn drop(&mut self) {
        // Zeroise what this grant could have written. A plain memset cannot be optimised away:
        // the pool keeps the memory alive and later hands it out again.
        if self.wipe {
            self.as_mut_slice().fill(0);
        }
        let mut st = self.pool.lock();
        for p in self.first_page..self.first_page + self.pages {
            st.used[p / 64] &= !(1 << (p % 64));
        }
        st.free_pages += self.pages;
        let next = st.head_that_fits();
        drop(st);
        if let Some(t) = next {
            t.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn grants_are_aligned_zeroed_disjoint_and_bounded() {
        let pool = BufferPool::new(4 * POOL_PAGE_BYTES).unwrap();
        let mut a = pool.take(1).unwrap();
        let mut b = pool.take(2 * POOL_PAGE_BYTES).unwrap();
        assert_eq!(a.as_mut_ptr() as usize % POOL_PAGE_BYTES, 0);
        assert_eq!(b.as_mut_ptr() as usize % POOL_PAGE_BYTES, 0);
        assert_ne!(a.as_mut_ptr(), b.as_mut_ptr());
        b.as_mut_slice().fill(7);
        assert_eq!(pool.free_bytes(), POOL_PAGE_BYTES);
        drop(b);
        let mut c = pool.take(3 * POOL_PAGE_BYTES).unwrap();
        assert!(
            c.as_mut_slice().iter().all(|&x| x == 0),
            "released grant was not zeroised"
        );
        drop((a, c));
        assert_eq!(pool.free_bytes(), 4 * POOL_PAGE_BYTES);
        assert!(
            pool.take(5 * POOL_PAGE_BYTES).is_err(),
            "oversized grant must be refused"
        );
    }

    #[test]
    fn waiters_get_served_in_order_without_deadlock() {
        // Many threads asking for random sizes up to the whole pool: all finish.
        let pool = Arc::new(BufferPool::new(8 * POOL_PAGE_BYTES).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let pages = 1 + (t * 7 + i * 3) % 8;
                        let mut g = pool.take(pages * POOL_PAGE_BYTES).unwrap();
                        g.as_mut_slice()[0] = 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(pool.free_bytes(), 8 * POOL_PAGE_BYTES);
    }
}
