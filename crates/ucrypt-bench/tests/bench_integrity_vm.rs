//! `ucrypt bench integrity --vm --quick --runs 1 --json` end to end: one boot of the test VM
//! (Debian trixie's kernel under qemu TCG) in which the guest's cryptsetup formats a plain XTS
//! volume and one per authenticated mode, the kernel (dm-crypt over dm-integrity, journal and
//! direct) and `ucrypt ublk` serve each in turn, and the probe measures both. Checks that every
//! row has both sides, positive numbers, the same device size on both sides (smaller for the
//! authenticated volumes than the plain one), ratios that are the quotients of the medians, and
//! dm-integrity in journal and direct mode in the kernel's tables. A
//! smoke test of the scenario: the numbers are the benchmark's report (BENCHMARKS.md).
//!
//! Needs qemu and the VM kit (tests/vm/install-deps.sh) and the `ucrypt` binary beside
//! `ucrypt-bench` (`cargo test --workspace` builds both): SKIPPED otherwise, failed under CI.
//! About two and a half minutes on this project's 2-core machine (158 s, 157 of them in the
//! VM, with other builds running).

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::process::Command;

const ROWS: [&str; 7] = [
    "plain aes-xts-plain64",
    "aes-gcm-random + aead (journal)",
    "aes-gcm-random + aead (direct)",
    "chacha20-random + poly1305 (journal)",
    "chacha20-random + poly1305 (direct)",
    "aes-xts-random + hmac-sha256 (journal)",
    "aes-xts-random + hmac-sha256 (direct)",
];

#[test]
fn bench_integrity_vm_fills_the_kernel_column() {
    if vm::require_trixie_vm("bench_integrity_vm").is_none() {
        return;
    }
    let bench = env!("CARGO_BIN_EXE_ucrypt-bench");
    if kit::sibling_bin("bench_integrity_vm", bench, "ucrypt").is_none() {
        return;
    }
    let out = Command::new(bench)
        .args(["integrity", "--vm", "--quick", "--runs", "1", "--json"])
        .output()
        .expect("run ucrypt-bench integrity --vm");
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stderr}");
    assert!(
        out.status.success(),
        "bench integrity --vm failed:\n{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let k = &v["kernel_vm"];
    assert_eq!(k["status"], "measured", "kernel column: {k}");
    assert!(
        k["kernel"].as_str().is_some_and(|s| s.starts_with("6.")),
        "guest kernel: {}",
        k["kernel"]
    );
    let rows = k["rows"].as_array().expect("rows");
    let names: Vec<&str> = rows.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ROWS, "the VM rows, in order");
    let med = |side: &serde_json::Value, f: &str| side[f]["median"].as_f64().unwrap_or(0.0);
    let plain = &rows[0];
    for r in rows {
        for side in ["kernel", "ucrypt"] {
            let s = &r[side];
            let p = &plain[side];
            for f in ["read_mib_s", "write_mib_s", "read_4k_us", "write_4k_us"] {
                assert!(med(s, f) > 0.0, "{} {side}: {f} = {}", r["name"], s[f]);
            }
            // Throughput this / plain; latency plain / this.
            let want = [
                ("read", med(s, "read_mib_s") / med(p, "read_mib_s")),
                ("write_4k", med(p, "write_4k_us") / med(s, "write_4k_us")),
            ];
            for (f, x) in want {
                let got = s["ratios"][f].as_f64().unwrap_or(f64::NAN);
                assert!(
                    (got - x).abs() < 1e-9,
                    "{} {side} {f}: {got} vs {x}",
                    r["name"]
                );
            }
        }
        // Both sides see the same data area: ucrypt computed from the kernel's superblock the
        // sectors dm-integrity provides, and an authenticated volume provides fewer than the
        // plain one on an image of the same size (its tags and journal take the rest).
        let bytes = |side: &str| r[side]["device_bytes"].as_u64().unwrap_or(0);
        assert_eq!(
            bytes("kernel"),
            bytes("ucrypt"),
            "{}: device sizes",
            r["name"]
        );
        let plain_bytes = plain["kernel"]["device_bytes"].as_u64().unwrap_or(0);
        if r["name"] != plain["name"] {
            assert!(
                bytes("kernel") > 0 && bytes("kernel") < plain_bytes,
                "{}: {} bytes, plain {plain_bytes}",
                r["name"],
                bytes("kernel")
            );
        }
        for f in ["read", "write", "read_4k", "write_4k"] {
            let q = r["ucrypt_over_kernel"][f].as_f64().unwrap_or(f64::NAN);
            assert!(
                q.is_finite() && q > 0.0,
                "{}: {f} ratio of ratios {q}",
                r["name"]
            );
        }
        let q = r["ucrypt_over_kernel"]["read"].as_f64().unwrap_or(f64::NAN);
        let x = r["ucrypt"]["ratios"]["read"].as_f64().unwrap_or(f64::NAN)
            / r["kernel"]["ratios"]["read"].as_f64().unwrap_or(f64::NAN);
        assert!(
            (q - x).abs() < 1e-9,
            "{}: ratio of ratios {q} vs {x}",
            r["name"]
        );
    }
    // The kernel really ran the authenticated modes over dm-integrity, both modes.
    let setup = k["kernel_setup"].to_string();
    for want in [" integrity ", " J ", " D "] {
        assert!(
            setup.contains(want),
            "no {want:?} in the kernel's tables: {setup}"
        );
    }
}
