//! Many volumes open at once on one host: N LUKS2 volumes opened with `ucrypt open ...
//! --front-end fuse` (a daemon each), one 4 KiB block written and read back through each,
//! `ucrypt list` showing all N active, then all closed, and nothing left: no daemon, no state
//! directory, no stable name, no FUSE mount.
//!
//! N is 100; `UCRYPT_MANY_VOLUMES=1000` (the long mode, like the other tests' count variables)
//! opens a thousand. Formats, opens and closes run in [`WORKERS`] parallel streams, each
//! command with a generous deadline, so that a loaded 2-core machine passes and a hang fails.
//!
//! Needs root and /dev/fuse; otherwise it prints `SKIPPED: reason`. Names carry the test's pid,
//! so that runs in other checkouts do not collide.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{is_root, s, TempDir, FAST_PBKDF2, UCRYPT};
use kit::{skip, wait_timeout};

/// Volumes opened by default (CI) and the variable that asks for another number.
const VOLUMES_DEFAULT: usize = 100;
const VOLUMES_VAR: &str = "UCRYPT_MANY_VOLUMES";
/// Commands run at once: more than the CI machine's 2 cores, since `open` waits on the
/// daemon's start as much as it computes.
const WORKERS: usize = 4;
/// Longest one `format`, `open` or `close` may take on a loaded machine before the test fails.
const COMMAND_WAIT: Duration = Duration::from_secs(120);
/// Longest a closed volume's daemon may take to be gone.
const EXIT_WAIT: Duration = Duration::from_secs(30);
/// Each image: a LUKS2 header with a [`KEYSLOTS_BYTES`] keyslots area (data from 1 MiB) and 1
/// MiB of data.
const IMAGE_BYTES: u64 = 2 << 20;
/// Room for one 512-bit key's keyslot: the default area (16 MiB less the metadata) is written
/// whole at format, 1.6 GB for a hundred volumes.
const KEYSLOTS_BYTES: &str = "524288";
const BLOCK: usize = 4096;
const PASSPHRASE: &[u8] = b"many volumes passphrase";
const RUN_DIR: &str = "/run/ucrypt";
const DEV_DIR: &str = "/dev/ucrypt";

/// More time `ucrypt list` may take per open volume: it asks each daemon for its status,
/// and each status reads every process's descriptors (whether the device is in use), so a
/// thousand volumes take about a minute (BENCHMARKS.md, "A thousand volumes").
const LIST_WAIT_PER_VOLUME: Duration = Duration::from_secs(1);

/// Runs `ucrypt ARGS` with [`COMMAND_WAIT`]: Ok, or what went wrong.
fn ucrypt(args: &[&str]) -> Result<String, String> {
    ucrypt_within(args, COMMAND_WAIT)
}

/// Runs `ucrypt ARGS`, allowed `wait`: its stdout, or what went wrong. Its output is read
/// while it runs (a `list` of many volumes fills a pipe's buffer before it exits).
fn ucrypt_within(args: &[&str], wait: Duration) -> Result<String, String> {
    let mut child = Command::new(UCRYPT)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("ucrypt {args:?}: {e}"))?;
    let drain = |p: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut p) = p {
                let _ = p.read_to_end(&mut v);
            }
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let code = wait_timeout(&mut child, wait);
    let timed_out = code.is_none() && matches!(child.try_wait(), Ok(None));
    if timed_out {
        let _ = child.kill();
    }
    let _ = child.wait();
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    match code {
        Some(0) => Ok(out),
        _ if timed_out => Err(format!("ucrypt {args:?} took over {wait:?}")),
        c => Err(format!("ucrypt {args:?} exited {c:?}: {}", err.trim())),
    }
}

/// Runs `f(i)` for i in 0..n on [`WORKERS`] threads; the first error.
fn parallel(n: usize, f: impl Fn(usize) -> Result<(), String> + Sync) -> Result<(), String> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|_| {
                sc.spawn(|| -> Result<(), String> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return Ok(());
                        }
                        f(i)?;
                    }
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a worker panicked".to_string()))
            })
            .collect::<Result<Vec<()>, String>>()
            .map(drop)
    })
}

/// The volumes' names; any still open are closed on drop (a failing test leaves nothing).
struct Names(Vec<String>);

impl Drop for Names {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new(UCRYPT)
                .args(["close", n])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A 4 KiB-aligned block of `buf` (O_DIRECT wants aligned memory).
fn aligned(buf: &mut [u8]) -> &mut [u8] {
    let off = buf.as_ptr().align_offset(BLOCK);
    &mut buf[off..off + BLOCK]
}

/// Writes block `i`'s pattern at a block of the volume chosen by `i`, O_DIRECT, and reads it
/// back.
fn write_read(dev: &Path, i: usize) -> Result<(), String> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(|e| format!("{}: {e}", dev.display()))?;
    let blocks = f
        .metadata()
        .map_err(|e| e.to_string())?
        .len()
        .checked_div(BLOCK as u64)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{} is empty", dev.display()))?;
    let at = (i as u64 * 7919 % blocks) * BLOCK as u64;
    let mut wbuf = vec![0u8; 2 * BLOCK];
    let w = aligned(&mut wbuf);
    for (k, b) in w.iter_mut().enumerate() {
        *b = (k as u64 * 31 + i as u64) as u8;
    }
    f.write_all_at(w, at)
        .map_err(|e| format!("write {}: {e}", dev.display()))?;
    let mut rbuf = vec![0u8; 2 * BLOCK];
    let r = aligned(&mut rbuf);
    f.read_exact_at(r, at)
        .map_err(|e| format!("read {}: {e}", dev.display()))?;
    if r != w {
        return Err(format!(
            "{}: block at {at} read back differs",
            dev.display()
        ));
    }
    Ok(())
}

