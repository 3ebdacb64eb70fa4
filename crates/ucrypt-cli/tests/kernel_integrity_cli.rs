//! LUKS2 volumes with authenticated encryption (dm-crypt over dm-integrity, direct mode)
//! between the `ucrypt` command and the kernel with cryptsetup 2.6, in one boot of a stock
//! Debian kernel under qemu (tests/vm/):
//! - ucrypt-made: `ucrypt format --integrity ...` (wiped) and `ucrypt import` of a seeded
//!   plaintext; in the VM `cryptsetup open --integrity-no-journal` opens it, reads the
//!   plaintext back byte for byte and reads the whole device (every tag verifies: the wipe);
//! - kernel-made: cryptsetup formats (wiping through the kernel) and the kernel writes the
//!   plaintext; `ucrypt export` yields the plaintext followed by zeroes;
//! - header: cryptsetup's JSON metadata of the ucrypt-made volume equals that of the one
//!   cryptsetup made with the same options, but for salts, digests and the UUID, and the
//!   dm-integrity superblock and journal are byte for byte the kernel's;
//! - filesystem, both ways (for the cases in `FS_CASES`): on a volume `ucrypt format` made, the
//!   kernel makes an ext4 and writes a file; the image `ucrypt export` gives is clean
//!   (`e2fsck -f -n`) and holds the file. And an ext4 made on the host and put in place by
//!   `ucrypt import` is clean for the kernel's `e2fsck -f -n` and holds its file.
//!
//! Cases: aes-gcm-random + aead (4096-byte sectors), aes-xts-random + hmac-sha256 (512),
//! chacha20-random + poly1305 (512); and two formatted as cryptsetup's luks2-integrity-test
//! does, with `--integrity-legacy-padding --offset 8192` on both sides: aes-xts-plain64 +
//! hmac-sha1 (4096) and aes-cbc-essiv:sha256 + hmac-sha256 (128-bit key, 512). `UCRYPT_INTEGRITY_CASES=chacha` runs only the cases whose
//! names contain one of the comma-separated words (the guest's crypto is emulated).
//! Needs qemu-system-x86_64 and a kernel (tests/vm/install-deps.sh): SKIPPED otherwise, unless
//! CI is set.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::fmt::Write as _;
use std::path::Path;

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
/// Each image: 16 MiB of LUKS2 header, then dm-integrity.
const IMAGE_BYTES: u64 = 48 << 20;
/// Plaintext per case.
const PLAIN_BYTES: u64 = 2 << 20;
/// The file the kernel writes into the ext4 it makes.
const FS_FILE: &str = "hello.txt";

struct Case {
    name: &'static str,
    cipher: &'static str,
    integrity: &'static str,
    key_bits: u32,
    sector: u64,
    /// More format options, given to `ucrypt format` and `cryptsetup luksFormat` alike.
    extra: &'static str,
}

/// luks2-integrity-test's format options.
const LEGACY: &str = "--integrity-legacy-padding --offset 8192";

const CASES: &[Case] = &[
    Case {
        name: "gcm-4096",
        cipher: "aes-gcm-random",
        integrity: "aead",
        key_bits: 256,
        sector: 4096,
        extra: "",
    },
    Case {
        name: "xts-hmac256-512",
        cipher: "aes-xts-random",
        integrity: "hmac-sha256",
        key_bits: 512,
        sector: 512,
        extra: "",
    },
    Case {
        name: "chacha-512",
        cipher: "chacha20-random",
        integrity: "poly1305",
        key_bits: 256,
        sector: 512,
        extra: "",
    },
    Case {
        name: "xts-plain64-sha1-4096-legacy",
        cipher: "aes-xts-plain64",
        integrity: "hmac-sha1",
        key_bits: 512,
        sector: 4096,
        extra: LEGACY,
    },
    Case {
        name: "cbc-essiv-sha256-512-legacy",
        cipher: "aes-cbc-essiv:sha256",
        integrity: "hmac-sha256",
        key_bits: 128,
        sector: 512,
        extra: LEGACY,
    },
];

/// The cases that also carry an ext4 both ways.
const FS_CASES: &[&str] = &["gcm-4096", "chacha-512"];
/// The ext4 made on the host for `ucrypt import` (smaller than the volume, as a filesystem may
/// be).
const HOST_FS_BYTES: u64 = 8 << 20;

