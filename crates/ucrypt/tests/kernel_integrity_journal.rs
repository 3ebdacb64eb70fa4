//! dm-integrity's journal between the kernel and ucrypt, both ways, in two boots of a stock
//! Debian kernel (tests/vm/). cryptsetup opens LUKS2 integrity volumes in journal mode by
//! default; so does ucrypt.
//!
//! 1. Kernel to ucrypt. In the VM, cryptsetup formats; opened in journal mode, the kernel
//!    writes 64 KiB (`conv=fsync`: the journal section is committed); while the mapping is
//!    still active the device is copied (what a power cut would leave: the journal committed,
//!    the data not yet written to its place), then closed cleanly. On the host, the copy's
//!    data places differ from the cleanly closed original's (the write-back had not happened),
//!    ucrypt refuses to open the copy read-only (a replay is needed), opens it read-write,
//!    replays the kernel's journal and reads the kernel's data byte for byte. The same with an
//!    ext4 the kernel made and wrote a file into: after ucrypt's replay the plaintext is a
//!    clean ext4 (`e2fsck -f -n`) holding the file.
//! 2. ucrypt to kernel. On the host, ucrypt writes through its journal with the write-back
//!    held (a test hook): its committed sections stay in the journal, the data places keep
//!    their old contents (checked). In the VM, `cryptsetup open` replays ucrypt's journal and
//!    the kernel reads ucrypt's data byte for byte; an ext4 whose first 128 KiB (superblock,
//!    group descriptors) only ucrypt's journal holds checks clean with `e2fsck -f -n` and
//!    holds its file.
//!
//! Cases: aes-gcm-random + aead with 4096-byte sectors (192 MiB),
//! aes-xts-random + hmac-sha256 and chacha20-random + poly1305 with 512-byte sectors (96 MiB);
//! the ext4 on aes-gcm-random 4096 (32 MiB: one section). The kernel writes its journal back
//! once fewer than half of its sections are free, and every commit closes the section it is
//! filling: the cases' journals (a 128th of the device) have room for the kernel's write plus
//! three early commits (its 10 s commit timer firing on a starved vCPU) before that watermark,
//! so the copy is taken before any write-back. The copies take the first 32 MiB (the LUKS2
//! header, the integrity superblock, the journal and the first data area). Needs qemu-system-x86_64 and a kernel
//! (tests/vm/install-deps.sh), and mkfs.ext4/e2fsck/debugfs on the host: SKIPPED otherwise,
//! unless CI is set.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::fmt::Write as _;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use ucrypt::backend::{Backend, DirectMode, FileBackend};
use ucrypt::integrity::{open_luks2, IntegrityVolume, WriteMode};
use ucrypt::luks::{read_header, unlock_key, Unlock};
use ucrypt::{BlockDev, Error, SecretBytes};

struct Case {
    name: &'static str,
    cipher: &'static str,
    integrity: &'static str,
    key_bits: u32,
    sector: u64,
    image_bytes: u64,
}

const CASES: &[Case] = &[
    Case {
        name: "gcm-4096",
        cipher: "aes-gcm-random",
        integrity: "aead",
        key_bits: 256,
        sector: 4096,
        image_bytes: 192 << 20,
    },
    Case {
        name: "xts-hmac256-512",
        cipher: "aes-xts-random",
        integrity: "hmac-sha256",
        key_bits: 512,
        sector: 512,
        image_bytes: 96 << 20,
    },
    Case {
        name: "chacha-512",
        cipher: "chacha20-random",
        integrity: "poly1305",
        key_bits: 256,
        sector: 512,
        image_bytes: 96 << 20,
    },
];
const FS: Case = Case {
    name: "ext4-gcm-4096",
    cipher: "aes-gcm-random",
    integrity: "aead",
    key_bits: 256,
    sector: 4096,
    image_bytes: 32 << 20,
};

/// What the cases' copies take from the start of the device, MiB.
const COPY_MIB: u64 = 32;
/// What the kernel writes and leaves in its journal: 64 KiB at the start.
const KERNEL_WRITE: (u64, u64) = (0, 64 << 10);
/// What ucrypt writes and leaves in its journal: 96 KiB at 1 MiB + 8 KiB.
const UCRYPT_WRITE: (u64, u64) = ((1 << 20) + (8 << 10), 96 << 10);
/// The ext4 head only ucrypt's journal holds.
const FS_HEAD_BYTES: usize = 128 << 10;
const FS_FILE: &str = "journal.txt";
/// Each boot formats, wipes and copies several volumes under emulation: more than the
/// harness's default.
const VM_TIMEOUT_S: u32 = 900;

