//! cryptsetup's own LUKS2 validation suite, run against `ucrypt dump` as a new user would:
//! the generators of cryptsetup's `tests/generators/` mutate its valid base header
//! (`luks2_valid_hdr.img.xz`) into 83 images, and `tests/luks2-validation-test` says of each
//! whether it must load ("R": `luksDump` exits 0) or be refused ("F": it exits non-zero, and
//! not by a crash). ucrypt must agree on every one.
//!
//! The suite comes with Debian's cryptsetup source package: `UCRYPT_CRYPTSETUP_TESTS` names an
//! unpacked `tests/` folder; otherwise the test fetches one once
//! (`scripts/fetch-cryptsetup-tests.sh`, a private deb-src list) into the temp dir. SKIPPED
//! when that cannot be done, or without bash, jq, xz and dd (the generators' tools). Where
//! cryptsetup is installed, its own `luksDump` is judged too, so a harness fault shows as
//! cryptsetup failing its own suite.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use cli_common::{have, UCRYPT};
/// Images the 2.6.1 suite judges (28 to load, 55 to refuse).
const SUITE_IMAGES: usize = 83;

/// The suite's verdicts: (image, must load), from its `RUN image "R|F" ...` lines.
fn verdicts(test: &str) -> Vec<(String, bool)> {
    test.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "RUN").then_some(())?;
            let img = w.next()?.to_string();
            match w.next()?.trim_matches('"') {
                "R" => Some((img, true)),
                "F" => Some((img, false)),
                _ => None,
            }
        })
        .collect()
}

/// Runs `cmd` on a copy of `img` (dump may repair a header, as cryptsetup's does in memory;
/// each image is judged as generated): Some(exit code), None if killed by a signal.
fn exit_code(cmd: &[&str], img: &Path, scratch: &Path) -> Option<i32> {
    std::fs::copy(img, scratch).expect("copy image");
    let st = Command::new(cmd[0])
        .args(&cmd[1..])
        .arg(scratch)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run dump");
    st.code()
}

/// Images judged as the suite expects, and the misses with their exit codes.
fn judge(cmd: &[&str], dir: &Path, list: &[(String, bool)]) -> (usize, Vec<String>) {
    let scratch = dir.join("judged.img");
    let mut agree = 0;
    let mut miss = Vec::new();
    for (img, load) in list {
        let code = exit_code(cmd, &dir.join(img), &scratch);
        let ok = match (load, code) {
            (true, Some(0)) => true,
            (false, Some(c)) => c != 0,
            _ => false,
        };
        if ok {
            agree += 1;
        } else {
            let want = if *load { "load" } else { "refuse" };
            miss.push(format!("{img}: must {want}, exit {code:?}"));
        }
    }
    (agree, miss)
}

#[test]
fn cryptsetup_luks2_validation_suite_agrees() {
    for tool in ["bash", "jq", "xz", "dd"] {
        if !have(tool) {
            println!("SKIPPED: the suite's generators need {tool}");
            return;
        }
    }
    let suite = match cli_common::cryptsetup_tests() {
        Ok(d) => d,
        Err(why) => {
            println!("SKIPPED: {why}");
            return;
        }
    };
    let list = verdicts(
        &std::fs::read_to_string(suite.join("luks2-validation-test")).expect("read the suite"),
    );
    assert_eq!(list.len(), SUITE_IMAGES, "the suite's RUN lines");

    let imgs = std::env::temp_dir().join(format!("ucrypt-luks2-suite-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&imgs);
    std::fs::create_dir_all(&imgs).expect("image dir");
    let base = imgs.join("luks2_valid_hdr.img");
    let xz = Command::new("xz")
        .arg("-dc")
        .arg(suite.join("luks2_valid_hdr.img.xz"))
        .output()
        .expect("xz");
    assert!(xz.status.success(), "unpack the base image");
    std::fs::write(&base, xz.stdout).expect("write the base image");
    let gen = suite.join("generators");
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(&gen)
        .expect("generators")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("generate-") && n.ends_with(".sh"))
        })
        .collect();
    scripts.sort();
    for s in &scripts {
        let st = Command::new("bash")
            .arg(s)
            .arg(&imgs)
            .arg(&base)
            .current_dir(&gen)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run a generator");
        assert!(st.success(), "generator {} failed", s.display());
    }

    let (agree, miss) = judge(&[UCRYPT, "dump"], &imgs, &list);
    println!("ucrypt dump agrees with cryptsetup 2.6.1's suite on {agree} of {SUITE_IMAGES}");
    if have("cryptsetup") {
        let (cs, cs_miss) = judge(&["cryptsetup", "luksDump"], &imgs, &list);
        println!("cryptsetup luksDump: {cs} of {SUITE_IMAGES}");
        assert_eq!(
            cs, SUITE_IMAGES,
            "the harness: cryptsetup misses {cs_miss:#?}"
        );
    }
    let _ = std::fs::remove_dir_all(&imgs);
    assert!(miss.is_empty(), "ucrypt disagrees on: {miss:#?}");
}
