//! ucrypt's sector layer against the Linux kernel's dm-crypt, byte-exact in both directions, in
//! one boot of a stock Debian kernel under qemu (tests/vm/).
//!
//! For every row of [`CASES`]:
//! - read: the host encrypts a seeded plaintext with [`SectorCipher`] into an image; in the VM,
//!   dm-crypt (a `dmsetup` table, or `cryptsetup open --type plain`) maps it and the mapped
//!   device must equal the plaintext byte for byte;
//! - write: in the VM, dm-crypt writes the same plaintext onto a zeroed image; on the host that
//!   ciphertext must equal ucrypt's own ciphertext byte for byte, decrypt to the plaintext, and
//!   the bytes before the data offset must be untouched.
//!
//! Needs qemu-system-x86_64 and a kernel (tests/vm/install-deps.sh); prints SKIPPED otherwise,
//! unless CI is set, where it fails.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::fmt::Write as _;

use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};

/// How the guest maps the image.
#[derive(Clone, Copy, Debug)]
enum Opener {
    /// `dmsetup create NAME --table "0 LEN crypt SPEC HEXKEY IV_OFFSET DEV OFFSET [opts]"`.
    Dmsetup,
    /// `cryptsetup open --type plain` with a binary key file, `--offset` and `--skip`.
    CryptsetupPlain,
}

struct Case {
    name: &'static str,
    spec: &'static str,
    key_bytes: usize,
    sector_bytes: u64,
    /// dm-crypt iv_offset (`--skip`), in 512-byte units.
    iv_offset: u64,
    /// Where the encrypted data starts on the device, in 512-byte units (`--offset`).
    data_offset: u64,
    iv_large_sectors: bool,
    opener: Opener,
}

const CASES: &[Case] = &[
    Case {
        name: "xts512",
        spec: "aes-xts-plain64",
        key_bytes: 64,
        sector_bytes: 512,
        iv_offset: 0,
        data_offset: 0,
        iv_large_sectors: false,
        opener: Opener::Dmsetup,
    },
    Case {
        name: "xts4096",
        spec: "aes-xts-plain64",
        key_bytes: 64,
        sector_bytes: 4096,
        iv_offset: 0,
        data_offset: 0,
        iv_large_sectors: false,
        opener: Opener::Dmsetup,
    },
    Case {
        name: "cbc-essiv512",
        spec: "aes-cbc-essiv:sha256",
        key_bytes: 32,
        sector_bytes: 512,
        iv_offset: 0,
        data_offset: 0,
        iv_large_sectors: false,
        opener: Opener::Dmsetup,
    },
    Case {
        name: "xts512-ivoff",
        spec: "aes-xts-plain64",
        key_bytes: 64,
        sector_bytes: 512,
        iv_offset: 12345,
        data_offset: 7,
        iv_large_sectors: false,
        opener: Opener::Dmsetup,
    },
    Case {
        name: "xts4096-plain-open",
        spec: "aes-xts-plain64",
        key_bytes: 64,
        sector_bytes: 4096,
        iv_offset: 4096,
        data_offset: 2048,
        iv_large_sectors: false,
        opener: Opener::CryptsetupPlain,
    },
    Case {
        name: "xts4096-large-iv",
        spec: "aes-xts-plain64",
        key_bytes: 64,
        sector_bytes: 4096,
        iv_offset: 2048,
        data_offset: 8,
        iv_large_sectors: true,
        opener: Opener::Dmsetup,
    },
    Case {
        name: "xts256-4096",
        spec: "aes-xts-plain64",
        key_bytes: 32,
        sector_bytes: 4096,
        iv_offset: 0,
        data_offset: 0,
        iv_large_sectors: false,
        opener: Opener::Dmsetup,
    },
    Case {
        name: "cbc-essiv4096",
        spec: "aes-cbc-essiv:sha256",
        key_bytes: 32,
        sector_bytes: 4096,
        iv_offset: 0,
        data_offset: 0,
        iv_large_sectors: false,
        opener: Opener::Dmsetup,
    },
];

/// Plaintext per case. Guest dm-crypt runs emulated at a few MiB/s: keep it small.
const PLAIN_BYTES: usize = 1 << 20;
/// Filler before the data offset, so a mapping at the wrong offset cannot go unnoticed.
const FILLER: u8 = 0xa5;

fn cipher(case: &Case, key: &[u8]) -> SectorCipher {
    let spec: CipherSpec = case.spec.parse().expect("case spec parses");
    let geometry = Geometry {
        sector_size: SectorSize::new(case.sector_bytes).expect("case sector size"),
        iv_offset: case.iv_offset,
        iv_large_sectors: case.iv_large_sectors,
    };
    SectorCipher::new(spec, key, geometry).expect("key the sector cipher")
}

