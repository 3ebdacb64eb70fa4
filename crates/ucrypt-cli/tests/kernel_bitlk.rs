//! BitLocker writes against cryptsetup 2.6 and the kernel's dm-crypt, in one boot of a stock
//! Debian kernel under qemu (tests/vm/), both ways for each image of cryptsetup's
//! `bitlk-images.tar.xz` below:
//! - read: `ucrypt import --type bitlk` writes a seeded plaintext into a copy of the image;
//!   `cryptsetup open --type bitlk --readonly` in the VM reads it back byte for byte;
//! - write: `cryptsetup open --type bitlk` in the VM writes the plaintext into another copy;
//!   `ucrypt export --type bitlk` reads it back byte for byte.
//!
//! The plaintext covers the start of the volume: the sectors BitLocker moved (its boot
//! sectors, kept elsewhere in the volume and mapped back by both) and data sectors, below the
//! first FVE metadata area of each image. Needs qemu-system-x86_64 and a kernel
//! (tests/vm/install-deps.sh) and cryptsetup's test images: SKIPPED otherwise, unless CI is
//! set.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
/// Plaintext per case: guest dm-crypt runs emulated at a few MiB/s, and every image's first
/// FVE metadata area lies above 33 MiB.
const PLAIN_BYTES: usize = 1 << 20;
/// `images.conf`'s `PW` of every image used.
const PASSPHRASE: &[u8] = b"anaconda\n";

/// (case name, image in bitlk-images/): AES-XTS (Windows 10+) and AES-CBC without the
/// diffuser, 128- and 256-bit, and the Elephant diffuser (dm-crypt's `elephant` IV).
const CASES: &[(&str, &str)] = &[
    ("aes-xts-128", "bitlk-aes-xts-128.img"),
    ("aes-xts-256", "bitlk-aes-xts-256.img"),
    ("aes-cbc-128", "bitlk-aes-cbc-128.img"),
    ("aes-cbc-256", "bitlk-aes-cbc-256.img"),
    ("aes-cbc-elephant-128", "bitlk-aes-cbc-elephant-128.img"),
];

fn ucrypt(verb: &str, from: &std::path::Path, to: &std::path::Path) -> Result<String, String> {
    vm::host_in(
        BIN,
        &[verb, kit::s(from), kit::s(to), "--type", "bitlk"],
        PASSPHRASE,
    )
}

#[test]
fn bitlk_writes_match_cryptsetup_and_dm_crypt() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let Some((_images_tmp, images)) = cli_common::unpacked_images("bitlk-images") else {
        return;
    };
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("kernel-bitlk");
    let dir = &tmp.0;
    let plain = vm::random_file(&mut rng, &dir.join("plain.bin"), PLAIN_BYTES);

    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    // cryptsetup maps BitLocker's metadata areas as dm-zero segments.
    run.extra_mods.push("dm-zero".into());
    let mut script = String::from("set -u\nfail=0\nP=/mnt/host/plain.bin\n");
    let mut write_imgs = Vec::new();
    for (i, (name, image)) in CASES.iter().enumerate() {
        let r = dir.join(format!("read{i}.img"));
        let w = dir.join(format!("write{i}.img"));
        for img in [&r, &w] {
            std::fs::copy(images.join(image), img).expect("copy the image");
        }
        ucrypt("import", &dir.join("plain.bin"), &r)
            .unwrap_or_else(|e| panic!("{name}: import: {e}"));
        run.disk(&r, true);
        run.disk(&w, false);
        let dr = format!("/dev/vd{}", (b'a' + 2 * i as u8) as char);
        let dw = format!("/dev/vd{}", (b'a' + 2 * i as u8 + 1) as char);
        let pw = "echo anaconda | cryptsetup open --type bitlk";
        script.push_str(&vm::both_ways_case(
            name,
            i,
            image,
            &format!("{pw} --readonly {dr}"),
            &format!("{pw} {dw}"),
            Some(PLAIN_BYTES),
        ));
        write_imgs.push(w);
    }
    script.push_str("sync\nexit $fail\n");
    run.script = script;
    let out = run.run(dir);
    println!(
        "VM run (BitLocker cases) took {:.1} s",
        out.elapsed.as_secs_f64()
    );

    let names = CASES.iter().map(|c| c.0);
    let failures = vm::both_ways_failures(&out.output, names, "BitLocker", &plain, |i| {
        let back = dir.join(format!("back{i}.bin"));
        ucrypt("export", &write_imgs[i], &back)?;
        let mut got = std::fs::read(&back).map_err(|e| format!("reading the export: {e}"))?;
        got.truncate(PLAIN_BYTES);
        Ok(got)
    });
    assert!(
        failures.is_empty(),
        "seed {seed:#x}: {failures:#?}\n--- VM output ---\n{}",
        out.output
    );
}
