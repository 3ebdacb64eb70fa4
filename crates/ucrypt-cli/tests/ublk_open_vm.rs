//! A volume's life cycle with ublk, in a VM (this host's kernel has no ublk_drv): boots Debian
//! trixie's stock kernel under qemu (TCG), then as a user would type it: `ucrypt open` of a
//! LUKS2 volume (made by `ucrypt format` on the host) picks ublk, `/dev/ucrypt/NAME` points at
//! `/dev/ublkbN`; mkfs.ext4 on it, mount, copy a tree, umount, `ucrypt close` (device and link
//! gone), `ucrypt open` again (idle, the daemon has one thread per CPU and one more, and no
//! io_uring worker: its control commands were issued from threads that ended), fsck clean and
//! the tree identical, `ucrypt close`. Then a
//! volume in a file grown while its ext4 is mounted (FUSE + loop, where the kernel, unlike this
//! container, lets `resize2fs` grow a mounted filesystem): `truncate`, `ucrypt resize`, online
//! `resize2fs`, the filesystem bigger and clean. Last, a key rotated online through `ublk
//! --control`: fio-free, dd writes a pattern through `/dev/ublkbN`, a reader compares it
//! in a loop while `ucrypt reencrypt --control` rotates the key (its hotzones in a worker
//! process), then the data reads back, `ucrypt resize --control` is refused (libublk has no
//! size update), the ciphertext changed, the header finished, and the export gives the
//! pattern.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::process::Command;

const SCRIPT: &str = r#"
set -e
modprobe ublk_drv
mkdir -p /run /m
U=/mnt/host/ucrypt
$U open /dev/vda data --key-file /mnt/host/pass > /tmp/open.out 2>&1 || { cat /tmp/open.out; exit 11; }
cat /tmp/open.out
dev=$(readlink -f /dev/ucrypt/data)
echo "device: $dev"
case "$dev" in /dev/ublkb*) echo "FRONT-END-UBLK";; esac
$U status data | sed -n 1p
mkfs.ext4 -q -F /dev/ucrypt/data
mount /dev/ucrypt/data /m
mkdir -p /m/tree/a/b
i=0; while [ $i -lt 20 ]; do dd if=/dev/urandom of=/m/tree/a/f$i bs=4k count=$((i + 1)) 2>/dev/null; i=$((i + 1)); done
echo hello-from-open > /m/tree/a/b/hello
(cd /m/tree && find . -type f | sort | xargs sha256sum) > /tmp/sums
umount /m
$U close data && echo "CLOSED"
[ ! -e /dev/ucrypt/data ] && echo "LINK-REMOVED"
[ ! -e "$dev" ] && echo "DEVICE-REMOVED"
$U open /dev/vda data --key-file /mnt/host/pass > /tmp/open2.out 2>&1 || { cat /tmp/open2.out; exit 12; }
# Idle: the engine's workers end after 5 s without work; 30 s at most under emulation.
pid=$($U status data | sed -n 's/^  pid: *//p')
i=0; while [ $i -lt 30 ]; do
  n=$(ls /proc/$pid/task | wc -l); [ "$n" -le $(( $(nproc) + 1 )) ] && break
  sleep 1; i=$((i + 1))
