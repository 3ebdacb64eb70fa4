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
struct Step {
    args: &'static [&'static str],
    input: &'static str,
    want: Want,
    data: bool,
}

const fn step(args: &'static [&'static str], input: &'static str, want: Want) -> Step {
    Step {
        args,
        input,
        want,
        data: false,
    }
}

/// An activation: ucrypt `export`s the volume with these options.
const fn data(args: &'static [&'static str], input: &'static str, want: Want) -> Step {
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
    if !have("xz") {
        println!("SKIPPED: xz not installed (cryptsetup's images are xz-compressed)");
        return None;
    }
    match cli_common::cryptsetup_tests() {
        Ok(d) => Some(d),
        Err(why) => {
            println!("SKIPPED: {why}");
            None
        }
    }
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
