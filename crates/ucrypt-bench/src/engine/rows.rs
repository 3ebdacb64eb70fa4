//! What the scenarios produce: result rows, per-phase breakdowns and target checks, gathered
//! in a [`Sink`] and then into the [`EngineReport`].

use crate::stats::{Machine, Summary};
use serde::Serialize;
use ucrypt::engine::{OpStats, Phase, StatsSnapshot};

use super::rig::Setup;
// ---------------------------------------------------------------- measuring

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub scenario: &'static str,
    pub backend: &'static str,
    pub cipher: &'static str,
    pub variant: String,
    pub unit: &'static str,
    pub value: Summary,
    /// Extra per-variant numbers (e.g. allocations per I/O, latency percentiles).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extra: Vec<(String, Summary)>,
    /// Request size of a block-size sweep row (scenario 7).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_bytes: Option<u64>,
    /// Thread count of a scaling row (scenario 8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    /// Latency CDF of the last run, (percentile 0..100, µs), for plots (scenario 5).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cdf: Vec<(f64, f64)>,
}

/// Where a variant's time went in its last run (from `Volume::stats()`): mean ns per timed
/// request of each stage. Stages of split requests are summed over their chunks, so they can
/// add up to more than the total.
#[derive(Debug, Clone, Serialize)]
pub struct Breakdown {
    pub backend: &'static str,
    pub scenario: String,
    pub variant: String,
    /// "read" or "write".
    pub op: &'static str,
    pub requests: u64,
    /// Requests cut into chunks for the workers.
    pub split: u64,
    pub wait_ns: f64,
    pub queue_ns: f64,
    pub crypto_ns: f64,
    pub device_ns: f64,
    pub total_ns: f64,
}

impl Breakdown {
    fn from_snapshot(
        backend: &'static str,
        scenario: &str,
        variant: &str,
        snap: &StatsSnapshot,
    ) -> Vec<Breakdown> {
        let per_request = |o: &OpStats, p: Phase| {
            let timed = o.phase(Phase::Total).count.max(1) as f64;
            let ph = o.phase(p);
            ph.mean_ns * ph.count as f64 / timed
        };
        [("read", &snap.read), ("write", &snap.write)]
            .into_iter()
            .filter(|(_, o)| o.requests > 0)
            .map(|(op, o)| Breakdown {
                backend,
                scenario: scenario.to_string(),
                variant: variant.to_string(),
                op,
                requests: o.requests,
                split: snap.split,
                wait_ns: per_request(o, Phase::Wait),
                queue_ns: per_request(o, Phase::Queue),
                crypto_ns: per_request(o, Phase::Crypto),
                device_ns: per_request(o, Phase::Backend),
                total_ns: per_request(o, Phase::Total),
            })
            .collect()
    }
}

/// A target of the engine's brief, checked against this run.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    pub what: String,
    pub measured: f64,
    pub target: f64,
    /// The same ratio without ucrypt, measured beside it in this run: the most this machine
    /// allows for it (None: the check has no such counterpart).
    pub ceiling: Option<f64>,
    pub verdict: Verdict,
    /// Not [`Verdict::Missed`].
    pub met: bool,
}

/// The share of the ceiling a check must reach where its target is more than that share of
/// the ceiling: the share the limit rows ask of their limit ([`crate::limit::LIMIT_TARGET`]).
pub const CEILING_SHARE: f64 = crate::limit::LIMIT_TARGET;

/// How a check came out against its target and the ceiling measured beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The measured ratio reaches the target.
    Met,
    /// Below the target, but at least [`CEILING_SHARE`] of what this machine allows: the
    /// target asks more than the machine gives the same work without ucrypt.
    MetAgainstCeiling,
    /// Below the target and below [`CEILING_SHARE`] of the ceiling (or no ceiling measured).
    Missed,
}

impl Verdict {
    /// A check is missed only when it is missed against the ceiling: below
    /// min(target, [`CEILING_SHARE`] × ceiling). A ceiling that is not a positive number
    /// (not measured, or a run without samples) counts as none.
    pub fn of(measured: f64, target: f64, ceiling: Option<f64>) -> Verdict {
        if measured >= target {
            return Verdict::Met;
        }
        match ceiling.filter(|c| c.is_finite() && *c > 0.0) {
            Some(c) if measured >= CEILING_SHARE * c => Verdict::MetAgainstCeiling,
            _ => Verdict::Missed,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::MetAgainstCeiling => "met against this machine's ceiling",
            Verdict::Missed => "MISSED",
        }
    }
}

