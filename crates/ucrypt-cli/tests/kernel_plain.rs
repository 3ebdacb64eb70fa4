//! cryptsetup's plain mode (a headerless volume whose key is one hash of the passphrase)
//! against cryptsetup 2.6 and the kernel's dm-crypt, in one boot of a stock Debian kernel
//! under qemu (tests/vm/), both ways for each case:
//! - read: `ucrypt import` writes a seeded plaintext with the passphrase; `cryptsetup open
//!   --type plain` with the same options in the VM reads it back byte for byte;
//! - write: `cryptsetup open --type plain` in the VM writes the plaintext; `ucrypt export`
//!   with the same options reads it back byte for byte.
//!
//! The cases cover what "Passphrase processing for PLAIN mode" (`man cryptsetup`) describes:
//! the default hash (ripemd160) and key size (256 bits), a key longer than the hash (extended
//! by hashing again), `--hash plain` (zero-padded passphrase), `--hash HASH:LEN`, a key file
//! (the key itself, from `--keyfile-offset`), `--key-file -` (all of stdin, newline kept),
//! `--offset`/`--skip`. Needs qemu-system-x86_64 and a kernel (tests/vm/install-deps.sh):
//! SKIPPED otherwise, unless CI is set.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

use std::path::Path;

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
/// Plaintext per case; guest dm-crypt runs emulated at a few MiB/s.
const PLAIN_BYTES: usize = 1 << 20;
const PASSPHRASE: &str = "plain-mode passphrase";

struct Case {
    name: &'static str,
    /// Options both tools are given (ucrypt needs --cipher where cryptsetup takes its
    /// default: `ucrypt export` has no `--type plain`).
    opts: &'static [&'static str],
    /// ucrypt only: the cipher cryptsetup takes by default.
    ucrypt_cipher: Option<&'static str>,
    /// How the secret is given: a line on stdin, all of stdin (`--key-file -`), or the key
    /// file.
    input: Input,
    /// 512-byte sectors before the data (`--offset`), so the image is that much larger.
    offset_sectors: usize,
}

#[derive(Clone, Copy)]
enum Input {
    Line,
    StdinFile,
    KeyFile,
}

const CASES: &[Case] = &[
    Case {
        name: "defaults",
        opts: &[],
        ucrypt_cipher: Some("aes-cbc-essiv:sha256"),
        input: Input::Line,
        offset_sectors: 0,
    },
    Case {
        name: "sha256-key-longer-than-hash",
        opts: &[
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "512",
            "--hash",
            "sha256",
        ],
        ucrypt_cipher: None,
        input: Input::Line,
        offset_sectors: 0,
    },
    Case {
        name: "hash-plain",
        opts: &[
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "512",
            "--hash",
            "plain",
        ],
        ucrypt_cipher: None,
        input: Input::Line,
        offset_sectors: 0,
    },
    Case {
        name: "hash-with-length",
        opts: &[
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "512",
            "--hash",
            "sha512:40",
        ],
        ucrypt_cipher: None,
        input: Input::Line,
        offset_sectors: 0,
    },
    Case {
        name: "key-file",
        opts: &[
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "512",
            "--keyfile-offset",
            "7",
        ],
        ucrypt_cipher: None,
        input: Input::KeyFile,
        offset_sectors: 0,
    },
    Case {
        name: "stdin-key-file",
        opts: &["--cipher", "aes-cbc-essiv:sha256", "--hash", "sha256"],
        ucrypt_cipher: None,
        input: Input::StdinFile,
        offset_sectors: 0,
    },
    Case {
        name: "offset-skip",
        opts: &["--offset", "8", "--skip", "3"],
        ucrypt_cipher: Some("aes-cbc-essiv:sha256"),
        input: Input::Line,
        offset_sectors: 8,
    },
];

/// What the case feeds on stdin, and the extra options that say where the secret is.
fn secret(case: &Case, key_file: &Path) -> (Vec<u8>, Vec<String>) {
    match case.input {
        Input::Line => (format!("{PASSPHRASE}\n").into_bytes(), Vec::new()),
        Input::StdinFile => (
            format!("{PASSPHRASE}\n").into_bytes(),
            vec!["--key-file".into(), "-".into()],
        ),
        Input::KeyFile => (
            Vec::new(),
            vec!["--key-file".into(), kit::s(key_file).to_string()],
        ),
    }
}

