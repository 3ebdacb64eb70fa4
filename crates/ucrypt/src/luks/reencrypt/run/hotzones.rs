//! The hotzone loop: resume a reencryption, protect each hotzone's old data as the resilience
//! says, rewrite it, commit the new segments, and finalise when every byte is done.

use crate::backend::Backend;
use crate::engine::crew::Crew;
use crate::luks::reencrypt::pieces::{pieces, read_summing, rewrite_pieces};
use crate::luks::reencrypt::plan::{
    area_limit, finalise, last_backward_hotzone, position, MovedGuard, Movement, Position, Protect,
    Step,
};
use crate::luks::reencrypt::serving::{Offline, Serving};
use crate::luks::reencrypt::Direction;
use crate::luks::{apply, WriteOp};
use crate::pool::{BufferPool, Grant};
use crate::{Error, Result};

use super::lanes::{
    checksums, read_lanes, read_lanes_summing, read_lanes_then, rekey, rekey_stream, rekey_then,
    write_lanes, Sink,
};
use super::unlock::{open_rotation, Extent, Unlocked};
use super::walk::{self};
use super::wipe_random;
use super::{
    Devices, Progress, RunOptions, AREA_ALIGN_BYTES, HOTZONE_BYTES_DEFAULT, HOTZONE_BYTES_MAX,
    NONE_BUFFER_BYTES,
};

pub(super) fn finish(dev: &dyn Backend, data: &dyn Backend, u: &mut Unlocked) -> Result<()> {
    let retired = finalise(&mut u.h.meta, &u.st)?;
    // A decryption that moved the data back leaves the old ciphertext of its last shift past
    // the plaintext: wiped before the commit, as cryptsetup does. No recovery reads it (the
    // last hotzone, the moved segment's, is rewritten in place), so a crash between the wipe
    // and the commit finalises again on resume.
    if let Movement::Unshift(us) = u.movement {
        wipe_random(std::iter::once((data, us.tail())))?;
        data.flush()?;
    }
    let mut ops = u.h.commit()?;
    ops.push(WriteOp::Sync);
    apply(dev, &ops)?;
    // Then the retired areas (up to the whole reencrypt area, megabytes) get random bytes.
    // A data shift's moved segment (a plaintext copy of the first shift) goes after the
    // commit, unlike cryptsetup, which wipes it first: a crash between its wipe and its
    // commit would leave a header whose last hotzone a resume redoes from wiped bytes. Here a
    // crash between them leaves that copy readable past the data until wiped by hand.
    let areas = retired.areas.iter().map(|a| (dev, *a));
    let data_areas = retired.data_areas.iter().map(|a| (data, *a));
    wipe_random(areas.chain(data_areas))?;
    data.flush()?;
    dev.flush()
}

/// Rewrites the rest of a reencryption [`super::init`] (or cryptsetup) started, hotzone after
/// hotzone, then finalises. `progress` is called after each hotzone. A volume whose metadata
/// was committed inside a hotzone needs [`super::recover`] first (as cryptsetup's `--resume-only`
/// requires `repair`).
pub fn resume(
    dev: &dyn Backend,
    passphrase: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    resume_on(Devices::one(dev), passphrase, opts, progress)
}

/// [`resume`] with the header on its own device (`--header`).
pub fn resume_on(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    resume_serving(devs, passphrase, opts, progress, &mut Offline)
}

/// [`resume_on`] while `serving` serves the data: each hotzone is held from before its read
/// to after its last commit.
pub fn resume_serving(
    devs: Devices<'_>,
    passphrase: &[u8],
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
    serving: &mut dyn Serving,
) -> Result<()> {
    let mut u = open_rotation(
        devs,
        passphrase,
        opts.resilience,
        Extent::Run(opts.device_size),
    )?;
    let pos = position(&u.h.meta, &u.st, u.data_bytes)?;
    if pos.hotzone.is_some() {
        return Err(Error::NeedsRecovery);
    }
    let backward = u.st.keyslot.direction == Direction::Backward;
    let new_key = u.new_key.as_ref().map(|(c, k, ss)| (*c, k.as_ref(), *ss));
    serving.start(new_key, pos.done, backward)?;
    if let Some(n) = serving.rekey_lanes_max() {
        u.lanes.truncate(n.max(1));
    }
    // Set once a hold succeeded (a refused one holds nothing, and nothing of ours is broken
    // on failure then), cleared at the release.
    let mut held = false;
    let r = run_hotzones(devs, &mut u, pos, opts, progress, serving, &mut held);
    if r.is_err() && held {
        serving.failed();
    }
    r
}

