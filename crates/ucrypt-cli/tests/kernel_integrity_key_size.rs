//! cryptsetup 2.8's `--integrity-key-size` against the kernel: volumes `ucrypt format
//! --integrity hmac-* --integrity-key-size BITS` makes (the segment records the HMAC key's
//! bytes as `integrity.key_size`) are opened in a VM by dm-integrity and dm-crypt with the
//! table cryptsetup 2.8 loads for them (`capi:authenc(hmac(H),MODE(aes))-IV`, the whole volume
//! key, `integrity:TAG:aead integrity_key_size:BYTES`; dm-crypt 1.28, Linux 6.11 and later:
//! Debian trixie's 6.12 kernel of the VM kit). Neither Debian's cryptsetup 2.6 nor 2.7 can
//! open such a volume, so the test loads the tables with `dmsetup`, as cryptsetup would.
//!
//! Each case: ucrypt formats (wiping the data area) with a known volume key and imports a
//! seeded plaintext; the kernel reads it back and reads the whole device (every tag
//! verifies), then writes a second plaintext; `ucrypt export` reads the kernel's writes. A
//! control loads the same key without `integrity_key_size`: the kernel splits it by the
//! hash's size instead and either refuses the cipher key that leaves or fails every read.
//! Cases: aes-xts-plain64 + hmac-sha256 with a 264-bit HMAC key (a line of 2.8's
//! luks2-integrity-test, legacy padding, 512-byte sectors); aes-xts-random + hmac-sha512 with
//! 792 bits (4096-byte sectors); aes-cbc-essiv:sha256 (128-bit key) + hmac-sha256 with 320
//! bits, whose control splits into a valid AES-192 key and fails authentication.
//! Needs qemu-system-x86_64 and the trixie kernel (tests/vm/): SKIPPED otherwise, unless CI
//! is set.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use kit::vm;

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
/// The LUKS2 metadata (`--offset 8192`), then the dm-integrity device.
const OFFSET_SECTORS: u64 = 8192;
const IMAGE_BYTES: u64 = 10 << 20;
/// Plaintext per case, each way.
const PLAIN_BYTES: usize = 1 << 20;

struct Case {
    name: &'static str,
    cipher: &'static str,
    /// The kernel's cipher spec for it.
    capi: &'static str,
    integrity: &'static str,
    key_bits: u32,
    mac_key_bits: u32,
    sector: u32,
    extra: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        name: "xts-plain64-sha256-264",
        cipher: "aes-xts-plain64",
        capi: "capi:authenc(hmac(sha256),xts(aes))-plain64",
        integrity: "hmac-sha256",
        key_bits: 512,
        mac_key_bits: 264,
        sector: 512,
        extra: &["--integrity-legacy-padding"],
    },
    Case {
        name: "xts-random-sha512-792",
        cipher: "aes-xts-random",
        capi: "capi:authenc(hmac(sha512),xts(aes))-random",
        integrity: "hmac-sha512",
        key_bits: 512,
        mac_key_bits: 792,
        sector: 4096,
        extra: &[],
    },
    Case {
        name: "cbc-essiv-sha256-320",
        cipher: "aes-cbc-essiv:sha256",
        capi: "capi:authenc(hmac(sha256),cbc(aes))-essiv:sha256",
        integrity: "hmac-sha256",
        key_bits: 128,
        mac_key_bits: 320,
        sector: 512,
        extra: &[],
    },
];

