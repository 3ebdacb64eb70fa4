//! Offline hotzones run back to back: no lane waits at the order points between them.
//!
//! The protocol orders each hotzone's writes after a commit: a `none` hotzone is written only
//! once it is committed as the hotzone, and a data shift's hotzone also only once the one
//! before it in the walk is flushed and committed done (its target is that one's source).
//! Reads and crypto have no such order: the next hotzone's source is not written before the
//! next hotzone itself. Run one hotzone at a time, every lane waits at each hotzone's end for
//! the slowest one and for the flush and commits, and beside busy threads a lane that waits
//! gives its CPU away and waits again to get it back.
//!
//! Here a run of hotzones is one list of tasks in the walk's order (a [`Plan`]), each a chunk
//! of at most [`LANE_CHUNK_BYTES`] to read, rekey and write. The tasks come in stages, one per
//! hotzone; after a stage's writes come a flush and the commits that open the next stage
//! (this hotzone done, the next one the hotzone). The lanes claim the tasks in order into a
//! ring of chunk slots (the hotzone buffer), read and rekey each, and write it at once if its
//! stage is open, else leave it parked in its slot. Whoever writes a stage's last chunk
//! flushes, commits, opens the next stage and writes the chunks parked for it. So what
//! reaches the device is in the protocol's order, and a crash anywhere leaves what the
//! one-hotzone-at-a-time loop can leave: the last commit names the hotzone being written, and
//! its source is intact. A lane waits only when the next chunk's slot still holds a chunk not
//! written (the ring is full of chunks parked for the next stage), and is woken only when that
//! slot is freed; parked chunks are written oldest first, so it is freed first. (Waking the
//! lanes at every write instead would only add context switches and sleeps in the claim.)
//!
//! Not for a journal: its rewrite rekeys each chunk in place after the chunk's copy is
//! written, and lanes that run ahead then wait for those copies chunk by chunk: beside busy
//! threads they sleep far more often than in the step loop, for no gain. Not for checksums, nor
//! for the decryption that moves the data back, nor for a volume served meanwhile, which
//! holds and releases each hotzone ([`Serving::hold`](super::Serving::hold)).

use std::sync::Mutex;
use std::time::Duration;

use super::lanes::rekey_chunk;
use super::unlock::{Lane, Unlocked};
use super::{Devices, LANE_CHUNK_BYTES};
use crate::luks::reencrypt::plan::Movement;
use crate::luks::reencrypt::plan::{Position, Protect, Step};
use crate::sync::{lock, TakeTurns, WaitCell};
use crate::{Error, Result};

/// About how long a run of hotzones lasts: progress is reported between runs.
const RUN_TIME: Duration = Duration::from_millis(250);
/// The bytes of the first run, before a rate was measured.
pub(super) const RUN_BYTES_FIRST: u64 = 64 << 20;
/// Bounds of a run's bytes.
const RUN_BYTES_MIN: u64 = 16 << 20;
const RUN_BYTES_MAX: u64 = 4 << 30;

/// A chunk: its stage, its data offset (for the crypto's sector numbers), its bytes, where
/// it is read and where written (on the data device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Task {
    stage: usize,
    offset: u64,
    len: usize,
    from: u64,
    to: u64,
}

/// A stage: its tasks' count, and the commits after they are written and flushed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stage {
    tasks: usize,
    commits: Vec<Position>,
}

/// A run of hotzones: the commit before its first stage may write, its tasks in claim order
/// (a stage's tasks together, the stages in order), its stages, and the position after it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    first: Option<Position>,
    tasks: Vec<Task>,
    stages: Vec<Stage>,
    end: Position,
}

/// The chunks of `[offset, offset + len)`, `chunk` bytes at a time.
fn cut(offset: u64, len: u64, chunk: usize) -> impl Iterator<Item = (u64, usize)> {
    (0..len)
        .step_by(chunk)
        .map(move |at| (offset + at, (chunk as u64).min(len - at) as usize))
}