/// The buffers a run of hotzones reuses, sized once at its start: one for every hotzone (a
/// backward walk's last one may be longer: it is read twice), one for a hotzone's checksums.
struct Buffers<'p> {
    hot: Grant<'p>,
    sums: Grant<'p>,
    /// The hotzone buffer's length.
    buf_len: u64,
    /// The longest piece read, journalled or rewritten at once (the serving side's choice),
    /// in whole sectors and pages.
    piece_max: u64,
}

/// The pool [`Buffers`] take their buffers from, and the largest hotzone `--hotzone-size`
/// allows: `(pool, hotzone buffer, checksums buffer, largest hotzone)`.
fn size_buffers(
    u: &Unlocked,
    pos: Position,
    opts: &RunOptions,
    serving: &dyn Serving,
) -> Result<(BufferPool, u64, u64, u64)> {
    let hot_max = opts
        .hotzone_bytes
        .unwrap_or(HOTZONE_BYTES_DEFAULT)
        .clamp(1, HOTZONE_BYTES_MAX);
    // A decryption that moves the data rewrites its moved segment in place, whole.
    let in_place_min = match u.movement {
        Movement::Unshift(us) if pos.done <= us.walk_bytes() => us.moved_bytes,
        _ => 0,
    };
    // Offline, a `none` hotzone is read, rekeyed and written a buffer at a time (below, and
    // `walk`): its buffer need not hold it whole.
    let none_cap = match (u.protect, u.movement, serving.serves()) {
        (Protect::None, Movement::InPlace { .. }, false) => NONE_BUFFER_BYTES,
        _ => u64::MAX,
    };
    let buf_len = hot_max
        .min(area_limit(&u.st)?)
        .min(u.data_bytes.saturating_sub(pos.done))
        .min(none_cap)
        .max(u.align)
        .max(in_place_min)
        .div_ceil(crate::pool::POOL_PAGE_BYTES as u64)
        * crate::pool::POOL_PAGE_BYTES as u64;
    // A backward walk's last hotzone may be longer than the buffer (up to a journal area, or
    // up to 1 GiB of checksum blocks: [`last_backward_hotzone`]); it is read twice, below.
    let longest = last_backward_hotzone(&u.st, u.data_bytes, u.align)?.max(buf_len);
    let sums_len = match u.protect {
        Protect::Checksum { hash, block }
        | Protect::Unshift(MovedGuard::Checksum { hash, block }) => {
            (longest / u64::from(block) * hash.output_bytes() as u64).div_ceil(AREA_ALIGN_BYTES)
                * AREA_ALIGN_BYTES
        }
        _ => 0,
    }
    .max(AREA_ALIGN_BYTES);
    let pool = BufferPool::new((buf_len + sums_len) as usize)?;
    Ok((pool, buf_len, sums_len, hot_max))
}

