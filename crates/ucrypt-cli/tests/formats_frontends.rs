//! The foreign formats through the NBD and FUSE front ends: one of cryptsetup's upstream
//! BitLocker images (`bitlk-aes-cbc-elephant-128`, AES-CBC with the Elephant diffuser) and
//! TCRYPT images (`tc_4-sha512-xts-aes-twofish-serpent`, a cascade; `tck_5-sha512-xts-aes`,
//! whose keyfile pool takes two `--key-file`), each opened with
//! `ucrypt serve --type T --nbd unix:SOCK` and read whole by `nbdcopy`, and with
//! `ucrypt mount --type T` and read whole from the FUSE file. Both must equal
//! `ucrypt export --type T` of the same image, itself checked against what cryptsetup's compat
//! tests expect (the SHA-256 in `bitlk-images/images.conf`; the TCRYPT image's FAT serial
//! DEAD-BABE).
//!
//! SKIPPED when cryptsetup's test material cannot be had or xz is missing; the NBD half needs
//! nbdcopy (libnbd-bin; a failure under CI, which installs it), the FUSE half /dev/fuse and
//! either root or fusermount3 (SKIPPED otherwise, also under CI).

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cli_common::{have, is_root, require, run, run_in, s, text, TempDir, UCRYPT};
use kit::skip;
use sha2::{Digest, Sha256};

/// How long a server may take to open the volume and announce it, or a mount to appear: the
/// TCRYPT header search runs PBKDF2 for every candidate, slow on a loaded machine.
const READY_WAIT: Duration = Duration::from_secs(180);
/// How long a server or mount may take to exit after SIGTERM.
const EXIT_WAIT: Duration = Duration::from_secs(30);

/// One image and how to open it.
struct Case {
    /// The `--type`.
    kind: &'static str,
    img: PathBuf,
    /// Options besides `--type` and `-r`.
    extra: Vec<String>,
    /// The passphrase, given on stdin.
    pass: String,
}

impl Case {
    /// `VERB --type KIND -r EXTRA...`, to which the caller appends the positional arguments.
    fn args(&self, verb: &'static str) -> Vec<String> {
        let mut a: Vec<String> = [verb, "--type", self.kind, "-r"]
            .iter()
            .map(|x| x.to_string())
            .collect();
        a.extend(self.extra.iter().cloned());
        a
    }
}

/// A child `ucrypt` that is sent SIGTERM (and reaped) when dropped.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        kit::terminate(self.0.id());
        if kit::wait_timeout(&mut self.0, EXIT_WAIT).is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Daemon {
    /// SIGTERM, then the exit code (None: still running after [`EXIT_WAIT`], or a signal).
    fn stop(mut self) -> Option<i32> {
        kit::terminate(self.0.id());
        kit::wait_timeout(&mut self.0, EXIT_WAIT)
    }
}

/// Starts `ucrypt ARGS` with `pass` on its stdin (then closed); stdout piped.
fn spawn(args: &[String], pass: &str) -> Daemon {
    let mut c = Command::new(UCRYPT)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn ucrypt");
    let mut stdin = c.stdin.take().expect("stdin piped");
    stdin
        .write_all(pass.as_bytes())
        .expect("passphrase to stdin");
    drop(stdin);
    Daemon(c)
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// The FAT volume serial of a FAT12/16 boot sector as blkid prints it.
fn fat_serial(boot: &[u8]) -> String {
    let Some(v) = boot.get(0x27..0x2b) else {
        return String::new();
    };
    let v = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    format!("{:04X}-{:04X}", v >> 16, v & 0xffff)
}

/// The value of `key=` in `[section]` of bitlk-images/images.conf.
fn conf_value(conf: &str, section: &str, key: &str) -> Option<String> {
    let head = format!("[{section}]");
    conf.lines()
        .skip_while(|l| l.trim() != head)
        .skip(1)
        .take_while(|l| !l.trim().starts_with('['))
        .find_map(|l| l.trim().strip_prefix(&format!("{key}=")).map(String::from))
}

/// `ucrypt export` of the case into `out`: the plaintext.
fn export(case: &Case, out: &Path) -> Vec<u8> {
    let mut a = case.args("export");
    a.extend([s(&case.img).to_string(), s(out).to_string()]);
    let a: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    let o = run_in(UCRYPT, &a, case.pass.as_bytes());
    assert!(o.status.success(), "{a:?}: {}", text(&o));
    std::fs::read(out).unwrap()
}

/// `ucrypt serve --nbd unix:SOCK`, read whole by nbdcopy into `out`.
fn through_nbd(case: &Case, sock: &Path, out: &Path) -> Vec<u8> {
    let mut a = case.args("serve");
    a.extend([
        s(&case.img).to_string(),
        "--nbd".into(),
        format!("unix:{}", s(sock)),
    ]);
    let mut d = spawn(&a, &case.pass);
    let stdout = d.0.stdout.take().expect("stdout piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(u) = line.strip_prefix("ready: ") {
                let _ = tx.send(u.to_string());
            }
        }
    });
    let uri = rx
        .recv_timeout(READY_WAIT)
        .unwrap_or_else(|_| panic!("{a:?}: no ready line"));
    let o = run("nbdcopy", &[&uri, s(out)]);
    assert!(o.status.success(), "nbdcopy {uri}: {}", text(&o));
    assert_eq!(d.stop(), Some(0), "{a:?}: exit code after SIGTERM");
    std::fs::read(out).unwrap()
}

