//! `ucrypt serve` against real NBD clients: qemu-img, qemu-io, nbdinfo, nbdcopy, fio, and a
//! filesystem through nbdfuse + loop. Debian packages: qemu-utils, libnbd-bin, fio, fuse3,
//! e2fsprogs, util-linux, python3-cryptography.

mod nbd_common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nbd_common::*;

const MIB: usize = 1 << 20;

fn serve_unix(dir: &TempDir, images: &[&str], extra: &[&str]) -> Server {
    let sock = dir.s("sock");
    let listen = format!("unix:{sock}");
    // The first image is VOLUME; the others are added as NAME=PATH exports.
    let first = dir.s(images[0]);
    let more: Vec<String> = images[1..]
        .iter()
        .map(|i| format!("--add-export={i}={}", dir.s(i)))
        .collect();
    let mut args: Vec<&str> = vec![&first];
    args.extend(more.iter().map(|s| s.as_str()));
    args.extend(["--nbd", &listen]);
    args.extend(extra);
    Server::start(&args, images.len())
}

#[test]
fn socket_is_private_and_uri_is_announced() {
    let dir = TempDir::new("perm");
    make_image(&dir.path("disk"), 4 * MIB, None);
    let srv = serve_unix(&dir, &["disk"], &["--unencrypted"]);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path("sock"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    assert_eq!(
        srv.uri(),
        format!("nbd+unix:///disk?socket={}", dir.s("sock"))
    );
}

#[test]
fn qemu_img_and_qemu_io_over_unix_and_tcp() {
    if !need("qemu-img", "qemu-utils") || !need("qemu-io", "qemu-utils") {
        return;
    }
    let dir = TempDir::new("qemu");
    make_image(&dir.path("disk"), 16 * MIB, None);
    make_image(&dir.path("src"), 16 * MIB, Some(0x51));
    let unix = serve_unix(&dir, &["disk"], &["--unencrypted", "--export-name", "vol"]);
    let disk = dir.s("disk");
    let tcp = Server::start(
        &[
            &disk,
            "--nbd",
            "tcp:127.0.0.1:0",
            "--insecure-plaintext",
            "--unencrypted",
            "--export-name",
            "vol",
        ],
        1,
    );
    assert!(
        tcp.uri().starts_with("nbd://127.0.0.1:") && tcp.uri().ends_with("/vol"),
        "{}",
        tcp.uri()
    );
    for (i, uri) in [unix.uri(), tcp.uri()].into_iter().enumerate() {
        let info = ok("qemu-img", &["info", "--output=json", uri]);
        let v: serde_json::Value = serde_json::from_str(&info).unwrap();
        assert_eq!(v["virtual-size"], 16 * MIB as u64, "{uri}");
        let pat = format!("0x{:02x}", 0xa0 + i);
        let w = format!("write -P {pat} 0 1M");
        let r = format!("read -P {pat} 0 1M");
        ok("qemu-io", &["-f", "raw", "-c", &w, "-c", &r, uri]);
        // Unaligned (qemu does its own read-modify-write around our 512-byte minimum).
        ok(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x11 1000 3000",
                "-c",
                "read -P 0x11 1000 3000",
                uri,
            ],
        );
        ok(
            "qemu-img",
            &[
                "convert",
                "-n",
                "-f",
                "raw",
                "-O",
                "raw",
                &dir.s("src"),
                uri,
            ],
        );
        ok(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", &dir.s("src"), uri],
        );
    }
    drop(tcp);
    drop(unix);
    assert_eq!(
        std::fs::read(dir.path("disk")).unwrap(),
        std::fs::read(dir.path("src")).unwrap()
    );
}

