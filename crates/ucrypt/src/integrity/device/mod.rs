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
//! volume's engine splits one, under the volume's [`crate::engine::Policies`]. A read's whole blocks are cut
//! into chunks that the caller and the workers of the volume's crew (`engine::crew`) claim one at a time,
//! each fetching its blocks' data and tags, verifying and decrypting them (`ReadSplit`). A
//! write is cut into pieces of at most [`WRITE_PIECE_BYTES`]: a piece's blocks are sealed
//! (fresh IVs, encryption, tags) in chunks on the caller and the workers (`SealSplit`), then
//! the caller alone writes them, to the journal or in direct mode to their places, in the
//! order a write on one thread would: the backend sees the same writes, in the same order,
//! whatever the policy. The locks do not change: the caller holds the volume's lock (shared
//! for a read, exclusive for a write, from the first seal to the last tag write) until every
//! chunk has finished, so the workers run inside the request's critical section.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockWriteGuard};

use crate::backend::Backend;
use crate::blockdev::check_range;
use crate::engine::crew::{Crew, CREW_WORKERS_MAX};
use crate::engine::Policy;
use crate::integrity::journal::Geometry;
use crate::integrity::layout::Layout;
use crate::integrity::superblock::{Superblock, SB_SECTORS};
use crate::integrity::tag::{TagCipher, TagMode};
use crate::pool::BufferPool;
use crate::sync::lock;
use crate::volume::AUTO_MIN_BYTES_CEIL;
use crate::{BlockDev, Error, Result, SecretBytes};

mod dispatch;
mod journal_io;
mod open;
mod read;
#[cfg(test)]
mod tests;
mod write;

use dispatch::Lanes;
pub use open::{
    luks2_write_mode, open_luks2, open_luks2_mode, read_superblock, superblock_offset,
    write_new_device,
};

/// Blocks handled per backend call pair (data + tags) of a read, and per write-back run of
/// the journal; bounds the scratch each takes.
pub const CHUNK_BYTES: usize = 256 << 10;
/// A write is sealed and written in pieces of at most this: one pool grant holds a piece's
/// ciphertext, tuples and tag span; the piece's seal is what a split shares between lanes.
pub const WRITE_PIECE_BYTES: usize = 1 << 20;
/// The pool grant of one write piece at most: ciphertext, tuples, and the tag span of its
/// run (direct mode), with three 4 KiB units of alignment slack (the span's ends, and the
/// span's start after the ciphertext).
pub(super) const WRITE_GRANT_BYTES_MAX: usize =
    WRITE_PIECE_BYTES + 2 * (WRITE_PIECE_BYTES / 512) * TUPLE_BYTES_MAX + 3 * 4096;
/// The pool grant of one read run or journal write-back run at most (data, tag span, the
/// same slack).
pub(super) const RUN_GRANT_BYTES_MAX: usize =
    CHUNK_BYTES + (CHUNK_BYTES / 512) * TUPLE_BYTES_MAX + 3 * 4096;
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
pub(super) const BLOCK_BYTES_MAX: usize = 4096;
/// Alignment of the journal section buffer (the largest memory alignment O_DIRECT asks).
pub(super) const JOURNAL_BUF_ALIGN: usize = 4096;
/// The largest journal section accepted: 8 entry sectors of 21 entries (the smallest entry,
/// 24 bytes) of 4 KiB blocks, plus the entry sectors. Bounds the one section buffer.
pub(super) const JOURNAL_SECTION_BYTES_MAX: usize = (8 + 8 * 21 * 8) * 512;

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
pub(super) struct AlignedBuf {
    pub(super) raw: Vec<u8>,
    pub(super) off: usize,
    pub(super) len: usize,
}

impl AlignedBuf {
    pub(super) fn new(len: usize) -> Self {
        let raw = vec![0u8; len + JOURNAL_BUF_ALIGN];
        let off = raw.as_ptr().align_offset(JOURNAL_BUF_ALIGN);
        assert!(off < JOURNAL_BUF_ALIGN, "alignment offset inside the slack");
        AlignedBuf { raw, off, len }
    }
    pub(super) fn as_slice(&self) -> &[u8] {
        &self.raw[self.off..self.off + self.len]
    }
    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.off..self.off + self.len]
    }
}

