//! `ucrypt vhost` serving a LUKS2 volume to a qemu guest (TCG) as a vhost-user-blk disk with two
//! queues. First boot: the raw image is also attached read-only beside the vhost disk; the guest checks the device's shape (queues, 4 KiB logical blocks, serial, write
//! cache), writes and reads back a pattern with O_DIRECT on both vCPUs, zeroes a range, makes an
//! ext4 with files and fscks it, then opens the raw image with its own dm-crypt and compares it
//! with the vhost disk byte for byte (the disks are told apart by serial: virtio's probe order
//! is not the command line's). Second boot (the same `ucrypt vhost` process, which must
//! accept the new VMM): the files are still there. Finally SIGTERM must end the server with
//! status 0, and `ucrypt export` of the image must equal what the guest read.
//!
//! A backend restart under load: qemu reconnects (`reconnect=1` on the chardev) while fio in
//! the guest writes with fsyncs and verifies; the backend is SIGKILLed and started again ten
//! times mid-run. Every fio run must finish (no request lost in flight: it would hang the
//! guest) and verify (no acknowledged write lost).
//!
//! A resize reaches the guest: `ucrypt open --front-end vhost-user` serves one volume and
//! `ucrypt vhost --control` another, the host grows both images and runs `ucrypt resize NAME`
//! and `ucrypt resize VOLUME --control PATH` while the guest waits, and each disk's
//! `/sys/block/vdX/size` must follow (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG, then qemu's
//! config-change interrupt). Without a VM, `ucrypt vhost --control` on its own: a resize
//! through the control socket, with no VMM connected, changes the size `status` reports.
//!
//! The boots take turns ([`VM`]): two TCG guests at once on a small host only slow both.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

const DATA_BYTES: u64 = 32 << 20;

