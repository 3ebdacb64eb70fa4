//! A plaintext device made of segments over one encrypted device: what cryptsetup builds
//! from several dm-crypt and dm-zero targets for a BitLocker volume.
//!
//! The segments sit above the engine, not below it in a backend: each encrypted segment of a
//! BitLocker volume uses the IV of its physical position (the moved volume header too), so
//! one engine [`crate::volume::Volume`] over the whole device, IVs counted from byte 0, serves
//! every encrypted segment, and this layer only moves offsets and serves the zero segments. A
//! backend layer below the engine could move the header but not give it its own IVs, nor
//! make a range read as plaintext zeros.

use std::sync::Arc;

use crate::bitlk::{Segment, SegmentKind};
use crate::blockdev::check_range;
use crate::{BlockDev, Result};

pub(crate) struct SegmentedDev {
    inner: Arc<dyn BlockDev>,
    /// Sorted, contiguous from 0, covering `size`.
    segments: Vec<Segment>,
    size: u64,
}

impl SegmentedDev {
    /// `segments` must be sorted and contiguous from 0 (as [`crate::bitlk::segments`] makes
    /// them), every encrypted one inside `inner`.
    pub(crate) fn new(inner: Arc<dyn BlockDev>, segments: Vec<Segment>) -> Result<Self> {
        let mut at = 0u64;
        for s in &segments {
            if s.offset != at {
                return Err(crate::Error::Bug("segments not contiguous"));
            }
            if let SegmentKind::Crypt { device_offset } = s.kind {
                check_range(device_offset, s.len, inner.size())?;
            }
            at = s.offset + s.len;
        }
        Ok(SegmentedDev {
            inner,
            segments,
            size: at,
        })
    }

    fn check_writable(&self) -> Result<()> {
        if self.inner.read_only() {
            return Err(crate::Error::ReadOnly(
                "the volume was opened read-only".into(),
            ));
        }
        Ok(())
    }

    /// Calls `f(segment, offset within it, request offset, len)` for each piece of the range.
    fn each(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Segment, u64, usize, usize) -> Result<()>,
    ) -> Result<()> {
        check_range(offset, len, self.size)?;
        let end = offset + len;
        let first = self
            .segments
            .partition_point(|s| s.offset + s.len <= offset);
        for s in &self.segments[first..] {
            if s.offset >= end {
                break;
            }
            let from = offset.max(s.offset);
            let to = end.min(s.offset + s.len);
            f(
                s,
                from - s.offset,
                (from - offset) as usize,
                (to - from) as usize,
            )?;
        }
        Ok(())
    }
}

impl BlockDev for SegmentedDev {
    fn size(&self) -> u64 {
        self.size
    }

    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }

    fn read_only(&self) -> bool {
        self.inner.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.each(offset, buf.len() as u64, |s, within, at, n| match s.kind {
            SegmentKind::Zero => {
                buf[at..at + n].fill(0);
                Ok(())
            }
            SegmentKind::Crypt { device_offset } => self
                .inner
                .read_at(&mut buf[at..at + n], device_offset + within),
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.check_writable()?;
        self.each(offset, buf.len() as u64, |s, within, at, n| match s.kind {
            // dm-zero drops writes.
            SegmentKind::Zero => Ok(()),
            SegmentKind::Crypt { device_offset } => self
                .inner
                .write_at(&buf[at..at + n], device_offset + within),
        })
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_writable()?;
        self.each(offset, len, |s, within, _, n| match s.kind {
            SegmentKind::Zero => Ok(()),
            SegmentKind::Crypt { device_offset } => {
                self.inner.discard(device_offset + within, n as u64)
            }
        })
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check_writable()?;
        self.each(offset, len, |s, within, _, n| match s.kind {
            SegmentKind::Zero => Ok(()),
            SegmentKind::Crypt { device_offset } => {
                self.inner.write_zeroes(device_offset + within, n as u64)
            }
        })
    }
}
