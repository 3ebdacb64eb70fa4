//! A crash-simulating backend: storage with a volatile write cache, as a disk has, that can
//! lose power at any moment.
//!
//! Reads see every write. A flush makes every write before it durable. What a power cut
//! leaves ([`CrashBackend::crash_image`]) is, for each atomic unit of the device (512 bytes or
//! 4 KiB, [`CrashBackend::new`]) written since the last flush, the unit's durable contents or
//! the contents of any one of those writes, chosen by a seeded generator: writes since the last
//! flush may land whole, torn at unit boundaries, in any order, or not at all. A FUA write
//! ([`CrashBackend::write_at_fua`]) is durable when it returns.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::{check_range, Backend};
use crate::sync::lock;
use crate::{Error, Result};

/// Largest simulated device: the simulator keeps two copies of it and a list of its units.
pub const CRASH_BACKEND_BYTES_MAX: u64 = 64 << 20;

struct State {
    /// What reads see.
    current: Vec<u8>,
    /// What survives any crash: everything written before the last flush.
    durable: Vec<u8>,
    /// For each unit written since the last flush, the contents of each write to it, oldest
    /// first.
    pending: BTreeMap<u64, Vec<Vec<u8>>>,
}

pub struct CrashBackend {
    state: Mutex<State>,
    size: u64,
    unit: u64,
}

/// xorshift64*: the seeded choices of a crash.
fn next(x: &mut u64) -> u64 {
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

impl CrashBackend {
    /// A zeroed device of `size` bytes whose writes are atomic in units of `unit` bytes (a
    /// power of two from 512 to 4096, dividing `size`).
    pub fn new(size: u64, unit: u64) -> Result<Self> {
        if !(512..=4096).contains(&unit) || !unit.is_power_of_two() || size % unit != 0 {
            return Err(Error::InvalidArgument(format!(
                "crash backend: atomic unit {unit} must be a power of two from 512 to 4096 \
                 dividing the size {size}"
            )));
        }
        if size > CRASH_BACKEND_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "crash backend: {size} bytes is more than {CRASH_BACKEND_BYTES_MAX}"
            )));
        }
        Ok(Self::from_image(vec![0; size as usize], unit))
    }

    /// A device whose durable contents are `image` (what a crash left), nothing pending.
    pub fn from_image(image: Vec<u8>, unit: u64) -> Self {
        CrashBackend {
            size: image.len() as u64,
            unit,
            state: Mutex::new(State {
                current: image.clone(),
                durable: image,
                pending: BTreeMap::new(),
            }),
        }
    }

    /// Units written since the last flush.
    pub fn pending_units(&self) -> usize {
        lock(&self.state).pending.len()
    }

    /// A write that is durable when it returns (Force Unit Access). A device writes whole
    /// atomic units, so every unit the write touches is durable afterwards with what it holds
    /// now (for a partly covered unit, the device's own read-modify-write made it so).
    pub fn write_at_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_at(buf, offset)?;
        let mut s = lock(&self.state);
        let s = &mut *s;
        let unit = self.unit;
        for u in offset / unit..(offset + buf.len() as u64).div_ceil(unit) {
            let at = (u * unit) as usize..((u + 1) * unit) as usize;
            s.durable[at.clone()].copy_from_slice(&s.current[at]);
            s.pending.remove(&u);
        }
        Ok(())
    }

    /// What the device holds after a power cut now, chosen by `seed` (see the module docs).
    /// The device itself is unchanged.
    pub fn crash_image(&self, seed: u64) -> Vec<u8> {
        let s = lock(&self.state);
        let mut img = s.durable.clone();
        let mut x = seed | 1;
        let unit = self.unit as usize;
        for (&u, versions) in &s.pending {
            // Any one of the writes, or none of them (the durable contents).
            let pick = (next(&mut x) % (versions.len() as u64 + 1)) as usize;
            if pick < versions.len() {
                let at = u as usize * unit;
                img[at..at + unit].copy_from_slice(&versions[pick]);
            }
        }
        img
    }

    /// Records a change of `offset..offset + len` (already in `current`) as pending, unit by
    /// unit.
    fn note(&self, s: &mut State, offset: u64, len: u64) {
        let unit = self.unit;
        for u in offset / unit..(offset + len).div_ceil(unit) {
            let at = (u * unit) as usize;
            let contents = s.current[at..at + unit as usize].to_vec();
            s.pending.entry(u).or_default().push(contents);
        }
    }
}

impl Backend for CrashBackend {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        check_range(offset, buf.len() as u64, self.size)?;
        let s = lock(&self.state);
        buf.copy_from_slice(&s.current[offset as usize..offset as usize + buf.len()]);
        Ok(buf.len())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len() as u64, self.size)?;
        let mut s = lock(&self.state);
        s.current[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        self.note(&mut s, offset, buf.len() as u64);
        Ok(())
    }

    fn write_at_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        CrashBackend::write_at_fua(self, buf, offset)
    }

    fn flush(&self) -> Result<()> {
        let mut s = lock(&self.state);
        let s = &mut *s;
        s.durable.copy_from_slice(&s.current);
        s.pending.clear();
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        // Discarded ranges may read back as anything: here, zeroes, pending like a write.
        self.write_zeroes(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_range(offset, len, self.size)?;
        let mut s = lock(&self.state);
        s.current[offset as usize..(offset + len) as usize].fill(0);
        self.note(&mut s, offset, len);
        Ok(())
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_bytes(&self) -> u32 {
        512
    }

    fn describe(&self) -> String {
        format!(
            "crash-simulating memory ({} bytes, {}-byte atomic units)",
            self.size, self.unit
        )
    }

    /// Every write holds the one state lock.
    fn serializes_writes(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unflushed_units_land_whole_or_not_at_all_and_flushed_ones_always() {
        let b = CrashBackend::new(8192, 512).unwrap();
        b.write_at(&[1u8; 1024], 0).unwrap();
        b.flush().unwrap();
        b.write_at(&[2u8; 1024], 0).unwrap();
        b.write_at(&[3u8; 512], 512).unwrap();
        b.write_at_fua(&[4u8; 512], 4096).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let img = b.crash_image(seed);
            // Unit 0: the flushed 1s or the later 2s; unit 1: 1s, 2s or 3s; whole units.
            assert!(img[..512].iter().all(|&x| x == img[0]) && [1, 2].contains(&img[0]));
            assert!(img[512..1024].iter().all(|&x| x == img[512]) && [1, 2, 3].contains(&img[512]));
            assert!(img[4096..4608].iter().all(|&x| x == 4), "FUA is durable");
            assert!(img[1024..4096].iter().all(|&x| x == 0));
            seen.insert((img[0], img[512]));
        }
        assert_eq!(seen.len(), 6, "every combination happens: {seen:?}");
        b.flush().unwrap();
        assert_eq!(b.pending_units(), 0);
        assert_eq!(b.crash_image(7)[512], 3);
        assert!(CrashBackend::new(8192, 1000).is_err());
    }
}
