//! ucrypt in front of any NBD server (the NBD client backend), as a user types it: the
//! volume is an NBD URI, `ucrypt format` writes its header there and `ucrypt serve` serves the
//! plaintext to fio, which verifies every block (crc32c) at QD1 and QD32:
//! - behind nbdkit's memory plugin;
//! - behind qemu-storage-daemon exporting a file, whose bytes, decrypted locally by
//!   `ucrypt export`, are what fio wrote through the remote (the ciphertext on the remote is
//!   what the sector layer computes);
//! - behind nbdkit's delay filter (5 ms a request): QD16 gets at least 12 times the QD1 rate
//!   (the client pipelines);
//! - behind an nbdkit that is killed and restarted during a verifying fio run: the run
//!   completes (reconnect, resend) and verifies.
//!
//! - behind an nbdkit that is killed (its socket removed) while fio writes, a SIGTERM ends
//!   `serve` within the remote timeout plus slack, non-zero, naming the export it could not
//!   flush (not one remote timeout per flush it still makes).
//!
//! - `nbds+unix://` to an nbdkit that requires TLS: the right CA works, another CA and plain
//!   NBD are refused with one line naming why.
//!
//! Debian packages: nbdkit, qemu-system-common (qemu-storage-daemon), fio, openssl.

mod nbd_common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nbd_common::*;

const PASS: &[u8] = b"remote passphrase";

fn wait_socket(path: &str) {
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{path} not listening"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nbdkit(sock: &str, args: &[&str]) -> Proc {
    let _ = std::fs::remove_file(sock);
    let c = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-U", sock])
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .expect("nbdkit");
    wait_socket(sock);
    Proc(c)
}

/// `ucrypt format` on the remote, then `ucrypt serve` of it on `dir/served`.
fn format_and_serve(dir: &TempDir, remote: &str) -> Server {
    std::fs::write(dir.path("pass"), PASS).unwrap();
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            remote,
            &dir.s("pass"),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    let listen = format!("unix:{}", dir.s("served"));
    Server::start(&[remote, "--nbd", &listen, "--key-file", &dir.s("pass")], 1)
}

