//! Requests a caller performs itself on the backing file ([`BlockDev::read_direct`],
//! [`BlockDev::write_direct`]): a front end with asynchronous I/O of its own (a vhost-user
//! queue's io_uring) keeps many requests in flight on one thread, where the volume's
//! synchronous calls would take a thread each.
//!
//! The volume hands out where the ciphertext lies. For a read the caller reads it into memory
//! of its own and gives it back, and the volume decrypts it from there into the caller's
//! buffer, which may be memory another party shares (a guest's): only plaintext ever reaches
//! that buffer, as with [`BlockDev::read_shared`]. For a write the volume encrypts from the
//! caller's buffer (each byte read once) into the caller's private memory, which the caller
//! then writes to the file. Each request holds what the volume's own call would hold while it
//! runs: the gate (so a suspend, a resize or the start of a reencryption waits for it) and, for
//! a write, its sectors' range lock. It is handed out without waiting for either: a closed
//! gate or a range another write holds gives `None`. So a caller that holds some while it waits
//! for their I/O never waits for itself; it must finish (or drop) each without waiting for
//! anything but its I/O.
//!
//! One is handed out only where a request is that simple: whole sectors inside the volume,
//! outside reencryption, a backend that is one file, offsets and length the backend's
//! alignment allows, a dispatch policy that would serve it inline on the caller's thread,
//! and, for a read, a cipher that decrypts from one buffer into another. Elsewhere the answer
//! is `None` and the caller uses `read_shared` / `write_shared`, which also report errors.
//!
//! [`BlockDev::read_direct`]: crate::BlockDev::read_direct
//! [`BlockDev::write_direct`]: crate::BlockDev::write_direct
//! [`BlockDev::read_shared`]: crate::BlockDev::read_shared

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering::Relaxed;

use super::Core;
use crate::engine::gate::Pass;
use crate::engine::plan::SectorRange;
use crate::engine::range_lock::RangeGuard;
use crate::engine::stats::{Kind, Times};
use crate::{Error, Result};

/// Where a request handed out lies, and what it holds; shared by reads and writes.
struct Place<'a> {
    core: &'a Core,
    fd: BorrowedFd<'a>,
    at: u64,
    offset: u64,
    len: usize,
    t: Times,
    // Last: dropped after everything above is done with.
    _pass: Pass<'a>,
}

impl<'a> Place<'a> {
    fn new(core: &'a Core, offset: u64, len: usize, write: bool) -> Option<Self> {
        core.activity.pass();
        // Inside the gate: reencryption begins, the cipher changes and the size shrinks with
        // it closed.
        let pass = core.gate.try_enter()?;
        let mask = (1u64 << core.shift) - 1;
        let whole = len > 0 && (offset | len as u64) & mask == 0;
        if !whole || core.segmented.load(Relaxed) || !core.runs_inline(write, len as u64) {
            return None;
        }
        core.check(offset, len as u64).ok()?;
        let fd = core.backend.file_fd()?;
        let at = core.data_offset.checked_add(offset)?;
        let block = u64::from(core.backend.logical_block_bytes().max(1));
        if (at | len as u64) % block != 0 {
            return None;
        }
        Some(Place {
            core,
            fd,
            at,
            offset,
            len,
            t: Times::start(),
            _pass: pass,
        })
    }

    /// The first sector.
    fn sector(&self) -> u64 {
        self.offset >> self.core.shift
    }

    /// Where the rest of a request the caller's I/O did `n` bytes of starts: `n` rounded down
    /// to what direct I/O may start at (both alignments are powers of two).
    fn resume_at(&self, n: usize) -> usize {
        let block = self.core.backend.logical_block_bytes().max(1) as usize;
        n - n % block.max(self.core.mem_align)
    }

    fn check_len(&self, what: &str, n: usize) -> Result<()> {
        if n == self.len {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "a direct request of {} bytes given a {what} of {n}",
            self.len
        )))
    }

    /// Counts the request (or its error) in the volume's statistics.
    fn count(&self, kind: Kind, r: &Result<()>) {
        match r {
            Ok(()) => self
                .core
                .stats
                .record(kind, self.len as u64, &self.t, false, false),
            Err(e) => self.core.stats.record_error(kind, e.kind()),
        }
    }

    fn io_error(&self, what: &str, e: io::Error) -> Error {
        Error::io(format!("{what} of {} bytes at {}", self.len, self.at), e)
    }
}

/// A read handed to the caller (see the module's text): read [`DirectRead::len`] bytes of
/// [`DirectRead::fd`] at [`DirectRead::file_offset`] into a buffer aligned to
/// [`DirectRead::align`], then [`DirectRead::finish`]. Dropped unfinished, it only lets the
/// gate go (nothing is counted).
pub struct DirectRead<'a>(Place<'a>);

impl<'a> DirectRead<'a> {
    pub(super) fn new(core: &'a Core, offset: u64, len: usize) -> Option<Self> {
        let p = Place::new(core, offset, len, false)?;
        (core.null_cipher() || core.out_of_place.load(Relaxed)).then_some(DirectRead(p))
    }

