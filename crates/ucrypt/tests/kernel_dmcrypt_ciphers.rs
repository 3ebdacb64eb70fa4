//! The ciphers beyond AES-XTS/CBC (serpent, twofish, camellia in XTS and CBC with plain, ESSIV
//! and benbi IVs; LRW-AES; Adiantum with XChaCha12 and XChaCha20; their `capi:` spellings)
//! against the Linux kernel's dm-crypt, byte-exact in both directions, in one boot of a stock
//! Debian kernel under qemu (tests/vm/), as kernel_dmcrypt.rs does for AES.
//!
//! Every case has its own region of two shared disks (so one boot holds them all):
//! - read: the host encrypts a seeded plaintext with [`SectorCipher`] into its region of the
//!   read disk; in the VM dm-crypt maps that region and it must equal the plaintext;
//! - write: in the VM dm-crypt writes the plaintext into its region of the zeroed write disk;
//!   on the host that ciphertext must equal ucrypt's byte for byte and decrypt to the plaintext,
//!   and nothing outside the regions may change.
//!
//! Specs ucrypt refuses because the kernel cannot key them (an ESSIV digest that is not a key
//! size of the cipher) must be refused by the kernel too.
//!
//! The guest first loads the crypto modules the cases need and prints which it has; a module
//! the kernel lacks fails the test (its cases would otherwise prove nothing). Needs
//! qemu-system-x86_64 and a kernel (tests/vm/install-deps.sh); prints SKIPPED otherwise,
//! unless CI is set, where it fails.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::fmt::Write as _;

use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};

/// How the guest maps a region.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Opener {
    /// `dmsetup create NAME --table "0 LEN crypt SPEC HEXKEY IV_OFFSET DEV OFFSET [opts]"`.
    Dmsetup,
    /// `cryptsetup open --type plain` with a binary key file, `--offset` and `--skip`.
    CryptsetupPlain,
}

struct Case {
    name: &'static str,
    /// The spec as the kernel is given it (a `capi:` form stays one for the table line).
    spec: &'static str,
    key_bytes: usize,
    sector_bytes: u64,
    /// dm-crypt iv_offset, in 512-byte units.
    iv_offset: u64,
    iv_large_sectors: bool,
    opener: Opener,
}

const fn case(name: &'static str, spec: &'static str, key_bytes: usize, sector_bytes: u64) -> Case {
    Case {
        name,
        spec,
        key_bytes,
        sector_bytes,
        iv_offset: 0,
        iv_large_sectors: false,
        opener: Opener::Dmsetup,
    }
}

const CASES: &[Case] = &[
    case("serpent-xts512", "serpent-xts-plain64", 64, 512),
    case("serpent-xts256-4k", "serpent-xts-plain64", 32, 4096),
    case("twofish-xts512", "twofish-xts-plain64", 64, 512),
    case("twofish-xts256-4k", "twofish-xts-plain64", 32, 4096),
    case("camellia-xts512-4k", "camellia-xts-plain64", 64, 4096),
    case("camellia-xts384", "camellia-xts-plain64", 48, 512),
    case("serpent-cbc-essiv", "serpent-cbc-essiv:sha256", 32, 512),
    case("twofish-cbc-essiv-4k", "twofish-cbc-essiv:sha256", 32, 4096),
    case("camellia-cbc-essiv", "camellia-cbc-essiv:sha256", 16, 512),
    case("serpent-cbc-plain64-192", "serpent-cbc-plain64", 24, 512),
    case("twofish-cbc-plain64-4k", "twofish-cbc-plain64", 16, 4096),
    case("camellia-cbc-plain64", "camellia-cbc-plain64", 32, 512),
    Case {
        iv_offset: 77_777,
        ..case("serpent-xts-plain-ivoff", "serpent-xts-plain", 32, 512)
    },
    case("twofish-cbc-plain64be", "twofish-cbc-plain64be", 32, 512),
    case("camellia-xts-benbi", "camellia-xts-benbi", 32, 512),
    case("serpent-cbc-essiv-sha1", "serpent-cbc-essiv:sha1", 32, 512),
    case("aes-xts-essiv-wp256", "aes-xts-essiv:wp256", 32, 512),
    case("aes-lrw-benbi256", "aes-lrw-benbi", 32, 512),
    case("aes-lrw-benbi384-4k", "aes-lrw-benbi", 48, 4096),
    Case {
        iv_offset: 2048,
        iv_large_sectors: true,
        ..case("aes-lrw-benbi-large-iv", "aes-lrw-benbi", 40, 4096)
    },
    Case {
        iv_offset: 12_345,
        ..case("aes-lrw-plain64", "aes-lrw-plain64", 32, 512)
    },
    case("adiantum12-512", "xchacha12,aes-adiantum-plain64", 32, 512),
    case("adiantum20-4k", "xchacha20,aes-adiantum-plain64", 32, 4096),
    case("adiantum12-plain", "xchacha12,aes-adiantum-plain", 32, 1024),
    Case {
        iv_offset: 4096,
        opener: Opener::CryptsetupPlain,
        ..case(
            "adiantum12-4k-cryptsetup",
            "xchacha12,aes-adiantum-plain64",
            32,
            4096,
        )
    },
    Case {
        opener: Opener::CryptsetupPlain,
        ..case("serpent-xts-cryptsetup", "serpent-xts-plain64", 64, 4096)
    },
    case("capi-xts-serpent", "capi:xts(serpent)-plain64", 64, 512),
    case(
        "capi-cbc-twofish-essiv",
        "capi:cbc(twofish)-essiv:sha256",
        32,
        512,
    ),
    case("capi-lrw-aes", "capi:lrw(aes)-benbi", 32, 512),
    case(
        "capi-adiantum20",
        "capi:adiantum(xchacha20,aes)-plain64",
        32,
        4096,
    ),
];

