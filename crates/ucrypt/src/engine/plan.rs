//! The pure planner: a request in plaintext bytes becomes a plan in encryption sectors —
//! which sectors to lock, which pieces (each fitting the buffer pool) to process, which pieces
//! need a read-modify-write of a partial sector, and how each piece is cut into chunks for the
//! workers. No I/O, no threads, no allocation: the drivers in `volume.rs` perform plans.

use super::Policy;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// Write plaintext zeroes (ciphertext of zeroes is not zeroes, except with the null cipher).
    WriteZeroes,
    Discard,
}

/// A half-open run of encryption sectors `first..end`, counted from the data segment start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectorRange {
    pub first: u64,
    pub end: u64,
}

impl SectorRange {
    pub fn len(&self) -> u64 {
        self.end - self.first
    }

    pub fn is_empty(&self) -> bool {
        self.end <= self.first
    }

    /// Chunk `i` of `n` nearly equal runs this range is cut into (`i < n <= len`).
    pub fn chunk(&self, i: u64, n: u64) -> SectorRange {
        debug_assert!(i < n && n <= self.len().max(1));
        let total = self.len();
        SectorRange {
            first: self.first + total * i / n,
            end: self.first + total * (i + 1) / n,
        }
    }

    pub fn overlaps(&self, o: &SectorRange) -> bool {
        self.first < o.end && o.first < self.end
    }
}

/// A split request is cut into this many chunks per lane (thread running it), which the lanes
/// claim one at a time: a helper that starts late or runs slower then holds the request up by
/// one small chunk, not by its whole share, and the phases of the lanes (backend I/O, crypto)
/// drift apart instead of contending in step. More chunks add claims and hand-offs for no
/// further gain; one chunk per lane is the whole share again. Two (256 KiB chunks for 1 MiB
/// on 2 cores) does best for one stream of 1 MiB, the split `bench engine` scenario 4 measures
/// (parallel ÷ inline, BENCHMARKS.md). The chunks are equal: a smaller first one, to offset
/// the lanes' phases, only adds a claim.
pub const CHUNKS_PER_LANE: u32 = 2;

/// How the pieces of a request are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// All work on the caller's thread.
    Inline,
    /// Each piece run on `chunks` lanes (the caller and `chunks - 1` workers), which claim
    /// [`CHUNKS_PER_LANE`] chunks each on average; done when all are.
    Parallel { chunks: u32 },
    /// Like `Parallel`, but backend writes and completions leave in submission order.
    Ordered { chunks: u32 },
    /// The dm-crypt model: crypto on a worker queue, writes through one sorting writer thread.
    Queued,
}

impl Dispatch {
    /// True if pieces are cut into several chunks for the workers.
    pub fn splits(&self) -> bool {
        matches!(self, Dispatch::Parallel { chunks } | Dispatch::Ordered { chunks } if *chunks > 1)
    }
}

/// Static facts the planner and dispatcher need; fixed when the volume is built.
#[derive(Debug, Clone, Copy)]
pub struct Planner {
    /// log2 of the encryption sector size.
    pub sector_shift: u32,
    /// Largest piece in bytes (the pool's capacity, a whole number of sectors).
    pub piece_bytes_max: u64,
    /// Requests at least this big are split by the `parallel` and `ordered` policies.
    pub parallel_min_bytes: u64,
    /// Requests at least this big are split by `auto` (calibrated at start-up).
    pub auto_min_bytes: u64,
    /// No chunk smaller than this (the hand-off would cost more than it saves).
    pub chunk_min_bytes: u64,
    /// Threads that can do crypto at once: the workers plus the caller.
    pub lanes: u32,
}

/// One pool-sized part of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The caller's bytes this piece covers: `buf_off..buf_off + buf_len`.
    pub buf_off: usize,
    pub buf_len: usize,
    /// The encryption sectors it covers.
    pub sectors: SectorRange,
    /// Bytes of the first sector that precede the caller's data (non-zero only in the first
    /// piece of an unaligned request).
    pub head_skip: usize,
    /// The first sector is only partly covered: a write must read-modify-write it.
    pub partial_first: bool,
    /// The last sector (different from the first) is only partly covered.
    pub partial_last: bool,
}

impl Piece {
    /// True if the piece covers whole sectors exactly (no read-modify-write, no bounce copy).
    pub fn aligned(&self) -> bool {
        !self.partial_first && !self.partial_last
    }

    /// Splits the piece into `n` (at most one per sector) nearly equal chunks of sectors, the
    /// way a split request's helpers claim them.
    #[cfg(test)]
    pub fn chunks(&self, n: u32) -> impl Iterator<Item = SectorRange> {
        let sectors = self.sectors;
        let n = (n as u64).clamp(1, sectors.len().max(1));
        (0..n).map(move |i| sectors.chunk(i, n))
    }
}