/// The hotzones after `pos` that make up a run of about `bytes` (two at least), in chunks of
/// `chunk`; `None` when fewer than two hotzones are left before the last (which finalises and
/// is left to the one-hotzone-at-a-time loop), or the rotation is not a `none` one or a data
/// shift (module docs).
fn plan(
    u: &Unlocked,
    pos: Position,
    hot_max: u64,
    bytes: u64,
    chunk: usize,
) -> Result<Option<Plan>> {
    match (u.protect, u.movement) {
        (Protect::None, Movement::InPlace { .. })
        | (Protect::Datashift, Movement::Shift(_) | Movement::Relocate(_)) => {}
        _ => return Ok(None),
    }
    let mut p = Plan {
        first: None,
        tasks: Vec::new(),
        stages: Vec::new(),
        end: pos,
    };
    let (mut total, mut hotzones) = (0u64, 0);
    while total < bytes || hotzones < 2 {
        let at = p.end;
        let steps = u
            .movement
            .next_hotzone(&u.st, at, u.data_bytes, hot_max, u.align)?;
        let Some(steps) = steps else {
            break;
        };
        let (offset, len, from, hot, done) = match steps[..] {
            [Step::CommitSegments(h), Step::MoveNew { from, offset, len }, Step::SyncData, Step::CommitSegments(d)] => {
                (offset, len, from, h, d)
            }
            [Step::ReadOld { offset, len }, Step::CommitSegments(h), Step::WriteNew {
                offset: o2,
                len: l2,
            }, Step::SyncData, Step::CommitSegments(d)]
                if (o2, l2) == (offset, len) =>
            {
                (offset, len, u.data_offset + offset, h, d)
            }
            // The last hotzone (it finalises).
            _ => break,
        };
        let want_hot = Position {
            done: at.done,
            hotzone: Some(len),
        };
        let want_done = Position {
            done: at.done + len,
            hotzone: None,
        };
        if hot != want_hot || done != want_done || len % u.align != 0 || offset % u.align != 0 {
            return Err(Error::Bug("a hotzone planned out of its order"));
        }
        // This hotzone's commit as the hotzone comes after the last one's as done.
        match p.stages.last_mut() {
            Some(s) => s.commits.push(hot),
            None => p.first = Some(hot),
        }
        let stage = p.stages.len();
        let first = p.tasks.len();
        let to = u.new_offset + offset;
        p.tasks.extend(cut(offset, len, chunk).map(|(o, n)| Task {
            stage,
            offset: o,
            len: n,
            from: from + (o - offset),
            to: to + (o - offset),
        }));
        p.stages.push(Stage {
            tasks: p.tasks.len() - first,
            commits: vec![done],
        });
        total += len;
        hotzones += 1;
        p.end = done;
    }
    Ok((hotzones >= 2).then_some(p))
}

/// What the lanes share, under one lock (taken a few times per chunk).
struct State {
    /// The next task to claim.
    next: usize,
    /// Whether each slot holds a chunk not written yet.
    slot_used: Vec<bool>,
    /// Stages below this one may write.
    open: usize,
    /// Tasks written, per stage.
    written: Vec<usize>,
    /// Tasks ready whose stage is not open yet.
    parked: Vec<usize>,
    failed: bool,
}

struct Walk<'a> {
    devs: Devices<'a>,
    plan: Plan,
    slots: Vec<Mutex<&'a mut [u8]>>,
    state: Mutex<State>,
    /// Lanes waiting for a slot.
    changed: WaitCell,
    /// The header's state, committed by whoever writes a stage's last chunk.
    meta: Mutex<&'a mut Unlocked>,
    turns: TakeTurns<usize>,
    in_turns: bool,
}