fn open_file(img: &Path, key: &[u8], writable: bool) -> ucrypt::Result<IntegrityVolume> {
    let be: Arc<dyn Backend> =
        Arc::new(FileBackend::open(img, writable, DirectMode::Never).expect("open image"));
    let hdr = read_header(be.as_ref()).expect("LUKS2 header");
    let (_, vk) = unlock_key(
        be.as_ref(),
        &hdr,
        Unlock::Passphrase(SecretBytes::from_slice(key)),
        None,
    )
    .expect("unlock");
    open_luks2(be, &hdr, &vk, !writable)
}

fn raw(img: &Path, at: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(img).expect("image");
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, at).expect("raw read");
    b
}

fn format_line(c: &Case, dev: &str, wipe: bool) -> String {
    format!(
        "cryptsetup luksFormat --type luks2 --cipher {} --integrity {} --key-size {} \
         --sector-size {} {} --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --batch-mode \
         --key-file $K {dev}",
        c.cipher,
        c.integrity,
        c.key_bits,
        c.sector,
        if wipe { "" } else { "--integrity-no-wipe" }
    )
}

/// The first data sector of `range` and the raw bytes of its block in `img`.
fn data_place(v: &IntegrityVolume, img: &Path, range: (u64, u64), bb: usize) -> Vec<u8> {
    let (d, _) = v.locate(range.0 / 512).expect("locate");
    raw(img, d, bb)
}

