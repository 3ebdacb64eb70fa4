//! cryptsetup's own test material, run against ucrypt with the verdicts cryptsetup's scripts
//! expect: the images of its upstream `tests/` folder (from Debian's source package, see
//! `cli_common::cryptsetup_tests`) and the command sequences of its compat scripts that use
//! them, each step with the exit status the script demands. Where cryptsetup is installed the
//! same steps run through it too (a step it cannot run here, an activation, is ucrypt's alone:
//! `export` stands for it, the same unlock and data path), so a disagreement between the
//! script and its own tool shows as a harness fault, not as a ucrypt defect.
//!
//! SKIPPED when the source package cannot be had (no network, no apt) or xz is missing.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::{Path, PathBuf};

use cli_common::{have, run_in, text, TempDir, FAST_PBKDF2, UCRYPT};

/// What a step must do.
#[derive(Clone, Copy, Debug)]
enum Want {
    /// Exit 0.
    Ok,
    /// Exit non-zero (and not by a signal).
    Fail,
    /// Exit with this code.
    Code(i32),
    /// Exit 0 with this text on stdout.
    Has(&'static str),
    /// This text not on stdout (whatever the exit code, as `cmd | grep -q X && fail` has it).
    Lacks(&'static str),
    /// No command: these two of the test's files are equal (`diff A B || fail`).
    SameFiles(&'static str, &'static str),
}

/// One command of a compat script: a verb with its arguments (`DEV`, `KEY5`, `KF0`, `KF1`
/// and `OUT` stand for the test's files), what it reads on stdin, and what it must do.
/// `data: true` marks an activation (`cryptsetup open DEV NAME`), which ucrypt checks with
/// `export` and cryptsetup cannot run here.
struct Step<'a> {
    args: &'a [&'a str],
    input: &'static str,
    want: Want,
    data: bool,
}

const fn step<'a>(args: &'a [&'a str], input: &'static str, want: Want) -> Step<'a> {
    Step {
        args,
        input,
        want,
        data: false,
    }
}

/// An activation: ucrypt `export`s the volume with these options.
const fn data<'a>(args: &'a [&'a str], input: &'static str, want: Want) -> Step<'a> {
    Step {
        args,
        input,
        want,
        data: true,
    }
}

/// The files a sequence refers to.
struct Files {
    dev: PathBuf,
    dir: PathBuf,
}

impl Files {
    fn arg(&self, a: &str) -> String {
        match a {
            "DEV" => self.dev.display().to_string(),
            "KEY5" | "KF0" | "KF1" | "OUT" => self.dir.join(a).display().to_string(),
            _ => a.to_string(),
        }
    }
}

/// Runs `steps` with `tool` (ucrypt or cryptsetup); returns the steps that did not do what
/// they must, each with what it did.
fn play(tool: &str, steps: &[Step], f: &Files) -> Vec<String> {
    let mut miss = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        if let Want::SameFiles(a, b) = s.want {
            let (a, b) = (f.arg(a), f.arg(b));
            if std::fs::read(&a).ok() != std::fs::read(&b).ok() {
                miss.push(format!("step {i}: {a} and {b} differ"));
            }
            continue;
        }
        let mut args: Vec<String> = Vec::new();
        if s.data {
            if tool != UCRYPT {
                continue;
            }
            let _ = std::fs::remove_file(f.dir.join("OUT"));
            args.extend(["export".to_string(), f.arg("DEV"), f.arg("OUT")]);
        }
        for a in s.args {
            let a = f.arg(a);
            if a == "FAST" {
                args.extend(FAST_PBKDF2.iter().map(|s| s.to_string()));
            } else {
                args.push(a);
            }
        }
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run_in(tool, &argv, s.input.as_bytes());
        let out = String::from_utf8_lossy(&o.stdout);
        let ok = match (s.want, o.status.code()) {
            (Want::Ok, Some(0)) => true,
            (Want::Fail, Some(c)) => c != 0,
            (Want::Code(w), Some(c)) => c == w,
            (Want::Has(t), Some(0)) => out.contains(t),
            (Want::Lacks(t), Some(_)) => !out.contains(t),
            (Want::SameFiles(..), _) | (_, None) => false,
            (Want::Ok | Want::Has(_), Some(_)) => false,
        };
        if !ok {
            miss.push(format!(
                "step {i}: {tool} {argv:?} must {:?}: {}",
                s.want,
                text(&o)
            ));
        }
    }
    miss
}

