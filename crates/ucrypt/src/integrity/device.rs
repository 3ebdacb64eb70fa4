//! [`IntegrityVolume`]: a [`BlockDev`] over a LUKS2 volume with authenticated sectors, reading
//! and writing dm-integrity's on-disk format, in the kernel's journal mode ('J', the default)
//! or its direct mode ('D', cryptsetup's `--integrity-no-journal`); see docs/integrity.md for
//! what each guarantees after a crash.
//!
//! Every read fetches the data and the tags of whole blocks, verifies each block's tag before
//! its plaintext leaves this module, and fails the request with [`Error::Integrity`] (EILSEQ)
//! on the first block that does not verify. Every write encrypts with fresh random IVs.
//! - Journal mode: the blocks and their tags go to the open journal section in memory (reads
//!   see them there); a flush, a FUA write or a full section commits it (every sector stamped
//!   with the commit id, written, flushed), and only then are data and tags written to their
//!   places. A crash at any point leaves each block with its old or its new data and a tag
//!   that verifies: the journal is replayed when the volume is opened again (by ucrypt or
//!   the kernel).
//! - Direct mode: the data, then the tags (a read-modify-write of the 512-byte tag sectors it
//!   shares with neighbours).
//!
//! Opening replays the journal as the kernel does on activation (committed sections, oldest
//! first) and leaves it empty. Writes exclude each other and reads; reads run together.
//!
//! Dispatch (docs/integrity.md, "Dispatch"): a large request is split across cores as a plain
//! volume's engine splits one, under the volume's [`Policies`]. A read's whole blocks are cut
//! into chunks that the caller and the workers of the volume's crew (`engine::crew`) claim one at a time,
//! each fetching its blocks' data and tags, verifying and decrypting them (`ReadSplit`). A
//! write is cut into pieces of at most [`WRITE_PIECE_BYTES`]: a piece's blocks are sealed
//! (fresh IVs, encryption, tags) in chunks on the caller and the workers (`SealSplit`), then
//! the caller alone writes them, to the journal or in direct mode to their places, in the
//! order a write on one thread would: the backend sees the same writes, in the same order,
//! whatever the policy. The locks do not change: the caller holds the volume's lock (shared
//! for a read, exclusive for a write, from the first seal to the last tag write) until every
//! chunk has finished, so the workers run inside the request's critical section.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockWriteGuard};

use super::journal::{self, Entry, Geometry, Scan};
use super::layout::Layout;
use super::superblock::{Superblock, SB_BYTES, SB_SECTORS};
use super::tag::{TagCipher, TagMode};
use crate::backend::Backend;
use crate::blockdev::check_range;
use crate::engine::crew::{Chunks, Crew, CREW_WORKERS_MAX};
use crate::engine::host;
use crate::engine::plan::CHUNKS_PER_LANE;
use crate::engine::stats::{now, ns_per_tick};
use crate::engine::{Policies, Policy};
use crate::luks::json::SegmentKind;
use crate::luks::{read_area, Header, VolumeKey};
use crate::pool::BufferPool;
use crate::sync::lock;
use crate::volume::{AUTO_MIN_BYTES_CEIL, AUTO_MIN_BYTES_FLOOR, PARALLEL_MIN_BYTES};
use crate::{BlockDev, Error, Result, SecretBytes};

/// Blocks handled per backend call pair (data + tags) of a read, and per write-back run of
/// the journal; bounds the scratch each takes.
pub const CHUNK_BYTES: usize = 256 << 10;
/// A write is sealed and written in pieces of at most this: one pool grant holds a piece's
/// ciphertext, tuples and tag span; the piece's seal is what a split shares between lanes.
pub const WRITE_PIECE_BYTES: usize = 1 << 20;
/// The pool grant of one write piece at most: ciphertext, tuples, and the tag span of its
/// run (direct mode), with three 4 KiB units of alignment slack (the span's ends, and the
/// span's start after the ciphertext).
const WRITE_GRANT_BYTES_MAX: usize =
    WRITE_PIECE_BYTES + 2 * (WRITE_PIECE_BYTES / 512) * TUPLE_BYTES_MAX + 3 * 4096;
/// The pool grant of one read run or journal write-back run at most (data, tag span, the
/// same slack).
const RUN_GRANT_BYTES_MAX: usize = CHUNK_BYTES + (CHUNK_BYTES / 512) * TUPLE_BYTES_MAX + 3 * 4096;
/// Scratch memory per volume: 8 read runs in flight at once (readers and their lanes).
pub const SCRATCH_POOL_BYTES: usize = 8 * RUN_GRANT_BYTES_MAX;
// A journal write holds its piece's grant while a commit writes a section back (one run's
// grant more). Writers are exclusive and readers hold no grant outside the lock, so both are
// then the only grants: they must fit together, or the writer would wait for itself.
const _: () = assert!(WRITE_GRANT_BYTES_MAX + RUN_GRANT_BYTES_MAX <= SCRATCH_POOL_BYTES);
/// Largest tuple accepted (dm-integrity's tag size for the modes here is at most 80).
pub const TUPLE_BYTES_MAX: usize = 128;
/// Keyed ciphers kept for reuse between requests on callers' threads (one per concurrent
/// caller at most); the crew's workers have one each besides.
pub const CIPHERS_CACHED_MAX: usize = 16;
/// No chunk of a split smaller than this: below it the hand-off costs more than the crypto
/// it moves (the engine's bound, `volume::CHUNK_MIN_BYTES`).
pub const SPLIT_CHUNK_MIN_BYTES: usize = 32 << 10;
/// Most lanes (the caller and workers) one request is split across.
pub const LANES_MAX: usize = 4;
/// The largest block dm-integrity supports.
const BLOCK_BYTES_MAX: usize = 4096;
/// Alignment of the journal section buffer (the largest memory alignment O_DIRECT asks).
const JOURNAL_BUF_ALIGN: usize = 4096;
/// The largest journal section accepted: 8 entry sectors of 21 entries (the smallest entry,
/// 24 bytes) of 4 KiB blocks, plus the entry sectors. Bounds the one section buffer.
const JOURNAL_SECTION_BYTES_MAX: usize = (8 + 8 * 21 * 8) * 512;

/// How writes reach the disk (the kernel's dm-integrity modes ucrypt implements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// 'J': through the journal; data and tag of a block change together (the default, as in
    /// the kernel).
    Journal,
    /// 'D': straight to their places, data then tag; a crash mid-write may leave a block that
    /// fails verification (cryptsetup's `--integrity-no-journal`).
    Direct,
}

/// What opening found in the journal and did about it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Committed sections whose entries were written to their places.
    pub sections: u32,
    /// Entries (blocks) written to their places.
    pub entries: u64,
    /// The journal was rewritten empty afterwards.
    pub cleared: bool,
}

/// A buffer of `len` bytes starting at a [`JOURNAL_BUF_ALIGN`] boundary, allocated once.
struct AlignedBuf {
    raw: Vec<u8>,
    off: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let raw = vec![0u8; len + JOURNAL_BUF_ALIGN];
        let off = raw.as_ptr().align_offset(JOURNAL_BUF_ALIGN);
        assert!(off < JOURNAL_BUF_ALIGN, "alignment offset inside the slack");
        AlignedBuf { raw, off, len }
    }
    fn as_slice(&self) -> &[u8] {
        &self.raw[self.off..self.off + self.len]
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.off..self.off + self.len]
    }
}

/// The journal's state in memory: the open section (entries not yet committed) and where the
/// ring goes on. Lives inside the volume's reader-writer lock: writers change it, readers look
/// up blocks in the open section.
struct JournalState {
    geo: Geometry,
    mode: WriteMode,
    /// The open section's index in the ring and the sequence its commit will carry.
    section: u32,
    seq: u8,
    /// Entries filled in the open section.
    used: u32,
    /// Data sectors the open section's entries cover: `lo..hi` (empty when `used == 0`).
    lo: u64,
    hi: u64,
    /// The open section in its on-disk layout; data blocks hold their own last bytes (the
    /// commit ids are stamped only while the section is written).
    buf: AlignedBuf,
    /// The section whose entries were last written to their places without a flush since.
    unflushed_writeback: Option<u32>,
    /// Something was committed since opening: closing marks the journal empty, as the kernel
    /// does when it suspends.
    wrote: bool,
    /// Test hook: committed sections are not written to their places.
    hold_writeback: bool,
    held_sections: u32,
    /// A journal write failed: the volume refuses further I/O (the kernel fails the device).
    failed: bool,
}

