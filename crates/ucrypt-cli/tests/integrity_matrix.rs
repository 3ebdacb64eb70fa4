//! cryptsetup's own authenticated-encryption matrix, run against `ucrypt` on the host: every
//! `intformat` line of upstream's `tests/luks2-integrity-test` (cipher, integrity, key sizes,
//! sector size, expected checksum) as that script runs it, with `ucrypt` in place of
//! `cryptsetup`:
//!
//! 1. `luksFormat --type luks2 -q -c C --integrity I --sector-size S -s K --pbkdf pbkdf2
//!    --pbkdf-force-iterations 1000 -d KEY IMG --offset 8192 --integrity-legacy-padding` on a
//!    32 MiB zeroed file (the script's `add_device`), the data area wiped with zeroes through
//!    the integrity layer as cryptsetup wipes it through the kernel;
//! 2. the script's `dump_check`s: the first `luksDump` line naming `cipher`, `sector`,
//!    `integrity` and `Key:` carries the line's values;
//! 3. its `int_check_sum`: the SHA-256 of the whole plaintext device (`ucrypt export`) is the
//!    checksum upstream recorded from the kernel. Those hash zeroes, so they pin the size of
//!    the data area the kernel's dm-integrity provides for that tag size, sector size and
//!    padding: the layout, byte for byte in size;
//! 4. its `int_error_detection`: `XXXXX` written at 28 MiB of the image makes a full read fail.
//!
//! A line cryptsetup's format refuses prints `[N/A]` in upstream's script; here every line
//! must pass, `aegis128-random` included. Lines that need options of later cryptsetup releases (`--integrity-key-size`, inline tags) are
//! skipped with a note. Needs cryptsetup's test material (`cli_common::cryptsetup_tests`):
//! SKIPPED without it.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
/// The script's `add_device`: `dd if=/dev/zero of=$DEV bs=1M count=32`.
const IMAGE_BYTES: u64 = 32 << 20;
/// Where its `int_error_detection` writes `XXXXX` (`dd bs=1M seek=28`).
const DAMAGE_AT: u64 = 28 << 20;

/// One `intformat alg integrity integrity_out key_size int_key_size sector_size csum` line.
#[derive(Debug)]
struct Line {
    cipher: String,
    integrity: String,
    integrity_out: String,
    key_bits: u32,
    int_key_bits: u32,
    sector: u32,
    checksum: String,
}

/// The `intformat` calls of the script's main (not-inline) run.
fn matrix(script: &str) -> Vec<Line> {
    script
        .lines()
        .take_while(|l| !l.starts_with("if dm_integrity_inline_support"))
        .filter(|l| l.starts_with("intformat "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 8, "intformat line: {l}");
            Line {
                cipher: f[1].into(),
                integrity: f[2].into(),
                integrity_out: f[3].replace('\\', ""),
                key_bits: f[4].parse().expect("key size"),
                int_key_bits: f[5].parse().expect("integrity key size"),
                sector: f[6].parse().expect("sector size"),
                checksum: f[7].into(),
            }
        })
        .collect()
}

fn ucrypt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn ucrypt")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The script's `dump_check` (`grep -m1 WHAT | sed -e 's/.*:[ \t]\+//' | cut -d' ' -f1`): the
/// first line containing `what`, after its last colon that blanks follow, up to the next space.
fn dump_value(dump: &str, what: &str) -> String {
    let Some(line) = dump.lines().find(|l| l.contains(what)) else {
        return String::new();
    };
    let b = line.as_bytes();
    let after = (0..b.len())
        .rev()
        .find(|&i| b[i] == b':' && matches!(b.get(i + 1), Some(b' ' | b'\t')))
        .map_or(line, |i| line[i + 1..].trim_start_matches([' ', '\t']));
    after.split(' ').next().unwrap_or("").to_string()
}

fn sha256_of(path: &Path) -> String {
    let o = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    assert!(o.status.success(), "sha256sum: {}", text(&o));
    String::from_utf8_lossy(&o.stdout)
        .split(' ')
        .next()
        .unwrap_or("")
        .to_string()
}