/// The guest commands that map `dev` as `/dev/mapper/NAME` for `case`.
fn open_cmd(case: &Case, key: &[u8], dev: &str, name: &str, key_file: &str) -> String {
    match case.opener {
        Opener::Dmsetup => {
            let mut opts = Vec::new();
            if case.sector_bytes != 512 {
                opts.push(format!("sector_size:{}", case.sector_bytes));
            }
            if case.iv_large_sectors {
                opts.push("iv_large_sectors".to_string());
            }
            let opts = if opts.is_empty() {
                String::new()
            } else {
                format!(" {} {}", opts.len(), opts.join(" "))
            };
            // No udev in the guest: `dmsetup mknodes` makes the /dev/mapper node.
            format!(
                "dmsetup create {name} --table \"0 {} crypt {} {} {} {dev} {}{opts}\" && dmsetup mknodes {name}",
                PLAIN_BYTES / 512,
                case.spec,
                kit::hex(key),
                case.iv_offset,
                case.data_offset
            )
        }
        Opener::CryptsetupPlain => {
            assert!(
                !case.iv_large_sectors,
                "add --iv-large-sectors to the plain opener first"
            );
            format!(
                "cryptsetup open --type plain --batch-mode --cipher {} --key-size {} --key-file {key_file} \
                 --sector-size {} --offset {} --skip {} --size {} {dev} {name}",
                case.spec,
                case.key_bytes * 8,
                case.sector_bytes,
                case.data_offset,
                case.iv_offset,
                PLAIN_BYTES / 512
            )
        }
    }
}

fn close_cmd(case: &Case, name: &str) -> String {
    match case.opener {
        Opener::Dmsetup => format!("dmsetup remove {name}"),
        Opener::CryptsetupPlain => format!("cryptsetup close {name}"),
    }
}

#[test]
fn kernel_dmcrypt_reads_and_writes_match_ucrypt() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("dmcrypt");
    let dir = &tmp.0;

    let mut plain = vec![0u8; PLAIN_BYTES];
    rng.fill(&mut plain);
    std::fs::write(dir.join("plain.bin"), &plain).expect("write plaintext");

    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    let mut script = String::from("set -u\nfail=0\nP=/mnt/host/plain.bin\n");
    let mut keys = Vec::new();
    let mut expected_ct = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let mut key = vec![0u8; case.key_bytes];
        rng.fill(&mut key);
        std::fs::write(dir.join(format!("key{i}.bin")), &key).expect("write key file");

        let mut ct = plain.clone();
        cipher(case, &key).encrypt(0, &mut ct).expect("encrypt");
        let off = (case.data_offset * 512) as usize;
        let mut img = vec![FILLER; off];
        img.extend_from_slice(&ct);
        let read_img = dir.join(format!("read{i}.img"));
        std::fs::write(&read_img, &img).expect("write read image");
        let write_img = dir.join(format!("write{i}.img"));
        std::fs::write(&write_img, vec![0u8; off + PLAIN_BYTES]).expect("write zero image");
        run.disk(&read_img, true);
        run.disk(&write_img, false);
        let dev_r = format!("/dev/vd{}", (b'a' + 2 * i as u8) as char);
        let dev_w = format!("/dev/vd{}", (b'a' + 2 * i as u8 + 1) as char);
        let kf = format!("/mnt/host/key{i}.bin");
        let name = case.name;
        writeln!(
            script,
            "echo \"== {name}: {} key {} bits, sector {}, iv_offset {}, offset {}, large {}, via {:?}\"\n\
             if {open_r} && [ -b /dev/mapper/r{i} ] && cmp /dev/mapper/r{i} $P; then echo \"CASE {name} READ-OK\"; else echo \"CASE {name} READ-FAIL\"; fail=1; fi\n\
             {close_r}\n\
             if {open_w} && [ -b /dev/mapper/w{i} ] && dd if=$P of=/dev/mapper/w{i} bs=65536 conv=fsync 2>/dev/null; then echo \"CASE {name} WRITE-DONE\"; else echo \"CASE {name} WRITE-FAIL\"; fail=1; fi\n\
             {close_w}",
            case.spec,
            case.key_bytes * 8,
            case.sector_bytes,
            case.iv_offset,
            case.data_offset,
            case.iv_large_sectors,
            case.opener,
            open_r = open_cmd(case, &key, &dev_r, &format!("r{i}"), &kf),
            close_r = close_cmd(case, &format!("r{i}")),
            open_w = open_cmd(case, &key, &dev_w, &format!("w{i}"), &kf),
            close_w = close_cmd(case, &format!("w{i}")),
        )
        .expect("format script");
        keys.push(key);
        expected_ct.push(ct);
    }
    let fs = FsStage::prepare(dir, &mut rng, &mut run, CASES.len() * 2);
    script.push_str(&fs.script);
    script.push_str("sync\nexit $fail\n");
    run.script = script;

    let out = run.run(dir);
    println!(
        "VM run took {:.1} s for {} cases",
        out.elapsed.as_secs_f64(),
        CASES.len()
    );

    let mut failures = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        if !out.output.contains(&format!("CASE {} READ-OK", case.name)) {
            failures.push(format!(
                "{}: kernel dm-crypt did not read ucrypt's ciphertext back exactly",
                case.name
            ));
        }
        if !out
            .output
            .contains(&format!("CASE {} WRITE-DONE", case.name))
        {
            failures.push(format!("{}: kernel dm-crypt write failed", case.name));
            continue;
        }
        let img = std::fs::read(dir.join(format!("write{i}.img"))).expect("read VM-written image");
        let off = (case.data_offset * 512) as usize;
        if img.len() != off + PLAIN_BYTES {
            failures.push(format!(
                "{}: image size changed to {}",
                case.name,
                img.len()
            ));
            continue;
        }
        if img[..off].iter().any(|&b| b != 0) {
            failures.push(format!(
                "{}: dm-crypt wrote before the data offset",
                case.name
            ));
        }
        let got = &img[off..];
        if got != expected_ct[i].as_slice() {
            let first = got
                .iter()
                .zip(&expected_ct[i])
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            failures.push(format!(
                "{}: dm-crypt's ciphertext differs from ucrypt's, first at byte {first} (sector {})",
                case.name,
                first as u64 / case.sector_bytes
            ));
        }
        let mut dec = got.to_vec();
        cipher(case, &keys[i])
            .decrypt(0, &mut dec)
            .expect("decrypt");
        if dec != plain {
            failures.push(format!(
                "{}: ucrypt did not decrypt dm-crypt's ciphertext to the plaintext",
                case.name
            ));
        } else {
            println!(
                "CASE {} host decrypt of VM-written ciphertext OK",
                case.name
            );
        }
    }
    assert_eq!(
        out.status, 0,
        "VM script failed (exit {}); failures: {failures:#?}",
        out.status
    );
    fs.check(dir, &out.output, &mut failures);
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
}