/// Plays `steps` on a copy of `image` (or on a new empty file of `mib` MiB when `image` is
/// None) with ucrypt, and, where installed, with cryptsetup on its own copy.
fn play_both(tag: &str, image: Option<&Path>, mib: u64, steps: &[Step], setup: &dyn Fn(&Path)) {
    let mut misses = Vec::new();
    for tool in [UCRYPT, "cryptsetup"] {
        if tool == "cryptsetup" && !have("cryptsetup") {
            println!("{tag}: cryptsetup not installed, its own run of the steps left out");
            continue;
        }
        let t = TempDir::new(tag);
        let dev = t.path("DEV");
        match image {
            Some(img) => {
                std::fs::copy(img, &dev).expect("copy the image");
            }
            None => {
                t.image("DEV", mib);
            }
        }
        setup(t.dir());
        let f = Files {
            dev,
            dir: t.dir().to_path_buf(),
        };
        let miss = play(tool, steps, &f);
        if tool == "cryptsetup" {
            assert!(
                miss.is_empty(),
                "the harness: cryptsetup fails its own script: {miss:#?}"
            );
        }
        misses.extend(miss);
    }
    assert!(misses.is_empty(), "{tag}: {misses:#?}");
}

fn suite() -> Option<PathBuf> {
    cli_common::image_suite()
}

const PWD0: &str = "compatkey\n";
const PWD1: &str = "93R4P4pIqAH8\n";
const PWD2: &str = "mymJeD8ivEhE\n";
const PWD3: &str = "ocMakf3fAcQO\n";

/// compat-test2, "test keyslot not assigned to segment is unable to unlock volume", on
/// `luks2_keyslot_unassigned.img` (keyslot 1 unbound).
#[test]
fn unbound_keyslot_of_the_unassigned_image_never_opens_the_data() {
    let Some(suite) = suite() else { return };
    let t = TempDir::new("unassigned-src");
    let img = t.path("luks2_keyslot_unassigned.img");
    cli_common::unxz(&suite.join("luks2_keyslot_unassigned.img.xz"), &img);
    let steps = [
        step(&["open", "-S1", "--test-passphrase", "DEV"], PWD1, Want::Ok),
        step(
            &["open", "--unbound", "--test-passphrase", "DEV"],
            PWD1,
            Want::Ok,
        ),
        // Without a slot or --unbound the unbound keyslot is not tried: cryptsetup's answer.
        step(&["open", "--test-passphrase", "DEV"], PWD1, Want::Code(1)),
        data(&["-S1"], PWD1, Want::Fail),
        data(&[], PWD1, Want::Fail),
        step(
            &["luksDump", "-q", "--dump-volume-key", "DEV"],
            PWD1,
            Want::Fail,
        ),
        step(
            &["open", "-S1", "--test-passphrase", "DEV"],
            PWD0,
            Want::Fail,
        ),
        step(&["luksKillSlot", "-q", "DEV", "0"], "", Want::Ok),
        step(&["luksDump", "DEV"], "", Want::Lacks("0: luks2")),
        step(&["open", "-S1", "--test-passphrase", "DEV"], PWD1, Want::Ok),
        step(
            &["open", "--unbound", "--test-passphrase", "DEV"],
            PWD1,
            Want::Ok,
        ),
        data(&["-S1"], PWD1, Want::Fail),
    ];
    play_both("unassigned", Some(&img), 0, &steps, &|_| {});
}

