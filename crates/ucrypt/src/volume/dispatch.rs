//! How a task runs once planned: inline on the caller's thread, split into chunks the caller
//! and the workers claim (`parallel`, and `ordered`'s crypto), or queued to a worker and the
//! writer thread (`queued`, dm-crypt's model).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use super::Core;
use crate::engine::plan::{Dispatch, Piece, Plan, CHUNKS_PER_LANE};
use crate::engine::stats::Times;
use crate::engine::task::Task;
use crate::engine::workers::{Completion, DoneRef, Executor, Job, Split, SplitRef};
use crate::{Error, Result};

impl Core {
    /// Runs `task` on `lanes` threads (the caller and `lanes - 1` workers), cut into
    /// `lanes * CHUNKS_PER_LANE` chunks they claim one at a time (see [`Split`]). Returns only
    /// when every chunk has finished, error or not.
    fn run_split(&self, task: &Task, lanes: u32, piece: &Piece, t: &mut Times) -> Result<()> {
        let bytes = piece.sectors.len() << self.shift;
        let by_size = (bytes / self.planner.chunk_min_bytes.max(1)).max(1);
        let chunks = by_size.min((lanes * CHUNKS_PER_LANE) as u64) as u32;
        let helpers = lanes.saturating_sub(1).min(chunks.saturating_sub(1));
        let split = Split::new(*task, chunks, self.shift, helpers);
        let me: *const Split = &split;
        for _ in 0..helpers {
            let job = Job::Help {
                split: SplitRef(me),
                queued_at: t.clock(),
            };
            if self.push_job(job).is_err() {
                split.helpers.done(
                    Err(Error::Bug("job queue closed while the volume is in use")),
                    &Times::default(),
                );
            }
        }
        let r = split.run_chunks(self, None, t);
        // Take back helper jobs no worker has started (all cores busy): there is nothing left
        // for them, and the request must not wait for a worker to be scheduled.
        while let Some(Job::Help { .. }) = self
            .jobs
            .steal(|j| matches!(j, Job::Help { split, .. } if std::ptr::eq(split.0, me)))
        {
            split.helpers.done(Ok(()), &Times::default());
        }
        let (rw, tw) = split.helpers.wait(self.spin());
        t.add(&tw);
        r.and(rw)
    }

    /// Hands a whole task to a worker (the `queued` model) and waits.
    fn run_queued(&self, task: Task, write: bool, t: &mut Times) -> Result<()> {
        let comp = Completion::new(1);
        let done = DoneRef(&comp);
        let queued_at = t.clock();
        let job = if write {
            Job::QueuedWrite {
                task,
                done,
                queued_at,
            }
        } else {
            Job::Chunk {
                task,
                done,
                queued_at,
            }
        };
        if self.push_job(job).is_err() {
            return Err(Error::Bug("job queue closed while the volume is in use"));
        }
        // Spin for the completion only if it can come within the spin: a worker was idle to
        // take the job at once, and its crypto alone is shorter than the spin. A caller that
        // spins for longer work takes a CPU from the worker doing it (64 writers of 1 MiB
        // spent a tenth of their CPU time spinning here).
        let spin = self.spin();
        let crypto_ns =
            task.bytes(self.shift) as u64 * self.crypto_ps_per_byte.load(Relaxed) / 1000;
        let spin = if self.jobs.idle() > 0 && crypto_ns < spin.as_nanos() as u64 {
            spin
        } else {
            Duration::ZERO
        };
        let (r, tw) = comp.wait(spin);
        t.add(&tw);
        r
    }

    /// Runs a task the way the plan says.
    pub(super) fn run(&self, plan: &Plan, piece: &Piece, task: Task, t: &mut Times) -> Result<()> {
        match plan.dispatch {
            Dispatch::Inline => self.exec_task(None, &task, t),
            Dispatch::Parallel { chunks } => self.run_split(&task, chunks, piece, t),
            Dispatch::Ordered { chunks } => {
                let mut turn = self.turns.take();
                // Writes: crypto in parallel, then the backend write when it is our turn.
                let io_now = !task.write;
                let r = self.run_split(&Task { io: io_now, ..task }, chunks, piece, t);
                let t0 = t.clock();
                turn.wait();
                t.wait += t.clock().wrapping_sub(t0);
                r?;
                if task.write {
                    self.write_task_io(&task, t)?;
                }
                Ok(())
            }
            Dispatch::Queued if task.write => self.run_queued(Task { io: false, ..task }, true, t),
            Dispatch::Queued => {
                // dm-crypt reads: the I/O completes, then decryption is queued to a worker.
                // SAFETY: as in exec_task.
                let buf = unsafe { self.task_buf(&task) };
                self.read_task_io(&task, buf, t)?;
                self.run_queued(Task { io: false, ..task }, false, t)
            }
        }
    }
}
