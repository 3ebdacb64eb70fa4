//! `ucrypt bench engine`: the volume engine's dispatch policies side by side with the raw
//! backend, on a /dev/shm file (O_DIRECT) and on the memory backend. Every scenario runs its
//! variants round-robin in one process; each number is the median of the runs (min–max shown).
//!
//! Scenarios (numbered as in the engine's brief):
//! 1. 4 KiB sequential reads, QD1, null cipher and aes-xts-plain64: raw vs inline vs queued.
//! 2. 1 MiB writes, 64 in flight (64 threads): throughput vs raw, heap allocations per I/O.
//! 3. 12 concurrent jobs of 256 KiB random reads/writes: inline vs parallel vs auto.
//! 4. One stream of 1 MiB reads, and of 1 MiB writes: parallel vs inline.
//! 5. 4 KiB random reads QD1 while two busy-loop threads compete: latency percentiles.
//! 6. Many independent streams of mixed sizes: auto vs the best static policy; again (6c)
//!    while a background load comes and goes every 150 ms.
//! 7. Throughput by block size (4 KiB .. 1 MiB), one stream, per policy (file backend only).
//! 8. Scaling with threads (1 .. 16 threads of 64 KiB random I/O), per policy (file backend).
//!
//! Scenario 5 also runs without the busy threads (5a), and keeps its latency CDF for plots.
//!
//! Its parts: `rig` (the setups, the round-robin, timed thread groups, allocation counting, the
//! background load), `throughput` (scenarios 1–4), `sweeps` (5–8), `rows` (what they produce)
//! and `report` (the Markdown).

use std::time::Duration;

use ucrypt::engine::Policy;

use super::stats::Machine;

mod report;
mod rig;
mod rows;
mod sweeps;
mod throughput;

pub use report::markdown;
pub(crate) use report::targets_table;
use rig::*;
pub(crate) use rows::{target, TargetCheck};
use rows::{EngineReport, Sink};
use sweeps::*;
use throughput::*;

type Scenario = fn(&Setup, &Knobs, &mut Sink);

/// The scenarios: number, what progress says, the code, and whether it is a long sweep.
const SCENARIOS: [(u8, &str, Scenario, bool); 8] = [
    (1, "1: 4 KiB sequential reads", s1_seq_reads, false),
    (2, "2: 1 MiB writes, 64 in flight", s2_big_writes, false),
    (3, "3: 12 jobs of 256 KiB", s3_twelve_jobs, false),
    (4, "4: one stream of 1 MiB", s4_one_stream, false),
    (5, "5: QD1 latency with busy threads", s5_latency, false),
    (6, "6: many streams", s6_many_streams, false),
    (7, "7: block size sweep", s7_block_sizes, true),
    (8, "8: scaling with threads", s8_threads, true),
];

/// Runs the scenarios numbered in `only` (all if empty).
pub fn measure(runs: usize, quick: bool, progress: bool, only: &[u8]) -> EngineReport {
    let run = |n: u8| only.is_empty() || only.contains(&n);
    let knobs = Knobs {
        runs,
        slice: Duration::from_millis(if quick { 120 } else { 400 }),
    };
    // The sweeps have 10 and 5 points of 5 variants each: shorter slices.
    let sweep = Knobs {
        runs,
        slice: knobs.slice / 2,
    };
    let data_bytes = if quick { 64 << 20 } else { 256 << 20 };
    let mut out = Sink::default();
    let sets = setups(data_bytes, &mut out.notes);
    for s in &sets {
        out.notes.push(format!(
            "{}: {}; {} workers; auto splits from {} KiB",
            s.name,
            s.backend.describe(),
            s.xts.workers(),
            s.xts.auto_threshold_bytes() >> 10
        ));
        let say = |what: &str| {
            if progress {
                eprintln!("bench engine: {} {what}", s.name);
            }
        };
        // The sweeps are long; they run on the first (file) backend only, with short slices.
        let first = std::ptr::eq(s, &sets[0]);
        for (n, what, scenario, sweeps) in SCENARIOS {
            if run(n) && (first || !sweeps) {
                say(what);
                scenario(s, if sweeps { &sweep } else { &knobs }, &mut out);
            }
        }
        s.xts.set_policy(Policy::Inline);
        s.null.set_policy(Policy::Inline);
    }
    EngineReport {
        schema: 1,
        machine: Machine::detect(),
        quick,
        runs,
        notes: out.notes,
        rows: out.rows,
        targets: out.targets,
        breakdown: out.stats,
    }
}
