//! Differential test of the sector layer against an independent implementation: Debian's
//! python3-cryptography driven by tests/support/sector_ref.py, over random keys, sector sizes,
//! IV offsets, iv_large_sectors, starting sectors and lengths, for every AES spec and both XTS
//! providers, and for camellia (OpenSSL's, through python-cryptography), LRW and ESSIV with
//! other hashes. (Serpent, twofish and Adiantum are not in python-cryptography: the kernel's
//! vectors and kernel_dmcrypt_ciphers.rs prove those.)

#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod support;

use std::io::Write;
use std::process::{Command, Stdio};

use kit::{hex, unhex};
use support::Rng;
use ucrypt::sector::{CipherSpec, Geometry, Provider, SectorCipher, SectorSize};

const SPECS: &[&str] = &[
    "aes-xts-plain64",
    "aes-xts-plain",
    "aes-xts-plain64be",
    "aes-xts-essiv:sha256",
    "aes-cbc-essiv:sha256",
    "aes-cbc-plain64",
    "aes-cbc-plain",
    "cipher_null-ecb",
    // OpenSSL's camellia (RustCrypto's here), LRW and benbi written in Python from the spec,
    // ESSIV with other hashes.
    "camellia-xts-plain64",
    "camellia-cbc-essiv:sha256",
    "camellia-cbc-plain64",
    "camellia-xts-benbi",
    "aes-lrw-benbi",
    "aes-lrw-plain64",
    "camellia-xts-essiv:sha256",
    "aes-cbc-essiv:sm3",
];
const CASES_PER_SPEC: usize = 60;

#[test]
fn sector_layer_matches_python_cryptography() {
    let py = "/usr/bin/python3";
    if !support::have_tool(py, "python3-cryptography", "sector_differential") {
        return;
    }
    let probe = Command::new(py)
        .args(["-c", "import cryptography"])
        .status()
        .expect("python3 runs");
    if !probe.success() {
        if std::env::var_os("CI").is_some() {
            panic!("python3-cryptography missing under CI");
        }
        println!("SKIPPED sector_differential: apt-get install python3-cryptography");
        return;
    }
    let mut rng = Rng::from_env("sector_differential");
    let mut requests = String::new();
    let mut expected = Vec::new();
    for spec_str in SPECS {
        let spec: CipherSpec = spec_str.parse().unwrap();
        for case in 0..CASES_PER_SPEC {
            let allowed = spec.key_bytes_allowed();
            let key_len = allowed[rng.below(allowed.len() as u64) as usize];
            let key = rng.bytes(key_len);
            let ss = [512u64, 1024, 2048, 4096][rng.below(4) as usize];
            let geo = Geometry {
                sector_size: SectorSize::new(ss).unwrap(),
                iv_offset: if case % 5 == 0 {
                    rng.next()
                } else {
                    rng.below(1 << 20)
                },
                iv_large_sectors: rng.below(3) == 0,
            };
            let first_sector = if case % 7 == 0 {
                rng.next() >> 9
            } else {
                rng.below(1 << 24)
            };
            let nsec = 1 + rng.below(6) as usize;
            let plain = rng.bytes(ss as usize * nsec);
            let providers: &[Provider] = if spec.mode
                == ucrypt::sector::Mode::Xts(ucrypt::sector::BlockCipher::Aes)
                && key_len == 64
            {
                &Provider::ALL
            } else {
                &[Provider::Auto]
            };
            for &provider in providers {
                let mut c = SectorCipher::with_provider(spec, &key, geo, provider).unwrap();
                let mut ct = plain.clone();
                c.encrypt(first_sector, &mut ct).unwrap();
                for (op, input, output) in [("encrypt", &plain, &ct), ("decrypt", &ct, &plain)] {
                    let req = format!(
                        "{{\"spec\":\"{spec_str}\",\"key\":\"{}\",\"sector_size\":{ss},\"iv_offset\":{},\"iv_large_sectors\":{},\"first_sector\":{first_sector},\"data\":\"{}\",\"op\":\"{op}\"}}\n",
                        hex(&key), geo.iv_offset, geo.iv_large_sectors, hex(input)
                    );
                    requests.push_str(&req);
                    expected.push((format!("{spec_str} case {case} {} {op} ss {ss} geo {geo:?} sector {first_sector}", provider.name()), output.clone()));
                }
            }
        }
    }
    let mut child = Command::new(py)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/sector_ref.py"
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn python reference");
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(requests.as_bytes()));
    let out = child.wait_with_output().expect("python reference output");
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "python reference failed");
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    assert_eq!(lines.len(), expected.len());
    for (line, (what, want)) in lines.iter().zip(&expected) {
        assert_eq!(
            &unhex(line),
            want,
            "mismatch with python-cryptography: {what}"
        );
    }
    println!("sector_differential: {} comparisons", expected.len());
}