/// The journal's state in memory: the open section (entries not yet committed) and where the
/// ring goes on. Lives inside the volume's reader-writer lock: writers change it, readers look
/// up blocks in the open section.
pub(super) struct JournalState {
    pub(super) geo: Geometry,
    pub(super) mode: WriteMode,
    /// The open section's index in the ring and the sequence its commit will carry.
    pub(super) section: u32,
    pub(super) seq: u8,
    /// Entries filled in the open section.
    pub(super) used: u32,
    /// Data sectors the open section's entries cover: `lo..hi` (empty when `used == 0`).
    pub(super) lo: u64,
    pub(super) hi: u64,
    /// The open section in its on-disk layout; data blocks hold their own last bytes (the
    /// commit ids are stamped only while the section is written).
    pub(super) buf: AlignedBuf,
    /// The section whose entries were last written to their places without a flush since.
    pub(super) unflushed_writeback: Option<u32>,
    /// Something was committed since opening: closing marks the journal empty, as the kernel
    /// does when it suspends.
    pub(super) wrote: bool,
    /// Test hook: committed sections are not written to their places.
    pub(super) hold_writeback: bool,
    pub(super) held_sections: u32,
    /// A journal write failed: the volume refuses further I/O (the kernel fails the device).
    pub(super) failed: bool,
}

/// Where and how a LUKS2 volume's data is authenticated.
pub struct IntegrityVolume {
    pub(super) backend: Arc<dyn Backend>,
    /// Byte offset of the dm-integrity superblock on the backend (the segment offset).
    pub(super) start_bytes: u64,
    pub(super) layout: Layout,
    pub(super) mode: TagMode,
    pub(super) key: SecretBytes,
    pub(super) ciphers: Mutex<Vec<TagCipher>>,
    pub(super) pool: BufferPool,
    /// Writes hold it exclusively (tag sectors are shared between neighbouring blocks, a
    /// direct write stores data and tags in two steps, a journal write fills the open
    /// section); reads hold it shared, so a read never sees a block between its data and its
    /// tag (dm-integrity's range locks give the kernel the same).
    pub(super) io_lock: RwLock<JournalState>,
    /// Backend I/O alignment (at least 512).
    pub(super) io_align: u64,
    /// Backend memory alignment: a read into a caller's buffer aligned to it needs no copy.
    pub(super) mem_align: usize,
    pub(super) read_only: bool,
    pub(super) integrity_errors: AtomicU64,
    pub(super) replay: ReplayReport,
    /// The threads large requests are split across (lanes `1..=workers`; the caller is 0).
    pub(super) crew: Crew,
    /// One keyed tag cipher per crew worker (lane `i + 1` uses `lane_ciphers[i]`), made when
    /// the volume opens: each lives in its `SecretBox`es, and only its worker locks it.
    pub(super) lane_ciphers: Box<[Mutex<TagCipher>]>,
    /// Threads that can do crypto at once: the machine's cores (at most [`LANES_MAX`]).
    pub(super) lanes: usize,
    /// The dispatch policy of reads (0) and writes (1) ([`Policy::to_u8`]).
    pub(super) policy: [AtomicU8; 2],
    /// `auto` splits requests of at least this many bytes (calibrated when opening).
    pub(super) auto_min_bytes: AtomicU64,
    /// `auto` requests at or above the threshold running now.
    pub(super) big_inflight: AtomicU32,
    /// Pieces of requests handed to the crew since opening (see `split_pieces`).
    pub(super) splits: AtomicU64,
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

    /// Chunks of the scratch buffers whose `mlock` failed (RLIMIT_MEMLOCK): plaintext in them
    /// may be swapped out.
    pub fn buffer_lock_failures(&self) -> u64 {
        self.pool.lock_failures()
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
}

/// Where the bytes of a write come from.
#[derive(Clone, Copy)]
pub(super) enum Src<'a> {
    Bytes(&'a [u8]),
    Zeroes,
}

/// One run of whole blocks in one area, as reads and direct writes walk it: its data on the
/// backend and the aligned span holding its tags.
pub(super) struct Run {
    pub(super) data_byte: u64,
    pub(super) blocks: usize,
    pub(super) tag_lo: u64,
    pub(super) tag_span: usize,
    /// Where the run's first tag sits inside the span.
    pub(super) tag_at: usize,
}

pub(super) fn align_down(v: u64, a: u64) -> u64 {
    v / a * a
}

pub(super) fn journal_failed() -> Error {
    Error::io(
        "integrity journal",
        std::io::Error::other("an earlier journal write failed; the volume refuses I/O"),
    )
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