/// The cases selected by `UCRYPT_INTEGRITY_CASES` (all when unset).
fn selected_cases() -> Vec<&'static Case> {
    let filter = std::env::var("UCRYPT_INTEGRITY_CASES").unwrap_or_default();
    let words: Vec<&str> = filter.split(',').filter(|w| !w.is_empty()).collect();
    CASES
        .iter()
        .filter(|c| words.is_empty() || words.iter().any(|w| c.name.contains(w)))
        .collect()
}

fn image(p: &Path) {
    std::fs::File::create(p)
        .and_then(|f| f.set_len(IMAGE_BYTES))
        .expect("image");
}

/// `ucrypt format --integrity ...` with every block wiped.
fn ucrypt_format(img: &Path, key: &Path, c: &Case) {
    image(img);
    let bits = c.key_bits.to_string();
    let sector = c.sector.to_string();
    let mut args = vec![
        "format",
        "--batch-mode",
        "--type",
        "luks2",
        "--cipher",
        c.cipher,
        "--integrity",
        c.integrity,
        "--integrity-no-journal",
        "--key-size",
        &bits,
        "--sector-size",
        &sector,
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        kit::s(key),
        kit::s(img),
    ];
    args.extend(c.extra.split_whitespace());
    vm::host(BIN, &args).unwrap_or_else(|e| panic!("{}: {e}", c.name));
}

/// The dm-integrity superblock and journal of an image: at the case's `--offset` (512-byte
/// sectors), else at LUKS2's default data offset of 16 MiB.
fn integrity_metadata(img: &Path, c: &Case) -> Vec<u8> {
    let words: Vec<&str> = c.extra.split_whitespace().collect();
    let sb_at = match words.iter().position(|w| *w == "--offset") {
        Some(i) => words[i + 1].parse::<usize>().expect("--offset N") * 512,
        None => 16 << 20,
    };
    let b = std::fs::read(img).expect("image");
    let sb = ucrypt::integrity::Superblock::parse(&b[sb_at..sb_at + 4096]).expect("superblock");
    let l = ucrypt::integrity::Layout::new(sb).expect("layout");
    b[sb_at..sb_at + (l.initial_sectors * 512) as usize].to_vec()
}

/// Removes what differs between any two formats: salts, digests (and the UUID, not in the JSON).
fn scrub(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("salt");
            m.remove("digest");
            m.values_mut().for_each(scrub);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(scrub),
        _ => {}
    }
}