pub(super) fn run_hotzones(
    devs: Devices<'_>,
    u: &mut Unlocked,
    mut pos: Position,
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
    serving: &mut dyn Serving,
    held: &mut bool,
) -> Result<()> {
    let (pool, buf_len, sums_len, hot_max) = size_buffers(u, pos, &opts, serving)?;
    if u.crew.is_none() && u.lanes.len() > 1 {
        // Between steps its threads sleep at once: a busy host's CPU is not spun away.
        let spin = std::time::Duration::ZERO;
        u.crew = Some(Crew::new("ucrypt-rekey", u.lanes.len() - 1, spin)?);
    }
    // The hotzone's pieces: whole sectors and pages (the buffer's O_DIRECT alignment).
    let unit = u.align.max(AREA_ALIGN_BYTES);
    let mut b = Buffers {
        hot: pool.take(buf_len as usize)?,
        sums: pool.take(sums_len as usize)?,
        buf_len,
        piece_max: serving
            .piece_bytes(buf_len)
            .map_or(buf_len, |p| (p / unit).max(1) * unit),
    };
    let total = u.data_bytes;
    let report = |p: &mut dyn FnMut(Progress), done| p(Progress { done, total });
    report(progress, pos.done);
    let mut run_bytes = walk::RUN_BYTES_FIRST;
    loop {
        if !serving.serves() {
            let started = std::time::Instant::now();
            let buf = b.hot.as_mut_slice();
            if let Some(p) = walk::run(devs, u, pos, hot_max, run_bytes, buf)? {
                run_bytes = walk::next_run_bytes(p.done - pos.done, started.elapsed());
                pos = p;
                report(progress, pos.done);
                continue;
            }
        }
        let next = u
            .movement
            .next_hotzone(&u.st, pos, u.data_bytes, hot_max, u.align)?;
        let Some(steps) = next else {
            // Every byte done, but not finalised (left so by a crash or by cryptsetup).
            return finish(devs.header, devs.data, u);
        };
        let mut h = Hotzone::new(&steps, devs, serving, held);
        for step in steps {
            if h.step(u, &mut b, step, &mut pos)? {
                report(progress, u.data_bytes);
                return Ok(());
            }
        }
        report(progress, pos.done);
    }
}

/// One hotzone's steps, performed in order, and what they leave for the next ones.
struct Hotzone<'s, 'd> {
    devs: Devices<'d>,
    serving: &'s mut dyn Serving,
    /// Set once a hold succeeded, cleared at the release (the caller tells a failure to the
    /// serving side only while it holds a hotzone).
    held: &'s mut bool,
    /// The hotzone's length, once read.
    cur: u64,
    /// Its checksums were taken while it was read.
    summed: bool,
    /// Without resilience data nothing needs the hotzone whole in memory before it is
    /// rewritten: its read is left to the rewrite, chunk by chunk ([`rekey_stream`]). No step
    /// between the two writes to the data.
    read_later: bool,
    /// Where its journal goes, if it has one: written while the hotzone is read, each chunk
    /// while it is in the cache.
    journal_area: Option<u64>,
    /// Its journal was written while it was read.
    journaled: bool,
}

impl<'s, 'd> Hotzone<'s, 'd> {
    fn new(
        steps: &[Step],
        devs: Devices<'d>,
        serving: &'s mut dyn Serving,
        held: &'s mut bool,
    ) -> Self {
        let journal_area = steps.iter().find_map(|s| match s {
            Step::WriteJournal { area_offset } => Some(*area_offset),
            _ => None,
        });
        Hotzone {
            devs,
            serving,
            held,
            cur: 0,
            summed: false,
            read_later: false,
            journal_area,
            journaled: false,
        }
    }

    /// Holds `[offset, offset + len)` against writers before it is read.
    fn hold(&mut self, offset: u64, len: u64) -> Result<()> {
        self.cur = len;
        self.serving.hold(offset, len)?;
        *self.held = true;
        Ok(())
    }

