//! `open --type plain --shared`: several plain mappings of one volume, as cryptsetup's
//! compat-test maps two areas of one device (`create A DEV --offset 0 --size 256`, then
//! `create B DEV --offset 512 --size 256` fails, and passes with `--shared`). The command-line
//! checks are compared with cryptsetup 2.6.1's (`--test-args`: `--shared` only on a plain
//! `open`); the mappings are ucrypt's (cryptsetup's need device-mapper, which its own
//! compat-test exercises): a second mapping without `--shared` is refused (exit 5, as
//! cryptsetup's EBUSY), with it both serve, each its own area, and one that is not shared
//! still finds the volume in use while a shared one lives.
//!
//! The mappings need root, /dev/fuse and /dev/loop-control (FUSE + loop): SKIPPED otherwise.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::Path;

use cli_common::*;

/// 512-byte sectors of each mapping (compat-test's `--size 256`).
const AREA_SECTORS: u64 = 256;

#[test]
fn shared_is_taken_where_cryptsetup_takes_it() {
    if !have("cryptsetup") {
        println!("SKIPPED: needs cryptsetup");
        return;
    }
    let t = TempDir::new("shared-args");
    let img = t.sparse("v.img", 4 << 20);
    let img = s(&img);
    let cases: &[(&str, Vec<&str>)] = &[
        (
            "open --type plain",
            vec!["open", img, "n", "--type", "plain", "--shared"],
        ),
        (
            "open --type luks1",
            vec!["open", img, "n", "--type", "luks1", "--shared"],
        ),
        ("open, no type", vec!["open", img, "n", "--shared"]),
        ("close", vec!["close", "n", "--shared"]),
        ("luksDump", vec!["luksDump", img, "--shared"]),
    ];
    for (what, args) in cases {
        let codes: Vec<Option<i32>> = ["cryptsetup", UCRYPT]
            .iter()
            .map(|tool| {
                let mut a = args.clone();
                a.push("--test-args");
                run(tool, &a).status.code()
            })
            .collect();
        assert_eq!(
            codes[0], codes[1],
            "{what}: cryptsetup's exit code, then ucrypt's"
        );
    }
    let o = run(
        UCRYPT,
        &[
            "open",
            img,
            "n",
            "--type",
            "luks2",
            "--shared",
            "--test-args",
        ],
    );
    assert_eq!(
        stderr_line(&o),
        "Option --shared is allowed only for open of plain device."
    );
}

fn stderr_line(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).trim().to_string()
}

/// `ucrypt open VOLUME NAME` in plain mode over the area at `offset` sectors; its exit code
/// and output.
fn open_area(img: &Path, key: &Path, name: &str, offset: u64, extra: &[&str]) -> (i32, String) {
    let offset = offset.to_string();
    let size = AREA_SECTORS.to_string();
    let mut a = vec![
        "open",
        s(img),
        name,
        "--type",
        "plain",
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
        "--key-file",
        s(key),
        "--offset",
        &offset,
        "--size",
        &size,
        "--front-end",
        "loop",
    ];
    a.extend(extra);
    let o = run(UCRYPT, &a);
    (o.status.code().unwrap_or(-1), text(&o))
}

/// The plaintext of the area at `offset` sectors, read offline (`ucrypt export`).
fn export_area(t: &TempDir, img: &Path, key: &Path, offset: u64) -> Vec<u8> {
    let out = t.path(&format!("area-{offset}"));
    let offset = offset.to_string();
    let size = AREA_SECTORS.to_string();
    ok(
        UCRYPT,
        &[
            "export",
            s(img),
            s(&out),
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "512",
            "--volume-key-file",
            s(key),
            "--offset",
            &offset,
            "--size",
            &size,
        ],
    );
    std::fs::read(&out).unwrap()
}

fn write_device(name: &str, data: &[u8]) {
    let dev = format!("/dev/ucrypt/{name}");
    std::fs::write(&dev, data).unwrap_or_else(|e| panic!("writing {dev}: {e}"));
    ok("sync", &[]);
}

