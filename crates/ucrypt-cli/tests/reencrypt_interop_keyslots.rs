//! `ucrypt reencrypt` and cryptsetup 2.6 on volumes of several keyslots: which passphrase a
//! key file unlocks, keyslots rotated from a pipe of passphrases by either tool (the same
//! keyslots, PBKDFs and metadata), what both refuse, and an Argon2 keyslot's threads.
//!
//! Needs `cryptsetup` (Debian package cryptsetup-bin); without it each test prints
//! `SKIPPED: <reason>` (or fails when the env var CI is set).

#[path = "../../../tests/kit/mod.rs"]
mod kit;
mod reencrypt_common;

use std::path::{Path, PathBuf};

use kit::cryptsetup::{self as cs, CRYPTSETUP, FAST_PBKDF2};
use kit::{ok, ok_in, run, run_in, s, stderr, TempDir};
use reencrypt_common::*;

// ------------------------------------------------------------------------- several keyslots

/// The passphrases of keyslots 0, 1 and 2 of [`three_keyslots`].
const PASSPHRASES: [&str; 3] = ["rotate-me", "second passphrase", "third"];

/// A [`Rotate`] volume with two more keyslots added by cryptsetup, each of another PBKDF:
/// keyslot 1 pbkdf2-sha512 of 1500 iterations, keyslot 2 argon2id (4 passes, 64 KiB, 1
/// thread). Returns the volume and the key files of the three passphrases.
fn three_keyslots(t: &TempDir, sector: u32) -> (Vol, Vec<PathBuf>) {
    let vol = Rotate.volume(t, 20, sector);
    let mut keys = vec![vol.key.clone()];
    let kdfs: [&[&str]; 2] = [
        &[
            "--pbkdf",
            "pbkdf2",
            "--hash",
            "sha512",
            "--pbkdf-force-iterations",
            "1500",
        ],
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-memory",
            "64",
            "--pbkdf-parallel",
            "1",
        ],
    ];
    for (i, kdf) in kdfs.iter().enumerate() {
        let k = t.file(&format!("key{}", i + 1), PASSPHRASES[i + 1]);
        cs::ok(
            &[
                &["luksAddKey", "-q", "--key-file", s(&vol.key)],
                *kdf,
                &[s(&vol.img), s(&k)],
            ]
            .concat(),
        );
        keys.push(k);
    }
    (vol, keys)
}

/// The passphrases of [`three_keyslots`] as both tools read them from a pipe: one a line.
fn passphrase_lines(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| format!("{}\n", PASSPHRASES[i % 3]).into_bytes())
        .collect()
}

/// The keyslots luksDump lists, by number and type.
fn keyslot_list(img: &Path) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&cs::dump_json(img)).expect("json");
    let mut l: Vec<String> = v["keyslots"]
        .as_object()
        .expect("keyslots")
        .iter()
        .map(|(id, k)| format!("{id}:{}", k["type"].as_str().unwrap_or("?")))
        .collect();
    l.sort();
    l
}

/// The PBKDF of keyslot `slot` without its salt (type, hash or costs), from luksDump's JSON.
fn keyslot_kdf(img: &Path, slot: u32) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(&cs::dump_json(img)).expect("json");
    let mut kdf = v["keyslots"][slot.to_string()]["kdf"].clone();
    kdf["salt"] = serde_json::Value::Null;
    kdf
}

/// cryptsetup opens keyslot `slot` with the passphrase in `key`; ucrypt reads the plaintext
/// with it.
fn opens_slot(t: &TempDir, vol: &Vol, key: &Path, slot: u32, what: &str) {
    let n = slot.to_string();
    cs::ok(&[
        "open",
        "--test-passphrase",
        "--key-slot",
        &n,
        "--key-file",
        s(key),
        s(&vol.img),
    ]);
    let with_key = Vol {
        key: key.to_path_buf(),
        ..vol.copy(t, "with-key")
    };
    assert!(
        with_key.exported(t) == vol.plain,
        "{what}: data, keyslot {slot}"
    );
}

