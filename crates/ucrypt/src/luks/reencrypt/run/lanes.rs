//! The data path of a hotzone: its bytes read, rekeyed and written in chunks by lanes of
//! threads, each chunk's old ciphertext summed or journalled first where the resilience
//! says so.

use crate::backend::Backend;
use crate::luks::reencrypt::pieces::{hash_blocks, share_out};
use crate::luks::util::HashAlg;
use crate::sync::TakeTurns;
use crate::{Error, Result};

use super::unlock::{Lane, Spread, Unlocked};
use super::{LANE_BYTES_MIN, LANE_CHUNK_BYTES};

/// Where the lanes hand each chunk they finished (its data offset, or its offset in the
/// buffer; its bytes): a write, made one lane at a time where the backend it goes to takes
/// writes one at a time anyway ([`Backend::serializes_writes`], [`TakeTurns`]), else by each
/// lane for its own chunks.
#[derive(Clone, Copy)]
pub(super) struct Sink<'a> {
    pub(super) write: &'a (dyn Fn(u64, &[u8]) -> Result<()> + Sync),
    pub(super) in_turns: bool,
}

impl<'a> Sink<'a> {
    /// Nothing: the chunk stays in the buffer.
    pub(super) const KEEP: Sink<'static> = Sink {
        write: &|_, _| Ok(()),
        in_turns: false,
    };

    /// `write`, which writes to `dev`.
    pub(super) fn to(
        dev: &dyn Backend,
        write: &'a (dyn Fn(u64, &[u8]) -> Result<()> + Sync),
    ) -> Self {
        Sink {
            write,
            in_turns: dev.serializes_writes(),
        }
    }
}

/// A [`Sink`] for one share-out of `chunks` chunks of a buffer that lives for `'b`.
pub(super) struct Handing<'a, 'b> {
    pub(super) sink: Sink<'a>,
    pub(super) turns: TakeTurns<(u64, &'b [u8])>,
}

impl<'a, 'b> Handing<'a, 'b> {
    pub(super) fn new(sink: Sink<'a>, chunks: usize) -> Self {
        let cap = if sink.in_turns { chunks } else { 0 };
        Handing {
            sink,
            turns: TakeTurns::new(cap),
        }
    }

    pub(super) fn hand(&self, at: u64, bytes: &'b [u8]) -> Result<()> {
        if self.sink.in_turns {
            self.turns
                .take((at, bytes), &|(o, c)| (self.sink.write)(o, c))
        } else {
            (self.sink.write)(at, bytes)
        }
    }

