//! Recovering the hotzone a crash interrupted (cryptsetup's `repair` of a reencryption): from
//! the checksums, the journal or the data shift, as the reencrypt keyslot records them.

use crate::backend::Backend;
use crate::luks::read_area;
use crate::luks::reencrypt::plan::{
    area_limit, hotzone_offset, position, shift_source, MovedGuard, Movement, Position, Protect,
};
use crate::pool::BufferPool;
use crate::{Error, Result};

use super::hotzones::{finish, move_new};
use super::lanes::rekey;
use super::unlock::{open_rotation, Extent, Unlocked};
use super::{bad, Devices, HOTZONE_BYTES_DEFAULT};

/// What [`recover`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// The metadata was not inside a hotzone: nothing to do.
    NotNeeded,
    /// The hotzone (offset, length) was brought to its new form from the resilience data
    /// (for `none`: taken as written, as cryptsetup does; its data may be lost).
    Recovered { offset: u64, len: u64 },
}

/// Recovers a hotzone the metadata was committed inside (a crash between the hotzone's two
/// commits), as cryptsetup's `repair` does: `checksum` rewrites each block whose bytes still
/// hash to the stored old checksum; `journal` rewrites the whole hotzone from the stored copy
/// of its old bytes; `none` has nothing to recover from. Then the boundary is committed past
/// the hotzone.
pub fn recover(dev: &dyn Backend, passphrase: &[u8]) -> Result<Recovery> {
    recover_on(Devices::one(dev), passphrase)
}

/// [`recover`] with the header on its own device (`--header`).
pub fn recover_on(devs: Devices<'_>, passphrase: &[u8]) -> Result<Recovery> {
    prepare_recovery(devs, passphrase)?.run()
}

/// A reencryption opened for [`recover_on`], its keys unlocked and its position read, before
/// anything is written: [`recover_on`] in two steps, so that a volume served meanwhile can
/// hold the hotzone against its requests between them (`online::recover_stopped`,
/// after an online rotation's driver stopped inside a hotzone).
pub(crate) struct PendingRecovery<'a> {
    pub(super) devs: Devices<'a>,
    pub(super) u: Unlocked,
    pub(super) pos: Position,
    /// The hotzone the metadata was committed inside, `(offset, len)` in bytes of the data.
    pub(super) hotzone: Option<(u64, u64)>,
}

/// Opens the reencryption on `devs` for recovery: [`PendingRecovery::run`] recovers it.
pub(crate) fn prepare_recovery<'a>(
    devs: Devices<'a>,
    passphrase: &[u8],
) -> Result<PendingRecovery<'a>> {
    let u = open_rotation(devs, passphrase, None, Extent::Header)?;
    let pos = position(&u.h.meta, &u.st, u.data_bytes)?;
    let hotzone = match pos.hotzone {
        None => None,
        Some(len) => {
            let offset = match u.movement {
                Movement::Unshift(us) => us.hotzone_offset(pos.done),
                Movement::InPlace { .. } | Movement::Shift(_) | Movement::Relocate(_) => {
                    hotzone_offset(&u.st, pos, len, u.data_bytes)
                }
            };
            if len % u.align != 0 || len > area_limit(&u.st)? {
                return Err(bad(format!(
                    "hotzone of {len} bytes does not fit its resilience data"
                )));
            }
            Some((offset, len))
        }
    };
    Ok(PendingRecovery {
        devs,
        u,
        pos,
        hotzone,
    })
}

impl PendingRecovery<'_> {
    /// The hotzone the metadata was committed inside, `(offset, len)` in bytes of the data;
    /// `None`: nothing to recover.
    pub(crate) fn hotzone(&self) -> Option<(u64, u64)> {
        self.hotzone
    }

    /// Whether the hotzone has no resilience data (`none`): its recovery takes it as
    /// rewritten, as cryptsetup's does, whatever was rewritten of it.
    pub(crate) fn without_resilience(&self) -> bool {
        matches!(self.u.protect, Protect::None)
    }

    /// The bytes done once [`PendingRecovery::run`] has run, and whether that is all of them
    /// (the header finalised).
    pub(crate) fn done_after(&self) -> (u64, bool) {
        let done = self.pos.done + self.hotzone.map_or(0, |(_, len)| len);
        (done, done >= self.u.data_bytes)
    }

    /// Recovers the hotzone, if any, and commits the boundary past it (finalises after the
    /// last one).
    pub(crate) fn run(self) -> Result<Recovery> {
        let PendingRecovery {
            devs,
            mut u,
            pos,
            hotzone,
        } = self;
        let Some((offset, len)) = hotzone else {
            return Ok(Recovery::NotNeeded);
        };
        recover_hotzone(devs, &mut u, pos, offset, len)
    }
}

