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
//! The arena is an anonymous mapping, reserved at the start and filled as requests need it:
//! page-aligned (O_DIRECT), zeroed by the kernel, excluded from core dumps where the kernel
//! allows (best effort, like secrets). Memory and locking follow use, so that an idle volume
//! costs little (what it costs: BENCHMARKS.md, "Idle volumes"):
//! - The arena is cut into chunks of [`LOCK_CHUNK_BYTES`]. A grant that lands on a chunk not
//!   yet in use since the last release locks it (`mlock`, which also faults its pages in) before
//!   it is handed out, so the pages that may hold plaintext are locked before they do, and only
//!   those: the pool's locked memory is the high-water mark of its use since it last went idle,
//!   not its bound. A failed `mlock` (RLIMIT_MEMLOCK) leaves the chunk usable, unlocked, and is
//!   counted ([`BufferPool::lock_failures`]).
//! - When no grant has been taken for an idle period ([`POOL_IDLE_RELEASE`]) and none is held,
//!   the pool gives every chunk back (`munlock`, `MADV_DONTNEED`): the kernel drops the pages,
//!   and the next use gets zeroed ones. Nothing needs wiping then: every grant wiped its pages
//!   at its release unless they held only ciphertext. The first chunk, once used, is kept
//!   ([`IDLE_KEPT_BYTES`]): the first small request after an idle period then neither faults
//!   nor locks.
//! - One thread per process (the "reaper") watches the pools that hold memory beyond their kept
//!   chunk and gives it back when they go idle. It runs only while some pool holds such memory:
//!   the grant that makes a pool resident past its kept chunk starts it (or wakes it, a futex
//!   call, when it runs), and it ends once every watched pool has given its memory back, so an
//!   idle process has no reaper thread. Its start (tens of microseconds) falls on a grant that
//!   also locks a fresh chunk, in a busy moment: the first small request after an idle period
//!   fits the kept chunk and starts nothing. One thread for all pools, not one per pool.
//! - Growth allocates nothing from the heap (the chunk bitmap is sized at the start; the pages
//!   are the mapping's own), so the steady state stays allocation-free. Registering a pool
//!   with the reaper may grow its list (once per busy period and pool, and only past the most
//!   pools ever watched at once), outside any steady state: an idle period ended it.
//!
//! Many pools share one memory budget when the process sets one ([`set_process_budget`]; the
//! accounting, across processes too, is in [`budget`]):
//! - A pool charges the budget for each chunk it makes resident beyond its reserve
//!   ([`POOL_RESERVE_BYTES`]) and refunds it when the chunk is given back.
//! - A grant whose chunks the budget refuses is not failed: it waits in line as if the pool
//!   were full, and stops the line (nobody passes it) so that the pool's grants drain. Once the
//!   pool holds no grant, the head of the line takes its pages by first fit from page 0: inside
//!   the reserve if it asks no more than that, which costs the budget nothing; a bigger one is
//!   charged whatever the total (the reserve of a pool that holds nothing is its one oldest
//!   request). So every pool always makes progress, and the budget caps what pools grow to
//!   beyond their reserves.
//! - With a budget, [`BufferPool::piece_bytes_max`] is the reserve: the engine cuts requests
//!   into pieces that fit it, so a volume's pool never needs more than its reserve to go on.
//! - A busy pool keeps the chunks it grew to, so that its requests do not charge the budget
//!   each time, until the budget has refused anyone a charge ([`Budget::refusals`] moved): at
//!   its next look the reaper then gives back the pool's charged chunks that no grant uses,
//!   and the refused pools' next growth finds room. A pool keeps the chunks its grants hold;
//!   so under pressure the budget goes to the requests running, not to the pools that grew
//!   first, and a pool charges at most once per chunk per look (a quarter of its idle
//!   period).
//!
//! The pool is not wiped at its drop: its grants were, and its pages go back to the kernel.

pub mod budget;

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::sync::{lock, PAGE_BYTES};
use crate::{Error, Result};
use budget::{Budget, BudgetUsage};