/// compat-test2 "[38] luksAddKey unbound tests", step by step.
#[test]
fn unbound_keys_as_compat_test2_adds_tests_and_dumps_them() {
    let Some(_) = suite() else { return };
    let steps = [
        step(
            &[
                "luksFormat",
                "-q",
                "FAST",
                "--type",
                "luks2",
                "DEV",
                "KEY5",
                "--key-slot",
                "5",
            ],
            "",
            Want::Ok,
        ),
        // An unbound key may have any size.
        step(
            &["luksAddKey", "FAST", "--unbound", "-s", "72", "DEV"],
            PWD1,
            Want::Ok,
        ),
        step(
            &[
                "luksAddKey",
                "-q",
                "FAST",
                "--unbound",
                "-s",
                "72",
                "-S",
                "2",
                "DEV",
            ],
            PWD2,
            Want::Ok,
        ),
        step(&["luksDump", "DEV"], "", Want::Has("2: luks2 (unbound)")),
        step(
            &[
                "luksAddKey",
                "-q",
                "FAST",
                "--unbound",
                "-s",
                "512",
                "-S",
                "3",
                "--volume-key-file",
                "KF0",
                "DEV",
            ],
            PWD3,
            Want::Ok,
        ),
        step(&["luksDump", "DEV"], "", Want::Has("3: luks2 (unbound)")),
        // The key size is required.
        step(&["luksAddKey", "-q", "--unbound", "DEV"], PWD1, Want::Fail),
        step(
            &[
                "luksAddKey",
                "-q",
                "--unbound",
                "--volume-key-file",
                "/dev/urandom",
                "DEV",
            ],
            PWD3,
            Want::Fail,
        ),
        // An unbound keyslot does not replace one in use.
        step(
            &["luksAddKey", "-q", "-S5", "--unbound", "-s", "32", "DEV"],
            PWD1,
            Want::Fail,
        ),
        data(&[], PWD2, Want::Fail),
        data(&["-S2"], PWD2, Want::Fail),
        step(
            &["open", "-q", "-S2", "DEV", "--test-passphrase"],
            PWD2,
            Want::Ok,
        ),
        data(&[], PWD1, Want::Fail),
        // An unbound keyslot's passphrase can be changed.
        step(
            &["luksChangeKey", "FAST", "-S", "2", "DEV"],
            "mymJeD8ivEhE\nocMakf3fAcQO\n",
            Want::Ok,
        ),
        step(
            &["open", "--test-passphrase", "-S", "2", "DEV"],
            PWD3,
            Want::Ok,
        ),
        data(&["-S", "2"], PWD3, Want::Fail),
        // An unbound keyslot adds no keyslot.
        step(
            &["luksAddKey", "-q", "DEV"],
            "ocMakf3fAcQO\n93R4P4pIqAH8\n",
            Want::Fail,
        ),
        // A keyslot is added beside unbound ones.
        step(
            &[
                "luksAddKey",
                "-q",
                "FAST",
                "DEV",
                "--key-file",
                "KEY5",
                "-S8",
            ],
            PWD1,
            Want::Ok,
        ),
        data(&[], PWD1, Want::Ok),
        step(&["luksKillSlot", "-q", "DEV", "2"], "", Want::Ok),
        step(&["luksDump", "DEV"], "", Want::Lacks("2: luks2 (unbound)")),
        // The slot must be named, and a key file is never overwritten.
        step(
            &["luksDump", "--unbound", "--volume-key-file", "KF1", "DEV"],
            PWD3,
            Want::Fail,
        ),
        step(&["luksDump", "--unbound", "DEV"], PWD3, Want::Fail),
        step(
            &[
                "luksDump",
                "--unbound",
                "--volume-key-file",
                "KF1",
                "-S3",
                "DEV",
            ],
            PWD3,
            Want::Ok,
        ),
        step(&[], "", Want::SameFiles("KF0", "KF1")),
        step(
            &[
                "luksDump",
                "--unbound",
                "--volume-key-file",
                "KF1",
                "-S3",
                "DEV",
            ],
            PWD3,
            Want::Fail,
        ),
        step(&[], "", Want::SameFiles("KF0", "KF1")),
        step(
            &["luksDump", "--unbound", "-S3", "DEV"],
            PWD3,
            Want::Has("Unbound Key:"),
        ),
        step(&["luksKillSlot", "-q", "DEV", "3"], "", Want::Ok),
        step(&["luksDump", "DEV"], "", Want::Lacks("3: luks2 (unbound)")),
    ];
    let check_key = |dir: &Path| {
        std::fs::write(dir.join("KEY5"), b"key5 of compat-test2\n").expect("KEY5");
        let mut k = [0u8; 64];
        for (i, b) in k.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(11);
        }
        std::fs::write(dir.join("KF0"), k).expect("KF0");
    };
    play_both("unbound38", None, 32, &steps, &check_key);
}

/// Grows the test's DEV to 8 MiB: the requirements images end where their data begins.
fn grow_to_8m(dir: &Path) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("DEV"))
        .expect("open DEV");
    f.set_len(8 << 20).expect("grow DEV");
}

const BLABLA: &str = "blablabl\n";
const BLABLA_NEW: &str = "blablabl\nnewpass9\n";

