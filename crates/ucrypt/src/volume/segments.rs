//! A volume in reencryption: two segments split at a mark. Going forward (a rotation, an
//! encryption), data below the mark is under the new key and data above under the old one;
//! going backward (a decryption), the new side is the one above the mark. The reencryptions
//! served online keep the data offset; the cipher and the sector size may change, and either
//! side may be plaintext (`cipher_null`: the new side of a decryption, the old side of an
//! encryption, with a detached header), so each side is a whole-volume view over the same
//! backend with its own cipher, key and sectors. A request is cut at the mark; each part runs
//! on its side's engine, which read-modify-writes a sector the part covers only in part (as
//! for any request not aligned to its sectors). The mark moves in whole sectors of both
//! sides, so no sector is ever split between them.
//!
//! The reencryptions that move the data give the new side its own data offset and the old
//! side a backend that reads the moved segment where it moved (`luks::reencrypt::online`).
//! The encryption that puts the header in front goes backward with one mark, as any. The
//! decryption that moves the data back goes forward from the end of its moved segment and
//! rewrites the moved segment last, so a leading head stays on the old side whatever the
//! mark, and leaves it piece by piece when it is rewritten: three ranges (old head, new,
//! old).
//!
//! A volume whose sector size or data offset changed keeps serving through the new side once
//! the reencryption ends (its own engine's sectors and offset are fixed for its life): the
//! segments stay, marked finished, with every byte on the new side, until the volume is
//! closed; suspend, resize and another reencryption wait for that reopening.
//!
//! The reencryption driver (`luks::reencrypt::online`) holds one hotzone at a time through the
//! [`ZoneLock`]: writes touching it wait for it alone, reads touching it only for the piece of
//! it being rewritten; the others keep flowing. The mark moves only while the hotzone past it
//! is held, past a piece once that piece is rewritten (reads of it excluded meanwhile), and a
//! request reads the mark only after it holds its range, so a request never sees a sector
//! change sides under it.
//!
//! Switching in and out happens with the volume's gate closed (no request inside):
//! [`Volume::begin_segments`] and [`Volume::end_segments`] (the old side's engine then takes
//! the new key, and the new side's engine is dropped).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::{Core, Source, Volume, VolumeConfig};
use crate::backend::Backend;
use crate::engine::plan::Op;
use crate::engine::zone_lock::{ByteRange, ZoneLock};
use crate::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};
use crate::sync::lock;
use crate::{Error, Result, SecretBytes};

/// Why a volume whose sector size or data offset changed online refuses suspend, resize and
/// another reencryption.
pub(crate) const REOPEN_NEEDED: &str = "the volume's sector size or data offset changed \
     online: it serves the new layout until it is closed; close it and open it again to \
     suspend, resize or reencrypt it";

pub(crate) struct Segments {
    /// The new key's side: a volume over the same backend (its own engine, pool and cipher
    /// contexts), reached only through this module.
    new: Volume,
    zones: ZoneLock,
    /// Where the new side meets the old one, in bytes from the start of the data.
    mark_bytes: AtomicU64,
    /// The new side is above the mark (a decryption), not below it.
    backward: bool,
    /// Going forward, a leading range the old side keeps whatever the mark (a decryption that
    /// moves the data back: its moved segment, done last): `[head_start, head_end)`. The
    /// walk's mark starts at `head_end`; the moved segment's pieces, rewritten in place from
    /// its start, move `head_start` up to `head_end`. Empty (`0, 0`) otherwise.
    head_start: AtomicU64,
    head_end: u64,
    /// The reencryption ended, but the new side's sectors or data offset differ from the
    /// volume's own: every byte is served by the new side until the volume is closed.
    finished: std::sync::atomic::AtomicBool,
}

impl Segments {
    /// The mark once `done` bytes are under the new key (the walk's bytes, the head's last).
    fn mark_of(&self, done: u64, size: u64) -> u64 {
        if self.backward {
            size.saturating_sub(done)
        } else {
            self.head_end.saturating_add(done).min(size)
        }
    }