const BOOT1: &str = r#"
set -e
# The vhost disk is the one with our serial (virtio probe order is not the command line's).
for b in /sys/block/vd*; do [ "$(cat $b/serial)" = "vhost-vm-serial" ] && q=$b; done
[ -n "$q" ] && echo "SERIAL-OK"
d=/dev/${q##*/}
raw=/dev/vda; [ "$d" = /dev/vda ] && raw=/dev/vdb
echo "vhost disk: queues=$(ls $q/mq | wc -l) lbs=$(cat $q/queue/logical_block_size) serial=$(cat $q/serial) cache=$(cat $q/queue/write_cache) size=$(cat $q/size) discard_max=$(cat $q/queue/discard_max_bytes) wz_max=$(cat $q/queue/write_zeroes_max_bytes)"
[ "$(ls $q/mq | wc -l)" = 2 ] && echo "QUEUES-2"
[ "$(cat $q/queue/logical_block_size)" = 4096 ] && echo "LBS-4096"
[ "$(cat $q/queue/write_cache)" = "write back" ] && echo "WRITE-BACK"
dd if=/dev/urandom of=/tmp/pat bs=65536 count=32 2>/dev/null
# One writer and one reader per vCPU: both queues carry requests.
taskset -c 0 dd if=/tmp/pat of=$d bs=65536 count=16 oflag=direct conv=fsync 2>/dev/null &
taskset -c 1 dd if=/tmp/pat of=$d bs=65536 skip=16 seek=16 count=16 oflag=direct conv=fsync 2>/dev/null &
wait
taskset -c 1 dd if=$d bs=65536 count=32 iflag=direct 2>/dev/null | cmp - /tmp/pat && echo "PATTERN-READ-BACK"
dd if=/dev/zero of=/tmp/zero bs=65536 count=4 2>/dev/null
/usr/local/sbin/blkdiscard -z -o 65536 -l 262144 $d
dd if=$d bs=65536 skip=1 count=4 iflag=direct 2>/dev/null | cmp - /tmp/zero && echo "WRITE-ZEROES-READ-ZERO"
mkfs.ext4 -q -F $d
mkdir -p /m && mount $d /m
for i in 1 2 3 4; do dd if=/dev/urandom of=/m/f$i bs=65536 count=8 2>/dev/null; done
mkdir /m/tree && cp -a /sbin /m/tree/
(cd /m && sha256sum f1 f2 f3 f4 > /m/SUMS)
umount /m
e2fsck -f -n $d && echo "FSCK-OK"
sync
cryptsetup open --readonly --key-file /mnt/host/key $raw k
cmp /dev/mapper/k $d && echo "DMCRYPT-SAME-PLAINTEXT"
e2fsck -f -n /dev/mapper/k && echo "DMCRYPT-FSCK-OK"
cryptsetup close k
sha256sum $d | cut -c1-64 | sed 's/^/PLAINTEXT-SHA /'
echo "BOOT1-OK"
"#;

const BOOT2: &str = r#"
set -e
mkdir -p /m && mount -o ro /dev/vda /m
(cd /m && sha256sum -c SUMS) && echo "FILES-KEPT"
umount /m
echo "BOOT2-OK"
"#;

/// One guest at a time.
static VM: Mutex<()> = Mutex::new(());

/// The restart test's guest: fio runs (2 jobs, one per vCPU and so per queue, random 4 KiB
/// writes at depth 16 with an fsync every 4 writes, then a read-back verify of every block)
/// one after another until the host leaves `stop` in the share.
const RESTARTS: &str = r#"
for b in /sys/block/vd*; do [ "$(cat $b/serial)" = "vhost-vm-serial" ] && q=$b; done
[ -n "$q" ] || { echo "no vhost disk"; exit 1; }
d=/dev/${q##*/}
n=0
while [ ! -e /mnt/host/stop ]; do
  n=$((n+1))
  /usr/local/sbin/fio --name=restart --filename=$d --ioengine=libaio --direct=1 \
    --rw=randwrite --bs=4k --iodepth=16 --numjobs=2 --size=4M --offset_increment=4M \
    --cpus_allowed=0-1 --cpus_allowed_policy=split --fsync=4 \
    --verify=crc32c --verify_fatal=1 --randseed=$n --output=/tmp/fio.out >/dev/null 2>&1 ||
    { echo "FIO-FAILED run $n"; cat /tmp/fio.out; exit 1; }
  echo "FIO-VERIFIED run $n"
done
echo "RESTARTS-SURVIVED runs=$n"
"#;

/// Backend restarts in the restart test.
const RESTART_TRIALS: usize = 10;

fn ucrypt(args: &[&str]) -> Result<String, String> {
    vm::host(env!("CARGO_BIN_EXE_ucrypt"), args)
}

/// A work directory with a share for the guest holding a random key file, and a LUKS2 volume
/// (AES-XTS, 4 KiB sectors) of `data_bytes` formatted with it: (dir, share, key, image).
fn volume(tag: &str, data_bytes: u64) -> (kit::TempDir, PathBuf, PathBuf, PathBuf) {
    let tmp = kit::TempDir::new(tag);
    let share = tmp.0.join("share");
    std::fs::create_dir_all(&share).unwrap();
    let key = share.join("key");
    let mut rng = kit::SplitMix(kit::seed());
    vm::random_file(&mut rng, &key, 32);
    let img = tmp.0.join("vol.img");
    let image = vm::Luks2Image {
        cipher: "aes-xts-plain64",
        key_bits: 512,
        sector_bytes: 4096,
        data_bytes,
    };
    image
        .format(env!("CARGO_BIN_EXE_ucrypt"), &img, &key)
        .expect("ucrypt format");
    (tmp, share, key, img)
}

/// `ucrypt vhost` on `img` at `sock`, once it says it is ready.
fn start_server(img: &Path, key: &Path, sock: &Path) -> Child {
    start_server_with(img, key, sock, &["--serial", "vhost-vm-serial"])
}

/// `ucrypt vhost` serving `img` at `sock` with `args` besides, once ready.
fn start_server_with(img: &Path, key: &Path, sock: &Path, args: &[&str]) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ucrypt"))
        .args(["vhost", kit::s(img), "--key-file", kit::s(key)])
        .args(["--socket", kit::s(sock), "--queues", "2"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn ucrypt vhost");
    let out = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(out).lines();
    let t0 = Instant::now();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("ready: ") => break,
            Some(Ok(_)) => {}
            _ => {
                let _ = child.kill();
                panic!("ucrypt vhost ended before it was ready");
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "ucrypt vhost not ready"
        );
    }
    child
}

#[test]
fn luks2_volume_served_to_a_vm_over_vhost_user_blk() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED vhost_vm: {reason}");
        return;
    }
    let _turn = VM.lock().unwrap_or_else(|e| e.into_inner());
    let (tmp, share, key, img) = volume("vhost-vm", DATA_BYTES);
    let sock = tmp.0.join("vhost.sock");
    let mut server = start_server(&img, &key, &sock);

    let mut run = vm::VmRun::new(BOOT1);
    run.disk(&img, true);
    run.vhosts.push(sock.clone());
    run.vhost_queues = Some(2);
    run.cpus = Some(2);
    run.share = Some(share.clone());
    run.silence_max_s = Some(120);
    let out1 = run.run(&tmp.0);

    // The same server must take the next VMM.
    let mut run = vm::VmRun::new(BOOT2);
    run.vhosts.push(sock.clone());
    run.cpus = Some(2);
    run.silence_max_s = Some(120);
    let out2 = run.run(&tmp.0);

    // SAFETY: plain FFI call sending SIGTERM to the child we spawned.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let status = server.wait().expect("wait for ucrypt vhost");
    assert!(!sock.exists(), "the socket outlived the server");

    for marker in [
        "QUEUES-2",
        "LBS-4096",
        "SERIAL-OK",
        "WRITE-BACK",
        "PATTERN-READ-BACK",
        "WRITE-ZEROES-READ-ZERO",
        "FSCK-OK",
        "DMCRYPT-SAME-PLAINTEXT",
        "DMCRYPT-FSCK-OK",
        "BOOT1-OK",
    ] {
        assert!(
            out1.output.contains(marker),
            "missing {marker} in the first boot's output (status {})",
            out1.status
        );
    }
    assert_eq!(out1.status, 0);
    assert!(
        out2.output.contains("FILES-KEPT"),
        "second boot: files lost"
    );
    assert_eq!(out2.status, 0);
    assert!(status.success(), "ucrypt vhost exited with {status}");

    let guest_sha = out1
        .output
        .lines()
        .find_map(|l| l.strip_prefix("PLAINTEXT-SHA "))
        .expect("the guest's sha256 of the disk")
        .trim()
        .to_string();
    let plain = tmp.0.join("plain.img");
    ucrypt(&[
        "export",
        kit::s(&img),
        kit::s(&plain),
        "--key-file",
        kit::s(&key),
    ])
    .expect("ucrypt export");
    let host_sha = vm::host("sha256sum", &[kit::s(&plain)]).unwrap();
    // The second boot mounted read-only: the export is what the first guest read.
    assert_eq!(
        &host_sha[..64],
        guest_sha,
        "ucrypt export differs from the guest's view"
    );
}