/// Two keyslots: without `--key-slot` a key file is refused (exit 1, cryptsetup's rule); with
/// it the named keyslot's passphrase gets the new key, and finalisation drops every old
/// keyslot (cryptsetup 2.6.1 does the same); a wrong passphrase exits 2 as cryptsetup's.
#[test]
fn key_slot_rotation_with_two_keyslots() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("slots");
    let vol = Rotate.volume(&t, 20, 4096);
    let key2 = t.file("key2", "second");
    cs::ok(
        &[
            &["luksAddKey", "-q", "--key-file", s(&vol.key)],
            FAST_PBKDF2,
            &[s(&vol.img), s(&key2)],
        ]
        .concat(),
    );
    let o = run(UCRYPT, &vol.reencrypt(Ucrypt, &[]));
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("exactly one key slot active"));
    let wrong = t.file("wrong", "nope");
    let o = run(
        UCRYPT,
        &[
            "reencrypt",
            "-q",
            "--key-slot",
            "1",
            "--key-file",
            s(&wrong),
            s(&vol.img),
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(!vol.in_reencryption());
    let rotated = Vol {
        key: key2.clone(),
        ..vol.copy(&t, "rotated")
    };
    ok(UCRYPT, &rotated.reencrypt(Ucrypt, &["--key-slot", "1"]));
    rotated.finished(&t, "keyslot 1");
    let o = cs::run(&[
        "open",
        "--test-passphrase",
        "--key-file",
        s(&vol.key),
        s(&rotated.img),
    ]);
    assert_eq!(o.status.code(), Some(2), "the other old keyslot is gone");
}

/// A volume with three keyslots of three PBKDFs, rotated from a pipe of three passphrases,
/// by ucrypt and by cryptsetup from copies of one image: `--init-only` leaves the same
/// keyslots (3, 4, 5 for the new key, each with its old keyslot's PBKDF, the reencrypt
/// keyslot after them), segments, digest lists and config; each finishes the other's; the
/// result opens with each passphrase in its new keyslot (cryptsetup `--key-slot N`), the old
/// keyslots are gone, and the data is the original.
#[test]
fn several_keyslots_init_matches_cryptsetup_and_each_finishes_the_other() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("slots3");
    let (mine, keys) = three_keyslots(&t, 4096);
    let theirs = mine.copy(&t, "theirs");
    for (tool, vol) in [(Ucrypt, &mine), (Cryptsetup, &theirs)] {
        let a = [
            "reencrypt",
            "--init-only",
            "-q",
            "--force-offline-reencrypt",
            s(&vol.img),
        ];
        ok_in(tool.prog(), &a, &passphrase_lines(3));
    }
    assert_eq!(metadata(&mine.img), metadata(&theirs.img), "init");
    let want = [
        "0:luks2",
        "1:luks2",
        "2:luks2",
        "3:luks2",
        "4:luks2",
        "5:luks2",
        "6:reencrypt",
    ];
    assert_eq!(keyslot_list(&mine.img), want);
    for (old, new) in [(0u32, 3u32), (1, 4), (2, 5)] {
        assert_eq!(
            keyslot_kdf(&mine.img, new),
            keyslot_kdf(&mine.img, old),
            "keyslot {new}"
        );
    }
    for (starter, vol) in [(Ucrypt, &mine), (Cryptsetup, &theirs)] {
        let fin = starter.other();
        let a = [
            "reencrypt",
            "--resume-only",
            "-q",
            "--force-offline-reencrypt",
            "--key-file",
            s(&keys[1]),
            s(&vol.img),
        ];
        ok(fin.prog(), &a);
        assert_eq!(
            keyslot_list(&vol.img),
            ["3:luks2", "4:luks2", "5:luks2"],
            "{starter:?} init"
        );
        for (i, key) in keys.iter().enumerate() {
            opens_slot(&t, vol, key, i as u32 + 3, &format!("{starter:?} init"));
        }
    }
}

/// A whole run from a pipe each way: ucrypt rotates and cryptsetup opens each passphrase in
/// its keyslot; cryptsetup rotates and ucrypt reads the data with each passphrase.
#[test]
fn several_keyslots_rotated_by_either_tool() {
    if !cs::require() {
        return;
    }
    for tool in [Ucrypt, Cryptsetup] {
        let t = TempDir::new("slots-run");
        let (vol, keys) = three_keyslots(&t, 512);
        let a = [
            "reencrypt",
            "-q",
            "--force-offline-reencrypt",
            "--hotzone-size",
            "1M",
            s(&vol.img),
        ];
        ok_in(tool.prog(), &a, &passphrase_lines(3));
        assert_eq!(
            keyslot_list(&vol.img),
            ["3:luks2", "4:luks2", "5:luks2"],
            "{tool:?}"
        );
        assert_eq!(keyslot_kdf(&vol.img, 4)["hash"], "sha512", "{tool:?}");
        assert_eq!(keyslot_kdf(&vol.img, 5)["type"], "argon2id", "{tool:?}");
        for (i, key) in keys.iter().enumerate() {
            opens_slot(&t, &vol, key, i as u32 + 3, &format!("{tool:?}"));
        }
    }
}

