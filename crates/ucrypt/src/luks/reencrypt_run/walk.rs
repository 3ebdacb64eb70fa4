//! Offline hotzones run back to back: no lane waits at the order points between them.
//!
//! The protocol orders each hotzone's writes after a commit: a `none` or data shift hotzone
//! is written only once it is committed as the hotzone (for a data shift, once the one before
//! it in the walk is flushed and committed done, since its target is that one's source); a
//! journal hotzone's copy is written only once the hotzone before is committed done (the
//! journal area holds one hotzone), and its rewrite only once the copy is flushed and the
//! hotzone committed. Reads and crypto have no such order. Run one step at a time, every lane
//! waits at each order point for the slowest one and for the commit, and beside busy threads
//! a lane that waits gives its CPU away and waits again to get it back.
//!
//! Here the rotation is a list of tasks in the protocol's order, each a chunk of at most
//! [`LANE_CHUNK_BYTES`] (a [`Plan`]): read and write (the journal's copy), read, rekey and
//! write (a `none` hotzone, a data shift's move) or rekey and write (a journal hotzone's
//! rewrite, of the chunk its copy read). Tasks come in stages: the writes of one hotzone step,
//! followed by a flush and the commits that open the next stage. The lanes claim the tasks
//! in order into a ring of chunk slots (the hotzone buffer), do each one's reads and crypto,
//! and write it at once if its stage is open, else leave it parked in its slot. Whoever
//! writes a stage's last chunk flushes, commits, opens the next stage and writes the chunks
//! parked for it. So what reaches the devices is in the protocol's order, and a crash
//! anywhere leaves what the one-step-at-a-time loop can leave. A lane waits only where the
//! order is the data's: for a slot whose chunk is not written yet, or for a journal copy to
//! be written before its chunk is rekeyed in place.
//!
//! Only offline: a volume served meanwhile holds and releases each hotzone
//! ([`Serving::hold`](super::Serving::hold)), which this walk does not do.

use std::sync::Mutex;
use std::time::Duration;

use super::{commit, Devices, Lane, Position, Protect, Step, Unlocked, LANE_CHUNK_BYTES};
use crate::luks::reencrypt_plan::{next_hotzone, next_hotzone_shift};
use crate::sync::{lock, TakeTurns, WaitCell};
use crate::{Error, Result};

/// About how long a run of hotzones lasts: progress is reported between runs.
const RUN_TIME: Duration = Duration::from_millis(250);
/// The bytes of the first run, before a rate was measured.
pub(super) const RUN_BYTES_FIRST: u64 = 64 << 20;
/// Bounds of a run's bytes.
const RUN_BYTES_MIN: u64 = 16 << 20;
const RUN_BYTES_MAX: u64 = 4 << 30;

/// What a task does with its chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Reads the chunk at `from` on the data device, rekeys it and writes it at `to` there:
    /// a `none` hotzone in place, a data shift's move.
    Move { from: u64, to: u64 },
    /// Reads the chunk at `from` on the data device and writes it as it is at `to` on the
    /// header device: a journal's copy, whose chunk stays in its slot for the rewrite.
    Copy { from: u64, to: u64 },
    /// Rekeys the chunk task `of` (a [`Work::Copy`]) read, once that one is written, and
    /// writes it at `to` on the data device.
    Rewrite { of: usize, to: u64 },
}

