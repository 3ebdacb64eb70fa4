//! dm-integrity's journal, as the kernel lays it out and replays it (sans I/O: byte layouts and
//! the replay decision; `device.rs` does the reads and writes).
//!
//! The journal is `sections` sections of `section_sectors` 512-byte sectors right after the
//! superblock. A section is [`JOURNAL_BLOCK_SECTORS`] sectors of entries, then one block of
//! data per entry. Entry `n` lies in entry sector `n % 8`, `n / 8` entries from its start; an
//! entry is the 8-byte target sector (little-endian; all ones in its high half when unused),
//! the last 8 bytes of each 512-byte sector of its block, then the block's tag, rounded up to
//! 8 bytes. Every sector of a section, entry or data, ends with the section's commit id: the
//! id of the sequence `seq` (0..4) xor `(section << 32) ^ sector`, little-endian. A data
//! block's own last 8 bytes live in its entry, so that each sector can carry the id.
//!
//! Writing: entries fill a section in memory; a commit stamps every sector with the current
//! id, writes the section and makes it durable; only then do data and tags go to their places.
//! The sequence moves on each time the ring wraps. Replay on activation (`plan_replay`): the
//! newest sequence in use and the last section carrying it say where the oldest section
//! starts; from there, sections are replayed in ring order while every sector carries the
//! expected id (a torn section stops the replay), then the ring continues or is cleared.

use super::layout::{Layout, JOURNAL_BLOCK_SECTORS, JOURNAL_ENTRY_ROUNDUP_BYTES};
use super::superblock::flags;
use crate::{Error, Result};

/// The kernel's commit sequences: four, used in turn.
pub const N_COMMIT_IDS: u8 = 4;
/// The commit id of each sequence before it is xored with the position (no journal cipher).
pub const COMMIT_IDS: [u64; N_COMMIT_IDS as usize] = [
    0x1111_1111_1111_1111,
    0x2222_2222_2222_2222,
    0x3333_3333_3333_3333,
    0x4444_4444_4444_4444,
];
/// The high half of an unused entry's target sector.
const SECTOR_HI_UNUSED: u32 = u32::MAX;
/// Bytes of the commit id at the end of every journal sector.
const COMMIT_ID_BYTES: usize = 8;

pub fn next_seq(seq: u8) -> u8 {
    (seq + 1) % N_COMMIT_IDS
}

pub fn prev_seq(seq: u8) -> u8 {
    (seq + N_COMMIT_IDS - 1) % N_COMMIT_IDS
}

/// The commit id of sector `sector` of section `section` in sequence `seq`.
pub fn commit_id(section: u32, sector: u32, seq: u8) -> u64 {
    COMMIT_IDS[usize::from(seq)] ^ ((u64::from(section) << 32) ^ u64::from(sector))
}

/// What an entry says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    Unused,
    /// The 512-byte data sector its block goes to.
    Sector(u64),
}

/// The journal's geometry, from a superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub sections: u32,
    pub section_sectors: u32,
    pub section_entries: u32,
    pub entry_bytes: usize,
    pub sectors_per_block: u32,
    pub tag_bytes: usize,
}

impl Geometry {
    /// The journal of `l`; journals with a MAC or encryption are not supported (LUKS2 writes
    /// `journal_integrity` and `journal_encryption` "none").
    pub fn new(l: &Layout) -> Result<Self> {
        let sb = &l.sb;
        if sb.has(flags::HAVE_JOURNAL_MAC) {
            return Err(Error::UnsupportedLuks(
                "a dm-integrity journal with a MAC (ucrypt reads journals without)".into(),
            ));
        }
        let spb = 1u32 << sb.log2_sectors_per_block;
        let entry_bytes = (8 + 8 * spb + u32::from(sb.tag_bytes))
            .next_multiple_of(JOURNAL_ENTRY_ROUNDUP_BYTES) as usize;
        let section_sectors = u32::try_from(l.journal_section_sectors)
            .map_err(|_| Error::Bug("journal section larger than 2^32 sectors"))?;
        let section_entries = (section_sectors - JOURNAL_BLOCK_SECTORS as u32) / spb;
        Ok(Geometry {
            sections: sb.journal_sections,
            section_sectors,
            section_entries,
            entry_bytes,
            sectors_per_block: spb,
            tag_bytes: usize::from(sb.tag_bytes),
        })
    }

