//! The read path: whole blocks' data and tags fetched, each tag verified before its plaintext
//! leaves, on one lane or split.

use std::sync::atomic::Ordering;

use crate::integrity::tag::TagCipher;
use crate::sync::lock;
use crate::{Error, Result};

use super::dispatch::{Lanes, ReadSplit, SplitState};
use super::{journal_failed, IntegrityVolume, JournalState, Run, CHUNK_BYTES};

impl IntegrityVolume {
    /// Runs `f` with the tag cipher of `lane`: the caller's (lane 0) from the shared cache, a
    /// worker's its own.
    pub(super) fn with_lane_cipher(
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
    pub(super) fn read_blocks(
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
    pub(super) fn read_blocks_with(
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
    pub(super) fn verify_run(
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
}