/// Where and how a LUKS2 volume's data is authenticated.
pub struct IntegrityVolume {
    backend: Arc<dyn Backend>,
    /// Byte offset of the dm-integrity superblock on the backend (the segment offset).
    start_bytes: u64,
    layout: Layout,
    mode: TagMode,
    key: SecretBytes,
    ciphers: Mutex<Vec<TagCipher>>,
    pool: BufferPool,
    /// Writes hold it exclusively (tag sectors are shared between neighbouring blocks, a
    /// direct write stores data and tags in two steps, a journal write fills the open
    /// section); reads hold it shared, so a read never sees a block between its data and its
    /// tag (dm-integrity's range locks give the kernel the same).
    io_lock: RwLock<JournalState>,
    /// Backend I/O alignment (at least 512).
    io_align: u64,
    /// Backend memory alignment: a read into a caller's buffer aligned to it needs no copy.
    mem_align: usize,
    read_only: bool,
    integrity_errors: AtomicU64,
    replay: ReplayReport,
    /// The threads large requests are split across (lanes `1..=workers`; the caller is 0).
    crew: Crew,
    /// One keyed tag cipher per crew worker (lane `i + 1` uses `lane_ciphers[i]`), made when
    /// the volume opens: each lives in its `SecretBox`es, and only its worker locks it.
    lane_ciphers: Box<[Mutex<TagCipher>]>,
    /// Threads that can do crypto at once: the machine's cores (at most [`LANES_MAX`]).
    lanes: usize,
    /// The dispatch policy of reads (0) and writes (1) ([`Policy::to_u8`]).
    policy: [AtomicU8; 2],
    /// `auto` splits requests of at least this many bytes (calibrated when opening).
    auto_min_bytes: AtomicU64,
    /// `auto` requests at or above the threshold running now.
    big_inflight: AtomicU32,
    /// Pieces of requests handed to the crew since opening (see `split_pieces`).
    splits: AtomicU64,
}

/// How one request's crypto runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lanes {
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
    fn chunks_for(self, bytes: usize, block_bytes: usize) -> usize {
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
struct BigGuard<'a>(&'a AtomicU32);

impl Drop for BigGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where the bytes of a write come from.
#[derive(Clone, Copy)]
enum Src<'a> {
    Bytes(&'a [u8]),
    Zeroes,
}

/// One run of whole blocks in one area, as reads and direct writes walk it: its data on the
/// backend and the aligned span holding its tags.
struct Run {
    data_byte: u64,
    blocks: usize,
    tag_lo: u64,
    tag_span: usize,
    /// Where the run's first tag sits inside the span.
    tag_at: usize,
}

fn align_down(v: u64, a: u64) -> u64 {
    v / a * a
}

fn journal_failed() -> Error {
    Error::io(
        "integrity journal",
        std::io::Error::other("an earlier journal write failed; the volume refuses I/O"),
    )
}

/// The chunks of one split request: which is next to claim, and the error of the lowest
/// failing chunk (so the request reports what a run on one thread would have met first,
/// whatever order the lanes ran them in).
struct SplitState {
    chunks: usize,
    /// Chunk boundaries fall on multiples of this many blocks (so that each chunk's part of
    /// the caller's buffer starts where the backend accepts a buffer, when the whole does).
    granule: usize,
    next: AtomicUsize,
    failed: Mutex<Option<(usize, Error)>>,
}

impl SplitState {
    fn new(chunks: usize, granule: usize) -> Self {
        SplitState {
            chunks: chunks.max(1),
            granule: granule.max(1),
            next: AtomicUsize::new(0),
            failed: Mutex::new(None),
        }
    }

    /// The next unclaimed chunk, if any.
    fn claim(&self) -> Option<usize> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        (i < self.chunks).then_some(i)
    }

    /// Blocks `lo..hi` of chunk `i` of `blocks`: nearly equal runs, cut at multiples of the
    /// granule (so one may be empty when there are few granules), the last up to `blocks`.
    fn bounds(&self, i: usize, blocks: usize) -> (usize, usize) {
        let cut = |k: usize| {
            if k >= self.chunks {
                blocks
            } else {
                blocks * k / self.chunks / self.granule * self.granule
            }
        };
        (cut(i), cut(i + 1))
    }

    fn record(&self, i: usize, r: Result<()>) {
        if let Err(e) = r {
            let mut f = lock(&self.failed);
            if f.as_ref().is_none_or(|(at, _)| i < *at) {
                *f = Some((i, e));
            }
        }
    }

    /// Claims and runs chunks with `run(lo, hi)` until none is left; every chunk runs, also
    /// after one failed (the request returns only when all have finished).
    fn run_all(&self, blocks: usize, mut run: impl FnMut(usize, usize) -> Result<()>) {
        while let Some(i) = self.claim() {
            let (lo, hi) = self.bounds(i, blocks);
            if lo < hi {
                self.record(i, run(lo, hi));
            }
        }
    }

    /// Runs every chunk left with `cipher`, or, if the lane's cipher could not be had, fails
    /// every chunk left with that error.
    fn run_lane(
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

    fn result(&self) -> Result<()> {
        match lock(&self.failed).take() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }
}

