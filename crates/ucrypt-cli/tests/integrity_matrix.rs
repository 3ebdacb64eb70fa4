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
//! must pass, `aegis128-random` included. A line whose integrity key size is not a multiple of
//! 16 bits is formatted with `--integrity-key-size` as the script of cryptsetup 2.8 does (its
//! "trick"): the main run takes the test material `cli_common::cryptsetup_tests` gives
//! (2.6.1, which has no such line), a second test the lines of 2.8's matrix that need the
//! option (`cli_common::cryptsetup_tests_of("sid")`). The inline-tag lines of 2.8 need a
//! device with hardware integrity fields and are not read. Each test is SKIPPED without its
//! test material.

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

/// Whether the script formats the line with `--integrity-key-size` (cryptsetup 2.8).
fn needs_key_size(l: &Line) -> bool {
    l.int_key_bits % 16 != 0
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
    let int_key_bits = l.int_key_bits.to_string();
    let mut format: Vec<&str> = vec![
        "luksFormat",
        "--type",
        "luks2",
        "-q",
        "-c",
        l.cipher.as_str(),
        "--integrity",
        l.integrity.as_str(),
        "--sector-size",
        sector.as_str(),
        "-s",
        key_bits.as_str(),
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
    ];
    // The script's "trick": an integrity key size that is no multiple of 16 is asked for.
    if needs_key_size(l) {
        format.extend(["--integrity-key-size", int_key_bits.as_str()]);
    }
    let o = ucrypt(&format);
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
    // cryptsetup 2.8's dump line for a recorded integrity key size.
    let key_line = format!("\tintegrity key size: {} [bits]", l.int_key_bits);
    if needs_key_size(l) != dump.lines().any(|d| d == key_line) {
        return Err(format!(
            "dump: {key_line:?} expected {}\n{dump}",
            needs_key_size(l)
        ));
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

/// Runs `lines` (those `pick` takes) in a fresh directory named after `tag`: the names of the
/// failed ones with why, and how many passed.
fn run_lines(tag: &str, lines: &[Line], pick: impl Fn(&Line) -> bool) -> (Vec<String>, usize) {
    let dir = std::env::temp_dir().join(format!(
        "ucrypt-integrity-matrix-{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let key = dir.join("key.img");
    // The script's key file: 512 random bytes.
    let mut key_bytes = [0u8; 512];
    getrandom_fill(&mut key_bytes);
    std::fs::write(&key, key_bytes).expect("key");
    let (mut failed, mut passed) = (Vec::new(), 0);
    for l in lines.iter().filter(|l| pick(l)) {
        let name = format!(
            "[{}:{}:{}:{}:{}]",
            l.cipher, l.integrity, l.key_bits, l.sector, l.int_key_bits
        );
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
    (failed, passed)
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
    let (failed, _) = run_lines("main", &lines, |_| true);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    assert!(
        lines.iter().any(|l| l.cipher == "aegis128-random"),
        "upstream's matrix has no aegis128-random line"
    );
}

/// The lines of cryptsetup 2.8's matrix formatted with `--integrity-key-size` (an HMAC key of
/// 264 bits for hmac-sha256, 792 for hmac-sha512, 512-byte sectors): the dump shows the
/// volume key as the cipher's key plus that many bits, the plaintext sums to what the kernel
/// gave upstream, and damage is detected.
#[test]
fn cryptsetup_2_8_integrity_key_size_lines_through_ucrypt() {
    let tests = match cli_common::cryptsetup_tests_of("sid") {
        Ok(t) => t,
        Err(why) => {
            println!("SKIPPED: cryptsetup 2.8's test material: {why}");
            return;
        }
    };
    let script = std::fs::read_to_string(tests.join("luks2-integrity-test"))
        .expect("tests/luks2-integrity-test");
    let lines = matrix(&script);
    let n = lines.iter().filter(|l| needs_key_size(l)).count();
    assert!(
        n >= 2,
        "{}: only {n} lines with --integrity-key-size (cryptsetup 2.8 has 2)",
        tests.display()
    );
    let (failed, passed) = run_lines("key-size", &lines, needs_key_size);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    assert_eq!(passed, n);
}

fn getrandom_fill(b: &mut [u8]) {
    let f = std::fs::File::open("/dev/urandom").expect("/dev/urandom");
    use std::io::Read;
    (&f).read_exact(b).expect("random bytes");
}
