//! ucrypt in front of Ceph RBD, against a real single-node cluster (scripts/ceph-cluster.sh),
//! as a user types it:
//! - `ucrypt format rbd:rbd/IMG` (data offset aligned to the object size, as librbd does),
//!   `ucrypt mount` it (FUSE), losetup, mkfs.ext4, copy a tree, umount, fsck; then qemu's rbd
//!   driver with librbd's own LUKS2 (`encrypt.format=luks2`) reads the same plaintext as
//!   `ucrypt export`, and that plaintext is a clean ext4;
//! - the reverse: an image formatted by `rbd encryption format` (librbd's argon2id) and written
//!   through qemu opens in ucrypt, which reads what qemu wrote;
//! - ucrypt's NBD client in front of qemu-storage-daemon exporting a raw rbd image: fio
//!   verifies through it at QD1 and QD32, and the same image opened as `rbd:` directly holds
//!   the plaintext that went through NBD;
//! - a clone header (magic RBDL, what later librbd writes on a clone formatted on its own) is
//!   named in the error.
//!
//! Debian packages: ceph-mon ceph-osd ceph-common (the cluster), qemu-utils and
//! qemu-block-extra (qemu's rbd driver), e2fsprogs, mount. Without Ceph: SKIPPED (CI fails).

#[path = "../../ucrypt-rbd/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{image_name, run_cases, Cluster};

const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");
const PASSPHRASE: &[u8] = b"rbd interop passphrase";
const IMAGE_SIZE: &str = "96M";

