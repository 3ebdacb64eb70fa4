//! `ucrypt-bench integrity --quick --runs 1 --json` end to end: every authenticated mode opens
//! its volume (a superblock and an initialised journal, as `ucrypt format` writes them), and
//! each row has positive numbers. A smoke test of the scenario: the numbers themselves are the
//! benchmark's report (BENCHMARKS.md), not checked here.

use std::process::Command;

const ROWS: [&str; 13] = [
    "plain aes-xts-plain64 (policy auto)",
    "plain aes-xts-plain64 (policy inline)",
    "aes-gcm-random + aead",
    "aegis128-random + aead",
    "chacha20-random + poly1305",
    "aes-xts-random + hmac-sha256",
    "aes-xts-random + hmac-sha512",
    "aes-gcm-random + aead (policy inline)",
    "aegis128-random + aead (policy inline)",
    "chacha20-random + poly1305 (policy inline)",
    "aes-xts-random + hmac-sha256 (policy inline)",
    "aes-xts-random + hmac-sha512 (policy inline)",
    "aes-gcm-random + aead (journal)",
];

#[test]
fn bench_integrity_quick_measures_every_mode() {
    let out = Command::new(env!("CARGO_BIN_EXE_ucrypt-bench"))
        .args(["integrity", "--quick", "--runs", "1", "--json"])
        .output()
        .expect("run ucrypt-bench integrity");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench integrity failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let rows = v["rows"].as_array().expect("rows");
    let names: Vec<&str> = rows.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ROWS, "the rows, in order");
    for r in rows {
        for field in ["read_mib_s", "write_mib_s"] {
            let m = r[field]["median"].as_f64().unwrap_or(0.0);
            assert!(m > 0.0, "{}: {field} median {m}", r["name"]);
        }
    }
}
