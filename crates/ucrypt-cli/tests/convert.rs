//! `convert --type luks1|luks2`, `luksConvertKey` and `erase`, judged by cryptsetup:
//! - cryptsetup's `conversion_imgs.tar.xz` (api-test-2's LuksConvert: 20 images, two must be
//!   refused): each converted by ucrypt gets cryptsetup's verdict; where it converts, cryptsetup
//!   reads the result (luksDump, every keyslot's passphrase, the same volume key) and the data
//!   decrypts as before; cryptsetup's own conversion of the image is read by ucrypt;
//! - round trips LUKS1 → LUKS2 → LUKS1 on fresh volumes, each tool converting one way;
//! - the refusals, exit codes beside cryptsetup's on the same input.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::{Path, PathBuf};

use cli_common::{cryptsetup_tests, run, s, text, untar, TempDir, FAST_PBKDF2, UCRYPT};
use kit::cryptsetup::CRYPTSETUP;
use kit::SplitMix;

/// api-test-2's passphrases of keyslots 0-7 in the conversion images.
const PASS: [&str; 8] = [
    "aaablabl", "hhhblabl", "cccblabl", "dddblabl", "eeeblabl", "fffblabl", "gggblabl", "bbbblabl",
];
/// The images api-test-2 expects `convert` to refuse.
const REFUSED: [&str; 2] = ["l1_256b_legacy_offset", "l1_256b_unmovable"];
/// Ciphertext appended as the data area of each image (or the detached headers' data device).
const DATA_BYTES: usize = 64 << 10;

