//! BitLocker: every image of cryptsetup's `tests/bitlk-images.tar.xz`, with the checks of its
//! `bitlk-compat-test`: the dump's GUIDs and cipher, the passphrase and recovery-passphrase
//! cases with the script's N/A rules, the startup keys (`.BEK` as `--key-file`), the volume
//! key written by `bitlkDump --volume-key-file` and opened with `--volume-key-file`, and the
//! whole plaintext (`export --type bitlk` stands for the script's activation) equal to the
//! SHA-256 in `images.conf`. cryptsetup 2.6 reads BitLocker metadata on this host: its
//! `bitlkDump` (run with TZ=UTC, as ucrypt prints the creation time) must equal ucrypt's
//! byte for byte, its `bitlkDump --dump-volume-key` must give the same volume key, and its
//! `--test-passphrase` the same exit code for every case. Where `dislocker-file` is installed,
//! its plaintext of each image it reads must equal ucrypt's.
//!
//! SKIPPED when cryptsetup's test material cannot be had or xz is missing; the cryptsetup and
//! dislocker comparisons say SKIPPED when those are missing.

mod cli_common;
#[path = "../../../tests/kit/mod.rs"]
mod kit;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use cli_common::{have, run_in, text, UCRYPT};
use sha2::{Digest, Sha256};

/// One `[name]` section of images.conf.
type Conf = BTreeMap<String, BTreeMap<String, String>>;

fn parse_conf(s: &str) -> Conf {
    let mut out = Conf::new();
    let mut cur = None;
    for l in s.lines() {
        let l = l.trim();
        if let Some(n) = l.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            cur = Some(n.to_string());
            out.entry(n.to_string()).or_default();
        } else if let (Some(c), Some((k, v))) = (&cur, l.split_once('=')) {
            out.get_mut(c).unwrap().insert(k.into(), v.into());
        }
    }
    out
}

/// cryptsetup with TZ=UTC and `input` on stdin.
fn cryptsetup(args: &[&str], input: &[u8]) -> Output {
    use std::io::Write;
    let mut c = Command::new("cryptsetup")
        .args(args)
        .env("TZ", "UTC")
        .env("LANG", "C")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cryptsetup");
    let _ = c.stdin.take().unwrap().write_all(input);
    c.wait_with_output().unwrap()
}

