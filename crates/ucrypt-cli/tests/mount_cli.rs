//! `ucrypt mount` (raw dm-crypt mode) end to end: mount the binary, losetup --direct-io=on,
//! mkfs.ext4, copy a tree, fsck; SIGTERM while the loop device still holds the file (the
//! process must keep serving until `losetup -d`, then exit 0); the ciphertext on disk decrypts
//! (with the sector layer) to a clean ext4; remount with --file-name, read back, SIGINT.
//! Needs root, /dev/fuse and loop devices: SKIPPED otherwise.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
const IMG_BYTES: u64 = 48 << 20;
const DATA_OFFSET: u64 = 1 << 20;
/// How long the mount may take to appear, or the process to exit after a signal.
const WAIT: Duration = Duration::from_secs(20);

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount, losetup)".into());
    }
    for p in ["/dev/fuse", "/dev/loop-control"] {
        if !Path::new(p).exists() {
            return Some(format!("{p} missing"));
        }
    }
    None
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn is_fuse_mount(p: &Path) -> bool {
    let canon = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            // mountinfo: ... mount-point ... - fstype source options
            let tail = l.split(" - ").nth(1).unwrap_or("");
            l.split(' ').nth(4) == canon.to_str()
                && tail.starts_with("fuse")
                && tail.contains(" ucrypt:")
        })
}

