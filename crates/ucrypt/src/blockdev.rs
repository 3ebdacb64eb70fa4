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
