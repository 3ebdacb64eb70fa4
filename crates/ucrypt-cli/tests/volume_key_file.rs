//! `--volume-key-file` read as cryptsetup's `tools_read_vk` reads it, by every verb: exactly the
//! key's size (the header's, or --key-size / the cipher's default), so that `/dev/zero` and
//! `/dev/urandom` work; a short file is "Cannot read N bytes from volume key file F." (exit 1);
//! a FIFO nobody writes fails after a bounded wait; a key the header refuses is cryptsetup's
//! "Volume key does not match the volume." (exit 2), not a wrong passphrase. The daemon's
//! `resume` reads it the same way and stays alive whatever the file is.
//!
//! Every ucrypt run here is capped (`prlimit --as`, `timeout`): a reader without a bound fails
//! the test instead of exhausting the machine's memory or hanging it.
//! The daemon test needs root, /dev/fuse, /dev/loop-control; otherwise it prints `SKIPPED`.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{missing_root_rig, run, s, text, TempDir, FAST_PBKDF2, UCRYPT};

/// Address space each ucrypt run may use (the open daemon inherits it): several times what a
/// debug build's daemon maps, far below what an unbounded read of /dev/zero reaches.
const AS_BYTES_MAX: u64 = 3 << 30;

/// How long one verb may take: the FIFO case waits `VOLUME_KEY_FILE_WAIT` (10 s) by design;
/// the rest is slack for a loaded machine.
const VERB_TIMEOUT_S: u64 = 120;

/// `ucrypt ARGS` under the caps; fails the test if it had to be killed.
fn ucrypt(args: &[&str]) -> Output {
    let cap = format!("--as={AS_BYTES_MAX}");
    let t = VERB_TIMEOUT_S.to_string();
    let mut a = vec![t.as_str(), "prlimit", cap.as_str(), UCRYPT];
    a.extend(args);
    let o = run("timeout", &a);
    assert_ne!(
        o.status.code(),
        Some(124),
        "ucrypt {args:?} still running after {VERB_TIMEOUT_S} s"
    );
    o
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).trim().to_string()
}

fn expect(o: &Output, code: i32, line: &str) {
    assert_eq!(o.status.code(), Some(code), "{}", text(o));
    assert!(stderr(o).ends_with(line), "want {line:?}: {}", text(o));
}

fn mkfifo(p: &Path) {
    let o = run("mkfifo", &[s(p)]);
    assert!(o.status.success(), "mkfifo: {}", text(&o));
}