#[test]
fn nbdinfo_reports_size_block_sizes_flags_and_exports() {
    if !need("nbdinfo", "libnbd-bin") {
        return;
    }
    let dir = TempDir::new("info");
    make_image(&dir.path("a"), 8 * MIB, None);
    make_image(&dir.path("b"), 3 * MIB, None);
    for (extra, ro) in [(&[][..], false), (&["--read-only"][..], true)] {
        let mut args = vec!["--unencrypted"];
        args.extend_from_slice(extra);
        let srv = serve_unix(&dir, &["a", "b"], &args);
        assert_eq!(srv.uris.len(), 2);
        let sock = dir.s("sock");
        let list = ok(
            "nbdinfo",
            &["--json", "--list", &format!("nbd+unix:///?socket={sock}")],
        );
        let v: serde_json::Value = serde_json::from_str(&list).unwrap();
        let names: Vec<&str> = v["exports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["export-name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
        for (uri, size) in [(&srv.uris[0], 8 * MIB), (&srv.uris[1], 3 * MIB)] {
            let v: serde_json::Value =
                serde_json::from_str(&ok("nbdinfo", &["--json", uri])).unwrap();
            let e = &v["exports"][0];
            #[rustfmt::skip]
            let want = [
                ("export-size", serde_json::json!(size)),
                ("block_size_minimum", 512.into()), ("block_size_preferred", 4096.into()),
                ("block_size_maximum", (32 * MIB).into()),
                ("is_read_only", ro.into()), ("can_flush", true.into()), ("can_fua", true.into()),
                ("can_multi_conn", true.into()), ("can_trim", (!ro).into()), ("can_zero", (!ro).into()),
            ];
            for (k, val) in want {
                assert_eq!(e[k], val, "{uri} field {k} (read-only {ro})");
            }
        }
        // The empty export name is the default (first) export.
        let v: serde_json::Value = serde_json::from_str(&ok(
            "nbdinfo",
            &["--json", &format!("nbd+unix://?socket={sock}")],
        ))
        .unwrap();
        assert_eq!(v["exports"][0]["export-size"], 8 * MIB as u64);
        // Unknown export: refused with an error, server keeps serving.
        let (good, out) = run("nbdinfo", &[&format!("nbd+unix:///nope?socket={sock}")]);
        assert!(!good, "unknown export accepted: {out}");
        ok("nbdinfo", &["--size", &srv.uris[1]]);
        if ro && need("qemu-io", "qemu-utils") {
            let (good, out) = run("qemu-io", &["-f", "raw", "-c", "write 0 4k", &srv.uris[0]]);
            assert!(
                !good || out.contains("failed") || out.contains("denied"),
                "write to read-only export: {out}"
            );
        }
        assert_eq!(srv.stop(), Some(0));
    }
}

#[test]
fn nbdcopy_round_trips_a_random_image() {
    if !need("nbdcopy", "libnbd-bin") {
        return;
    }
    let dir = TempDir::new("copy");
    make_image(&dir.path("disk"), 32 * MIB, None);
    make_image(&dir.path("src"), 32 * MIB, Some(0xc0b1));
    let srv = serve_unix(&dir, &["disk"], &["--unencrypted"]);
    ok("nbdcopy", &[&dir.s("src"), srv.uri()]);
    ok(
        "nbdcopy",
        &[
            "--connections=4",
            "--requests=32",
            srv.uri(),
            &dir.s("back"),
        ],
    );
    assert!(std::fs::read(dir.path("back")).unwrap() == std::fs::read(dir.path("src")).unwrap());
}

fn fio(uri: &str, qd: u32, jobs: u32, bs: &str, seed: u32) -> String {
    let args = [
        "--name=nbdjob".to_string(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        "--rw=randwrite".into(),
        format!("--bs={bs}"),
        format!("--iodepth={qd}"),
        format!("--numjobs={jobs}"),
        "--size=8M".into(),
        "--offset_increment=8M".into(),
        "--verify=crc32c".into(),
        "--do_verify=1".into(),
        // fio would otherwise leave verify state files in the working directory.
        "--verify_state_save=0".into(),
        format!("--randseed={seed}"),
        "--group_reporting".into(),
    ];
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    ok("fio", &args)
}

#[test]
fn fio_verify_finds_no_errors_qd1_qd32_multi_conn() {
    if !need("fio", "fio") {
        return;
    }
    let dir = TempDir::new("fio");
    make_image(&dir.path("disk"), 32 * MIB, None);
    make_image(&dir.path("key"), 64, Some(7));
    let key = dir.s("key");
    for mode in [
        vec!["--unencrypted"],
        vec![
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &key,
            "--sector-size",
            "4096",
        ],
    ] {
        let srv = serve_unix(&dir, &["disk"], &mode);
        // Each fio job is its own NBD connection: 3 jobs = multi-conn to one export.
        for (qd, jobs, bs) in [
            (1, 1, "4k"),
            (32, 1, "4k"),
            (32, 3, "4k"),
            (8, 3, "512"),
            (4, 2, "64k"),
        ] {
            let out = fio(srv.uri(), qd, jobs, bs, 1234);
            assert!(
                out.contains("err= 0"),
                "fio {mode:?} qd {qd} jobs {jobs} bs {bs}:\n{out}"
            );
            assert!(
                !out.contains("verify: bad") && !out.contains("verify failed"),
                "fio verify failure {mode:?} qd {qd}:\n{out}"
            );
        }
        assert_eq!(srv.stop(), Some(0));
    }
}

#[test]
fn ext4_on_nbdfuse_and_loop_survives_fsck() {
    if !need("nbdfuse", "libnbd-bin")
        || !need("mkfs.ext4", "e2fsprogs")
        || !need("losetup", "mount")
        || !need("fusermount3", "fuse3")
    {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/dev/fuse").exists() {
        println!("SKIPPED: needs root, /dev/fuse and loop devices");
        return;
    }
    let dir = TempDir::new("fs");
    make_image(&dir.path("disk"), 64 * MIB, None);
    make_image(&dir.path("key"), 64, Some(9));
    let key = dir.s("key");
    let srv = serve_unix(
        &dir,
        &["disk"],
        &[
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &key,
            "--sector-size",
            "4096",
        ],
    );
    let fuse_dir = dir.path("fuse");
    let mnt = dir.path("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let mut nbdfuse = Command::new("nbdfuse")
        .arg(&fuse_dir)
        .arg(srv.uri())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let dev_file = fuse_dir.join("nbd");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dev_file.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let result = std::panic::catch_unwind(|| {
        let out = ok("losetup", &["-f", "--show", &dev_file.to_string_lossy()]);
        let l = out.trim().to_string();
        let mnt_s = mnt.to_string_lossy().into_owned();
        let r = std::panic::catch_unwind(|| {
            ok("mkfs.ext4", &["-q", "-F", &l]);
            ok("mount", &[&l, &mnt_s]);
            let data = pattern(3 * MIB + 123, 77);
            for i in 0..5 {
                std::fs::write(mnt.join(format!("f{i}")), &data[i..]).unwrap();
            }
            ok("umount", &[&mnt_s]);
            ok("mount", &[&l, &mnt_s]);
            for i in 0..5 {
                assert!(std::fs::read(mnt.join(format!("f{i}"))).unwrap() == data[i..]);
            }
            ok("umount", &[&mnt_s]);
            let out = ok("fsck.ext4", &["-f", "-n", &l]);
            println!("{out}");
            assert!(out.contains("16/") || out.contains("files"), "{out}");
        });
        let _ = run("umount", &[&mnt_s]);
        let _ = run("losetup", &["-d", &l]);
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
        l
    });
    let _ = run("fusermount3", &["-u", &fuse_dir.to_string_lossy()]);
    let _ = wait_timeout(&mut nbdfuse, Duration::from_secs(10)).or_else(|| {
        let _ = nbdfuse.kill();
        nbdfuse.wait().ok().and_then(|s| s.code())
    });
    let loopdev = match result {
        Ok(l) => l,
        Err(e) => std::panic::resume_unwind(e),
    };
    println!("ext4 on {loopdev} over nbdfuse: written, remounted, verified, fsck clean");
    assert!(loopdev.starts_with("/dev/loop"));
    assert_eq!(srv.stop(), Some(0));
}

#[test]
fn sigterm_exits_zero_flushes_and_removes_pid_file_and_socket() {
    if !need("qemu-io", "qemu-utils") {
        return;
    }
    let dir = TempDir::new("term");
    make_image(&dir.path("disk"), 8 * MIB, None);
    let pid = dir.s("pid");
    let srv = serve_unix(&dir, &["disk"], &["--unencrypted", "--pid-file", &pid]);
    let written: i32 = std::fs::read_to_string(&pid)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(written, srv.pid());
    // A client that is mid-session when the server stops.
    let mut client = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0x77 0 4M",
            "-c",
            "sleep 2000",
            "-c",
            "read -P 0x77 0 4M",
            srv.uri(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Stop only once the write is acknowledged (qemu-io reports it, then sleeps).
    let out = client.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(out));
    let acked = lines.any(|l| l.map(|l| l.starts_with("wrote 4194304/")).unwrap_or(false));
    assert!(acked, "qemu-io did not report its write");
    assert_eq!(srv.stop(), Some(0));
    let _ = wait_timeout(&mut client, Duration::from_secs(20));
    assert!(!dir.path("pid").exists(), "pid file left behind");
    assert!(!dir.path("sock").exists(), "socket left behind");
    let data = std::fs::read(dir.path("disk")).unwrap();
    assert!(
        data[..4 * MIB].iter().all(|&b| b == 0x77),
        "acknowledged write lost"
    );
}

#[test]
fn tcp_without_tls_needs_explicit_waiver() {
    let dir = TempDir::new("tcp");
    make_image(&dir.path("disk"), MIB, None);
    let (good, out) = run(
        UCRYPT,
        &[
            "serve",
            &dir.s("disk"),
            "--nbd",
            "tcp:127.0.0.1:0",
            "--unencrypted",
        ],
    );
    assert!(!good && out.contains("TLS"), "{out}");
}

/// Raw mode writes dm-crypt compatible ciphertext: decrypt the file independently (AES-XTS with
/// the 512-byte-unit IV of 4096-byte sectors) with python3-cryptography.
#[test]
fn raw_mode_ciphertext_matches_dm_crypt_plain_layout() {
    if !need("qemu-io", "qemu-utils") {
        return;
    }
    let py = "/usr/bin/python3";
    let (has_crypto, _) = run(py, &["-c", "import cryptography"]);
    if !has_crypto {
        if std::env::var_os("CI").is_some() {
            panic!("python3-cryptography is required under CI");
        }
        println!("SKIPPED: python3-cryptography not installed");
        return;
    }
    let dir = TempDir::new("raw");
    make_image(&dir.path("disk"), 4 * MIB, None);
    make_image(&dir.path("key"), 64, Some(3));
    let key = dir.s("key");
    let srv = serve_unix(
        &dir,
        &["disk"],
        &[
            "--cipher",
            "aes-xts-plain64",
            "--volume-key-file",
            &key,
            "--sector-size",
            "4096",
            "--offset",
            "2048",
        ],
    );
    ok(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x5a 8192 8192", srv.uri()],
    );
    assert_eq!(srv.stop(), Some(0));
    let script = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
key = open(sys.argv[1], 'rb').read()
data = open(sys.argv[2], 'rb').read()
for sector in (2, 3):
    ct = data[1048576 + sector * 4096: 1048576 + (sector + 1) * 4096]
    iv = (sector * 8).to_bytes(16, 'little')
    d = Cipher(algorithms.AES(key), modes.XTS(iv)).decryptor()
    pt = d.update(ct) + d.finalize()
    assert ct != pt
    assert pt == b'\x5a' * 4096, sector
print('ok')
"#;
    let out = ok(py, &["-c", script, &key, &dir.s("disk")]);
    assert!(out.contains("ok"));
}

#[test]
fn notifies_systemd_when_ready() {
    let dir = TempDir::new("notify");
    make_image(&dir.path("disk"), 1 << 20, None);
    let notify = std::os::unix::net::UnixDatagram::bind(dir.path("notify")).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut child = Command::new(UCRYPT)
        .args([
            "serve",
            &dir.s("disk"),
            "--unencrypted",
            "--nbd",
            &format!("unix:{}", dir.s("sock")),
        ])
        .env("NOTIFY_SOCKET", dir.path("notify"))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 64];
    let got = notify.recv(&mut buf);
    terminate(child.id() as i32);
    assert_eq!(wait_timeout(&mut child, Duration::from_secs(20)), Some(0));
    let n = got.expect("no sd_notify datagram");
    assert_eq!(&buf[..n], b"READY=1");
}