#[test]
fn shared_plain_mappings_of_one_volume() {
    if let Some(why) = missing_root_rig(&["losetup", "sync"]) {
        println!("SKIPPED: {why}");
        return;
    }
    let t = TempDir::new("shared");
    let img = t.path("v.img");
    std::fs::write(&img, kit::SplitMix(0x5a).bytes(1 << 20)).unwrap();
    let key = t.file("key", kit::SplitMix(0x5b).bytes(64));
    let (a, b) = (
        format!("shared-a-{}", std::process::id()),
        format!("shared-b-{}", std::process::id()),
    );
    let close = |n: &str| {
        let _ = run(UCRYPT, &["close", n]);
    };
    // compat-test: the second area without --shared is busy; with it, mapped.
    let (code, out) = open_area(&img, &key, &a, 0, &[]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = open_area(&img, &key, &b, 512, &[]);
    assert_eq!(code, 5, "a second mapping without --shared: {out}");
    let (code, out) = open_area(&img, &key, &b, 512, &["--shared"]);
    if code != 0 {
        close(&a);
        panic!("--shared beside a mapping: {out}");
    }
    // Each mapping writes its own area, and both are read back offline as written.
    let area = (AREA_SECTORS * 512) as usize;
    let (pa, pb) = (kit::SplitMix(1).bytes(area), kit::SplitMix(2).bytes(area));
    write_device(&a, &pa);
    write_device(&b, &pb);
    // While the shared mapping lives, a mapping that is not shared finds the volume in use,
    // and a verb that rewrites the volume refuses it.
    close(&a);
    let (code, out) = open_area(&img, &key, &a, 0, &[]);
    assert_eq!(code, 5, "not shared, beside a shared mapping: {out}");
    let (code, out) = open_area(&img, &key, &a, 0, &["--shared"]);
    assert_eq!(code, 0, "two shared mappings: {out}");
    close(&a);
    close(&b);
    assert_eq!(export_area(&t, &img, &key, 0), pa);
    assert_eq!(export_area(&t, &img, &key, 512), pb);
    // Closed: a mapping that is not shared is free to open.
    let (code, out) = open_area(&img, &key, &a, 0, &[]);
    assert_eq!(code, 0, "{out}");
    close(&a);
}

/// In the VM (dm-crypt and ublk run there): ucrypt's mappings beside the kernel's. A plain
/// dm-crypt mapping holds the device, so a ucrypt mapping that is not shared is refused (exit
/// 5, as cryptsetup refuses it) and one with `--shared` maps beside it; each writes its own
/// area, and the other tool reads each area back. The other way round, a device ucrypt serves
/// read-write is refused to `cryptsetup open` and to `mkfs` (the kernel's exclusive open), and
/// a mounted device is refused to ucrypt.
const VM_SCRIPT: &str = r#"
set -e
modprobe ublk_drv
mkdir -p /run /m
U=/mnt/host/ucrypt
P="--type plain --cipher aes-xts-plain64 --key-size 256 --key-file /mnt/host/key"
cryptsetup open $P --offset 0 --size 256 /dev/vda A
set +e
$U open /dev/vda B $P --offset 512 --size 256 > /tmp/o 2>&1; echo "UCRYPT-BESIDE-DM-EXIT $?"
head -n 2 /tmp/o
set -e
$U open /dev/vda B $P --offset 512 --size 256 --shared
echo "UCRYPT-SHARED-BESIDE-DM-OK"
dd if=/mnt/host/pa of=/dev/mapper/A bs=512 count=256 oflag=direct 2>/dev/null
dd if=/mnt/host/pb of=/dev/ucrypt/B bs=512 count=256 oflag=direct 2>/dev/null
cryptsetup close A
$U close B
cryptsetup open $P --offset 512 --size 256 /dev/vda D
cmp /dev/mapper/D /mnt/host/pb && echo "DMCRYPT-READS-UCRYPT-AREA"
cryptsetup close D
$U open /dev/vda E $P --offset 0 --size 256
cmp /dev/ucrypt/E /mnt/host/pa && echo "UCRYPT-READS-DMCRYPT-AREA"
$U close E
$U open /dev/vdb C $P
set +e
cryptsetup open $P /dev/vdb F > /tmp/o 2>&1; echo "CRYPTSETUP-BESIDE-UCRYPT-EXIT $?"
head -n 2 /tmp/o
mkfs.ext4 -q -F /dev/vdb > /tmp/o 2>&1; echo "MKFS-BESIDE-UCRYPT-EXIT $?"
set -e
$U close C
cryptsetup open $P /dev/vdb F && echo "CRYPTSETUP-AFTER-CLOSE-OK"
cryptsetup close F
mkfs.ext4 -q -F /dev/vdc
mount /dev/vdc /m
set +e
$U open /dev/vdc G $P > /tmp/o 2>&1; echo "UCRYPT-ON-MOUNTED-EXIT $?"
head -n 2 /tmp/o
set -e
umount /m
echo "SHARED-VM-OK"
"#;

#[test]
fn mappings_beside_dm_crypt_in_the_vm() {
    let Some((kernel, modroot)) = kit::vm::require_trixie_vm("shared_plain (VM)") else {
        return;
    };
    let t = TempDir::new("shared-vm");
    let share = t.0.join("share");
    std::fs::create_dir_all(&share).unwrap();
    std::fs::copy(UCRYPT, share.join("ucrypt")).unwrap();
    std::fs::write(share.join("key"), kit::SplitMix(3).bytes(32)).unwrap();
    let area = (AREA_SECTORS * 512) as usize;
    std::fs::write(share.join("pa"), kit::SplitMix(4).bytes(area)).unwrap();
    std::fs::write(share.join("pb"), kit::SplitMix(5).bytes(area)).unwrap();
    let mut run = kit::vm::VmRun::new(VM_SCRIPT);
    for (name, bytes) in [
        ("a.img", 2u64 << 20),
        ("b.img", 2 << 20),
        ("c.img", 8 << 20),
    ] {
        run.disk(&t.sparse(name, bytes), false);
    }
    run.share = Some(share);
    run.kernel = Some(kernel);
    run.modroot = Some(modroot);
    let out = run.run(&t.0);
    let o = &out.output;
    assert_eq!(out.status, 0, "{o}");
    for marker in [
        "UCRYPT-BESIDE-DM-EXIT 5",
        "UCRYPT-SHARED-BESIDE-DM-OK",
        "DMCRYPT-READS-UCRYPT-AREA",
        "UCRYPT-READS-DMCRYPT-AREA",
        "CRYPTSETUP-BESIDE-UCRYPT-EXIT 5",
        "CRYPTSETUP-AFTER-CLOSE-OK",
        "UCRYPT-ON-MOUNTED-EXIT 5",
        "SHARED-VM-OK",
    ] {
        assert!(o.contains(marker), "missing {marker}:\n{o}");
    }
    assert!(
        !o.contains("MKFS-BESIDE-UCRYPT-EXIT 0"),
        "mkfs wrote over a device ucrypt serves:\n{o}"
    );
}