fn pid_of(name: &str) -> Result<u32, String> {
    let p = Path::new(RUN_DIR).join(name).join("pid");
    std::fs::read_to_string(&p)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| format!("no daemon pid in {}", p.display()))
}

/// Whether `pid` is a live process still running ucrypt (not a zombie, not reused).
fn ucrypt_alive(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    !status.is_empty()
        && !status.contains("State:\tZ")
        && String::from_utf8_lossy(&cmd).contains("ucrypt")
}

/// What of volume `name` is left: state directory, stable name, FUSE mount.
fn leftovers(name: &str, mounts: &str) -> Vec<String> {
    let mut left = Vec::new();
    for p in [Path::new(RUN_DIR).join(name), Path::new(DEV_DIR).join(name)] {
        if std::fs::symlink_metadata(&p).is_ok() {
            left.push(p.display().to_string());
        }
    }
    if mounts.contains(&format!("ucrypt:{name} ")) {
        left.push(format!("FUSE mount ucrypt:{name}"));
    }
    left
}

#[test]
fn hundred_volumes_open_list_close() {
    if !is_root() {
        skip("not root (FUSE volumes at /dev/ucrypt/NAME)");
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        skip("/dev/fuse missing (modprobe fuse)");
        return;
    }
    let n: usize = std::env::var(VOLUMES_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(VOLUMES_DEFAULT);
    let t = TempDir::new("many");
    let key = t.file("key", PASSPHRASE);
    let imgs: Vec<PathBuf> = (0..n).map(|i| t.path(&format!("v{i}.img"))).collect();
    let mut names = Names(
        (0..n)
            .map(|i| format!("many-{}-{i}", std::process::id()))
            .collect(),
    );
    let t0 = Instant::now();

    parallel(n, |i| {
        std::fs::File::create(&imgs[i])
            .and_then(|f| f.set_len(IMAGE_BYTES))
            .map_err(|e| e.to_string())?;
        let mut a = vec!["format", "-q", "--key-file", s(&key)];
        a.extend(FAST_PBKDF2);
        a.extend(["--luks2-keyslots-size", KEYSLOTS_BYTES, s(&imgs[i])]);
        ucrypt(&a).map(drop)
    })
    .unwrap();
    let t_format = t0.elapsed();

    parallel(n, |i| {
        let a = [
            "open",
            s(&imgs[i]),
            &names.0[i],
            "--key-file",
            s(&key),
            "--front-end",
            "fuse",
        ];
        ucrypt(&a).map(drop)
    })
    .unwrap();
    let t_open = t0.elapsed();

    parallel(n, |i| write_read(&Path::new(DEV_DIR).join(&names.0[i]), i)).unwrap();
    let t_io = t0.elapsed();

    let listed = ucrypt_within(&["list"], COMMAND_WAIT + LIST_WAIT_PER_VOLUME * n as u32).unwrap();
    let t_list = t0.elapsed();
    for name in &names.0 {
        let line = listed
            .lines()
            .find(|l| l.split(' ').next() == Some(name.as_str()))
            .unwrap_or_else(|| panic!("{name} not in ucrypt list:\n{listed}"));
        assert!(line.ends_with(" active"), "{line}");
    }
    let pids: Vec<u32> = names.0.iter().map(|n| pid_of(n).unwrap()).collect();

    parallel(n, |i| ucrypt(&["close", &names.0[i]]).map(drop)).unwrap();
    let t_close = t0.elapsed();

    let deadline = Instant::now() + EXIT_WAIT;
    while pids.iter().any(|&p| ucrypt_alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let alive: Vec<u32> = pids.iter().copied().filter(|&p| ucrypt_alive(p)).collect();
    assert!(alive.is_empty(), "daemons still running: {alive:?}");
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let left: Vec<String> = names.0.iter().flat_map(|n| leftovers(n, &mounts)).collect();
    assert!(left.is_empty(), "left after close: {left:?}");
    // All closed: nothing for the guard to do.
    names.0.clear();
    println!(
        "{n} volumes, {WORKERS} at a time: format {:.1} s, open {:.1} s, write+read {:.1} s, \
         list {:.2} s, close {:.1} s, total {:.1} s",
        t_format.as_secs_f64(),
        (t_open - t_format).as_secs_f64(),
        (t_io - t_open).as_secs_f64(),
        (t_list - t_io).as_secs_f64(),
        (t_close - t_list).as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