#[test]
fn ucrypt_on_rbd_against_librbd() {
    run_cases(
        "cli",
        &[
            (
                "ucrypt_format_filesystem_reads_in_qemu",
                ucrypt_format_filesystem_reads_in_qemu,
            ),
            (
                "rbd_encryption_format_opens_in_ucrypt",
                rbd_encryption_format_opens_in_ucrypt,
            ),
            ("rbd_clone_header_is_named", rbd_clone_header_is_named),
            ("nbd_backend_over_qsd_rbd", nbd_backend_over_qsd_rbd),
        ],
    );
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(prog: &str, args: &[&str]) -> Output {
    let o = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {prog}: {e}"));
    assert!(o.status.success(), "{prog} {args:?}: {}", text(&o));
    o
}

struct Scratch(PathBuf);
impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("ucrypt-rbdcli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch dir");
        std::fs::write(d.join("pass"), PASSPHRASE).expect("pass");
        Scratch(d)
    }
    fn p(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// qemu's rbd driver through librbd's own LUKS encryption, for `qemu-img`/`qemu-io`.
fn qemu_image_opts(c: &Cluster, image: &str) -> String {
    format!(
        "driver=rbd,pool=rbd,image={image},conf={},encrypt.format=luks2,encrypt.key-secret=sec0",
        c.conf.display()
    )
}

fn need_qemu_rbd() -> bool {
    let o = Command::new("qemu-img")
        .args(["--help"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(" rbd "))
        .unwrap_or(false);
    common::present((!o).then(|| {
        "qemu's rbd driver not available (Debian packages qemu-utils, qemu-block-extra)".into()
    }))
}

/// The whole plaintext as librbd's encryption reads it, every byte (no extent shortcuts).
fn qemu_read_all(c: &Cluster, s: &Scratch, image: &str, bytes: u64, out: &str) {
    ok(
        "qemu-img",
        &[
            "dd",
            "--object",
            &format!("secret,id=sec0,file={}", s.p("pass")),
            "--image-opts",
            &format!("if={}", qemu_image_opts(c, image)),
            &format!("of={out}"),
            "bs=1M",
            &format!("count={}", bytes >> 20),
        ],
    );
}

/// Waits for `path` to be served by a FUSE mount (a regular file of `size` bytes).
fn wait_for_file(path: &Path, size: u64) {
    let t0 = Instant::now();
    while std::fs::metadata(path).map(|m| m.len()).ok() != Some(size) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{} not served",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ucrypt_format_filesystem_reads_in_qemu(c: &Cluster) {
    if !need_qemu_rbd() {
        return;
    }
    let s = Scratch::new("fmt");
    let img = image_name("ufmt");
    c.create_image(&img, IMAGE_SIZE);
    let target = format!("rbd:rbd/{img}");
    let conf = c.conf.display().to_string();
    let o = ok(
        UCRYPT,
        &[
            "format",
            "-q",
            &target,
            &s.p("pass"),
            "--rbd-conf",
            &conf,
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("aligned to the image's object size"),
        "{}",
        text(&o)
    );
    let dump = String::from_utf8_lossy(&ok(UCRYPT, &["dump", &target, "--rbd-conf", &conf]).stdout)
        .to_string();
    assert!(dump.contains("offset: 16777216 [bytes]"), "{dump}");

    // Serve it as a FUSE file, put a filesystem on it through a loop device, copy a tree.
    let file = s.0.join("plain");
    let mut mount = Command::new(UCRYPT)
        .args(["mount", &target, &file.display().to_string()])
        .args(["--key-file", &s.p("pass"), "--rbd-conf", &conf])
        .stdin(Stdio::null())
        .spawn()
        .expect("ucrypt mount");
    let data_bytes = (96u64 << 20) - (16 << 20);
    wait_for_file(&file, data_bytes);
    let lo = String::from_utf8_lossy(
        &ok(
            "losetup",
            &[
                "-f",
                "--show",
                "--direct-io=on",
                &file.display().to_string(),
            ],
        )
        .stdout,
    )
    .trim()
    .to_string();
    let mnt = s.0.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let m = mnt.display().to_string();
    let tree = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let copied = std::panic::catch_unwind(|| {
        ok("mkfs.ext4", &["-q", "-F", &lo]);
        ok("mount", &[&lo, &m]);
        ok(
            "cp",
            &["-r", &tree.display().to_string(), &format!("{m}/src")],
        );
        ok("umount", &[&m]);
        ok("fsck.ext4", &["-fn", &lo]);
    });
    let _ = Command::new("umount")
        .arg(&m)
        .stderr(Stdio::null())
        .status();
    ok("losetup", &["-d", &lo]);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(mount.id() as i32, libc::SIGTERM) };
    let st = mount.wait().expect("wait mount");
    assert!(copied.is_ok(), "filesystem steps failed");
    assert_eq!(st.code(), Some(0), "ucrypt mount exits 0 after SIGTERM");

    // librbd's own LUKS2 reads the same plaintext ucrypt does, and it is a clean ext4 holding
    // the tree.
    let ours = s.p("ours.img");
    ok(
        UCRYPT,
        &[
            "export",
            &target,
            &ours,
            "--key-file",
            &s.p("pass"),
            "--rbd-conf",
            &conf,
        ],
    );
    let theirs = s.p("theirs.img");
    qemu_read_all(c, &s, &img, data_bytes, &theirs);
    assert!(
        std::fs::read(&ours).unwrap() == std::fs::read(&theirs).unwrap(),
        "qemu (librbd LUKS2) and ucrypt read different plaintext"
    );
    ok("fsck.ext4", &["-fn", &theirs]);
    let ls = ok("debugfs", &["-R", "ls -l /src", &theirs]);
    assert!(String::from_utf8_lossy(&ls.stdout).contains("main.rs"));
}

fn rbd_encryption_format_opens_in_ucrypt(c: &Cluster) {
    if !need_qemu_rbd() {
        return;
    }
    let s = Scratch::new("librbd");
    let img = image_name("lfmt");
    c.create_image(&img, IMAGE_SIZE);
    // librbd's own format: argon2id with its own costs (~2 s per unlock here).
    c.rbd(&[
        "encryption",
        "format",
        &format!("rbd/{img}"),
        "luks2",
        &s.p("pass"),
    ]);
    // qemu writes a pattern through librbd's encryption.
    ok(
        "qemu-io",
        &[
            "--object",
            &format!("secret,id=sec0,file={}", s.p("pass")),
            "--image-opts",
            &qemu_image_opts(c, &img),
            "-c",
            "write -P 0xab 1M 4M",
        ],
    );
    let target = format!("rbd:rbd/{img}");
    let conf = c.conf.display().to_string();
    let dump = String::from_utf8_lossy(&ok(UCRYPT, &["dump", &target, "--rbd-conf", &conf]).stdout)
        .to_string();
    assert!(dump.contains("argon2id"), "{dump}");
    let out = s.p("plain.img");
    ok(
        UCRYPT,
        &[
            "export",
            &target,
            &out,
            "--key-file",
            &s.p("pass"),
            "--rbd-conf",
            &conf,
        ],
    );
    let plain = std::fs::read(&out).unwrap();
    assert!(
        plain[1 << 20..5 << 20].iter().all(|&b| b == 0xab),
        "ucrypt reads what qemu wrote through librbd"
    );
    // And what ucrypt writes, qemu reads.
    let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 + 3) as u8).collect();
    std::fs::write(s.p("pattern"), &pattern).unwrap();
    let served = Command::new(UCRYPT)
        .args(["serve", &target, "--nbd", &format!("unix:{}", s.p("sock"))])
        .args(["--key-file", &s.p("pass"), "--rbd-conf", &conf])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("serve");
    let mut served = ServeGuard(served);
    let t0 = Instant::now();
    while !Path::new(&s.p("sock")).exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "serve did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    ok(
        "qemu-img",
        &[
            "dd",
            &format!("if={}", s.p("pattern")),
            "-O",
            "raw",
            &format!("of=nbd+unix:///{img}?socket={}", s.p("sock")),
            "bs=1M",
            "count=1",
        ],
    );
    served.stop();
    let back = s.p("back.img");
    qemu_read_all(c, &s, &img, 1 << 20, &back);
    assert!(
        std::fs::read(&back).unwrap() == pattern,
        "qemu reads what ucrypt wrote"
    );
}