#[test]
fn journal_replay_between_kernel_and_ucrypt() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    for tool in ["mkfs.ext4", "e2fsck", "debugfs"] {
        if Command::new(tool).arg("-V").output().is_err() && !kit::under_ci() {
            println!("SKIPPED: {tool} not installed");
            return;
        }
    }
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("kernel-integrity-journal");
    let dir = &tmp.0;
    let mut key = vec![0u8; 32];
    rng.fill(&mut key);
    std::fs::write(dir.join("key"), &key).expect("key file");
    let mut plain = vec![0u8; KERNEL_WRITE.1 as usize];
    rng.fill(&mut plain);
    std::fs::write(dir.join("plain.bin"), &plain).expect("plaintext");
    let fs_text = format!("written by the kernel through its journal, seed {seed}\n");
    std::fs::write(dir.join("fs.txt"), &fs_text).expect("fs text");

    // ---- boot 1: the kernel writes through its journal; copies taken before write-back ----
    let mut vmrun = vm::VmRun::new("");
    vmrun.timeout_s = VM_TIMEOUT_S;
    vmrun.share = Some(dir.clone());
    let mut script =
        String::from("set -u\nK=/mnt/host/key\nP=/mnt/host/plain.bin\nmkdir -p /mnt/f\n");
    let mut ndev = 0u8;
    let mut attach = |vmrun: &mut vm::VmRun, img: &Path, bytes: u64| -> String {
        std::fs::File::create(img)
            .and_then(|f| f.set_len(bytes))
            .expect("image");
        vmrun.disk(img, false);
        let d = format!("/dev/vd{}", (b'a' + ndev) as char);
        ndev += 1;
        d
    };
    let mut imgs = Vec::new();
    for (i, c) in CASES.iter().enumerate() {
        let img = dir.join(format!("{}.img", c.name));
        let copy = dir.join(format!("{}.crash.img", c.name));
        let dev = attach(&mut vmrun, &img, c.image_bytes);
        let cdev = attach(&mut vmrun, &copy, c.image_bytes);
        writeln!(
            script,
            "if {} && cryptsetup open --key-file $K {dev} j{i} && \
             {{ dmsetup table | grep integrity | sed 's/^/TABLE /'; true; }} && \
             dd if=$P of=/dev/mapper/j{i} bs=65536 count=1 conv=fsync 2>/dev/null && \
             dd if={dev} of={cdev} bs=1M count={COPY_MIB} iflag=direct oflag=direct 2>/dev/null; \
             then echo \"CASE {} CRASH-COPIED\"; fi; cryptsetup close j{i}",
            format_line(c, &dev, false),
            c.name
        )
        .expect("script");
        imgs.push((img, copy));
    }
    let fs_img = dir.join("fs.img");
    let fs_copy = dir.join("fs.crash.img");
    let fdev = attach(&mut vmrun, &fs_img, FS.image_bytes);
    let fcdev = attach(&mut vmrun, &fs_copy, FS.image_bytes);
    writeln!(
        script,
        "if {} && cryptsetup open --key-file $K {fdev} f && mkfs.ext4 -q /dev/mapper/f && \
         mount /dev/mapper/f /mnt/f && cp /mnt/host/fs.txt /mnt/f/{FS_FILE} && umount /mnt/f && \
         dd if={fdev} of={fcdev} bs=1M iflag=direct oflag=direct 2>/dev/null; \
         then echo \"FS CRASH-COPIED\"; fi; cryptsetup close f",
        format_line(&FS, &fdev, true)
    )
    .expect("script");
    vmrun.script = script;
    let out = vmrun.run(dir);
    assert_eq!(out.status, 0, "seed {seed}: VM boot 1 failed");

    // ---- host: ucrypt replays the kernel's journals ----
    let mut failures = Vec::new();
    let mut ucrypt_wrote = Vec::new();
    for (i, c) in CASES.iter().enumerate() {
        if !out
            .output
            .contains(&format!("CASE {} CRASH-COPIED", c.name))
        {
            failures.push(format!("{}: the kernel did not write and copy", c.name));
            continue;
        }
        let (img, copy) = &imgs[i];
        let bb = c.sector as usize;
        // The cleanly closed original holds the data in place; the copy does not yet.
        let orig = open_file(img, &key, false).expect("open the cleanly closed original");
        assert_eq!(orig.replay_report().entries, 0, "{}", c.name);
        let mut got = vec![0u8; KERNEL_WRITE.1 as usize];
        orig.read_at(&mut got, KERNEL_WRITE.0)
            .expect("read original");
        assert!(
            got == plain,
            "seed {seed}: {}: the original differs",
            c.name
        );
        let placed = data_place(&orig, img, KERNEL_WRITE, bb);
        let sections = orig.layout().sb.journal_sections;
        println!("CASE {} journal: {sections} sections", c.name);
        drop(orig);
        assert_ne!(
            data_place(
                &open_file(img, &key, false).expect("reopen"),
                copy,
                KERNEL_WRITE,
                bb
            ),
            placed,
            "{}: the copy already holds the data in place (the kernel wrote its journal \
             of {sections} sections back): it tests no replay",
            c.name
        );
        match open_file(copy, &key, false) {
            Err(Error::ReadOnly(m)) => println!("CASE {} read-only open refused: {m}", c.name),
            Err(e) => panic!("{}: read-only open of the copy: {e}", c.name),
            Ok(_) => panic!("{}: read-only open of a journal needing replay", c.name),
        }
        let v = open_file(copy, &key, true).expect("open the copy read-write");
        let rep = v.replay_report();
        println!("CASE {} ucrypt replayed {rep:?}", c.name);
        assert!(rep.entries > 0 && rep.cleared, "{}: {rep:?}", c.name);
        assert_eq!(v.write_mode(), WriteMode::Journal);
        v.read_at(&mut got, KERNEL_WRITE.0)
            .expect("read the replayed copy");
        assert!(
            got == plain,
            "seed {seed}: {}: ucrypt's replay of the kernel's journal differs",
            c.name
        );
        drop(v);
        assert_eq!(
            data_place(
                &open_file(img, &key, false).expect("reopen"),
                copy,
                KERNEL_WRITE,
                bb
            ),
            placed,
            "{}: after the replay the data is in place",
            c.name
        );
        let v = open_file(copy, &key, false).expect("read-only open after the replay");
        v.read_at(&mut got, KERNEL_WRITE.0).expect("read");
        assert!(got == plain, "{}: after the replay, read-only", c.name);
        drop(v);
        println!("CASE {} ucrypt replays the kernel's journal OK", c.name);

        // ucrypt writes on the original, leaving its journal un-written-back.
        let v = open_file(img, &key, true).expect("open original read-write");
        let before = data_place(&v, img, UCRYPT_WRITE, bb);
        let mut mine = vec![0u8; UCRYPT_WRITE.1 as usize];
        rng.fill(&mut mine);
        v.hold_writeback_for_tests();
        v.write_at(&mine, UCRYPT_WRITE.0).expect("ucrypt write");
        v.flush().expect("commit");
        assert_eq!(
            data_place(&v, img, UCRYPT_WRITE, bb),
            before,
            "{}: the write-back was held",
            c.name
        );
        drop(v);
        std::fs::write(dir.join(format!("mine{i}.bin")), &mine).expect("expect file");
        ucrypt_wrote.push(i);
    }
    // The kernel's ext4, replayed by ucrypt.
    let mut fs_ready = false;
    if !out.output.contains("FS CRASH-COPIED") {
        failures.push("fs: the kernel did not make and copy its ext4".into());
    } else {
        let v = open_file(&fs_copy, &key, true).expect("open the fs copy");
        println!("FS ucrypt replayed {:?}", v.replay_report());
        let mut fs = vec![0u8; v.size() as usize];
        v.read_at(&mut fs, 0).expect("read the replayed ext4");
        drop(v);
        let exported = dir.join("fs.out");
        std::fs::write(&exported, &fs).expect("export");
        let s = |p: &Path| p.display().to_string();
        let r = vm::host("e2fsck", &["-f", "-n", &s(&exported)]).and_then(|_| {
            vm::host(
                "debugfs",
                &["-R", &format!("cat /{FS_FILE}"), &s(&exported)],
            )
        });
        match r {
            Err(e) => failures.push(format!("fs (kernel -> ucrypt): {e}")),
            Ok(t) if t == fs_text => println!("FS kernel's ext4 replayed by ucrypt is clean OK"),
            Ok(t) => failures.push(format!("fs: {FS_FILE} reads {t:?}")),
        }
        // ucrypt's ext4 on the cleanly closed original: the head only in ucrypt's journal.
        let mkimg = dir.join("mine.ext4");
        let size = open_file(&fs_img, &key, false).expect("open fs").size();
        std::fs::File::create(&mkimg)
            .and_then(|f| f.set_len(size))
            .expect("ext4 image");
        let mine_text = format!("written by ucrypt through its journal, seed {seed}\n");
        std::fs::write(dir.join("mine.txt"), &mine_text).expect("text");
        let r = vm::host("mkfs.ext4", &["-q", "-F", "-b", "4096", &s(&mkimg)]).and_then(|_| {
            vm::host(
                "debugfs",
                &[
                    "-w",
                    "-R",
                    &format!("write {} {FS_FILE}", s(&dir.join("mine.txt"))),
                    &s(&mkimg),
                ],
            )
        });
        match r {
            Err(e) => failures.push(format!("fs (ucrypt -> kernel): {e}")),
            Ok(_) => {
                let img = std::fs::read(&mkimg).expect("read ext4 image");
                let v = open_file(&fs_img, &key, true).expect("open fs read-write");
                let mut body = img.clone();
                body[..FS_HEAD_BYTES].fill(0);
                v.write_at(&body, 0).expect("write the ext4 body");
                v.flush().expect("flush");
                v.hold_writeback_for_tests();
                v.write_at(&img[..FS_HEAD_BYTES], 0)
                    .expect("write the ext4 head");
                v.flush().expect("commit");
                drop(v);
                std::fs::write(dir.join("mine.txt.expect"), &mine_text).expect("text");
                fs_ready = true;
            }
        }
    }

    // ---- boot 2: the kernel replays ucrypt's journal ----
    let mut vmrun = vm::VmRun::new("");
    vmrun.timeout_s = VM_TIMEOUT_S;
    vmrun.share = Some(dir.clone());
    let mut script = String::from("set -u\nK=/mnt/host/key\nmkdir -p /mnt/f\n");
    for (img, copy) in &imgs {
        vmrun.disk(img, false);
        vmrun.disk(copy, false);
    }
    vmrun.disk(&fs_img, false);
    for &i in &ucrypt_wrote {
        let c = &CASES[i];
        let dev = format!("/dev/vd{}", (b'a' + 2 * i as u8) as char);
        writeln!(
            script,
            "cryptsetup open --key-file $K {dev} k{i} && \
             if dd if=/dev/mapper/k{i} bs=4096 skip={} count={} 2>/dev/null | cmp - /mnt/host/mine{i}.bin; \
             then echo \"CASE {n} KERNEL-REPLAYED-OK\"; else echo \"CASE {n} KERNEL-READ-FAIL\"; fi; \
             cryptsetup close k{i}",
            UCRYPT_WRITE.0 / 4096,
            UCRYPT_WRITE.1 / 4096,
            n = c.name
        )
        .expect("script");
    }
    if fs_ready {
        let fdev = format!("/dev/vd{}", (b'a' + 2 * CASES.len() as u8) as char);
        writeln!(
            script,
            "cryptsetup open --key-file $K {fdev} g && \
             if e2fsck -f -n /dev/mapper/g >/dev/null 2>&1; then echo \"FS KERNEL-FSCK-OK\"; fi; \
             mount -o ro /dev/mapper/g /mnt/f && \
             if cmp /mnt/f/{FS_FILE} /mnt/host/mine.txt.expect; then echo \"FS KERNEL-FILE-OK\"; fi; \
             umount /mnt/f; cryptsetup close g"
        )
        .expect("script");
    }
    vmrun.script = script;
    let out2 = vmrun.run(dir);
    assert_eq!(out2.status, 0, "seed {seed}: VM boot 2 failed");
    for &i in &ucrypt_wrote {
        let n = CASES[i].name;
        if !out2
            .output
            .contains(&format!("CASE {n} KERNEL-REPLAYED-OK"))
        {
            failures.push(format!(
                "{n}: the kernel did not read ucrypt's journalled data"
            ));
        }
    }
    if fs_ready {
        for want in ["FS KERNEL-FSCK-OK", "FS KERNEL-FILE-OK"] {
            if !out2.output.contains(want) {
                failures.push(format!("fs (ucrypt -> kernel): no {want}"));
            }
        }
    }
    assert_eq!(
        ucrypt_wrote.len(),
        CASES.len(),
        "seed {seed}: {failures:#?}"
    );
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
}