    /// The bytes under the new key, from the mark and the head.
    fn done_of(&self, mark: u64, size: u64) -> u64 {
        if self.backward {
            size.saturating_sub(mark)
        } else {
            mark.saturating_sub(self.head_end) + self.head_start.load(Relaxed)
        }
    }
}

/// Where the new side of a reencryption served online lives: on `backend` (the device) at
/// `data_offset`; `head_bytes`, going forward, the leading range the old side keeps until the
/// end (see `Segments`).
pub struct NewSideAt {
    pub backend: Arc<dyn Backend>,
    pub data_offset: u64,
    pub head_bytes: u64,
}

impl Volume {
    /// Starts serving the volume as two segments: `done_bytes` under `new_key` of `new_spec`
    /// in sectors of `new_sector` (same data offset; each sector's IV its number in its own
    /// sectors), from the start, or from the end when `backward`; the rest under the volume's
    /// own cipher, key and sectors. Waits for the requests inside to finish (the gate), as
    /// `resize` does.
    pub fn begin_segments(
        &self,
        new_side: (CipherSpec, SecretBytes, SectorSize),
        done_bytes: u64,
        backward: bool,
    ) -> Result<()> {
        let at = NewSideAt {
            backend: self.core.backend.clone(),
            data_offset: self.core.data_offset,
            head_bytes: 0,
        };
        self.begin_segments_at(new_side, at, done_bytes, backward)
    }

    /// [`Volume::begin_segments`] with the new side where `at` says (a data shift's: on the
    /// device itself at another offset, the old side's backend remapping the moved segment;
    /// the one that moves the data back also keeps its moved segment on the old side until
    /// the end).
    pub fn begin_segments_at(
        &self,
        (new_spec, new_key, new_sector): (CipherSpec, SecretBytes, SectorSize),
        at: NewSideAt,
        done_bytes: u64,
        backward: bool,
    ) -> Result<()> {
        let NewSideAt {
            backend,
            data_offset,
            head_bytes,
        } = at;
        let suspended = lock(&self.core.suspended);
        if *suspended {
            return Err(Error::InvalidArgument(
                "the volume is suspended: resume it first".into(),
            ));
        }
        let c = &*self.core;
        let size = c.size.load(Relaxed);
        let align = (1u64 << c.shift).max(u64::from(new_sector.bytes()));
        if backward && head_bytes != 0 || head_bytes > size || head_bytes % align != 0 {
            return Err(Error::InvalidArgument(format!(
                "a head of {head_bytes} bytes kept on the old side (forward only, whole \
                 {align}-byte sectors, inside the volume)"
            )));
        }
        if done_bytes > size || done_bytes % align != 0 || size % align != 0 {
            return Err(Error::InvalidArgument(format!(
                "reencryption mark {done_bytes} or size {size} is not a boundary of \
                 {align}-byte sectors"
            )));
        }
        if c.segmented.load(Relaxed) {
            return Err(Error::InvalidArgument(if self.reopen_needed() {
                REOPEN_NEEDED.into()
            } else {
                "the volume is already in reencryption".into()
            }));
        }
        let p = self.policy();
        let cfg = VolumeConfig {
            spec: new_spec,
            key: new_key,
            geometry: Geometry {
                sector_size: new_sector,
                ..c.geometry
            },
            data_offset_bytes: data_offset,
            size_bytes: Some(size),
            policy: p,
            pool_bytes: c.pool.capacity(),
            read_only: c.read_only,
            allow_discards: c.allow_discards.load(Relaxed),
            spin: self.spin(),
            idle_release: c.idle_release,
        };
        // The same counters: requests served by either side count as the volume's.
        let new = Volume::with_stats(backend, cfg, c.stats.clone())?;
        let seg = Arc::new(Segments {
            new,
            zones: ZoneLock::default(),
            mark_bytes: AtomicU64::new(0),
            backward,
            head_start: AtomicU64::new(0),
            head_end: head_bytes,
            finished: std::sync::atomic::AtomicBool::new(false),
        });
        seg.mark_bytes.store(seg.mark_of(done_bytes, size), Relaxed);
        if done_bytes == size {
            seg.head_start.store(head_bytes, Relaxed);
        }
        c.gate.close();
        *lock(&self.segments) = Some(seg);
        c.segmented.store(true, Relaxed);
        c.gate.open();
        drop(suspended);
        Ok(())
    }

