//! The volume's side of the requests a caller performs itself on the backing file
//! (`crate::direct`): what it hands out (whole sectors inside the volume, outside reencryption,
//! a backend that is one file, the backend's alignment, a policy that runs the request inline,
//! for a read a cipher that decrypts out of place, for a write a writable volume and sectors no
//! other write holds), taken without waiting at the gate or the range lock, and the crypto,
//! backend calls and statistics the handles use ([`DirectHost`]).

use std::sync::atomic::Ordering::Relaxed;

use super::Core;
use crate::direct::{DirectHost, DirectRead, DirectWrite, Place};
use crate::engine::plan::SectorRange;
use crate::engine::stats::{Kind, Times};
use crate::Result;

impl DirectHost for Core {
    fn decrypt_out(&self, sector: u64, buf: &[u8], out: &mut [u8]) -> Result<()> {
        Core::decrypt_out(self, None, sector, buf, out)
    }

    fn encrypt_to(&self, sector: u64, src: &[u8], buf: &mut [u8]) -> Result<()> {
        self.crypt(None, true, sector, buf, Some(src))
    }

    fn read_rest(&self, buf: &mut [u8], at: u64) -> Result<()> {
        self.backend.read_exact_at(buf, at)
    }

    fn write_rest(&self, buf: &[u8], at: u64, durable: bool) -> Result<()> {
        if durable {
            self.backend.write_at_fua(buf, at)
        } else {
            self.backend.write_at(buf, at)
        }
    }

    fn mem_align(&self) -> usize {
        self.mem_align
    }

    fn io_block(&self) -> usize {
        (self.backend.logical_block_bytes().max(1) as usize).max(self.mem_align)
    }

    fn sector_shift(&self) -> u32 {
        self.shift
    }

    fn count(&self, kind: Kind, bytes: u64, t: &Times, r: &Result<()>) {
        match r {
            Ok(()) => self.stats.record(kind, bytes, t, false, false),
            Err(e) => self.stats.record_error(kind, e.kind()),
        }
    }
}

impl Core {
    /// Where a request of `len` bytes at `offset` lies, if it may be handed out (see the
    /// module's text); inside the gate, entered without waiting.
    fn place(&self, offset: u64, len: usize, write: bool) -> Option<Place<'_>> {
        self.activity.pass();
        // Inside the gate: reencryption begins, the cipher changes and the size shrinks with
        // it closed.
        let pass = self.gate.try_enter()?;
        let mask = (1u64 << self.shift) - 1;
        let whole = len > 0 && (offset | len as u64) & mask == 0;
        if !whole || self.segmented.load(Relaxed) || !self.runs_inline(write, len as u64) {
            return None;
        }
        self.check(offset, len as u64).ok()?;
        let fd = self.backend.file_fd()?;
        let at = self.data_offset.checked_add(offset)?;
        let block = u64::from(self.backend.logical_block_bytes().max(1));
        if (at | len as u64) % block != 0 {
            return None;
        }
        Some(Place::new(self, pass, fd, at, offset, len))
    }

    /// [`crate::BlockDev::read_direct`] of a volume.
    pub(super) fn direct_read(&self, offset: u64, len: usize) -> Option<DirectRead<'_>> {
        let place = self.place(offset, len, false)?;
        let out_of_place = self.null_cipher() || self.out_of_place.load(Relaxed);
        out_of_place.then(|| DirectRead::new(place))
    }

    /// [`crate::BlockDev::write_direct`] of a volume.
    pub(super) fn direct_write(
        &self,
        offset: u64,
        len: usize,
        fua: bool,
    ) -> Option<DirectWrite<'_>> {
        if self.read_only {
            return None;
        }
        let place = self.place(offset, len, true)?;
        let first = place.sector();
        let range = SectorRange {
            first,
            end: first + (len as u64 >> self.shift),
        };
        let lock = self.locks.try_lock(range)?;
        let durable = fua || self.backend.writes_through();
        Some(DirectWrite::new(place, lock, durable))
    }
}