/// A read's whole blocks, verified and decrypted in chunks by the caller and crew workers.
/// Lives on the caller's stack, which holds the volume's lock shared until the crew returns.
struct ReadSplit<'a> {
    vol: &'a IntegrityVolume,
    j: &'a JournalState,
    /// Data sector of the first block.
    first: u64,
    /// The caller's buffer: `blocks` whole blocks.
    out: *mut u8,
    blocks: usize,
    split: SplitState,
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
struct SealSplit<'a> {
    vol: &'a IntegrityVolume,
    first: u64,
    plain: *const u8,
    dbuf: *mut u8,
    tuples: *mut u8,
    blocks: usize,
    split: SplitState,
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
    /// A volume over `backend` whose dm-integrity superblock `sb` lies at `start_bytes`, with
    /// tags made by `mode` under `key`, writing through the journal (the kernel's default).
    /// Replays the journal first (see [`IntegrityVolume::with_write_mode`]).
    pub fn new(
        backend: Arc<dyn Backend>,
        start_bytes: u64,
        sb: Superblock,
        mode: TagMode,
        key: SecretBytes,
        read_only: bool,
    ) -> Result<Self> {
        Self::with_write_mode(
            backend,
            start_bytes,
            sb,
            mode,
            key,
            read_only,
            WriteMode::Journal,
        )
    }

    /// As [`IntegrityVolume::new`], writing in `write_mode`. Opening replays committed journal
    /// sections the kernel or ucrypt left unapplied (a crash) and leaves the journal empty; a
    /// read-only open refuses a journal that needs a replay.
    pub fn with_write_mode(
        backend: Arc<dyn Backend>,
        start_bytes: u64,
        sb: Superblock,
        mode: TagMode,
        key: SecretBytes,
        read_only: bool,
        write_mode: WriteMode,
    ) -> Result<Self> {
        if usize::from(sb.tag_bytes) != mode.tuple_bytes() {
            return Err(Error::BadHeader {
                check: "integrity tag size",
                detail: format!(
                    "the superblock keeps {} bytes per block; {mode:?} needs {}",
                    sb.tag_bytes,
                    mode.tuple_bytes()
                ),
            });
        }
        if start_bytes % 512 != 0 {
            return Err(Error::BadHeader {
                check: "integrity offset",
                detail: format!("superblock at byte {start_bytes}, not a 512-byte sector"),
            });
        }
        let layout = Layout::for_device(sb, start_bytes / 512, backend.size() / 512)?;
        let io_align = u64::from(backend.logical_block_bytes()).max(512);
        let backend_mem_align = backend.mem_align_bytes().max(1);
        if backend_mem_align > crate::pool::POOL_PAGE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "{}: buffers aligned to {backend_mem_align} bytes (at most {} supported)",
                backend.describe(),
                crate::pool::POOL_PAGE_BYTES
            )));
        }
        if io_align > u64::from(sb.block_bytes()) || start_bytes % io_align != 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: {io_align}-byte I/O cannot address {}-byte integrity blocks at byte {start_bytes}",
                backend.describe(),
                sb.block_bytes()
            )));
        }
        let geo = Geometry::new(&layout)?;
        if geo.section_bytes() > JOURNAL_SECTION_BYTES_MAX {
            return Err(Error::Bug("journal section larger than its bound"));
        }
        let cipher = TagCipher::new(mode, key.as_ref())?;
        let mut cached = Vec::with_capacity(CIPHERS_CACHED_MAX);
        cached.push(cipher);
        let lanes = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, LANES_MAX.min(CREW_WORKERS_MAX));
        // One worker per core, as the engine has: the caller is a lane too, so a split uses
        // `lanes - 1` of them and the others serve concurrent requests.
        let crew = Crew::new("ucrypt-integrity", lanes, crate::volume::SPIN_BEFORE_SLEEP)?;
        let lane_ciphers = (0..crew.workers())
            .map(|_| TagCipher::new(mode, key.as_ref()).map(Mutex::new))
            .collect::<Result<Box<[_]>>>()?;
        let state = JournalState {
            geo,
            mode: write_mode,
            section: 0,
            seq: 0,
            used: 0,
            lo: 0,
            hi: 0,
            buf: AlignedBuf::new(geo.section_bytes()),
            unflushed_writeback: None,
            wrote: false,
            hold_writeback: false,
            held_sections: 0,
            failed: false,
        };
        let mut v = IntegrityVolume {
            backend,
            start_bytes,
            layout,
            mode,
            key,
            ciphers: Mutex::new(cached),
            pool: BufferPool::new(SCRATCH_POOL_BYTES)?,
            io_lock: RwLock::new(state),
            io_align,
            mem_align: backend_mem_align,
            read_only,
            integrity_errors: AtomicU64::new(0),
            replay: ReplayReport::default(),
            crew,
            lane_ciphers,
            lanes,
            policy: [
                AtomicU8::new(Policy::Auto.to_u8()),
                AtomicU8::new(Policy::Auto.to_u8()),
            ],
            auto_min_bytes: AtomicU64::new(AUTO_MIN_BYTES_CEIL),
            big_inflight: AtomicU32::new(0),
            splits: AtomicU64::new(0),
        };
        v.replay = v.recover()?;
        v.calibrate()?;
        Ok(v)
    }

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

    /// Reads and write pieces (up to [`WRITE_PIECE_BYTES`]) whose crypto went to the crew's
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
    fn calibrate(&self) -> Result<()> {
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
    fn lanes_for(&self, write: bool, bytes: usize) -> (Lanes, Option<BigGuard<'_>>) {
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

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn mode(&self) -> TagMode {
        self.mode
    }

    /// How writes reach the disk.
    pub fn write_mode(&self) -> WriteMode {
        self.io_lock.read().unwrap_or_else(|p| p.into_inner()).mode
    }

    /// What opening replayed from the journal.
    pub fn replay_report(&self) -> ReplayReport {
        self.replay
    }

    /// Test hook: from now on, committed journal sections stay in the journal only (not
    /// written to their places) and closing leaves the journal as it is, as after a crash
    /// right after each commit. Reads of such blocks then see their old contents; use it only
    /// to hand a journal to another implementation's replay.
    #[doc(hidden)]
    pub fn hold_writeback_for_tests(&self) {
        self.write_lock().hold_writeback = true;
    }

    /// Where data sector `sector` (512-byte units) and its block's tag lie on the backend, in
    /// bytes: `(data, tag)`. For tools and tests that inspect or damage a volume on purpose.
    pub fn locate(&self, sector: u64) -> Option<(u64, u64)> {
        if sector >= self.layout.sb.provided_data_sectors {
            return None;
        }
        let data = self.layout.data_sector(sector)?.checked_mul(512)?;
        let tag = self.layout.tag_byte(sector)?;
        Some((
            self.start_bytes.checked_add(data)?,
            self.start_bytes.checked_add(tag)?,
        ))
    }

    /// Blocks whose tag did not verify, since opening.
    pub fn integrity_errors(&self) -> u64 {
        self.integrity_errors.load(Ordering::Relaxed)
    }

    fn write_lock(&self) -> RwLockWriteGuard<'_, JournalState> {
        self.io_lock.write().unwrap_or_else(|p| p.into_inner())
    }

    fn with_cipher<T>(&self, f: impl FnOnce(&mut TagCipher) -> Result<T>) -> Result<T> {
        let cached = lock(&self.ciphers).pop();
        let mut c = match cached {
            Some(c) => c,
            None => TagCipher::new(self.mode, self.key.as_ref())?,
        };
        let r = f(&mut c);
        let mut cache = lock(&self.ciphers);
        if cache.len() < CIPHERS_CACHED_MAX {
            cache.push(c);
        }
        r
    }

    fn block_bytes(&self) -> usize {
        self.layout.sb.block_bytes() as usize
    }

    /// `bytes` rounded up to the backend's memory alignment: where, in a pool grant (page
    /// aligned), the next buffer the backend reads or writes may start.
    fn io_offset(&self, bytes: usize) -> usize {
        bytes.next_multiple_of(self.mem_align)
    }

    /// The backend byte offset of journal section `i`.
    fn section_byte(&self, geo: &Geometry, i: u32) -> u64 {
        self.start_bytes + (SB_SECTORS + u64::from(i) * u64::from(geo.section_sectors)) * 512
    }

    /// The aligned byte span on the backend holding the tags of `blocks` blocks from
    /// `tag_byte` (relative to the superblock), and where they start inside it.
    fn tag_span(&self, tag_byte: u64, blocks: u64) -> (u64, usize, usize) {
        let tb = u64::from(self.layout.sb.tag_bytes);
        let lo_abs = self.start_bytes + tag_byte;
        let lo = align_down(lo_abs, self.io_align);
        let hi = (lo_abs + blocks * tb).next_multiple_of(self.io_align);
        (lo, (hi - lo) as usize, (lo_abs - lo) as usize)
    }

    /// Where the next run of whole blocks at data sector `sector` lives: at most
    /// `blocks_max` blocks, all in one area.
    fn run_at(&self, sector: u64, blocks_max: usize) -> Result<Run> {
        let want = blocks_max as u64;
        let e = self
            .layout
            .extent(sector, want)
            .filter(|e| e.blocks > 0)
            .ok_or(Error::Bug("integrity extent outside the device"))?;
        let (tag_lo, tag_span, tag_at) = self.tag_span(e.tag_byte, e.blocks);
        Ok(Run {
            data_byte: self.start_bytes + e.data_byte,
            blocks: e.blocks as usize,
            tag_lo,
            tag_span,
            tag_at,
        })
    }

    // ---- the journal: replay, commit, write-back ----

    /// Replays the journal as the kernel does when it activates the device (`replay_journal`):
    /// scans every section's commit ids, then writes the entries of the committed sections to
    /// their places, oldest first, stopping at the first section not wholly committed; then
    /// leaves the journal empty (cleared, or marked empty as the kernel does on suspend).
    fn recover(&self) -> Result<ReplayReport> {
        let mut g = self.write_lock();
        let j = &mut *g;
        let geo = j.geo;
        let mut scan = Scan::default();
        // Per section: the sequence all its sectors carry, and whether it has entries (one
        // allocation at open, a few bytes per section).
        let mut committed = Vec::with_capacity(geo.sections as usize);
        for i in 0..geo.sections {
            self.backend
                .read_exact_at(j.buf.as_mut_slice(), self.section_byte(&geo, i))?;
            let seq = scan.section(&geo, j.buf.as_slice(), i)?;
            let used =
                (0..geo.section_entries).any(|n| geo.entry(j.buf.as_slice(), n) != Entry::Unused);
            committed.push((seq, used));
        }
        let plan = scan.plan(geo.sections)?;
        let mut report = ReplayReport::default();
        let (mut i, mut want, mut run) = (plan.start, plan.start_seq, 0u32);
        while run < geo.sections {
            let (seq, used) = committed[i as usize];
            if seq != Some(want) {
                break;
            }
            if !plan.empty && used {
                self.backend
                    .read_exact_at(j.buf.as_mut_slice(), self.section_byte(&geo, i))?;
                let entries = (0..geo.section_entries)
                    .filter(|&n| geo.entry(j.buf.as_slice(), n) != Entry::Unused)
                    .count() as u64;
                if entries > 0 {
                    geo.restore_last_bytes(j.buf.as_mut_slice());
                    if !self.read_only {
                        self.write_back(j, geo.section_entries, true)?;
                        report.sections += 1;
                        report.entries += entries;
                    }
                }
            }
            run += 1;
            i += 1;
            if i >= geo.sections {
                i = 0;
                want = journal::next_seq(want);
            }
        }
        if self.read_only {
            // Without writes the ring's position does not matter; what matters is whether a
            // replay would change anything: the newest entry of every sector in the committed
            // run must already be in place, data and tag.
            if !plan.empty && !self.run_in_place(j, plan.start, run, &committed)? {
                return Err(Error::ReadOnly(format!(
                    "{}: the dm-integrity journal holds committed writes not yet in place (the \
                     volume was not closed cleanly); open it read-write once to replay them",
                    self.backend.describe()
                )));
            }
            return Ok(report);
        }
        if report.entries > 0 {
            self.backend.flush()?;
        }
        if run == geo.sections && (j.mode == WriteMode::Journal || plan.empty) {
            j.section = plan.start;
            j.seq = want;
            if report.entries > 0 {
                // Mark it empty as the kernel's suspend does after writing back.
                self.mark_empty(j)?;
                report.cleared = true;
            }
        } else {
            let erase = journal::erase_seq(plan.last_used);
            for n in 0..geo.sections {
                let s = (plan.start + n) % geo.sections;
                geo.init_section(j.buf.as_mut_slice(), s, erase);
                self.backend
                    .write_at(j.buf.as_slice(), self.section_byte(&geo, s))?;
            }
            self.backend.flush()?;
            j.section = 0;
            j.seq = journal::next_seq(erase);
            report.cleared = true;
        }
        geo.init_section(j.buf.as_mut_slice(), j.section, j.seq);
        Ok(report)
    }

    /// Rewrites every section with all entries unused, keeping the ring's position: from the
    /// open section to the end in its sequence, the sections before it in the next (the
    /// kernel's suspend). Clobbers the section buffer.
    fn mark_empty(&self, j: &mut JournalState) -> Result<()> {
        let geo = j.geo;
        for s in 0..geo.sections {
            let seq = if s >= j.section {
                j.seq
            } else {
                journal::next_seq(j.seq)
            };
            geo.init_section(j.buf.as_mut_slice(), s, seq);
            self.backend
                .write_at(j.buf.as_slice(), self.section_byte(&geo, s))?;
        }
        self.backend.flush()
    }

    /// Writes the used entries (of the first `entries`) of the section in `j.buf` (last bytes
    /// restored) to their places: data runs of consecutive sectors in one area in one write,
    /// their tags patched into the tag sectors. From a replay, an entry beyond the device is
    /// skipped, as the kernel does.
    fn write_back(&self, j: &JournalState, entries: u32, from_replay: bool) -> Result<()> {
        let geo = &j.geo;
        let sec = j.buf.as_slice();
        let bb = geo.block_bytes();
        let tb = geo.tag_bytes;
        let spb = u64::from(geo.sectors_per_block);
        let provided = self.layout.sb.provided_data_sectors;
        let run_max = (CHUNK_BYTES / bb) as u32;
        let mut n = 0u32;
        while n < entries {
            let Entry::Sector(first) = geo.entry(sec, n) else {
                n += 1;
                continue;
            };
            if first % spb != 0 || first >= provided {
                if from_replay {
                    n += 1;
                    continue;
                }
                return Err(Error::Bug("journal entry outside the device"));
            }
            let e = self
                .layout
                .extent(first, u64::from(run_max.min(entries - n)))
                .filter(|e| e.blocks > 0)
                .ok_or(Error::Bug("integrity extent outside the device"))?;
            // The run: following entries for the following sectors, inside this extent.
            let mut len = 1u32;
            while u64::from(len) < e.blocks
                && n + len < entries
                && geo.entry(sec, n + len) == Entry::Sector(first + u64::from(len) * spb)
            {
                len += 1;
            }
            let data_len = len as usize * bb;
            let (tag_lo, span, at) = self.tag_span(e.tag_byte, u64::from(len));
            let d0 = geo.data_at(n);
            let data = &sec[d0..d0 + data_len];
            // The section's blocks go out as they are when the backend accepts their address
            // (the section is page-aligned, a block starts at a multiple of its size); else
            // through a bounce buffer. The grant holds ciphertext and tags only.
            let bounce = (data.as_ptr() as usize) % self.mem_align != 0;
            let tags_at = if bounce { self.io_offset(data_len) } else { 0 };
            let mut g = self.pool.take(tags_at + span)?;
            g.held_only_ciphertext();
            let (dbuf, tbuf) = g.as_mut_slice().split_at_mut(tags_at);
            let dbuf = &mut dbuf[..if bounce { data_len } else { 0 }];
            let tbuf = &mut tbuf[..span];
            if at != 0 || len as usize * tb != span {
                self.backend.read_exact_at(tbuf, tag_lo)?;
            }
            for k in 0..len {
                let t = geo.tag_at(n + k);
                let o = at + k as usize * tb;
                tbuf[o..o + tb].copy_from_slice(&sec[t..t + tb]);
            }
            let at_data = self.start_bytes + e.data_byte;
            if bounce {
                dbuf.copy_from_slice(data);
                self.backend.write_at(dbuf, at_data)?;
            } else {
                self.backend.write_at(data, at_data)?;
            }
            self.backend.write_at(tbuf, tag_lo)?;
            n += len;
        }
        Ok(())
    }

    /// True if the newest entry of every sector in the `run` committed sections from `start`
    /// already lies in its place, data and tag: a replay would change nothing, and a read-only
    /// open may go on. Walks the sections newest first (one set of the sectors seen, bounded
    /// by the journal's entries, allocated here).
    fn run_in_place(
        &self,
        j: &mut JournalState,
        start: u32,
        run: u32,
        committed: &[(Option<u8>, bool)],
    ) -> Result<bool> {
        let geo = j.geo;
        let mut seen = std::collections::HashSet::new();
        for k in (0..run).rev() {
            let i = (start + k) % geo.sections;
            if !committed[i as usize].1 {
                continue;
            }
            self.backend
                .read_exact_at(j.buf.as_mut_slice(), self.section_byte(&geo, i))?;
            geo.restore_last_bytes(j.buf.as_mut_slice());
            if !self.entries_in_place(j, &mut seen)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// True if every used entry of the section in `j.buf` (last bytes restored) whose sector is
    /// not in `seen` (newer entries) already lies in its place; adds its sectors to `seen`.
    fn entries_in_place(
        &self,
        j: &JournalState,
        seen: &mut std::collections::HashSet<u64>,
    ) -> Result<bool> {
        let geo = &j.geo;
        let sec = j.buf.as_slice();
        let bb = geo.block_bytes();
        let tb = geo.tag_bytes;
        let spb = u64::from(geo.sectors_per_block);
        let provided = self.layout.sb.provided_data_sectors;
        let mut g = self
            .pool
            .take(self.io_offset(bb) + 2 * self.io_align as usize + TUPLE_BYTES_MAX)?;
        for n in (0..geo.section_entries).rev() {
            let Entry::Sector(s) = geo.entry(sec, n) else {
                continue;
            };
            if s % spb != 0 || s >= provided || !seen.insert(s) {
                continue;
            }
            let e = self
                .layout
                .extent(s, 1)
                .filter(|e| e.blocks == 1)
                .ok_or(Error::Bug("integrity extent outside the device"))?;
            let (tag_lo, span, at) = self.tag_span(e.tag_byte, 1);
            let (dbuf, tbuf) = g.as_mut_slice().split_at_mut(self.io_offset(bb));
            let (dbuf, tbuf) = (&mut dbuf[..bb], &mut tbuf[..span]);
            self.backend
                .read_exact_at(dbuf, self.start_bytes + e.data_byte)?;
            self.backend.read_exact_at(tbuf, tag_lo)?;
            let (d, t) = (geo.data_at(n), geo.tag_at(n));
            if dbuf[..] != sec[d..d + bb] || tbuf[at..at + tb] != sec[t..t + tb] {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Commits the open section (if it holds entries): stamps every sector with the commit
    /// id, writes the section and flushes (the writes in it are durable from here), then
    /// writes its entries to their places and opens the next section of the ring.
    fn commit(&self, j: &mut JournalState) -> Result<()> {
        if j.failed {
            return Err(journal_failed());
        }
        if j.used == 0 {
            return Ok(());
        }
        let r = self.commit_inner(j);
        if r.is_err() {
            j.failed = true;
        }
        r
    }

    fn commit_inner(&self, j: &mut JournalState) -> Result<()> {
        let geo = j.geo;
        let s = j.section;
        if j.hold_writeback && j.held_sections >= geo.sections {
            return Err(Error::InvalidArgument(
                "journal write-back held for a test: the ring is full".into(),
            ));
        }
        if j.unflushed_writeback == Some(s) {
            // Overwriting this section's entries: their places must be durable first.
            self.backend.flush()?;
        }
        geo.stamp(j.buf.as_mut_slice(), s, j.seq);
        self.backend
            .write_at(j.buf.as_slice(), self.section_byte(&geo, s))?;
        self.backend.flush()?;
        j.unflushed_writeback = None;
        j.wrote = true;
        geo.restore_last_bytes(j.buf.as_mut_slice());
        if j.hold_writeback {
            j.held_sections += 1;
        } else {
            self.write_back(j, j.used, false)?;
            j.unflushed_writeback = Some(s);
        }
        j.section += 1;
        if j.section >= geo.sections {
            j.section = 0;
            j.seq = journal::next_seq(j.seq);
        }
        geo.init_section(j.buf.as_mut_slice(), j.section, j.seq);
        j.used = 0;
        Ok(())
    }

    /// Copies the open section's newest entries for blocks `first..` (`dbuf.len()` bytes) over
    /// what was read from their places, tags included.
    fn overlay(&self, j: &JournalState, first: u64, dbuf: &mut [u8], tuples: &mut [u8]) {
        let bb = self.block_bytes();
        let end = first + (dbuf.len() / 512) as u64;
        if j.used == 0 || j.hi <= first || j.lo >= end {
            return;
        }
        let geo = &j.geo;
        let tb = geo.tag_bytes;
        let spb = u64::from(geo.sectors_per_block);
        let sec = j.buf.as_slice();
        for n in 0..j.used {
            let Entry::Sector(s) = geo.entry(sec, n) else {
                continue;
            };
            if s < first || s >= end {
                continue;
            }
            let k = ((s - first) / spb) as usize;
            let d = geo.data_at(n);
            dbuf[k * bb..(k + 1) * bb].copy_from_slice(&sec[d..d + bb]);
            let t = geo.tag_at(n);
            tuples[k * tb..(k + 1) * tb].copy_from_slice(&sec[t..t + tb]);
        }
    }

    /// Marks the journal empty when closing after writes, as the kernel does when it suspends:
    /// commits what is open, writes it back, flushes, rewrites every section unused.
    fn finish(&self) -> Result<()> {
        let mut g = self.write_lock();
        let j = &mut *g;
        if self.read_only || j.failed || j.hold_writeback || j.mode != WriteMode::Journal {
            return Ok(());
        }
        self.commit(j)?;
        if !j.wrote {
            return Ok(());
        }
        self.backend.flush()?;
        j.unflushed_writeback = None;
        self.mark_empty(j)?;
        j.wrote = false;
        let (s, q) = (j.section, j.seq);
        j.geo.init_section(j.buf.as_mut_slice(), s, q);
        Ok(())
    }

    // ---- reads and writes of whole blocks ----

    /// Runs `f` with the tag cipher of `lane`: the caller's (lane 0) from the shared cache, a
    /// worker's its own.
    fn with_lane_cipher(
        &self,
        lane: usize,
        f: impl FnOnce(&mut TagCipher) -> Result<()>,
    ) -> Result<()> {
        if lane == 0 {
            return self.with_cipher(f);
        }
        let slot = self
            .lane_ciphers
            .get(lane - 1)
            .ok_or(Error::Bug("a crew lane without its tag cipher"))?;
        f(&mut lock(slot))
    }

    /// Reads, verifies and decrypts whole blocks starting at data sector `first` into `out`,
    /// split across lanes as `lanes` says. On failure, the error of the lowest failing chunk.
    fn read_blocks(
        &self,
        j: &JournalState,
        first: u64,
        out: &mut [u8],
        lanes: Lanes,
    ) -> Result<()> {
        if j.failed {
            return Err(journal_failed());
        }
        let bb = self.block_bytes();
        let chunks = lanes.chunks_for(out.len(), bb);
        let Lanes::Split {
            helpers,
            caller_helps,
            ..
        } = lanes
        else {
            return self.read_blocks_with(None, j, first, out);
        };
        if chunks < 2 && caller_helps {
            return self.read_blocks_with(None, j, first, out);
        }
        let work = ReadSplit {
            vol: self,
            j,
            first,
            out: out.as_mut_ptr(),
            blocks: out.len() / bb,
            split: SplitState::new(chunks, self.mem_align.div_ceil(bb)),
        };
        self.splits.fetch_add(1, Ordering::Relaxed);
        self.crew.run(&work, helpers, caller_helps)?;
        work.split.result()
    }

    /// [`IntegrityVolume::read_blocks`] on one thread with cipher `c` (or, with `None`, one
    /// borrowed from the cache for each run's crypto): runs of at most
    /// [`CHUNK_BYTES`] in one area, each read in two backend calls (data and tags). The data
    /// lands straight in `out` when `out` sits at an address the backend accepts (no copy).
    fn read_blocks_with(
        &self,
        mut c: Option<&mut TagCipher>,
        j: &JournalState,
        first: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let bb = self.block_bytes();
        debug_assert!(out.len() % bb == 0);
        let mut done = 0usize;
        while done < out.len() {
            let sector = first + (done / 512) as u64;
            let run = self.run_at(sector, ((out.len() - done) / bb).min(CHUNK_BYTES / bb))?;
            let data_len = run.blocks * bb;
            let dst = &mut out[done..done + data_len];
            if (dst.as_ptr() as usize) % self.mem_align == 0 {
                // Only tags in the grant: nothing secret to wipe.
                let mut g = self.pool.take(run.tag_span)?;
                g.held_only_ciphertext();
                self.verify_run(
                    c.as_deref_mut(),
                    j,
                    sector,
                    &run,
                    dst,
                    &mut g.as_mut_slice()[..run.tag_span],
                )?;
            } else {
                let tags_at = self.io_offset(data_len);
                let mut g = self.pool.take(tags_at + run.tag_span)?;
                let (dbuf, tbuf) = g.as_mut_slice().split_at_mut(tags_at);
                let dbuf = &mut dbuf[..data_len];
                let tbuf = &mut tbuf[..run.tag_span];
                self.verify_run(c.as_deref_mut(), j, sector, &run, dbuf, tbuf)?;
                dst.copy_from_slice(dbuf);
            }
            done += data_len;
        }
        Ok(())
    }

    /// Reads one run's data into `dbuf` and its tag span into `tbuf`, lays the open journal
    /// section's newer blocks over them, then verifies and decrypts `dbuf` in place. A block
    /// that fails leaves `dbuf` wiped (no unauthenticated plaintext) and is counted.
    fn verify_run(
        &self,
        c: Option<&mut TagCipher>,
        j: &JournalState,
        sector: u64,
        run: &Run,
        dbuf: &mut [u8],
        tbuf: &mut [u8],
    ) -> Result<()> {
        let tb = usize::from(self.layout.sb.tag_bytes);
        self.backend.read_exact_at(dbuf, run.data_byte)?;
        self.backend.read_exact_at(tbuf, run.tag_lo)?;
        let tuples = &mut tbuf[run.tag_at..run.tag_at + run.blocks * tb];
        self.overlay(j, sector, dbuf, tuples);
        let bb = self.block_bytes();
        let verdict = match c {
            Some(c) => c.open(sector, bb, dbuf, tuples)?,
            None => self.with_cipher(|c| c.open(sector, bb, dbuf, tuples))?,
        };
        if let Err(m) = verdict {
            self.integrity_errors.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Integrity { sector: m.sector });
        }
        Ok(())
    }

    /// Seals (fresh IVs, encryption, tuples) and writes whole blocks starting at data sector
    /// `first`, in pieces of at most [`WRITE_PIECE_BYTES`] inside one area: each piece's seal
    /// is split across lanes as `lanes` says, then written by the caller, through the journal
    /// or in direct mode data then tags. The caller holds `self.io_lock` exclusively.
    fn write_blocks(
        &self,
        j: &mut JournalState,
        first: u64,
        len: usize,
        src: Src<'_>,
        lanes: Lanes,
    ) -> Result<()> {
        if j.failed {
            return Err(journal_failed());
        }
        let bb = self.block_bytes();
        let tb = usize::from(self.layout.sb.tag_bytes);
        debug_assert!(len % bb == 0);
        let piece_max = WRITE_PIECE_BYTES / bb * bb;
        let direct = j.mode == WriteMode::Direct;
        let mut done = 0usize;
        while done < len {
            let sector = first + (done / 512) as u64;
            // A piece is one run: its data is one backend write from the start of the grant.
            let run = self.run_at(sector, (len - done).min(piece_max) / bb)?;
            let blocks = run.blocks;
            let n = blocks * bb;
            // One grant for the piece: ciphertext, (direct mode) the run's tag span, tuples.
            // It never holds plaintext: the seal reads the caller's buffer and writes
            // ciphertext here (zeroes are no secret).
            let tags_at = self.io_offset(n);
            let span = if direct { run.tag_span } else { 0 };
            let mut g = self.pool.take(tags_at + span + blocks * tb)?;
            g.held_only_ciphertext();
            let (dbuf, rest) = g.as_mut_slice().split_at_mut(tags_at);
            let dbuf = &mut dbuf[..n];
            let (tbuf, tuples) = rest.split_at_mut(span);
            let tuples = &mut tuples[..blocks * tb];
            let plain = match src {
                Src::Bytes(b) => Some(&b[done..done + n]),
                Src::Zeroes => {
                    dbuf.fill(0);
                    None
                }
            };
            self.seal_blocks(sector, plain, dbuf, tuples, lanes)?;
            if direct {
                self.write_sealed(&run, dbuf, tuples, tbuf)?;
            } else {
                self.journal_sealed(j, sector, dbuf, tuples)?;
            }
            done += n;
        }
        Ok(())
    }

    /// Seals the blocks of `dbuf` (from `plain`, or in place) and fills `tuples`, on the
    /// caller alone or split across lanes.
    fn seal_blocks(
        &self,
        first: u64,
        plain: Option<&[u8]>,
        dbuf: &mut [u8],
        tuples: &mut [u8],
        lanes: Lanes,
    ) -> Result<()> {
        let bb = self.block_bytes();
        let chunks = lanes.chunks_for(dbuf.len(), bb);
        match lanes {
            Lanes::Split {
                helpers,
                caller_helps,
                ..
            } if chunks >= 2 || !caller_helps => {
                let work = SealSplit {
                    vol: self,
                    first,
                    plain: plain.map_or(std::ptr::null(), |p| p.as_ptr()),
                    dbuf: dbuf.as_mut_ptr(),
                    tuples: tuples.as_mut_ptr(),
                    blocks: dbuf.len() / bb,
                    split: SplitState::new(chunks, 1),
                };
                assert!(plain.is_none_or(|p| p.len() == dbuf.len()));
                assert_eq!(tuples.len(), work.blocks * self.mode.tuple_bytes());
                self.splits.fetch_add(1, Ordering::Relaxed);
                self.crew.run(&work, helpers, caller_helps)?;
                work.split.result()
            }
            _ => self.with_cipher(|c| c.seal_to(first, bb, plain, dbuf, tuples)),
        }
    }

    /// Direct mode: writes one run of sealed blocks to its place: the data, then the tags,
    /// patched into the tag sectors they share with neighbouring blocks (read, patch, write;
    /// `tbuf` holds the run's tag span).
    fn write_sealed(&self, run: &Run, dbuf: &[u8], tuples: &[u8], tbuf: &mut [u8]) -> Result<()> {
        let tb = usize::from(self.layout.sb.tag_bytes);
        let n = run.blocks;
        assert!(
            dbuf.len() == n * self.block_bytes()
                && tuples.len() == n * tb
                && tbuf.len() == run.tag_span,
            "write_sealed: buffer sizes"
        );
        if run.tag_at != 0 || n * tb != run.tag_span {
            self.backend.read_exact_at(tbuf, run.tag_lo)?;
        }
        tbuf[run.tag_at..run.tag_at + n * tb].copy_from_slice(tuples);
        self.backend.write_at(dbuf, run.data_byte)?;
        self.backend.write_at(tbuf, run.tag_lo)
    }

    /// Journal mode: copies sealed blocks from data sector `first` into the open section,
    /// committing each section that fills.
    fn journal_sealed(
        &self,
        j: &mut JournalState,
        first: u64,
        dbuf: &[u8],
        tuples: &[u8],
    ) -> Result<()> {
        let bb = self.block_bytes();
        let tb = usize::from(self.layout.sb.tag_bytes);
        let spb = u64::from(j.geo.sectors_per_block);
        let blocks = dbuf.len() / bb;
        let mut k = 0usize;
        while k < blocks {
            if j.used == j.geo.section_entries {
                self.commit(j)?;
            }
            let sector = first + k as u64 * spb;
            let free = (j.geo.section_entries - j.used) as usize;
            let n = (blocks - k).min(free);
            let d0 = j.geo.data_at(j.used);
            // The data first: an entry keeps the last bytes of its block's sectors.
            j.buf.as_mut_slice()[d0..d0 + n * bb].copy_from_slice(&dbuf[k * bb..(k + n) * bb]);
            for i in 0..n {
                j.geo.set_entry(
                    j.buf.as_mut_slice(),
                    j.used + i as u32,
                    sector + i as u64 * spb,
                    &tuples[(k + i) * tb..(k + i + 1) * tb],
                );
            }
            let end = sector + n as u64 * spb;
            if j.used == 0 {
                (j.lo, j.hi) = (sector, end);
            } else {
                (j.lo, j.hi) = (j.lo.min(sector), j.hi.max(end));
            }
            j.used += n as u32;
            k += n;
        }
        Ok(())
    }

    /// Splits `offset..offset+len` into a partial head block, whole blocks, a partial tail.
    fn split(&self, offset: u64, len: usize) -> (usize, usize, usize) {
        let bb = self.block_bytes();
        let head_off = (offset % bb as u64) as usize;
        let head = if head_off == 0 {
            0
        } else {
            (bb - head_off).min(len)
        };
        let mid = (len - head) / bb * bb;
        (head, mid, len - head - mid)
    }

    /// A partial block: read it whole (verified), patch `n` bytes at `within`, write it whole.
    fn rmw(
        &self,
        j: &mut JournalState,
        block_off: u64,
        within: usize,
        piece: Src<'_>,
        n: usize,
    ) -> Result<()> {
        let bb = self.block_bytes();
        let mut blk = [0u8; BLOCK_BYTES_MAX];
        let blk = &mut blk[..bb];
        let r = (|| {
            self.read_blocks(j, block_off / 512, blk, Lanes::Inline)?;
            match piece {
                Src::Bytes(b) => blk[within..within + n].copy_from_slice(b),
                Src::Zeroes => blk[within..within + n].fill(0),
            }
            self.write_blocks(j, block_off / 512, bb, Src::Bytes(blk), Lanes::Inline)
        })();
        blk.fill(0);
        r
    }

    fn write_any(&self, offset: u64, len: usize, src: Src<'_>) -> Result<()> {
        check_range(offset, len as u64, self.size())?;
        if self.read_only {
            return Err(Error::ReadOnly(
                "the integrity volume was opened read-only".into(),
            ));
        }
        let (head, mid, tail) = self.split(offset, len);
        let (lanes, _big) = self.lanes_for(true, mid);
        let mut g = self.write_lock();
        let j = &mut *g;
        let sub = |from: usize, n: usize| match src {
            Src::Bytes(b) => Src::Bytes(&b[from..from + n]),
            Src::Zeroes => Src::Zeroes,
        };
        let bb = self.block_bytes() as u64;
        if head > 0 {
            let block_off = align_down(offset, bb);
            self.rmw(
                j,
                block_off,
                (offset - block_off) as usize,
                sub(0, head),
                head,
            )?;
        }
        if mid > 0 {
            self.write_blocks(j, (offset + head as u64) / 512, mid, sub(head, mid), lanes)?;
        }
        if tail > 0 {
            let block_off = offset + (head + mid) as u64;
            self.rmw(j, block_off, 0, sub(head + mid, tail), tail)?;
        }
        Ok(())
    }
}

impl Drop for IntegrityVolume {
    fn drop(&mut self) {
        // Errors cannot be returned here; the journal stays valid either way (a later open
        // replays what was committed).
        let _ = self.finish();
    }
}

impl BlockDev for IntegrityVolume {
    fn size(&self) -> u64 {
        self.layout.sb.provided_data_sectors * 512
    }

    fn block_size(&self) -> u32 {
        self.layout.sb.block_bytes()
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size())?;
        let bb = self.block_bytes();
        let (head, mid, tail) = self.split(offset, buf.len());
        let (lanes, _big) = self.lanes_for(false, mid);
        let mut blk = [0u8; BLOCK_BYTES_MAX];
        let g = self.io_lock.read().unwrap_or_else(|p| p.into_inner());
        let j = &*g;
        let r = (|| {
            if head > 0 {
                let block_off = align_down(offset, bb as u64);
                self.read_blocks(j, block_off / 512, &mut blk[..bb], Lanes::Inline)?;
                let within = (offset - block_off) as usize;
                buf[..head].copy_from_slice(&blk[within..within + head]);
            }
            if mid > 0 {
                let at = (offset + head as u64) / 512;
                self.read_blocks(j, at, &mut buf[head..head + mid], lanes)?;
            }
            if tail > 0 {
                let at = (offset + (head + mid) as u64) / 512;
                self.read_blocks(j, at, &mut blk[..bb], Lanes::Inline)?;
                buf[head + mid..].copy_from_slice(&blk[..tail]);
            }
            Ok(())
        })();
        blk.fill(0);
        r
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_any(offset, buf.len(), Src::Bytes(buf))
    }

    /// Journal mode: commits the open section (its writes are then durable). Direct mode:
    /// flushes the backend.
    fn flush(&self) -> Result<()> {
        let mut g = self.write_lock();
        let j = &mut *g;
        if j.failed {
            return Err(journal_failed());
        }
        if j.used > 0 {
            self.commit(j)
        } else {
            self.backend.flush()
        }
    }

    /// Discards are advisory and dm-crypt refuses them on authenticated volumes unless asked;
    /// nothing is freed here (a discarded range keeps its old data and tags).
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(offset, len, self.size())?;
        if self.read_only {
            return Err(Error::ReadOnly(
                "the integrity volume was opened read-only".into(),
            ));
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let len = usize::try_from(len).map_err(|_| Error::OutOfRange {
            offset,
            len,
            size: self.size(),
        })?;
        self.write_any(offset, len, Src::Zeroes)
    }
}

/// Writes the superblock of `l` at `start_bytes` and its journal as the kernel initialises it
/// when it formats (every section in sequence 0, every entry unused), then flushes: a new
/// dm-integrity device. Without a valid journal the kernel (and ucrypt) refuse the device.
pub fn write_new_device(backend: &dyn Backend, start_bytes: u64, l: &Layout) -> Result<()> {
    backend.write_at(&l.sb.serialize(), start_bytes)?;
    let geo = Geometry::new(l)?;
    let mut sec = AlignedBuf::new(geo.section_bytes());
    for i in 0..geo.sections {
        geo.init_section(sec.as_mut_slice(), i, 0);
        let at = start_bytes + (SB_SECTORS + u64::from(i) * u64::from(geo.section_sectors)) * 512;
        backend.write_at(sec.as_slice(), at)?;
    }
    backend.flush()
}

/// The byte offset of the dm-integrity superblock of a LUKS2 header's authenticated data
/// segment (the segment offset); `None` if the header has none.
pub fn superblock_offset(hdr: &Header) -> Option<u64> {
    let Header::Luks2(h) = hdr else {
        return None;
    };
    h.meta
        .segments
        .values()
        .find(|s| s.kind == SegmentKind::Crypt && s.integrity.is_some())
        .map(|s| s.offset.0)
}

/// The dm-integrity superblock under a LUKS2 header's authenticated segment (at the segment
/// offset of `data`), with its layout checked against `data`'s size; `None` if the header has
/// no authenticated segment.
pub fn read_superblock(data: &dyn Backend, hdr: &Header) -> Result<Option<Layout>> {
    let Some(start) = superblock_offset(hdr) else {
        return Ok(None);
    };
    let sb = Superblock::parse(&read_area(data, start, SB_BYTES as u64)?)?;
    Layout::for_device(sb, start / 512, data.size() / 512).map(Some)
}

/// The write mode cryptsetup would activate a LUKS2 volume in: direct when its persistent
/// flags say `no-journal` (`cryptsetup refresh --integrity-no-journal --persistent`), else
/// the journal.
pub fn luks2_write_mode(hdr: &Header) -> WriteMode {
    if hdr.activation_flags().iter().any(|f| f == "no-journal") {
        WriteMode::Direct
    } else {
        WriteMode::Journal
    }
}

/// Opens the authenticated data segment of a LUKS2 volume whose key is already unlocked:
/// reads the dm-integrity superblock at the segment offset and checks it against the header;
/// writes in the mode the header's flags ask ([`luks2_write_mode`]). Replays the journal.
pub fn open_luks2(
    backend: Arc<dyn Backend>,
    hdr: &Header,
    vk: &VolumeKey,
    read_only: bool,
) -> Result<IntegrityVolume> {
    open_luks2_mode(backend, hdr, vk, read_only, luks2_write_mode(hdr))
}

/// [`open_luks2`] in an explicit write mode (cryptsetup's `open --integrity-no-journal` asks
/// for [`WriteMode::Direct`]).
pub fn open_luks2_mode(
    backend: Arc<dyn Backend>,
    hdr: &Header,
    vk: &VolumeKey,
    read_only: bool,
    write_mode: WriteMode,
) -> Result<IntegrityVolume> {
    vk.require_bound()?;
    let Header::Luks2(h) = hdr else {
        return Err(Error::UnsupportedLuks(
            "LUKS1 has no authenticated encryption".into(),
        ));
    };
    let crypt: Vec<_> = h
        .meta
        .segments
        .values()
        .filter(|s| s.kind == SegmentKind::Crypt)
        .collect();
    let [seg] = crypt[..] else {
        return Err(Error::UnsupportedLuks(format!(
            "{} crypt segments (ucrypt opens volumes with exactly one)",
            crypt.len()
        )));
    };
    let integ = seg.integrity.as_ref().ok_or_else(|| {
        Error::InvalidArgument("the data segment has no integrity protection".into())
    })?;
    if integ.journal_encryption != "none" || integ.journal_integrity != "none" {
        return Err(Error::UnsupportedLuks(format!(
            "journal encryption '{}' / journal integrity '{}' (ucrypt supports 'none')",
            integ.journal_encryption, integ.journal_integrity
        )));
    }
    if seg.iv_tweak.is_some_and(|t| t.0 != 0) {
        return Err(Error::UnsupportedLuks(
            "an authenticated segment with an IV tweak".into(),
        ));
    }
    let mode = TagMode::from_luks2(
        seg.encryption.as_deref().unwrap_or(""),
        &integ.kind,
        vk.bytes().len(),
    )?;
    let sector = u64::from(seg.sector_size.unwrap_or(512));
    let start = seg.offset.0;
    let sb_bytes = read_area(backend.as_ref(), start, SB_BYTES as u64)?;
    let sb = Superblock::parse(&sb_bytes)?;
    if u64::from(sb.block_bytes()) != sector {
        return Err(Error::BadHeader {
            check: "integrity block size",
            detail: format!(
                "the superblock's blocks are {} bytes, the segment's sectors {sector}",
                sb.block_bytes()
            ),
        });
    }
    hdr.check_requirements()?;
    IntegrityVolume::with_write_mode(
        backend,
        start,
        sb,
        mode,
        SecretBytes::from_slice(vk.bytes()),
        read_only,
        write_mode,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemBackend;
    use crate::integrity::superblock::flags;

    const DEVICE_BYTES: u64 = 2 << 20;

    /// Memory whose writes take a while, so that a reader racing a writer would land between a
    /// block's data and its tag if nothing kept it out.
    struct SlowWrites(MemBackend);

    impl Backend for SlowWrites {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
            self.0.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
            std::thread::sleep(std::time::Duration::from_micros(200));
            self.0.write_at(buf, offset)
        }
        fn flush(&self) -> Result<()> {
            self.0.flush()
        }
        fn discard(&self, offset: u64, len: u64) -> Result<()> {
            self.0.discard(offset, len)
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
            self.0.write_zeroes(offset, len)
        }
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn logical_block_bytes(&self) -> u32 {
            512
        }
        fn describe(&self) -> String {
            "slow memory".into()
        }
    }

    fn mem_volume(mode: TagMode) -> IntegrityVolume {
        let be: Arc<dyn Backend> = Arc::new(SlowWrites(MemBackend::new(DEVICE_BYTES)));
        mem_volume_on(be, mode, false)
    }

    fn mem_volume_on(be: Arc<dyn Backend>, mode: TagMode, read_only: bool) -> IntegrityVolume {
        let mut sb = Superblock {
            version: 4,
            log2_interleave_sectors: 10,
            tag_bytes: mode.tuple_bytes() as u16,
            journal_sections: 1,
            provided_data_sectors: 8,
            flags: flags::FIXED_PADDING,
            log2_sectors_per_block: 0,
            log2_blocks_per_bitmap_bit: 0,
            recalc_sector: 0,
            salt: [0; 16],
        };
        sb.provided_data_sectors = Layout::new(sb)
            .expect("layout")
            .max_provided_sectors(0, DEVICE_BYTES / 512);
        let key: Vec<u8> = (0..mode.key_bytes() as u8).collect();
        let l = Layout::new(sb).expect("layout");
        if Superblock::parse(&read_area(be.as_ref(), 0, SB_BYTES as u64).expect("read")).is_err() {
            write_new_device(be.as_ref(), 0, &l).expect("format");
        }
        IntegrityVolume::new(be, 0, sb, mode, SecretBytes::from_slice(&key), read_only)
            .expect("volume")
    }

    /// Readers racing writers over the same blocks (which share tag sectors) never see a block
    /// between its data and its tag: no spurious integrity error, only whole written patterns.
    #[test]
    fn concurrent_reads_and_writes_never_fail_verification() {
        use std::sync::atomic::AtomicBool;
        let v = Arc::new(mem_volume(TagMode::AesGcmRandom { key_bytes: 32 }));
        const BLOCKS: usize = 8;
        const WRITES_PER_WRITER: usize = 100;
        v.write_at(&[1u8; BLOCKS * 512], 0).expect("initial write");
        let done = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..2u8)
            .map(|t| {
                let v = v.clone();
                std::thread::spawn(move || {
                    for i in 0..WRITES_PER_WRITER {
                        let block = (i * 3 + usize::from(t)) % BLOCKS;
                        let fill = vec![(t * 100 + (i % 100) as u8) | 1; 512];
                        v.write_at(&fill, (block * 512) as u64).expect("write");
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (v, done) = (v.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; BLOCKS * 512];
                    let mut reads = 0u64;
                    while !done.load(Ordering::Relaxed) {
                        v.read_at(&mut buf, 0).expect("read verifies");
                        for b in buf.chunks(512) {
                            assert!(b.iter().all(|&x| x == b[0]), "a whole written pattern");
                        }
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        done.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().expect("reader") > 0);
        }
        assert_eq!(v.integrity_errors(), 0);
    }

    #[test]
    fn ranges_read_only_and_unaligned_requests() {
        let mode = TagMode::AesXtsRandomHmac(crate::integrity::HmacHash::Sha256);
        let be: Arc<dyn Backend> = Arc::new(MemBackend::new(DEVICE_BYTES));
        let v = mem_volume_on(be.clone(), mode, false);
        let size = v.size();
        assert!(matches!(
            v.read_at(&mut [0u8; 512], size),
            Err(Error::OutOfRange { .. })
        ));
        v.write_at(&[7u8; 4096], 0).expect("write");
        v.write_at(&[9u8; 1000], 100).expect("unaligned write");
        v.write_zeroes(3000, 200).expect("zeroes");
        let mut b = vec![0u8; 4096];
        v.read_at(&mut b[..3333], 1).expect("unaligned read");
        let mut want = vec![7u8; 4096];
        want[100..1100].fill(9);
        want[3000..3200].fill(0);
        assert_eq!(&b[..3333], &want[1..3334]);
        v.flush().expect("flush: commits the open journal section");
        // Committed and written back: a read-only open checks the entries are in place.
        let ro = mem_volume_on(be.clone(), mode, true);
        let mut b = vec![0u8; 4096];
        ro.read_at(&mut b[..3333], 1)
            .expect("read-only, entries in place");
        assert_eq!(&b[..3333], &want[1..3334]);
        assert!(matches!(
            ro.write_at(&[0u8; 512], 0),
            Err(Error::ReadOnly(_))
        ));
        drop(ro);
        // Committed, not written back (as after a crash): a read-only open refuses.
        v.hold_writeback_for_tests();
        v.write_at(&[3u8; 1024], 2048).expect("write");
        v.flush().expect("commit");
        let ro = IntegrityVolume::new(
            v.backend.clone(),
            0,
            v.layout.sb,
            v.mode,
            SecretBytes::from_slice(v.key.as_ref()),
            true,
        );
        assert!(
            matches!(ro, Err(Error::ReadOnly(_))),
            "a journal with entries not in place refuses a read-only open"
        );
        drop(v);
        // A read-write open replays them; afterwards the journal is empty.
        let rw = mem_volume_on(be.clone(), mode, false);
        assert_eq!(rw.replay_report().entries, 2);
        drop(rw);
        let ro = mem_volume_on(be, mode, true);
        want[2048..3072].fill(3);
        ro.read_at(&mut b, 0).expect("read after the replay");
        assert_eq!(b, want);
    }
}
