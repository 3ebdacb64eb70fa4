//! `ucrypt bench all --quick --runs 1` end to end: the results folder holds a report, JSON that
//! parses with the documented shape, and the plots; `bench compare` of a file with itself finds
//! no change. A smoke test of the command (its numbers are not checked: speed targets live in
//! the benchmark's own report). It runs as users do, `ucrypt bench ...`, which hands over to
//! the `ucrypt-bench` binary beside `ucrypt` (`cargo test --workspace` builds both). It leaves
//! out `vhost` (`--skip vhost`), whose emulated guest takes many minutes even with `--quick`;
//! bench_vhost_interrupt.rs starts that scenario.

use std::path::Path;
use std::process::Command;

/// The `ucrypt` binary of this build: it sits beside `ucrypt-bench`.
fn ucrypt() -> Command {
    let bin = Path::new(env!("CARGO_BIN_EXE_ucrypt-bench")).with_file_name("ucrypt");
    assert!(
        bin.is_file(),
        "{} missing: run the tests with --workspace",
        bin.display()
    );
    Command::new(bin)
}

fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

#[test]
fn bench_all_quick_writes_report_json_and_plots() {
    let dir = std::env::temp_dir().join(format!("ucrypt-bench-all-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = ucrypt()
        .args([
            "bench", "all", "--quick", "--runs", "1", "--skip", "vhost", "--out",
        ])
        .arg(&dir)
        .output()
        .expect("run ucrypt bench all");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench all failed:\n{stderr}");
    assert!(
        stderr.contains("[1/4] cipher") && stderr.contains("[4/4] nbd"),
        "no progress lines:\n{stderr}"
    );
    assert!(!stderr.contains("vhost"), "--skip vhost ran it:\n{stderr}");

    let all: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("all.json")).expect("all.json"))
            .expect("all.json parses");
    assert_eq!(all["schema"], 1);
    for key in ["host", "started_utc", "command", "timings"] {
        assert!(!all[key].is_null(), "all.json lacks {key}");
    }
    assert!(all["host"]["cpu_model"].is_string());
    let skipped = all["skipped"].as_array().expect("skipped is an array");
    for scenario in ["cipher", "engine", "fuse", "nbd"] {
        let report = &all[scenario];
        let why: Vec<&serde_json::Value> = skipped
            .iter()
            .filter(|s| s["scenario"] == scenario)
            .collect();
        if report.is_null() {
            // Only the front ends may be missing (no FUSE, peers not installed), and never in CI.
            assert!(
                matches!(scenario, "fuse" | "nbd") && !why.is_empty() && !in_ci(),
                "{scenario} missing from all.json (skipped: {why:?})"
            );
            println!("SKIPPED bench_all {scenario}: {why:?}");
            continue;
        }
        assert_eq!(report["schema"], 1, "{scenario} schema");
        assert!(
            dir.join(format!("{scenario}.json")).is_file(),
            "{scenario}.json missing"
        );
        for w in &why {
            let reason = w["reason"].as_str().unwrap_or_default();
            // A kernel switch left off (FUSE-over-io_uring) is the machine's choice; a peer
            // that is not installed is not, in CI (deps.sh installs them all).
            assert!(
                !(in_ci() && reason.contains("not installed")),
                "{scenario} skipped a peer in CI: {reason}"
            );
            println!("SKIPPED bench_all {scenario} part: {reason}");
        }
    }
    let engine_rows = all["engine"]["rows"].as_array().expect("engine rows");
    assert!(engine_rows.iter().any(|r| r["block_bytes"].is_u64()));
    assert!(engine_rows.iter().any(|r| r["threads"].is_u64()));
    assert!(engine_rows.iter().any(|r| r["cdf"].is_array()));
    assert!(!all["engine"]["breakdown"]
        .as_array()
        .expect("breakdown")
        .is_empty());

    // The durable-write job on disk: measured for ucrypt and nbdkit, or skipped with a reason
    // (a RAM-backed /var/tmp).
    if let Some(nbd) = all.get("nbd").filter(|v| !v.is_null()) {
        let on_disk = |target: &str| {
            nbd["rows"].as_array().is_some_and(|rows| {
                rows.iter().any(|r| {
                    r["target"] == target
                        && r["job"]["name"]
                            .as_str()
                            .is_some_and(|n| n.contains("on disk"))
                        && r["mib_s"]["median"].as_f64().is_some_and(|m| m > 0.0)
                })
            })
        };
        // The QD1 jobs with fio and the server pinned to one CPU ran (pinning worked).
        let one_cpu = nbd["rows"].as_array().is_some_and(|rows| {
            rows.iter().any(|r| {
                r["target"] == "ucrypt-luks2"
                    && r["job"]["cpus"] == "one"
                    && r["mib_s"]["median"].as_f64().is_some_and(|m| m > 0.0)
            })
        });
        assert!(one_cpu, "no one-CPU QD1 row for ucrypt");
        if nbd["disk_image_dir"].is_string() {
            assert!(on_disk("ucrypt-luks2"), "no durable-write row for ucrypt");
            assert!(on_disk("nbdkit-luks1"), "no durable-write row for nbdkit");
        } else {
            let why: Vec<&str> = skipped
                .iter()
                .filter_map(|s| s["reason"].as_str())
                .filter(|r| r.contains("disk jobs") || r.contains("qemu-img jobs"))
                .collect();
            assert!(!why.is_empty(), "disk jobs neither ran nor were skipped");
            println!("SKIPPED bench_all nbd disk jobs: {why:?}");
        }
    }

    let report = std::fs::read_to_string(dir.join("report.md")).expect("report.md");
    for want in [
        "## Machine",
        "## Scenario: engine",
        "## Where time went",
        "plots/engine-latency-cdf-busy.svg",
    ] {
        assert!(report.contains(want), "report.md lacks {want:?}");
    }
    let font = Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists();
    for stem in [
        "engine-block-size-reads",
        "engine-block-size-writes",
        "engine-latency-cdf-idle",
        "engine-latency-cdf-busy",
        "engine-threads",
    ] {
        let svg = std::fs::read_to_string(dir.join("plots").join(format!("{stem}.svg")))
            .unwrap_or_else(|e| panic!("{stem}.svg: {e}"));
        assert!(svg.contains("<svg") && svg.contains("inline"), "{stem}.svg");
        let png = dir.join("plots").join(format!("{stem}.png"));
        if font || in_ci() {
            let bytes = std::fs::read(&png).unwrap_or_else(|e| panic!("{stem}.png: {e}"));
            assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{stem}.png");
        } else {
            println!("SKIPPED bench_all {stem}.png: fonts-dejavu-core not installed");
        }
    }

    let cmp = ucrypt()
        .args(["bench", "compare"])
        .arg(dir.join("all.json"))
        .arg(dir.join("all.json"))
        .output()
        .expect("run ucrypt bench compare");
    let text = String::from_utf8_lossy(&cmp.stdout);
    assert!(cmp.status.success(), "compare failed: {text}");
    assert!(
        text.contains("0 probably real") && text.contains("0 within noise"),
        "compare of a file with itself found changes:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