    /// True while the volume is in reencryption: two segments, the reencryption not ended
    /// (after one that changed the sector size or the data offset, see
    /// [`Volume::reopen_needed`]).
    pub fn in_reencryption(&self) -> bool {
        self.core.segmented.load(Relaxed) && !self.reopen_needed()
    }

    /// True once a reencryption that changed the sector size or the data offset has ended:
    /// the volume serves through the new side until it is closed (see the module
    /// documentation).
    pub fn reopen_needed(&self) -> bool {
        lock(&self.segments)
            .as_ref()
            .is_some_and(|s| s.finished.load(Relaxed))
    }

    /// The encryption sector size and the data offset (bytes on the device) every byte is
    /// served with now: the volume's own, or after a reencryption that changed them (until
    /// the volume is closed, [`Volume::reopen_needed`]) the new side's.
    pub fn serving_layout(&self) -> (SectorSize, u64) {
        match lock(&self.segments).as_ref() {
            Some(s) if s.finished.load(Relaxed) => {
                (s.new.core.geometry.sector_size, s.new.core.data_offset)
            }
            _ => (self.core.geometry.sector_size, self.core.data_offset),
        }
    }

    /// The backend the new side serves from while in reencryption: the device itself, also
    /// when the old side reads through a remapping one (a data shift). The reencryption
    /// driver writes the hotzones and the header there.
    pub fn reencryption_backend(&self) -> Option<Arc<dyn Backend>> {
        lock(&self.segments)
            .as_ref()
            .map(|s| s.new.core.backend.clone())
    }

    /// Bytes under the new key while in reencryption.
    pub fn reencrypted_bytes(&self) -> Option<u64> {
        let size = self.core.size.load(Relaxed);
        lock(&self.segments)
            .as_ref()
            .filter(|s| !s.finished.load(Relaxed))
            .map(|s| s.done_of(s.mark_bytes.load(Relaxed), size))
    }

    /// The direction of the reencryption served, if any: `true` going backward.
    pub fn reencryption_backward(&self) -> Option<bool> {
        lock(&self.segments)
            .as_ref()
            .filter(|s| !s.finished.load(Relaxed))
            .map(|s| s.backward)
    }

    /// Ends the two segments once the rotation has finished (every byte under the new key; the
    /// caller, the reencryption driver, knows): the volume's own engine takes the new key, so
    /// it serves as a plain volume under it again. When the sector size or the data offset
    /// changed, the new side goes on serving every byte instead, until the volume is closed.
    pub fn end_segments(&self) -> Result<()> {
        let _suspended = lock(&self.core.suspended);
        let c = &*self.core;
        let Some(seg) = lock(&self.segments).clone() else {
            return Err(Error::InvalidArgument(
                "the volume is not in reencryption".into(),
            ));
        };
        if seg.finished.load(Relaxed) {
            return Err(Error::InvalidArgument(
                "the volume's reencryption has already ended".into(),
            ));
        }
        if seg.new.core.shift != c.shift || seg.new.core.data_offset != c.data_offset {
            let size = c.size.load(Relaxed);
            c.gate.close();
            seg.mark_bytes.store(seg.mark_of(size, size), Relaxed);
            seg.head_start.store(seg.head_end, Relaxed);
            seg.finished.store(true, Relaxed);
            *lock(&c.spec) = *lock(&seg.new.core.spec);
            c.gate.open();
            return Ok(());
        }
        // A context of the new side's engine, cloned (the key never leaves the engines).
        let proto: SectorCipher = seg.new.core.ciphers.with(|k| k.try_clone())?;
        let spec = *lock(&seg.new.core.spec);
        let null = seg.new.core.null_cipher();
        let out_of_place = proto.crypts_out_of_place();
        let cost = seg.new.core.crypto_ps_per_byte.load(Relaxed);
        c.gate.close();
        c.ciphers.install(proto);
        *lock(&c.spec) = spec;
        // A decryption ends in plaintext, an encryption begins in it: the null cipher's
        // shortcuts and `auto`'s measure of the cipher's cost follow the new side.
        c.null_cipher.store(null, Relaxed);
        c.out_of_place.store(out_of_place, Relaxed);
        c.crypto_ps_per_byte.store(cost, Relaxed);
        c.segmented.store(false, Relaxed);
        let seg = lock(&self.segments).take();
        c.gate.open();
        // The new side's engine (its threads, contexts) goes once no request holds it.
        drop(seg);
        Ok(())
    }

