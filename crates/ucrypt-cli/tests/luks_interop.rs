//! Interop with the real cryptsetup 2.6 and qemu-img/qemu-io: volumes each tool makes, the
//! other opens, with the same volume key.
//!
//! Needs the Debian packages `cryptsetup-bin` and `qemu-utils`; a missing tool prints
//! `SKIPPED: <reason>` (or fails when the env var CI is set, since CI installs them).

use std::path::Path;
use std::process::{Command, Output, Stdio};

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{ok, require as have, run, s, TempDir, FAST_PBKDF2, UCRYPT};

/// `PROG luksFormat -q EXTRA... --pbkdf pbkdf2 (fast) IMG KEYFILE`, which must succeed.
fn luks_format(prog: &str, img: &Path, key: &Path, extra: &[&str]) {
    let mut f = vec!["luksFormat", "-q"];
    f.extend(extra);
    f.extend(FAST_PBKDF2);
    f.extend([s(img), s(key)]);
    ok(prog, &f);
}

/// The volume key from a `--dump-volume-key` output ("MK dump:" hex lines).
fn mk_from_dump(out: &str) -> Vec<u8> {
    let start = out
        .find("MK dump:")
        .unwrap_or_else(|| panic!("no MK dump in:\n{out}"));
    let mut key = Vec::new();
    for (i, line) in out[start + "MK dump:".len()..].lines().enumerate() {
        let t = line.trim();
        if i > 0 && (t.is_empty() || t.contains(':')) {
            break;
        }
        for h in t.split_whitespace() {
            key.push(u8::from_str_radix(h, 16).expect("hex byte"));
        }
    }
    key
}

/// Volume key via cryptsetup and via ucrypt; both must agree.
fn keys_agree(img: &Path, key_file: &Path, header: Option<&Path>) -> Vec<u8> {
    let mut args = vec![
        "luksDump",
        "--dump-volume-key",
        "-q",
        "--key-file",
        s(key_file),
    ];
    if let Some(h) = header {
        args.extend(["--header", s(h)]);
    }
    args.push(s(img));
    let c = mk_from_dump(&ok("cryptsetup", &args));
    let u = mk_from_dump(&ok(UCRYPT, &args));
    assert!(!c.is_empty());
    assert_eq!(c, u, "volume keys differ for {}", img.display());
    c
}

/// `open --test-passphrase -v` with a key file: the slot that opened (ucrypt) or success.
fn test_passphrase(prog: &str, img: &Path, key_file: &Path, header: Option<&Path>) -> Output {
    let mut args = vec!["open", "--test-passphrase", "-v", "--key-file", s(key_file)];
    if let Some(h) = header {
        args.extend(["--header", s(h)]);
    }
    args.push(s(img));
    run(prog, &args)
}

fn assert_opens(prog: &str, img: &Path, key_file: &Path, header: Option<&Path>, slot: u32) {
    let o = test_passphrase(prog, img, key_file, header);
    let err = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{prog} cannot open {}: {err}",
        img.display()
    );
    assert!(
        err.contains(&format!("Key slot {slot} unlocked")),
        "{prog}: expected slot {slot}: {err}"
    );
}