/// Runs one line.
fn run_line(dir: &Path, key: &Path, l: &Line) -> Result<(), String> {
    let img = dir.join("mode-test.img");
    let plain = dir.join("plain.bin");
    let _ = std::fs::remove_file(&img);
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(IMAGE_BYTES))
        .map_err(|e| e.to_string())?;
    let (key_bits, sector) = (l.key_bits.to_string(), l.sector.to_string());
    let o = ucrypt(&[
        "luksFormat",
        "--type",
        "luks2",
        "-q",
        "-c",
        &l.cipher,
        "--integrity",
        &l.integrity,
        "--sector-size",
        &sector,
        "-s",
        &key_bits,
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "-d",
        s(key),
        s(&img),
        "--offset",
        "8192",
        "--integrity-legacy-padding",
    ]);
    if !o.status.success() {
        return Err(format!("luksFormat failed: {}", text(&o)));
    }
    let dump = ucrypt(&["luksDump", s(&img)]);
    if !dump.status.success() {
        return Err(format!("luksDump: {}", text(&dump)));
    }
    let dump = String::from_utf8_lossy(&dump.stdout).to_string();
    let total_key = (l.key_bits + l.int_key_bits).to_string();
    for (what, want) in [
        ("cipher", l.cipher.as_str()),
        ("sector", sector.as_str()),
        ("integrity", l.integrity_out.as_str()),
        ("Key:", total_key.as_str()),
    ] {
        let got = dump_value(&dump, what);
        if got != want {
            return Err(format!("dump {what}: want {want}, got {got:?}\n{dump}"));
        }
    }
    let o = ucrypt(&["export", s(&img), s(&plain), "--key-file", s(key)]);
    if !o.status.success() {
        return Err(format!("export: {}", text(&o)));
    }
    let sum = sha256_of(&plain);
    if sum != l.checksum {
        return Err(format!("checksum: want {}, got {sum}", l.checksum));
    }
    // int_error_detection: damage, then a full read must fail.
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .map_err(|e| e.to_string())?;
    f.write_all_at(b"XXXXX", DAMAGE_AT)
        .map_err(|e| e.to_string())?;
    drop(f);
    let o = ucrypt(&["export", s(&img), s(&plain), "--key-file", s(key)]);
    if o.status.success() {
        return Err("a read over damaged data succeeded".into());
    }
    Ok(())
}

#[test]
fn cryptsetups_integrity_matrix_through_ucrypt() {
    let tests = match cli_common::cryptsetup_tests() {
        Ok(t) => t,
        Err(why) => {
            println!("SKIPPED: cryptsetup's test material: {why}");
            return;
        }
    };
    let script = std::fs::read_to_string(tests.join("luks2-integrity-test"))
        .expect("tests/luks2-integrity-test");
    let lines = matrix(&script);
    assert!(lines.len() >= 30, "only {} intformat lines", lines.len());
    let dir = std::env::temp_dir().join(format!("ucrypt-integrity-matrix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let key = dir.join("key.img");
    // The script's key file: 512 random bytes.
    let mut key_bytes = [0u8; 512];
    getrandom_fill(&mut key_bytes);
    std::fs::write(&key, key_bytes).expect("key");
    let (mut failed, mut passed) = (Vec::new(), 0);
    for l in &lines {
        let name = format!("[{}:{}:{}:{}]", l.cipher, l.integrity, l.key_bits, l.sector);
        if l.int_key_bits % 16 != 0 {
            println!("{name} skipped: needs --integrity-key-size (cryptsetup 2.8)");
            continue;
        }
        match run_line(&dir, &key, l) {
            Ok(()) => {
                println!("{name}[OK]");
                passed += 1;
            }
            Err(e) => {
                println!("{name}[FAIL] {e}");
                failed.push(format!("{name}: {e}"));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{passed} lines passed");
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    assert!(
        lines.iter().any(|l| l.cipher == "aegis128-random"),
        "upstream's matrix has no aegis128-random line"
    );
}

fn getrandom_fill(b: &mut [u8]) {
    let f = std::fs::File::open("/dev/urandom").expect("/dev/urandom");
    use std::io::Read;
    (&f).read_exact(b).expect("random bytes");
}
