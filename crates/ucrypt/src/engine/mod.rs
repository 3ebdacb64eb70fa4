//! The engine: how a request's crypto and backend I/O are dispatched.
//!
//! - `plan`: the pure planner (request -> pieces, chunks, locks; which dispatch).
//! - `range_lock`: sector range locks (writes and read-modify-write lock only what they touch).
//! - `queue`: the bounded queue every hand-off goes through.
//! - `workers`: the worker threads (one per core) and the single writer of the `queued` model.
//! - `ciphers`: cipher contexts reused across requests (one is costly to create).
//! - `gate`: the gate every request passes, closed while a volume is suspended or resized.
//! - `host`: how many of the host's cores this process could use lately (for `auto`).
//! - `stats`: cheap per-request timings (log2 histograms).
//!
//! - `task`: a unit of crypto and I/O over one run of sectors, as handed to a thread.
//! - `crew`: a small bounded executor for split work that is not a sector task (the chunks of
//!   an authenticated volume's requests), with the same rules as the workers.
//!
//! Only [`Policy`] and the statistics types are public: the rest carries raw pointers into
//! callers' buffers and is sound only as the volume uses it. The drivers that perform plans
//! live in `volume.rs`, next to the data path they serve; the workers reach them through the
//! `workers::Executor` trait, so this module never imports the volume.

pub(crate) mod ciphers;
pub(crate) mod crew;
pub(crate) mod gate;
pub(crate) mod host;
pub(crate) mod plan;
pub(crate) mod queue;
pub(crate) mod range_lock;
pub(crate) mod stats;
pub(crate) mod task;
pub(crate) mod workers;
pub(crate) mod zone_lock;

pub use gate::{GATE_DRAIN_POLL, GATE_SHARDS};
pub use stats::{OpStats, Phase, PhaseStats, StatsSnapshot, HIST_BUCKETS, SAMPLE_EVERY};

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// How a volume dispatches crypto (per volume, switchable at run time for benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Crypto and backend I/O on the caller's thread (the default; dm-crypt's
    /// `no_read_workqueue,no_write_workqueue`).
    Inline,
    /// Requests above a threshold are cut into chunks run on the caller and a bounded worker
    /// pool; the request completes when all chunks have.
    Parallel,
    /// Like `Parallel`, but backend writes and completions leave in submission order.
    Ordered,
    /// A model of classic dm-crypt: every request's crypto goes through a worker queue, writes
    /// are sorted by sector and submitted by a single writer thread. The baseline.
    Queued,
    /// Per request: inline below a threshold calibrated at start-up, parallel above it when a
    /// worker is idle.
    Auto,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Policy::Inline,
        Policy::Parallel,
        Policy::Ordered,
        Policy::Queued,
        Policy::Auto,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Inline => "inline",
            Policy::Parallel => "parallel",
            Policy::Ordered => "ordered",
            Policy::Queued => "queued",
            Policy::Auto => "auto",
        }
    }

    pub(crate) fn to_u8(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_u8(v: u8) -> Policy {
        Policy::ALL
            .into_iter()
            .find(|p| *p as u8 == v)
            .unwrap_or(Policy::Inline)
    }
}

/// A dispatch policy per direction, as dm-crypt keeps separate read and write workqueue flags
/// (`no_read_workqueue`, `no_write_workqueue`). Writes include write-zeroes and discards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policies {
    pub read: Policy,
    pub write: Policy,
}

impl From<Policy> for Policies {
    fn from(p: Policy) -> Self {
        Policies { read: p, write: p }
    }
}

impl fmt::Display for Policies {
    /// One name when both directions agree, else `read=P,write=Q`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.read == self.write {
            write!(f, "{}", self.read)
        } else {
            write!(f, "read={},write={}", self.read, self.write)
        }
    }
}

impl FromStr for Policies {
    type Err = Error;
    /// `P` for both directions, or `read=P`, `write=Q`, comma-separated; a direction not named
    /// gets `auto`.
    fn from_str(s: &str) -> Result<Self, Error> {
        if !s.contains('=') {
            return s.parse::<Policy>().map(Policies::from);
        }
        let mut p = Policies::from(Policy::Auto);
        let mut seen = [false; 2];
        for part in s.split(',') {
            let (dir, name) = part.split_once('=').unwrap_or((part, ""));
            let (i, slot) = match dir {
                "read" => (0, &mut p.read),
                "write" => (1, &mut p.write),
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "policy direction '{other}' in '{s}'; read=P,write=Q"
                    )))
                }
            };
            if std::mem::replace(&mut seen[i], true) {
                return Err(Error::InvalidArgument(format!(
                    "'{dir}' named twice in '{s}'"
                )));
            }
            *slot = name.parse()?;
        }
        Ok(p)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown dispatch policy '{s}'; one of inline, parallel, ordered, queued, auto"
                ))
            })
    }
}