/// Buffers are handed out in pages: the alignment O_DIRECT needs on every device seen so far.
pub const POOL_PAGE_BYTES: usize = PAGE_BYTES;
/// Default bounce memory per volume: 16 concurrent 1 MiB requests, or 4096 4 KiB ones.
pub const POOL_BYTES_DEFAULT: usize = 16 << 20;
/// Refuse silly configurations (a typo adding zeroes) rather than pin gigabytes.
pub const POOL_BYTES_MAX: usize = 1 << 30;
/// Waiter slots reserved up front (the queue grows past it, once, if more threads wait).
const WAITERS_RESERVED: usize = 64;
/// The unit in which the arena is locked and given back: small enough that the first 4 KiB
/// request after an idle period faults in and locks little (16 pages), big enough that a busy
/// 16 MiB pool makes a few hundred `mlock` calls per busy period, not one per grant.
pub const LOCK_CHUNK_BYTES: usize = 64 << 10;
const CHUNK_PAGES: usize = LOCK_CHUNK_BYTES / POOL_PAGE_BYTES;
const _: () = assert!(LOCK_CHUNK_BYTES % POOL_PAGE_BYTES == 0 && CHUNK_PAGES > 0);
/// What a pool keeps through idle periods once it was used: its first chunk, where the first
/// fit puts small requests, so that the first request after an idle period finds its buffer
/// faulted in and locked (an `mlock` of a chunk costs more than a 4 KiB request), at a cost
/// well inside the goal of 256 KiB locked per idle volume beyond its keys.
pub const IDLE_KEPT_BYTES: usize = LOCK_CHUNK_BYTES;
const KEPT_CHUNKS: usize = IDLE_KEPT_BYTES / LOCK_CHUNK_BYTES;
/// What a pool may hold without charging the process's budget: four chunks, so that a volume
/// under a budget still moves requests in pieces of 256 KiB (a 1 MiB write in four), and
/// within the goal of 256 KiB locked per idle volume beyond its keys.
pub const POOL_RESERVE_BYTES: usize = 4 * LOCK_CHUNK_BYTES;
const RESERVE_CHUNKS: usize = POOL_RESERVE_BYTES / LOCK_CHUNK_BYTES;
const _: () = assert!(RESERVE_CHUNKS >= KEPT_CHUNKS && POOL_RESERVE_BYTES % LOCK_CHUNK_BYTES == 0);
/// How long a pool keeps its memory after its last grant was taken: a request stream with
/// pauses shorter than this never pays for faulting and locking again; a volume left idle
/// gives its memory back after this (up to twice this: the reaper looks once per period).
pub const POOL_IDLE_RELEASE: Duration = Duration::from_secs(5);

/// See the module documentation. The arena and its state live in an `Arc` that the reaper
/// watches (weakly: a dropped pool's arena goes at once, unless the reaper is looking at it).
pub struct BufferPool {
    inner: Arc<Inner>,
}

struct Inner {
    base: NonNull<u8>,
    pages: usize,
    idle: Duration,
    /// What growth beyond the reserve is charged to: the process's budget when the pool was
    /// made, if it had one.
    budget: Option<Arc<dyn Budget>>,
    /// The reaper that watches this pool while it holds memory beyond its kept chunk.
    reaper: &'static Mutex<Reaper>,
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
    /// One bit per chunk; set = resident (locked, or tried to) since the last release.
    resident: Vec<u64>,
    resident_chunks: usize,
    /// Resident chunks beyond the reserve: what this pool has charged its budget.
    charged_chunks: usize,
    /// Times the budget refused a grant's chunks (the grant waited and tried again).
    budget_waits: u64,
    /// Chunks charged whatever the total (a pool holding nothing served a request bigger
    /// than its reserve).
    budget_overdrafts: u64,
    /// Chunks whose `mlock` failed since the pool was made.
    lock_failures: u64,
    /// Grants taken so far: the reaper sees whether any was taken since it last looked.
    taken: u64,
    /// `taken` when the reaper last saw it change, and when.
    seen_taken: u64,
    seen_at: Instant,
    /// In the reaper's list (set by the grant that makes the pool resident).
    watched: bool,
    /// The budget's [`Budget::refusals`] when the reaper last looked.
    refusals_seen: u64,
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
// under the mutex, so no two threads ever get the same bytes; the reaper touches the pages
// (munlock, madvise) only under the mutex with no grant held.
unsafe impl Send for Inner {}
// SAFETY: as above; shared access only hands out disjoint grants.
unsafe impl Sync for Inner {}

/// A run of pool pages owned by one request; zeroised and returned on drop.
pub struct Grant<'a> {
    pool: &'a BufferPool,
    first_page: usize,
    pages: usize,
    len: usize,
    wipe: bool,
}

