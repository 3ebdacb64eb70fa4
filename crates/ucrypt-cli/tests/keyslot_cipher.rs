//! `--keyslot-cipher` and `--keyslot-key-size` (a keyslot area's encryption, not the data's),
//! judged by cryptsetup: the same verbs run by each tool on a volume of its own (luksFormat,
//! luksAddKey, luksChangeKey, luksConvertKey, each with its own keyslot cipher) give the same
//! keyslot `area` objects in cryptsetup's `luksDump --dump-json-metadata`; each tool opens
//! every keyslot of the other's volume and finds the same volume key; and the refusals exit
//! as cryptsetup's do.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::Path;

use cli_common::{have, run, s, text, TempDir, FAST_PBKDF2, UCRYPT};
use kit::cryptsetup::CRYPTSETUP;

/// One step: a verb, its arguments after the image, and the keyslot cipher it asks for.
struct Step {
    verb: &'static str,
    args: &'static [&'static str],
    cipher: &'static str,
    key_bits: &'static str,
}

/// Format with pass0 in keyslot 0, add pass1 (keyslot 1), change pass1 to pass2, convert
/// keyslot 0's PBKDF; each with a keyslot cipher of its own. AES only: cryptsetup encrypts
/// keyslots through the kernel's crypto API, which lacks Serpent and Twofish on many hosts.
const STEPS: &[Step] = &[
    Step {
        verb: "luksFormat",
        args: &["p0"],
        cipher: "aes-cbc-essiv:sha256",
        key_bits: "256",
    },
    Step {
        verb: "luksAddKey",
        args: &["p1", "--key-file", "p0"],
        cipher: "aes-cbc-plain64",
        key_bits: "128",
    },
    Step {
        verb: "luksChangeKey",
        args: &["p2", "--key-file", "p1"],
        cipher: "aes-xts-plain64",
        key_bits: "256",
    },
    Step {
        verb: "luksConvertKey",
        args: &["--key-file", "p0", "--key-slot", "0"],
        cipher: "aes-cbc-plain64",
        key_bits: "192",
    },
];

/// The passphrases that must open the volume after all steps.
const OPENING: &[&str] = &["p0", "p2"];

/// Runs `prog VERB IMG ARGS --keyslot-cipher C --keyslot-key-size N` in `dir`.
fn step(prog: &str, dir: &Path, img: &str, st: &Step) {
    let mut a = vec!["-q", st.verb, img];
    a.extend(st.args);
    a.extend([
        "--keyslot-cipher",
        st.cipher,
        "--keyslot-key-size",
        st.key_bits,
    ]);
    a.extend(FAST_PBKDF2);
    let o = std::process::Command::new(prog)
        .args(&a)
        .current_dir(dir)
        .output()
        .expect(prog);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{prog} {}: {}",
        a.join(" "),
        text(&o)
    );
}

/// The keyslots' `area` objects, by keyslot id, as cryptsetup reads them, without their
/// offsets: `luksConvertKey -S N` overwrites keyslot N's area in place in cryptsetup, where
/// ucrypt writes the new material to a free area first so that a crash leaves the old or the
/// new keyslot whole.
fn areas(img: &Path) -> serde_json::Value {
    let o = run(CRYPTSETUP, &["luksDump", "--dump-json-metadata", s(img)]);
    assert_eq!(o.status.code(), Some(0), "luksDump: {}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("luksDump JSON");
    let mut out = serde_json::Map::new();
    for (id, ks) in j["keyslots"].as_object().expect("keyslots") {
        let mut area = ks["area"].clone();
        if let Some(a) = area.as_object_mut() {
            a.remove("offset");
        }
        out.insert(id.clone(), area);
    }
    serde_json::Value::Object(out)
}

/// `prog`'s volume key of `img` through the passphrase in `key_file` (luksDump
/// --dump-volume-key).
fn volume_key(prog: &str, dir: &Path, img: &str, key_file: &str) -> String {
    let o = std::process::Command::new(prog)
        .args([
            "luksDump",
            "-q",
            "--dump-volume-key",
            img,
            "--key-file",
            key_file,
        ])
        .current_dir(dir)
        .output()
        .expect(prog);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{prog} luksDump --dump-volume-key {img} with {key_file}: {}",
        text(&o)
    );
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    // The key's hex follows "MK dump:" over one or more lines, up to the end.
    let at = out.find("MK dump:").expect("MK dump line");
    out[at + "MK dump:".len()..]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join("")
}