/// Table lines both must refuse: (spec, key bytes). ESSIV keys the mode's cipher with the
/// digest: SHA-1's 160 bits key neither AES nor twofish, SHA-512's 512 bits no cipher here.
const REFUSED: &[(&str, usize)] = &[
    ("aes-cbc-essiv:sha1", 32),
    ("twofish-cbc-essiv:sha1", 32),
    ("serpent-cbc-essiv:sha512", 32),
];

/// The modules the cases need, loaded by the initramfs (build-initramfs.sh loads the rest:
/// xts, essiv, serpent_generic, twofish_generic, chacha_generic, nhpoly1305, adiantum).
const EXTRA_MODS: &[&str] = &["camellia_generic", "lrw", "wp512", "sha512_generic"];
/// Checked in the guest before the cases: a missing one fails the run.
const MODULES: &[&str] = &[
    "dm_crypt",
    "xts",
    "essiv",
    "lrw",
    "serpent_generic",
    "twofish_generic",
    "camellia_generic",
    "wp512",
    "chacha_generic",
    "nhpoly1305",
    "adiantum",
];

/// Plaintext per case. Guest dm-crypt runs emulated at a few MiB/s: keep it small.
const PLAIN_BYTES: usize = 256 << 10;
/// Each case's region: its data and a gap of filler before the next, so a mapping at the wrong
/// offset or a write past its end cannot go unnoticed.
const REGION_BYTES: usize = PLAIN_BYTES + (64 << 10);
/// Filler of the read disk outside the regions' data.
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

/// The guest command that maps region `i` of `dev` as `/dev/mapper/NAME`.
fn open_cmd(case: &Case, i: usize, key: &[u8], dev: &str, name: &str, key_file: &str) -> String {
    let offset = (i * REGION_BYTES / 512) as u64;
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
                "dmsetup create {name} --table \"0 {} crypt {} {} {} {dev} {offset}{opts}\" && dmsetup mknodes {name}",
                PLAIN_BYTES / 512,
                case.spec,
                kit::hex(key),
                case.iv_offset,
            )
        }
        Opener::CryptsetupPlain => format!(
            "cryptsetup open --type plain --batch-mode --cipher {} --key-size {} --key-file {key_file} \
             --sector-size {} --offset {offset} --skip {} --size {} {dev} {name}",
            case.spec,
            case.key_bytes * 8,
            case.sector_bytes,
            case.iv_offset,
            PLAIN_BYTES / 512
        ),
    }
}

fn close_cmd(case: &Case, name: &str) -> String {
    match case.opener {
        Opener::Dmsetup => format!("dmsetup remove {name}"),
        Opener::CryptsetupPlain => format!("cryptsetup close {name}"),
    }
}