impl BufferPool {
    /// Reserves the arena: `bytes` rounded up to whole pages (at least one); memory is taken
    /// as grants need it and given back after [`POOL_IDLE_RELEASE`] without grants.
    pub fn new(bytes: usize) -> Result<Self> {
        Self::with_idle_release(bytes, POOL_IDLE_RELEASE)
    }

    /// Like [`Self::new`], giving memory back after `idle` without grants.
    pub fn with_idle_release(bytes: usize, idle: Duration) -> Result<Self> {
        let budget = lock(&PROCESS_BUDGET).clone();
        Self::with_parts(bytes, idle, budget, &REAPER)
    }

    /// Like [`Self::with_idle_release`], charging growth beyond the reserve to `budget`
    /// instead of the process's.
    pub fn with_budget(
        bytes: usize,
        idle: Duration,
        budget: Option<Arc<dyn Budget>>,
    ) -> Result<Self> {
        Self::with_parts(bytes, idle, budget, &REAPER)
    }

    /// Like [`Self::with_idle_release`], watched by `reaper` (the process's one, or a test's).
    #[cfg(test)]
    fn with_reaper(bytes: usize, idle: Duration, reaper: &'static Mutex<Reaper>) -> Result<Self> {
        let budget = lock(&PROCESS_BUDGET).clone();
        Self::with_parts(bytes, idle, budget, reaper)
    }