/// The plan for one request.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub op: Op,
    pub dispatch: Dispatch,
    /// Every sector the request touches.
    pub covering: SectorRange,
    /// Sectors held exclusively while the request runs (writes, write-zeroes, discards), so that
    /// overlapping writers never tear a sector and read-modify-write never loses an update.
    pub lock: Option<SectorRange>,
    /// For discards: the sectors wholly inside the range (partial ones are left alone).
    pub discard: Option<SectorRange>,
    offset: u64,
    len: u64,
    piece_sectors: u64,
    shift: u32,
}

impl Plan {
    /// The pieces in ascending order (none for discards).
    pub fn pieces(&self) -> impl Iterator<Item = Piece> + '_ {
        let n = if self.op == Op::Discard || self.covering.is_empty() {
            0
        } else {
            self.covering.len().div_ceil(self.piece_sectors)
        };
        (0..n).map(move |i| {
            let first = self.covering.first + i * self.piece_sectors;
            let end = (first + self.piece_sectors).min(self.covering.end);
            let (start_b, end_b) = (first << self.shift, end << self.shift);
            let req_end = self.offset + self.len;
            let data_start = start_b.max(self.offset);
            let data_end = end_b.min(req_end);
            let partial_first = self.offset > start_b || (end - first == 1 && req_end < end_b);
            let partial_last = end - first > 1 && req_end < end_b;
            Piece {
                buf_off: (data_start - self.offset) as usize,
                buf_len: (data_end - data_start) as usize,
                sectors: SectorRange { first, end },
                head_skip: (data_start - start_b) as usize,
                partial_first,
                partial_last,
            }
        })
    }
}

impl Planner {
    /// Chooses how to carry out a request of `len` bytes. `idle_workers`: workers waiting for
    /// work right now (only `auto` looks at it).
    pub fn dispatch(&self, policy: Policy, op: Op, len: u64, idle_workers: u32) -> Dispatch {
        if op == Op::Discard {
            return Dispatch::Inline;
        }
        let chunks = |len: u64| -> u32 {
            let by_size = (len / self.chunk_min_bytes.max(1)).max(1);
            by_size.min(self.lanes as u64) as u32
        };
        match policy {
            Policy::Inline => Dispatch::Inline,
            Policy::Queued => Dispatch::Queued,
            Policy::Parallel | Policy::Ordered => {
                let c = chunks(len.min(self.piece_bytes_max));
                let ordered = policy == Policy::Ordered;
                if len < self.parallel_min_bytes || c < 2 {
                    if ordered {
                        Dispatch::Ordered { chunks: 1 }
                    } else {
                        Dispatch::Inline
                    }
                } else if ordered {
                    Dispatch::Ordered { chunks: c }
                } else {
                    Dispatch::Parallel { chunks: c }
                }
            }
            Policy::Auto => {
                // Split only when it pays (calibrated) and someone is free to take a chunk: with
                // every core busy, a hand-off only adds a queue hop.
                let c = chunks(len.min(self.piece_bytes_max)).min(idle_workers + 1);
                if len >= self.auto_min_bytes && c >= 2 {
                    Dispatch::Parallel { chunks: c }
                } else {
                    Dispatch::Inline
                }
            }
        }
    }