/// api-test-2's Luks2Requirements, through the CLI: a header with mandatory requirements
/// neither tool knows (`req0 req1`) is read (dump, backup, a passphrase test, the volume
/// key), keyslots may be removed, but it is never activated, not even read-only, and no
/// other header write happens.
#[test]
fn unknown_requirements_allow_reads_and_refuse_writes_and_activation() {
    let Some(suite) = suite() else { return };
    let t = TempDir::new("reqs-src");
    cli_common::untar(&suite.join("luks2_header_requirements.tar.xz"), t.dir());
    let steps = [
        step(&["luksDump", "DEV"], "", Want::Has("req0 req1")),
        step(&["open", "--test-passphrase", "DEV"], BLABLA, Want::Ok),
        step(
            &["luksDump", "-q", "--dump-volume-key", "DEV"],
            BLABLA,
            Want::Has("MK dump:"),
        ),
        step(
            &["luksHeaderBackup", "DEV", "--header-backup-file", "KF1"],
            "",
            Want::Ok,
        ),
        step(&["config", "--label", "x", "DEV"], "", Want::Code(1)),
        step(
            &["config", "--priority", "prefer", "-S", "0", "DEV"],
            "",
            Want::Code(1),
        ),
        step(
            &[
                "luksUUID",
                "--uuid",
                "11111111-1111-1111-1111-111111111111",
                "DEV",
            ],
            "",
            Want::Code(1),
        ),
        step(&["luksAddKey", "FAST", "DEV"], BLABLA_NEW, Want::Code(1)),
        step(&["luksChangeKey", "FAST", "DEV"], BLABLA_NEW, Want::Code(1)),
        step(&["repair", "-q", "DEV"], "", Want::Code(1)),
        step(
            &[
                "luksHeaderRestore",
                "-q",
                "DEV",
                "--header-backup-file",
                "KF1",
            ],
            "",
            Want::Code(1),
        ),
        data(&[], BLABLA, Want::Fail),
        data(&["--readonly"], BLABLA, Want::Fail),
        step(&["luksDump", "DEV"], "", Want::Has("req0 req1")),
        step(&["luksKillSlot", "-q", "DEV", "0"], "", Want::Ok),
        step(&["luksDump", "DEV"], "", Want::Lacks("0: luks2")),
    ];
    play_both(
        "reqs",
        Some(&t.path("luks2_header_requirements")),
        0,
        &steps,
        &grow_to_8m,
    );

    // The same header without requirements: every one of those verbs works.
    let free = [
        step(&["open", "--test-passphrase", "DEV"], BLABLA, Want::Ok),
        step(
            &["luksHeaderBackup", "DEV", "--header-backup-file", "KF1"],
            "",
            Want::Ok,
        ),
        data(&[], BLABLA, Want::Ok),
        step(&["config", "--label", "x", "DEV"], "", Want::Ok),
        step(
            &["config", "--priority", "prefer", "-S", "0", "DEV"],
            "",
            Want::Ok,
        ),
        step(
            &[
                "luksUUID",
                "--uuid",
                "11111111-1111-1111-1111-111111111111",
                "DEV",
            ],
            "",
            Want::Ok,
        ),
        step(&["luksAddKey", "FAST", "DEV"], BLABLA_NEW, Want::Ok),
        step(&["luksChangeKey", "FAST", "DEV"], BLABLA_NEW, Want::Ok),
        step(&["repair", "-q", "DEV"], "", Want::Ok),
        step(
            &[
                "luksHeaderRestore",
                "-q",
                "DEV",
                "--header-backup-file",
                "KF1",
            ],
            "",
            Want::Ok,
        ),
        data(&[], BLABLA, Want::Ok),
    ];
    play_both(
        "reqs-free",
        Some(&t.path("luks2_header_requirements_free")),
        0,
        &free,
        &grow_to_8m,
    );
}

/// The volume key api-test's LuksHeaderRestore formats with (`valid_header_file` holds it).
const RESTORE_VK_HEX: &str = "bb21158c733229347bd4e681891e213d94c685be6a5b84818afe7a78a6de7a1a";

