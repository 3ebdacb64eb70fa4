//! An interrupted `ucrypt-bench vhost` leaves nothing running. For each of SIGINT, SIGTERM and
//! SIGKILL, sent to the benchmark alone (not to its process group, as `kill PID` does) once the
//! VM's qemu runs beside the four backends: every process the benchmark started
//! (qemu-storage-daemon twice, `ucrypt vhost`, `ucrypt serve`, run-in-vm.sh with its `timeout`,
//! qemu and console pipeline) is gone within [`EXIT_WAIT`]. After SIGINT and SIGTERM the
//! benchmark also exits with an error that says it was interrupted, and has removed its images.
//!
//! This test process makes itself a child subreaper (PR_SET_CHILD_SUBREAPER): the orphans of a
//! killed benchmark become its children, so a survivor is found rather than lost to init; it
//! reaps them as they exit, as init would.
//!
//! Needs what the scenario needs (qemu and the VM kit, qemu-storage-daemon, fio, cryptsetup)
//! and the `ucrypt` binary beside `ucrypt-bench` (`cargo test --workspace` builds both):
//! SKIPPED otherwise, failed under CI. About a minute per signal on this project's 2-core
//! machine (formatting, the backends' start, the VM's start).

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long the benchmark may take to reach its VM (the first run builds the VM's initramfs).
const QEMU_WAIT: Duration = Duration::from_secs(300);
/// How long the benchmark may take to exit after SIGINT or SIGTERM (its servers stop, its
/// images go).
const BENCH_EXIT_WAIT: Duration = Duration::from_secs(120);
/// How long the processes it started may take to go once it has exited.
const EXIT_WAIT: Duration = Duration::from_secs(30);
/// qemu's command name as /proc/PID/stat shows it (15 bytes at most).
const QEMU_COMM: &str = "qemu-system-x86";

/// (pid, parent pid, command name) of every process.
fn processes() -> Vec<(i32, i32, String)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (open, close) = (stat.find('(')?, stat.rfind(')')?);
        let comm = stat[open + 1..close].to_string();
        let mut f = stat[close + 2..].split_whitespace();
        let state = f.next()?;
        let ppid = f.next()?.parse().ok()?;
        // A zombie has ended; only its parent's wait is left.
        (state != "Z").then_some((pid, ppid, comm))
    })
    .collect()
}

/// The living descendants of `root`: (pid, command name).
fn descendants(root: i32) -> Vec<(i32, String)> {
    let all = processes();
    let mut out: Vec<(i32, String)> = Vec::new();
    let mut parents = vec![root];
    while let Some(p) = parents.pop() {
        for (pid, ppid, comm) in &all {
            if *ppid == p && !out.iter().any(|(q, _)| q == pid) {
                out.push((*pid, comm.clone()));
                parents.push(*pid);
            }
        }
    }
    out
}

/// Reaps every child of this process that has exited (the benchmark's orphans are ours).
fn reap_exited() {
    loop {
        // SAFETY: waitpid with a null status pointer and WNOHANG only reaps exited children.
        let r = unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) };
        if r <= 0 {
            return;
        }
    }
}

/// Reaps the exited orphans this process adopted, leaving `keep` (the benchmark) to its
/// `Child`: a subreaper that does not reap keeps its zombies' pids alive to `kill(pid, 0)`,
/// which `tail --pid` and the like take for a process still running.
fn reap_adopted(keep: i32) {
    let me = std::process::id().to_string();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let mut f = stat[close + 2..].split_whitespace();
        if pid != keep && f.next() == Some("Z") && f.next() == Some(me.as_str()) {
            // SAFETY: waitpid on an exited child of this process, with a null status pointer.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        }
    }
}

/// The benchmark's leftovers in the image directory.
fn images_left(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default()
}