/// No keyslot left at all: both tools say so and exit 1.
fn assert_no_keyslot(prog: &str, img: &Path, key_file: &Path, header: Option<&Path>) {
    let o = test_passphrase(prog, img, key_file, header);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{prog}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("No usable keyslot is available."),
        "{prog}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn assert_wrong(prog: &str, img: &Path, key_file: &Path, header: Option<&Path>) {
    let o = test_passphrase(prog, img, key_file, header);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{prog} opened with a wrong passphrase"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("No key available with this passphrase."),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// cryptsetup → ucrypt: one row per format variant cryptsetup users meet.
#[test]
fn cryptsetup_volumes_open_in_ucrypt() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("c2u");
    let k0 = t.file("k0", b"first passphrase");
    let k1 = t.file("k1", b"second\npassphrase\x00with bytes");
    let bad = t.file("bad", b"first passphrasE");
    // Forced costs, no benchmark: cryptsetup 2.6.1's argon2 calibration with a short
    // --iter-time died of a divide error (SIGFPE in libcryptsetup) on a loaded host.
    let argon = |kind: &'static str| -> Vec<&'static str> {
        vec![
            "--pbkdf",
            kind,
            "--pbkdf-memory",
            "64",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-parallel",
            "2",
        ]
    };
    // (name, luksFormat arguments, detached header)
    let rows: Vec<(&str, Vec<&str>, bool)> = vec![
        (
            "luks2-pbkdf2-sha256-4k",
            [FAST_PBKDF2, &["--hash", "sha256", "--sector-size", "4096"]].concat(),
            false,
        ),
        (
            "luks2-pbkdf2-sha512-512",
            [FAST_PBKDF2, &["--hash", "sha512", "--sector-size", "512"]].concat(),
            false,
        ),
        (
            "luks2-pbkdf2-sha1",
            [FAST_PBKDF2, &["--hash", "sha1"]].concat(),
            false,
        ),
        ("luks2-argon2i", argon("argon2i"), false),
        ("luks2-argon2id", argon("argon2id"), false),
        (
            "luks2-xts-256",
            [FAST_PBKDF2, &["--key-size", "256"]].concat(),
            false,
        ),
        (
            "luks2-cbc-essiv",
            [
                FAST_PBKDF2,
                &["--cipher", "aes-cbc-essiv:sha256", "--key-size", "256"],
            ]
            .concat(),
            false,
        ),
        ("luks2-detached", FAST_PBKDF2.to_vec(), true),
        (
            "luks1-sha256",
            [FAST_PBKDF2, &["--type", "luks1"]].concat(),
            false,
        ),
        (
            "luks1-sha1-cbc",
            [
                FAST_PBKDF2,
                &[
                    "--type",
                    "luks1",
                    "--hash",
                    "sha1",
                    "--cipher",
                    "aes-cbc-essiv:sha256",
                    "--key-size",
                    "256",
                ],
            ]
            .concat(),
            false,
        ),
        (
            "luks1-detached",
            [FAST_PBKDF2, &["--type", "luks1"]].concat(),
            true,
        ),
        // The hashes beyond SHA-1/SHA-2 that cryptsetup's backend offers.
        (
            "luks1-ripemd160",
            [FAST_PBKDF2, &["--type", "luks1", "--hash", "ripemd160"]].concat(),
            false,
        ),
        (
            "luks1-whirlpool",
            [FAST_PBKDF2, &["--type", "luks1", "--hash", "whirlpool"]].concat(),
            false,
        ),
        (
            "luks1-blake2s-256",
            [FAST_PBKDF2, &["--type", "luks1", "--hash", "blake2s-256"]].concat(),
            false,
        ),
        (
            "luks2-pbkdf2-sha3-256",
            [FAST_PBKDF2, &["--hash", "sha3-256"]].concat(),
            false,
        ),
        (
            "luks2-pbkdf2-blake2b-512",
            [FAST_PBKDF2, &["--hash", "blake2b-512"]].concat(),
            false,
        ),
        (
            "luks2-pbkdf2-sm3",
            [FAST_PBKDF2, &["--hash", "sm3"]].concat(),
            false,
        ),
    ];
    for (name, fmt, detached) in rows {
        let img = t.image(&format!("{name}.img"), 20);
        let hdr = t.path(&format!("{name}.hdr"));
        let header = detached.then_some(hdr.as_path());
        let mut args = vec!["luksFormat", "-q", "--batch-mode"];
        args.extend(fmt.iter().copied());
        if detached {
            std::fs::File::create(&hdr)
                .expect("header file")
                .set_len(16 << 20)
                .expect("size");
            args.extend(["--header", s(&hdr)]);
        }
        args.extend([s(&img), s(&k0)]);
        ok("cryptsetup", &args);
        // A second passphrase in slot 3 (pbkdf2 always: keeps the row fast).
        let mut add = vec!["luksAddKey", "-q", "--key-file", s(&k0), "--key-slot", "3"];
        add.extend(FAST_PBKDF2);
        if let Some(h) = header {
            add.extend(["--header", s(h)]);
        }
        add.extend([s(&img), s(&k1)]);
        ok("cryptsetup", &add);
        eprintln!("row {name}");
        assert_opens(UCRYPT, &img, &k0, header, 0);
        assert_opens(UCRYPT, &img, &k1, header, 3);
        assert_wrong(UCRYPT, &img, &bad, header);
        keys_agree(&img, &k0, header);
        keys_agree(&img, &k1, header);
        // ucrypt's plain dump parses what cryptsetup wrote.
        let mut d = vec!["luksDump"];
        if let Some(h) = header {
            d.extend(["--header", s(h)]);
        }
        d.push(s(&img));
        ok(UCRYPT, &d);
    }
}