/// Whether `p` (whose parent exists) is a FUSE mount point.
fn is_fuse_mount(p: &Path) -> bool {
    let p = match (p.parent().map(std::fs::canonicalize), p.file_name()) {
        (Some(Ok(dir)), Some(name)) => dir.join(name),
        _ => p.to_path_buf(),
    };
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let tail = l.split(" - ").nth(1).unwrap_or("");
            l.split(' ').nth(4) == p.to_str() && tail.starts_with("fuse")
        })
}

/// `ucrypt mount` onto the regular file `file` (created, and removed on unmount), read whole.
fn through_fuse(case: &Case, file: &Path) -> Vec<u8> {
    let mut a = case.args("mount");
    a.extend([s(&case.img).to_string(), s(file).to_string()]);
    let mut d = spawn(&a, &case.pass);
    let t0 = Instant::now();
    while !is_fuse_mount(file) {
        if let Ok(Some(st)) = d.0.try_wait() {
            panic!("{a:?} exited before mounting: {st}");
        }
        assert!(t0.elapsed() < READY_WAIT, "{a:?}: no mount in time");
        std::thread::sleep(Duration::from_millis(20));
    }
    let data = std::fs::read(file).expect("read the FUSE file");
    assert_eq!(d.stop(), Some(0), "{a:?}: exit code after SIGTERM");
    assert!(!is_fuse_mount(file), "{a:?}: still mounted after exit");
    data
}

/// Why the FUSE half cannot run here, if it cannot.
fn fuse_missing() -> Option<String> {
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse missing".into());
    }
    if !is_root() && !have("fusermount3") {
        return Some("not root and no fusermount3 (Debian package fuse3)".into());
    }
    None
}

/// Exports, serves and mounts `case`; the served and mounted bytes must equal the export's.
fn check_front_ends(case: &Case, tmp: &TempDir, name: &str) -> Vec<u8> {
    let plain = export(case, &tmp.path(&format!("{name}.export")));
    if require("nbdcopy", "libnbd-bin") {
        let got = through_nbd(
            case,
            &tmp.path(&format!("{name}.sock")),
            &tmp.path(&format!("{name}.nbd")),
        );
        assert!(got == plain, "{name}: NBD bytes differ from export's");
        println!("{name}: serve --type {} over NBD = export", case.kind);
    }
    match fuse_missing() {
        Some(why) => skip(format!("{name} over FUSE: {why}")),
        None => {
            let got = through_fuse(case, &tmp.path(&format!("{name}.fuse")));
            assert!(got == plain, "{name}: FUSE bytes differ from export's");
            println!("{name}: mount --type {} over FUSE = export", case.kind);
        }
    }
    plain
}

#[test]
fn bitlk_through_serve_and_mount() {
    let Some((tmp, dir)) = cli_common::unpacked_images("bitlk-images") else {
        return;
    };
    let name = "bitlk-aes-cbc-elephant-128";
    let conf = std::fs::read_to_string(dir.join("images.conf")).unwrap();
    let pw = conf_value(&conf, name, "PW").expect("PW in images.conf");
    let want = conf_value(&conf, name, "SHA256SUM").expect("SHA256SUM in images.conf");
    let case = Case {
        kind: "bitlk",
        img: dir.join(format!("{name}.img")),
        extra: Vec::new(),
        pass: format!("{pw}\n"),
    };
    let plain = check_front_ends(&case, &tmp, name);
    assert_eq!(sha256_hex(&plain), want, "{name}: export's SHA-256");
}

#[test]
fn tcrypt_through_serve_and_mount() {
    let Some((tmp, dir)) = cli_common::unpacked_images("tcrypt-images") else {
        return;
    };
    let name = "tc_4-sha512-xts-aes-twofish-serpent";
    // The TrueCrypt header only (no VeraCrypt candidates), with the compat test's filters.
    let case = Case {
        kind: "tcrypt",
        img: dir.join(name),
        extra: ["--disable-veracrypt", "-h", "sha512", "-c", "aes"]
            .map(String::from)
            .to_vec(),
        pass: "aaaaaaaaaaaa\n".into(),
    };
    let plain = check_front_ends(&case, &tmp, name);
    assert_eq!(
        fat_serial(&plain),
        "DEAD-BABE",
        "{name}: export's FAT serial"
    );
}

/// The keyfile image of cryptsetup's set: `serve` and `mount` take its two keyfiles as two
/// `--key-file`, as `export` does.
#[test]
fn tcrypt_keyfile_pool_through_serve_and_mount() {
    let Some((tmp, dir)) = cli_common::unpacked_images("tcrypt-images") else {
        return;
    };
    let name = "tck_5-sha512-xts-aes";
    let mut extra: Vec<String> = ["--disable-veracrypt", "-h", "sha512", "-c", "aes"]
        .map(String::from)
        .to_vec();
    for k in ["keyfile1", "keyfile2"] {
        extra.extend(["--key-file".to_string(), s(&dir.join(k)).to_string()]);
    }
    let case = Case {
        kind: "tcrypt",
        img: dir.join(name),
        extra,
        pass: "aaaaaaaaaaaa\n".into(),
    };
    let plain = check_front_ends(&case, &tmp, name);
    assert_eq!(
        fat_serial(&plain),
        "DEAD-BABE",
        "{name}: export's FAT serial"
    );
}