#[test]
fn integrity_volumes_between_the_ucrypt_command_and_the_kernel() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let cases = selected_cases();
    assert!(!cases.is_empty(), "UCRYPT_INTEGRITY_CASES selects no case");
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("kernel-integrity-cli");
    let dir = &tmp.0;
    let key = dir.join("key");
    vm::random_file(&mut rng, &key, 32);
    let plain_path = dir.join("plain.bin");
    let plain = vm::random_file(&mut rng, &plain_path, PLAIN_BYTES as usize);
    let fs_text = format!("ucrypt integrity seed {seed}\n");
    std::fs::write(dir.join("fs.txt"), &fs_text).expect("fs text");

    let mut vmrun = vm::VmRun::new("");
    vmrun.share = Some(dir.clone());
    let mut script = String::from(
        "set -u\nK=/mnt/host/key\nP=/mnt/host/plain.bin\nmkdir -p /mnt/f\n\
         O='--integrity-no-journal --key-file /mnt/host/key'\n",
    );
    let mut disk = 0u8;
    let mut next_dev = |vmrun: &mut vm::VmRun, img: &Path| {
        vmrun.disk(img, false);
        let d = format!("/dev/vd{}", (b'a' + disk) as char);
        disk += 1;
        d
    };
    let plain_blocks = PLAIN_BYTES / 65536;
    for c in &cases {
        // ucrypt-made, ucrypt-written: the kernel reads. Written in direct mode, as the kernel
        // writes its own image here, so that the two journals can be compared below (journal
        // mode between the two sides: tests/kernel_integrity_journal.rs).
        let u = dir.join(format!("u-{}.img", c.name));
        ucrypt_format(&u, &key, c);
        vm::host(
            BIN,
            &[
                "import",
                kit::s(&plain_path),
                kit::s(&u),
                "--key-file",
                kit::s(&key),
                "--integrity-no-journal",
            ],
        )
        .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let du = next_dev(&mut vmrun, &u);
        writeln!(
            script,
            "if cryptsetup open $O {du} u && cmp -n {PLAIN_BYTES} /dev/mapper/u $P; then \
             echo \"CASE {n} KERNEL-READ-OK\"; else echo \"CASE {n} KERNEL-READ-FAIL\"; fi\n\
             cryptsetup luksDump --dump-json-metadata {du} > /mnt/host/{n}-u.json\n\
             if dd if=/dev/mapper/u of=/dev/null bs=1M 2>/dev/null; then \
             echo \"CASE {n} KERNEL-FULL-READ-OK\"; else echo \"CASE {n} KERNEL-FULL-READ-FAIL\"; fi\n\
             cryptsetup close u",
            n = c.name
        )
        .expect("script");
        // kernel-made, kernel-written: ucrypt exports.
        let kimg = dir.join(format!("k-{}.img", c.name));
        image(&kimg);
        let dk = next_dev(&mut vmrun, &kimg);
        writeln!(
            script,
            "if cryptsetup luksFormat --type luks2 --cipher {} --integrity {} --key-size {} \
             --sector-size {} {} --integrity-no-journal --pbkdf pbkdf2 --pbkdf-force-iterations 1000 \
             --batch-mode --key-file $K {dk} >/dev/null 2>&1 && cryptsetup open $O {dk} k && \
             dd if=$P of=/dev/mapper/k bs=65536 count={plain_blocks} conv=fsync 2>/dev/null && \
             cryptsetup close k; then echo \"CASE {n} KERNEL-WROTE\"; \
             else echo \"CASE {n} KERNEL-WRITE-FAIL\"; fi\n\
             cryptsetup luksDump --dump-json-metadata {dk} > /mnt/host/{n}-k.json",
            c.cipher,
            c.integrity,
            c.key_bits,
            c.sector,
            c.extra,
            n = c.name
        )
        .expect("script");
    }
    // Filesystem: ucrypt formats, the kernel makes an ext4 and writes a file; and an ext4 made
    // on the host, imported by ucrypt, checked by the kernel.
    let fs_cases: Vec<&Case> = cases
        .iter()
        .copied()
        .filter(|c| FS_CASES.contains(&c.name))
        .collect();
    let host_fs = dir.join("host-fs.img");
    if !fs_cases.is_empty() {
        std::fs::File::create(&host_fs)
            .and_then(|f| f.set_len(HOST_FS_BYTES))
            .expect("host fs image");
        // 4096-byte blocks: a filesystem block must not be smaller than the device's sector
        // (mkfs picks 1024 for a file this small, which a 4096-byte-sector volume cannot mount).
        vm::host("mkfs.ext4", &["-q", "-F", "-b", "4096", kit::s(&host_fs)])
            .expect("mkfs.ext4 on the host");
        vm::host(
            "debugfs",
            &[
                "-w",
                "-R",
                &format!("write {} {FS_FILE}", kit::s(&dir.join("fs.txt"))),
                kit::s(&host_fs),
            ],
        )
        .expect("debugfs write");
    }
    for c in &fs_cases {
        let n = c.name;
        let f = dir.join(format!("fs-{n}.img"));
        ucrypt_format(&f, &key, c);
        let df = next_dev(&mut vmrun, &f);
        writeln!(
            script,
            "if cryptsetup open $O {df} f && mkfs.ext4 -q /dev/mapper/f && mount /dev/mapper/f /mnt/f \
             && cp /mnt/host/fs.txt /mnt/f/{FS_FILE} && umount /mnt/f && cryptsetup close f; then \
             echo \"FS {n} KERNEL-MADE\"; else echo \"FS {n} KERNEL-MADE-FAIL\"; fi"
        )
        .expect("script");
        let g = dir.join(format!("gs-{n}.img"));
        ucrypt_format(&g, &key, c);
        vm::host(
            BIN,
            &[
                "import",
                kit::s(&host_fs),
                kit::s(&g),
                "--key-file",
                kit::s(&key),
            ],
        )
        .unwrap_or_else(|e| panic!("{n}: import of the host's ext4: {e}"));
        let dg = next_dev(&mut vmrun, &g);
        writeln!(
            script,
            "if cryptsetup open $O {dg} g-{n} && e2fsck -f -n /dev/mapper/g-{n} >/dev/null 2>&1 && \
             mount -o ro /dev/mapper/g-{n} /mnt/f && cmp /mnt/f/{FS_FILE} /mnt/host/fs.txt && \
             umount /mnt/f && cryptsetup close g-{n}; then echo \"FS {n} KERNEL-FSCK-OK\"; \
             else echo \"FS {n} KERNEL-FSCK-FAIL\"; fi"
        )
        .expect("script");
    }
    vmrun.script = script;
    let out = vmrun.run(dir);
    assert_eq!(out.status, 0, "seed {seed}: VM boot failed");

    let mut failures = Vec::new();
    let mut expect = |line: String| {
        if !out.output.contains(&line) {
            failures.push(format!("missing in the VM output: {line}"));
            false
        } else {
            true
        }
    };
    let mut kernel_wrote = Vec::new();
    for c in &cases {
        expect(format!("CASE {} KERNEL-READ-OK", c.name));
        expect(format!("CASE {} KERNEL-FULL-READ-OK", c.name));
        kernel_wrote.push(expect(format!("CASE {} KERNEL-WROTE", c.name)));
    }
    let fs_made: Vec<bool> = fs_cases
        .iter()
        .map(|c| {
            expect(format!("FS {} KERNEL-FSCK-OK", c.name));
            expect(format!("FS {} KERNEL-MADE", c.name))
        })
        .collect();
    for c in &cases {
        let load = |side: &str| -> Option<serde_json::Value> {
            let text = std::fs::read_to_string(dir.join(format!("{}-{side}.json", c.name))).ok()?;
            let mut v: serde_json::Value = serde_json::from_str(&text).ok()?;
            scrub(&mut v);
            Some(v)
        };
        match (load("u"), load("k")) {
            (Some(u), Some(k)) if u == k => {
                println!("CASE {} LUKS2 metadata = cryptsetup's OK", c.name)
            }
            (Some(u), Some(k)) => failures.push(format!(
                "{}: LUKS2 metadata differs from cryptsetup's:\nucrypt:     {u}\ncryptsetup: {k}",
                c.name
            )),
            _ => failures.push(format!("{}: no JSON metadata from the VM", c.name)),
        }
    }
    for (c, wrote) in cases.iter().zip(kernel_wrote) {
        if !wrote {
            continue;
        }
        let kimg = dir.join(format!("k-{}.img", c.name));
        let uimg = dir.join(format!("u-{}.img", c.name));
        let (km, um) = (integrity_metadata(&kimg, c), integrity_metadata(&uimg, c));
        if km == um {
            println!(
                "CASE {} dm-integrity superblock + journal = the kernel's OK ({} bytes)",
                c.name,
                km.len()
            );
        } else {
            let first = km.iter().zip(&um).position(|(a, b)| a != b);
            failures.push(format!(
                "{}: dm-integrity superblock or journal differs from the kernel's (kernel {} \
                 bytes, ucrypt {}, first difference at byte {first:?} after the superblock's \
                 start)",
                c.name,
                km.len(),
                um.len()
            ));
        }
        let exported = dir.join(format!("k-{}.out", c.name));
        match vm::host(
            BIN,
            &[
                "export",
                kit::s(&kimg),
                kit::s(&exported),
                "--key-file",
                kit::s(&key),
            ],
        ) {
            Err(e) => failures.push(format!("{}: ucrypt export: {e}", c.name)),
            Ok(_) => {
                let got = std::fs::read(&exported).expect("exported");
                if got.len() < plain.len() || got[..plain.len()] != plain[..] {
                    failures.push(format!(
                        "{}: ucrypt export differs from what the kernel wrote",
                        c.name
                    ));
                } else if got[plain.len()..].iter().any(|&b| b != 0) {
                    failures.push(format!(
                        "{}: the kernel's wipe does not export as zeroes",
                        c.name
                    ));
                } else {
                    println!("CASE {} ucrypt export = the kernel's writes OK", c.name);
                }
            }
        }
    }
    for (c, made) in fs_cases.iter().zip(fs_made) {
        let n = c.name;
        if out.output.contains(&format!("FS {n} KERNEL-FSCK-OK")) {
            println!("FS {n} the kernel's e2fsck of ucrypt's ext4 is clean OK");
        }
        if !made {
            continue;
        }
        let f = dir.join(format!("fs-{n}.img"));
        let exported = dir.join(format!("fs-{n}.out"));
        let r = vm::host(
            BIN,
            &[
                "export",
                kit::s(&f),
                kit::s(&exported),
                "--key-file",
                kit::s(&key),
            ],
        )
        .and_then(|_| vm::host("e2fsck", &["-f", "-n", kit::s(&exported)]))
        .and_then(|_| {
            vm::host(
                "debugfs",
                &["-R", &format!("cat /{FS_FILE}"), kit::s(&exported)],
            )
        });
        match r {
            Err(e) => failures.push(format!("fs {n}: {e}")),
            Ok(text) if text == fs_text => println!("FS {n} ucrypt export is clean ext4 OK"),
            Ok(text) => failures.push(format!("fs {n}: {FS_FILE} reads {text:?}")),
        }
    }
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
}