/// LUKS2 keyslot priorities: a "prefer" slot is tried first, an "ignore" slot only by number.
#[test]
fn cryptsetup_priorities_are_honoured() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("prio");
    let k0 = t.file("k0", b"zero");
    let k1 = t.file("k1", b"one");
    let img = t.image("p.img", 20);
    luks_format("cryptsetup", &img, &k0, &[]);
    let mut a = vec!["luksAddKey", "-q", "--key-file", s(&k0)];
    a.extend(FAST_PBKDF2);
    a.extend([s(&img), s(&k1)]);
    ok("cryptsetup", &a);
    ok(
        "cryptsetup",
        &["config", "--priority", "ignore", "--key-slot", "1", s(&img)],
    );
    // Slot 1 is ignored unless asked for by number.
    assert_wrong(UCRYPT, &img, &k1, None);
    ok(
        UCRYPT,
        &[
            "open",
            "--test-passphrase",
            "--key-file",
            s(&k1),
            "--key-slot",
            "1",
            s(&img),
        ],
    );
    ok(
        "cryptsetup",
        &["config", "--priority", "prefer", "--key-slot", "1", s(&img)],
    );
    assert_opens(UCRYPT, &img, &k1, None, 1);
    let dump = ok(UCRYPT, &["luksDump", s(&img)]);
    assert!(dump.contains("Priority:   preferred\n"), "{dump}");
}