#[derive(Serialize)]
pub struct EngineReport {
    /// Bumped on an incompatible change of this JSON (see docs/bench-json.md).
    pub schema: u32,
    pub machine: Machine,
    pub quick: bool,
    pub runs: usize,
    pub notes: Vec<String>,
    pub rows: Vec<Row>,
    pub targets: Vec<TargetCheck>,
    /// Where each variant's time went in its last run.
    pub breakdown: Vec<Breakdown>,
}

pub(super) type StatsLog = Vec<Breakdown>;
pub(crate) type Targets = Vec<TargetCheck>;

/// What the scenarios produce, gathered into the report.
#[derive(Default)]
pub(super) struct Sink {
    pub(super) stats: StatsLog,
    pub(super) rows: Vec<Row>,
    pub(super) targets: Targets,
    pub(super) notes: Vec<String>,
}

/// Checks `measured` against `want` and against `ceiling`, the same ratio measured without
/// ucrypt in the same run, where the check has one.
pub(crate) fn target(
    targets: &mut Targets,
    what: String,
    measured: f64,
    want: f64,
    ceiling: Option<f64>,
) {
    let verdict = Verdict::of(measured, want, ceiling);
    targets.push(TargetCheck {
        what,
        measured,
        target: want,
        ceiling,
        verdict,
        met: verdict != Verdict::Missed,
    });
}

/// Breakdown rows of one scenario's round-robin (`stats` as `round_robin` returns them).
pub(super) fn log_stats(
    log: &mut StatsLog,
    s: &Setup,
    scenario: &str,
    stats: Vec<(String, StatsSnapshot)>,
) {
    for (variant, snap) in stats {
        log.extend(Breakdown::from_snapshot(s.name, scenario, &variant, &snap));
    }
}

/// One row per variant of a scenario's round-robin results (in variant order); returns the
/// new rows, for scenario-specific fields.
/// [`push_rows`] for the usual case: aes-xts-plain64 on `s`'s backend, in MB/s.
pub(super) fn push_mbps<'a>(
    rows: &'a mut Vec<Row>,
    s: &Setup,
    scenario: &'static str,
    variants: &[&str],
    res: Vec<(Summary, Vec<(String, Summary)>)>,
) -> &'a mut [Row] {
    push_rows(
        rows,
        scenario,
        s.name,
        "aes-xts-plain64",
        "MB/s",
        variants,
        res,
    )
}

pub(super) fn push_rows<'a>(
    rows: &'a mut Vec<Row>,
    scenario: &'static str,
    backend: &'static str,
    cipher: &'static str,
    unit: &'static str,
    variants: &[&str],
    res: Vec<(Summary, Vec<(String, Summary)>)>,
) -> &'a mut [Row] {
    let first = rows.len();
    for (v, (value, extra)) in variants.iter().zip(res) {
        rows.push(Row {
            scenario,
            backend,
            cipher,
            variant: v.to_string(),
            unit,
            value,
            extra,
            block_bytes: None,
            threads: None,
            cdf: Vec::new(),
        });
    }
    &mut rows[first..]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verdict as a truth table: (measured, target, ceiling) -> verdict.
    #[test]
    fn verdict_against_target_and_ceiling() {
        use Verdict::*;
        let share = CEILING_SHARE;
        let rows: &[(f64, f64, Option<f64>, Verdict)] = &[
            // At or above the target: met, whatever the ceiling.
            (1.8, 1.8, None, Met),
            (1.9, 1.8, Some(1.2), Met),
            (0.95, 0.9, Some(2.0), Met),
            // No ceiling: below the target is missed.
            (1.79, 1.8, None, Missed),
            // A ceiling below the target: judged against share × ceiling.
            (share * 1.23, 1.8, Some(1.23), MetAgainstCeiling),
            (share * 1.23 - 1e-9, 1.8, Some(1.23), Missed),
            (1.23, 1.8, Some(1.23), MetAgainstCeiling),
            // A ceiling above the target but share × ceiling below it: the same rule (no jump
            // where the ceiling crosses the target).
            (1.75, 1.8, Some(1.9), MetAgainstCeiling),
            (1.70, 1.8, Some(1.9), Missed),
            // A ceiling well above the target: the target decides.
            (1.79, 1.8, Some(3.0), Missed),
            // A ceiling that is no number counts as none; a measured NaN is missed.
            (1.0, 1.8, Some(f64::NAN), Missed),
            (1.0, 1.8, Some(0.0), Missed),
            (f64::NAN, 1.8, Some(1.2), Missed),
        ];
        for &(measured, target, ceiling, want) in rows {
            assert_eq!(
                Verdict::of(measured, target, ceiling),
                want,
                "measured {measured}, target {target}, ceiling {ceiling:?}"
            );
        }
    }
}