/// api-test's LuksHeaderRestore through the CLI: the five evil headers of cryptsetup's tests
/// (a damaged keyslot descriptor, enabled or not; material over the payload; stripes; a
/// header too small; overlapping keyslots) are refused, on a LUKS1 volume and on one whose
/// header was wiped, and `valid_header_file` is restored and opens with its volume key; a
/// backup whose key size or payload offset differs from the volume's is refused.
#[test]
fn luks1_header_restore_refuses_every_evil_header_as_api_test_does() {
    let Some(suite) = suite() else { return };
    let src = TempDir::new("restore-src");
    let names = [
        "evil_hdr-luks_hdr_damage",
        "evil_hdr-payload_overwrite",
        "evil_hdr-stripes_payload_dmg",
        "evil_hdr-small_luks_device",
        "evil_hdr-keyslot_overlap",
        "valid_header_file",
    ];
    for n in names {
        cli_common::unxz(&suite.join(format!("{n}.xz")), &src.path(n));
    }
    let vk: Vec<u8> = (0..RESTORE_VK_HEX.len() / 2)
        .map(|i| u8::from_str_radix(&RESTORE_VK_HEX[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    // Every evil header is refused by the header parser itself (dump), as cryptsetup's load.
    for n in &names[..5] {
        for tool in [UCRYPT, "cryptsetup"] {
            if tool == "cryptsetup" && !have("cryptsetup") {
                continue;
            }
            let o = run_in(tool, &["luksDump", cli_common::s(&src.path(n))], b"");
            assert_ne!(
                o.status.code(),
                Some(0),
                "{tool} luksDump {n}: {}",
                text(&o)
            );
        }
    }
    let restore = |name: &'static str| {
        [
            "luksHeaderRestore",
            "-q",
            "DEV",
            "--header-backup-file",
            name,
        ]
    };
    let evils = [
        restore("EVIL1"),
        restore("EVIL2"),
        restore("EVIL3"),
        restore("EVIL4"),
        restore("EVIL5"),
    ];
    let valid_args = restore("VALID");
    let evil = |i: usize| step(&evils[i - 1], "", Want::Fail);
    let valid = || step(&valid_args, "", Want::Ok);
    let format = |align: &'static str, key_bits: &'static str| {
        [
            "luksFormat",
            "-q",
            "--type",
            "luks1",
            "--cipher",
            "aes-cbc-essiv:sha256",
            "--hash",
            "sha512",
            "--key-size",
            key_bits,
            "--align-payload",
            align,
            "--volume-key-file",
            "KF0",
            "FAST",
            "DEV",
            "KEY5",
        ]
    };
    let f2048 = format("2048", "256");
    let f2048_128 = format("2048", "128");
    let f8192 = format("8192", "256");
    let steps = [
        step(&f2048, "", Want::Ok),
        evil(1),
        evil(2),
        evil(3),
        evil(4),
        evil(5),
        valid(),
        // The volume's own header wiped: the same verdicts, and the valid header opens.
        step(&["WIPE"], "", Want::Ok),
        evil(1),
        evil(2),
        evil(3),
        evil(4),
        evil(5),
        valid(),
        step(
            &[
                "open",
                "--test-passphrase",
                "--volume-key-file",
                "KF0",
                "DEV",
            ],
            "",
            Want::Ok,
        ),
        // A backup of another key size, or another payload offset, does not fit.
        step(&f2048_128, "", Want::Ok),
        step(
            &[
                "luksHeaderRestore",
                "-q",
                "DEV",
                "--header-backup-file",
                "VALID",
            ],
            "",
            Want::Fail,
        ),
        step(&f8192, "", Want::Ok),
        step(
            &[
                "luksHeaderRestore",
                "-q",
                "DEV",
                "--header-backup-file",
                "VALID",
            ],
            "",
            Want::Fail,
        ),
    ];
    for tool in [UCRYPT, "cryptsetup"] {
        if tool == "cryptsetup" && !have("cryptsetup") {
            continue;
        }
        let t = TempDir::new("restore");
        // The payload (4096 sectors at 2048-sector alignment) and 5000 sectors of data.
        t.image("DEV", 0);
        std::fs::OpenOptions::new()
            .write(true)
            .open(t.path("DEV"))
            .and_then(|f| f.set_len((4096 + 5000) * 512))
            .expect("size DEV");
        std::fs::write(t.path("KEY5"), b"key5").expect("KEY5");
        for (i, n) in names.iter().enumerate() {
            let to = if i == 5 {
                "VALID".to_string()
            } else {
                format!("EVIL{}", i + 1)
            };
            std::fs::copy(src.path(n), t.path(&to)).expect("copy header");
        }
        let mut miss = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            if s.args == ["WIPE"] {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(t.path("DEV"))
                    .unwrap();
                std::os::unix::fs::FileExt::write_all_at(&f, &vec![0u8; 4096 * 512], 0).unwrap();
                continue;
            }
            let (kf0, key_bits) = (
                t.path("KF0"),
                s.args.iter().position(|a| *a == "--key-size"),
            );
            let bits: usize = key_bits.map_or(256, |p| s.args[p + 1].parse().unwrap());
            std::fs::write(&kf0, &vk[..bits / 8]).expect("KF0");
            let f = Files {
                dev: t.path("DEV"),
                dir: t.dir().to_path_buf(),
            };
            let args: Vec<String> = s
                .args
                .iter()
                .flat_map(|a| match *a {
                    "FAST" => FAST_PBKDF2.iter().map(|s| s.to_string()).collect(),
                    "VALID" | "EVIL1" | "EVIL2" | "EVIL3" | "EVIL4" | "EVIL5" => {
                        vec![t.path(a).display().to_string()]
                    }
                    a => vec![f.arg(a)],
                })
                .collect();
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let o = run_in(tool, &argv, b"");
            let ok = match s.want {
                Want::Ok => o.status.code() == Some(0),
                _ => o.status.code().is_some_and(|c| c != 0),
            };
            if !ok {
                miss.push(format!(
                    "step {i}: {tool} {argv:?} must {:?}: {}",
                    s.want,
                    text(&o)
                ));
            }
        }
        if tool == "cryptsetup" {
            assert!(
                miss.is_empty(),
                "the harness: cryptsetup fails api-test's cases: {miss:#?}"
            );
        }
        assert!(miss.is_empty(), "{miss:#?}");
    }
}

/// api-test's "do not restore header over plain device": a device served in plain mode (a raw
/// dm-crypt mapping, here `ucrypt serve --cipher`) takes no LUKS header restore while it is
/// served (exit 5, busy), and takes the valid header once it is not.
#[test]
fn no_header_restore_over_a_served_plain_device() {
    let Some(suite) = suite() else { return };
    let t = TempDir::new("restore-plain");
    let valid = t.path("valid_header_file");
    cli_common::unxz(&suite.join("valid_header_file.xz"), &valid);
    let dev = t.image("DEV", 8);
    let key: Vec<u8> = (0..RESTORE_VK_HEX.len() / 2)
        .map(|i| u8::from_str_radix(&RESTORE_VK_HEX[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    let kf = t.file("KF0", &key);
    let sock = t.path("plain.sock");
    let listen = format!("unix:{}", sock.display());
    let mut serve = std::process::Command::new(UCRYPT)
        .args([
            "serve",
            cli_common::s(&dev),
            "--cipher",
            "aes-cbc-essiv:sha256",
        ])
        .args(["--volume-key-file", cli_common::s(&kf), "--nbd", &listen])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("serve");
    let t0 = std::time::Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed().as_secs() < 60, "serve did not listen");
        assert!(
            serve.try_wait().expect("wait").is_none(),
            "serve exited early"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let restore = [
        "luksHeaderRestore",
        "-q",
        cli_common::s(&dev),
        "--header-backup-file",
    ];
    let mut args = restore.to_vec();
    args.push(cli_common::s(&valid));
    let o = run_in(UCRYPT, &args, b"");
    let _ = serve.kill();
    let _ = serve.wait();
    assert_eq!(
        o.status.code(),
        Some(5),
        "restore over a served plain device: {}",
        text(&o)
    );
    assert_ne!(
        run_in(UCRYPT, &["isLuks", cli_common::s(&dev)], b"")
            .status
            .code(),
        Some(0),
        "the refused restore wrote a header"
    );
    let o = run_in(UCRYPT, &args, b"");
    assert_eq!(
        o.status.code(),
        Some(0),
        "restore once the device is free: {}",
        text(&o)
    );
}

/// luks1-compat-test's images (serpent, twofish, aes-lrw, essiv:wp256 and aes volumes, sha1,
/// sha256 and whirlpool): the header-only verbs need no data cipher, so `isLuks` and
/// `luksDump` answer for every one, and the dump is cryptsetup's text byte for byte; unlocking
/// one whose cipher ucrypt cannot run says so ("unsupported cipher"), not "bad header".
#[test]
fn luks1_images_dump_without_their_cipher() {
    let Some(suite) = suite() else { return };
    let t = TempDir::new("luks1-images");
    cli_common::untar(&suite.join("luks1-images.tar.xz"), t.dir());
    let dir = t.path("luks1-images");
    let mut images: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("images")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "img"))
        .collect();
    images.sort();
    assert_eq!(images.len(), 12, "luks1-images.tar.xz holds 12 volumes");
    let mut miss = Vec::new();
    for img in &images {
        let i = cli_common::s(img);
        for verb in ["isLuks", "luksDump"] {
            let o = run_in(UCRYPT, &[verb, i], b"");
            if o.status.code() != Some(0) {
                miss.push(format!("{verb} {i}: {}", text(&o)));
            }
        }
        if have("cryptsetup") {
            let ours = run_in(UCRYPT, &["luksDump", i], b"");
            let theirs = run_in("cryptsetup", &["luksDump", i], b"");
            if ours.stdout != theirs.stdout {
                miss.push(format!(
                    "luksDump {i} differs from cryptsetup's:\n{}\n---\n{}",
                    String::from_utf8_lossy(&ours.stdout),
                    String::from_utf8_lossy(&theirs.stdout)
                ));
            }
        }
        let kf = dir.join("keyfile1");
        let o = run_in(
            UCRYPT,
            &[
                "open",
                "--test-passphrase",
                "--key-file",
                cli_common::s(&kf),
                i,
            ],
            b"",
        );
        let err = String::from_utf8_lossy(&o.stderr);
        if o.status.code() != Some(0) && !err.contains("unsupported cipher") {
            miss.push(format!("open --test-passphrase {i}: {}", text(&o)));
        }
        if err.contains("LUKS header check") {
            miss.push(format!(
                "open --test-passphrase {i} calls the header bad: {}",
                text(&o)
            ));
        }
    }
    // cryptsetup's legacy LUKS1 images of the null cipher carry a 256-bit key (dm-crypt's
    // cipher_null ignores it): the header is read, dumped as cryptsetup dumps it, unlocked.
    let null = t.image("null.img", 20);
    let n = cli_common::s(&null);
    let mut fmt = vec![
        "luksFormat",
        "-q",
        "--type",
        "luks1",
        "-c",
        "cipher_null-ecb",
        "-s",
        "256",
    ];
    fmt.extend(FAST_PBKDF2);
    fmt.push(n);
    let o = run_in(UCRYPT, &fmt, b"pw\n");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = run_in(UCRYPT, &["open", "--test-passphrase", n], b"pw\n");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    if have("cryptsetup") {
        let ours = run_in(UCRYPT, &["luksDump", n], b"");
        let theirs = run_in("cryptsetup", &["luksDump", n], b"");
        assert_eq!(theirs.status.code(), Some(0), "{}", text(&theirs));
        assert_eq!(
            ours.stdout,
            theirs.stdout,
            "cipher_null dump: {}",
            text(&ours)
        );
    }
    assert!(miss.is_empty(), "{miss:#?}");
}

/// The volume serial of a FAT boot sector as blkid prints it (`DEAD-BABE`): after the extended
/// boot signature 0x29, at 0x27 for FAT12/16 and at 0x43 for FAT32, little-endian.
fn fat_volume_id(boot: &[u8]) -> Option<String> {
    let at = [(0x26, 0x27), (0x42, 0x43)]
        .into_iter()
        .find(|&(sig, _)| boot.get(sig) == Some(&0x29))?
        .1;
    let id = u32::from_le_bytes(boot.get(at..at + 4)?.try_into().ok()?);
    Some(format!("{:04X}-{:04X}", id >> 16, id & 0xffff))
}

/// luks1-compat-test's "PASSPHRASE CHECK" and "ACTIVATION FS UUID CHECK" on its 12 images
/// (aes-xts, aes-cbc-essiv:sha256, aes-lrw-plain64, aes-xts-essiv:wp256, serpent-xts and
/// twofish-xts; sha1, sha256 and whirlpool): `keyfile1` unlocks every one, through its own
/// cipher in the keyslot area, and the exported plaintext is a FAT volume with the UUID
/// DEAD-BABE, read from the boot sector and, where installed, by `blkid -p` as the script does.
#[test]
fn luks1_images_unlock_and_hold_the_dead_babe_filesystem() {
    let Some(suite) = suite() else { return };
    let t = TempDir::new("luks1-images-open");
    cli_common::untar(&suite.join("luks1-images.tar.xz"), t.dir());
    let dir = t.path("luks1-images");
    let kf = dir.join("keyfile1");
    let mut images: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("images")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "img"))
        .collect();
    images.sort();
    assert_eq!(images.len(), 12, "luks1-images.tar.xz holds 12 volumes");
    let mut miss = Vec::new();
    for img in &images {
        let i = cli_common::s(img);
        let name = img.file_name().and_then(|n| n.to_str()).unwrap_or(i);
        let o = run_in(
            UCRYPT,
            &[
                "open",
                "--test-passphrase",
                "--key-file",
                cli_common::s(&kf),
                i,
            ],
            b"",
        );
        if o.status.code() != Some(0) {
            miss.push(format!("open --test-passphrase {name}: {}", text(&o)));
            continue;
        }
        let out = t.path("plain.img");
        let _ = std::fs::remove_file(&out);
        let o = run_in(
            UCRYPT,
            &[
                "export",
                "--key-file",
                cli_common::s(&kf),
                i,
                cli_common::s(&out),
            ],
            b"",
        );
        if o.status.code() != Some(0) {
            miss.push(format!("export {name}: {}", text(&o)));
            continue;
        }
        let plain = std::fs::read(&out).expect("exported plaintext");
        match fat_volume_id(&plain) {
            Some(id) if id == "DEAD-BABE" => {}
            other => miss.push(format!("{name}: FAT volume id {other:?}, not DEAD-BABE")),
        }
        if have("blkid") {
            let o = run_in(
                "blkid",
                &["-p", "-o", "value", "-s", "UUID", cli_common::s(&out)],
                b"",
            );
            let uuid = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if uuid != "DEAD-BABE" {
                miss.push(format!("{name}: blkid says UUID {uuid:?}: {}", text(&o)));
            }
        }
        println!("{name}: unlocked, DEAD-BABE");
    }
    assert!(miss.is_empty(), "{miss:#?}");
}