/// ucrypt → cryptsetup: formats, key management and header verbs checked by cryptsetup.
#[test]
fn ucrypt_volumes_open_in_cryptsetup() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("u2c");
    let k0 = t.file("k0", b"ucrypt first");
    let k1 = t.file("k1", b"added by cryptsetup");
    let k2 = t.file("k2", b"added by ucrypt");
    let k3 = t.file("k3", b"changed by ucrypt");
    let rows: Vec<(&str, Vec<&str>, bool)> = vec![
        ("luks2-default-cipher", FAST_PBKDF2.to_vec(), false),
        (
            "luks2-argon2id",
            vec![
                "--pbkdf",
                "argon2id",
                "--pbkdf-memory",
                "64",
                "--iter-time",
                "50",
            ],
            false,
        ),
        (
            "luks2-argon2i-512",
            vec![
                "--pbkdf",
                "argon2i",
                "--pbkdf-memory",
                "64",
                "--pbkdf-force-iterations",
                "4",
                "--sector-size",
                "512",
            ],
            false,
        ),
        (
            "luks2-sha512-label",
            [
                FAST_PBKDF2,
                &[
                    "--hash",
                    "sha512",
                    "--label",
                    "ucrypt-test",
                    "--uuid",
                    "12345678-1234-4321-8765-123456789abc",
                ],
            ]
            .concat(),
            false,
        ),
        ("luks2-detached", FAST_PBKDF2.to_vec(), true),
        ("luks1", [FAST_PBKDF2, &["--type", "luks1"]].concat(), false),
        (
            "luks1-cbc-sha1",
            [
                FAST_PBKDF2,
                &[
                    "--type",
                    "luks1",
                    "--cipher",
                    "aes-cbc-essiv:sha256",
                    "--key-size",
                    "256",
                    "--hash",
                    "sha1",
                ],
            ]
            .concat(),
            false,
        ),
        (
            "luks1-whirlpool",
            [FAST_PBKDF2, &["--type", "luks1", "--hash", "whirlpool"]].concat(),
            false,
        ),
        (
            "luks1-sha3-512",
            [FAST_PBKDF2, &["--type", "luks1", "--hash", "sha3-512"]].concat(),
            false,
        ),
        (
            "luks2-ripemd160",
            [FAST_PBKDF2, &["--hash", "ripemd160"]].concat(),
            false,
        ),
        (
            "luks2-blake2s-256",
            [FAST_PBKDF2, &["--hash", "blake2s-256"]].concat(),
            false,
        ),
    ];
    for (name, fmt, detached) in rows {
        eprintln!("row {name}");
        let img = t.image(&format!("{name}.img"), 20);
        let hdr = t.path(&format!("{name}.hdr"));
        let header = detached.then_some(hdr.as_path());
        let with_hdr = |mut v: Vec<&'static str>| -> Vec<String> {
            let mut out: Vec<String> = v.drain(..).map(String::from).collect();
            if let Some(h) = header {
                out.push("--header".into());
                out.push(s(h).into());
            }
            out
        };
        let mut args: Vec<String> = with_hdr(vec!["luksFormat", "-q"]);
        args.extend(fmt.iter().map(|x| x.to_string()));
        args.push(s(&img).into());
        args.push(s(&k0).into());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(UCRYPT, &argv);
        let mut dumpargs = with_hdr(vec!["luksDump"]);
        dumpargs.push(s(&img).into());
        let dv: Vec<&str> = dumpargs.iter().map(String::as_str).collect();
        let cdump = ok("cryptsetup", &dv);
        if name.contains("label") {
            assert!(cdump.contains("ucrypt-test"), "{cdump}");
            assert!(
                cdump.contains("12345678-1234-4321-8765-123456789abc"),
                "{cdump}"
            );
        }
        assert_opens("cryptsetup", &img, &k0, header, 0);
        // cryptsetup adds a key; ucrypt opens with it.
        let mut add = with_hdr(vec!["luksAddKey", "-q"]);
        add.extend(["--key-file".to_string(), s(&k0).to_string()]);
        add.extend(FAST_PBKDF2.iter().map(|x| x.to_string()));
        add.extend([s(&img).to_string(), s(&k1).to_string()]);
        let av: Vec<&str> = add.iter().map(String::as_str).collect();
        ok("cryptsetup", &av);
        assert_opens(UCRYPT, &img, &k1, header, 1);
        // ucrypt adds a key (slot 5); cryptsetup opens with it.
        let mut add = with_hdr(vec!["luksAddKey", "-q", "--key-slot", "5"]);
        add.extend(["--key-file".to_string(), s(&k1).to_string()]);
        add.extend(FAST_PBKDF2.iter().map(|x| x.to_string()));
        add.extend([s(&img).to_string(), s(&k2).to_string()]);
        let av: Vec<&str> = add.iter().map(String::as_str).collect();
        ok(UCRYPT, &av);
        assert_opens("cryptsetup", &img, &k2, header, 5);
        let vk = keys_agree(&img, &k2, header);
        // change-key: k2 -> k3 (keeps slot 5 on LUKS2).
        let mut ch = with_hdr(vec!["luksChangeKey", "-q"]);
        ch.extend(["--key-file".to_string(), s(&k2).to_string()]);
        ch.extend(FAST_PBKDF2.iter().map(|x| x.to_string()));
        ch.extend([s(&img).to_string(), s(&k3).to_string()]);
        let cv: Vec<&str> = ch.iter().map(String::as_str).collect();
        ok(UCRYPT, &cv);
        assert_wrong("cryptsetup", &img, &k2, header);
        let o = test_passphrase("cryptsetup", &img, &k3, header);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(keys_agree(&img, &k3, header), vk);
        // remove-key k1 (slot 1), kill-slot 0.
        let mut rm = with_hdr(vec!["luksRemoveKey", "-q"]);
        rm.extend([s(&img).to_string(), s(&k1).to_string()]);
        let rv: Vec<&str> = rm.iter().map(String::as_str).collect();
        ok(UCRYPT, &rv);
        assert_wrong("cryptsetup", &img, &k1, header);
        let mut ks = with_hdr(vec!["luksKillSlot", "-q"]);
        ks.extend([s(&img).to_string(), "0".to_string()]);
        let kv: Vec<&str> = ks.iter().map(String::as_str).collect();
        ok(UCRYPT, &kv);
        assert_wrong("cryptsetup", &img, &k0, header);
        let o = test_passphrase("cryptsetup", &img, &k3, header);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        ok("cryptsetup", &dv);
    }
}