    /// The backing file to read.
    pub fn fd(&self) -> BorrowedFd<'a> {
        self.0.fd
    }

    /// Where in the file the ciphertext lies, in bytes.
    pub fn file_offset(&self) -> u64 {
        self.0.at
    }

    /// Bytes to read: the request's length.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Never true: a request of nothing is not handed out.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The buffer read into must start at a multiple of this (the backend's direct I/O).
    pub fn align(&self) -> usize {
        self.0.core.mem_align
    }

    /// Ends the read: `read` is what the caller's read of the file returned (bytes read, or
    /// its error); `ciphertext` (the caller's private buffer, [`DirectRead::len`] bytes) what
    /// it read. A short read is completed here with the backend's own read. Decrypts into
    /// `out` (the same length) and counts the request in the volume's statistics.
    pub fn finish(
        self,
        read: io::Result<usize>,
        ciphertext: &mut [u8],
        out: &mut [u8],
    ) -> Result<()> {
        let r = self.open(read, ciphertext, out);
        self.0.count(Kind::Read, &r);
        r
    }

    fn open(&self, read: io::Result<usize>, ciphertext: &mut [u8], out: &mut [u8]) -> Result<()> {
        let p = &self.0;
        p.check_len("buffer", ciphertext.len())?;
        p.check_len("destination", out.len())?;
        let n = read.map_err(|e| p.io_error("read", e))?.min(p.len);
        if n < p.len {
            let from = p.resume_at(n);
            p.core
                .backend
                .read_exact_at(&mut ciphertext[from..], p.at + from as u64)?;
        }
        p.core.decrypt_out(None, p.sector(), ciphertext, out)
    }
}

/// A write handed to the caller (see the module's text): [`DirectWrite::seal`] the data into a
/// buffer aligned to [`DirectWrite::align`], write that buffer's [`DirectWrite::len`] bytes to
/// [`DirectWrite::fd`] at [`DirectWrite::file_offset`] (with `RWF_DSYNC` where
/// [`DirectWrite::durable`]), then [`DirectWrite::finish`]. Dropped unfinished, it lets its
/// sectors and the gate go (nothing is counted).
pub struct DirectWrite<'a> {
    // First: the sectors are let go before the gate.
    _lock: RangeGuard<'a>,
    place: Place<'a>,
    durable: bool,
}

impl<'a> DirectWrite<'a> {
    pub(super) fn new(core: &'a Core, offset: u64, len: usize, fua: bool) -> Option<Self> {
        if core.read_only {
            return None;
        }
        let place = Place::new(core, offset, len, true)?;
        let first = place.sector();
        let range = SectorRange {
            first,
            end: first + (len as u64 >> core.shift),
        };
        let lock = core.locks.try_lock(range)?;
        Some(DirectWrite {
            _lock: lock,
            place,
            durable: fua || core.backend.writes_through(),
        })
    }

    /// The backing file to write.
    pub fn fd(&self) -> BorrowedFd<'a> {
        self.place.fd
    }

    /// Where in the file the ciphertext goes, in bytes.
    pub fn file_offset(&self) -> u64 {
        self.place.at
    }

    /// Bytes to write: the request's length.
    pub fn len(&self) -> usize {
        self.place.len
    }

    /// Never true: a request of nothing is not handed out.
    pub fn is_empty(&self) -> bool {
        self.place.len == 0
    }

    /// The buffer written from must start at a multiple of this (the backend's direct I/O).
    pub fn align(&self) -> usize {
        self.place.core.mem_align
    }

    /// The write must be durable when it completes (a FUA write, or a write-through cache):
    /// write with `RWF_DSYNC`.
    pub fn durable(&self) -> bool {
        self.durable
    }

    /// Encrypts `src` (the plaintext, [`DirectWrite::len`] bytes; each byte is read once)
    /// into `buf`, the caller's private buffer of the same length.
    pub fn seal(&self, src: &[u8], buf: &mut [u8]) -> Result<()> {
        let p = &self.place;
        let r = p
            .check_len("source", src.len())
            .and_then(|()| p.check_len("buffer", buf.len()))
            .and_then(|()| p.core.crypt(None, true, p.sector(), buf, Some(src)));
        if let Err(e) = &r {
            p.core.stats.record_error(Kind::Write, e.kind());
        }
        r
    }

    /// Ends the write: `written` is what the caller's write of `buf` (the sealed buffer)
    /// returned. A short write is completed here with the backend's own write. Counts the
    /// request in the volume's statistics.
    pub fn finish(self, written: io::Result<usize>, buf: &[u8]) -> Result<()> {
        let r = self.close(written, buf);
        self.place.count(Kind::Write, &r);
        r
    }

    fn close(&self, written: io::Result<usize>, buf: &[u8]) -> Result<()> {
        let p = &self.place;
        p.check_len("buffer", buf.len())?;
        let n = written.map_err(|e| p.io_error("write", e))?.min(p.len);
        if n < p.len {
            let from = p.resume_at(n);
            let at = p.at + from as u64;
            if self.durable {
                p.core.backend.write_at_fua(&buf[from..], at)?;
            } else {
                p.core.backend.write_at(&buf[from..], at)?;
            }
        }
        Ok(())
    }
}
