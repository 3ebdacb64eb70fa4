//! A volume's life cycle as a user types it: `open VOLUME NAME` -> a block device named NAME
//! -> mkfs, mount, copy, umount -> `close NAME` -> `open` again -> fsck clean, tree identical;
//! `status` field by field; cryptsetup's exit codes for a wrong passphrase (2), a NAME or a
//! volume in use (5), an unknown NAME (4); `close` refusing a mounted or held device, one writer
//! per volume whatever the order of verbs; a daemon killed
//! with SIGKILL cleaned up by `close`; a FUSE file unmounted from outside ending its daemon;
//! the same as a non-root user (FUSE file only).
//!
//! Needs root, /dev/fuse, /dev/loop-control, mkfs.ext4 (FUSE + loop); the rootless test also
//! needs `setpriv` and a setuid `fusermount3`. Otherwise each test prints `SKIPPED: reason`.
//! Names carry the test's pid, so that runs in other checkouts do not collide.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{have, is_root, missing_root_rig, run, s, text, TempDir, FAST_PBKDF2, UCRYPT};

const PASSPHRASE: &[u8] = b"life cycle passphrase";

/// What the FUSE + loop tests need besides root and the devices. With ublk_drv loaded `auto`
/// would pick ublk: the tests ask for --front-end loop.
const RIG_CMDS: &[&str] = &["mkfs.ext4", "fsck.ext4", "mount", "umount", "losetup"];

macro_rules! skip_unless_rig {
    () => {
        if let Some(why) = missing_root_rig(RIG_CMDS) {
            println!("SKIPPED: {why}");
            return;
        }
    };
}

fn ok(prog: &str, args: &[&str]) -> Output {
    let o = run(prog, args);
    assert!(o.status.success(), "{prog} {args:?}: {}", text(&o));
    o
}

fn ucrypt(args: &[&str]) -> Output {
    run(UCRYPT, args)
}

/// The one non-empty stderr line (asserts there is exactly one).
fn one_line(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = e.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "not one line: {}", text(o));
    lines[0].to_string()
}

/// A LUKS2 volume of `mib` MiB and its key file.
fn volume(t: &TempDir, name: &str, mib: u64) -> (PathBuf, PathBuf) {
    let img = t.path(name);
    let key = t.path("key");
    std::fs::write(&key, PASSPHRASE).unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(mib << 20))
        .unwrap();
    let mut a = vec!["format", "-q", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    (img, key)
}

fn name(tag: &str) -> String {
    format!("life-{tag}-{}", std::process::id())
}

const RUN_DIR: &str = "/run/ucrypt";
const DEV_DIR: &str = "/dev/ucrypt";

fn open(img: &Path, key: &Path, name: &str) -> Output {
    cli_common::open_loop(img, key, name, &[])
}

/// What is left of NAME: its state dir, its stable path, a loop device on its FUSE file, its
/// mount.
fn leftovers(name: &str) -> Vec<String> {
    let mut left = Vec::new();
    let dir = Path::new(RUN_DIR).join(name);
    if dir.exists() {
        left.push(format!("{}", dir.display()));
    }
    let link = Path::new(DEV_DIR).join(name);
    if std::fs::symlink_metadata(&link).is_ok() {
        left.push(format!("{}", link.display()));
    }
    let fuse_file = dir.join("volume");
    let loops = String::from_utf8_lossy(&ok("losetup", &["-a"]).stdout).to_string();
    if loops.contains(s(&fuse_file)) {
        left.push(format!("a loop device on {}: {loops}", fuse_file.display()));
    }
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    if mounts.contains(&format!("ucrypt:{name} ")) {
        left.push(format!("its FUSE mount: {mounts}"));
    }
    left
}