    /// After every lane returned `Ok`: each chunk handed was written.
    pub(super) fn finished(&self) -> Result<()> {
        match self.turns.left() {
            0 => Ok(()),
            _ => Err(Error::Bug(
                "a chunk handed to the writing lane was not written",
            )),
        }
    }
}

/// Decrypts `buf` (the old bytes at data offset `offset`) with the old key and encrypts it
/// with the new one, in place (a linear side is left as it is): cut into chunks of
/// [`LANE_CHUNK_BYTES`] (whole `align` units) shared out among the lanes ([`share_out`]), each
/// on its own thread with its own ciphers; one lane for buffers under [`LANE_BYTES_MIN`].
pub(super) fn rekey(u: &mut Unlocked, offset: u64, buf: &mut [u8]) -> Result<()> {
    rekey_then(u, offset, buf, Sink::KEEP)
}

/// [`rekey`], each lane then handing its bytes (data offset, bytes) to `then` — the write of
/// the new ciphertext, so that the lanes' writes overlap each other's crypto and the copies
/// into the device run on every lane (or on one lane at a time, where the backend takes
/// writes one at a time anyway: [`Sink`]). Each chunk is decrypted, encrypted and handed on
/// while it is in the CPU's cache: one pass over memory instead of three.
pub(super) fn rekey_then(
    u: &mut Unlocked,
    offset: u64,
    buf: &mut [u8],
    then: Sink<'_>,
) -> Result<()> {
    rekey_stream(u, offset, buf, &|_, _| Ok(()), then)
}

/// [`rekey_then`], each chunk first filled by `fill` (data offset, bytes): the read of the
/// old ciphertext, where nothing else needs the hotzone whole in memory (no resilience data),
/// so that every byte is read, rekeyed and written while it is in the cache.
pub(super) fn rekey_stream(
    u: &mut Unlocked,
    offset: u64,
    buf: &mut [u8],
    fill: &(dyn Fn(u64, &mut [u8]) -> Result<()> + Sync),
    then: Sink<'_>,
) -> Result<()> {
    let lanes = if buf.len() < LANE_BYTES_MIN {
        1
    } else {
        u.lanes.len()
    };
    let align = u.align as usize;
    assert!(
        align > 0 && LANE_CHUNK_BYTES % align == 0,
        "a lane's chunk holds whole sectors"
    );
    let then = Handing::new(then, buf.len().div_ceil(LANE_CHUNK_BYTES));
    let chunks = buf
        .chunks_mut(LANE_CHUNK_BYTES)
        .enumerate()
        .map(|(i, c)| (offset + (i * LANE_CHUNK_BYTES) as u64, c));
    share_out(
        u.crew.as_ref(),
        u.lanes.iter_mut().take(lanes),
        chunks,
        "rekey thread panicked",
        |lane: &mut &mut Lane, (o, c)| {
            fill(o, c)?;
            rekey_chunk(lane, o, c)?;
            then.hand(o, c)
        },
    )?;
    then.finished()
}

/// One lane's rekey of `b`, the old bytes at data offset `offset`: decrypted with the old
/// cipher and encrypted with the new one, in place, sector numbers counted from the data
/// offset (a linear side, `None`, is left as it is).
pub(super) fn rekey_chunk((old, new): &mut Lane, offset: u64, b: &mut [u8]) -> Result<()> {
    if let Some(old) = old {
        old.decrypt(offset / old.sector_bytes() as u64, b)?;
    }
    if let Some(new) = new {
        new.encrypt(offset / new.sector_bytes() as u64, b)?;
    }
    Ok(())
}

/// The lanes `spread` has, or one for a buffer of `len` bytes under [`LANE_BYTES_MIN`].
pub(super) fn lanes_for(len: usize, spread: Spread<'_>) -> std::iter::RepeatN<()> {
    let n = if len < LANE_BYTES_MIN {
        1
    } else {
        spread.lanes.max(1)
    };
    std::iter::repeat_n((), n)
}

/// Reads `buf` from `at` in chunks of [`LANE_CHUNK_BYTES`] shared out among the lanes (the
/// copies out of the device run on every CPU); one lane for buffers under [`LANE_BYTES_MIN`].
pub(super) fn read_lanes(
    dev: &dyn Backend,
    buf: &mut [u8],
    at: u64,
    lanes: Spread<'_>,
) -> Result<()> {
    read_lanes_then(dev, buf, at, lanes, Sink::KEEP)
}

/// [`read_lanes`], each lane handing every [`LANE_CHUNK_BYTES`] it read (offset in `buf`,
/// bytes) to `then` while they are in its cache: the journal's copy of the hotzone.
pub(super) fn read_lanes_then(
    dev: &dyn Backend,
    buf: &mut [u8],
    at: u64,
    spread: Spread<'_>,
    then: Sink<'_>,
) -> Result<()> {
    let lanes = lanes_for(buf.len(), spread);
    let then = Handing::new(then, buf.len().div_ceil(LANE_CHUNK_BYTES));
    let chunks = buf.chunks_mut(LANE_CHUNK_BYTES).enumerate();
    share_out(
        spread.crew,
        lanes,
        chunks,
        "read thread panicked",
        |_, (i, c)| {
            let o = (i * LANE_CHUNK_BYTES) as u64;
            dev.read_exact_at(c, at + o)?;
            then.hand(o, c)
        },
    )?;
    then.finished()
}

/// [`read_lanes`], each lane hashing every `block` bytes of a chunk it read into that chunk's
/// part of `sums` (one digest after the other, as [`checksums`]) while they are in its cache.
pub(super) fn read_lanes_summing(
    dev: &dyn Backend,
    buf: &mut [u8],
    at: u64,
    spread: Spread<'_>,
    (hash, block): (HashAlg, usize),
    sums: &mut [u8],
) -> Result<()> {
    let hb = hash.output_bytes();
    assert!(
        block > 0 && buf.len() % block == 0 && sums.len() >= buf.len() / block * hb,
        "whole checksum blocks, a digest for each"
    );
    assert!(
        LANE_CHUNK_BYTES % block == 0,
        "chunks of whole checksum blocks"
    );
    let lanes = lanes_for(buf.len(), spread);
    let chunks = buf
        .chunks_mut(LANE_CHUNK_BYTES)
        .zip(sums.chunks_mut(LANE_CHUNK_BYTES / block * hb))
        .enumerate();
    share_out(
        spread.crew,
        lanes,
        chunks,
        "read thread panicked",
        |_, (i, (c, out))| {
            dev.read_exact_at(c, at + (i * LANE_CHUNK_BYTES) as u64)?;
            hash_blocks(c, block, hash, out);
            Ok(())
        },
    )
}

/// Writes `buf` at `at`, in chunks shared out among the lanes as [`read_lanes`] reads.
pub(super) fn write_lanes(
    dev: &dyn Backend,
    buf: &[u8],
    at: u64,
    spread: Spread<'_>,
) -> Result<()> {
    let lanes = lanes_for(buf.len(), spread);
    let chunks = buf.chunks(LANE_CHUNK_BYTES).enumerate();
    share_out(
        spread.crew,
        lanes,
        chunks,
        "write thread panicked",
        |_, (i, c)| dev.write_at(c, at + (i * LANE_CHUNK_BYTES) as u64),
    )
}

/// [`hash_blocks`] on up to `lanes` threads.
pub(super) fn checksums(
    data: &[u8],
    block: usize,
    hash: HashAlg,
    out: &mut [u8],
    spread: Spread<'_>,
) -> Result<()> {
    let hb = hash.output_bytes();
    let n = data.len() / block;
    let per = (LANE_CHUNK_BYTES / block).max(1);
    let chunks = data[..n * block]
        .chunks(per * block)
        .zip(out[..n * hb].chunks_mut(per * hb));
    let lanes = lanes_for(data.len(), spread);
    share_out(
        spread.crew,
        lanes,
        chunks,
        "checksum thread panicked",
        |_, (d, o)| {
            hash_blocks(d, block, hash, o);
            Ok(())
        },
    )
}