/// Size of each ext4 image of the filesystem stage.
const FS_BYTES: u64 = 8 << 20;
/// The filesystem stage's cipher: what cryptsetup picks by default (LUKS2 data segment).
const FS_SPEC: &str = "aes-xts-plain64";
const FS_SECTOR: u64 = 4096;

/// A filesystem made on one side and checked on the other, in the same boot:
/// - host: `mkfs.ext4 -d TREE` on a plain file, encrypted with the sector layer; VM: dm-crypt
///   maps it, `e2fsck -f -n` is clean, every file's sha256 matches;
/// - VM: `mkfs.ext4` on dm-crypt, the tree copied in, `e2fsck`; host: decrypts with the sector
///   layer, `fsck.ext4 -f -n` is clean, `debugfs rdump` gives back the tree.
struct FsStage {
    script: String,
    key: Vec<u8>,
    tree: Vec<(String, Vec<u8>)>,
}

fn fs_cipher(key: &[u8]) -> SectorCipher {
    let spec: CipherSpec = FS_SPEC.parse().expect("spec");
    SectorCipher::new(
        spec,
        key,
        Geometry::new(SectorSize::new(FS_SECTOR).expect("size")),
    )
    .expect("cipher")
}

impl FsStage {
    fn prepare(
        dir: &std::path::Path,
        rng: &mut kit::SplitMix,
        run: &mut vm::VmRun,
        first_disk: usize,
    ) -> FsStage {
        let rows: &[(&str, usize)] = &[
            ("hello", 6),
            ("a/b/unaligned", 12_345),
            ("a/big", 1 << 20),
            ("a/odd", (256 << 10) + 3),
        ];
        let src = dir.join("src");
        let mut tree = Vec::new();
        for &(rel, n) in rows {
            let mut v = vec![0u8; n];
            rng.fill(&mut v);
            let p = src.join(rel);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(&p, &v).expect("write tree");
            tree.push((rel.to_string(), v));
        }
        let manifest: String = tree
            .iter()
            .map(|(rel, v)| {
                use sha2::Digest;
                format!("{}  {rel}\n", kit::hex(&sha2::Sha256::digest(v)))
            })
            .collect();
        std::fs::write(dir.join("manifest"), manifest).expect("manifest");

        let mut key = vec![0u8; 64];
        rng.fill(&mut key);
        // Host-made filesystem, encrypted by ucrypt. 4 KiB blocks: the dm device has 4 KiB logical
        // blocks (sector_size:4096), on which a 1 KiB-block ext4 cannot mount.
        let plain = dir.join("fs-host-plain.img");
        std::fs::File::create(&plain)
            .expect("create")
            .set_len(FS_BYTES)
            .expect("size");
        let p = plain.to_str().expect("utf-8");
        vm::host(
            "mkfs.ext4",
            &[
                "-q",
                "-F",
                "-b",
                "4096",
                "-d",
                src.to_str().expect("utf-8"),
                p,
            ],
        )
        .expect("host mkfs.ext4 -d");
        let mut img = std::fs::read(&plain).expect("read fs");
        fs_cipher(&key).encrypt(0, &mut img).expect("encrypt fs");
        let host_img = dir.join("fs-host.img");
        std::fs::write(&host_img, &img).expect("write fs image");
        let vm_img = dir.join("fs-vm.img");
        std::fs::write(&vm_img, vec![0u8; FS_BYTES as usize]).expect("zero image");
        run.disk(&host_img, true);
        run.disk(&vm_img, false);
        let dev = |i: usize| format!("/dev/vd{}", (b'a' + i as u8) as char);
        let table = |d: &str| {
            format!(
                "0 {} crypt {FS_SPEC} {} 0 {d} 0 1 sector_size:{FS_SECTOR}",
                FS_BYTES / 512,
                kit::hex(&key)
            )
        };
        let script = format!(
            r#"echo "== fs: ext4 made by the host (mkfs -d), encrypted by ucrypt; checked by the VM"
mkdir -p /mnt/fsh /mnt/fsv
if dmsetup create fsh --readonly --table "{th}" && dmsetup mknodes fsh && e2fsck -f -n /dev/mapper/fsh && mount -o ro /dev/mapper/fsh /mnt/fsh && (cd /mnt/fsh && sha256sum -c /mnt/host/manifest); then echo "FS HOST-MADE-OK"; else echo "FS HOST-MADE-FAIL"; fail=1; fi
umount /mnt/fsh 2>/dev/null; dmsetup remove fsh
echo "== fs: ext4 made and filled by the VM on dm-crypt"
if dmsetup create fsv --table "{tv}" && dmsetup mknodes fsv && mkfs.ext4 -q /dev/mapper/fsv && mount /dev/mapper/fsv /mnt/fsv && cp -a /mnt/host/src/. /mnt/fsv/ && umount /mnt/fsv && e2fsck -f -n /dev/mapper/fsv; then echo "FS VM-MADE-DONE"; else echo "FS VM-MADE-FAIL"; fail=1; fi
dmsetup remove fsv
"#,
            th = table(&dev(first_disk)),
            tv = table(&dev(first_disk + 1)),
        );
        FsStage { script, key, tree }
    }