/// Nothing of NAME is left, or at most [`GONE_WAIT`] after the call: a loop device goes with
/// its last user (autoclear) and a mount with its daemon, each a moment after the close answered.
fn assert_gone(name: &str) {
    let t0 = std::time::Instant::now();
    loop {
        let left = leftovers(name);
        if left.is_empty() {
            return;
        }
        assert!(t0.elapsed() < GONE_WAIT, "{name}: left behind: {left:#?}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// How long a closed volume's leftovers may take to go.
const GONE_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// `status` as key -> value (the first line under "" ).
fn status_fields(name: &str) -> (i32, Vec<(String, String)>) {
    let o = ucrypt(&["status", name]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let mut fields = Vec::new();
    for (i, l) in out.lines().enumerate() {
        if i == 0 {
            fields.push((String::new(), l.to_string()));
            continue;
        }
        let (k, v) = l
            .split_once(':')
            .unwrap_or_else(|| panic!("not 'key: value': {l}"));
        fields.push((k.trim().to_string(), v.trim().to_string()));
    }
    (o.status.code().unwrap_or(-1), fields)
}

fn field<'a>(f: &'a [(String, String)], k: &str) -> &'a str {
    f.iter()
        .find(|(key, _)| key == k)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {k:?} in {f:?}"))
}

/// A tree of files with varied sizes, from this crate's sources.
fn copy_tree(dst: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    ok("cp", &["-a", s(&src), s(dst)]);
}

#[test]
fn round_trip_as_typed_with_fuse_and_loop() {
    skip_unless_rig!();
    let t = TempDir::new("trip");
    let (img, key) = volume(&t, "vol.img", 64);
    let n = name("trip");
    let stable = format!("{DEV_DIR}/{n}");
    let mnt = t.path("mnt");
    std::fs::create_dir(&mnt).unwrap();

    let o = open(&img, &key, &n);
    let ready = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        ready.starts_with(&format!("{n}: {stable} -> /dev/loop")) && ready.contains("(fuse+loop)"),
        "ready line: {ready}"
    );
    let target = std::fs::read_link(&stable).expect("stable symlink");
    ok("mkfs.ext4", &["-q", "-b", "4096", &stable]);
    ok("mount", &[&stable, s(&mnt)]);
    copy_tree(&mnt.join("tree"));
    ok("sync", &[]);

    // status, field by field, while mounted.
    let (code, f) = status_fields(&n);
    assert_eq!(code, 0);
    assert_eq!(f[0].1, format!("{stable} is active and is in use."));
    assert_eq!(field(&f, "type"), "LUKS2");
    assert_eq!(field(&f, "cipher"), "aes-xts-plain64");
    assert_eq!(field(&f, "keysize"), "512 bits");
    assert_eq!(field(&f, "key location"), "ucrypt daemon");
    let canon = std::fs::canonicalize(&img).unwrap();
    assert_eq!(field(&f, "device"), s(&canon));
    let sector: u64 = field(&f, "sector size").parse().unwrap();
    assert!([512, 4096].contains(&sector));
    let offset: u64 = field(&f, "offset")
        .strip_suffix(" sectors")
        .unwrap()
        .parse()
        .unwrap();
    let size: u64 = field(&f, "size")
        .strip_suffix(" sectors")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        offset + size,
        (64 << 20) / 512,
        "offset + size = the volume"
    );
    assert_eq!(field(&f, "mode"), "read/write");
    assert_eq!(field(&f, "front end"), "fuse+loop");
    assert_eq!(field(&f, "device path"), s(&target));
    assert!(field(&f, "front end notes").starts_with("loop: "));
    assert!(field(&f, "in use").contains("is mounted on"));
    assert_eq!(field(&f, "policy"), "auto");
    let writes = field(&f, "writes");
    let w_bytes: u64 = writes
        .split(", ")
        .nth(1)
        .and_then(|b| b.strip_suffix(" bytes"))
        .unwrap()
        .parse()
        .unwrap();
    assert!(w_bytes > 1 << 20, "mkfs and the copy wrote: {writes}");
    let pid: u32 = field(&f, "pid").parse().unwrap();
    assert!(Path::new(&format!("/proc/{pid}")).exists());

    // `list` names it with its device.
    let l = String::from_utf8_lossy(&ok(UCRYPT, &["list"]).stdout).to_string();
    assert!(
        l.lines()
            .any(|line| line == format!("{n} {stable} {} fuse+loop active", target.display())),
        "list: {l}"
    );

    ok("umount", &[s(&mnt)]);
    let o = ucrypt(&["close", &n]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    assert_gone(&n);

    open(&img, &key, &n);
    ok("fsck.ext4", &["-fn", &stable]);
    ok("mount", &["-o", "ro", &stable, s(&mnt)]);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let d = run("diff", &["-r", s(&src), s(&mnt.join("tree"))]);
    ok("umount", &[s(&mnt)]);
    assert!(d.status.success(), "trees differ: {}", text(&d));
    ok(UCRYPT, &["close", &n]);
    assert_gone(&n);
}

#[test]
fn wrong_passphrase_exits_2_and_leaves_nothing() {
    skip_unless_rig!();
    let t = TempDir::new("wrong");
    let (img, _key) = volume(&t, "vol.img", 20);
    let bad = t.path("bad");
    std::fs::write(&bad, b"not it").unwrap();
    let n = name("wrong");
    let o = ucrypt(&["open", s(&img), &n, "--key-file", s(&bad)]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        one_line(&o).contains("No key available with this passphrase"),
        "{}",
        text(&o)
    );
    assert_gone(&n);
}

#[test]
fn names_and_volumes_are_exclusive_and_mounted_devices_stay() {
    skip_unless_rig!();
    let t = TempDir::new("excl");
    let (img, key) = volume(&t, "vol.img", 20);
    let (img2, _) = volume(&t, "vol2.img", 20);
    let n = name("excl");
    let other = name("excl-other");
    open(&img, &key, &n);

    // The same NAME (another volume): cryptsetup's "already exists", 5.
    let o = ucrypt(&["open", s(&img2), &n, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert_eq!(one_line(&o), format!("Device {n} already exists."));
    // The same volume under another NAME (through another path): 5, and no trace of it.
    let alias = t.path("alias.img");
    std::os::unix::fs::symlink(&img, &alias).unwrap();
    let o = ucrypt(&["open", s(&alias), &other, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    let canon = std::fs::canonicalize(&img).unwrap();
    assert_eq!(
        one_line(&o),
        format!(
            "Cannot use device {} which is in use (already mapped or mounted).",
            canon.display()
        )
    );
    assert_gone(&other);

    // Mounted: close refuses (5, one line) and the device keeps working.
    let stable = format!("{DEV_DIR}/{n}");
    let mnt = t.path("mnt");
    std::fs::create_dir(&mnt).unwrap();
    ok("mkfs.ext4", &["-q", &stable]);
    ok("mount", &[&stable, s(&mnt)]);
    let o = ucrypt(&["close", &n]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    let line = one_line(&o);
    assert!(
        line.starts_with(&format!("Cannot close {n}: /dev/loop"))
            && line.contains(&format!("is mounted on {}", mnt.display())),
        "{line}"
    );
    std::fs::write(mnt.join("still"), b"works").unwrap();
    ok("sync", &[]);
    // --force: closed now; the mounted file system then sees errors and unmounts.
    let o = ucrypt(&["close", "--force", &n]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!Path::new(RUN_DIR).join(&n).exists());
    ok("umount", &[s(&mnt)]);
    assert_gone(&n);
    // The name and the volume are free again.
    open(&img, &key, &other);
    ok(UCRYPT, &["close", &other]);
    assert_gone(&other);
}

#[test]
fn killed_daemon_is_dead_to_status_and_cleaned_by_close() {
    skip_unless_rig!();
    let t = TempDir::new("kill");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("kill");
    open(&img, &key, &n);
    let stable = format!("{DEV_DIR}/{n}");
    // Something holds the loop device while the daemon dies, so that it cannot autoclear.
    let mut holder = Command::new("sleep")
        .arg("30")
        .stdin(std::fs::File::open(&stable).unwrap())
        .spawn()
        .unwrap();
    let pid = std::fs::read_to_string(Path::new(RUN_DIR).join(&n).join("pid")).unwrap();
    // The daemon keeps transparent huge pages off (an idle daemon's untouched buffers stay
    // untouched); kernels before 6.0 do not say.
    let st = std::fs::read_to_string(format!("/proc/{}/status", pid.trim())).unwrap();
    match st.lines().find_map(|l| l.strip_prefix("THP_enabled:")) {
        Some(v) => assert_eq!(v.trim(), "0", "the daemon's THP_enabled"),
        None => println!("SKIPPED the huge-page check: this kernel's status has no THP_enabled"),
    }
    ok("kill", &["-9", pid.trim()]);
    std::thread::sleep(std::time::Duration::from_millis(300));

    let (code, f) = status_fields(&n);
    assert_eq!(code, 1, "{f:?}");
    assert_eq!(f[0].1, format!("{stable} is dead."));
    assert_eq!(field(&f, "daemon"), format!("pid {} is gone", pid.trim()));
    let l = String::from_utf8_lossy(&ok(UCRYPT, &["list"]).stdout).to_string();
    assert!(
        l.lines()
            .any(|line| line.starts_with(&format!("{n} ")) && line.ends_with(" dead")),
        "list: {l}"
    );

    let _ = holder.kill();
    let _ = holder.wait();
    let o = ucrypt(&["close", &n]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_gone(&n);
}

#[test]
fn unknown_names_get_cryptsetups_codes() {
    if !is_root() && std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        println!("SKIPPED: not root and XDG_RUNTIME_DIR unset");
        return;
    }
    let n = name("nosuch");
    let o = ucrypt(&["status", &n]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.trim_end().ends_with(&format!("{n} is inactive.")),
        "{}",
        text(&o)
    );
    let o = ucrypt(&["close", &n]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert_eq!(one_line(&o), format!("Device {n} is not active."));
    for bad in ["..", "-x"] {
        let o = ucrypt(&["close", "--", bad]);
        assert_eq!(o.status.code(), Some(1), "{bad}: {}", text(&o));
        one_line(&o);
    }
    // A path that is no NAME's stable path is no open device, as cryptsetup answers.
    let o = ucrypt(&["close", "a/b"]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert_eq!(one_line(&o), "Device a/b is not active.");
    let long = "n".repeat(128);
    let o = ucrypt(&["status", &long]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

#[test]
fn rootless_fuse_file_round_trip() {
    if !is_root() {
        println!("SKIPPED: the rootless test switches to user nobody, which needs root");
        return;
    }
    if !have("setpriv") || !have("fusermount3") || !Path::new("/dev/fuse").exists() {
        println!("SKIPPED: needs setpriv, fusermount3 (fuse3) and /dev/fuse");
        return;
    }
    let t = TempDir::new("rootless");
    // The user needs to reach the files: the temp dir is root's (0755 here) and the volume,
    // key and runtime dir are handed over.
    std::fs::set_permissions(t.dir(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (img, key) = volume(&t, "vol.img", 20);
    let xdg = t.path("xdg");
    std::fs::create_dir(&xdg).unwrap();
    std::fs::set_permissions(&xdg, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    for p in [&img, &key, &xdg] {
        ok("chown", &["nobody:nogroup", s(p)]);
    }
    let bin_ok = run(
        "setpriv",
        &[
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            UCRYPT,
            "--version",
        ],
    );
    if !bin_ok.status.success() {
        println!("SKIPPED: user nobody cannot run {UCRYPT}");
        return;
    }
    let as_user = |args: &[&str]| -> Output {
        let mut a = vec!["--reuid=nobody", "--regid=nogroup", "--clear-groups", "env"];
        let x = format!("XDG_RUNTIME_DIR={}", s(&xdg));
        a.push(&x);
        a.push(UCRYPT);
        a.extend_from_slice(args);
        run("setpriv", &a)
    };
    let n = name("rootless");
    let o = as_user(&["open", s(&img), &n, "--key-file", s(&key)]);
    if o.status.code() != Some(0) && String::from_utf8_lossy(&o.stderr).contains("fusermount") {
        println!(
            "SKIPPED: FUSE mounts by non-root users fail here: {}",
            text(&o)
        );
        return;
    }
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let dir = xdg.join("ucrypt").join(&n);
    let device = dir.join("device");
    let ready = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        ready.starts_with(&format!("{n}: {} -> ", device.display())) && ready.contains("(fuse)"),
        "{ready}"
    );
    // Write and read back through the stable path, as the user.
    let pattern = t.path("pattern");
    std::fs::write(
        &pattern,
        (0..1u32 << 20)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    ok("chown", &["nobody:nogroup", s(&pattern)]);
    let dd = |args: &[&str]| {
        let mut a = vec!["--reuid=nobody", "--regid=nogroup", "--clear-groups", "dd"];
        a.extend_from_slice(args);
        a.push("status=none");
        ok("setpriv", &a)
    };
    dd(&[
        &format!("if={}", s(&pattern)),
        &format!("of={}", s(&device)),
        "bs=64k",
        "conv=notrunc,fsync",
    ]);
    // The device named by its stable path, as cryptsetup takes /dev/mapper/NAME.
    let o = as_user(&["status", s(&device)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let st = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        st.starts_with(&format!("{} is active.", device.display())),
        "{st}"
    );
    assert!(st.contains("  front end: fuse\n"), "{st}");
    assert!(st.contains("  writes:  "), "{st}");
    let o = as_user(&["close", &n]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!dir.exists(), "state left: {}", dir.display());
    // Open again: the bytes are there.
    let o = as_user(&["open", s(&img), &n, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let back = t.path("back");
    std::fs::File::create(&back).unwrap();
    ok("chown", &["nobody:nogroup", s(&back)]);
    dd(&[
        &format!("if={}", s(&device)),
        &format!("of={}", s(&back)),
        "bs=64k",
        "count=16",
    ]);
    assert!(
        std::fs::read(&back).unwrap() == std::fs::read(&pattern).unwrap(),
        "read back differs"
    );
    let o = as_user(&["close", s(&device)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(!mounts.contains(&format!("ucrypt:{n} ")), "{mounts}");
}

/// A RLIMIT_MEMLOCK below the buffer pool's bound, without CAP_IPC_LOCK (what a user's
/// session has): the volume serves, the daemon's log says at the start that buffers past the
/// limit will not be locked, and `status` counts the chunks that could not be locked once
/// requests used them. Root drops CAP_IPC_LOCK from its bounding set, which for mlock is the
/// same as being another user.
#[test]
fn a_memlock_limit_below_the_pool_is_said_in_the_log_and_status() {
    if !is_root() || !have("setpriv") || !have("prlimit") || !Path::new("/dev/fuse").exists() {
        println!("SKIPPED: needs root, setpriv and prlimit (util-linux), and /dev/fuse");
        return;
    }
    let t = TempDir::new("memlock");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("memlock");
    // 256 KiB: the keys and a few 64 KiB chunks of the pool, not a 1 MiB piece.
    let o = run(
        "setpriv",
        &[
            "--bounding-set=-ipc_lock",
            "prlimit",
            "--memlock=262144:262144",
            UCRYPT,
            "open",
            s(&img),
            &n,
            "--key-file",
            s(&key),
            "--front-end",
            "fuse",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let dir = Path::new(RUN_DIR).join(&n);
    let (_, before) = status_fields(&n);
    assert!(
        !before.iter().any(|(k, _)| k == "memory"),
        "nothing failed to lock yet: {before:?}"
    );
    let file = dir.join("volume");
    ok(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", s(&file)),
            "bs=1M",
            "count=4",
            "oflag=direct",
            "conv=notrunc",
            "status=none",
        ],
    );
    let (code, f) = status_fields(&n);
    let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
    let closed = ucrypt(&["close", &n]);
    assert_eq!(code, 0);
    assert_eq!(closed.status.code(), Some(0), "{}", text(&closed));
    let memory = field(&f, "memory");
    let chunks: u64 = memory
        .split_whitespace()
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("memory: {memory}"));
    assert!(chunks > 0, "{memory}");
    assert!(memory.contains("RLIMIT_MEMLOCK"), "{memory}");
    assert!(
        log.contains("RLIMIT_MEMLOCK is 256 KiB, below the 16384 KiB"),
        "daemon.log: {log}"
    );
}

/// `close --deferred` of a mounted device: exit 0 at once, the device keeps serving while it
/// is mounted, and once it is unmounted the daemon closes by itself and leaves nothing behind.
/// Of an unused device: closes at once.
#[test]
fn deferred_close_waits_for_the_last_user() {
    skip_unless_rig!();
    let t = TempDir::new("deferred");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("deferred");
    open(&img, &key, &n);
    let stable = format!("{DEV_DIR}/{n}");
    let mnt = t.path("mnt");
    std::fs::create_dir(&mnt).unwrap();
    ok("mkfs.ext4", &["-q", &stable]);
    ok("mount", &[&stable, s(&mnt)]);
    let o = ucrypt(&["close", "--deferred", &n]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        Path::new(RUN_DIR).join(&n).exists(),
        "still open while mounted"
    );
    std::fs::write(mnt.join("after"), b"deferred").unwrap();
    ok("sync", &[]);
    ok("umount", &[s(&mnt)]);
    closes_by_itself(&n, "after the last user went");
    // Unused: --deferred closes at once.
    open(&img, &key, &n);
    let o = ucrypt(&["close", "--deferred", &n]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_gone(&n);
}

/// A FUSE file unmounted from outside (`umount`) ends its daemon, which cleans up: the main
/// loop hears the FUSE connection end (an error on /dev/fuse) and waits for the workers.
#[test]
fn a_fuse_file_unmounted_from_outside_closes_the_volume() {
    skip_unless_rig!();
    let t = TempDir::new("outside");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("outside");
    let o = ucrypt(&[
        "open",
        s(&img),
        &n,
        "--key-file",
        s(&key),
        "--front-end",
        "fuse",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let file = Path::new(RUN_DIR).join(&n).join("volume");
    ok("umount", &[s(&file)]);
    closes_by_itself(&n, "after its FUSE file was unmounted");
}

/// Waits (60 s at most: the host may be loaded) until `n`'s daemon has closed by itself, then
/// checks that it left nothing behind.
fn closes_by_itself(n: &str, when: &str) {
    let t0 = std::time::Instant::now();
    while Path::new(RUN_DIR).join(n).exists() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "the daemon did not close {when}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_gone(n);
}

/// A LUKS2 volume of `mib` MiB made with a known volume key (returned), and its key file.
fn volume_with_key(t: &TempDir, name: &str, mib: u64) -> (PathBuf, PathBuf, Vec<u8>) {
    let img = t.path(name);
    let key = t.path("key");
    let vk_file = t.path("vk");
    std::fs::write(&key, PASSPHRASE).unwrap();
    // Distinct, non-repeating bytes in each half, so that a find in a core dump means the key.
    let mut vk = vec![0u8; 64];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut vk))
        .unwrap();
    std::fs::write(&vk_file, &vk).unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(mib << 20))
        .unwrap();
    let mut a = vec![
        "format",
        "-q",
        "--key-file",
        s(&key),
        "--volume-key-file",
        s(&vk_file),
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    std::fs::remove_file(&vk_file).unwrap();
    (img, key, vk)
}

/// A core dump of `pid` by gdb's gcore, with the mappings the process marked not to dump
/// (MADV_DONTDUMP: its locked secrets) included, so that a key anywhere in memory is found.
fn core_dump(pid: u32, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    let o = run(
        "gdb",
        &[
            "-nx",
            "-batch",
            "-p",
            &pid.to_string(),
            "-ex",
            "set use-coredump-filter off",
            "-ex",
            "set dump-excluded-mappings on",
            "-ex",
            &format!("gcore {}", s(out)),
        ],
    );
    let core = std::fs::read(out).unwrap_or_else(|e| panic!("gcore: {e}: {}", text(&o)));
    std::fs::remove_file(out).unwrap();
    core
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    let first = needle[0];
    let mut i = 0;
    while let Some(p) = hay[i..].iter().position(|&b| b == first) {
        let at = i + p;
        if hay[at..].starts_with(needle) {
            return true;
        }
        i = at + 1;
    }
    false
}

/// Bytes the volume has written so far, from `status`.
fn written(name: &str) -> u64 {
    let (code, f) = status_fields(name);
    assert_eq!(code, 0);
    field(&f, "writes")
        .split(", ")
        .nth(1)
        .and_then(|b| b.strip_suffix(" bytes"))
        .unwrap()
        .parse()
        .unwrap()
}

/// On a failed assertion: resumes and closes the volume and stops fio, so that nothing waits on
/// a suspended device after the test.
struct SuspendCleanup {
    name: String,
    key: PathBuf,
    fio: Option<std::process::Child>,
}

impl Drop for SuspendCleanup {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let _ = ucrypt(&["resume", &self.name, "--key-file", s(&self.key)]);
        if let Some(mut f) = self.fio.take() {
            let _ = f.kill();
            let _ = f.wait();
        }
        let _ = ucrypt(&["close", "--force", &self.name]);
    }
}

#[test]
fn suspend_holds_io_and_wipes_the_key_resume_releases_it() {
    skip_unless_rig!();
    for cmd in ["fio", "gdb"] {
        if !have(cmd) {
            println!("SKIPPED: {cmd} not installed (scripts/deps.sh test)");
            return;
        }
    }
    let t = TempDir::new("susp");
    let (img, key, vk) = volume_with_key(&t, "vol.img", 96);
    let n = name("susp");
    let stable = format!("{DEV_DIR}/{n}");
    open(&img, &key, &n);
    let (_, f) = status_fields(&n);
    let pid: u32 = field(&f, "pid").parse().unwrap();
    let halves = [&vk[..32], &vk[32..]];

    // The test can see the key: before suspending, the daemon's memory holds it.
    let core = core_dump(pid, &t.path("core0"));
    for h in halves {
        assert!(
            contains(&core, h),
            "volume key half not found in an open daemon's core"
        );
    }
    drop(core);

    // fio writes 48 MiB at 8 MiB/s (about 6 s) and then reads it all back, checking crc32c.
    let fio_out = t.path("fio.out");
    let mut cleanup = SuspendCleanup {
        name: n.clone(),
        key: key.clone(),
        fio: None,
    };
    let fio = Command::new("fio")
        .args([
            "--name=suspend",
            &format!("--filename={stable}"),
            "--rw=write",
            "--bs=64k",
            "--size=48m",
            "--direct=1",
            "--ioengine=psync",
            "--rate=8m",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            &format!("--output={}", s(&fio_out)),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let fio = cleanup.fio.insert(fio);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let o = ucrypt(&["suspend", &n]);
    assert_eq!(o.status.code(), Some(0), "suspend: {}", text(&o));
    let (code, f) = status_fields(&n);
    assert_eq!(code, 0);
    assert_eq!(f[0].1, format!("{stable} is active and is suspended."));
    let l = String::from_utf8_lossy(&ucrypt(&["list"]).stdout).to_string();
    assert!(
        l.lines()
            .any(|line| line.starts_with(&format!("{n} ")) && line.ends_with(" suspended")),
        "list while suspended: {l}"
    );

    // fio stalls: nothing more is written, and it has not failed.
    let w0 = written(&n);
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert_eq!(written(&n), w0, "writes went on while suspended");
    assert!(
        fio.try_wait().unwrap().is_none(),
        "fio ended while suspended"
    );
    assert!(
        w0 > 0 && w0 < 48 << 20,
        "fio was midway: {w0} bytes written"
    );

    // No copy of either half of the key is left in the daemon's memory.
    let core = core_dump(pid, &t.path("core1"));
    assert!(
        core.len() > 1 << 20,
        "core dump too small: {} bytes",
        core.len()
    );
    for (i, h) in halves.iter().enumerate() {
        assert!(
            !contains(&core, h),
            "XTS key half {i} found in a suspended daemon's core"
        );
    }
    drop(core);

    // Already suspended: busy; closing waits for a resume (exit 5). A wrong passphrase:
    // exit 2, still suspended.
    assert_eq!(ucrypt(&["suspend", &n]).status.code(), Some(5));
    let o = ucrypt(&["close", &n]);
    assert_eq!(
        o.status.code(),
        Some(5),
        "close while suspended: {}",
        text(&o)
    );
    let bad = t.path("bad");
    std::fs::write(&bad, b"not it").unwrap();
    let o = ucrypt(&["resume", &n, "--key-file", s(&bad)]);
    assert_eq!(o.status.code(), Some(2), "wrong passphrase: {}", text(&o));
    assert!(
        one_line(&o).contains("No key available with this passphrase"),
        "{}",
        text(&o)
    );
    let (_, f) = status_fields(&n);
    assert_eq!(f[0].1, format!("{stable} is active and is suspended."));
    assert_eq!(written(&n), w0);

    // luksResume with the right one: fio completes and verifies.
    let o = ucrypt(&["luksResume", &n, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(0), "resume: {}", text(&o));
    let st = fio.wait().unwrap();
    cleanup.fio = None;
    let report = std::fs::read_to_string(&fio_out).unwrap_or_default();
    assert!(st.success(), "fio failed after resume: {report}");
    assert!(
        !report.contains("verify:") || !report.contains("bad"),
        "{report}"
    );
    assert!(written(&n) >= 48 << 20);

    // The key is back in memory (what the absence above is measured against).
    let core = core_dump(pid, &t.path("core2"));
    for h in halves {
        assert!(contains(&core, h), "volume key half not found after resume");
    }
    drop(core);
    let (_, f) = status_fields(&n);
    assert_eq!(f[0].1, format!("{stable} is active."));
    let o = ucrypt(&["resume", &n, "--key-file", s(&key)]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "resume when not suspended: {}",
        text(&o)
    );
    ok(UCRYPT, &["close", &n]);
    assert_gone(&n);
}

/// Whether this process has CAP_SYS_RESOURCE (bit 24 of CapEff), which ext4's online resize
/// needs.
fn cap_sys_resource() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|st| {
            st.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps >> CAP_SYS_RESOURCE & 1 == 1)
}

#[test]
fn resize_grows_a_mounted_ext4_and_refuses_a_size_beyond_the_volume() {
    skip_unless_rig!();
    if !have("resize2fs") {
        println!("SKIPPED: resize2fs not installed (e2fsprogs)");
        return;
    }
    let t = TempDir::new("resize");
    let (img, key) = volume(&t, "vol.img", 64);
    let n = name("resize");
    let stable = format!("{DEV_DIR}/{n}");
    let mnt = t.path("mnt");
    std::fs::create_dir(&mnt).unwrap();
    open(&img, &key, &n);
    let size_of = |dev: &str| -> u64 {
        let o = ok("blockdev", &["--getsize64", dev]);
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
    };
    let before = size_of(&stable);
    ok("mkfs.ext4", &["-q", "-b", "4096", &stable]);
    ok("mount", &[&stable, s(&mnt)]);
    copy_tree(&mnt.join("tree"));

    ok("truncate", &["-s", "128M", s(&img)]);
    let o = ucrypt(&["resize", &n]);
    assert_eq!(o.status.code(), Some(0), "resize: {}", text(&o));
    let after = size_of(&stable);
    assert_eq!(after, before + (64 << 20), "the device did not grow");
    let (_, f) = status_fields(&n);
    assert_eq!(
        field(&f, "size"),
        format!("{} sectors", after / 512),
        "status size"
    );
    let df = |p: &Path| -> u64 {
        let o = ok("df", &["--output=size", "-B1", s(p)]);
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .nth(1)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let fs_before = df(&mnt);
    if cap_sys_resource() {
        // Online, as the issue asks: the mounted ext4 grows into the new device size.
        ok("resize2fs", &[&stable]);
    } else {
        // ext4's online resize needs CAP_SYS_RESOURCE (the kernel answers EPERM without it);
        // where it is dropped, the same size change is checked offline.
        println!("NOTE: no CAP_SYS_RESOURCE: resize2fs runs on the unmounted filesystem");
        ok("umount", &[s(&mnt)]);
        ok("e2fsck", &["-fy", &stable]);
        ok("resize2fs", &[&stable]);
        ok("mount", &[&stable, s(&mnt)]);
    }
    let fs_after = df(&mnt);
    assert!(
        fs_after > fs_before + (48 << 20),
        "ext4 did not grow: {fs_before} -> {fs_after}"
    );

    // A size beyond the backing file: a clear error, cryptsetup's exit code (1), no change.
    let beyond = (256u64 << 20) / 512;
    let o = ucrypt(&["resize", &n, "--size", &beyond.to_string()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(one_line(&o).contains("does not fit"), "{}", text(&o));
    assert_eq!(size_of(&stable), after);

    ok("umount", &[s(&mnt)]);
    ok("fsck.ext4", &["-fn", &stable]);
    ok(UCRYPT, &["close", &n]);
    assert_gone(&n);
}

#[test]
fn refresh_and_cancel_deferred() {
    skip_unless_rig!();
    let t = TempDir::new("refresh");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("refresh");
    let stable = format!("{DEV_DIR}/{n}");
    let mnt = t.path("mnt");
    std::fs::create_dir(&mnt).unwrap();
    open(&img, &key, &n);
    let flags = |n: &str| {
        let (_, f) = status_fields(n);
        f.iter()
            .find(|(k, _)| k == "flags")
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(flags(&n), "");
    ok(
        UCRYPT,
        &["refresh", &n, "--allow-discards", "--spin-us", "0"],
    );
    assert_eq!(flags(&n), "discards");
    ok(
        UCRYPT,
        &[
            "refresh",
            &n,
            "--allow-discards=false",
            "--policy",
            "read=inline,write=auto",
        ],
    );
    assert_eq!(flags(&n), "");
    let (_, f) = status_fields(&n);
    assert_eq!(field(&f, "policy"), "read=inline,write=auto");
    // cryptsetup's flag, on top of the policy the volume runs now.
    let o = ucrypt(&["refresh", &n, "--perf-no_write_workqueue"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let (_, f) = status_fields(&n);
    assert_eq!(field(&f, "policy"), "inline");
    let o = ucrypt(&["refresh", &n, "--spin-us", "20000"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(ucrypt(&["refresh", &n]).status.code(), Some(1));

    // A deferred close, cancelled: the last user going no longer closes it.
    ok("mkfs.ext4", &["-q", &stable]);
    ok("mount", &[&stable, s(&mnt)]);
    ok(UCRYPT, &["close", "--deferred", &n]);
    let o = ucrypt(&["close", "--cancel-deferred", &n]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("deferred close cancelled"),
        "{}",
        text(&o)
    );
    ok("umount", &[s(&mnt)]);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let (code, _) = status_fields(&n);
    assert_eq!(code, 0, "closed although the deferred close was cancelled");
    ok(UCRYPT, &["close", &n]);
    assert_gone(&n);
}

/// An authenticated LUKS2 volume (aes-gcm-random + aead, 4096-byte sectors) of `mib` MiB made
/// with a known 256-bit volume key (returned), and its key file.
fn integrity_volume_with_key(t: &TempDir, name: &str, mib: u64) -> (PathBuf, PathBuf, Vec<u8>) {
    let img = t.path(name);
    let key = t.path("key");
    let vk_file = t.path("vk");
    std::fs::write(&key, PASSPHRASE).unwrap();
    let mut vk = vec![0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut vk))
        .unwrap();
    std::fs::write(&vk_file, &vk).unwrap();
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(mib << 20))
        .unwrap();
    let mut a = vec![
        "format",
        "-q",
        "--cipher",
        "aes-gcm-random",
        "--integrity",
        "aead",
        "--sector-size",
        "4096",
        "--key-file",
        s(&key),
        "--volume-key-file",
        s(&vk_file),
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok(UCRYPT, &a);
    std::fs::remove_file(&vk_file).unwrap();
    (img, key, vk)
}

/// Where the ciphertext of data block `block` (4096 bytes) of an authenticated volume lies in
/// its image, from the dm-integrity superblock at the LUKS2 data offset (16 MiB).
fn integrity_block_byte(img: &Path, block: u64) -> u64 {
    use ucrypt::integrity::{Layout, Superblock};
    const SB_AT: u64 = 16 << 20;
    let raw = std::fs::read(img).unwrap();
    let sb = Superblock::parse(&raw[SB_AT as usize..SB_AT as usize + 4096]).unwrap();
    let layout = Layout::for_device(sb, SB_AT / 512, raw.len() as u64 / 512).unwrap();
    SB_AT + layout.data_sector(block * 8).unwrap() * 512
}

/// GET /metrics over TCP: the body.
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics connect");
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("HTTP head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The value of the sample line starting with `prefix` (name and labels).
fn sample(body: &str, prefix: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(prefix)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in\n{body}"))
}

fn dd(args: &[&str]) -> Output {
    run("dd", &[&["status=none"], args].concat())
}

/// An authenticated volume (dm-crypt over dm-integrity) through the daemon: open, status with
/// its integrity type, list, data written and read back through the loop device, suspend
/// (I/O held; no copy of the volume key left in the daemon's memory), resume, resize refused,
/// then a ciphertext bit flipped in the image: reading that block fails, its neighbours read,
/// and `status` and the metrics endpoint count the mismatch; close leaves nothing behind.
#[test]
fn integrity_volume_life_cycle_with_a_tampered_block() {
    skip_unless_rig!();
    if !have("gdb") {
        println!("SKIPPED: gdb not installed (scripts/deps.sh test)");
        return;
    }
    let t = TempDir::new("integ");
    let (img, key, vk) = integrity_volume_with_key(&t, "vol.img", 40);
    let n = name("integ");
    let stable = format!("{DEV_DIR}/{n}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let o = ucrypt(&[
        "open",
        s(&img),
        &n,
        "--key-file",
        s(&key),
        "--front-end",
        "loop",
        "--metrics",
        &format!("tcp:127.0.0.1:{port}"),
    ]);
    assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
    let _cleanup = SuspendCleanup {
        name: n.clone(),
        key: key.clone(),
        fio: None,
    };

    let (code, f) = status_fields(&n);
    assert_eq!(code, 0);
    assert_eq!(f[0].1, format!("{stable} is active."));
    assert_eq!(field(&f, "type"), "LUKS2");
    assert_eq!(field(&f, "cipher"), "aes-gcm-random");
    assert_eq!(field(&f, "keysize"), "256 bits");
    assert_eq!(field(&f, "integrity"), "aead");
    assert_eq!(field(&f, "sector size"), "4096");
    assert_eq!(field(&f, "integrity mismatches"), "0");
    let pid: u32 = field(&f, "pid").parse().unwrap();
    let size_sectors: u64 = field(&f, "size")
        .strip_suffix(" sectors")
        .unwrap()
        .parse()
        .unwrap();
    assert!(size_sectors > 0 && size_sectors < 40 << 11);
    let l = String::from_utf8_lossy(&ucrypt(&["list"]).stdout).to_string();
    assert!(
        l.lines().any(|line| line.starts_with(&format!("{n} "))),
        "list: {l}"
    );

    // 1 MiB of data through the device, read back.
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 13 + i / 4096) as u8).collect();
    let src = t.path("data");
    std::fs::write(&src, &data).unwrap();
    let o = dd(&[
        &format!("if={}", s(&src)),
        &format!("of={stable}"),
        "bs=1M",
        "oflag=direct",
    ]);
    assert!(o.status.success(), "dd write: {}", text(&o));
    let back = t.path("back");
    let o = dd(&[
        &format!("if={stable}"),
        &format!("of={}", s(&back)),
        "bs=1M",
        "count=1",
        "iflag=direct",
    ]);
    assert!(o.status.success(), "dd read: {}", text(&o));
    assert!(std::fs::read(&back).unwrap() == data, "read back differs");

    // Suspend: the key is gone from memory, requests wait; resume lets them through.
    let core = core_dump(pid, &t.path("core0"));
    assert!(
        contains(&core, &vk[..16]) && contains(&core, &vk[16..]),
        "volume key not found in an open daemon's core"
    );
    drop(core);
    let o = ucrypt(&["suspend", &n]);
    assert_eq!(o.status.code(), Some(0), "suspend: {}", text(&o));
    let (_, f) = status_fields(&n);
    assert_eq!(f[0].1, format!("{stable} is active and is suspended."));
    let core = core_dump(pid, &t.path("core1"));
    assert!(core.len() > 1 << 20, "core dump too small");
    for (i, h) in [&vk[..16], &vk[16..]].iter().enumerate() {
        assert!(
            !contains(&core, h),
            "GCM key half {i} found in a suspended daemon's core"
        );
    }
    drop(core);
    let reader = std::process::Command::new("dd")
        .args([
            "status=none",
            &format!("if={stable}"),
            "of=/dev/null",
            "bs=4096",
            "count=1",
            "skip=3",
            "iflag=direct",
        ])
        .spawn()
        .unwrap();
    let mut reader = KillOnDrop(reader);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        reader.0.try_wait().unwrap().is_none(),
        "a read finished while suspended"
    );
    assert_eq!(ucrypt(&["suspend", &n]).status.code(), Some(5));
    let o = ucrypt(&["resume", &n, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(0), "resume: {}", text(&o));
    assert!(reader.0.wait().unwrap().success(), "held read after resume");

    // Resize does not apply.
    let o = ucrypt(&["resize", &n, "--size", "2048"]);
    assert_eq!(o.status.code(), Some(1), "resize: {}", text(&o));
    assert!(
        one_line(&o).contains("authenticated encryption"),
        "{}",
        text(&o)
    );

    // One ciphertext bit of block 5 flipped in the image.
    let at = integrity_block_byte(&img, 5) + 100;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&img)
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        b[0] ^= 0x04;
        f.write_all_at(&b, at).unwrap();
        f.sync_all().unwrap();
    }
    let read_block = |i: u64| {
        dd(&[
            &format!("if={stable}"),
            "of=/dev/null",
            "bs=4096",
            "count=1",
            &format!("skip={i}"),
            "iflag=direct",
        ])
    };
    let o = read_block(5);
    assert!(!o.status.success(), "the tampered block read: {}", text(&o));
    for i in [4, 6] {
        let o = read_block(i);
        assert!(o.status.success(), "block {i}: {}", text(&o));
    }
    let (_, f) = status_fields(&n);
    let mismatches: u64 = field(&f, "integrity mismatches").parse().unwrap();
    assert!(mismatches >= 1, "no mismatch counted: {f:?}");
    let body = scrape(port);
    assert_eq!(
        sample(
            &body,
            &format!("ucrypt_integrity_mismatches_total{{volume=\"{n}\"}}")
        ),
        mismatches,
        "{body}"
    );
    assert!(
        sample(
            &body,
            &format!("ucrypt_errors_total{{volume=\"{n}\",op=\"read\",kind=\"bad_data\"}}")
        ) >= 1,
        "{body}"
    );
    assert!(
        sample(
            &body,
            &format!("ucrypt_bytes_total{{volume=\"{n}\",op=\"write\"}}")
        ) >= 1 << 20,
        "{body}"
    );

    let o = ucrypt(&["close", &n]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_gone(&n);
}

/// A child process killed on drop (a test that fails must not leave it running). Not waited
/// for: a read held by a suspended device ends only once the volume is resumed or closed.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
    }
}

/// Runs `prog args` and fails the test if it takes over `secs` (a verb that waits on a lock
/// would otherwise hang the test).
fn within(secs: u64, prog: &str, args: &[&str]) -> Output {
    let mut a = vec![secs.to_string(), prog.to_string()];
    a.extend(args.iter().map(|s| s.to_string()));
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let o = run("timeout", &a);
    assert_ne!(
        o.status.code(),
        Some(124),
        "{prog} {args:?} still waiting after {secs} s"
    );
    o
}

/// Keyslots change while the volume is open, as on an active dm-crypt device: the daemon holds
/// cryptsetup's header lock only to read the header (at open, on resume), so `luksAddKey` of
/// ucrypt and of cryptsetup go through; `resume` reads the header again and takes a key added
/// meanwhile. A `format` of the open volume is refused (exit 5, nothing written).
#[test]
fn keyslots_change_while_the_volume_is_open() {
    skip_unless_rig!();
    let t = TempDir::new("keyslots");
    let (img, key) = volume(&t, "vol.img", 24);
    let n = name("keyslots");
    let o = open(&img, &key, &n);
    assert!(o.status.success(), "{}", text(&o));
    let key2 = t.path("key2");
    std::fs::write(&key2, b"added while open").unwrap();
    let mut a = vec!["luksAddKey", "--batch-mode", "--key-file", s(&key)];
    a.extend(FAST_PBKDF2);
    a.extend([s(&img), s(&key2)]);
    let o = within(30, UCRYPT, &a);
    assert!(o.status.success(), "ucrypt luksAddKey: {}", text(&o));
    let key3 = t.path("key3");
    std::fs::write(&key3, b"added by cryptsetup").unwrap();
    if have("cryptsetup") {
        let o = within(
            30,
            "cryptsetup",
            &[
                "luksAddKey",
                "-q",
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--key-file",
                s(&key),
                s(&img),
                s(&key3),
            ],
        );
        assert!(o.status.success(), "cryptsetup luksAddKey: {}", text(&o));
    } else {
        println!("SKIPPED (part): cryptsetup not installed");
    }
    let before = std::fs::read(&img).unwrap();
    let o = within(
        30,
        UCRYPT,
        &["format", "-q", "--key-file", s(&key), s(&img)],
    );
    assert_eq!(
        o.status.code(),
        Some(5),
        "format of the open volume: {}",
        text(&o)
    );
    assert!(
        std::fs::read(&img).unwrap() == before,
        "the refused format wrote"
    );
    ok(UCRYPT, &["suspend", &n]);
    let o = within(30, UCRYPT, &["resume", &n, "--key-file", s(&key2)]);
    assert!(
        o.status.success(),
        "resume with the key added while open: {}",
        text(&o)
    );
    ok(UCRYPT, &["close", &n]);
    assert_gone(&n);
}

/// Stops a background `ucrypt` (SIGTERM, then waits) when dropped, so that a failed assertion
/// leaves no server behind.
struct Background(std::process::Child);

impl Drop for Background {
    fn drop(&mut self) {
        let _ = run("kill", &["-TERM", &self.0.id().to_string()]);
        let _ = self.0.wait();
    }
}

/// `ucrypt serve VOLUME --nbd unix:SOCK EXTRA...`, returned once its socket accepts.
fn serve_in_background(img: &Path, key: &Path, sock: &Path, extra: &[&str]) -> Background {
    let listen = format!("unix:{}", s(sock));
    let mut a = vec!["serve", s(img), "--nbd", &listen, "--key-file", s(key)];
    a.extend(extra);
    let child = Command::new(UCRYPT)
        .args(&a)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut bg = Background(child);
    let t0 = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(sock).is_err() {
        if let Some(st) = bg.0.try_wait().unwrap() {
            panic!("ucrypt serve ended: {st}");
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "ucrypt serve not listening after 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    bg
}

/// `close` of a device a process holds open (not mounted) is busy, as cryptsetup's close of a
/// held dm device: exit 5, the NAME stays and keeps its volume; `close --deferred` closes it
/// once the holder lets go. Whatever the order of verbs, one ciphertext has one writer: a
/// second `open` of the volume (under another NAME), or a `serve` of it, is refused while
/// the first daemon serves it, also after `close --deferred`; read-only servers share it.
#[test]
fn a_held_device_is_busy_and_a_served_volume_has_one_writer() {
    skip_unless_rig!();
    let t = TempDir::new("held");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("held");
    let other = name("held-other");
    let stable = format!("{DEV_DIR}/{n}");
    open(&img, &key, &n);
    let holder = Command::new("sleep")
        .arg("600")
        .stdin(std::fs::File::open(&stable).unwrap())
        .spawn()
        .unwrap();
    let holder_pid = holder.id();
    let mut holder = Background(holder);

    let o = ucrypt(&["close", &n]);
    assert_eq!(
        o.status.code(),
        Some(5),
        "close of a held device: {}",
        text(&o)
    );
    let line = one_line(&o);
    assert!(
        line.starts_with(&format!("Cannot close {n}: /dev/loop"))
            && line.contains(&format!("is open in process {holder_pid} (sleep)")),
        "{line}"
    );
    let (code, f) = status_fields(&n);
    assert_eq!(code, 0);
    assert_eq!(f[0].1, format!("{stable} is active and is in use."));
    // The volume stays its: no second daemon, no serve beside it.
    let o = ucrypt(&["open", s(&img), &other, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert_gone(&other);

    // Deferred: returns at once, the NAME stays until the holder goes, and still nobody else
    // may serve the volume.
    let o = ucrypt(&["close", "--deferred", &n]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(Path::new(RUN_DIR).join(&n).exists(), "closed while held");
    let o = ucrypt(&["open", s(&img), &other, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    let sock = t.path("nbd.sock");
    let listen = format!("unix:{}", s(&sock));
    // (Bounded: a serve that is not refused serves until stopped.)
    let o = within(
        120,
        UCRYPT,
        &["serve", s(&img), "--nbd", &listen, "--key-file", s(&key)],
    );
    assert_eq!(
        o.status.code(),
        Some(5),
        "serve beside the daemon: {}",
        text(&o)
    );
    assert!(
        one_line(&o).contains("which is in use (a ucrypt process serves it"),
        "{}",
        text(&o)
    );
    let _ = holder.0.kill();
    let _ = holder.0.wait();
    closes_by_itself(&n, "after the holder went (a deferred close)");

    // A volume `serve` writes: `open` refuses it, read-write or read-only.
    let srv = serve_in_background(&img, &key, &sock, &[]);
    for ro in [&[][..], &["--readonly"][..]] {
        let mut a = vec!["open", s(&img), &other, "--key-file", s(&key)];
        a.extend(ro);
        a.extend(["--front-end", "loop"]);
        let o = ucrypt(&a);
        assert_eq!(
            o.status.code(),
            Some(5),
            "open {ro:?} beside serve: {}",
            text(&o)
        );
        assert_gone(&other);
    }
    drop(srv);
    // Read-only beside read-only goes; read-write beside it does not.
    let srv = serve_in_background(&img, &key, &sock, &["--readonly"]);
    let o = ucrypt(&[
        "open",
        s(&img),
        &n,
        "--key-file",
        s(&key),
        "--front-end",
        "loop",
    ]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert_gone(&n);
    cli_common::open_loop(&img, &key, &n, &["--readonly"]);
    ok(UCRYPT, &["close", &n]);
    drop(srv);
    assert_gone(&n);
}

/// A NAME whose control socket (`/run/ucrypt/NAME/control.sock`) would not fit in a unix
/// socket's path (`sun_path`: 107 bytes and the NUL) is refused up front, before a passphrase
/// is read or anything made, with the limit in the message (exit 1); the longest that fits
/// opens and closes.
#[test]
fn names_too_long_for_the_control_socket_are_refused_up_front() {
    skip_unless_rig!();
    let t = TempDir::new("longname");
    let (img, key) = volume(&t, "vol.img", 20);
    let max = 107 - format!("{RUN_DIR}/").len() - "/control.sock".len();
    let tag = format!("long-{}-", std::process::id());
    for len in [max + 1, 127] {
        let long = format!("{tag}{}", "n".repeat(len - tag.len()));
        let o = ucrypt(&["open", s(&img), &long, "--front-end", "loop"]);
        assert_eq!(o.status.code(), Some(1), "{len} bytes: {}", text(&o));
        let line = one_line(&o);
        assert!(
            line.contains(&format!("is too long: {len} bytes; at most {max} fit")),
            "{line}"
        );
        assert_gone(&long);
    }
    let fits = format!("{tag}{}", "n".repeat(max - tag.len()));
    open(&img, &key, &fits);
    ok(UCRYPT, &["close", &fits]);
    assert_gone(&fits);
}

/// `close --force` of a suspended device: the requests held since the suspend fail with EIO
/// (a writer waiting on the device gets its error instead of hanging for ever), and the
/// device closes; a plain `close` still asks for a resume first (exit 5).
#[test]
fn force_closes_a_suspended_device_and_fails_its_held_requests() {
    skip_unless_rig!();
    let t = TempDir::new("forcesusp");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("forcesusp");
    let stable = format!("{DEV_DIR}/{n}");
    open(&img, &key, &n);
    ok(UCRYPT, &["suspend", &n]);
    let writer = Command::new("dd")
        .args([
            "if=/dev/zero",
            &format!("of={stable}"),
            "bs=64k",
            "count=16",
            "oflag=direct",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut cleanup = SuspendCleanup {
        name: n.clone(),
        key: key.clone(),
        fio: Some(writer),
    };
    std::thread::sleep(std::time::Duration::from_secs(1));
    let writer = cleanup.fio.as_mut().unwrap();
    assert!(
        writer.try_wait().unwrap().is_none(),
        "a write passed the suspend"
    );
    let o = within(60, UCRYPT, &["close", &n]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    let o = within(60, UCRYPT, &["close", "--force", &n]);
    assert_eq!(o.status.code(), Some(0), "close --force: {}", text(&o));
    let t0 = std::time::Instant::now();
    let st = loop {
        if let Some(st) = writer.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "the held write still waits after close --force"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut writer.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!st.success(), "the held write succeeded: {err}");
    assert!(err.contains("Input/output error"), "{err}");
    cleanup.fio = None;
    assert_gone(&n);
}

/// Peak resident memory of process `pid`, KiB (VmHWM).
fn peak_rss_kib(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Concurrent `resume` attempts run one at a time in the daemon: four wrong passphrases sent
/// at once against an Argon2 keyslot of 128 MiB raise the daemon's peak memory by less than
/// two KDFs' worth (at once they would need four), each is refused with exit 2 and logged to
/// the daemon's log without the passphrase, and the right one then resumes.
#[test]
fn concurrent_resumes_run_one_at_a_time_and_failures_are_logged() {
    skip_unless_rig!();
    const KDF_MIB: u64 = 128;
    let t = TempDir::new("resumes");
    let img = t.image("vol.img", 20);
    let key = t.file("key", PASSPHRASE);
    let kib = (KDF_MIB << 10).to_string();
    ok(
        UCRYPT,
        &[
            "format",
            "-q",
            "--key-file",
            s(&key),
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            &kib,
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-parallel",
            "1",
            s(&img),
        ],
    );
    let n = name("resumes");
    open(&img, &key, &n);
    let dir = Path::new(RUN_DIR).join(&n);
    let pid = std::fs::read_to_string(dir.join("pid")).unwrap();
    let pid = pid.trim();
    ok(UCRYPT, &["suspend", &n]);
    let _cleanup = SuspendCleanup {
        name: n.clone(),
        key: key.clone(),
        fio: None,
    };
    // The open's own KDF is in the peak already.
    let before = peak_rss_kib(pid);
    let secret = "not-the-passphrase-0xC0FFEE";
    let wrong = t.file("wrong", secret.as_bytes());
    let tries: Vec<_> = (0..4)
        .map(|_| {
            Command::new(UCRYPT)
                .args(["resume", &n, "--key-file", s(&wrong)])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in tries {
        let o = c.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    }
    let grown_kib = peak_rss_kib(pid).saturating_sub(before);
    assert!(
        grown_kib < (KDF_MIB << 10) * 3 / 2,
        "the daemon's peak grew by {grown_kib} KiB: resume KDFs ran at once"
    );
    let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap();
    let refused = log
        .lines()
        .filter(|l| l.contains("resume refused (exit 2): No key available with this passphrase."))
        .count();
    assert_eq!(refused, 4, "daemon.log: {log}");
    assert!(!log.contains(secret), "the passphrase is in the log: {log}");
    let o = within(60, UCRYPT, &["resume", &n, "--key-file", s(&key)]);
    assert_eq!(o.status.code(), Some(0), "resume: {}", text(&o));
    ok(UCRYPT, &["close", &n]);
    assert_gone(&n);
}

/// Closes NAME (`--force`; a dead daemon's leftovers too) when dropped, so that a failed
/// assertion leaves nothing behind.
struct CloseOnDrop(String);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let _ = run(UCRYPT, &["close", "--force", &self.0]);
    }
}

/// The child of `parent` whose command line contains `word`, if one runs.
fn child_with(parent: &str, word: &str) -> Option<String> {
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let pid = e.ok()?.file_name().into_string().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .to_string();
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        (ppid == parent && String::from_utf8_lossy(&cmd).contains(word)).then_some(pid)
    })
}

/// An online `reencrypt` whose daemon is killed (SIGKILL) under it says that the daemon is
/// gone and what to do (exit 1), not that the device is busy. The rotation's worker is
/// stopped first, so that the rotation cannot finish before the kill.
#[test]
fn reencrypt_through_a_daemon_killed_under_it_says_the_daemon_is_gone() {
    skip_unless_rig!();
    let t = TempDir::new("gone");
    let (img, key) = volume(&t, "vol.img", 64);
    let n = name("gone");
    open(&img, &key, &n);
    let _closer = CloseOnDrop(n.clone());
    let pid = std::fs::read_to_string(Path::new(RUN_DIR).join(&n).join("pid")).unwrap();
    let pid = pid.trim().to_string();
    let mut a = vec![
        "reencrypt",
        "--batch-mode",
        "--key-file",
        s(&key),
        "--hotzone-size",
        "256K",
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    let verb = Command::new(UCRYPT)
        .args(&a)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut verb = Background(verb);
    let t0 = std::time::Instant::now();
    let worker = loop {
        if let Some(w) = child_with(&pid, "reencrypt-worker") {
            break w;
        }
        if let Some(st) = verb.0.try_wait().unwrap() {
            panic!("the reencryption ended ({st}) before its worker was seen");
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "no rotation worker after 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    ok("kill", &["-STOP", &worker]);
    ok("kill", &["-9", &pid]);
    let t0 = std::time::Instant::now();
    let st = loop {
        if let Some(st) = verb.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "the verb still waits 60 s after its daemon died"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut verb.0.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "Device {n} has lost its daemon (pid {pid} is gone)"
        )) && err.contains(&format!("'ucrypt close {n}' cleans up")),
        "{err}"
    );
    // The worker died with its daemon; the dead daemon's leftovers are cleaned by close.
    let _ = run("kill", &["-CONT", &worker]);
    let o = ucrypt(&["close", &n]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    assert_gone(&n);
}

/// Every verb on an open device takes its stable path as well as its NAME, as cryptsetup takes
/// /dev/mapper/NAME: status, suspend, resume, resize, refresh, close. Another path is no
/// open device (status: "inactive", close: "not active", exit 4).
#[test]
fn the_stable_path_names_the_device() {
    skip_unless_rig!();
    let t = TempDir::new("stable");
    let (img, key) = volume(&t, "vol.img", 20);
    let n = name("stable");
    let stable = format!("{DEV_DIR}/{n}");
    open(&img, &key, &n);
    let _closer = CloseOnDrop(n.clone());
    let o = ucrypt(&["status", &stable]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with(&format!("{stable} is active.\n")),
        "{}",
        text(&o)
    );
    ok(UCRYPT, &["suspend", &stable]);
    ok(UCRYPT, &["resume", &stable, "--key-file", s(&key)]);
    ok(UCRYPT, &["resize", &stable]);
    ok(UCRYPT, &["refresh", &stable, "--policy", "inline"]);
    let o = ucrypt(&["status", "/dev/mapper/nothing-here"]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "/dev/mapper/nothing-here is inactive.\n"
    );
    let o = ucrypt(&["close", "/dev/mapper/nothing-here"]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let o = ucrypt(&["close", &stable]);
    assert_eq!(o.status.code(), Some(0), "close {stable}: {}", text(&o));
    assert_gone(&n);
}

/// Asks a vhost-user backend at `sock` for its virtio features, as a VMM's first message
/// does (`VHOST_USER_GET_FEATURES`: a 12-byte header, the reply a header and a u64); returns
/// the connection with the features.
fn vhost_user_features(sock: &Path) -> (std::os::unix::net::UnixStream, u64) {
    use std::io::{Read, Write};
    const GET_FEATURES: u32 = 1;
    const VERSION_1: u32 = 0x1;
    const REPLY: u32 = 0x4;
    let mut c = std::os::unix::net::UnixStream::connect(sock).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut hdr = Vec::new();
    for v in [GET_FEATURES, VERSION_1, 0] {
        hdr.extend_from_slice(&v.to_le_bytes());
    }
    c.write_all(&hdr).unwrap();
    let mut reply = [0u8; 20];
    c.read_exact(&mut reply).unwrap();
    let word = |i: usize| u32::from_le_bytes(reply[i..i + 4].try_into().unwrap());
    assert_eq!(word(0), GET_FEATURES, "reply to GET_FEATURES");
    assert_eq!(word(4), VERSION_1 | REPLY, "reply flags");
    assert_eq!(word(8), 8, "reply size");
    (c, u64::from_le_bytes(reply[12..20].try_into().unwrap()))
}

#[test]
fn vhost_user_front_end_serves_a_socket_until_close() {
    if !is_root() && std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        println!("SKIPPED: not root and XDG_RUNTIME_DIR unset");
        return;
    }
    let t = TempDir::new("life-vhost");
    let (img, key) = volume(&t, "vhost.img", 20);
    let n = name("vhost");
    let o = ucrypt(&[
        "open",
        s(&img),
        &n,
        "--key-file",
        s(&key),
        "--front-end",
        "vhost-user",
    ]);
    assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
    // NAME: STABLE -> SOCKET (vhost-user)
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("{n}: ")))
        .unwrap();
    let (_, rest) = line.split_once(" -> ").expect("a ready line");
    let sock = PathBuf::from(rest.strip_suffix(" (vhost-user)").expect("(vhost-user)"));
    assert!(sock.ends_with(format!("{n}/vhost.sock")), "{line}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&sock).unwrap().file_type().is_socket());

    let (code, f) = status_fields(&n);
    assert_eq!(code, 0);
    assert_eq!(field(&f, "front end"), "vhost-user");
    assert_eq!(field(&f, "device path"), s(&sock));

    // No VMM to tell: the resize stands (the config space shows it to the next VMM).
    let size = |n: &str| {
        let (_, f) = status_fields(n);
        field(&f, "size").to_string()
    };
    let before: u64 = size(&n).strip_suffix(" sectors").unwrap().parse().unwrap();
    ok("truncate", &["-s", "24M", s(&img)]);
    let o = ucrypt(&["resize", &n]);
    assert_eq!(o.status.code(), Some(0), "resize: {}", text(&o));
    assert_eq!(size(&n), format!("{} sectors", before + 8192));

    let (conn, features) = vhost_user_features(&sock);
    const VIRTIO_F_VERSION_1: u64 = 1 << 32;
    const VHOST_USER_F_PROTOCOL_FEATURES: u64 = 1 << 30;
    const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
    for bit in [
        VIRTIO_F_VERSION_1,
        VHOST_USER_F_PROTOCOL_FEATURES,
        VIRTIO_BLK_F_FLUSH,
    ] {
        assert_ne!(features & bit, 0, "features {features:#x} lack {bit:#x}");
    }
    // A VMM that gave no backend channel (this one negotiated nothing) is not told; the
    // resize stands.
    let o = ucrypt(&["resize", &n, "--size", &before.to_string()]);
    assert_eq!(o.status.code(), Some(0), "resize: {}", text(&o));
    assert_eq!(size(&n), format!("{before} sectors"));
    // A connected VMM's guest may use the disk: close refuses, as for a mounted device.
    let (_, f) = status_fields(&n);
    assert!(field(&f, "in use").contains("VMM"), "{f:?}");
    let o = ucrypt(&["close", &n]);
    assert_eq!(
        o.status.code(),
        Some(5),
        "close while connected: {}",
        text(&o)
    );
    drop(conn);
    // The backend sees the VMM go and waits for the next one.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let o = ucrypt(&["close", &n]);
        if o.status.code() == Some(0) {
            break;
        }
        assert_eq!(o.status.code(), Some(5), "close: {}", text(&o));
        assert!(
            std::time::Instant::now() < deadline,
            "still busy: {}",
            text(&o)
        );
    }
    assert!(!sock.exists(), "{} left behind", sock.display());
    let o = ucrypt(&["status", &n]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
}

/// Context switches of thread `tid` of process `pid` so far, voluntary and not.
fn switches(pid: &str, tid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("ctxt_switches:"))
        .filter_map(|l| l.split(':').nth(1)?.trim().parse::<u64>().ok())
        .sum()
}

/// Longer than the daemon's heap-trim period (10 s), in which a main loop that woke to look
/// again after its trim would switch at least once.
const QUIET_SPAN: std::time::Duration = std::time::Duration::from_secs(11);

/// The threads of process `pid` by name (`/proc/PID/task/*/comm`).
fn thread_names(pid: &str) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

/// An idle FUSE daemon keeps 2 threads (its main loop and one FUSE reader): after a busy
/// moment that started a second reader, the engine's workers and the pool's reaper, all of
/// them end once the volume has been idle for their idle periods (5 s each here; the test
/// waits up to a minute, for a loaded machine). Once the heap is trimmed the main thread
/// sleeps until the next request. The volume then still serves, and closes.
#[test]
fn an_idle_fuse_daemon_keeps_two_threads() {
    if !is_root() || !Path::new("/dev/fuse").exists() {
        println!("SKIPPED: needs root and /dev/fuse");
        return;
    }
    let t = TempDir::new("idle-threads");
    // 16 MiB of LUKS2 header, 24 MiB of data.
    let (img, key) = volume(&t, "vol.img", 40);
    let n = name("idle");
    let o = ucrypt(&[
        "open",
        s(&img),
        &n,
        "--key-file",
        s(&key),
        "--front-end",
        "fuse",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let (_, f) = status_fields(&n);
    let pid = field(&f, "pid").to_string();
    let file = Path::new(RUN_DIR).join(&n).join("volume");
    // Busy: writers at once (requests queue: a second reader starts; 1 MiB writes take the
    // pool past its kept chunk: the reaper starts), then a read.
    let writers: Vec<_> = (0..4)
        .map(|i| {
            Command::new("dd")
                .args([
                    "if=/dev/zero",
                    &format!("of={}", s(&file)),
                    "bs=1M",
                    "count=4",
                    &format!("seek={}", i * 4),
                    "oflag=direct",
                    "conv=notrunc",
                    "status=none",
                ])
                .spawn()
                .unwrap()
        })
        .collect();
    let written = writers
        .into_iter()
        .all(|mut w| w.wait().is_ok_and(|st| st.success()));
    let read = [
        &format!("if={}", s(&file)),
        "of=/dev/null",
        "bs=1M",
        "count=16",
        "iflag=direct",
        "status=none",
    ];
    let read_busy = run("dd", &read);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut names = thread_names(&pid);
    while names.len() > 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(250));
        names = thread_names(&pid);
    }
    let log = std::fs::read_to_string(Path::new(RUN_DIR).join(&n).join("daemon.log"));
    let idle_ok = names.len() <= 2 && !names.is_empty();
    // Once the heap is trimmed the main thread (whose id is the pid) sleeps until an event:
    // a span longer than the trim's period passes with no switch (within a deadline: the
    // trim comes 10 s after the main loop last saw a request).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(45);
    let quiet = loop {
        let before = switches(&pid, &pid);
        std::thread::sleep(QUIET_SPAN);
        let n = switches(&pid, &pid) - before;
        if n == 0 || std::time::Instant::now() >= deadline {
            break n;
        }
    };
    let asleep = switches(&pid, &pid);
    // Still serving after the idle period, and the request wakes the main loop; closes.
    let read_idle = run("dd", &read);
    let woken = switches(&pid, &pid) > asleep;
    let closed = ucrypt(&["close", &n]);
    assert!(written, "dd into {}", file.display());
    for o in [&read_busy, &read_idle] {
        assert!(
            o.status.success(),
            "dd from {}: {}",
            file.display(),
            text(o)
        );
    }
    assert!(
        idle_ok,
        "idle daemon {pid} has {} threads after 60 s: {names:?}; log: {log:?}",
        names.len()
    );
    assert_eq!(
        quiet, 0,
        "the idle daemon's main thread switched {quiet} times in {QUIET_SPAN:?}"
    );
    assert!(woken, "a request after the trim did not wake the main loop");
    assert_eq!(closed.status.code(), Some(0), "{}", text(&closed));
    assert_gone(&n);
}