    pub fn section_bytes(&self) -> usize {
        self.section_sectors as usize * 512
    }

    pub fn block_bytes(&self) -> usize {
        self.sectors_per_block as usize * 512
    }

    /// Byte offset of entry `n` inside a section.
    pub fn entry_at(&self, n: u32) -> usize {
        let per = JOURNAL_BLOCK_SECTORS as u32;
        (n % per) as usize * 512 + (n / per) as usize * self.entry_bytes
    }

    /// Byte offset of entry `n`'s data block inside a section.
    pub fn data_at(&self, n: u32) -> usize {
        (JOURNAL_BLOCK_SECTORS as usize + (n * self.sectors_per_block) as usize) * 512
    }

    /// Byte offset of entry `n`'s tag inside a section.
    pub fn tag_at(&self, n: u32) -> usize {
        self.entry_at(n) + 8 + 8 * self.sectors_per_block as usize
    }

    pub fn entry(&self, sec: &[u8], n: u32) -> Entry {
        let at = self.entry_at(n);
        let raw = u64::from_le_bytes(sec[at..at + 8].try_into().expect("8 bytes"));
        if (raw >> 32) as u32 == SECTOR_HI_UNUSED {
            Entry::Unused
        } else {
            Entry::Sector(raw)
        }
    }

    /// Fills entry `n` for data sector `sector`: the target, the last bytes of each 512-byte
    /// sector of the data block already at [`Geometry::data_at`], and the tag.
    pub fn set_entry(&self, sec: &mut [u8], n: u32, sector: u64, tag: &[u8]) {
        debug_assert_eq!(tag.len(), self.tag_bytes);
        let at = self.entry_at(n);
        sec[at..at + 8].copy_from_slice(&sector.to_le_bytes());
        let data = self.data_at(n);
        for s in 0..self.sectors_per_block as usize {
            let end = data + (s + 1) * 512;
            let (head, tail) = sec.split_at_mut(end - COMMIT_ID_BYTES);
            let last = &tail[..COMMIT_ID_BYTES];
            head[at + 8 + 8 * s..at + 16 + 8 * s].copy_from_slice(last);
        }
        let t = self.tag_at(n);
        sec[t..t + self.tag_bytes].copy_from_slice(tag);
    }

    /// Puts each data sector's own last bytes (kept in its entry) back in place of the commit
    /// id, for every used entry: the blocks as they go to their places.
    pub fn restore_last_bytes(&self, sec: &mut [u8]) {
        for n in 0..self.section_entries {
            if self.entry(sec, n) == Entry::Unused {
                continue;
            }
            let at = self.entry_at(n);
            let data = self.data_at(n);
            for s in 0..self.sectors_per_block as usize {
                let end = data + (s + 1) * 512;
                let (head, tail) = sec.split_at_mut(end - COMMIT_ID_BYTES);
                tail[..COMMIT_ID_BYTES].copy_from_slice(&head[at + 8 + 8 * s..at + 16 + 8 * s]);
            }
        }
    }

    /// Writes the commit id of `seq` at the end of every sector of section `section`.
    pub fn stamp(&self, sec: &mut [u8], section: u32, seq: u8) {
        for j in 0..self.section_sectors {
            let end = (j as usize + 1) * 512;
            sec[end - COMMIT_ID_BYTES..end]
                .copy_from_slice(&commit_id(section, j, seq).to_le_bytes());
        }
    }

