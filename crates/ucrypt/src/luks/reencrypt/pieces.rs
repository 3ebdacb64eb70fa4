//! A hotzone in pieces, for a rotation that shares the machine with the volume's requests
//! (`reencrypt_online`; the offline driver takes a hotzone whole): read, hashed and rewritten
//! piece after piece, each piece's CPU work overlapping the next piece's (or the previous
//! one's) I/O. The order of what reaches the device is the
//! offline driver's: the old bytes read, the resilience data written and flushed, the
//! hotzone committed, then the new bytes written; only how the hotzone is cut changes, and
//! recovery works per checksum block or from the journal whatever part of it was rewritten.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

use super::serving::Serving;
use crate::backend::Backend;
use crate::engine::crew::{Chunks, Crew};
use crate::luks::sha256_x16;
use crate::luks::util::HashAlg;
use crate::{Error, Result};

/// `[0, len)` cut into ranges of at most `piece` bytes, in order.
pub(super) fn pieces(len: u64, piece: u64) -> impl Iterator<Item = std::ops::Range<usize>> {
    let piece = piece.max(1);
    (0..len.div_ceil(piece)).map(move |i| {
        let start = i * piece;
        start as usize..(start + piece).min(len) as usize
    })
}

/// Hashes each whole `block` bytes of `data` into `out`, one digest after the other (the
/// layout of a checksum area); `out` holds a digest for each block.
pub(super) fn hash_blocks(data: &[u8], block: usize, hash: HashAlg, out: &mut [u8]) {
    let hb = hash.output_bytes();
    assert!(
        block > 0 && out.len() >= data.len() / block * hb,
        "a digest for each checksum block"
    );
    let n = data.len() / block;
    let mut done = 0;
    // SHA-256, sixteen blocks at a time where the CPU allows ([`sha256_x16`]).
    if hash == HashAlg::Sha256 && block % sha256_x16::BLOCK_BYTES == 0 && sha256_x16::available() {
        const L: usize = sha256_x16::LANES;
        let mut digests = [[0u8; 32]; L];
        while n - done >= L {
            let msgs: [&[u8]; L] =
                std::array::from_fn(|i| &data[(done + i) * block..(done + i + 1) * block]);
            if !sha256_x16::digest16(&msgs, &mut digests) {
                break;
            }
            for (i, d) in digests.iter().enumerate() {
                out[(done + i) * hb..(done + i + 1) * hb].copy_from_slice(d);
            }
            done += L;
        }
    }
    let rest = data[done * block..n * block].chunks_exact(block);
    for (d, h) in rest.zip(out[done * hb..].chunks_exact_mut(hb)) {
        h.copy_from_slice(&hash.digest(&[d]));
    }
}

