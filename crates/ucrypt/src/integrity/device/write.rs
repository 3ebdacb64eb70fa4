//! The write path: blocks sealed (fresh IVs, encryption, tags) in pieces, then written to the
//! journal or, in direct mode, to their places; partial blocks through a read-modify-write.

use std::sync::atomic::Ordering;

use crate::blockdev::check_range;
use crate::{BlockDev, Error, Result};

use super::dispatch::{Lanes, SealSplit, SplitState};
use super::{
    align_down, journal_failed, IntegrityVolume, JournalState, Run, Src, WriteMode,
    BLOCK_BYTES_MAX, WRITE_PIECE_BYTES,
};

impl IntegrityVolume {
    /// Seals (fresh IVs, encryption, tuples) and writes whole blocks starting at data sector
    /// `first`, in pieces of at most [`WRITE_PIECE_BYTES`] inside one area: each piece's seal
    /// is split across lanes as `lanes` says, then written by the caller, through the journal
    /// or in direct mode data then tags. The caller holds `self.io_lock` exclusively.
    pub(super) fn write_blocks(
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
    pub(super) fn seal_blocks(
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
    pub(super) fn write_sealed(
        &self,
        run: &Run,
        dbuf: &[u8],
        tuples: &[u8],
        tbuf: &mut [u8],
    ) -> Result<()> {
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

    /// Splits `offset..offset+len` into a partial head block, whole blocks, a partial tail.
    pub(super) fn split(&self, offset: u64, len: usize) -> (usize, usize, usize) {
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
    pub(super) fn rmw(
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

    pub(super) fn write_any(&self, offset: u64, len: usize, src: Src<'_>) -> Result<()> {
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