/// One run of the benchmark interrupted by `sig`; the failures found, one line each.
fn interrupt_once(bench: &str, ucrypt: &Path, images: &Path, sig: i32, name: &str) -> Vec<String> {
    let log = images.with_extension(format!("{name}.log"));
    let out = std::fs::File::create(&log).expect("bench log");
    let mut child = Command::new(bench)
        .args(["vhost", "--quick", "--runs", "1"])
        .env("UCRYPT_BIN", ucrypt)
        .env("UCRYPT_BENCH_DISK_DIR", images)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .expect("run ucrypt-bench vhost");
    let pid = child.id() as i32;
    let t0 = Instant::now();
    let mut failures = Vec::new();
    let started = loop {
        let d = descendants(pid);
        if d.iter().any(|(_, c)| c == QEMU_COMM) {
            break Some(d);
        }
        if child.try_wait().expect("wait").is_some() || t0.elapsed() > QEMU_WAIT {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let Some(started) = started else {
        let _ = child.kill();
        let _ = child.wait();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        return vec![format!("{name}: the benchmark never started qemu:\n{text}")];
    };
    let names: Vec<&str> = started.iter().map(|(_, c)| c.as_str()).collect();
    println!("{name}: sending to the benchmark; its processes: {names:?}");
    for want in ["qemu-storage-da", "ucrypt", "run-in-vm.sh", "timeout"] {
        if !names.contains(&want) {
            failures.push(format!("{name}: no {want} among the benchmark's processes"));
        }
    }
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(pid, sig) };
    let bench_pid = child.id() as i32;
    let code = kit::wait_timeout_doing(&mut child, BENCH_EXIT_WAIT, || reap_adopted(bench_pid));
    if child.try_wait().expect("wait").is_none() {
        failures.push(format!(
            "{name}: the benchmark did not exit within {BENCH_EXIT_WAIT:?}"
        ));
        let _ = child.kill();
        let _ = child.wait();
    }
    let t1 = Instant::now();
    let mut left = descendants(std::process::id() as i32);
    while !left.is_empty() && t1.elapsed() < EXIT_WAIT {
        std::thread::sleep(Duration::from_millis(200));
        reap_exited();
        left = descendants(std::process::id() as i32);
    }
    if !left.is_empty() {
        failures.push(format!(
            "{name}: still running {EXIT_WAIT:?} after the benchmark exited: {left:?}"
        ));
        for (p, _) in &left {
            // SAFETY: kill(2) on a leftover of this test's run (our descendant).
            unsafe { libc::kill(*p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(500));
        reap_exited();
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    if sig != libc::SIGKILL {
        if code != Some(1) || !text.contains("interrupted by a signal") {
            failures.push(format!(
                "{name}: the benchmark exited with {code:?}, not as interrupted:\n{text}"
            ));
        }
        let files = images_left(images);
        if !files.is_empty() {
            failures.push(format!("{name}: images left behind: {files:?}"));
        }
    }
    for f in images_left(images) {
        let _ = std::fs::remove_dir_all(&f);
    }
    let _ = std::fs::remove_file(&log);
    failures
}

#[test]
fn interrupted_vhost_bench_leaves_no_process() {
    if let Err(why) = kit::vm::require_vm() {
        println!("SKIPPED interrupted_vhost_bench_leaves_no_process: {why}");
        return;
    }
    for (p, pkg) in [
        ("qemu-storage-daemon", "qemu-system-common"),
        ("fio", "fio"),
        ("cryptsetup", "cryptsetup-bin"),
    ] {
        if !kit::have(p) {
            assert!(
                !kit::under_ci(),
                "{p} not installed (apt-get install {pkg})"
            );
            println!("SKIPPED interrupted_vhost_bench_leaves_no_process: {p} not installed");
            return;
        }
    }
    let bench = env!("CARGO_BIN_EXE_ucrypt-bench");
    let test = "interrupted_vhost_bench_leaves_no_process";
    let Some(ucrypt) = kit::sibling_bin(test, bench, "ucrypt") else {
        return;
    };
    // SAFETY: prctl on this process only; it changes who inherits its descendants' orphans.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
    assert_eq!(r, 0, "PR_SET_CHILD_SUBREAPER");
    // On disk, as the scenario asks (/tmp may be a tmpfs).
    let images =
        Path::new("/var/tmp").join(format!("ucrypt-vhost-interrupt-{}", std::process::id()));
    std::fs::create_dir_all(&images).expect("image directory");
    let mut failures = Vec::new();
    for (sig, name) in [
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGKILL, "SIGKILL"),
    ] {
        failures.extend(interrupt_once(bench, &ucrypt, &images, sig, name));
    }
    let _ = std::fs::remove_dir_all(&images);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
