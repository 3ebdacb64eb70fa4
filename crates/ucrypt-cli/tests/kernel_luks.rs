//! LUKS2 volumes made by `ucrypt format` against the kernel's dm-crypt and cryptsetup 2.6, in
//! one boot of a stock Debian kernel under qemu (tests/vm/):
//! - read: ucrypt formats and imports a seeded plaintext; `cryptsetup open` in the VM reads it
//!   back byte for byte;
//! - write: ucrypt formats; the VM's dm-crypt (`cryptsetup open`) writes the plaintext; `ucrypt
//!   export` reads it back byte for byte;
//! - filesystem: an ext4 made on the host (`mkfs.ext4 -d`) and imported by ucrypt is clean
//!   (`e2fsck -f`) and holds the right files through dm-crypt; an ext4 made and filled through
//!   dm-crypt in the VM, exported by ucrypt, is clean on the host and holds the right files.
//!
//! Cases: aes-xts-plain64 512-bit key with 512- and 4096-byte sectors, aes-cbc-essiv:sha256,
//! and the other ciphers LUKS2 volumes use (serpent-xts, camellia-xts, twofish-cbc-essiv,
//! Adiantum): their keyslot areas are encrypted with the segment's cipher too, so the guest's
//! cryptsetup unlocking them (through AF_ALG) proves the keyslot path as well as the data.
//! Needs qemu-system-x86_64 and a kernel (tests/vm/install-deps.sh): SKIPPED otherwise, unless
//! CI is set. SKIPPED too while this build has no `ucrypt format` (LUKS verbs not merged).

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::fmt::Write as _;
use std::path::Path;

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
/// Plaintext per data case; guest dm-crypt runs emulated at a few MiB/s.
const PLAIN_BYTES: u64 = 2 << 20;
/// Size of the ext4 images of the filesystem stage.
const FS_BYTES: u64 = 8 << 20;

struct Case {
    name: &'static str,
    cipher: &'static str,
    key_bits: u32,
    sector: u64,
}

const CASES: &[Case] = &[
    Case {
        name: "xts512",
        cipher: "aes-xts-plain64",
        key_bits: 512,
        sector: 512,
    },
    Case {
        name: "xts4096",
        cipher: "aes-xts-plain64",
        key_bits: 512,
        sector: 4096,
    },
    Case {
        name: "cbc-essiv",
        cipher: "aes-cbc-essiv:sha256",
        key_bits: 256,
        sector: 512,
    },
    Case {
        name: "serpent-xts4096",
        cipher: "serpent-xts-plain64",
        key_bits: 512,
        sector: 4096,
    },
    Case {
        name: "camellia-xts",
        cipher: "camellia-xts-plain64",
        key_bits: 256,
        sector: 512,
    },
    Case {
        name: "twofish-cbc-essiv",
        cipher: "twofish-cbc-essiv:sha256",
        key_bits: 256,
        sector: 512,
    },
    Case {
        name: "adiantum4096",
        cipher: "xchacha12,aes-adiantum-plain64",
        key_bits: 256,
        sector: 4096,
    },
];

fn ucrypt(args: &[&str]) -> Result<String, String> {
    vm::host(BIN, args)
}

/// A fresh LUKS2 image made by `ucrypt format` with a data area of `data_bytes`.
fn format(path: &Path, key: &Path, case: &Case, data_bytes: u64) {
    let image = vm::Luks2Image {
        cipher: case.cipher,
        key_bits: case.key_bits,
        sector_bytes: case.sector,
        data_bytes,
    };
    image.format(BIN, path, key).expect("ucrypt format");
}