/// --volume-key-file: ucrypt formats with a given key; cryptsetup reports the same key.
#[test]
fn volume_key_file_round_trip() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("vkf");
    let k0 = t.file("k0", b"pw");
    let key: Vec<u8> = (0..64u8)
        .map(|i| i.wrapping_mul(37).wrapping_add(5))
        .collect();
    let vkf = t.file("vk", &key);
    for ty in ["luks2", "luks1"] {
        let img = t.image(&format!("{ty}.img"), 20);
        let mut a = vec![
            "luksFormat",
            "-q",
            "--type",
            ty,
            "--volume-key-file",
            s(&vkf),
        ];
        a.extend(FAST_PBKDF2);
        a.extend([s(&img), s(&k0)]);
        ok(UCRYPT, &a);
        assert_eq!(keys_agree(&img, &k0, None), key, "{ty}");
        // dump --volume-key-file writes the key to a new file.
        let out = t.path(&format!("{ty}.vk"));
        ok(
            UCRYPT,
            &[
                "luksDump",
                "--dump-volume-key",
                "-q",
                "--key-file",
                s(&k0),
                "--volume-key-file",
                s(&out),
                s(&img),
            ],
        );
        assert_eq!(std::fs::read(&out).expect("vk file"), key);
        // add-key with the volume key instead of a passphrase.
        let k9 = t.file(&format!("{ty}.k9"), b"via volume key");
        let mut a = vec!["luksAddKey", "-q", "--volume-key-file", s(&vkf)];
        a.extend(FAST_PBKDF2);
        a.extend([s(&img), s(&k9)]);
        ok(UCRYPT, &a);
        let o = test_passphrase("cryptsetup", &img, &k9, None);
        assert_eq!(o.status.code(), Some(0), "{ty}");
    }
}

/// Header backup/restore, uuid, is-luks, config flags, and cryptsetup reading the results.
#[test]
fn header_verbs_interoperate() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("hdr");
    let k0 = t.file("k0", b"pw0");
    let img = t.image("h.img", 20);
    luks_format(UCRYPT, &img, &k0, &[]);
    // is-luks
    assert_eq!(run(UCRYPT, &["isLuks", s(&img)]).status.code(), Some(0));
    assert_eq!(
        run(UCRYPT, &["isLuks", "--type", "luks1", s(&img)])
            .status
            .code(),
        Some(1)
    );
    let plain = t.image("plain.img", 1);
    assert_eq!(run(UCRYPT, &["isLuks", s(&plain)]).status.code(), Some(1));
    let o = run(UCRYPT, &["luksDump", s(&plain)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("is not a valid LUKS device"));
    assert_eq!(
        run(UCRYPT, &["luksDump", s(&t.path("missing"))])
            .status
            .code(),
        Some(4)
    );
    // Wrong parameters: exit 1 like cryptsetup (not clap's 2, which means a bad passphrase).
    let code = |args: &[&str]| run(UCRYPT, args).status.code();
    assert_eq!(code(&["luksFormat"]), Some(1));
    assert_eq!(code(&["luksDump", "--no-such-option", s(&img)]), Some(1));
    let bad_cipher = [
        "luksFormat",
        "-q",
        "--cipher",
        "blowfish-cbc-plain64",
        s(&plain),
    ];
    assert_eq!(code(&bad_cipher), Some(1));
    // uuid
    ok(
        UCRYPT,
        &[
            "luksUUID",
            "-q",
            "--uuid",
            "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee",
            s(&img),
        ],
    );
    assert_eq!(
        ok("cryptsetup", &["luksUUID", s(&img)]).trim(),
        "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
    );
    assert_eq!(
        ok(UCRYPT, &["luksUUID", s(&img)]).trim(),
        "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
    );
    // persistent flags, label
    ok(
        UCRYPT,
        &[
            "config",
            "--persistent",
            "--allow-discards",
            "--perf-no_read_workqueue",
            "--perf-no_write_workqueue",
            "--label",
            "lbl",
            s(&img),
        ],
    );
    let d = ok("cryptsetup", &["luksDump", s(&img)]);
    assert!(
        d.contains("allow-discards")
            && d.contains("no-read-workqueue")
            && d.contains("no-write-workqueue"),
        "{d}"
    );
    assert!(d.contains("lbl"), "{d}");
    // cryptsetup's own flags show up in ucrypt.
    ok("cryptsetup", &["config", "--label", "from-cs", s(&img)]);
    let d = ok(UCRYPT, &["luksDump", s(&img)]);
    assert!(d.contains("from-cs") && d.contains("allow-discards"), "{d}");
    // backup, kill the only keyslot, restore: the passphrase works again.
    let bk = t.path("backup");
    ok(
        UCRYPT,
        &["luksHeaderBackup", s(&img), "--header-backup-file", s(&bk)],
    );
    ok(UCRYPT, &["luksKillSlot", "-q", s(&img), "0"]);
    assert_no_keyslot("cryptsetup", &img, &k0, None);
    assert_no_keyslot(UCRYPT, &img, &k0, None);
    ok(
        UCRYPT,
        &[
            "luksHeaderRestore",
            "-q",
            s(&img),
            "--header-backup-file",
            s(&bk),
        ],
    );
    assert_opens(UCRYPT, &img, &k0, None, 0);
    assert_eq!(
        test_passphrase("cryptsetup", &img, &k0, None).status.code(),
        Some(0)
    );
    // cryptsetup restores a ucrypt backup too.
    ok(UCRYPT, &["luksKillSlot", "-q", s(&img), "0"]);
    ok(
        "cryptsetup",
        &[
            "luksHeaderRestore",
            "-q",
            s(&img),
            "--header-backup-file",
            s(&bk),
        ],
    );
    assert_eq!(
        test_passphrase("cryptsetup", &img, &k0, None).status.code(),
        Some(0)
    );
}

