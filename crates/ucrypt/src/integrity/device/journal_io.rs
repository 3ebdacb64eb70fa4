//! dm-integrity's journal on disk: replay at open, commit of a section, write-back of its
//! entries to their places, and the overlay that lets reads see what the open section holds.

use crate::integrity::journal::{self, Entry, Scan};
use crate::{Error, Result};

use super::{
    journal_failed, IntegrityVolume, JournalState, ReplayReport, WriteMode, CHUNK_BYTES,
    TUPLE_BYTES_MAX,
};

impl IntegrityVolume {
    /// Replays the journal as the kernel does when it activates the device (`replay_journal`):
    /// scans every section's commit ids, then writes the entries of the committed sections to
    /// their places, oldest first, stopping at the first section not wholly committed; then
    /// leaves the journal empty (cleared, or marked empty as the kernel does on suspend).
    pub(super) fn recover(&self) -> Result<ReplayReport> {
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
    pub(super) fn mark_empty(&self, j: &mut JournalState) -> Result<()> {
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
    pub(super) fn write_back(
        &self,
        j: &JournalState,
        entries: u32,
        from_replay: bool,
    ) -> Result<()> {
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
    pub(super) fn run_in_place(
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
    pub(super) fn entries_in_place(
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
    pub(super) fn commit(&self, j: &mut JournalState) -> Result<()> {
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

    pub(super) fn commit_inner(&self, j: &mut JournalState) -> Result<()> {
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
    pub(super) fn overlay(&self, j: &JournalState, first: u64, dbuf: &mut [u8], tuples: &mut [u8]) {
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
    pub(super) fn finish(&self) -> Result<()> {
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

    /// Journal mode: copies sealed blocks from data sector `first` into the open section,
    /// committing each section that fills.
    pub(super) fn journal_sealed(
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
}