#[test]
fn luks2_by_ucrypt_opened_by_kernel_and_back() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    if ucrypt(&["format", "--help"]).is_err() {
        println!("SKIPPED: this ucrypt build has no LUKS verbs (format/import/export)");
        return;
    }
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("kernel-luks");
    let dir = &tmp.0;
    let key = dir.join("key");
    let mut pass = vec![0u8; 32];
    rng.fill(&mut pass);
    std::fs::write(&key, &pass).expect("key file");
    let mut plain = vec![0u8; PLAIN_BYTES as usize];
    rng.fill(&mut plain);
    let plain_path = dir.join("plain.bin");
    std::fs::write(&plain_path, &plain).expect("plaintext");

    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    // camellia-xts (the initramfs' own list has the other ciphers' modules).
    run.extra_mods = vec!["camellia_generic".to_string()];
    let mut script = String::from("set -u\nfail=0\nP=/mnt/host/plain.bin\nK=/mnt/host/key\n");
    let mut disk = 0usize;
    let mut next_dev = |run: &mut vm::VmRun, img: &Path, ro: bool| {
        run.disk(img, ro);
        disk += 1;
        format!("/dev/vd{}", (b'a' + (disk - 1) as u8) as char)
    };
    let mut write_imgs = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let r = dir.join(format!("read{i}.img"));
        format(&r, &key, case, PLAIN_BYTES);
        ucrypt(&[
            "import",
            kit::s(&plain_path),
            kit::s(&r),
            "--key-file",
            kit::s(&key),
        ])
        .expect("ucrypt import");
        let w = dir.join(format!("write{i}.img"));
        format(&w, &key, case, PLAIN_BYTES);
        let dr = next_dev(&mut run, &r, true);
        let dw = next_dev(&mut run, &w, false);
        script.push_str(&vm::both_ways_case(
            case.name,
            i,
            &format!(
                "{} {} bits, sector {}",
                case.cipher, case.key_bits, case.sector
            ),
            &format!("cryptsetup open --readonly --key-file $K {dr}"),
            &format!("cryptsetup open --key-file $K {dw}"),
            None,
        ));
        write_imgs.push(w);
    }

    // Filesystem stage (aes-xts-plain64, 4096-byte sectors, the cryptsetup default).
    let fs_case = &CASES[1];
    let rows: &[(&str, usize)] = &[
        ("hello", 6),
        ("a/b/unaligned", 12_345),
        ("a/big", 1 << 20),
        ("a/odd", (256 << 10) + 3),
    ];
    let mut tree = Vec::new();
    let mut manifest = String::new();
    for &(rel, n) in rows {
        let mut v = vec![0u8; n];
        rng.fill(&mut v);
        let p = dir.join("src").join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, &v).expect("tree file");
        manifest.push_str(&format!("{}  {rel}\n", kit::hex(&sha256(&v))));
        tree.push((rel, v));
    }
    std::fs::write(dir.join("manifest"), manifest).expect("manifest");
    let fs_plain = dir.join("fs-host-plain.img");
    std::fs::File::create(&fs_plain)
        .and_then(|f| f.set_len(FS_BYTES))
        .expect("fs plain");
    vm::host(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-b",
            "4096",
            "-d",
            kit::s(&dir.join("src")),
            kit::s(&fs_plain),
        ],
    )
    .expect("mkfs.ext4 -d");
    let fs_host = dir.join("fs-host.img");
    format(&fs_host, &key, fs_case, FS_BYTES);
    ucrypt(&[
        "import",
        kit::s(&fs_plain),
        kit::s(&fs_host),
        "--key-file",
        kit::s(&key),
    ])
    .expect("import fs");
    let fs_vm = dir.join("fs-vm.img");
    format(&fs_vm, &key, fs_case, FS_BYTES);
    let dh = next_dev(&mut run, &fs_host, true);
    let dv = next_dev(&mut run, &fs_vm, false);
    write!(
        script,
        r#"echo "== fs: ext4 made on the host, imported into LUKS2 by ucrypt; checked through dm-crypt"
mkdir -p /mnt/f
if cryptsetup open --readonly --key-file $K {dh} fh && e2fsck -f -n /dev/mapper/fh && mount -o ro /dev/mapper/fh /mnt/f && (cd /mnt/f && sha256sum -c /mnt/host/manifest); then echo "FS HOST-MADE-OK"; else echo "FS HOST-MADE-FAIL"; fail=1; fi
umount /mnt/f 2>/dev/null; cryptsetup close fh
echo "== fs: ext4 made and filled through dm-crypt on a ucrypt-formatted LUKS2 volume"
if cryptsetup open --key-file $K {dv} fv && mkfs.ext4 -q /dev/mapper/fv && mount /dev/mapper/fv /mnt/f && cp -a /mnt/host/src/. /mnt/f/ && umount /mnt/f && e2fsck -f -n /dev/mapper/fv; then echo "FS VM-MADE-DONE"; else echo "FS VM-MADE-FAIL"; fail=1; fi
cryptsetup close fv
sync
exit $fail
"#
    )
    .expect("script");
    run.script = script;

    let out = run.run(dir);
    println!(
        "VM run (LUKS2 cases + filesystem) took {:.1} s",
        out.elapsed.as_secs_f64()
    );
    let names = CASES.iter().map(|c| c.name);
    let mut failures = vm::both_ways_failures(&out.output, names, "LUKS2", &plain, |i| {
        let back = dir.join(format!("back{i}.bin"));
        ucrypt(&[
            "export",
            kit::s(&write_imgs[i]),
            kit::s(&back),
            "--key-file",
            kit::s(&key),
        ])?;
        Ok(std::fs::read(&back).expect("read export"))
    });
    if !out.output.contains("FS HOST-MADE-OK") {
        failures.push(
            "fs: the host-made ext4 imported by ucrypt is not clean/complete through dm-crypt"
                .into(),
        );
    }
    if out.output.contains("FS VM-MADE-DONE") {
        let back = dir.join("fs-vm-plain.img");
        match ucrypt(&[
            "export",
            kit::s(&fs_vm),
            kit::s(&back),
            "--key-file",
            kit::s(&key),
        ])
        .and_then(|_| vm::host("fsck.ext4", &["-f", "-n", kit::s(&back)]))
        {
            Ok(_) => {
                let rd = dir.join("rdump");
                std::fs::create_dir_all(&rd).expect("mkdir");
                vm::host(
                    "debugfs",
                    &["-R", &format!("rdump / {}", rd.display()), kit::s(&back)],
                )
                .expect("debugfs rdump");
                for (rel, want) in &tree {
                    match std::fs::read(rd.join(rel)) {
                        Ok(got) if got == *want => {}
                        _ => failures.push(format!(
                            "fs: {rel} wrong or missing in the VM-made ext4 exported by ucrypt"
                        )),
                    }
                }
                println!(
                    "FS VM-made ext4, exported by ucrypt: fsck clean, {} files identical",
                    tree.len()
                );
            }
            Err(e) => failures.push(format!("fs: VM-made ext4 through ucrypt export: {e}")),
        }
    } else {
        failures.push("fs: the VM could not make its ext4 through dm-crypt".into());
    }
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
    assert_eq!(out.status, 0, "VM script failed (exit {})", out.status);
}

fn sha256(data: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(data).into()
}