/// A damaged primary header: ucrypt opens from the secondary, warns, and `repair` fixes it so
/// that cryptsetup sees a clean header.
#[test]
fn damaged_primary_is_recovered_and_repaired() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("rep");
    let k0 = t.file("k0", b"pw");
    let img = t.image("r.img", 20);
    luks_format("cryptsetup", &img, &k0, &[]);
    // Break the primary's JSON (its checksum then fails).
    let mut bytes = std::fs::read(&img).expect("read");
    bytes[4096 + 20] ^= 0x55;
    std::fs::write(&img, &bytes).expect("write");
    let o = test_passphrase(UCRYPT, &img, &k0, None);
    assert_eq!(o.status.code(), Some(0));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("WARNING") && err.contains("Primary"), "{err}");
    ok(UCRYPT, &["repair", "-q", s(&img)]);
    let o = test_passphrase(UCRYPT, &img, &k0, None);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("WARNING"));
    assert_eq!(
        test_passphrase("cryptsetup", &img, &k0, None).status.code(),
        Some(0)
    );
}

/// Passphrases on stdin: one line when stdin is not a terminal, the whole input with
/// `--key-file -`.
#[test]
fn passphrase_from_stdin() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("stdin");
    let k0 = t.file("k0", b"line-pass");
    let img = t.image("s.img", 20);
    luks_format("cryptsetup", &img, &k0, &[]);
    let feed = |args: &[&str], input: &[u8]| -> i32 {
        use std::io::Write;
        let mut c = Command::new(UCRYPT)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        c.stdin
            .take()
            .expect("stdin")
            .write_all(input)
            .expect("feed");
        c.wait().expect("wait").code().unwrap_or(-1)
    };
    assert_eq!(
        feed(
            &["open", "--test-passphrase", s(&img)],
            b"line-pass\nignored"
        ),
        0
    );
    assert_eq!(
        feed(&["open", "--test-passphrase", s(&img)], b"line-pasS\n"),
        2
    );
    assert_eq!(
        feed(
            &["open", "--test-passphrase", "--key-file", "-", s(&img)],
            b"line-pass"
        ),
        0
    );
    assert_eq!(
        feed(
            &["open", "--test-passphrase", "--key-file", "-", s(&img)],
            b"line-pass\n"
        ),
        2
    );
    // keyfile offset/size
    let kf = t.file("kf", b"XXline-passYY");
    ok(
        UCRYPT,
        &[
            "open",
            "--test-passphrase",
            "--key-file",
            s(&kf),
            "--keyfile-offset",
            "2",
            "--keyfile-size",
            "9",
            s(&img),
        ],
    );
    // Options before the verb, cryptsetup style.
    ok(
        UCRYPT,
        &["--key-file", s(&k0), "open", "--test-passphrase", s(&img)],
    );
}