    fn with_parts(
        bytes: usize,
        idle: Duration,
        budget: Option<Arc<dyn Budget>>,
        reaper: &'static Mutex<Reaper>,
    ) -> Result<Self> {
        if bytes > POOL_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "buffer pool of {bytes} bytes exceeds the limit of {POOL_BYTES_MAX}"
            )));
        }
        let pages = bytes.div_ceil(POOL_PAGE_BYTES).max(1);
        let size = pages * POOL_PAGE_BYTES;
        // An anonymous mapping: its pages come zeroed from the kernel (as a chunk's `mlock` or
        // the first touch faults them in), page-aligned, and go back to it at the drop.
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
        // SAFETY: our own page-aligned mapping; the call is advisory.
        unsafe {
            libc::madvise(raw, size, libc::MADV_DONTDUMP);
        }
        let chunks = pages.div_ceil(CHUNK_PAGES);
        let refusals_seen = budget.as_ref().map_or(0, |b| b.refusals());
        Ok(BufferPool {
            inner: Arc::new(Inner {
                base,
                pages,
                idle,
                budget,
                reaper,
                state: Mutex::new(State {
                    used: vec![0; pages.div_ceil(64)],
                    free_pages: pages,
                    holders: 0,
                    next_ticket: 0,
                    waiting_pages: 0,
                    head_stuck: false,
                    waiters: VecDeque::with_capacity(WAITERS_RESERVED),
                    resident: vec![0; chunks.div_ceil(64)],
                    resident_chunks: 0,
                    charged_chunks: 0,
                    budget_waits: 0,
                    budget_overdrafts: 0,
                    lock_failures: 0,
                    taken: 0,
                    seen_taken: 0,
                    seen_at: Instant::now(),
                    watched: false,
                    refusals_seen,
                }),
            }),
        })
    }

    /// The largest grant ever possible, in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.pages * POOL_PAGE_BYTES
    }

    /// The largest piece a caller should ask for at once: the capacity, or with a budget the
    /// reserve (see the module documentation), so that a pool held to its reserve still
    /// serves every piece without charging.
    pub fn piece_bytes_max(&self) -> usize {
        match self.inner.budget {
            Some(_) => self.capacity().min(POOL_RESERVE_BYTES),
            None => self.capacity(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.lock()
    }

    /// Times the budget refused to let the pool grow for a grant (which waited and tried
    /// again).
    pub fn budget_waits(&self) -> u64 {
        self.lock().budget_waits
    }

    /// Chunks charged beyond the budget by a pool holding nothing (a request bigger than the
    /// reserve).
    pub fn budget_overdrafts(&self) -> u64 {
        self.lock().budget_overdrafts
    }

    /// Bytes resident now (locked, or tried to): the chunks used since the pool last went idle.
    pub fn resident_bytes(&self) -> usize {
        self.lock().resident_chunks * LOCK_CHUNK_BYTES
    }

    /// Chunks whose `mlock` failed (RLIMIT_MEMLOCK): their pages may be swapped out.
    pub fn lock_failures(&self) -> u64 {
        self.lock().lock_failures
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
        if pages > self.inner.pages {
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
            // The budget refused the chunks a run would need.
            let mut refused = false;
            if fits {
                let run = find_run(&st.used, self.inner.pages, pages);
                if let Some(first) = run {
                    if !self.inner.charge_growth(&mut st, first, pages) {
                        refused = true;
                        st.budget_waits += 1;
                    }
                }
                if let Some(first) = run.filter(|_| !refused) {
                    // Grants turn `first_page` into pointer offsets: the run must lie inside
                    // the arena (checked once per grant).
                    assert!(
                        first + pages <= self.inner.pages,
                        "pool run beyond the arena"
                    );
                    mark(&mut st.used, first, pages, true);
                    st.free_pages -= pages;
                    st.holders += 1;
                    st.taken += 1;
                    let watch = self.inner.make_resident(&mut st, first, pages);
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
                    if watch {
                        watch_pool(&self.inner);
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
                // Refused and first in line: stop the line so the pool's grants drain.
                if refused && st.waiters.len() == 1 {
                    st.head_stuck = true;
                }
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

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is bitmaps and counters updated in single steps; a panic elsewhere cannot
        // corrupt it.
        lock(&self.state)
    }

    fn chunk_ptr(&self, chunk: usize) -> (*mut libc::c_void, usize) {
        let first_page = chunk * CHUNK_PAGES;
        let pages = CHUNK_PAGES.min(self.pages - first_page);
        // SAFETY: chunk < chunks, so first_page < self.pages: inside the arena.
        let p = unsafe { self.base.as_ptr().add(first_page * POOL_PAGE_BYTES) };
        (p.cast(), pages * POOL_PAGE_BYTES)
    }

    /// Charges the budget for the chunks under pages `first..first + pages` that are neither
    /// resident nor in the reserve. False if the budget refuses and the pool holds a grant
    /// (which will come back); with none held the charge is made whatever the total.
    fn charge_growth(&self, st: &mut State, first: usize, pages: usize) -> bool {
        let Some(budget) = &self.budget else {
            return true;
        };
        let (c0, c1) = (first / CHUNK_PAGES, (first + pages - 1) / CHUNK_PAGES);
        let new = (c0.max(RESERVE_CHUNKS)..=c1)
            .filter(|&c| st.resident[c / 64] >> (c % 64) & 1 == 0)
            .count();
        if new == 0 {
            return true;
        }
        let bytes = (new * LOCK_CHUNK_BYTES) as u64;
        if !budget.try_charge(bytes) {
            if st.holders != 0 {
                return false;
            }
            budget.charge_anyway(bytes);
            st.budget_overdrafts += new as u64;
        }
        st.charged_chunks += new;
        true
    }

    /// Locks the chunks under pages `first..first + pages` that are not resident yet. Returns
    /// true if the caller must have the reaper watch the pool (marked as watched already).
    fn make_resident(&self, st: &mut State, first: usize, pages: usize) -> bool {
        let (c0, c1) = (first / CHUNK_PAGES, (first + pages - 1) / CHUNK_PAGES);
        // Only a chunk that an idle period gives back needs the reaper.
        let mut releasable = false;
        for c in c0..=c1 {
            if st.resident[c / 64] >> (c % 64) & 1 != 0 {
                continue;
            }
            let (p, len) = self.chunk_ptr(c);
            // SAFETY: a range of our own mapping; `mlock` only faults in and pins it.
            if unsafe { libc::mlock(p, len) } != 0 {
                st.lock_failures += 1;
            }
            st.resident[c / 64] |= 1 << (c % 64);
            st.resident_chunks += 1;
            releasable |= c >= KEPT_CHUNKS;
        }
        if releasable && !st.watched {
            st.watched = true;
            st.seen_taken = st.taken;
            st.seen_at = Instant::now();
            return true;
        }
        false
    }

    /// Gives every resident chunk but the kept ones ([`IDLE_KEPT_BYTES`]) back to the kernel.
    /// Only with no grant held: the pages hold zeroes or ciphertext (grants wiped their
    /// plaintext at their release).
    fn release_all(&self, st: &mut State) {
        debug_assert_eq!(st.holders, 0);
        self.release_where(st, KEPT_CHUNKS, |_, _| true);
        // Charged only with a budget: every chunk beyond the reserve then.
        debug_assert!(self.budget.is_none() || st.charged_chunks == 0);
    }

    /// Gives back the charged chunks (beyond the reserve) that no grant uses now: their pages
    /// hold zeroes or ciphertext (grants wiped their plaintext at their release).
    fn release_unused_charged(&self, st: &mut State) {
        let pages = self.pages;
        self.release_where(st, RESERVE_CHUNKS, |st, c| {
            let first = c * CHUNK_PAGES;
            let end = (first + CHUNK_PAGES).min(pages);
            (first..end).all(|p| st.used[p / 64] >> (p % 64) & 1 == 0)
        });
    }

    /// Gives the resident chunks from `from` on that `pick` takes back to the kernel and
    /// refunds the charged ones (beyond the reserve, with a budget). `pick` must take only
    /// chunks no grant holds.
    fn release_where(&self, st: &mut State, from: usize, pick: impl Fn(&State, usize) -> bool) {
        let mut refund = 0;
        for c in from..self.pages.div_ceil(CHUNK_PAGES) {
            if st.resident[c / 64] >> (c % 64) & 1 == 0 || !pick(st, c) {
                continue;
            }
            let (p, len) = self.chunk_ptr(c);
            // SAFETY: a chunk of our own mapping that no grant holds (`pick`'s contract, under
            // the mutex): dropping its pages loses nothing anyone may read.
            unsafe {
                libc::munlock(p, len);
                libc::madvise(p, len, libc::MADV_DONTNEED);
            }
            st.resident[c / 64] &= !(1 << (c % 64));
            st.resident_chunks -= 1;
            refund += usize::from(c >= RESERVE_CHUNKS);
        }
        if let (Some(b), true) = (&self.budget, refund > 0) {
            debug_assert!(refund <= st.charged_chunks);
            st.charged_chunks -= refund;
            b.refund((refund * LOCK_CHUNK_BYTES) as u64);
        }
    }

    /// The reaper's look at this pool: gives its memory back if no grant has been taken for
    /// its idle period and none is held; gives back its unused charged chunks if the budget
    /// refused anyone a charge since the last look. Returns when to look again (None:
    /// released, stop watching).
    fn look(&self, now: Instant) -> Option<Instant> {
        let mut st = self.lock();
        if st.taken != st.seen_taken {
            st.seen_taken = st.taken;
            st.seen_at = now;
        }
        let due = st.seen_at + self.idle;
        if now >= due && st.holders == 0 && st.waiters.is_empty() {
            self.release_all(&mut st);
            st.watched = false;
            return None;
        }
        if let Some(b) = &self.budget {
            let refusals = b.refusals();
            if refusals != st.refusals_seen {
                st.refusals_seen = refusals;
                self.release_unused_charged(&mut st);
            }
        }
        Some(due.max(now + self.idle / 4))
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

/// The pools holding memory, watched by the process's reaper thread.
struct Reaper {
    pools: Vec<std::sync::Weak<Inner>>,
    /// The reaper thread while it runs (it ends when no pool is watched).
    thread: Option<Thread>,
}

/// The budget every pool made from now on in this process charges (see the module
/// documentation); None: pools grow to their capacity.
static PROCESS_BUDGET: Mutex<Option<Arc<dyn Budget>>> = Mutex::new(None);

/// Sets the budget that pools made from now on charge. One per process: a [`budget::FileBudget`]
/// holds one slot of its file for the whole process.
pub fn set_process_budget(budget: Option<Arc<dyn Budget>>) {
    *lock(&PROCESS_BUDGET) = budget;
}

/// The process budget's numbers, if one is set.
pub fn process_budget_usage() -> Option<BudgetUsage> {
    lock(&PROCESS_BUDGET).as_ref().map(|b| b.usage())
}

static REAPER: Mutex<Reaper> = Mutex::new(Reaper {
    pools: Vec::new(),
    thread: None,
});

/// Has the reaper watch `inner` (just made resident), starting the reaper if it is not
/// running. If it cannot start, the pool keeps its memory (it is still bounded) until a later growth
/// starts it.
fn watch_pool(inner: &Arc<Inner>) {
    let reaper = inner.reaper;
    let mut r = lock(reaper);
    r.pools.push(Arc::downgrade(inner));
    match &r.thread {
        Some(t) => t.unpark(),
        None => {
            let spawned = std::thread::Builder::new()
                .name("ucrypt-pool".into())
                .spawn(move || reap(reaper));
            match spawned {
                Ok(h) => r.thread = Some(h.thread().clone()),
                Err(_) => {
                    r.pools.pop();
                    drop(r);
                    inner.lock().watched = false;
                }
            }
        }
    }
}

/// The reaper thread: looks at every watched pool when it is due, drops the pools that gave
/// their memory back or were dropped, and sleeps until the next is due; it ends when none is
/// watched (under the list's lock, so that the next [`watch_pool`] starts a new one).
fn reap(reaper: &'static Mutex<Reaper>) {
    loop {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        {
            let mut r = lock(reaper);
            let mut i = 0;
            while i < r.pools.len() {
                let again = r.pools[i].upgrade().and_then(|p| p.look(now));
                match again {
                    Some(t) => {
                        next = Some(next.map_or(t, |n| n.min(t)));
                        i += 1;
                    }
                    None => {
                        r.pools.swap_remove(i);
                    }
                }
            }
            if r.pools.is_empty() {
                r.thread = None;
                return;
            }
        }
        if let Some(t) = next {
            std::thread::park_timeout(t.saturating_duration_since(Instant::now()));
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let size = self.pages * POOL_PAGE_BYTES;
        if let Some(b) = &self.budget {
            let charged = lock(&self.state).charged_chunks;
            b.refund((charged * LOCK_CHUNK_BYTES) as u64);
        }
        // Not wiped here: every grant wiped its pages at its release unless they held only
        // ciphertext, and the pages go back to the kernel, which zeroes a page before it maps
        // it anywhere again (a grant leaked with `mem::forget` included).
        // SAFETY: mapped in `new` with this size; no grant outlives the pool (grants borrow
        // it), and the reaper holds this `Inner` only while it looks at it.
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
                .inner
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

    /// Memory follows use: nothing resident at the start, the chunks a grant lands on once it
    /// is taken, nothing again after an idle period, and a busy pool keeps its chunks.
    #[test]
    fn memory_is_taken_on_use_and_given_back_when_idle() {
        // A reaper of this test's own: other tests' pools do not keep it running.
        static OWN: Mutex<Reaper> = Mutex::new(Reaper {
            pools: Vec::new(),
            thread: None,
        });
        let running = || lock(&OWN).thread.is_some();
        let idle = Duration::from_millis(50);
        let pool = BufferPool::with_reaper(4 * LOCK_CHUNK_BYTES, idle, &OWN).unwrap();
        assert_eq!(pool.resident_bytes(), 0, "nothing resident before use");
        // The kept chunk alone needs no reaper.
        drop(pool.take(POOL_PAGE_BYTES).unwrap());
        assert!(!running(), "a reaper for the kept chunk alone");
        let mut g = pool.take(LOCK_CHUNK_BYTES + POOL_PAGE_BYTES).unwrap();
        assert_eq!(
            pool.resident_bytes(),
            2 * LOCK_CHUNK_BYTES,
            "two chunks touched"
        );
        assert!(running(), "no reaper for a pool past its kept chunk");
        g.as_mut_slice().fill(9);
        // Held across several idle periods: nothing is given back under a grant.
        std::thread::sleep(idle * 4);
        assert_eq!(pool.resident_bytes(), 2 * LOCK_CHUNK_BYTES);
        assert!(g.as_mut_slice().iter().all(|&x| x == 9));
        drop(g);
        // Busy: a grant per half period keeps the memory.
        for _ in 0..6 {
            drop(pool.take(POOL_PAGE_BYTES).unwrap());
            std::thread::sleep(idle / 2);
        }
        assert_eq!(
            pool.resident_bytes(),
            2 * LOCK_CHUNK_BYTES,
            "a busy pool keeps its memory"
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool.resident_bytes() > IDLE_KEPT_BYTES && std::time::Instant::now() < deadline {
            std::thread::sleep(idle);
        }
        assert_eq!(
            pool.resident_bytes(),
            IDLE_KEPT_BYTES,
            "idle pool kept more than its first chunk"
        );
        // The reaper ends once nothing is watched (it gives the memory back, then looks at
        // the list under its lock).
        while running() && std::time::Instant::now() < deadline {
            std::thread::sleep(idle);
        }
        assert!(!running(), "the reaper outlived the last pool it watched");
        // And it grows again, zeroed, with a reaper started again.
        let mut g = pool.take(4 * LOCK_CHUNK_BYTES).unwrap();
        assert!(g.as_mut_slice().iter().all(|&x| x == 0));
        assert_eq!(pool.resident_bytes(), 4 * LOCK_CHUNK_BYTES);
        assert!(running(), "no reaper after the pool grew again");
        drop(g);
        while running() && std::time::Instant::now() < deadline + Duration::from_secs(10) {
            std::thread::sleep(idle);
        }
        assert!(!running(), "the reaper outlived the second busy period");
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

    /// Pools sharing a budget too small for all: every grant is served (none fails), the
    /// charge never passes the budget, pools that were refused waited, and the pieces the
    /// pools advertise fit their reserves so nobody overdraws.
    #[test]
    fn a_budget_makes_pools_wait_not_fail() {
        let limit = 2 * LOCK_CHUNK_BYTES as u64;
        let budget: Arc<dyn Budget> = Arc::new(budget::LocalBudget::new(limit));
        let pools: Vec<_> = (0..3)
            .map(|_| {
                let p = BufferPool::with_budget(
                    16 * LOCK_CHUNK_BYTES,
                    Duration::from_millis(20),
                    Some(budget.clone()),
                );
                Arc::new(p.unwrap())
            })
            .collect();
        assert_eq!(pools[0].piece_bytes_max(), POOL_RESERVE_BYTES);
        let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let threads: Vec<_> = (0..12)
            .map(|t| {
                let (pool, budget, peak) = (pools[t % 3].clone(), budget.clone(), peak.clone());
                std::thread::spawn(move || {
                    for i in 0..300 {
                        let want = POOL_PAGE_BYTES * (1 + (t * 7 + i * 13) % 64);
                        let mut g = pool.take(want).unwrap();
                        g.as_mut_slice()[want - 1] = 1;
                        let used = budget.usage().used_bytes;
                        peak.fetch_max(used, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(std::sync::atomic::Ordering::Relaxed) <= limit);
        assert_eq!(pools.iter().map(|p| p.budget_overdrafts()).sum::<u64>(), 0);
        // A wait, made certain (the stress above need not overlap on a busy host): pool 0
        // fills its reserve and charges the whole budget; pool 1, holding its reserve, asks
        // for one more chunk, is refused the charge and waits for its own grant to come back.
        // First the pools give back what they grew to in the stress (idle for 20 ms), so
        // that pool 0's charge below is not refused (it would wait for itself).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while budget.usage().used_bytes > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "charges kept after idling"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let (a, b) = (&pools[0], &pools[1]);
        let reserve_a = a.take(POOL_RESERVE_BYTES).unwrap();
        let charged = a.take(2 * LOCK_CHUNK_BYTES).unwrap();
        assert_eq!(budget.usage().used_bytes, limit);
        let reserve_b = b.take(POOL_RESERVE_BYTES).unwrap();
        let waits_before = b.budget_waits();
        let b2 = b.clone();
        let asker = std::thread::spawn(move || drop(b2.take(LOCK_CHUNK_BYTES).unwrap()));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pools[1].budget_waits() == waits_before {
            assert!(std::time::Instant::now() < deadline, "nobody waited");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!asker.is_finished(), "served beyond the budget");
        drop(reserve_b);
        asker.join().unwrap();
        assert_eq!(budget.usage().used_bytes, limit, "pool 1 charged nothing");
        drop((reserve_a, charged));
        assert_eq!(pools.iter().map(|p| p.budget_overdrafts()).sum::<u64>(), 0);
        // A request bigger than the reserve, alone: served, charged beyond the budget.
        let big = pools[0].take(8 * LOCK_CHUNK_BYTES).unwrap();
        assert!(budget.usage().used_bytes > 0);
        drop(big);
        drop(pools);
        assert_eq!(budget.usage().used_bytes, 0, "every charge refunded");
    }

    /// A busy pool that grew first gives the charged chunks it does not use back once another
    /// pool was refused a charge, at the reaper's next look, and keeps serving; the refused
    /// pool then grows beyond its reserve without waiting.
    #[test]
    fn a_refused_charge_makes_a_busy_pool_give_back_what_it_does_not_use() {
        let limit = 4 * LOCK_CHUNK_BYTES as u64;
        let budget: Arc<dyn Budget> = Arc::new(budget::LocalBudget::new(limit));
        let idle = Duration::from_millis(400);
        let pool =
            || Arc::new(BufferPool::with_budget(1 << 20, idle, Some(budget.clone())).unwrap());
        let (a, b) = (pool(), pool());
        // A grows to the whole budget, then uses only its reserve.
        drop(a.take(POOL_RESERVE_BYTES + limit as usize).unwrap());
        assert_eq!(budget.usage().used_bytes, limit);
        // B, holding its reserve, asks for more: refused, it waits for its own grant.
        let held = b.take(POOL_RESERVE_BYTES).unwrap();
        let b2 = b.clone();
        let asker = std::thread::spawn(move || drop(b2.take(LOCK_CHUNK_BYTES).unwrap()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while b.budget_waits() == 0 {
            assert!(Instant::now() < deadline, "B was not refused");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(held);
        asker.join().unwrap();
        // A stays busy (a grant every 20 ms, so it never goes idle) and gives its unused
        // charged chunks back within a few looks (every 100 ms).
        let deadline = Instant::now() + Duration::from_secs(10);
        while budget.usage().used_bytes > 0 {
            assert!(
                Instant::now() < deadline,
                "the busy pool kept {} charged bytes it does not use",
                budget.usage().used_bytes
            );
            drop(a.take(POOL_PAGE_BYTES).unwrap());
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(a.resident_bytes() > 0, "A gave back its reserve too");
        // B grows now: a second grant beside its reserve is charged, with no wait.
        let waits = b.budget_waits();
        let held = b.take(POOL_RESERVE_BYTES).unwrap();
        let more = b.take(LOCK_CHUNK_BYTES).unwrap();
        assert_eq!(b.budget_waits(), waits);
        assert_eq!(budget.usage().used_bytes, LOCK_CHUNK_BYTES as u64);
        drop((held, more));
        // A's next growth is charged again, within the budget.
        let again = a.take(POOL_RESERVE_BYTES + LOCK_CHUNK_BYTES).unwrap();
        assert_eq!(budget.usage().used_bytes, 2 * LOCK_CHUNK_BYTES as u64);
        drop(again);
        drop((a, b));
        assert_eq!(budget.usage().used_bytes, 0, "every charge refunded");
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
