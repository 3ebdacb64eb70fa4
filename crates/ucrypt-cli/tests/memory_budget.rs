//! `open --memory-budget` under load: N volumes (each its own daemon, FUSE front end and an
//! NBD socket beside it), each written by `nbdcopy` with 16 requests of 1 MiB in flight, share a budget smaller than what their pools would grow to
//! alone. Nothing fails, every acknowledged write reads back, and while they write the locked
//! memory of all the daemons together (`VmLck`) and the bytes charged to the budget stay
//! within the budget plus what each volume may hold uncharged (its 256 KiB reserve, its keys).
//!
//! `UCRYPT_BUDGET_VOLUMES` sets N (default 8; the long mode recorded in BENCHMARKS.md runs
//! 100, with `UCRYPT_BUDGET_BYTES` 64 MiB). The budget is N × 128 KiB unless that says: far less than what 16 requests per volume would take
//! beyond their reserves (a 256 KiB piece each), so the pools must wait for each other.
//! Needs root, /dev/fuse and nbdcopy: SKIPPED otherwise. Names carry the test's pid.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{have, is_root, run, s, text, TempDir, FAST_PBKDF2, UCRYPT};

const PASSPHRASE: &[u8] = b"memory budget passphrase";
/// Each volume's data: written `PASSES` times over, read back.
const DATA_MIB: u64 = 8;
const PASSES: usize = 4;
/// What a volume may lock beyond its share of the budget: its pool's reserve (256 KiB), its
/// keys and the cipher contexts of the engine's workers (`--policy parallel`), with room for
/// the sampling's skew (each daemon's `VmLck` is read at a different instant, so the sum may
/// add peaks that were not at once).
const UNCHARGED_PER_VOLUME_BYTES: u64 = 1 << 20;
/// The budget per volume: half a 256 KiB piece.
const BUDGET_PER_VOLUME_BYTES: u64 = 128 << 10;