    /// The hotzone `[offset, offset + len)` (plaintext bytes): returns once no request touches
    /// it; new ones wait until [`Volume::release_hotzone`]. Refused while another is held
    /// (busy) or broken.
    pub(crate) fn hold_hotzone(&self, offset: u64, len: u64) -> Result<()> {
        let seg = self.segments()?;
        seg.zones.hold_hotzone(self.zone(offset, len)?)?;
        Ok(())
    }

    /// `[offset, offset + len)` as a range of the volume, refused if it is not one (the
    /// driver's calls come from a worker process).
    fn zone(&self, offset: u64, len: u64) -> Result<ByteRange> {
        let size = self.core.size.load(Relaxed);
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(ByteRange { start: offset, end }),
            _ => Err(Error::InvalidArgument(format!(
                "a hotzone or piece of {len} bytes at {offset} is not inside the volume \
                 ({size} bytes)"
            ))),
        }
    }

    /// The rewrite of `[offset, offset + len)`, a piece of the held hotzone, starts: reads of
    /// it wait from now on too, until [`Volume::hotzone_rewritten`].
    pub(crate) fn hotzone_rewrite(&self, offset: u64, len: u64) -> Result<()> {
        let seg = self.segments()?;
        seg.zones.exclude_reads(self.zone(offset, len)?)?;
        Ok(())
    }

    /// The piece `[offset, offset + len)` is rewritten (its new ciphertext written, not yet
    /// flushed): the mark moves past it (to its end going forward, to its start going
    /// backward; the driver rewrites a hotzone's pieces in that order, so the new side stays
    /// one range), and reads of the piece go on. Writes still wait for the release. (A read of
    /// a written but unflushed piece returns the same plaintext as the old ciphertext it
    /// replaces: a crash then leaves sectors that recovery rewrites to the same plaintext.)
    /// Refused for any other range than the piece being rewritten.
    pub(crate) fn hotzone_rewritten(&self, offset: u64, len: u64) -> Result<()> {
        let seg = self.segments()?;
        let piece = self.zone(offset, len)?;
        seg.zones.allow_reads(piece, || {
            if !seg.backward && offset < seg.head_end {
                // A piece of the head (rewritten in place from its start): it leaves the old
                // side.
                seg.head_start.store(piece.end.min(seg.head_end), Relaxed);
            } else {
                let mark = if seg.backward { piece.start } else { piece.end };
                seg.mark_bytes.store(mark, Relaxed);
            }
        })?;
        Ok(())
    }

    /// `done` bytes are now under the new key; the hotzone is released.
    pub(crate) fn release_hotzone(&self, done: u64) -> Result<()> {
        let seg = self.segments()?;
        let size = self.core.size.load(Relaxed);
        if done > size {
            return Err(Error::InvalidArgument(format!(
                "{done} bytes done of a volume of {size}"
            )));
        }
        seg.zones.release_hotzone(|| {
            seg.mark_bytes.store(seg.mark_of(done, size), Relaxed);
            if done >= size {
                seg.head_start.store(seg.head_end, Relaxed);
            }
        })?;
        Ok(())
    }

    /// The driver failed inside the hotzone: requests touching it fail from now on.
    pub(crate) fn break_hotzone(&self) {
        if let Ok(seg) = self.segments() {
            seg.zones.break_hotzone();
        }
    }

    /// The hotzone held now (`offset`, `len`), if any: one a driver that stopped left.
    pub(crate) fn held_hotzone(&self) -> Option<(u64, u64)> {
        let seg = lock(&self.segments).clone()?;
        seg.zones.held_hotzone().map(|h| (h.start, h.end - h.start))
    }

    /// Holds `[offset, offset + len)` (and the hotzone held now, if any: the two as one)
    /// against every request, reads too, while a hotzone whose driver stopped is recovered
    /// under it; returns once the requests inside have left. Then
    /// [`Volume::release_hotzone`] with the bytes the header says done, or
    /// [`Volume::break_hotzone`].
    pub(crate) fn fence_hotzone(&self, offset: u64, len: u64) -> Result<()> {
        let seg = self.segments()?;
        seg.zones.fence(self.zone(offset, len)?);
        Ok(())
    }

    fn segments(&self) -> Result<Arc<Segments>> {
        lock(&self.segments)
            .clone()
            .ok_or(Error::Bug("segmented request without segments"))
    }

    /// Runs `f` on each side's core for the part of `[offset, offset + len)` it holds (below
    /// the mark the new side going forward, the old one going backward), with the range held
    /// shared against the hotzone. `f` gets the core, the part's offset and its place in the
    /// request's buffer.
    fn seg_run(
        &self,
        offset: u64,
        len: u64,
        write: bool,
        mut f: impl FnMut(&Core, u64, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<()> {
        self.core.check(offset, len)?;
        let seg = self.segments()?;
        let end = offset + len;
        let _held = seg.zones.shared(ByteRange { start: offset, end }, write)?;
        let mark = seg.mark_bytes.load(Relaxed);
        let (old, new) = (&self.core, &seg.new.core);
        if seg.backward {
            let cut = mark.clamp(offset, end);
            if cut > offset {
                f(old, offset, 0..(cut - offset) as usize)?;
            }
            if cut < end || len == 0 {
                f(new, cut, (cut - offset) as usize..len as usize)?;
            }
            return Ok(());
        }
        if len == 0 {
            return f(old, offset, 0..0);
        }
        // Forward: the head's rewritten part, the head's rest, the walk's part done, the rest.
        let head_start = seg.head_start.load(Relaxed);
        let parts = [
            (head_start, new),
            (seg.head_end, old),
            (mark.max(seg.head_end), new),
            (u64::MAX, old),
        ];
        let mut at = offset;
        for (until, core) in parts {
            let stop = until.clamp(at, end);
            if stop > at {
                f(core, at, (at - offset) as usize..(stop - offset) as usize)?;
            }
            at = stop;
        }
        Ok(())
    }

    pub(super) fn seg_read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.seg_run(offset, buf.len() as u64, false, |c, at, r| {
            c.read(&mut buf[r], at)
        })
    }

    pub(super) fn seg_write(
        &self,
        op: Op,
        src: Source<'_>,
        offset: u64,
        len: u64,
        fua: bool,
    ) -> Result<()> {
        self.seg_run(offset, len, true, |c, at, r| {
            let n = r.len() as u64;
            let part = match src {
                Source::Buf(b) => Source::Buf(&b[r]),
                Source::Zeroes => Source::Zeroes,
            };
            c.write(op, part, at, n, fua)
        })
    }

    pub(super) fn seg_discard(&self, offset: u64, len: u64) -> Result<()> {
        self.seg_run(offset, len, true, |c, at, r| c.discard(at, r.len() as u64))
    }
}
