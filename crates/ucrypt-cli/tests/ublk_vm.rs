//! `ucrypt ublk` in a VM (this host's kernel has no ublk_drv): boots Debian trixie's stock
//! kernel under qemu (TCG), serves a raw aes-xts-plain64 volume on /dev/vda as /dev/ublkbN,
//! makes an ext4 filesystem on it, writes files, fscks, stops ucrypt with SIGTERM (the device
//! must disappear and ucrypt exit 0), then opens the same ciphertext with kernel dm-crypt and
//! checks the filesystem and the files: what ucrypt wrote is exactly what dm-crypt reads.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

const SCRIPT: &str = r#"
set -e
modprobe ublk_drv
/mnt/host/ucrypt ublk /dev/vda --cipher aes-xts-plain64 --volume-key-file /mnt/host/key --sector-size 4096 > /tmp/ublk.out 2>&1 &
pid=$!
for i in $(seq 1 150); do grep -q '^ready: ' /tmp/ublk.out && break; sleep 0.2; done
cat /tmp/ublk.out
dev=$(sed -n 's/^ready: //p' /tmp/ublk.out)
[ -b "$dev" ] || { echo "no ublk device"; exit 10; }
q=/sys/block/${dev#/dev/}/queue
echo "limits: lbs=$(cat $q/logical_block_size) queues=$(ls /sys/block/${dev#/dev/}/mq | wc -l) cpus=$(nproc) fua=$(cat $q/fua) cache=$(cat $q/write_cache) discard_max=$(cat $q/discard_max_bytes) wz_max=$(cat $q/write_zeroes_max_bytes)"
[ "$(cat $q/logical_block_size)" = 4096 ] && echo "LBS-IS-SECTOR-SIZE"
[ "$(ls /sys/block/${dev#/dev/}/mq | wc -l)" = "$(nproc)" ] && echo "QUEUE-PER-CPU"
[ "$(cat $q/fua)" = 1 ] && [ "$(cat $q/write_cache)" = "write back" ] && echo "FLUSH-FUA"
# util-linux blkdiscard by full path: busybox's applet (no -z) shadows PATH in busybox sh.
dd if=/dev/zero of=/tmp/zero bs=65536 count=16 2>/dev/null
dd if=/dev/urandom of="$dev" bs=65536 count=16 oflag=direct 2>/dev/null
/usr/local/sbin/blkdiscard -z -o 0 -l 1048576 "$dev"
dd if="$dev" bs=65536 count=16 iflag=direct 2>/dev/null | cmp -s - /tmp/zero && echo "WRITE-ZEROES-READ-ZERO"
/usr/local/sbin/blkdiscard "$dev" && echo "DISCARD-OK"
mkfs.ext4 -q -F "$dev"
mkdir -p /m && mount "$dev" /m
echo hello-from-ublk > /m/hello
dd if=/dev/urandom of=/m/data bs=64k count=32 2>/dev/null
sha256sum /m/data | cut -c1-64 > /tmp/sum
umount /m
e2fsck -f -n "$dev"
kill -TERM $pid
wait $pid && echo "UCRYPT-EXIT-0"
[ ! -e "$dev" ] && echo "DEVICE-REMOVED"
key=$(od -An -tx1 -v /mnt/host/key | tr -d ' \n')
sz=$(blockdev --getsz /dev/vda)
echo "0 $sz crypt aes-xts-plain64 $key 0 /dev/vda 0 1 sector_size:4096" | dmsetup create dmc
dmsetup mknodes
e2fsck -f -n /dev/mapper/dmc
mount -o ro /dev/mapper/dmc /m
grep -q hello-from-ublk /m/hello && echo "DMCRYPT-READS-FILE"
sha256sum /m/data | cut -c1-64 | cmp - /tmp/sum && echo "DMCRYPT-READS-DATA"
umount /m
dmsetup remove dmc
echo "UBLK-VM-OK"
"#;

#[test]
fn ublk_device_filesystem_read_back_by_kernel_dm_crypt() {
    let Some((kernel, modroot)) = vm::require_trixie_vm("ublk_vm") else {
        return;
    };
    let tmp = kit::TempDir::new("ublk-vm");
    let share = tmp.0.join("share");
    std::fs::create_dir_all(&share).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_ucrypt"), share.join("ucrypt")).unwrap();
    let mut key = [0u8; 64];
    kit::SplitMix(kit::seed()).fill(&mut key);
    std::fs::write(share.join("key"), key).unwrap();
    let img = tmp.0.join("vol.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();

    let mut run = vm::VmRun::new(SCRIPT);
    run.disk(&img, false);
    run.share = Some(share);
    run.kernel = Some(kernel);
    run.modroot = Some(modroot);
    let out = run.run(&tmp.0);
    for marker in [
        "LBS-IS-SECTOR-SIZE",
        "QUEUE-PER-CPU",
        "FLUSH-FUA",
        "WRITE-ZEROES-READ-ZERO",
        "DISCARD-OK",
        "UCRYPT-EXIT-0",
        "DEVICE-REMOVED",
        "DMCRYPT-READS-FILE",
        "DMCRYPT-READS-DATA",
        "UBLK-VM-OK",
    ] {
        assert!(
            out.output.contains(marker),
            "missing {marker} in VM output (status {})",
            out.status
        );
    }
    assert_eq!(out.status, 0);
}