    /// Section `section` as the kernel initialises it: zeroes, every entry unused, every
    /// sector stamped with `seq`.
    pub fn init_section(&self, sec: &mut [u8], section: u32, seq: u8) {
        sec.fill(0);
        self.stamp(sec, section, seq);
        for n in 0..self.section_entries {
            let at = self.entry_at(n) + 4;
            sec[at..at + 4].copy_from_slice(&SECTOR_HI_UNUSED.to_le_bytes());
        }
    }

    /// The sequence whose id sector `j` of section `section` carries, if any.
    fn sector_seq(&self, sec: &[u8], section: u32, j: u32) -> Option<u8> {
        let end = (j as usize + 1) * 512;
        let id = u64::from_le_bytes(sec[end - COMMIT_ID_BYTES..end].try_into().expect("8"));
        (0..N_COMMIT_IDS).find(|&k| commit_id(section, j, k) == id)
    }

    /// True if every sector of the section carries the id of `seq`: a committed section.
    pub fn section_committed(&self, sec: &[u8], section: u32, seq: u8) -> bool {
        (0..self.section_sectors).all(|j| self.sector_seq(sec, section, j) == Some(seq))
    }
}

/// The first pass of replay: what sequences the sections carry. Feed every section in order.
#[derive(Debug, Default)]
pub struct Scan {
    used: [bool; N_COMMIT_IDS as usize],
    max_section: [u32; N_COMMIT_IDS as usize],
    /// Some entry of some section is in use.
    pub has_entries: bool,
}

/// What replay does after the scan (the kernel's `replay_journal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayPlan {
    /// The oldest section: replay starts here, in ring order.
    pub start: u32,
    /// The sequence section `start` must carry; it moves on at the ring's end.
    pub start_seq: u8,
    /// Nothing to replay: every entry unused (or the kernel's test for a cleared ring).
    pub empty: bool,
    /// The newest sequence in use (the cleared journal's sequence derives from it).
    pub last_used: u8,
}

impl Scan {
    /// Notes section `i`; an unknown commit id is an error (the kernel fails the device).
    /// Returns the sequence every sector of the section carries, if they agree: the section
    /// is committed in that sequence.
    pub fn section(&mut self, g: &Geometry, sec: &[u8], i: u32) -> Result<Option<u8>> {
        let mut uniform = None;
        for j in 0..g.section_sectors {
            let k = g.sector_seq(sec, i, j).ok_or_else(|| Error::BadHeader {
                check: "integrity journal commit id",
                detail: format!("sector {j} of journal section {i} carries no known commit id"),
            })?;
            self.used[usize::from(k)] = true;
            self.max_section[usize::from(k)] = i;
            uniform = match (j, uniform) {
                (0, _) => Some(Some(k)),
                (_, Some(Some(u))) if u == k => Some(Some(k)),
                _ => Some(None),
            };
        }
        if !self.has_entries {
            self.has_entries = (0..g.section_entries).any(|n| g.entry(sec, n) != Entry::Unused);
        }
        Ok(uniform.flatten())
    }

    /// Where replay starts, from the sequences seen (after every section).
    pub fn plan(&self, sections: u32) -> Result<ReplayPlan> {
        let n = usize::from(N_COMMIT_IDS);
        let unused = if !self.used[n - 1] {
            let mut u = n - 1;
            while u > 0 && !self.used[u - 1] {
                u -= 1;
            }
            u
        } else {
            (0..n)
                .find(|&u| !self.used[u])
                .ok_or_else(|| Error::BadHeader {
                    check: "integrity journal commit id",
                    detail: "the journal carries all four commit sequences".into(),
                })?
        } as u8;
        let last_used = prev_seq(unused);
        let mut want = prev_seq(last_used);
        let mut empty = !self.has_entries;
        if !self.used[usize::from(want)] && self.used[usize::from(prev_seq(want))] {
            empty = true;
        }
        let mut start = self.max_section[usize::from(last_used)] + 1;
        if start >= sections {
            want = next_seq(want);
            start -= sections;
        }
        Ok(ReplayPlan {
            start,
            start_seq: want,
            empty,
            last_used,
        })
    }
}

