//! loop-AES against cryptsetup 2.6 and the kernel's dm-crypt (`aes-cbc-plain64` for one key,
//! `aes:64-cbc-lmk` for 64 and 65), in one boot of a stock Debian kernel under qemu
//! (tests/vm/), both ways for each case:
//! - read: `ucrypt import --type loopaes` writes a seeded plaintext; `cryptsetup loopaesOpen`
//!   with the same options in the VM reads it back byte for byte;
//! - write: `cryptsetup loopaesOpen` in the VM writes the plaintext; `ucrypt export --type
//!   loopaes` reads it back byte for byte.
//!
//! The cases: the three key file versions of `loopaes-test`, key sizes 128 and 256,
//! `--offset` with and without `--skip 0`, a key file and `--key-file -`. Needs
//! qemu-system-x86_64 and a kernel (tests/vm/install-deps.sh): SKIPPED otherwise, unless CI
//! is set.

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use kit::vm;

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
/// Plaintext per case; guest dm-crypt runs emulated at a few MiB/s.
const PLAIN_BYTES: usize = 1 << 20;

struct Case {
    name: &'static str,
    /// Key lines in the key file: 1, 64 or 65.
    keys: usize,
    opts: &'static [&'static str],
    /// The key file on standard input (`--key-file -`) rather than as a file.
    stdin: bool,
    /// 512-byte sectors before the data (`--offset`).
    offset_sectors: usize,
}

const CASES: &[Case] = &[
    Case {
        name: "v1-128",
        keys: 1,
        opts: &["-s", "128"],
        stdin: false,
        offset_sectors: 0,
    },
    Case {
        name: "v2-128-offset",
        keys: 64,
        opts: &["-s", "128", "-o", "16"],
        stdin: false,
        offset_sectors: 16,
    },
    Case {
        name: "v3-256-offset-skip0-stdin",
        keys: 65,
        opts: &["-s", "256", "-o", "16", "-p", "0"],
        stdin: true,
        offset_sectors: 16,
    },
    Case {
        name: "v3-128",
        keys: 65,
        opts: &["-s", "128"],
        stdin: false,
        offset_sectors: 0,
    },
];

fn ucrypt(args: &[String], input: &[u8]) -> Result<String, String> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    vm::host_in(BIN, &args, input)
}

/// `keys` lines of 60 base64 characters (loopaes-test's `uuencode -m` lines).
fn key_file(rng: &mut kit::SplitMix, keys: usize) -> Vec<u8> {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    for _ in 0..keys {
        let mut raw = [0u8; 60];
        rng.fill(&mut raw);
        out.extend(raw.iter().map(|b| B64[(b % 64) as usize]));
        out.push(b'\n');
    }
    out
}

/// ucrypt's options and standard input for `case` with the key file at `kf`.
fn ucrypt_opts(case: &Case, kf: &str, body: &[u8]) -> (Vec<String>, Vec<u8>) {
    let mut v: Vec<String> = ["--type", "loopaes"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(case.opts.iter().map(|s| s.to_string()));
    v.push("--key-file".into());
    if case.stdin {
        v.push("-".into());
        (v, body.to_vec())
    } else {
        v.push(kf.into());
        (v, Vec::new())
    }
}

#[test]
fn loopaes_matches_cryptsetup_and_dm_crypt() {
    if let Err(reason) = vm::require_vm() {
        println!("SKIPPED: {reason}");
        return;
    }
    let seed = kit::seed();
    let mut rng = kit::SplitMix(seed);
    let tmp = kit::TempDir::new("kernel-loopaes");
    let dir = &tmp.0;
    let mut plain = vec![0u8; PLAIN_BYTES];
    rng.fill(&mut plain);
    let plain_path = dir.join("plain.bin");
    std::fs::write(&plain_path, &plain).expect("plaintext");

    let mut run = vm::VmRun::new("");
    run.share = Some(dir.clone());
    // cryptsetup reads `--key-file -` of loop-AES through /dev/stdin, which the initramfs
    // lacks.
    let mut script = String::from(
        "set -u\nfail=0\nP=/mnt/host/plain.bin\n[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin\n",
    );
    let mut write_imgs = Vec::new();
    let mut bodies = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let body = key_file(&mut rng, case.keys);
        let kf = dir.join(format!("key{i}"));
        std::fs::write(&kf, &body).expect("key file");
        let kfs = kit::s(&kf).to_string();
        let bytes = (PLAIN_BYTES + case.offset_sectors * 512) as u64;
        let r = dir.join(format!("read{i}.img"));
        let w = dir.join(format!("write{i}.img"));
        for img in [&r, &w] {
            std::fs::File::create(img)
                .and_then(|f| f.set_len(bytes))
                .expect("image");
        }
        let (opts, input) = ucrypt_opts(case, &kfs, &body);
        let mut args = vec![
            "import".to_string(),
            kit::s(&plain_path).to_string(),
            kit::s(&r).to_string(),
        ];
        args.extend(opts);
        ucrypt(&args, &input).unwrap_or_else(|e| panic!("{}: import: {e}", case.name));
        run.disk(&r, true);
        run.disk(&w, false);
        let dr = format!("/dev/vd{}", (b'a' + 2 * i as u8) as char);
        let dw = format!("/dev/vd{}", (b'a' + 2 * i as u8 + 1) as char);
        let opts = case.opts.join(" ");
        let (feed, key) = if case.stdin {
            (format!("cat /mnt/host/key{i} | "), "-".to_string())
        } else {
            (String::new(), format!("/mnt/host/key{i}"))
        };
        script.push_str(&vm::both_ways_case(
            case.name,
            i,
            &opts,
            &format!("{feed}cryptsetup loopaesOpen --readonly {opts} --key-file {key} {dr}"),
            &format!("{feed}cryptsetup loopaesOpen {opts} --key-file {key} {dw}"),
            Some(PLAIN_BYTES),
        ));
        write_imgs.push(w);
        bodies.push((kfs, body));
    }
    script.push_str("sync\nexit $fail\n");
    run.script = script;
    let out = run.run(dir);
    println!(
        "VM run (loop-AES cases) took {:.1} s",
        out.elapsed.as_secs_f64()
    );

    let names = CASES.iter().map(|c| c.name);
    let failures = vm::both_ways_failures(&out.output, names, "loop-AES", &plain, |i| {
        let back = dir.join(format!("back{i}.bin"));
        let (opts, input) = ucrypt_opts(&CASES[i], &bodies[i].0, &bodies[i].1);
        let mut args = vec![
            "export".to_string(),
            kit::s(&write_imgs[i]).to_string(),
            kit::s(&back).to_string(),
        ];
        args.extend(opts);
        ucrypt(&args, &input)?;
        Ok(std::fs::read(&back).expect("export"))
    });
    assert!(
        failures.is_empty(),
        "seed {seed:#x}: {failures:#?}\n--- VM output ---\n{}",
        out.output
    );
}