    fn check(&self, dir: &std::path::Path, output: &str, failures: &mut Vec<String>) {
        if !output.contains("FS HOST-MADE-OK") {
            failures.push("fs: the VM could not fsck/mount/verify the ext4 made by the host and encrypted by ucrypt".into());
        }
        if !output.contains("FS VM-MADE-DONE") {
            failures.push("fs: the VM could not make its ext4 on dm-crypt".into());
            return;
        }
        let mut img = std::fs::read(dir.join("fs-vm.img")).expect("read VM fs image");
        fs_cipher(&self.key).decrypt(0, &mut img).expect("decrypt");
        let plain = dir.join("fs-vm-plain.img");
        std::fs::write(&plain, &img).expect("write decrypted");
        let p = plain.to_str().expect("utf-8");
        if let Err(e) = vm::host("fsck.ext4", &["-f", "-n", p]) {
            failures.push(format!(
                "fs: fsck of the VM's ext4, decrypted by ucrypt, failed: {e}"
            ));
            return;
        }
        let out = dir.join("rdump");
        std::fs::create_dir_all(&out).expect("mkdir rdump");
        if let Err(e) = vm::host("debugfs", &["-R", &format!("rdump / {}", out.display()), p]) {
            failures.push(format!("fs: debugfs rdump failed: {e}"));
            return;
        }
        for (rel, want) in &self.tree {
            match std::fs::read(out.join(rel)) {
                Ok(got) if got == *want => {}
                Ok(_) => failures.push(format!("fs: {rel} differs in the VM-made ext4")),
                Err(e) => failures.push(format!("fs: {rel} missing from the VM-made ext4: {e}")),
            }
        }
        println!("FS host check of the VM-made ext4 (decrypted by ucrypt): fsck clean, {} files identical", self.tree.len());
    }
}
