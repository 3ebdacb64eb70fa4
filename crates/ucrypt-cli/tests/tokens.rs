//! LUKS2 tokens, as cryptsetup's compat-test2 exercises them ("[33] tokens", "[39] LUKS2
//! metadata variants"): `token add|import|export|remove|unassign`, a `luks2-keyring` token
//! unlocking from the kernel keyring with `--token-only`/`--token-id`/`--token-type`, and
//! every token's bytes (as `cryptsetup token export` prints them) unchanged by ucrypt's
//! header writes. Where cryptsetup is installed it runs the same steps beside ucrypt.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::Path;

use cli_common::{have, run, run_in, s, text, TempDir, FAST_PBKDF2, UCRYPT};

/// compat-test2's token: its key order (type, keyslots, base64_data) is not sorted.
const IMPORT_TOKEN: &str = r#"{"type":"some_type","keyslots":[],"base64_data":"zxI7vKB1Qwl4VPB4D-N-OgcC14hPCG0IDu8O7eCqaQ"}"#;

/// A token as systemd-cryptenroll writes one (nested objects, keys out of order).
const SYSTEMD_TOKEN: &str = r#"{"type":"systemd-tpm2","keyslots":["0"],"tpm2-blob":"AJ4AIA==","tpm2-pcrs":[7],"tpm2-pcr-bank":"sha256","tpm2-primary-alg":"ecc","tpm2-policy-hash":"ab12","tpm2-pin":false}"#;

const PWD: &str = "93R4P4pIqAH8";

fn luks2(t: &TempDir) -> std::path::PathBuf {
    let img = t.image("v.img", 20);
    let mut args = vec!["luksFormat", "-q", "--type", "luks2"];
    args.extend_from_slice(FAST_PBKDF2);
    args.push(s(&img));
    let o = run_in(UCRYPT, &args, PWD.as_bytes());
    assert!(o.status.success(), "format: {}", text(&o));
    img
}

fn ucrypt(args: &[&str], input: &str) -> std::process::Output {
    run_in(UCRYPT, args, input.as_bytes())
}

fn export(prog: &str, img: &Path, id: &str) -> String {
    let o = run(prog, &["token", "export", s(img), "--token-id", id]);
    assert!(o.status.success(), "{prog} token export {id}: {}", text(&o));
    String::from_utf8(o.stdout).expect("utf-8 token")
}

#[test]
fn import_and_export_keep_the_tokens_bytes() {
    let t = TempDir::new("tokens-import");
    let img = luks2(&t);
    let f0 = t.file("token0", IMPORT_TOKEN.as_bytes());
    let steps: [(&[&str], bool); 4] = [
        (&["token", "import", "--token-id", "10"], true),
        (
            &["token", "import", "--token-id", "11", "--json-file", "-"],
            true,
        ),
        (
            &["token", "import", "--token-id", "12", "--json-file", s(&f0)],
            true,
        ),
        (
            &["token", "import", "--token-id", "12", "--json-file", s(&f0)],
            false,
        ),
    ];
    for (args, ok) in steps {
        let mut a = args.to_vec();
        a.push(s(&img));
        let o = ucrypt(&a, IMPORT_TOKEN);
        assert_eq!(o.status.success(), ok, "{a:?}: {}", text(&o));
    }
    for id in ["10", "11", "12"] {
        assert_eq!(export(UCRYPT, &img, id), IMPORT_TOKEN, "ucrypt export {id}");
        if have("cryptsetup") {
            assert_eq!(
                export("cryptsetup", &img, id),
                IMPORT_TOKEN,
                "cryptsetup export {id}"
            );
        }
    }
    let out = t.path("token1");
    let o = ucrypt(
        &[
            "token",
            "export",
            s(&img),
            "--token-id",
            "12",
            "--json-file",
            s(&out),
        ],
        "",
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), IMPORT_TOKEN);
    // Removing one leaves the others.
    let o = ucrypt(&["token", "remove", "--token-id", "11", s(&img)], "");
    assert!(o.status.success(), "{}", text(&o));
    let o = ucrypt(&["token", "remove", "--token-id", "11", s(&img)], "");
    assert_eq!(o.status.code(), Some(1), "second remove: {}", text(&o));
    assert_eq!(export(UCRYPT, &img, "12"), IMPORT_TOKEN);
    // Reserved and malformed tokens are refused.
    for bad in [
        r#"{"type":"luks2-other","keyslots":[]}"#,
        r#"{"type":"luks2-keyring","keyslots":[]}"#,
        r#"{"keyslots":[]}"#,
        r#"{"type":"x","keyslots":["7"]}"#,
        r#"["not an object"]"#,
        "{",
    ] {
        let o = ucrypt(&["token", "import", s(&img)], bad);
        assert_eq!(o.status.code(), Some(1), "{bad}: {}", text(&o));
        if have("cryptsetup") {
            let c = run_in("cryptsetup", &["token", "import", s(&img)], bad.as_bytes());
            assert!(!c.status.success(), "cryptsetup took {bad}");
        }
    }
}