    /// Plans a request already checked to lie inside the volume.
    pub fn plan(&self, op: Op, offset: u64, len: u64, dispatch: Dispatch) -> Plan {
        let sector = 1u64 << self.sector_shift;
        let covering = if len == 0 {
            SectorRange {
                first: offset >> self.sector_shift,
                end: offset >> self.sector_shift,
            }
        } else {
            SectorRange {
                first: offset >> self.sector_shift,
                end: (offset + len).div_ceil(sector),
            }
        };
        let inner = SectorRange {
            first: offset.div_ceil(sector),
            end: (offset + len) >> self.sector_shift,
        };
        let lock = match op {
            Op::Read => None,
            Op::Discard if inner.is_empty() => None,
            Op::Discard => Some(inner),
            Op::Write | Op::WriteZeroes if covering.is_empty() => None,
            Op::Write | Op::WriteZeroes => Some(covering),
        };
        Plan {
            op,
            dispatch,
            covering,
            lock,
            discard: (op == Op::Discard && !inner.is_empty()).then_some(inner),
            offset,
            len,
            piece_sectors: (self.piece_bytes_max >> self.sector_shift).max(1),
            shift: self.sector_shift,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planner(shift: u32, piece: u64) -> Planner {
        Planner {
            sector_shift: shift,
            piece_bytes_max: piece,
            parallel_min_bytes: 64 << 10,
            auto_min_bytes: 128 << 10,
            chunk_min_bytes: 16 << 10,
            lanes: 2,
        }
    }

    /// (offset, len, piece bytes) -> expected pieces as
    /// (buf_off, buf_len, first, end, head_skip, partial_first, partial_last).
    #[test]
    fn pieces_table() {
        type Row = (
            u64,
            u64,
            u64,
            &'static [(usize, usize, u64, u64, usize, bool, bool)],
        );
        let rows: &[Row] = &[
            (0, 4096, 1 << 20, &[(0, 4096, 0, 8, 0, false, false)]),
            (100, 10, 1 << 20, &[(0, 10, 0, 1, 100, true, false)]),
            (500, 24, 1 << 20, &[(0, 24, 0, 2, 500, true, true)]),
            (512, 1024, 1024, &[(0, 1024, 1, 3, 0, false, false)]),
            (
                510,
                1030,
                1024,
                &[
                    (0, 514, 0, 2, 510, true, false),
                    (514, 516, 2, 4, 0, false, true),
                ],
            ),
            (
                1024,
                600,
                512,
                &[
                    (0, 512, 2, 3, 0, false, false),
                    (512, 88, 3, 4, 0, true, false),
                ],
            ),
        ];
        let p = planner(9, 0);
        for &(offset, len, piece, want) in rows {
            let p = Planner {
                piece_bytes_max: piece,
                ..p
            };
            let plan = p.plan(Op::Write, offset, len, Dispatch::Inline);
            let got: Vec<_> = plan
                .pieces()
                .map(|x| {
                    (
                        x.buf_off,
                        x.buf_len,
                        x.sectors.first,
                        x.sectors.end,
                        x.head_skip,
                        x.partial_first,
                        x.partial_last,
                    )
                })
                .collect();
            assert_eq!(got, want, "offset {offset} len {len} piece {piece}");
        }
    }

    #[test]
    fn pieces_cover_request_exactly_random() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..5000 {
            let shift = if next() % 2 == 0 { 9 } else { 12 };
            let piece = ((next() % 8) + 1) << shift;
            let offset = next() % (1 << 20);
            let len = next() % (64 << 10);
            let p = planner(shift, piece);
            let plan = p.plan(Op::Write, offset, len, Dispatch::Inline);
            let mut expect_off = 0usize;
            let mut prev_end = plan.covering.first;
            for pc in plan.pieces() {
                assert_eq!(pc.buf_off, expect_off);
                assert_eq!(pc.sectors.first, prev_end);
                assert!(pc.sectors.len() << shift <= piece);
                assert_eq!(
                    (pc.sectors.first << shift) + pc.head_skip as u64,
                    offset + pc.buf_off as u64
                );
                expect_off += pc.buf_len;
                prev_end = pc.sectors.end;
                let chunks: Vec<_> = pc.chunks(3).collect();
                assert_eq!(chunks.first().unwrap().first, pc.sectors.first);
                assert_eq!(chunks.last().unwrap().end, pc.sectors.end);
                assert!(chunks
                    .windows(2)
                    .all(|w| w[0].end == w[1].first && !w[0].is_empty()));
            }
            assert_eq!(expect_off as u64, len, "offset {offset} len {len}");
            assert_eq!(prev_end, plan.covering.end);
        }
    }

    #[test]
    fn discard_only_whole_sectors() {
        let p = planner(12, 1 << 20);
        type Row = (u64, u64, Option<(u64, u64)>);
        let rows: &[Row] = &[
            (0, 4096, Some((0, 1))),
            (1, 4096, None),
            (100, 10000, Some((1, 2))),
            (4096, 8192, Some((1, 3))),
            (0, 0, None),
        ];
        for &(off, len, want) in rows {
            let plan = p.plan(Op::Discard, off, len, Dispatch::Inline);
            assert_eq!(plan.discard.map(|r| (r.first, r.end)), want, "{off}+{len}");
            assert_eq!(plan.pieces().count(), 0);
        }
    }

    #[test]
    fn dispatch_table() {
        let p = planner(12, 4 << 20);
        use Dispatch::*;
        let rows: &[(Policy, u64, u32, Dispatch)] = &[
            (Policy::Inline, 1 << 20, 2, Inline),
            (Policy::Queued, 4096, 2, Queued),
            (Policy::Parallel, 4096, 2, Inline),
            (Policy::Parallel, 1 << 20, 0, Parallel { chunks: 2 }),
            (Policy::Ordered, 4096, 2, Ordered { chunks: 1 }),
            (Policy::Ordered, 1 << 20, 2, Ordered { chunks: 2 }),
            (Policy::Auto, 64 << 10, 2, Inline),
            (Policy::Auto, 1 << 20, 0, Inline),
            (Policy::Auto, 1 << 20, 1, Parallel { chunks: 2 }),
        ];
        for &(policy, len, idle, want) in rows {
            assert_eq!(
                p.dispatch(policy, Op::Write, len, idle),
                want,
                "{policy:?} {len} {idle}"
            );
        }
    }
}
