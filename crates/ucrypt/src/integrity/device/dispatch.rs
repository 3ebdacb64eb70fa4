//! How an authenticated volume's requests are dispatched (docs/integrity.md, "Dispatch"):
//! the policy, its calibration, the lanes a request runs on, and the splits that share a
//! read's verification or a write piece's sealing between the caller and the crew.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::engine::crew::Chunks;
use crate::engine::host;
use crate::engine::plan::CHUNKS_PER_LANE;
use crate::engine::stats::{now, ns_per_tick};
use crate::engine::{Policies, Policy};
use crate::integrity::tag::TagCipher;
use crate::sync::lock;
use crate::volume::{AUTO_MIN_BYTES_CEIL, AUTO_MIN_BYTES_FLOOR, PARALLEL_MIN_BYTES};
use crate::{Error, Result};

use super::{IntegrityVolume, JournalState, SPLIT_CHUNK_MIN_BYTES};

/// How one request's crypto runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lanes {
    /// On the caller's thread alone.
    Inline,
    /// In `chunks` chunks claimed by `helpers` crew workers and, if `caller_helps`, the caller.
    Split {
        helpers: usize,
        chunks: usize,
        caller_helps: bool,
    },
}

impl Lanes {
    /// `chunks` for `bytes` of work: the lanes' count times [`CHUNKS_PER_LANE`], none smaller
    /// than [`SPLIT_CHUNK_MIN_BYTES`], none smaller than a block.
    pub(super) fn chunks_for(self, bytes: usize, block_bytes: usize) -> usize {
        match self {
            Lanes::Inline => 1,
            Lanes::Split { chunks, .. } => chunks
                .min(bytes / SPLIT_CHUNK_MIN_BYTES)
                .min(bytes / block_bytes)
                .max(1),
        }
    }
}

/// Counts a big request of the `auto` policy while it runs.
pub(super) struct BigGuard<'a>(&'a AtomicU32);

impl Drop for BigGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The chunks of one split request: which is next to claim, and the error of the lowest
/// failing chunk (so the request reports what a run on one thread would have met first,
/// whatever order the lanes ran them in).
pub(super) struct SplitState {
    pub(super) chunks: usize,
    /// Chunk boundaries fall on multiples of this many blocks (so that each chunk's part of
    /// the caller's buffer starts where the backend accepts a buffer, when the whole does).
    pub(super) granule: usize,
    pub(super) next: AtomicUsize,
    pub(super) failed: Mutex<Option<(usize, Error)>>,
}

impl SplitState {
    pub(super) fn new(chunks: usize, granule: usize) -> Self {
        SplitState {
            chunks: chunks.max(1),
            granule: granule.max(1),
            next: AtomicUsize::new(0),
            failed: Mutex::new(None),
        }
    }

    /// The next unclaimed chunk, if any.
    pub(super) fn claim(&self) -> Option<usize> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        (i < self.chunks).then_some(i)
    }

    /// Blocks `lo..hi` of chunk `i` of `blocks`: nearly equal runs, cut at multiples of the
    /// granule (so one may be empty when there are few granules), the last up to `blocks`.
    pub(super) fn bounds(&self, i: usize, blocks: usize) -> (usize, usize) {
        let cut = |k: usize| {
            if k >= self.chunks {
                blocks
            } else {
                blocks * k / self.chunks / self.granule * self.granule
            }
        };
        (cut(i), cut(i + 1))
    }

    pub(super) fn record(&self, i: usize, r: Result<()>) {
        if let Err(e) = r {
            let mut f = lock(&self.failed);
            if f.as_ref().is_none_or(|(at, _)| i < *at) {
                *f = Some((i, e));
            }
        }
    }

    /// Claims and runs chunks with `run(lo, hi)` until none is left; every chunk runs, also
    /// after one failed (the request returns only when all have finished).
    pub(super) fn run_all(&self, blocks: usize, mut run: impl FnMut(usize, usize) -> Result<()>) {
        while let Some(i) = self.claim() {
            let (lo, hi) = self.bounds(i, blocks);
            if lo < hi {
                self.record(i, run(lo, hi));
            }
        }
    }

    /// Runs every chunk left with `cipher`, or, if the lane's cipher could not be had, fails
    /// every chunk left with that error.
    pub(super) fn run_lane(
        &self,
        blocks: usize,
        with_cipher: impl FnOnce(&mut dyn FnMut(&mut TagCipher) -> Result<()>) -> Result<()>,
        mut run: impl FnMut(&mut TagCipher, usize, usize) -> Result<()>,
    ) {
        let r = with_cipher(&mut |c: &mut TagCipher| {
            self.run_all(blocks, |lo, hi| run(c, lo, hi));
            Ok(())
        });
        if let Err(e) = r {
            let mut first = Some(e);
            while let Some(i) = self.claim() {
                let e = first
                    .take()
                    .unwrap_or(Error::Bug("tag cipher unavailable for a chunk"));
                self.record(i, Err(e));
            }
        }
    }

    pub(super) fn result(&self) -> Result<()> {
        match lock(&self.failed).take() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }
}