fn code(o: &std::process::Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

/// A volume as a verb takes it: the image, with `--header` when it is a detached header.
struct Vol {
    header: PathBuf,
    data: Option<PathBuf>,
}

impl Vol {
    /// The device argument and `--header`.
    fn args(&self) -> Vec<String> {
        match &self.data {
            Some(d) => vec![s(d).into(), "--header".into(), s(&self.header).into()],
            None => vec![s(&self.header).into()],
        }
    }

    fn run(&self, prog: &str, verb: &[&str], extra: &[&str]) -> std::process::Output {
        let mut a: Vec<String> = verb.iter().map(|x| x.to_string()).collect();
        a.extend(self.args());
        a.extend(extra.iter().map(|x| x.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        run(prog, &a)
    }

    /// The volume key through `prog`'s `luksDump --dump-volume-key`, opened by slot 0's
    /// passphrase.
    fn volume_key(&self, prog: &str, t: &TempDir, pass_file: &Path, tag: &str) -> Vec<u8> {
        let out = t.path(&format!("vk-{tag}"));
        let _ = std::fs::remove_file(&out);
        let o = run(
            prog,
            &[
                "luksDump",
                "--dump-volume-key",
                "-q",
                "--key-file",
                s(pass_file),
                "--volume-key-file",
                s(&out),
                s(&self.header),
            ],
        );
        assert!(
            o.status.success(),
            "{prog} luksDump --dump-volume-key {tag}: {}",
            text(&o)
        );
        std::fs::read(&out).expect("volume key file")
    }

    /// The plaintext of the data area through `ucrypt export`.
    fn export(&self, t: &TempDir, pass_file: &Path, tag: &str) -> Vec<u8> {
        let out = t.path(&format!("plain-{tag}"));
        let _ = std::fs::remove_file(&out);
        let mut a: Vec<String> = vec!["export".into()];
        a.extend(self.args());
        a.extend([
            s(&out).to_string(),
            "--key-file".into(),
            s(pass_file).into(),
        ]);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let o = run(UCRYPT, &a);
        assert!(o.status.success(), "ucrypt export {tag}: {}", text(&o));
        std::fs::read(&out).expect("plaintext")
    }
}

/// A copy of image `name` in `dir`, with [`DATA_BYTES`] of ciphertext after the data offset
/// (or in a data file beside a detached header).
fn stage(t: &TempDir, src: &Path, name: &str, tag: &str) -> Vol {
    let header = t.path(&format!("{tag}-{name}"));
    std::fs::copy(src.join(name), &header).expect("copy image");
    let mut rng = SplitMix(0xc0_4e_47 ^ name.len() as u64);
    let data = rng.bytes(DATA_BYTES);
    if name.contains("_det") {
        let d = t.file(&format!("{tag}-{name}.data"), &data);
        Vol {
            header,
            data: Some(d),
        }
    } else {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&header)
            .expect("open image");
        f.write_all(&data).expect("append data");
        Vol { header, data: None }
    }
}

fn dumps_as(img: &Path, version: u32) -> bool {
    let o = run(CRYPTSETUP, &["luksDump", s(img)]);
    o.status.success()
        && text(&o)
            .lines()
            .any(|l| l.starts_with("Version:") && l.trim_end().ends_with(&version.to_string()))
}

/// Slots whose passphrase the image has: 0 and 7, all eight in the `_full` images.
fn slots_of(name: &str) -> Vec<usize> {
    if name.contains("_full") {
        (0..8).collect()
    } else {
        vec![0, 7]
    }
}

#[test]
fn cryptsetup_conversion_images() {
    if !kit::cryptsetup::require() {
        return;
    }
    let tests = match cryptsetup_tests() {
        Ok(d) => d,
        Err(why) => {
            println!("SKIPPED: {why}");
            return;
        }
    };
    let t = TempDir::new("convert-imgs");
    untar(&tests.join("conversion_imgs.tar.xz"), t.dir());
    let src = t.path("conversion_imgs");
    let pass_files: Vec<PathBuf> = PASS
        .iter()
        .enumerate()
        .map(|(i, p)| t.file(&format!("pass{i}"), p))
        .collect();
    let mut names: Vec<String> = std::fs::read_dir(&src)
        .expect("images")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 20, "conversion_imgs holds 20 images");
    let mut agreed = 0;
    for name in &names {
        let (to, version) = if name.starts_with("l1") {
            ("luks2", 2)
        } else {
            ("luks1", 1)
        };
        let orig = stage(&t, &src, name, "orig");
        let ours = stage(&t, &src, name, "ucrypt");
        let theirs = stage(&t, &src, name, "cs");
        let cu = ours.run(UCRYPT, &["convert", "-q", "--type", to], &[]);
        let cc = theirs.run(CRYPTSETUP, &["convert", "-q", "--type", to], &[]);
        let refused = REFUSED.contains(&name.as_str());
        assert_eq!(
            code(&cc),
            if refused { 1 } else { 0 },
            "{name}: cryptsetup: {}",
            text(&cc)
        );
        assert_eq!(
            code(&cu),
            code(&cc),
            "{name}: ucrypt: {} / cryptsetup: {}",
            text(&cu),
            text(&cc)
        );
        if refused {
            // Nothing was written.
            assert_eq!(
                std::fs::read(&ours.header).expect("read"),
                std::fs::read(&orig.header).expect("read"),
                "{name}: a refused conversion changed the image"
            );
            agreed += 1;
            continue;
        }
        // cryptsetup reads ucrypt's conversion, ucrypt reads cryptsetup's.
        assert!(
            dumps_as(&ours.header, version),
            "{name}: cryptsetup luksDump of ucrypt's"
        );
        for slot in slots_of(name) {
            let slot_s = slot.to_string();
            let pf = s(&pass_files[slot]);
            for (prog, vol) in [(CRYPTSETUP, &ours), (UCRYPT, &theirs)] {
                let o = vol.run(
                    prog,
                    &[
                        "open",
                        "--test-passphrase",
                        "--key-slot",
                        &slot_s,
                        "--key-file",
                        pf,
                    ],
                    &[],
                );
                assert!(
                    o.status.success(),
                    "{name}: {prog} slot {slot}: {}",
                    text(&o)
                );
            }
        }
        let vk = orig.volume_key(CRYPTSETUP, &t, &pass_files[0], &format!("{name}-orig"));
        assert_eq!(
            ours.volume_key(CRYPTSETUP, &t, &pass_files[0], &format!("{name}-u")),
            vk,
            "{name}: cryptsetup finds another volume key in ucrypt's conversion"
        );
        assert_eq!(
            theirs.volume_key(UCRYPT, &t, &pass_files[0], &format!("{name}-c")),
            vk,
            "{name}: ucrypt finds another volume key in cryptsetup's conversion"
        );
        let plain = orig.export(&t, &pass_files[0], &format!("{name}-orig"));
        assert_eq!(
            ours.export(&t, &pass_files[0], &format!("{name}-u")),
            plain,
            "{name}"
        );
        assert_eq!(
            theirs.export(&t, &pass_files[0], &format!("{name}-c")),
            plain,
            "{name}"
        );
        if version == 1 {
            // Down-conversion is deterministic: both tools write the same bytes.
            assert!(
                std::fs::read(&ours.header).expect("read")
                    == std::fs::read(&theirs.header).expect("read"),
                "{name}: ucrypt's LUKS1 differs from cryptsetup's"
            );
        } else {
            let json = |p: &Path| -> serde_json::Value {
                let o = run(CRYPTSETUP, &["luksDump", "--dump-json-metadata", s(p)]);
                assert!(o.status.success(), "{}", text(&o));
                serde_json::from_slice(&o.stdout).expect("json")
            };
            assert_eq!(
                json(&ours.header),
                json(&theirs.header),
                "{name}: LUKS2 metadata"
            );
        }
        agreed += 1;
    }
    assert_eq!(agreed, 20);
    println!("conversion images: {agreed}/20 as cryptsetup");
}

/// A volume of 8 MiB with `pass0` in slot 0 and ciphertext noise in its data area, formatted
/// by `prog` as `luks_type`.
fn fresh(t: &TempDir, prog: &str, luks_type: &str, tag: &str, pf: &Path) -> PathBuf {
    let img = t.image(&format!("{tag}.img"), 8);
    let mut a = vec!["luksFormat", "-q", "--type", luks_type, "--key-file", s(pf)];
    a.extend_from_slice(FAST_PBKDF2);
    if luks_type == "luks2" {
        a.extend_from_slice(&[
            "--sector-size",
            "512",
            "--offset",
            "8192",
            "--luks2-keyslots-size",
            "2097152",
        ]);
    }
    a.push(s(&img));
    let o = run(prog, &a);
    assert!(o.status.success(), "{prog} format: {}", text(&o));
    // Ciphertext noise over the data area's first MiB.
    let data = SplitMix(0xda7a).bytes(1 << 20);
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .expect("open");
    f.write_all_at(&data, 4 << 20).expect("write");
    img
}

fn export(t: &TempDir, img: &Path, pf: &Path, tag: &str) -> Vec<u8> {
    Vol {
        header: img.to_path_buf(),
        data: None,
    }
    .export(t, pf, tag)
}

fn convert_ok(prog: &str, img: &Path, to: &str) {
    let o = run(prog, &["convert", "-q", "--type", to, s(img)]);
    assert!(
        o.status.success(),
        "{prog} convert --type {to}: {}",
        text(&o)
    );
}

fn opens(prog: &str, img: &Path, pf: &Path) -> bool {
    run(
        prog,
        &["open", "--test-passphrase", "--key-file", s(pf), s(img)],
    )
    .status
    .success()
}

#[test]
fn round_trips_between_the_tools() {
    if !kit::cryptsetup::require() {
        return;
    }
    let t = TempDir::new("convert-round");
    let pf = t.file("pass", "pass0");
    for (maker, luks_type) in [
        (CRYPTSETUP, "luks1"),
        (UCRYPT, "luks1"),
        (CRYPTSETUP, "luks2"),
        (UCRYPT, "luks2"),
    ] {
        for first in [UCRYPT, CRYPTSETUP] {
            let tag = format!("{maker}-{luks_type}-{first}");
            let tag = tag.replace('/', "_");
            let img = fresh(&t, maker, luks_type, &tag, &pf);
            let plain = export(&t, &img, &pf, &format!("{tag}-0"));
            let second = if first == UCRYPT { CRYPTSETUP } else { UCRYPT };
            let (a, b) = if luks_type == "luks1" {
                ("luks2", "luks1")
            } else {
                ("luks1", "luks2")
            };
            convert_ok(first, &img, a);
            assert!(
                opens(second, &img, &pf),
                "{tag}: {second} opens {first}'s {a}"
            );
            assert!(opens(first, &img, &pf), "{tag}: {first} opens its {a}");
            assert_eq!(export(&t, &img, &pf, &format!("{tag}-1")), plain, "{tag}");
            convert_ok(second, &img, b);
            assert!(
                opens(first, &img, &pf),
                "{tag}: {first} opens {second}'s {b}"
            );
            assert_eq!(export(&t, &img, &pf, &format!("{tag}-2")), plain, "{tag}");
        }
    }
}

/// Runs `verb` with both tools on copies of `img`: same exit code, and the first line of
/// cryptsetup's error is ucrypt's.
fn same_verdict(t: &TempDir, img: &Path, args: &[&str], tag: &str) -> i32 {
    let mine = t.path(&format!("{tag}-u"));
    let theirs = t.path(&format!("{tag}-c"));
    std::fs::copy(img, &mine).expect("copy");
    std::fs::copy(img, &theirs).expect("copy");
    let with = |p: &Path| {
        let mut a = args.to_vec();
        a.push(s(p));
        a.iter().map(|x| x.to_string()).collect::<Vec<_>>()
    };
    let (am, at) = (with(&mine), with(&theirs));
    let am: Vec<&str> = am.iter().map(String::as_str).collect();
    let at: Vec<&str> = at.iter().map(String::as_str).collect();
    let (u, c) = (run(UCRYPT, &am), run(CRYPTSETUP, &at));
    assert_eq!(
        code(&u),
        code(&c),
        "{tag}: ucrypt {} / cryptsetup {}",
        text(&u),
        text(&c)
    );
    let first = |o: &std::process::Output| {
        String::from_utf8_lossy(&o.stderr)
            .lines()
            .next()
            .unwrap_or("")
            .replace(s(&mine), "DEV")
            .replace(s(&theirs), "DEV")
    };
    if !first(&c).is_empty() {
        assert_eq!(first(&u), first(&c), "{tag}: messages");
    }
    code(&c)
}

#[test]
fn refusals_beside_cryptsetup() {
    if !kit::cryptsetup::require() {
        return;
    }
    let t = TempDir::new("convert-refuse");
    let pf = t.file("pass", "pass0");
    let fmt = |tag: &str, extra: &[&str]| -> PathBuf {
        let img = t.image(&format!("{tag}.img"), 20);
        let mut a = vec!["luksFormat", "-q", "--type", "luks2", "--key-file", s(&pf)];
        if !extra.contains(&"argon2id") {
            a.extend_from_slice(FAST_PBKDF2);
        }
        a.extend_from_slice(extra);
        a.push(s(&img));
        let o = run(CRYPTSETUP, &a);
        assert!(o.status.success(), "format {tag}: {}", text(&o));
        img
    };
    let to1 = ["convert", "-q", "--type", "luks1"];
    let to2 = ["convert", "-q", "--type", "luks2"];
    let plain512 = fmt("plain", &["--sector-size", "512"]);
    assert_eq!(same_verdict(&t, &plain512, &to2, "already"), 1);
    assert_eq!(
        same_verdict(&t, &plain512, &["convert", "-q", "--type", "luks3"], "type"),
        1
    );
    let s4k = fmt("s4k", &["--sector-size", "4096"]);
    assert_eq!(same_verdict(&t, &s4k, &to1, "sector"), 1);
    let argon = fmt(
        "argon",
        &[
            "--sector-size",
            "512",
            "--pbkdf",
            "argon2id",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-memory",
            "32",
            "--pbkdf-parallel",
            "1",
        ],
    );
    assert_eq!(same_verdict(&t, &argon, &to1, "argon"), 1);
    let tok = fmt("tok", &["--sector-size", "512"]);
    let tf = t.file("token", r#"{"type":"x","keyslots":[]}"#);
    let o = run(
        CRYPTSETUP,
        &["token", "import", "--json-file", s(&tf), s(&tok)],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(same_verdict(&t, &tok, &to1, "token"), 1);
    let slot9 = fmt("slot9", &["--sector-size", "512"]);
    let o = run(
        CRYPTSETUP,
        &[
            "luksAddKey",
            "-q",
            "--key-file",
            s(&pf),
            "-S",
            "9",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            s(&slot9),
            s(&pf),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(same_verdict(&t, &slot9, &to1, "slot9"), 1);
    let unbound = fmt("unbound", &["--sector-size", "512"]);
    let o = run(
        CRYPTSETUP,
        &[
            "luksAddKey",
            "-q",
            "--unbound",
            "-s",
            "256",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            s(&unbound),
            s(&pf),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(same_verdict(&t, &unbound, &to1, "unbound"), 1);
    let junk = t.image("junk.img", 1);
    assert_eq!(same_verdict(&t, &junk, &to1, "junk"), 1);
}

#[test]
fn erase_and_convert_key_beside_cryptsetup() {
    if !kit::cryptsetup::require() {
        return;
    }
    let t = TempDir::new("convert-erase");
    let pf = t.file("pass", "pass0");
    for luks_type in ["luks1", "luks2"] {
        let img = fresh(
            &t,
            CRYPTSETUP,
            luks_type,
            &format!("erase-{luks_type}"),
            &pf,
        );
        let o = run(
            CRYPTSETUP,
            &[
                "luksAddKey",
                "-q",
                "--key-file",
                s(&pf),
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                s(&img),
                s(&pf),
            ],
        );
        assert!(o.status.success(), "{}", text(&o));
        assert_eq!(
            same_verdict(&t, &img, &["erase", "-q"], &format!("erase-{luks_type}")),
            0
        );
        let erased = t.path(&format!("erase-{luks_type}-u"));
        assert!(
            !opens(CRYPTSETUP, &erased, &pf),
            "{luks_type}: a keyslot survived erase"
        );
        let keyslots = |p: &Path| -> usize {
            text(&run(CRYPTSETUP, &["luksDump", s(p)]))
                .lines()
                .filter(|l| l.contains(": ENABLED") || l.trim_end().ends_with(": luks2"))
                .count()
        };
        assert_eq!(keyslots(&erased), 0, "{luks_type}");
        assert_eq!(keyslots(&t.path(&format!("erase-{luks_type}-c"))), 0);
    }
    // luksConvertKey: pbkdf2 → argon2id (LUKS1 cannot take it), and back.
    let img = fresh(&t, CRYPTSETUP, "luks2", "ck", &pf);
    let plain = export(&t, &img, &pf, "ck-0");
    let ck = |args: &[&str]| {
        let mut a = vec!["luksConvertKey", "-q", "-S", "0", "--key-file", s(&pf)];
        a.extend_from_slice(args);
        a.push(s(&img));
        let o = run(UCRYPT, &a);
        assert!(o.status.success(), "luksConvertKey {args:?}: {}", text(&o));
    };
    ck(&[
        "--pbkdf",
        "argon2id",
        "--pbkdf-force-iterations",
        "4",
        "--pbkdf-memory",
        "32",
        "--pbkdf-parallel",
        "1",
    ]);
    let dump = text(&run(CRYPTSETUP, &["luksDump", s(&img)]));
    assert!(dump.contains("PBKDF:      argon2id"), "{dump}");
    assert!(opens(CRYPTSETUP, &img, &pf));
    assert_eq!(
        code(&run(
            CRYPTSETUP,
            &["convert", "-q", "--type", "luks1", s(&img)]
        )),
        1
    );
    ck(FAST_PBKDF2);
    let dump = text(&run(CRYPTSETUP, &["luksDump", s(&img)]));
    assert!(dump.contains("PBKDF:      pbkdf2"), "{dump}");
    convert_ok(CRYPTSETUP, &img, "luks1");
    assert!(opens(UCRYPT, &img, &pf));
    assert_eq!(export(&t, &img, &pf, "ck-1"), plain);
    // LUKS1 has no luksConvertKey in cryptsetup 2.6.1 (it loads LUKS2 only): refused alike.
    assert_eq!(
        same_verdict(
            &t,
            &img,
            &["luksConvertKey", "-q", "--key-file", s(&pf)],
            "ck-l1"
        ),
        1
    );
}

/// `luksConvertKey` without `--key-slot`: the keyslot the passphrase opens is converted, the
/// others are left as they were; a passphrase that opens none exits 2. Each tool on its copy of
/// one volume of three keyslots, then every keyslot's KDF type compared (cryptsetup's JSON).
#[test]
fn convert_key_finds_the_keyslot_by_its_passphrase() {
    if !kit::cryptsetup::require() {
        return;
    }
    let t = TempDir::new("convert-key-find");
    let pf = t.file("pass", "pass0");
    let passes: Vec<PathBuf> = (1..3)
        .map(|i| t.file(&format!("pass{i}"), format!("pass{i}")))
        .collect();
    let img = fresh(&t, CRYPTSETUP, "luks2", "find", &pf);
    for p in &passes {
        let mut a = vec!["luksAddKey", "-q", "--key-file", s(&pf), s(&img), s(p)];
        a.extend(FAST_PBKDF2);
        let o = run(CRYPTSETUP, &a);
        assert!(o.status.success(), "{}", text(&o));
    }
    let wrong = t.file("wrong", "nope");
    let kdf_types = |p: &Path| -> Vec<(String, String)> {
        let o = run(CRYPTSETUP, &["luksDump", "--dump-json-metadata", s(p)]);
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
        let mut v: Vec<(String, String)> = j["keyslots"]
            .as_object()
            .expect("keyslots")
            .iter()
            .map(|(id, k)| (id.clone(), k["kdf"]["type"].as_str().unwrap_or("").into()))
            .collect();
        v.sort();
        v
    };
    let mut results = Vec::new();
    for prog in [CRYPTSETUP, UCRYPT] {
        let copy = t.path(&format!("find-{}", if prog == UCRYPT { "u" } else { "c" }));
        std::fs::copy(&img, &copy).expect("copy");
        let convert = |key: &Path| {
            code(&run(
                prog,
                &[
                    "luksConvertKey",
                    "-q",
                    s(&copy),
                    "--key-file",
                    s(key),
                    "--pbkdf",
                    "argon2id",
                    "--pbkdf-force-iterations",
                    "4",
                    "--pbkdf-memory",
                    "32",
                    "--pbkdf-parallel",
                    "1",
                ],
            ))
        };
        let codes = (convert(&passes[0]), convert(&wrong));
        results.push((codes, kdf_types(&copy)));
        assert!(
            opens(CRYPTSETUP, &copy, &passes[0]),
            "{prog}: pass1 no longer opens"
        );
    }
    assert_eq!(results[0], results[1], "cryptsetup's, then ucrypt's");
    assert_eq!(results[0].0, (0, 2));
    assert_eq!(
        results[0].1,
        [("0", "pbkdf2"), ("1", "argon2id"), ("2", "pbkdf2")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .to_vec()
    );
}
