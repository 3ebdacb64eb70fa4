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
use crate::luks::util::Noise;
use crate::luks::{apply, WriteOp};
use crate::pool::BufferPool;
use crate::{Error, Result};

use super::lanes::{
    checksums, read_lanes, read_lanes_summing, read_lanes_then, rekey, rekey_stream, rekey_then,
    write_lanes, Sink,
};
use super::unlock::{open_rotation, Unlocked};
use super::walk::{self};
use super::{
    Devices, Progress, RunOptions, AREA_ALIGN_BYTES, HOTZONE_BYTES_DEFAULT, HOTZONE_BYTES_MAX,
    NONE_BUFFER_BYTES, WIPE_PIECE_BYTES,
};

/// Commits the segments of `pos`: the header says the reencryption is there.
pub(super) fn commit(dev: &dyn Backend, u: &mut Unlocked, pos: Position) -> Result<()> {
    u.movement
        .set_segments(&mut u.h.meta, &mut u.st, pos, u.data_bytes)?;
    let ops = u.h.commit()?;
    apply(dev, &ops)
}

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

/// Writes random bytes ([`Noise`]) over each (device, (offset, length)), a bounded piece
/// ([`WIPE_PIECE_BYTES`]) at a time from one page-aligned buffer (the pool's, as a device
/// opened with O_DIRECT needs: the `open` daemon's is). No flush.
pub(super) fn wipe_random<'a>(
    ranges: impl Iterator<Item = (&'a dyn Backend, (u64, u64))> + Clone,
) -> Result<()> {
    let Some(longest) = ranges.clone().map(|(_, a)| a.1).max() else {
        return Ok(());
    };
    let piece = WIPE_PIECE_BYTES.min(longest).max(AREA_ALIGN_BYTES) as usize;
    let pool = BufferPool::new(piece)?;
    let mut g = pool.take(piece)?;
    let buf = g.as_mut_slice();
    let mut noise = Noise::new()?;
    for (d, (offset, len)) in ranges {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            noise.fill(&mut buf[..n])?;
            d.write_at(&buf[..n], offset + at)?;
            at += n as u64;
        }
    }
    Ok(())
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
    let mut u = open_rotation(devs, passphrase, opts.resilience)?;
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

