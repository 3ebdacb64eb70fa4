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
//!   else, the head of the queue is always eventually served. A newcomer passes the line only
//!   when what it takes leaves every waiter's pages free (it delays nobody).
//! - A release wakes only the head of the queue, and only if its request fits; the head, once
//!   served, wakes the next in the same way. Waking every waiter on each release (a condition
//!   variable's `notify_all`) would have 64 writers of 1 MiB against a 16 MiB pool switch
//!   context dozens of times per release for one thread's progress, only the head being able
//!   to go on.
//! - A request that may be done in parts (an aligned write: each part is encrypted and written
//!   on its own) asks for its fair share ([`BufferPool::take_share`]): the pool's capacity
//!   divided among everyone holding or waiting for a grant, so that as many writers as the pool
//!   holds at a sixty-fourth each go on without waiting. If every writer asked for a whole
//!   piece, 64 writers of 1 MiB against a 16 MiB pool would take turns one write each (a
//!   first-come-first-served line), so each write would start with its data evicted from the
//!   caches by the 63 before it, and cost more CPU per MiB than the same writes without the
//!   pool (BENCHMARKS.md, "Large writes at depth").
//! - Grants are zeroised on release, unless their holder declared that they only ever held
//!   ciphertext ([`Grant::held_only_ciphertext`]: it is on the disk anyway, and wiping 1 MiB
//!   is a sizeable fraction of encrypting it). So a fresh grant holds zeroes or old
//!   ciphertext, never plaintext; nobody may assume it is zero.
//!
//! The arena is an anonymous mapping: page-aligned (O_DIRECT), zeroed by the kernel, locked in
//! memory and excluded from core dumps where the kernel allows (best effort, like secrets). It
//! is not wiped at the pool's drop: its grants were, and its pages go back to the kernel.

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
    /// Grants not yet released (for the fair share).
    holders: usize,
    /// The ticket of the next caller to queue (tickets only name waiters).
    next_ticket: u64,
    /// Callers waiting in line, in ticket order: the front is served next.
    waiters: VecDeque<Waiter>,
    /// The pages all waiters ask for together: a newcomer passes the line only if what it
    /// takes leaves at least this many free.
    waiting_pages: usize,
    /// The head of the line found enough free pages but not in one run: until it is served,
    /// nobody passes the line (a stream of passers could otherwise keep the free pages
    /// fragmented and the head waiting).
    head_stuck: bool,
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
            .filter(|w| w.pages <= self.free_pages)
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
        let size = pages * POOL_PAGE_BYTES;
        // An anonymous mapping: its pages come zeroed from the kernel (once, as `mlock` below
        // or the first touch faults them in), page-aligned, and go back to it at the drop.
        // An allocator's zeroed allocation of this alignment is a memset over pages that the
        // kernel has just zeroed: a second pass over the arena (with the wipe the drop made,
        // two of three).
        // SAFETY: a new private anonymous mapping (no file, no fixed address) aliases nothing.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::Io {
                context: format!("mapping a buffer pool of {size} bytes"),
                source: std::io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(raw.cast::<u8>()).ok_or(Error::Bug("mmap returned null"))?;
        assert_eq!(
            raw as usize % POOL_PAGE_BYTES,
            0,
            "a mapping starts on a page"
        );
        // SAFETY: our own page-aligned mapping; both calls are advisory and may fail
        // (RLIMIT_MEMLOCK) without harm.
        unsafe {
            libc::madvise(raw, size, libc::MADV_DONTDUMP);
            libc::mlock(raw, size);
        }
        Ok(BufferPool {
            base,
            pages,
            state: Mutex::new(State {
                used: vec![0; pages.div_ceil(64)],
                free_pages: pages,
                holders: 0,
                next_ticket: 0,
                waiting_pages: 0,
                head_stuck: false,
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
    /// ciphertext, never old plaintext), waiting in line while the pool is short. `len` must be
    /// at most [`Self::capacity`].
    pub fn take(&self, len: usize) -> Result<Grant<'_>> {
        self.take_as(Ask::Exactly(len))
    }

    /// Takes the first part of a `want`-byte job that can be done in parts: `want` bytes if
    /// they are within the fair share (the capacity divided among the grants held, the callers
    /// waiting and this one), else the fair share (at least `min`), evened out over the parts,
    /// a multiple of `unit` (a power of two; the grant's `len` says how much). Waits in line
    /// like [`Self::take`]. `want` must be a multiple of `unit` and at most the capacity.
    pub fn take_share(&self, want: usize, unit: usize, min: usize) -> Result<Grant<'_>> {
        self.take_as(Ask::Share { want, unit, min })
    }

    fn take_as(&self, ask: Ask) -> Result<Grant<'_>> {
        let capacity = self.capacity();
        let mut st = self.lock();
        let len = match ask {
            Ask::Exactly(len) => len,
            Ask::Share { want, unit, min } => {
                let users = st.holders + st.waiters.len();
                share_bytes(want, unit, min, capacity, users)
            }
        };
        let pages = len.div_ceil(POOL_PAGE_BYTES).max(1);
        if pages > self.pages {
            return Err(Error::Bug(
                "buffer request larger than the pool (planner must split)",
            ));
        }
        // Some(ticket) once in line.
        let mut ticket = None;
        loop {
            let fits = match ticket {
                // A newcomer takes at once if that delays no waiter: every waiter's pages stay
                // free. Queueing behind a line that the pool could serve together with it
                // made a line, once formed, last for as long as requests kept coming (each
                // served waiter must first be scheduled): a convoy.
                None => !st.head_stuck && st.free_pages >= st.waiting_pages + pages,
                Some(t) => {
                    st.waiters.front().map(|w| w.ticket) == Some(t) && st.free_pages >= pages
                }
            };
            if fits {
                if let Some(first) = find_run(&st.used, self.pages, pages) {
                    // Grants turn `first_page` into pointer offsets: the run must lie inside
                    // the arena (checked once per grant).
                    assert!(first + pages <= self.pages, "pool run beyond the arena");
                    mark(&mut st.used, first, pages, true);
                    st.free_pages -= pages;
                    st.holders += 1;
                    if ticket.is_some() {
                        let me = st.waiters.pop_front();
                        debug_assert_eq!(me.map(|w| w.ticket), ticket);
                        st.waiting_pages -= pages;
                        st.head_stuck = false;
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
                if ticket.is_some() {
                    st.head_stuck = true;
                }
            }
            if ticket.is_none() {
                let t = st.next_ticket;
                st.next_ticket += 1;
                st.waiters.push_back(Waiter {
                    ticket: t,
                    pages,
                    thread: std::thread::current(),
                });
                st.waiting_pages += pages;
                ticket = Some(t);
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

/// What a caller asks of [`BufferPool::take_as`].
#[derive(Clone, Copy)]
enum Ask {
    Exactly(usize),
    Share {
        want: usize,
        unit: usize,
        min: usize,
    },
}

/// The bytes to take now of a `want`-byte job done in parts, when `others` grants are held or
/// waited for in a pool of `capacity` bytes (see [`BufferPool::take_share`]): all of it within
/// the fair share `capacity / (others + 1)` (or `min`, whichever is more); else that many
/// bytes, evened out over the parts it takes, rounded up to whole `unit`s and pages.
fn share_bytes(want: usize, unit: usize, min: usize, capacity: usize, others: usize) -> usize {
    let share = (capacity / (others + 1)).max(min).max(1);
    if want <= share {
        return want;
    }
    let parts = want.div_ceil(share);
    // Units and pages are powers of two: the larger is a multiple of the smaller.
    let grain = unit.max(POOL_PAGE_BYTES);
    (want.div_ceil(parts).div_ceil(grain) * grain).min(want)
}

/// First run of `n` clear bits among the first `total` bits: a word at a time where the bits
/// allow (a 16 MiB pool has 4096 pages, walked under the pool's lock on every grant).
fn find_run(used: &[u64], total: usize, n: usize) -> Option<usize> {
    let (mut start, mut run, mut p) = (0usize, 0usize, 0usize);
    while p < total {
        // The bits from p to the end of its word (zeroes shifted in beyond it).
        let w = used[p / 64] >> (p % 64);
        let left = (64 - p % 64).min(total - p);
        if w & 1 != 0 {
            p += (w.trailing_ones() as usize).min(left);
            run = 0;
            continue;
        }
        let free = (w.trailing_zeros() as usize).min(left);
        if run == 0 {
            start = p;
        }
        run += free;
        if run >= n {
            return Some(start);
        }
        p += free;
    }
    None
}

/// Sets (`on`) or clears the `n` bits from `first`, a word at a time.
fn mark(used: &mut [u64], first: usize, n: usize, on: bool) {
    let (mut p, end) = (first, first + n);
    while p < end {
        let bits = (64 - p % 64).min(end - p);
        let mask = if bits == 64 {
            u64::MAX
        } else {
            ((1u64 << bits) - 1) << (p % 64)
        };
        if on {
            used[p / 64] |= mask;
        } else {
            used[p / 64] &= !mask;
        }
        p += bits;
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        let size = self.pages * POOL_PAGE_BYTES;
        // Not wiped here: every grant wiped its pages at its release unless they held only
        // ciphertext, and the pages go back to the kernel, which zeroes a page before it maps
        // it anywhere again (a grant leaked with `mem::forget` included).
        // SAFETY: mapped in `new` with this size; no grant outlives the pool (grants borrow
        // it).
        unsafe {
            libc::munlock(self.base.as_ptr().cast(), size);
            libc::munmap(self.base.as_ptr().cast(), size);
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
        mark(&mut st.used, self.first_page, self.pages, false);
        st.free_pages += self.pages;
        st.holders -= 1;
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

    /// The word-at-a-time bitmap walk agrees with a bit-by-bit one on random bitmaps.
    #[test]
    fn find_run_and_mark_agree_with_bit_by_bit() {
        fn naive(bits: &[bool], n: usize) -> Option<usize> {
            let mut run = 0;
            for (p, used) in bits.iter().enumerate() {
                run = if *used { 0 } else { run + 1 };
                if run == n {
                    return Some(p + 1 - n);
                }
            }
            None
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..2000 {
            let total = 1 + (rnd() % 300) as usize;
            let mut used = vec![0u64; total.div_ceil(64)];
            let mut bits = vec![false; total];
            // Runs of set bits, marked as grants mark them.
            for _ in 0..(rnd() % 8) {
                let first = (rnd() as usize) % total;
                let n = 1 + (rnd() as usize) % (total - first).min(90);
                mark(&mut used, first, n, true);
                bits[first..first + n].iter_mut().for_each(|b| *b = true);
                if round % 3 == 0 {
                    let f = first + (rnd() as usize) % n;
                    let m = 1 + (rnd() as usize) % (first + n - f);
                    mark(&mut used, f, m, false);
                    bits[f..f + m].iter_mut().for_each(|b| *b = false);
                }
            }
            for (p, b) in bits.iter().enumerate() {
                assert_eq!(used[p / 64] >> (p % 64) & 1 == 1, *b, "bit {p}");
            }
            for n in [1, 2, 3, 63, 64, 65, 100, total] {
                assert_eq!(
                    find_run(&used, total, n),
                    naive(&bits, n),
                    "n {n} bits {bits:?}"
                );
            }
        }
    }

    /// (want, unit, min, capacity, others) -> bytes taken now.
    #[test]
    fn fair_share_table() {
        const K: usize = 1024;
        let rows = [
            // Alone, or few enough to fit: the whole job.
            (1024 * K, 4096, 64 * K, 16384 * K, 0, 1024 * K),
            (1024 * K, 4096, 64 * K, 16384 * K, 15, 1024 * K),
            // 64 writers of 1 MiB in 16 MiB: 16 MiB / 64 = 256 KiB.
            (1024 * K, 4096, 64 * K, 16384 * K, 63, 256 * K),
            // 65: a share of 252 KiB; 1 MiB in 5 parts of 208 KiB (whole pages).
            (1024 * K, 4096, 64 * K, 16384 * K, 64, 208 * K),
            // Never below `min`.
            (1024 * K, 4096, 64 * K, 16384 * K, 10_000, 64 * K),
            // 512-byte sectors still get whole pages.
            (1024 * K, 512, 64 * K, 16384 * K, 63, 256 * K),
            // A job smaller than the page grain is taken whole.
            (2048, 512, 64 * K, 4 * 4096, 100, 2048),
            // A 64 KiB sector: parts stay whole sectors.
            (1024 * K, 64 * K, 4 * K, 16384 * K, 99, 192 * K),
        ];
        for (want, unit, min, cap, others, expect) in rows {
            let got = share_bytes(want, unit, min, cap, others);
            assert_eq!(got, expect, "{want} {unit} {min} {cap} {others}");
            assert!(got <= want && got % unit == 0 && got > 0);
        }
    }

    #[test]
    fn take_share_divides_among_holders() {
        let pool = BufferPool::new(16 * POOL_PAGE_BYTES).unwrap();
        let alone = pool
            .take_share(8 * POOL_PAGE_BYTES, 512, POOL_PAGE_BYTES)
            .unwrap();
        assert_eq!(alone.len(), 8 * POOL_PAGE_BYTES, "alone: all of it");
        let held: Vec<_> = (0..3)
            .map(|_| pool.take(POOL_PAGE_BYTES).unwrap())
            .collect();
        // Four holders and this caller: 16 / 5 = 3 pages, so 8 pages in 3 parts of 3 pages.
        let part = pool
            .take_share(8 * POOL_PAGE_BYTES, 512, POOL_PAGE_BYTES)
            .unwrap();
        assert_eq!(part.len(), 3 * POOL_PAGE_BYTES);
        drop((alone, held, part));
        assert_eq!(pool.free_bytes(), 16 * POOL_PAGE_BYTES);
        assert_eq!(pool.lock().holders, 0);
    }
}
