//! `ucrypt ublk` in a VM booting Debian trixie's kernel (this machine's kernel has no ublk_drv):
//! the host-built binary serves a raw aes-xts-plain64 (4096-byte sectors) volume on /dev/vda as
//! /dev/ublkbN; the guest checks the queue limits (logical block 4096, one queue per CPU, write
//! cache + FUA, discard and write-zeroes), zeroes a range with `blkdiscard -z`, makes ext4,
//! copies a tree, fscks, reads it back; SIGTERM removes the device and the process exits 0.
//! Then the guest's own dm-crypt maps the same ciphertext and fscks it and the host decrypts
//! it with the sector layer, fscks it and reads the tree back with debugfs.

#[path = "../../../tests/vm/harness.rs"]
mod vm;

use sha2::Digest;
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};

const VOL_BYTES: u64 = 24 << 20;
const DATA_OFFSET: u64 = 1 << 20;

#[test]
fn ublk_device_in_vm_mkfs_fsck_readback() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let (kernel, modroot) = match vm::trixie_kernel() {
        Ok(k) => k,
        Err(e) if vm::under_ci() => panic!("CI is set but the trixie kernel is unavailable: {e}"),
        Err(e) => {
            println!("SKIPPED: no kernel with ublk_drv: {e}");
            return;
        }
    };
    let seed = vm::seed();
    let mut rng = vm::SplitMix(seed);
    let tmp = vm::TempDir::new("ublk");
    let dir = &tmp.0;

    std::fs::copy(env!("CARGO_BIN_EXE_ucrypt"), dir.join("ucrypt")).expect("copy ucrypt binary");
    let mut key = vec![0u8; 64];
    rng.fill(&mut key);
    std::fs::write(dir.join("key"), &key).expect("key");
    let rows: &[(&str, usize)] = &[
        ("hello", 6),
        ("a/b/unaligned", 12_345),
        ("a/big", 1 << 20),
        ("a/odd", (128 << 10) + 7),
    ];
    let mut tree = Vec::new();
    let mut manifest = String::new();
    for &(rel, n) in rows {
        let mut v = vec![0u8; n];
        rng.fill(&mut v);
        let p = dir.join("src").join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, &v).expect("tree file");
        manifest.push_str(&format!("{}  {rel}\n", vm::hex(&sha2::Sha256::digest(&v))));
        tree.push((rel, v));
    }
    std::fs::write(dir.join("manifest"), manifest).expect("manifest");
    let img = dir.join("vol.img");
    std::fs::File::create(&img)
        .expect("img")
        .set_len(VOL_BYTES)
        .expect("size");

    let data_sectors = (VOL_BYTES - DATA_OFFSET) / 512;
    let script = format!(
        r#"set -u
fail() {{ echo "UBLK-FAIL: $*"; cat /tmp/err 2>/dev/null; exit 1; }}
modprobe ublk_drv || fail "no ublk_drv"
/mnt/host/ucrypt ublk /dev/vda --cipher aes-xts-plain64 --volume-key-file /mnt/host/key --sector-size 4096 --offset {off} >/tmp/out 2>/tmp/err &
pid=$!
i=0; while [ ! -s /tmp/out ] && [ $i -lt 600 ] && kill -0 $pid 2>/dev/null; do sleep 0.1; i=$((i+1)); done
dev=$(head -1 /tmp/out)
echo "UBLK-DEV $dev"
[ -b "$dev" ] || fail "no block device"
q=/sys/block/${{dev#/dev/}}/queue
echo "limits: lbs=$(cat $q/logical_block_size) queues=$(ls /sys/block/${{dev#/dev/}}/mq | wc -l) cpus=$(nproc) fua=$(cat $q/fua) cache=$(cat $q/write_cache) discard_max=$(cat $q/discard_max_bytes) wz_max=$(cat $q/write_zeroes_max_bytes)"
[ "$(cat $q/logical_block_size)" = 4096 ] || fail "logical block size"
[ "$(ls /sys/block/${{dev#/dev/}}/mq | wc -l)" = "$(nproc)" ] || fail "not one queue per CPU"
[ "$(cat $q/fua)" = 1 ] || fail "no FUA"
[ "$(cat $q/write_cache)" = "write back" ] || fail "no volatile write cache (flush)"
[ "$(cat $q/discard_max_bytes)" != 0 ] || fail "no discard"
[ "$(cat $q/write_zeroes_max_bytes)" != 0 ] || fail "no write-zeroes"
dd if=/dev/zero of=/tmp/zero bs=65536 count=16 2>/dev/null
dd if=/dev/urandom of=$dev bs=65536 count=16 oflag=direct 2>/dev/null || fail "write"
dd if=$dev bs=65536 count=16 iflag=direct 2>/dev/null | cmp -s - /tmp/zero && fail "random data reads as zeroes"
/usr/local/sbin/blkdiscard -z -o 0 -l 1048576 $dev || fail "blkdiscard -z"
dd if=$dev bs=65536 count=16 iflag=direct 2>/dev/null | cmp -s - /tmp/zero || fail "write-zeroes range does not read as zeroes"
echo UBLK-WRITE-ZEROES-OK
/usr/local/sbin/blkdiscard $dev || fail "blkdiscard"
echo UBLK-DISCARD-OK
mkdir -p /mnt/u
mkfs.ext4 -q $dev || fail mkfs
mount $dev /mnt/u || fail mount
cp -a /mnt/host/src/. /mnt/u/ || fail cp
sync
umount /mnt/u || fail umount
e2fsck -f -n $dev || fail e2fsck
mount -o ro $dev /mnt/u || fail "mount ro"
(cd /mnt/u && sha256sum -c /mnt/host/manifest) || fail "read back"
umount /mnt/u
echo UBLK-FS-OK
kill -TERM $pid
wait $pid; rc=$?
echo "UBLK-EXIT rc=$rc"
cat /tmp/err
[ $rc = 0 ] || fail "ucrypt ublk exit status $rc"
[ -e $dev ] && fail "$dev still exists after SIGTERM"
echo UBLK-REMOVED-OK
dmsetup create x --readonly --table "0 {sectors} crypt aes-xts-plain64 {hexkey} 0 /dev/vda {off512} 1 sector_size:4096" && dmsetup mknodes x || fail "dm-crypt map"
e2fsck -f -n /dev/mapper/x || fail "dm-crypt view of the ublk-made ext4 is not clean"
mount -o ro /dev/mapper/x /mnt/u && (cd /mnt/u && sha256sum -c /mnt/host/manifest) || fail "dm-crypt read back"
umount /mnt/u; dmsetup remove x
echo UBLK-DMCRYPT-OK
"#,
        off = DATA_OFFSET,
        off512 = DATA_OFFSET / 512,
        sectors = data_sectors,
        hexkey = vm::hex(&key),
    );
    let mut run = vm::VmRun::new(script);
    run.share = Some(dir.clone());
    run.kernel = Some(kernel);
    run.modroot = Some(modroot);
    run.disk(&img, false);
    let out = run.run(dir);
    println!(
        "VM run (trixie kernel, ublk) took {:.1} s",
        out.elapsed.as_secs_f64()
    );
    assert_eq!(out.status, 0, "VM script failed (exit {})", out.status);
    for marker in [
        "UBLK-WRITE-ZEROES-OK",
        "UBLK-DISCARD-OK",
        "UBLK-FS-OK",
        "UBLK-REMOVED-OK",
        "UBLK-DMCRYPT-OK",
    ] {
        assert!(
            out.output.contains(marker),
            "missing {marker} in the VM output"
        );
    }

    // Host: the ciphertext the ublk server wrote decrypts to a clean ext4 holding the tree.
    let mut data = std::fs::read(&img)
        .expect("read image")
        .split_off(DATA_OFFSET as usize);
    let spec: CipherSpec = "aes-xts-plain64".parse().expect("spec");
    SectorCipher::new(spec, &key, Geometry::new(SectorSize::S4096))
        .expect("cipher")
        .decrypt(0, &mut data)
        .expect("decrypt");
    let plain = dir.join("plain.img");
    std::fs::write(&plain, &data).expect("write plain");
    let p = plain.to_str().expect("utf-8");
    let fsck = std::process::Command::new("fsck.ext4")
        .args(["-f", "-n", p])
        .output()
        .expect("fsck.ext4");
    assert!(
        fsck.status.success(),
        "host fsck of the decrypted image: {}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    let rdump = dir.join("rdump");
    std::fs::create_dir_all(&rdump).expect("mkdir");
    let st = std::process::Command::new("debugfs")
        .args(["-R", &format!("rdump / {}", rdump.display()), p])
        .output()
        .expect("debugfs");
    assert!(st.status.success(), "debugfs rdump failed");
    for (rel, want) in &tree {
        let got = std::fs::read(rdump.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert!(got == *want, "{rel} differs (seed {seed})");
    }
}