/// Every ucrypt verb that rewrites the header keeps the tokens it does not change, byte for
/// byte (systemd's tokens above all: losing one locks a TPM-only user out).
#[test]
fn header_writes_keep_other_programs_tokens() {
    let t = TempDir::new("tokens-keep");
    let img = luks2(&t);
    let o = ucrypt(
        &["token", "import", "--token-id", "3", s(&img)],
        SYSTEMD_TOKEN,
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = ucrypt(
        &["token", "import", "--token-id", "10", s(&img)],
        IMPORT_TOKEN,
    );
    assert!(o.status.success(), "{}", text(&o));
    let mut add = vec!["luksAddKey", "-q", "-S", "4"];
    add.extend_from_slice(FAST_PBKDF2);
    add.push(s(&img));
    let writes: Vec<(Vec<&str>, String)> = vec![
        (add, format!("{PWD}\nsecond\n")),
        (vec!["config", "--label", "L1", s(&img)], String::new()),
        (
            vec![
                "luksUUID",
                "--uuid",
                "a1b2c3d4-0000-4000-8000-000000000001",
                s(&img),
            ],
            String::new(),
        ),
        (vec!["luksKillSlot", "-q", s(&img), "4"], String::new()),
        (vec!["repair", "-q", s(&img)], String::new()),
    ];
    for (args, input) in &writes {
        let o = ucrypt(args, input);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
        assert_eq!(export(UCRYPT, &img, "3"), SYSTEMD_TOKEN, "after {args:?}");
        assert_eq!(export(UCRYPT, &img, "10"), IMPORT_TOKEN, "after {args:?}");
        if have("cryptsetup") {
            assert_eq!(
                export("cryptsetup", &img, "3"),
                SYSTEMD_TOKEN,
                "after {args:?}"
            );
        }
    }
}

#[test]
fn dump_prints_tokens_as_cryptsetup_does() {
    if !have("cryptsetup") {
        println!("SKIPPED: cryptsetup not installed (the dump is compared with its own)");
        return;
    }
    let t = TempDir::new("tokens-dump");
    let img = luks2(&t);
    let mut add = vec!["luksAddKey", "-q", "-S", "2"];
    add.extend_from_slice(FAST_PBKDF2);
    add.push(s(&img));
    assert!(ucrypt(&add, &format!("{PWD}\nsecond\n")).status.success());
    for args in [
        vec![
            "token",
            "add",
            "--key-description",
            "ucrypt:a",
            "--token-id",
            "1",
            s(&img),
        ],
        vec![
            "token",
            "add",
            "--key-description",
            "ucrypt:b",
            "-S",
            "2",
            s(&img),
        ],
    ] {
        let o = ucrypt(&args, "");
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    }
    assert!(ucrypt(
        &["token", "import", "--token-id", "12", s(&img)],
        IMPORT_TOKEN
    )
    .status
    .success());
    let section = |prog: &str| {
        let o = run(prog, &["luksDump", s(&img)]);
        let d = text(&o);
        let start = d.find("Tokens:").expect("Tokens:");
        let end = d.find("Digests:").expect("Digests:");
        d[start..end].to_string()
    };
    let ours = section(UCRYPT);
    assert_eq!(ours, section("cryptsetup"));
    assert!(
        ours.contains("\tKey description: ucrypt:a\n\tKeyslot:    0\n\tKeyslot:    2\n"),
        "{ours}"
    );
    let json = run(UCRYPT, &["luksDump", "--dump-json-metadata", s(&img)]);
    assert!(text(&json).contains("\"tokens\":"), "{}", text(&json));
}

/// A `user` key in the caller's user keyring, removed when dropped.
struct KeyringKey(i64);

impl KeyringKey {
    fn add(description: &str, payload: &str) -> Option<Self> {
        const KEY_SPEC_USER_KEYRING: libc::c_long = -4;
        let desc = std::ffi::CString::new(description).ok()?;
        // SAFETY: the strings are NUL-terminated and the payload's pointer and length
        // describe a live buffer for the call's duration.
        let id = unsafe {
            libc::syscall(
                libc::SYS_add_key,
                c"user".as_ptr(),
                desc.as_ptr(),
                payload.as_ptr(),
                payload.len(),
                KEY_SPEC_USER_KEYRING,
            )
        };
        (id >= 0).then_some(KeyringKey(id))
    }
}

impl Drop for KeyringKey {
    fn drop(&mut self) {
        const KEYCTL_INVALIDATE: libc::c_long = 21;
        // SAFETY: keyctl(KEYCTL_INVALIDATE, id) takes no pointers.
        unsafe { libc::syscall(libc::SYS_keyctl, KEYCTL_INVALIDATE, self.0) };
    }
}

/// compat-test2 "[33] tokens", the keyring part, each step with its exit code beside
/// cryptsetup's.
#[test]
fn keyring_token_unlocks_as_cryptsetup_does() {
    let desc = format!("ucrypt-test:{}:keyring", std::process::id());
    let Some(_key) = KeyringKey::add(&desc, PWD) else {
        println!("SKIPPED: no kernel keyring here (add_key(2) refused)");
        return;
    };
    let missing = format!("{desc}:missing");
    let t = TempDir::new("tokens-keyring");
    let img = luks2(&t);
    let dev = s(&img);
    // DEV, DESC and MISSING stand for the volume, the key in the keyring and a key that is
    // not there.
    let table: &[(&[&str], i32)] = &[
        (&["open", "--test-passphrase", "--token-only", "DEV"], 1),
        (
            &[
                "token",
                "add",
                "DEV",
                "--key-description",
                "DESC",
                "--token-id",
                "3",
            ],
            0,
        ),
        (
            &[
                "token",
                "add",
                "DEV",
                "--key-description",
                "DESC",
                "-S",
                "5",
            ],
            1,
        ),
        (&["open", "--test-passphrase", "--token-only", "DEV"], 0),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-id",
                "3",
                "DEV",
            ],
            0,
        ),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-type",
                "luks2-keyring",
                "DEV",
            ],
            0,
        ),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-type",
                "some_type",
                "DEV",
            ],
            1,
        ),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-id",
                "4",
                "DEV",
            ],
            1,
        ),
        (
            &[
                "token",
                "add",
                "DEV",
                "--key-description",
                "MISSING",
                "--token-id",
                "4",
            ],
            0,
        ),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-id",
                "4",
                "DEV",
            ],
            2,
        ),
        (&["token", "remove", "--token-id", "3", "DEV"], 0),
        (&["token", "remove", "--token-id", "4", "DEV"], 0),
        (&["open", "--test-passphrase", "--token-only", "DEV"], 1),
        (
            &[
                "token",
                "add",
                "DEV",
                "--key-description",
                "DESC",
                "--unbound",
                "--token-id",
                "0",
            ],
            0,
        ),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-id",
                "0",
                "DEV",
            ],
            1,
        ),
        (&["token", "remove", "--token-id", "0", "DEV"], 0),
        (
            &[
                "token",
                "add",
                "DEV",
                "--key-description",
                "DESC",
                "-S0",
                "--token-id",
                "0",
            ],
            0,
        ),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-id",
                "0",
                "DEV",
            ],
            0,
        ),
        (&["token", "unassign", "--token-id", "0", "DEV"], 1),
        (&["token", "unassign", "-S0", "DEV"], 1),
        (&["token", "unassign", "--token-id", "0", "-S0", "DEV"], 0),
        (
            &[
                "open",
                "--test-passphrase",
                "--token-only",
                "--token-id",
                "0",
                "DEV",
            ],
            1,
        ),
        (&["token", "unassign", "--token-id", "0", "-S0", "DEV"], 1),
        (&["token", "unassign", "--token-id", "0", "-S44", "DEV"], 1),
        (&["token", "unassign", "--token-id", "44", "-S0", "DEV"], 1),
    ];
    let steps: Vec<(Vec<String>, i32)> = table
        .iter()
        .map(|(args, want)| {
            let a = args
                .iter()
                .map(|x| match *x {
                    "DESC" => desc.clone(),
                    "MISSING" => missing.clone(),
                    other => other.to_string(),
                })
                .collect();
            (a, *want)
        })
        .collect();
    for (args, want) in &steps {
        let a: Vec<&str> = args
            .iter()
            .map(|x| if x == "DEV" { dev } else { x.as_str() })
            .collect();
        let o = ucrypt(&a, "");
        assert_eq!(o.status.code(), Some(*want), "ucrypt {a:?}: {}", text(&o));
    }
    // The same sequence through cryptsetup on a fresh volume gives the same codes.
    if have("cryptsetup") {
        let t2 = TempDir::new("tokens-keyring-cs");
        let img2 = luks2(&t2);
        for (args, want) in &steps {
            let a: Vec<&str> = args
                .iter()
                .map(|x| if x == "DEV" { s(&img2) } else { x.as_str() })
                .collect();
            let o = run("cryptsetup", &a);
            assert_eq!(
                o.status.code(),
                Some(*want),
                "cryptsetup {a:?}: {}",
                text(&o)
            );
        }
    }
}