/// A read's whole blocks, verified and decrypted in chunks by the caller and crew workers.
/// Lives on the caller's stack, which holds the volume's lock shared until the crew returns.
pub(super) struct ReadSplit<'a> {
    pub(super) vol: &'a IntegrityVolume,
    pub(super) j: &'a JournalState,
    /// Data sector of the first block.
    pub(super) first: u64,
    /// The caller's buffer: `blocks` whole blocks.
    pub(super) out: *mut u8,
    pub(super) blocks: usize,
    pub(super) split: SplitState,
}

// SAFETY: `out` is a caller's `&mut [u8]` of `blocks` blocks that outlives the split (the
// caller waits in `Crew::run`); chunks are disjoint block ranges of it, each claimed by one
// lane, so no two threads touch the same bytes. The rest is shared read-only or Sync.
unsafe impl Sync for ReadSplit<'_> {}

impl Chunks for ReadSplit<'_> {
    fn run_chunks(&self, lane: usize) {
        let v = self.vol;
        let bb = v.block_bytes();
        let read = |c: Option<&mut TagCipher>, lo: usize, hi: usize| {
            assert!(
                lo < hi && hi <= self.blocks,
                "read chunk outside the request"
            );
            // SAFETY: blocks lo..hi lie inside `out` (asserted) and belong to this chunk
            // alone (see the Sync impl).
            let out =
                unsafe { std::slice::from_raw_parts_mut(self.out.add(lo * bb), (hi - lo) * bb) };
            v.read_blocks_with(c, self.j, self.first + (lo * bb / 512) as u64, out)
        };
        if lane == 0 {
            // The caller borrows a cached cipher per run, for its crypto only, as an inline
            // read does: many concurrent readers then share the cache without waiting on I/O.
            self.split.run_all(self.blocks, |lo, hi| read(None, lo, hi));
        } else {
            self.split.run_lane(
                self.blocks,
                |f| v.with_lane_cipher(lane, f),
                |c, lo, hi| read(Some(c), lo, hi),
            );
        }
    }
}

/// A write piece's blocks, sealed in chunks by the caller and crew workers: plaintext from
/// `plain` (or `dbuf` itself when null) into `dbuf`, tuples into `tuples`. Lives on the
/// caller's stack, which holds the volume's lock exclusively until the crew returns.
pub(super) struct SealSplit<'a> {
    pub(super) vol: &'a IntegrityVolume,
    pub(super) first: u64,
    pub(super) plain: *const u8,
    pub(super) dbuf: *mut u8,
    pub(super) tuples: *mut u8,
    pub(super) blocks: usize,
    pub(super) split: SplitState,
}

// SAFETY: the three buffers are the caller's, of `blocks` blocks (and tuples) each, and outlive
// the split (the caller waits in `Crew::run`); `plain` is only read; chunks are disjoint block
// ranges, each claimed by one lane, so no two threads write the same bytes.
unsafe impl Sync for SealSplit<'_> {}

impl Chunks for SealSplit<'_> {
    fn run_chunks(&self, lane: usize) {
        let v = self.vol;
        let bb = v.block_bytes();
        let tb = v.mode.tuple_bytes();
        self.split.run_lane(
            self.blocks,
            |f| v.with_lane_cipher(lane, f),
            |c, lo, hi| {
                assert!(lo < hi && hi <= self.blocks, "seal chunk outside the piece");
                let len = (hi - lo) * bb;
                // SAFETY: blocks lo..hi lie inside each buffer (asserted against `blocks`,
                // which sized them) and belong to this chunk alone (see the Sync impl).
                let (plain, dbuf, tuples) = unsafe {
                    (
                        (!self.plain.is_null())
                            .then(|| std::slice::from_raw_parts(self.plain.add(lo * bb), len)),
                        std::slice::from_raw_parts_mut(self.dbuf.add(lo * bb), len),
                        std::slice::from_raw_parts_mut(self.tuples.add(lo * tb), (hi - lo) * tb),
                    )
                };
                c.seal_to(self.first + (lo * bb / 512) as u64, bb, plain, dbuf, tuples)
            },
        );
    }
}

impl IntegrityVolume {
    /// The dispatch policies (`auto` for both directions unless set, as `ucrypt` opens
    /// volumes). See [`IntegrityVolume::set_policy`].
    pub fn policy(&self) -> Policies {
        let get = |i: usize| Policy::from_u8(self.policy[i].load(Ordering::Relaxed));
        Policies {
            read: get(0),
            write: get(1),
        }
    }