/// A chunk: its stage, its data offset (for the crypto's sector numbers), its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Task {
    stage: usize,
    offset: u64,
    len: usize,
    work: Work,
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
/// `chunk`; `None` when fewer than two hotzones are left before the last (which finalises and is left to
/// the one-step-at-a-time loop), or the rotation is of a kind this walk does not run
/// (checksums; a decryption that moves the data back). A journal run needs a slot per chunk
/// of its longest hotzone (`slots`).
fn plan(
    u: &Unlocked,
    pos: Position,
    hot_max: u64,
    bytes: u64,
    chunk: usize,
    slots: usize,
) -> Result<Option<Plan>> {
    let journal = match (u.protect, u.shift, u.unshift) {
        (Protect::Journal, None, None) => true,
        (Protect::None, None, None) | (Protect::Datashift, Some(_), None) => false,
        _ => return Ok(None),
    };
    if journal && u.data_offset != u.new_offset {
        return Ok(None);
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
        let steps = match u.shift {
            Some(sh) => next_hotzone_shift(&sh, at, u.align)?,
            None => next_hotzone(&u.st, at, u.data_bytes, hot_max, u.align)?,
        };
        let Some(steps) = steps else {
            break;
        };
        let hot = Position {
            done: at.done,
            hotzone: None,
        };
        let (offset, len, from, hot_at, done) = match steps[..] {
            [Step::CommitSegments(h), Step::MoveNew { from, offset, len }, Step::SyncData, Step::CommitSegments(d)]
                if !journal =>
            {
                (offset, len, from, h, d)
            }
            [Step::ReadOld { offset, len }, Step::CommitSegments(h), Step::WriteNew {
                offset: o2,
                len: l2,
            }, Step::SyncData, Step::CommitSegments(d)]
                if !journal && (o2, l2) == (offset, len) =>
            {
                (offset, len, u.data_offset + offset, h, d)
            }
            [Step::ReadOld { offset, len }, Step::WriteJournal { .. }, Step::SyncData, Step::CommitSegments(h), Step::WriteNew {
                offset: o2,
                len: l2,
            }, Step::SyncData, Step::CommitSegments(d)]
                if journal
                    && (o2, l2) == (offset, len)
                    && len.div_ceil(chunk as u64) <= slots as u64 =>
            {
                (offset, len, u.data_offset + offset, h, d)
            }
            _ => break,
        };
        if hot_at
            != (Position {
                hotzone: Some(len),
                ..hot
            })
            || done
                != (Position {
                    done: at.done + len,
                    hotzone: None,
                })
            || len % u.align != 0
            || offset % u.align != 0
        {
            return Err(Error::Bug("a hotzone planned out of its order"));
        }
        let to = u.new_offset + offset;
        if journal {
            let area = u.st.keyslot.area_offset;
            let copy = p.stages.len();
            let first = p.tasks.len();
            p.tasks.extend(cut(offset, len, chunk).map(|(o, n)| Task {
                stage: copy,
                offset: o,
                len: n,
                work: Work::Copy {
                    from: from + (o - offset),
                    to: area + (o - offset),
                },
            }));
            let copies = p.tasks.len() - first;
            p.stages.push(Stage {
                tasks: copies,
                commits: vec![hot_at],
            });
            let rewrites: Vec<Task> = (first..first + copies)
                .map(|of| {
                    let c = p.tasks[of];
                    Task {
                        stage: copy + 1,
                        work: Work::Rewrite {
                            of,
                            to: to + (c.offset - offset),
                        },
                        ..c
                    }
                })
                .collect();
            p.tasks.extend(rewrites);
            p.stages.push(Stage {
                tasks: copies,
                commits: vec![done],
            });
        } else {
            // The commit of this hotzone as the hotzone comes after the last one's done.
            match p.stages.last_mut() {
                Some(s) => s.commits.push(hot_at),
                None => p.first = Some(hot_at),
            }
            let stage = p.stages.len();
            let first = p.tasks.len();
            p.tasks.extend(cut(offset, len, chunk).map(|(o, n)| Task {
                stage,
                offset: o,
                len: n,
                work: Work::Move {
                    from: from + (o - offset),
                    to: to + (o - offset),
                },
            }));
            p.stages.push(Stage {
                tasks: p.tasks.len() - first,
                commits: vec![done],
            });
        }
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
    /// The task each slot holds until it is written (a copy's slot until its rewrite is).
    slot_task: Vec<Option<usize>>,
    /// Stages below this one may write.
    open: usize,
    /// Tasks written, per stage.
    written: Vec<usize>,
    /// Whether each task was written (a rewrite waits for its copy's).
    done: Vec<bool>,
    /// Tasks ready whose stage is not open yet.
    parked: Vec<usize>,
    failed: bool,
}

struct Walk<'a> {
    devs: Devices<'a>,
    plan: Plan,
    /// The slot of each task.
    slot_of: Vec<usize>,
    slots: Vec<Mutex<&'a mut [u8]>>,
    state: Mutex<State>,
    /// Lanes waiting for a slot or for a copy to be written.
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

    /// Waits until the next task may start (its slot free, or for a rewrite its copy
    /// written) and claims it; `None` when none is left or a lane failed.
    fn claim(&self) -> Option<usize> {
        let mut s = lock(&self.state);
        loop {
            if s.failed || s.next == self.plan.tasks.len() {
                return None;
            }
            let i = s.next;
            let slot = self.slot_of[i];
            let ready = match self.plan.tasks[i].work {
                Work::Rewrite { of, .. } => s.done[of],
                Work::Move { .. } | Work::Copy { .. } => s.slot_task[slot].is_none(),
            };
            if ready {
                s.slot_task[slot] = Some(i);
                s.next += 1;
                return Some(i);
            }
            s = self.changed.wait(s);
        }
    }

    fn claim_all(&self, lane: &mut Lane) -> Result<()> {
        while let Some(i) = self.claim() {
            let t = self.plan.tasks[i];
            {
                let mut slot = lock(&self.slots[self.slot_of[i]]);
                let b = &mut slot[..t.len];
                let (old, new) = &mut *lane;
                match t.work {
                    Work::Copy { from, .. } => self.devs.data.read_exact_at(b, from)?,
                    Work::Move { from, .. } => {
                        self.devs.data.read_exact_at(b, from)?;
                        rekey(old, new, t.offset, b)?;
                    }
                    Work::Rewrite { .. } => rekey(old, new, t.offset, b)?,
                }
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
        let mut todo = vec![i];
        while let Some(i) = todo.pop() {
            let t = self.plan.tasks[i];
            {
                let slot = lock(&self.slots[self.slot_of[i]]);
                let b = &slot[..t.len];
                match t.work {
                    Work::Copy { to, .. } => self.devs.header.write_at(b, to)?,
                    Work::Move { to, .. } | Work::Rewrite { to, .. } => {
                        self.devs.data.write_at(b, to)?
                    }
                }
            }
            let stage_done = {
                let mut s = lock(&self.state);
                s.done[i] = true;
                if !matches!(t.work, Work::Copy { .. }) {
                    s.slot_task[self.slot_of[i]] = None;
                }
                s.written[t.stage] += 1;
                s.written[t.stage] == self.plan.stages[t.stage].tasks
            };
            self.changed.notify_all();
            if !stage_done {
                continue;
            }
            self.devs.flush()?;
            {
                let mut u = lock(&self.meta);
                for &p in &self.plan.stages[t.stage].commits {
                    commit(self.devs.header, &mut u, p)?;
                }
            }
            let next = t.stage + 1;
            let mut s = lock(&self.state);
            s.open = next + 1;
            let tasks = &self.plan.tasks;
            let (ready, wait): (Vec<usize>, Vec<usize>) =
                s.parked.iter().partition(|&&j| tasks[j].stage == next);
            s.parked = wait;
            todo.extend(ready);
        }
        Ok(())
    }
}

/// Decrypts `b` (data offset `offset`) with the old key and encrypts it with the new one, in
/// place; a linear side is left as it is.
fn rekey(
    old: &mut Option<crate::sector::SectorCipher>,
    new: &mut Option<crate::sector::SectorCipher>,
    offset: u64,
    b: &mut [u8],
) -> Result<()> {
    if let Some(old) = old {
        old.decrypt(offset / old.sector_bytes() as u64, b)?;
    }
    if let Some(new) = new {
        new.encrypt(offset / new.sector_bytes() as u64, b)?;
    }
    Ok(())
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
    let Some(plan) = plan(u, pos, hot_max, bytes, chunk, n_slots)? else {
        return Ok(None);
    };
    if let Some(p) = plan.first {
        commit(devs.header, u, p)?;
    }
    // A task's slot: the next one in turn for a read, its copy's for a rewrite.
    let mut slot_of = Vec::with_capacity(plan.tasks.len());
    let mut reads = 0;
    for t in &plan.tasks {
        slot_of.push(match t.work {
            Work::Rewrite { of, .. } => slot_of[of],
            Work::Move { .. } | Work::Copy { .. } => {
                reads += 1;
                (reads - 1) % n_slots
            }
        });
    }
    let lanes = std::mem::take(&mut u.lanes);
    let crew = u.crew.take();
    let n_tasks = plan.tasks.len();
    let n_stages = plan.stages.len();
    let end = plan.end;
    let walk = Walk {
        devs,
        slot_of,
        slots: buf.chunks_exact_mut(chunk).map(Mutex::new).collect(),
        state: Mutex::new(State {
            next: 0,
            slot_task: vec![None; n_slots],
            open: 1,
            written: vec![0; n_stages],
            done: vec![false; n_tasks],
            parked: Vec::with_capacity(n_slots),
            failed: false,
        }),
        plan,
        changed: WaitCell::new(),
        meta: Mutex::new(u),
        turns: TakeTurns::new(n_slots),
        in_turns: devs.data.serializes_writes() || devs.header.serializes_writes(),
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
