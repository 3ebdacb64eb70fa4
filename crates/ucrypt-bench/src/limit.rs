//! The limit an encrypting path can reach on this machine, measured beside it.
//!
//! A request that must be encrypted (or decrypted) costs what the same request costs without
//! crypto plus the cipher's work on its bytes. Where the path is bound by CPU (fio, the
//! servers and a test cluster all share this machine's cores), those costs add up:
//! `limit = 1 / (1/ceiling + 1/(cores × cipher))`, with `ceiling` the best unencrypted path
//! in the same run and `cores × cipher` the cipher's throughput on all cores at once, measured
//! in the same round, so that both carry whatever load the machine carries then. This is the
//! formula the hardening issue gives for large writes; where a path is bound by latency
//! instead (QD1), the cipher's share is a few hundred nanoseconds and the limit is the
//! ceiling.
//!
//! Ratios to the limit are taken per run (each run's own ceiling and cipher), then
//! summarised, as `bench engine` scenario 2 does.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use serde::Serialize;
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};

use super::stats::Summary;

/// Bytes each cipher thread encrypts per call: one 1 MiB request.
const CALL_BYTES: usize = 1 << 20;
/// How long the cipher is measured in each round.
pub const CIPHER_MEASURE: Duration = Duration::from_millis(300);
/// The target every "÷ limit" row is checked against.
pub const LIMIT_TARGET: f64 = 0.9;

/// AES-256-XTS (aes-xts-plain64, 512-bit key, 4096-byte sectors) on every core at once, one
/// thread per core, each encrypting 1 MiB from one buffer into another as a write does; MiB/s
/// of all threads together over `dur`.
pub fn cipher_x_cores_mib_s(dur: Duration) -> f64 {
    cipher_x_cores_mib_s_at(dur, SectorSize::S4096)
}

/// [`cipher_x_cores_mib_s`] with sectors of `sector` bytes (the volume's: a 512-byte sector
/// costs AES-XTS more per byte than a 4096-byte one).
pub fn cipher_x_cores_mib_s_at(dur: Duration, sector: SectorSize) -> f64 {
    let per_call = CALL_BYTES as u64 / sector.bytes() as u64;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let stop = AtomicBool::new(false);
    // Everyone allocated and keyed before the clock starts.
    let ready = Barrier::new(cores + 1);
    let (bytes, secs) = std::thread::scope(|s| {
        let threads: Vec<_> = (0..cores)
            .map(|_| {
                let (stop, ready) = (&stop, &ready);
                s.spawn(move || {
                    let key: Vec<u8> = (0..64u8).map(|i| i ^ 0xa5).collect();
                    let mut c =
                        SectorCipher::new(CipherSpec::AES_XTS_PLAIN64, &key, Geometry::new(sector))
                            .expect("aes-xts-plain64 with a 512-bit key");
                    let src = vec![0x5au8; CALL_BYTES];
                    let mut dst = vec![0u8; CALL_BYTES];
                    ready.wait();
                    let mut n = 0u64;
                    while !stop.load(Relaxed) {
                        c.encrypt_to(n * per_call, &src, &mut dst).expect("encrypt");
                        black_box(dst[0]);
                        n += 1;
                    }
                    n * CALL_BYTES as u64
                })
            })
            .collect();
        ready.wait();
        let t0 = Instant::now();
        std::thread::sleep(dur);
        stop.store(true, Relaxed);
        let bytes: u64 = threads
            .into_iter()
            .map(|t| t.join().expect("cipher thread"))
            .sum();
        (bytes, t0.elapsed().as_secs_f64())
    });
    bytes as f64 / secs / (1 << 20) as f64
}

/// `1 / (1/ceiling + 1/cipher)`: NaN unless both are positive.
pub fn limit(ceiling: f64, cipher: f64) -> f64 {
    if ceiling > 0.0 && cipher > 0.0 {
        1.0 / (1.0 / ceiling + 1.0 / cipher)
    } else {
        f64::NAN
    }
}

/// One encrypting target's throughput against the limit of its job, run by run.
#[derive(Debug, Serialize)]
pub struct LimitResult {
    pub job: &'static str,
    /// The encrypting target.
    pub ours: String,
    /// The unencrypted targets whose best, run by run, is the ceiling.
    pub ceiling_of: Vec<String>,
    /// The limit per run, MiB/s.
    pub limit_mib_s: Summary,
    /// Ours ÷ that run's limit.
    pub ratio: Summary,
    pub min_ratio: f64,
    /// Whether the median ratio reaches `min_ratio` (None: not measured).
    pub met: Option<bool>,
}