struct ServeGuard(std::process::Child);
impl ServeGuard {
    fn stop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}
impl Drop for ServeGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// librbd 16.2.15 (Debian 12) refuses `rbd encryption format` on a clone ("cannot format a
/// cloned image"; later librbd writes such a clone's header with the magic `RBDL\xba\xbe`), so
/// the clone header is made here from a real LUKS2 image whose magic is patched, then imported
/// as an image: ucrypt must name it rather than call it "not LUKS".
fn rbd_clone_header_is_named(c: &Cluster) {
    let s = Scratch::new("clone");
    let img = image_name("plain2");
    c.create_image(&img, "32M");
    c.rbd(&[
        "encryption",
        "format",
        &format!("rbd/{img}"),
        "luks1",
        &s.p("pass"),
    ]);
    let raw = s.p("raw.img");
    c.rbd(&["export", &format!("rbd/{img}"), &raw]);
    let mut bytes = std::fs::read(&raw).unwrap();
    assert_eq!(&bytes[..6], b"LUKS\xba\xbe");
    bytes[..6].copy_from_slice(b"RBDL\xba\xbe");
    std::fs::write(&raw, &bytes).unwrap();
    let child = image_name("clonehdr");
    c.rbd(&["import", &raw, &format!("rbd/{child}")]);
    let o = Command::new(UCRYPT)
        .args(["dump", &format!("rbd:rbd/{child}"), "--rbd-conf"])
        .arg(&c.conf)
        .output()
        .expect("dump");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("RBDL"),
        "{}",
        text(&o)
    );
}

fn nbd_backend_over_qsd_rbd(c: &Cluster) {
    if !need_qemu_rbd() {
        return;
    }
    let s = Scratch::new("qsdrbd");
    let img = image_name("qsdrbd");
    c.create_image(&img, "64M");
    let qsd_sock = s.p("qsd.sock");
    let qsd = Command::new("qemu-storage-daemon")
        .arg("--blockdev")
        .arg(format!(
            "driver=rbd,node-name=r0,pool=rbd,image={img},conf={}",
            c.conf.display()
        ))
        .args([
            "--nbd-server",
            &format!("addr.type=unix,addr.path={qsd_sock}"),
        ])
        .args([
            "--export",
            "type=nbd,id=e0,node-name=r0,name=disk,writable=on",
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("qemu-storage-daemon");
    let _qsd = ServeGuard(qsd);
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&qsd_sock).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(60), "qsd did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    let remote = format!("nbd+unix:///disk?socket={qsd_sock}");
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            &remote,
            &s.p("pass"),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    let served = Command::new(UCRYPT)
        .args(["serve", &remote, "--nbd", &format!("unix:{}", s.p("sock"))])
        .args(["--export-name", "v", "--key-file", &s.p("pass")])
        .stdout(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .expect("serve");
    let mut served = ServeGuard(served);
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(s.p("sock")).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "serve did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let uri = format!("nbd+unix:///v?socket={}", s.p("sock"));
    for qd in ["1", "32"] {
        ok(
            "fio",
            &[
                "--name=v",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=randwrite",
                "--bs=4k",
                &format!("--iodepth={qd}"),
                "--size=8M",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_state_save=0",
            ],
        );
    }
    let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i * 13 + 5) as u8).collect();
    std::fs::write(s.p("pattern"), &pattern).unwrap();
    ok("nbdcopy", &[&s.p("pattern"), &uri]);
    served.stop();
    drop(_qsd);
    let out = s.p("plain.img");
    let conf = c.conf.display().to_string();
    ok(
        UCRYPT,
        &[
            "export",
            &format!("rbd:rbd/{img}"),
            &out,
            "--key-file",
            &s.p("pass"),
            "--rbd-conf",
            &conf,
        ],
    );
    let plain = std::fs::read(&out).unwrap();
    assert!(
        plain[..1 << 20] == pattern[..],
        "the rbd image holds, as ciphertext, what went through ucrypt -> NBD -> qemu -> librbd"
    );
}
