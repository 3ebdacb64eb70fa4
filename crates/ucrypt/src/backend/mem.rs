//! An in-memory backend: for tests and for benchmarks that take storage out of the picture.

use std::sync::RwLock;

use super::{check_range, Backend};
use crate::{Error, Result};

/// Memory is split in stripes, each behind its own lock, so that concurrent requests to
/// different places do not serialise on one lock. A request touching several stripes locks them
/// one at a time: each stripe's part is atomic, the whole is not (like a disk).
const STRIPE_BYTES: usize = 64 << 10;

pub struct MemBackend {
    stripes: Vec<RwLock<Vec<u8>>>,
    size: u64,
    logical_block_bytes: u32,
}

impl MemBackend {
    /// A zero-filled backend of `size` bytes with 512-byte logical blocks.
    pub fn new(size: u64) -> Self {
        Self::with_block_bytes(size, 512)
    }

    pub fn with_block_bytes(size: u64, logical_block_bytes: u32) -> Self {
        let n = (size as usize).div_ceil(STRIPE_BYTES);
        let stripes = (0..n)
            .map(|i| {
                let len = STRIPE_BYTES.min(size as usize - i * STRIPE_BYTES);
                RwLock::new(vec![0u8; len])
            })
            .collect();
        MemBackend {
            stripes,
            size,
            logical_block_bytes,
        }
    }

    /// Visits the stripes covering `offset..offset+len`: `f(stripe, range_in_stripe, range_in_request)`.
    fn each_stripe(
        &self,
        offset: u64,
        len: usize,
        mut f: impl FnMut(
            &RwLock<Vec<u8>>,
            std::ops::Range<usize>,
            std::ops::Range<usize>,
        ) -> Result<()>,
    ) -> Result<()> {
        let mut done = 0usize;
        while done < len {
            let pos = offset as usize + done;
            let (i, within) = (pos / STRIPE_BYTES, pos % STRIPE_BYTES);
            let n = (STRIPE_BYTES - within).min(len - done);
            f(&self.stripes[i], within..within + n, done..done + n)?;
            done += n;
        }
        Ok(())
    }

    fn fill_zero(&self, offset: u64, len: u64) -> Result<()> {
        check_range(offset, len, self.size)?;
        self.each_stripe(offset, len as usize, |s, r, _| {
            s.write().map_err(|_| poisoned())?[r].fill(0);
            Ok(())
        })
    }
}

fn poisoned() -> Error {
    Error::Bug("memory backend lock poisoned by a panicking thread")
}

impl Backend for MemBackend {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        if offset >= self.size {
            return Ok(0);
        }
        let n = buf.len().min((self.size - offset) as usize);
        self.each_stripe(offset, n, |s, r, b| {
            buf[b].copy_from_slice(&s.read().map_err(|_| poisoned())?[r]);
            Ok(())
        })?;
        Ok(n)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size)?;
        self.each_stripe(offset, buf.len(), |s, r, b| {
            s.write().map_err(|_| poisoned())?[r].copy_from_slice(&buf[b]);
            Ok(())
        })
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.fill_zero(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.fill_zero(offset, len)
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_bytes(&self) -> u32 {
        self.logical_block_bytes
    }

    fn describe(&self) -> String {
        format!("memory ({} bytes)", self.size)
    }
}