#[test]
fn kernel_dmcrypt_matches_ucrypt_for_every_cipher() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("dmcrypt-ciphers");
    let dir = &tmp.0;

    let plain = vm::random_file(&mut rng, &dir.join("plain.bin"), PLAIN_BYTES);
    let disk_bytes = CASES.len() * REGION_BYTES;
    let mut read_disk = vec![FILLER; disk_bytes];

    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    run.extra_mods = EXTRA_MODS.iter().map(|m| m.to_string()).collect();
    let mut script = String::from("set -u\nfail=0\nP=/mnt/host/plain.bin\n");
    for m in MODULES {
        writeln!(
            script,
            "if grep -q '^{m} ' /proc/modules || [ -d /sys/module/{m} ]; then echo \"MODULE {m} OK\"; else echo \"MODULE {m} MISSING\"; fail=1; fi"
        )
        .expect("format");
    }
    let mut keys = Vec::new();
    let mut expected_ct = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let mut key = vec![0u8; case.key_bytes];
        rng.fill(&mut key);
        std::fs::write(dir.join(format!("key{i}.bin")), &key).expect("write key file");
        let mut ct = plain.clone();
        cipher(case, &key).encrypt(0, &mut ct).expect("encrypt");
        read_disk[i * REGION_BYTES..i * REGION_BYTES + PLAIN_BYTES].copy_from_slice(&ct);
        let kf = format!("/mnt/host/key{i}.bin");
        let name = case.name;
        writeln!(
            script,
            "echo \"== {name}: {} key {} bits, sector {}, iv_offset {}, large {}, via {:?}\"\n\
             if {open_r} && [ -b /dev/mapper/r{i} ] && cmp /dev/mapper/r{i} $P; then echo \"CASE {name} READ-OK\"; else echo \"CASE {name} READ-FAIL\"; fail=1; fi\n\
             {close_r}\n\
             if {open_w} && [ -b /dev/mapper/w{i} ] && dd if=$P of=/dev/mapper/w{i} bs=65536 conv=fsync 2>/dev/null; then echo \"CASE {name} WRITE-DONE\"; else echo \"CASE {name} WRITE-FAIL\"; fail=1; fi\n\
             {close_w}",
            case.spec,
            case.key_bytes * 8,
            case.sector_bytes,
            case.iv_offset,
            case.iv_large_sectors,
            case.opener,
            open_r = open_cmd(case, i, &key, "/dev/vda", &format!("r{i}"), &kf),
            close_r = close_cmd(case, &format!("r{i}")),
            open_w = open_cmd(case, i, &key, "/dev/vdb", &format!("w{i}"), &kf),
            close_w = close_cmd(case, &format!("w{i}")),
        )
        .expect("format script");
        keys.push(key);
        expected_ct.push(ct);
    }
    for (j, (spec, key_bytes)) in REFUSED.iter().enumerate() {
        let err = spec
            .parse::<CipherSpec>()
            .expect_err("ucrypt refuses the spec");
        assert!(err.to_string().contains("ESSIV"), "{spec}: {err}");
        writeln!(
            script,
            "if dmsetup create x{j} --table \"0 8 crypt {spec} {} 0 /dev/vda 0\" 2>/dev/null; then echo \"REFUSE {spec} ACCEPTED\"; dmsetup remove x{j}; fail=1; else echo \"REFUSE {spec} REFUSED\"; fi",
            kit::hex(&vec![0x11u8; *key_bytes])
        )
        .expect("format");
    }
    // Which kernel drivers served the cases (generic C, or an arch-specific one).
    script.push_str(
        "echo '== drivers'; grep -E '^driver' /proc/crypto | grep -E 'serpent|twofish|camellia|lrw|adiantum|essiv|xts' | sort -u\n",
    );
    script.push_str("sync\nexit $fail\n");
    let read_img = dir.join("read.img");
    std::fs::write(&read_img, &read_disk).expect("write read disk");
    let write_img = dir.join("write.img");
    std::fs::write(&write_img, vec![0u8; disk_bytes]).expect("write zero disk");
    run.disk(&read_img, true);
    run.disk(&write_img, false);
    run.script = script;

    let out = run.run(dir);
    println!(
        "VM run took {:.1} s for {} cases",
        out.elapsed.as_secs_f64(),
        CASES.len()
    );

    let mut failures = Vec::new();
    for m in MODULES {
        if !out.output.contains(&format!("MODULE {m} OK")) {
            failures.push(format!("the guest kernel lacks module {m}"));
        }
    }
    for (spec, _) in REFUSED {
        if !out.output.contains(&format!("REFUSE {spec} REFUSED")) {
            failures.push(format!(
                "{spec}: the kernel did not refuse what ucrypt refuses"
            ));
        }
    }
    let written = std::fs::read(&write_img).expect("read VM-written disk");
    assert_eq!(written.len(), disk_bytes, "write disk size changed");
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
        let region = &written[i * REGION_BYTES..(i + 1) * REGION_BYTES];
        let (got, gap) = region.split_at(PLAIN_BYTES);
        if gap.iter().any(|&b| b != 0) {
            failures.push(format!("{}: dm-crypt wrote past its region", case.name));
        }
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
    assert!(
        failures.is_empty() && out.status == 0,
        "seed {seed}, VM exit {}: {failures:#?}",
        out.status
    );
}
