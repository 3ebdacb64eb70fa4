//! The plaintext block device every front end (NBD, FUSE, ublk, export/import) serves. A
//! [`crate::volume::Volume`] implements it; tests may implement it over plain memory. Front ends
//! never see keys, cipher contexts or headers, only this.

use crate::{Error, Result};

/// A thread-safe plaintext block device: many callers may issue requests at once (`&self`).
///
/// Contract:
/// - Offsets and lengths are bytes; a request must lie within `size()` (else `OutOfRange`).
/// - Requests need not be aligned to `block_size()`; unaligned ones cost a read-modify-write.
/// - `write_at` returning `Ok` means the data is visible to later reads; it is durable only
///   after a later `flush` returns `Ok`, or when it was written with `write_fua`.
/// - Errors affect only the request that returned them; the device stays usable.
pub trait BlockDev: Send + Sync {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// The encryption sector size: the smallest request served without read-modify-write.
    fn block_size(&self) -> u32;
    /// True if writes, discards and write-zeroes are refused with `Error::ReadOnly`.
    fn read_only(&self) -> bool;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// Like `write_at`, for a caller that gives up its buffer's contents (a network payload it
    /// will not read again): the device may use `buf` as scratch space, so an encrypted volume
    /// can encrypt an aligned request in place instead of copying it to a bounce buffer.
    /// Afterwards `buf` holds unspecified bytes (for a volume, ciphertext or the plaintext).
    fn write_at_mut(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.write_at(buf, offset)
    }
    /// Like `write_at_mut`, and durable when it returns `Ok` (Force Unit Access): a front end's
    /// FUA write. Other writes are not made durable by it. The default writes, then flushes.
    fn write_fua(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.write_at_mut(buf, offset)?;
        self.flush()
    }
    /// Like `read_at`, into memory another party can see and change while the read runs (a
    /// virtual machine's): only plaintext is ever written into `dst`, never ciphertext or
    /// data an integrity check has not passed. `scratch` is the caller's private memory of
    /// at least `dst.len()` bytes; the default reads into it and copies, and afterwards it
    /// holds the plaintext (the caller wipes it).
    fn read_shared(&self, dst: &mut [u8], offset: u64, scratch: &mut [u8]) -> Result<()> {
        read_through(self, dst, offset, scratch)
    }
    /// Like `write_at` (`write_fua` with `fua`), from memory another party may change while
    /// the write runs: the device reads each byte of `src` once, into memory of its own,
    /// before it computes anything from it (an integrity tag, an IV). `scratch` as for
    /// `read_shared`; the default copies `src` into it and writes from there.
    fn write_shared(&self, src: &[u8], offset: u64, fua: bool, scratch: &mut [u8]) -> Result<()> {
        write_through(self, src, offset, fua, scratch)
    }
    /// Like `read_shared`, into a buffer of several runs of shared memory (a VM's scattered
    /// pages), in order: the first run receives the bytes at `offset`, the next the bytes
    /// after them. `scratch` holds at least their total; the default reads into it and copies
    /// out run by run. A volume decrypts straight into the runs when each is a whole number of
    /// its sectors.
    fn read_shared_runs(&self, dst: &[SharedRun], offset: u64, scratch: &mut [u8]) -> Result<()> {
        read_runs_through(self, dst, offset, scratch)
    }
    /// Like `write_shared`, from runs of shared memory in order, as `read_shared_runs`; the
    /// default copies them into `scratch` and writes from there. A volume encrypts straight
    /// from the runs when each is a whole number of its sectors.
    fn write_shared_runs(
        &self,
        src: &[SharedRun],
        offset: u64,
        fua: bool,
        scratch: &mut [u8],
    ) -> Result<()> {
        write_runs_through(self, src, offset, fua, scratch)
    }
    /// A read of `len` bytes at `offset` that the caller performs itself on the backing file,
    /// for a front end with asynchronous I/O of its own that keeps many reads in flight on one
    /// thread ([`DirectRead`](crate::direct::DirectRead)). `None` where the device does not
    /// hand one out (the default); the caller then reads with [`BlockDev::read_shared`], which
    /// also reports any error.
    fn read_direct(&self, offset: u64, len: usize) -> Option<crate::direct::DirectRead<'_>> {
        let _ = (offset, len);
        None
    }
    /// A whole-block write of `len` bytes at `offset` (durable when it completes, with `fua`)
    /// that the caller performs itself on the backing file, as [`BlockDev::read_direct`]
    /// ([`DirectWrite`](crate::direct::DirectWrite)). `None` where the device does not hand
    /// one out (the default); the caller then writes with [`BlockDev::write_shared`].
    fn write_direct(
        &self,
        offset: u64,
        len: usize,
        fua: bool,
    ) -> Option<crate::direct::DirectWrite<'_>> {
        let _ = (offset, len, fua);
        None
    }
    /// Makes every acknowledged write durable on the backing store (fdatasync).
    fn flush(&self) -> Result<()>;
    /// The range may read back as anything afterwards (LUKS: ciphertext hole reads as garbage);
    /// frees space on the backing store where it can.
    fn discard(&self, offset: u64, len: u64) -> Result<()>;
    /// The range reads back as zeroes afterwards.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()>;
}

/// Checks that `offset..offset+len` lies inside a device (or backend) of `size` bytes, without
/// overflowing: the one range check of every `BlockDev` and `Backend`.
pub fn check_range(offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfRange { offset, len, size }),
    }
}

