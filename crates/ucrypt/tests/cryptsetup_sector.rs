//! Interop with real cryptsetup (Debian cryptsetup-bin): `cryptsetup reencrypt --encrypt`
//! (offline, in userspace, detached header so the data stays at offset 0) encrypts a known
//! plaintext image for each spec, key size and sector size; with the volume key from
//! `luksDump --dump-volume-key`, ucrypt's sector layer must decrypt it to exactly the plaintext,
//! and ucrypt's ciphertext of the plaintext must be byte-identical to cryptsetup's.

#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod support;

use std::path::Path;
use std::process::Command;

use support::Rng;
use ucrypt::sector::{CipherSpec, Geometry, SectorCipher, SectorSize};

/// (spec, key bits). Not here: cipher_null and 384-bit XTS, which cryptsetup's userspace
/// reencryption cannot do without device-mapper (the python differential test covers them).
const ROWS: &[(&str, u32)] = &[
    ("aes-xts-plain64", 512),
    ("aes-xts-plain64", 256),
    ("aes-xts-plain", 512),
    ("aes-xts-plain64be", 512),
    ("aes-xts-essiv:sha256", 512),
    ("aes-cbc-essiv:sha256", 256),
    ("aes-cbc-plain64", 256),
    ("aes-cbc-plain64", 128),
    ("aes-cbc-plain", 192),
];
const IMAGE_BYTES: usize = 1 << 20;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run cryptsetup");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The volume key printed by `luksDump --dump-volume-key` ("MK dump:" then hex byte pairs).
fn parse_mk_dump(text: &str) -> Vec<u8> {
    let start = text.find("MK dump:").expect("MK dump in luksDump output") + "MK dump:".len();
    let mut hexs = String::new();
    for (i, line) in text[start..].lines().enumerate() {
        if i > 0 && !line.starts_with(char::is_whitespace) {
            break;
        }
        hexs.push_str(line);
    }
    kit::unhex(&hexs)
}

#[test]
fn cryptsetup_reencrypt_matches_sector_layer() {
    if !support::have_tool("cryptsetup", "cryptsetup-bin", "cryptsetup_sector") {
        return;
    }
    let dir = tempdir();
    let mut rng = Rng::from_env("cryptsetup_sector");
    std::fs::write(dir.join("key"), b"interop passphrase").unwrap();
    for &(spec_str, bits) in ROWS {
        for ss in [512u64, 4096] {
            let what = format!("{spec_str} {bits}-bit key, {ss}-byte sectors");
            let plain = rng.bytes(IMAGE_BYTES);
            let data = dir.join("data.img");
            let hdr = dir.join("hdr.img");
            std::fs::write(&data, &plain).unwrap();
            let _ = std::fs::remove_file(&hdr);
            std::fs::File::create(&hdr)
                .unwrap()
                .set_len(16 << 20)
                .unwrap();
            run(Command::new("cryptsetup")
                .args([
                    "reencrypt",
                    "--encrypt",
                    "--type",
                    "luks2",
                    "-q",
                    "--force-offline-reencrypt",
                ])
                .args([
                    "--cipher",
                    spec_str,
                    "--key-size",
                    &bits.to_string(),
                    "--sector-size",
                    &ss.to_string(),
                ])
                .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
                .arg("--key-file")
                .arg(dir.join("key"))
                .arg("--header")
                .arg(&hdr)
                .arg(&data));
            let dump = run(Command::new("cryptsetup")
                .args(["luksDump", "--dump-volume-key", "-q"])
                .arg("--key-file")
                .arg(dir.join("key"))
                .arg(&hdr));
            let key = parse_mk_dump(&dump);
            assert_eq!(
                key.len() * 8,
                bits as usize,
                "{what}: key length from luksDump"
            );
            let theirs = std::fs::read(&data).unwrap();
            assert_ne!(theirs, plain, "{what}: cryptsetup did not encrypt");

            let spec: CipherSpec = spec_str.parse().unwrap();
            let mut c =
                SectorCipher::new(spec, &key, Geometry::new(SectorSize::new(ss).unwrap())).unwrap();
            let mut ours = plain.clone();
            c.encrypt(0, &mut ours).unwrap();
            assert!(
                ours == theirs,
                "{what}: ucrypt ciphertext differs from cryptsetup's"
            );
            let mut back = theirs.clone();
            c.decrypt(0, &mut back).unwrap();
            assert!(
                back == plain,
                "{what}: ucrypt cannot decrypt cryptsetup's ciphertext"
            );
            println!("ok: {what}");
        }
    }
}

/// A scratch directory, removed when dropped (also when the test fails).
struct TempDir(std::path::PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> TempDir {
    let base = std::env::var_os("TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new("/tmp").into());
    let d = base.join(format!("ucrypt-cs-sector-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}
