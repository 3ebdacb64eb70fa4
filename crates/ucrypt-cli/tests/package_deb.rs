//! The Debian packages: `scripts/package-deb.sh --bin-dir` packages this build's binaries (the
//! debug build: the packaging is what is tested, not the release profile).
//!
//! [`deb_installs_and_runs_from_a_throwaway_root`] unpacks the `ucrypt` package into a
//! throwaway directory with `dpkg-deb -x` and uses it from there: `--version` names the commit
//! and the cipher library, every man page renders with `man -l` (ucrypt-bench's too), the
//! completions and the systemd unit are in their Debian places, the binary is stripped and its
//! symbols are in the -dbgsym package under its build id, and the control file declares the
//! shared libraries. lintian, where installed, reports no error.
//!
//! [`debs_install_and_run_in_a_clean_debian_root`] installs the packages with dpkg into a
//! clean Debian root made by mmdebstrap from the mirror apt uses (`scripts/package-smoke.sh`)
//! and runs format, open over FUSE, a write and its read-back, close and `man -l` there.
//!
//! Needs dpkg-deb, dpkg-shlibdeps (dpkg-dev), objcopy (binutils), man (man-db) and mmdebstrap;
//! otherwise SKIPPED (under CI a missing one fails). The clean root also needs root, /dev/fuse
//! and /dev/loop-control, and the mirror the first time (SKIPPED without them, also under CI:
//! they are no package). ucrypt-bench's package is checked when its binary sits beside
//! `ucrypt` (`cargo test --workspace` builds it; under CI its absence fails).

use std::path::{Path, PathBuf};
use std::process::Command;

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;
use cli_common::{have, missing_root_rig, require, s, text, TempDir, UCRYPT};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The one `.deb` of `pkg` among `debs`.
fn deb<'a>(debs: &'a [PathBuf], pkg: &str) -> &'a Path {
    debs.iter()
        .find(|d| {
            let name = d.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with(&format!("{pkg}_"))
        })
        .unwrap_or_else(|| panic!("no {pkg} package among {debs:?}"))
}

/// man's output without its overstrikes (`N\x08N` bold, `_\x08N` underlined).
fn plain_text(rendered: &str) -> String {
    let mut out = String::new();
    for c in rendered.chars() {
        if c == '\x08' {
            out.pop();
        } else {
            out.push(c);
        }
    }
    out
}

/// `man -l PAGE`, which must succeed and show a NAME section; the text without overstrikes.
fn man_l(page: &Path) -> String {
    let o = Command::new("man")
        .args(["-l", s(page)])
        .env("MANWIDTH", "80")
        .output()
        .expect("man");
    let rendered = plain_text(&String::from_utf8_lossy(&o.stdout));
    assert!(
        o.status.success(),
        "man -l {}: {}",
        page.display(),
        text(&o)
    );
    assert!(rendered.contains("NAME"), "{}: {rendered}", page.display());
    rendered
}