#[test]
fn keyslot_areas_match_cryptsetups_and_open_in_both_tools() {
    if !have(CRYPTSETUP) {
        println!("SKIPPED: needs cryptsetup");
        return;
    }
    let t = TempDir::new("keyslot-cipher");
    for (f, p) in [("p0", "pass0"), ("p1", "pass1"), ("p2", "pass2")] {
        t.file(f, p);
    }
    let dir = t.dir();
    let mut images = Vec::new();
    for prog in [CRYPTSETUP, UCRYPT] {
        let img = t.sparse(if prog == UCRYPT { "u.img" } else { "c.img" }, 32 << 20);
        for st in STEPS {
            step(prog, dir, s(&img), st);
        }
        images.push(img);
    }
    let (cs, uc) = (areas(&images[0]), areas(&images[1]));
    assert_eq!(cs, uc, "keyslot areas: cryptsetup's, then ucrypt's");
    // Each area has the cipher of the last step that wrote its keyslot.
    assert_eq!(cs["0"]["encryption"], "aes-cbc-plain64");
    assert_eq!(cs["0"]["key_size"], 24);
    assert_eq!(cs["1"]["encryption"], "aes-xts-plain64");
    assert_eq!(cs["1"]["key_size"], 32);
    for img in &images {
        for pass in OPENING {
            let keys: Vec<String> = [CRYPTSETUP, UCRYPT]
                .iter()
                .map(|prog| volume_key(prog, dir, s(img), pass))
                .collect();
            assert_eq!(keys[0], keys[1], "{}: {pass}", img.display());
        }
    }
}

#[test]
fn keyslot_option_refusals_exit_as_cryptsetups() {
    if !have(CRYPTSETUP) {
        println!("SKIPPED: needs cryptsetup");
        return;
    }
    let t = TempDir::new("keyslot-cipher-refused");
    t.file("p0", "pass0");
    let img = t.sparse("v.img", 20 << 20);
    let img = s(&img);
    let key = t.s("p0");
    let cases: &[(&str, &[&str])] = &[
        (
            "--keyslot-cipher alone",
            &["--keyslot-cipher", "aes-xts-plain64"],
        ),
        ("--keyslot-key-size alone", &["--keyslot-key-size", "512"]),
        (
            "a key size not a multiple of 8",
            &[
                "--keyslot-cipher",
                "aes-xts-plain64",
                "--keyslot-key-size",
                "260",
            ],
        ),
        (
            "the null cipher",
            &[
                "--keyslot-cipher",
                "cipher_null",
                "--keyslot-key-size",
                "256",
            ],
        ),
        (
            "a key size the cipher cannot take",
            &[
                "--keyslot-cipher",
                "aes-xts-plain64",
                "--keyslot-key-size",
                "128",
            ],
        ),
        (
            "LUKS1",
            &[
                "--type",
                "luks1",
                "--keyslot-cipher",
                "aes-xts-plain64",
                "--keyslot-key-size",
                "512",
            ],
        ),
    ];
    for (what, extra) in cases {
        let codes: Vec<Option<i32>> = [CRYPTSETUP, UCRYPT]
            .iter()
            .map(|prog| {
                let mut a = vec!["luksFormat", "-q", img, &key];
                a.extend(*extra);
                a.extend(FAST_PBKDF2);
                run(prog, &a).status.code()
            })
            .collect();
        assert_eq!(
            codes[0], codes[1],
            "{what}: cryptsetup's exit code, then ucrypt's"
        );
        assert_ne!(codes[0], Some(0), "{what}: cryptsetup formats");
    }
}