done
names=$(cat /proc/$pid/task/*/comm | sort | tr '\n' ' ')
echo "idle daemon threads after $i s ($(nproc) CPUs): $n: $names"
[ "$n" -le $(( $(nproc) + 1 )) ] && case "$names" in *iou-wrk*) ;; *) echo "UBLK-THREADS-OK";; esac
e2fsck -f -n /dev/ucrypt/data && echo "FSCK-CLEAN"
mount -o ro /dev/ucrypt/data /m
(cd /m/tree && sha256sum -c /tmp/sums > /dev/null) && echo "TREE-IDENTICAL"
umount /m
$U close data && echo "CLOSED-AGAIN"
echo "UBLK-OPEN-VM-OK"
cp /mnt/host/small.img /tmp/small.img
$U open /tmp/small.img grow --front-end loop --key-file /mnt/host/pass > /tmp/open3.out 2>&1 || { cat /tmp/open3.out; exit 13; }
cat /tmp/open3.out
mkfs.ext4 -q -F /dev/ucrypt/grow
mount /dev/ucrypt/grow /m
echo kept > /m/kept
before=$(df -k /m | awk 'NR==2 {print $2}')
truncate -s 80M /tmp/small.img
$U resize grow
resize2fs /dev/ucrypt/grow && echo "ONLINE-RESIZE2FS-OK"
after=$(df -k /m | awk 'NR==2 {print $2}')
echo "ext4 size: $before KiB -> $after KiB"
[ "$after" -gt $((before + 20000)) ] && echo "FILESYSTEM-GREW"
grep -q kept /m/kept && echo "DATA-KEPT"
umount /m
e2fsck -f -n /dev/ucrypt/grow && echo "FSCK-CLEAN-AFTER-GROW"
$U close grow && echo "RESIZE-VM-OK"
cp /mnt/host/rot.img /tmp/rot.img
$U ublk /tmp/rot.img --key-file /mnt/host/pass --control /run/rot.sock > /tmp/ublk.out 2>&1 &
UB=$!
dev=
i=0; while [ $i -lt 150 ]; do
  dev=$(grep -o '/dev/ublkb[0-9]*' /tmp/ublk.out | head -n 1)
  [ -n "$dev" ] && [ -b "$dev" ] && [ -S /run/rot.sock ] && break
  sleep 0.2; i=$((i + 1))
done
[ -n "$dev" ] || { cat /tmp/ublk.out; exit 14; }
dd if=/dev/urandom of=/tmp/pattern bs=1M count=32 2>/dev/null
dd if=/tmp/pattern of=$dev bs=1M oflag=direct conv=fsync 2>/dev/null
before=$(dd if=/tmp/rot.img bs=1M skip=16 count=32 2>/dev/null | sha256sum)
( while [ ! -e /tmp/rot.done ]; do
    dd if=$dev bs=1M count=32 iflag=direct 2>/dev/null | cmp -s - /tmp/pattern || echo "READ-DIFFERED"
  done ) > /tmp/reader.out &
RD=$!
$U reencrypt /tmp/rot.img --control /run/rot.sock --batch-mode --key-file /mnt/host/pass \
  --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --hotzone-size 1M > /tmp/re.out 2>&1 \
  && echo "UBLK-CONTROL-REENCRYPT-OK" || cat /tmp/re.out
touch /tmp/rot.done; wait $RD
grep -q READ-DIFFERED /tmp/reader.out || echo "READS-DURING-ROTATION-OK"
dd if=$dev bs=1M count=32 iflag=direct 2>/dev/null | cmp -s - /tmp/pattern && echo "UBLK-DATA-AFTER-ROTATION"
rc=0; $U resize /tmp/rot.img --control /run/rot.sock > /tmp/rs.out 2>&1 || rc=$?
if [ $rc = 1 ] && grep -q "libublk has no size update" /tmp/rs.out; then
  echo "UBLK-CONTROL-RESIZE-REFUSED"
else
  echo "resize --control exited $rc"; cat /tmp/rs.out
fi
kill $UB; wait $UB || echo "ublk exited $?"
after=$(dd if=/tmp/rot.img bs=1M skip=16 count=32 2>/dev/null | sha256sum)
[ "$before" != "$after" ] && echo "CIPHERTEXT-REWRITTEN"
$U luksDump /tmp/rot.img | grep -q "online-reencrypt" || echo "HEADER-FINISHED"
$U export /tmp/rot.img /tmp/plain.img --key-file /mnt/host/pass && cmp -s /tmp/plain.img /tmp/pattern && echo "ROTATED-VOLUME-EXPORTS-THE-DATA"
"#;

#[test]
fn open_close_reopen_with_ublk_keeps_the_filesystem() {
    let Some((kernel, modroot)) = vm::require_trixie_vm("ublk_open_vm") else {
        return;
    };
    let tmp = kit::TempDir::new("ublk-open-vm");
    let share = tmp.0.join("share");
    std::fs::create_dir_all(&share).unwrap();
    let ucrypt = env!("CARGO_BIN_EXE_ucrypt");
    std::fs::copy(ucrypt, share.join("ucrypt")).unwrap();
    std::fs::write(share.join("pass"), "open-in-the-vm").unwrap();
    // The volume ublk serves from the VM's disk; the one grown in the VM and the one rotated
    // online through `ublk --control` (32 MiB of data after LUKS2's 16 MiB header each).
    let img = tmp.0.join("vol.img");
    let (small, rot) = (share.join("small.img"), share.join("rot.img"));
    for (path, bytes) in [(&img, 64u64 << 20), (&small, 48 << 20), (&rot, 48 << 20)] {
        std::fs::File::create(path).unwrap().set_len(bytes).unwrap();
        let out = Command::new(ucrypt)
            .args(["format", "-q", "--type", "luks2", "--pbkdf", "pbkdf2"])
            .args(["--pbkdf-force-iterations", "1000"])
            .arg(path)
            .arg(share.join("pass"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "format {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let mut run = vm::VmRun::new(SCRIPT);
    run.disk(&img, false);
    run.share = Some(share);
    run.kernel = Some(kernel);
    run.modroot = Some(modroot);
    let out = run.run(&tmp.0);
    for marker in [
        "FRONT-END-UBLK",
        "CLOSED",
        "LINK-REMOVED",
        "DEVICE-REMOVED",
        "UBLK-THREADS-OK",
        "FSCK-CLEAN",
        "TREE-IDENTICAL",
        "CLOSED-AGAIN",
        "UBLK-OPEN-VM-OK",
        "ONLINE-RESIZE2FS-OK",
        "FILESYSTEM-GREW",
        "DATA-KEPT",
        "FSCK-CLEAN-AFTER-GROW",
        "RESIZE-VM-OK",
        "UBLK-CONTROL-REENCRYPT-OK",
        "READS-DURING-ROTATION-OK",
        "UBLK-DATA-AFTER-ROTATION",
        "UBLK-CONTROL-RESIZE-REFUSED",
        "CIPHERTEXT-REWRITTEN",
        "HEADER-FINISHED",
        "ROTATED-VOLUME-EXPORTS-THE-DATA",
    ] {
        assert!(
            out.output.contains(marker),
            "missing {marker} in VM output (status {}):\n{}",
            out.status,
            out.output
        );
    }
    assert_eq!(out.status, 0);
}
