//! loop-AES: the cases of cryptsetup's `tests/loopaes-test` run against ucrypt on the host.
//! Its matrix: key files v1 (one line), v2 (64) and v3 (65: 64 keys and the IV seed), each line
//! 60 base64 characters (the script's `uuencode -m` of random bytes; here from a printed
//! seed); key sizes 128 and 256; offsets 0, 8192, @8192, 8388608 and @8388608 bytes (`@`: the
//! IV does not count the offset, `--skip 0`). As the script does, a 10000 KiB image is opened,
//! filled with zeros through the mapping (`import --type loopaes`), reopened with the key file
//! given as a file and on standard input (`export --type loopaes`), and the plaintext's
//! SHA-256 must be the sum the script expects for that offset.
//!
//! Those sums prove the round trip and the size only (the keys are random); the cipher itself
//! is checked beside it: a Python reference written from the kernel's dm-crypt (CBC-plain64,
//! and CBC over 64 keys with the LMK IV, its MD5 from RFC 1321's formulas) and the
//! `cryptography` package's AES decrypts sectors of the image's ciphertext, which must give
//! the zeros written. SKIPPED (that part only) without python3 and `cryptography`. The
//! script's own cross-check with loop-AES's patched losetup has no counterpart here (no
//! loop-AES kernel module); the kernel's dm-crypt is compared in the VM (`kernel_loopaes.rs`).

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::process::Command;

use cli_common::{run_in, text, TempDir, UCRYPT};
use sha2::{Digest, Sha256};

const IMG_BYTES: u64 = 10000 * 1024;

/// loopaes-test's `get_expsum`.
fn expected_sum(offset: &str) -> &'static str {
    match offset.trim_start_matches('@') {
        "0" => "31e00e0e4c233c89051cd748122fde2c98db0121ca09ba93a3820817ea037bc5",
        "8192" => "bfd94392d1dd8f5d477251d21b3c736e177a4945cd4937847fc7bace82996aed",
        "8388608" => "33838fe36928a929bd7971bed7e82bd426c88193fcd692c2e6f1b9c9bfecd4d6",
        o => panic!("no sum for offset {o}"),
    }
}

/// loopaes-test's `get_offset_params`.
fn offset_params(offset: &str) -> Vec<String> {
    match offset.strip_prefix('@') {
        Some(o) => vec![
            "-o".into(),
            (o.parse::<u64>().unwrap() / 512).to_string(),
            "-p".into(),
            "0".into(),
        ],
        None => vec![
            "-o".into(),
            (offset.parse::<u64>().unwrap() / 512).to_string(),
        ],
    }
}

/// 65 lines of 60 base64 characters from a xorshift stream seeded with `seed`.
fn key_lines(seed: u64) -> Vec<String> {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut x = seed | 1;
    (0..65)
        .map(|_| {
            (0..60)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    B64[(x % 64) as usize] as char
                })
                .collect()
        })
        .collect()
}

/// The Python reference: decrypts the given sectors of the image and prints each plaintext
/// in hex. Arguments: image, key file, key bytes, data offset bytes, IV offset sectors,
/// sectors (comma-separated).
const REFERENCE: &str = r#"
import sys, hashlib, struct, math
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
img, keyf, ksz, off, skip = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
sectors = [int(x) for x in sys.argv[6].split(',')]
lines = [l for l in open(keyf, 'rb').read().split(b'\n') if l]
h = {16: hashlib.sha256, 24: hashlib.sha384, 32: hashlib.sha512}[ksz]
tweak = {1: 0, 64: 0x55, 65: 0xF4}[len(lines)]
keys = []
for l in lines:
    k = bytearray(h(l).digest()[:ksz]); k[0] ^= tweak; keys.append(bytes(k))
K = [int(abs(math.sin(i + 1)) * 2**32) & 0xffffffff for i in range(64)]
S = [7, 12, 17, 22] * 4 + [5, 9, 14, 20] * 4 + [4, 11, 16, 23] * 4 + [6, 10, 15, 21] * 4
def compress(st, blk):
    M = struct.unpack('<16I', blk); a, b, c, d = st
    for i in range(64):
        if i < 16: f = (b & c) | (~b & d); g = i
        elif i < 32: f = (d & b) | (~d & c); g = (5 * i + 1) % 16
        elif i < 48: f = b ^ c ^ d; g = (3 * i + 5) % 16
        else: f = c ^ (b | ~d); g = (7 * i) % 16
        t = (a + (f & 0xffffffff) + K[i] + M[g]) & 0xffffffff
        a, d, c = d, c, b
        b = (b + (((t << S[i]) | (t >> (32 - S[i]))) & 0xffffffff)) & 0xffffffff
    return [(x + y) & 0xffffffff for x, y in zip(st, [a, b, c, d])]
def lmk_iv(seed, n, plain):
    st = [0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476]
    data = (seed + b'\0' * 48 if seed else b'') + plain[16:512] + struct.pack('<IIII', n & 0xffffffff, ((n >> 32) & 0xffffff) | 0x80000000, 4024, 0)
    for i in range(0, len(data), 64): st = compress(st, data[i:i + 64])
    return struct.pack('<4I', *st)
