//! `ucrypt vhost` serving a LUKS2 volume to a qemu guest (TCG) as a vhost-user-blk disk with two
//! queues. First boot: the raw image is also attached read-only beside the vhost disk; the guest checks the device's shape (queues, 4 KiB logical blocks, serial, write
//! cache), writes and reads back a pattern with O_DIRECT on both vCPUs, zeroes a range, makes an
//! ext4 with files and fscks it, then opens the raw image with its own dm-crypt and compares it
//! with the vhost disk byte for byte (the disks are told apart by serial: virtio's probe order
//! is not the command line's). Second boot (the same `ucrypt vhost` process, which must
//! accept the new VMM): the files are still there. Finally SIGTERM must end the server with
//! status 0, and `ucrypt export` of the image must equal what the guest read.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

fn ucrypt(args: &[&str]) -> Result<String, String> {
    vm::host(env!("CARGO_BIN_EXE_ucrypt"), args)
}

/// `ucrypt vhost` on `img` at `sock`, once it says it is ready.
fn start_server(img: &Path, key: &Path, sock: &Path) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ucrypt"))
        .args(["vhost", kit::s(img), "--key-file", kit::s(key)])
        .args(["--socket", kit::s(sock), "--queues", "2"])
        .args(["--serial", "vhost-vm-serial"])
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
    let tmp = kit::TempDir::new("vhost-vm");
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
        data_bytes: DATA_BYTES,
    };
    image
        .format(env!("CARGO_BIN_EXE_ucrypt"), &img, &key)
        .expect("ucrypt format");
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
