//! LUKS2 reencryption metadata against cryptsetup's own: the typed state, the dump text and
//! the reencryption digest of headers cryptsetup 2.6 wrote.
//!
//! - `stored_crash_header_*`: the first 32 KiB (both header copies) of a 96 MiB volume that
//!   `cryptsetup reencrypt --resilience checksum --hotzone-size 4M` was SIGKILLed inside a
//!   hotzone, with the two volume keys (old, new) as cryptsetup's keyslots 0 and 1 hold them.
//! - `cryptsetup_*`: made at test time with the installed cryptsetup (skipped without it).

#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use ucrypt::backend::{Backend, DirectMode, FileBackend};
use ucrypt::luks::reencrypt::{Direction, Mode, ReencryptState, Resilience};
use ucrypt::luks::{self, Header, Unlock};
use ucrypt::SecretBytes;

mod common;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

fn luks2(h: &Header) -> &luks::Luks2Header {
    match h {
        Header::Luks2(h) => h,
        Header::Luks1(_) => panic!("LUKS1 header"),
    }
}

fn hex_key(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn stored_bytes() -> Vec<u8> {
    std::fs::read(format!("{DATA}/reencrypt-crash-hdr.bin")).unwrap()
}

fn stored() -> (Header, Vec<u8>, Vec<u8>) {
    let bytes = stored_bytes();
    let hdr = luks::parse_any(&bytes).unwrap();
    let keys = std::fs::read_to_string(format!("{DATA}/reencrypt-crash-keys.txt")).unwrap();
    let mut lines = keys.lines().filter(|l| !l.starts_with('#'));
    let old = hex_key(lines.next().unwrap());
    let new = hex_key(lines.next().unwrap());
    (hdr, old, new)
}

#[test]
fn stored_crash_header_typed_state() {
    let (hdr, _, _) = stored();
    let st = ReencryptState::from_metadata(luks2(&hdr).meta())
        .unwrap()
        .expect("in reencryption");
    assert_eq!(st.version, 2);
    assert_eq!(st.keyslot.id, 2);
    assert_eq!(st.keyslot.mode, Mode::Reencrypt);
    assert_eq!(st.keyslot.direction, Direction::Forward);
    assert_eq!(
        st.keyslot.resilience,
        Resilience::Checksum {
            hash: "sha256".into(),
            sector_size: 4096
        }
    );
    assert_eq!(st.in_reencryption, Some(1));
    assert!(st.needs_recovery());
    assert_eq!((st.backup_previous, st.backup_final), (3, 4));
    assert_eq!(st.backup_moved, None);
    // cryptsetup's live segments are the layout ucrypt's planner gives for their position.
    let meta = luks2(&hdr).meta();
    ucrypt::luks::reencrypt::plan::check_layout(meta, &st, u64::MAX >> 1)
        .expect("cryptsetup's layout passes the layout checks");
}

#[test]
fn stored_crash_header_digest_matches_cryptsetup() {
    let (hdr, old, new) = stored();
    let h = luks2(&hdr);
    let old = h
        .verify_key(Some(0), SecretBytes::from_slice(&old))
        .unwrap();
    let new = h
        .verify_key(Some(1), SecretBytes::from_slice(&new))
        .unwrap();
    h.verify_reencrypt_digest(Some(&old), Some(&new)).unwrap();
    // Keys swapped, or the metadata changed by one field: refused.
    assert!(h.verify_reencrypt_digest(Some(&new), Some(&old)).is_err());
    let mut bytes = stored_bytes();
    let hdr_size = h.bin().hdr_size;
    common::mutate_json(hdr_size, &mut bytes, &|v| {
        v["segments"]["4"]["sector_size"] = serde_json::json!(512)
    });
    let edited = luks::parse_any(&bytes).unwrap();
    assert!(matches!(
        luks2(&edited).verify_reencrypt_digest(Some(&old), Some(&new)),
        Err(ucrypt::Error::BadHeader {
            check: "reencrypt-digest",
            ..
        })
    ));
}

// ---------------------------------------------------------------- with cryptsetup

fn have_cryptsetup() -> bool {
    Command::new("cryptsetup")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn run(args: &[&str]) -> String {
    let o = Command::new("cryptsetup").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "cryptsetup {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

const IMAGE_BYTES: u64 = 32 << 20;

/// A LUKS2 file volume with passphrase "pass" (pbkdf2, fast), then `reencrypt --init-only`
/// with `extra` resilience arguments: the metadata of a reencryption that has not started.
fn init_only(img: &Path, pw: &Path, extra: &[&str]) {
    let img = img.display().to_string();
    let pw = pw.display().to_string();
    std::fs::write(&pw, b"pass").unwrap();
    let fast = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
    let mut a = vec!["luksFormat", "-q", "--type", "luks2", "--key-file", &pw];
    a.extend_from_slice(&fast);
    a.push(&img);
    run(&a);
    let mut a = vec![
        "reencrypt",
        "-q",
        "--init-only",
        "--force-offline-reencrypt",
        "--key-file",
        &pw,
    ];
    a.extend_from_slice(&fast);
    a.extend_from_slice(extra);
    a.push(&img);
    run(&a);
}

fn unlock_slot(dev: &FileBackend, hdr: &Header, slot: u32) -> luks::VolumeKey {
    let (_, vk) = luks::unlock_key(
        dev,
        hdr,
        Unlock::Passphrase(SecretBytes::from_slice(b"pass")),
        Some(slot),
    )
    .unwrap();
    vk
}

fn check_init_only(extra: &[&str], want: Resilience) {
    if !have_cryptsetup() {
        println!("SKIPPED cryptsetup_init_only: cryptsetup is not installed");
        return;
    }
    let file = kit::TempFile::new(IMAGE_BYTES);
    let pw = kit::TempFile::new(0);
    init_only(&file.0, &pw.0, extra);
    let img = file.0.display().to_string();
    let dev = Arc::new(FileBackend::open(&img, false, DirectMode::Never).unwrap());
    let hdr = luks::read_header(dev.as_ref() as &dyn Backend).unwrap();
    let h = luks2(&hdr);
    let st = ReencryptState::from_metadata(h.meta()).unwrap().unwrap();
    assert_eq!(st.keyslot.resilience, want);
    assert_eq!(st.in_reencryption, None);
    // cryptsetup's key rotation: keyslot 0 holds the old key, the new keyslot the new one.
    let old = unlock_slot(&dev, &hdr, 0);
    let new = unlock_slot(&dev, &hdr, 1);
    h.verify_reencrypt_digest(Some(&old), Some(&new)).unwrap();
    assert!(h.verify_reencrypt_digest(Some(&new), Some(&old)).is_err());
    // The dump is cryptsetup's, byte for byte.
    assert_eq!(luks::dump(&hdr, &img, None), run(&["luksDump", &img]));
}

#[test]
fn cryptsetup_init_only_checksum() {
    check_init_only(
        &["--resilience", "checksum", "--hotzone-size", "4M"],
        Resilience::Checksum {
            hash: "sha256".into(),
            sector_size: 4096,
        },
    );
}

#[test]
fn cryptsetup_init_only_journal() {
    check_init_only(&["--resilience", "journal"], Resilience::Journal);
}

#[test]
fn cryptsetup_init_only_none() {
    check_init_only(&["--resilience", "none"], Resilience::None);
}

/// The dump of the stored header is what cryptsetup 2.6.1's luksDump printed for the image
/// (hotzone flagged in-reencryption, backups, the reencrypt keyslot).
#[test]
fn stored_crash_header_dump_is_cryptsetups() {
    let (hdr, _, _) = stored();
    let want = std::fs::read_to_string(format!("{DATA}/reencrypt-crash-luksdump.txt")).unwrap();
    assert_eq!(luks::dump(&hdr, "unused", None), want);
}