    /// Switches the dispatch policies for the next requests. What each means here
    /// (docs/integrity.md, "Dispatch"): `inline`, crypto on the caller's thread only;
    /// `parallel`, requests of [`PARALLEL_MIN_BYTES`] or more split across the caller and the
    /// crew; `auto`, split from a threshold calibrated at open, when a worker is idle and
    /// fewer large requests than cores run; `ordered`, as `parallel` (writes already leave in
    /// the order they take the exclusive lock, each whole before the next starts); `queued`,
    /// every request's crypto handed to a worker while the caller waits (dm-crypt's kcryptd
    /// model, the baseline).
    pub fn set_policy(&self, p: impl Into<Policies>) {
        let p = p.into();
        self.policy[0].store(p.read.to_u8(), Ordering::Relaxed);
        self.policy[1].store(p.write.to_u8(), Ordering::Relaxed);
    }

    /// Worker threads large requests are split across (besides the caller).
    pub fn workers(&self) -> usize {
        self.crew.workers()
    }

    /// Reads and write pieces (up to [`super::WRITE_PIECE_BYTES`]) whose crypto went to the crew's
    /// workers since opening: split across lanes, or (`queued`) handed off whole.
    pub fn split_pieces(&self) -> u64 {
        self.splits.load(Ordering::Relaxed)
    }

    /// The request size from which `auto` splits (calibrated when opening).
    pub fn auto_threshold_bytes(&self) -> u64 {
        self.auto_min_bytes.load(Ordering::Relaxed)
    }

    /// Measures the tag cipher's cost per byte and the crew's hand-off round trip, and sets
    /// the `auto` threshold where splitting a request in two saves more than the hand-off
    /// costs, as the engine does for a plain volume (`Volume::calibrate`).
    pub(super) fn calibrate(&self) -> Result<()> {
        const PROBE_BYTES: usize = 64 << 10;
        const ROUNDS: usize = 8;
        let bb = self.block_bytes();
        let blocks = PROBE_BYTES / bb;
        let tb = self.mode.tuple_bytes();
        let mut g = self.pool.take(blocks * bb + blocks * tb)?;
        let (data, tuples) = g.as_mut_slice().split_at_mut(blocks * bb);
        let tuples = &mut tuples[..blocks * tb];
        let mut best_crypto = u64::MAX;
        self.with_cipher(|c| {
            for _ in 0..ROUNDS {
                let t0 = now();
                c.seal(0, bb, data, tuples)?;
                best_crypto = best_crypto.min(now().wrapping_sub(t0));
            }
            Ok(())
        })?;
        drop(g);
        let best_ping = self.crew.ping_ticks(ROUNDS * 4)?;
        let ns = ns_per_tick();
        let per_byte_ns = (best_crypto as f64 * ns / (blocks * bb) as f64).max(1e-3);
        let handoff_ns = best_ping as f64 * ns;
        // Splitting L bytes in two saves L*c/2 and costs one hand-off; ask for a 2x margin.
        let t = (4.0 * handoff_ns / per_byte_ns) as u64;
        let t = t
            .clamp(AUTO_MIN_BYTES_FLOOR, AUTO_MIN_BYTES_CEIL)
            .next_multiple_of(bb as u64);
        self.auto_min_bytes.store(t, Ordering::Relaxed);
        Ok(())
    }

    /// How a request of `bytes` runs under the direction's policy; for a large `auto` request,
    /// a guard that counts it while it runs.
    pub(super) fn lanes_for(&self, write: bool, bytes: usize) -> (Lanes, Option<BigGuard<'_>>) {
        let policy = Policy::from_u8(self.policy[usize::from(write)].load(Ordering::Relaxed));
        let bytes = bytes as u64;
        let split = |helpers: usize| {
            let helpers = helpers.min(self.lanes - 1).min(self.crew.workers());
            if helpers == 0 {
                Lanes::Inline
            } else {
                Lanes::Split {
                    helpers,
                    chunks: (helpers + 1) * CHUNKS_PER_LANE as usize,
                    caller_helps: true,
                }
            }
        };
        match policy {
            Policy::Inline => (Lanes::Inline, None),
            Policy::Parallel | Policy::Ordered if bytes >= PARALLEL_MIN_BYTES => {
                (split(self.lanes - 1), None)
            }
            Policy::Parallel | Policy::Ordered => (Lanes::Inline, None),
            Policy::Queued => (
                Lanes::Split {
                    helpers: 1,
                    chunks: 1,
                    caller_helps: false,
                },
                None,
            ),
            Policy::Auto if bytes >= self.auto_min_bytes.load(Ordering::Relaxed) => {
                // Split only if a worker is idle AND fewer big requests than the cores this
                // process could use are running, i.e. another core is likely free (the
                // engine's rule, `engine::host`).
                let others = self.big_inflight.fetch_add(1, Ordering::Relaxed) as usize;
                let guard = BigGuard(&self.big_inflight);
                let free_cores = host::free_cores(self.lanes, others);
                let idle = (self.crew.idle() as usize).min(free_cores);
                (split(idle), Some(guard))
            }
            Policy::Auto => (Lanes::Inline, None),
        }
    }
}