/// Brings the hotzone `[offset, offset + len)` the metadata was committed inside (at `pos`)
/// to its new form from the resilience data, then commits past it.
pub(super) fn recover_hotzone(
    devs: Devices<'_>,
    u: &mut Unlocked,
    pos: Position,
    offset: u64,
    len: u64,
) -> Result<Recovery> {
    let (hdr_dev, data_dev) = (devs.header, devs.data);
    let moved_from = match u.movement {
        Movement::Shift(sh) => Some(shift_source(&sh, offset)),
        Movement::Relocate(r) => Some(r.source(offset)),
        Movement::InPlace { .. } | Movement::Unshift(_) => None,
    };
    if let Some(from) = moved_from {
        // The hotzone's source is intact (nothing writes it before the hotzone is committed
        // done): move it again, as cryptsetup's datashift recovery does.
        let piece = len
            .min(HOTZONE_BYTES_DEFAULT)
            .max(u.align)
            .div_ceil(crate::pool::POOL_PAGE_BYTES as u64)
            * crate::pool::POOL_PAGE_BYTES as u64;
        let pool = BufferPool::new(piece as usize)?;
        let mut g = pool.take(piece as usize)?;
        move_new(data_dev, u, from, offset, len, g.as_mut_slice())?;
        drop(g);
        return finish_recovery(devs, u, pos, offset, len);
    }
    if let (Movement::Unshift(us), true) = (u.movement, offset > 0) {
        // A hotzone of the walk: its ciphertext at the old place is intact (the hotzone is
        // at most the shift, so nothing written overlaps it): decrypt and move it again, as
        // cryptsetup's datashift recovery does. The moved segment's (offset 0) is rewritten
        // in place, from its checksums, below.
        let piece = len
            .min(HOTZONE_BYTES_DEFAULT)
            .max(u.align)
            .div_ceil(crate::pool::POOL_PAGE_BYTES as u64)
            * crate::pool::POOL_PAGE_BYTES as u64;
        let pool = BufferPool::new(piece as usize)?;
        let mut g = pool.take(piece as usize)?;
        move_new(
            data_dev,
            u,
            us.source(offset),
            offset,
            len,
            g.as_mut_slice(),
        )?;
        drop(g);
        return finish_recovery(devs, u, pos, offset, len);
    }
    let area = u.st.keyslot.area_offset;
    let pool = BufferPool::new(len.max(u.align) as usize)?;
    let mut g = pool.take(len as usize)?;
    let buf = g.as_mut_slice();
    // The hotzone's place: where its old data is and its new data goes (the same for a
    // reencryption in place; the moved segment of a decryption that moves the data lies at
    // the new data offset).
    let place = u.new_offset + offset;
    match u.protect {
        Protect::None => {}
        Protect::Datashift => return Err(Error::Bug("datashift recovered above")),
        Protect::Journal | Protect::Unshift(MovedGuard::Journal) => {
            hdr_dev.read_exact_at(buf, area)?;
            rekey(u, offset, buf)?;
            data_dev.write_at(buf, place)?;
        }
        Protect::Checksum { hash, block }
        | Protect::Unshift(MovedGuard::Checksum { hash, block }) => {
            let hb = hash.output_bytes();
            let block = u64::from(block);
            let n = (len / block) as usize;
            let sums = read_area(hdr_dev, area, (n * hb) as u64)?;
            data_dev.read_exact_at(buf, place)?;
            for i in 0..n {
                let at = i * block as usize;
                let chunk = &mut buf[at..at + block as usize];
                if hash.digest(&[chunk]) == sums[i * hb..(i + 1) * hb] {
                    let o = offset + at as u64;
                    rekey(u, o, chunk)?;
                    data_dev.write_at(chunk, u.new_offset + o)?;
                }
            }
        }
    }
    drop(g);
    finish_recovery(devs, u, pos, offset, len)
}

/// After a recovered hotzone: flush, then commit the boundary past it (finalise after the
/// last one).
pub(super) fn finish_recovery(
    devs: Devices<'_>,
    u: &mut Unlocked,
    pos: Position,
    offset: u64,
    len: u64,
) -> Result<Recovery> {
    devs.flush()?;
    let after = Position {
        done: pos.done + len,
        hotzone: None,
    };
    if after.done >= u.data_bytes {
        finish(devs.header, devs.data, u)?;
    } else {
        u.commit(devs.header, after)?;
    }
    Ok(Recovery::Recovered { offset, len })
}