fn ucrypt(args: &[String], input: &[u8]) -> Result<String, String> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    vm::host_in(BIN, &args, input)
}

fn ucrypt_opts(case: &Case, key_file: &Path) -> Vec<String> {
    let mut v: Vec<String> = case.opts.iter().map(|s| s.to_string()).collect();
    if let Some(c) = case.ucrypt_cipher {
        v.extend(["--cipher".to_string(), c.to_string()]);
    }
    v.extend(secret(case, key_file).1);
    v
}

#[test]
fn plain_mode_matches_cryptsetup_and_dm_crypt() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("kernel-plain");
    let dir = &tmp.0;
    let key_file = dir.join("key");
    let mut key = vec![0u8; 128];
    rng.fill(&mut key);
    std::fs::write(&key_file, &key).expect("key file");
    let mut plain = vec![0u8; PLAIN_BYTES];
    rng.fill(&mut plain);
    let plain_path = dir.join("plain.bin");
    std::fs::write(&plain_path, &plain).expect("plaintext");

    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    let mut script = String::from("set -u\nfail=0\nP=/mnt/host/plain.bin\n");
    let mut disks = 0usize;
    let mut write_imgs = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let bytes = (PLAIN_BYTES + case.offset_sectors * 512) as u64;
        let r = dir.join(format!("read{i}.img"));
        let w = dir.join(format!("write{i}.img"));
        for img in [&r, &w] {
            std::fs::File::create(img)
                .and_then(|f| f.set_len(bytes))
                .expect("image");
        }
        let (input, _) = secret(case, &key_file);
        let mut args = vec![
            "import".to_string(),
            kit::s(&plain_path).to_string(),
            kit::s(&r).to_string(),
        ];
        args.extend(ucrypt_opts(case, &key_file));
        ucrypt(&args, &input).unwrap_or_else(|e| panic!("{}: import: {e}", case.name));
        run.disk(&r, true);
        run.disk(&w, false);
        let dr = format!("/dev/vd{}", (b'a' + disks as u8) as char);
        let dw = format!("/dev/vd{}", (b'a' + disks as u8 + 1) as char);
        disks += 2;
        let opts = case.opts.join(" ");
        let (feed, key_opt) = match case.input {
            Input::Line => (format!("printf '%s\\n' '{PASSPHRASE}' | "), String::new()),
            Input::StdinFile => (
                format!("printf '%s\\n' '{PASSPHRASE}' | "),
                " --key-file -".to_string(),
            ),
            Input::KeyFile => (String::new(), " --key-file /mnt/host/key".to_string()),
        };
        let open = format!("{feed}cryptsetup open --type plain --batch-mode");
        script.push_str(&vm::both_ways_case(
            case.name,
            i,
            &format!("{opts}{key_opt}"),
            &format!("{open} --readonly {opts}{key_opt} {dr}"),
            &format!("{open} {opts}{key_opt} {dw}"),
            Some(PLAIN_BYTES),
        ));
        write_imgs.push(w);
    }
    script.push_str("sync\nexit $fail\n");
    run.script = script;
    let out = run.run(dir);
    println!(
        "VM run (plain-mode cases) took {:.1} s",
        out.elapsed.as_secs_f64()
    );

    let names = CASES.iter().map(|c| c.name);
    let failures = vm::both_ways_failures(&out.output, names, "plain", &plain, |i| {
        let back = dir.join(format!("back{i}.bin"));
        let (input, _) = secret(&CASES[i], &key_file);
        let mut args = vec![
            "export".to_string(),
            kit::s(&write_imgs[i]).to_string(),
            kit::s(&back).to_string(),
        ];
        args.extend(ucrypt_opts(&CASES[i], &key_file));
        ucrypt(&args, &input)?;
        Ok(std::fs::read(&back).expect("export"))
    });
    assert!(
        failures.is_empty(),
        "seed {seed:#x}: {failures:#?}\n--- VM output ---\n{}",
        out.output
    );
}
