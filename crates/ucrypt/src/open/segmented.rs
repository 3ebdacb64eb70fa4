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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::Error;

    /// Plain memory as a device: the "decrypted" layer under the segments.
    struct Mem(Mutex<Vec<u8>>, bool);

    impl BlockDev for Mem {
        fn size(&self) -> u64 {
            self.0.lock().unwrap().len() as u64
        }
        fn block_size(&self) -> u32 {
            512
        }
        fn read_only(&self) -> bool {
            self.1
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            let m = self.0.lock().unwrap();
            buf.copy_from_slice(&m[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
            let mut m = self.0.lock().unwrap();
            m[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
            Ok(())
        }
        fn flush(&self) -> Result<()> {
            Ok(())
        }
        fn discard(&self, _: u64, _: u64) -> Result<()> {
            Ok(())
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
            self.write_at(&vec![0; len as usize], offset)
        }
    }

    fn seg(offset: u64, len: u64, kind: SegmentKind) -> Segment {
        Segment { offset, len, kind }
    }

    /// 8 KiB: the head (0..1 KiB) lives at 4 KiB, 4..5 KiB reads as zeros.
    fn layout() -> Vec<Segment> {
        vec![
            seg(
                0,
                1024,
                SegmentKind::Crypt {
                    device_offset: 4096,
                },
            ),
            seg(
                1024,
                3072,
                SegmentKind::Crypt {
                    device_offset: 1024,
                },
            ),
            seg(4096, 1024, SegmentKind::Zero),
            seg(
                5120,
                3072,
                SegmentKind::Crypt {
                    device_offset: 5120,
                },
            ),
        ]
    }

    fn dev(read_only: bool) -> (Arc<Mem>, SegmentedDev) {
        let bytes: Vec<u8> = (0..8192u32).map(|i| (i / 512 + 1) as u8).collect();
        let mem = Arc::new(Mem(Mutex::new(bytes), read_only));
        let d = SegmentedDev::new(mem.clone(), layout()).unwrap();
        (mem, d)
    }

    #[test]
    fn reads_follow_the_segments() {
        let (_, d) = dev(false);
        assert_eq!(d.size(), 8192);
        let mut all = vec![0u8; 8192];
        d.read_at(&mut all, 0).unwrap();
        // The head comes from 4 KiB (sectors 9 and 10 of the device).
        assert_eq!(all[0], 9);
        assert_eq!(all[600], 10);
        assert_eq!(all[1024], 3);
        assert!(all[4096..5120].iter().all(|&b| b == 0));
        assert_eq!(all[5120], 11);
        // A read across every boundary equals the slices of the whole.
        let mut part = vec![0u8; 6000];
        d.read_at(&mut part, 1000).unwrap();
        assert_eq!(part, all[1000..7000]);
    }

    #[test]
    fn writes_land_where_they_are_read_and_zero_segments_drop_them() {
        let (mem, d) = dev(false);
        d.write_at(&[0xaa; 8192], 0).unwrap();
        let mut all = vec![0u8; 8192];
        d.read_at(&mut all, 0).unwrap();
        assert!(all[..4096].iter().all(|&b| b == 0xaa));
        assert!(all[4096..5120].iter().all(|&b| b == 0));
        assert!(all[5120..].iter().all(|&b| b == 0xaa));
        // The device's own 4..5 KiB holds the head, written through offset 0.
        assert!(mem.0.lock().unwrap()[4096..5120].iter().all(|&b| b == 0xaa));
    }

    #[test]
    fn misuse_and_read_only() {
        let (_, d) = dev(true);
        assert!(matches!(
            d.write_at(&[1; 512], 4096),
            Err(Error::ReadOnly(_))
        ));
        assert!(matches!(d.write_zeroes(4096, 512), Err(Error::ReadOnly(_))));
        let mut b = [0u8; 2];
        assert!(matches!(
            d.read_at(&mut b, 8191),
            Err(Error::OutOfRange { .. })
        ));
        let mem = Arc::new(Mem(Mutex::new(vec![0; 4096]), false));
        // A gap, and an encrypted segment past the device.
        assert!(SegmentedDev::new(mem.clone(), vec![seg(512, 512, SegmentKind::Zero)]).is_err());
        assert!(SegmentedDev::new(
            mem,
            vec![seg(0, 4096, SegmentKind::Crypt { device_offset: 512 })]
        )
        .is_err());
    }
}