/// compat-test2 "[39] LUKS2 metadata variants": a token imported and exported on each of
/// the nine metadata sizes of `luks2_mda_images.tar.xz`.
#[test]
fn tokens_on_every_metadata_size() {
    let Some(suite) = cli_common::image_suite() else {
        return;
    };
    let t = TempDir::new("tokens-mda");
    cli_common::untar(&suite.join("luks2_mda_images.tar.xz"), t.dir());
    for mda in [16, 32, 64, 128, 256, 512, 1024, 2048, 4096] {
        let img = t.path(&format!("test_image_{mda}"));
        let o = ucrypt(
            &["token", "import", s(&img), "--token-id", "10"],
            IMPORT_TOKEN,
        );
        assert!(o.status.success(), "{mda} KiB import: {}", text(&o));
        assert_eq!(export(UCRYPT, &img, "10"), IMPORT_TOKEN, "{mda} KiB");
        if have("cryptsetup") {
            assert_eq!(
                export("cryptsetup", &img, "10"),
                IMPORT_TOKEN,
                "{mda} KiB (cryptsetup)"
            );
        }
    }
}

/// `luksAddKey --new-token-id N` (no new key file): the new passphrase is the one the
/// luks2-keyring token N gives, and the new keyslot is assigned to N; each tool on a copy of
/// one volume gives the same tokens, and the keyring's passphrase opens the new keyslot. A
/// token whose key is not in the keyring, and a token that does not exist: the same exit
/// codes from both.
#[test]
fn add_key_by_token_as_cryptsetup() {
    let desc = format!("ucrypt-test:{}:newtoken", std::process::id());
    const NEW: &str = "second passphrase";
    let Some(_key) = KeyringKey::add(&desc, NEW) else {
        println!("SKIPPED: no kernel keyring here (add_key(2) refused)");
        return;
    };
    let t = TempDir::new("tokens-addkey");
    let img = luks2(&t);
    for (id, description) in [
        ("0", desc.as_str()),
        ("1", "ucrypt-test:not-in-the-keyring"),
    ] {
        let o = ucrypt(
            &[
                "token",
                "add",
                s(&img),
                "--key-description",
                description,
                "--token-id",
                id,
            ],
            "",
        );
        assert!(o.status.success(), "token add: {}", text(&o));
    }
    let new_key = t.path("new.key");
    std::fs::write(&new_key, NEW).unwrap();
    let add = |prog: &str, token: &str| {
        let copy = t.path(&format!(
            "{}-{token}.img",
            prog.rsplit('/').next().unwrap_or(prog)
        ));
        std::fs::copy(&img, &copy).unwrap();
        let mut a = vec!["luksAddKey", s(&copy), "--new-token-id", token];
        a.extend_from_slice(FAST_PBKDF2);
        let o = run_in(prog, &a, PWD.as_bytes());
        let d = text(&run("cryptsetup", &["luksDump", s(&copy)]));
        let tokens = d[d.find("Tokens:").unwrap()..d.find("Digests:").unwrap()].to_string();
        (o.status.code(), tokens, copy)
    };
    let (u_code, u_tokens, u_copy) = add(UCRYPT, "0");
    let (c_code, c_tokens, _) = add("cryptsetup", "0");
    assert_eq!(
        (u_code, &u_tokens),
        (c_code, &c_tokens),
        "luksAddKey --new-token-id 0"
    );
    assert_eq!(u_code, Some(0));
    let o = run(
        "cryptsetup",
        &[
            "open",
            "--test-passphrase",
            "-S",
            "1",
            s(&u_copy),
            "--key-file",
            s(&new_key),
        ],
    );
    assert!(
        o.status.success(),
        "the keyring's passphrase opens slot 1: {}",
        text(&o)
    );
    for (token, what) in [("1", "its key not in the keyring"), ("7", "no such token")] {
        let (u_code, _, _) = add(UCRYPT, token);
        let (c_code, _, _) = add("cryptsetup", token);
        assert_eq!(u_code, c_code, "--new-token-id {token}: {what}");
    }
}
