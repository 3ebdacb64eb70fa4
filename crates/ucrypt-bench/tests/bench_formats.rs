//! `ucrypt-bench formats --quick --runs 1 --json` end to end: cryptsetup's BitLocker and
//! VeraCrypt images served by the `ucrypt` of this build (and dislocker-fuse where installed),
//! fio on each, and the VeraCrypt header-key search on every CPU and on one. A smoke test of
//! the scenario, so that it cannot rot: every row has a positive number and every ratio is
//! there; the numbers themselves are the benchmark's report (BENCHMARKS.md), not checked here.
//! SKIPPED, with the reason, without fio, FUSE, cryptsetup or cryptsetup's test images.

use std::path::Path;
use std::process::Command;

fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn bench_formats_quick_measures_every_target() {
    for p in ["fio", "fusermount3", "cryptsetup", "xz"] {
        if !have(p) {
            println!("SKIPPED: {p} not installed");
            return;
        }
    }
    if !Path::new("/dev/fuse").exists() {
        println!("SKIPPED: no /dev/fuse");
        return;
    }
    let bench = env!("CARGO_BIN_EXE_ucrypt-bench");
    let ucrypt = Path::new(bench).with_file_name("ucrypt");
    assert!(
        ucrypt.is_file(),
        "{} missing: build ucrypt-cli too (cargo test -p ucrypt-cli -p ucrypt-bench)",
        ucrypt.display()
    );
    let out = Command::new(bench)
        .args(["formats", "--quick", "--runs", "1", "--json"])
        .env("UCRYPT_BIN", &ucrypt)
        .output()
        .expect("run ucrypt-bench formats");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("cryptsetup's test images not found") {
        println!("SKIPPED: {stderr}");
        return;
    }
    assert!(out.status.success(), "bench formats failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let rows = v["rows"].as_array().expect("rows");
    let has = |server: &str, volume: &str| {
        rows.iter()
            .any(|r| r["target"]["server"] == server && r["target"]["volume"] == volume)
    };
    let dislocker = has("Dislocker", "BitlkXts");
    let tcrypt = has("Ucrypt", "TcryptXts");
    // 4 jobs × (5 ucrypt volumes: 3 BitLocker, LUKS2, no cipher; VeraCrypt's where the test
    // material has it; and 2 dislocker-fuse ones where it is installed).
    let targets = 5 + usize::from(tcrypt) + 2 * usize::from(dislocker);
    assert_eq!(rows.len(), 4 * targets, "{v:#}");
    for r in rows {
        let mib_s = r["mib_s"]["median"].as_f64().unwrap_or(0.0);
        assert!(mib_s > 0.0, "row without a measurement: {r:#}");
    }
    let kdf = v["kdf"].as_array().expect("kdf rows");
    assert!(kdf.len() >= 2, "{v:#}");
    for r in kdf {
        assert!(
            r["seconds"]["median"].as_f64().unwrap_or(0.0) > 0.0,
            "{r:#}"
        );
    }
    let ratios = v["ratios"].as_array().expect("ratios");
    // 4 jobs × (4 ucrypt ratios, the ceiling's included; VeraCrypt's; 3 against
    // dislocker-fuse) + the search's.
    let want = 4 * (4 + usize::from(tcrypt) + 3 * usize::from(dislocker)) + 1;
    assert_eq!(ratios.len(), want, "{v:#}");
    for r in ratios {
        assert!(r["ratio"]["median"].as_f64().unwrap_or(0.0) > 0.0, "{r:#}");
    }
    for (what, there) in [
        ("dislocker-fuse", dislocker),
        ("the VeraCrypt system image", tcrypt),
    ] {
        if !there {
            println!("{what} not here: its rows were SKIPPED");
        }
    }
}