/// What both tools refuse on a volume of several keyslots, with the same exit code and
/// cryptsetup's words, writing nothing: a key file without `--key-slot`; a wrong passphrase
/// for one keyslot (exit 2); `--key-slot` of a keyslot that is not there (exit 1, no words
/// from cryptsetup); a volume whose keyslots leave no room for the new ones (16 active
/// keyslots need 16 more and the reencrypt keyslot). And a `--resilience-hash` that is no
/// hash: exit 1 from both, but cryptsetup adds the new keyslots, fails ("Failed to
/// initialize LUKS2 reencryption in metadata.") and destroys them again (its header
/// changed), while ucrypt refuses before any write.
#[test]
fn several_keyslots_refusals_match_cryptsetup() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("slots-refuse");
    let (vol, keys) = three_keyslots(&t, 4096);
    let before = vol.raw();
    let k0 = s(&keys[0]);
    let rows: [(&[&str], &[u8], i32, &str); 3] = [
        (
            &["--key-file", k0],
            b"",
            1,
            "Key file can be used only with --key-slot or with exactly one key slot active.",
        ),
        (
            &[],
            b"rotate-me\nnot the second\nthird\n",
            2,
            "No key available with this passphrase.",
        ),
        (&["--key-slot", "7", "--key-file", k0], b"", 1, ""),
    ];
    for (extra, input, code, words) in rows {
        for tool in [Ucrypt, Cryptsetup] {
            let a = [
                &["reencrypt", "-q", "--force-offline-reencrypt"],
                extra,
                &[s(&vol.img)],
            ]
            .concat();
            let o = run_in(tool.prog(), &a, input);
            assert_eq!(
                o.status.code(),
                Some(code),
                "{tool:?} {extra:?}: {}",
                stderr(&o)
            );
            assert!(
                stderr(&o).contains(words),
                "{tool:?} {extra:?}: {}",
                stderr(&o)
            );
            assert!(vol.raw() == before, "{tool:?} {extra:?} wrote");
        }
    }
    for tool in [Ucrypt, Cryptsetup] {
        let copy = vol.copy(&t, "nohash");
        let a = [
            "reencrypt",
            "-q",
            "--force-offline-reencrypt",
            "--resilience-hash",
            "nohash",
            s(&copy.img),
        ];
        let o = run_in(tool.prog(), &a, &passphrase_lines(3));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{tool:?}: {err}");
        assert_eq!(
            keyslot_list(&copy.img),
            ["0:luks2", "1:luks2", "2:luks2"],
            "{tool:?}"
        );
        if tool == Ucrypt {
            assert!(
                err.contains("Hash algorithm nohash is not available"),
                "{err}"
            );
            assert!(copy.raw() == before, "ucrypt wrote");
        }
    }
    // 16 active keyslots.
    for i in 3..16 {
        cs::ok(
            &[
                &["luksAddKey", "-q", "--key-file", k0],
                FAST_PBKDF2,
                &[s(&vol.img), s(&keys[i % 3])],
            ]
            .concat(),
        );
    }
    let full = vol.raw();
    for tool in [Ucrypt, Cryptsetup] {
        let o = run_in(
            tool.prog(),
            &["reencrypt", "-q", "--force-offline-reencrypt", s(&vol.img)],
            &passphrase_lines(16),
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{tool:?}: {err}");
        assert!(
            err.contains("Not enough free keyslots for reencryption."),
            "{tool:?}: {err}"
        );
        assert!(vol.raw() == full, "{tool:?} wrote");
    }
}

/// An Argon2 keyslot of 4 threads (made by `ucrypt add-key`: cryptsetup caps the threads at
/// the CPUs online when it makes one) rotated by both tools from copies of one image: the
/// new keyslots get the same PBKDF, its threads capped as cryptsetup caps them (2 on a
/// 2-CPU machine), its passes and memory copied.
#[test]
fn argon2_keyslot_copied_as_cryptsetup_copies_it() {
    if !cs::require() {
        return;
    }
    let t = TempDir::new("slots-argon");
    let vol = Rotate.volume(&t, 20, 4096);
    let key2 = t.file("key2", "argon");
    let argon = [
        "--pbkdf",
        "argon2id",
        "--pbkdf-force-iterations",
        "4",
        "--pbkdf-memory",
        "64",
        "--pbkdf-parallel",
        "4",
    ];
    ok(
        UCRYPT,
        &[
            &["add-key", "-q", "--key-file", s(&vol.key)][..],
            &argon,
            &[s(&vol.img), s(&key2)],
        ]
        .concat(),
    );
    cs::ok(&["luksKillSlot", "-q", s(&vol.img), "0"]);
    assert_eq!(keyslot_kdf(&vol.img, 1)["cpus"], 4);
    let mine = Vol {
        key: key2.clone(),
        ..vol.copy(&t, "mine")
    };
    let theirs = mine.copy(&t, "theirs");
    ok(
        UCRYPT,
        &[
            "reencrypt",
            "--init-only",
            "-q",
            "--key-file",
            s(&key2),
            s(&mine.img),
        ],
    );
    cs::ok(&[
        "reencrypt",
        "--init-only",
        "-q",
        "--key-file",
        s(&key2),
        s(&theirs.img),
    ]);
    let cpus = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(4);
    assert_eq!(keyslot_kdf(&mine.img, 0), keyslot_kdf(&theirs.img, 0));
    assert_eq!(keyslot_kdf(&mine.img, 0)["cpus"], cpus);
    assert_eq!(metadata(&mine.img), metadata(&theirs.img));
    ok(CRYPTSETUP, &mine.resume(Cryptsetup, &[]));
    opens_slot(&t, &mine, &key2, 0, "argon2");
}
