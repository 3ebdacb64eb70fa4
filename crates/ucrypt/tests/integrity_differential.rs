//! Differential test of the authenticated-sector layer (`ucrypt::integrity::TagCipher`)
//! against python3-cryptography (tests/support/tag_ref.py): for random keys, sector numbers,
//! sector sizes and data, the ciphertext and tag ucrypt writes equal the reference's for the
//! IV ucrypt drew (or, where no IV is kept, the one the sector gives), and ucrypt opens what it
//! sealed. Every mode ucrypt authenticates with is covered but `aegis128-random`:
//! python3-cryptography has no AEGIS-128; the kernel's own vectors
//! (`ucrypt::integrity::aegis128`'s tests) and the VM (tests/kernel_integrity.rs, both ways)
//! prove that one.

#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod support;

use std::io::Write;
use std::process::{Command, Stdio};

use kit::{hex, unhex};
use support::Rng;
use ucrypt::integrity::{TagCipher, TagMode};

const CASES_PER_MODE: usize = 40;
/// Sectors sealed per call (many per call, as the volume does).
const SECTORS_PER_CALL: usize = 3;

#[test]
fn tag_layer_matches_python_cryptography() {
    let py = "/usr/bin/python3";
    if !support::have_tool(py, "python3-cryptography", "integrity_differential") {
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
        println!("SKIPPED integrity_differential: apt-get install python3-cryptography");
        return;
    }
    let mut rng = Rng::from_env("integrity_differential");
    // The name tells tag_ref.py the construction; authenc modes name it in full
    // (`authenc-MODE-IV-HASH`) so the reference builds it from the kernel's rules alone.
    let mut modes = vec![
        (TagMode::AesGcmRandom { key_bytes: 32 }, "gcm".to_string()),
        (TagMode::AesGcmRandom { key_bytes: 16 }, "gcm".to_string()),
        (TagMode::ChaCha20RandomPoly1305, "chacha20-poly1305".into()),
        (
            TagMode::ChaCha20Plain64Poly1305,
            "chacha20-plain64-poly1305".into(),
        ),
        (TagMode::AesCcmRandom { key_bytes: 16 + 3 }, "ccm".into()),
        (TagMode::AesCcmRandom { key_bytes: 24 + 3 }, "ccm".into()),
        (TagMode::AesCcmRandom { key_bytes: 32 + 3 }, "ccm".into()),
    ];
    for (mode, enc_bytes) in [("xts", 64), ("xts", 32), ("cbc", 32), ("cbc", 16)] {
        for iv in ["random", "plain64", "essiv:sha256"] {
            for (hash, mac_bytes) in [("sha1", 20), ("sha256", 32), ("sha512", 64)] {
                let m = TagMode::from_luks2(
                    &format!("aes-{mode}-{iv}"),
                    &format!("hmac({hash})"),
                    enc_bytes + mac_bytes,
                )
                .expect("a mode ucrypt supports");
                let iv = iv.trim_end_matches(":sha256");
                modes.push((m, format!("authenc-{mode}-{iv}-{hash}")));
            }
        }
    }
    let mut requests = String::new();
    let mut expected = Vec::new();
    for (mode, name) in &modes {
        let mode = *mode;
        for _ in 0..CASES_PER_MODE {
            let key = rng.bytes(mode.key_bytes());
            let ss = [512usize, 4096][rng.below(2) as usize];
            let first = rng.below(1 << 40) * (ss as u64 / 512);
            let plain = rng.bytes(ss * SECTORS_PER_CALL);
            let mut c = TagCipher::new(mode, &key).expect("key");
            let mut data = plain.clone();
            let tb = mode.tuple_bytes();
            let mut tuples = vec![0u8; tb * SECTORS_PER_CALL];
            c.seal(first, ss, &mut data, &mut tuples).expect("seal");
            let mut back = data.clone();
            assert_eq!(c.open(first, ss, &mut back, &tuples).expect("open"), Ok(()));
            assert_eq!(back, plain, "{name}: round trip");
            for k in 0..SECTORS_PER_CALL {
                let t = &tuples[k * tb..(k + 1) * tb];
                let (tag, iv) = t.split_at(mode.auth_bytes());
                let sector = first + (k * ss / 512) as u64;
                let p = &plain[k * ss..(k + 1) * ss];
                // "-": no IV kept (generated from the sector).
                let iv = if iv.is_empty() { "-".into() } else { hex(iv) };
                requests.push_str(&format!("{name} {} {sector} {iv} {}\n", hex(&key), hex(p)));
                expected.push((
                    format!("{name} sector {sector} ({ss} bytes)"),
                    data[k * ss..(k + 1) * ss].to_vec(),
                    tag.to_vec(),
                ));
            }
        }
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/tag_ref.py");
    let mut child = Command::new(py)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn python3");
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || stdin.write_all(requests.as_bytes()));
    let out = child.wait_with_output().expect("python3 output");
    writer.join().expect("writer").expect("write requests");
    assert!(out.status.success(), "tag_ref.py failed");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), expected.len(), "one answer per request");
    for (line, (what, ct, tag)) in lines.iter().zip(&expected) {
        let (rct, rtag) = line.split_once(' ').expect("two fields");
        assert!(
            unhex(rct) == *ct,
            "{what}: ciphertext differs from python3-cryptography"
        );
        assert!(
            unhex(rtag) == *tag,
            "{what}: tag differs from python3-cryptography"
        );
    }
    println!("{} sectors match python3-cryptography", expected.len());
}