/// A LUKS2 volume of 32 MiB formatted with the volume key read from `vk`.
fn format(t: &TempDir, name: &str, vk: &str) -> String {
    let img = t.image(name, 32);
    let key = t.file("pass", b"volume key file passphrase");
    let mut a = vec![
        "format",
        "-q",
        "--key-file",
        s(&key),
        "--volume-key-file",
        vk,
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = ucrypt(&a);
    assert_eq!(o.status.code(), Some(0), "format from {vk}: {}", text(&o));
    s(&img).to_string()
}

#[test]
fn every_verb_reads_exactly_the_keys_size() {
    let t = TempDir::new("vkfile");
    // format and luksAddKey as cryptsetup's compat-test runs them.
    let img = format(&t, "zero.img", "/dev/zero");
    let new = t.file("new", b"another passphrase");
    let add = |vk: &str| ucrypt(&["luksAddKey", "--volume-key-file", vk, &img, s(&new)]);
    let o = add("/dev/zero");
    assert_eq!(
        o.status.code(),
        Some(0),
        "add-key from /dev/zero: {}",
        text(&o)
    );
    expect(
        &add("/dev/urandom"),
        2,
        "Volume key does not match the volume.",
    );
    let short = t.file("short", [0u8; 10]);
    expect(
        &add(s(&short)),
        1,
        &format!("Cannot read 64 bytes from volume key file {}.", s(&short)),
    );
    // A FIFO nobody writes: refused after the bounded wait.
    let fifo = t.path("fifo");
    mkfifo(&fifo);
    let t0 = Instant::now();
    let o = add(s(&fifo));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains(&format!(
            "Cannot read 64 bytes from volume key file {}",
            s(&fifo)
        )),
        "{}",
        text(&o)
    );
    assert!(
        t0.elapsed() >= Duration::from_secs(9),
        "no wait for a writer"
    );
    // The header kept the one keyslot added.
    let dump = ucrypt(&["luksDump", &img]);
    let slots = String::from_utf8_lossy(&dump.stdout)
        .lines()
        .filter(|l| {
            l.trim_start().starts_with(|c: char| c.is_ascii_digit()) && l.contains(": luks2")
        })
        .count();
    assert_eq!(slots, 2, "{}", text(&dump));

    // The open path (export opens the volume as every front end does).
    let out = t.path("out");
    let o = ucrypt(&["export", &img, s(&out), "--volume-key-file", "/dev/zero"]);
    assert_eq!(o.status.code(), Some(0), "export: {}", text(&o));
    let o = ucrypt(&["export", &img, s(&out), "--volume-key-file", "/dev/urandom"]);
    expect(&o, 2, "Volume key does not match the volume.");
    let o = ucrypt(&["export", &img, s(&out), "--volume-key-file", s(&short)]);
    expect(
        &o,
        1,
        &format!("Cannot read 64 bytes from volume key file {}.", s(&short)),
    );
    // Plain mode: the cipher's default key size, or --key-size.
    let plain = ["--cipher", "aes-xts-plain64", "--volume-key-file"];
    let mut a = vec!["export", &img, s(&out)];
    a.extend(plain);
    a.push("/dev/zero");
    let o = ucrypt(&a);
    assert_eq!(o.status.code(), Some(0), "plain export: {}", text(&o));
    let mut a = vec!["export", &img, s(&out), "--key-size", "256"];
    a.extend(plain);
    a.push(s(&short));
    expect(
        &ucrypt(&a),
        1,
        &format!("Cannot read 32 bytes from volume key file {}.", s(&short)),
    );
    // The key's size read, not the file's, not the file's: 64 bytes of a longer file open it.
    let long = t.file("long", [0u8; 100]);
    let o = ucrypt(&["export", &img, s(&out), "--volume-key-file", s(&long)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

/// `open` and `resume` through the daemon: /dev/zero opens and resumes, /dev/urandom is the
/// wrong key (exit 2, cryptsetup's words), a FIFO nobody writes fails after the bounded wait;
/// the daemon lives through all of it with its memory bounded.
#[test]
fn the_daemon_reads_the_volume_key_file_to_the_key_size() {
    if let Some(why) = missing_root_rig(&[]) {
        println!("SKIPPED: {why}");
        return;
    }
    let t = TempDir::new("vkresume");
    let zeros = t.file("zeros", [0u8; 64]);
    let img = format(&t, "vol.img", s(&zeros));
    let n = format!("vk-resume-{}", std::process::id());
    let open = |vk: &str| {
        ucrypt(&[
            "open",
            &img,
            &n,
            "--volume-key-file",
            vk,
            "--front-end",
            "loop",
        ])
    };
    expect(
        &open("/dev/urandom"),
        2,
        "Volume key does not match the volume.",
    );
    assert!(!Path::new("/run/ucrypt").join(&n).exists());
    let o = open("/dev/zero");
    assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
    let pid = std::fs::read_to_string(Path::new("/run/ucrypt").join(&n).join("pid")).unwrap();
    let pid = pid.trim().to_string();
    struct Close(String);
    impl Drop for Close {
        fn drop(&mut self) {
            let _ = run(UCRYPT, &["close", "--force", &self.0]);
        }
    }
    let _close = Close(n.clone());

    let o = ucrypt(&["suspend", &n]);
    assert_eq!(o.status.code(), Some(0), "suspend: {}", text(&o));
    let resume = |vk: &str| ucrypt(&["resume", &n, "--volume-key-file", vk]);
    expect(
        &resume("/dev/urandom"),
        2,
        "Volume key does not match the volume.",
    );
    let fifo = t.path("fifo");
    mkfifo(&fifo);
    let o = resume(s(&fifo));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).starts_with(&format!(
            "Cannot read 64 bytes from volume key file {}",
            s(&fifo)
        )),
        "{}",
        text(&o)
    );
    let o = resume("/dev/zero");
    assert_eq!(o.status.code(), Some(0), "resume: {}", text(&o));
    // The same daemon, not suspended, its peak memory far from what a file read whole takes.
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the daemon lives");
    let hwm_kib: u64 = st
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(hwm_kib < 512 << 10, "daemon peak RSS {hwm_kib} KiB");
    let o = run(UCRYPT, &["status", &n]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with(&format!("/dev/ucrypt/{n} is active.\n")),
        "{}",
        text(&o)
    );
    let o = run(UCRYPT, &["close", &n]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
}