fn ucrypt_ok(args: &[&str]) -> String {
    let o = Command::new(BIN).args(args).output().expect("spawn ucrypt");
    assert!(
        o.status.success(),
        "ucrypt {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn sha256(data: &[u8], dir: &Path) -> String {
    let f = dir.join("sum.tmp");
    std::fs::write(&f, data).expect("write");
    let out = vm::host("sha256sum", &[s(&f)]).expect("sha256sum");
    out.split(' ').next().unwrap_or("").to_string()
}

/// The dm-integrity superblock's tag size and provided data sectors.
fn superblock(img: &Path) -> (u16, u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(img).expect("image");
    let mut sb = [0u8; 64];
    f.read_exact_at(&mut sb, OFFSET_SECTORS * 512)
        .expect("superblock");
    assert_eq!(&sb[..8], b"integrt\0", "no dm-integrity superblock");
    let tag = u16::from_le_bytes([sb[10], sb[11]]);
    let sectors = u64::from_le_bytes(sb[16..24].try_into().expect("8 bytes"));
    (tag, sectors)
}

/// One case's lines of the guest script on `dev`.
fn script_for(c: &Case, dev: &str, vk: &[u8], tag: u16, sectors: u64, p1_sum: &str) -> String {
    let n = c.name.replace('-', "_");
    let hex = kit::hex(vk);
    let sectors = sectors / u64::from(c.sector / 512) * u64::from(c.sector / 512);
    let int_opts = if c.sector == 512 {
        "0".to_string()
    } else {
        format!("1 block_size:{}", c.sector)
    };
    let sector_opt = if c.sector == 512 {
        String::new()
    } else {
        format!(" sector_size:{}", c.sector)
    };
    let base_opts = 1 + usize::from(c.sector != 512);
    let crypt = |key_size: bool| {
        format!(
            "0 {sectors} crypt {} {hex} 0 /dev/mapper/{n}_dif 0 {}{sector_opt} integrity:{tag}:aead{}",
            c.capi,
            base_opts + usize::from(key_size),
            if key_size {
                format!(" integrity_key_size:{}", c.mac_key_bits / 8)
            } else {
                String::new()
            }
        )
    };
    let mut o = String::new();
    let _ = writeln!(o, "echo '== {}'", c.name);
    let _ = writeln!(
        o,
        "dmsetup create {n}_dif --table \"0 {sectors} integrity {dev} {OFFSET_SECTORS} {tag} D {int_opts}\" && dmsetup mknodes {n}_dif || echo 'FAIL-INTEGRITY {}'",
        c.name
    );
    // The control: the key split by the hash's output size.
    let _ = writeln!(
        o,
        "if dmsetup create {n}_ctl --table \"{}\"; then dmsetup mknodes {n}_ctl; \
         if dd if=/dev/mapper/{n}_ctl of=/dev/null bs=4096 count=16 2>/dev/null; \
         then echo 'CONTROL-READ {}'; else echo 'CONTROL-EIO {}'; fi; dmsetup remove {n}_ctl; \
         else echo 'CONTROL-REFUSED {}'; fi",
        crypt(false),
        c.name,
        c.name,
        c.name
    );
    let _ = writeln!(
        o,
        "dmsetup create {n} --table \"{}\" && dmsetup mknodes {n} || echo 'FAIL-CRYPT {}'",
        crypt(true),
        c.name
    );
    let _ = writeln!(
        o,
        "[ \"$(dd if=/dev/mapper/{n} bs=65536 count={} 2>/dev/null | sha256sum | cut -d' ' -f1)\" = {p1_sum} ] && echo 'PLAIN-READ-OK {}'",
        PLAIN_BYTES / 65536,
        c.name
    );
    let _ = writeln!(
        o,
        "dd if=/dev/mapper/{n} of=/dev/null bs=65536 2>/dev/null && echo 'ALL-READ-OK {}'",
        c.name
    );
    let _ = writeln!(
        o,
        "dd if=/mnt/host/{}.p2 of=/dev/mapper/{n} bs=65536 2>/dev/null && sync && echo 'WRITE-OK {}'",
        c.name, c.name
    );
    let _ = writeln!(o, "dmsetup remove {n}; dmsetup remove {n}_dif");
    o
}

#[test]
fn integrity_key_size_volumes_with_the_kernel() {
    let Some((kernel, modroot)) = vm::require_trixie_vm("kernel_integrity_key_size") else {
        return;
    };
    let tmp = kit::TempDir::new("integrity-key-size-vm");
    let share = tmp.0.join("share");
    std::fs::create_dir_all(&share).expect("share");
    let pass = tmp.0.join("pass");
    std::fs::write(&pass, b"integrity key size").expect("pass");
    let mut rng = kit::SplitMix(kit::seed());
    let mut script = String::from("modprobe dm-integrity; modprobe dm-crypt\n");
    let mut images = Vec::new();
    for (i, c) in CASES.iter().enumerate() {
        let img = tmp.0.join(format!("{}.img", c.name));
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(IMAGE_BYTES))
            .expect("image");
        let vk_len = ((c.key_bits + c.mac_key_bits) / 8) as usize;
        let vk_path = tmp.0.join(format!("{}.vk", c.name));
        let vk = vm::random_file(&mut rng, &vk_path, vk_len);
        let (key_bits, mac_bits, sector) = (
            c.key_bits.to_string(),
            c.mac_key_bits.to_string(),
            c.sector.to_string(),
        );
        let offset = OFFSET_SECTORS.to_string();
        let mut a: Vec<&str> = vec![
            "luksFormat",
            "-q",
            "--type",
            "luks2",
            "-c",
            c.cipher,
            "--integrity",
            c.integrity,
            "--integrity-key-size",
            mac_bits.as_str(),
            "-s",
            key_bits.as_str(),
            "--sector-size",
            sector.as_str(),
            "--offset",
            offset.as_str(),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--volume-key-file",
            s(&vk_path),
            "--key-file",
            s(&pass),
            s(&img),
        ];
        a.extend(c.extra);
        ucrypt_ok(&a);
        let p1_path = tmp.0.join(format!("{}.p1", c.name));
        let p1 = vm::random_file(&mut rng, &p1_path, PLAIN_BYTES);
        ucrypt_ok(&["import", s(&p1_path), s(&img), "--key-file", s(&pass)]);
        vm::random_file(&mut rng, &share.join(format!("{}.p2", c.name)), PLAIN_BYTES);
        let (tag, sectors) = superblock(&img);
        let dev = format!("/dev/vd{}", (b'a' + i as u8) as char);
        script += &script_for(c, &dev, &vk, tag, sectors, &sha256(&p1, &tmp.0));
        images.push(img);
    }
    script += "echo VM-DONE\n";
    let mut run = vm::VmRun::new(script);
    for img in &images {
        run.disk(img, false);
    }
    run.share = Some(share.clone());
    run.kernel = Some(kernel);
    run.modroot = Some(modroot);
    run.extra_mods = vec!["xts".into(), "essiv".into()];
    run.silence_max_s = Some(120);
    let out = run.run(&tmp.0);
    assert!(out.output.contains("VM-DONE"), "the VM script did not end");
    let mut failed = Vec::new();
    for c in CASES {
        for marker in ["PLAIN-READ-OK", "ALL-READ-OK", "WRITE-OK"] {
            if !out.output.contains(&format!("{marker} {}", c.name)) {
                failed.push(format!("{}: no {marker}", c.name));
            }
        }
        let control_failed = out.output.contains(&format!("CONTROL-REFUSED {}", c.name))
            || out.output.contains(&format!("CONTROL-EIO {}", c.name));
        if !control_failed {
            failed.push(format!(
                "{}: the key split by the hash's size was not refused",
                c.name
            ));
        }
    }
    // The essiv case's control loads (AES-192 and a 32-byte MAC key) and must fail to read.
    if !out.output.contains("CONTROL-EIO cbc-essiv-sha256-320") {
        failed.push("cbc-essiv-sha256-320: the control did not fail authentication".into());
    }
    // The kernel's writes, read by ucrypt.
    for (c, img) in CASES.iter().zip(&images) {
        let got = tmp.0.join(format!("{}.out", c.name));
        ucrypt_ok(&["export", s(img), s(&got), "--key-file", s(&pass)]);
        let got = std::fs::read(&got).expect("export");
        let p2 = std::fs::read(share.join(format!("{}.p2", c.name))).expect("p2");
        if got.len() < PLAIN_BYTES || got[..PLAIN_BYTES] != p2[..] {
            failed.push(format!(
                "{}: ucrypt does not read the kernel's writes",
                c.name
            ));
        }
        if got[PLAIN_BYTES.min(got.len())..].iter().any(|&b| b != 0) {
            failed.push(format!("{}: the wipe does not read as zeroes", c.name));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