/// A run of memory another party maps too and may read or change at any time (a VM's pages):
/// the unit of [`BlockDev::read_shared_runs`] and [`BlockDev::write_shared_runs`].
#[derive(Clone, Copy, Debug)]
pub struct SharedRun {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

impl SharedRun {
    /// The `len` bytes at `ptr`.
    ///
    /// # Safety
    /// They must stay mapped and readable (and writable, for a read's runs) until every call
    /// given this run has returned. Others may read and change them meanwhile, and runs may
    /// overlap each other: a device only ever reads each byte once, into memory of its own,
    /// or stores finished plaintext there, and never relies on what it finds.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> SharedRun {
        SharedRun { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The total length of `runs`, saturated: a request that long is refused by its scratch.
pub(crate) fn runs_len(runs: &[SharedRun]) -> usize {
    runs.iter().fold(0usize, |n, r| n.saturating_add(r.len))
}

/// [`Scratch`]'s alignment, a page: what direct I/O asks of a buffer's address.
pub const SCRATCH_ALIGN: usize = 4096;

/// One page of a [`Scratch`].
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; SCRATCH_ALIGN]);

/// A caller's private memory for [`BlockDev::read_shared`] and [`BlockDev::write_shared`]:
/// page-aligned (a volume does direct I/O from it), grown on demand to whole pages, and wiped
/// before it is regrown and when dropped, since it may hold plaintext.
#[derive(Default)]
pub struct Scratch(Vec<Page>);

impl Scratch {
    /// The first `n` bytes, grown (and the old contents wiped) when shorter.
    pub fn get(&mut self, n: usize) -> &mut [u8] {
        let pages = n.div_ceil(SCRATCH_ALIGN);
        if self.0.len() < pages {
            self.wipe();
            self.0 = vec![Page([0; SCRATCH_ALIGN]); pages];
        }
        assert!(
            self.0.len() * SCRATCH_ALIGN >= n,
            "scratch shorter than asked"
        );
        // SAFETY: `Page` is `repr(C)` around a byte array whose size is its alignment, so it
        // has no padding and the vector's pages are one initialised, contiguous byte range of
        // `len * SCRATCH_ALIGN` bytes (at least `n`, asserted above), borrowed through
        // `&mut self` for as long as the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), n) }
    }

    fn wipe(&mut self) {
        for p in &mut self.0 {
            zeroize::Zeroize::zeroize(&mut p.0);
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.wipe();
    }
}

/// [`BlockDev::read_shared`] through the caller's `scratch`: a read into it, then a copy.
pub fn read_through<D: BlockDev + ?Sized>(
    dev: &D,
    dst: &mut [u8],
    offset: u64,
    scratch: &mut [u8],
) -> Result<()> {
    let tmp = scratch_for(scratch, dst.len())?;
    dev.read_at(tmp, offset)?;
    dst.copy_from_slice(tmp);
    Ok(())
}

/// [`BlockDev::write_shared`] through the caller's `scratch`: a copy into it, then a write
/// that may use it as scratch space.
pub fn write_through<D: BlockDev + ?Sized>(
    dev: &D,
    src: &[u8],
    offset: u64,
    fua: bool,
    scratch: &mut [u8],
) -> Result<()> {
    let tmp = scratch_for(scratch, src.len())?;
    tmp.copy_from_slice(src);
    if fua {
        dev.write_fua(tmp, offset)
    } else {
        dev.write_at_mut(tmp, offset)
    }
}

/// [`BlockDev::read_shared_runs`] through the caller's `scratch`: a read into it, then a copy
/// into each run.
pub fn read_runs_through<D: BlockDev + ?Sized>(
    dev: &D,
    dst: &[SharedRun],
    offset: u64,
    scratch: &mut [u8],
) -> Result<()> {
    let tmp = scratch_for(scratch, runs_len(dst))?;
    dev.read_at(tmp, offset)?;
    let mut at = 0;
    for r in dst {
        // SAFETY: `SharedRun::new`'s contract: `r.len` writable bytes at `r.ptr`, apart from
        // `tmp` (the caller's private scratch); `at + r.len` is within `tmp`, which is the
        // runs' total long.
        unsafe { std::ptr::copy_nonoverlapping(tmp[at..].as_ptr(), r.ptr, r.len) };
        at += r.len;
    }
    Ok(())
}

/// [`BlockDev::write_shared_runs`] through the caller's `scratch`: a copy of each run into
/// it, then a write that may use it as scratch space.
pub fn write_runs_through<D: BlockDev + ?Sized>(
    dev: &D,
    src: &[SharedRun],
    offset: u64,
    fua: bool,
    scratch: &mut [u8],
) -> Result<()> {
    let tmp = scratch_for(scratch, runs_len(src))?;
    let mut at = 0;
    for r in src {
        // SAFETY: as in `read_runs_through`, with `r.len` readable bytes at `r.ptr`.
        unsafe { std::ptr::copy_nonoverlapping(r.ptr, tmp[at..].as_mut_ptr(), r.len) };
        at += r.len;
    }
    if fua {
        dev.write_fua(tmp, offset)
    } else {
        dev.write_at_mut(tmp, offset)
    }
}

fn scratch_for(scratch: &mut [u8], len: usize) -> Result<&mut [u8]> {
    let have = scratch.len();
    scratch.get_mut(..len).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "scratch buffer of {have} bytes for a request of {len} bytes"
        ))
    })
}