pub(super) fn run_hotzones(
    devs: Devices<'_>,
    u: &mut Unlocked,
    mut pos: Position,
    opts: RunOptions,
    progress: &mut dyn FnMut(Progress),
    serving: &mut dyn Serving,
    held: &mut bool,
) -> Result<()> {
    let hot_max = opts
        .hotzone_bytes
        .unwrap_or(HOTZONE_BYTES_DEFAULT)
        .clamp(1, HOTZONE_BYTES_MAX);
    // One buffer for every hotzone, and one for the checksums of a hotzone.
    // A decryption that moves the data rewrites its moved segment in place, whole.
    let in_place_min = match u.movement {
        Movement::Unshift(us) if pos.done <= us.walk_bytes() => us.moved_bytes,
        _ => 0,
    };
    // Offline, a `none` hotzone is read, rekeyed and written a buffer at a time (below, and
    // `walk`): its buffer need not hold it whole.
    let none_cap = match (u.protect, u.movement, serving.serves()) {
        (Protect::None, Movement::InPlace, false) => NONE_BUFFER_BYTES,
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
    };
    let pool = BufferPool::new((buf_len + sums_len.max(AREA_ALIGN_BYTES)) as usize)?;
    if u.crew.is_none() && u.lanes.len() > 1 {
        // Between steps its threads sleep at once: a busy host's CPU is not spun away.
        let spin = std::time::Duration::ZERO;
        u.crew = Some(Crew::new("ucrypt-rekey", u.lanes.len() - 1, spin)?);
    }
    let mut hot = pool.take(buf_len as usize)?;
    let mut sums = pool.take(sums_len.max(AREA_ALIGN_BYTES) as usize)?;
    // The hotzone's pieces: whole sectors and pages (the buffer's O_DIRECT alignment).
    let unit = u.align.max(AREA_ALIGN_BYTES);
    let piece_max = serving
        .piece_bytes(buf_len)
        .map_or(buf_len, |p| (p / unit).max(1) * unit);
    progress(Progress {
        done: pos.done,
        total: u.data_bytes,
    });
    let mut run_bytes = walk::RUN_BYTES_FIRST;
    loop {
        if !serving.serves() {
            let started = std::time::Instant::now();
            if let Some(p) = walk::run(devs, u, pos, hot_max, run_bytes, hot.as_mut_slice())? {
                run_bytes = walk::next_run_bytes(p.done - pos.done, started.elapsed());
                pos = p;
                progress(Progress {
                    done: pos.done,
                    total: u.data_bytes,
                });
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
        let mut cur = 0u64;
        // The checksums of the hotzone were taken while it was read.
        let mut summed = false;
        // Without resilience data nothing needs the hotzone whole in memory before it is
        // rewritten: its read is left to the rewrite, chunk by chunk ([`rekey_stream`]). No
        // step between the two writes to the data.
        let mut read_later = false;
        // Where this hotzone's journal goes, if it has one: written while the hotzone is
        // read, each chunk while it is in the cache.
        let journal_area = steps.iter().find_map(|s| match s {
            Step::WriteJournal { area_offset } => Some(*area_offset),
            _ => None,
        });
        let mut journaled = false;
        for step in steps {
            match step {
                // Without resilience data, read later by the rewrite, a buffer at a time
                // offline (the buffer may be shorter than the hotzone: `NONE_BUFFER_BYTES`).
                Step::ReadOld { offset, len }
                    if matches!(u.protect, Protect::None)
                        && (len <= piece_max || !serving.serves()) =>
                {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    read_later = true;
                }
                // Longer than the buffer: read for its resilience data (checksums or journal)
                // a buffer at a time, and read again for its rewrite (`read_later`).
                Step::ReadOld { offset, len } if len > buf_len => {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    let at = u.data_offset + offset;
                    let buf = hot.as_mut_slice();
                    let lanes = u.spread();
                    for r in pieces(len, buf_len) {
                        let (b, a) = (&mut buf[..r.len()], at + r.start as u64);
                        match (u.protect, journal_area) {
                            (Protect::Checksum { hash, block }, _) => {
                                let hb = hash.output_bytes();
                                let out = &mut sums.as_mut_slice()[r.start / block as usize * hb..];
                                read_lanes_summing(
                                    devs.data,
                                    b,
                                    a,
                                    lanes,
                                    (hash, block as usize),
                                    out,
                                )?;
                                summed = true;
                            }
                            (Protect::Journal, Some(area)) => {
                                let area = area + r.start as u64;
                                let journal = |o: u64, c: &[u8]| devs.header.write_at(c, area + o);
                                let journal = Sink::to(devs.header, &journal);
                                read_lanes_then(devs.data, b, a, lanes, journal)?;
                                journaled = true;
                            }
                            _ => return Err(Error::Bug(
                                "a hotzone longer than the buffer without a journal or checksums",
                            )),
                        }
                    }
                    read_later = true;
                }
                Step::ReadOld { offset, len } => {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    let buf = &mut hot.as_mut_slice()[..len as usize];
                    let at = u.data_offset + offset;
                    summed = false;
                    match u.protect {
                        // In pieces: the checksums of each piece are taken while the next one
                        // is read.
                        Protect::Checksum { hash, block }
                            if len > piece_max && piece_max % u64::from(block) == 0 =>
                        {
                            let block = block as usize;
                            let sums = sums.as_mut_slice();
                            read_summing(devs.data, buf, at, piece_max, block, hash, sums)?;
                            summed = true;
                        }
                        // Offline: the checksums taken as the hotzone is read, on every lane.
                        Protect::Checksum { hash, block }
                            if AREA_ALIGN_BYTES % u64::from(block) == 0
                                && len % u64::from(block) == 0 =>
                        {
                            let sums = sums.as_mut_slice();
                            let how = (hash, block as usize);
                            read_lanes_summing(devs.data, buf, at, u.spread(), how, sums)?;
                            summed = true;
                        }
                        // The journal's copy written as the hotzone is read.
                        Protect::Journal if len <= piece_max && journal_area.is_some() => {
                            let area = journal_area.expect("tested in the guard");
                            let journal = |o: u64, b: &[u8]| devs.header.write_at(b, area + o);
                            let journal = Sink::to(devs.header, &journal);
                            read_lanes_then(devs.data, buf, at, u.spread(), journal)?;
                            journaled = true;
                        }
                        _ => {
                            for r in pieces(len, piece_max) {
                                let a = at + r.start as u64;
                                read_lanes(devs.data, &mut buf[r], a, u.spread())?;
                            }
                        }
                    }
                }
                Step::ReadAt { from, offset, len } => {
                    cur = len;
                    serving.hold(offset, len)?;
                    *held = true;
                    read_lanes(
                        devs.data,
                        &mut hot.as_mut_slice()[..len as usize],
                        from,
                        u.spread(),
                    )?;
                }
                Step::WriteChecksums {
                    area_offset,
                    block,
                    hash,
                } => {
                    let hb = hash.output_bytes();
                    let n = (cur / u64::from(block)) as usize;
                    let out = sums.as_mut_slice();
                    if !summed {
                        let data = &hot.as_mut_slice()[..cur as usize];
                        checksums(data, block as usize, hash, out, u.spread())?;
                    }
                    let len = ((n * hb) as u64).div_ceil(AREA_ALIGN_BYTES) * AREA_ALIGN_BYTES;
                    out[n * hb..len as usize].fill(0);
                    devs.header.write_at(&out[..len as usize], area_offset)?;
                }
                Step::WriteJournal { .. } if journaled => journaled = false,
                Step::WriteJournal { area_offset } => {
                    let buf = &hot.as_mut_slice()[..cur as usize];
                    for r in pieces(cur, piece_max) {
                        let at = area_offset + r.start as u64;
                        write_lanes(devs.header, &buf[r], at, u.spread())?;
                    }
                }
                Step::SyncData => devs.flush()?,
                Step::CommitSegments(p) => {
                    commit(devs.header, u, p)?;
                    pos = p;
                    if p.hotzone.is_none() {
                        *held = false;
                        serving.release(p.done)?;
                    }
                }
                Step::MoveNew { from, offset, len } => {
                    serving.hold(offset, len)?;
                    *held = true;
                    serving.rewrite(offset, len)?;
                    move_new(devs.data, u, from, offset, len, hot.as_mut_slice())?;
                }
                Step::WriteNew { offset, len } if read_later => {
                    assert!(
                        len <= cur,
                        "the rewrite stays inside the hotzone read later"
                    );
                    read_later = false;
                    serving.rewrite(offset, len)?;
                    let (from, to) = (u.data_offset, u.new_offset);
                    // Each chunk is read, then written where it was: nothing read later was
                    // overwritten before.
                    assert_eq!(from, to, "a hotzone read later is rewritten in place");
                    for r in pieces(len, buf_len) {
                        rekey_stream(
                            u,
                            offset + r.start as u64,
                            &mut hot.as_mut_slice()[..r.len()],
                            &|at, b| devs.data.read_exact_at(b, from + at),
                            Sink::to(devs.data, &|at, b| devs.data.write_at(b, to + at)),
                        )?;
                    }
                    serving.rewritten(offset, len)?;
                }
                Step::WriteNew { offset, len } if len > piece_max => {
                    let buf = &mut hot.as_mut_slice()[..len as usize];
                    let base = u.new_offset;
                    let backward = u.st.keyslot.direction == Direction::Backward;
                    let rekey = &mut |at, b: &mut [u8]| rekey(u, at, b);
                    rewrite_pieces(
                        devs.data, base, offset, buf, piece_max, backward, serving, rekey,
                    )?;
                }
                Step::WriteNew { offset, len } => {
                    serving.rewrite(offset, len)?;
                    let buf = &mut hot.as_mut_slice()[..len as usize];
                    let base = u.new_offset;
                    let write = |at, b: &[u8]| devs.data.write_at(b, base + at);
                    rekey_then(u, offset, buf, Sink::to(devs.data, &write))?;
                    serving.rewritten(offset, len)?;
                }
                Step::Finalise => {
                    finish(devs.header, devs.data, u)?;
                    *held = false;
                    serving.release(u.data_bytes)?;
                    progress(Progress {
                        done: u.data_bytes,
                        total: u.data_bytes,
                    });
                    return Ok(());
                }
            }
        }
        progress(Progress {
            done: pos.done,
            total: u.data_bytes,
        });
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