fn sha256_file(p: &Path) -> String {
    use std::io::Read;
    let mut f = std::fs::File::open(p).unwrap();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The value of the line after the one `grep -B1 PAT | head -1` finds: the GUID line before a
/// protection line, as the script reads it.
fn guid_before(dump: &str, pat: &str) -> Option<String> {
    let lines: Vec<&str> = dump.lines().collect();
    let i = lines.iter().position(|l| l.contains(pat))?;
    let l = lines.get(i.checked_sub(1)?)?;
    Some(l.split_once(':')?.1.trim().to_string())
}

fn field(dump: &str, key: &str) -> String {
    dump.lines()
        .find(|l| l.contains(key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.chars().filter(|c| !c.is_whitespace()).collect())
        .unwrap_or_default()
}

/// The "MK dump" hex of `bitlkDump --dump-volume-key`.
fn mk_dump(out: &str) -> String {
    let at = out.find("MK dump:").map(|i| i + 8).unwrap_or(out.len());
    out[at..].split_whitespace().collect()
}

struct Run {
    failures: Vec<String>,
    skipped: Vec<String>,
    passed: usize,
}

impl Run {
    fn check(&mut self, what: &str, ok: bool, detail: impl FnOnce() -> String) {
        if ok {
            self.passed += 1;
        } else {
            self.failures.push(format!("{what}: {}", detail()));
        }
    }
}

/// The script's N/A rule for an activation that exits 1.
fn not_applicable(name: &str) -> bool {
    ["aes-cbc", "clearkey", "eow", "-4k"]
        .iter()
        .any(|p| name.contains(p))
}

/// `open --type bitlk` served by the daemon over FUSE: `status` says BITLK, and the served
/// file's SHA-256 is images.conf's (one image per cipher mode; the rest go through export).
fn served_through_fuse(dir: &Path, conf: &Conf, run: &mut Run) {
    if !Path::new("/dev/fuse").exists() {
        run.skipped.push("FUSE open: SKIPPED, no /dev/fuse".into());
        return;
    }
    for name in ["bitlk-aes-xts-128", "bitlk-aes-cbc-elephant-128"] {
        let img = dir.join(format!("{name}.img"));
        let map = format!("bitlk-test-{}", std::process::id());
        let pw = format!("{}\n", conf[name]["PW"]);
        let o = run_in(
            UCRYPT,
            &[
                "open",
                "--type",
                "bitlk",
                "-r",
                img.to_str().unwrap(),
                &map,
                "--front-end",
                "fuse",
            ],
            pw.as_bytes(),
        );
        run.check(
            &format!("{name}: open over FUSE"),
            o.status.success(),
            || text(&o),
        );
        if !o.status.success() {
            continue;
        }
        let st = run_in(UCRYPT, &["status", &map], b"");
        let status = String::from_utf8_lossy(&st.stdout).into_owned();
        run.check(
            &format!("{name}: status type"),
            status.contains("type:    BITLK"),
            || status.clone(),
        );
        let path = status
            .lines()
            .find_map(|l| l.trim().strip_prefix("device path:"))
            .map(|p| p.trim().to_string())
            .unwrap_or_default();
        let got = if Path::new(&path).exists() {
            sha256_file(Path::new(&path))
        } else {
            format!("no device path in {status}")
        };
        let want = &conf[name]["SHA256SUM"];
        run.check(
            &format!("{name}: served plaintext SHA-256"),
            &got == want,
            || format!("{got}, images.conf {want}"),
        );
        let c = run_in(UCRYPT, &["close", &map], b"");
        run.check(&format!("{name}: close"), c.status.success(), || text(&c));
    }
}

#[test]
fn bitlk_images() {
    let Some((tmp, dir)) = cli_common::unpacked_images("bitlk-images") else {
        return;
    };
    let conf = parse_conf(&std::fs::read_to_string(dir.join("images.conf")).unwrap());
    let have_cs = have("cryptsetup");
    let have_dislocker = have("dislocker-file");
    if !have_cs {
        println!("SKIPPED (comparison): cryptsetup not installed");
    }
    if !have_dislocker {
        println!("SKIPPED (comparison): dislocker-file not installed (Debian package dislocker)");
    }
    let mut run = Run {
        failures: Vec::new(),
        skipped: Vec::new(),
        passed: 0,
    };
    let mut cases = 0;
    let out_file = tmp.dir().join("plain.bin");
    for (name, v) in &conf {
        let img = dir.join(format!("{name}.img"));
        let file = img.to_str().unwrap();
        let get = |k: &str| v.get(k).cloned().unwrap_or_default();
        // HEADER CHECK.
        let d = run_in(UCRYPT, &["bitlkDump", file], b"");
        run.check(&format!("{name}: bitlkDump"), d.status.success(), || {
            text(&d)
        });
        let dump = String::from_utf8_lossy(&d.stdout).into_owned();
        run.check(
            &format!("{name}: GUID"),
            field(&dump, "GUID:") == get("GUID"),
            || dump.clone(),
        );
        let cipher = format!(
            "{}-{}",
            field(&dump, "Cipher name"),
            field(&dump, "Cipher mode")
        );
        run.check(&format!("{name}: cipher"), cipher == get("CIPHER"), || {
            cipher.clone()
        });
        for (pat, key) in [
            ("VMK protected with smart card", "SC_VMK_GUID"),
            ("VMK protected with startup key", "SK_VMK_GUID"),
            ("VMK protected with passphrase", "PW_VMK_GUID"),
            ("VMK protected with recovery passphrase", "RP_VMK_GUID"),
        ] {
            if v.contains_key(key) {
                let g = guid_before(&dump, pat);
                run.check(&format!("{name}: {key}"), g == Some(get(key)), || {
                    format!("{g:?}")
                });
            }
        }
        if have_cs {
            let cs = cryptsetup(&["bitlkDump", file], b"");
            let theirs = String::from_utf8_lossy(&cs.stdout);
            run.check(
                &format!("{name}: dump equals cryptsetup's"),
                theirs == dump,
                || format!("cryptsetup:\n{theirs}\nucrypt:\n{dump}"),
            );
        }
        // ACTIVATION: passphrase and recovery passphrase.
        let sum = get("SHA256SUM");
        let mut secrets: Vec<(String, Vec<&str>)> = Vec::new();
        for k in ["PW", "RP"] {
            if !get(k).is_empty() {
                secrets.push((format!("{}\n", get(k)), vec![]));
            }
        }
        let bek;
        if let Some(g) = v.get("SK_VMK_GUID") {
            bek = dir
                .join(format!("{}.BEK", g.to_uppercase()))
                .display()
                .to_string();
            secrets.push((String::new(), vec!["--key-file", &bek]));
        }
        for (secret, extra) in &secrets {
            cases += 1;
            let what = if extra.is_empty() {
                format!("{name} with {}", secret.trim())
            } else {
                format!("{name} with the startup key")
            };
            let mut a = vec!["open", "--type", "bitlk", "-r", "--test-passphrase", file];
            a.extend_from_slice(extra);
            let t = run_in(UCRYPT, &a, secret.as_bytes());
            if have_cs {
                let mut ca = vec!["bitlkOpen", "-r", file, "--test-passphrase"];
                ca.extend_from_slice(extra);
                let c = cryptsetup(&ca, secret.as_bytes());
                run.check(
                    &format!("{what}: --test-passphrase exit code"),
                    c.status.code() == t.status.code(),
                    || format!("cryptsetup {}\nucrypt {}", text(&c), text(&t)),
                );
            }
            if t.status.code() == Some(1) && not_applicable(name) {
                run.skipped
                    .push(format!("{what}: N/A (exit 1, as the script allows)"));
                continue;
            }
            run.check(
                &format!("{what}: --test-passphrase"),
                t.status.success(),
                || text(&t),
            );
            let mut a = vec![
                "export",
                "--type",
                "bitlk",
                "-r",
                file,
                out_file.to_str().unwrap(),
            ];
            a.extend_from_slice(extra);
            let e = run_in(UCRYPT, &a, secret.as_bytes());
            run.check(&format!("{what}: export"), e.status.success(), || text(&e));
            if e.status.success() {
                let got = sha256_file(&out_file);
                run.check(&format!("{what}: plaintext SHA-256"), got == sum, || {
                    format!("{got}, images.conf {sum}")
                });
            }
        }
        // The volume key, against cryptsetup's.
        let rp = format!("{}\n", get("RP"));
        let ours = run_in(
            UCRYPT,
            &["bitlkDump", "--dump-volume-key", "-q", file],
            rp.as_bytes(),
        );
        if have_cs {
            let cs = cryptsetup(
                &["bitlkDump", "--dump-volume-key", "-q", file],
                rp.as_bytes(),
            );
            run.check(
                &format!("{name}: --dump-volume-key exit code"),
                cs.status.code() == ours.status.code(),
                || format!("cryptsetup {}\nucrypt {}", text(&cs), text(&ours)),
            );
            if cs.status.success() {
                let (a, b) = (
                    String::from_utf8_lossy(&cs.stdout),
                    String::from_utf8_lossy(&ours.stdout),
                );
                run.check(&format!("{name}: volume key"), a == b, || {
                    format!("cryptsetup:\n{a}\nucrypt:\n{b}")
                });
                run.check(
                    &format!("{name}: volume key present"),
                    !mk_dump(&a).is_empty(),
                    || a.to_string(),
                );
            }
        }
        // The script's "test with volume key": the key written by --volume-key-file opens the
        // data.
        let vk_file = tmp.dir().join("vk");
        let vkf = vk_file.to_str().unwrap();
        let w = run_in(
            UCRYPT,
            &[
                "bitlkDump",
                "--dump-volume-key",
                "-q",
                "--volume-key-file",
                vkf,
                file,
            ],
            rp.as_bytes(),
        );
        run.check(
            &format!("{name}: --volume-key-file written"),
            w.status.success(),
            || text(&w),
        );
        let e = run_in(
            UCRYPT,
            &[
                "export",
                "--type",
                "bitlk",
                "-r",
                "--volume-key-file",
                vkf,
                file,
                out_file.to_str().unwrap(),
            ],
            b"",
        );
        if e.status.code() == Some(1) && not_applicable(name) {
            run.skipped
                .push(format!("{name} with the volume key: N/A (exit 1)"));
        } else {
            run.check(
                &format!("{name}: export with the volume key"),
                e.status.success(),
                || text(&e),
            );
            if e.status.success() {
                let got = sha256_file(&out_file);
                run.check(
                    &format!("{name}: plaintext SHA-256 with the volume key"),
                    got == sum,
                    || format!("{got}, images.conf {sum}"),
                );
            }
        }
        // dislocker's plaintext, where it reads the image.
        if have_dislocker && !sum.is_empty() && !get("RP").is_empty() {
            let dl = tmp.dir().join("dislocker.bin");
            let _ = std::fs::remove_file(&dl);
            let p = format!("-p{}", get("RP"));
            let o = Command::new("dislocker-file")
                .args(["-V", file, &p, "--", dl.to_str().unwrap()])
                .stdin(Stdio::null())
                .output()
                .unwrap();
            if o.status.success() && dl.exists() {
                let got = sha256_file(&dl);
                let e = run_in(
                    UCRYPT,
                    &[
                        "export",
                        "--type",
                        "bitlk",
                        "-r",
                        file,
                        out_file.to_str().unwrap(),
                    ],
                    rp.as_bytes(),
                );
                let ours = if e.status.success() {
                    sha256_file(&out_file)
                } else {
                    text(&e)
                };
                run.check(
                    &format!("{name}: dislocker-file's plaintext"),
                    got == ours,
                    || format!("dislocker {got}, ucrypt {ours}"),
                );
            } else {
                run.skipped.push(format!(
                    "{name}: dislocker-file does not read it: {}",
                    text(&o).lines().last().unwrap_or("")
                ));
            }
            let _ = std::fs::remove_file(&dl);
        }
        let _ = std::fs::remove_file(&out_file);
    }
    served_through_fuse(&dir, &conf, &mut run);
    for s in &run.skipped {
        println!("skipped: {s}");
    }
    println!(
        "{} images, {cases} key cases, {} checks passed",
        conf.len(),
        run.passed
    );
    assert!(conf.len() >= 16, "images.conf has {} images", conf.len());
    assert!(cases >= 29, "{cases} key cases");
    assert!(run.failures.is_empty(), "{}", run.failures.join("\n"));
}
