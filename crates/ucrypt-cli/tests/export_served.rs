//! `export` of a volume a ucrypt process serves read-write is refused (exit 5), as `open`'s
//! in-use rule refuses it: the copy would mix data from before and after that process's
//! writes. `--force` exports all the same; a volume served read-only is exported beside it.
//! Needs no root (the server is `ucrypt serve` on a unix socket).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{run, s, text, TempDir, FAST_PBKDF2, UCRYPT};

/// A `ucrypt serve` stopped (SIGTERM) and waited for on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = run("kill", &["-TERM", &self.0.id().to_string()]);
        let _ = self.0.wait();
    }
}

fn serve(img: &Path, key: &Path, sock: &Path, extra: &[&str]) -> Server {
    let listen = format!("unix:{}", s(sock));
    let mut a = vec!["serve", s(img), "--nbd", &listen, "--key-file", s(key)];
    a.extend(extra);
    let child = Command::new(UCRYPT)
        .args(&a)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut srv = Server(child);
    let t0 = Instant::now();
    while UnixStream::connect(sock).is_err() {
        if let Some(st) = srv.0.try_wait().unwrap() {
            panic!("ucrypt serve ended: {st}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "ucrypt serve not listening after 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    srv
}

#[test]
fn export_refuses_a_volume_served_read_write_unless_forced() {
    let t = TempDir::new("exportserved");
    let img = t.image("vol.img", 20);
    let key = t.file("key", b"export beside a server");
    let mut a = vec!["format", "-q", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let o = run(UCRYPT, &a);
    assert_eq!(o.status.code(), Some(0), "format: {}", text(&o));
    let (out, sock) = (t.path("out"), t.path("nbd.sock"));
    let export = |extra: &[&str]| {
        let mut a = vec!["export", s(&img), s(&out), "--key-file", s(&key)];
        a.extend(extra);
        run(UCRYPT, &a)
    };

    let srv = serve(&img, &key, &sock, &[]);
    let o = export(&[]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("is in use by a ucrypt process serving it read-write"),
        "{}",
        text(&o)
    );
    assert!(!out.exists(), "a refused export made its file");
    let o = export(&["--force"]);
    assert_eq!(o.status.code(), Some(0), "export --force: {}", text(&o));
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 4 << 20);
    std::fs::remove_file(&out).unwrap();
    drop(srv);

    let _srv = serve(&img, &key, &sock, &["--readonly"]);
    let o = export(&[]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "export beside a read-only server: {}",
        text(&o)
    );
}