struct Server(Child);
impl Server {
    fn start(args: &[&str], mountpoint: &Path) -> Server {
        let child = Command::new(BIN)
            .arg("mount")
            .args(args)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ucrypt mount");
        let s = Server(child);
        let t0 = Instant::now();
        while !is_fuse_mount(mountpoint) {
            assert!(
                t0.elapsed() < WAIT,
                "ucrypt mount did not mount {} in time",
                mountpoint.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }
    fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child process.
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, sig) }, 0);
    }
    fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.0.try_wait().expect("try_wait") {
                return Some(st.code().unwrap_or(-1));
            }
            if t0.elapsed() > within {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
impl Drop for Server {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

struct Cleanup(Vec<(String, Vec<String>)>);
impl Cleanup {
    /// Detaches a loop device now and drops its cleanup entry: detaching it again at the end
    /// could hit a loop device that a test running in parallel has attached since under the
    /// same name.
    fn detach_loop(&mut self, lo: &str) {
        run("losetup", &["-d", lo]);
        self.0
            .retain(|(c, a)| !(c == "losetup" && a.iter().any(|x| x == lo)));
    }
}
impl Drop for Cleanup {
    fn drop(&mut self) {
        for (c, a) in self.0.iter().rev() {
            let _ = Command::new(c).args(a).stderr(Stdio::null()).status();
        }
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[test]
fn mount_cli_raw_mode_end_to_end() {
    if let Some(r) = skip_reason() {
        println!("SKIPPED: {r}");
        return;
    }
    let seed: u64 = std::env::var("UCRYPT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f05e);
    println!("seed: UCRYPT_TEST_SEED={seed}");
    let mut st = seed;
    let tmp = std::env::temp_dir().join(format!("ucrypt-mount-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).expect("tmp");
    let mut cleanup = Cleanup(vec![(
        "rm".into(),
        vec!["-rf".into(), tmp.display().to_string()],
    )]);

    let img = tmp.join("vol.img");
    std::fs::File::create(&img)
        .expect("img")
        .set_len(IMG_BYTES)
        .expect("size img");
    let key: Vec<u8> = (0..8)
        .flat_map(|_| splitmix(&mut st).to_le_bytes())
        .collect();
    let keyf = tmp.join("key");
    std::fs::write(&keyf, &key).expect("key");
    let src = tmp.join("src");
    std::fs::create_dir_all(src.join("d")).expect("src");
    let mut payload = vec![0u8; (2 << 20) + 333];
    for c in payload.chunks_mut(8) {
        c.copy_from_slice(&splitmix(&mut st).to_le_bytes()[..c.len()]);
    }
    std::fs::write(src.join("d/payload"), &payload).expect("payload");
    std::fs::write(src.join("hello"), b"hello\n").expect("hello");

    let file = tmp.join("plain");
    std::fs::write(&file, b"").expect("mount point");
    // --offset counts 512-byte sectors, like cryptsetup plain.
    let off = (DATA_OFFSET / 512).to_string();
    let raw = [
        "--cipher",
        "aes-xts-plain64",
        "--volume-key-file",
        keyf.to_str().expect("utf-8"),
        "--sector-size",
        "4096",
        "--offset",
        &off,
    ];
    let mut args = vec![img.to_str().expect("utf-8"), file.to_str().expect("utf-8")];
    args.extend_from_slice(&raw);
    let mut srv = Server::start(&args, &file);
    assert_eq!(
        std::fs::metadata(&file).expect("stat").len(),
        IMG_BYTES - DATA_OFFSET
    );

    let lo = run(
        "losetup",
        &[
            "--find",
            "--show",
            "--direct-io=on",
            file.to_str().expect("utf-8"),
        ],
    );
    cleanup
        .0
        .push(("losetup".into(), vec!["-d".into(), lo.clone()]));
    run("mkfs.ext4", &["-q", "-F", &lo]);
    let mnt = tmp.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mnt");
    run("mount", &[&lo, mnt.to_str().expect("utf-8")]);
    cleanup
        .0
        .push(("umount".into(), vec![mnt.display().to_string()]));
    run(
        "cp",
        &[
            "-a",
            &format!("{}/.", src.display()),
            mnt.to_str().expect("utf-8"),
        ],
    );
    run("umount", &[mnt.to_str().expect("utf-8")]);
    run("fsck.ext4", &["-f", "-n", &lo]);

    // SIGTERM while the loop device holds the file: detach, keep serving, exit after losetup -d.
    srv.signal(libc::SIGTERM);
    assert_eq!(
        srv.wait_exit(Duration::from_millis(500)),
        None,
        "exited while the loop device still used the file"
    );
    run("fsck.ext4", &["-f", "-n", &lo]);
    cleanup.detach_loop(&lo);
    assert_eq!(
        srv.wait_exit(WAIT),
        Some(0),
        "ucrypt mount did not exit cleanly after the last user left"
    );
    assert!(!is_fuse_mount(&file));

    // The ciphertext decrypts, with the sector layer (proven equal to dm-crypt), to a clean fs.
    let mut data = std::fs::read(&img)
        .expect("read img")
        .split_off(DATA_OFFSET as usize);
    let spec: CipherSpec = "aes-xts-plain64".parse().expect("spec");
    SectorCipher::new(spec, &key, Geometry::new(SectorSize::S4096))
        .expect("cipher")
        .decrypt(0, &mut data)
        .expect("decrypt");
    let plain = tmp.join("decrypted.img");
    std::fs::write(&plain, &data).expect("write decrypted");
    run("fsck.ext4", &["-f", "-n", plain.to_str().expect("utf-8")]);
    let hello = run(
        "debugfs",
        &["-R", "cat /hello", plain.to_str().expect("utf-8")],
    );
    assert_eq!(hello, "hello");

    // Remount as DIR/disk, read-only loop, compare; then SIGINT with nothing attached.
    let dir = tmp.join("dir");
    std::fs::create_dir_all(&dir).expect("dir");
    let mut args: Vec<&str> = vec![
        img.to_str().expect("utf-8"),
        dir.to_str().expect("utf-8"),
        "--file-name",
        "disk",
    ];
    args.extend_from_slice(&raw);
    let mut srv = Server::start(&args, &dir);
    let disk: PathBuf = dir.join("disk");
    let lo = run(
        "losetup",
        &[
            "--find",
            "--show",
            "--read-only",
            disk.to_str().expect("utf-8"),
        ],
    );
    cleanup
        .0
        .push(("losetup".into(), vec!["-d".into(), lo.clone()]));
    run("mount", &["-o", "ro", &lo, mnt.to_str().expect("utf-8")]);
    let got = std::fs::read(mnt.join("d/payload")).expect("read payload");
    assert!(got == payload, "payload differs after remount");
    run("umount", &[mnt.to_str().expect("utf-8")]);
    cleanup.detach_loop(&lo);
    srv.signal(libc::SIGINT);
    assert_eq!(
        srv.wait_exit(WAIT),
        Some(0),
        "ucrypt mount did not exit cleanly on SIGINT"
    );
    assert!(!is_fuse_mount(&dir));
}

/// A LUKS2 volume made by `ucrypt format`, served by `ucrypt mount --key-file`: losetup
/// --direct-io=on, mkfs.ext4, files, fsck; SIGTERM; cryptsetup still accepts the passphrase;
/// `ucrypt export` gives a clean ext4 holding the file.
#[test]
fn mount_cli_luks2_end_to_end() {
    if let Some(r) = skip_reason() {
        println!("SKIPPED: {r}");
        return;
    }
    let tmp = std::env::temp_dir().join(format!("ucrypt-mount-luks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).expect("tmp");
    let mut cleanup = Cleanup(vec![(
        "rm".into(),
        vec!["-rf".into(), tmp.display().to_string()],
    )]);
    let img = tmp.join("luks.img");
    std::fs::File::create(&img)
        .expect("img")
        .set_len(IMG_BYTES)
        .expect("size");
    let key = tmp.join("pass");
    std::fs::write(&key, b"correct horse battery staple").expect("pass");
    let (i, k) = (img.to_str().expect("utf-8"), key.to_str().expect("utf-8"));
    run(
        BIN,
        &[
            "format",
            i,
            k,
            "--type",
            "luks2",
            "--sector-size",
            "4096",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--batch-mode",
        ],
    );
    let file = tmp.join("plain");
    std::fs::write(&file, b"").expect("mount point");
    let f = file.to_str().expect("utf-8");
    let mut srv = Server::start(&[i, f, "--key-file", k], &file);
    let lo = run("losetup", &["--find", "--show", "--direct-io=on", f]);
    cleanup
        .0
        .push(("losetup".into(), vec!["-d".into(), lo.clone()]));
    run("mkfs.ext4", &["-q", "-F", &lo]);
    let mnt = tmp.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mnt");
    let m = mnt.to_str().expect("utf-8");
    run("mount", &[&lo, m]);
    cleanup.0.push(("umount".into(), vec![m.to_string()]));
    std::fs::write(mnt.join("hello"), b"hello luks\n").expect("write file");
    run("umount", &[m]);
    run("fsck.ext4", &["-f", "-n", &lo]);
    cleanup.detach_loop(&lo);
    srv.signal(libc::SIGTERM);
    assert_eq!(
        srv.wait_exit(WAIT),
        Some(0),
        "ucrypt mount did not exit cleanly"
    );
    run(
        "cryptsetup",
        &["open", "--test-passphrase", "--key-file", k, i],
    );
    let plain = tmp.join("exported.img");
    let p = plain.to_str().expect("utf-8");
    run(BIN, &["export", i, p, "--key-file", k]);
    run("fsck.ext4", &["-f", "-n", p]);
    assert_eq!(run("debugfs", &["-R", "cat /hello", p]), "hello luks");
}

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Restores enable_uring on drop.
struct RestoreUring(String);
impl Drop for RestoreUring {
    fn drop(&mut self) {
        let _ = std::fs::write(ENABLE_URING, &self.0);
    }
}

/// `--fuse-transport io-uring`: refused with the reason and the fix while enable_uring is N
/// (nothing mounted); with Y it mounts over io_uring, serves reads and writes, and exits 0 on
/// SIGINT. The test switches the kernel parameter itself (root) and restores it.
#[test]
fn mount_cli_fuse_transport_io_uring() {
    if let Some(r) = skip_reason() {
        println!("SKIPPED: {r}");
        return;
    }
    let Ok(old) = std::fs::read_to_string(ENABLE_URING) else {
        let is_ci = std::env::var_os("CI").is_some();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut v = release
            .trim()
            .split(['.', '-'])
            .map(|x| x.parse::<u32>().unwrap_or(0));
        let new_kernel = (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (6, 14);
        assert!(
            !(is_ci && new_kernel),
            "CI on Linux >= 6.14 without {ENABLE_URING}"
        );
        println!("SKIPPED: {ENABLE_URING} missing (kernel without FUSE-over-io_uring)");
        return;
    };
    let _restore = RestoreUring(old.trim().to_string());
    let tmp = std::env::temp_dir().join(format!("ucrypt-mount-uring-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).expect("tmp");
    let _cleanup = Cleanup(vec![(
        "rm".into(),
        vec!["-rf".into(), tmp.display().to_string()],
    )]);
    let img = tmp.join("vol.img");
    std::fs::File::create(&img)
        .expect("img")
        .set_len(8 << 20)
        .expect("size");
    let keyf = tmp.join("key");
    std::fs::write(&keyf, [7u8; 64]).expect("key");
    let file = tmp.join("plain");
    std::fs::write(&file, b"").expect("mount point");
    let args = [
        img.to_str().expect("utf-8"),
        file.to_str().expect("utf-8"),
        "--cipher",
        "aes-xts-plain64",
        "--volume-key-file",
        keyf.to_str().expect("utf-8"),
        "--fuse-transport",
        "io-uring",
    ];

    std::fs::write(ENABLE_URING, "N").expect("set enable_uring=N");
    let out = Command::new(BIN)
        .arg("mount")
        .args(args)
        .output()
        .expect("run ucrypt mount");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(
        err.contains("enable_uring is N") && err.contains("echo Y >"),
        "the refusal does not name the reason and fix: {err}"
    );
    assert!(!is_fuse_mount(&file));

    std::fs::write(ENABLE_URING, "Y").expect("set enable_uring=Y");
    let mut srv = Server::start(&args, &file);
    let block: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .and_then(|f| std::os::unix::fs::FileExt::write_all_at(&f, &block, 8192))
        .expect("write through io_uring");
    let mut got = vec![0u8; 4096];
    std::fs::File::open(&file)
        .and_then(|f| std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, 8192))
        .expect("read through io_uring");
    assert!(got == block, "read back differs");
    srv.signal(libc::SIGINT);
    assert_eq!(srv.wait_exit(WAIT), Some(0), "no clean exit on SIGINT");
    assert!(!is_fuse_mount(&file));
}

/// The README's example as typed: `ucrypt mount vol.img ./plain` with no `./plain` creates the
/// file, serves the volume on it and removes it on SIGTERM (`ucrypt resize VOLUME --control
/// PATH` on the way: the file's size follows the grown image, then `--size`); a directory
/// serves a file named after the volume inside it.
#[test]
fn mount_point_missing_or_directory() {
    if let Some(r) = skip_reason() {
        println!("SKIPPED: {r}");
        return;
    }
    let tmp = std::env::temp_dir().join(format!("ucrypt-mount-point-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).expect("tmp");
    let _cleanup = Cleanup(vec![(
        "rm".into(),
        vec!["-rf".into(), tmp.display().to_string()],
    )]);
    let img = tmp.join("vol.img");
    std::fs::File::create(&img)
        .expect("img")
        .set_len(IMG_BYTES)
        .expect("size");
    let key = tmp.join("key");
    std::fs::write(&key, [0x42u8; 64]).expect("key");
    let (i, k) = (img.to_str().expect("utf-8"), key.to_str().expect("utf-8"));
    let raw = ["--cipher", "aes-xts-plain64", "--volume-key-file", k];

    // Missing: created, served, removed again. Resized through `--control`: the file takes
    // the grown image's size, then the size `--size` gives.
    let plain = tmp.join("plain");
    let p = plain.to_str().expect("utf-8");
    let ctl = tmp.join("control.sock");
    let c = ctl.to_str().expect("utf-8");
    let mut s = Server::start(&[&[i, p, "--control", c][..], &raw[..]].concat(), &plain);
    assert_eq!(
        std::fs::metadata(&plain).expect("served file").len(),
        IMG_BYTES
    );
    const GROWN: u64 = IMG_BYTES + (4 << 20);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .and_then(|f| f.set_len(GROWN))
        .expect("grow the image");
    run(BIN, &["resize", i, "--control", c]);
    assert_eq!(std::fs::metadata(&plain).expect("file").len(), GROWN);
    let sectors = (IMG_BYTES / 512 + 8).to_string();
    run(BIN, &["resize", i, "--control", c, "--size", &sectors]);
    assert_eq!(
        std::fs::metadata(&plain).expect("file").len(),
        IMG_BYTES + 4096
    );
    s.signal(libc::SIGTERM);
    assert_eq!(s.wait_exit(WAIT), Some(0), "mount exits 0 on SIGTERM");
    assert!(!plain.exists(), "the mount point ucrypt created is removed");

    // A directory: the volume appears in it under its own file name.
    let dir = tmp.join("dir");
    std::fs::create_dir(&dir).expect("dir");
    let d = dir.to_str().expect("utf-8");
    let mut s = Server::start(&[&[i, d][..], &raw[..]].concat(), &dir);
    assert_eq!(
        std::fs::metadata(dir.join("vol.img"))
            .expect("dir/vol.img")
            .len(),
        GROWN
    );
    s.signal(libc::SIGTERM);
    assert_eq!(s.wait_exit(WAIT), Some(0), "mount exits 0 on SIGTERM");
    assert!(dir.is_dir(), "a directory given is left alone");
}