fn ok(cmd: &mut Command) -> String {
    let o = cmd.output().expect("spawn");
    assert!(o.status.success(), "{cmd:?} failed: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Whether each of `tools` (with the Debian package that brings it) is here ([`require`]).
fn require_all(tools: &[(&str, &str)]) -> bool {
    tools.iter().all(|(tool, package)| require(tool, package))
}

const PACKAGING_TOOLS: &[(&str, &str)] = &[
    ("dpkg-deb", "dpkg"),
    ("dpkg-shlibdeps", "dpkg-dev"),
    ("objcopy", "binutils"),
];

/// Whether ucrypt-bench sits beside `ucrypt` (so that its package is built). `cargo test
/// --workspace` builds it; under CI its absence is a failure.
fn bench_built() -> bool {
    let here = Path::new(UCRYPT).with_file_name("ucrypt-bench").is_file();
    assert!(
        here || !kit::under_ci(),
        "ucrypt-bench is not built beside {UCRYPT} (cargo test --workspace builds it)"
    );
    if !here {
        println!("ucrypt-bench is not built beside ucrypt: its package is not checked (cargo build -p ucrypt-bench)");
    }
    here
}

/// The packages of this build's binaries, made in `out` (`--fast`: gzip -1).
fn build_debs(out: &Path) -> Vec<PathBuf> {
    let bin_dir = Path::new(UCRYPT).parent().expect("bin dir");
    let listed = ok(Command::new("bash")
        .arg(repo().join("scripts/package-deb.sh"))
        .args(["--bin-dir", s(bin_dir), "--out", s(out), "--fast"]));
    listed.lines().map(PathBuf::from).collect()
}

#[test]
fn deb_installs_and_runs_from_a_throwaway_root() {
    if !require_all(PACKAGING_TOOLS) || !require("man", "man-db") {
        return;
    }
    let bench = bench_built();
    let tmp = TempDir::new("package-deb");
    let debs = build_debs(&tmp.path("debs"));
    let main = deb(&debs, "ucrypt");
    let dbgsym = deb(&debs, "ucrypt-dbgsym");

    // The control file: shared libraries from dpkg-shlibdeps, the run-time extras.
    let control = ok(Command::new("dpkg-deb").args(["-f", s(main)]));
    assert!(control.contains("Depends: libc6"), "{control}");
    assert!(control.contains("Recommends: fuse3"), "{control}");
    assert!(control.contains("Suggests: librbd1"), "{control}");

    let root = tmp.path("root");
    ok(Command::new("dpkg-deb").args(["-x", s(main), s(&root)]));
    ok(Command::new("dpkg-deb").args(["-x", s(dbgsym), s(&root)]));

    // The binary runs from the package and says which build it is.
    let bin = root.join("usr/bin/ucrypt");
    let version = ok(Command::new(&bin).arg("--version"));
    let want = format!("ucrypt {} (", env!("CARGO_PKG_VERSION"));
    assert!(version.starts_with(&want), "{version}");
    assert!(version.contains("AWS-LC "), "{version}");

    // Stripped, with its symbols in the -dbgsym package at the build id's path.
    let sections = ok(Command::new("readelf").args(["-S", "-W", s(&bin)]));
    assert!(
        !sections.contains(".debug_info"),
        "not stripped:\n{sections}"
    );
    assert!(sections.contains(".gnu_debuglink"), "{sections}");
    let notes = ok(Command::new("readelf").args(["-n", s(&bin)]));
    let id = notes
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .expect("a build id");
    let debug = root.join(format!(
        "usr/lib/debug/.build-id/{}/{}.debug",
        &id[..2],
        &id[2..]
    ));
    let debug_sections = ok(Command::new("readelf").args(["-S", "-W", s(&debug)]));
    assert!(debug_sections.contains(".debug_info"), "{debug_sections}");

    // Every man page renders; the verb pages carry cryptsetup's exit codes.
    let mut pages = Vec::new();
    for section in ["man8", "man5"] {
        for e in std::fs::read_dir(root.join("usr/share/man").join(section)).expect("man dir") {
            pages.push(e.expect("entry").path());
        }
    }
    assert!(pages.len() > 20, "{pages:?}");
    for page in &pages {
        let rendered = man_l(page);
        if page.to_string_lossy().contains("man8") {
            assert!(rendered.contains("EXIT STATUS"), "{}", page.display());
        }
    }
    for page in [
        "man8/ucrypt.8.gz",
        "man8/ucrypt-open.8.gz",
        "man5/ucrypttab.5.gz",
    ] {
        assert!(root.join("usr/share/man").join(page).exists(), "{page}");
    }

    // Completions where bash-completion, zsh and fish look for them; bash's loads.
    let bash = root.join("usr/share/bash-completion/completions/ucrypt");
    for f in [
        bash.clone(),
        root.join("usr/share/zsh/vendor-completions/_ucrypt"),
        root.join("usr/share/fish/vendor_completions.d/ucrypt.fish"),
    ] {
        let len = std::fs::metadata(&f).map(|m| m.len()).unwrap_or(0);
        assert!(len > 0, "{} missing or empty", f.display());
    }
    let complete =
        ok(Command::new("bash")
            .args(["-c", &format!("source {} && complete -p ucrypt", s(&bash))]));
    assert!(complete.contains("ucrypt"), "{complete}");

    // The unit runs the packaged binary; the example table is in the docs.
    let unit =
        std::fs::read_to_string(root.join("lib/systemd/system/ucrypt@.service")).expect("unit");
    assert!(
        unit.contains("ExecStart=/usr/bin/ucrypt tab start %I --foreground"),
        "{unit}"
    );
    assert!(root
        .join("usr/share/doc/ucrypt/examples/ucrypttab.example")
        .exists());

    // ucrypt-bench: its man pages (one for the binary, one per scenario) render.
    let mut checked = vec![s(main), s(dbgsym)];
    if bench {
        let bench_deb = deb(&debs, "ucrypt-bench");
        checked.push(s(bench_deb));
        ok(Command::new("dpkg-deb").args(["-x", s(bench_deb), s(&root)]));
        let man1 = root.join("usr/share/man/man1");
        let pages: Vec<PathBuf> = std::fs::read_dir(&man1)
            .expect("man1 dir")
            .map(|e| e.expect("entry").path())
            .collect();
        assert!(man1.join("ucrypt-bench.1.gz").exists(), "{pages:?}");
        assert!(man1.join("ucrypt-bench-cipher.1.gz").exists(), "{pages:?}");
        for page in &pages {
            let rendered = man_l(page);
            assert!(rendered.contains("EXIT STATUS"), "{}", page.display());
        }
        let main_page = man_l(&man1.join("ucrypt-bench.1.gz"));
        assert!(main_page.contains("engine"), "{main_page}");
    }

    // lintian: no errors (its warnings are listed in the packaging notes).
    if have("lintian") {
        let o = Command::new("lintian")
            .args(["--tag-display-limit", "0"])
            .args(&checked)
            .output()
            .expect("lintian");
        let report = String::from_utf8_lossy(&o.stdout);
        let errors: Vec<&str> = report.lines().filter(|l| l.starts_with("E:")).collect();
        assert!(errors.is_empty(), "lintian errors:\n{report}");
    } else {
        println!("lintian not installed: the lintian check did not run (scripts/deps.sh test)");
    }
}

/// `scripts/package-smoke.sh`'s status when the mirror cannot be reached to make the root.
const SMOKE_MIRROR_UNREACHABLE: i32 = 75;
/// Bound on the whole smoke run: making the root (about a minute when the mirror answers; a
/// cached root is unpacked in seconds), installing, and the steps inside, each bounded by the
/// script itself.
const SMOKE_TIMEOUT_S: u32 = 900;

#[test]
fn debs_install_and_run_in_a_clean_debian_root() {
    if !require_all(PACKAGING_TOOLS) || !require("mmdebstrap", "mmdebstrap") {
        return;
    }
    if let Some(why) = missing_root_rig(&[]) {
        kit::skip(format!("the clean root: {why}"));
        return;
    }
    let bench = bench_built();
    let tmp = TempDir::new("package-smoke");
    let debs = build_debs(&tmp.path("debs"));
    // The packages a user installs: not the -dbgsym ones (their layout is checked above).
    let mut install = vec![deb(&debs, "ucrypt")];
    if bench {
        install.push(deb(&debs, "ucrypt-bench"));
    }
    let limit_s = SMOKE_TIMEOUT_S.to_string();
    let o = Command::new("timeout")
        .args(["--kill-after=30", limit_s.as_str(), "bash"])
        .arg(repo().join("scripts/package-smoke.sh"))
        .args(&install)
        .output()
        .expect("spawn package-smoke.sh");
    let said = text(&o);
    if o.status.code() == Some(SMOKE_MIRROR_UNREACHABLE) {
        let why = String::from_utf8_lossy(&o.stderr);
        kit::skip(why.lines().last().unwrap_or("the mirror is unreachable"));
        return;
    }
    assert!(o.status.success(), "package-smoke.sh failed: {said}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    println!("{stdout}");
    assert!(stdout.contains("package-smoke: passed"), "{said}");
    assert!(
        stdout.contains(&format!("ucrypt {} (", env!("CARGO_PKG_VERSION"))),
        "{said}"
    );
}
