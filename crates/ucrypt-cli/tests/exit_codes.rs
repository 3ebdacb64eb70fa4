//! Errors reach the user typed: every verb and front end exits 2 on a wrong passphrase, as
//! cryptsetup does, and says so in one line; bad arguments exit 1, a missing device 4.

use std::path::PathBuf;
use std::process::{Command, Output};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{s, TempDir, FAST_PBKDF2, UCRYPT};

fn run(args: &[&str]) -> Output {
    cli_common::run(UCRYPT, args)
}

/// A small LUKS volume of `version` whose passphrase is in `good`; `bad` holds another one.
fn volume(t: &TempDir, version: &str) -> (PathBuf, PathBuf, PathBuf) {
    let img = t.path(&format!("{version}.img"));
    let good = t.path("good");
    let bad = t.path("bad");
    std::fs::write(&good, b"right passphrase").unwrap();
    std::fs::write(&bad, b"wrong passphrase").unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(20 << 20))
        .unwrap();
    let mut a = vec!["format", "-q", "--type", version, "--key-file", s(&good)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(&a);
    assert!(o.status.success(), "format: {o:?}");
    (img, good, bad)
}

#[test]
fn wrong_passphrase_exits_2_with_one_line_everywhere() {
    let t = TempDir::new("wrongkey");
    for version in ["luks2", "luks1"] {
        let (img, _good, bad) = volume(&t, version);
        let (img, bad) = (s(&img), s(&bad));
        let out = t.path("out.bin");
        let sock = t.path("nbd.sock");
        let listen = format!("unix:{}", s(&sock));
        let mnt = t.path("plain");
        std::fs::write(&mnt, b"").unwrap();
        let cases: Vec<(&str, Vec<&str>)> = vec![
            (
                "open --test-passphrase",
                vec!["open", "--test-passphrase", "--key-file", bad, img],
            ),
            (
                "dump --dump-volume-key",
                vec!["dump", "--dump-volume-key", "-q", "--key-file", bad, img],
            ),
            ("add-key", vec!["add-key", "--key-file", bad, img, bad]),
            ("export", vec!["export", "--key-file", bad, img, s(&out)]),
            ("import", vec!["import", "--key-file", bad, s(&out), img]),
            (
                "serve",
                vec!["serve", img, "--key-file", bad, "--nbd", &listen],
            ),
            ("mount", vec!["mount", img, s(&mnt), "--key-file", bad]),
            ("ublk", vec!["ublk", img, "--key-file", bad]),
        ];
        // import needs an input file that exists.
        std::fs::write(&out, vec![0u8; 4096]).unwrap();
        for (verb, args) in cases {
            let o = run(&args);
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert_eq!(
                o.status.code(),
                Some(2),
                "{version} {verb}: exit {:?}, stderr: {stderr}",
                o.status.code()
            );
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.is_empty()).collect();
            assert_eq!(lines.len(), 1, "{version} {verb}: not one line: {stderr}");
            assert!(
                lines[0].contains("No key available with this passphrase"),
                "{version} {verb}: does not name the problem: {stderr}"
            );
        }
    }
}

#[test]
fn bad_arguments_exit_1_and_missing_devices_4() {
    let t = TempDir::new("args");
    let (img, good, _bad) = volume(&t, "luks2");
    let missing = t.path("missing.img");
    // A policy that does not exist: clap refuses it before anything is opened.
    let o = run(&[
        "serve",
        s(&img),
        "--policy",
        "fastest",
        "--nbd",
        "unix:/tmp/x",
    ]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let o = run(&["export", "--key-file", s(&good), s(&missing), "/dev/null"]);
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("missing.img"),
        "does not name the device: {stderr}"
    );
}

