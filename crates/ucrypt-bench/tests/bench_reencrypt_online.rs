//! `ucrypt-bench reencrypt --online --quick --runs 1 --json` end to end: a small volume opened
//! by the `ucrypt` of this build, fio before and during an online rotation, the offline
//! rotation beside it, idle and with busy threads. A smoke test of the scenario, so that it
//! cannot rot: each row has positive numbers and the verdicts are there; the numbers
//! themselves are the benchmark's report (BENCHMARKS.md), not checked here. Without root,
//! FUSE, loop or fio the scenario reports SKIPPED with the reason, and so does this test.

use std::path::Path;
use std::process::Command;

#[test]
fn bench_reencrypt_online_quick_measures_both_jobs_idle_and_busy() {
    let bench = env!("CARGO_BIN_EXE_ucrypt-bench");
    let ucrypt = Path::new(bench).with_file_name("ucrypt");
    assert!(
        ucrypt.is_file(),
        "{} missing: build ucrypt-cli too (cargo test -p ucrypt-cli -p ucrypt-bench)",
        ucrypt.display()
    );
    let out = Command::new(bench)
        .args(["reencrypt", "--online", "--quick", "--runs", "1", "--json"])
        .env("UCRYPT_BIN", &ucrypt)
        .output()
        .expect("run ucrypt-bench reencrypt --online");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "bench reencrypt --online failed:\n{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    if let Some(why) = v["skipped"].as_str() {
        println!("SKIPPED: {why}");
        return;
    }
    let rows = v["rows"].as_array().expect("rows");
    let keys: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["job"].as_str().unwrap_or_default().to_string(),
                r["busy_threads"].as_u64().unwrap_or(99),
            )
        })
        .collect();
    let want: Vec<(String, u64)> = [0, 2]
        .iter()
        .flat_map(|&b| {
            ["4 KiB random read QD1", "1 MiB read QD4"]
                .iter()
                .map(move |j| (j.to_string(), b))
        })
        .collect();
    assert_eq!(keys, want, "the rows, in order");
    for r in rows {
        for field in [
            "before_mib_s",
            "during_mib_s",
            "online_s",
            "offline_s",
            "during_of_before",
            "speed_of_offline",
            "ceiling_during_mib_s",
            "ceiling_of_before",
            "of_ceiling",
        ] {
            let m = r[field]["median"].as_f64().unwrap_or(0.0);
            assert!(
                m > 0.0,
                "{} busy {}: {field} {m}",
                r["job"],
                r["busy_threads"]
            );
        }
    }
    let verdicts = v["verdicts"].as_array().expect("verdicts");
    assert_eq!(verdicts.len(), 2);
    for vd in verdicts {
        for goal in ["foreground_met", "rotation_met", "ceiling_met"] {
            assert!(vd[goal].is_boolean(), "{goal}: {vd}");
        }
    }
}