f = open(img, 'rb')
for s in sectors:
    f.seek(off + s * 512); ct = f.read(512)
    n = s + skip
    if len(keys) == 1:
        pt = Cipher(algorithms.AES(keys[0]), modes.CBC(struct.pack('<Q', n) + b'\0' * 8)).decryptor().update(ct)
    else:
        pt = bytearray(Cipher(algorithms.AES(keys[n % 64]), modes.CBC(b'\0' * 16)).decryptor().update(ct))
        iv = lmk_iv(keys[64][:16] if len(keys) == 65 else None, n, bytes(pt))
        for i in range(16): pt[i] ^= iv[i]
    print(bytes(pt).hex())
"#;

fn have_reference() -> bool {
    Command::new("python3")
        .args(["-c", "import cryptography"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

#[test]
fn loopaes_test_cases() {
    let seed = std::env::var("LOOPAES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x010a_9ae5_u64);
    eprintln!("loop-AES key lines from seed {seed} (LOOPAES_SEED)");
    let reference = have_reference();
    if !reference {
        eprintln!("SKIPPED: the Python reference (python3 with cryptography) is missing: only the script's sums are checked");
    }
    let tmp = TempDir::new("loopaes");
    let lines = key_lines(seed);
    let mut keys = Vec::new();
    for (name, n) in [("key_v1", 1), ("key_v2", 64), ("key_v3", 65)] {
        let p = tmp.path(name);
        let body: String = lines[..n].iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&p, body).unwrap();
        keys.push((name, p));
    }
    let img = tmp.path("loopaes.img");
    let zeros = tmp.path("zeros");
    let out = tmp.path("plain");
    let (imgs, zs, outs) = (
        img.to_str().unwrap(),
        zeros.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let mut checked = 0;
    for key_size in ["128", "256"] {
        for (kname, key) in &keys {
            let ks = key.to_str().unwrap();
            for offset in ["0", "8192", "@8192", "8388608", "@8388608"] {
                let case = format!("{kname} / AES-{key_size} / offset {offset}");
                let off_bytes: u64 = offset.trim_start_matches('@').parse().unwrap();
                std::fs::write(&img, vec![0u8; IMG_BYTES as usize]).unwrap();
                std::fs::write(&zeros, vec![0u8; (IMG_BYTES - off_bytes) as usize]).unwrap();
                let params = offset_params(offset);
                let common: Vec<&str> = vec!["--type", "loopaes", "-s", key_size, "--key-file"];
                let tail: Vec<&str> = params.iter().map(String::as_str).collect();
                // Fill the device with zeros.
                let mut a = vec!["import"];
                a.extend_from_slice(&common);
                a.push(ks);
                a.extend_from_slice(&tail);
                a.extend_from_slice(&[zs, imgs]);
                let o = run_in(UCRYPT, &a, b"");
                assert!(o.status.success(), "{case}: import: {}", text(&o));
                let ct = std::fs::read(&img).unwrap();
                assert!(
                    ct[off_bytes as usize..].iter().any(|&b| b != 0),
                    "{case}: nothing was encrypted"
                );
                // check_sum keyfile, then check_sum stdin.
                let body = std::fs::read(key).unwrap();
                for (src, input) in [(ks, &b""[..]), ("-", &body[..])] {
                    let mut a = vec!["export"];
                    a.extend_from_slice(&common);
                    a.push(src);
                    a.extend_from_slice(&tail);
                    a.extend_from_slice(&[imgs, outs]);
                    let o = run_in(UCRYPT, &a, input);
                    assert!(o.status.success(), "{case} ({src}): export: {}", text(&o));
                    let sum = sha256_hex(&std::fs::read(&out).unwrap());
                    assert_eq!(sum, expected_sum(offset), "{case} ({src})");
                }
                if reference {
                    let data_sectors = (IMG_BYTES - off_bytes) / 512;
                    let skip = if offset.starts_with('@') {
                        0
                    } else {
                        off_bytes / 512
                    };
                    let sectors = format!("0,1,63,64,65,{}", data_sectors - 1);
                    let kb = (key_size.parse::<usize>().unwrap() / 8).to_string();
                    let o = Command::new("python3")
                        .args([
                            "-c",
                            REFERENCE,
                            imgs,
                            ks,
                            &kb,
                            &off_bytes.to_string(),
                            &skip.to_string(),
                            &sectors,
                        ])
                        .output()
                        .unwrap();
                    assert!(o.status.success(), "{case}: reference: {}", text(&o));
                    let got = String::from_utf8(o.stdout).unwrap();
                    assert_eq!(got.lines().count(), 6, "{case}: {got}");
                    for l in got.lines() {
                        assert!(
                            l.bytes().all(|c| c == b'0'),
                            "{case}: the reference decrypts to {l}"
                        );
                    }
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 30);
}

/// cryptsetup's refusals: no key file, a GPG-armoured one, a key file of 2 lines.
#[test]
fn loopaes_refusals() {
    let tmp = TempDir::new("loopaes-refusals");
    let img = tmp.path("img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let imgs = img.to_str().unwrap();
    let out = tmp.path("out");
    let outs = out.to_str().unwrap();
    let o = run_in(UCRYPT, &["export", "--type", "loopaes", imgs, outs], b"");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("Option --key-file is required."),
        "{}",
        text(&o)
    );
    for (body, want) in [
        (&b"-----BEGIN PGP MESSAGE-----\nabc\n"[..], "GPG"),
        (
            &b"aaaa\nbbbb\n"[..],
            "Incompatible loop-AES keyfile detected.",
        ),
    ] {
        let o = run_in(
            UCRYPT,
            &["export", "--type", "loopaes", "--key-file", "-", imgs, outs],
            body,
        );
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains(want), "{}", text(&o));
    }
}