/// compat-test2 "[29] Repair metadata": `blkid-luks2-pv.img` holds a LUKS2 secondary header
/// and, where the primary was, an LVM2 physical volume's label. Neither tool recovers the
/// header on its own (isLuks, luksDump refuse: ambiguous signatures); `repair` does, and then
/// it is LUKS2.
#[test]
fn ambiguous_signatures_refused_until_repair() {
    let Some(suite) = suite() else { return };
    let t = TempDir::new("pv-src");
    let img = t.path("blkid-luks2-pv.img");
    cli_common::unxz(&suite.join("blkid-luks2-pv.img.xz"), &img);
    let steps = [
        step(&["isLuks", "--disable-locks", "DEV"], "", Want::Fail),
        step(&["isLuks", "DEV"], "", Want::Fail),
        step(
            &["isLuks", "--disable-locks", "--type", "luks2", "DEV"],
            "",
            Want::Fail,
        ),
        step(&["isLuks", "--type", "luks2", "DEV"], "", Want::Fail),
        step(&["luksDump", "DEV"], "", Want::Code(1)),
        step(&["repair", "-q", "DEV"], "", Want::Ok),
        step(&["isLuks", "DEV"], "", Want::Ok),
        step(&["isLuks", "--type", "luks2", "DEV"], "", Want::Ok),
        step(&["isLuks", "--type", "luks1", "DEV"], "", Want::Fail),
        step(&["luksDump", "DEV"], "", Want::Has("Version:       \t2")),
    ];
    play_both("pv", Some(&img), 0, &steps, &|_| {});
    // What ucrypt repaired, cryptsetup reads (and the other way round is the run above).
    if have("cryptsetup") {
        let t2 = TempDir::new("pv-cross");
        let dev = t2.path("DEV");
        std::fs::copy(&img, &dev).expect("copy");
        assert_eq!(
            run_in(UCRYPT, &["repair", "-q", cli_common::s(&dev)], b"")
                .status
                .code(),
            Some(0)
        );
        let o = run_in("cryptsetup", &["luksDump", cli_common::s(&dev)], b"");
        assert_eq!(
            o.status.code(),
            Some(0),
            "cryptsetup reads ucrypt's repair: {}",
            text(&o)
        );
    }
}