/// qemu's LUKS1 driver and ucrypt read each other's volumes and data.
#[test]
fn qemu_luks1_interop() {
    if !have("qemu-img", "qemu-utils") || !have("qemu-io", "qemu-utils") {
        return;
    }
    let t = TempDir::new("qemu");
    let pass = "qemu-pass";
    let k = t.file("k", pass.as_bytes());
    let img = t.path("q.luks");
    // qemu calibrates PBKDF2 by CPU time and gives up ("Unable to get accurate CPU usage")
    // at random, at once and at any target on this machine: retry (failures cost nothing).
    let secret_obj = format!("secret,id=s0,data={pass}");
    let created = [200, 1000, 2000, 500].iter().cycle().take(20).any(|ms| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let o = format!("key-secret=s0,iter-time={ms}");
        let args = [
            "create",
            "-f",
            "luks",
            "--object",
            &secret_obj,
            "-o",
            &o,
            s(&img),
            "4M",
        ];
        run("qemu-img", &args).status.success()
    });
    assert!(created, "qemu-img create -f luks failed at every iter-time");
    assert_opens(UCRYPT, &img, &k, None, 0);
    // qemu writes a pattern; ucrypt exports the plaintext.
    let opts = format!("driver=luks,key-secret=s0,file.filename={}", s(&img));
    let secret = format!("secret,id=s0,data={pass}");
    ok(
        "qemu-io",
        &[
            "--object",
            &secret,
            "--image-opts",
            &opts,
            "-c",
            "write -P 0xa5 0 1M",
            "-c",
            "write -P 0x3c 1M 64k",
        ],
    );
    let out = t.path("plain");
    ok(UCRYPT, &["export", "--key-file", s(&k), s(&img), s(&out)]);
    let plain = std::fs::read(&out).expect("export");
    assert!(plain.len() >= (1 << 20) + (64 << 10));
    assert!(plain[..1 << 20].iter().all(|&b| b == 0xa5));
    assert!(plain[1 << 20..(1 << 20) + (64 << 10)]
        .iter()
        .all(|&b| b == 0x3c));
    // ucrypt imports data; qemu reads it back.
    let mut data = vec![0x77u8; 2 << 20];
    data[(1 << 20)..].fill(0x11);
    let inp = t.file("in", &data);
    ok(UCRYPT, &["import", "--key-file", s(&k), s(&inp), s(&img)]);
    ok(
        "qemu-io",
        &[
            "--object",
            &secret,
            "--image-opts",
            &opts,
            "-c",
            "read -P 0x77 0 1M",
            "-c",
            "read -P 0x11 1M 1M",
        ],
    );
    // A ucrypt LUKS1 volume opens in qemu-io.
    let u = t.image("u.luks", 8);
    luks_format(UCRYPT, &u, &k, &["--type", "luks1"]);
    let inp2 = t.file("in2", vec![0x5au8; 1 << 20]);
    ok(UCRYPT, &["import", "--key-file", s(&k), s(&inp2), s(&u)]);
    let uopts = format!("driver=luks,key-secret=s0,file.filename={}", s(&u));
    let r = ok(
        "qemu-io",
        &[
            "--object",
            &secret,
            "--image-opts",
            &uopts,
            "-c",
            "read -P 0x5a 0 1M",
        ],
    );
    assert!(!r.contains("Pattern verification failed"), "{r}");
}

/// LUKS2 data: ucrypt imports plaintext, cryptsetup's offline decryption (detached header)
/// turns the device back into exactly that plaintext.
#[test]
fn luks2_data_matches_cryptsetup_reencrypt_decrypt() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("data");
    let k = t.file("k", b"data-pass");
    for (name, sector) in [("4k", "4096"), ("512", "512")] {
        let img = t.image(&format!("{name}.img"), 4);
        let hdr = t.path(&format!("{name}.hdr"));
        let mut f = vec![
            "luksFormat",
            "-q",
            "--header",
            s(&hdr),
            "--sector-size",
            sector,
        ];
        f.extend(FAST_PBKDF2);
        f.extend([s(&img), s(&k)]);
        ok(UCRYPT, &f);
        let data: Vec<u8> = (0..4u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let inp = t.file(&format!("{name}.in"), &data);
        ok(
            UCRYPT,
            &[
                "import",
                "--header",
                s(&hdr),
                "--key-file",
                s(&k),
                s(&inp),
                s(&img),
            ],
        );
        assert_ne!(
            std::fs::read(&img).expect("img"),
            data,
            "data was not encrypted"
        );
        // Round trip through ucrypt.
        let out = t.path(&format!("{name}.out"));
        ok(
            UCRYPT,
            &[
                "export",
                "--header",
                s(&hdr),
                "--key-file",
                s(&k),
                s(&img),
                s(&out),
            ],
        );
        assert_eq!(std::fs::read(&out).expect("out"), data);
        ok(
            "cryptsetup",
            &[
                "reencrypt",
                "--decrypt",
                "-q",
                "--force-offline-reencrypt",
                "--header",
                s(&hdr),
                "--key-file",
                s(&k),
                s(&img),
            ],
        );
        assert_eq!(
            std::fs::read(&img).expect("img"),
            data,
            "cryptsetup decrypted something else ({name})"
        );
    }
}