/// Shares `chunks` out among `lanes`: every lane takes the next chunk as soon as it is free,
/// so that a lane the scheduler holds back (a busy host) leaves its part to the others instead
/// of making them wait for it at the end, as fixed shares would. With a `crew`, the calling
/// thread is the first lane and the crew's threads the others (started once per rotation: a
/// thread started for one hotzone step starts with no scheduler history, and beside busy
/// threads the scheduler may leave two such threads on one CPU for whole runs);
/// without one, each lane has a scoped thread. The first error stops the lanes taking more
/// chunks and comes back; a panic comes back as `Error::Bug(what)`.
pub(super) fn share_out<L: Send, T: Send, I: Iterator<Item = T> + Send, F>(
    crew: Option<&Crew>,
    lanes: impl Iterator<Item = L>,
    chunks: I,
    what: &'static str,
    work: F,
) -> Result<()>
where
    F: Fn(&mut L, T) -> Result<()> + Sync,
{
    let lanes: Vec<L> = lanes.collect();
    let n = lanes.len();
    let shared = Shared {
        lanes: lanes.into_iter().map(Mutex::new).collect(),
        queue: Mutex::new(chunks),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        work,
        what,
    };
    match crew {
        _ if n <= 1 => shared.run_chunks(0),
        Some(crew) => crew.run(&shared, (n - 1).min(crew.workers()), true)?,
        None => std::thread::scope(|sc| {
            let shared = &shared;
            for lane in 0..n {
                sc.spawn(move || shared.run_chunks(lane));
            }
        }),
    }
    match shared
        .error
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
    {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The work [`share_out`] hands to each lane.
struct Shared<L, I, F> {
    /// One per lane; each lane locks only its own (uncontended).
    lanes: Vec<Mutex<L>>,
    queue: Mutex<I>,
    failed: AtomicBool,
    /// The first error (or panic) any lane met.
    error: Mutex<Option<Error>>,
    work: F,
    what: &'static str,
}

impl<L: Send, T: Send, I: Iterator<Item = T> + Send, F> Chunks for Shared<L, I, F>
where
    F: Fn(&mut L, T) -> Result<()> + Sync,
{
    fn run_chunks(&self, lane: usize) {
        let Some(mine) = self.lanes.get(lane) else {
            return;
        };
        let mut mine = mine.lock().unwrap_or_else(PoisonError::into_inner);
        let run = || -> Result<()> {
            while !self.failed.load(Relaxed) {
                // Held only to take the next chunk, never while working on it.
                let next = self
                    .queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .next();
                let Some(chunk) = next else { break };
                (self.work)(&mut mine, chunk)?;
            }
            Ok(())
        };
        let r = catch_unwind(AssertUnwindSafe(run)).unwrap_or(Err(Error::Bug(self.what)));
        if let Err(e) = r {
            self.failed.store(true, Relaxed);
            self.error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert(e);
        }
    }
}

/// Reads `buf` from `at` in pieces of `piece` bytes (a multiple of `block`), in order, and
/// hashes each `block` bytes into `sums` (one digest after the other, as the offline
/// driver's checksums): the hashing of each piece (on a thread of its own) overlaps the read
/// of the next one.
pub(super) fn read_summing(
    dev: &dyn Backend,
    buf: &mut [u8],
    at: u64,
    piece: u64,
    block: usize,
    hash: HashAlg,
    sums: &mut [u8],
) -> Result<()> {
    let hb = hash.output_bytes();
    let piece = piece as usize;
    let hash_piece = |data: &[u8], out: &mut [u8]| hash_blocks(data, block, hash, out);
    let (mut rest, mut sums_rest) = (buf, sums);
    let mut read_at = at;
    let mut last: Option<(&[u8], &mut [u8])> = None;
    loop {
        let n = piece.min(rest.len());
        let (cur, after) = std::mem::take(&mut rest).split_at_mut(n);
        let k = (n / block * hb).min(sums_rest.len());
        let (cur_sums, sums_after) = std::mem::take(&mut sums_rest).split_at_mut(k);
        let read = std::thread::scope(|sc| {
            let hashing = last.take().map(|(d, o)| sc.spawn(move || hash_piece(d, o)));
            let read = if n > 0 {
                dev.read_exact_at(cur, read_at)
            } else {
                Ok(())
            };
            match hashing.map(|h| h.join()) {
                Some(Err(_)) => Err(Error::Bug("checksum thread panicked")),
                _ => read,
            }
        });
        read?;
        if n == 0 {
            return Ok(());
        }
        let cur: &[u8] = cur;
        last = Some((cur, cur_sums));
        (rest, sums_rest, read_at) = (after, sums_after, read_at + n as u64);
    }
}

/// Rewrites the hotzone in `buf` (the old bytes at data offset `offset`, on `data` from byte
/// `base`) in pieces of `piece` bytes, from its start, or from its end when `backward` (so
/// that the rewritten part always borders the bytes done before): `rekey` turns a piece's old
/// bytes into its new ones, and the write of each piece overlaps the rekeying of the next one
/// (on a thread of its own), so that the device and a CPU work at once. `serving` is told
/// before each piece is written and after.
#[allow(clippy::too_many_arguments)]
pub(super) fn rewrite_pieces(
    data: &dyn Backend,
    base: u64,
    offset: u64,
    buf: &mut [u8],
    piece: u64,
    backward: bool,
    serving: &mut dyn Serving,
    rekey: &mut (dyn FnMut(u64, &mut [u8]) -> Result<()> + Send),
) -> Result<()> {
    let len = buf.len();
    let piece = (piece as usize).clamp(1, len.max(1));
    let count = len.div_ceil(piece).max(1);
    // The `k`-th piece rewritten.
    let range = |k: usize| {
        let i = if backward { count - 1 - k } else { k };
        let start = (i * piece).min(len);
        start..(start + piece).min(len)
    };
    let first = range(0);
    rekey(offset + first.start as u64, &mut buf[first])?;
    for k in 0..count {
        let cur = range(k);
        let next = (k + 1 < count).then(|| range(k + 1));
        let (cur_buf, next_buf) = two_pieces(buf, cur.clone(), next.clone());
        let at = offset + cur.start as u64;
        serving.rewrite(at, cur.len() as u64)?;
        let (wrote, keyed) = std::thread::scope(|sc| {
            let keying = next.zip(next_buf).map(|(n, b)| {
                let rekey = &mut *rekey;
                sc.spawn(move || rekey(offset + n.start as u64, b))
            });
            let wrote = data.write_at(cur_buf, base + at);
            (wrote, keying.map(|h| h.join()))
        });
        wrote?;
        serving.rewritten(at, cur.len() as u64)?;
        if let Some(k) = keyed {
            k.map_err(|_| Error::Bug("rekey thread panicked"))??;
        }
    }
    Ok(())
}

/// The pieces `cur` and `next` (disjoint ranges) of `buf`, borrowed at once.
fn two_pieces(
    buf: &mut [u8],
    cur: std::ops::Range<usize>,
    next: Option<std::ops::Range<usize>>,
) -> (&mut [u8], Option<&mut [u8]>) {
    match next {
        None => (&mut buf[cur], None),
        Some(n) if n.start >= cur.end => {
            let (a, b) = buf.split_at_mut(cur.end);
            (
                &mut a[cur.clone()],
                Some(&mut b[n.start - cur.end..n.end - cur.end]),
            )
        }
        Some(n) => {
            assert!(n.end <= cur.start, "pieces are disjoint");
            let (a, b) = buf.split_at_mut(cur.start);
            (&mut b[..cur.len()], Some(&mut a[n]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemBackend;

    #[test]
    fn hash_blocks_gives_each_blocks_digest() {
        // Counts of blocks around the sixteen SHA-256 takes at once, and a hash it does not.
        let data: Vec<u8> = (0..40 * 4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for hash in [HashAlg::Sha256, HashAlg::Sha1] {
            for block in [512, 4096] {
                for n in [0, 1, 15, 16, 17, 33, 40] {
                    let d = &data[..n * block];
                    let hb = hash.output_bytes();
                    let mut out = vec![0u8; n * hb + 7];
                    hash_blocks(d, block, hash, &mut out);
                    let want: Vec<u8> = d.chunks(block).flat_map(|b| hash.digest(&[b])).collect();
                    assert_eq!(
                        out[..n * hb],
                        want[..],
                        "{hash:?}, {block}-byte blocks, {n}"
                    );
                    assert_eq!(out[n * hb..], [0u8; 7], "nothing past the digests");
                }
            }
        }
    }

    #[test]
    fn share_out_runs_every_chunk_once_and_returns_an_error() {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        for lanes in [1, 2, 5] {
            let mut out = [0u8; 64];
            let by_lane: Vec<AtomicUsize> = (0..lanes).map(|_| AtomicUsize::new(0)).collect();
            share_out(
                None,
                0..lanes,
                out.iter_mut().enumerate(),
                "lane panicked",
                |l, (i, b)| {
                    *b += i as u8 + 1;
                    by_lane[*l].fetch_add(1, Relaxed);
                    Ok(())
                },
            )
            .unwrap();
            let want: Vec<u8> = (1..=64).collect();
            assert_eq!(out.to_vec(), want, "{lanes} lanes: each chunk once");
            let done: usize = by_lane.iter().map(|n| n.load(Relaxed)).sum();
            assert_eq!(done, 64);
        }
        let taken = AtomicUsize::new(0);
        let err = share_out(None, 0..2, 0..1000, "lane panicked", |_, i| {
            taken.fetch_add(1, Relaxed);
            match i {
                3 => Err(Error::Bug("chunk 3 failed")),
                _ => Ok(()),
            }
        });
        assert!(matches!(err, Err(Error::Bug("chunk 3 failed"))), "{err:?}");
        assert!(
            taken.load(Relaxed) < 1000,
            "the lanes stop taking chunks after an error"
        );
        let panicked = share_out(None, 0..2, 0..4, "lane panicked", |_, i| match i {
            1 => panic!("lane work panics"),
            _ => Ok(()),
        });
        assert!(
            matches!(panicked, Err(Error::Bug("lane panicked"))),
            "{panicked:?}"
        );
        // The same on a crew's threads, the caller as the first lane.
        let crew = Crew::new("share-out-test", 2, std::time::Duration::ZERO).unwrap();
        for lanes in [1, 2, 3, 5] {
            let mut out = [0u8; 64];
            let chunks = out.iter_mut().enumerate();
            share_out(
                Some(&crew),
                0..lanes,
                chunks,
                "lane panicked",
                |_, (i, b)| {
                    *b += i as u8 + 1;
                    Ok(())
                },
            )
            .unwrap();
            let want: Vec<u8> = (1..=64).collect();
            assert_eq!(out.to_vec(), want, "{lanes} lanes on a crew");
        }
        let err = share_out(
            Some(&crew),
            0..3,
            0..1000,
            "lane panicked",
            |_, i| match i {
                3 => Err(Error::Bug("chunk 3 failed")),
                _ => Ok(()),
            },
        );
        assert!(matches!(err, Err(Error::Bug("chunk 3 failed"))), "{err:?}");
        let panicked = share_out(Some(&crew), 0..3, 0..8, "lane panicked", |_, i| match i {
            1 => panic!("lane work panics"),
            _ => Ok(()),
        });
        assert!(
            matches!(panicked, Err(Error::Bug("lane panicked"))),
            "{panicked:?}"
        );
    }

    #[test]
    fn pieces_cover_the_range_in_order() {
        // (len, piece, expected ranges as (start, end))
        type Row = (u64, u64, &'static [(usize, usize)]);
        let rows: &[Row] = &[
            (10, 4, &[(0, 4), (4, 8), (8, 10)]),
            (8, 4, &[(0, 4), (4, 8)]),
            (3, 8, &[(0, 3)]),
            (0, 8, &[]),
        ];
        for (len, piece, want) in rows {
            let got: Vec<(usize, usize)> = pieces(*len, *piece).map(|r| (r.start, r.end)).collect();
            assert_eq!(got, *want, "len {len}, piece {piece}");
        }
    }

    /// Records what the loop tells the volume.
    #[derive(Default)]
    struct Told(Vec<(char, u64, u64)>);

    impl Serving for Told {
        fn start(
            &mut self,
            _: Option<(crate::sector::CipherSpec, &[u8], crate::sector::SectorSize)>,
            _: u64,
            _: bool,
        ) -> Result<()> {
            Ok(())
        }
        fn hold(&mut self, _: u64, _: u64) -> Result<()> {
            Ok(())
        }
        fn rewrite(&mut self, offset: u64, len: u64) -> Result<()> {
            self.0.push(('w', offset, len));
            Ok(())
        }
        fn rewritten(&mut self, offset: u64, len: u64) -> Result<()> {
            self.0.push(('d', offset, len));
            Ok(())
        }
        fn release(&mut self, _: u64) -> Result<()> {
            Ok(())
        }
        fn failed(&mut self) {}
    }

    #[test]
    fn rewrite_pieces_goes_from_the_start_or_from_the_end() {
        let (base, offset) = (4096u64, 1000u64);
        for backward in [false, true] {
            for (len, piece) in [(10usize, 4u64), (8, 4), (3, 8), (12, 1)] {
                let dev = MemBackend::new(base + offset + 64);
                let old: Vec<u8> = (0..len as u8).collect();
                let mut buf = old.clone();
                let mut told = Told::default();
                let mut rekey = |at: u64, b: &mut [u8]| {
                    for (i, x) in b.iter_mut().enumerate() {
                        assert_eq!(u64::from(*x), at - offset + i as u64, "rekeyed once");
                        *x ^= 0xff;
                    }
                    Ok(())
                };
                rewrite_pieces(
                    &dev, base, offset, &mut buf, piece, backward, &mut told, &mut rekey,
                )
                .unwrap();
                let mut got = vec![0u8; len];
                dev.read_exact_at(&mut got, base + offset).unwrap();
                let want: Vec<u8> = old.iter().map(|x| x ^ 0xff).collect();
                assert_eq!(got, want, "len {len}, piece {piece}, backward {backward}");
                // Each piece announced then done, in order; the done part is one range that
                // borders the start (forward) or the end (backward).
                let mut edge = if backward {
                    offset + len as u64
                } else {
                    offset
                };
                for pair in told.0.chunks(2) {
                    let [('w', o1, l1), ('d', o2, l2)] = pair else {
                        panic!("{:?}", told.0)
                    };
                    assert_eq!((o1, l1), (o2, l2));
                    if backward {
                        assert_eq!(o1 + l1, edge, "{:?}", told.0);
                        edge = *o1;
                    } else {
                        assert_eq!(*o1, edge, "{:?}", told.0);
                        edge = o1 + l1;
                    }
                }
                assert_eq!(
                    edge,
                    if backward {
                        offset
                    } else {
                        offset + len as u64
                    }
                );
            }
        }
    }

    #[test]
    fn read_summing_reads_and_hashes_as_whole() {
        let block = 4096;
        let len = 10 * block;
        let dev = MemBackend::new((len + 8192) as u64);
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        dev.write_at(&data, 8192).unwrap();
        for piece in [block, 3 * block, len] {
            let mut buf = vec![0u8; len];
            let mut sums = vec![0u8; 10 * 32];
            let h = HashAlg::Sha256;
            read_summing(&dev, &mut buf, 8192, piece as u64, block, h, &mut sums).unwrap();
            assert_eq!(buf, data, "piece {piece}");
            for (i, s) in sums.chunks(32).enumerate() {
                assert_eq!(
                    s,
                    h.digest(&[&data[i * block..(i + 1) * block]]),
                    "piece {piece}"
                );
            }
        }
    }
}
