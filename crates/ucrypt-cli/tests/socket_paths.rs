//! Sockets at paths the user names (`--metrics unix:PATH`, `--nbd unix:PATH`, `--control
//! PATH`) follow one rule: a file (anything not a socket) at PATH is refused and kept; a live
//! socket (it answers) is refused and keeps answering, except that another `open`'s NBD
//! socket is joined (a shared listener); a stale one (nobody listens) is replaced; and what
//! ucrypt bound is removed when it stops serving.
//!
//! The `open` test needs root, /dev/fuse, /dev/loop-control; otherwise it prints `SKIPPED`.

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Output;

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{missing_root_rig, run, s, text, TempDir, FAST_PBKDF2, UCRYPT};

const PRECIOUS: &[u8] = b"precious: not a socket\n";

fn ucrypt(args: &[&str]) -> Output {
    // Bounded: a verb that is not refused serves until stopped.
    let mut a = vec!["120", UCRYPT];
    a.extend(args);
    let o = run("timeout", &a);
    assert_ne!(
        o.status.code(),
        Some(124),
        "ucrypt {args:?} was not refused"
    );
    o
}

fn volume(t: &TempDir, name: &str) -> (PathBuf, PathBuf) {
    let img = t.image(name, 20);
    let key = t.file("key", b"socket paths passphrase");
    let mut a = vec!["format", "-q", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(0), "format: {}", text(&o));
    (img, key)
}

fn is_socket(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

/// A socket left by a process that died: bound, never unlinked, nobody listening.
fn stale_socket(p: &Path) {
    drop(UnixListener::bind(p).unwrap());
    assert!(is_socket(p));
}

fn refused_keeping_the_file(o: &Output, file: &Path) {
    assert_eq!(o.status.code(), Some(1), "{}", text(o));
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains(&format!("{} exists and is not a socket", file.display())),
        "{}",
        text(o)
    );
    assert_eq!(
        std::fs::read(file).unwrap(),
        PRECIOUS,
        "the file was touched"
    );
}

/// `serve` (no root needed): --metrics, --nbd and --control refuse a file and keep it.
#[test]
fn serve_refuses_a_file_at_its_socket_paths() {
    let t = TempDir::new("sockserve");
    let (img, key) = volume(&t, "vol.img");
    let file = t.file("file", PRECIOUS);
    let sock = t.path("nbd.sock");
    let nbd = format!("unix:{}", s(&sock));
    let at_file = format!("unix:{}", s(&file));
    let base = ["serve", s(&img), "--key-file", s(&key)];
    for extra in [
        vec!["--nbd", at_file.as_str()],
        vec!["--nbd", &nbd, "--metrics", &at_file],
        vec!["--nbd", &nbd, "--control", s(&file)],
    ] {
        let mut a = base.to_vec();
        a.extend(&extra);
        refused_keeping_the_file(&ucrypt(&a), &file);
        assert!(!sock.exists(), "{extra:?}: the NBD socket was left behind");
    }
}

/// `open` (the daemon): a file at --metrics or --nbd is refused and kept; another daemon's
/// live sockets are refused and keep answering; a stale socket is replaced; `close` removes
/// the sockets the daemon made.
#[test]
fn open_keeps_files_and_live_sockets_and_removes_its_own() {
    if let Some(why) = missing_root_rig(&[]) {
        println!("SKIPPED: {why}");
        return;
    }
    let t = TempDir::new("sockopen");
    let (img, key) = volume(&t, "vol.img");
    let (img2, _) = volume(&t, "vol2.img");
    let n = format!("sock-{}", std::process::id());
    let n2 = format!("sock2-{}", std::process::id());
    let open = |img: &Path, name: &str, extra: &[&str]| {
        let mut a = vec![
            "open",
            s(img),
            name,
            "--key-file",
            s(&key),
            "--front-end",
            "loop",
        ];
        a.extend(extra);
        ucrypt(&a)
    };
    let gone = |name: &str| !Path::new("/run/ucrypt").join(name).exists();
    // Whatever fails, no daemon is left behind.
    struct Close(Vec<String>);
    impl Drop for Close {
        fn drop(&mut self) {
            for n in &self.0 {
                let _ = run(UCRYPT, &["close", "--force", n]);
            }
        }
    }
    let _close = Close(vec![n.clone(), n2.clone()]);

    let file = t.file("file", PRECIOUS);
    let at_file = format!("unix:{}", s(&file));
    refused_keeping_the_file(&open(&img, &n, &["--metrics", &at_file]), &file);
    assert!(gone(&n));
    refused_keeping_the_file(&open(&img, &n, &["--nbd", &at_file]), &file);
    assert!(gone(&n));

    let (m, nb) = (t.path("metrics.sock"), t.path("nbd.sock"));
    stale_socket(&m);
    let (at_m, at_nb) = (format!("unix:{}", s(&m)), format!("unix:{}", s(&nb)));
    let o = open(&img, &n, &["--metrics", &at_m, "--nbd", &at_nb]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "open over a stale socket: {}",
        text(&o)
    );
    assert!(is_socket(&m) && is_socket(&nb));
    // Another volume's daemon may not take the metrics socket: refused (busy), and it still
    // answers.
    let o = open(&img2, &n2, &["--metrics", &at_m]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is the socket of a live server"),
        "{}",
        text(&o)
    );
    assert!(gone(&n2));
    assert!(UnixStream::connect(&m).is_ok(), "metrics lost");
    // The NBD socket of another `open` it joins instead (tests/nbd_shared.rs), and leaves on
    // close without taking the socket with it.
    let o = open(&img2, &n2, &["--nbd", &at_nb]);
    assert_eq!(o.status.code(), Some(0), "joining {at_nb}: {}", text(&o));
    let o = run(UCRYPT, &["close", &n2]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    assert!(UnixStream::connect(&nb).is_ok(), "NBD lost");
    // A live socket that is no ucrypt daemon's NBD socket is refused and kept.
    let foreign = t.path("foreign.sock");
    let _listening = UnixListener::bind(&foreign).unwrap();
    let o = open(&img2, &n2, &["--nbd", &format!("unix:{}", s(&foreign))]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is the socket of a live server"),
        "{}",
        text(&o)
    );
    assert!(gone(&n2));
    assert!(
        UnixStream::connect(&foreign).is_ok(),
        "the foreign socket lost"
    );
    let o = run(UCRYPT, &["close", &n]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    assert!(!m.exists(), "the metrics socket stayed after close");
    assert!(!nb.exists(), "the NBD socket stayed after close");
}

/// A metrics address that cannot be bound is named as it was written (`tcp:HOST:PORT`), not
/// as Rust's debug form of the parsed value (`Tcp { host: .. }`).
#[test]
fn a_busy_metrics_address_is_named_as_written() {
    let t = TempDir::new("sockmetrics");
    let (img, key) = volume(&t, "vol.img");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = format!("tcp:127.0.0.1:{}", taken.local_addr().unwrap().port());
    let nbd = format!("unix:{}", s(&t.path("nbd.sock")));
    let o = ucrypt(&[
        "serve",
        s(&img),
        "--key-file",
        s(&key),
        "--nbd",
        &nbd,
        "--metrics",
        &at,
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("metrics at {at}: ")) && !err.contains('{'),
        "{}",
        text(&o)
    );
}