fn fuse_mounted(p: &Path) -> bool {
    let canon = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            l.split(' ').nth(4) == canon.to_str()
                && l.split(" - ").nth(1).unwrap_or("").starts_with("fuse")
        })
}

/// The whole stack on a cryptsetup volume: LUKS2 header → engine → FUSE file. Data written
/// through `ucrypt mount` is what cryptsetup's offline decryption recovers.
#[test]
fn luks2_volume_served_over_fuse_matches_cryptsetup() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        println!("SKIPPED: /dev/fuse missing");
        return;
    }
    let t = TempDir::new("fuse");
    let k = t.file("k", b"fuse-pass");
    let img = t.image("f.img", 8);
    let hdr = t.path("f.hdr");
    luks_format("cryptsetup", &img, &k, &["--header", s(&hdr)]);
    let mnt = t.file("mnt", b"");
    let mut child = Command::new(UCRYPT)
        .args([
            "mount",
            "--header",
            s(&hdr),
            "--key-file",
            s(&k),
            s(&img),
            s(&mnt),
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn ucrypt mount");
    let t0 = std::time::Instant::now();
    while !fuse_mounted(&mnt) {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("ucrypt mount exited early: {st}");
        }
        assert!(
            t0.elapsed().as_secs() < 20,
            "ucrypt mount did not mount in time"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let data: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(40503) >> 7) as u8)
        .collect();
    let result = std::panic::catch_unwind(|| {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&mnt)
            .expect("open");
        assert_eq!(file.metadata().expect("stat").len(), 8 << 20);
        file.write_all_at(&data, 0).expect("write through FUSE");
        file.sync_all().expect("sync");
        let mut back = vec![0u8; data.len()];
        file.read_exact_at(&mut back, 0).expect("read back");
        assert!(back == data, "read back differs");
    });
    // SIGTERM makes ucrypt mount unmount and exit cleanly.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    if fuse_mounted(&mnt) {
        let _ = Command::new("fusermount3").args(["-u", s(&mnt)]).status();
    }
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    ok(
        "cryptsetup",
        &[
            "reencrypt",
            "--decrypt",
            "-q",
            "--force-offline-reencrypt",
            "--header",
            s(&hdr),
            "--key-file",
            s(&k),
            s(&img),
        ],
    );
    assert!(
        std::fs::read(&img).expect("img") == data,
        "cryptsetup decrypted something else"
    );
}

/// A volume cryptsetup left in reencryption (`reencrypt --init-only`): ucrypt's luksDump is
/// cryptsetup's byte for byte; the passphrase test unlocks the new key's keyslot as
/// cryptsetup does, a wrong one and a named keyslot are refused with cryptsetup's exit code;
/// header verbs refuse with cryptsetup's message and leave the header as it was.
#[test]
fn reencryption_in_progress_is_recognised() {
    if !have("cryptsetup", "cryptsetup-bin") {
        return;
    }
    let t = TempDir::new("reenc");
    let key = t.file("key", b"pass");
    let bad = t.file("bad", b"wrong");
    let img = t.image("r.img", 32);
    luks_format("cryptsetup", &img, &key, &[]);
    let mut a = vec![
        "reencrypt",
        "-q",
        "--init-only",
        "--force-offline-reencrypt",
        "--resilience",
        "checksum",
        "--hotzone-size",
        "4M",
        "--key-file",
        s(&key),
    ];
    a.extend(FAST_PBKDF2);
    a.push(s(&img));
    ok("cryptsetup", &a);
    let before = std::fs::read(&img).unwrap();

    assert_eq!(
        ok(UCRYPT, &["luksDump", s(&img)]),
        ok("cryptsetup", &["luksDump", s(&img)])
    );
    for prog in ["cryptsetup", UCRYPT] {
        assert_opens(prog, &img, &key, None, 1);
        assert_no_keyslot(prog, &img, &bad, None);
        let named = run(
            prog,
            &[
                "open",
                "--test-passphrase",
                "--key-file",
                s(&key),
                "--key-slot",
                "0",
                s(&img),
            ],
        );
        assert_eq!(named.status.code(), Some(1), "{prog} --key-slot 0");
        let o = run(prog, &["config", "--label", "x", s(&img)]);
        assert_eq!(o.status.code(), Some(1), "{prog} config");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(
                "Operation incompatible with device marked for LUKS2 reencryption. Aborting."
            ),
            "{prog}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert!(
        std::fs::read(&img).unwrap() == before,
        "a refused verb wrote"
    );
}