fn volumes_n() -> usize {
    std::env::var("UCRYPT_BUDGET_VOLUMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

fn ok(prog: &str, args: &[&str]) {
    let o = run(prog, args);
    assert!(o.status.success(), "{prog} {args:?}: {}", text(&o));
}

/// A status field's value (`key: value` lines).
fn status_field(name: &str, key: &str) -> Option<String> {
    let o = run(UCRYPT, &["status", name]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    out.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// `VmLck` of a process, in bytes.
fn vm_lck_bytes(pid: u32) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    st.lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// "B bytes for all volumes, U used by all, C by this one" -> U.
fn used_by_all(budget_line: &str) -> u64 {
    budget_line
        .split(',')
        .nth(1)
        .and_then(|p| p.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("budget: {budget_line}"))
}

struct Open {
    names: Vec<String>,
}

impl Drop for Open {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = run(UCRYPT, &["close", n]);
        }
    }
}

#[test]
fn volumes_under_one_budget_wait_and_never_fail() {
    if !is_root() || !Path::new("/dev/fuse").exists() || !have("nbdcopy") {
        println!("SKIPPED: needs root, /dev/fuse and nbdcopy (libnbd-bin)");
        return;
    }
    let n = volumes_n();
    let budget = std::env::var("UCRYPT_BUDGET_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n as u64 * BUDGET_PER_VOLUME_BYTES);
    let t = TempDir::new("budget");
    let key = t.path("key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    let t0 = Instant::now();
    let mut imgs: Vec<PathBuf> = Vec::new();
    let mut open = Open { names: Vec::new() };
    for i in 0..n {
        let img = t.path(&format!("v{i}.img"));
        std::fs::File::create(&img)
            .and_then(|f| f.set_len((DATA_MIB + 16) << 20))
            .unwrap();
        let mut a = vec!["format", "-q", "--key-file", s(&key)];
        a.extend(FAST_PBKDF2);
        a.push(s(&img));
        ok(UCRYPT, &a);
        let name = format!("budget-{i}-{}", std::process::id());
        let budget_arg = budget.to_string();
        let o = run(
            UCRYPT,
            &[
                "open",
                s(&img),
                &name,
                "--key-file",
                s(&key),
                "--front-end",
                "fuse",
                "--memory-budget",
                &budget_arg,
                // Planned writes take pool grants (an inline write is encrypted in the
                // caller's buffer and takes none).
                "--policy",
                "parallel",
                "--nbd",
                &format!("unix:{}", s(&t.path(&format!("nbd{i}.sock")))),
            ],
        );
        assert_eq!(o.status.code(), Some(0), "open {name}: {}", text(&o));
        open.names.push(name);
        imgs.push(img);
    }
    let opened_s = t0.elapsed().as_secs_f64();
    let pids: Vec<u32> = open
        .names
        .iter()
        .map(|n| {
            status_field(n, "pid")
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("no pid in the status of {n}"))
        })
        .collect();
    // The data: a file per volume, different for each.
    let patterns: Vec<PathBuf> = (0..n)
        .map(|i| {
            let p = t.path(&format!("p{i}"));
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1);
            let data: Vec<u8> = (0..(DATA_MIB << 20) / 8)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()
                })
                .collect();
            std::fs::write(&p, data).unwrap();
            p
        })
        .collect();
    // Sampled while the writers run: the most locked by all daemons together, the most
    // charged to the budget.
    let stop = Arc::new(AtomicBool::new(false));
    let (peak_lck, peak_used) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let sampler = {
        let (stop, peak_lck, peak_used) = (stop.clone(), peak_lck.clone(), peak_used.clone());
        let (pids, first) = (pids.clone(), open.names[0].clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let lck: u64 = pids.iter().map(|&p| vm_lck_bytes(p)).sum();
                peak_lck.fetch_max(lck, Ordering::Relaxed);
                if let Some(b) = status_field(&first, "budget") {
                    peak_used.fetch_max(used_by_all(&b), Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let t1 = Instant::now();
    let writers: Vec<_> = (0..n)
        .map(|i| {
            let uri = format!(
                "nbd+unix:///{}?socket={}",
                open.names[i],
                s(&t.path(&format!("nbd{i}.sock")))
            );
            let pat = patterns[i].clone();
            std::thread::spawn(move || {
                let args = [
                    "--request-size=1048576",
                    "--requests=16",
                    "--flush",
                    s(&pat),
                    &uri,
                ];
                let mut last = None;
                for _ in 0..PASSES {
                    let o = run("nbdcopy", &args);
                    let failed = !o.status.success();
                    last = Some(o);
                    if failed {
                        break;
                    }
                }
                (i, last.expect("one pass at least"))
            })
        })
        .collect();
    for w in writers {
        let (i, o) = w.join().unwrap();
        assert!(o.status.success(), "writer of volume {i}: {}", text(&o));
    }
    let write_s = t1.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    // Every acknowledged write reads back (O_DIRECT: from the volume, not a cache).
    for (i, name) in open.names.iter().enumerate() {
        let back = t.path(&format!("b{i}"));
        ok(
            "dd",
            &[
                &format!("if=/run/ucrypt/{name}/volume"),
                &format!("of={}", s(&back)),
                "bs=1M",
                &format!("count={DATA_MIB}"),
                "iflag=direct",
                "status=none",
            ],
        );
        let (want, got) = (
            std::fs::read(&patterns[i]).unwrap(),
            std::fs::read(&back).unwrap(),
        );
        assert!(
            want == got,
            "volume {i} ({name}) does not read back what was written"
        );
    }
    let (lck, used) = (
        peak_lck.load(Ordering::Relaxed),
        peak_used.load(Ordering::Relaxed),
    );
    let bound = budget + n as u64 * UNCHARGED_PER_VOLUME_BYTES;
    println!(
        "{n} volumes, budget {budget} bytes: opened in {opened_s:.1} s, {} MiB written in \
         {write_s:.1} s; peak VmLck of all daemons {lck} bytes (bound {bound}), peak charged \
         {used} bytes",
        n as u64 * DATA_MIB * PASSES as u64
    );
    assert!(used <= budget, "charged {used} > budget {budget}");
    assert!(lck <= bound, "locked {lck} > {bound}");
    drop(open);
    drop(imgs);
}