/// `open --type`: an unknown type, a LUKS version the header does not have and a format
/// ucrypt does not read are each refused with exit 1, as cryptsetup refuses them, and
/// ucrypt's message names what is wrong; the right type opens.
#[test]
fn open_type_is_validated() {
    let Some(_) = suite() else { return };
    let k = "93R4P4pIqAH8\n";
    let steps = [
        step(
            &["luksFormat", "-q", "FAST", "--type", "luks2", "DEV"],
            k,
            Want::Ok,
        ),
        step(
            &["open", "--type", "bogus", "--test-passphrase", "DEV"],
            k,
            Want::Code(1),
        ),
        step(
            &["open", "--type", "luks1", "--test-passphrase", "DEV"],
            k,
            Want::Code(1),
        ),
        step(
            &["open", "--type", "plain", "--test-passphrase", "DEV"],
            k,
            Want::Code(1),
        ),
        step(
            &["open", "--type", "luks2", "--test-passphrase", "DEV"],
            k,
            Want::Ok,
        ),
        step(
            &["open", "--type", "luks", "--test-passphrase", "DEV"],
            k,
            Want::Ok,
        ),
        step(
            &["luksFormat", "-q", "FAST", "--type", "luks1", "DEV"],
            k,
            Want::Ok,
        ),
        step(
            &["open", "--type", "luks2", "--test-passphrase", "DEV"],
            k,
            Want::Code(1),
        ),
        step(
            &["open", "--type", "luks1", "--test-passphrase", "DEV"],
            k,
            Want::Ok,
        ),
    ];
    play_both("open-type", None, 32, &steps, &|_| {});
    // ucrypt's own words, the formats it does not read (cryptsetup fails on those here for
    // want of the kernel's crypto API, so they are ucrypt's alone), and a LUKS volume opened
    // as BitLocker (cryptsetup's words).
    let t = TempDir::new("open-type-words");
    let dev = t.image("DEV", 32);
    let d = cli_common::s(&dev);
    let fast: Vec<&str> = FAST_PBKDF2.to_vec();
    let mut fmt = vec!["luksFormat", "-q", "--type", "luks2"];
    fmt.extend(&fast);
    fmt.push(d);
    assert_eq!(run_in(UCRYPT, &fmt, k.as_bytes()).status.code(), Some(0));
    // A LUKS volume is no FileVault2 volume, and loop-AES has no passphrase to test and
    // needs a key file (cryptsetup's words).
    for (ty, test_word, open_word) in [
        (
            "bogus",
            "unknown device type 'bogus'",
            "unknown device type 'bogus'",
        ),
        ("luks1", "it is LUKS2", "it is LUKS2"),
        (
            "bitlk",
            "is not a valid BITLK device",
            "is not a valid BITLK device",
        ),
        (
            "fvault2",
            "is not a valid FVAULT2 device",
            "is not a valid FVAULT2 device",
        ),
        (
            "loopaes",
            "--test-passphrase is allowed only for open of LUKS, TCRYPT, BITLK and FVAULT2",
            "Option --key-file is required.",
        ),
    ] {
        for (args, word) in [
            (
                vec!["open", "--type", ty, "--test-passphrase", d],
                test_word,
            ),
            (
                vec!["open", "--type", ty, d, "typed", "--front-end", "fuse"],
                open_word,
            ),
        ] {
            let o = run_in(UCRYPT, &args, k.as_bytes());
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
            assert!(
                err.contains(word),
                "{args:?} must say {word:?}: {}",
                text(&o)
            );
        }
    }
    // A LUKS volume is no TrueCrypt volume: no TCRYPT header decrypts with its passphrase
    // (cryptsetup's words and exit code of a wrong passphrase), whatever LUKS would say.
    for args in [
        vec!["open", "--type", "tcrypt", "--test-passphrase", d],
        vec![
            "open",
            "--type",
            "tcrypt",
            d,
            "typed",
            "--front-end",
            "fuse",
        ],
    ] {
        let o = run_in(UCRYPT, &args, k.as_bytes());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("No device header detected"),
            "{args:?}: {}",
            text(&o)
        );
    }
}
