//! `--tries`: a wrong passphrase typed on a terminal is asked for again, as cryptsetup asks
//! again in `open` and `luksResume`. The passphrases are typed on a pseudo-terminal (the
//! child's controlling terminal, as a user's shell gives it), one after each prompt, once the
//! prompt has turned echo off; cryptsetup is driven the same way and must agree.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cli_common::*;

const RIGHT: &str = "the right one";
const PROMPT: &str = "Enter passphrase";
const WRONG_MSG: &str = "No key available with this passphrase.";
/// Longest a run may take (each try is a PBKDF2 of 1000 iterations).
const RUN_MAX: Duration = Duration::from_secs(60);

/// What a run on the terminal showed.
struct Typed {
    code: Option<i32>,
    prompts: usize,
    wrong_msgs: usize,
    screen: String,
}

/// Runs `prog args` with a pseudo-terminal as its controlling terminal and its stdin, stdout
/// and stderr; types `answers[k]` after the k-th prompt, once echo is off; returns the exit
/// code and what the terminal showed.
fn on_terminal(prog: &str, args: &[&str], answers: &[&str]) -> Typed {
    let (mut master, slave) = {
        let (mut m, mut s) = (-1, -1);
        // SAFETY: openpty writes two descriptors into the given ints; the name, termios and
        // window size pointers may be null.
        let r = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both descriptors are fresh and owned by nobody else.
        unsafe {
            (
                std::fs::File::from(OwnedFd::from_raw_fd(m)),
                OwnedFd::from_raw_fd(s),
            )
        }
    };
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave.try_clone().unwrap()));
    // SAFETY: between fork and exec only async-signal-safe calls: a new session, and the
    // terminal on stdin made its controlling terminal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn on the terminal");
    drop(slave);
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let fl = libc::fcntl(master.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(master.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    let echo_off = |fd: i32| {
        // SAFETY: an all-zero termios is a valid value of this plain C struct.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: tcgetattr fills the termios of a terminal descriptor (the master reports the
        // terminal's settings).
        unsafe { libc::tcgetattr(fd, &mut t) == 0 && t.c_lflag & libc::ECHO == 0 }
    };
    let mut screen = Vec::new();
    let mut typed = 0;
    let t0 = Instant::now();
    let code = loop {
        let mut buf = [0u8; 4096];
        // SAFETY: reading into a local buffer of its length.
        let n = unsafe { libc::read(master.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            screen.extend_from_slice(&buf[..n as usize]);
        }
        let shown = String::from_utf8_lossy(&screen).matches(PROMPT).count();
        if shown > typed && typed < answers.len() && echo_off(master.as_raw_fd()) {
            master
                .write_all(format!("{}\n", answers[typed]).as_bytes())
                .unwrap();
            typed += 1;
        }
        if let Some(st) = child.try_wait().unwrap() {
            // What is still in the terminal's buffer.
            std::thread::sleep(Duration::from_millis(50));
            loop {
                // SAFETY: as above.
                let n =
                    unsafe { libc::read(master.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n <= 0 {
                    break;
                }
                screen.extend_from_slice(&buf[..n as usize]);
            }
            break st.code();
        }
        if t0.elapsed() > RUN_MAX {
            let _ = child.kill();
            panic!(
                "{prog} {args:?} still running after {RUN_MAX:?}; the terminal showed:\n{}",
                String::from_utf8_lossy(&screen)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let screen = String::from_utf8_lossy(&screen).into_owned();
    Typed {
        code,
        prompts: screen.matches(PROMPT).count(),
        wrong_msgs: screen.matches(WRONG_MSG).count(),
        screen,
    }
}

fn luks_volume(t: &TempDir) -> std::path::PathBuf {
    let img = t.image("vol.img", 20);
    let key = t.file("key", RIGHT.as_bytes());
    let mut a = vec!["luksFormat", "-q"];
    a.extend(FAST_PBKDF2);
    a.extend([s(&img), s(&key)]);
    ok(UCRYPT, &a);
    img
}

/// ucrypt, and cryptsetup beside it where it is installed (its column is SKIPPED, and said
/// so, where it is not).
fn tools() -> Vec<&'static str> {
    if have("cryptsetup") {
        vec![UCRYPT, "cryptsetup"]
    } else {
        println!("SKIPPED (the cryptsetup column): cryptsetup not installed");
        vec![UCRYPT]
    }
}

/// `open --test-passphrase` on a terminal, ucrypt beside cryptsetup: a wrong passphrase and
/// then the right one opens (two prompts); three wrong ones exit 2 after three prompts, each
/// answered "No key available with this passphrase."; `--tries 1` asks once; `--tries 2`
/// twice.
#[test]
fn test_passphrase_asks_again_like_cryptsetup() {
    let t = TempDir::new("tries");
    let img = luks_volume(&t);
    let tools = tools();
    // (extra arguments, answers, exit code, prompts, wrong-passphrase messages)
    type Row<'a> = (&'a [&'a str], &'a [&'a str], i32, usize, usize);
    let rows: [Row; 4] = [
        (&[], &["wrong", RIGHT], 0, 2, 1),
        (&[], &["wrong", "wrong again", "still wrong"], 2, 3, 3),
        (&["--tries", "1"], &["wrong", RIGHT], 2, 1, 1),
        (&["--tries", "2"], &["wrong", "wrong again", RIGHT], 2, 2, 2),
    ];
    for (extra, answers, code, prompts, wrong) in rows {
        for tool in &tools {
            let mut a = vec!["open", "--test-passphrase"];
            a.extend(extra);
            a.push(s(&img));
            let r = on_terminal(tool, &a, answers);
            let what = format!(
                "{tool} {extra:?} {answers:?}; the terminal showed:\n{}",
                r.screen
            );
            assert_eq!(r.code, Some(code), "{what}");
            assert_eq!(r.prompts, prompts, "{what}");
            assert_eq!(r.wrong_msgs, wrong, "{what}");
            assert!(
                !r.screen.contains("wrong") && !r.screen.contains(RIGHT),
                "a passphrase was echoed: {what}"
            );
        }
    }
    // From a key file there is nothing to ask again.
    let bad = t.file("bad", b"wrong");
    let o = run(
        UCRYPT,
        &["open", "--test-passphrase", "--key-file", s(&bad), s(&img)],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(text(&o).matches(WRONG_MSG).count(), 1, "{}", text(&o));
}

/// `ucrypt open` and `ucrypt resume` on a terminal: a wrong passphrase, then the right one,
/// opens (and resumes) the volume.
#[test]
fn open_and_resume_ask_again() {
    if let Some(why) = missing_root_rig(&[]) {
        println!("SKIPPED: {why}");
        return;
    }
    let t = TempDir::new("tries-open");
    let img = luks_volume(&t);
    let name = format!("tries{}", std::process::id());
    let r = on_terminal(UCRYPT, &["open", s(&img), &name], &["wrong", RIGHT]);
    assert_eq!(r.code, Some(0), "open; the terminal showed:\n{}", r.screen);
    assert_eq!((r.prompts, r.wrong_msgs), (2, 1), "open:\n{}", r.screen);
    let closing = Closing(name.clone());
    ok(UCRYPT, &["suspend", &name]);
    let r = on_terminal(UCRYPT, &["resume", &name], &["wrong", "wrong again", RIGHT]);
    assert_eq!(
        r.code,
        Some(0),
        "resume; the terminal showed:\n{}",
        r.screen
    );
    assert_eq!((r.prompts, r.wrong_msgs), (3, 2), "resume:\n{}", r.screen);
    let st = ok(UCRYPT, &["status", &name]);
    assert!(!st.contains("suspended"), "{st}");
    drop(closing);
    assert!(!Path::new(&format!("/dev/ucrypt/{name}")).exists());
}

/// Closes the volume when the test ends, passed or not.
struct Closing(String);

impl Drop for Closing {
    fn drop(&mut self) {
        let _ = run(UCRYPT, &["close", &self.0]);
    }
}

/// A key rotation on a terminal asks the keyslot's passphrase again while it is wrong, as
/// cryptsetup's reencrypt does; both finish the rotation after a wrong answer.
#[test]
fn reencrypt_asks_a_keyslot_again() {
    let t = TempDir::new("tries-reencrypt");
    let img = luks_volume(&t);
    let tools = tools();
    for tool in tools {
        let copy = t.path(&format!("{}.img", tool.rsplit('/').next().unwrap_or(tool)));
        std::fs::copy(&img, &copy).unwrap();
        let mut a = vec!["reencrypt", "-q", "--force-offline-reencrypt"];
        a.extend(FAST_PBKDF2);
        a.push(s(&copy));
        let r = on_terminal(tool, &a, &["wrong", RIGHT]);
        let what = format!("{tool}; the terminal showed:\n{}", r.screen);
        assert_eq!(r.code, Some(0), "{what}");
        assert_eq!((r.prompts, r.wrong_msgs), (2, 1), "{what}");
        // The rotation happened: the old header's volume key no longer opens the copy.
        assert!(
            std::fs::read(&copy).unwrap()[..4096] != std::fs::read(&img).unwrap()[..4096],
            "{tool} changed nothing"
        );
        let key = t.file("key", RIGHT.as_bytes());
        ok(
            UCRYPT,
            &["open", "--test-passphrase", "--key-file", s(&key), s(&copy)],
        );
    }
}

/// Where cryptsetup 2.6.1 does not ask again, neither does ucrypt (measured): a reencryption
/// left by `--init-only` and resumed on a terminal reads one passphrase, and a wrong one ends
/// it with exit code 1 (no usable keyslot); a decryption (detached header) reads one, and a
/// wrong one ends it with exit code 2. Each then finishes with the right one.
#[test]
fn resume_and_decrypt_ask_once() {
    let t = TempDir::new("tries-resume");
    let img = luks_volume(&t);
    let key = t.file("key", RIGHT.as_bytes());
    for tool in tools() {
        let name = tool.rsplit('/').next().unwrap_or(tool);
        let copy = t.path(&format!("{name}-resume.img"));
        std::fs::copy(&img, &copy).unwrap();
        let mut a = vec![
            "reencrypt",
            "-q",
            "--init-only",
            "--force-offline-reencrypt",
            "--key-file",
            s(&key),
        ];
        a.extend(FAST_PBKDF2);
        a.push(s(&copy));
        ok(tool, &a);
        let resume = [
            "reencrypt",
            "-q",
            "--resume-only",
            "--force-offline-reencrypt",
            s(&copy),
        ];
        let r = on_terminal(tool, &resume, &["wrong", RIGHT]);
        let what = format!("{tool} --resume-only; the terminal showed:\n{}", r.screen);
        assert_eq!((r.code, r.prompts), (Some(1), 1), "{what}");
        let r = on_terminal(tool, &resume, &[RIGHT]);
        assert_eq!(r.code, Some(0), "{tool}: {}", r.screen);
        let d = ok(UCRYPT, &["luksDump", s(&copy)]);
        assert!(!d.contains("reencrypt"), "{tool} did not finish:\n{d}");

        let data = t.image(&format!("{name}-data.img"), 8);
        let hdr = t.image(&format!("{name}-hdr.img"), 16);
        let mut f = vec!["luksFormat", "-q", "--header", s(&hdr)];
        f.extend(FAST_PBKDF2);
        f.extend([s(&data), s(&key)]);
        ok(UCRYPT, &f);
        let decrypt = [
            "reencrypt",
            "-q",
            "--decrypt",
            "--force-offline-reencrypt",
            "--header",
            s(&hdr),
            s(&data),
        ];
        let r = on_terminal(tool, &decrypt, &["wrong", RIGHT]);
        let what = format!("{tool} --decrypt; the terminal showed:\n{}", r.screen);
        assert_eq!((r.code, r.prompts, r.wrong_msgs), (Some(2), 1, 1), "{what}");
        let r = on_terminal(tool, &decrypt, &[RIGHT]);
        assert_eq!(r.code, Some(0), "{tool}: {}", r.screen);
        let d = ok(UCRYPT, &["luksDump", s(&hdr)]);
        assert!(d.contains("0: linear"), "{tool} did not decrypt:\n{d}");
    }
}
