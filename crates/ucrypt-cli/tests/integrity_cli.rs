//! The `ucrypt` command with LUKS2 volumes with integrity, on the host (no kernel needed):
//! `format --integrity` with and without the wipe, `import` / `export`, a block never written
//! failing authentication in `export` and over NBD (NBD_EIO, seen by qemu-io as EIO) with one
//! log line, and a superblock flagged as recalculating refused; cryptsetup 2.8's
//! `--integrity-key-size`: what it records, shows and refuses.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ucrypt");
const IMAGE_BYTES: u64 = 48 << 20;
const PLAIN_BYTES: usize = 1 << 20;
/// Where the LUKS2 header puts the dm-integrity superblock (the 16 MiB data offset).
const SB_OFFSET: u64 = 16 << 20;
/// Byte of the superblock's flags; bit 1 = recalculating.
const SB_FLAGS_AT: u64 = 24;
const SERVE_READY: Duration = Duration::from_secs(20);

fn ucrypt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn ucrypt")
}

fn ok(args: &[&str]) -> Output {
    let o = ucrypt(args);
    assert!(
        o.status.success(),
        "ucrypt {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// `import` of `plain` (at `plain_path`) into the wiped volume `img`, then `export` of the
/// whole volume beside it: the import's bytes, then the wipe's zeroes. Returns the export.
fn import_then_export(img: &Path, key: &Path, plain_path: &Path, plain: &[u8]) -> Vec<u8> {
    ok(&["import", s(plain_path), s(img), "--key-file", s(key)]);
    let out = img.with_extension("out");
    ok(&["export", s(img), s(&out), "--key-file", s(key)]);
    let got = std::fs::read(&out).expect("export");
    assert!(
        got[..plain.len()] == plain[..],
        "export differs from import"
    );
    assert!(
        got[plain.len()..].iter().all(|&b| b == 0),
        "the wipe reads as zeroes"
    );
    got
}

fn format(img: &Path, key: &Path, wipe: bool) {
    std::fs::File::create(img)
        .and_then(|f| f.set_len(IMAGE_BYTES))
        .expect("image");
    let mut args = vec![
        "format",
        "-q",
        "--cipher",
        "aes-xts-random",
        "--integrity",
        "hmac-sha256",
        "--integrity-no-journal",
        "--sector-size",
        "4096",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        s(key),
        s(img),
    ];
    if !wipe {
        args.insert(1, "--integrity-no-wipe");
    }
    ok(&args);
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn integrity_volumes_through_the_command() {
    let dir = std::env::temp_dir().join(format!("ucrypt-integrity-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let key = dir.join("key");
    std::fs::write(&key, b"integrity passphrase").expect("key");
    let plain: Vec<u8> = (0..PLAIN_BYTES).map(|i| (i * 7 + i / 4096) as u8).collect();
    let plain_path = dir.join("plain.bin");
    std::fs::write(&plain_path, &plain).expect("plain");

    // Wiped: everything reads, the import's bytes and zeroes after them.
    let wiped = dir.join("wiped.img");
    format(&wiped, &key, true);
    let got = import_then_export(&wiped, &key, &plain_path, &plain);
    assert!(got.len() > PLAIN_BYTES);

    // Not wiped: blocks never written fail authentication.
    let raw = dir.join("raw.img");
    format(&raw, &key, false);
    ok(&["import", s(&plain_path), s(&raw), "--key-file", s(&key)]);
    let o = ucrypt(&[
        "export",
        s(&raw),
        s(&dir.join("raw.out")),
        "--key-file",
        s(&key),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "export of never-written blocks must fail"
    );
    assert!(
        err.contains("integrity error: block at data sector 2048"),
        "{err}"
    );

    // Over NBD: the imported MiB reads, the next block is NBD_EIO, logged once.
    if Command::new("qemu-io").arg("--version").output().is_err() {
        println!("SKIPPED: NBD part: no qemu-io (apt install qemu-utils)");
    } else {
        let sock = dir.join("s.sock");
        let log = dir.join("serve.log");
        let child = Command::new(BIN)
            .args([
                "serve",
                s(&raw),
                "--nbd",
                &format!("unix:{}", s(&sock)),
                "--key-file",
                s(&key),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn serve");
        let server = Server(child);
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(t0.elapsed() < SERVE_READY, "serve did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        let url = format!("nbd+unix:///?socket={}", s(&sock));
        let io = |cmd: &str| {
            let o = Command::new("qemu-io")
                .args(["-f", "raw", "-c", cmd, &url])
                .output()
                .expect("qemu-io");
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        let good = io("read -P 0 0 1");
        let first = plain[0];
        let good_pattern = io(&format!("read -P {first} 0 1"));
        assert!(
            good_pattern.contains("read 1/1 bytes"),
            "{good} {good_pattern}"
        );
        let bad = io(&format!("read {PLAIN_BYTES} 4096"));
        assert!(bad.contains("Input/output error"), "{bad}");
        drop(server);
        let log = std::fs::read_to_string(&log).expect("log");
        assert_eq!(
            log.matches("integrity error: block at data sector 2048")
                .count(),
            1,
            "{log}"
        );
    }

    // A superblock flagged as recalculating is refused.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&wiped)
        .expect("open image");
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(SB_OFFSET + SB_FLAGS_AT))
        .expect("seek");
    f.read_exact(&mut b).expect("read flags");
    b[0] |= 2;
    f.seek(SeekFrom::Start(SB_OFFSET + SB_FLAGS_AT))
        .expect("seek");
    f.write_all(&b).expect("write flags");
    drop(f);
    let out = wiped.with_extension("out");
    let o = ucrypt(&["export", s(&wiped), s(&out), "--key-file", s(&key)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a recalculating superblock is refused");
    assert!(err.contains("recalculated"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `format --cipher chacha20-random --integrity poly1305`: the header says so (`luksDump`),
/// the import exports byte for byte, and one flipped ciphertext bit fails exactly its block.
#[test]
fn poly1305_volume_through_the_command() {
    let dir = std::env::temp_dir().join(format!("ucrypt-integrity-poly-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let key = dir.join("key");
    std::fs::write(&key, b"poly1305 passphrase").expect("key");
    let plain: Vec<u8> = (0..PLAIN_BYTES).map(|i| (i * 13 + i / 512) as u8).collect();
    let plain_path = dir.join("plain.bin");
    std::fs::write(&plain_path, &plain).expect("plain");
    let img = dir.join("poly.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(IMAGE_BYTES))
        .expect("image");
    ok(&[
        "format",
        "-q",
        "--cipher",
        "chacha20-random",
        "--integrity",
        "poly1305",
        "--sector-size",
        "512",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        s(&key),
        s(&img),
    ]);
    let dump = String::from_utf8(ok(&["luksDump", s(&img)]).stdout).expect("utf-8");
    assert!(dump.contains("chacha20-random"), "{dump}");
    assert!(dump.contains("poly1305"), "{dump}");
    assert!(dump.contains("tag size:       28 [bytes]"), "{dump}");
    // A key size ChaCha20 does not have is refused.
    let o = ucrypt(&[
        "format",
        "-q",
        "--cipher",
        "chacha20-random",
        "--integrity",
        "poly1305",
        "--key-size",
        "128",
        "--key-file",
        s(&key),
        s(&img),
    ]);
    assert!(
        !o.status.success(),
        "a 128-bit ChaCha20 key must be refused"
    );
    import_then_export(&img, &key, &plain_path, &plain);

    // One ciphertext bit of data sector 100 (512-byte sectors): that block fails.
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .expect("open image");
    let mut sb = vec![0u8; 4096];
    f.seek(SeekFrom::Start(SB_OFFSET)).expect("seek");
    f.read_exact(&mut sb).expect("superblock");
    let sb = ucrypt::integrity::Superblock::parse(&sb).expect("parse superblock");
    let layout = ucrypt::integrity::Layout::new(sb).expect("layout");
    let at = SB_OFFSET + layout.data_sector(100).expect("data sector") * 512 + 33;
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(at)).expect("seek");
    f.read_exact(&mut b).expect("read");
    b[0] ^= 0x10;
    f.seek(SeekFrom::Start(at)).expect("seek");
    f.write_all(&b).expect("write");
    drop(f);
    let out = img.with_extension("out");
    let o = ucrypt(&["export", s(&img), s(&out), "--key-file", s(&key)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "export over a flipped bit must fail");
    assert!(
        err.contains("integrity error: block at data sector 100"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `format --integrity hmac-* --integrity-key-size BITS` as cryptsetup 2.8 takes it: the volume
/// key is the cipher's key then the HMAC key, the segment records the HMAC key's bytes
/// (`integrity.key_size`, after the journal fields, as cryptsetup writes it), `luksDump` shows
/// `integrity key size: BITS [bits]`, and the volume round-trips. Refused as cryptsetup
/// refuses it (exit 1, its messages, nothing written): not a multiple of 8 bits, 0, under
/// 128 bits, or on an AEAD. Without `--integrity` the option changes nothing.
#[test]
fn integrity_key_size_as_cryptsetup_2_8() {
    let dir = std::env::temp_dir().join(format!("ucrypt-integrity-keysize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let key = dir.join("key");
    std::fs::write(&key, b"integrity passphrase").expect("key");
    let img = dir.join("vol.img");
    let fresh = |img: &Path| {
        let _ = std::fs::remove_file(img);
        std::fs::File::create(img)
            .and_then(|f| f.set_len(IMAGE_BYTES))
            .expect("image");
    };
    let format_cmd = |integrity: &'static str, cipher: &'static str, extra: &[&'static str]| {
        let mut a = vec![
            "luksFormat",
            "-q",
            "--type",
            "luks2",
            "-c",
            cipher,
            "--integrity",
            integrity,
            "--integrity-no-wipe",
            "--sector-size",
            "512",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ];
        a.extend(extra);
        a
    };
    for (integrity, cipher, bits, want) in [
        ("hmac-sha256", "aes-xts-plain64", "260", "Key size must be a multiple of 8 bits"),
        ("hmac-sha256", "aes-xts-plain64", "0", ""),
        ("hmac-sha256", "aes-xts-plain64", "120", "Integrity key size is too small."),
        (
            "aead",
            "aes-gcm-random",
            "256",
            "No known integrity specification pattern detected.\nCannot use specified integrity key size.",
        ),
        (
            "poly1305",
            "chacha20-random",
            "256",
            "Cannot use specified integrity key size.",
        ),
    ] {
        fresh(&img);
        let mut a: Vec<&str> = format_cmd(integrity, cipher, &["--integrity-key-size", bits]);
        a.extend(["--key-file", s(&key), s(&img)]);
        let o = ucrypt(&a);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{integrity} {bits}: {err}");
        assert!(err.contains(want), "{integrity} {bits}: {err}");
        let written = std::fs::read(&img).expect("image");
        assert!(
            written.iter().all(|&b| b == 0),
            "{integrity} {bits}: refused, yet written"
        );
    }

    // 792 bits for hmac-sha512 (a line of cryptsetup 2.8's luks2-integrity-test).
    fresh(&img);
    let mut a: Vec<&str> = format_cmd(
        "hmac-sha512",
        "aes-xts-plain64",
        &["-s", "512", "--integrity-key-size", "792"],
    );
    a.retain(|x| *x != "--integrity-no-wipe");
    a.extend(["--key-file", s(&key), s(&img)]);
    ok(&a);
    let dump = String::from_utf8_lossy(&ok(&["luksDump", s(&img)]).stdout).into_owned();
    assert!(
        dump.contains("\tintegrity: hmac(sha512)\n\tintegrity key size: 792 [bits]\n"),
        "{dump}"
    );
    assert!(dump.contains("\tKey:        1304 bits\n"), "{dump}");
    let json = String::from_utf8_lossy(&ok(&["luksDump", "--dump-json-metadata", s(&img)]).stdout)
        .into_owned();
    let compact: String = json.split_whitespace().collect();
    assert!(
        compact.contains(r#""integrity":{"type":"hmac(sha512)","journal_encryption":"none","journal_integrity":"none","key_size":99}"#),
        "{json}"
    );
    let plain: Vec<u8> = (0..PLAIN_BYTES).map(|i| (i * 13 + i / 512) as u8).collect();
    let plain_path = dir.join("plain.bin");
    std::fs::write(&plain_path, &plain).expect("plain");
    import_then_export(&img, &key, &plain_path, &plain);

    // Without --integrity the option changes nothing (cryptsetup reads it only with one).
    fresh(&img);
    ok(&[
        "luksFormat",
        "-q",
        "--integrity-key-size",
        "264",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        s(&key),
        s(&img),
    ]);
    let dump = String::from_utf8_lossy(&ok(&["luksDump", s(&img)]).stdout).into_owned();
    assert!(!dump.contains("integrity"), "{dump}");
    let _ = std::fs::remove_dir_all(&dir);
}
