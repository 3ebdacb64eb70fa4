//! systemd and ucrypttab: the shipped unit `contrib/systemd/ucrypt@.service` passes
//! `systemd-analyze verify` without a warning; `ucrypt tab start` opens every line of a test
//! ucrypttab but its `noauto` one, and `tab stop` closes them; `tab start NAME --foreground`
//! (what the unit runs) tells systemd READY=1 through NOTIFY_SOCKET once the device is there
//! and exits 0 after `ucrypt close NAME`. A bad line costs only its own volume, and a second
//! `tab start` leaves the volumes already open alone.
//!
//! Needs root and /dev/fuse (the FUSE front end; no loop devices), and systemd-analyze for the
//! unit check; otherwise SKIPPED with the reason. Names carry the pid.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const UCRYPT: &str = env!("CARGO_BIN_EXE_ucrypt");

fn root_and_fuse() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (/run/ucrypt and FUSE mounts)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse missing".into());
    }
    None
}

fn run(args: &[&str]) -> Output {
    Command::new(UCRYPT)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ucrypt")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A temporary directory with a LUKS2 volume `luks.img` (passphrase in `pass`) and a raw one
/// `raw.img` (volume key in `raw.key`).
fn volumes(tag: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("ucrypt-tab-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("dir");
    for f in ["luks.img", "raw.img"] {
        std::fs::File::create(d.join(f))
            .and_then(|x| x.set_len(24 << 20))
            .expect("image");
    }
    std::fs::write(d.join("pass"), b"tab passphrase").expect("pass");
    std::fs::write(d.join("raw.key"), [7u8; 64]).expect("key");
    let o = run(&[
        "format",
        "-q",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        d.join("pass").to_str().unwrap(),
        d.join("luks.img").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "format: {}", text(&o));
    Dir(d)
}

fn listed(name: &str) -> bool {
    let o = run(&["list"]);
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

#[test]
fn unit_file_verifies_cleanly() {
    let have = Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        println!("SKIPPED: systemd-analyze not installed (package systemd)");
        return;
    }
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd/ucrypt@.service");
    let text = std::fs::read_to_string(&unit).expect("unit file");
    assert!(
        text.contains("Type=notify") && text.contains("ExecStop=/usr/local/bin/ucrypt close %I")
    );
    // Verified as installed, with the binary under test where the unit expects ucrypt.
    let d = std::env::temp_dir().join(format!("ucrypt-unit-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("dir");
    let _d = Dir(d.clone());
    let path = d.join("ucrypt@.service");
    std::fs::write(&path, text.replace("/usr/local/bin/ucrypt", UCRYPT)).expect("write");
    for instance in ["ucrypt@.service", "ucrypt@data.service"] {
        let o = Command::new("systemd-analyze")
            .args(["verify", &format!("./{instance}")])
            .current_dir(&d)
            .output()
            .expect("systemd-analyze");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success() && err.trim().is_empty(),
            "systemd-analyze verify {instance}: {err}"
        );
    }
}

#[test]
fn tab_start_opens_every_line_and_stop_closes_them() {
    if let Some(why) = root_and_fuse() {
        println!("SKIPPED: {why}");
        return;
    }
    let d = volumes("all");
    let pid = std::process::id();
    let (a, b, c) = (
        format!("tab-a-{pid}"),
        format!("tab-b-{pid}"),
        format!("tab-c-{pid}"),
    );
    let p = |f: &str| d.0.join(f).display().to_string();
    let tab = d.0.join("ucrypttab");
    std::fs::write(
        &tab,
        format!(
            "# test table\n{a} {} {} luks,discard,front-end=fuse\n\n{b} {} {} plain,cipher=aes-xts-plain64,front-end=fuse\n{c} {} {} noauto,front-end=fuse\n",
            p("luks.img"),
            p("pass"),
            p("raw.img"),
            p("raw.key"),
            p("luks.img"),
            p("pass"),
        ),
    )
    .expect("tab");
    let t = tab.to_str().unwrap();
    let o = run(&["tab", "start", "--tab", t]);
    // The noauto line is skipped; the other two open (c would be refused anyway: luks.img is
    // already open as a).
    assert_eq!(o.status.code(), Some(0), "tab start: {}", text(&o));
    assert!(listed(&a) && listed(&b), "{}", text(&run(&["list"])));
    assert!(!listed(&c));
    let st = run(&["status", &a]);
    assert!(
        String::from_utf8_lossy(&st.stdout).contains("flags:   discards")
            || String::from_utf8_lossy(&st.stdout).contains("discards"),
        "discard option reached the volume: {}",
        text(&st)
    );
    let o = run(&["tab", "stop", "--tab", t]);
    assert_eq!(o.status.code(), Some(0), "tab stop: {}", text(&o));
    assert!(!listed(&a) && !listed(&b));
    // An unknown NAME exits 4 with one line naming the table.
    let o = run(&["tab", "start", "nosuch", "--tab", t]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not in"));
}

/// As systemd-cryptsetup does: a bad line (line 3 here) is a warning naming its line and
/// problem, the other lines' volumes open all the same, and `tab start` exits 1 naming the bad
/// one last; `tab stop` closes them all the same (exit 0). A second `tab start` leaves the open
/// volumes alone with a note (exit 0); a name open for another volume is refused (exit 5).
#[test]
fn a_bad_line_costs_only_its_volume_and_a_second_start_leaves_open_ones() {
    if let Some(why) = root_and_fuse() {
        println!("SKIPPED: {why}");
        return;
    }
    let d = volumes("badline");
    let pid = std::process::id();
    let (a, b, bad) = (
        format!("tab-ba-{pid}"),
        format!("tab-bb-{pid}"),
        format!("tab-bx-{pid}"),
    );
    let p = |f: &str| d.0.join(f).display().to_string();
    let good_a = format!("{a} {} {} luks,front-end=fuse\n", p("luks.img"), p("pass"));
    let good_b = format!(
        "{b} {} {} plain,cipher=aes-xts-plain64,front-end=fuse\n",
        p("raw.img"),
        p("raw.key")
    );
    let bad_line = format!("{bad} {} - frobnicate\n", p("raw.img"));
    let with_bad = d.0.join("with-bad");
    std::fs::write(&with_bad, format!("# table\n{good_a}{bad_line}{good_b}")).expect("tab");
    let good = d.0.join("good");
    std::fs::write(&good, format!("{good_a}{good_b}")).expect("tab");
    let (wb, g) = (with_bad.to_str().unwrap(), good.to_str().unwrap());
    let stderr = |o: &Output| String::from_utf8_lossy(&o.stderr).to_string();

    let o = run(&["tab", "start", "--tab", wb]);
    assert_eq!(o.status.code(), Some(1), "tab start: {}", text(&o));
    assert!(
        stderr(&o).contains("line 3: unknown option 'frobnicate'"),
        "the warning names the line and the problem: {}",
        text(&o)
    );
    let last = stderr(&o).lines().last().unwrap_or_default().to_string();
    assert!(
        last.contains("failed") && last.contains(&bad) && !last.contains(&a),
        "the closing line names what failed: {}",
        text(&o)
    );
    assert!(listed(&a) && listed(&b), "{}", text(&run(&["list"])));
    assert!(!listed(&bad));

    // Again, with the table fixed: both are open already, and left so.
    let o = run(&["tab", "start", "--tab", g]);
    assert_eq!(o.status.code(), Some(0), "second tab start: {}", text(&o));
    for n in [&a, &b] {
        assert!(
            stderr(&o).contains(&format!("{n} (line")) && stderr(&o).contains("already open"),
            "a note for {n}: {}",
            text(&o)
        );
        assert!(listed(n));
    }
    // A name that is open for another volume than its line's is refused, as `open` would.
    let other = d.0.join("other");
    std::fs::write(
        &other,
        format!(
            "{a} {} {} plain,cipher=aes-xts-plain64,front-end=fuse\n",
            p("raw.img"),
            p("raw.key")
        ),
    )
    .expect("tab");
    let o = run(&["tab", "start", "--tab", other.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(stderr(&o).contains("open already"), "{}", text(&o));
    assert!(listed(&a));

    let o = run(&["tab", "stop", "--tab", wb]);
    assert_eq!(o.status.code(), Some(0), "tab stop: {}", text(&o));
    assert!(
        stderr(&o).contains("line 3: unknown option"),
        "{}",
        text(&o)
    );
    assert!(!listed(&a) && !listed(&b), "{}", text(&run(&["list"])));
    // `tab start NAME` of the bad line is that line's error.
    let o = run(&["tab", "start", &bad, "--tab", wb]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("line 3: unknown option"),
        "{}",
        text(&o)
    );
}

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Restores enable_uring on drop.
struct RestoreUring(String);
impl Drop for RestoreUring {
    fn drop(&mut self) {
        let _ = std::fs::write(ENABLE_URING, &self.0);
    }
}

/// Why FUSE-over-io_uring is not used (a hint about the kernel, not the volume) is said once,
/// in `status`'s front end notes, and not on the line `open` and `tab start` print per
/// volume. With enable_uring at Y the test sets it to N for its run (root), so that there is
/// a hint to place.
#[test]
fn the_io_uring_hint_is_said_once_in_status() {
    if let Some(why) = root_and_fuse() {
        println!("SKIPPED: {why}");
        return;
    }
    let _restore = match std::fs::read_to_string(ENABLE_URING) {
        Ok(v) if v.trim() == "Y" => {
            std::fs::write(ENABLE_URING, "N").expect("set enable_uring=N");
            Some(RestoreUring(v.trim().to_string()))
        }
        // N, or a kernel without it: either way there is a hint.
        _ => None,
    };
    let d = volumes("hint");
    let pid = std::process::id();
    let (a, b) = (format!("tab-ha-{pid}"), format!("tab-hb-{pid}"));
    let p = |f: &str| d.0.join(f).display().to_string();
    let both = |o: &Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let o = run(&[
        "open",
        &p("raw.img"),
        &a,
        "--cipher",
        "aes-xts-plain64",
        "--volume-key-file",
        &p("raw.key"),
        "--front-end",
        "fuse",
    ]);
    assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
    assert!(!both(&o).contains("io_uring"), "open: {}", text(&o));
    let tab = d.0.join("ucrypttab");
    std::fs::write(
        &tab,
        format!("{b} {} {} front-end=fuse\n", p("luks.img"), p("pass")),
    )
    .expect("tab");
    let o = run(&["tab", "start", "--tab", tab.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "tab start: {}", text(&o));
    assert!(!both(&o).contains("io_uring"), "tab start: {}", text(&o));
    for n in [&a, &b] {
        let st = run(&["status", n]);
        let lines: Vec<String> = both(&st)
            .lines()
            .filter(|l| l.contains("io_uring"))
            .map(str::to_string)
            .collect();
        assert!(
            lines.len() == 1 && lines[0].contains("front end notes:"),
            "status {n} says the hint once, in its notes: {}",
            text(&st)
        );
    }
    for n in [&a, &b] {
        let o = run(&["close", n]);
        assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    }
}

#[test]
fn foreground_start_notifies_systemd_and_close_ends_it() {
    if let Some(why) = root_and_fuse() {
        println!("SKIPPED: {why}");
        return;
    }
    let d = volumes("fg");
    let name = format!("tab-fg-{}", std::process::id());
    let tab = d.0.join("ucrypttab");
    std::fs::write(
        &tab,
        format!(
            "{name} {} {} front-end=fuse\n",
            d.0.join("luks.img").display(),
            d.0.join("pass").display()
        ),
    )
    .expect("tab");
    let notify = d.0.join("notify");
    let sock = UnixDatagram::bind(&notify).expect("notify socket");
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut child = Command::new(UCRYPT)
        .args(["tab", "start", &name, "--foreground", "--tab"])
        .arg(&tab)
        .env("NOTIFY_SOCKET", &notify)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).expect("READY=1 within 30 s");
    assert_eq!(&buf[..n], b"READY=1");
    assert!(listed(&name));
    assert!(Path::new("/dev/ucrypt").join(&name).exists());
    let o = run(&["close", &name]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    let st = child.wait().expect("wait");
    assert_eq!(
        st.code(),
        Some(0),
        "the foreground daemon exits 0 after close"
    );
    assert!(!listed(&name));
}

/// `refresh NAME --policy P` changes the running volume's dispatch policy (shown by `status`)
/// without closing it; an unknown NAME exits 4.
#[test]
fn refresh_changes_the_policy_of_an_open_volume() {
    if let Some(why) = root_and_fuse() {
        println!("SKIPPED: {why}");
        return;
    }
    let d = volumes("refresh");
    let name = format!("tab-refresh-{}", std::process::id());
    let img = d.0.join("raw.img");
    let key = d.0.join("raw.key");
    let o = run(&[
        "open",
        img.to_str().unwrap(),
        &name,
        "--cipher",
        "aes-xts-plain64",
        "--volume-key-file",
        key.to_str().unwrap(),
        "--front-end",
        "fuse",
        "--policy",
        "inline",
    ]);
    assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
    let policy = |o: &Output| {
        String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
            l.trim()
                .strip_prefix("policy:")
                .map(|p| p.trim().to_string())
        })
    };
    assert_eq!(policy(&run(&["status", &name])).as_deref(), Some("inline"));
    let o = run(&["refresh", &name, "--policy", "parallel"]);
    assert_eq!(o.status.code(), Some(0), "refresh: {}", text(&o));
    assert_eq!(policy(&o).as_deref(), Some("parallel"));
    assert_eq!(
        policy(&run(&["status", &name])).as_deref(),
        Some("parallel")
    );
    let o = run(&["close", &name]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    let o = run(&["refresh", &name, "--policy", "auto"]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
}

/// The LUKS2 header's persistent no-read-workqueue flag (`config --persistent
/// --perf-no_read_workqueue`) makes reads inline when `open` is given no --policy; the
/// command-line flag `--perf-no_write_workqueue` does the same for writes; an explicit
/// `--policy` wins over the header.
#[test]
fn workqueue_flags_map_to_per_direction_policies() {
    if let Some(why) = root_and_fuse() {
        println!("SKIPPED: {why}");
        return;
    }
    let d = volumes("wq");
    let img = d.0.join("luks.img");
    let pass = d.0.join("pass");
    let (i, k) = (img.to_str().unwrap(), pass.to_str().unwrap());
    let o = run(&[
        "config",
        i,
        "--persistent",
        "--perf-no_read_workqueue",
        "--key-file",
        k,
    ]);
    assert_eq!(o.status.code(), Some(0), "config: {}", text(&o));
    let policy_of = |extra: &[&str]| {
        let name = format!("tab-wq-{}", std::process::id());
        let mut args = vec!["open", i, &name, "--key-file", k, "--front-end", "fuse"];
        args.extend(extra);
        let o = run(&args);
        assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
        let st = run(&["status", &name]);
        let p = String::from_utf8_lossy(&st.stdout).lines().find_map(|l| {
            l.trim()
                .strip_prefix("policy:")
                .map(|p| p.trim().to_string())
        });
        let c = run(&["close", &name]);
        assert_eq!(c.status.code(), Some(0), "close: {}", text(&c));
        p.unwrap_or_default()
    };
    assert_eq!(policy_of(&[]), "read=inline,write=auto");
    assert_eq!(policy_of(&["--perf-no_write_workqueue"]), "inline");
    assert_eq!(policy_of(&["--policy", "parallel"]), "parallel");
    assert_eq!(
        policy_of(&["--policy", "read=queued,write=ordered"]),
        "read=queued,write=ordered"
    );
}

/// `open --nbd unix:PATH` serves the volume to NBD clients beside its device: what is written
/// to /dev/ucrypt/NAME reads back over NBD, and `close` removes the socket.
#[test]
fn open_also_serves_nbd() {
    if let Some(why) = root_and_fuse() {
        println!("SKIPPED: {why}");
        return;
    }
    if Command::new("nbdcopy").arg("--version").output().is_err() {
        println!("SKIPPED: nbdcopy not installed (libnbd-bin)");
        return;
    }
    let d = volumes("nbd");
    let name = format!("tab-nbd-{}", std::process::id());
    let sock = d.0.join("nbd.sock");
    let o = run(&[
        "open",
        d.0.join("raw.img").to_str().unwrap(),
        &name,
        "--cipher",
        "aes-xts-plain64",
        "--volume-key-file",
        d.0.join("raw.key").to_str().unwrap(),
        "--front-end",
        "fuse",
        "--nbd",
        &format!("unix:{}", sock.display()),
    ]);
    assert_eq!(o.status.code(), Some(0), "open: {}", text(&o));
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 31 + 7) as u8).collect();
    {
        use std::os::unix::fs::FileExt;
        // No truncation: the device's size is the volume's.
        let dev = std::fs::OpenOptions::new()
            .write(true)
            .open(Path::new("/dev/ucrypt").join(&name))
            .expect("open the device");
        dev.write_all_at(&data, 0).expect("write the device");
        dev.sync_all().expect("sync");
    }
    let back = d.0.join("back");
    let uri = format!("nbd+unix:///{name}?socket={}", sock.display());
    let o = Command::new("nbdcopy")
        .args([&uri, back.to_str().unwrap()])
        .output()
        .expect("nbdcopy");
    assert!(o.status.success(), "nbdcopy: {}", text(&o));
    assert!(std::fs::read(&back).unwrap()[..1 << 20] == data[..]);
    let o = run(&["close", &name]);
    assert_eq!(o.status.code(), Some(0), "close: {}", text(&o));
    assert!(!sock.exists(), "the NBD socket goes with the volume");
    let o = run(&[
        "open",
        d.0.join("raw.img").to_str().unwrap(),
        &name,
        "--cipher",
        "aes-xts-plain64",
        "--volume-key-file",
        d.0.join("raw.key").to_str().unwrap(),
        "--nbd",
        "tcp:127.0.0.1:10809",
    ]);
    assert_eq!(o.status.code(), Some(1), "tcp is serve's: {}", text(&o));
}