fn fio(uri: &str, args: &[&str]) -> String {
    let mut a = vec![
        "--name=remote".to_string(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        "--verify_state_save=0".into(),
        "--output-format=json".into(),
    ];
    a.extend(args.iter().map(|s| s.to_string()));
    let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
    ok("fio", &a)
}

fn verify_qd1_qd32(uri: &str) {
    for qd in ["1", "32"] {
        fio(
            uri,
            &[
                "--rw=randwrite",
                "--bs=4k",
                &format!("--iodepth={qd}"),
                "--size=16M",
                "--verify=crc32c",
                "--do_verify=1",
            ],
        );
    }
}

fn iops(json: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(&json[json.find('{').unwrap()..]).unwrap();
    v["jobs"][0]["read"]["iops"].as_f64().unwrap()
}

#[test]
fn behind_nbdkit_memory() {
    if !need("nbdkit", "nbdkit") || !need("fio", "fio") {
        return;
    }
    let dir = TempDir::new("remote-mem");
    let sock = dir.s("kit");
    let _kit = nbdkit(&sock, &["memory", "128M"]);
    let srv = format_and_serve(&dir, &format!("nbd+unix:///?socket={sock}"));
    verify_qd1_qd32(srv.uri());
}

#[test]
fn behind_qemu_storage_daemon_the_remote_holds_the_ciphertext() {
    if !need("qemu-storage-daemon", "qemu-system-common") || !need("fio", "fio") {
        return;
    }
    let dir = TempDir::new("remote-qsd");
    make_image(&dir.path("back.img"), 64 << 20, None);
    let sock = dir.s("qsd");
    let qsd = Command::new("qemu-storage-daemon")
        .args(["--blockdev"])
        .arg(format!(
            "driver=file,node-name=f0,filename={}",
            dir.s("back.img")
        ))
        .args(["--nbd-server", &format!("addr.type=unix,addr.path={sock}")])
        .args([
            "--export",
            "type=nbd,id=e0,node-name=f0,name=disk,writable=on",
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("qemu-storage-daemon");
    let _qsd = Proc(qsd);
    wait_socket(&sock);
    let srv = format_and_serve(&dir, &format!("nbd+unix:///disk?socket={sock}"));
    let data: Vec<u8> = pattern(4 << 20, 77);
    std::fs::write(dir.path("data"), &data).unwrap();
    ok("nbdcopy", &[&dir.s("data"), srv.uri()]);
    verify_qd1_qd32(srv.uri());
    // Rewrite the first 4 MiB (fio overwrote some of it), then read the remote's own file
    // with the local LUKS path: the plaintext is what went through the remote.
    ok("nbdcopy", &[&dir.s("data"), srv.uri()]);
    drop(srv);
    ok(
        UCRYPT,
        &[
            "export",
            &dir.s("back.img"),
            &dir.s("plain"),
            "--key-file",
            &dir.s("pass"),
        ],
    );
    let plain = std::fs::read(dir.path("plain")).unwrap();
    assert!(
        plain[..4 << 20] == data[..],
        "the remote file holds the volume's ciphertext"
    );
    let raw = std::fs::read(dir.path("back.img")).unwrap();
    assert!(
        !raw.windows(4096).any(|w| w == &data[..4096]),
        "no plaintext on the remote"
    );
}

#[test]
fn pipelines_behind_a_slow_server() {
    if !need("nbdkit", "nbdkit") || !need("fio", "fio") {
        return;
    }
    let dir = TempDir::new("remote-delay");
    let sock = dir.s("kit");
    let _kit = nbdkit(
        &sock,
        &[
            "--filter=delay",
            "memory",
            "64M",
            "delay-read=5ms",
            "delay-write=5ms",
        ],
    );
    let srv = format_and_serve(&dir, &format!("nbd+unix:///?socket={sock}"));
    let run = |qd: &str| {
        iops(&fio(
            srv.uri(),
            &[
                "--rw=randread",
                "--bs=4k",
                &format!("--iodepth={qd}"),
                "--size=32M",
                "--time_based",
                "--runtime=3",
            ],
        ))
    };
    let (one, sixteen) = (run("1"), run("16"));
    println!(
        "delay 5 ms: QD1 {one:.0} IOPS, QD16 {sixteen:.0} IOPS, x{:.1}",
        sixteen / one
    );
    assert!(
        sixteen >= 12.0 * one,
        "QD16 {sixteen:.0} IOPS is not 12x QD1 {one:.0}"
    );
}

#[test]
fn survives_a_server_restart_during_a_verifying_run() {
    if !need("nbdkit", "nbdkit") || !need("fio", "fio") {
        return;
    }
    let dir = TempDir::new("remote-restart");
    make_image(&dir.path("back.img"), 64 << 20, None);
    let sock = dir.s("kit");
    let back = dir.s("back.img");
    let kit = nbdkit(&sock, &["file", &back]);
    let srv = format_and_serve(&dir, &format!("nbd+unix:///?socket={sock}"));
    let uri = srv.uri().to_string();
    let f = std::thread::spawn(move || {
        fio(
            &uri,
            &[
                "--rw=randwrite",
                "--bs=64k",
                "--iodepth=4",
                "--size=32M",
                "--verify=crc32c",
                "--do_verify=1",
                "--rate=8m",
            ],
        )
    });
    std::thread::sleep(Duration::from_millis(1500));
    drop(kit);
    std::thread::sleep(Duration::from_millis(1000));
    let _kit = nbdkit(&sock, &["file", &back]);
    let out = f.join().expect("fio completes after the restart");
    assert!(out.contains("\"error\" : 0"), "fio verified without errors");
}

/// A stop of `serve` in front of a remote that has gone away while a client writes waits for
/// the remote one remote timeout at most (plus slack), then exits non-zero naming the export
/// it could not flush. Each request the stopping process still made (the client
/// connection's last flush, the export's flush) used to wait a remote timeout of its own.
#[test]
fn a_stop_behind_a_vanished_remote_waits_one_remote_timeout() {
    const REMOTE_TIMEOUT_S: u64 = 10;
    /// Loose, for a loaded machine: the reconnection loop's ticks and the process's own
    /// teardown, many times over; below a second remote timeout.
    const STOP_SLACK: Duration = Duration::from_secs(8);
    /// How long the test waits for the exit at all before it kills the server.
    const EXIT_WAIT_MAX: Duration = Duration::from_secs(120);
    if !need("nbdkit", "nbdkit") || !need("fio", "fio") {
        return;
    }
    let dir = TempDir::new("remote-gone");
    make_image(&dir.path("back.img"), 64 << 20, None);
    std::fs::write(dir.path("key"), [0x3cu8; 64]).unwrap();
    let sock = dir.s("kit");
    let back = dir.s("back.img");
    let kit = nbdkit(&sock, &["file", &back]);
    let log = std::fs::File::create(dir.path("serve.log")).unwrap();
    let mut srv = Server::try_start_logged(
        &[
            &format!("nbd+unix:///?socket={sock}"),
            "--nbd",
            &format!("unix:{}", dir.s("served")),
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &dir.s("key"),
            "--remote-timeout",
            &REMOTE_TIMEOUT_S.to_string(),
        ],
        1,
        log.into(),
    )
    .unwrap_or_else(|e| panic!("serve did not start: {e}"));
    // A writer that keeps requests in flight until the end of the test.
    let mut writer = Proc(
        Command::new("fio")
            .args([
                "--name=gone",
                "--ioengine=nbd",
                &format!("--uri={}", srv.uri()),
                "--rw=randwrite",
                "--bs=64k",
                "--iodepth=8",
                "--size=48M",
                "--time_based",
                "--runtime=600",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fio"),
    );
    // The remote has ciphertext: fio's writes go through.
    let t0 = Instant::now();
    while std::fs::read(&back).unwrap().iter().all(|&b| b == 0) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no write reached the remote"
        );
        assert!(matches!(writer.0.try_wait(), Ok(None)), "fio ended early");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(kit);
    let _ = std::fs::remove_file(&sock);
    std::thread::sleep(Duration::from_secs(1));
    let t = Instant::now();
    terminate(srv.pid());
    let code = wait_timeout(&mut srv.child, EXIT_WAIT_MAX);
    let took = t.elapsed();
    let _ = writer.0.kill();
    let log = std::fs::read_to_string(dir.path("serve.log")).unwrap();
    assert!(
        code.is_some(),
        "serve still running {EXIT_WAIT_MAX:?} after SIGTERM; its log:\n{log}"
    );
    assert_ne!(
        code,
        Some(0),
        "a stop that could not flush exits non-zero: {log}"
    );
    assert!(
        took < Duration::from_secs(REMOTE_TIMEOUT_S) + STOP_SLACK,
        "serve took {took:?} to stop with a remote timeout of {REMOTE_TIMEOUT_S} s; its log:\n{log}"
    );
    assert!(
        log.contains("flushing export") && log.contains("server unreachable"),
        "the log names what could not be flushed and why:\n{log}"
    );
}

#[test]
fn tls_with_the_right_ca_only() {
    if !need("nbdkit", "nbdkit") || !need("openssl", "openssl") {
        return;
    }
    let dir = TempDir::new("remote-tls");
    ca(&dir, "ca");
    ca(&dir, "other");
    leaf(&dir, "ca", "server", SERVER_EXT);
    // nbdkit's certificates directory: ca-cert.pem, server-cert.pem, server-key.pem.
    let pki = dir.path("pki");
    std::fs::create_dir_all(&pki).unwrap();
    for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
        std::fs::copy(dir.path(f), pki.join(f)).unwrap();
    }
    let sock = dir.s("kit");
    let _kit = nbdkit(
        &sock,
        &[
            "--tls=require",
            &format!("--tls-certificates={}", pki.display()),
            "memory",
            "64M",
        ],
    );
    std::fs::write(dir.path("pass"), PASS).unwrap();
    let tls = format!("nbds+unix:///?socket={sock}");
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            &tls,
            &dir.s("pass"),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--remote-tls-ca",
            &dir.s("ca-cert.pem"),
        ],
    );
    let dump = ok(
        UCRYPT,
        &["dump", &tls, "--remote-tls-ca", &dir.s("ca-cert.pem")],
    );
    assert!(dump.contains("LUKS header information"), "{dump}");
    for (uri, ca_file, why) in [
        (tls.as_str(), dir.s("other-cert.pem"), "certificate"),
        (
            &format!("nbd+unix:///?socket={sock}"),
            dir.s("ca-cert.pem"),
            "TLS",
        ),
    ] {
        let (okay, out) = run(UCRYPT, &["dump", uri, "--remote-tls-ca", &ca_file]);
        assert!(!okay, "{uri} with {ca_file} must be refused");
        let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(
            lines.iter().any(|l| l.contains(why)),
            "{uri}: the refusal names {why}: {out}"
        );
    }
}

#[test]
fn open_runs_a_remote_volume_in_the_background() {
    if !need("nbdkit", "nbdkit") || !need("fio", "fio") {
        return;
    }
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 && std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        println!("SKIPPED: not root and XDG_RUNTIME_DIR unset (no place for open's state)");
        return;
    }
    let dir = TempDir::new("remote-open");
    let sock = dir.s("kit");
    let _kit = nbdkit(&sock, &["memory", "64M"]);
    let remote = format!("nbd+unix:///?socket={sock}");
    std::fs::write(dir.path("pass"), PASS).unwrap();
    std::fs::write(dir.path("bad"), b"not it").unwrap();
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            &remote,
            &dir.s("pass"),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    let name = format!("remote-bg-{}", std::process::id());
    let served = dir.s("served");
    let open = |key: &str| {
        Command::new(UCRYPT)
            .args(["open", &remote, &name, "--key-file", key])
            .args(["--front-end", "fuse", "--nbd", &format!("unix:{served}")])
            .stdin(Stdio::null())
            .output()
            .expect("run ucrypt open")
    };
    // A wrong passphrase: found in the daemon, reported by `open` with cryptsetup's code.
    let o = open(&dir.s("bad"));
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{said}");
    assert!(said.contains("No key available"), "{said}");
    let (found, _) = run(UCRYPT, &["status", &name]);
    assert!(!found, "a failed open left {name} behind");
    // The right one: `open` returns once the daemon serves.
    let o = open(&dir.s("pass"));
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let uri = format!("nbd+unix:///{name}?socket={served}");
    let verified = std::panic::catch_unwind(|| {
        fio(
            &uri,
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=8",
                "--size=8M",
                "--verify=crc32c",
                "--do_verify=1",
            ],
        )
    });
    let status = ok(UCRYPT, &["status", &name]);
    ok(UCRYPT, &["close", &name]);
    verified.expect("fio through the background daemon");
    assert!(
        status.contains(&remote),
        "status names the volume: {status}"
    );
    let (found, _) = run(UCRYPT, &["status", &name]);
    assert!(!found, "{name} still open after close");
}