    /// Performs `step`; `true` once the reencryption is finalised.
    fn step(
        &mut self,
        u: &mut Unlocked,
        b: &mut Buffers<'_>,
        step: Step,
        pos: &mut Position,
    ) -> Result<bool> {
        let devs = self.devs;
        match step {
            // Without resilience data, read later by the rewrite, a buffer at a time offline
            // (the buffer may be shorter than the hotzone: `NONE_BUFFER_BYTES`).
            Step::ReadOld { offset, len }
                if matches!(u.protect, Protect::None)
                    && (len <= b.piece_max || !self.serving.serves()) =>
            {
                self.hold(offset, len)?;
                self.read_later = true;
            }
            Step::ReadOld { offset, len } if len > b.buf_len => {
                self.hold(offset, len)?;
                self.read_longer(u, b, offset, len)?;
            }
            Step::ReadOld { offset, len } => {
                self.hold(offset, len)?;
                self.read_old(u, b, offset, len)?;
            }
            Step::ReadAt { from, offset, len } => {
                self.hold(offset, len)?;
                let buf = &mut b.hot.as_mut_slice()[..len as usize];
                read_lanes(devs.data, buf, from, u.spread())?;
            }
            Step::WriteChecksums {
                area_offset,
                block,
                hash,
            } => {
                let hb = hash.output_bytes();
                let n = (self.cur / u64::from(block)) as usize;
                let out = b.sums.as_mut_slice();
                if !self.summed {
                    let data = &b.hot.as_mut_slice()[..self.cur as usize];
                    checksums(data, block as usize, hash, out, u.spread())?;
                }
                let len = ((n * hb) as u64).div_ceil(AREA_ALIGN_BYTES) * AREA_ALIGN_BYTES;
                out[n * hb..len as usize].fill(0);
                devs.header.write_at(&out[..len as usize], area_offset)?;
            }
            Step::WriteJournal { .. } if self.journaled => self.journaled = false,
            Step::WriteJournal { area_offset } => {
                let buf = &b.hot.as_mut_slice()[..self.cur as usize];
                for r in pieces(self.cur, b.piece_max) {
                    let at = area_offset + r.start as u64;
                    write_lanes(devs.header, &buf[r], at, u.spread())?;
                }
            }
            Step::SyncData => devs.flush()?,
            Step::CommitSegments(p) => {
                u.commit(devs.header, p)?;
                *pos = p;
                if p.hotzone.is_none() {
                    *self.held = false;
                    self.serving.release(p.done)?;
                }
            }
            Step::MoveNew { from, offset, len } => {
                self.serving.hold(offset, len)?;
                *self.held = true;
                self.serving.rewrite(offset, len)?;
                move_new(devs.data, u, from, offset, len, b.hot.as_mut_slice())?;
            }
            Step::WriteNew { offset, len } => self.write_new(u, b, offset, len)?,
            Step::Finalise => {
                finish(devs.header, devs.data, u)?;
                *self.held = false;
                self.serving.release(u.data_bytes)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A hotzone longer than the buffer: read for its resilience data (checksums or journal)
    /// a buffer at a time, and read again for its rewrite ([`Hotzone::read_later`]).
    fn read_longer(
        &mut self,
        u: &mut Unlocked,
        b: &mut Buffers<'_>,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let devs = self.devs;
        let at = u.data_offset + offset;
        let buf = b.hot.as_mut_slice();
        let lanes = u.spread();
        for r in pieces(len, b.buf_len) {
            let (chunk, a) = (&mut buf[..r.len()], at + r.start as u64);
            match (u.protect, self.journal_area) {
                (Protect::Checksum { hash, block }, _) => {
                    let hb = hash.output_bytes();
                    let out = &mut b.sums.as_mut_slice()[r.start / block as usize * hb..];
                    read_lanes_summing(devs.data, chunk, a, lanes, (hash, block as usize), out)?;
                    self.summed = true;
                }
                (Protect::Journal, Some(area)) => {
                    let area = area + r.start as u64;
                    let journal = |o: u64, c: &[u8]| devs.header.write_at(c, area + o);
                    let journal = Sink::to(devs.header, &journal);
                    read_lanes_then(devs.data, chunk, a, lanes, journal)?;
                    self.journaled = true;
                }
                _ => {
                    return Err(Error::Bug(
                        "a hotzone longer than the buffer without a journal or checksums",
                    ))
                }
            }
        }
        self.read_later = true;
        Ok(())
    }

    /// A hotzone read whole into the buffer, its resilience data taken as it is read where
    /// the protection allows.
    fn read_old(
        &mut self,
        u: &mut Unlocked,
        b: &mut Buffers<'_>,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let devs = self.devs;
        let buf = &mut b.hot.as_mut_slice()[..len as usize];
        let at = u.data_offset + offset;
        self.summed = false;
        match u.protect {
            // In pieces: the checksums of each piece are taken while the next one is read.
            Protect::Checksum { hash, block }
                if len > b.piece_max && b.piece_max % u64::from(block) == 0 =>
            {
                let block = block as usize;
                let sums = b.sums.as_mut_slice();
                read_summing(devs.data, buf, at, b.piece_max, block, hash, sums)?;
                self.summed = true;
            }
            // Offline: the checksums taken as the hotzone is read, on every lane.
            Protect::Checksum { hash, block }
                if AREA_ALIGN_BYTES % u64::from(block) == 0 && len % u64::from(block) == 0 =>
            {
                let sums = b.sums.as_mut_slice();
                let how = (hash, block as usize);
                read_lanes_summing(devs.data, buf, at, u.spread(), how, sums)?;
                self.summed = true;
            }
            // The journal's copy written as the hotzone is read.
            Protect::Journal if len <= b.piece_max && self.journal_area.is_some() => {
                let area = self.journal_area.expect("tested in the guard");
                let journal = |o: u64, c: &[u8]| devs.header.write_at(c, area + o);
                let journal = Sink::to(devs.header, &journal);
                read_lanes_then(devs.data, buf, at, u.spread(), journal)?;
                self.journaled = true;
            }
            _ => {
                for r in pieces(len, b.piece_max) {
                    let a = at + r.start as u64;
                    read_lanes(devs.data, &mut buf[r], a, u.spread())?;
                }
            }
        }
        Ok(())
    }

    /// The hotzone rekeyed and written at the new data offset: streamed from the device when
    /// it was read later, in pieces when longer than a piece, else at once.
    fn write_new(
        &mut self,
        u: &mut Unlocked,
        b: &mut Buffers<'_>,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let devs = self.devs;
        if self.read_later {
            assert!(
                len <= self.cur,
                "the rewrite stays inside the hotzone read later"
            );
            self.read_later = false;
            self.serving.rewrite(offset, len)?;
            let (from, to) = (u.data_offset, u.new_offset);
            // Each chunk is read, then written where it was: nothing read later was
            // overwritten before.
            assert_eq!(from, to, "a hotzone read later is rewritten in place");
            for r in pieces(len, b.buf_len) {
                rekey_stream(
                    u,
                    offset + r.start as u64,
                    &mut b.hot.as_mut_slice()[..r.len()],
                    &|at, c| devs.data.read_exact_at(c, from + at),
                    Sink::to(devs.data, &|at, c| devs.data.write_at(c, to + at)),
                )?;
            }
            return self.serving.rewritten(offset, len);
        }
        let buf = &mut b.hot.as_mut_slice()[..len as usize];
        let base = u.new_offset;
        if len > b.piece_max {
            let backward = u.st.keyslot.direction == Direction::Backward;
            let rekey = &mut |at, c: &mut [u8]| rekey(u, at, c);
            return rewrite_pieces(
                devs.data,
                base,
                offset,
                buf,
                b.piece_max,
                backward,
                self.serving,
                rekey,
            );
        }
        self.serving.rewrite(offset, len)?;
        let write = |at, c: &[u8]| devs.data.write_at(c, base + at);
        rekey_then(u, offset, buf, Sink::to(devs.data, &write))?;
        self.serving.rewritten(offset, len)
    }
}

/// A data shift's hotzone ([`Step::MoveNew`]): the plaintext at `from` read, encrypted for
/// data offset `offset` and written at the new data offset, in pieces of `buf` (the one
/// hotzone buffer: a hotzone of the shift may be larger). Source and target never overlap,
/// so the pieces' order does not matter, and a crash anywhere is recovered by doing it again.
pub(super) fn move_new(
    data: &dyn Backend,
    u: &mut Unlocked,
    from: u64,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> Result<()> {
    let piece = (buf.len() as u64 / u.align * u.align).min(len);
    if piece == 0 {
        return Err(Error::Bug("hotzone buffer smaller than a sector"));
    }
    let base = u.new_offset;
    let mut at = 0;
    while at < len {
        let n = piece.min(len - at) as usize;
        let b = &mut buf[..n];
        // Source and target do not overlap: each chunk is read, encrypted and written while
        // it is in the cache.
        let src = from + at;
        let start = offset + at;
        rekey_stream(
            u,
            start,
            b,
            &|o, c| data.read_exact_at(c, src + (o - start)),
            Sink::to(data, &|o, p| data.write_at(p, base + o)),
        )?;
        at += n as u64;
    }
    Ok(())
}