/// Waits up to `t` for `child` to end; its exit code (None: still running, then killed).
fn exit_within(child: &mut std::process::Child, t: std::time::Duration) -> Option<i32> {
    let deadline = std::time::Instant::now() + t;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            return st.code();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[test]
fn sigterm_interrupts_opening_a_volume() {
    let t = TempDir::new("sigstart");
    let fifo = t.path("fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let good = t.path("good");
    std::fs::write(&good, b"right passphrase").unwrap();
    // A volume whose KDF takes seconds (the format takes as long).
    let slow = t.path("slow.img");
    std::fs::File::create(&slow)
        .and_then(|f| f.set_len(20 << 20))
        .unwrap();
    let o = run(&[
        "format",
        "-q",
        "--type",
        "luks2",
        "--key-file",
        s(&good),
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "10000000",
        s(&slow),
    ]);
    assert!(o.status.success(), "format: {o:?}");
    let listen = format!("unix:{}", s(&t.path("sock")));
    let mnt = t.path("mnt");
    let cases: Vec<(&str, Vec<&str>)> = vec![
        // A FIFO nobody writes to: opening it waits for a writer.
        (
            "serve, key file a FIFO",
            vec!["serve", s(&slow), "--key-file", s(&fifo), "--nbd", &listen],
        ),
        (
            "mount, key file a FIFO",
            vec!["mount", s(&slow), s(&mnt), "--key-file", s(&fifo)],
        ),
        (
            "serve, slow KDF",
            vec!["serve", s(&slow), "--key-file", s(&good), "--nbd", &listen],
        ),
        (
            "mount, slow KDF",
            vec!["mount", s(&slow), s(&mnt), "--key-file", s(&good)],
        ),
    ];
    for (what, args) in cases {
        let mut child = Command::new(UCRYPT)
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(700));
        assert!(
            matches!(child.try_wait(), Ok(None)),
            "{what}: ended before the signal"
        );
        // SAFETY: kill sends a signal to our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let code = exit_within(&mut child, std::time::Duration::from_secs(3));
        assert_eq!(code, Some(128 + libc::SIGTERM), "{what}: SIGTERM ignored");
        assert!(!mnt.exists(), "{what}: mount point it made left behind");
    }
}

/// What is tried, ucrypt's arguments, cryptsetup's for the same (if it can run them), the
/// exit code both give, words ucrypt's line must hold.
type Row<'a> = (&'a str, Vec<&'a str>, Option<Vec<&'a str>>, i32, &'a str);

/// cryptsetup's exit code for `args`, when it is installed (None otherwise).
fn cryptsetup(args: &[&str]) -> Option<i32> {
    let o = Command::new("cryptsetup")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    o.status.code()
}

#[test]
fn hostile_inputs_exit_as_cryptsetup_does() {
    let t = TempDir::new("hostile");
    let (img, good, _bad) = volume(&t, "luks2");
    let (img, good) = (s(&img), s(&good));
    let dir = t.path("dir");
    std::fs::create_dir(&dir).unwrap();
    let fifo = t.path("fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let missing = t.path("missing-key");
    let listen = format!("unix:{}", s(&t.path("sock")));
    // (what, ucrypt's arguments, cryptsetup's for the same, expected code, words in the line)
    #[rustfmt::skip]
    let rows: Vec<Row> = vec![
        ("missing key file", vec!["open", "--test-passphrase", "--key-file", s(&missing), img],
         Some(vec!["open", "--test-passphrase", "--key-file", s(&missing), img]), 1,
         "Failed to open key file"),
        ("missing key file, serve", vec!["serve", img, "--key-file", s(&missing), "--nbd", &listen],
         None, 1, "Failed to open key file"),
        ("key file /dev/zero", vec!["open", "--test-passphrase", "--key-file", "/dev/zero", img],
         Some(vec!["open", "--test-passphrase", "--key-file", "/dev/zero", img]), 1,
         "Maximum keyfile size exceeded"),
        ("a directory as the device", vec!["dump", s(&dir)],
         Some(vec!["luksDump", s(&dir)]), 4, "not compatible"),
        ("a directory as the device, open", vec!["open", "--test-passphrase", "--key-file", good, s(&dir)],
         Some(vec!["open", "--test-passphrase", "--key-file", good, s(&dir)]), 4, "not compatible"),
        ("a directory as the device, serve", vec!["serve", s(&dir), "--key-file", good, "--nbd", &listen],
         None, 4, "not compatible"),
        ("a character device", vec!["dump", "/dev/null"],
         Some(vec!["luksDump", "/dev/null"]), 4, "not compatible"),
        // cryptsetup waits for a writer on a FIFO; ucrypt refuses it before opening it.
        ("a FIFO as the device, dump", vec!["dump", s(&fifo)], None, 4, "not compatible"),
        ("a FIFO as the device, isLuks", vec!["isLuks", s(&fifo)], None, 4, ""),
    ];
    for (what, args, cs, want, words) in rows {
        let o = run(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(want), "{what}: {stderr}");
        assert!(
            stderr.contains(words),
            "{what}: does not say '{words}': {stderr}"
        );
        if let Some(cs) = cs {
            if let Some(code) = cryptsetup(&cs) {
                assert_eq!(code, want, "{what}: cryptsetup exits {code}");
            }
        }
    }
}

#[test]
fn add_key_on_an_immutable_file_exits_1() {
    let t = TempDir::new("immutable");
    let (img, good, _bad) = volume(&t, "luks2");
    let chattr = |flag: &str| {
        Command::new("chattr")
            .args([flag, s(&img)])
            .status()
            .is_ok_and(|st| st.success())
    };
    if !chattr("+i") {
        println!("SKIPPED: chattr +i not possible here (needs root and ext4/xfs/btrfs)");
        return;
    }
    let mut a = vec!["add-key", "--key-file", s(&good)];
    a.extend(FAST_PBKDF2);
    a.extend([s(&img), s(&good)]);
    let o = run(&a);
    let mut cs = vec!["luksAddKey", "--key-file", s(&good)];
    cs.extend(FAST_PBKDF2);
    cs.extend([s(&img), s(&good)]);
    let theirs = cryptsetup(&cs);
    chattr("-i");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("immutable"), "unclear: {stderr}");
    if let Some(code) = theirs {
        assert_eq!(code, 1, "cryptsetup exits {code}");
    }
}

#[test]
fn truncated_headers_and_header_only_files_are_refused() {
    let t = TempDir::new("truncated");
    for version in ["luks2", "luks1"] {
        let (img, good, _bad) = volume(&t, version);
        let whole = std::fs::read(&img).unwrap();
        for cut in [16usize << 10, 32 << 10] {
            let short = t.path(&format!("{version}-{cut}"));
            std::fs::write(&short, &whole[..cut]).unwrap();
            for (verb, theirs) in [("dump", "luksDump"), ("isLuks", "isLuks")] {
                let o = run(&[verb, s(&short)]);
                let what = format!("{verb} of a {version} header cut to {cut} bytes");
                assert_eq!(o.status.code(), Some(1), "{what}: {o:?}");
                if verb == "dump" {
                    let stderr = String::from_utf8_lossy(&o.stderr);
                    assert!(stderr.contains("too small"), "{what}: {stderr}");
                }
                if let Some(code) = cryptsetup(&[theirs, s(&short)]) {
                    assert_eq!(code, 1, "{what}: cryptsetup exits {code}");
                }
            }
        }
        // A header backup holds the header and keyslots only: nothing to serve.
        let backup = t.path(&format!("{version}-backup"));
        let o = run(&["header-backup", s(&img), "--header-backup-file", s(&backup)]);
        assert!(o.status.success(), "header-backup: {o:?}");
        let listen = format!("unix:{}", s(&t.path("sock")));
        let o = run(&[
            "serve",
            s(&backup),
            "--key-file",
            s(&good),
            "--nbd",
            &listen,
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(
            o.status.code(),
            Some(1),
            "{version} serve a header backup: {stderr}"
        );
        assert!(stderr.contains("no data"), "{version}: unclear: {stderr}");
    }
}

/// cryptsetup's short options mean what they mean there: `-h` is `--hash` (a ported script's
/// `luksFormat --batch-mode -h sha512` formats with sha512; it must never print help and exit
/// 0 having done nothing), help is `-?`/`--help` on every command, and `-S`, `-l`, `-r`, `-I`
/// are accepted where cryptsetup takes them.
#[test]
fn short_options_are_cryptsetups() {
    let t = TempDir::new("shortopts");
    let img = t.path("h.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(20 << 20))
        .unwrap();
    let key = t.file("key", b"short options");
    let mut a = vec![
        "luksFormat",
        "--batch-mode",
        "-h",
        "sha512",
        "--key-file",
        s(&key),
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(&a);
    assert_eq!(o.status.code(), Some(0), "format -h sha512: {o:?}");
    assert_eq!(
        run(&["isLuks", s(&img)]).status.code(),
        Some(0),
        "nothing was formatted"
    );
    let dump = String::from_utf8_lossy(&run(&["luksDump", s(&img)]).stdout).into_owned();
    assert!(
        dump.contains("Hash:       sha512"),
        "the digest's hash is sha512:\n{dump}"
    );
    // `-h` with nothing after it is a missing value, not a request for help.
    let o = run(&["luksFormat", "-h"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(o.stdout.is_empty(), "no help printed: {o:?}");
    for verb in [
        vec![],
        vec!["luksFormat"],
        vec!["open"],
        vec!["luksDump"],
        vec!["serve"],
        vec!["close"],
        vec!["export"],
    ] {
        for help in ["-?", "--help"] {
            let mut a = verb.clone();
            a.push(help);
            let o = run(&a);
            assert_eq!(o.status.code(), Some(0), "{a:?}: {o:?}");
            assert!(
                String::from_utf8_lossy(&o.stdout).contains("Usage:"),
                "{a:?}: {o:?}"
            );
        }
    }
    let o = run(&[
        "open",
        "-S",
        "0",
        "-l",
        "13",
        "-r",
        "--test-passphrase",
        "--key-file",
        s(&key),
        s(&img),
    ]);
    assert_eq!(o.status.code(), Some(0), "open -S -l -r: {o:?}");
}