/// The image file's modification time: it changes when the backend writes the volume.
fn mtime(img: &Path) -> Option<SystemTime> {
    std::fs::metadata(img).and_then(|m| m.modified()).ok()
}

/// Waits until `img` is written after `since` (or the guest has ended): whether it was.
fn written_after(img: &Path, since: Option<SystemTime>, guest_done: &AtomicBool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline && !guest_done.load(Ordering::Acquire) {
        if mtime(img) != since {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Kills and restarts the backend [`RESTART_TRIALS`] times once the guest writes, each after
/// a seeded delay; then leaves `stop` for the guest. Returns the last server and a line per
/// trial, or what went wrong.
fn restart_trials(
    img: PathBuf,
    key: PathBuf,
    sock: PathBuf,
    stop: PathBuf,
    mut server: Child,
    guest_done: Arc<AtomicBool>,
) -> (Child, Result<Vec<String>, String>) {
    let mut rng = kit::SplitMix(kit::seed());
    let mut trials = Vec::new();
    let result = (|| {
        if !written_after(&img, mtime(&img), &guest_done) {
            return Err("the guest never wrote the vhost disk".to_string());
        }
        for trial in 0..RESTART_TRIALS {
            let delay = Duration::from_millis(200 + rng.next_u64() % 1300);
            std::thread::sleep(delay);
            if guest_done.load(Ordering::Acquire) {
                return Err(format!("the guest ended before trial {trial}"));
            }
            let _ = server.kill();
            let _ = server.wait();
            let before = mtime(&img);
            let t0 = Instant::now();
            server = start_server(&img, &key, &sock);
            if !written_after(&img, before, &guest_done) {
                return Err(format!("trial {trial}: no write after the restart"));
            }
            trials.push(format!(
                "trial {trial}: SIGKILL {delay:?} into the run, written again {:?} after",
                t0.elapsed()
            ));
        }
        Ok(())
    })();
    let _ = std::fs::write(&stop, b"");
    (server, result.map(|()| trials))
}

#[test]
fn a_backend_killed_under_fio_restarts_and_loses_nothing() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED vhost_vm restart: {reason}");
        return;
    }
    let _turn = VM.lock().unwrap_or_else(|e| e.into_inner());
    let (tmp, share, key, img) = volume("vhost-restart", 16 << 20);
    let sock = tmp.0.join("vhost.sock");
    let server = start_server(&img, &key, &sock);
    let guest_done = Arc::new(AtomicBool::new(false));
    let trials = {
        let (img, key, sock) = (img.clone(), key.clone(), sock.clone());
        let (stop, done) = (share.join("stop"), guest_done.clone());
        std::thread::spawn(move || restart_trials(img, key, sock, stop, server, done))
    };

    let mut run = vm::VmRun::new(RESTARTS);
    run.vhosts.push(sock.clone());
    run.vhost_reconnect = Some(1);
    run.cpus = Some(2);
    run.share = Some(share.clone());
    run.extra_bins.push(PathBuf::from("/usr/bin/fio"));
    run.silence_max_s = Some(180);
    let out = run.run(&tmp.0);
    guest_done.store(true, Ordering::Release);
    let (mut server, trials) = trials.join().expect("the restart thread");
    let _ = server.kill();
    let _ = server.wait();

    let trials = trials.unwrap_or_else(|e| panic!("{e} (VM status {})", out.status));
    for t in &trials {
        println!("{t}");
    }
    assert!(
        out.output.contains("RESTARTS-SURVIVED") && !out.output.contains("FIO-FAILED"),
        "fio did not survive {RESTART_TRIALS} backend restarts (VM status {})",
        out.status
    );
    assert_eq!(out.status, 0);
}

/// The resize test's guest: says its disks' sizes and that it is ready, waits for the host's
/// resizes, then for both sizes to change. The disk `ucrypt vhost --control` serves has the
/// serial `vhost-standalone`, the open daemon's is the other.
const RESIZE: &str = r#"
for b in /sys/block/vd*; do
  if [ "$(cat $b/serial)" = "vhost-standalone" ]; then s=$b; else q=$b; fi
done
[ -n "$q" ] && [ -n "$s" ] || { echo "NO-DISKS"; exit 1; }
before=$(cat $q/size); sbefore=$(cat $s/size)
echo "SIZE-BEFORE $before"
echo "STANDALONE-SIZE-BEFORE $sbefore"
: > /mnt/host/ready
# Bounds, not timings: generous for a loaded host running TCG.
n=0
while [ ! -e /mnt/host/resized ] && [ $n -lt 600 ]; do sleep 1; n=$((n+1)); done
[ -e /mnt/host/resized ] || { echo "NO-RESIZE-FROM-HOST"; exit 1; }
echo "resized after $n s of waiting"
n=0
while { [ "$(cat $q/size)" = "$before" ] || [ "$(cat $s/size)" = "$sbefore" ]; } && [ $n -lt 120 ]; do sleep 1; n=$((n+1)); done
echo "SIZE-AFTER $(cat $q/size) ($n s after the host's resize)"
echo "STANDALONE-SIZE-AFTER $(cat $s/size)"
for d in $q $s; do
  dd if=/dev/${d##*/} of=/dev/null bs=4096 skip=$(( $(cat $d/size) / 8 - 1 )) count=1 iflag=direct 2>/dev/null && echo "LAST-BLOCK-READ ${d##*/}"
done
"#;

/// An `ucrypt open` daemon closed when dropped (the VMM gone first: close refuses while one is
/// connected).
struct Opened(String);

impl Drop for Opened {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while ucrypt(&["close", &self.0]).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = ucrypt(&["close", "--force", &self.0]);
    }
}

/// The host's side of the resize test: once the guest is ready, grows each image by `grow`
/// bytes and runs `ucrypt resize` with its arguments, then tells the guest. Returns the
/// resizes' output.
fn resize_when_ready(
    share: &Path,
    resizes: &[(PathBuf, Vec<String>)],
    grow: u64,
    guest_done: &AtomicBool,
) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(600);
    while !share.join("ready").exists() {
        if guest_done.load(Ordering::Acquire) || Instant::now() > deadline {
            return Err("the guest never became ready".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut out = String::new();
    let grown = resizes.iter().try_for_each(|(img, args)| {
        let len = std::fs::metadata(img).map_err(|e| e.to_string())?.len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(img)
            .and_then(|f| f.set_len(len + grow))
            .map_err(|e| e.to_string())?;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let t0 = Instant::now();
        out += &ucrypt(&args)?;
        println!("ucrypt {args:?} took {:?}", t0.elapsed());
        Ok::<(), String>(())
    });
    // Told either way: the guest stops waiting.
    let _ = std::fs::write(share.join("resized"), b"");
    grown.map(|()| out)
}

#[test]
fn a_resize_of_the_open_volume_reaches_the_guest() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED vhost_vm resize: {reason}");
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 && std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        println!("SKIPPED vhost_vm resize: not root and XDG_RUNTIME_DIR unset (ucrypt open)");
        return;
    }
    let _turn = VM.lock().unwrap_or_else(|e| e.into_inner());
    const GROW_BYTES: u64 = 8 << 20;
    let (tmp, share, key, img) = volume("vhost-resize", 8 << 20);
    let name = format!("vhost-resize-{}", std::process::id());
    let out = ucrypt(&[
        "open",
        kit::s(&img),
        &name,
        "--key-file",
        kit::s(&key),
        "--front-end",
        "vhost-user",
    ])
    .expect("ucrypt open --front-end vhost-user");
    let opened = Opened(name.clone());
    // NAME: STABLE -> SOCKET (vhost-user)
    let sock = out
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|l| l.split_once(" -> "))
        .and_then(|(_, r)| r.strip_suffix(" (vhost-user)"))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no socket in open's output: {out}"));

    // Beside it, `ucrypt vhost --control` serves a second volume, resized through its
    // control socket.
    let (_tmp2, _, key2, img2) = volume("vhost-resize-standalone", 8 << 20);
    let (sock2, ctl) = (tmp.0.join("standalone.sock"), tmp.0.join("control.sock"));
    let extra = ["--serial", "vhost-standalone", "--control", kit::s(&ctl)];
    let mut standalone = start_server_with(&img2, &key2, &sock2, &extra);

    let guest_done = Arc::new(AtomicBool::new(false));
    let host_side = {
        let resizes = vec![
            (img.clone(), vec!["resize".to_string(), name.clone()]),
            (
                img2.clone(),
                ["resize", kit::s(&img2), "--control", kit::s(&ctl)]
                    .map(String::from)
                    .to_vec(),
            ),
        ];
        let (share, done) = (share.clone(), guest_done.clone());
        std::thread::spawn(move || resize_when_ready(&share, &resizes, GROW_BYTES, &done))
    };
    let mut run = vm::VmRun::new(RESIZE);
    run.vhosts.push(sock);
    run.vhosts.push(sock2);
    run.share = Some(share);
    run.silence_max_s = Some(700);
    run.timeout_s = 900;
    let out = run.run(&tmp.0);
    guest_done.store(true, Ordering::Release);
    let resized = host_side.join().expect("the host's resize thread");
    drop(opened);
    let _ = standalone.kill();
    let _ = standalone.wait();

    let size = |tag: &str| -> u64 {
        out.output
            .lines()
            .find_map(|l| l.strip_prefix(tag))
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_else(|| panic!("no {tag} in the guest's output (status {})", out.status))
            .parse()
            .unwrap()
    };
    resized.unwrap_or_else(|e| panic!("resize: {e}"));
    let (before, after) = (size("SIZE-BEFORE "), size("SIZE-AFTER "));
    println!("guest's /sys/block/vda/size: {before} -> {after} sectors");
    assert_eq!(before, (8 << 20) / 512);
    assert_eq!(
        after,
        before + GROW_BYTES / 512,
        "the guest did not see the resize"
    );
    let (before, after) = (
        size("STANDALONE-SIZE-BEFORE "),
        size("STANDALONE-SIZE-AFTER "),
    );
    println!("ucrypt vhost --control: the guest's size {before} -> {after} sectors");
    assert_eq!(
        after,
        before + GROW_BYTES / 512,
        "the guest did not see the resize through ucrypt vhost --control"
    );
    let last_blocks = out.output.matches("LAST-BLOCK-READ").count();
    assert_eq!(last_blocks, 2, "the new last blocks of both disks");
    assert_eq!(out.status, 0);
}