impl Walk<'_> {
    /// Claims and does tasks until none is left, writing each whose stage is open.
    fn run_lane(&self, lane: &mut Lane) -> Result<()> {
        let r = self.claim_all(lane);
        if r.is_err() {
            lock(&self.state).failed = true;
            self.changed.notify_all();
        }
        r
    }

    /// Waits until the next task's slot is free and claims it; `None` when none is left or a
    /// lane failed.
    fn claim(&self) -> Option<usize> {
        let n = self.slots.len();
        let mut s = lock(&self.state);
        loop {
            if s.failed || s.next == self.plan.tasks.len() {
                return None;
            }
            let i = s.next;
            if !s.slot_used[i % n] {
                s.slot_used[i % n] = true;
                s.next += 1;
                // Another lane may wait for the slot after this one, freed already.
                let next_free = !s.slot_used[s.next % n];
                drop(s);
                if next_free {
                    self.changed.notify_all();
                }
                return Some(i);
            }
            s = self.changed.wait(s);
        }
    }

    fn claim_all(&self, lane: &mut Lane) -> Result<()> {
        let n = self.slots.len();
        while let Some(i) = self.claim() {
            let t = self.plan.tasks[i];
            {
                let mut slot = lock(&self.slots[i % n]);
                let b = &mut slot[..t.len];
                self.devs.data.read_exact_at(b, t.from)?;
                rekey_chunk(lane, t.offset, b)?;
            }
            {
                let mut s = lock(&self.state);
                if t.stage >= s.open {
                    s.parked.push(i);
                    continue;
                }
            }
            if self.in_turns {
                self.turns.take(i, &|i| self.write(i))?;
            } else {
                self.write(i)?;
            }
        }
        Ok(())
    }

    /// Writes task `i`'s chunk; if it was its stage's last, flushes, commits, opens the next
    /// stage and writes the chunks parked for it, and so on.
    fn write(&self, i: usize) -> Result<()> {
        let n = self.slots.len();
        let mut todo = vec![i];
        while let Some(i) = todo.pop() {
            let t = self.plan.tasks[i];
            {
                let slot = lock(&self.slots[i % n]);
                self.devs.data.write_at(&slot[..t.len], t.to)?;
            }
            let (stage_done, wake) = {
                let mut s = lock(&self.state);
                s.slot_used[i % n] = false;
                s.written[t.stage] += 1;
                (
                    s.written[t.stage] == self.plan.stages[t.stage].tasks,
                    // Lanes wait only for the next task's slot: a wake for any other is a
                    // context switch for nothing (beside busy threads, hundreds per rotation).
                    i % n == s.next % n,
                )
            };
            if wake {
                self.changed.notify_all();
            }
            if !stage_done {
                continue;
            }
            self.devs.flush()?;
            {
                let mut u = lock(&self.meta);
                for &p in &self.plan.stages[t.stage].commits {
                    u.commit(self.devs.header, p)?;
                }
            }
            let next = t.stage + 1;
            let mut s = lock(&self.state);
            s.open = next + 1;
            let tasks = &self.plan.tasks;
            let (mut ready, wait): (Vec<usize>, Vec<usize>) =
                s.parked.iter().partition(|&&j| tasks[j].stage == next);
            s.parked = wait;
            // Oldest first (`todo` pops from its end): the oldest chunk's slot is the one the
            // next claim waits for.
            ready.sort_unstable_by(|a, b| b.cmp(a));
            todo.extend(ready);
        }
        Ok(())
    }
}

/// Runs the hotzones of about `bytes` after `pos` of an offline rotation back to back (the
/// module's doc), in the ring `buf`; returns the position after the last, or `None` where
/// the one-step-at-a-time loop does the next hotzones ([`plan`]).
pub(super) fn run(
    devs: Devices<'_>,
    u: &mut Unlocked,
    pos: Position,
    hot_max: u64,
    bytes: u64,
    buf: &mut [u8],
) -> Result<Option<Position>> {
    let align = u.align as usize;
    let chunk = LANE_CHUNK_BYTES.min(buf.len() / align * align);
    if chunk == 0 || LANE_CHUNK_BYTES % align != 0 {
        return Ok(None);
    }
    let n_slots = buf.len() / chunk;
    let bytes = bytes.clamp(RUN_BYTES_MIN, RUN_BYTES_MAX);
    let Some(plan) = plan(u, pos, hot_max, bytes, chunk)? else {
        return Ok(None);
    };
    if let Some(p) = plan.first {
        u.commit(devs.header, p)?;
    }
    let lanes = std::mem::take(&mut u.lanes);
    let crew = u.crew.take();
    let n_tasks = plan.tasks.len();
    let n_stages = plan.stages.len();
    let end = plan.end;
    let walk = Walk {
        devs,
        slots: buf.chunks_exact_mut(chunk).map(Mutex::new).collect(),
        state: Mutex::new(State {
            next: 0,
            slot_used: vec![false; n_slots],
            open: 1,
            written: vec![0; n_stages],
            parked: Vec::with_capacity(n_slots),
            failed: false,
        }),
        plan,
        changed: WaitCell::new(),
        meta: Mutex::new(u),
        turns: TakeTurns::new(n_slots),
        in_turns: devs.data.serializes_writes(),
    };
    let mut lanes = lanes;
    let tokens = lanes.len();
    let r = super::share_out(
        crew.as_ref(),
        lanes.iter_mut(),
        0..tokens,
        "rotation thread panicked",
        |lane: &mut &mut Lane, _| walk.run_lane(lane),
    );
    let Walk { meta, state, .. } = walk;
    let u = meta
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    u.lanes = lanes;
    u.crew = crew;
    r?;
    let s = state
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if s.next != n_tasks || !s.parked.is_empty() || s.open != n_stages + 1 {
        return Err(Error::Bug(
            "a run of hotzones ended with chunks not written",
        ));
    }
    Ok(Some(end))
}

/// The bytes of the next run: [`RUN_TIME`] at the rate the last one went.
pub(super) fn next_run_bytes(bytes: u64, took: Duration) -> u64 {
    let rate = bytes as f64 / took.as_secs_f64().max(1e-3);
    ((rate * RUN_TIME.as_secs_f64()) as u64).clamp(RUN_BYTES_MIN, RUN_BYTES_MAX)
}
