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
//! The volume (`volume/direct.rs`) decides what it hands out and provides its side through
//! `DirectHost`; this module holds the handles, which front ends see.
//!
//! [`BlockDev::read_direct`]: crate::BlockDev::read_direct
//! [`BlockDev::write_direct`]: crate::BlockDev::write_direct
//! [`BlockDev::read_shared`]: crate::BlockDev::read_shared

use std::io;
use std::os::fd::BorrowedFd;

use crate::engine::gate::Pass;
use crate::engine::range_lock::RangeGuard;
use crate::engine::stats::{Kind, Times};
use crate::{Error, Result};

/// What a volume provides to the requests it hands out.
pub(crate) trait DirectHost: Sync {
    /// Decrypts whole sectors from `buf` into `out`, the first sector being `sector`.
    fn decrypt_out(&self, sector: u64, buf: &[u8], out: &mut [u8]) -> Result<()>;
    /// Encrypts whole sectors from `src` into `buf`.
    fn encrypt_to(&self, sector: u64, src: &[u8], buf: &mut [u8]) -> Result<()>;
    /// The backend's own read of all of `buf` at file offset `at`.
    fn read_rest(&self, buf: &mut [u8], at: u64) -> Result<()>;
    /// The backend's own write of all of `buf` at file offset `at`, durable if `durable`.
    fn write_rest(&self, buf: &[u8], at: u64, durable: bool) -> Result<()>;
    /// What the backend's direct I/O asks of a buffer's address.
    fn mem_align(&self) -> usize;
    /// Where direct I/O may start: a multiple of this (a power of two).
    fn io_block(&self) -> usize;
    /// log2 of the sector size.
    fn sector_shift(&self) -> u32;
    /// Counts a request (`Ok`) or its error.
    fn count(&self, kind: Kind, bytes: u64, t: &Times, r: &Result<()>);
}

/// Where a request handed out lies, and what it holds; shared by reads and writes.
pub(crate) struct Place<'a> {
    host: &'a dyn DirectHost,
    fd: BorrowedFd<'a>,
    at: u64,
    offset: u64,
    len: usize,
    t: Times,
    // Last: dropped after everything above is done with.
    _pass: Pass<'a>,
}

impl<'a> Place<'a> {
    /// A request of `len` bytes at volume offset `offset`, at `at` in the file `fd`, inside
    /// the gate (`pass`); the volume checked everything the module's text lists.
    pub(crate) fn new(
        host: &'a dyn DirectHost,
        pass: Pass<'a>,
        fd: BorrowedFd<'a>,
        at: u64,
        offset: u64,
        len: usize,
    ) -> Self {
        Place {
            host,
            fd,
            at,
            offset,
            len,
            t: Times::start(),
            _pass: pass,
        }
    }

    /// The first sector.
    pub(crate) fn sector(&self) -> u64 {
        self.offset >> self.host.sector_shift()
    }

    /// Where the rest of a request the caller's I/O did `n` bytes of starts: `n` rounded down
    /// to what direct I/O may start at.
    fn resume_at(&self, n: usize) -> usize {
        n - n % self.host.io_block().max(1)
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
    pub(crate) fn new(place: Place<'a>) -> Self {
        DirectRead(place)
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
        self.0.host.mem_align()
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
        let p = &self.0;
        p.host.count(Kind::Read, p.len as u64, &p.t, &r);
        r
    }

    fn open(&self, read: io::Result<usize>, ciphertext: &mut [u8], out: &mut [u8]) -> Result<()> {
        let p = &self.0;
        p.check_len("buffer", ciphertext.len())?;
        p.check_len("destination", out.len())?;
        let n = read.map_err(|e| p.io_error("read", e))?.min(p.len);
        if n < p.len {
            let from = p.resume_at(n);
            p.host
                .read_rest(&mut ciphertext[from..], p.at + from as u64)?;
        }
        p.host.decrypt_out(p.sector(), ciphertext, out)
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
    /// A write at `place` holding its sectors (`lock`).
    pub(crate) fn new(place: Place<'a>, lock: RangeGuard<'a>, durable: bool) -> Self {
        DirectWrite {
            _lock: lock,
            place,
            durable,
        }
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
        self.place.host.mem_align()
    }

    /// The write must be durable when it completes (a FUA write, or a write-through cache):
    /// write with `RWF_DSYNC`.
    pub fn durable(&self) -> bool {
        self.durable
    }

    /// Encrypts `src` (the plaintext, [`DirectWrite::len`] bytes; each byte is read once)
    /// into `buf`, the caller's private buffer of the same length. A failure is counted.
    pub fn seal(&self, src: &[u8], buf: &mut [u8]) -> Result<()> {
        let p = &self.place;
        let r = p
            .check_len("source", src.len())
            .and_then(|()| p.check_len("buffer", buf.len()))
            .and_then(|()| p.host.encrypt_to(p.sector(), src, buf));
        if r.is_err() {
            p.host.count(Kind::Write, p.len as u64, &p.t, &r);
        }
        r
    }

    /// Ends the write: `written` is what the caller's write of `buf` (the sealed buffer)
    /// returned. A short write is completed here with the backend's own write. Counts the
    /// request in the volume's statistics.
    pub fn finish(self, written: io::Result<usize>, buf: &[u8]) -> Result<()> {
        let r = self.close(written, buf);
        let p = &self.place;
        p.host.count(Kind::Write, p.len as u64, &p.t, &r);
        r
    }

    fn close(&self, written: io::Result<usize>, buf: &[u8]) -> Result<()> {
        let p = &self.place;
        p.check_len("buffer", buf.len())?;
        let n = written.map_err(|e| p.io_error("write", e))?.min(p.len);
        if n < p.len {
            let from = p.resume_at(n);
            p.host
                .write_rest(&buf[from..], p.at + from as u64, self.durable)?;
        }
        Ok(())
    }
}