/// One request line on a control socket; the answer line.
fn control(sock: &Path, line: &str) -> String {
    use std::io::Write;
    let mut s = std::os::unix::net::UnixStream::connect(sock).expect("connect to --control");
    s.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).unwrap();
    answer
}

/// `ucrypt resize VOLUME --control PATH` with `args` besides: (exit code, stderr).
fn resize_by_control(volume: &Path, ctl: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ucrypt"))
        .args(["resize", kit::s(volume), "--control", kit::s(ctl)])
        .args(args)
        .output()
        .expect("run ucrypt resize");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), err)
}

/// `ucrypt vhost --control` without a VMM: `ucrypt resize VOLUME --control PATH` grows the
/// volume to its grown image (nobody to tell: the resize stands) and `status` reports the new
/// size; `--device-size` shrinks it; a volume the process does not serve is refused, and so
/// are a request of the open daemon's life cycle and the resize of an authenticated volume.
#[test]
fn a_standalone_vhost_resizes_through_its_control_socket() {
    let (tmp, _, key, img) = volume("vhost-control-resize", 8 << 20);
    let (sock, ctl) = (tmp.0.join("vhost.sock"), tmp.0.join("control.sock"));
    let mut server = start_server_with(&img, &key, &sock, &["--control", kit::s(&ctl)]);
    let size_sectors = || {
        let st = control(&ctl, r#"{"v":1,"cmd":"status"}"#);
        let v: serde_json::Value = serde_json::from_str(&st).expect("status JSON");
        v["status"]["volume"]["size_sectors"]
            .as_u64()
            .unwrap_or_else(|| panic!("{st}"))
    };
    let before = size_sectors();
    assert_eq!(before, (8 << 20) / 512);
    let len = std::fs::metadata(&img).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .and_then(|f| f.set_len(len + (4 << 20)))
        .unwrap();
    let (code, err) = resize_by_control(&img, &ctl, &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains(&format!("{} sectors", (12 << 20) / 512)),
        "{err}"
    );
    assert_eq!(size_sectors(), (12 << 20) / 512, "status after the resize");
    let (code, err) = resize_by_control(&img, &ctl, &["--device-size", "10M"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        size_sectors(),
        (10 << 20) / 512,
        "status after --device-size"
    );

    let other = tmp.0.join("other.img");
    std::fs::write(&other, b"").unwrap();
    let (code, err) = resize_by_control(&other, &ctl, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not "), "{err}");
    let cl = control(&ctl, r#"{"v":1,"cmd":"suspend"}"#);
    assert!(cl.contains("belongs to `ucrypt open`'s daemon"), "{cl}");
    assert_eq!(size_sectors(), (10 << 20) / 512);

    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let status = server.wait().expect("wait for ucrypt vhost");
    assert!(status.success(), "ucrypt vhost exited with {status}");

    // An authenticated volume is refused, as the open daemon refuses it.
    let auth = tmp.0.join("auth.img");
    std::fs::File::create(&auth)
        .and_then(|f| f.set_len(32 << 20))
        .unwrap();
    ucrypt(&[
        "format",
        "-q",
        "--integrity-no-wipe",
        "--cipher",
        "aes-xts-random",
        "--integrity",
        "hmac-sha256",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        kit::s(&key),
        kit::s(&auth),
    ])
    .expect("ucrypt format --integrity");
    let (sock, ctl) = (tmp.0.join("auth.sock"), tmp.0.join("auth-control.sock"));
    let mut server = start_server_with(&auth, &key, &sock, &["--control", kit::s(&ctl)]);
    let (code, err) = resize_by_control(&auth, &ctl, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("authenticated encryption"), "{err}");
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    assert!(server.wait().expect("wait for ucrypt vhost").success());
}
