//! FileVault2: the image of cryptsetup's `tests/fvault2-images.tar.xz` with the checks of its
//! `fvault2-compat-test`: the dump fields (physical volume and family UUIDs, logical volume
//! offset and size, PBKDF2 iterations and salt), the volume key with the script's passphrase,
//! `open --test-passphrase`, and the data: `export --type fvault2` stands for the script's
//! activation, and the plaintext's SHA-256 must be the sum the script expects. Where
//! cryptsetup is installed, its `fvault2Dump` (with and without `--dump-volume-key`) runs
//! beside ucrypt's and the two outputs must be equal line for line.
//!
//! SKIPPED when cryptsetup's test material cannot be had or xz is missing. The kernel's own
//! mapping of the image is checked in the VM (`fvault2_image_in_the_kernel`).

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use cli_common::{have, run_in, text, UCRYPT};
use sha2::{Digest, Sha256};

const PASSPHRASE: &str = "heslo123";

/// fvault2-compat-test's `check_dump` pairs.
const FIELDS: [(&str, &str); 6] = [
    (
        "Physical volume UUID",
        "fc52bfae-5a1f-4f9b-b3a6-f33303a0e401",
    ),
    ("Family UUID", "33a76caa-1481-4bc5-8d04-1ac1707c19c0"),
    ("Logical volume offset", "67108864 [bytes]"),
    ("Logical volume size", "167772160 [bytes]"),
    ("PBKDF2 iterations", "204222"),
    (
        "PBKDF2 salt",
        "2c 24 9e db 66 63 d6 fb cc 79 05 b7 a4 d7 27 52",
    ),
];
const VOLUME_KEY: &str = "20 73 4d 33 89 21 27 74 d7 61 0c 29 d7 32 88 09 16 f3 be 14 c4 b1 2a \
                          c7 aa f0 7e 5c cc 77 b3 19";
const PLAINTEXT_SHA256: &str = "2c662e36c0f7e2f5583e6a939bbcbdc660805692d0fccaa45ad4052beb3b8e18";

/// The script's `sed -n "s|$key:\s*\(.*\)|\1|p" | sed 's|\s*$||'`.
fn field(dump: &str, key: &str) -> Option<String> {
    dump.lines()
        .find_map(|l| l.split_once(&format!("{key}:")).map(|(_, v)| v))
        .map(|v| v.trim().to_string())
}

#[test]
fn fvault2_image() {
    let Some((tmp, dir)) = cli_common::unpacked_images("fvault2-images") else {
        return;
    };
    let img = dir.join("small");
    let img = img.to_str().unwrap();

    // HEADER CHECK.
    let dump = run_in(UCRYPT, &["fvault2Dump", img], b"");
    assert!(dump.status.success(), "fvault2Dump: {}", text(&dump));
    let dump = String::from_utf8(dump.stdout).unwrap();
    for (k, v) in FIELDS {
        assert_eq!(field(&dump, k).as_deref(), Some(v), "{k} in:\n{dump}");
    }
    let args = ["fvault2Dump", img, "--dump-volume-key", "-q"];
    let with_key = run_in(UCRYPT, &args, format!("{PASSPHRASE}\n").as_bytes());
    assert!(with_key.status.success(), "{}", text(&with_key));
    let with_key = String::from_utf8(with_key.stdout).unwrap();
    assert_eq!(field(&with_key, "Volume key").as_deref(), Some(VOLUME_KEY));
    let wrong = run_in(UCRYPT, &args, b"heslo124\n");
    assert_eq!(wrong.status.code(), Some(2), "{}", text(&wrong));

    // Beside cryptsetup: the same text, line for line.
    if have("cryptsetup") {
        let cs = run_in("cryptsetup", &["fvault2Dump", img], b"");
        if cs.status.success() {
            assert_eq!(String::from_utf8_lossy(&cs.stdout), dump);
            let cs = run_in("cryptsetup", &args, format!("{PASSPHRASE}\n").as_bytes());
            assert!(cs.status.success(), "{}", text(&cs));
            assert_eq!(String::from_utf8_lossy(&cs.stdout), with_key);
        } else {
            eprintln!(
                "SKIPPED: dump not compared, cryptsetup cannot read the image here: {}",
                text(&cs)
            );
        }
    } else {
        eprintln!("SKIPPED: dump not compared with cryptsetup (not installed)");
    }

    let t = run_in(
        UCRYPT,
        &["open", "--type", "fvault2", "--test-passphrase", img],
        format!("{PASSPHRASE}\n").as_bytes(),
    );
    assert!(t.status.success(), "--test-passphrase: {}", text(&t));
    let t = run_in(
        UCRYPT,
        &["open", "--type", "fvault2", "--test-passphrase", img],
        b"wrong\n",
    );
    assert_eq!(t.status.code(), Some(2), "{}", text(&t));

    // ACTIVATION CHECK: the whole plaintext.
    let out = tmp.path("small.plain");
    let outs = out.to_str().unwrap();
    let e = run_in(
        UCRYPT,
        &[
            "export",
            "--type",
            "fvault2",
            "-r",
            "--key-file",
            "-",
            img,
            outs,
        ],
        PASSPHRASE.as_bytes(),
    );
    assert!(e.status.success(), "export: {}", text(&e));
    let data = std::fs::read(&out).unwrap();
    assert_eq!(data.len(), 167772160);
    let sum: String = Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(sum, PLAINTEXT_SHA256);

    // The volume key written by the dump opens the volume without a passphrase.
    let vk = tmp.path("vk");
    let vks = vk.to_str().unwrap();
    let d = run_in(
        UCRYPT,
        &[
            "fvault2Dump",
            img,
            "--dump-volume-key",
            "-q",
            "--volume-key-file",
            vks,
        ],
        format!("{PASSPHRASE}\n").as_bytes(),
    );
    assert!(d.status.success(), "{}", text(&d));
    assert_eq!(std::fs::read(&vk).unwrap().len(), 32);
    let e = run_in(
        UCRYPT,
        &[
            "export",
            "--type",
            "fvault2",
            "-r",
            "--volume-key-file",
            vks,
            img,
            outs,
        ],
        b"",
    );
    assert!(
        e.status.success(),
        "export with the volume key: {}",
        text(&e)
    );
    assert_eq!(std::fs::read(&out).unwrap(), data);
}

/// The script's ACTIVATION CHECK with the kernel: `cryptsetup open --type fvault2` in the VM
/// (tests/vm/) maps the image and the plaintext's SHA-256 is the script's sum, which ucrypt's
/// export gives too (`fvault2_image`). SKIPPED without the VM or cryptsetup's test material.
#[test]
fn fvault2_image_in_the_kernel() {
    if let Err(reason) = kit::vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let Some((tmp, dir)) = cli_common::unpacked_images("fvault2-images") else {
        return;
    };
    let img = dir.join("small");
    let mut run = kit::vm::VmRun::new(format!(
        "printf '%s' '{PASSPHRASE}' | cryptsetup open --type fvault2 --readonly --key-file - \
         /dev/vda fv || exit 1\n\
         echo \"SUM $(sha256sum /dev/mapper/fv | cut -d' ' -f1)\"\n\
         cryptsetup close fv\n"
    ));
    run.disk(&img, true);
    let out = run.run(tmp.dir());
    assert!(
        out.output.contains(&format!("SUM {PLAINTEXT_SHA256}")),
        "--- VM output ---\n{}",
        out.output
    );
}