/// The sequence a cleared journal is written with after a replay that did not cover the whole
/// ring (the kernel's `erase_seq`); new commits then start at section 0 with the next one.
pub fn erase_seq(last_used: u8) -> u8 {
    prev_seq(prev_seq(last_used))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::integrity::format::{initial_journal_section, new_superblock};

    fn geo() -> (Layout, Geometry) {
        let l = new_superblock(28, 4096, 32768, 98304, true).expect("layout");
        let g = Geometry::new(&l).expect("geometry");
        (l, g)
    }

    #[test]
    fn geometry_matches_the_layout() {
        let (l, g) = geo();
        // 4096-byte blocks, 28-byte tags: 8 + 64 + 28 = 100 -> 104-byte entries, 4 a sector.
        assert_eq!(g.entry_bytes, 104);
        assert_eq!(g.section_entries, 32);
        assert_eq!(u64::from(g.section_sectors), l.journal_section_sectors);
        assert_eq!(g.data_at(31) + 4096, g.section_bytes());
    }

    #[test]
    fn init_section_is_the_format_journal_at_sequence_0() {
        let (l, g) = geo();
        let mut sec = vec![0u8; g.section_bytes()];
        for i in 0..g.sections {
            g.init_section(&mut sec, i, 0);
            assert_eq!(sec, initial_journal_section(&l, i));
        }
    }

    #[test]
    fn entries_keep_the_last_bytes_and_restore_them() {
        let (_, g) = geo();
        let mut sec = vec![0u8; g.section_bytes()];
        g.init_section(&mut sec, 1, 2);
        let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let d = g.data_at(5);
        sec[d..d + 4096].copy_from_slice(&block);
        g.set_entry(&mut sec, 5, 808, &[9u8; 28]);
        assert_eq!(g.entry(&sec, 5), Entry::Sector(808));
        assert_eq!(g.entry(&sec, 4), Entry::Unused);
        g.stamp(&mut sec, 1, 2);
        assert!(g.section_committed(&sec, 1, 2));
        assert!(!g.section_committed(&sec, 1, 3));
        assert_ne!(
            &sec[d..d + 4096],
            &block[..],
            "the ids replace the last bytes"
        );
        g.restore_last_bytes(&mut sec);
        assert_eq!(&sec[d..d + 4096], &block[..]);
    }

    fn plan_of(seqs: &[u8], has_entries: bool) -> ReplayPlan {
        let mut s = Scan::default();
        for (i, &k) in seqs.iter().enumerate() {
            s.used[usize::from(k)] = true;
            s.max_section[usize::from(k)] = i as u32;
        }
        s.has_entries = has_entries;
        s.plan(seqs.len() as u32).expect("plan")
    }

    /// The ring's state read back as the kernel reads it: the oldest section first.
    #[test]
    fn replay_starts_at_the_oldest_section() {
        // Freshly formatted: all sequence 0, nothing to replay; the ring goes on at 0.
        let p = plan_of(&[0, 0, 0], false);
        assert_eq!((p.start, p.start_seq, p.empty), (0, 0, true));
        // Sections 0 and 1 rewritten in sequence 1: section 2 (sequence 0) is the oldest.
        let p = plan_of(&[1, 1, 0], true);
        assert_eq!((p.start, p.start_seq, p.empty), (2, 0, false));
        // A whole cycle of sequence 1: start over at 0.
        let p = plan_of(&[1, 1, 1], true);
        assert_eq!((p.start, p.start_seq), (0, 1));
        // Wrapping from sequence 3 to 0.
        let p = plan_of(&[0, 3, 3], true);
        assert_eq!((p.start, p.start_seq, p.last_used), (1, 3, 0));
        let s = Scan {
            used: [true; 4],
            ..Scan::default()
        };
        assert!(s.plan(4).is_err(), "four sequences at once");
    }
}