impl LimitResult {
    /// From per-run samples (MiB/s, in run order): `ours`, each ceiling candidate's, and the
    /// cipher's. Runs where anything is missing are left out.
    pub fn of(
        job: &'static str,
        ours: (&str, &[f64]),
        ceilings: &[(&str, &[f64])],
        cipher: &[f64],
    ) -> LimitResult {
        let mut limits = Vec::new();
        let mut ratios = Vec::new();
        for (run, &c) in cipher.iter().enumerate() {
            let best = ceilings
                .iter()
                .filter_map(|(_, v)| v.get(run).copied())
                .filter(|x| x.is_finite())
                .fold(f64::NAN, f64::max);
            let l = limit(best, c);
            limits.push(l);
            if let Some(&o) = ours.1.get(run) {
                ratios.push(o / l);
            }
        }
        let ratio = Summary::of(&ratios);
        LimitResult {
            job,
            ours: ours.0.to_string(),
            ceiling_of: ceilings.iter().map(|(n, _)| n.to_string()).collect(),
            limit_mib_s: Summary::of(&limits),
            met: (ratio.runs > 0).then_some(ratio.median >= LIMIT_TARGET),
            ratio,
            min_ratio: LIMIT_TARGET,
        }
    }
}

/// A markdown table of limit rows.
pub fn markdown(title: &str, rows: &[LimitResult], cipher: &Summary) -> String {
    let mut s = format!(
        "\n{title}: the limit is 1 / (1/ceiling + 1/(cores × cipher)) per run, with the \
         ceiling the best of the unencrypted targets named and cores × cipher (AES-256-XTS on \
         every core at once) measured in the same round: {} MiB/s.\n\n\
         | job | ours | ceiling (best of) | limit MiB/s | ours ÷ limit | goal | |\n\
         |---|---|---|---|---|---|---|\n",
        cipher.show(0)
    );
    for r in rows {
        let verdict = match r.met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "not measured",
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | ≥ {} | {verdict} |\n",
            r.job,
            r.ours,
            r.ceiling_of.join(", "),
            r.limit_mib_s.show(0),
            r.ratio.show(2),
            r.min_ratio
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_adds_the_costs_per_byte() {
        assert!((limit(1000.0, 1000.0) - 500.0).abs() < 1e-9);
        assert!((limit(3000.0, 6000.0) - 2000.0).abs() < 1e-9);
        assert!(limit(0.0, 1000.0).is_nan());
        assert!(limit(f64::NAN, 1000.0).is_nan());
    }

    #[test]
    fn ratios_are_taken_run_by_run_against_the_best_ceiling() {
        // Run 0: ceilings 1000 and 3000 (best 3000), cipher 6000: limit 2000; ours 1800: 0.9.
        // Run 1: best ceiling 1500, cipher 3000: limit 1000; ours 500: 0.5.
        // Run 2: best 600 (one candidate missing), cipher 600: limit 300; ours 300: 1.0.
        let r = LimitResult::of(
            "1M write",
            ("ours", &[1800.0, 500.0, 300.0]),
            &[("a", &[1000.0, 1500.0, 600.0]), ("b", &[3000.0, 1200.0])],
            &[6000.0, 3000.0, 600.0],
        );
        assert_eq!(r.ratio.runs, 3);
        assert!((r.ratio.median - 0.9).abs() < 1e-9, "{:?}", r.ratio);
        assert!((r.ratio.min - 0.5).abs() < 1e-9);
        assert!((r.ratio.max - 1.0).abs() < 1e-9);
        assert!((r.limit_mib_s.median - 1000.0).abs() < 1e-9);
        assert_eq!(r.met, Some(true));
        let below = LimitResult::of("x", ("o", &[100.0]), &[("a", &[1000.0])], &[1000.0]);
        assert_eq!(below.met, Some(false));
        let none = LimitResult::of("x", ("o", &[]), &[("a", &[1000.0])], &[1000.0]);
        assert_eq!(none.met, None);
    }

    #[test]
    fn the_cipher_is_measured_on_every_core() {
        let mib_s = cipher_x_cores_mib_s(Duration::from_millis(50));
        assert!(mib_s.is_finite() && mib_s > 10.0, "{mib_s}");
    }
}
